"""The tensor-core quantized GEMMs (stratatools/runtime/gpu/qmm.py) on a GPU: the dense kernel for every layout and
token counts from 1 to a full chunk against float64 and against the prefill's dequantize + SGEMM path on the same
matrices; the hgemm path (fp16 hi/lo weights, cuBLAS) against float64 for every layout, its fp16 overflow check;
the routed-expert job kernels with blobs in VRAM against float64 per (token, expert) pair. Skips without CuPy and a
GPU (tests/test_gpu_qmm_host.py checks the same kernels as host C++ in CI)."""

from __future__ import annotations

import numpy as np
import pytest

from stratatools.runtime import gpu
from stratatools.runtime.dequant import dequantize
from stratatools.runtime.gpu import qmm as qmm_host  # (needs no CuPy: the parameters' ring list)

from hostlib import i8_bound

pytestmark = pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")


def _blocks(rng, tname, rows, cols):
    bv, tb = (32, 34) if tname == "Q8_0" else (64, 18)
    nb = rows * cols // bv
    d = (rng.standard_normal(nb) * 0.02).astype(np.float16)
    b = np.empty((nb, tb), dtype=np.uint8)
    b[:, :2] = d.view(np.uint8).reshape(nb, 2)
    b[:, 2:] = rng.integers(0, 256, size=(nb, tb - 2)).astype(np.uint8)
    return b.reshape(-1)


def _experts(rng, tname: str, E: int, hidden: int, ff: int):
    """E random experts of ``tname`` blocks: (blobs [gate | up | down] on the device, float64 matrices (gate [ff,
    hidden], up, down [hidden, ff]) per expert)."""
    import cupy as cp

    blobs, mats = [], []
    for _ in range(E):
        g, u, dn = _blocks(rng, tname, ff, hidden), _blocks(rng, tname, ff, hidden), _blocks(rng, tname, hidden, ff)
        blobs.append(cp.asarray(np.concatenate([g, u, dn])))
        mats.append([np.asarray(dequantize(a, tname, r * c)).reshape(r, c).astype(np.float64)
                     for a, r, c in ((g, ff, hidden), (u, ff, hidden), (dn, hidden, ff))])
    return blobs, mats


def _matrix(rng, layout: str, rows: int, cols: int) -> tuple[tuple, np.ndarray]:
    """Random [rows, cols] weights as qmm.dense / qmm.hgemm take them on the device for ``layout`` (Q8R: the
    re-laid-out Q8_0 codes and scales; Q8_0 / Q2_0: GGUF blocks): (the calls' arguments after X, W float64)."""
    import cupy as cp

    from stratatools.runtime.gpu import kernels as K

    tname = "Q2_0" if layout == "Q2_0" else "Q8_0"
    raw = _blocks(rng, tname, rows, cols)
    W = np.asarray(dequantize(raw, tname, rows * cols)).reshape(rows, cols).astype(np.float64)
    if layout == "Q8R":
        q, d = K.q8_relayout(raw, rows, cols)
        return ("Q8R", cp.asarray(q), cp.asarray(d), rows, cols), W
    return (tname, cp.asarray(raw), None, rows, cols), W


@pytest.mark.parametrize("layout,rows,cols", [("Q8R", 2560, 2560), ("Q8R", 300, 1056), ("Q8_0", 520, 640),
                                              ("Q2_0", 264, 1024)])
@pytest.mark.parametrize("T", [1, 15, 16, 33, 512])
def test_gpu_dense_matches_float64_and_sgemm(layout, rows, cols, T):
    import cupy as cp

    from stratatools.runtime.gpu import qmm

    rng = np.random.default_rng(rows + T)
    args, W = _matrix(rng, layout, rows, cols)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    X[0] *= np.float32(1e4)
    Y = cp.asnumpy(qmm.dense(cp.asarray(X), *args)).astype(np.float64)
    ref = X.astype(np.float64) @ W.T.astype(np.float64)
    sg = cp.asnumpy(cp.asarray(X) @ cp.asarray(W.astype(np.float32)).T).astype(np.float64)  # the SGEMM path's
    rel_q = np.abs(Y - ref).max() / np.abs(ref).max()
    rel_s = np.abs(sg - ref).max() / np.abs(ref).max()
    print(f"{layout} {rows}x{cols} T={T}: qmm rel {rel_q:.2e}, sgemm rel {rel_s:.2e}")
    if qmm.split_kind(*args[:1], T, cols, *args[1:3]) == "i8d":  # the integer ring: the 16-bit fixed point's bound
        for t in range(T):
            assert np.all(np.abs(Y[t] - ref[t]) <= i8_bound(W, X[t].astype(np.float64))), t
        assert rel_q < 1e-4
        return
    bound = np.abs(X.astype(np.float64)) @ np.abs(W.T.astype(np.float64))
    assert np.all(np.abs(Y - ref) <= 1e-5 * bound + 1e-30)
    assert rel_q < 1e-5


