"""GPU dequantization: ggml blocks (in device or host memory) to float32 device arrays, bit-identical to the
numpy path of :mod:`stratatools.runtime.dequant` (kernels in :mod:`stratatools.runtime.gpu.kernels`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.model.ggml_types import GGMLType, block_values

from stratatools.runtime.gpu import require_cupy
from stratatools.runtime.gpu.kernels import UNIT, kernel


def to_device_bytes(raw: Any) -> Any:
    """A flat contiguous uint8 CuPy array of ``raw`` (copied to the device when it is a host array)."""
    cp = require_cupy()
    if isinstance(raw, cp.ndarray):
        arr = raw if raw.dtype == cp.uint8 else cp.ascontiguousarray(raw).view(cp.uint8)
        return cp.ascontiguousarray(arr).reshape(-1)
    host = np.ascontiguousarray(np.asarray(raw))
    if host.dtype != np.uint8:
        host = host.view(np.uint8)
    return cp.asarray(host.reshape(-1))


def dequantize(raw: Any, t: GGMLType, n_values: int | None = None) -> Any:
    """Dequantize whole blocks of type ``t`` on the GPU.

    Args:
        raw: uint8 bytes (CuPy array, or a numpy array / memory-map slice that is copied to the device).
        t: the ggml type; one of :data:`stratatools.runtime.dequant.SUPPORTED_TYPES`.
        n_values: expected value count, checked against the byte size.
    Returns:
        CuPy float32 array ``[n_values]``.
    Raises:
        StrataError: size not whole blocks or not ``n_values``; a type without a GPU kernel.
    """
    cp = require_cupy()
    arr = to_device_bytes(raw)
    n = block_values(int(arr.size), t, n_values)
    if n == 0:
        return cp.empty(0, dtype=cp.float32)
    if t.name == "F32":
        return arr.view(cp.float32).copy()
    if t.name == "F16":
        return arr.view(cp.float16).astype(cp.float32)
    if t.name == "BF16":
        return (arr.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    if t.id not in UNIT:
        raise StrataError(f"ggml type {t.name} has no GPU dequantizer (supported: see stratatools.runtime.dequant.SUPPORTED_TYPES)")
    out = cp.empty(n, dtype=cp.float32)
    n_groups = n // 8
    threads = 256
    blocks = (n_groups + threads - 1) // threads
    kernel("dequant_kernel", t.id)((blocks,), (threads,), (arr, out, np.int64(n_groups)))
    return out
