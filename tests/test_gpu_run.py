"""``stratatools run --device gpu`` and the static decoder with a partial expert tier (GPU; skips without CuPy).

* the decoder with a partial tier (misses read from mapped pinned host memory, swaps between graph replays)
  gives the all-resident decoder's logits bit for bit, for every policy, and its hits are the simulator's;
* ``run --device gpu`` against ``--device cpu``: the same tokens and routing, the same tier counts;
* a context past QSA's full-selection range runs in the static decoder (selection on the device).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from stratatools.runtime import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.kit,
              pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")]

BF16 = "gguf/model-bf16.gguf"


def _prompt(kit, n):
    line = (kit / "routing/tokens.tsv").read_text().splitlines()[0]
    return [int(v) for v in line.split("\t")[1].split()][:n]


@pytest.mark.parametrize("fetch", ["zero-copy", "fetch", "prefetch"])
@pytest.mark.parametrize("policy", ["static", "adaptive", "lru", "lfu", "lfru"])
def test_static_decoder_partial_tier_equals_all_resident(kit, policy, fetch, monkeypatch):
    """Every miss fetch mode (decode.MISS_FETCH_ENV): bit for bit the all-resident logits and routing, the
    simulator's hits; with a fetch mode every miss of a replayed step is either copied after its routing or served by
    the copy its prediction made (counted on the device)."""
    import cupy as cp

    monkeypatch.setenv("STRATATOOLS_MISS_FETCH", fetch)

    from stratatools.cachesim import make_tier
    from stratatools.profiles.strp import read_profile
    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.gpu.tier import HostArena
    from stratatools.runtime.weights import load

    w = load(kit / BF16, xp=cp)
    arena = HostArena.from_expert_source(w.experts)
    if arena.device_ptr is None:
        pytest.skip("pinned memory is not mapped into the device here")
    cfg = w.cfg
    L, E = cfg.n_layer, max(cfg.n_expert)
    bb = [ly.blob_bytes for ly in arena.layers]
    slots = L * (cfg.n_expert_used + 2)

    def pol():
        if policy in ("static", "adaptive"):
            prof = read_profile(kit / "pruned/profile-canonical.bin")
            extra = {"adapt_every": 1, "usage_floor": 0.5} if policy == "adaptive" else {}
            return make_tier(policy, profile=prof, slots=slots, blob_bytes=bb, **extra)
        return make_tier(policy, n_layers=L, n_expert=E, slots=slots, blob_bytes=bb)

    part = GPURuntime(w, policy=pol(), miss_mode="host", arena=arena)
    full = GPURuntime(w, arena=arena)
    sim = pol()
    assert part.tier.resident_count() < L * E
    n_ctx = max_full_context(cfg, "transformers")
    decs = []
    for rt in (part, full):
        d = StaticDecoder(rt, max_ctx=n_ctx)
        d.load_state(rt.new_state())
        assert d.capture()
        decs.append(d)
    tok = _prompt(kit, 1)[0]
    dev_misses = 0  # routed experts not in a slot when their step replayed (what the device fetches)
    for step in range(n_ctx):
        before = [set(d) for d in part.tier.slot_of]
        a = decs[0].step(tok).get()
        b = decs[1].step(tok).get()
        ia, _ = decs[0].routing()
        ib, _ = decs[1].routing()
        assert np.array_equal(a, b), (policy, step)
        assert np.array_equal(ia, ib)
        dev_misses += sum(int(e) not in before[l] for l in range(L) for e in ia[l])
        for l in range(L):
            sim.access(l, ib[l].astype(np.int64))
        sim.end_round()
        part.tier.end_round()
        tok = int(np.argmax(b))
    st = part.tier.stats()
    assert st["hits"] == sim.stats()["hits"]
    assert st["hits"] + st["misses"] == n_ctx * L * cfg.n_expert_used
    assert st["misses"] > 0 and st["miss_host_read_bytes"] == st["misses"] * bb[0]
    if policy != "static":
        assert decs[0].stats.get("slot_uploads", 0) > 0  # experts moved between replays
    fs = decs[0].fetch_stats()
    assert fs["mode"] == fetch and decs[1].fetch_stats() == {"mode": "zero-copy"}
    if fetch != "zero-copy":
        assert decs[0].kernels_routed == "pipe"
        # An evicting policy can count more misses than the device fetched: its access of a layer's k experts in
        # turn may evict one of the same k (resident when the step ran, a miss by the time the policy reaches it).
        assert fs["fetched_jobs"] + fs["prefetch_used_jobs"] == dev_misses
        assert dev_misses == st["misses"] if policy == "static" else 0 < dev_misses <= st["misses"]
        assert fs["fetched_bytes"] == fs["fetched_jobs"] * bb[0]
        if fetch == "prefetch":
            assert fs["prefetched_bytes"] == fs["prefetched_jobs"] * bb[0]
            assert 0 < fs["prefetch_used_jobs"] <= fs["prefetched_jobs"]
        else:
            assert fs["prefetched_jobs"] == fs["prefetch_used_jobs"] == 0


@pytest.mark.parametrize("policy", ["lru", "static"])
def test_run_gpu_matches_cpu(kit, tmp_path, cli, policy):
    """Short context (inside the static decoder's range): the GPU run decodes the same tokens, records the same
    routing and counts the same hits as the CPU run."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"token_ids": _prompt(kit, 4)}]))
    out = {}
    for dev in ("cpu", "gpu"):
        trace = tmp_path / f"{dev}.csv"
        code, text, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "6", "--slots", "24", "--policy", policy,
                              "--device", dev, "--trace-out", trace, "--json")
        assert code == 0, err
        out[dev] = (json.loads(text), trace.read_text())
    c, g = out["cpu"][0], out["gpu"][0]
    assert g["device"]["device"] == "gpu" and g["device"]["engine"].startswith("static decoder")
    assert g["requests"][0]["new_ids"] == c["requests"][0]["new_ids"]
    rows = {dev: [ln.split(",") for ln in out[dev][1].splitlines()] for dev in out}
    head = rows["cpu"][0]
    wcol = head.index("weight")
    assert len(rows["cpu"]) == len(rows["gpu"]) > 1
    for rc, rg in zip(rows["cpu"][1:], rows["gpu"][1:]):  # same records; router weights to float rounding
        assert rc[:wcol] + rc[wcol + 1:] == rg[:wcol] + rg[wcol + 1:]
        assert abs(float(rc[wcol]) - float(rg[wcol])) < 1e-5
    for ph in ("prefill", "decode"):
        assert g["tier"][ph]["entries"] == c["tier"][ph]["entries"]
        assert g["tier"][ph]["hits"] == c["tier"][ph]["hits"], ph


