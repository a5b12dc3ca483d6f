"""Reading GGUF models: one file or a ``-0000N-of-0000M`` shard set, memory-mapped.

Why our own parser and not ``gguf.GGUFReader``: gguf 0.19.0 raises on any file containing a tensor type it
does not know (Q2_0, id 42, is used throughout the ISTA releases), and it builds numpy views of every
tensor up front. The header layout is GGUF v2/v3 (llama.cpp ``gguf.cpp``): magic ``GGUF``, u32 version,
u64 tensor count, u64 KV count, the KV pairs, the tensor infos (name, u32 n_dims, n_dims x u64 ne,
u32 type, u64 offset), then tensor data aligned to ``general.alignment`` (default 32).

Nothing here reads tensor data unless asked: :meth:`Model.raw` returns a zero-copy view of the mapped file.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.core.fsutil import check_input
from stratatools.model.ggml_types import GGMLType, type_by_id

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF metadata value types (gguf.cpp, GGUFValueType)
_SCALAR = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
T_STRING, T_ARRAY = 8, 9

SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a model.

    Attributes:
        name: GGUF tensor name (``blk.3.ffn_gate_exps.weight``).
        type: its ggml type.
        ne: ggml shape, ne0 innermost (numpy shape is the reverse).
        rel_offset: offset inside the file's data section, bytes.
        offset: absolute byte offset in its file (data start + rel_offset); what ``native_experts.txt`` stores.
        nbytes: size in bytes from the block geometry.
        shard: index of the file in the shard set (0 = shard 1).
        file_name: base name of that file.
    """

    name: str
    type: GGMLType
    ne: tuple[int, ...]
    rel_offset: int
    offset: int
    nbytes: int
    shard: int
    file_name: str

    @property
    def n_dims(self) -> int:
        """Number of dimensions (length of ``ne``, GGUF order: ne[0] is the contiguous one)."""
        return len(self.ne)


