"""inspect: every field from the files (kit files made by llama.cpp, synthetic releases), table and JSON."""

from __future__ import annotations

import json

from stratatools.pack.inspect import inspect_model
from stratatools.synth.model import SynthConfig, synth_release


def test_inspect_every_kit_gguf(kit, cli):
    for p in sorted(kit.glob("**/*.gguf")):
        if "imatrix" in p.name:
            continue
        code, out, err = cli("inspect", p, "--json")
        assert code == 0, err
        d = json.loads(out)
        pruned = "coder-rev" in p.name
        assert d["architecture"] == "qwen4exp" and d["block_count"] == 8 and d["n_trunk"] == 8 and d["n_mtp"] == 0
        assert d["n_embd"] == 256 and d["n_expert_used"] == 4 and d["n_ff"] == 64 and d["n_ff_shared"] == 64
        assert d["n_expert"] == (16 if pruned else 32) and d["expert_count_kv"] == (16 if pruned else 32)
        assert [x["n_expert"] for x in d["layers"]] == [d["n_expert"]] * 8
        assert d["full_attention_layers"] == [3, 7] and d["packable"] and d["n_tensors"] == 214
        assert all(x["router_type"] == "F32" for x in d["layers"])
        assert d["expert_bytes"] == sum(x["blob_bytes"] for x in d["layers"]) * d["n_expert"]
        code, out, _ = cli("inspect", p)
        assert code == 0 and "experts per layer (routers)" in out and "Qwen4Exp Tiny" in out


def test_inspect_ista_mix_types_and_split_shards(kit):
    r = inspect_model(kit / "quant/model-ISTA-mix.gguf")
    # kit README section 4: IQ3_XXS gate/up + IQ4_NL down in blk 0,1,7; IQ2_XS + Q2_0 in blk 2-6
    for x in r.layers:
        hi = x.layer in (0, 1, 7)
        assert (x.gate_type, x.up_type, x.down_type) == (("IQ3_XXS",) * 2 + ("IQ4_NL",) if hi else ("IQ2_XS",) * 2 + ("Q2_0",))
        gu_row = 256 // 256 * (98 if hi else 74)
        d_row = 64 // 32 * 18 if hi else 64 // 64 * 18
        assert x.blob_bytes == 2 * 64 * gu_row + 256 * d_row
    s = inspect_model(kit / "gguf/split/model-Q2_0-split-00004-of-00004.gguf")
    assert [sh.n_tensors for sh in s.shards] == [66, 66, 66, 16]
    assert s.layers[2].shards == (2, 2, 1) and s.layers[7].shards == (3, 4, 3)
    assert s.total_bytes == sum(p.stat().st_size for p in sorted((kit / "gguf/split").glob("*.gguf")))


def test_inspect_synthetic_mtp(tmp_path, cli):
    rel = synth_release(tmp_path / "r", SynthConfig(n_layers=4, mtp=True, ple_layers=(1,)))
    r = inspect_model(rel.revB.path)
    assert r.synthetic and r.name.endswith("revB (synthetic)")
    assert (r.block_count, r.n_trunk, r.n_mtp, r.n_expert) == (5, 4, 1, 16)
    assert r.layers[-1].is_mtp and r.layers[-1].n_expert == 32 and r.packable
    assert [x.gate_type for x in r.layers[:4]] == ["Q8_0", "Q4_0", "Q8_0", "Q4_0"]
    assert all(x.down_type == "Q2_0" for x in r.layers)
    code, out, _ = cli("inspect", rel.revB.path)
    assert code == 0 and "4 (MTP)" in out and "yes (stratatools.synthetic)" in out and "revB (synthetic)" in out
