"""The tensor-core quantized GEMMs (stratatools/runtime/gpu/mma.cuh, qmm.cu) checked on the CPU: the CUDA source
compiled as host C++ (host_kernel_shim.cuh runs a block as one thread, which plays the 32 lanes of the mma fragments
in turn) against numpy: the fragment wrapper on one 16x16 by 16x8 product, the float -> half rounding against numpy's,
the hi/lo activation split, the dense GEMM (Q8R, GGUF Q8_0 and Q2_0; token counts that do not fill a tile, rows that
do not fill a warp's 16, K not a multiple of the staged chunk) and the routed-expert jobs, against float64 references
on the reference dequantizer's values; the hgemm path's weight split (Wh + Wl = W exactly, the fp16 overflow flag),
its numerics emulated in numpy and its launcher and fallbacks with a numpy stand-in for cuBLAS. Skips without a C++
compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import types

import numpy as np
import pytest

from stratatools.core.errors import StrataError
from stratatools.runtime.dequant import dequantize
from stratatools.runtime.gpu import kernels as K
from stratatools.runtime.gpu import qmm as Q
from stratatools.runtime.gpu.prefill import expert_jobs

from hostlib import i8_bound, shared_within

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the host copy of the qmm kernels")
P, I, U, LL, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_longlong, ctypes.c_float


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return _host_lib(tmp_path_factory, Q.KC)


@pytest.fixture(scope="module")
def lib256(tmp_path_factory):
    """The host build with the chunk of the device's Q2_0 expert jobs (QMM_KC 256: MOE_KC_DEFAULT)."""
    return _host_lib(tmp_path_factory, 256)