@pytest.mark.parametrize("layout,rows,cols,T", [("Q8_0", 37, 640, 100), ("Q8R", 4, 10240, 512), ("Q8_0", 6, 10240, 40),
                                                ("Q8R", 36, 2560, 64), ("Q8R", 320, 10240, 512)])
def test_gpu_dense_split_k_shapes(layout, rows, cols, T):
    """Dense launches whose k is split and added by each tile's last slice (T > 32, few row blocks): rows that are not
    a multiple of 4 (the slices' scalar adds), a last tile of fewer rows than the block's 64 (4, 6, 36), and the
    prefill's hyper-connection down projection shape; every element within 1e-5 of float64 relative to |W| |x|,
    and two launches on the same stream (the tile counters left zero) give the same bits."""
    import cupy as cp

    from stratatools.runtime.gpu import qmm

    rng = np.random.default_rng(rows * 7 + T)
    args, W = _matrix(rng, layout, rows, cols)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    assert qmm.dense_launch(T, rows, cols, layout, 132)[3] > 1  # (on a 132-SM device: split)
    Y1 = cp.asnumpy(qmm.dense(cp.asarray(X), *args))
    Y2 = cp.asnumpy(qmm.dense(cp.asarray(X), *args))
    assert np.array_equal(Y1, Y2)
    ref = X.astype(np.float64) @ W.T
    bound = np.abs(X.astype(np.float64)) @ np.abs(W).T
    assert np.all(np.abs(Y1 - ref) <= 1e-5 * bound + 1e-30)


@pytest.mark.parametrize("layout,rows,cols,T", [("Q8R", 2560, 2560, 512), ("Q8_0", 128, 640, 40),
                                                ("Q2_0", 256, 1024, 100), ("Q8R", 8192, 2560, 33)])
def test_gpu_dense_two_row_tiles(layout, rows, cols, T, monkeypatch):
    """STRATATOOLS_QMM_DENSE2=1: the two-tile dense kernel (rows a multiple of 128, more than 32 tokens) within 1e-5
    of float64 relative to |W| |x| element by element."""
    import cupy as cp

    from stratatools.runtime.gpu import qmm

    monkeypatch.setenv(qmm.DENSE2_ENV, "1")
    assert qmm.dense2_launch(T, rows) is not None
    rng = np.random.default_rng(rows + T + 1)
    args, W = _matrix(rng, layout, rows, cols)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    Y = cp.asnumpy(qmm.dense(cp.asarray(X), *args)).astype(np.float64)
    ref = X.astype(np.float64) @ W.T
    bound = np.abs(X.astype(np.float64)) @ np.abs(W).T
    assert np.all(np.abs(Y - ref) <= 1e-5 * bound + 1e-30)


