"""Provenance sidecars name the model's shards; digests come from the digest cache (filled by pack)."""

from __future__ import annotations

import json

from stratatools.core.fsutil import sha256_file


def test_make_profile_sidecar_names_model_shards(kit, cli, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh-cache"))  # other tests may have hashed the model
    model = kit / "quant/model-ISTA-mix.gguf"
    trace = kit / "routing/llamacpp-ISTA-mix.routing.csv"
    code, _, err = cli("make-profile", trace, "--model", model, "-o", tmp_path / "a.bin")
    assert code == 0, err
    shards = json.loads((tmp_path / "a.bin.json").read_text())["model"]["shards"]
    assert [s["name"] for s in shards] == ["model-ISTA-mix.gguf"]
    assert shards[0]["size_bytes"] == model.stat().st_size
    assert shards[0]["sha256"] is None  # not hashed yet: describing a model never re-reads it
    code, _, err = cli("pack", model, "-o", tmp_path / "pack")  # pack hashes the model into the digest cache
    assert code == 0, err
    code, _, err = cli("make-profile", trace, "--model", model, "-o", tmp_path / "b.bin")
    assert code == 0, err
    shards = json.loads((tmp_path / "b.bin.json").read_text())["model"]["shards"]
    assert shards[0]["sha256"] == sha256_file(model)
    out = json.loads((tmp_path / "b.bin.json").read_text())["output"]
    assert out["sha256"] == sha256_file(tmp_path / "b.bin")


def test_remap_sidecar_names_model_shards(kit, cli, tmp_path):
    p = kit / "pruned"
    code, _, err = cli("remap-profile", p / "profile-revA.bin", "--from-alloc", p / "coder-revA.rco-allocation.txt",
                       "--to-alloc", p / "coder-revB.rco-allocation.txt", "--model", p / "coder-revB.gguf",
                       "-o", tmp_path / "r.bin")
    assert code == 0, err
    model = json.loads((tmp_path / "r.bin.json").read_text())["model"]
    assert model["n_expert"] == 16 and [s["name"] for s in model["shards"]] == ["coder-revB.gguf"]
