"""Memory sizes on the command line: ``--card 0.5GB`` is 0.5 x 10^9 bytes (GB is SI; GiB, G or a bare number is
2^30), and the values echoed back (``--reserve-gib 0.9999999``, ``--budget-gib``) read back as the value given."""

from __future__ import annotations

import json

import pytest

from stratatools.core.errors import StrataError, num_text


@pytest.mark.parametrize("text, nbytes", [
    ("0.5GB", 500_000_000), ("12GB", 12_000_000_000), ("12 gb", 12_000_000_000), ("12.3GB", 12_300_000_000),
    ("0.5GiB", 1 << 29), ("16G", 16 << 30), ("24 GiB", 24 << 30), ("12", 12 << 30), ("1.5", 3 << 29),
    ("512MiB", 1 << 29), ("512M", 1 << 29), ("500MB", 500_000_000), ("1TB", 10**12), ("1TiB", 1 << 40),
    ("1.5000001GiB", 1_610_612_843),
])
def test_card_sizes_are_bytes_in_the_unit_named(text, nbytes):
    from stratatools.cli.tune_cmd import parse_card

    assert parse_card(text)[0] == nbytes


@pytest.mark.parametrize("text", ["twelve", "12GBs", "-1GB", "0GB", "0", "12 KB", "GB", "1e400GB", "inf"])
def test_card_refuses_what_is_no_size(text):
    from stratatools.cli.tune_cmd import parse_card

    with pytest.raises(StrataError, match=r"^--card .*: expected a memory size such as 12GiB"):
        parse_card(text)


@pytest.mark.parametrize("x, text", [(1.0, "1"), (12.0, "12"), (1.5, "1.5"), (0.9999999, "0.9999999"),
                                     (1.5000001, "1.5000001"), (1e-06, "1e-06"), (1 / 3, repr(1 / 3)),
                                     (123456789.0, "123456789"), (0.1, "0.1")])
def test_num_text_reads_back_as_the_value(x, text):
    assert num_text(x) == text and float(num_text(x)) == x


def test_card_budget_text_keeps_units_and_digits():
    from stratatools.cli.tune_cmd import _budget

    s, b, text = _budget(None, None, "0.5GB", 0.1)
    assert s is None and b == 500_000_000 - 107_374_183  # the reserve is rounded up to a whole byte
    assert text == "card 0.5 GB - reserve 0.1 GiB = 392,625,817 bytes for experts", text
    s, b, text = _budget(None, None, "12GiB", 0.9999999)
    assert b == (12 << 30) - 1_073_741_717
    assert text == "card 12 GiB - reserve 0.9999999 GiB = 11,811,160,171 bytes for experts", text
    assert _budget(None, 0.9999999, None, 1.5)[2] == "0.9999999 GiB"
    with pytest.raises(StrataError) as e:
        _budget(None, None, "1GB", 1.5)
    msg = str(e.value)
    assert msg == ("--card 1GB: 1 GB is 1,000,000,000 bytes, less than the --reserve-gib 1.5 (1,610,612,736 bytes): "
                   "no room for experts; give a larger --card (a card sold as 12 GB usually has 12 GiB: write "
                   "12GiB) or a smaller --reserve-gib"), msg


def test_tune_card_in_gb_and_exact_reserve_on_the_kit(kit, cli):
    p = kit / "pruned"
    base = ("tune", "-t", p / "coder-revB.routing.csv", "--model", p / "coder-revB.gguf", "--kfold", 2,
            "--candidates", 0, "--json")
    code, out, err = cli(*base, "--card", "0.5GB", "--reserve-gib", "0.1")
    assert code == 0, err
    assert json.loads(out)["budget"] == "card 0.5 GB - reserve 0.1 GiB = 392,625,817 bytes for experts"
    code, out, err = cli(*base, "--card", "12GiB", "--reserve-gib", "0.9999999")
    assert code == 0, err
    assert "reserve 0.9999999 GiB" in json.loads(out)["budget"]


def test_help_says_what_gb_means(cli):
    code, out, _ = cli("tune", "--help")
    text = " ".join(out.replace("│", " ").split())  # (the help table's wrapped lines, without its borders)
    assert code == 0 and "GB = 10^9 bytes" in text and "GiB" in text, text
