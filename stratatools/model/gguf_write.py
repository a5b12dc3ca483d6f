"""Writing GGUF v3 files (for ``synth`` and test fixtures), streaming and atomic.

Why our own writer and not ``gguf.GGUFWriter``: gguf 0.19.0 only writes tensor types it knows, and the
synthetic releases need Q2_0 (id 42). Layout as in :mod:`stratatools.model.gguf` (llama.cpp ``gguf.cpp``).
Tensor data is streamed in the declared order, each tensor aligned to ``alignment``; memory stays bounded
by the largest chunk a producer yields.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from stratatools.core.fsutil import AtomicFile
from stratatools.model.ggml_types import GGMLType

# value type ids (gguf.cpp)
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
        I64: "<q", F64: "<d"}


def _guess_type(v: Any) -> int:
    if isinstance(v, bool):
        return BOOL
    if isinstance(v, int):
        return U32 if 0 <= v < 2**32 else I64
    if isinstance(v, float):
        return F32
    if isinstance(v, str):
        return STRING
    raise TypeError(f"cannot guess a GGUF value type for {v!r}; pass vtype")


def _enc_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def encode_value(v: Any, vtype: int, etype: int | None = None) -> bytes:
    """Encode one metadata value of GGUF type ``vtype`` (arrays need ``etype``)."""
    if vtype == STRING:
        return _enc_str(v)
    if vtype == ARRAY:
        assert etype is not None
        items = list(v)
        out = struct.pack("<IQ", etype, len(items))
        if etype == STRING:
            return out + b"".join(_enc_str(s) for s in items)
        return out + b"".join(struct.pack(_FMT[etype], x) for x in items)
    return struct.pack(_FMT[vtype], v)


Producer = Callable[[], Iterable[bytes | np.ndarray]]


class GGUFWriterStream:
    """Write a GGUF v3 file: declare metadata and tensors, then :meth:`write` streams everything.

    Tensors are given as (name, ne, ggml type, producer); the producer yields the tensor's bytes in chunks
    (bytes or uint8/any numpy arrays, written raw). The total must equal the type's size for ``ne``;
    otherwise ValueError. The file appears at ``path`` only when complete (temp file + rename).
    """

    def __init__(self, path: str | os.PathLike, alignment: int = 32):
        self.path = Path(path)
        self.alignment = alignment
        self.kv: list[tuple[str, int, Any, int | None]] = []
        self.tensors: list[tuple[str, tuple[int, ...], GGMLType, Producer]] = []

    def add(self, key: str, value: Any, vtype: int | None = None, etype: int | None = None) -> None:
        """Declare a metadata key. ``vtype``/``etype`` are GGUF v3 value type ids (ggml docs/gguf.md); when None
        they are guessed: bool -> BOOL, int -> UINT32 (INT64 outside 0..2**32-1), float -> FLOAT32,
        str -> STRING, list/array -> ARRAY of its first element's type. Raises TypeError for other values.
        """
        if vtype is None:
            if isinstance(value, (list, tuple, np.ndarray)):
                vtype = ARRAY
                if etype is None:
                    first = value[0] if len(value) else 0
                    etype = _guess_type(first.item() if hasattr(first, "item") else first)
            else:
                vtype = _guess_type(value)
        self.kv.append((key, vtype, value, etype))

    def add_tensor(self, name: str, ne: tuple[int, ...] | list[int], gtype: GGMLType, producer: Producer) -> None:
        """Declare a tensor of shape ``ne`` (GGUF order, ne[0] contiguous) and type ``gtype``; ``producer`` yields
        its ``gtype.nbytes(ne)`` bytes in chunks when :meth:`write` runs.
        """
        self.tensors.append((name, tuple(int(x) for x in ne), gtype, producer))

    def _header(self) -> tuple[bytes, list[int]]:
        parts = [b"GGUF", struct.pack("<IQQ", 3, len(self.tensors), len(self.kv))]
        for key, vtype, value, etype in self.kv:
            parts.append(_enc_str(key) + struct.pack("<I", vtype) + encode_value(value, vtype, etype))
        offsets = []
        off = 0
        for name, ne, gtype, _ in self.tensors:
            offsets.append(off)
            parts.append(_enc_str(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
                         + struct.pack("<IQ", gtype.id, off))
            off += gtype.nbytes(ne)
            off += (-off) % self.alignment
        head = b"".join(parts)
        head += b"\0" * ((-len(head)) % self.alignment)
        return head, offsets

    def write(self) -> int:
        """Write the file; returns its size in bytes."""
        head, _ = self._header()
        with AtomicFile(self.path) as fh:
            fh.write(head)
            for name, ne, gtype, producer in self.tensors:
                want = gtype.nbytes(ne)
                got = 0
                for chunk in producer():
                    b = chunk.tobytes() if isinstance(chunk, np.ndarray) and not chunk.flags.c_contiguous else chunk
                    mv = memoryview(b).cast("B") if not isinstance(b, (bytes, bytearray)) else b
                    fh.write(mv)
                    got += len(mv)
                if got != want:
                    raise ValueError(f"tensor {name}: producer gave {got} bytes, {gtype.name} {list(ne)} needs {want}")
                fh.write(b"\0" * ((-want) % self.alignment))
            size = fh.tell()
        return size
