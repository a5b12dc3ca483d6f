"""The runtime's oracle checks with CuPy (issue 7.3): the kit's BF16 GGUF run by stratatools.runtime.gpu.GPURuntime
against transformers' reference outputs shipped in the kit (routing/transformers-f32.*) and against the numpy
runtime; the ISTA-mix GGUF (i-quants, Q2_0) against the numpy runtime. Skips without a GPU or the kit."""

from __future__ import annotations

import csv
import json
import os
from collections import defaultdict

import numpy as np
import pytest

from stratatools.runtime import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.kit,
              pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")]

REPORT = os.environ.get("STRATATOOLS_GPU_REPORT")  # optional JSON file collecting the measured numbers


def _report(key, value):
    if not REPORT:
        return
    data = {}
    if os.path.exists(REPORT):
        with open(REPORT) as fh:
            data = json.load(fh)
    data[key] = value
    with open(REPORT, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)


def _prompts(kit):
    out = {}
    for line in (kit / "routing/tokens.tsv").read_text().splitlines():
        pid, ids = line.split("\t")
        out[pid] = [int(v) for v in ids.split()]
    return out


def _hf_routing(kit):
    sets = defaultdict(set)
    with open(kit / "routing/transformers-f32.routing.csv") as fh:
        for r in csv.DictReader(fh):
            sets[(r["prompt_id"], int(r["token_pos"]), int(r["layer"]))].add(int(r["expert_id"]))
    return sets


def _hf_logits(kit):
    lg = defaultdict(dict)
    with open(kit / "routing/transformers-f32.logits_last.csv") as fh:
        for r in csv.DictReader(fh):
            lg[r["prompt_id"]][int(r["token_id"])] = float(r["logit"])
    return {p: np.array([d[i] for i in range(len(d))], dtype=np.float64) for p, d in lg.items()}


def _load(path, xp):
    from stratatools.runtime.weights import load

    return load(path, xp=xp)


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


def _run(rt, ids):
    st = rt.new_state()
    lg, rec = rt.forward(ids, st, logits="last")
    return np.asarray(lg.get() if hasattr(lg, "get") else lg, dtype=np.float64), rec


def test_gpu_runtime_bf16_oracle(cp, kit):
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.model import Qwen4ExpRuntime

    path = kit / "gguf/model-bf16.gguf"
    prompts, hf_sets, hf_lg = _prompts(kit), _hf_routing(kit), _hf_logits(kit)
    w_gpu, w_cpu = _load(path, cp), _load(path, np)
    rt_gpu, rt_cpu = GPURuntime(w_gpu), Qwen4ExpRuntime(w_cpu)
    same_hf = total = same_cpu = 0
    worst = {"max_abs_vs_hf": 0.0, "max_rel_vs_hf": 0.0, "max_abs_vs_cpu": 0.0}
    for pid, ids in prompts.items():
        lg_g, rec_g = _run(rt_gpu, ids)
        lg_c, rec_c = _run(rt_cpu, ids)
        ref = hf_lg[pid]
        worst["max_abs_vs_hf"] = max(worst["max_abs_vs_hf"], float(np.abs(lg_g - ref).max()))
        worst["max_rel_vs_hf"] = max(worst["max_rel_vs_hf"], float(np.abs(lg_g - ref).max() / np.abs(ref).max()))
        worst["max_abs_vs_cpu"] = max(worst["max_abs_vs_cpu"], float(np.abs(lg_g - lg_c).max()))
        for il, (ig, ic) in enumerate(zip(rec_g.ids, rec_c.ids)):
            for t in range(ig.shape[0]):
                total += 1
                same_hf += set(ig[t].tolist()) == hf_sets[(pid, t, il)]
                same_cpu += set(ig[t].tolist()) == set(ic[t].tolist())
    worst.update(topk_agree_vs_hf=same_hf / total, topk_agree_vs_cpu=same_cpu / total, cells=total)
    print("GPU bf16 oracle:", worst)
    _report("bf16_oracle", worst)
    assert total == 1080
    assert same_cpu / total >= 0.999
    assert worst["max_rel_vs_hf"] < 1e-3
    assert same_hf / total >= 0.999


def test_gpu_runtime_prefill_then_decode(cp, kit):
    from stratatools.runtime.gpu.runtime import GPURuntime

    rt = GPURuntime(_load(kit / "gguf/model-bf16.gguf", cp))
    ids = _prompts(kit)["p1"][:20]
    whole, _ = _run(rt, ids)
    st = rt.new_state()
    rt.forward(ids[:12], st, logits="none")
    for t in ids[12:]:
        lg, _ = rt.forward([t], st, logits="last")
        rt.end_round()
    step = np.asarray(lg.get(), dtype=np.float64)
    err = float(np.abs(step - whole).max() / np.abs(whole).max())
    _report("prefill_vs_decode_rel", err)
    assert err < 1e-4


def test_gpu_runtime_ista_mix_matches_cpu(cp, kit):
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.model import Qwen4ExpRuntime

    path = kit / "quant/model-ISTA-mix.gguf"
    if not path.exists():
        pytest.skip("ISTA-mix not carried")
    ids = _prompts(kit)["p0"]
    lg_g, rec_g = _run(GPURuntime(_load(path, cp)), ids)
    lg_c, rec_c = _run(Qwen4ExpRuntime(_load(path, np)), ids)
    rel = float(np.abs(lg_g - lg_c).max() / np.abs(lg_c).max())
    same = sum(set(a[t].tolist()) == set(b[t].tolist()) for a, b in zip(rec_g.ids, rec_c.ids) for t in range(a.shape[0]))
    n = sum(a.shape[0] for a in rec_g.ids)
    _report("ista_mix_gpu_vs_cpu", {"max_rel": rel, "topk_agree": same / n})
    assert rel < 1e-3
    assert same / n >= 0.99


def test_gpu_runtime_with_tier(cp, kit):
    """The kit model through the tier under a static profile: same logits as all-resident, hits counted."""
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.cachesim import make_tier
    from stratatools.profiles.strp import read_profile

    path = kit / "gguf/model-bf16.gguf"
    prof_path = kit / "pruned/profile-canonical.bin"
    w = _load(path, cp)
    L, E = w.cfg.n_layer, w.cfg.n_expert if isinstance(w.cfg.n_expert, int) else max(w.cfg.n_expert)
    prof = read_profile(prof_path) if prof_path.exists() else None
    if prof is None or (prof.n_layers, prof.n_expert) != (L, E):
        pytest.skip("no kit profile for this geometry")
    rt_all = GPURuntime(w)
    bb = [ly.blob_bytes for ly in rt_all.arena.layers]
    pol = make_tier("static", profile=prof, slots=L * E // 4, blob_bytes=bb)
    rt = GPURuntime(w, policy=pol, miss_mode="copy", arena=rt_all.arena)
    ids = _prompts(kit)["p2"]
    a, _ = _run(rt_all, ids)
    b, _ = _run(rt, ids)
    st = rt.tier.stats()
    _report("kit_tier_static_quarter", {k: st[k] for k in ("hits", "misses", "h_expert", "miss_copy_bytes")})
    assert np.array_equal(a, b)
    assert st["hits"] == pol.stats()["hits"] and st["hits"] + st["misses"] == len(ids) * L * w.cfg.n_expert_used