@pytest.mark.parametrize("tname,hidden,ff", [("Q2_0", 1024, 512), ("Q8_0", 512, 256)])
@pytest.mark.parametrize("jt", [8, 16, 32])
def test_gpu_moe_jobs_match_float64(tname, hidden, ff, jt):
    import cupy as cp

    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.prefill import expert_jobs

    rng = np.random.default_rng(hidden)
    E, T, k = 6, 77, 4
    blobs, mats = _experts(rng, tname, E, hidden, ff)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    tt = jt
    je, jt, jd = expert_jobs(ids, tt)
    ptr = cp.asarray(np.array([int(blobs[e].data.ptr) for e in je], dtype=np.uint64))
    X = rng.standard_normal((T, hidden)).astype(np.float32)
    hbuf = cp.zeros((je.size * tt, ff), dtype=cp.float32)
    qmm.moe_gate_up(ptr, cp.asarray(jt), qmm.split(cp.asarray(X)), tname, hbuf, hidden, ff, tt)
    out = cp.full((T * k, hidden), cp.nan, dtype=cp.float32)
    bv, bb = qmm.BLOCK_VALUES[qmm.LAYOUTS[tname]], qmm.BLOCK_BYTES[qmm.LAYOUTS[tname]]
    qmm.moe_down(ptr, 2 * ff * hidden // bv * bb, cp.asarray(jd), qmm.split(hbuf), tname, out, hidden, ff, tt)
    out = cp.asnumpy(out).astype(np.float64)
    ref = np.empty_like(out)
    for t in range(T):
        x = X[t].astype(np.float64)
        for r in range(k):
            g, u, dn = mats[ids[t, r]]
            hg = g @ x
            ref[t * k + r] = dn @ (hg / (1.0 + np.exp(-hg)) * (u @ x))
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("layout,rows,cols,T", [("Q8R", 4, 10240, 32), ("Q8R", 320, 10240, 32), ("Q8R", 2560, 2560, 1),
                                              ("Q8_0", 6, 640, 7), ("Q2_0", 66, 1024, 20)])
@pytest.mark.parametrize("sm", ["0", "1"])
def test_gpu_dense_short_split_sums(layout, rows, cols, T, sm, monkeypatch):
    """Up to 32 tokens the split of k's slices is added by a launch of its own: qmm_sum_slices (STRATATOOLS_QMM_SUM=1;
    eight threads a run of 4 values, shuffles) or the CuPy reduction (0); within 1e-5 of float64 relative to |W| |x|
    (rows x T a multiple of 4 and not: 6 x 7), the same bits twice."""
    import cupy as cp

    from stratatools.runtime.gpu import qmm

    monkeypatch.setenv(qmm.SUM_ENV, sm)
    rng = np.random.default_rng(rows + T)
    args, W = _matrix(rng, layout, rows, cols)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    Y1 = cp.asnumpy(qmm.dense(cp.asarray(X), *args))
    Y2 = cp.asnumpy(qmm.dense(cp.asarray(X), *args))
    assert np.array_equal(Y1, Y2)
    ref = X.astype(np.float64) @ W.T
    assert np.all(np.abs(Y1 - ref) <= 1e-5 * (np.abs(X.astype(np.float64)) @ np.abs(W).T) + 1e-30)


@pytest.mark.parametrize("rows,cols,T", [(2560, 2560, 32), (12288, 2560, 32), (4, 10240, 32), (320, 10240, 17),
                                         (300, 1024, 1), (520, 640, 8), (37, 128, 16)])
@pytest.mark.parametrize("rg", [qmm_host._ring_name(r) for r in qmm_host.RINGS])
def test_gpu_dense_ring_matches_qmm_dense(rows, cols, T, rg, monkeypatch):
    """qmm_dense_ring (STRATATOOLS_QMM_RING, up to 32 tokens): within 1e-5 of float64 relative to |W| |x|, the same
    bits twice; with one group of warps and no split of k the same bits as qmm_dense (the same products in the same
    order)."""
    import cupy as cp

    from stratatools.runtime.gpu import kernels as K
    from stratatools.runtime.gpu import qmm

    rkc = int(rg.split(":")[1])
    if cols % rkc:
        pytest.skip("K is not whole chunks of the ring: qmm.dense takes qmm_dense")
    rng = np.random.default_rng(rows + cols + T)
    args, W = _matrix(rng, "Q8R", rows, cols)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    X[0] *= 1e3
    monkeypatch.setenv(qmm.RING_ENV, rg)
    monkeypatch.setenv(qmm.DENSE_I8_ENV, "0")  # (the fp16 ring; the integer ring's test is below)
    Y1 = cp.asnumpy(qmm.dense(cp.asarray(X), *args))
    assert np.array_equal(Y1, cp.asnumpy(qmm.dense(cp.asarray(X), *args)))
    ref = X.astype(np.float64) @ W.T
    assert np.all(np.abs(Y1 - ref) <= 1e-5 * (np.abs(X.astype(np.float64)) @ np.abs(W).T) + 1e-30)
    nz = qmm.dense_launch(T, rows, cols, "Q8R", K._device_limits()[0], rkc)[3]
    if nz == 1 and rg.count(":") == 1:  # (one group of warps: qmm_dense's order; groups add in another)
        monkeypatch.setenv(qmm.RING_ENV, "0")
        monkeypatch.setenv(qmm.DENSE2_ENV, "0")
        # qmm_dense without its own split of k (a grid that fills the SMs: the same single slice)
        if qmm.dense_launch(T, rows, cols, "Q8R", K._device_limits()[0])[3] == 1:
            assert np.array_equal(Y1, cp.asnumpy(qmm.dense(cp.asarray(X), *args)))


@pytest.mark.parametrize("rows,cols,T", [(2560, 2560, 32), (12288, 2560, 32), (4, 10240, 32), (320, 10240, 17),
                                         (300, 1024, 1), (520, 640, 8), (37, 128, 16)])
@pytest.mark.parametrize("rg", [qmm_host._ring_name(r) for r in qmm_host.DENSE_I8_RINGS])
def test_gpu_dense_i8_ring_matches_float64(rows, cols, T, rg, monkeypatch):
    """The integer dense ring (STRATATOOLS_QMM_DENSE_I8, up to 32 tokens: Q8R codes as signed bytes of mma.m16n8k32,
    activations as qmm_split_i8d's 16-bit fixed point per block of 64): every element within the fixed point's bound
    of float64 (hostlib.i8_bound), the same bits twice, a split made beforehand (split_kind "i8d") giving the same
    bits as the one dense makes, and within 1e-4 of the fp16 ring relative to the largest output."""
    import cupy as cp

    from hostlib import i8_bound

    from stratatools.runtime.gpu import qmm

    rkc = int(rg.split(":")[1])
    if cols % rkc:
        pytest.skip("K is not whole chunks of the ring: qmm.dense takes the fp16 path")
    rng = np.random.default_rng(rows + cols + T + 5)
    args, W = _matrix(rng, "Q8R", rows, cols)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    X[0] *= 1e3
    X[-1, 7] = 300.0  # an outlier: its block's other values keep fewer bits
    monkeypatch.setenv(qmm.DENSE_I8_ENV, rg)
    Xd = cp.asarray(X)
    assert qmm.split_kind(args[0], T, cols, args[1], args[2]) == "i8d"
    Y1 = cp.asnumpy(qmm.dense(Xd, *args))
    assert np.array_equal(Y1, cp.asnumpy(qmm.dense(Xd, *args)))
    assert np.array_equal(Y1, cp.asnumpy(qmm.dense(Xd, *args, xs=qmm.split_i8(Xd, dense=True))))
    ref = X.astype(np.float64) @ W.T
    for t in range(T):
        assert np.all(np.abs(Y1[t] - ref[t]) <= i8_bound(W, X[t].astype(np.float64))), t
    monkeypatch.setenv(qmm.DENSE_I8_ENV, "0")
    Y0 = cp.asnumpy(qmm.dense(Xd, *args))
    assert np.abs(Y1 - Y0).max() <= 1e-4 * np.abs(Y0).max()


@pytest.mark.parametrize("rows,cols,T", [(12288, 2560, 32), (4, 10240, 32), (10240, 320, 17), (37, 640, 5)])
@pytest.mark.parametrize("wg", [8, 2])
@pytest.mark.parametrize("i8,ring", [("3:128:2", "0"), ("4:64:2", "0"), ("0", "4:64:2")])
def test_gpu_dense_rings_of_8_or_2_warps(rows, cols, T, i8, ring, wg, monkeypatch):
    """STRATATOOLS_QMM_RING_WARPS=8 / 2 (groups of 8 or 2 warps, 128 or 32 rows a block) for the integer and the fp16
    rings: within their bounds of float64 (the fixed point's; fp16 hi + lo's 1e-5 of |W| |x|), the same bits twice."""
    import cupy as cp

    from hostlib import i8_bound

    from stratatools.runtime.gpu import qmm

    rng = np.random.default_rng(rows + cols + T + 8)
    args, W = _matrix(rng, "Q8R", rows, cols)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    X[0] *= 1e3
    monkeypatch.setenv(qmm.DENSE_I8_ENV, i8)
    monkeypatch.setenv(qmm.RING_ENV, ring)
    monkeypatch.setenv(qmm.RING_WARPS_ENV, str(wg))
    Xd = cp.asarray(X)
    Y = cp.asnumpy(qmm.dense(Xd, *args))
    assert np.array_equal(Y, cp.asnumpy(qmm.dense(Xd, *args)))
    ref = X.astype(np.float64) @ W.T
    for t in range(T):
        x = X[t].astype(np.float64)
        bound = i8_bound(W, x) if i8 != "0" else 1e-5 * (np.abs(W) @ np.abs(x)) + 1e-30
        assert np.all(np.abs(Y[t] - ref[t]) <= bound), t


@pytest.mark.parametrize("hidden,ff", [(2560, 640), (1024, 512), (640, 192), (640, 704)])
@pytest.mark.parametrize("jt", [8, 16, 32])
def test_gpu_moe_jobs_i8_match_float64(hidden, ff, jt):
    """The integer Q2_0 job kernels (mma.m16n8k32 on the codes, 16-bit fixed-point activations per block of 64) with
    blobs in VRAM against float64 per pair, within the fixed point's bound (each value off by at most half a step of
    its block of 64: hostlib.i8_bound) plus float32 sums, and the hidden rows of empty slots neither written nor split
    (NaN there)."""
    import cupy as cp

    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.prefill import expert_jobs

    rng = np.random.default_rng(hidden + jt)
    E, T, k = 6, 77, 4
    blobs, mats = _experts(rng, "Q2_0", E, hidden, ff)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    tt = jt
    je, jt, jd = expert_jobs(ids, tt)
    ptr = cp.asarray(np.array([int(blobs[e].data.ptr) for e in je], dtype=np.uint64))
    X = rng.standard_normal((T, hidden)).astype(np.float32)
    X[3] *= np.float32(1e5)
    hbuf = cp.full((je.size * tt, ff), cp.nan, dtype=cp.float32)
    qmm.moe_gate_up_i8(ptr, cp.asarray(jt), qmm.split_i8(cp.asarray(X)), hbuf, hidden, ff, tt)
    djd = cp.asarray(jd)
    hn = cp.asnumpy(hbuf)
    assert np.all(np.isfinite(hn[jt >= 0])) and np.all(np.isnan(hn[jt < 0]))
    out = cp.full((T * k, hidden), cp.nan, dtype=cp.float32)
    qmm.moe_down_i8(ptr, 2 * ff * hidden // 64 * 18, djd, qmm.split_i8(hbuf, djd), out, hidden, ff, tt)
    out = cp.asnumpy(out).astype(np.float64)
    from hostlib import i8_bound

    for t in range(T):
        x = X[t].astype(np.float64)
        for r in range(k):
            g, u, dn = mats[ids[t, r]]
            slot = int(np.nonzero(jd == t * k + r)[0][0])
            hg, hu = g @ x, u @ x
            eg, eu = i8_bound(g, x), i8_bound(u, x)
            bound_h = eg * (np.abs(hu) + eu) * 1.2 + np.abs(hg / (1.0 + np.exp(-hg))) * eu + 1e-30
            assert np.all(np.abs(hn[slot] - hg / (1.0 + np.exp(-hg)) * hu) <= bound_h), (t, r)
            hv = hn[slot].astype(np.float64)
            assert np.all(np.abs(out[t * k + r] - dn @ hv) <= i8_bound(dn, hv)), (t, r)


@pytest.mark.parametrize("hidden,ff", [(2560, 640), (640, 704), (1024, 192)])
@pytest.mark.parametrize("jt", [8, 16, 32])
def test_gpu_moe_jobs_i8_ring_is_qi8_tile(hidden, ff, jt, monkeypatch):
    """The integer jobs with their weights through the ring of shared-memory stages (STRATATOOLS_QMM_JOBS_RING, every
    ring of JOBS_RINGS) give the same bits as the register-prefetch tile (0), gate/up and down, blobs in VRAM at
    row offsets of every even value mod 16 (every job size: the launcher's limit to jobs of 8 lifted here)."""
    import cupy as cp

    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.prefill import expert_jobs

    rng = np.random.default_rng(hidden + 3 * jt)
    E, T, k = 6, 50, 4
    blobs, _ = _experts(rng, "Q2_0", E, hidden, ff)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    je, jtok, jd = expert_jobs(ids, jt)
    ptr = cp.asarray(np.array([int(blobs[e].data.ptr) for e in je], dtype=np.uint64))
    X = cp.asarray(rng.standard_normal((T, hidden)).astype(np.float32))
    djt, djd = cp.asarray(jtok), cp.asarray(jd)
    got = {}
    monkeypatch.setattr(qmm, "JOBS_RING_MAX_JT", 32)
    for rg in ["0"] + [f"{a}:{b}:{c}" for a, b, c in qmm.JOBS_RINGS]:
        monkeypatch.setenv(qmm.JOBS_RING_ENV, rg)
        hbuf = cp.full((je.size * jt, ff), cp.nan, dtype=cp.float32)
        qmm.moe_gate_up_i8(ptr, djt, qmm.split_i8(X), hbuf, hidden, ff, jt)
        out = cp.full((T * k, hidden), cp.nan, dtype=cp.float32)
        qmm.moe_down_i8(ptr, 2 * ff * hidden // 64 * 18, djd, qmm.split_i8(hbuf, djd), out, hidden, ff, jt)
        got[rg] = (cp.asnumpy(hbuf), cp.asnumpy(out))
    h0, o0 = got["0"]
    assert np.all(np.isfinite(o0))
    for rg, (h, o) in got.items():
        assert np.array_equal(h[jtok >= 0], h0[jtok >= 0]) and np.array_equal(o, o0), rg


@pytest.mark.parametrize("T,k,E,seed", [(32, 10, 256, 1), (512, 10, 256, 2), (1, 4, 300, 3), (40, 2, 3, 4),
                                        (33, 7, 12288, 5), (1000, 8, 64, 6)])
@pytest.mark.parametrize("jt", [8, 16, 32])
def test_gpu_device_job_table_matches_expert_jobs(T, k, E, seed, jt):
    """qmm.moe_jobs on the device (one block of 1,024 threads: the threads' scan of the experts' counts and the
    bitonic sort, which the host build runs with one thread) = expert_jobs' table, the spare jobs empty."""
    import cupy as cp

    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.prefill import expert_jobs

    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:k] if k <= E else rng.integers(0, E, k) for _ in range(T)]).astype(np.int32)
    if T > 16:
        ids[:, 0] = 1  # an expert with pairs of every token: several jobs
    ptr_row = (np.arange(E, dtype=np.uint64) * 4096 + 0x1000).astype(np.uint64)
    jp, tok, dst = (cp.asnumpy(a) for a in qmm.moe_jobs(cp.asarray(ids.reshape(-1)), k, E, cp.asarray(ptr_row), jt))
    je, rt, rd = expert_jobs(ids, jt)
    n = je.size
    assert jp.size == qmm.job_capacity(ids.size, E, jt) >= n
    assert np.array_equal(jp[:n], ptr_row[je]) and np.array_equal(tok[:n * jt], rt) and np.array_equal(dst[:n * jt], rd)
    assert np.all(jp[n:] == ptr_row[0]) and np.all(tok[n * jt:] == -1) and np.all(dst[n * jt:] == -1)


