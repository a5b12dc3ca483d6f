"""Block quantizers the synthetic releases need, and random-but-valid blocks for large benchmark models.

* :func:`quantize` turns float32 rows into the bytes of one ggml type: F32, F16, BF16, Q8_0 and Q4_0 (numpy, the
  rounding of ggml-quants.c ``quantize_row_q8_0_ref`` / ``quantize_row_q4_0_ref``; bit-identical to
  ``gguf.quants``, tests/test_synth.py checks it, without importing ``gguf`` at run time), **Q2_0** (``gguf``
  0.19.0 does not know type 42).
* Q2_0 block (formats.md section 1; llama.cpp ggml-common.h ``block_q2_0``): fp16 scale ``d`` then 16 bytes of
  2-bit codes; value j is code ``(qs[j // 4] >> (2 * (j % 4))) & 3`` and dequantizes to ``(code - 1) * d``
  (levels -d, 0, d, 2d; a negative d mirrors them).
* :func:`random_blocks` fills blocks of types whose first two bytes are the fp16 super-scale ``d`` (Q*_0, Q*_1,
  IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, Q4_K, Q5_K; ggml-common.h) with random code bytes and
  a sane random scale: every bit pattern of those code fields is a valid block (grid indices cover their tables).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.model.ggml_types import GGMLType, type_by_name

Q2_0_BLOCK = 64
Q2_0_BYTES = 18


def quantize_q2_0(x: np.ndarray) -> np.ndarray:
    """Quantize float rows to Q2_0.

    Args:
        x: float array (..., n) with n a multiple of 64.

    Returns:
        uint8 array (..., n // 64 * 18): per block fp16 d then 16 code bytes.

    The scale per block is the best (least squared error) of 16 candidates, both signs of d, so blocks leaning
    negative use mirrored levels. Raises StrataError when n is not a multiple of 64.
    """
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1]
    if n % Q2_0_BLOCK:
        raise StrataError(f"Q2_0 needs rows of a multiple of {Q2_0_BLOCK} values, got {n}")
    lead = x.shape[:-1]
    b = x.reshape(-1, Q2_0_BLOCK)
    mx = b.max(axis=1)
    mn = b.min(axis=1)
    d_pos = np.maximum(mx / 2, -mn)     # levels -d..2d cover [mn, mx]
    d_neg = -np.maximum(-mn / 2, mx)    # mirrored: levels d..-2d
    fr = np.linspace(0.35, 1.0, 8, dtype=np.float32)
    cands = np.concatenate([d_pos[None, :] * fr[:, None], d_neg[None, :] * fr[:, None]], axis=0)  # (16, nb)
    cands = cands.astype(np.float16).astype(np.float32)
    best_d = cands[0].copy()
    best_err = np.full(b.shape[0], np.inf, dtype=np.float32)
    for d in cands:
        safe = np.where(d == 0, 1.0, d)
        c = np.clip(np.rint(b / safe[:, None]) + 1, 0, 3)
        err = (((c - 1) * d[:, None] - b) ** 2).sum(axis=1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_d = np.where(better, d, best_d)
    safe = np.where(best_d == 0, 1.0, best_d)
    codes = np.clip(np.rint(b / safe[:, None]) + 1, 0, 3).astype(np.uint8)
    codes[best_d == 0] = 1
    c4 = codes.reshape(-1, 16, 4)
    qs = c4[:, :, 0] | (c4[:, :, 1] << 2) | (c4[:, :, 2] << 4) | (c4[:, :, 3] << 6)
    out = np.empty((b.shape[0], Q2_0_BYTES), dtype=np.uint8)
    out[:, :2] = best_d.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:] = qs
    return out.reshape(*lead, n // Q2_0_BLOCK * Q2_0_BYTES)


def dequantize_q2_0(data: np.ndarray) -> np.ndarray:
    """Q2_0 bytes (..., nb * 18) -> float32 (..., nb * 64). Raises StrataError on a length that is not whole blocks."""
    data = np.asarray(data, dtype=np.uint8)
    if data.shape[-1] % Q2_0_BYTES:
        raise StrataError(f"Q2_0 data of {data.shape[-1]} bytes per row is not a whole number of 18-byte blocks")
    lead = data.shape[:-1]
    blk = data.reshape(-1, Q2_0_BYTES)
    d = blk[:, :2].copy().view("<f2").astype(np.float32).reshape(-1)
    qs = blk[:, 2:]
    codes = np.stack([(qs >> (2 * s)) & 3 for s in range(4)], axis=-1).reshape(-1, Q2_0_BLOCK).astype(np.float32)
    vals = (codes - 1) * d[:, None]
    return vals.reshape(*lead, data.shape[-1] // Q2_0_BYTES * Q2_0_BLOCK)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C ``roundf`` on float32 (halves away from zero), exactly: no ``v + 0.5`` that could round up itself."""
    a = np.abs(v)
    f = np.floor(a)
    return np.copysign(f + (a - f >= np.float32(0.5)), v)


def _quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (32 values: fp16 d = amax / 127, then 32 int8 ``roundf(v / d)``; ggml-common.h block_q8_0)."""
    b = x.reshape(-1, 32)
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    out = np.empty((b.shape[0], 34), dtype=np.uint8)
    out[:, :2] = d.astype("<f2").view(np.uint8)
    out[:, 2:] = _round_half_away(b * inv).astype(np.int8).view(np.uint8)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 34)


def _quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """Q4_0 blocks (32 values: fp16 d = (the value of largest magnitude) / -8, then 16 bytes holding codes
    ``min(15, trunc(v / d + 8.5))``, values 0..15 in the low nibbles, 16..31 in the high ones; block_q4_0)."""
    b = x.reshape(-1, 32)
    m = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
    d = m / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.minimum(np.trunc(b * inv + np.float32(8.5)), np.float32(15)).astype(np.uint8)
    out = np.empty((b.shape[0], 18), dtype=np.uint8)
    out[:, :2] = d.astype("<f2").view(np.uint8)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << np.uint8(4))
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 18)


def _bf16(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # round to nearest even, as torch/ggml do
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r.view(np.uint8).reshape(*x.shape[:-1], x.shape[-1] * 2)


def quantize(x: np.ndarray, gtype: GGMLType | str) -> np.ndarray:
    """Float rows (..., ne0) -> uint8 bytes (..., row_bytes) of ``gtype``.

    Supported: F32, F16, BF16, Q8_0, Q4_0 (bit-identical to ``gguf.quants``), Q2_0. Raises StrataError for any other type
    or a row width that is not whole blocks.
    """
    t = type_by_name(gtype) if isinstance(gtype, str) else gtype
    x = np.asarray(x, dtype=np.float32)
    t.row_bytes(x.shape[-1])  # raises when not whole blocks
    if t.name == "F32":
        return np.ascontiguousarray(x, dtype="<f4").view(np.uint8)
    if t.name == "F16":
        return np.ascontiguousarray(x.astype("<f2")).view(np.uint8)
    if t.name == "BF16":
        return _bf16(x)
    if t.name == "Q2_0":
        return quantize_q2_0(x)
    if t.name == "Q8_0":
        return _quantize_q8_0(x)
    if t.name == "Q4_0":
        return _quantize_q4_0(x)
    raise StrataError(f"no quantizer for {t.name} (supported: F32, F16, BF16, Q8_0, Q4_0, Q2_0; other types are "
                      f"written as random valid blocks)")


def can_quantize(gtype: GGMLType | str) -> bool:
    """True when :func:`quantize` has a real quantizer for the type (F32, F16, BF16, Q8_0, Q4_0, Q2_0). Raises
    StrataError for an unknown type name.
    """
    t = type_by_name(gtype) if isinstance(gtype, str) else gtype
    return t.name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q2_0")


# Nominal fp16 super-scale per type so that random codes dequantize to roughly N(0, 0.02)-sized values
# (rms of the code levels from ggml-common.h tables, rounded; for the types with sub-block scales, the rms
# measured over random blocks).
_D_FOR_RMS_002 = {
    "Q2_0": 0.02 / 1.22, "Q4_0": 0.02 / 4.6, "Q4_1": 0.02 / 4.6, "Q5_0": 0.02 / 9.2, "Q5_1": 0.02 / 9.2,
    "Q8_0": 0.02 / 73.9, "IQ4_NL": 0.02 / 65.0, "IQ4_XS": 0.02 / 1290.0, "IQ2_XXS": 0.02 / 56.0,
    "IQ2_XS": 0.02 / 58.5, "IQ2_S": 0.02 / 59.0, "IQ3_XXS": 0.02 / 148.0, "IQ3_S": 0.02 / 146.0,
    "Q4_K": 0.02 / 268.0, "Q5_K": 0.02 / 548.0,
}  # the IQ and K factors measured: rms of 4000 random blocks dequantized (tests/test_safety_readers.py checks)


# Factor of the second fp16 of a block relative to ``d`` (types whose block is ``d, m|dmin, ...``).
_SECOND_SCALE = {"Q4_1": -7.5, "Q5_1": -15.5, "Q4_K": 7.5, "Q5_K": 15.5}


def random_block_types() -> list[str]:
    """Type names :func:`random_blocks` can fill."""
    return sorted(_D_FOR_RMS_002)


def random_blocks(gtype: GGMLType | str, n_blocks: int, rng: np.random.Generator, balanced: bool = False,
                  scale: float = 1.0) -> np.ndarray:
    """``n_blocks`` random but valid blocks of ``gtype`` as uint8 (n_blocks, type_size).

    Code bytes are uniform random (every bit pattern of the code fields is a valid block, module docstring); the
    leading fp16 ``d`` is the type's nominal scale (``_D_FOR_RMS_002``) times one of 256 steps in [0.5, 1.5), the
    step chosen by the block's own first random byte; types with a second fp16 (Q4_1/Q5_1 ``m``, Q4_K/Q5_K
    ``dmin``) get it set from the same step, never random bits (1 in 32 of those are NaN/Inf).

    ``balanced``: the sign of every block's scale(s) is random too (bit 8 of the block's first random half-word),
    so the block's values are negated in half of the blocks. The offset codes of Q2_0 (``d * (q - 1)``, mean
    ``0.5 d``), Q4_0 / Q5_0 / Q8_0 (mean ``-0.5 d``) and the asymmetric IQ4 tables give every block a mean of the
    same sign: a matrix of n inputs then has a DC gain of ``mean * n`` along the all-ones direction (Q2_0: 0.39
    of the rms, so 21 x the rms at n 2560), which wide synthetic models amplify layer after layer until every
    token's residual is the same vector (docs/synthetic-routing.md, "Offset codes at full width"). Balanced
    blocks have zero mean on average; the default (False) keeps the bytes of earlier versions.

    ``scale``: multiplies the nominal scale (the rms becomes ``0.02 * scale``; small scales give fp16 subnormal
    ``d``, still exact fp16 values).

    Speed: one draw of raw 64-bit words from the bit generator covers every byte of the chunk (no per-value float
    conversion, no pool reuse: every block is fresh randomness from ``rng``); the scale fields are then overwritten
    through a uint16 view (every supported block size is even and the buffer is 8-byte aligned) with a 256-entry
    table lookup, so the cost is about one pass over the memory (several hundred MiB/s per core).
    Deterministic for a given ``rng`` state. Raises StrataError for a type whose block does not start with its
    fp16 scale.
    """
    t = type_by_name(gtype) if isinstance(gtype, str) else gtype
    d_tab, m_tab = _scale_tables(t.name, float(scale))
    nbytes = n_blocks * t.type_size
    raw = rng.bit_generator.random_raw((nbytes + 7) // 8)  # uint64 words straight from the bit generator (fast)
    u16 = raw.view("<u2")[:nbytes // 2].reshape(n_blocks, t.type_size // 2)
    first = u16[:, 0]
    idx = first & 0xFF  # the block's first random byte (little-endian low byte of its first half-word)
    sign = ((first & 0x100) << 7).astype(np.uint16) if balanced else None  # fp16 sign bit from a free random bit
    u16[:, 0] = d_tab[idx]
    if m_tab is not None:
        u16[:, 1] = m_tab[idx]
    if sign is not None:
        u16[:, 0] ^= sign
        if m_tab is not None:
            u16[:, 1] ^= sign
    return raw.view(np.uint8)[:nbytes].reshape(n_blocks, t.type_size)


@lru_cache(maxsize=None)
def _scale_tables(name: str, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray | None]:
    """(d, second) fp16 bit patterns (uint16 [256]) of the 256 scale steps of one type (see random_blocks)."""
    base = _D_FOR_RMS_002.get(name)
    if base is None:
        raise StrataError(f"cannot write random {name} blocks (supported: {', '.join(random_block_types())})")
    steps = base * (0.5 + (np.arange(256, dtype=np.float32) + 0.5) / 256)
    if scale != 1.0:
        steps = steps * np.float32(scale)
    d = steps.astype("<f2").view("<u2")
    second = _SECOND_SCALE.get(name)
    m = None if second is None else (steps * second).astype("<f2").view("<u2")
    for a in (d, m):
        if a is not None:
            a.flags.writeable = False
    return d, m
