"""``runtime/gpu/blas.py`` (cuBLAS SGEMM through ctypes, so that a captured batched step may run it) against numpy:
shapes of one row, non-contiguous inputs, an empty inner dimension, the same result inside a CUDA graph as eagerly;
the fp16 GEMM with float32 output of the hgemm path likewise, and qmm.hgemm inside a captured graph. Skips without
CuPy and a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from stratatools.core.errors import StrataError
from stratatools.runtime import gpu

pytestmark = pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")


@pytest.mark.parametrize("T,K,R", [(1, 64, 40), (7, 130, 33), (32, 2560, 512)])
def test_sgemm_matches_numpy(T, K, R):
    import cupy as cp

    from stratatools.runtime.gpu.blas import sgemm_nt

    rng = np.random.default_rng(T + K + R)
    X = rng.standard_normal((T, 2 * K)).astype(np.float32)[:, ::2]  # not contiguous
    W = rng.standard_normal((R, K)).astype(np.float32)
    got = cp.asnumpy(sgemm_nt(cp.asarray(X), cp.asarray(W)))
    ref = X.astype(np.float64) @ W.astype(np.float64).T
    assert got.shape == (T, R)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(X).max() * np.abs(W).max() * K


def test_sgemm_edges_and_capture():
    import cupy as cp

    from stratatools.runtime.gpu.blas import sgemm_nt

    out = sgemm_nt(cp.zeros((3, 0), cp.float32), cp.zeros((4, 0), cp.float32))
    assert out.shape == (3, 4) and float(cp.abs(out).max()) == 0.0
    with pytest.raises(StrataError, match="not"):
        sgemm_nt(cp.zeros((3, 5), cp.float32), cp.zeros((4, 6), cp.float32))
    with pytest.raises(StrataError, match="contiguous float32"):
        sgemm_nt(cp.zeros((3, 5), cp.float32), cp.zeros((4, 5), cp.float32), out=cp.zeros((4, 3), cp.float32))
    rng = np.random.default_rng(1)
    X = cp.asarray(rng.standard_normal((16, 256)).astype(np.float32))
    W = cp.asarray(rng.standard_normal((96, 256)).astype(np.float32))
    eager = cp.asnumpy(sgemm_nt(X, W))
    s = cp.cuda.Stream(non_blocking=True)
    Y = cp.zeros((16, 96), cp.float32)
    with s:
        s.begin_capture()
        sgemm_nt(X, W, out=Y)
        g = s.end_capture()
    assert float(cp.abs(Y).max()) == 0.0  # capturing ran nothing
    g.launch(stream=s)
    s.synchronize()
    assert np.array_equal(cp.asnumpy(Y), eager)


def test_gemm16_matches_numpy_eager_and_captured():
    """gemm16: Y = B A^T, then Y += B A^T, float32 output of fp16 operands (exact products, float32 sums), eagerly and
    replayed from a CUDA graph (the same bits); qmm.hgemm unchecked inside a captured graph gives its eager result."""
    import cupy as cp

    from stratatools.runtime.dequant import dequantize
    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.blas import gemm16

    rng = np.random.default_rng(2)
    A = cp.asarray(rng.standard_normal((40, 64)).astype(np.float16).view(np.uint16))
    B = cp.asarray(rng.standard_normal((3, 64)).astype(np.float16).view(np.uint16))
    ref = cp.asnumpy(B).view(np.float16).astype(np.float64) @ cp.asnumpy(A).view(np.float16).astype(np.float64).T
    Y = cp.full((3, 40), 7.0, dtype=cp.float32)
    gemm16(A, B, Y, False)
    assert np.abs(cp.asnumpy(Y) - ref).max() <= 1e-5 * np.abs(ref).max()
    gemm16(A, B, Y, True)
    eager = cp.asnumpy(Y)
    assert np.abs(eager - 2 * ref).max() <= 2e-5 * np.abs(ref).max()
    s = cp.cuda.Stream(non_blocking=True)
    Y2 = cp.zeros((3, 40), cp.float32)
    with s:
        s.begin_capture()
        gemm16(A, B, Y2, False)
        gemm16(A, B, Y2, True)
        g = s.end_capture()
    g.launch(stream=s)
    s.synchronize()
    assert np.array_equal(cp.asnumpy(Y2), eager)
    # the whole hgemm (weight split, X split, GEMMs, scales) of a Q8_0 matrix in a graph, as the batched step has it
    rows, cols, T = 48, 256, 8
    nb = rows * cols // 32
    blk = np.empty((nb, 34), np.uint8)
    blk[:, :2] = (rng.standard_normal(nb) * 0.02).astype(np.float16).view(np.uint8).reshape(nb, 2)
    blk[:, 2:] = rng.integers(0, 256, size=(nb, 32)).astype(np.uint8)
    raw = cp.asarray(blk.reshape(-1))
    X = cp.asarray(rng.standard_normal((T, cols)).astype(np.float32))
    want = cp.asnumpy(qmm.hgemm(X, "Q8_0", raw, None, rows, cols))
    W = np.asarray(dequantize(blk.reshape(-1), "Q8_0", rows * cols)).reshape(rows, cols).astype(np.float64)
    Xh = cp.asnumpy(X).astype(np.float64)
    assert np.all(np.abs(want - Xh @ W.T) <= 1e-5 * (np.abs(Xh) @ np.abs(W.T)))
    pool = cp.cuda.MemoryPool()  # as BatchDecoder._capture: an eager run fills the graph's pool, then the capture
    with cp.cuda.using_allocator(pool.malloc), s:
        qmm.hgemm(X, "Q8_0", raw, None, rows, cols, check=False)
        s.synchronize()
        mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)
        s.begin_capture(mode=mode) if mode is not None else s.begin_capture()
        out = qmm.hgemm(X, "Q8_0", raw, None, rows, cols, check=False)
        g = s.end_capture()
    g.launch(stream=s)
    s.synchronize()
    assert np.array_equal(cp.asnumpy(out), want)
