"""cuBLAS SGEMM for the batched prefill and the batched decode step: ``Y[T, R] = X[T, K] W[R, K]^T`` in float32.

CuPy's ``matmul`` refuses to call cuBLAS while a stream is being captured into a CUDA graph (NotImplementedError),
although cuBLAS supports capture; the batched decode step is captured (:mod:`stratatools.runtime.gpu.batch`), so its
dense GEMMs go through this thin call of cuBLAS's ``sgemm`` on the current stream instead (the eager steps too, so
that a replayed step and an eager one run the same cuBLAS call and agree bit for bit). Importing this module needs no
CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stratatools.core.errors import StrataError

_ONE = np.ones(1, dtype=np.float32)  # host scalars cuBLAS reads at the call (pointer mode host)
_ZERO = np.zeros(1, dtype=np.float32)


def _cublas() -> Any:
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:  # older CuPy layouts
        from cupy.cuda import cublas
    return cublas


def sgemm_nt(X: Any, W: Any, out: Any = None) -> Any:
    """``X @ W.T`` for float32 CuPy arrays X [T, K] and W [R, K] (made contiguous first): returns ``out`` or a new
    float32 [T, R] array. Runs cuBLAS ``sgemm`` on the current stream (also while it is captured).

    Raises StrataError for shapes that do not match or an ``out`` that is not a contiguous float32 [T, R] array."""
    import cupy as cp

    if X.ndim != 2 or W.ndim != 2 or int(X.shape[1]) != int(W.shape[1]):
        raise StrataError(f"sgemm: X {tuple(X.shape)} and W {tuple(W.shape)} are not [T, K] and [R, K]")
    X = cp.ascontiguousarray(X, dtype=cp.float32)
    W = cp.ascontiguousarray(W, dtype=cp.float32)
    T, K = (int(s) for s in X.shape)
    R = int(W.shape[0])
    if out is None:
        out = cp.empty((T, R), dtype=cp.float32)
    elif out.dtype != cp.float32 or tuple(out.shape) != (T, R) or not out.flags.c_contiguous:
        raise StrataError(f"sgemm: out {tuple(out.shape)} {out.dtype} is not a contiguous float32 [{T}, {R}]")
    if T == 0 or R == 0:
        return out
    if K == 0:
        out.fill(0)
        return out
    cublas = _cublas()
    h = cp.cuda.device.get_cublas_handle()
    cublas.setStream(h, cp.cuda.get_current_stream().ptr)
    # column-major view: Y^T [R, T] = (W^T)^T [R, K] . X^T [K, T]; W^T and X^T are the row-major arrays as stored
    cublas.sgemm(h, 1, 0, R, T, K, _ONE.ctypes.data, W.data.ptr, K, X.data.ptr, K, _ZERO.ctypes.data, out.data.ptr, R)
    return out