@pytest.mark.parametrize("T,R,K", [(32, 257, 2560), (1, 257, 2560), (7, 33, 132), (32, 64, 128), (5, 40, 260)])
def test_gpu_f32_nt_matches_float64(T, R, K):
    """qmm.f32_nt (the batched step's router: qmm_f32_nt's slices of k, qmm_sum_slices) within 2e-6 of float64
    relative to |X| |W| element by element, the same bits on a second launch, and within the same bound of cuBLAS's
    SGEMM."""
    import cupy as cp

    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.blas import sgemm_nt

    rng = np.random.default_rng(T + R + K)
    X = rng.standard_normal((T, K)).astype(np.float32)
    W = (0.05 * rng.standard_normal((R, K))).astype(np.float32)
    Xd, Wd = cp.asarray(X), cp.asarray(W)
    assert qmm.f32_nt_applies(Xd, Wd)
    Y = cp.asnumpy(qmm.f32_nt(Xd, Wd))
    assert Y.shape == (T, R) and np.array_equal(Y, cp.asnumpy(qmm.f32_nt(Xd, Wd)))
    mag = np.abs(X.astype(np.float64)) @ np.abs(W.astype(np.float64)).T
    assert np.all(np.abs(Y - X.astype(np.float64) @ W.astype(np.float64).T) <= 2e-6 * mag)
    assert np.all(np.abs(Y - cp.asnumpy(sgemm_nt(Xd, Wd))) <= 4e-6 * mag)


