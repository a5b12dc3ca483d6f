"""Dequantization of ggml tensor blocks to float32, on the CPU (numpy) or the GPU (CuPy).

One entry point for every ggml type that appears in the kit and in the ISTA-DASLab releases:
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XS,
IQ2_S, IQ1_M and Q2_0 (plus any other type the ``gguf`` package can dequantize, on the CPU only).

* numpy path: ``gguf.quants.dequantize`` (gguf 0.19.0) for every type it knows, and the project's Q2_0
  decoder (:func:`stratatools.model.quantize.dequantize_q2_0`, formats.md section 1), which that package does not know.
* CuPy path (``xp=cupy``): the kernels of :mod:`stratatools.runtime.gpu.dequant`, which give bit-identical float32
  results (same arithmetic order, no fused multiply-add). Imported only when asked for, so this module
  imports on machines without CuPy.

Block layouts are ggml's (llama.cpp ``ggml-common.h``); sizes come from :mod:`stratatools.model.ggml_types`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.model.ggml_types import GGMLType, block_values, type_by_id, type_by_name
from stratatools.model.quantize import dequantize_q2_0

#: Types every path (numpy and CuPy) must support; the GPU kernels cover exactly these.
SUPPORTED_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S", "IQ1_M", "Q2_0",
)


def as_type(gtype: GGMLType | int | str) -> GGMLType:
    """Normalise a type given as :class:`GGMLType`, ggml id or name. Raises StrataError when unknown."""
    if isinstance(gtype, GGMLType):
        return gtype
    if isinstance(gtype, str):
        return type_by_name(gtype)
    return type_by_id(int(gtype))


def _is_cupy(xp: Any) -> bool:
    return getattr(xp, "__name__", "") == "cupy"


def q2_0_dequantize(raw: np.ndarray) -> np.ndarray:
    """Dequantize Q2_0 blocks (ggml type 42) with numpy: :func:`stratatools.model.quantize.dequantize_q2_0` on flat bytes.

    Block (18 bytes, 64 values): fp16 scale ``d``, then 16 bytes of 2-bit codes; value j is
    ``(qs[j // 4] >> (2 * (j % 4))) & 3`` and dequantizes to ``(code - 1) * d`` (levels -d, 0, d, 2d).
    Source: formats.md section 1 (llama.cpp ``ggml-common.h`` block_q2_0).

    Args:
        raw: uint8 array whose size is a multiple of 18.
    Returns:
        float32 array of ``raw.size // 18 * 64`` values.
    Raises:
        StrataError: a size that is not whole 18-byte blocks.
    """
    return dequantize_q2_0(np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1))


def _dequantize_numpy(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    if t.name == "Q2_0":
        return q2_0_dequantize(raw)
    if t.name == "F32":
        return raw.view("<f4").astype(np.float32, copy=True)
    if t.name == "F16":
        return raw.view("<f2").astype(np.float32)
    if t.name == "BF16":
        return (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    # gguf.quants already implements ggml's block formats bit for bit; a thin wrapper keeps one reference.
    import gguf
    from gguf import quants

    try:
        qt = gguf.GGMLQuantizationType(t.id)
    except ValueError:
        raise StrataError(f"ggml type {t.name} (id {t.id}) cannot be dequantized: no decoder for it") from None
    try:
        out = quants.dequantize(raw.reshape(-1, t.type_size), qt)
    except NotImplementedError:
        raise StrataError(f"ggml type {t.name} cannot be dequantized: the gguf package has no decoder for it") from None
    return np.asarray(out, dtype=np.float32).reshape(-1)


def dequantize(raw: Any, gtype: GGMLType | int | str, n_values: int | None = None, xp: Any = np) -> Any:
    """Dequantize ggml blocks to a flat float32 array.

    Args:
        raw: uint8 array (numpy, or CuPy when ``xp`` is cupy; a numpy array is copied to the device then)
            holding whole blocks of ``gtype``.
        gtype: :class:`GGMLType`, ggml type id or type name.
        n_values: expected number of values; checked against the byte size when given.
        xp: array module, ``numpy`` (default) or ``cupy``.
    Returns:
        ``xp`` float32 array of shape ``[n_values]``.
    Raises:
        StrataError: a byte size that is not whole blocks or disagrees with ``n_values``; a type nobody can
            decode (on the GPU: a type outside :data:`SUPPORTED_TYPES`).
    """
    t = as_type(gtype)
    if _is_cupy(xp):
        from stratatools.runtime.gpu import dequant as gpu_dequant

        return gpu_dequant.dequantize(raw, t, n_values)
    arr = np.asarray(raw)
    if arr.dtype != np.uint8:
        arr = np.ascontiguousarray(arr).view(np.uint8)
    arr = np.ascontiguousarray(arr).reshape(-1)
    if block_values(arr.size, t, n_values) == 0:
        return np.empty(0, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf scales decode to NaN/inf, as in ggml
        return _dequantize_numpy(arr, t)


def dequantize_rows(raw: Any, gtype: GGMLType | int | str, ne: Sequence[int], xp: Any = np) -> Any:
    """Dequantize a whole tensor given its ggml shape ``ne`` (ne0 innermost).

    Args:
        raw: the tensor's bytes (uint8, numpy or CuPy).
        gtype: its type.
        ne: ggml shape; ``ne[0]`` must be a whole number of blocks.
    Returns:
        ``xp`` float32 array of numpy shape ``tuple(reversed(ne))`` (rows of ne0 values).
    Raises:
        StrataError: ne0 not a whole number of blocks, or the byte size does not match ``ne``.
    """
    t = as_type(gtype)
    ne = [int(x) for x in ne]
    if not ne:
        raise StrataError("a tensor shape needs at least one dimension")
    t.row_bytes(ne[0])  # raises when ne0 is not whole blocks
    n = 1
    for x in ne:
        n *= x
    return dequantize(raw, t, n, xp=xp).reshape(tuple(reversed(ne)))