class _Cursor:
    """Bounds-checked little-endian reader over a bytes-like header buffer."""

    def __init__(self, buf, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size = len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise StrataError(
                f"{self.path}: byte {self.pos}: truncated GGUF header while reading {what} "
                f"(needs {n} bytes, file has {self.size}); the file is cut short, download it again",
                self.path,
            )

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(what + " length")
        if n > self.size:
            raise StrataError(f"{self.path}: byte {self.pos - 8}: {what} length {n} exceeds the file size; not a valid GGUF", self.path)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if depth > 8:
            raise StrataError(f"{self.path}: byte {self.pos}: arrays nested more than 8 deep in {what}; not a valid GGUF", self.path)
        if vtype in _SCALAR:
            fmt, size = _SCALAR[vtype]
            return self.unpack(fmt, size, what)
        if vtype == T_STRING:
            return self.string(what)
        if vtype == T_ARRAY:
            etype = self.u32(what + " element type")
            n = self.u64(what + " element count")
            if etype in _NP:
                size = _SCALAR[etype][1]
                if n * size > self.size:
                    raise StrataError(f"{self.path}: byte {self.pos}: array {what} of {n} elements exceeds the file size", self.path)
                self.need(n * size, what)
                arr = np.frombuffer(self.buf, dtype=_NP[etype], count=n, offset=self.pos).copy()
                self.pos += n * size
                return arr.astype(bool) if etype == 7 else arr
            if etype == T_STRING:
                if n * 8 > self.size - self.pos:  # every string takes at least its 8-byte length
                    raise StrataError(f"{self.path}: byte {self.pos}: string array {what} of {n} elements exceeds the file size", self.path)
                return [self.string(what) for _ in range(n)]
            if etype == T_ARRAY:
                if n * 12 > self.size - self.pos:  # every inner array takes at least its type and count
                    raise StrataError(f"{self.path}: byte {self.pos}: nested array {what} too large", self.path)
                return [self.value(T_ARRAY, what, depth + 1) for _ in range(n)]
            raise StrataError(f"{self.path}: byte {self.pos}: unknown array element type {etype} in {what}", self.path)
        raise StrataError(f"{self.path}: byte {self.pos}: unknown metadata value type {vtype} in {what}", self.path)


class GGUFFile:
    """One GGUF file, header parsed, data memory-mapped on demand.

    Attributes:
        path: the file.
        size: file size in bytes.
        version: GGUF version (2 or 3).
        kv: metadata, key -> value (ints, floats, str, numpy arrays for numeric arrays, lists of str).
        tensors: name -> :class:`TensorInfo`, in file order.
        data_start: absolute offset of the tensor data section.
        alignment: ``general.alignment`` or 32.

    Raises:
        StrataError: not a GGUF, truncated header, unknown tensor type, tensor data past the end of file,
            duplicate tensor names, bad dimensions.
    """

    def __init__(self, path: str | os.PathLike, shard: int = 0):
        self.path = check_input(path, "model")
        self.shard = shard
        try:
            self.size = self.path.stat().st_size
            fh = open(self.path, "rb")
        except FileNotFoundError:
            raise StrataError(f"{self.path}: no such file", self.path) from None
        except IsADirectoryError:
            raise StrataError(f"{self.path}: is a directory, expected a .gguf file", self.path) from None
        except OSError as e:
            raise StrataError(f"{self.path}: cannot open: {e.strerror}", self.path) from None
        self._fh = fh
        self._mm: mmap.mmap | None = None
        if self.size < 24:
            head = fh.read(4)
            fh.close()
            if head != GGUF_MAGIC:
                raise StrataError(f"{self.path}: byte 0: not a GGUF file (magic {head!r}, expected b'GGUF')", self.path)
            raise StrataError(f"{self.path}: byte {self.size}: truncated GGUF header (file is {self.size} bytes)", self.path)
        self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    # -- parsing ---------------------------------------------------------------------------------------
    def _parse(self) -> None:
        c = _Cursor(self._mm, self.path)
        magic = bytes(self._mm[:4])
        if magic != GGUF_MAGIC:
            raise StrataError(f"{self.path}: byte 0: not a GGUF file (magic {magic!r}, expected b'GGUF')", self.path)
        c.pos = 4
        self.version = c.u32("version")
        if self.version not in (2, 3):
            raise StrataError(f"{self.path}: byte 4: unsupported GGUF version {self.version} (2 and 3 are read)", self.path)
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        if n_tensors > self.size // 24 or n_kv > self.size // 12:
            raise StrataError(f"{self.path}: byte 8: tensor count {n_tensors} / metadata count {n_kv} cannot fit in the file; not a valid GGUF", self.path)
        self.kv: dict[str, Any] = {}
        self.kv_types: dict[str, int] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            vtype = c.u32(f"type of {key}")
            self.kv[key] = c.value(vtype, key)
            self.kv_types[key] = vtype
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor name #{i}")
            n_dims = c.u32(f"n_dims of {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise StrataError(f"{self.path}: byte {c.pos - 4}: tensor {name} has {n_dims} dimensions (1..{MAX_DIMS} allowed)", self.path)
            ne = tuple(c.u64(f"ne of {name}") for _ in range(n_dims))
            tid = c.u32(f"type of {name}")
            rel = c.u64(f"offset of {name}")
            try:
                t = type_by_id(tid)
            except StrataError:
                raise StrataError(
                    f"{self.path}: tensor {name}: unknown ggml type id {tid}; its block geometry is not known, "
                    f"so the file cannot be read", self.path) from None
            infos.append((name, t, ne, rel))
        align = self.kv.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, (int, np.integer)) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise StrataError(
                f"{self.path}: metadata general.alignment is {align!r}; it must be a positive power of two", self.path)
        self.alignment = int(align)
        pad = (-c.pos) % self.alignment
        self.data_start = c.pos + pad
        self.tensors: dict[str, TensorInfo] = {}
        for name, t, ne, rel in infos:
            if name in self.tensors:
                raise StrataError(f"{self.path}: tensor {name} appears twice in the header", self.path)
            try:
                nbytes = t.nbytes(ne)
            except StrataError as e:
                raise StrataError(f"{self.path}: tensor {name}: {e}", self.path) from None
            start = self.data_start + rel
            if rel % self.alignment:
                raise StrataError(
                    f"{self.path}: tensor {name}: data offset {rel} is not a multiple of the alignment "
                    f"{self.alignment} (llama.cpp refuses such a file); the file is corrupt", self.path)
            if start + nbytes > self.size:
                raise StrataError(
                    f"{self.path}: tensor {name}: data [{start}, {start + nbytes}) runs past the end of the file "
                    f"({self.size} bytes); the file is truncated, download it again", self.path)
            self.tensors[name] = TensorInfo(name, t, tuple(int(x) for x in ne), rel, start, nbytes, self.shard, self.path.name)
        spans = sorted((ti.offset, ti.offset + ti.nbytes, ti.name) for ti in self.tensors.values() if ti.nbytes)
        for (a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise StrataError(f"{self.path}: tensors {an} [{a0}, {a1}) and {bn} (from byte {b0}) overlap "
                                  f"(llama.cpp refuses such a file); the file is corrupt", self.path)

    # -- access ----------------------------------------------------------------------------------------
    def buffer(self) -> mmap.mmap:
        """The read-only memory map of the whole file."""
        assert self._mm is not None
        return self._mm

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a numpy view is still alive; the map goes with it
                pass
            self._mm = None
        self._fh.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {len(self.tensors)} tensors)"


def meta_int(value: Any, path: str | os.PathLike, key: str) -> int:
    """A metadata value that must be an integer scalar, as int. Raises StrataError naming file and key."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise StrataError(f"{path}: metadata {key} is {value!r}; expected an integer", path)
    return int(value)


def shard_siblings(path: Path) -> list[Path] | None:
    """For ``x-0000N-of-0000M.gguf`` return the M expected shard paths in order; None for a single file."""
    m = SHARD_RE.match(path.name)
    if not m:
        return None
    count = int(m.group("count"))
    stem = m.group("stem")
    return [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


@dataclass
class Model:
    """A GGUF model over one or more shards.

    Attributes:
        files: the shard files in order (shard 1 first). Metadata comes from shard 1.
        kv: shard 1's metadata.
        tensors: every tensor of every shard, by name.
        path: the path the user gave.
    """

    files: list[GGUFFile]
    path: Path
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def kv(self) -> dict[str, Any]:
        """Metadata key/values of the first shard (split GGUFs keep the model metadata there)."""
        return self.files[0].kv

    @property
    def arch(self) -> str:
        """``general.architecture`` (e.g. ``qwen4exp``), or '' when absent."""
        return str(self.kv.get("general.architecture", ""))

    def key(self, name: str, default: Any = None) -> Any:
        """Metadata ``<arch>.<name>``, or ``default``."""
        return self.kv.get(f"{self.arch}.{name}", default)

    def has(self, name: str) -> bool:
        """True when a tensor of that name is in any shard."""
        return name in self.tensors

    def tensor(self, name: str) -> TensorInfo:
        """Tensor info by name. Raises StrataError naming the model when absent."""
        try:
            return self.tensors[name]
        except KeyError:
            raise StrataError(f"{self.path}: tensor {name} is missing", self.path) from None

    def file_of(self, t: TensorInfo) -> GGUFFile:
        """The shard file holding tensor ``t``."""
        return self.files[t.shard]

    def raw(self, name_or_info: str | TensorInfo, start: int = 0, length: int | None = None) -> np.ndarray:
        """Zero-copy uint8 view of a tensor's bytes, or of ``[start, start+length)`` within them."""
        t = self.tensor(name_or_info) if isinstance(name_or_info, str) else name_or_info
        if length is None:
            length = t.nbytes - start
        if start < 0 or start + length > t.nbytes:
            raise StrataError(f"{self.path}: tensor {t.name}: slice [{start}, {start + length}) outside its {t.nbytes} bytes")
        return np.frombuffer(self.file_of(t).buffer(), dtype=np.uint8, count=length, offset=t.offset + start)

    def array(self, name: str) -> np.ndarray:
        """A float32/float16/bf16-as-float32 tensor as a numpy array in numpy order (reverse of ne).

        Only for unquantized types (F32, F16, BF16); quantized tensors go through the runtime's dequantizer.
        """
        t = self.tensor(name)
        shape = tuple(reversed(t.ne))
        raw = self.raw(t)
        if t.type.name == "F32":
            return raw.view("<f4").reshape(shape)
        if t.type.name == "F16":
            return raw.view("<f2").astype(np.float32).reshape(shape)
        if t.type.name == "BF16":
            return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
        raise StrataError(f"{self.path}: tensor {name} is {t.type.name}; expected F32, F16 or BF16")

    def iter_tensors(self) -> Iterator[TensorInfo]:
        """All tensors of all shards, in file order."""
        return iter(self.tensors.values())

    @property
    def total_bytes(self) -> int:
        """Sum of the shard file sizes, bytes."""
        return sum(f.size for f in self.files)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_model(path: str | os.PathLike) -> Model:
    """Open a GGUF model from one file or any shard of a ``<stem>-0000N-of-0000M.gguf`` set.

    Shards are found next to the given file. Checks (llama.cpp ``llama-model-loader.cpp`` split rules):
    every sibling exists; ``split.no`` (0-based) matches the file name's number; ``split.count`` agrees;
    the tensor total equals shard 1's ``split.tensors.count``; no tensor is in two shards.

    Returns:
        a :class:`Model` (close it, or use it as a context manager).

    Raises:
        StrataError: missing, duplicate or mis-numbered shards, and every :class:`GGUFFile` error.
    """
    path = Path(path)
    sibs = shard_siblings(path)
    if sibs is None:
        f = GGUFFile(path)
        count = meta_int(f.kv.get("split.count", 1), path, "split.count")
        if count > 1:
            raise StrataError(
                f"{path}: split.count is {count} but the name is not <stem>-0000N-of-{count:05d}.gguf; "
                f"rename the shards to the gguf-split pattern", path)
        model = Model([f], path)
        model.tensors = dict(f.tensors)
        return model
    missing = [p.name for p in sibs if not p.exists()]
    if missing:
        raise StrataError(f"{path}: shard set is incomplete: missing {', '.join(missing)} (put every shard in {path.parent})", path)
    files = []
    try:
        for i, p in enumerate(sibs):
            files.append(GGUFFile(p, shard=i))
    except StrataError:
        for f in files:
            f.close()
        raise
    count = len(sibs)
    seen: dict[int, str] = {}
    for i, f in enumerate(files):
        no = f.kv.get("split.no")
        cnt = f.kv.get("split.count")
        if no is None or cnt is None:
            if count == 1:
                continue
            raise StrataError(f"{f.path}: no split.no/split.count metadata; not a gguf-split shard", f.path)
        no, cnt = meta_int(no, f.path, "split.no"), meta_int(cnt, f.path, "split.count")
        if cnt != count:
            raise StrataError(f"{f.path}: split.count is {cnt} but the file name says {count} shards", f.path)
        if no in seen:
            raise StrataError(f"{f.path}: duplicate shard: split.no {no} is also in {seen[no]}", f.path)
        seen[no] = f.path.name
        if no != i:
            raise StrataError(
                f"{f.path}: mis-numbered shard: split.no is {no} (shard {no + 1}) but the file name says shard {i + 1}",
                f.path)
    model = Model(files, path)
    for f in files:
        for name, t in f.tensors.items():
            if name in model.tensors:
                raise StrataError(
                    f"{f.path}: tensor {name} is also in {model.tensors[name].file_name}; duplicate shard content", f.path)
            model.tensors[name] = t
    expected = files[0].kv.get("split.tensors.count")
    if expected is not None:
        expected = meta_int(expected, files[0].path, "split.tensors.count")
    if expected is not None and expected != len(model.tensors):
        raise StrataError(
            f"{files[0].path}: split.tensors.count is {int(expected)} but the {count} shards hold {len(model.tensors)} tensors",
            files[0].path)
    return model


def use_model(model: "Model | str | os.PathLike"):
    """Context manager giving an open :class:`Model`: an open one passes through (and stays open), a path is
    opened with :func:`open_model` and closed on exit. Lets callers that already hold the model avoid
    parsing its headers again."""
    import contextlib

    return contextlib.nullcontext(model) if isinstance(model, Model) else open_model(model)
