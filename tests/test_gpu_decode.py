"""The static batch-1 decoder (stratatools.runtime.gpu.decode): numpy steps equal the reference forward on the CPU; on a GPU
its eager steps and its CUDA-graph replays equal GPURuntime.forward (logits and routed sets), the routing read
back once per step feeds the tier counters. GPU tests skip without CuPy; all need the kit."""

from __future__ import annotations

import numpy as np
import pytest

from stratatools.runtime import gpu
from stratatools.core.errors import StrataError


def _prompt(kit, n):
    line = (kit / "routing/tokens.tsv").read_text().splitlines()[0]
    return [int(v) for v in line.split("\t")[1].split()][:n]


def _compare(rt, dec, st, first, steps):
    """Feed the same tokens to rt.forward (state st) and dec; return worst relative logit error and top-k agreement."""
    worst, same, total, tok_ok = 0.0, 0, 0, 0
    errs = []
    tok = first
    for _ in range(steps):
        ref, rec = rt.forward([tok], st)
        got = dec.step(tok)
        ids, _ = dec.routing()
        ref = np.asarray(ref.get() if hasattr(ref, "get") else ref, dtype=np.float64)
        got = np.asarray(got.get() if hasattr(got, "get") else got, dtype=np.float64)
        errs.append(float(np.abs(ref - got).max() / np.abs(ref).max()))
        worst = max(worst, errs[-1])
        for l in range(len(rec.ids)):
            total += 1
            same += set(rec.ids[l][0].tolist()) == set(ids[l].tolist())
        tok_ok += dec.next_token() == int(np.argmax(ref)) or np.sort(ref)[-1] - np.sort(ref)[-2] < 1e-4
        tok = int(np.argmax(ref))
    print("per-step relative logit errors:", errs)
    assert tok_ok == steps
    return worst, same / total


