"""ggml tensor types: ids, names and block geometry.

The table holds the ids, names and (values per block, bytes per block) of the ``gguf`` package 0.19.0
(``GGMLQuantizationType`` and ``GGML_QUANT_SIZES``, the pinned dependency; ``tests/test_gguf_core.py`` checks
they agree) plus the types that package does not know, above all **Q2_0** (id 42, 64 values in 18 bytes: fp16
scale then 16 bytes of 2-bit codes; formats.md section 1, llama.cpp ggml-common.h). It is written out here
rather than read from ``gguf`` at import time because importing ``gguf`` (and the yaml it pulls in) costs
about 0.1 s of every command's start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from stratatools.core.errors import StrataError


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type.

    Attributes:
        id: ggml type id as stored in GGUF tensor infos (u32).
        name: upper-case ggml name (``Q2_0``, ``IQ4_XS``, ``BF16``).
        block_size: values per block (1 for plain float/int types).
        type_size: bytes per block.
    """

    id: int
    name: str
    block_size: int
    type_size: int

    def row_bytes(self, ne0: int) -> int:
        """Bytes of one row of ``ne0`` values. Raises StrataError when ne0 is not a whole number of blocks."""
        if ne0 % self.block_size:
            raise StrataError(f"a row of {ne0} values is not a whole number of {self.name} blocks of {self.block_size}")
        return ne0 // self.block_size * self.type_size

    def nbytes(self, ne: tuple[int, ...] | list[int]) -> int:
        """Bytes of a tensor with ggml shape ``ne`` (ne0 innermost)."""
        n_rows = 1
        for d in ne[1:]:
            n_rows *= int(d)
        return self.row_bytes(int(ne[0])) * n_rows if ne else self.type_size


# id: (name, values per block, bytes per block); gguf 0.19.0 GGML_QUANT_SIZES, then the types it lacks
_TABLE: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
    # not in gguf 0.19.0; geometry from llama.cpp ggml.c type_traits (formats.md section 1)
    42: ("Q2_0", 64, 18),
}


def _build_table() -> dict[int, GGMLType]:
    return {tid: GGMLType(tid, name, block, size) for tid, (name, block, size) in _TABLE.items()}


TYPES: dict[int, GGMLType] = _build_table()
TYPES_BY_NAME: dict[str, GGMLType] = {t.name: t for t in TYPES.values()}

Q2_0 = TYPES[42]
F32 = TYPES[0]
F16 = TYPES[1]
BF16 = TYPES[30]


def type_by_id(type_id: int) -> GGMLType:
    """Return the type with ggml id ``type_id``. Raises StrataError for an id nobody knows the geometry of."""
    try:
        return TYPES[int(type_id)]
    except KeyError:
        raise StrataError(f"unknown ggml type id {type_id}: its block geometry is not known") from None


def type_by_name(name: str) -> GGMLType:
    """Return the type called ``name`` (case-insensitive, e.g. ``q2_0``). Raises StrataError if unknown."""
    try:
        return TYPES_BY_NAME[name.strip().upper()]
    except KeyError:
        raise StrataError(f"unknown ggml type name {name!r}") from None


def block_values(n_bytes: int, t: GGMLType, n_values: int | None) -> int:
    """Return the value count (elements) of ``n_bytes`` of type ``t``; raise StrataError on a size mismatch."""
    if n_bytes % t.type_size:
        raise StrataError(
            f"{t.name} data of {n_bytes} bytes is not a whole number of {t.type_size}-byte blocks "
            f"(the tensor's offset or size is wrong)")
    n = n_bytes // t.type_size * t.block_size
    if n_values is not None and int(n_values) != n:
        raise StrataError(
            f"{t.name} data of {n_bytes} bytes holds {n} values, but {n_values} were expected "
            f"(tensor shape and byte size disagree)")
    return n