@pytest.mark.parametrize("layout,rows,cols", [("Q8R", 2560, 2560), ("Q8R", 300, 1056), ("Q8_0", 520, 640),
                                              ("Q2_0", 264, 1024)])
@pytest.mark.parametrize("T", [1, 7, 32, 512])
def test_gpu_hgemm_matches_float64(layout, rows, cols, T):
    """qmm.hgemm (Wh + Wl = W in fp16, three cuBLAS fp16 GEMMs into float32, the rows' scales) within 1e-5 of
    float64 relative to |W| |x| element by element, as qmm.dense is held above (a dropped hi/lo term would be
    ~2e-4); the worst errors of both printed (expected about 1e-6)."""
    import cupy as cp

    from stratatools.runtime.gpu import qmm

    rng = np.random.default_rng(rows + T + 1)
    args, W = _matrix(rng, layout, rows, cols)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    X[0] *= np.float32(1e4)
    if T > 2:
        X[1] *= np.float32(1e-20)
    Y = qmm.hgemm(cp.asarray(X), *args)
    assert Y is not None and Y.shape == (T, rows) and Y.dtype == cp.float32
    Y = cp.asnumpy(Y).astype(np.float64)
    ref = X.astype(np.float64) @ W.T
    bound = np.abs(X.astype(np.float64)) @ np.abs(W.T)
    err = np.abs(Y - ref) / np.maximum(bound, 1e-300)
    Yd = cp.asnumpy(qmm.dense(cp.asarray(X), *args)).astype(np.float64)
    err_d = np.abs(Yd - ref) / np.maximum(bound, 1e-300)
    print(f"hgemm {layout} {rows}x{cols} T={T}: worst {err.max():.2e} of |W||x| (mma {err_d.max():.2e})")
    assert err.max() < 1e-5


