"""A new-user break test's inputs: a byte budget or card too small for one expert slot accepted by tune and
validate-release (every score 0, ``--expert-cache 0`` recommended, which the engine reads as "the profile's slot
count"); a layer refusal hinting at --model when --model was given and counting layers the trace does not route;
``tune --slots`` bounds saying 0 is allowed; ``validate-release --slots 0`` without a gate sent to the gate's
slot rule; ``run -n 0/1`` titling prefill counts "(decode)" and a garbled decode line; tune leaving MTP-block
entries out without a word."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stratatools.core.errors import StrataError

# the kit's coder-revB: 8 layers x 16 experts, expert blobs of 21,760 (layers 0, 1, 7) and 14,080 bytes
ONE_SLOT = 14_080


def _kit(kit: Path) -> tuple[Path, Path, Path]:
    p = kit / "pruned"
    return p / "coder-revB.routing.csv", p / "coder-revB.gguf", p / "expected-profile-revA-remapped-to-revB.bin"


def _one_line(err: str) -> str:
    assert len(err.strip().splitlines()) == 1 or "error:" in err.splitlines()[0], err
    return " ".join(err.split())


# ------------------------------------------------------------------ 1. a budget of 0 slots


def test_budget_that_holds_no_slot_is_refused_at_the_smallest_rounded_blob():
    from stratatools.cachesim.layout import require_budget_slot

    blobs = [21_760, 21_700, 14_000]  # rounded up to 256: 21,760, 21,760, 14,080
    require_budget_slot(ONE_SLOT, blobs, "--budget-gib X", "tune needs at least 1 slot")  # one slot fits
    with pytest.raises(StrataError) as e:
        require_budget_slot(ONE_SLOT - 1, blobs, "--budget-gib X", "tune needs at least 1 slot")
    msg = str(e.value)
    assert msg.startswith("--budget-gib X: 14,079 bytes hold no expert slot (one slot needs 14,080 bytes"), msg
    # the GiB suggested is rounded up, so that it holds the slot
    assert "give --budget-gib 1.32e-05 or more, or --slots N" in msg and int(1.32e-05 * 2**30) >= ONE_SLOT, msg


def test_tune_refuses_a_budget_or_card_of_no_slot(kit, cli):
    t, m, _ = _kit(kit)
    base = ("tune", "-t", t, "--model", m, "--kfold", 3, "--candidates", 3)
    code, out, err = cli(*base, "--budget-gib", "0.000001")  # exited 0, every row 0.00%, --expert-cache 0
    one = _one_line(err)
    assert code == 2 and out == "", err
    assert ("--budget-gib 1e-06: 1,073 bytes hold no expert slot (one slot needs 14,080 bytes = 0.0134 MiB, this "
            "model's smallest expert rounded up to 256 bytes), the same as --slots 0; tune needs at least 1 slot"
            in one), one
    assert one.endswith("give --budget-gib 1.32e-05 or more, or --slots N"), one
    code, out, err = cli(*base, "--card", "1.5000001GiB")  # 0.1 KiB after the default 1.5 GiB reserve
    one = _one_line(err)
    assert code == 2 and "--card 1.5000001GiB (with --reserve-gib 1.5: 107 bytes for experts): 107 bytes hold " \
        "no expert slot (one slot needs 14,080 bytes" in one, one
    assert "a --card at least 1.32e-05 GiB larger than the --reserve-gib 1.5" in one, one
    # the budget the message suggests tunes, and the engine gets a slot count of at least 1
    code, out, err = cli(*base, "--budget-gib", "1.32e-05", "--json")
    assert code == 0, err
    flags = [ln for ln in json.loads(out)["engine_flags"] if ln.startswith("--expert-cache")]
    assert flags and flags[0].startswith("--expert-cache 1 "), flags


def test_validate_release_refuses_a_gate_budget_of_no_slot(kit, cli):
    t, m, p = _kit(kit)
    for gate in ("0.0", "0.1"):  # 0.0 passed with h 0 at 1e-06 GiB; 0.1 failed (exit 1) without saying why
        code, out, err = cli("validate-release", "--model", m, "--profile", p, "-t", t, "--min-hit-rate", gate,
                             "--budget-gib", "0.000001")
        one = _one_line(err)
        assert code == 2, (gate, out, err)
        assert ("--budget-gib 1e-06: 1,073 bytes hold no expert slot (one slot needs 14,080 bytes" in one
                and "the hit-rate gate needs at least 1 slot" in one
                and one.endswith("give --budget-gib 1.32e-05 or more, or --slots N")), one


# ------------------------------------------------------------------ 2. messages


def _extra_trace(kit: Path, out: Path, layer: int) -> Path:
    """The kit's revB trace (layers 0..7) plus a copy of layer 7's rows as layer ``layer``."""
    lines = (kit / "pruned/coder-revB.routing.csv").read_text().splitlines()
    extra = []
    for ln in lines[1:]:
        f = ln.split(",")
        if f[3] == "7":
            f[3] = str(layer)
            extra.append(",".join(f))
    out.write_text("\n".join(lines + extra) + "\n")
    return out


def test_layer_refusal_hints_at_mtp_only_without_the_model(kit, cli, tmp_path):
    _, m, p = _kit(kit)
    t9 = _extra_trace(kit, tmp_path / "extra9.csv", 8)
    for cmd in (("simulate", "--no-sweep"), ("tune", "--kfold", "2", "--candidates", "3")):
        code, _, err = cli(*cmd, "-t", t9, "--model", m, "--slots", "16")
        one = _one_line(err)
        assert code == 2 and "routes layers up to 8 but the model has 8 trunk layers (0..7)" in one, one
        assert "MTP" not in one, one  # the model was read: it has no MTP block
    # the limit that knows the model was read travels to Dask workers (simulate --cluster) unchanged
    import pickle

    from stratatools.cachesim.replay import LayerLimit

    back = pickle.loads(pickle.dumps(LayerLimit(8, True)))
    assert (int(back), back.model_read, int(LayerLimit(9)), LayerLimit(9).model_read) == (8, True, 9, False)
    code, _, err = cli("compare", "-t", t9, "-p", p, "--slots", "16")  # no model: layer 8 may be its MTP block
    one = _one_line(err)
    assert code == 2 and one.endswith("(if layer 8 is this model's MTP block: pass --model M.gguf, which names it)")


def test_layer_refusal_names_the_highest_layer_not_a_count(kit, cli, tmp_path):
    _, m, _ = _kit(kit)
    t100 = _extra_trace(kit, tmp_path / "extra100.csv", 100)  # 9 distinct layers: 0..7 and 100
    code, _, err = cli("simulate", "-t", t100, "--model", m, "--slots", "16", "--no-sweep")
    one = _one_line(err)
    assert code == 2 and "routes layers up to 100 but the model has 8 trunk layers" in one, one
    assert "101 layers" not in one and "entries of layers 8..100 would be left out" in one, one


def test_tune_slots_bound_starts_at_1(kit, cli):
    t, m, _ = _kit(kit)
    for v in ("-1", "0"):
        code, _, err = cli("tune", "-t", t, "--model", m, "--slots", v)
        one = _one_line(err)
        assert code == 2 and f"'--slots': must be an integer from 1 to 1099511627776 (got {v}); tune needs at " \
            "least 1 slot (with no slot nothing is resident" in one, one


def test_validate_release_slots_0_without_a_gate_says_no_gate(kit, cli):
    _, m, p = _kit(kit)
    for v in ("0", "5"):
        code, _, err = cli("validate-release", "--model", m, "--profile", p, "--slots", v)
        one = _one_line(err)
        assert code == 2 and one == ("error: --slots: only the hit-rate gate's budget, and no gate is set; add "
                                     "--min-hit-rate X (with --traces and --profile) or drop --slots"), one


# ------------------------------------------------------------------ 3. console output


from test_cli_bounds import tiny  # noqa: E402,F401  (the tiny synthetic model and prompts fixture)


def test_run_without_decode_steps_titles_the_prefill_table_and_says_so(tiny, cli):
    m, p = tiny
    for n in ("0", "1"):
        code, out, err = cli("run", m, "-p", p, "--device", "cpu", "--slots", "4", "-n", n, "--batch", "3")
        assert code == 0, err
        assert "expert tier per layer (prefill)" in out and "(decode)" not in out.replace("h_expert (decode)", ""), out
        line = " ".join([ln for ln in out.splitlines() if ln.startswith("prefill: ")][0].split())
        assert line.endswith(f"from the prefill logits); decode: no decode step ran"), line
        assert "aggregate" not in line, line
        code, out, err = cli("run", m, "-p", p, "--device", "cpu", "--slots", "4", "-n", n, "--json")
        d = json.loads(out)["tier"]
        assert sum(d["decode"]["layer_entries"]) == 0 and sum(d["prefill"]["layer_entries"]) > 0, d
    # with decode steps the table is the decode's
    code, out, err = cli("run", m, "-p", p, "--device", "cpu", "--slots", "4", "-n", "3")
    assert code == 0 and "expert tier per layer (decode)" in out, out


def test_tune_says_what_it_left_out(cli, tmp_path):
    """A trace of a model with an MTP block (layer 3 of a 3-layer trunk): simulate warns that its 48 entries are
    left out of the replay; tune left them out without a word."""
    code, _, err = cli("synth", tmp_path / "rel", "--layers", "3", "--experts", "8", "--keep", "4", "--mtp",
                       "--no-revisions")
    assert code == 0, err
    m = tmp_path / "rel/synth-canonical.gguf"
    rows = ["model,prompt_id,token_pos,layer,rank,expert_id,weight"]
    for pid in ("p0", "p1"):
        for pos in range(12):
            for layer in range(4):
                for rank in range(2):
                    rows.append(f"m,{pid},{pos},{layer},{rank},{(pos + layer + 3 * rank) % 8},0.5")
    t = tmp_path / "mtp.csv"
    t.write_text("\n".join(rows) + "\n")
    want = "left out of the replay: 48 entries of layers >= 3 (the model's MTP blocks)"
    code, _, err = cli("simulate", "-t", t, "--model", m, "--slots", "6", "--no-sweep")
    assert code == 0 and want in " ".join(err.split()), err
    for extra in ((), ("--cluster", "local:1")):  # the streamed and the whole-table paths
        code, out, err = cli("tune", "-t", t, "--model", m, "--slots", "6", "-k", "2", "--candidates", "2",
                             "--json", *extra)
        assert code == 0 and want in " ".join(err.split()), err
        assert json.loads(out)["skipped"] == {"prefill": 0, "layer": 48, "expert": 0}
