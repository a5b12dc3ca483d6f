"""The batched prefill of the static decoder (stratatools.runtime.gpu.prefill): on the CPU (numpy decoder) a prompt run
in chunks leaves the decoder in the state of one step per token (K/V, GDN, PLE, QSA indexer caches, context, position)
with the same routing and logits, in the full-selection range and past it; on a GPU the batched prefill agrees with the
token-by-token decode graph by tolerance and the decode that follows gives the same greedy tokens. GPU tests skip
without CuPy; all need the kit."""

from __future__ import annotations

import io

import numpy as np
import pytest

from stratatools.core.errors import StrataError
from stratatools.runtime import gpu


def _prompt(kit, n):
    toks = []
    for line in (kit / "routing/tokens.tsv").read_text().splitlines():
        toks += [int(v) for v in line.split("\t")[1].split()]
    if len(toks) < n:
        raise AssertionError(f"the kit's prompts hold {len(toks)} tokens, {n} wanted")
    return toks[:n]


def _h(a):
    return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.float64)


def _rel(a, b):
    a, b = _h(a), _h(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _states(dec):
    out = {}
    for name in ("conv", "ssm", "kc", "vc", "ple_conv", "ik", "bk"):
        for il, a in getattr(dec, name).items():
            out[f"{name}[{il}]"] = a
    return out


@pytest.fixture(scope="module")
def cpu_rt(kit):
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    return Qwen4ExpRuntime(load(kit / "gguf/model-bf16.gguf"))


@pytest.mark.kit
@pytest.mark.parametrize("max_ctx,n_prompt,chunk,group,experts", [(11, 9, 4, 3, "rows"), (64, 37, 8, 5, "rows"),
                                                                 (64, 37, 8, 5, "gemm"), (64, 30, 64, 32, "gemm"),
                                                                 (64, 37, 8, 5, "mma")])
def test_numpy_prefill_equals_steps(kit, cpu_rt, max_ctx, n_prompt, chunk, group, experts):
    """Chunks (uneven last chunk, blocks completed inside a chunk, queries past the full-selection range on the long
    decoder) leave every cache, the PLE context and the position as the steps do; routing identical, logits equal to
    float rounding; then both decode the same greedy tokens."""
    from stratatools.runtime.gpu.decode import StaticDecoder

    toks = _prompt(kit, n_prompt)
    ref = StaticDecoder(cpu_rt, max_ctx=max_ctx)
    got = StaticDecoder(cpu_rt, max_ctx=max_ctx)
    assert ref.long == (max_ctx > 11)
    st = cpu_rt.new_state()
    ref.load_state(st)
    got.load_state(st)
    ids_r, w_r = [], []
    for t in toks:
        lg_r = ref.step(t)
        i, w = ref.routing(account=False)
        ids_r.append(i)
        w_r.append(w)
    lg, ids, w = got.prefill(toks, chunk=chunk, group=group, experts=experts)
    assert ids.shape == (n_prompt, cpu_rt.cfg.n_layer, cpu_rt.cfg.n_expert_used)
    assert np.array_equal(ids, np.stack(ids_r))
    assert np.allclose(w, np.stack(w_r), rtol=1e-5, atol=1e-7)
    assert _rel(lg, lg_r) < 1e-5
    assert got.pos == ref.pos == n_prompt
    assert np.array_equal(got.ple_ctx, ref.ple_ctx)
    sr, sg = _states(ref), _states(got)
    assert sr.keys() == sg.keys() and any(k.startswith("ik") for k in sr) == ref.long
    for key in sr:
        assert _rel(sg[key], sr[key]) < 1e-5, key
    for _ in range(max_ctx - n_prompt):
        a, b = int(np.argmax(_h(lg_r))), int(np.argmax(_h(lg)))
        assert a == b
        lg_r, lg = ref.step(a), got.step(b)


@pytest.mark.kit
def test_numpy_prefill_refuses_bad_input(kit, cpu_rt):
    from stratatools.runtime.gpu.decode import StaticDecoder

    dec = StaticDecoder(cpu_rt, max_ctx=11)
    dec.load_state(cpu_rt.new_state())
    with pytest.raises(StrataError, match="outside the vocabulary"):
        dec.prefill([1, cpu_rt.cfg.n_vocab])
    with pytest.raises(StrataError, match="past the static decoder"):
        dec.prefill(list(range(12)))
    with pytest.raises(StrataError, match="no tokens"):
        dec.prefill([])
    with pytest.raises(StrataError, match="expert path 'x'"):
        dec.prefill([1, 2], experts="x")
    assert dec.pos == 0


@pytest.mark.kit
def test_prefill_gemm_switch(kit, cpu_rt, monkeypatch):
    """STRATATOOLS_PREFILL_GEMM picks the GPU path's dense GEMMs (default mma; a bad value is a one-line error);
    a CPU decoder ignores it (a garbage value must not stop a CPU run: found by a new-user test of run --batch 2),
    while an explicit gemm path applies there too: with mma the rows expert path becomes the mma jobs (an explicit
    expert path stays); another option makes the decoder build a new prefiller."""
    from stratatools.runtime.gpu.decode import StaticDecoder
    from stratatools.runtime.gpu.prefill import ChunkPrefill
    from stratatools.runtime.gpu.qmm import prefill_gemm

    dec = StaticDecoder(cpu_rt, max_ctx=11)
    monkeypatch.delenv("STRATATOOLS_PREFILL_GEMM", raising=False)
    assert prefill_gemm() == "mma"  # the GPU path's default; the CPU decoder below stays on sgemm
    pf = dec.prefiller()
    assert (pf.gemm, pf.experts) == ("sgemm", "rows") and dec.prefiller() is pf
    for v in ("mma", "bf16"):
        monkeypatch.setenv("STRATATOOLS_PREFILL_GEMM", v)
        assert dec.prefiller() is pf and (ChunkPrefill(dec).gemm, ChunkPrefill(dec).experts) == ("sgemm", "rows")
    with pytest.raises(StrataError, match="STRATATOOLS_PREFILL_GEMM='bf16'"):
        prefill_gemm()
    monkeypatch.setenv("STRATATOOLS_PREFILL_GEMM", "MMA")
    assert prefill_gemm() == "mma"
    pf2 = dec.prefiller(experts="gemm")
    assert pf2 is not pf and pf2.experts == "gemm"
    assert (ChunkPrefill(dec, gemm="mma").gemm, ChunkPrefill(dec, gemm="mma").experts) == ("mma", "mma")
    assert ChunkPrefill(dec, experts="gemm", gemm="mma").experts == "gemm"
    assert ChunkPrefill(dec, gemm="sgemm").experts == "rows"
    assert (ChunkPrefill(dec, gemm="hgemm").gemm, ChunkPrefill(dec, gemm="hgemm").experts) == ("hgemm", "mma")
    monkeypatch.setenv("STRATATOOLS_PREFILL_GEMM", "hgemm")
    assert prefill_gemm() == "hgemm" and dec.prefiller(experts="gemm").gemm == "sgemm"  # the CPU decoder's own
    with pytest.raises(StrataError, match="GEMM path 'x'"):
        ChunkPrefill(dec, gemm="x")
    from stratatools.runtime.gpu.prefill import JOB_TOKENS, JOB_TOKENS_MMA_MAX, prefill_scratch_bytes

    # the dense share: one matrix as float32 twice (8 bytes a weight), which covers hgemm's fp16 pair (4)
    assert prefill_scratch_bytes(cpu_rt.cfg, 0, max_dense_values=1000) - prefill_scratch_bytes(cpu_rt.cfg, 0) == 8000
    cfg = cpu_rt.cfg  # the mma jobs' hidden rows (jobs up to 32 tokens) and their halves take more than the rows path's
    extra = prefill_scratch_bytes(cfg, 0, experts="mma") - prefill_scratch_bytes(cfg, 0, experts="rows")
    E, ff, k = max(cfg.n_expert), cfg.n_ff_exp, cfg.n_expert_used
    assert extra == (2 * (512 * k + JOB_TOKENS_MMA_MAX - 1 + E * JOB_TOKENS_MMA_MAX)
                     - (512 * k + E * (JOB_TOKENS - 1))) * ff * 4 \
        + 512 * cfg.n_embd * 4


def test_expert_jobs_cover_every_pair_once():
    """Jobs hold one expert and at most tt of its tokens, in expert then token order; every (token, rank) pair is in
    exactly one slot, with its token; the rest of the slots are empty."""
    from stratatools.runtime.gpu.prefill import expert_jobs

    rng = np.random.default_rng(3)
    T, k, E, tt = 29, 4, 9, 3
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    je, jt, jd = expert_jobs(ids, tt)
    assert jt.shape == jd.shape == (je.size * tt,)
    assert np.all(np.diff(je) >= 0)
    counts = np.bincount(ids.reshape(-1), minlength=E)
    assert np.array_equal(np.bincount(je, minlength=E), -(-counts // tt))
    filled = jd >= 0
    assert np.array_equal(filled, jt >= 0) and filled.sum() == T * k
    assert sorted(jd[filled].tolist()) == list(range(T * k))
    assert np.array_equal(jt[filled], jd[filled] // k)
    assert np.array_equal(ids.reshape(-1)[jd[filled]], np.repeat(je, tt)[filled])
    for j in range(je.size):  # full slots first, tokens increasing
        s = jt[j * tt:(j + 1) * tt]
        n = int((s >= 0).sum())
        assert np.all(s[:n] >= 0) and np.all(np.diff(s[:n]) > 0) and np.all(s[n:] < 0)


@pytest.mark.gpu
@pytest.mark.kit
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("model,max_ctx,n_prompt,chunk,slots,gemm", [
    ("gguf/model-bf16.gguf", 11, 9, 4, None, "sgemm"), ("gguf/model-bf16.gguf", 96, 70, 16, None, "sgemm"),
    ("gguf/model-bf16.gguf", 96, 70, 32, 6, "sgemm"), ("quant/model-ISTA-mix.gguf", 96, 70, 512, None, "sgemm"),
    ("quant/model-ISTA-mix.gguf", 96, 70, 512, None, "mma"), ("quant/model-Q2_0.gguf", 96, 70, 32, 6, "mma")])
def test_gpu_prefill_matches_steps(kit, model, max_ctx, n_prompt, chunk, slots, gemm, monkeypatch):
    """DecoderRuntime: the batched prefill against the token-by-token graph (same prompt, fresh runtimes; all resident,
    or an LRU tier of ``slots`` per layer whose other experts are read from mapped host memory; the dense GEMMs as
    SGEMMs or, ``STRATATOOLS_PREFILL_GEMM=mma``, on the tensor cores straight from the quantized matrices, with the
    routed experts' mma jobs): logits within 1e-3 relative, routed sets agreeing on >= 99.5% of (token, layer), caches
    close, the same greedy decode."""
    import cupy as cp

    monkeypatch.setenv("STRATATOOLS_PREFILL_GEMM", gemm)
    from stratatools.cachesim import make_tier
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    path = kit / model
    if not path.exists():
        pytest.skip(f"{model} not carried")
    toks = _prompt(kit, n_prompt)
    out = {}
    for mode in ("steps", "batched"):
        w = load(path, xp=cp)
        pol = None
        if slots is not None:
            L = w.cfg.n_layer
            bb = [w.experts.blob_bytes(il) for il in range(L)]
            pol = make_tier("lru", n_layers=L, n_expert=max(w.cfg.n_expert), slots=L * slots, blob_bytes=bb)
        grt = GPURuntime(w, policy=pol, miss_mode="host" if slots is not None else "copy")
        drt = DecoderRuntime(grt, max_ctx=max_ctx, prefill=mode, prefill_chunk=chunk)
        st = drt.new_state()
        lg, rec = drt.forward(toks, st)
        lg_prefill = _h(lg)
        assert st.pos == drt.dec.pos == n_prompt and rec.positions.tolist() == list(range(n_prompt))
        assert drt.dec.stats.get("prefill_tokens", 0) == (n_prompt if mode == "batched" else 0)
        states = {k: _h(v) for k, v in _states(drt.dec).items()}
        new = []
        for _ in range(max_ctx - n_prompt):
            t = int(np.argmax(_h(lg)))
            new.append(t)
            lg, _ = drt.forward([t], st)
        out[mode] = (lg, rec, states, new)
        out[mode + "_prefill"] = lg_prefill
        counts = grt.tier.counters.to_dict()
        out[mode + "_tier"] = counts
    lg_s, rec_s, st_s, new_s = out["steps"]
    lg_b, rec_b, st_b, new_b = out["batched"]
    same = sum(set(a.tolist()) == set(b.tolist()) for l in range(len(rec_s.ids))
               for a, b in zip(rec_s.ids[l], rec_b.ids[l]))
    total = sum(len(a) for a in rec_s.ids)
    pre = _rel(out["batched_prefill"], out["steps_prefill"])
    print(f"{model} ({gemm}): routed sets agree {same}/{total}; prompt logits rel {pre:.2e}; last decode logits rel "
          f"{_rel(lg_b, lg_s):.2e}")
    assert pre < 1e-3
    assert same / total >= 0.995
    for key in st_s:
        assert _rel(st_b[key], st_s[key]) < 1e-3, key
    assert new_b == new_s
    assert _rel(lg_b, lg_s) < 1e-3
    assert out["steps_tier"] == out["batched_tier"] or same < total  # same routing: the same tier accounting


@pytest.mark.gpu
@pytest.mark.kit
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("model", ["quant/model-ISTA-mix.gguf", "quant/model-Q2_0.gguf"])
def test_gpu_prefill_hgemm_matches_sgemm(kit, model, monkeypatch):
    """STRATATOOLS_PREFILL_GEMM=hgemm (the Q8_0 / Q2_0 dense matrices through fp16 hi/lo cuBLAS GEMMs; others
    dequantize + SGEMM) against sgemm on the same decoder and prompt, the routed experts on the same path for both
    (the mma jobs; ISTA-mix's expert types take the rows path): the last token's logits within 1e-5 relative and the
    same routed sets for every (token, layer); every fp16 check of the hgemm path passed (no fallback on these models)
    and its matrices were met. The mma path's distance is printed beside."""
    import cupy as cp

    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    path = kit / model
    if not path.exists():
        pytest.skip(f"{model} not carried")
    toks = _prompt(kit, 70)
    drt = DecoderRuntime(GPURuntime(load(path, xp=cp), policy=None, miss_mode="copy"), max_ctx=96,
                         prefill="batched", prefill_chunk=512)
    dec = drt.dec
    drt.prepare()  # the step's graph (its Q8_0 matrices re-laid out, as a real run has them)
    out = {}
    for gemm in ("sgemm", "hgemm", "mma"):
        monkeypatch.setenv("STRATATOOLS_PREFILL_GEMM", gemm)
        dec.load_state(drt.new_state())
        lg, ids, _ = dec.prefill(toks, chunk=512, experts="mma")
        assert dec.prefiller(512, experts="mma").gemm == gemm
        out[gemm] = (_h(lg), np.sort(ids, axis=-1))
    fits = getattr(dec, "_hgemm_fits_by_name", {})
    rel_h, rel_m = _rel(out["hgemm"][0], out["sgemm"][0]), _rel(out["mma"][0], out["sgemm"][0])
    same = float(np.mean(np.all(out["hgemm"][1] == out["sgemm"][1], axis=-1)))
    print(f"{model}: hgemm vs sgemm logits rel {rel_h:.2e} (mma {rel_m:.2e}); routed sets agree {same:.4f}; "
          f"{len(fits)} matrices through hgemm")
    assert len(fits) >= 5 * dec.cfg.n_layer and all(fits.values())
    assert same == 1.0
    assert rel_h <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("chunk,big", [(128, None), (64, "0")])
def test_gpu_prefill_graph_equals_eager_chunks(chunk, big, tmp_path, monkeypatch):
    """STRATATOOLS_PREFILL_GRAPH: full chunks replay one CUDA graph (captured after the first full chunk ran eagerly;
    the positions read on the device, so later chunks at other positions and a second prompt replay it), the last
    partial chunk runs eagerly; against every chunk eager (``STRATATOOLS_PREFILL_GRAPH=0``) on the same decoder of a
    4-layer full-width synthetic (Q2_0 experts, Q8_0 dense matrices; its QSA keeps every position up to max_ctx, which
    the kit's small models do not: they refuse the graph): the last logits within 1e-5 relative, the same routed sets
    for >= 99.5% of (token, layer), caches within 1e-4; the stats count one capture and the replays. Chunks of 128:
    the matrices of 2M weights and more through cuBLAS inside the graph (its default), the tensor-core kernel eagerly;
    ``STRATATOOLS_PREFILL_BIG=0``: the tensor-core kernel in both."""
    import cupy as cp

    from stratatools.cli import run_captured
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    out_, err_ = io.StringIO(), io.StringIO()
    assert run_captured(["synth", str(tmp_path / "rel"), "--full-width", "--layers", "4", "--experts", "8",
                         "--no-revisions", "--types", "gu=Q2_0,down=Q2_0", "--json"], out_, err_) == 0, err_.getvalue()
    path = sorted((tmp_path / "rel").glob("*.gguf"))[0]
    monkeypatch.setenv("STRATATOOLS_PREFILL_GEMM", "mma")
    if big is not None:
        monkeypatch.setenv("STRATATOOLS_PREFILL_BIG", big)
    w = load(path, xp=cp)
    toks = np.random.default_rng(chunk).integers(0, w.cfg.n_vocab, 300).tolist()
    drt = DecoderRuntime(GPURuntime(w, policy=None, miss_mode="copy"), max_ctx=320, prefill="batched",
                         prefill_chunk=chunk)
    dec = drt.dec
    drt.prepare()
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("STRATATOOLS_PREFILL_GRAPH", mode)
        runs = []
        for _ in range(2):
            dec.load_state(drt.new_state())
            lg, ids, _w = dec.prefill(toks, chunk=chunk, experts="mma")
            runs.append((_h(lg), np.sort(ids, axis=-1), {k: _h(v) for k, v in _states(dec).items()}))
        out[mode] = runs
    st = dec.stats
    full = len(toks) // chunk
    print(f"chunk {chunk}: {st.get('prefill_graph_captures')} capture(s), {st.get('prefill_graph_replays')} "
          f"replays, error {st.get('prefill_graph_error')}")
    assert st.get("prefill_graph_error") is None
    assert st.get("prefill_graph_captures") == 1 and st.get("prefill_graph_replays", 0) == 2 * full - 1
    for (lg_e, ids_e, s_e), (lg_g, ids_g, s_g) in zip(out["0"], out["1"]):
        assert _rel(lg_g, lg_e) <= 1e-5
        assert float(np.mean(np.all(ids_g == ids_e, axis=-1))) >= 0.995
        for key in s_e:
            assert _rel(s_g[key], s_e[key]) <= 1e-4, key


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("gating,norm,E,k", [("sigmoid", True, 256, 10), ("softmax", True, 128, 8),
                                             ("softmax", False, 250, 10), ("sigmoid", False, 7, 7),
                                             ("softmax", True, 256, 40), ("sigmoid", True, 64, 32)])
def test_gpu_route_warp_matches_pf_route(gating, norm, E, k):
    """pf_route_warp (a warp a token, 4 a block: the launcher's shape) = pf_route on the device: the same experts in
    the same order (ties to the lower index: repeated logits), weights within 1e-6; k up to 32 (each lane keeps a
    round's pick) and past it (lane 0 writes each round's)."""
    import cupy as cp

    from stratatools.runtime.gpu import prefill as PF

    rng = np.random.default_rng(E + k)
    T = 77
    lg = rng.standard_normal((T, E)).astype(np.float32)
    lg[:, 3] = lg[:, 1]
    lg[5, :] = 0.25
    mod = PF._module(False, ())
    got = []
    for name in ("pf_route", "pf_route_warp"):
        ids = cp.full((T, k), -1, dtype=cp.int32)
        w = cp.zeros((T, k), dtype=cp.float32)
        args = (cp.asarray(lg), np.int32(T), np.int32(E), np.int32(E), np.int32(k), np.int32(gating == "sigmoid"),
                np.int32(norm), np.float32(1.5), ids, w)
        if name == "pf_route":
            mod.get_function(name)((T,), (PF.ROUTE_THREADS,), args, shared_mem=(E + 2 * PF.ROUTE_THREADS) * 4)
        else:
            mod.get_function(name)((-(-T // (PF.ROUTE_THREADS // 32)),), (PF.ROUTE_THREADS,), args)
        got.append((cp.asnumpy(ids), cp.asnumpy(w)))
    assert np.array_equal(got[0][0], got[1][0])
    assert np.allclose(got[0][1], got[1][1], rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")
@pytest.mark.parametrize("T,nk,dk,nv,dv", [(64, 16, 128, 32, 128), (9, 2, 32, 4, 24), (5, 1, 100, 2, 10),
                                           (37, 2, 16, 4, 12), (1, 64, 128, 64, 128), (2, 3, 100, 6, 200),
                                           (1, 2, 16, 4, 8), (3, 2, 128, 4, 100)])
def test_gpu_gdn_warp_and_chunk_kernels_match_the_recurrence(T, nk, dk, nv, dv):
    """pf_gdn_warp (a warp per 4 value columns, lanes over the key rows, shuffle sums: the prefill's default) and
    pf_gdn_chunk on the device, and pf_gdn_step_rw (the state's rows over warps: the batched step's) with its
    launcher's grid, the full-width shapes included (the batched step's one token of 32 places x 32 heads as 64 heads
    here): outputs and final states within 1e-5 of the float64 delta rule (the host build checks the kernels with
    one-lane warps)."""
    import cupy as cp

    from stratatools.runtime.gpu import prefill as PF
    from stratatools.runtime.model import _l2norm, _sigmoid

    rng = np.random.default_rng(T + dk)
    q = _l2norm(np, rng.standard_normal((T, nk, dk)).astype(np.float32)) * np.float32(dk ** -0.5)
    kk = _l2norm(np, rng.standard_normal((T, nk, dk)).astype(np.float32))
    v = rng.standard_normal((T, nv * dv)).astype(np.float32)
    beta = _sigmoid(np, rng.standard_normal((T, nv)).astype(np.float32))
    decay = np.exp(-rng.uniform(0, 2, (T, nv))).astype(np.float32)
    S0 = (rng.standard_normal((nv, dk, dv)) * 0.1).astype(np.float32)
    from hostlib import gdn_reference

    ref, St = gdn_reference(q, kk, v.reshape(T, nv, dv), beta, decay, S0)
    mod = PF._module(False, ())
    args = [cp.asarray(a) for a in (q, kk, v)]
    for name in ("pf_gdn_warp", "pf_gdn_chunk", "pf_gdn_step_rw", "pf_gdn_step_rwc"):
        S = cp.asarray(S0)
        out = cp.full((T, nv * dv), cp.nan, dtype=cp.float32)
        common = (args[0], args[1], args[2], np.int32(nv * dv), cp.asarray(beta), cp.asarray(decay), S, out,
                  np.int32(T), np.int32(nk), np.int32(nv), np.int32(dk), np.int32(dv))
        if name.startswith("pf_gdn_step_rw"):
            gy, th = PF.gdn_step_rw_launch(dk, dv)
            mod.get_function(name)((gy, nv) if name.endswith("c") else (nv, gy), (th,),
                                   common + (np.int32(0), np.int32(0)))
        elif name != "pf_gdn_chunk":
            per = PF.GDN_WARP_COLUMNS * PF.GDN_WARP_WARPS
            mod.get_function(name)((nv, -(-dv // per)), (32 * PF.GDN_WARP_WARPS,), common)
        else:
            ncb = max(1, min(dv, -(-128 // nv)))
            cw = -(-dv // ncb)
            threads = 256 if cw >= 32 else 128
            rs = max(1, threads // cw)
            mod.get_function(name)((nv, ncb), (threads,), common, shared_mem=PF.gdn_chunk_shared(dk, cw, rs))
        o = cp.asnumpy(out).reshape(T, nv, dv)
        assert np.abs(o - ref).max() <= 1e-5 * np.abs(ref).max(), name
        assert np.abs(cp.asnumpy(S) - St).max() <= 1e-5 * np.abs(St).max(), name