def test_gpu_hgemm_overflow_check():
    """A matrix with a value past fp16's range: hgemm's check returns None (the prefill takes the mma kernel); the
    same matrix at half the scale fits."""
    import cupy as cp

    from stratatools.runtime.gpu import qmm

    rng = np.random.default_rng(9)
    rows, cols, T = 64, 256, 5
    raw = _blocks(rng, "Q8_0", rows, cols).reshape(-1, 34)
    raw[3, :2] = np.float16(1024.0).reshape(1).view(np.uint8)
    raw[3, 2:] = 100  # 102,400
    X = cp.asarray(rng.standard_normal((T, cols)).astype(np.float32))
    assert qmm.hgemm(X, "Q8_0", cp.asarray(raw.reshape(-1)), None, rows, cols) is None
    raw[3, :2] = np.float16(512.0).reshape(1).view(np.uint8)  # 51,200
    W = np.asarray(dequantize(raw.reshape(-1), "Q8_0", rows * cols)).reshape(rows, cols).astype(np.float64)
    Y = cp.asnumpy(qmm.hgemm(X, "Q8_0", cp.asarray(raw.reshape(-1)), None, rows, cols)).astype(np.float64)
    Xh = cp.asnumpy(X).astype(np.float64)
    assert np.all(np.abs(Y - Xh @ W.T) <= 1e-5 * (np.abs(Xh) @ np.abs(W.T)))


