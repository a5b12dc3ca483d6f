"""cuBLAS SGEMM that a CUDA-graph capture may record: ``Y[T, R] = X[T, K] W[R, K]^T`` in float32; and the fp16 GEMM
with float32 output and accumulation of the ``hgemm`` path (:func:`gemm16`, :func:`stratatools.runtime.gpu.qmm.hgemm`;
CuPy's matmul of fp16 arrays returns fp16), through the same library call eagerly and in a capture.

CuPy refuses every cuBLAS call while a stream is being captured (its ``setStream`` raises NotImplementedError),
although cuBLAS supports capture; the batched decode step is captured (:mod:`stratatools.runtime.gpu.batch`), so its
dense GEMMs there call the cuBLAS library CuPy already loaded, through ctypes, on CuPy's handle. Eager steps keep
CuPy's ``matmul``. Importing this module needs no CuPy.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError

_ONE = np.ones(1, dtype=np.float32)  # host scalars cuBLAS reads at the call (pointer mode host)
_ZERO = np.zeros(1, dtype=np.float32)


@functools.lru_cache(maxsize=1)
def _lib() -> Any:
    """The cuBLAS library of this process (the one CuPy loaded: found among the mapped libraries), with the two
    entry points used here typed."""
    import ctypes.util

    import cupy as cp

    cp.cuda.device.get_cublas_handle()  # CuPy loads cuBLAS on its first handle
    path = None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                name = line.split()[-1] if line.strip() else ""
                if "libcublas.so" in name and "libcublasLt" not in name:
                    path = name
                    break
    except OSError:
        pass
    path = path or ctypes.util.find_library("cublas")
    if path is None:
        raise StrataError("cuBLAS: the library CuPy uses was not found among this process's libraries")
    lib = ctypes.CDLL(path)
    vp, ci = ctypes.c_void_p, ctypes.c_int
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSgemm_v2.argtypes = [vp, ci, ci, ci, ci, ci, vp, vp, ci, vp, ci, vp, vp, ci]
    lib.cublasGemmEx.argtypes = [vp, ci, ci, ci, ci, ci, vp, vp, ci, ci, vp, ci, ci, vp, vp, ci, ci, ci, ci]
    return lib


def _on_stream() -> tuple[Any, int, int]:
    """The library, CuPy's cuBLAS handle set to the current stream, and that call's status (0: set)."""
    import cupy as cp

    lib = _lib()
    h = cp.cuda.device.get_cublas_handle()
    return lib, h, lib.cublasSetStream_v2(h, cp.cuda.get_current_stream().ptr)


def sgemm_nt(X: Any, W: Any, out: Any = None) -> Any:
    """``X @ W.T`` for float32 CuPy arrays X [T, K] and W [R, K] (made contiguous first): returns ``out`` or a new
    float32 [T, R] array, computed by cuBLAS ``cublasSgemm`` on the current stream (also while it is captured).

    Raises StrataError for shapes that do not match, an ``out`` that is not a contiguous float32 [T, R] array, or a
    cuBLAS error status."""
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
    lib, h, st = _on_stream()
    # column-major view: Y^T [R, T] = (W^T)^T [R, K] . X^T [K, T]; W^T and X^T are the row-major arrays as stored
    if st == 0:
        st = lib.cublasSgemm_v2(h, 1, 0, R, T, K, _ONE.ctypes.data, W.data.ptr, K, X.data.ptr, K, _ZERO.ctypes.data,
                                out.data.ptr, R)
    if st != 0:
        raise StrataError(f"cuBLAS sgemm of [{T}, {K}] x [{R}, {K}]^T failed with status {st}")
    return out


def gemm16(A: Any, B: Any, Y: Any, accumulate: bool) -> None:
    """``Y (+)= B A^T`` on the current stream (eagerly, or recorded by a capture): A [R, K] and B [T, K] fp16 bits
    (uint16, C-contiguous CuPy arrays), Y float32 [T, R] C-contiguous; products and sums in float32 (cuBLAS
    ``cublasGemmEx``, CUBLAS_COMPUTE_32F, scalars from host memory as :func:`sgemm_nt`'s). The caller checks shapes
    and layout (:func:`stratatools.runtime.gpu.qmm.hgemm`). Raises StrataError for a cuBLAS error status."""
    R, K = (int(v) for v in A.shape)
    T = int(B.shape[0])
    lib, h, st = _on_stream()
    # column-major view as in sgemm_nt; 2 = CUDA_R_16F, 0 = CUDA_R_32F, 68 = CUBLAS_COMPUTE_32F,
    # -1 = CUBLAS_GEMM_DEFAULT
    if st == 0:
        st = lib.cublasGemmEx(h, 1, 0, R, T, K, _ONE.ctypes.data, A.data.ptr, 2, K, B.data.ptr, 2, K,
                              (_ONE if accumulate else _ZERO).ctypes.data, Y.data.ptr, 0, R, 68, -1)
    if st != 0:
        raise StrataError(f"cuBLAS fp16 GEMM of [{T}, {K}] x [{R}, {K}]^T failed with status {st}")