def _host_lib(tmp_path_factory, kc: int):
    d = tmp_path_factory.mktemp("qmmhost")
    (d / "qmm.cpp").write_text(("" if kc == Q.KC else f"#define QMM_KC {kc}\n") + Q.host_source())
    so = d / "qmm.so"
    r = subprocess.run([CXX, "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(so), str(d / "qmm.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    h = ctypes.CDLL(str(so))
    h.host_qmm_split.argtypes = [U, U, P, LL, I, I, P, P, P]
    h.host_qmm_sum_slices.argtypes = [U, U, P, P, LL, I]
    for a in (1, 2):
        getattr(h, f"host_qmm_sum_act_{a}").argtypes = [U, U, P, P, LL, I, F]
    h.host_qmm_act_rows.argtypes = [U, U, P, LL, I, F]
    h.host_qmm_f32_nt.argtypes = [U, U, P, P, P, I, I, I]
    h.host_qmm_jobs.argtypes = [U, U, P, I, I, I, P, I, I, P, P, P]
    for f in sorted(set(Q.LAYOUTS.values())):
        for nt in Q.TILES:
            getattr(h, f"host_qmm_dense_{f}_{nt}").argtypes = [U, U, P, P, LL, P, P, P, P, LL, I, I, I, I, P, P]
        getattr(h, f"host_qmm_dense_{f}_{Q.DENSE2_NT}_2").argtypes = [U, U, P, P, LL, P, P, P, P, LL, I, I, I, I, P, P]
    rings = [f"{nt}_{st}_{rkc}_{kg}_{i8}" for i8, cfgs in ((0, Q.RING_HOST), (1, Q.DENSE_I8_HOST))
             for nt, st, rkc, kg in cfgs] + ["_".join(map(str, r)) + f"_{wg}" for wg in (8, 2)
                                               for r in Q.RING_WG_HOST]
    for r in rings:
        getattr(h, f"host_qmm_dense_ring_{r}").argtypes = [U, U, P, P, LL, P, P, P, P, LL, I, I, I, I, P, P]
    for f in sorted(set(Q.LAYOUTS.values())):
        getattr(h, f"host_qmm_wsplit_{f}").argtypes = [U, U, P, P, LL, I, I, P, P, P]
    for f in (8, 42):
        for jt in Q.JOB_SIZES:
            getattr(h, f"host_qmm_moe_gu_{f}_{jt}").argtypes = [U, U, P, P, P, P, P, P, I, I]
            getattr(h, f"host_qmm_moe_down_{f}_{jt}").argtypes = [U, U, P, LL, P, P, P, P, P, I, I]
    for jt in Q.JOB_SIZES:
        getattr(h, f"host_qmm_moe_gu_i8_{jt}").argtypes = [U, U, P, P, P, P, P, P, P, I, I]
        getattr(h, f"host_qmm_moe_down_i8_{jt}").argtypes = [U, U, P, LL, P, P, P, P, P, P, I, I]
    for st, rkc, pad in Q.JOBS_RING_HOST:
        for jt in Q.JOB_SIZES:
            getattr(h, f"host_qmm_moe_gu_i8_{jt}_{st}_{rkc}_{pad}").argtypes = [U, U, P, P, P, P, P, P, P, I, I]
            getattr(h, f"host_qmm_moe_down_i8_{jt}_{st}_{rkc}_{pad}").argtypes = [U, U, P, LL, P, P, P, P, P, P, I, I]
    h.host_qmm_split_i8.argtypes = h.host_qmm_split_i8d.argtypes = [U, U, P, LL, I, I, P, P, P, P, P]
    h.host_qmm_hc_norm_split.argtypes = [U, U, P, P, P, I, I, P, I, F, P, P, P, P, P]
    for o in (0, 1):
        getattr(h, f"host_qmm_hc_mix_split_{o}").argtypes = [U, U, P, P, I, I, I, P, P, P, P, P]
    for a in (0, 1, 2):
        getattr(h, f"host_qmm_sum_act_split_{a}").argtypes = [U, U, P, P, I, I, F, P, P, P, P]
    h.host_qmm_sum_hc.argtypes = [U, U, P, P, P, I, I, I, F, P, P, P, P]
    h.host_mma_tile.argtypes = [P, P, P, P]
    h.host_f2h.argtypes = [P, P, LL]
    h.host_h2f.argtypes = [P, P, LL]
    return h


def _p(a):
    return a.ctypes.data


def _silu_np(a):
    return a / (1.0 + np.exp(-a))


def blocks(rng, tname: str, rows: int, cols: int) -> np.ndarray:
    """Random valid GGUF blocks of Q8_0 (34 bytes) or Q2_0 (18 bytes): fp16 scales of both signs (one subnormal),
    codes over the whole range."""
    bv, tb = (32, 34) if tname == "Q8_0" else (64, 18)
    nb = rows * cols // bv
    d = (rng.standard_normal(nb) * 0.02).astype(np.float16)
    d[0] = np.float16(3e-6)
    b = np.empty((nb, tb), dtype=np.uint8)
    b[:, :2] = d.view(np.uint8).reshape(nb, 2)
    b[:, 2:] = rng.integers(0, 256, size=(nb, tb - 2)).astype(np.uint8)
    return b.reshape(-1)


def wmat(raw: np.ndarray, tname: str, rows: int, cols: int) -> np.ndarray:
    return np.asarray(dequantize(raw, tname, rows * cols)).reshape(rows, cols).astype(np.float64)


def experts(rng, tname: str, E: int, hidden: int, ff: int, wrap=lambda a: a):
    """E random experts of ``tname`` blocks: (blobs [gate | up | down] passed through ``wrap``, float64 matrices
    (gate [ff, hidden], up, down [hidden, ff]) per expert)."""
    blobs, mats = [], []
    for _ in range(E):
        g, u, dn = blocks(rng, tname, ff, hidden), blocks(rng, tname, ff, hidden), blocks(rng, tname, hidden, ff)
        blobs.append(wrap(np.concatenate([g, u, dn])))
        mats.append((wmat(g, tname, ff, hidden), wmat(u, tname, ff, hidden), wmat(dn, tname, hidden, ff)))
    return blobs, mats


def job_case(rng, tname: str, E: int, hidden: int, ff: int, T: int, k: int, jt: int):
    """A routed-expert case: E random experts (:func:`experts`), T tokens routed to k distinct experts each (expert 0
    gets every token: more than one job), their jobs of jt tokens (expert_jobs), the jobs' blob addresses and the
    activations X [T, hidden] (row 1 1e4 times the rest). Returns (blobs, mats, ids, ptr, (je, job_tok, job_dst), X):
    the caller keeps ``blobs``, which own the memory ``ptr`` points at."""
    blobs, mats = experts(rng, tname, E, hidden, ff)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    ids[:, 0] = 0
    jobs = expert_jobs(ids, jt)
    ptr = np.array([blobs[e].ctypes.data for e in jobs[0]], dtype=np.uint64)
    X = rng.standard_normal((T, hidden)).astype(np.float32)
    X[1] *= np.float32(1e4)
    return blobs, mats, ids, ptr, jobs, X


def acts(rng, T: int, K: int) -> np.ndarray:
    """Activations with rows of very different magnitude (1e-30 .. 1e30, a zero row, a row with one outlier)."""
    X = rng.standard_normal((T, K)).astype(np.float32)
    mags = [1.0, 1e30, 1e-30, 0.0, 3e4, 1e-3]
    for t in range(min(T, len(mags))):
        X[t] *= np.float32(mags[t])
    if T > 6:
        X[6, 3] = 5e3  # one outlier: the rest of the row sits far below it
    return X


def test_f2h_rounds_like_numpy(lib):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000) * s for s in (1e-7, 1e-5, 1e-3, 1.0, 1e3, 6e4)]).astype(np.float32)
    # ties between halves (normal and subnormal), overflow edges, signed zeros, infinities
    ties = (np.arange(1, 200, dtype=np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)
    x = np.concatenate([x, ties, -ties, np.float32([65504, 65519.99, 65520, 1e6, -1e6, 0.0, -0.0, np.inf, -np.inf,
                                                    2.0 ** -25, 2.0 ** -25 * 1.0001, 2.0 ** -26, 2.0 ** -14])])
    x = x.astype(np.float32)
    h = np.zeros(x.size, dtype=np.uint16)
    lib.host_f2h(_p(x), _p(h), x.size)
    with np.errstate(over="ignore"):
        assert np.array_equal(h, x.astype(np.float16).view(np.uint16))
    back = np.zeros(x.size, dtype=np.float32)
    lib.host_h2f(_p(h), _p(back), x.size)
    assert np.array_equal(back, h.view(np.float16).astype(np.float32))


def test_mma_tile_matches_numpy(lib):
    """One mma.m16n8k16 through the documented fragment layout: D = A B + C (products of halves exact)."""
    rng = np.random.default_rng(1)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    B = rng.standard_normal((16, 8)).astype(np.float16)
    A[3, 5], B[7, 2] = np.float16(2.0 ** -20), np.float16(-3e4)  # a subnormal and a large value
    C = rng.standard_normal((16, 8)).astype(np.float32)
    D = np.full((16, 8), np.nan, dtype=np.float32)
    lib.host_mma_tile(_p(np.ascontiguousarray(A.view(np.uint16))), _p(np.ascontiguousarray(B.view(np.uint16))),
                      _p(C), _p(D))
    ref = (A.astype(np.float64) @ B.astype(np.float64) + C).astype(np.float32)
    assert np.array_equal(D, ref)
    # a different A gives a different D (the layout reaches every element)
    for r, c in ((0, 0), (15, 15), (8, 9), (7, 8)):
        A2 = A.copy()
        A2[r, c] += np.float16(1.0)
        D2 = np.zeros_like(D)
        lib.host_mma_tile(_p(np.ascontiguousarray(A2.view(np.uint16))), _p(np.ascontiguousarray(B.view(np.uint16))),
                          _p(C), _p(D2))
        ref2 = (A2.astype(np.float64) @ B.astype(np.float64) + C).astype(np.float32)
        assert np.array_equal(D2, ref2) and not np.array_equal(D2[r], D[r])


def split_host(lib, X: np.ndarray):
    T, Kc = X.shape
    hi = np.zeros((T, Kc), np.uint16)
    lo = np.zeros((T, Kc), np.uint16)
    sc = np.zeros(T, np.float32)
    lib.host_qmm_split(3, 1, _p(X), Kc, T, Kc, _p(hi), _p(lo), _p(sc))
    return hi, lo, sc


@pytest.mark.parametrize("K", [96, 8, 640])
def test_split_keeps_22_bits(lib, K):
    """qmm_split: the row scale a power of two that puts the row's maximum below 2^15, hi + lo within 2^-22 of each
    value; rows of fewer (8) and more (640, the host's one thread) values than the thread keeps in registers (16)."""
    rng = np.random.default_rng(2)
    X = acts(rng, 9, K)
    hi, lo, sc = split_host(lib, X)
    m = np.frexp(np.abs(X).max(axis=1))[1]
    e = np.where(np.abs(X).max(axis=1) > 0, np.clip(m - 15, -126, 127), 0)
    assert np.array_equal(sc, np.ldexp(np.float32(1), e).astype(np.float32))
    scaled = np.abs(X.astype(np.float64)) / sc[:, None].astype(np.float64)
    assert np.all(scaled.max(axis=1) < 2.0 ** 15)
    rec = (hi.view(np.float16).astype(np.float64) + lo.view(np.float16).astype(np.float64)) * sc[:, None]
    rowmax = np.abs(X).max(axis=1, keepdims=True).astype(np.float64)
    err = np.abs(rec - X)
    # each value to 2^-22 of itself, or (far below its row's maximum: lo subnormal) to 2^-39 of the row's maximum
    assert np.all(err <= np.maximum(2.0 ** -22 * np.abs(X), 2.0 ** -38 * rowmax))
    assert not np.any(hi[3] & 0x7fff) and not np.any(lo[3] & 0x7fff) and sc[3] == 1.0  # the zero row (signed zeros)


def test_gdn_launch_shapes():
    """pf_gdn_step_rw's grid covers every value column (32 a block) and its warps every state row (16 a warp, at most
    8 warps); the GDN element-wise kernels' parts leave none without units."""
    from stratatools.runtime.gpu.prefill import GDN_STEP_MAX_DK, gdn_parts, gdn_step_rw_launch

    for dk, dv, want in ((128, 128, (4, 256)), (16, 8, (1, 32)), (100, 200, (7, 224)), (17, 33, (2, 64))):
        gy, th = gdn_step_rw_launch(dk, dv)
        assert (gy, th) == want and gy * 32 >= dv > (gy - 1) * 32 and (th // 32) * 16 >= dk > (th // 32 - 1) * 16
    assert gdn_step_rw_launch(GDN_STEP_MAX_DK, 1)[1] == 256
    assert gdn_parts(32, 48) == 16 and gdn_parts(512, 48) == 1
    for rows, units in ((32, 10), (50, 7), (1, 100), (3, 13)):
        p = gdn_parts(rows, units)
        per = -(-units // p)
        assert (p - 1) * per < units <= p * per  # every part has units


def test_split_threads():
    """qmm_split's block: about 4 values a thread in whole warps, 32 to 256 threads (the batched step's rows of 640
    values: 160; of 2,560: 256)."""
    assert [Q.split_threads(k) for k in (8, 128, 640, 2560, 10240)] == [32, 32, 160, 256, 256]


def q8r_case(rng, rows: int, cols: int, T: int) -> tuple:
    """Random Q8_0 weights re-laid out as Q8R and activations: (W float64 [rows, cols], codes q, scales d, X [T,
    cols] from :func:`acts`)."""
    raw = blocks(rng, "Q8_0", rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    return wmat(raw, "Q8_0", rows, cols), q, d, acts(rng, T, cols)


def dense_case(rng, layout: str, rows: int, cols: int) -> tuple:
    """Random [rows, cols] weights as a dense kernel of ``layout`` reads them: (W8 codes or blocks, Wd Q8R scales or
    None, W the float64 matrix)."""
    tname = "Q2_0" if layout == "Q2_0" else "Q8_0"
    raw = blocks(rng, tname, rows, cols)
    W = wmat(raw, tname, rows, cols)
    if layout == "Q8R":
        q, d = K.q8_relayout(raw, rows, cols)
        return q.view(np.uint8), d, W
    return raw, None, W


def dense_host(lib, layout: str, W8, Wd, X, rows: int, cols: int, nt: int | None = None, nz: int = 1,
               add: bool = True, mt: int = 1) -> np.ndarray:
    """The host build's qmm_dense; with ``nz`` > 1 k split into nz slices whose partial results [nz, T, rows] the
    kernel's last slice of each tile adds into Y (every slice's every element written: an empty slice writes zeros;
    the tile counters are left zero); without ``add`` (null counters) Y is left alone and the slices are added
    here. ``mt`` 2: the two-tile kernel (``qmm_dense<F, 4, 2>``: 32 rows a host block, rows a multiple of 32)."""
    f = Q.LAYOUTS[layout]
    T = X.shape[0]
    nt = Q.DENSE2_NT if mt == 2 else (nt or Q.token_tile(T))
    hi, lo, sc = split_host(lib, X)
    Y = np.full((T, rows), np.nan, dtype=np.float32)
    P = np.full((nz, T, rows), np.nan, dtype=np.float32)
    rb = cols if f == 0 else cols // Q.BLOCK_VALUES[f] * Q.BLOCK_BYTES[f]
    gx, gy = -(-rows // (16 * mt)), -(-T // (8 * nt)) * nz  # host blocks: one warp, 16 mt rows
    cnt = np.zeros(gx * (gy // nz) + 1, dtype=np.int32)
    entry = f"host_qmm_dense_{f}_{nt}" + ("_2" if mt == 2 else "")
    with shared_within(lib, Q.smem_bytes(f, nt)):
        getattr(lib, entry)(gx, gy, _p(W8), _p(Wd if Wd is not None else W8), rb, _p(hi), _p(lo), _p(sc), _p(Y), rows,
                            T, rows, cols, nz, _p(P), _p(cnt) if add else None)
    if not add:
        assert nz > 1 and np.all(np.isnan(Y)) and np.all(np.isfinite(P))
        return P.sum(axis=0, dtype=np.float32)
    assert np.all(np.isfinite(Y)) and not np.any(cnt)
    if nz > 1:
        assert np.all(np.isfinite(P))
        # the kernel's sum is the slices' in order z = 0 .. nz - 1, in float32
        want = P[0].copy()
        for z in range(1, nz):
            want = want + P[z]
        assert np.array_equal(Y, want)
    return Y


def check(Y, W, X, tol=2e-6):
    """|Y - ref| within tol of |W| |x| (the sum of the magnitudes of the products) for every element."""
    ref = X.astype(np.float64) @ W.T
    bound = np.abs(X.astype(np.float64)) @ np.abs(W).T
    assert np.all(np.isfinite(Y))
    err = np.abs(Y - ref)
    assert np.all(err <= tol * bound + 1e-300), float((err / np.maximum(bound, 1e-300)).max())
    return float((err / np.maximum(bound, 1e-300)).max())


@pytest.mark.parametrize("layout,rows,cols,T,nt,nz", [
    ("Q8R", 37, 96, 1, None, 1), ("Q8R", 16, 160, 15, None, 1), ("Q8R", 40, 288, 16, None, 1),
    ("Q8R", 21, 64, 33, None, 1), ("Q8R", 19, 128, 20, 4, 1), ("Q8_0", 37, 96, 15, None, 1),
    ("Q8_0", 17, 160, 33, None, 1), ("Q2_0", 37, 320, 1, None, 1), ("Q2_0", 18, 192, 33, None, 1),
    ("Q2_0", 16, 64, 16, 4, 1),
    # k split over nz slices (dense_launch's launch for few tokens): the slices' sum is the product
    ("Q8R", 37, 640, 5, None, 2),   # 5 chunks: slices [0, 3) and [3, 5) (the second starts on an odd chunk)
    ("Q8R", 16, 640, 32, None, 7),  # 1 chunk a slice, slices 5 and 6 empty (zeros)
    ("Q8_0", 21, 384, 17, None, 3), ("Q2_0", 18, 320, 9, None, 2), ("Q2_0", 40, 640, 1, None, 4)])
def test_dense_matches_float64(lib, layout, rows, cols, T, nt, nz):
    rng = np.random.default_rng(rows * 1000 + cols + T + 7 * (nz - 1))
    W8, Wd, W = dense_case(rng, layout, rows, cols)
    X = acts(rng, T, cols)
    Y = dense_host(lib, layout, W8, Wd, X, rows, cols, nt, nz)
    check(Y, W, X)


@pytest.mark.parametrize("layout,rows,cols,T,nz", [("Q8R", 37, 640, 5, 2), ("Q8R", 16, 640, 32, 7),
                                                   ("Q2_0", 40, 640, 1, 4)])
def test_dense_slices_added_by_the_caller(lib, layout, rows, cols, T, nz):
    """With null tile counters (dense's launch up to 32 tokens) the kernel leaves Y alone and writes every slice's
    partial result; their sum is the product."""
    rng = np.random.default_rng(rows + cols + T + nz)
    W8, Wd, W = dense_case(rng, layout, rows, cols)
    X = acts(rng, T, cols)
    check(dense_host(lib, layout, W8, Wd, X, rows, cols, None, nz, add=False), W, X)


@pytest.mark.parametrize("layout,rows,cols,T", [("Q8R", 64, 256, 40), ("Q8_0", 32, 160, 70), ("Q2_0", 96, 192, 33),
                                                ("Q8R", 128, 96, 100)])
def test_dense_two_row_tiles_a_warp_match_float64(lib, layout, rows, cols, T):
    """qmm_dense<F, 4, 2> (two 16-row tiles a warp: the host's one-warp blocks take 32 rows) against float64, rows a
    multiple of 32 as the launcher asks (of 128 on the device: 4 warps); the same values as the one-tile kernel up to
    float summation order."""
    rng = np.random.default_rng(rows + cols + T)
    W8, Wd, W = dense_case(rng, layout, rows, cols)
    X = acts(rng, T, cols)
    Y = dense_host(lib, layout, W8, Wd, X, rows, cols, mt=2)
    check(Y, W, X)
    Y1 = dense_host(lib, layout, W8, Wd, X, rows, cols, Q.DENSE2_NT)
    assert np.allclose(Y, Y1, rtol=1e-6, atol=1e-6 * float(np.abs(Y1).max()))


def ring_host(lib, W8, Wd, X, rows: int, cols: int, nt: int, stages: int, rkc: int, kg: int, nz: int = 1,
              add: bool = True, i8: bool = False) -> np.ndarray:
    """The host build's qmm_dense_ring<nt, stages, rkc, kg, i8> (one-warp blocks of 16 rows, the warp playing the kg
    groups) on Q8R weights, X split by the host qmm_split (``i8``: the integer ring, X split by qmm_split_i8d); k
    split into nz slices of chunks of rkc values as :func:`dense_host` does, the slices added by the kernel's last
    slice (``add``) or here."""
    T = X.shape[0]
    hi, lo, sc = split_i8_host(lib, X, dense=True)[:3] if i8 else split_host(lib, X)
    Y = np.full((T, rows), np.nan, dtype=np.float32)
    P = np.full((nz, T, rows), np.nan, dtype=np.float32)
    gx, gy = -(-rows // 16), -(-T // (8 * nt)) * nz
    cnt = np.zeros(gx * (gy // nz) + 1, dtype=np.int32)
    with shared_within(lib, stages * Q.ring_stage_bytes(nt, rkc, warps=1, i8=i8)):
        getattr(lib, f"host_qmm_dense_ring_{nt}_{stages}_{rkc}_{kg}_{int(i8)}")(
            gx, gy, _p(W8), _p(Wd), cols, _p(hi), _p(lo), _p(sc), _p(Y), rows, T, rows, cols, nz, _p(P),
            _p(cnt) if add else None)
    if not add:
        assert np.all(np.isnan(Y)) and np.all(np.isfinite(P))
        return P.sum(axis=0, dtype=np.float32)
    assert np.all(np.isfinite(Y)) and not np.any(cnt)
    return Y


@pytest.mark.parametrize("nt,stages,rkc,kg", Q.RING_HOST)
@pytest.mark.parametrize("rows,cols,T", [(37, 640, 5), (16, 128, 16), (21, 384, 9), (40, 1280, 32)])
def test_dense_ring_is_qmm_dense_bit_for_bit(lib, nt, stages, rkc, kg, rows, cols, T):
    """qmm_dense_ring (the weights through a ring of shared-memory stages) computes qmm_dense's products in its order
    with one group of warps: without a split of k the same float32 bits, for rows that do not fill a warp, ranges
    shorter than the ring, token tiles not filled; with kg groups (each a share of every stage's blocks, their sums
    added in group order: another order than qmm_dense's) the same bits on a second run and within float64's
    bound."""
    if cols % rkc or T > 8 * nt:
        pytest.skip("the launcher does not take the ring for this shape")
    rng = np.random.default_rng(rows * 7 + cols + T + nt)
    W8, Wd, W = dense_case(rng, "Q8R", rows, cols)
    X = acts(rng, T, cols)
    Y = ring_host(lib, W8, Wd, X, rows, cols, nt, stages, rkc, kg)
    if kg == 1:
        assert np.array_equal(Y, dense_host(lib, "Q8R", W8, Wd, X, rows, cols, nt))
    else:
        assert np.array_equal(Y, ring_host(lib, W8, Wd, X, rows, cols, nt, stages, rkc, kg))
    check(Y, W, X)


@pytest.mark.parametrize("nt,stages,rkc,kg", Q.RING_HOST)
@pytest.mark.parametrize("rows,cols,T,nz", [(37, 640, 5, 2), (16, 1280, 32, 7), (18, 384, 16, 3)])
def test_dense_ring_split_k_matches_float64(lib, nt, stages, rkc, kg, rows, cols, T, nz):
    """The ring's split of k (slices of whole chunks of rkc values; the last slices empty where the chunks run out):
    the kernel's last slice adds them in slice order, or the caller does; both within float64's bound."""
    if cols % rkc or T > 8 * nt:
        pytest.skip("the launcher does not take the ring for this shape")
    rng = np.random.default_rng(rows + cols * 3 + T + nz)
    W8, Wd, W = dense_case(rng, "Q8R", rows, cols)
    X = acts(rng, T, cols)
    check(ring_host(lib, W8, Wd, X, rows, cols, nt, stages, rkc, kg, nz), W, X)
    check(ring_host(lib, W8, Wd, X, rows, cols, nt, stages, rkc, kg, nz, add=False), W, X)


def test_split_i8d_is_split_i8_in_the_values_order(lib):
    """qmm_split_i8d: the same fixed point as qmm_split_i8 (q, block scales and sums), its planes holding value k at
    byte k of the row (the integer dense ring's order)."""
    rng = np.random.default_rng(23)
    X = acts(rng, 7, 384)
    hi, lo, sc, qs = split_i8_host(lib, X)
    hd, ld, sd, qd = split_i8_host(lib, X, dense=True)
    assert np.array_equal(hd.view(np.int8).astype(np.int64) * 256 + ld, i8_values(hi, lo))
    assert np.array_equal(sd, sc) and np.array_equal(qd, qs)


def check_i8(Y, W, X):
    """Every element of Y [T, R] within the integer products' bound of float64 (hostlib.i8_bound: each value of x off
    by at most half a step of its block's fixed point, float32 sums)."""
    ref = X.astype(np.float64) @ W.T
    for t in range(X.shape[0]):
        b = i8_bound(W, X[t].astype(np.float64))
        assert np.all(np.abs(Y[t] - ref[t]) <= b), (t, float(np.max(np.abs(Y[t] - ref[t]) / b)))


@pytest.mark.parametrize("nt,stages,rkc,kg", Q.DENSE_I8_HOST)
@pytest.mark.parametrize("rows,cols,T,nz", [(37, 640, 5, 1), (16, 128, 16, 1), (21, 384, 9, 1), (40, 1280, 32, 1),
                                            (37, 640, 5, 2), (16, 1280, 32, 7), (18, 384, 16, 3)])
def test_dense_i8_ring_matches_float64(lib, nt, stages, rkc, kg, rows, cols, T, nz):
    """The integer dense ring (Q8R codes as signed bytes of mma.m16n8k32, activations as qmm_split_i8d's 16-bit
    fixed point per block of 64) within the fixed point's bound of float64 for rows that do not fill a warp, ranges
    shorter than the ring, token tiles not filled, a split of k added by the kernel's last slice or by the caller;
    the same bits on a second run."""
    if cols % rkc or T > 8 * nt:
        pytest.skip("the launcher does not take the ring for this shape")
    rng = np.random.default_rng(rows * 5 + cols + T + nt + nz)
    W8, Wd, W = dense_case(rng, "Q8R", rows, cols)
    X = acts(rng, T, cols)
    Y = ring_host(lib, W8, Wd, X, rows, cols, nt, stages, rkc, kg, nz, i8=True)
    check_i8(Y, W, X)
    assert np.array_equal(Y, ring_host(lib, W8, Wd, X, rows, cols, nt, stages, rkc, kg, nz, i8=True))
    if nz > 1:
        check_i8(ring_host(lib, W8, Wd, X, rows, cols, nt, stages, rkc, kg, nz, add=False, i8=True), W, X)


def test_dense_i8_ring_fragments_on_host(lib):
    """The integer ring on inputs whose products name their place: row r of W holds one code 1 (scale 1) at value k
    and zeros elsewhere, x = 3 e_k' for token t: Y[t, r] = 3 only when k = k', and every other output 0 (a wrong
    pairing of A's and B's k-slots, rows or tokens fails)."""
    rows, cols, T = 16, 128, 16
    for r, k, t in ((0, 0, 0), (9, 5, 3), (3, 38, 12), (15, 127, 15), (8, 64, 7), (1, 100, 9)):
        for kk in (k, k ^ 4, k ^ 16, k ^ 32, (k + 1) % cols):
            W8 = np.zeros((rows, cols), np.int8)
            W8[r, k] = 1
            Wd = np.full(rows * cols // 32, np.float16(1.0)).view(np.uint16)
            X = np.zeros((T, cols), np.float32)
            X[t, kk] = 3.0
            Y = ring_host(lib, W8.view(np.uint8), Wd, X, rows, cols, 2, 2, 64, 1, i8=True)
            want = np.zeros((T, rows), np.float32)
            want[t, r] = 3.0 if kk == k else 0.0
            assert np.array_equal(Y, want), (r, k, t, kk)


def test_ring_switch(monkeypatch):
    """STRATATOOLS_QMM_RING: the default ring unless 0; S:RKC from RINGS; other values refused; the ring takes Q8R
    up to 32 tokens over K a multiple of its chunk only."""
    monkeypatch.delenv(Q.RING_ENV, raising=False)
    assert Q.ring() == Q.RING_DEFAULT
    monkeypatch.setenv(Q.RING_ENV, "0")
    assert Q.ring() is None
    monkeypatch.setenv(Q.RING_ENV, "3:128")
    assert Q.ring() == (3, 128, 1)
    monkeypatch.setenv(Q.RING_ENV, "3:128:4")
    assert Q.ring() == (3, 128, 4)
    for bad in ("5:64", "6", "x:64", "6:64:3", "3:64:2", "-1", "6:64:1:1"):
        monkeypatch.setenv(Q.RING_ENV, bad)
        with pytest.raises(StrataError, match=Q.RING_ENV):
            Q.ring()
    assert Q.ring_applies(0, 32, 2560, (6, 64, 1)) and Q.ring_applies(0, 1, 320, (6, 64, 1))
    assert not Q.ring_applies(0, 33, 2560, (6, 64, 1))       # longer X: qmm_dense
    assert not Q.ring_applies(0, 32, 320, (3, 128, 2))       # K not whole chunks
    assert not Q.ring_applies(8, 32, 2560, (6, 64, 1))       # GGUF Q8_0 blocks
    assert not Q.ring_applies(0, 32, 2560, None)
    assert not Q.ring_applies(0, 32, 2560, (6, 64, 1), 8, 0)     # codes not 16-byte aligned (dense checks 8)
    assert not Q.ring_applies(0, 32, 2560, (3, 128, 1), 0, 4)    # scales not 8-byte aligned for chunks of 128
    assert Q.ring_applies(0, 32, 2560, (6, 64, 1), 32, 4)
    assert all(rkc // 32 % kg == 0 for _, rkc, kg in Q.RINGS)  # (a stage's blocks split evenly between groups)
    # the groups' sums meet in the ring's memory: (KG - 1) groups x 4 warps x 32 lanes x NT x 4 floats
    assert all((kg - 1) * 4 * 32 * nt * 4 * 4 <= s * Q.ring_stage_bytes(nt, rkc) for s, rkc, kg in Q.RINGS
               for nt in Q.TILES[:2])
    # the device's stage at 4 warps, NT 4, 64 values: codes and scales 64 x (96 + 4), halves 2 x 32 x 96 x 2
    assert Q.ring_stage_bytes(4, 64) == 64 * 100 + 12288


def test_dense2_switch_and_launch(monkeypatch):
    """STRATATOOLS_QMM_DENSE2: auto by default (where the two-tile blocks alone fill the SMs), 1 wherever it applies,
    0 never, another value refused; the two-tile launch takes more than 32 tokens over rows of a multiple of 128
    only, and with a count of SMs only where its blocks fill them."""
    monkeypatch.delenv(Q.DENSE2_ENV, raising=False)
    assert Q.dense2() == "auto"
    for v in ("1", "0", "auto"):
        monkeypatch.setenv(Q.DENSE2_ENV, f" {v} ")
        assert Q.dense2() == v
    for bad in ("yes", "2", "AUTO"):
        monkeypatch.setenv(Q.DENSE2_ENV, bad)
        with pytest.raises(StrataError, match=Q.DENSE2_ENV):
            Q.dense2()
    assert Q.dense2_launch(512, 8192) == (4, 64, 16) and Q.dense2_launch(33, 2560) == (4, 20, 2)
    assert Q.dense2_launch(32, 8192) is None and Q.dense2_launch(512, 320) is None
    # 64 x 16 blocks fill 132 SMs; the shared expert's 512 rows over 512 tokens (4 x 16 = 64 blocks) do not
    assert Q.dense2_launch(512, 8192, 132) == (4, 64, 16) and Q.dense2_launch(512, 512, 132) is None
    assert Q.dense2_launch(512, 1024, 128) == (4, 8, 16) and Q.dense2_launch(512, 1024, 129) is None


def test_chunk_values_from_the_environment(monkeypatch):
    """The chunk knobs take 64, 128 or 256 (ASCII digits), the default when empty or unset."""
    for env, moe in ((Q.KC_ENV, False), (Q.MOE_KC_ENV, True)):
        monkeypatch.delenv(env, raising=False)
        assert Q.chunk_values(moe) == Q.KC
        monkeypatch.setenv(env, " 256 ")
        assert Q.chunk_values(moe) == 256
        monkeypatch.setenv(env, "")
        assert Q.chunk_values(moe) == Q.KC
        for bad in ("96", "２５６", "+128", "1e2", "x"):
            monkeypatch.setenv(env, bad)
            with pytest.raises(StrataError, match=env):
                Q.chunk_values(moe)
        monkeypatch.delenv(env)
    assert Q.chunk_values(True, "Q2_0") == 256 and Q.chunk_values(True, 8) == Q.KC and Q.chunk_values() == Q.KC
    monkeypatch.setenv(Q.MOE_KC_ENV, "64")
    assert Q.chunk_values(True, "Q2_0") == 64 and Q.chunk_values() == Q.KC
    monkeypatch.delenv(Q.MOE_KC_ENV)
    assert Q.smem_bytes("Q2_0", 2, 256) == 2 * 2 * 16 * (256 + 40) * 2
    assert Q.dense_launch(512, 320, 10240, "Q8R", 132, 256) == (8, 5, 48, 6)  # 40 chunks of 256: still 6 slices


def test_big_matrices_take_cublas_only_where_asked(monkeypatch):
    """STRATATOOLS_PREFILL_BIG: off by default; on the mma path a matrix of at least that many weights times at
    least BIG_MIN_TOKENS rows takes hgemm, never on another GEMM path, in the captured batched step or on the shared
    expert's stream; a value that is not a whole number is refused, naming the variable."""
    from types import SimpleNamespace

    from stratatools.runtime.gpu.prefill import ChunkPrefill

    monkeypatch.delenv(Q.BIG_ENV, raising=False)
    assert Q.big_matrix_values() == Q.BIG_DEFAULT == 0
    assert Q.big_matrix_values(graph=True) == Q.BIG_GRAPH_DEFAULT == 1 << 21
    cur = SimpleNamespace(ptr=5)
    pf = ChunkPrefill.__new__(ChunkPrefill)
    pf.gemm = "mma"
    pf.cp = SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: cur))
    assert not pf._big_hgemm(8192, 2560, 512)
    pf._in_graph = True  # the prefill's graph body: 2M weights and more by default
    assert pf._big_hgemm(8192, 2560, 512) and not pf._big_hgemm(640, 2560, 512)
    monkeypatch.setenv(Q.BIG_ENV, "0")
    assert not pf._big_hgemm(8192, 2560, 512)
    monkeypatch.delenv(Q.BIG_ENV)
    pf._in_graph = False
    monkeypatch.setenv(Q.BIG_ENV, str(1 << 21))
    assert pf._big_hgemm(8192, 2560, 512) and pf._big_hgemm(2048, 1024, Q.BIG_MIN_TOKENS)
    assert not pf._big_hgemm(640, 2560, 512)  # 1.6M weights: the tensor-core kernel
    assert not pf._big_hgemm(8192, 2560, Q.BIG_MIN_TOKENS - 1)
    pf._shared_side = SimpleNamespace(ptr=5)  # called on the shared expert's stream
    assert not pf._big_hgemm(8192, 2560, 512)
    pf._shared_side = SimpleNamespace(ptr=6)
    assert pf._big_hgemm(8192, 2560, 512)
    pf._in_static = True
    assert not pf._big_hgemm(8192, 2560, 512)
    pf._in_static, pf.gemm = False, "sgemm"
    assert not pf._big_hgemm(8192, 2560, 512)
    for bad in ("2M", "-1", "1.5"):
        monkeypatch.setenv(Q.BIG_ENV, bad)
        with pytest.raises(StrataError, match=Q.BIG_ENV):
            Q.big_matrix_values()


def test_dense_launch_short_fill(monkeypatch):
    """STRATATOOLS_QMM_SHORT_FILL=3 up to 32 tokens: the 12,288-row attention matrix (192 row blocks, one wave and a
    half at 132 SMs) splits k in two (384 blocks, within 3 a SM); 2,560 rows (40 blocks) into 9 slices (360 blocks)
    of 20 chunks -> 7 (each slice 3 chunks, none empty); longer X keeps the default's split; 5 is refused."""
    monkeypatch.setenv(Q.SHORT_FILL_ENV, "3")
    assert Q.dense_launch(32, 12288, 2560, "Q8R", 132) == (4, 192, 2, 2)
    assert Q.dense_launch(32, 10240, 320, "Q8R", 132) == (4, 160, 2, 2)
    assert Q.dense_launch(32, 2560, 2560, "Q8R", 132) == (4, 40, 7, 7)
    assert Q.dense_launch(32, 40000, 2560, "Q8R", 132) == (4, 625, 1, 1)
    assert Q.dense_launch(512, 320, 10240, "Q8R", 132) == (8, 5, 48, 6)
    monkeypatch.setenv(Q.SHORT_FILL_ENV, "5")
    with pytest.raises(StrataError, match=Q.SHORT_FILL_ENV):
        Q.dense_launch(32, 12288, 2560, "Q8R", 132)


def test_dense_launch_splits_k_for_few_tokens():
    """Up to 32 tokens: one token tile and k split while the row blocks leave SMs idle (about 2 blocks a SM, at
    most one slice a chunk, at most SPLIT_MAX); longer X: token_tile's tiles, and k split while the row blocks times
    the token tiles leave SMs idle."""
    # 2,560 x 2,560 Q8R (the full-width hidden), 132 SMs: 40 row blocks, 20 chunks of 128 -> 6 slices would be 4
    # chunks each with the sixth empty: 5 slices (200 blocks)
    assert Q.dense_launch(32, 2560, 2560, "Q8R", 132) == (4, 40, 5, 5)
    assert Q.dense_launch(1, 2560, 2560, "Q8R", 132) == (2, 40, 5, 5)
    assert Q.dense_launch(16, 64, 256, "Q8_0", 132) == (2, 1, 2, 2)  # 2 chunks: at most 2 slices
    assert Q.dense_launch(32, 12288, 2560, "Q8R", 132) == (4, 192, 1, 1)  # rows fill the device
    # the batched step's few-row matrices: slices of one or two chunks (up to SPLIT_MAX_SHORT, 64)
    assert Q.dense_launch(32, 4, 10240, "Q8R", 132) == (4, 1, 40, 40)  # 80 chunks: 64 slices of 2 leave 24 empty
    assert Q.dense_launch(32, 320, 10240, "Q8R", 132) == (4, 5, 40, 40)  # 264 // 5 = 52 slices of 2: 40 with chunks
    assert Q.dense_launch(32, 32, 2560, "Q8R", 132) == (4, 1, 20, 20)  # one slice a chunk
    assert Q.dense_launch(512, 2560, 2560, "Q8R", 132) == (8, 40, 8, 1)
    # longer X: k split where row blocks x token tiles leave SMs idle (the prefill's 320 x 10,240 hyper-connection
    # down projection: 5 x 8 tiles, 80 chunks -> 6 slices; the 4-row inject: 1 x 8 tiles -> 33, at most SPLIT_MAX)
    assert Q.dense_launch(512, 320, 10240, "Q8R", 132) == (8, 5, 48, 6)
    assert Q.dense_launch(512, 4, 10240, "Q8R", 132) == (8, 1, 8 * Q.SPLIT_MAX, Q.SPLIT_MAX)
    assert Q.dense_launch(512, 32, 256, "Q8R", 132) == (8, 1, 16, 2)  # 2 chunks: at most 2 slices


def test_dense_large_rows_precision(lib):
    """Rows of large magnitude: the result is within ~1e-6 of float64 relative to each row's |W| |x|, also where
    the row's sum cancels."""
    rng = np.random.default_rng(7)
    rows, cols, T = 32, 512, 9
    W, q, d, X = q8r_case(rng, rows, cols, T)
    X = X * np.float32(1e3)
    worst = check(dense_host(lib, "Q8R", q.view(np.uint8), d, X, rows, cols), W, X, tol=1e-6)
    assert worst < 1e-6


def test_launchers_refuse_bad_shapes():
    with pytest.raises(StrataError, match="layout"):
        Q.dense(np.zeros((2, 64), np.float32), "Q4_0", np.zeros(8, np.uint8), None, 1, 64)
    with pytest.raises(StrataError, match="whole blocks"):
        Q.dense(np.zeros((2, 96), np.float32), "Q2_0", np.zeros(8, np.uint8), None, 1, 96)
    assert Q.supports("Q8R", 2560) and Q.supports(42, 128) and not Q.supports(42, 96) and not Q.supports(2, 64)
    assert [Q.token_tile(t) for t in (1, 16, 17, 32, 33, 512)] == [2, 2, 4, 4, 8, 8]


def test_prefill_and_batch_gemm_env(monkeypatch):
    """The prefill's switch defaults to mma, the batched step's to mma too; each reads its own variable only and takes
    sgemm, mma or hgemm (any case, spaces around)."""
    monkeypatch.delenv(Q.GEMM_ENV, raising=False)
    monkeypatch.delenv(Q.BATCH_GEMM_ENV, raising=False)
    assert (Q.prefill_gemm(), Q.batch_gemm()) == ("mma", "mma")
    monkeypatch.setenv(Q.GEMM_ENV, "SGEMM")
    assert (Q.prefill_gemm(), Q.batch_gemm()) == ("sgemm", "mma")
    monkeypatch.setenv(Q.BATCH_GEMM_ENV, " sgemm")
    assert (Q.prefill_gemm(), Q.batch_gemm()) == ("sgemm", "sgemm")
    monkeypatch.setenv(Q.GEMM_ENV, "HGEMM ")
    assert (Q.prefill_gemm(), Q.batch_gemm()) == ("hgemm", "sgemm")
    monkeypatch.setenv(Q.BATCH_GEMM_ENV, "hgemm")
    assert (Q.prefill_gemm(), Q.batch_gemm()) == ("hgemm", "hgemm")
    for env, fn in ((Q.GEMM_ENV, Q.prefill_gemm), (Q.BATCH_GEMM_ENV, Q.batch_gemm)):
        monkeypatch.setenv(env, "tf32")
        with pytest.raises(StrataError, match=f"{env}='tf32': use sgemm, mma or hgemm"):
            fn()
        monkeypatch.setenv(env, "mma")


@pytest.mark.parametrize("tname,hidden,ff,T,E,k,jt", [("Q2_0", 192, 128, 21, 5, 3, 16), ("Q8_0", 96, 64, 19, 3, 2, 16),
                                                     ("Q2_0", 192, 128, 41, 5, 3, 32), ("Q8_0", 96, 64, 37, 3, 2, 32),
                                                     ("Q2_0", 192, 128, 13, 5, 3, 8)])
def test_moe_jobs_match_float64(lib, tname, hidden, ff, T, E, k, jt):
    """Routed experts as jobs of one expert and up to jt (8, 16 or 32) tokens: gate/up with the silu epilogue into hbuf,
    then down into the pair's own row, against float64 per pair (blobs read through host addresses, as through the
    slot table's device addresses)."""
    tt = jt
    blobs, mats, ids, ptr, (je, jt, jd), X = job_case(np.random.default_rng(hidden + T), tname, E, hidden, ff, T, k,
                                                      tt)
    J = je.size
    xh, xl, xs = split_host(lib, X)
    hbuf = np.full((J * tt, ff), np.nan, dtype=np.float32)
    f = Q.LAYOUTS[tname]
    with shared_within(lib, Q.smem_bytes(f, tt // 8)):
        getattr(lib, f"host_qmm_moe_gu_{f}_{tt}")(-(-ff // 16), J, _p(ptr), _p(jt), _p(xh), _p(xl), _p(xs), _p(hbuf),
                                                  hidden, ff)
    used = jt >= 0
    assert np.all(np.isfinite(hbuf[used])) and np.all(np.isnan(hbuf[~used]))
    hbuf[~used] = 0.0
    hh, hl, hs = split_host(lib, hbuf)
    out = np.full((T * k, hidden), np.nan, dtype=np.float32)
    doff = 2 * (ff * hidden // Q.BLOCK_VALUES[f]) * Q.BLOCK_BYTES[f]
    with shared_within(lib, Q.smem_bytes(f, tt // 8)):
        getattr(lib, f"host_qmm_moe_down_{f}_{tt}")(-(-hidden // 16), J, _p(ptr), doff, _p(jd), _p(hh), _p(hl), _p(hs),
                                                    _p(out), hidden, ff)
    for t in range(T):
        x = X[t].astype(np.float64)
        for r in range(k):
            g, u, dn = mats[ids[t, r]]
            hg, hu = g @ x, u @ x
            h = _silu_np(hg) * hu
            # the hidden row the kernel wrote (float32) is the down's input: check both halves separately
            slot = int(np.nonzero(jd == t * k + r)[0][0])
            bound_h = (np.abs(g) @ np.abs(x)) * (np.abs(hu) + 1) + np.abs(_silu_np(hg)) * (np.abs(u) @ np.abs(x))
            assert np.all(np.abs(hbuf[slot] - h) <= 4e-6 * bound_h + 1e-30)
            hv = hbuf[slot].astype(np.float64)
            ref = dn @ hv
            assert np.all(np.abs(out[t * k + r] - ref) <= 2e-6 * (np.abs(dn) @ np.abs(hv)) + 1e-30)


def check_i8_pair(g, u, dn, x, hrow, orow):
    """One (token, expert) pair of the integer jobs against float64 within the fixed point's bound (hostlib.i8_bound):
    the hidden row hrow = silu(g x) (u x) as the kernel wrote it, then orow = dn hrow."""
    hg, hu = g @ x, u @ x
    eg, eu = i8_bound(g, x), i8_bound(u, x)
    bound_h = eg * (np.abs(hu) + eu) * 1.2 + np.abs(_silu_np(hg)) * eu + 1e-30
    assert np.all(np.abs(hrow - _silu_np(hg) * hu) <= bound_h)
    hv = np.asarray(hrow, dtype=np.float64)
    assert np.all(np.abs(orow - dn @ hv) <= i8_bound(dn, hv))


def split_i8_host(lib, X: np.ndarray, rowok=None, dense: bool = False):
    """The host build's qmm_split_i8 of X [T, K] (``dense``: qmm_split_i8d, the planes in the values' order): (hi,
    lo) byte planes [T, K] (poisoned 0xAB first), block scales and sums [T, K / 64] (poisoned)."""
    T, Kc = X.shape
    hi = np.full((T, Kc), 0xAB, np.uint8)
    lo = np.full((T, Kc), 0xAB, np.uint8)
    sc = np.full((T, Kc // 64), -7.0, np.float32)
    qs = np.full((T, Kc // 64), 7777, np.int32)
    ok = None if rowok is None else np.ascontiguousarray(rowok, dtype=np.int32)
    split = lib.host_qmm_split_i8d if dense else lib.host_qmm_split_i8
    split(T * (Kc // 64), 1, _p(X), Kc, T, Kc, None if ok is None else _p(ok), _p(hi), _p(lo), _p(sc), _p(qs))
    return hi, lo, sc, qs


def i8_values(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """q [T, K] (int) from the byte planes, undoing the word order (word w of a block: bytes i = values 16 (w >> 2) +
    4 i + (w & 3))."""
    q = hi.view(np.int8).astype(np.int64) * 256 + lo.astype(np.int64)
    T, Kc = q.shape
    w = q.reshape(T, Kc // 64, 4, 4, 4)  # [t, block, G, r, i]: value 16 G + 4 i + r
    return w.transpose(0, 1, 2, 4, 3).reshape(T, Kc)


def test_split_i8_is_16_bit_fixed_point_per_block(lib):
    """qmm_split_i8: q within 1/2 (plus float rounding) of x / s for s = max |block| / 32767, |q| <= 32767 and the
    block's largest value at +-32767, the block sums exact; an all-zero block gets s = 0, a block with inf or NaN
    s = NaN and q = 0; rows with rowok < 0 are not written."""
    rng = np.random.default_rng(11)
    T, Kc = 7, 320
    X = acts(rng, T, Kc)
    X[2] = 0.0
    X[2, 70] = 1e-38  # one tiny value in a block of zeros (subnormal range of the scale)
    X[4, 130] = np.inf
    X[5, 10] = np.nan
    hi, lo, sc, qs = split_i8_host(lib, X)
    q = i8_values(hi, lo)
    nb = Kc // 64
    for t in range(T):
        for b in range(nb):
            xb = X[t, 64 * b:64 * b + 64].astype(np.float64)
            qb = q[t, 64 * b:64 * b + 64]
            if not np.all(np.isfinite(xb)):
                assert np.isnan(sc[t, b]) and np.all(qb == 0) and qs[t, b] == 0
                continue
            m = np.abs(xb).max()
            assert sc[t, b] == np.float32(np.float32(m) / np.float32(32767.0))
            assert qs[t, b] == qb.sum() and np.abs(qb).max() <= 32767
            if m == 0:
                assert np.all(qb == 0)
                continue
            assert np.abs(qb[np.argmax(np.abs(xb))]) == 32767
            assert np.all(np.abs(qb - xb / (m / 32767.0)) <= 0.5 + 1e-3)
    ok = np.array([0, -1, 3, -1, 0, 0, 0], np.int32)
    hi2, lo2, sc2, qs2 = split_i8_host(lib, X, ok)
    keep = ok >= 0
    assert np.all(hi2[~keep] == 0xAB) and np.all(sc2[~keep] == -7.0) and np.all(qs2[~keep] == 7777)
    assert np.array_equal(hi2[keep], hi[keep]) and np.array_equal(lo2[keep], lo[keep])
    assert np.array_equal(qs2[keep], qs[keep])


def test_mma_i8_fragments_on_host(lib):
    """The integer jobs on inputs whose products name their place: one expert, one token, one row of weights with a
    single code 2 (weight 1) at value k and 1 (weight 0) elsewhere, and x = e_k' scaled: the output is nonzero only
    when k = k' (a wrong pairing of A's and B's k-slots fails)."""
    hidden, ff = 128, 16
    for k in (0, 5, 17, 38, 63, 64, 100, 127):
        g = np.zeros((ff * hidden // 64, 18), np.uint8)
        g[:, :2] = np.array([1.0], np.float16).view(np.uint8)
        g[:, 2:] = 0x55  # every code 1: weight 0
        blk, j = divmod(k, 64)
        qsb = int(g[blk, 2 + j // 4])  # row 0 of gate: code 2 at value k
        g[blk, 2 + j // 4] = (qsb & (0xFF ^ (3 << (2 * (j % 4))))) | (2 << (2 * (j % 4)))
        u = g.copy()
        dn = np.zeros((hidden * ff // 64, 18), np.uint8)
        dn[:, :2] = np.array([1.0], np.float16).view(np.uint8)
        dn[:, 2:] = 0xAA  # every code 2: weight 1
        blob = np.concatenate([g.reshape(-1), u.reshape(-1), dn.reshape(-1)])
        ptr = np.array([blob.ctypes.data], np.uint64)
        for kk in (k, (k + 1) % hidden, k ^ 4, k ^ 16):
            X = np.zeros((1, hidden), np.float32)
            X[0, kk] = 3.0
            xq = split_i8_host(lib, X)
            tok = np.array([0] + [-1] * 7, np.int32)
            hbuf = np.zeros((8, ff), np.float32)
            with shared_within(lib, Q.smem_bytes_i8(1, hidden)):
                lib.host_qmm_moe_gu_i8_8(1, 1, _p(ptr), _p(tok), *(_p(a) for a in xq), _p(hbuf), hidden, ff)
            want = 3.0 / (1.0 + np.exp(-3.0)) * 3.0 if kk == k else 0.0
            assert abs(hbuf[0, 0] - want) <= 1e-4 * max(1.0, want), (k, kk, hbuf[0, 0])
            assert np.all(hbuf[0, 1:] == 0.0)


@pytest.mark.parametrize("hidden,ff,T,E,k,jt", [(192, 128, 21, 5, 3, 16), (192, 128, 13, 5, 3, 8),
                                                (320, 192, 41, 5, 3, 32), (640, 320, 9, 4, 2, 8),
                                                (640, 704, 9, 4, 2, 16), (640, 192, 11, 4, 2, 32)])
@pytest.mark.parametrize("kc", [Q.KC, 256])
def test_moe_jobs_i8_match_float64(request, hidden, ff, T, E, k, jt, kc):
    """The integer Q2_0 expert jobs against float64 per pair, within the bound of 16-bit fixed point per block of 64
    (each value off by at most s / 2) plus float32 sums: gate/up with the silu epilogue, then down from the hidden
    rows' own split (the empty slots' rows, NaN here, left out by rowok); k in one chunk, several, a partial last; the
    host build's chunk (128 values) and the device's default for these jobs (256)."""
    lib = request.getfixturevalue("lib" if kc == Q.KC else "lib256")
    tt = jt
    blobs, mats, ids, ptr, (je, jt_, jd), X = job_case(np.random.default_rng(hidden + T + jt), "Q2_0", E, hidden, ff,
                                                       T, k, tt)
    J = je.size
    X[2, 5] = 300.0  # an outlier: its block's other values keep fewer bits
    xq = split_i8_host(lib, X)
    hbuf = np.full((J * tt, ff), np.nan, dtype=np.float32)
    with shared_within(lib, Q.smem_bytes_i8(tt // 8, hidden, kc)):
        getattr(lib, f"host_qmm_moe_gu_i8_{tt}")(-(-ff // 16), J, _p(ptr), _p(jt_), *(_p(a) for a in xq), _p(hbuf),
                                                 hidden, ff)
    used = jt_ >= 0
    assert np.all(np.isfinite(hbuf[used])) and np.all(np.isnan(hbuf[~used]))
    hq = split_i8_host(lib, hbuf, jd)
    out = np.full((T * k, hidden), np.nan, dtype=np.float32)
    doff = 2 * (ff * hidden // 64) * 18
    with shared_within(lib, Q.smem_bytes_i8(tt // 8, ff, kc)):
        getattr(lib, f"host_qmm_moe_down_i8_{tt}")(-(-hidden // 16), J, _p(ptr), doff, _p(jd), *(_p(a) for a in hq),
                                                   _p(out), hidden, ff)

    for t in range(T):
        x = X[t].astype(np.float64)
        for r in range(k):
            g, u, dn = mats[ids[t, r]]
            slot = int(np.nonzero(jd == t * k + r)[0][0])
            check_i8_pair(g, u, dn, x, hbuf[slot], out[t * k + r])
    # and the activations were rounded (the bound above is not met by an exact float64 product alone)
    x = X[0].astype(np.float64)
    g = mats[ids[0, 0]][0]
    slot = int(np.nonzero(jd == 0)[0][0])
    assert np.max(np.abs(hbuf[slot] - _silu_np(g @ x) * (mats[ids[0, 0]][1] @ x))) > 0


@pytest.mark.parametrize("hidden,ff,T,E,k,jt", [(192, 128, 21, 5, 3, 16), (320, 192, 41, 5, 3, 32),
                                                (640, 320, 9, 4, 2, 8), (640, 704, 9, 4, 2, 16)])
@pytest.mark.parametrize("st,rkc,pad", Q.JOBS_RING_HOST)
def test_moe_jobs_i8_ring_is_qi8_tile_bit_for_bit(lib, hidden, ff, T, E, k, jt, st, rkc, pad):
    """The integer jobs with their weights through the ring (qi8r_tile: each row's chunk copied as the 16-byte pieces
    that cover it from any even offset) compute qi8_tile's products in its order: the same float32 bits, gate/up and
    down, for rows whose chunks start at every even offset mod 16 (rows of 54, 90, 180 or 198 bytes), a partial last
    chunk (704 / 64 = 11 blocks), rows that do not fill a block's warps; the ring's shared memory as the launcher
    asks."""
    blobs, mats, ids, ptr, (je, jt_, jd), X = job_case(np.random.default_rng(hidden + T + 3 * jt), "Q2_0", E, hidden,
                                                       ff, T, k, jt)
    assert all(b.ctypes.data % 16 == 0 for b in blobs)  # (the pieces' aligned starts lie in the blob's own granules)
    J = je.size
    xq = split_i8_host(lib, X)
    doff = 2 * (ff * hidden // 64) * 18
    got = []
    for ring in (None, (st, rkc, pad)):
        sfx = "" if ring is None else f"_{st}_{rkc}_{pad}"
        hbuf = np.full((J * jt, ff), np.nan, dtype=np.float32)
        with shared_within(lib, Q.smem_bytes_i8(jt // 8, hidden, Q.KC, ring, 2, warps=1)):
            getattr(lib, f"host_qmm_moe_gu_i8_{jt}{sfx}")(-(-ff // 16), J, _p(ptr), _p(jt_), *(_p(a) for a in xq),
                                                          _p(hbuf), hidden, ff)
        hq = split_i8_host(lib, hbuf, jd)
        out = np.full((T * k, hidden), np.nan, dtype=np.float32)
        with shared_within(lib, Q.smem_bytes_i8(jt // 8, ff, Q.KC, ring, 1, warps=1)):
            getattr(lib, f"host_qmm_moe_down_i8_{jt}{sfx}")(-(-hidden // 16), J, _p(ptr), doff, _p(jd),
                                                            *(_p(a) for a in hq), _p(out), hidden, ff)
        got.append((hbuf, out))
    used = jt_ >= 0
    assert np.all(np.isfinite(got[0][0][used])) and np.all(np.isfinite(got[0][1]))
    assert np.array_equal(got[0][0][used], got[1][0][used]) and np.all(np.isnan(got[1][0][~used]))
    assert np.array_equal(got[0][1], got[1][1])


def _i8_jobs(lib, sfx, jt, ptr, job_tok, job_dst, xq, J, T, k, hidden, ff, ring):
    """gate/up (table jobs), split and down of the host build's integer jobs: (hbuf [J jt, ff], out [T k, hidden])."""
    hbuf = np.full((J * jt, ff), np.nan, dtype=np.float32)
    with shared_within(lib, Q.smem_bytes_i8(jt // 8, hidden, Q.KC, ring, 2, warps=1)):
        getattr(lib, f"host_qmm_moe_gu_i8_{jt}{sfx}")(-(-ff // 16), J, _p(ptr), _p(job_tok), *(_p(a) for a in xq),
                                                      _p(hbuf), hidden, ff)
    return hbuf, _i8_down(lib, sfx, jt, ptr, job_dst, hbuf, J, T, k, hidden, ff, ring)


def _i8_down(lib, sfx, jt, ptr, job_dst, hbuf, J, T, k, hidden, ff, ring):
    out = np.full((T * k, hidden), np.nan, dtype=np.float32)
    hq = split_i8_host(lib, hbuf, job_dst)  # (held: the kernel reads the planes through raw pointers)
    with shared_within(lib, Q.smem_bytes_i8(jt // 8, ff, Q.KC, ring, 1, warps=1)):
        getattr(lib, f"host_qmm_moe_down_i8_{jt}{sfx}")(-(-hidden // 16), J, _p(ptr), 2 * (ff * hidden // 64) * 18,
                                                        _p(job_dst), *(_p(a) for a in hq), _p(out), hidden, ff)
    return out


def test_jobs_ring_switch(monkeypatch):
    """STRATATOOLS_QMM_JOBS_RING: the default ring unless 0, S:RKC from JOBS_RINGS, other values refused; the stage's
    bytes as qmm.cu's QI8Ring (rows of 16-byte pieces covering 4 blocks of 18 bytes from any even offset: 6 pieces)."""
    monkeypatch.delenv(Q.JOBS_RING_ENV, raising=False)
    assert Q.jobs_ring() == Q.JOBS_RING_DEFAULT
    monkeypatch.setenv(Q.JOBS_RING_ENV, "0")
    assert Q.jobs_ring() is None
    monkeypatch.setenv(Q.JOBS_RING_ENV, "4:128")
    assert Q.jobs_ring() == (4, 128, 16)
    monkeypatch.setenv(Q.JOBS_RING_ENV, "3:256:0")
    assert Q.jobs_ring() == (3, 256, 0)
    for bad in ("3:64", "3", "a:b", "-3:256"):
        monkeypatch.setenv(Q.JOBS_RING_ENV, bad)
        with pytest.raises(StrataError, match=Q.JOBS_RING_ENV):
            Q.jobs_ring()
    assert Q.jobs_ring_stage_bytes(1, 2, 256) == 2 * 64 * (6 * 16 + 16) + 2 * 8 * 320
    assert Q.jobs_ring_stage_bytes(1, 2, 256, pad=0) == 2 * 64 * 6 * 16 + 2 * 8 * 320
    assert Q.smem_bytes_i8(1, 2560, 256, (3, 256, 16), 2) == 3 * Q.jobs_ring_stage_bytes(1, 2, 256) + 8 * 40 * 8
    # (the gate/up kernel of jobs of 8 at 3 x 256: 3 blocks a SM of 228 KB with the padding, 4 without)
    assert 228 * 1024 // (Q.smem_bytes_i8(1, 2560, 256, (3, 256, 16), 2) + 1024) == 3
    assert 228 * 1024 // (Q.smem_bytes_i8(1, 2560, 256, (3, 256, 0), 2) + 1024) == 4


@pytest.mark.parametrize("T,k,E,seed", [(32, 10, 64, 1), (5, 3, 7, 2), (1, 4, 300, 3), (40, 2, 3, 4),
                                        (512, 10, 256, 5), (1, 1, 1, 6), (33, 7, 12288, 7)])
@pytest.mark.parametrize("jt", [8, 16, 32])
def test_qmm_jobs_match_expert_jobs(lib, T, k, E, seed, jt):
    """The device-built job table (qmm_jobs) = expert_jobs' for the first J jobs (jobs of jt tokens), blob addresses
    from the layer's row; the spare jobs up to job_capacity are empty with expert 0's address. An expert with more
    than one job's pairs and experts with none are in every case but one."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:k] if k <= E else rng.integers(0, E, k) for _ in range(T)]).astype(np.int32)
    if T > 16:
        ids[:, 0] = 1  # 1 gets a pair of every token: two jobs or more
    N = ids.size
    ptr_row = (np.arange(E, dtype=np.uint64) * 4096 + 0x1000).astype(np.uint64)
    J = Q.job_capacity(N, E, jt)
    assert J == -(-N // jt) + min(E, N)
    jp = np.zeros(J, np.uint64)
    tok = np.full(J * jt, 7777, np.int32)
    dst = np.full(J * jt, 7777, np.int32)
    assert Q.device_jobs_ok(N, E)
    with shared_within(lib, Q.jobs_shared(N, E)):
        lib.host_qmm_jobs(1, 1, _p(ids.reshape(-1)), N, k, E, _p(ptr_row), J, jt, _p(jp), _p(tok), _p(dst))
    je, rt, rd = expert_jobs(ids, jt)
    n = je.size
    assert n <= J
    assert np.array_equal(jp[:n], ptr_row[je]) and np.array_equal(tok[:n * jt], rt) and np.array_equal(dst[:n * jt], rd)
    assert np.all(jp[n:] == ptr_row[0]) and np.all(tok[n * jt:] == -1) and np.all(dst[n * jt:] == -1)


def test_job_sizes_from_the_environment(monkeypatch):
    """STRATATOOLS_PREFILL_JOB / STRATATOOLS_BATCH_JOB: 8, 16 or 32 (default 16); another value, or another size asked
    for, is refused."""
    monkeypatch.delenv(Q.JOB_ENV, raising=False)
    assert Q.job_tokens() == Q.JOB_DEFAULT == 16 and Q.job_tokens(32) == 32
    monkeypatch.setenv(Q.JOB_ENV, "32")
    assert Q.job_tokens() == 32 and Q.job_tokens(16) == 16
    for bad in ("24", "３２", "x"):
        monkeypatch.setenv(Q.JOB_ENV, bad)
        with pytest.raises(StrataError, match=Q.JOB_ENV):
            Q.job_tokens()
    with pytest.raises(StrataError, match="12 tokens"):
        Q.job_tokens(12)
    monkeypatch.delenv(Q.JOB_ENV)
    monkeypatch.setenv(Q.BATCH_JOB_ENV, "32")
    assert Q.job_tokens(batch=True) == 32 and Q.job_tokens() == 16
    monkeypatch.delenv(Q.BATCH_JOB_ENV)
    assert Q.job_tokens(batch=True) == Q.BATCH_JOB_DEFAULT == 8


def test_moe_job_kernels_skip_empty_jobs(lib):
    """Jobs whose first slot is empty (qmm_jobs' spares) are skipped before any weight is read: their blob address
    here is null, which the host build would crash on; the real jobs' results are those without the spares."""
    rng = np.random.default_rng(5)
    tname, hidden, ff, T, E, k = "Q2_0", 128, 64, 9, 4, 2
    f = Q.LAYOUTS[tname]
    blobs = [np.concatenate([blocks(rng, tname, ff, hidden), blocks(rng, tname, ff, hidden), blocks(rng, tname, hidden, ff)])
             for _ in range(E)]
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    je, jt, jd = expert_jobs(ids, Q.JOB_TOKENS)
    X = rng.standard_normal((T, hidden)).astype(np.float32)
    xh, xl, xs = split_host(lib, X)
    outs = []
    for spare in (0, 3):
        J = je.size + spare
        ptr = np.array([blobs[e].ctypes.data for e in je] + [0] * spare, dtype=np.uint64)
        t2 = np.concatenate([jt, np.full(spare * 16, -1, np.int32)])
        d2 = np.concatenate([jd, np.full(spare * 16, -1, np.int32)])
        hbuf = np.zeros((J * 16, ff), dtype=np.float32)
        getattr(lib, f"host_qmm_moe_gu_{f}_16")(-(-ff // 16), J, _p(ptr), _p(t2), _p(xh), _p(xl), _p(xs), _p(hbuf),
                                               hidden, ff)
        hh, hl, hs = split_host(lib, hbuf)
        out = np.full((T * k, hidden), np.nan, dtype=np.float32)
        doff = 2 * (ff * hidden // Q.BLOCK_VALUES[f]) * Q.BLOCK_BYTES[f]
        getattr(lib, f"host_qmm_moe_down_{f}_16")(-(-hidden // 16), J, _p(ptr), doff, _p(d2), _p(hh), _p(hl), _p(hs),
                                                  _p(out), hidden, ff)
        assert np.all(np.isfinite(out))
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])


# ---- the Python launchers and the prefill's mma paths, run on the host kernels through a stand-in for CuPy --------
class HostArr(np.ndarray):
    """A numpy array that answers ``.data.ptr`` as a CuPy array does (its host address)."""

    @property
    def data(self):
        from types import SimpleNamespace

        return SimpleNamespace(ptr=self.ctypes.data)


def _h(a, dtype=None):
    return np.ascontiguousarray(np.asarray(a, dtype=dtype)).view(HostArr)


def _fake_cupy():
    from types import SimpleNamespace

    return SimpleNamespace(
        float32=np.float32, uint16=np.uint16, uint8=np.uint8, int32=np.int32, uint64=np.uint64, nan=np.nan,
        asarray=lambda a, dtype=None: _h(np.array(a, dtype=dtype)),
        ascontiguousarray=lambda a, dtype=None: _h(a, dtype),
        empty=lambda shape, dtype=np.float32: _h(np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 0xAB, dtype)),
        zeros=lambda shape, dtype=np.float32: _h(np.zeros(shape, dtype)),
        sum=lambda a, axis=None, out=None: np.sum(a, axis=axis, out=out),
        cuda=SimpleNamespace(Device=lambda: SimpleNamespace(id=0), get_current_stream=lambda: SimpleNamespace(ptr=0)))


@pytest.fixture
def hostcp(lib, monkeypatch):
    """qmm's kernels looked up as the host build's entries (a device block of 4 warps = 4 host blocks of one warp),
    CuPy replaced by numpy arrays with ``.data.ptr``."""
    import sys

    def fn(name, kc=Q.KC):
        assert kc == Q.KC  # (the host build is made with the default chunk)
        base, _, targs = name.partition("<")
        entry = "host_" + base + "".join("_" + p.strip() for p in targs.rstrip(">").split(",") if p.strip())
        f = getattr(lib, entry)

        def launch(grid, block, args, shared_mem=0):
            assert shared_mem <= 228 * 1024 and shared_mem <= getattr(launch, "max_dynamic_shared_size_bytes",
                                                                       48 * 1024)
            gx, gy = grid[0], (grid[1] if len(grid) > 1 else 1)
            if base in ("qmm_split_i8", "qmm_split_i8d", "qmm_hc_mix_split"):
                gx *= block[0] // 16  # a block of 64 values: 16 threads on the device, one host block
            elif base in ("qmm_sum_slices", "qmm_sum_act"):
                gx *= block[0] // Q.SUM_GROUP  # a run of 4 values: SUM_GROUP threads on the device
            elif base == "qmm_act_rows":
                gx *= block[0]  # a value a thread
            elif base == "qmm_dense_ring":  # 16 rows a warp of one of the KG groups (the host's warp plays all)
                gx *= block[0] // 32 // int(targs.rstrip(">").split(",")[3])
            elif base not in ("qmm_split", "qmm_jobs", "qmm_hc_norm_split", "qmm_sum_act_split", "qmm_sum_hc"):
                gx *= block[0] // 32  # rows: 16 per warp on the device, 16 per host block
            with shared_within(lib, shared_mem):  # the bytes the launcher asks the device for
                f(gx, gy, *[a.ctypes.data if isinstance(a, np.ndarray) else (a.item() if isinstance(a, np.generic) else a)
                            for a in args])
        return launch

    fake = _fake_cupy()
    monkeypatch.setattr(Q, "_new_counters", lambda cp, n: _h(np.zeros(n, np.int32)))  # (no device memory here)
    monkeypatch.setenv(Q.MOE_KC_ENV, str(Q.KC))  # the host build's chunk (Q2_0 jobs default to 256 on the device)
    monkeypatch.delenv(Q.KC_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(Q, "_fn", fn)
    monkeypatch.setattr(Q, "_ring_fn", lambda name, cfg: Q._fn(name))  # (read at call time: the tests' wrappers see it)
    monkeypatch.setenv(Q.RING_ENV, "4:64")  # a ring the host build has (RING_HOST)
    monkeypatch.setenv(Q.DENSE_I8_ENV, "0")  # (the fp16 ring; the tests of the integer ring set theirs)
    monkeypatch.setattr(Q, "_jobs_ring_fn", lambda name, cfg: Q._fn(name))
    monkeypatch.setenv(Q.JOBS_RING_ENV, "3:256")  # (JOBS_RING_HOST, padding 16)
    monkeypatch.setattr(K, "_device_limits", lambda: (132, 228 * 1024))
    return fake


def kernels_asked(monkeypatch) -> list:
    """The names of the kernels qmm's launchers look up from now on (through the ``hostcp`` stand-in), in order."""
    asked: list = []
    fn = Q._fn
    monkeypatch.setattr(Q, "_fn", lambda name, kc=Q.KC: asked.append(name) or fn(name, kc))
    return asked


@pytest.mark.parametrize("layout,T,two,sm,rg", [
    ("Q8R", 1, "0", "0", "0"), ("Q8R", 70, "0", "0", "4:64"), ("Q8_0", 20, "0", "0", "4:64"),
    ("Q2_0", 33, "0", "0", "4:64"), ("Q8R", 70, "1", "0", "4:64"), ("Q2_0", 33, "1", "0", "4:64"),
    ("Q8R", 1, "0", "1", "0"), ("Q8_0", 20, "0", "1", "4:64"), ("Q2_0", 7, "0", "1", "4:64"),
    ("Q8R", 1, "0", "1", "4:64"), ("Q8R", 20, "0", "0", "3:128"), ("Q8R", 32, "0", "1", "2:64"),
    ("Q8R", 32, "0", "1", "2:64:2"), ("Q8R", 9, "0", "0", "2:64:2")])
def test_dense_launcher_on_host(hostcp, layout, T, two, sm, rg, monkeypatch):
    """qmm.dense / qmm.split: argument order and grid as the device launch has them (rows of 4 warps), against
    float64; with STRATATOOLS_QMM_DENSE2=1 and 128 rows the two-tile kernel runs (its name asked for); with
    STRATATOOLS_QMM_SUM=1 the split of k's slices (up to 32 tokens) is added by qmm_sum_slices (asked for); Q8R up to
    32 tokens takes the ring (STRATATOOLS_QMM_RING) where K is whole chunks of it (192: not of 128)."""
    monkeypatch.setenv(Q.DENSE2_ENV, two)
    monkeypatch.setenv(Q.SUM_ENV, sm)
    monkeypatch.setenv(Q.RING_ENV, rg)
    asked = kernels_asked(monkeypatch)
    rng = np.random.default_rng(T)
    rows, cols = (128 if two == "1" else 70), 192
    tname = "Q2_0" if layout == "Q2_0" else "Q8_0"
    raw = blocks(rng, tname, rows, cols)
    W = wmat(raw, tname, rows, cols)
    X = acts(rng, T, cols)
    if layout == "Q8R":
        q, d = K.q8_relayout(raw, rows, cols)
        Y = Q.dense(_h(X), "Q8R", _h(q), _h(d), rows, cols)
    else:
        Y = Q.dense(_h(X), tname, _h(raw), None, rows, cols)
    check(np.asarray(Y), W, X)
    assert any(n.startswith("qmm_dense<") and n.count(",") == 2 for n in asked) == (two == "1")
    rung = layout == "Q8R" and rg != "0" and T <= 32 and cols % int(rg.split(":")[1]) == 0
    assert any(n.startswith("qmm_dense_ring<") for n in asked) == rung
    cfg = tuple(int(v) for v in rg.split(":")) + ((1,) if rg.count(":") == 1 else ())
    assert (f"qmm_dense_ring<{Q.token_tile(T)}, {', '.join(map(str, cfg))}, 0>" in asked) == rung
    kc = int(rg.split(":")[1]) if rung else Q.KC
    nz = Q.dense_launch(T, rows, cols, tname if layout != "Q8R" else "Q8R", 132, kc)[3]
    assert ("qmm_sum_slices" in asked) == (sm == "1" and nz > 1 and T <= 32)
    assert sm == "0" or T > 32 or nz > 1  # (every SUM case splits k)
    with pytest.raises(StrataError, match="weight bytes"):
        Q.dense(_h(X), tname if layout != "Q8R" else "Q8_0", _h(raw[:-2]), None, rows, cols)
    with pytest.raises(StrataError, match="do not match"):
        Q.dense(_h(X[:, :64]), "Q8_0", _h(raw), None, rows, cols)


def test_dense_i8_switch(monkeypatch):
    """STRATATOOLS_QMM_DENSE_I8: the default integer ring unless 0; S:RKC[:KG] from DENSE_I8_RINGS (chunks of whole
    blocks of 64, groups that split a stage's Q8R blocks evenly, the groups' sums within the ring's memory); other
    values refused naming the variable."""
    monkeypatch.delenv(Q.DENSE_I8_ENV, raising=False)
    assert Q.dense_i8() == Q.DENSE_I8_DEFAULT
    monkeypatch.setenv(Q.DENSE_I8_ENV, "0")
    assert Q.dense_i8() is None
    monkeypatch.setenv(Q.DENSE_I8_ENV, "3:128:4")
    assert Q.dense_i8() == (3, 128, 4) and Q.dense_i8(2560) == (3, 128, 4)
    assert Q.dense_i8(320) == Q.DENSE_I8_SMALL  # (K = 320: whole blocks of 64, not chunks of 128)
    monkeypatch.setenv(Q.DENSE_I8_ENV, "0")
    assert Q.dense_i8(320) is None
    assert Q.DENSE_I8_SMALL in Q.DENSE_I8_RINGS and Q.DENSE_I8_SMALL[1] == 64
    for bad in ("5:64", "2:256:2", "x", "4:64:3", "4:32"):
        monkeypatch.setenv(Q.DENSE_I8_ENV, bad)
        with pytest.raises(StrataError, match=Q.DENSE_I8_ENV):
            Q.dense_i8()
    assert all(rkc % 64 == 0 and rkc // 32 % kg == 0 for _, rkc, kg in Q.DENSE_I8_RINGS)
    assert all((kg - 1) * 4 * 32 * nt * 4 * 4 <= s * Q.ring_stage_bytes(nt, rkc, i8=True)
               for s, rkc, kg in Q.DENSE_I8_RINGS for nt in Q.TILES[:2])
    # the device's stage at 4 warps, NT 4, 64 values: codes and scales 64 x (96 + 4), block scales 32 x 4, planes
    # 2 x 32 x 96
    assert Q.ring_stage_bytes(4, 64, i8=True) == 64 * 100 + 128 + 6144


@pytest.mark.parametrize("T,i8,cols,ringed", [(32, "4:64:2", 640, "4, 64, 2"), (9, "4:64:2", 640, "4, 64, 2"),
                                              (32, "3:128:2", 640, "3, 128, 2"), (20, "3:128:2", 320, "4, 64, 2"),
                                              (33, "4:64:2", 640, ""), (32, "0", 640, "")])
def test_dense_launcher_takes_the_integer_ring_on_host(hostcp, T, i8, cols, ringed, monkeypatch):
    """qmm.dense for Q8R up to 32 tokens with STRATATOOLS_QMM_DENSE_I8 set: the integer ring's instance (for K not
    whole chunks of the ring, DENSE_I8_SMALL's) and qmm_split_i8d asked for (within the fixed point's bound of
    float64; a split_kind "i8d" split passed in is used, not made again); with 0 or longer X the fp16 path
    (qmm_split), within 2e-6."""
    monkeypatch.setenv(Q.DENSE_I8_ENV, i8)
    asked = kernels_asked(monkeypatch)
    rng = np.random.default_rng(T + 3)
    rows = 70
    W, q, d, X = q8r_case(rng, rows, cols, T)
    Y = np.asarray(Q.dense(_h(X), "Q8R", _h(q), _h(d), rows, cols))
    name = f"qmm_dense_ring<{Q.token_tile(T)}, {ringed}, 1>"
    ringed = bool(ringed)
    assert (name in asked) == ringed and ("qmm_split_i8d" in asked) == ringed and ("qmm_split" in asked) != ringed
    assert sum(n.startswith("qmm_dense") for n in asked) == 1
    if ringed:
        check_i8(Y, W, X)
        assert Q.split_kind("Q8R", T, cols, _h(q), _h(d)) == "i8d"
        xs = Q.split_i8(_h(X), dense=True)
        assert isinstance(xs, Q.DensePlanes)
        asked.clear()
        assert np.array_equal(np.asarray(Q.dense(_h(X), "Q8R", _h(q), _h(d), rows, cols, xs=xs)), Y)
        assert name in asked and not any(n.startswith("qmm_split") for n in asked)
        asked.clear()  # an fp16 split given to the integer ring is not used: X is split again, its own way
        Q.dense(_h(X), "Q8R", _h(q), _h(d), rows, cols, xs=Q.split(_h(X)))
        assert [n for n in asked if n.startswith("qmm_split")] == ["qmm_split", "qmm_split_i8d"] and name in asked
    else:
        check(Y, W, X)
        assert Q.split_kind("Q8R", T, cols, _h(q), _h(d)) == "f16"


@pytest.mark.parametrize("wg", [8, 2])
@pytest.mark.parametrize("i8,ring,name", [("3:128:2", "0", "qmm_dense_ring<4, 3, 128, 2, 1, {}>"),
                                          ("0", "4:64:2", "qmm_dense_ring<4, 4, 64, 2, 0, {}>")])
def test_ring_warps_launch_on_host(hostcp, i8, ring, name, wg, monkeypatch):
    """STRATATOOLS_QMM_RING_WARPS=8 / 2: both rings launched with groups of 8 or 2 warps (128 or 32 rows a block,
    half or twice the row blocks of 4 warps' grid, wg warps x KG threads, the stages' shared memory for those rows),
    the instance named with its warps, the result as with 4 warps (within its bound of float64)."""
    name = name.format(wg)
    monkeypatch.setenv(Q.DENSE_I8_ENV, i8)
    monkeypatch.setenv(Q.RING_ENV, ring)
    monkeypatch.setenv(Q.RING_WARPS_ENV, str(wg))
    rng = np.random.default_rng(8)
    rows, cols, T = 300, 640, 32
    W, q, d, X = q8r_case(rng, rows, cols, T)
    launches = []
    fn = Q._fn

    def spy(name_, kc=Q.KC):
        f = fn(name_, kc)

        def launch(grid, block, args, shared_mem=0):
            launches.append((name_, tuple(grid), tuple(block), shared_mem))
            if hasattr(launch, "max_dynamic_shared_size_bytes"):  # (what launch_big_shared set, for the stand-in)
                f.max_dynamic_shared_size_bytes = launch.max_dynamic_shared_size_bytes
            return f(grid, block, args, shared_mem)
        return launch

    monkeypatch.setattr(Q, "_fn", spy)
    Y = np.asarray(Q.dense(_h(X), "Q8R", _h(q), _h(d), rows, cols))
    (check_i8 if i8 != "0" else check)(Y, W, X)
    ring_l = [x for x in launches if x[0].startswith("qmm_dense_ring")]
    assert [x[0] for x in ring_l] == [name]
    cfg = tuple(int(v) for v in (i8 if i8 != "0" else ring).split(":"))
    _, grid, block, smem = ring_l[0]
    assert grid[0] == -(-rows // (16 * wg)) and block == (wg * 32 * cfg[2],)
    assert smem == cfg[0] * Q.ring_stage_bytes(4, cfg[1], wg, i8 != "0")
    assert grid[1] == Q.dense_launch(T, rows, cols, "Q8R", 132, cfg[1], 16 * wg)[2]


def test_dense_ring_only_for_aligned_codes_on_host(hostcp, monkeypatch):
    """Q8R codes at an address 8 mod 16 (dense accepts 8-byte alignment) do not go through the ring's 16-byte copies:
    qmm_dense takes them, with the same result."""
    asked = kernels_asked(monkeypatch)
    rng = np.random.default_rng(5)
    rows, cols, T = 40, 192, 9
    W, q, d, X = q8r_case(rng, rows, cols, T)
    buf = _h(np.zeros(rows * cols + 16, dtype=np.int8))
    off = (8 - buf.ctypes.data % 16) % 16
    w8 = buf[off:off + rows * cols]
    w8[:] = q.reshape(-1)
    assert w8.ctypes.data % 16 == 8
    Y = Q.dense(_h(X), "Q8R", w8, _h(d), rows, cols)
    check(np.asarray(Y), W, X)
    assert not any(n.startswith("qmm_dense_ring") for n in asked) and "qmm_dense<0, 2>" in asked
    asked.clear()
    check(np.asarray(Q.dense(_h(X), "Q8R", _h(q), _h(d), rows, cols)), W, X)
    assert any(n.startswith("qmm_dense_ring") for n in asked)


@pytest.mark.parametrize("jt,rg,ringed", [(8, "3:256", True), (16, "3:256", False), (8, "0", False)])
def test_job_launchers_take_the_ring_for_small_jobs_on_host(hostcp, jt, rg, ringed, monkeypatch):
    """qmm.moe_gate_up_i8 / moe_down_i8: jobs of up to JOBS_RING_MAX_JT tokens take the ring's instances (the names
    asked for, the shared memory the ring needs), longer jobs and STRATATOOLS_QMM_JOBS_RING=0 the register path; the
    outputs the same bits either way."""
    asked = kernels_asked(monkeypatch)
    hidden, ff, T, E, k = 192, 128, 13, 5, 3
    blobs, _, _, ptr, (je, jtok, jd), X = job_case(np.random.default_rng(jt), "Q2_0", E, hidden, ff, T, k, jt)
    outs = []
    for env in (rg, "0"):
        monkeypatch.setenv(Q.JOBS_RING_ENV, env)
        hbuf = _h(np.full((je.size * jt, ff), np.nan, dtype=np.float32))
        Q.moe_gate_up_i8(_h(ptr), _h(jtok), Q.split_i8(_h(X)), hbuf, hidden, ff, jt)
        out = _h(np.full((T * k, hidden), np.nan, dtype=np.float32))
        Q.moe_down_i8(_h(ptr), 2 * (ff * hidden // 64) * 18, _h(jd), Q.split_i8(hbuf, _h(jd)), out, hidden, ff, jt)
        outs.append((np.asarray(hbuf)[jtok >= 0], np.asarray(out)))
    assert np.all(np.isfinite(outs[0][1]))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    names = [n for n in asked if n.startswith("qmm_moe")]
    assert (f"qmm_moe_gu_i8<{jt}, 3, 256, 16>" in names and f"qmm_moe_down_i8<{jt}, 3, 256, 16>" in names) == ringed
    assert f"qmm_moe_gu_i8<{jt}>" in names and f"qmm_moe_down_i8<{jt}>" in names
    del blobs


@pytest.mark.parametrize("n,nz", [(4 * 320, 40), (4 * 7, 1), (130, 9), (4 * 33, 64)])
def test_sum_slices_adds_in_slice_order(lib, n, nz):
    """qmm_sum_slices: Y = the nz slices of P added in order z = 0 .. nz - 1 (the host build's one thread a run: the
    same float32 sums as that loop in numpy, bit for bit), for runs of 4 values and for n not a multiple of 4; values
    past n untouched."""
    rng = np.random.default_rng(n + nz)
    P = rng.standard_normal((nz, n)).astype(np.float32)
    Y = np.full(n + 3, 7.0, np.float32)
    runs = n // 4 if n % 4 == 0 else n
    lib.host_qmm_sum_slices(runs + 2, 1, _p(P), _p(Y), n, nz)  # (two spare blocks: past the runs, nothing written)
    ref = np.zeros(n, np.float32)
    for z in range(nz):
        ref = ref + P[z]
    assert np.array_equal(Y[:n], ref) and np.all(Y[n:] == 7.0)


@pytest.mark.parametrize("T,R,K", [(32, 257, 2560), (1, 1, 4), (7, 33, 132), (32, 64, 128), (5, 40, 260)])
def test_f32_nt_slices_are_the_float32_products(lib, T, R, K):
    """qmm_f32_nt (the batched step's router): slice z of P [nz, T, R] is X[:, k] . W[:, k] over k in [128 z,
    128 (z + 1)) (rows past R, tokens past T and k past K read as zeros, nothing written outside P), each an fmaf chain
    in float32 (within a few ulps of the float64 products); qmm_sum_slices of the slices is X W^T; the same bits each
    run; whole blocks of 32 rows, partial ones, one token and 32."""
    rng = np.random.default_rng(T * 1000 + R + K)
    X = rng.standard_normal((T, K)).astype(np.float32)
    W = (0.05 * rng.standard_normal((R, K))).astype(np.float32)
    nz = -(-K // Q.F32_KS)
    gx = -(-R // Q.F32_ROWS)
    Pz = np.full((nz + 1, T, R), np.nan, np.float32)  # (a spare slice: must stay untouched)
    lib.host_qmm_f32_nt(gx, nz, _p(X), _p(W), _p(Pz), T, R, K)
    assert np.all(np.isnan(Pz[nz]))
    X64, W64 = X.astype(np.float64), W.astype(np.float64)
    for z in range(nz):
        ks = slice(z * Q.F32_KS, min(K, (z + 1) * Q.F32_KS))
        ref = X64[:, ks] @ W64[:, ks].T
        mag = np.abs(X64[:, ks]) @ np.abs(W64[:, ks]).T
        assert np.all(np.abs(Pz[z] - ref) <= 1e-6 * mag + 1e-30), z
    again = np.full_like(Pz, np.nan)
    lib.host_qmm_f32_nt(gx, nz, _p(X), _p(W), _p(again), T, R, K)
    assert np.array_equal(again[:nz], Pz[:nz])
    Y = np.zeros((T, R), np.float32)
    n = T * R
    lib.host_qmm_sum_slices(n // 4 if n % 4 == 0 else n, 1, _p(Pz), _p(Y), n, nz)  # (slices 0 .. nz - 1 of Pz)
    ref = X64 @ W64.T
    assert np.all(np.abs(Y - ref) <= 2e-6 * (np.abs(X64) @ np.abs(W64).T)), np.max(np.abs(Y - ref))


def test_f32_nt_refuses_what_it_does_not_take():
    """f32_nt_applies: float32 contiguous [T <= 32, K] and [R, K], K a multiple of 4, 16-byte aligned (numpy stands
    for CuPy: only shapes, dtypes, flags and addresses are read); f32_nt raises StrataError for anything else."""
    class Arr(np.ndarray):  # a numpy array with CuPy's .data.ptr
        @property
        def data(self):
            return types.SimpleNamespace(ptr=self.ctypes.data)

    def arr(shape, dtype=np.float32, off=0):
        buf = np.zeros(int(np.prod(shape)) + 8, dtype)
        a0 = (-buf.ctypes.data // buf.itemsize) % (16 // buf.itemsize)  # (first 16-byte aligned element)
        return buf[a0 + off:a0 + off + int(np.prod(shape))].reshape(shape).view(Arr)

    assert Q.f32_nt_applies(arr((32, 2560)), arr((257, 2560)))
    assert Q.f32_nt_applies(arr((1, 4)), arr((1, 4)))
    for X, W in ((arr((33, 2560)), arr((257, 2560))), (arr((4, 2562)), arr((9, 2562))), (arr((4, 64)), arr((9, 60))),
                 (arr((4, 64), np.float64), arr((9, 64))), (arr((4, 64), off=1), arr((9, 64))),
                 (arr((4, 64)), arr((9, 64), off=2)), (arr((4, 128))[:, ::2], arr((9, 64)))):
        assert not Q.f32_nt_applies(X, W)
        with pytest.raises(StrataError, match="f32_nt"):
            Q.f32_nt(X, W)


def _act_ref(y, act, div):
    """The activations of qmm.ACT_* in float64 (the kernels' float32 within a few ulps)."""
    a = y.astype(np.float64) / div
    with np.errstate(over="ignore"):
        sg = 1.0 / (1.0 + np.exp(-a))
    return {Q.ACT_NONE: y.astype(np.float64), Q.ACT_SILU: a * sg, Q.ACT_SIG2: 2.0 * sg}[act]


@pytest.mark.parametrize("act", [Q.ACT_NONE, Q.ACT_SILU, Q.ACT_SIG2])
@pytest.mark.parametrize("n,nz", [(4 * 320, 40), (130, 9)])
def test_sum_slices_applies_the_activation(lib, act, n, nz):
    """qmm_sum_act<ACT>: each sum (the same float32 sum as qmm_sum_slices') through silu(s / div) or 2 sigmoid(s /
    div) before it is stored; qmm_act_rows applies the same to a stored array."""
    rng = np.random.default_rng(n + 7 * act)
    P = (3.0 * rng.standard_normal((nz, n))).astype(np.float32)
    Y0, Y = np.zeros(n, np.float32), np.zeros(n, np.float32)
    runs = n // 4 if n % 4 == 0 else n
    lib.host_qmm_sum_slices(runs, 1, _p(P), _p(Y0), n, nz)
    if act == Q.ACT_NONE:
        lib.host_qmm_sum_slices(runs, 1, _p(P), _p(Y), n, nz)
    else:
        getattr(lib, f"host_qmm_sum_act_{act}")(runs, 1, _p(P), _p(Y), n, nz, 4.0)
    ref = _act_ref(Y0, act, 4.0)
    assert np.allclose(Y, ref, rtol=1e-6, atol=1e-7)
    assert act != Q.ACT_NONE or np.array_equal(Y, Y0)
    Z = Y0.copy()
    lib.host_qmm_act_rows(n, 1, _p(Z), n, act, 4.0)
    assert np.array_equal(Z, Y)


@pytest.mark.parametrize("rows,T,fused", [(320, 32, True), (4, 32, True), (2560, 33, False)])
def test_dense_activation_in_the_sum_or_after(hostcp, monkeypatch, rows, T, fused):
    """dense(act=...): with a split of k added by the sum kernel the activation is its epilogue (no launch of its
    own), else qmm_act_rows after the product; both give the activation of the plain product; an unknown act is
    refused."""
    monkeypatch.setenv(Q.SUM_ENV, "1")
    rng = np.random.default_rng(rows + T)
    cols = 1024
    raw = blocks(rng, "Q8_0", rows, cols)
    X = acts(rng, T, cols)
    plain = np.asarray(Q.dense(_h(X), "Q8_0", _h(raw), None, rows, cols))
    for act in (Q.ACT_SILU, Q.ACT_SIG2):
        asked = kernels_asked(monkeypatch)
        Y = np.asarray(Q.dense(_h(X), "Q8_0", _h(raw), None, rows, cols, act=act, act_div=4.0))
        assert (f"qmm_sum_act<{act}>" in asked) == fused and ("qmm_act_rows" in asked) == (not fused)
        assert np.allclose(Y, _act_ref(plain, act, 4.0), rtol=1e-6, atol=1e-7)
    with pytest.raises(StrataError, match="unknown activation"):
        Q.dense(_h(X), "Q8_0", _h(raw), None, rows, cols, act=3)


def test_dense_sum_kernel_only_for_aligned_outputs(hostcp, monkeypatch):
    """qmm_sum_slices stores float4s: an ``out`` that is not 16-byte aligned (a row view one value in) takes the CuPy
    sum instead, with the same product."""
    monkeypatch.setenv(Q.SUM_ENV, "1")
    asked = kernels_asked(monkeypatch)
    rng = np.random.default_rng(4)
    rows, cols, T = 8, 2560, 4
    raw = blocks(rng, "Q8_0", rows, cols)
    X = acts(rng, T, cols)
    assert Q.dense_launch(T, rows, cols, "Q8_0", 132)[3] > 1
    buf = _h(np.zeros(T * rows + 1, np.float32))
    out = buf[1:].reshape(T, rows)
    assert out.ctypes.data % 16 and out.flags.c_contiguous
    Y = Q.dense(_h(X), "Q8_0", _h(raw), None, rows, cols, out=out)
    assert "qmm_sum_slices" not in asked
    check(np.asarray(Y), wmat(raw, "Q8_0", rows, cols), X)
    Q.dense(_h(X), "Q8_0", _h(raw), None, rows, cols)
    assert "qmm_sum_slices" in asked


def test_split_counters_never_made_while_capturing(hostcp):
    """A stream without tile counters that is being captured gets none (making and zeroing them there would be
    recorded into the graph): dense() then adds the k slices by a sum launch, with the same result; a stream that is
    not captured gets its own zeroed counters, kept for the next launch."""
    from types import SimpleNamespace

    rng = np.random.default_rng(3)
    rows, cols, T = 70, 192, 70  # 2 row blocks x 2 token tiles, 2 chunks: k split in two
    assert Q.dense_launch(T, rows, cols, "Q8_0", 132)[3] == 2
    raw = blocks(rng, "Q8_0", rows, cols)
    W = wmat(raw, "Q8_0", rows, cols)
    X = acts(rng, T, cols)
    cap = SimpleNamespace(ptr=991, is_capturing=lambda: True)
    hostcp.cuda.get_current_stream = lambda: cap
    assert Q.split_counters(hostcp) is None
    Y = np.asarray(Q.dense(_h(X), "Q8_0", _h(raw), None, rows, cols))
    check(Y, W, X)
    assert Q.split_counters(hostcp) is None  # (still none made for the captured stream)
    eager = SimpleNamespace(ptr=992, is_capturing=lambda: False)
    hostcp.cuda.get_current_stream = lambda: eager
    c = Q.split_counters(hostcp)
    assert c is not None and not np.any(c) and Q.split_counters(hostcp) is c
    Y2 = np.asarray(Q.dense(_h(X), "Q8_0", _h(raw), None, rows, cols))
    check(Y2, W, X)
    assert not np.any(c)  # the kernel's last slices left them zero


@pytest.mark.parametrize("i8", ["0", "1"])
def test_prefill_qmm_and_expert_paths_on_host(hostcp, i8, monkeypatch):
    """ChunkPrefill._qmm on a decoder's stacked Q8R group (the second matrix's rows) and on GGUF blocks; the mma
    expert path (_experts_mma: jobs, slot-table addresses, split, gate/up, down; the fp16 kernels, or with
    STRATATOOLS_QMM_JOBS_I8=1 the integer ones, whose fixed point allows 1e-4) against float64; another expert type
    falls back to the rows path."""
    monkeypatch.setenv(Q.JOBS_I8_ENV, i8)
    from types import SimpleNamespace

    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.gpu.prefill import ChunkPrefill, _Q8RRows

    rng = np.random.default_rng(11)
    pf = ChunkPrefill.__new__(ChunkPrefill)
    pf.gpu, pf.cp, pf.k, pf.gemm = True, hostcp, 3, "mma"
    q8 = type_by_name("Q8_0")
    r1, r2, cols = 48, 40, 256
    raw1, raw2 = blocks(rng, "Q8_0", r1, cols), blocks(rng, "Q8_0", r2, cols)
    q, d = K.q8_relayout(np.concatenate([raw1, raw2]), r1 + r2, cols)
    grp = SimpleNamespace(q=_h(q), d=_h(d))
    X = acts(rng, 21, cols)
    check(np.asarray(pf._qmm(_h(X), _Q8RRows(grp, r1), q8, r2, cols)), wmat(raw2, "Q8_0", r2, cols), X)
    check(np.asarray(pf._qmm(_h(X), _h(raw1), q8, r1, cols)), wmat(raw1, "Q8_0", r1, cols), X)
    assert pf._qmm(_h(X), _h(raw1), type_by_name("Q4_0"), r1, cols) is None

    hidden, ff, E, T = 128, 64, 4, 23
    q2 = type_by_name("Q2_0")
    blobs, mats = experts(rng, "Q2_0", E, hidden, ff, _h)
    ly = SimpleNamespace(hidden=hidden, ff=ff, gu_type=q2, d_type=q2, gate_bytes=ff * hidden // 64 * 18)
    pf.rt = SimpleNamespace(tier=SimpleNamespace(arena=SimpleNamespace(layers=[ly])))
    pf._slots = [np.array([b.ctypes.data for b in blobs], dtype=np.uint64)]
    ids = np.stack([rng.permutation(E)[:pf.k] for _ in range(T)]).astype(np.int32)
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    out = np.asarray(pf._experts_mma(0, _h(x), ids))
    for t in range(T):
        for r in range(pf.k):
            g, u, dn = mats[ids[t, r]]
            hg = g @ x[t].astype(np.float64)
            ref = dn @ (_silu_np(hg) * (u @ x[t].astype(np.float64)))
            if i8 == "1":  # (the hidden row the kernel wrote is not kept here: the bound through float64's)
                hf = _silu_np(hg) * (u @ x[t].astype(np.float64))
                bound = i8_bound(dn, hf) + np.abs(dn) @ (np.abs(hf) * 1e-4)  # (+ the hidden row's own error)
                assert np.all(np.abs(out[t * pf.k + r] - ref) <= bound)
            else:
                assert np.abs(out[t * pf.k + r] - ref).max() <= 1e-5 * np.abs(ref).max()
    # the batched step's path: the same jobs built by qmm_jobs from the routing on the "device", addresses from the
    # decoder's device slot table: the same outputs bit for bit
    ly.n_expert = E
    pf.dec = SimpleNamespace(slot=[_h(pf._slots[0])])
    assert pf._mma_experts_ok(0)
    assert np.array_equal(np.asarray(pf._experts_mma_dev(0, _h(x), _h(ids))), out)
    ly.d_type = type_by_name("Q4_0")
    assert not pf._mma_experts_ok(0)
    pf._experts_rows = lambda il, xx, ii: "rows path"
    assert pf._experts_mma(0, _h(x), ids) == "rows path"


def test_shared_split_splits_each_input_once_on_host(hostcp, monkeypatch):
    """ChunkPrefill._shared_split: the GEMMs of one input array (the same object) inside the block share one
    qmm.split of it (the batched step split its rows 16 times a layer); the results are bit for bit those of a
    split per GEMM; another array (even with equal values) splits on its own; the memo ends with the block and
    nested blocks restore the outer one."""
    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.gpu.prefill import ChunkPrefill

    rng = np.random.default_rng(5)
    pf = ChunkPrefill.__new__(ChunkPrefill)
    pf.gpu, pf.cp, pf.k, pf.gemm = True, hostcp, 3, "mma"
    q8, q2 = type_by_name("Q8_0"), type_by_name("Q2_0")
    cols = 256
    ra, rb = blocks(rng, "Q8_0", 48, cols), blocks(rng, "Q2_0", 40, cols)
    X, Y = _h(acts(rng, 9, cols)), _h(acts(rng, 9, cols))
    calls = []
    real = Q.split
    monkeypatch.setattr(Q, "split", lambda a: calls.append(a.ctypes.data) or real(a))
    ref_a, ref_b = np.asarray(pf._qmm(X, _h(ra), q8, 48, cols)), np.asarray(pf._qmm(X, _h(rb), q2, 40, cols))
    ref_y = np.asarray(pf._qmm(Y, _h(ra), q8, 48, cols))
    assert len(calls) == 3
    calls.clear()
    with pf._shared_split(X):
        a, b = pf._qmm(X, _h(ra), q8, 48, cols), pf._qmm(X, _h(rb), q2, 40, cols)
        assert len(calls) == 1
        assert np.array_equal(np.asarray(pf._qmm(_h(np.array(X)), _h(ra), q8, 48, cols)), ref_a)  # equal values, not X
        assert len(calls) == 2
        with pf._shared_split(Y):
            y1, y2 = pf._qmm(Y, _h(ra), q8, 48, cols), pf._qmm(Y, _h(ra), q8, 48, cols)
            assert len(calls) == 3
        assert np.array_equal(np.asarray(pf._qmm(X, _h(ra), q8, 48, cols)), ref_a) and len(calls) == 3
    assert pf._xs_memo is None
    assert np.array_equal(np.asarray(a), ref_a) and np.array_equal(np.asarray(b), ref_b)
    assert np.array_equal(np.asarray(y1), ref_y) and np.array_equal(np.asarray(y2), ref_y)
    pf._qmm(X, _h(ra), q8, 48, cols)
    assert len(calls) == 4  # after the block: a split per GEMM again


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no nvcc to compile the device code")
def test_device_build_has_no_spills(tmp_path):
    """The module's source as qmm.py assembles it, every kernel it instantiates, compiled for sm_90 with the options
    of the fast modules: compiles, and ptxas reports no spills (register counts printed for the notes)."""
    import re

    inst = []
    for n in Q.kernel_names():
        base, _, targs = n.partition("<")
        if not targs:
            continue
        if base == "qmm_dense":
            sig = ("const u8*, const u16*, long long, const u16*, const u16*, const float*, float*, long long, int, int, "
                   "int, int, float*, int*")
        elif base == "qmm_wsplit":
            sig = "const u8*, const u16*, long long, int, int, u16*, u16*, int*"
        elif base == "qmm_moe_gu":
            sig = "const u64*, const int*, const u16*, const u16*, const float*, float*, int, int"
        elif base == "qmm_moe_gu_i8":
            sig = "const u64*, const int*, const u8*, const u8*, const float*, const int*, float*, int, int"
        elif base == "qmm_moe_down_i8":
            sig = "const u64*, long long, const int*, const u8*, const u8*, const float*, const int*, float*, int, int"
        elif base == "qmm_sum_act":
            sig = "const float*, float*, long long, int, float"
        elif base == "qmm_hc_mix_split":
            sig = "const float*, const float*, int, int, int, float*, u32*, u32*, float*, int*"
        elif base == "qmm_sum_act_split":
            sig = "const float*, float*, int, int, float, u32*, u32*, float*, int*"
        else:
            sig = "const u64*, long long, const int*, const u16*, const u16*, const float*, float*, int, int"
        inst.append(f"template __global__ void {base}<{targs}({sig});\n")
    dsig = ("const u8*, const u16*, long long, const u16*, const u16*, const float*, float*, long long, int, int, int, "
            "int, float*, int*")
    rings = [f"template __global__ void qmm_dense_ring<{nt}, {s}, {kc}, {kg}, {i8}>({dsig});\n"
             for i8, cfgs in ((0, Q.RINGS), (1, Q.DENSE_I8_RINGS)) for s, kc, kg in cfgs
             for nt in Q.TILES[:2]]  # (ring_module's instances)
    rings += [f"template __global__ void qmm_dense_ring<{nt}, {s}, {kc}, {kg}, {i8}, {wg}>({dsig});\n"
              for i8, (s, kc, kg) in ((0, Q.RING_DEFAULT), (1, Q.DENSE_I8_DEFAULT), (1, Q.DENSE_I8_SMALL))
              for nt in Q.TILES[:2] for wg in (8, 2)]  # (STRATATOOLS_QMM_RING_WARPS=8 / 2 on the defaults)
    gsig = "const u64*, const int*, const u8*, const u8*, const float*, const int*, float*, int, int"
    dnsig = "const u64*, long long, const int*, const u8*, const u8*, const float*, const int*, float*, int, int"
    rings += [f"template __global__ void {k}<{jt}, {s}, {kc}, {pad}>({sig});\n" for s, kc, pad in Q.JOBS_RINGS
              for jt in Q.JOB_SIZES for k, sig in (("qmm_moe_gu_i8", gsig), ("qmm_moe_down_i8", dnsig))]
    src = tmp_path / "qmm_dev.cu"
    src.write_text(Q.device_source() + "".join(inst) + "".join(rings))
    r = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v", "--std=c++17", "-o",
                        str(tmp_path / "qmm.cubin"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    entries = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers",
                         r.stderr + r.stdout, flags=re.S)
    assert len(entries) == len(Q.kernel_names()) + len(rings)
    for name, spill, regs in entries:
        print(f"{name}: {regs} registers, {spill} bytes spill stores")
        assert int(spill) == 0, name
    # the Q2_0 expert jobs' default chunk (MOE_KC_DEFAULT: 256 values; Q8_0's gate/up spills there, so it keeps 128)
    assert Q.MOE_KC_DEFAULT == {42: 256}
    moe = [i for i in inst if "qmm_moe" in i and ("<42," in i or "_i8<" in i)]
    assert len(moe) == 4 * len(Q.JOB_SIZES)
    src.write_text("#define QMM_KC 256\n" + Q.device_source() + "".join(moe))
    r = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v", "--std=c++17", "-o",
                        str(tmp_path / "qmm256.cubin"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    entries = [e for e in re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) "
                                     r"registers", r.stderr + r.stdout, flags=re.S) if "qmm_moe" in e[0]]
    assert len(entries) == len(moe)  # (the extern "C" kernels compile too; only the expert jobs are counted)
    for name, spill, regs in entries:
        print(f"{name} (chunk 256): {regs} registers, {spill} bytes spill stores")
        assert int(spill) == 0, name


@pytest.mark.parametrize("env,read", [("COPY_PLAN_ENV", "copy_plan"), ("Q8R_SHARED_ENV", "q8r_shared")])
def test_flag_switches(monkeypatch, env, read):
    """STRATATOOLS_QMM_COPY_PLAN (the rings' copies from each thread's plan) and STRATATOOLS_Q8R_SHARED (the shared
    expert's short products from Q8R copies): on by default, 0 off, another value refused naming the variable."""
    name, fn = getattr(Q, env), getattr(Q, read)
    monkeypatch.delenv(name, raising=False)
    assert fn() is True
    monkeypatch.setenv(name, "0")
    assert fn() is False
    monkeypatch.setenv(name, "1")
    assert fn() is True
    monkeypatch.setenv(name, "on")
    with pytest.raises(StrataError, match=name):
        fn()


def test_copy_plan_picks_the_rings_build(monkeypatch):
    """The rings' modules are built per STRATATOOLS_QMM_COPY_PLAN setting (-DQMM_COPY_PLAN=0 when off)."""
    built = []
    monkeypatch.setattr(Q, "_instances_module", lambda names, plan: built.append((names, plan)) or "module")
    for v, want in (("0", False), ("", True)):
        monkeypatch.setenv(Q.COPY_PLAN_ENV, v)
        assert Q.instances_module(("a<1>",)) == "module"
        assert built[-1] == (("a<1>",), want)


@pytest.mark.skipif(NVCC is None, reason="no nvcc to compile the device code")
def test_device_build_without_copy_plan(tmp_path):
    """The rings' default instances (the integer jobs' ring, the integer dense ring) compiled for sm_90 with
    -DQMM_COPY_PLAN=0 (each chunk's copies worked out, STRATATOOLS_QMM_COPY_PLAN=0): compile without spills."""
    import re

    gsig = "const u64*, const int*, const u8*, const u8*, const float*, const int*, float*, int, int"
    dnsig = "const u64*, long long, const int*, const u8*, const u8*, const float*, const int*, float*, int, int"
    dsig = ("const u8*, const u16*, long long, const u16*, const u16*, const float*, float*, long long, int, int, int, "
            "int, float*, int*")
    s, kc, pad = Q.JOBS_RING_DEFAULT
    st, rkc, kg = Q.DENSE_I8_DEFAULT
    inst = [f"template __global__ void qmm_moe_gu_i8<8, {s}, {kc}, {pad}>({gsig});\n",
            f"template __global__ void qmm_moe_down_i8<8, {s}, {kc}, {pad}>({dnsig});\n",
            f"template __global__ void qmm_dense_ring<4, {st}, {rkc}, {kg}, 1, 4>({dsig});\n"]
    src = tmp_path / "qmm_noplan.cu"
    src.write_text(Q.device_source() + "".join(inst))
    r = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v", "--std=c++17", "-DQMM_COPY_PLAN=0",
                        "-o", str(tmp_path / "noplan.cubin"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    entries = [e for e in re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores",
                                     r.stderr + r.stdout, flags=re.S) if "moe" in e[0] or "ring" in e[0]]
    assert len(entries) == 3, entries
    assert all(int(sp) == 0 for _, sp in entries), entries


# ---- hgemm: fp16 hi / lo weights (qmm_wsplit) and the cuBLAS path's numerics -------------------------------------
def wide_blocks(rng, tname: str, rows: int, cols: int) -> np.ndarray:
    """:func:`blocks` with scales log-uniform over 1e-7 .. 500 of both signs (subnormal fp16 scales; products down to
    the subnormal range of fp16 and up to 64,000) and the extreme codes in every row."""
    bv, tb = (32, 34) if tname == "Q8_0" else (64, 18)
    raw = blocks(rng, tname, rows, cols).reshape(-1, tb)
    nb = raw.shape[0]
    d = (np.exp(rng.uniform(np.log(1e-7), np.log(500.0), nb)) * rng.choice([-1.0, 1.0], nb)).astype(np.float16)
    d[:4] = np.float16([500.0, -500.0, 6e-8, 1e-7])
    raw[:, :2] = d.view(np.uint8).reshape(nb, 2)
    if tname == "Q8_0":
        raw[0, 2:4] = (np.int8([-128, 127]).view(np.uint8))  # -64,000 and 63,500
    else:
        raw[0, 2] = 0xFF  # codes 3: 2 d = 1,000
    return raw.reshape(-1)


def wsplit_host(lib, layout: str, raw: np.ndarray, rows: int, cols: int, grid: int = 5):
    """The host build's qmm_wsplit (grid-stride over ``grid`` blocks of one thread): (Wh, Wl, flag), Wl as left by
    the kernel (poisoned with 0xABCD first)."""
    f = Q.LAYOUTS[layout]
    if f == 0:
        q, d = K.q8_relayout(raw, rows, cols)
        W8, Wd, rb = q.view(np.uint8), d, cols
    else:
        W8, Wd, rb = raw, raw, cols // Q.BLOCK_VALUES[f] * Q.BLOCK_BYTES[f]
    wh = np.full((rows, cols), 0xABCD, np.uint16)
    wl = np.full((rows, cols), 0xABCD, np.uint16)
    flag = np.zeros(1, np.int32)
    getattr(lib, f"host_qmm_wsplit_{f}")(grid, 1, _p(W8), _p(Wd), rb, rows, cols, _p(wh), _p(wl), _p(flag))
    return wh, wl, int(flag[0])


@pytest.mark.parametrize("layout,rows,cols", [("Q8R", 13, 96), ("Q8_0", 9, 160), ("Q2_0", 11, 192)])
def test_wsplit_is_exact(lib, layout, rows, cols):
    """Wh = fp16(W) rounded to nearest and Wh + Wl = W exactly (the reference dequantizer's values) over scales from
    1e-7 to 500 (products from fp16's subnormals to 64,000); Q2_0 needs no Wl (left unwritten); no overflow flag."""
    rng = np.random.default_rng(rows + cols)
    tname = "Q2_0" if layout == "Q2_0" else "Q8_0"
    raw = wide_blocks(rng, tname, rows, cols)
    W = np.asarray(dequantize(raw, tname, rows * cols), dtype=np.float32).reshape(rows, cols)
    wh, wl, flag = wsplit_host(lib, layout, raw, rows, cols)
    assert flag == 0
    assert np.array_equal(wh, W.astype(np.float16).view(np.uint16))
    hv = wh.view(np.float16).astype(np.float64)
    if layout == "Q2_0":
        assert np.all(wl == 0xABCD) and np.array_equal(hv, W.astype(np.float64))
    else:
        assert np.array_equal(hv + wl.view(np.float16).astype(np.float64), W.astype(np.float64))
        assert np.any(wl != 0) and np.abs(wl.view(np.float16)).min() == 0  # both cases occur
        sub = (np.abs(W) < 2.0 ** -14) & (W != 0)
        assert sub.sum() > 0 and np.all(wl[sub] == 0)  # fp16 subnormal range: the value itself, exactly
    assert np.abs(W).max() >= 1000


@pytest.mark.parametrize("layout,d,code,flagged", [
    ("Q8R", 511.75, -128, 0), ("Q8R", 512.0, -128, 1), ("Q8_0", 600.0, 127, 1), ("Q8_0", 515.5, 127, 0),
    ("Q8_0", 516.0, 127, 1),
    ("Q2_0", 32752.0, 3, 0), ("Q2_0", 32768.0, 3, 1), ("Q2_0", 40000.0, 1, 0)])
def test_wsplit_flags_values_past_fp16(lib, layout, d, code, flagged):
    """One value d code (Q2_0: (code - 1) d) at fp16's edge: -65,504 (511.75 x -128), 65,468.5 and 65,504 (32,752 x
    2) fit, -65,536, 65,532 (rounds to infinity) and past set the flag; a large scale on a zero value does not."""
    rng = np.random.default_rng(3)
    tname = "Q2_0" if layout == "Q2_0" else "Q8_0"
    rows, cols = 3, 128
    raw = blocks(rng, tname, rows, cols).reshape(-1, 34 if tname == "Q8_0" else 18)
    raw[:, :2] = np.float16(0.01).reshape(1).view(np.uint8)
    b = 4  # a block inside the second row
    raw[b, :2] = np.float16(d).reshape(1).view(np.uint8)
    if tname == "Q8_0":
        raw[b, 2:] = 0
        raw[b, 7] = np.int8(code).view(np.uint8)
    else:
        raw[b, 2:] = 0x55  # codes 1: value 0
        raw[b, 9] = 0x55 & ~0x0C | (code << 2)
    raw = raw.reshape(-1)
    wh, wl, flag = wsplit_host(lib, layout, raw, rows, cols)
    assert flag == flagged
    if not flagged:
        W = np.asarray(dequantize(raw, tname, rows * cols), dtype=np.float32).reshape(rows, cols)
        rec = wh.view(np.float16).astype(np.float64)
        if layout != "Q2_0":
            rec = rec + wl.view(np.float16).astype(np.float64)
        assert np.array_equal(rec, W.astype(np.float64))


def hgemm_emulated(wh, wl, hi, lo, sc) -> np.ndarray:
    """The hgemm path's arithmetic in numpy: three fp16 GEMMs into one float32 Y (each product sum exact, rounded to
    float32 once per GEMM as cuBLAS's beta = 1 accumulation does), then Y[t] *= sc[t] in float32."""
    Wh = wh.view(np.float16).astype(np.float64)
    Xh, Xl = hi.view(np.float16).astype(np.float64), lo.view(np.float16).astype(np.float64)
    Y = (Xh @ Wh.T).astype(np.float32)
    Y = (Y + Xl @ Wh.T).astype(np.float32)
    if wl is not None:
        Y = (Y + Xh @ wl.view(np.float16).astype(np.float64).T).astype(np.float32)
    return (Y * sc[:, None]).astype(np.float32)


@pytest.mark.parametrize("layout,rows,cols,T", [("Q8R", 24, 256, 9), ("Q8_0", 17, 320, 7), ("Q2_0", 19, 256, 8)])
def test_hgemm_numerics_match_float64(lib, layout, rows, cols, T):
    """Wh hi + Wh lo + Wl hi (lo lo dropped: below 2^-22 of |W| |x|) scaled back agrees with float64 to 2e-6 of
    |W| |x| for every element, on rows of activations from 1e-30 to 1e30 and weights with scales from 1e-7 to 500."""
    rng = np.random.default_rng(rows * T)
    tname = "Q2_0" if layout == "Q2_0" else "Q8_0"
    raw = wide_blocks(rng, tname, rows, cols)
    W = wmat(raw, tname, rows, cols)
    wh, wl, flag = wsplit_host(lib, layout, raw, rows, cols)
    assert flag == 0
    X = acts(rng, T, cols)
    hi, lo, sc = split_host(lib, X)
    Y = hgemm_emulated(wh, None if layout == "Q2_0" else wl, hi, lo, sc)
    worst = check(Y, W, X, tol=2e-6)
    print(f"{layout}: worst error {worst:.2e} of |W| |x|")


def _gemm16_np(A, B, Y, accumulate):
    """cuBLAS gemmEx's contract (Y (+)= B A^T, fp16 inputs, float32 output) in numpy: exact sums rounded once."""
    P = np.asarray(B).view(np.float16).astype(np.float64) @ np.asarray(A).view(np.float16).astype(np.float64).T
    Y[...] = ((np.asarray(Y, dtype=np.float64) if accumulate else 0.0) + P).astype(np.float32)


@pytest.fixture
def host_gemm16(hostcp, monkeypatch):
    """hostcp with blas.gemm16 replaced by :func:`_gemm16_np`; returns the list of the calls' ``accumulate``."""
    class Calls(list):
        cupy = None

    calls = Calls()

    def fake(A, B, Y, accumulate):
        calls.append(accumulate)
        _gemm16_np(A, B, Y, accumulate)

    from stratatools.runtime.gpu import blas

    monkeypatch.setattr(blas, "gemm16", fake)
    calls.cupy = hostcp
    return calls


def _layout_args(raw, layout, rows, cols):
    if layout == "Q8R":
        q, d = K.q8_relayout(raw, rows, cols)
        return "Q8R", _h(q), _h(d)
    return layout, _h(raw), None


@pytest.mark.parametrize("layout,T", [("Q8R", 1), ("Q8R", 40), ("Q8_0", 20), ("Q2_0", 33)])
def test_hgemm_launcher_on_host(host_gemm16, layout, T):
    """qmm.hgemm: the weight split's launch, the GEMMs (three; Q2_0 two: no Wl) and the rows' scales, against
    float64 within 2e-6 of |W| |x|."""
    rng = np.random.default_rng(50 + T)
    rows, cols = 70, 192
    tname = "Q2_0" if layout == "Q2_0" else "Q8_0"
    raw = wide_blocks(rng, tname, rows, cols)
    X = acts(rng, T, cols)
    Y = Q.hgemm(_h(X), *_layout_args(raw, layout, rows, cols), rows, cols)
    check(np.asarray(Y), wmat(raw, tname, rows, cols), X, tol=2e-6)
    assert host_gemm16 == ([False, True] if layout == "Q2_0" else [False, True, True])
    with pytest.raises(StrataError, match="weight bytes"):
        Q.hgemm(_h(X), tname, _h(raw[:-2]), None, rows, cols)


def test_prefill_hgemm_falls_back_on_fp16_overflow(host_gemm16, monkeypatch):
    """ChunkPrefill._qmm on the hgemm path: a matrix that fits fp16 is checked on its first call only (one flag read),
    then multiplied unchecked; one with a value past fp16's range is found on its first call, goes through the mma
    kernel (the same result as the mma path) and is not split again; another layout has no kernel (None: the
    caller dequantizes)."""
    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.gpu.prefill import ChunkPrefill

    rng = np.random.default_rng(21)
    q8 = type_by_name("Q8_0")
    rows, cols, T = 40, 256, 12
    good = blocks(rng, "Q8_0", rows, cols)
    bad = good.copy().reshape(-1, 34)
    bad[7, :2] = np.float16(600.0).reshape(1).view(np.uint8)
    bad[7, 2:] = 127  # 76,200: no fp16
    bad = bad.reshape(-1)
    X = acts(rng, T, cols)
    assert Q.hgemm(_h(X), "Q8_0", _h(bad), None, rows, cols) is None  # the check finds it
    with np.errstate(all="ignore"):
        assert not np.all(np.isfinite(np.asarray(Q.hgemm(_h(X), "Q8_0", _h(bad), None, rows, cols, check=False))))
    checks, splits = [], []
    real_hgemm, real_wsplit = Q.hgemm, Q.wsplit
    monkeypatch.setattr(Q, "hgemm", lambda *a, **kw: (checks.append(kw["check"]), real_hgemm(*a, **kw))[1])
    monkeypatch.setattr(Q, "wsplit", lambda *a, **kw: (splits.append(1), real_wsplit(*a, **kw))[1])
    pf = ChunkPrefill.__new__(ChunkPrefill)
    pf.gpu, pf.cp, pf.gemm = True, host_gemm16.cupy, "hgemm"
    for _ in range(2):
        check(np.asarray(pf._qmm(_h(X), _h(good), q8, rows, cols, "blk.0.good")), wmat(good, "Q8_0", rows, cols), X)
        yb = np.asarray(pf._qmm(_h(X), _h(bad), q8, rows, cols, "blk.0.bad"))
        check(yb, wmat(bad, "Q8_0", rows, cols), X)
    assert checks == [True, True, False] and len(splits) == 3  # good checked, bad checked; then good unchecked only
    assert pf._hgemm_fits() == {"blk.0.good": True, "blk.0.bad": False}
    pf.gemm = "mma"
    assert np.array_equal(np.asarray(pf._qmm(_h(X), _h(bad), q8, rows, cols, "blk.0.bad")), yb)
    pf.gemm = "hgemm"
    assert pf._qmm(_h(X), _h(good), type_by_name("Q4_0"), rows, cols, "blk.0.q4") is None
    assert "blk.0.q4" not in pf._hgemm_fits()


def _planes_host(T: int, K: int):
    return (np.full((T, K), 0xAB, np.uint8), np.full((T, K), 0xAB, np.uint8),
            np.full((T, K // 64), -7.0, np.float32), np.full((T, K // 64), 7777, np.int32))


@pytest.mark.parametrize("wlen", [512, 128, 64, 0])
@pytest.mark.parametrize("inject", [True, False])
def test_hc_norm_split_injects_norms_and_splits_in_one_launch(lib, wlen, inject):
    """qmm_hc_norm_split: H += y iw per stream where an inject is pending (H's new values exactly numpy's float32
    H + y iw), hn the rows' RMS norm times w repeated over the rows (w of a row's length, of all the streams', of less
    than a row: the modulo path, or none) within float32 rounding of float64, and the planes qmm_split_i8d makes of
    that hn, bit for bit; without planes the same hn bits."""
    h = lib
    rng = np.random.default_rng(5)
    T, hc, n, eps = 3, 4, 128, 1e-6
    H0 = (rng.standard_normal((T, hc * n)) * 3).astype(np.float32)
    H0[1, :n] *= 1e-3  # a quiet stream
    y = rng.standard_normal((T, n)).astype(np.float32)
    iw = rng.uniform(0.1, 2.0, (T, hc)).astype(np.float32)
    w = (rng.standard_normal(wlen) + 1.0).astype(np.float32) if wlen else None
    want_H = (H0.reshape(T, hc, n) + y[:, None, :] * iw[:, :, None]).reshape(T, hc * n) if inject else H0
    x = want_H.astype(np.float64).reshape(T * hc, n)
    ref = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
    if w is not None:
        ref = ref * np.resize(w.astype(np.float64), T * hc * n).reshape(T * hc, n)
    got = []
    for split in (True, False):
        H = H0.copy()
        hn = np.full_like(H, -9.0)
        pl = _planes_host(T, hc * n) if split else (None,) * 4
        h.host_qmm_hc_norm_split(T * hc, 1, _p(H), _p(y) if inject else None, _p(iw) if inject else None, hc, n,
                                 _p(w) if w is not None else None, wlen or 1, eps, _p(hn),
                                 *[_p(a) if a is not None else None for a in pl])
        assert np.array_equal(H, want_H)
        assert np.allclose(hn.reshape(T * hc, n), ref, rtol=3e-6, atol=1e-7)
        if split:
            want = split_i8_host(lib, hn, dense=True)
            for a, b in zip(pl, want):
                assert np.array_equal(a, b)
        got.append(hn)
    assert np.array_equal(got[0], got[1])


@pytest.mark.parametrize("order", [0, 1])
def test_hc_mix_split_mixes_and_splits_in_one_launch(lib, order):
    """qmm_hc_mix_split<ORD>: out = sum over the streams of sigmoid(u) hn, over hc, within float32 rounding of
    float64; its planes qmm_split_i8 (ORD 0) / qmm_split_i8d (ORD 1) of that out, bit for bit (a block with a
    non-finite value included); without planes the same out bits."""
    h = lib
    rng = np.random.default_rng(6)
    T, hc, n = 2, 4, 192
    u = rng.standard_normal((T, hc * n)).astype(np.float32)
    hn = rng.standard_normal((T, hc * n)).astype(np.float32)
    hn[1, 2 * n + 70] = np.inf  # (block 1 of token 1: NaN scale, q = 0)
    su = 1.0 / (1.0 + np.exp(-u.astype(np.float64)))
    ref = (su * hn.astype(np.float64)).reshape(T, hc, n).sum(axis=1) / hc
    fn = getattr(h, f"host_qmm_hc_mix_split_{order}")
    outs = []
    for split in (True, False):
        out = np.full((T, n), -9.0, np.float32)
        pl = _planes_host(T, n) if split else (None,) * 4
        fn(T * (n // 64), 1, _p(u), _p(hn), hc, n, T, _p(out), *[_p(a) if a is not None else None for a in pl])
        fin = np.isfinite(ref)
        assert np.allclose(out[fin], ref[fin], rtol=3e-6, atol=1e-7) and np.all(~np.isfinite(out[~fin]))
        if split:
            want = split_i8_host(lib, out, dense=order == 1)
            for a, b in zip(pl, want):
                assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("act", [0, 1, 2])
def test_sum_act_split_is_the_sum_kernels_output_and_its_split(lib, act):
    """qmm_sum_act_split<ACT>: Y the bits of qmm_sum_act<ACT> (qmm_sum_slices for ACT 0) over the same slices, and the
    planes qmm_split_i8d makes of that Y, bit for bit (rows of 3 units of 64, 5 tokens, 7 slices)."""
    h = lib
    rng = np.random.default_rng(7 + act)
    T, R, nz, div = 5, 192, 7, 4.0
    Pt = rng.standard_normal((nz, T, R)).astype(np.float32)
    n = T * R
    want = np.full((T, R), -9.0, np.float32)
    if act == 0:
        h.host_qmm_sum_slices(n // 4, 1, _p(Pt), _p(want), n, nz)
    else:
        getattr(h, f"host_qmm_sum_act_{act}")(n // 4, 1, _p(Pt), _p(want), n, nz, div)
    ref = Pt.astype(np.float64).sum(axis=0)
    if act:
        a = ref / div
        ref = a / (1.0 + np.exp(-a)) if act == 1 else 2.0 / (1.0 + np.exp(-a))
    assert np.allclose(want, ref, rtol=1e-5, atol=1e-6)
    Y = np.full((T, R), -9.0, np.float32)
    pl = _planes_host(T, R)
    getattr(h, f"host_qmm_sum_act_split_{act}")(n // 64, 1, _p(Pt), _p(Y), R, nz, div, *[_p(x) for x in pl])
    assert np.array_equal(Y, want)
    for x, y in zip(pl, split_i8_host(lib, Y, dense=True)):
        assert np.array_equal(x, y)


def test_hc_launchers_on_host(hostcp, lib, monkeypatch):
    """qmm.hc_norm_split and qmm.hc_mix launch their kernels as the host entries compute them (H injected in place,
    hn, the planes of the kind asked as split_i8 makes them: ``i8d`` as DensePlanes); shapes that are not [T, hc n]
    with n a multiple of 64, and kinds other than i8 / i8d, are refused."""
    rng = np.random.default_rng(8)
    T, hc, n, eps = 3, 4, 128, 1e-6
    H0 = rng.standard_normal((T, hc * n)).astype(np.float32)
    y = rng.standard_normal((T, n)).astype(np.float32)
    iw = rng.uniform(0.5, 1.5, (T, hc)).astype(np.float32)
    w = (rng.standard_normal(hc * n) + 1).astype(np.float32)
    H = _h(H0.copy())
    hn, pl = Q.hc_norm_split(H, _h(w), eps, hc, n, _h(y), _h(iw), "i8d")
    want_H, want_hn = H0.copy(), np.zeros_like(H0)
    want_pl = _planes_host(T, hc * n)
    lib.host_qmm_hc_norm_split(T * hc, 1, _p(want_H), _p(y), _p(iw), hc, n, _p(w), w.size, eps, _p(want_hn),
                               *[_p(a) for a in want_pl])
    assert np.array_equal(np.asarray(H), want_H) and np.array_equal(np.asarray(hn), want_hn)
    assert isinstance(pl, Q.DensePlanes) and all(np.array_equal(np.asarray(a), b) for a, b in zip(pl, want_pl))
    hn2, none = Q.hc_norm_split(_h(want_H.copy()), None, eps, hc, n)
    assert none is None and np.allclose(np.asarray(hn2) * np.resize(w, hn2.shape), want_hn, rtol=1e-6, atol=1e-7)
    u = _h(rng.standard_normal((T, hc * n)).astype(np.float32))
    outs = []
    for kind in ("i8", "i8d", None):
        asked = kernels_asked(monkeypatch)
        out, pl = Q.hc_mix(u, hn, hc, n, kind)
        assert asked == [f"qmm_hc_mix_split<{0 if kind == 'i8' else 1}>"]
        outs.append(np.asarray(out))
        if kind is None:
            assert pl is None
            continue
        assert isinstance(pl, Q.DensePlanes) == (kind == "i8d")
        for a, b in zip(pl, split_i8_host(lib, np.asarray(out), dense=kind == "i8d")):
            assert np.array_equal(np.asarray(a), b)
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    with pytest.raises(StrataError, match="not contiguous float32"):
        Q.hc_norm_split(_h(np.zeros((T, hc * 96), np.float32)), None, eps, hc, 96)
    with pytest.raises(StrataError, match="'i8d', not 'f16'"):
        Q.hc_norm_split(H, None, eps, hc, n, kind="f16")
    with pytest.raises(StrataError, match="not \\[T, 4 x 128\\] twice"):
        Q.hc_mix(u, _h(np.zeros((T, n), np.float32)), hc, n)
    with pytest.raises(StrataError, match="'i8' or 'i8d'"):
        Q.hc_mix(u, hn, hc, n, "f16")


@pytest.mark.parametrize("rows,act,sums,fused", [(320, Q.ACT_SILU, "1", True), (192, Q.ACT_NONE, "1", True),
                                                  (192, Q.ACT_SILU, "0", False), (70, Q.ACT_SILU, "1", False)])
def test_dense_planes_from_the_sum_launch(hostcp, lib, monkeypatch, rows, act, sums, fused):
    """dense(planes=True) on the integer ring at 32 tokens with a split of k: (out, out's split_i8 ``dense`` planes);
    with the sum kernel the planes come from the sum's launch (qmm_sum_act_split, no qmm_split_i8d after it), else
    from a split after the sum; rows not a multiple of 64 get None; out the bits of the plain call."""
    monkeypatch.setenv(Q.SUM_ENV, sums)
    monkeypatch.setenv(Q.DENSE_I8_ENV, "4:64:2")
    rng = np.random.default_rng(rows)
    T, cols = 32, 1024
    _, q, d, X = q8r_case(rng, rows, cols, T)
    plain = np.asarray(Q.dense(_h(X), "Q8R", _h(q), _h(d), rows, cols, act=act, act_div=4.0))
    xs = Q.split_i8(_h(X), dense=True)
    asked = kernels_asked(monkeypatch)
    out, pl = Q.dense(_h(X), "Q8R", _h(q), _h(d), rows, cols, xs=xs, act=act, act_div=4.0, planes=True)
    assert np.array_equal(np.asarray(out), plain) and (f"qmm_sum_act_split<{act}>" in asked) == fused
    if rows % 64:
        assert pl is None and "qmm_split_i8d" not in asked
        return
    assert isinstance(pl, Q.DensePlanes) and ("qmm_split_i8d" in asked) != fused
    for a, b in zip(pl, split_i8_host(lib, plain, dense=True)):
        assert np.array_equal(np.asarray(a), b)


def test_sum_hc_is_the_two_activation_sums_and_the_split(lib):
    """qmm_sum_hc over the slices of [T, rd + 4] (the down and inject projections as one matrix): m the bits of
    qmm_sum_act<1> over the first rd columns, iw those of qmm_sum_act<2> over the other 4, m's planes qmm_split_i8d's
    of m, bit for bit."""
    rng = np.random.default_rng(21)
    T, rd, ri, nz, div = 3, 128, 4, 9, 4.0
    R = rd + ri
    Pt = rng.standard_normal((nz, T, R)).astype(np.float32)
    m, iw = np.full((T, rd), -9.0, np.float32), np.full((T, ri), -9.0, np.float32)
    pl = _planes_host(T, rd)
    lib.host_qmm_sum_hc(T * rd // 64, 1, _p(Pt), _p(m), _p(iw), R, rd, nz, div, *[_p(x) for x in pl])
    for cols, act, got in ((slice(0, rd), 1, m), (slice(rd, R), 2, iw)):
        part = np.ascontiguousarray(Pt[:, :, cols])
        want = np.full(got.shape, -9.0, np.float32)
        n = want.size
        getattr(lib, f"host_qmm_sum_act_{act}")(n // 4, 1, _p(part), _p(want), n, nz, div)
        assert np.array_equal(got, want)
    for a, b in zip(pl, split_i8_host(lib, m, dense=True)):
        assert np.array_equal(a, b)


def test_dense_hc_rd_launcher_on_host(hostcp, lib, monkeypatch):
    """dense(hc_rd=) of a [rd + 4, K] Q8R matrix at 32 tokens on the integer ring: (silu(y / div) of the first rd
    rows' outputs, its planes, 2 sigmoid(y / div) of the others) from one product and one qmm_sum_hc launch, within
    the fixed point's bound of float64's activations; without the sum kernel the same from a split after the product;
    hc_rd not a multiple of 64 below the rows, or with an act, refused."""
    monkeypatch.setenv(Q.DENSE_I8_ENV, "4:64:2")
    rng = np.random.default_rng(22)
    T, rd, cols, div = 32, 128, 1024, 4.0
    W, q, d, X = q8r_case(rng, rd + 4, cols, T)
    ref = X.astype(np.float64) @ W.T
    tol = 1e-4 * np.abs(ref).max()
    for sums in ("1", "0"):
        monkeypatch.setenv(Q.SUM_ENV, sums)
        asked = kernels_asked(monkeypatch)
        m, pl, iw = Q.dense(_h(X), "Q8R", _h(q), _h(d), rd + 4, cols, act_div=div, hc_rd=rd)
        assert ("qmm_sum_hc" in asked) == (sums == "1") and sum(n.startswith("qmm_dense") for n in asked) == 1
        m, iw = np.asarray(m), np.asarray(iw)
        assert m.shape == (T, rd) and iw.shape == (T, 4) and isinstance(pl, Q.DensePlanes)
        a = ref[:, :rd] / div
        with np.errstate(over="ignore"):  # (exp of large negative sums: the sigmoid's 0)
            assert np.abs(m - a / (1 + np.exp(-a))).max() <= tol
            assert np.abs(iw - 2 / (1 + np.exp(-ref[:, rd:] / div))).max() <= tol
        for x, y in zip(pl, split_i8_host(lib, m, dense=True)):
            assert np.array_equal(np.asarray(x), y)
    for bad, act in ((100, Q.ACT_NONE), (rd + 4, Q.ACT_NONE), (rd, Q.ACT_SILU)):
        with pytest.raises(StrataError, match="hc_rd"):
            Q.dense(_h(X), "Q8R", _h(q), _h(d), rd + 4, cols, act=act, hc_rd=bad)


def test_hc_mix_block_fits_its_shared_units():
    """qmm.HC_MIX_THREADS: whole groups of 16 threads (the device's QI8_GROUP), no more of them than qmm.cu's
    QI8_MIX_UNITS rows of shared memory (a larger block would index past them)."""
    import re
    from pathlib import Path

    src = (Path(Q.__file__).parent / "qmm.cu").read_text()
    units = int(re.search(r"#define QI8_MIX_UNITS (\d+)", src).group(1))
    group = int(re.search(r"#else\s+#define QI8_GROUP (\d+)", src).group(1))
    assert Q.HC_MIX_THREADS % 32 == 0 and Q.HC_MIX_THREADS // group <= units