@pytest.mark.kit
def test_static_decoder_numpy_matches_forward(kit):
    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    w = load(kit / "gguf/model-bf16.gguf")
    rt = Qwen4ExpRuntime(w)
    n_ctx = max_full_context(w.cfg, "transformers")
    assert n_ctx == (w.cfg.idx_budget // 4 + 1) * 4 - 1  # kit: budget 8, ratio 4 -> positions 0..10
    st = rt.new_state()
    lg, _ = rt.forward(_prompt(kit, 4), st)
    dec = StaticDecoder(rt, max_ctx=n_ctx)
    dec.load_state(st)
    worst, agree = _compare(rt, dec, st, int(np.argmax(lg)), n_ctx - 4)
    assert worst < 1e-5 and agree == 1.0
    with pytest.raises(StrataError, match="past the static decoder"):
        dec.step(1)
    assert not dec.long and StaticDecoder(rt, max_ctx=n_ctx + 1).long  # past it: selection inside the step
    with pytest.raises(StrataError, match="over the model's context length 4096"):
        StaticDecoder(rt, max_ctx=4097)


@pytest.mark.gpu
@pytest.mark.kit
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("model", ["gguf/model-bf16.gguf", "quant/model-ISTA-mix.gguf"])
def test_static_decoder_gpu_eager_and_graph(kit, model):
    import cupy as cp

    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    path = kit / model
    if not path.exists():
        pytest.skip(f"{model} not carried")
    rt = GPURuntime(load(path, xp=cp))
    n_ctx = max_full_context(rt.cfg, "transformers")
    for use_graph in (False, True):
        st = rt.new_state()
        lg, _ = rt.forward(_prompt(kit, 4), st)
        dec = StaticDecoder(rt, max_ctx=n_ctx)
        dec.load_state(st)
        if use_graph:
            assert dec.capture()
        hits0 = int(rt.tier.counters.hits.sum())
        worst, agree = _compare(rt, dec, st, int(np.argmax(lg.get())), n_ctx - 4)
        print(model, "graph" if use_graph else "eager", worst, agree)
        assert worst < 1e-4 and agree >= 0.99
        assert dec.stats["graph_steps"] == (n_ctx - 4 if use_graph else 0)
        # eager forward and the decoder's batched bookkeeping both count k hits per layer per step
        assert int(rt.tier.counters.hits.sum()) - hits0 == 2 * (n_ctx - 4) * rt.cfg.n_layer * rt.cfg.n_expert_used


@pytest.mark.gpu
@pytest.mark.kit
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("model", ["gguf/model-bf16.gguf", "quant/model-ISTA-mix.gguf", "quant/model-Q2_0.gguf"])
def test_static_decoder_fast_matches_reference_step(kit, model):
    """The fast step (tiled matvec, fused norms/hyper-connections/router), unfused and with the fused_step.cu kernels
    (GDN step, PLE, inject + norm, FMA expert kernels), against the reference step, all replayed from graphs on the
    same tokens: logits to float rounding, the same routed experts and weights, the copied-back next token."""
    import cupy as cp

    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    path = kit / model
    if not path.exists():
        pytest.skip(f"{model} not carried")
    rt = GPURuntime(load(path, xp=cp))
    n_ctx = max_full_context(rt.cfg, "transformers")
    decs = []
    for fast, fused in ((False, False), (True, False), (True, True)):
        st = rt.new_state()
        lg, _ = rt.forward(_prompt(kit, 4), st)
        d = StaticDecoder(rt, max_ctx=n_ctx, fast=fast, fused=fused)
        assert d.fast == fast and d.fused == fused
        d.load_state(st)
        assert d.capture()
        decs.append(d)
    tok = int(np.argmax(lg.get()))
    worst, same, total = [0.0, 0.0], [0, 0], 0
    for _ in range(n_ctx - 4):
        a = decs[0].step(tok).get().astype(np.float64)
        ia, wa = decs[0].routing()
        for j, d in enumerate(decs[1:]):
            b = d.step(tok).get().astype(np.float64)
            ib, wb = d.routing()
            assert d.next_token() == int(np.argmax(b))
            worst[j] = max(worst[j], float(np.abs(a - b).max() / np.abs(a).max()))
            for l in range(ia.shape[0]):
                if set(ia[l].tolist()) == set(ib[l].tolist()):
                    same[j] += 1
                    oa, ob = np.argsort(ia[l]), np.argsort(ib[l])
                    assert np.allclose(wa[l][oa], wb[l][ob], rtol=1e-4, atol=1e-7), l
        total += ia.shape[0]
        tok = int(np.argmax(a))
    print(model, "fast (unfused, fused) vs reference step:", worst, [s / total for s in same])
    assert max(worst) < 1e-4 and min(same) / total >= 0.99


@pytest.mark.gpu
@pytest.mark.kit
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("selection", ["transformers", "llamacpp"])
def test_static_decoder_gpu_long_context(kit, selection):
    """Past the full-selection context (kit: 11 positions) the step pools block keys, scores and selects cells on
    the device (qsa_step.cu) and attends them with the split attention: eager and graph replays against
    GPURuntime.forward for 80 positions."""
    import cupy as cp

    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    rt = GPURuntime(load(kit / "gguf/model-bf16.gguf", xp=cp), selection=selection)
    lim = max_full_context(rt.cfg, selection)
    n_ctx = 84
    for use_graph in (False, True):
        st = rt.new_state()
        lg, _ = rt.forward(_prompt(kit, 4), st)
        dec = StaticDecoder(rt, max_ctx=n_ctx)
        assert dec.long and n_ctx > 7 * lim
        dec.load_state(st)
        if use_graph:
            assert dec.capture()
        worst, agree = _compare(rt, dec, st, int(np.argmax(lg.get())), n_ctx - 4)
        print(selection, "graph" if use_graph else "eager", worst, agree)
        assert worst < 1e-4 and agree >= 0.99


@pytest.mark.kit
def test_decoder_buffers_are_the_plan_and_the_capture_snapshot_does_not_grow(kit):
    """What the static decoder allocates for its states and caches is what plan_vram counts (cache_bytes) at two
    context lengths; the capture's save/restore of the step's writes (host copies) is exact and does not grow with
    max_ctx. The capture used to keep a full device copy of every cache in the graph's private pool: on the H200
    the 48x256 model's pool grew by the caches' size again from a 256- to an 8k-token context (over --vram-gib)."""
    from stratatools.runtime.device import cache_bytes
    from stratatools.runtime.gpu.decode import ATTN_SPLITS, StaticDecoder
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    w = load(kit / "gguf/model-bf16.gguf")
    rt = Qwen4ExpRuntime(w)
    cfg = w.cfg
    snap_bytes, state_bytes = {}, {}
    for mc in (64, 512):
        dec = StaticDecoder(rt, max_ctx=mc)
        assert dec.long and dec.ik and dec.bk
        # the QSA selection/attention scratch is allocated on CuPy only
        scratch = 4 * 5 * (mc + 1) + 4 * cfg.n_head * mc + 4 * cfg.n_head * ATTN_SPLITS * (cfg.head_dim + 2)
        state_bytes[mc] = dec.state_buffer_bytes()
        slack = cache_bytes(cfg, mc) - state_bytes[mc] - scratch
        assert 0 <= slack < 64 * 1024, slack  # the plan covers the buffers, by a constant independent of max_ctx
        dec.load_state(rt.new_state())
        for t in _prompt(kit, 7):
            dec.step(t)
        assert dec.pos == 7  # the next step completes block 1 (ratio 4): it writes a block key too
        dec._stage(5)
        before = [a.copy() for a in dec._mutable()]
        snap = dec._snapshot()
        dec._body()
        changed = [i for i, (a, b) in enumerate(zip(dec._mutable(), before)) if not np.array_equal(a, b)]
        assert len(changed) >= len(dec.kc) + len(dec.vc) + len(dec.ik) + len(dec.bk)
        dec._restore(snap)
        assert all(np.array_equal(a, b) for a, b in zip(dec._mutable(), before))
        snap_bytes[mc] = StaticDecoder.snapshot_bytes(snap)
    assert state_bytes[512] - state_bytes[64] > 448 * 2 * 4 * cfg.head_dim  # the caches grow with max_ctx ...
    assert snap_bytes[64] == snap_bytes[512] < state_bytes[64]  # ... what the capture saves does not


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
def test_fused_step_q8_dense_matches_reference_step(tmp_path, monkeypatch):
    """The fused step with Q8_0 dense matrices re-laid out for dense_q8.cu (stacked projections, row parts, the
    hyper-connection up projection and mix in one kernel) and with the GGUF-block matvec (STRATATOOLS_DENSE_Q8=0),
    against the reference step on a small synthetic model whose dense matrices are Q8_0: logits to float rounding,
    the same routed experts."""
    import cupy as cp

    from stratatools.runtime.gpu.decode import Q8R, StaticDecoder
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load
    from stratatools.synth.model import SynthConfig, synth_release

    rel = synth_release(tmp_path / "m", SynthConfig(seed=3, n_layers=4, revisions=False))
    rt = GPURuntime(load(rel.canonical, xp=cp))
    decs = {}
    for name, fast, env in (("reference", False, "1"), ("fused", True, "1"), ("fused_blocks", True, "0")):
        monkeypatch.setenv("STRATATOOLS_DENSE_Q8", env)
        d = StaticDecoder(rt, max_ctx=24, fast=fast, fused=fast)
        d.load_state(rt.new_state())
        assert d.capture()
        decs[name] = d
    q8 = [n for n, (raw, *_rest) in decs["fused"]._raw.items() if isinstance(raw, Q8R)]
    assert any(n.endswith("hc_attn_up.weight") for n in q8)  # the mix kernel's matrices
    assert any(isinstance(raw, Q8R) for raw, _ in decs["fused"]._raw_groups.values())
    assert not any(isinstance(raw, Q8R) for raw, *_ in decs["fused_blocks"]._raw.values())
    tok = 5
    worst, same, total = {"fused": 0.0, "fused_blocks": 0.0}, {"fused": 0, "fused_blocks": 0}, 0
    for _ in range(20):
        a = decs["reference"].step(tok).get().astype(np.float64)
        ia, _ = decs["reference"].routing(account=False)
        for k in worst:
            b = decs[k].step(tok).get().astype(np.float64)
            ib, _ = decs[k].routing(account=False)
            worst[k] = max(worst[k], float(np.abs(a - b).max() / np.abs(a).max()))
            same[k] += sum(set(ia[l].tolist()) == set(ib[l].tolist()) for l in range(ia.shape[0]))
        total += ia.shape[0]
        tok = int(np.argmax(a))
    print("fused step vs reference on Q8_0 dense:", worst, {k: v / total for k, v in same.items()})
    assert max(worst.values()) < 1e-4 and min(same.values()) / total >= 0.99


def test_graph_cuts_parse_and_refuse(monkeypatch):
    from stratatools.runtime.gpu.decode import GRAPH_PARTS_ENV, graph_cuts

    monkeypatch.delenv(GRAPH_PARTS_ENV, raising=False)
    assert graph_cuts(48) == [2, 8, 24]  # pieces of 2, 6, 16 and 24 layers
    assert graph_cuts(8) == [1, 4] and graph_cuts(2) == [1] and graph_cuts(1) == []
    assert graph_cuts(48, "1") == [] and graph_cuts(48, " 30, 3,3 ") == [3, 30]
    monkeypatch.setenv(GRAPH_PARTS_ENV, "1")
    assert graph_cuts(48) == []
    for bad in ("0", "48", "two", ","):
        with pytest.raises(StrataError, match="STRATATOOLS_GRAPH_PARTS=.*comma list of layers from 1 to 47"):
            graph_cuts(48, bad)


def _partial_lru(arena, cfg):
    """A partial LRU tier over ``arena``'s experts (k + 2 slots a layer); skips the test where pinned host memory is
    not mapped into the device."""
    from stratatools.cachesim import make_tier

    if arena.device_ptr is None:
        pytest.skip("pinned memory is not mapped into the device here")
    L = cfg.n_layer
    return make_tier("lru", n_layers=L, n_expert=max(cfg.n_expert), slots=L * (cfg.n_expert_used + 2),
                     blob_bytes=[ly.blob_bytes for ly in arena.layers])


def _captured_steps(kit, w, arena, pol, n_ctx):
    """A static decoder over ``w`` (the tier policy ``pol``, None: all resident; misses read from ``arena``), captured,
    run greedily for ``n_ctx`` steps from the kit's first prompt token: (decoder, [(logits, routed ids)] a step)."""
    from stratatools.runtime.gpu.decode import StaticDecoder
    from stratatools.runtime.gpu.runtime import GPURuntime

    rt = GPURuntime(w, policy=pol, miss_mode="host", arena=arena)
    dec = StaticDecoder(rt, max_ctx=n_ctx)
    dec.load_state(rt.new_state())
    assert dec.capture()
    tok, out = _prompt(kit, 1)[0], []
    for _ in range(n_ctx):
        lg = dec.step(tok).get()
        ids, _ = dec.routing()
        out.append((lg.copy(), ids.copy()))
        tok = dec.next_token()
    return dec, out


@pytest.mark.gpu
@pytest.mark.kit
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("fetch", ["zero-copy", "prefetch"])
def test_graph_pieces_replay_the_one_graph_bit_for_bit(kit, fetch, monkeypatch):
    """The fused step captured in pieces (auto, and a cut before every layer) gives the one-graph step's logits and
    routing bit for bit, with every expert resident and (prefetch) with a partial LRU tier whose prefetch is joined at
    the cuts."""
    import cupy as cp

    from stratatools.runtime.gpu.decode import graph_cuts, max_full_context
    from stratatools.runtime.gpu.tier import HostArena
    from stratatools.runtime.weights import load

    monkeypatch.setenv("STRATATOOLS_MISS_FETCH", fetch)
    w = load(kit / "gguf/model-bf16.gguf", xp=cp)
    arena = HostArena.from_expert_source(w.experts)
    cfg = w.cfg
    L = cfg.n_layer
    n_ctx = max_full_context(cfg, "transformers")
    every = ",".join(str(i) for i in range(1, L))
    got = {}
    for parts in ("1", "auto", every):
        monkeypatch.setenv("STRATATOOLS_GRAPH_PARTS", parts)
        pol = _partial_lru(arena, cfg) if fetch == "prefetch" else None
        dec, got[parts] = _captured_steps(kit, w, arena, pol, n_ctx)
        assert len(dec.graphs) == {"1": 1, "auto": len(graph_cuts(L, "auto")) + 1, every: L}[parts]
        assert dec.stats["graph_steps"] == n_ctx
    for parts in ("auto", every):
        for (a, ia), (b, ib) in zip(got["1"], got[parts]):
            assert np.array_equal(a, b) and np.array_equal(ia, ib)


@pytest.mark.gpu
@pytest.mark.kit
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
def test_prefetch_orders_give_the_same_step(kit, monkeypatch):
    """STRATATOOLS_PREFETCH_ORDER first / after / mixer only decide when the next layer's predicted misses are
    copied: the same logits, routing and hit counts bit for bit under a partial LRU tier, each order prefetching."""
    import cupy as cp

    from stratatools.runtime.gpu.decode import max_full_context
    from stratatools.runtime.gpu.tier import HostArena
    from stratatools.runtime.weights import load

    monkeypatch.setenv("STRATATOOLS_MISS_FETCH", "prefetch")
    w = load(kit / "gguf/model-bf16.gguf", xp=cp)
    arena = HostArena.from_expert_source(w.experts)
    if arena.device_ptr is None:
        pytest.skip("pinned memory is not mapped into the device here")
    cfg = w.cfg
    n_ctx = max_full_context(cfg, "transformers")
    got, stats = {}, {}
    for order in ("first", "after", "mixer"):
        monkeypatch.setenv("STRATATOOLS_PREFETCH_ORDER", order)
        dec, got[order] = _captured_steps(kit, w, arena, _partial_lru(arena, cfg), n_ctx)
        stats[order] = dec.fetch_stats()
        assert stats[order]["prefetched_jobs"] > 0 and stats[order]["prefetch_used_jobs"] > 0, (order, stats[order])
    for order in ("after", "mixer"):
        for (a, ia), (b, ib) in zip(got["first"], got[order]):
            assert np.array_equal(a, b) and np.array_equal(ia, ib)
    # the misses are the same; only how many a prediction served differs
    tot = {o: st["fetched_jobs"] + st["prefetch_used_jobs"] for o, st in stats.items()}
    assert tot["first"] == tot["after"] == tot["mixer"] > 0, stats


def _same_steps_under_flag(kit, model, fetch, env, check, monkeypatch):
    """The kit's ``model`` decoded by :func:`_captured_steps` with environment flag ``env`` at 0 and at 1 (misses
    served by ``fetch``; a partial LRU tier with ``prefetch``, all resident otherwise; skips when the model is not
    carried): ``check(decoder, value, cfg)`` after each, then the same logits and routing bit for bit."""
    import cupy as cp

    from stratatools.runtime.gpu.decode import max_full_context
    from stratatools.runtime.gpu.tier import HostArena
    from stratatools.runtime.weights import load

    if not (kit / model).exists():
        pytest.skip(f"{model} not carried")
    monkeypatch.setenv("STRATATOOLS_MISS_FETCH", fetch)
    w = load(kit / model, xp=cp)
    arena = HostArena.from_expert_source(w.experts)
    cfg = w.cfg
    n_ctx = max_full_context(cfg, "transformers")
    got = {}
    for v in ("0", "1"):
        monkeypatch.setenv(env, v)
        pol = _partial_lru(arena, cfg) if fetch == "prefetch" else None
        dec, got[v] = _captured_steps(kit, w, arena, pol, n_ctx)
        check(dec, v, cfg)
    for (a, ia), (b, ib) in zip(got["0"], got["1"]):
        assert np.array_equal(a, b) and np.array_equal(ia, ib)


@pytest.mark.gpu
@pytest.mark.kit
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("fetch", ["zero-copy", "prefetch"])
@pytest.mark.parametrize("model", ["gguf/model-bf16.gguf", "quant/model-Q2_0.gguf"])
def test_shared_expert_beside_the_routed_ones_gives_the_same_step(kit, model, fetch, monkeypatch):
    """STRATATOOLS_SHARED_SIDE=1 (the shared expert on a second stream beside the routed gate/up, the routed down
    adding to its result) against 0 (the shared expert after the routed ones): the same logits and routing bit for
    bit, every expert resident and (prefetch) under a partial LRU tier, graph-replayed in pieces; on the kit's BF16
    model (staged expert kernels) and its Q2_0 model (the pipelined ones, integer gate/up: the default path of a
    Q2_0 release)."""
    from stratatools.runtime.gpu.decode import SHARED_SIDE_ENV

    def check(dec, side, cfg):
        assert (dec._shared_side is not None) == (side == "1") and dec.fused
    _same_steps_under_flag(kit, model, fetch, SHARED_SIDE_ENV, check, monkeypatch)


def _fused_decoders(kit, model, env, values, monkeypatch):
    """One captured fused fast StaticDecoder per value of environment variable ``env``, over a GPURuntime on the kit's
    ``model`` (skips when it is not carried), each loaded with the state after the kit's 4-token prompt: ({value:
    decoder}, the prompt's greedy next token, the decoders' context)."""
    import cupy as cp

    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    path = kit / model
    if not path.exists():
        pytest.skip(f"{model} not carried")
    rt = GPURuntime(load(path, xp=cp))
    n_ctx = min(32, max_full_context(rt.cfg, "transformers"))
    st = rt.new_state()
    lg, _ = rt.forward(_prompt(kit, 4), st)
    decs = {}
    for v in values:
        monkeypatch.setenv(env, v)
        d = StaticDecoder(rt, max_ctx=n_ctx, fast=True, fused=True)
        d.load_state(st)
        assert d.capture()
        decs[v] = d
    return decs, int(np.argmax(lg.get())), n_ctx


@pytest.mark.gpu
@pytest.mark.kit
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
def test_fused_step_int8_experts_match_float_experts(kit, monkeypatch):
    """STRATATOOLS_MOE_INT8=1 (moe_gate_up_pipe_i8 / moe_down_pipe_i8 for the Q2_0 routed and shared experts)
    against =0 (the float pipelined kernels), graph-replayed on the kit's Q2_0 model: logits within 1e-4
    relative and the same greedy token every step, the same routed experts in at least 99% of the layers."""
    from stratatools.runtime.gpu import experts as E

    monkeypatch.setenv(E.MOE_KERNEL_ENV, "pipe")
    decs, tok, n_ctx = _fused_decoders(kit, "quant/model-Q2_0.gguf", E.MOE_INT8_ENV, ("0", "1"), monkeypatch)
    worst, same, total, differs = 0.0, 0, 0, False
    for _ in range(n_ctx - 4):
        a = decs["0"].step(tok).get().astype(np.float64)
        b = decs["1"].step(tok).get().astype(np.float64)
        ia, _w = decs["0"].routing()
        ib, _w = decs["1"].routing()
        differs |= not np.array_equal(a, b)
        worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
        same += sum(set(ia[l].tolist()) == set(ib[l].tolist()) for l in range(ia.shape[0]))
        total += ia.shape[0]
        top2 = np.sort(a)[-2:]
        assert decs["1"].next_token() == int(np.argmax(a)) or top2[1] - top2[0] < 1e-5 * np.abs(a).max()
        tok = int(np.argmax(a))
    print("int8 experts vs float experts, worst relative logit difference:", worst, "routing", same / total)
    assert differs  # the integer kernels ran (their rounding differs from the float kernels')
    assert worst < 1e-4 and same / total >= 0.99


def test_shared_side_flag_refuses_other_values(monkeypatch):
    from stratatools.runtime.gpu.decode import SHARED_SIDE_ENV, shared_side

    monkeypatch.delenv(SHARED_SIDE_ENV, raising=False)
    assert shared_side() is True
    monkeypatch.setenv(SHARED_SIDE_ENV, "0")
    assert shared_side() is False
    for bad in ("yes", "2", "off"):
        monkeypatch.setenv(SHARED_SIDE_ENV, bad)
        with pytest.raises(StrataError, match="STRATATOOLS_SHARED_SIDE=.*use 1"):
            shared_side()


@pytest.mark.gpu
@pytest.mark.kit
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
def test_fused_step_int8_dense_matches_default(kit, monkeypatch):
    """STRATATOOLS_DENSE_KERNEL=int8 (mv_q8i: x quantized per block of 32 to 16-bit fixed point, int8 dot products)
    against the float streaming matvec (mv_q8s, STRATATOOLS_DENSE_KERNEL=stream), both graph-replayed on the kit's Q8_0-dense model with every
    re-laid-out matrix on the streaming kernel (the row threshold lowered to 0; the hyper-connection up projection
    and mix in one launch): logits within 1e-4 relative, the same greedy token, every step."""
    from stratatools.runtime.gpu import kernels as K
    from stratatools.runtime.gpu.decode import Q8R

    monkeypatch.setattr(K, "DQS_MIN_ROWS_PER_SM", 0)
    decs, tok, n_ctx = _fused_decoders(kit, "quant/model-ISTA-mix.gguf", K.DENSE_KERNEL_ENV, ("stream", "int8"),
                                       monkeypatch)
    for env, d in decs.items():
        assert d.dense_q8 and d.dense_int8 == (env == "int8")
    assert any(isinstance(raw, Q8R) for raw, *_ in decs["int8"]._raw.values())
    worst = 0.0
    for _ in range(n_ctx - 4):
        a = decs["stream"].step(tok).get().astype(np.float64)
        b = decs["int8"].step(tok).get().astype(np.float64)
        worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
        top2 = np.sort(a)[-2:]
        assert decs["stream"].next_token() == int(np.argmax(a))
        # the same greedy token (unless the default step's top two logits are within float rounding of a tie)
        assert decs["int8"].next_token() == int(np.argmax(a)) or top2[1] - top2[0] < 1e-5 * np.abs(a).max()
        tok = int(np.argmax(a))
    print("int8 dense (mv_q8i) vs stream (mv_q8s) step logits, worst relative:", worst)
    assert worst < 1e-4


@pytest.mark.gpu
@pytest.mark.kit
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("fetch", ["zero-copy", "prefetch"])
@pytest.mark.parametrize("model", ["gguf/model-bf16.gguf", "quant/model-Q2_0.gguf"])
def test_programmatic_dependent_launch_gives_the_same_step(kit, model, fetch, monkeypatch):
    """STRATATOOLS_PDL=1 (the step's kernels launched by programmatic dependent launch inside its graphs: each may
    start before the one before it ends and waits in griddepcontrol.wait) against =0: the same logits and routing bit
    for bit, every expert resident and (prefetch) under a partial LRU tier, graph-replayed in pieces, on the kit's
    BF16 model (staged expert kernels) and its Q2_0 model (the pipelined ones); with 1 the captures made such
    launches."""
    from stratatools.runtime.gpu.launch import PDL_ENV, PdlKernel

    def check(dec, v, cfg):
        assert dec.pdl == (v == "1") and dec.fused
        assert isinstance(dec.k_inject_rms, PdlKernel) == (v == "1")
        if v == "1":
            n = sum(k.pdl_launches for k in vars(dec).values() if isinstance(k, PdlKernel))
            assert dec.k_inject_rms.pdl_launches > 0 and n > cfg.n_layer, n
    _same_steps_under_flag(kit, model, fetch, PDL_ENV, check, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("E", [8, 33, 200, 256, 300, 512])
@pytest.mark.parametrize("gating, norm", [("softmax", 1), ("softmax", 0), ("sigmoid", 1)])
def test_route_warp_matches_route_block_bit_for_bit(E, gating, norm):
    """route_warp_sg8 (E <= 256) and route_warp_sg16 (one warp, the probabilities in registers) against
    route_fused_sg (one block): the same ids, weights, blob addresses and shared gate bit for bit, on random logits, on
    logits with ties (rounded to a coarse grid) and with NaN entries, for k of 1, 8 and 10."""
    import cupy as cp

    from stratatools.runtime.gpu.kernels import cuda_unit

    mod = cp.RawModule(code=cuda_unit("decode_step.cu"), options=("--std=c++17",))
    kb = mod.get_function("route_fused_sg")
    kws = [mod.get_function(f"route_warp_sg{nv}") for nv in (8, 16) if E <= 32 * nv]
    rng = np.random.default_rng(E)
    slot = cp.asarray(rng.integers(1, 2 ** 40, size=E, dtype=np.int64).astype(np.uint64) * 16)
    for trial in range(6):
        lg = rng.standard_normal(E + 1).astype(np.float32) * 3
        if trial % 3 == 1:
            lg = np.round(lg * 2) / 2  # many ties
        if trial % 3 == 2:
            lg[rng.integers(0, E, size=max(1, E // 8))] = np.nan
        for k in (1, 8, 10):
            if k > E:
                continue
            outs = []
            for kern, block, shm in [(kb, (min(1024, (E + 31) // 32 * 32),), E * 4)] + [(kw, (32,), 0) for kw in kws]:
                ids, w = cp.full(k, -1, cp.int32), cp.full(k, -1, cp.float32)
                gp, up, dp = (cp.zeros(k, cp.uint64) for _ in range(3))
                sg = cp.zeros(1, cp.float32)
                kern((1,), block, (cp.asarray(lg), np.int32(E), np.int32(k), np.int32(gating == "sigmoid"),
                                   np.int32(norm), np.float32(1.5), slot, np.uint64(4096), ids, w, gp, up, dp, sg),
                     shared_mem=shm)
                outs.append([a.get() for a in (ids, w, gp, up, dp, sg)])
            for got in outs[1:]:
                for a, b in zip(outs[0], got):
                    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (E, gating, norm, trial, k, a, b)
            if trial % 3 != 2:  # (with NaN entries fewer than k may be selectable: both repeat the same ids)
                assert len(set(outs[1][0].tolist())) == k