def test_run_gpu_long_context_selects_on_the_device(kit, tmp_path, cli):
    """A context past the full-selection range (kit: 11 positions) runs in the static decoder with QSA selection
    on the device: the same tokens, routing and hits as the CPU run; --vram-gib plans it."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"token_ids": _prompt(kit, 40)}]))
    out = {}
    for dev in ("cpu", "gpu"):
        code, text, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "24", "--slots", "24", "--policy", "lru",
                              "--device", dev, "--json")
        assert code == 0, err
        out[dev] = json.loads(text)
    c, g = out["cpu"], out["gpu"]
    assert g["device"]["engine"] == "static decoder + CUDA graph (QSA selection on the device)"
    assert g["requests"][0]["new_ids"] == c["requests"][0]["new_ids"]
    for ph in ("prefill", "decode"):
        assert g["tier"][ph]["entries"] == c["tier"][ph]["entries"]
        assert g["tier"][ph]["hits"] == c["tier"][ph]["hits"], ph
    code, text, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "24", "--device", "gpu", "--vram-gib", "1",
                          "--policy", "lru", "--json")
    assert code == 0, err
    d = json.loads(text)["device"]
    assert d["plan"]["planned_bytes"] <= d["plan"]["budget_bytes"]
    assert json.loads(text)["requests"][0]["new_ids"] == c["requests"][0]["new_ids"]


def test_run_gpu_vram_budget(kit, tmp_path, cli):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"token_ids": _prompt(kit, 4)}]))
    code, text, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "4", "--device", "gpu", "--vram-gib", "1",
                          "--policy", "lru", "--json")
    assert code == 0, err
    d = json.loads(text)["device"]
    assert d["plan"]["planned_bytes"] <= d["plan"]["budget_bytes"]
    assert d["pool_bytes"] <= d["plan"]["budget_bytes"]
    code, _, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "4", "--device", "gpu", "--vram-gib", "0.01")
    assert code == 2 and "before any expert slot" in err, err


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_lagged_bookkeeping_counts_as_before(kit, policy):
    """DecoderRuntime with the previous step's bookkeeping done while the next step runs (lag, the default), and with
    admitted experts copied alongside the next step (async_swaps), against the bookkeeping before each launch and
    against all resident: the same tokens (a miss reads the same bytes from host memory), the same routing, and the
    same hits per layer and copies (the policy sees the same calls); experts did move between replays."""
    import cupy as cp

    from stratatools.cachesim import make_tier
    from stratatools.profiles.strp import read_profile
    from stratatools.runtime.gpu.decode import max_full_context
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.gpu.tier import HostArena
    from stratatools.runtime.model import generate
    from stratatools.runtime.weights import load

    w = load(kit / BF16, xp=cp)
    arena = HostArena.from_expert_source(w.experts)
    if arena.device_ptr is None:
        pytest.skip("pinned memory is not mapped into the device here")
    cfg = w.cfg
    L, E = cfg.n_layer, max(cfg.n_expert)
    bb = [ly.blob_bytes for ly in arena.layers]
    slots = L * (cfg.n_expert_used + 2)

    def pol():
        if policy == "adaptive":
            return make_tier(policy, profile=read_profile(kit / "pruned/profile-canonical.bin"), slots=slots,
                             blob_bytes=bb, adapt_every=1, usage_floor=0.5)
        return make_tier(policy, n_layers=L, n_expert=E, slots=slots, blob_bytes=bb)

    n_ctx = max_full_context(cfg, "transformers")
    out = {}
    for name, lag, part in (("lag", True, True), ("nolag", False, True), ("resident", True, False), ("async", True, True)):
        grt = GPURuntime(w, policy=pol() if part else None, miss_mode="host", arena=arena)
        rt = DecoderRuntime(grt, max_ctx=n_ctx, lag=lag, async_swaps=name == "async")
        assert rt.async_swaps == (name == "async")
        g = generate(rt, _prompt(kit, 4), max_new_tokens=n_ctx - 4, stop_id=-1,
                     on_forward=lambda phase: grt.tier.end_round())
        assert not grt.tier.holding()
        out[name] = (g, grt.tier.stats(), rt.dec.stats.get("slot_uploads", 0))
    (ga, sa, ua), (gb, sb, _), (gc, _, _), (gd, sd, ud) = out["lag"], out["nolag"], out["resident"], out["async"]
    assert ga.new_ids == gb.new_ids == gc.new_ids == gd.new_ids and len(ga.new_ids) == n_ctx - 4
    assert len(ga.decode) == len(gb.decode) == len(gd.decode) == n_ctx - 5
    for ra, rb, rd in zip(ga.decode, gb.decode, gd.decode):
        assert np.array_equal(ra.positions, rb.positions)
        assert all(np.array_equal(x, y) and np.array_equal(x, z) for x, y, z in zip(ra.ids, rb.ids, rd.ids))
    for st in (sa, sd):  # the copies alongside the next step (async) count what the policy counts, as the others
        assert st["layer_hits"] == sb["layer_hits"] and st["layer_misses"] == sb["layer_misses"]
        assert st["admit_copies"] == sb["admit_copies"]
    assert sa["misses"] > 0 and ua > 0 and ud > 0
