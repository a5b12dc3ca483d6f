"""ggml tensor types: ids, names and block geometry.

The table comes from the ``gguf`` package (``GGMLQuantizationType`` and ``GGML_QUANT_SIZES``) and is
extended with the types that package (0.19.0) does not know, above all **Q2_0** (id 42, 64 values in 18
bytes: fp16 scale then 16 bytes of 2-bit codes; formats.md section 1, llama.cpp ggml-common.h).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

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


def _build_table() -> dict[int, GGMLType]:
    table: dict[int, GGMLType] = {}
    for qt, (block, size) in gguf.GGML_QUANT_SIZES.items():
        table[int(qt)] = GGMLType(int(qt), qt.name, int(block), int(size))
    # gguf 0.19.0 lacks these; geometry from llama.cpp ggml.c type_traits (formats.md section 1).
    extra = {42: ("Q2_0", 64, 18)}
    for tid, (name, block, size) in extra.items():
        table.setdefault(tid, GGMLType(tid, name, block, size))
    return table


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