@pytest.mark.parametrize("T,big,taken", [(256, 1 << 16, True), (64, 1 << 16, False), (256, 1 << 30, False)])
def test_gpu_prefill_big_matrices_through_cublas(T, big, taken, monkeypatch):
    """STRATATOOLS_PREFILL_BIG on the mma prefill path: a matrix of at least that many weights times at least 128
    rows goes through qmm.hgemm (its transient fp16 split shows in the fp16 check's record), else the tensor-core
    kernel; both within 1e-5 of float64 relative to |W| |x|."""
    import cupy as cp

    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.dequant import dequantize
    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.prefill import ChunkPrefill

    monkeypatch.setenv(qmm.BIG_ENV, str(big))
    rng = np.random.default_rng(T)
    rows, cols = 384, 512
    raw = _blocks(rng, "Q8_0", rows, cols)
    W = np.asarray(dequantize(raw, "Q8_0", rows * cols)).reshape(rows, cols).astype(np.float64)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    pf = ChunkPrefill.__new__(ChunkPrefill)
    pf.gpu, pf.cp, pf.gemm = True, cp, "mma"
    assert pf._big_hgemm(rows, cols, T) is taken
    Y = cp.asnumpy(pf._qmm(cp.asarray(X), cp.asarray(raw), type_by_name("Q8_0"), rows, cols, "w")).astype(np.float64)
    assert ("w" in pf._hgemm_fits()) is taken
    ref = X.astype(np.float64) @ W.T
    bound = np.abs(X.astype(np.float64)) @ np.abs(W).T
    assert np.all(np.abs(Y - ref) <= 1e-5 * bound)


