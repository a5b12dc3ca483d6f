"""``runtime/gpu/blas.py`` (cuBLAS SGEMM through ctypes, so that a captured batched step may run it) against numpy:
shapes of one row, non-contiguous inputs, an empty inner dimension, the same result inside a CUDA graph as eagerly.
Skips without CuPy and a GPU."""

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
