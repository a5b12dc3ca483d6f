"""The batched-prefill kernels (stratatools/runtime/gpu/prefill.cu) checked on the CPU: the CUDA source compiled as host
C++ (host_kernel_shim.cuh runs each block as one thread) against numpy: the T-token router against the CPU path's
stable sort, the chunked gated-DeltaNet recurrence against T sequential delta-rule steps, the pointer-table expert
dequantizer against stratatools.runtime.dequant. Skips without a C++ compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from stratatools.core.errors import StrataError
from stratatools.runtime.gpu import kernels as K
from stratatools.runtime.gpu import prefill as PF
from stratatools.runtime.model import _l2norm, _sigmoid, _softmax

from hostlib import gdn_reference, shared_within

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the host copy of the prefill kernels")
TYPES = ("Q2_0", "Q8_0", "Q4_0", "BF16", "F32")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    from stratatools.model.ggml_types import type_by_name

    d = tmp_path_factory.mktemp("prefillhost")
    tids = tuple(sorted({type_by_name(t).id for t in TYPES}))
    (d / "pf.cpp").write_text(PF.host_source(tids))
    so = d / "pf.so"
    r = subprocess.run([CXX, "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(so), str(d / "pf.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    h = ctypes.CDLL(str(so))
    ctype = {"int": ctypes.c_int, "float": ctypes.c_float}
    for name, params in K.kernel_signatures("prefill.cu").items():
        f = getattr(h, f"host_{name}")
        f.argtypes = [ctypes.c_uint, ctypes.c_uint] + [ctypes.c_void_p if "*" in t else ctype[t] for t, _ in params]
    P, I, U, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_longlong
    for tid in tids:
        getattr(h, f"host_pf_moe_gu_{tid}").argtypes = [U, U, P, P, P, P, I, I]
        getattr(h, f"host_pf_moe_down_{tid}").argtypes = [U, U, P, LL, P, P, P, I, I]
        getattr(h, f"host_pf_dequant_blobs_{tid}").argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                                                                ctypes.c_longlong, ctypes.c_longlong, ctypes.c_void_p]
    return h


def _p(a):
    return a.ctypes.data


def test_prefill_kernel_signatures():
    sig = K.kernel_signatures("prefill.cu")
    assert set(sig) == {"pf_route", "pf_gdn_chunk", "pf_moe_sum", "pf_gdn_warp", "pf_gdn_step_rw", "pf_route_warp",
                        "pf_moe_sum_shared", "pf_gdn_step_rwc", "pf_gdn_step_rwce", "pf_gdn_step_rwcs"}
    assert ("int", "ldv") in sig["pf_gdn_chunk"] and sig["pf_route"][-1][1] == "w"


@pytest.mark.parametrize("gating,norm,E,k", [("softmax", True, 32, 4), ("sigmoid", False, 256, 10),
                                             ("softmax", False, 250, 10), ("sigmoid", True, 7, 7),
                                             ("softmax", True, 50, 1), ("sigmoid", True, 256, 1)])
@pytest.mark.parametrize("kernel", ["pf_route", "pf_route_warp"])
def test_pf_route_matches_stable_sort(lib, gating, norm, E, k, kernel):
    """Ids = the first k of a stable descending sort of the probabilities (ties to the lower index: some logits are
    repeated), weights = chosen probabilities (normalised), times the scale; the rows past E (ld > E) are ignored.
    pf_route (a block a token, grid stride) and pf_route_warp (a warp a token; the host's one-thread warp: with k 1
    its lane keeps the pick as the device's lanes keep theirs for k <= 32)."""
    rng = np.random.default_rng(E)
    T, ld = 7, E + 1
    lg = rng.standard_normal((T, ld)).astype(np.float32)
    lg[:, 5] = lg[:, 3]  # ties
    lg[2, :E] = 0.5  # all tied
    ids = np.full((T, k), -1, np.int32)
    w = np.zeros((T, k), np.float32)
    grid = 3 if kernel == "pf_route" else T
    getattr(lib, f"host_{kernel}")(grid, 1, _p(lg), T, ld, E, k, int(gating == "sigmoid"), int(norm), 1.5, _p(ids),
                                   _p(w))
    pr = _sigmoid(np, lg[:, :E]) if gating == "sigmoid" else _softmax(np, lg[:, :E], axis=-1)
    ref = np.argsort(-pr, axis=-1, kind="stable")[:, :k]
    assert np.array_equal(ids, ref)
    rw = np.take_along_axis(pr, ref, axis=-1)
    if norm:
        rw = rw / rw.sum(axis=-1, keepdims=True)
    assert np.allclose(w, rw * 1.5, rtol=1e-5)


@pytest.mark.parametrize("T,nk,dk,nv,dv,ncb", [(5, 2, 8, 4, 8, 3), (9, 2, 32, 4, 24, 1), (3, 1, 16, 3, 10, 4),
                                                (9, 2, 32, 4, 24, 24), (6, 2, 128, 4, 9, 0),
                                                (37, 2, 16, 4, 12, 0)])
@pytest.mark.parametrize("kernel", ["pf_gdn_chunk", "pf_gdn_warp", "pf_gdn_step_rw", "pf_gdn_step_rwc",
                                    "pf_gdn_step_rwce", "pf_gdn_step_rwcs"])
def test_pf_gdn_chunk_matches_sequential_steps(lib, T, nk, dk, nv, dv, ncb, kernel):
    """pf_gdn_chunk over T tokens (columns split over ncb blocks, uneven split included; v read with a row stride)
    = T delta-rule steps of the decoder's numpy _gdn; the state is written back. pf_gdn_warp likewise (the host's
    one-lane warps take 4 columns each: the last warp of a head fewer where dv is not a multiple of 4), and
    pf_gdn_step_rw (a thread per column: the batched step's kernel, used there for one token) and pf_gdn_step_rwc
    (its grid's axes swapped; rwce / rwcs: its state loaded before the wait, rwcs evicting first)."""
    rng = np.random.default_rng(T * dv)
    q = _l2norm(np, rng.standard_normal((T, nk, dk)).astype(np.float32)) * np.float32(dk ** -0.5)
    kk = _l2norm(np, rng.standard_normal((T, nk, dk)).astype(np.float32))
    ldv = nv * dv + 7
    vbuf = rng.standard_normal((T, ldv)).astype(np.float32)
    v = vbuf[:, 3:3 + nv * dv].reshape(T, nv, dv)
    beta = _sigmoid(np, rng.standard_normal((T, nv)).astype(np.float32))
    decay = np.exp(-rng.uniform(0, 2, (T, nv))).astype(np.float32)
    S0 = (rng.standard_normal((nv, dk, dv)) * 0.1).astype(np.float32)
    ref, St = gdn_reference(q, kk, v, beta, decay, S0)
    S = S0.copy()
    out = np.full((T, nv * dv), np.nan, np.float32)
    if kernel.startswith("pf_gdn_step_rw"):  # (the host's blocks of one thread: a block a column)
        grid = (nv, dv) if kernel == "pf_gdn_step_rw" else (dv, nv)
        with shared_within(lib, 0):
            getattr(lib, f"host_{kernel}")(*grid, _p(q), _p(kk), vbuf.ctypes.data + 3 * 4, ldv, _p(beta), _p(decay),
                                           _p(S), _p(out), T, nk, nv, dk, dv, 0, 0)
    elif kernel == "pf_gdn_warp":
        with shared_within(lib, 0):  # no shared memory
            lib.host_pf_gdn_warp(nv, -(-dv // PF.GDN_WARP_COLUMNS), _p(q), _p(kk), vbuf.ctypes.data + 3 * 4, ldv,
                                 _p(beta), _p(decay), _p(S), _p(out), T, nk, nv, dk, dv)
    else:
        ncb = ncb or 2
        cw = -(-dv // ncb)
        with shared_within(lib, PF.gdn_chunk_shared(dk, cw, 1)):  # the host block is one thread: one row slice
            lib.host_pf_gdn_chunk(nv, ncb, _p(q), _p(kk), vbuf.ctypes.data + 3 * 4, ldv, _p(beta), _p(decay), _p(S),
                                  _p(out), T, nk, nv, dk, dv)
    assert np.abs(out.reshape(T, nv, dv) - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(S - St).max() <= 1e-5 * np.abs(St).max()


@pytest.mark.parametrize("T,k,n,grid", [(5, 3, 7, 1), (9, 10, 40, 3), (1, 1, 1, 1)])
def test_pf_moe_sum_weights_in_rank_order(lib, T, k, n, grid):
    """pf_moe_sum = the k routed rows of each token times its weights, summed in rank order in float32 with every
    product rounded first (the same bits as that loop in numpy), for any grid (grid stride)."""
    rng = np.random.default_rng(T * k + n)
    ya = rng.standard_normal((T * k, n)).astype(np.float32)
    w = rng.uniform(0, 1, (T, k)).astype(np.float32)
    y = np.full((T, n), np.nan, np.float32)
    lib.host_pf_moe_sum(grid, 1, _p(ya), _p(w), T, k, n, _p(y))
    want = np.zeros((T, n), np.float32)
    for r in range(k):
        want = want + w[:, r:r + 1] * ya.reshape(T, k, n)[:, r]
    assert np.array_equal(y, want)


@pytest.mark.parametrize("T,k,n,grid,ldg,goff", [(5, 3, 7, 1, 1, 0), (9, 10, 40, 3, 257, 256), (1, 1, 1, 1, 4, 2)])
def test_pf_moe_sum_shared_adds_the_gated_shared_expert(lib, T, k, n, grid, ldg, goff):
    """pf_moe_sum_shared = pf_moe_sum's rows + sigmoid(g[t, goff]) ys[t] (g read with its row stride: the router's
    logits with the gate's column after the experts'), as the array code's separate launches: the rank-order sum,
    then y + sigmoid(g) * ys (within the ulp of numpy's exp against the C library's expf)."""
    rng = np.random.default_rng(T * k + n + ldg)
    ya = rng.standard_normal((T * k, n)).astype(np.float32)
    w = rng.uniform(0, 1, (T, k)).astype(np.float32)
    ys = rng.standard_normal((T, n)).astype(np.float32)
    g = (3.0 * rng.standard_normal((T, ldg))).astype(np.float32)
    y0 = np.full((T, n), np.nan, np.float32)
    y = np.full((T, n), np.nan, np.float32)
    lib.host_pf_moe_sum(grid, 1, _p(ya), _p(w), T, k, n, _p(y0))
    lib.host_pf_moe_sum_shared(grid, 1, _p(ya), _p(w), T, k, n, _p(ys), _p(g), ldg, goff, _p(y))
    sg = (np.float32(1.0) / (np.float32(1.0) + np.exp(-g[:, goff:goff + 1]))).astype(np.float32)
    want = y0 + sg * ys
    assert np.abs(y - want).max() <= 4e-7 * np.abs(ys).max(), np.abs(y - want).max()


@pytest.mark.parametrize("tname", TYPES)
def test_pf_dequant_blobs_matches_numpy(lib, tname):
    """Three blobs at scattered addresses, a byte offset into each: every blob's values = dequantize of its bytes."""
    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.dequant import dequantize

    from test_dequant import random_blocks

    t = type_by_name(tname)
    nblk, off = (40 if tname in ("F32", "BF16") else 5), 24  # whole groups of 8 values
    raw = [random_blocks(tname, nblk, seed=s).reshape(-1) for s in range(3)]
    nb = raw[0].size
    arena = np.zeros(3 * (nb + off + 40), np.uint8)
    starts = [5, nb + off + 17, 2 * (nb + off) + 33]
    for s, r in zip(starts, raw):
        arena[s + off:s + off + nb] = r
    ptrs = np.array([arena.ctypes.data + s for s in starts], dtype=np.uint64)
    n_vals = int(dequantize(raw[0], t).size)
    dst = np.full((3, n_vals), np.nan, np.float32)
    getattr(lib, f"host_pf_dequant_blobs_{t.id}")(2, 3, _p(ptrs), off, n_vals // 8, _p(dst))
    for b in range(3):
        ref = np.asarray(dequantize(raw[b], t), dtype=np.float32)
        assert np.array_equal(np.isnan(dst[b]), np.isnan(ref))
        ok = ~np.isnan(ref)
        assert np.array_equal(dst[b][ok], ref[ok]), tname


@pytest.mark.parametrize("gu,dn,hidden,ff", [("Q2_0", "Q2_0", 512, 128), ("Q8_0", "Q4_0", 256, 96),
                                             ("Q8_0", "F32", 64, 32)])
def test_pf_moe_kernels_match_reference(lib, gu, dn, hidden, ff):
    """pf_moe_gu + pf_moe_down over jobs of up to PF_TT tokens (a full job, a partial one, one expert in two jobs, blobs
    at scattered addresses) = expert_ffn_reference per (token, expert) pair without the router weight; empty slots
    write nothing."""
    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.gpu.experts import expert_ffn_reference
    from stratatools.runtime.gpu.prefill import JOB_TOKENS, expert_jobs

    from test_dequant import random_blocks

    tg, td = type_by_name(gu), type_by_name(dn)
    gb = ff * tg.row_bytes(hidden)
    db = hidden * td.row_bytes(ff)
    per_blk = lambda t, nbytes: nbytes // t.type_size  # noqa: E731
    E, T, k = 3, 11, 2
    blobs = [np.concatenate([random_blocks(gu, per_blk(tg, 2 * gb), seed=5 * e + 1).reshape(-1),
                             random_blocks(dn, per_blk(td, db), seed=5 * e + 2).reshape(-1)]) for e in range(E)]
    size = 2 * gb + db
    arena = np.zeros(E * (size + 64), np.uint8)
    starts = [e * (size + 64) + 8 * e for e in range(E)]
    for s0, b in zip(starts, blobs):
        arena[s0:s0 + size] = b
    rng = np.random.default_rng(hidden)
    ids = np.array([[0, 1] if t < 9 else [2, 0] for t in range(T)], dtype=np.int32)  # expert 0: 11 tokens, 2 jobs
    X = (rng.standard_normal((T, hidden)) * 0.5).astype(np.float32)
    je, jt, jd = expert_jobs(ids, JOB_TOKENS)
    ptr = np.array([arena.ctypes.data + starts[e] for e in je], dtype=np.uint64)
    J = je.size
    hbuf = np.full((J * JOB_TOKENS, ff), np.nan, np.float32)
    out = np.full((T * k + 1, hidden), 7.0, np.float32)
    getattr(lib, f"host_pf_moe_gu_{tg.id}")(2, J, _p(ptr), _p(jt), _p(X), _p(hbuf), hidden, ff)
    getattr(lib, f"host_pf_moe_down_{td.id}")(3, J, _p(ptr), 2 * gb, _p(jd), _p(hbuf), _p(out), hidden, ff)
    for t in range(T):
        for r in range(k):
            ref = expert_ffn_reference(X[t], [blobs[ids[t, r]]], np.ones(1), tg, td, hidden, ff)
            got = out[t * k + r]
            assert np.abs(got - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1e-6), (t, r)
    assert np.all(out[T * k] == 7.0)


def test_gdn_kernel_from_the_environment(monkeypatch):
    """STRATATOOLS_GDN_WARP names the prefill's recurrence kernel: 1 (default, also empty) the warp kernel, 0 the block
    kernel; another value is refused, naming the variable."""
    monkeypatch.delenv(PF.GDN_WARP_ENV, raising=False)
    assert PF.gdn_kernel() == "warp"
    for v, want in (("0", "chunk"), ("1", "warp"), (" 0 ", "chunk"), ("", "warp")):
        monkeypatch.setenv(PF.GDN_WARP_ENV, v)
        assert PF.gdn_kernel() == want
    monkeypatch.setenv(PF.GDN_WARP_ENV, "2")
    with pytest.raises(StrataError, match=PF.GDN_WARP_ENV):
        PF.gdn_kernel()


def test_gdn_step_early_switch(monkeypatch):
    """STRATATOOLS_GDN_STEP_EARLY: 1 by default (the state loaded before the wait), cs and 0 taken, another value
    refused naming the variable."""
    monkeypatch.delenv(PF.GDN_STEP_EARLY_ENV, raising=False)
    assert PF.gdn_step_early() == "1"
    for v in ("0", "1", "cs", " cs "):
        monkeypatch.setenv(PF.GDN_STEP_EARLY_ENV, v)
        assert PF.gdn_step_early() == v.strip()
    monkeypatch.setenv(PF.GDN_STEP_EARLY_ENV, "early")
    with pytest.raises(StrataError, match=PF.GDN_STEP_EARLY_ENV):
        PF.gdn_step_early()


def test_gdn_step_cols_switch(monkeypatch):
    """STRATATOOLS_GDN_STEP_COLS: on by default (pf_gdn_step_rwc, a head's column parts together), 0 off (the heads
    first), another value refused naming the variable."""
    monkeypatch.delenv(PF.GDN_STEP_COLS_ENV, raising=False)
    assert PF.gdn_step_cols() is True
    monkeypatch.setenv(PF.GDN_STEP_COLS_ENV, "0")
    assert PF.gdn_step_cols() is False
    monkeypatch.setenv(PF.GDN_STEP_COLS_ENV, "1")
    assert PF.gdn_step_cols() is True
    monkeypatch.setenv(PF.GDN_STEP_COLS_ENV, "cols")
    with pytest.raises(StrataError, match=PF.GDN_STEP_COLS_ENV):
        PF.gdn_step_cols()


def test_pf_gdn_step_rw_reads_each_places_key_heads(lib):
    """pf_gdn_step_rw with places folded into the heads (hpp value heads and kpp key heads a place: value head h of a
    place reads its key head h mod kpp) gives the bits of the same launch over q and k repeated to every value head
    (the batched step's copies before)."""
    rng = np.random.default_rng(4)
    P, nk, nv, dk, dv = 3, 2, 6, 8, 5
    q = _l2norm(np, rng.standard_normal((P, nk, dk)).astype(np.float32)) * np.float32(dk ** -0.5)
    kk = _l2norm(np, rng.standard_normal((P, nk, dk)).astype(np.float32))
    v = rng.standard_normal((P, nv * dv)).astype(np.float32)
    beta = _sigmoid(np, rng.standard_normal((P, nv)).astype(np.float32))
    decay = np.exp(-rng.uniform(0, 2, (P, nv))).astype(np.float32)
    S0 = (rng.standard_normal((P * nv, dk, dv)) * 0.1).astype(np.float32)
    H = P * nv
    got = []
    for qq, kx, nkk, hpp, kpp, cols in ((np.tile(q, (1, nv // nk, 1)), np.tile(kk, (1, nv // nk, 1)), H, 0, 0, ""),
                                        (q, kk, P * nk, nv, nk, ""), (q, kk, P * nk, nv, nk, "c"),
                                        (q, kk, P * nk, nv, nk, "ce"), (q, kk, P * nk, nv, nk, "cs")):
        S, out = S0.copy(), np.full((P, nv * dv), np.nan, np.float32)
        fn, grid = (getattr(lib, f"host_pf_gdn_step_rw{cols}"), (dv, H)) if cols else (lib.host_pf_gdn_step_rw,
                                                                                      (H, dv))
        with shared_within(lib, 0):
            fn(*grid, _p(np.ascontiguousarray(qq)), _p(np.ascontiguousarray(kx)), _p(v), H * dv,
               _p(beta), _p(decay), _p(S), _p(out), 1, nkk, H, dk, dv, hpp, kpp)
        got.append((S, out))
    for g in got[1:]:  # (and pf_gdn_step_rwc, its grid's axes swapped, and rwce / rwcs: the same bits)
        assert np.array_equal(got[0][0], g[0]) and np.array_equal(got[0][1], g[1])
    assert not np.isnan(got[2][1]).any() and not np.array_equal(got[2][0], S0)


def test_row_stride_takes_rows_of_consecutive_floats_only():
    """prefill.row_stride: a contiguous float32 array's row length, a column slice's parent row length (the joined
    products' views), one row's own length; a transposed, float64, 1-D or element-strided array refused by name."""
    a = np.zeros((4, 10), np.float32)
    assert PF.row_stride(a) == 10 and PF.row_stride(a[:, 3:7]) == 10 and PF.row_stride(a[:1, 2:5]) == 3
    for bad in (a.T, a.astype(np.float64), a[0], a[:, ::2]):
        with pytest.raises(StrataError, match="not float32 rows of consecutive values"):
            PF.row_stride(bad)


def test_same_memory_and_held_matrices():
    """prefill._same_memory: device arrays (anything with .data.ptr) of one pointer, shape and strides, never host
    arrays; ChunkPrefill._held: a matrix the decoder keeps in its own buffer or a stacked group, not one it lacks or
    keeps as None."""
    from types import SimpleNamespace as NS

    def dev(ptr, shape=(2, 3), strides=(12, 4)):
        return NS(data=NS(ptr=ptr), shape=shape, strides=strides)

    assert PF._same_memory(dev(64), dev(64)) and not PF._same_memory(dev(64), dev(128))
    assert not PF._same_memory(dev(64), dev(64, (3, 2), (8, 4)))
    h = np.zeros(3, np.float32)
    assert not PF._same_memory(h, h)
    fake = NS(dec=NS(_raw={"a.weight": ("buf", 3), "gone.weight": (None, 0)},
                     _raw_groups={("b.weight", "c.weight"): ("buf", [1, 2])}))
    held = [PF.ChunkPrefill._held(fake, n) for n in ("a.weight", "c.weight", "gone.weight", "d.weight")]
    assert held == [True, True, False, False]


def test_shared_q8r_copies_on_the_host(kit, monkeypatch):
    """ChunkPrefill._shared_q8r with numpy standing for CuPy, on the kit's ISTA mix (Q8_0 shared experts): every
    layer whose three shared matrices are Q8_0 gets copies (gate and up as one [2 ff, hidden] matrix, then down)
    holding q8_relayout's codes and scales of its GGUF blocks; made once (kept on the runtime); None past 32 rows,
    on another GEMM path, and with STRATATOOLS_Q8R_SHARED=0."""
    from types import SimpleNamespace

    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.kernels import q8_relayout
    from stratatools.runtime.gpu.prefill import ChunkPrefill
    from stratatools.runtime.weights import load

    path = kit / "quant/model-ISTA-mix.gguf"
    if not path.exists():
        pytest.skip("the kit's ISTA mix is absent")
    monkeypatch.delenv(qmm.Q8R_SHARED_ENV, raising=False)
    monkeypatch.delenv(qmm.DENSE_I8_ENV, raising=False)
    w = load(path)
    try:
        m = w.model
        fake = SimpleNamespace(gemm="mma", rt=SimpleNamespace(), cp=np, w=w, cfg=w.cfg,
                               _no_upload_in_capture=lambda what: None)
        got = ChunkPrefill._shared_q8r(fake, 0, 32)
        assert got is not None
        q8 = [j for j in range(w.cfg.n_layer)
              if all(m.tensor(f"blk.{j}.ffn_{r}_shexp.weight").type.name == "Q8_0" for r in ("gate", "up", "down"))]
        assert q8 and sorted(fake.rt._shared_q8r) == q8
        j = q8[-1]
        ts = [m.tensor(f"blk.{j}.ffn_{r}_shexp.weight") for r in ("gate", "up", "down")]
        hidden, ff = int(ts[0].ne[0]), int(ts[0].ne[1])
        gu, dn = fake.rt._shared_q8r[j]
        q, d = q8_relayout(np.concatenate([np.asarray(m.raw(t)).reshape(-1) for t in ts[:2]]), 2 * ff, hidden)
        assert np.array_equal(gu.q, q) and np.array_equal(gu.d, d)
        q, d = q8_relayout(np.asarray(m.raw(ts[2])), hidden, ff)
        assert np.array_equal(dn.q, q) and np.array_equal(dn.d, d)
        assert ChunkPrefill._shared_q8r(fake, j, 1) is fake.rt._shared_q8r[j]  # (made once)
        assert ChunkPrefill._shared_q8r(fake, j, 33) is None
        assert ChunkPrefill._shared_q8r(SimpleNamespace(**{**vars(fake), "gemm": "hgemm"}), j, 8) is None
        monkeypatch.setenv(qmm.Q8R_SHARED_ENV, "0")
        assert ChunkPrefill._shared_q8r(fake, j, 8) is None
    finally:
        w.close()
