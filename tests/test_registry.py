"""The release registry parses, recognises the kit files by digest, and matches public revision prefixes."""

from __future__ import annotations

import pytest

from stratatools.core.errors import StrataError
from stratatools.core.fsutil import sha256_file
from stratatools.alloc.registry import load_registry


def test_coder_revisions_present():
    reg = load_registry()
    old = reg.find("qwen3.8-flash-next-coder-rco", "5348543e")
    new = reg.find("qwen3.8-flash-next-coder-rco", "bba88856f8c3c0c9e40e45f82d05e228b814ac43")
    assert [r.date for r in old] == ["2026-09-29"]
    assert [r.date for r in new] == ["2026-10-19"]
    assert old[0].n_expert == 256 and old[0].n_expert_original == 512
    # a full revision that starts with the public prefix matches it
    assert old[0].matches_revision("5348543e" + "0" * 32)
    assert not new[0].matches_revision("5348543e")


def test_kit_files_identified(kit):
    reg = load_registry()
    assert reg.identify(sha256_file(kit / "pruned/coder-revB.gguf")) == ("shard", "kit-coder@revB")
    assert reg.identify(sha256_file(kit / "pruned/coder-revA.rco-allocation.txt")) == ("allocation", "kit-coder@revA")
    assert reg.identify(sha256_file(kit / "pruned/profile-revA.bin")) == ("profile", "kit-coder@revA")
    assert reg.identify("0" * 64) is None


def test_bad_registry(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text("[[release]]\nname = 'x'\n")
    with pytest.raises(StrataError, match="needs name and revision"):
        load_registry(p)
    p.write_text("not = [toml")
    with pytest.raises(StrataError, match="not valid TOML"):
        load_registry(p)



@pytest.mark.parametrize("body, msg", [
    ("release = 5\n", "'release' must be an array of tables"),
    ("profile = [1]\n", "'profile' must be an array of tables"),
    ("[[release]]\nname = 'a'\nrevision = 'r'\nshard = 5\n", "#1: 'shard' must be an array of tables"),
    ("[[release]]\nname = 'a'\nrevision = 'r'\nshard = [1]\n", "#1: 'shard' must be an array of tables"),
])
def test_registry_of_the_wrong_shape_is_a_one_line_error(tmp_path, monkeypatch, body, msg):
    """Arrays of the wrong kind were a TypeError/AttributeError traceback; now StrataError naming file and fix."""
    from stratatools.profiles.remap import identify_release

    p = tmp_path / "r.toml"
    p.write_text(body)
    with pytest.raises(StrataError) as ei:
        load_registry(p)
    assert msg in str(ei.value) and str(p) in str(ei.value) and "\n" not in str(ei.value)
    monkeypatch.setenv("STRATATOOLS_REGISTRY", str(p))
    assert identify_release("ab" * 32) is None  # provenance treats a broken registry as "unknown"


def test_numeric_allocation_digest_is_compared_as_text(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text("[[release]]\nname = 'a'\nrevision = 'r1'\nallocation_sha256 = 12\n")
    reg = load_registry(p)
    assert reg.identify("12") == ("allocation", "a@r1") and reg.identify("13") is None


def test_validate_release_with_a_malformed_registry_exits_2(cli, tmp_path):
    reg = tmp_path / "r.toml"
    reg.write_text("release = 5\n")
    m = tmp_path / "m.gguf"
    m.write_bytes(b"GGUF")
    code, out, err = cli("validate-release", "--model", m, "--registry", reg)
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert "must be an array of tables" in err, err
