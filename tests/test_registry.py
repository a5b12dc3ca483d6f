"""The release registry parses, recognises the kit files by digest, and matches public revision prefixes."""

from __future__ import annotations

import pytest

from stratatools.errors import StrataError
from stratatools.fsutil import sha256_file
from stratatools.registry import load_registry


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