@pytest.mark.parametrize("T", [1, 32])
def test_gpu_hc_kernels_split_as_split_i8(T):
    """The hyper-connections' fused launches on the device: qmm.hc_norm_split (inject in place, RMS norm within 2e-6
    of float64, its planes split_i8 ``dense`` of its hn bit for bit), qmm.hc_mix (within 2e-6 of float64, planes of
    both kinds split_i8 of its output bit for bit), and dense(planes=True) of the down projection's shape (320 x
    10,240 with silu: the sums' launch) equal to split_i8 of its output."""
    import cupy as cp

    rng = np.random.default_rng(T)
    hc, n, eps = 4, 2560, 1e-6
    H0 = rng.standard_normal((T, hc * n)).astype(np.float32)
    y = rng.standard_normal((T, n)).astype(np.float32)
    iw = rng.uniform(0.5, 1.5, (T, hc)).astype(np.float32)
    w = (rng.standard_normal(hc * n) + 1).astype(np.float32)
    H = cp.asarray(H0)
    hn, pl = qmm_host.hc_norm_split(H, cp.asarray(w), eps, hc, n, cp.asarray(y), cp.asarray(iw), "i8d")
    Hw = (H0.reshape(T, hc, n) + y[:, None, :] * iw[:, :, None]).reshape(T * hc, n).astype(np.float64)
    assert np.allclose(cp.asnumpy(H).reshape(T * hc, n), Hw, rtol=1e-6, atol=1e-6)
    ref = Hw / np.sqrt((Hw * Hw).mean(axis=1, keepdims=True) + eps) * np.resize(w, (T * hc, n))
    assert np.allclose(cp.asnumpy(hn).reshape(T * hc, n), ref, rtol=2e-6, atol=2e-6)
    for a, b in zip(pl, qmm_host.split_i8(hn, dense=True)):
        assert np.array_equal(cp.asnumpy(a), cp.asnumpy(b))
    u = cp.asarray(rng.standard_normal((T, hc * n)).astype(np.float32))
    su = 1.0 / (1.0 + np.exp(-cp.asnumpy(u).astype(np.float64)))
    mref = (su * cp.asnumpy(hn).astype(np.float64)).reshape(T, hc, n).sum(axis=1) / hc
    for kind in ("i8", "i8d"):
        mixed, mp = qmm_host.hc_mix(u, hn, hc, n, kind)
        assert np.allclose(cp.asnumpy(mixed), mref, rtol=2e-6, atol=2e-6)
        for a, b in zip(mp, qmm_host.split_i8(mixed, dense=kind == "i8d")):
            assert np.array_equal(cp.asnumpy(a), cp.asnumpy(b))
    rows, cols = 320, hc * n
    raw = _blocks(rng, "Q8_0", rows, cols)
    from stratatools.runtime.gpu.kernels import q8_relayout

    q, d = q8_relayout(raw, rows, cols)
    xs = qmm_host.split_i8(hn, dense=True)
    plain = qmm_host.dense(hn, "Q8R", cp.asarray(q), cp.asarray(d), rows, cols, xs=xs, act=qmm_host.ACT_SILU,
                           act_div=4.0)
    m, mp = qmm_host.dense(hn, "Q8R", cp.asarray(q), cp.asarray(d), rows, cols, xs=xs, act=qmm_host.ACT_SILU,
                           act_div=4.0, planes=True)
    assert np.array_equal(cp.asnumpy(m), cp.asnumpy(plain))
    for a, b in zip(mp, qmm_host.split_i8(m, dense=True)):
        assert np.array_equal(cp.asnumpy(a), cp.asnumpy(b))


def test_gpu_dense_hc_rd_matches_float64():
    """dense(hc_rd=) on the device (the hyper-connection's down and inject projections as one 324 x 10,240 matrix at
    32 tokens: one product, one qmm_sum_hc): silu and 2 sigmoid of the outputs within 1e-4 of float64's (relative to
    the largest), the planes split_i8 of m bit for bit."""
    import cupy as cp

    from stratatools.runtime.gpu.kernels import q8_relayout

    rng = np.random.default_rng(3)
    T, rd, cols, div = 32, 320, 10240, 4.0
    raw = _blocks(rng, "Q8_0", rd + 4, cols)
    q, d = q8_relayout(raw, rd + 4, cols)
    W = np.asarray(dequantize(raw, "Q8_0", (rd + 4) * cols)).reshape(rd + 4, cols).astype(np.float64)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    m, pl, iw = qmm_host.dense(cp.asarray(X), "Q8R", cp.asarray(q), cp.asarray(d), rd + 4, cols, act_div=div,
                               hc_rd=rd)
    ref = X.astype(np.float64) @ W.T
    tol = 1e-4 * np.abs(ref).max()
    a = ref[:, :rd] / div
    with np.errstate(over="ignore"):
        assert np.abs(cp.asnumpy(m) - a / (1 + np.exp(-a))).max() <= tol
        assert np.abs(cp.asnumpy(iw) - 2 / (1 + np.exp(-ref[:, rd:] / div))).max() <= tol
    for x, y in zip(pl, qmm_host.split_i8(m, dense=True)):
        assert np.array_equal(cp.asnumpy(x), cp.asnumpy(y))
