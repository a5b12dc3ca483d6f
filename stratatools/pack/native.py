"""Native pack: ``native_experts.txt`` (+ optional ``experts.bin``) for Strata's ``expert_layout_load``.

A native pack keeps every routed expert in its original GGUF quantization (formats.md section 5; Strata
``tools/iq_pack.py`` writes it, ``kernels/cpu`` ``expert_layout_load`` reads it).

Header text (decision). The engine only needs two things from the comment line: the prefix
``# strata native experts v<N>`` (it refuses N > 4) and ``(n_expert <E>`` (the expert count it uses instead of its
compiled-in 512). We write the same header line, word for word, as Strata's own ``tools/iq_pack.py`` so that a
pack made here and one made by the engine's tool are byte-identical for the same model:

* v3: ``# strata native experts v3: layer gu_type d_type offset blob_bytes gate_off up_off down_off [shard]
  (n_expert <E>, total <T>; absolute offsets in <shard 1 name>, or in the named shard beside it)``
* v4 (only when some layer's gate/up/down sit in different shards): ``... down_off [shard | gate,up,down]
  (n_expert <E>, total <T>; absolute offsets in <shard 1 name>, or in the named shard beside it - per role where
  the column is gate,up,down)``

Shard column (engine reader, v4 from Strata #255): absent when all three roles are in shard 1; one file name when
all three are in that (other) shard; in a v4 file, for a layer whose roles are split, ``gate,up,down`` file names
where an empty field means shard 1 (so blk.2 of the kit's split set, gate and up in shard 2 and down in shard 1,
reads ``<shard2>,<shard2>,``). Each ``*_off`` is absolute in the file that holds that role (its own data start
plus the tensor offset). Layers not split keep their v3 form inside a v4 file.

Copying (decision). ``experts.bin`` is assembled with ``os.copy_file_range`` (the kernel copies page-cache pages,
nothing passes through Python memory, as with ``cp``), falling back to ``pread``/``write`` in 8 MiB pieces
where the file systems do not support it; the peak RSS stays flat whatever the model size.

Provenance hashing (decision, measured with bench/bench_pack.py on a 2-core machine, 2.6 GB model, 2.4 GB
experts.bin). The provenance sidecar records the sha256 of every shard: the registry and validate-release identify a
release by it (it is also the Hugging Face LFS object id), so it must be the plain sha256 of the whole file, which
is inherently sequential - one core at ~1.7 GB/s of CPU time here, while ``cp`` moves the same bytes at ~1.5 GB/s
of wall time and little CPU. No ordering of reads can make a first full sha256 cost less than that hash. So:

* The hash is computed in a background thread while the expert ranges are copied, through 64 MiB memory-mapped
  windows (:func:`stratatools.core.fsutil.sha256_fd`): no copy into a Python buffer (about 30 % less CPU than 8 MiB
  ``readinto``), the page-cache pages are shared with ``copy_file_range``'s reads (the disk is read once), and RSS
  stays under the window size. Streaming the experts through Python instead (pread, hash, pwrite) was rejected:
  the same hash cost plus two user-space copies of every expert byte.
* The result is kept in a persistent digest cache (``$XDG_CACHE_HOME/stratatools/sha256``, one small JSON entry
  per file, :func:`stratatools.core.fsutil.cached_sha256`) keyed by (device, inode, size, mtime_ns, ctime_ns). ctime is
  in the key because user programs cannot set it: a same-size rewrite with the old mtime put back (``cp -p``,
  ``touch -d``) still misses. Files changed during the hash, or modified less than 2 s before it started, are not
  recorded (a rewrite within one timestamp tick would be invisible). A re-pack, ``--force`` run or a later command
  that uses the cache then costs a ``stat``. The sidecar bytes are the same either way;
  :attr:`PackResult.sha256_sources` and a note say which shards came from the cache; ``--rehash`` recomputes
  (and refreshes the entry), ``STRATATOOLS_DIGEST_CACHE=off`` disables the cache, ``--no-hash`` records null.
* Not done: ``sync_file_range`` or a background ``fdatasync`` to start writeback during the copy (both measured
  slower: the copy then waits on the disk), and dropping the fsync before publishing (a crash could then leave a
  published experts.bin of zeros that the engine would load).

Measured (bench/bench_pack.py, 5 interleaved rounds, medians, busy 2-core VM; cp of 2.37 GB took 1.1-2.0 s):
copy_file_range + fsync alone is at par with ``cp`` + ``sync`` (fsync ~0.8 s of it) and process start is ~0.5 s,
so even ``--no-hash`` is ~0.5x of a plain ``cp`` that leaves its data dirty in the page cache (0.75x of
``cp`` + ``sync``). A re-pack (digest cache) runs like ``--no-hash`` (0.49x cp, 0.75x cp+sync; before: 0.35x). A
first pack, which must hash 2.6 GB, reached 0.34x cp / 0.50x cp+sync (before: 0.27x / 0.40x). When cp is
disk-bound (another run, cp at 0.5 GB/s) the same first pack reached 0.68x and a re-pack 1.35x. Peak RSS 115 MB
(70 MB without hashing). The 0.7x-of-cp target is therefore met only for re-packs and disk-bound copies; the
first-pack gap is the sha256 itself, plus the fsync and interpreter start.

Atomicity (issue 14). The whole pack (table, sidecars, experts.bin) is built in a unique temp folder beside the
pack folder and swapped in whole (:func:`stratatools.core.fsutil.publish_dir`, under an advisory lock beside it: a
second concurrent pack of the same folder is refused). A run killed, out of space or failing at any point leaves the
previous pack exactly as it was; the next run recognises and removes its leftovers. Files in the pack folder that
are not pack outputs are carried over (hard links). An existing experts.bin is reused only when
``experts.bin.src.json`` records the sha256 of every source byte range it was cut from and that digest is
recomputed equal now (no sampling).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from stratatools.core.errors import StrataError
from stratatools.core.fsutil import (cached_sha256, check_input, publish_dir, refuse_foreign_folder, sha256_fd, store_sha256, tidy_output,
                                     write_json_atomic, write_text_atomic)
from stratatools.model.geometry import ROLES, Geometry, LayerExperts, check_consistency, exps_name, read_geometry, router_name
from stratatools.model.ggml_types import type_by_id
from stratatools.model.gguf import Model, TensorInfo, open_model
from stratatools.core.provenance import build as build_provenance
from stratatools.core.provenance import sidecar_path

NATIVE_TXT = "native_experts.txt"
EXPERTS_BIN = "experts.bin"
EXPERTS_SRC = "experts.bin.src.json"
MAX_VERSION = 4  # Strata kExpertLayoutVersion (expert_layout.hpp)
HEADER_TAG = "# strata native experts v"
_COPY_CHUNK = 8 << 20
_MAX_TABLE_BYTES = 64 << 20  # a table line is < 200 bytes; 4096 layers take < 1 MiB


# --------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class PackLayer:
    """One line of ``native_experts.txt``.

    Attributes:
        layer: trunk layer index (lines are contiguous from 0).
        gu_type, d_type: ggml type ids of gate/up and of down.
        offset: the layer's first byte in the experts.bin arena (running sum of blob_bytes x E).
        blob_bytes: one expert's [gate][up][down] bytes.
        gate_off, up_off, down_off: absolute byte offsets of the three ``*_exps`` tensors in their files, or None
            for a 5-column line (an experts.bin-only pack).
        shards: per role (gate, up, down) the file holding it, ``""`` meaning shard 1; None when the line has no
            shard column.
    """

    layer: int
    gu_type: int
    d_type: int
    offset: int
    blob_bytes: int
    gate_off: int | None = None
    up_off: int | None = None
    down_off: int | None = None
    shards: tuple[str, str, str] | None = None

    @property
    def split(self) -> bool:
        """True when the layer's roles are in different files (needs v4)."""
        return self.shards is not None and len(set(self.shards)) > 1

    def shard_column(self) -> str:
        """The shard column text ('' when there is none)."""
        if self.shards is None:
            return ""
        return self.shards[0] if not self.split else ",".join(self.shards)

    def line(self) -> str:
        """The line as written (no newline)."""
        parts = [self.layer, self.gu_type, self.d_type, self.offset, self.blob_bytes]
        if self.gate_off is not None:
            parts += [self.gate_off, self.up_off, self.down_off]
        s = " ".join(str(p) for p in parts)
        col = self.shard_column()
        return s + (" " + col if col else "")

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "gu_type": self.gu_type, "gu_type_name": _tname(self.gu_type),
                "d_type": self.d_type, "d_type_name": _tname(self.d_type), "offset": self.offset,
                "blob_bytes": self.blob_bytes, "gate_off": self.gate_off, "up_off": self.up_off,
                "down_off": self.down_off, "shards": list(self.shards) if self.shards else None}


def _tname(tid: int) -> str:
    try:
        return type_by_id(tid).name
    except StrataError:
        return f"type{tid}"


def header_line(version: int, n_expert: int, total: int, shard1_name: str) -> str:
    """The comment line of a v3/v4 table (see the module docstring for the source of the text)."""
    if version == 3:
        return (f"# strata native experts v3: layer gu_type d_type offset blob_bytes gate_off up_off down_off [shard] "
                f"(n_expert {n_expert}, total {total}; absolute offsets in {shard1_name}, "
                f"or in the named shard beside it)")
    return (f"# strata native experts v4: layer gu_type d_type offset blob_bytes gate_off up_off down_off "
            f"[shard | gate,up,down] (n_expert {n_expert}, total {total}; absolute offsets in {shard1_name}, "
            f"or in the named shard beside it - per role where the column is gate,up,down)")


@dataclass
class Pack:
    """A parsed native pack (see :func:`read_pack`).

    Attributes:
        path: the pack folder.
        version: 3 or 4 (the header's ``v<N>``; lower versions are read when their lines fit).
        n_expert: E from ``(n_expert E`` in the header.
        total_bytes: T from ``total T`` (= the experts.bin size).
        layers: one :class:`PackLayer` per trunk layer, in order.
        header: the comment line.
        source_name: shard 1's file name from ``absolute offsets in <name>``, when the header has it.
    """

    path: Path
    version: int
    n_expert: int
    total_bytes: int
    layers: list[PackLayer]
    header: str
    source_name: str | None = None

    @property
    def n_layers(self) -> int:
        """Number of packed layers (rows of native_experts.txt)."""
        return len(self.layers)

    @property
    def experts_bin(self) -> Path | None:
        """``experts.bin`` when the pack has one."""
        p = self.path / EXPERTS_BIN
        return p if p.exists() else None

    def text(self) -> str:
        """The table as it would be written."""
        return self.header + "\n" + "".join(ln.line() + "\n" for ln in self.layers)

    def blob_offset(self, layer: int, expert: int) -> int:
        """Byte offset of expert ``expert`` of ``layer`` in experts.bin."""
        if not 0 <= layer < len(self.layers) or not 0 <= expert < self.n_expert:
            raise StrataError(f"{self.path}: (layer {layer}, expert {expert}) is outside the pack "
                              f"({len(self.layers)} layers x {self.n_expert} experts)", self.path)
        ln = self.layers[layer]
        return ln.offset + expert * ln.blob_bytes

    def read_blob(self, layer: int, expert: int) -> bytes:
        """One expert's [gate][up][down] bytes from experts.bin. Raises StrataError when there is none."""
        p = self.experts_bin
        if p is None:
            raise StrataError(f"{self.path}: the pack has no experts.bin (repack with --experts-bin)", self.path)
        off = self.blob_offset(layer, expert)
        with open(p, "rb") as fh:
            fh.seek(off)
            b = fh.read(self.layers[layer].blob_bytes)
        if len(b) != self.layers[layer].blob_bytes:
            raise StrataError(f"{p}: byte {off}: experts.bin is shorter than the table says ({self.total_bytes} bytes)", p)
        return b

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "version": self.version, "n_expert": self.n_expert,
                "total_bytes": self.total_bytes, "n_layers": self.n_layers, "source_name": self.source_name,
                "layers": [ln.to_dict() for ln in self.layers]}


def _parse_int(tok: str, path: Path, lineno: int, what: str) -> int:
    if not tok.isdigit() or not tok.isascii():
        raise StrataError(f"{path}:{lineno}: {what} {tok!r} is not a non-negative integer; repack with stratatools pack",
                          path)
    return int(tok)


def parse_native_experts(text: str, path: str | os.PathLike = NATIVE_TXT) -> Pack:
    """Parse the text of a ``native_experts.txt`` strictly (formats.md section 5).

    Checks: a ``# strata native experts v<N>`` header with N <= 4, ``(n_expert E`` and ``total T`` in it; every
    other non-empty line is ``layer gu_type d_type offset blob_bytes [gate_off up_off down_off [shard]]``; layers
    contiguous from 0; offsets the running sum of blob_bytes x E; T equal to the final sum; known type ids; a
    shard column of one name, or (v4 only) ``gate,up,down``; nothing after it.

    Raises:
        StrataError: naming the file, the line and the fix.
    """
    path = Path(path)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    header = None
    version = n_expert = total = None
    source = None
    rows: list[PackLayer] = []
    running = 0
    for i, raw in enumerate(lines, start=1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        if line.startswith("#"):
            if line.startswith(HEADER_TAG):
                if header is not None:
                    raise StrataError(f"{path}:{i}: a second header line; a table has one", path)
                rest = line[len(HEADER_TAG):]
                digits = ""
                for ch in rest:
                    if not ch.isdigit() or not ch.isascii():
                        break
                    digits += ch
                if not digits or len(digits) > 6:
                    raise StrataError(f"{path}:{i}: header has no version number after 'v'", path)
                version = int(digits)
                if not 1 <= version <= MAX_VERSION:
                    raise StrataError(f"{path}:{i}: native_experts.txt v{version}; versions 1..{MAX_VERSION} are "
                                      f"read (repack with this stratatools)", path)
                header = line
                at = line.find("(n_expert ")
                if at < 0:
                    raise StrataError(f"{path}:{i}: header lacks '(n_expert E, total T' ; repack with stratatools pack",
                                      path)
                tail = line[at + len("(n_expert "):]
                tok = tail.split(",")[0].split(")")[0].strip()
                n_expert = _parse_int(tok, path, i, "n_expert")
                if n_expert == 0:
                    raise StrataError(f"{path}:{i}: n_expert is 0", path)
                tat = tail.find("total ")
                if tat < 0:
                    raise StrataError(f"{path}:{i}: header lacks 'total T'; repack with stratatools pack", path)
                tok = tail[tat + 6:].replace(")", ";").split(";")[0].strip()
                total = _parse_int(tok, path, i, "total")
                sat = line.find("absolute offsets in ")
                if sat >= 0:
                    source = line[sat + len("absolute offsets in "):].split(",")[0].strip() or None
            continue
        if header is None:
            raise StrataError(f"{path}:{i}: a table line before the '# strata native experts v<N>:' header", path)
        toks = line.split()
        if len(toks) not in (5, 8, 9):
            raise StrataError(f"{path}:{i}: {len(toks)} columns; expected 'layer gu_type d_type offset blob_bytes "
                              f"[gate_off up_off down_off [shard]]'", path)
        nums = [_parse_int(t, path, i, name) for t, name in
                zip(toks[:8], ("layer", "gu_type", "d_type", "offset", "blob_bytes", "gate_off", "up_off", "down_off"))]
        layer, gt, dt, off, blob = nums[:5]
        if layer != len(rows):
            raise StrataError(f"{path}:{i}: layer {layer} where layer {len(rows)} was expected (layers must be "
                              f"contiguous from 0)", path)
        for tid, what in ((gt, "gu_type"), (dt, "d_type")):
            try:
                type_by_id(tid)
            except StrataError:
                raise StrataError(f"{path}:{i}: {what} {tid} is not a known ggml type id", path) from None
        if blob == 0:
            raise StrataError(f"{path}:{i}: blob_bytes is 0", path)
        if off != running:
            raise StrataError(f"{path}:{i}: layer {layer} offset {off} but the layers before it end at {running} "
                              f"(offset must be the running sum of blob_bytes x n_expert)", path)
        running += blob * n_expert
        shards = None
        if len(toks) == 9:
            col = toks[8]
            parts = col.split(",")
            if len(parts) == 1:
                shards = (col, col, col)
            elif len(parts) == 3 and version >= 4:
                shards = (parts[0], parts[1], parts[2])
            elif len(parts) == 3:
                raise StrataError(f"{path}:{i}: per-role shard column '{col}' in a v{version} table (needs v4)", path)
            else:
                raise StrataError(f"{path}:{i}: the shard column is one name or gate,up,down, not '{col}'", path)
        if len(toks) >= 8:
            rows.append(PackLayer(layer, gt, dt, off, blob, nums[5], nums[6], nums[7], shards))
        else:
            rows.append(PackLayer(layer, gt, dt, off, blob))
    if header is None:
        raise StrataError(f"{path}: no '# strata native experts v<N>:' header line; not a native pack table", path)
    if not rows:
        raise StrataError(f"{path}: the table has no layer lines", path)
    if total != running:
        raise StrataError(f"{path}: header total {total} but the layers add up to {running} bytes", path)
    return Pack(path.parent, version, n_expert, total, rows, header, source)


def read_pack(packdir: str | os.PathLike) -> Pack:
    """Read ``<packdir>/native_experts.txt`` (strict, see :func:`parse_native_experts`).

    Raises:
        StrataError: no such folder or table (an unfinished pack has none), unreadable or malformed text.
    """
    packdir = Path(packdir)
    p = packdir / NATIVE_TXT if packdir.is_dir() or not packdir.exists() else packdir
    if p.name != NATIVE_TXT and p.is_file():
        packdir = p.parent
    check_input(p, "pack table")
    try:
        if p.stat().st_size > _MAX_TABLE_BYTES:
            raise StrataError(f"{p}: {p.stat().st_size} bytes is not a native_experts.txt (a table of at most "
                              f"{_MAX_TABLE_BYTES >> 20} MiB); give the pack folder", p)
        raw = p.read_bytes()
    except FileNotFoundError:
        raise StrataError(f"{p}: no such file; {packdir} is not a finished pack (run stratatools pack)", p) from None
    except OSError as e:
        raise StrataError(f"{p}: cannot read: {e.strerror}", p) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StrataError(f"{p}: byte {e.start}: not UTF-8 text; not a native_experts.txt", p) from None
    pack = parse_native_experts(text, p)
    pack.path = p.parent
    return pack


# ----------------------------------------------------------------------------------------- planning
@dataclass
class LayerPlan:
    """One trunk layer's pack line plus the tensors it is cut from."""

    row: PackLayer
    tensors: tuple[TensorInfo, TensorInfo, TensorInfo]  # gate, up, down
    slice_bytes: tuple[int, int, int]


@dataclass
class PackPlan:
    """Everything :func:`pack_model` will write, derived from the model alone (no I/O beyond the headers).

    Attributes:
        version: 3, or 4 when a layer's roles are split over shards.
        n_expert: trunk E (all routers agree).
        total_bytes: experts.bin size.
        layers: per trunk layer.
        text: the exact native_experts.txt.
        notes: remarks for the user (an MTP block with its own E, ...).
        geometry: the model's geometry.
    """

    version: int
    n_expert: int
    total_bytes: int
    layers: list[LayerPlan]
    text: str
    shard1_name: str
    notes: list[str] = field(default_factory=list)
    geometry: Geometry | None = None

    @property
    def split_layers(self) -> list[int]:
        """Layers whose gate/up/down live in different shards (a split pack row, native_experts v4)."""
        return [lp.row.layer for lp in self.layers if lp.row.split]


def _check_layer(model: Model, le: LayerExperts, n_expert: int) -> tuple[TensorInfo, TensorInfo, TensorInfo]:
    L = le.layer
    missing = [exps_name(L, r) for r in ROLES if le.role(r) is None]
    if missing:
        raise StrataError(f"{model.path}: layer {L}: tensor {', '.join(missing)} is missing; every trunk layer needs "
                          f"gate, up and down experts", model.path)
    g, u, d = le.gate, le.up, le.down
    assert g is not None and u is not None and d is not None
    for t in (g, u, d):
        if len(t.ne) != 3 or t.ne[2] != n_expert:
            raise StrataError(f"{model.path}: tensor {t.name}: shape {list(t.ne)}; expected 3-D with ne2 = {n_expert} "
                              f"(the router's expert count)", model.path)
    if g.type.id != u.type.id:
        raise StrataError(f"{model.path}: layer {L}: gate is {g.type.name} but up is {u.type.name}; gate and up must "
                          f"share a type (requantize them alike)", model.path)
    if g.ne != u.ne:
        raise StrataError(f"{model.path}: layer {L}: gate {list(g.ne)} and up {list(u.ne)} differ in shape", model.path)
    n_embd, ff = g.ne[0], g.ne[1]
    if le.n_embd != n_embd:
        raise StrataError(f"{model.path}: layer {L}: router width {le.n_embd} but experts take {n_embd} inputs",
                          model.path)
    if d.ne[0] != ff or d.ne[1] != n_embd:
        raise StrataError(f"{model.path}: tensor {d.name}: shape {list(d.ne)}; expected [{ff}, {n_embd}, {n_expert}]",
                          model.path)
    return g, u, d


def plan_pack(model: Model) -> PackPlan:
    """Derive the native pack of ``model`` (formats.md section 5): one line per trunk layer.

    E comes from each router's ne1 (never from a constant); all trunk routers must agree. MTP blocks are not
    packed; one whose E differs from the trunk is reported in ``notes``.

    Raises:
        StrataError: not a MoE model; a trunk layer without router or with a missing role; routers disagreeing;
            gate/up of different types; a ``*_exps`` tensor that is not 3-D with ne2 = E; metadata that does not
            fit the tensors (:func:`stratatools.model.geometry.check_consistency`).
    """
    geo = read_geometry(model)
    no_router = [i for i, le in enumerate(geo.layers) if le is None]
    if no_router:
        raise StrataError(f"{model.path}: trunk layer {no_router[0]} has no router ({router_name(no_router[0])}); "
                          f"a native pack needs routed experts in every trunk layer", model.path)
    counts = geo.expert_counts
    if len(set(counts)) != 1:
        first = counts[0]
        odd = next(i for i, c in enumerate(counts) if c != first)
        raise StrataError(f"{model.path}: routers disagree on the expert count: layer 0 has {first}, layer {odd} has "
                          f"{counts[odd]} ({router_name(odd)} ne1); a per-layer pruned model cannot be packed",
                          model.path)
    n_expert = int(counts[0])  # type: ignore[arg-type]
    shard1 = model.files[0].path.name
    layers: list[LayerPlan] = []
    offset = 0
    for le in geo.layers:
        assert le is not None
        g, u, d = _check_layer(model, le, n_expert)
        per = tuple(le.slice_bytes(r) for r in ROLES)  # le.n_expert == n_expert (routers agree)
        blob = sum(per)
        names = tuple("" if t.shard == 0 else t.file_name for t in (g, u, d))
        shards = None if names == ("", "", "") else names
        row = PackLayer(le.layer, g.type.id, d.type.id, offset, blob, g.offset, u.offset, d.offset, shards)  # type: ignore[arg-type]
        layers.append(LayerPlan(row, (g, u, d), per))
        offset += blob * n_expert
    version = 4 if any(lp.row.split for lp in layers) else 3
    text = header_line(version, n_expert, offset, shard1) + "\n" + "".join(lp.row.line() + "\n" for lp in layers)
    notes = []
    for le in geo.mtp_layers:
        if le.n_expert != n_expert:
            notes.append(f"MTP block {le.layer} keeps {le.n_expert} experts (trunk {n_expert}); it is not packed")
        else:
            notes.append(f"MTP block {le.layer} ({le.n_expert} experts) is not packed")
    if version == 4:
        notes.append("layer(s) " + ", ".join(str(x) for x in (lp.row.layer for lp in layers if lp.row.split))
                     + " have gate/up/down in different shards: native_experts.txt v4 with a per-role shard column")
    check_consistency(model)
    return PackPlan(version, n_expert, offset, layers, text, shard1, notes, geo)


# ------------------------------------------------------------------------------------------ copying
class _Copier:
    """Copy byte ranges between file descriptors: copy_file_range, else pread/write in bounded pieces."""

    def __init__(self) -> None:
        self.kernel = hasattr(os, "copy_file_range")

    def copy(self, src_fd: int, src_off: int, n: int, dst_fd: int, dst_off: int) -> None:
        while n > 0:
            if self.kernel:
                try:
                    k = os.copy_file_range(src_fd, dst_fd, min(n, 1 << 30), src_off, dst_off)
                except OSError as e:
                    if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM,
                                   errno.EBADF):
                        self.kernel = False
                        continue
                    raise
            else:
                b = os.pread(src_fd, min(n, _COPY_CHUNK), src_off)
                k = len(b)
                mv = memoryview(b)
                at = dst_off
                while mv:
                    w = os.pwrite(dst_fd, mv, at)
                    mv = mv[w:]
                    at += w
            if k <= 0:
                raise StrataError(f"unexpected end of file at byte {src_off} while copying expert data; the model "
                                  f"file changed or is truncated")
            src_off += k
            dst_off += k
            n -= k


def _experts_src(model: Model, text: str, total: int) -> dict[str, Any]:
    """The experts.bin.src.json record: source shards (names, sizes), hash of the table, bytes (formats.md 5)."""
    return {"schema": 1,
            "shards": [{"name": f.path.name, "size": f.size} for f in model.files],
            "native_experts_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "bytes": total}


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def _expert_blob_from_model(model: Model, lp: LayerPlan, e: int) -> bytes:
    return b"".join(bytes(model.raw(t, e * s, s)) for t, s in zip(lp.tensors, lp.slice_bytes))


_PACK_FILES = (NATIVE_TXT, NATIVE_TXT + ".json", EXPERTS_BIN, EXPERTS_SRC)
_SRC_DIGESTS = ("ranges_sha256", "shards_sha256")


def _ranges_digest(model: Model, plan: PackPlan, stop: Callable[[], bool] | None = None) -> str | None:
    """sha256 over every source byte range experts.bin is cut from, in table order (layer, then gate, up, down:
    each role's whole ``n_expert x slice`` range), read through 64 MiB memory-mapped windows (bounded RSS).
    None when ``stop()`` turned true. Raises OSError when a shard cannot be read."""
    import mmap

    h = hashlib.sha256()
    fds: dict[int, int] = {}
    gran = mmap.ALLOCATIONGRANULARITY
    try:
        for lp in plan.layers:
            for t, s in zip(lp.tensors, lp.slice_bytes):
                if t.shard not in fds:
                    fds[t.shard] = os.open(model.files[t.shard].path, os.O_RDONLY)
                fd = fds[t.shard]
                off, end = t.offset, t.offset + s * plan.n_expert
                while off < end:
                    if stop is not None and stop():
                        return None
                    base = off - off % gran
                    n = min(64 << 20, end - base)
                    mm = mmap.mmap(fd, n, access=mmap.ACCESS_READ, offset=base)
                    try:
                        h.update(memoryview(mm)[off - base:n])
                    finally:
                        mm.close()
                    off = base + n
    finally:
        for fd in fds.values():
            os.close(fd)
    return h.hexdigest()


class _RangesDigest(threading.Thread):
    """:func:`_ranges_digest` in a background thread (while experts.bin is copied from the same pages)."""

    def __init__(self, model: Model, plan: PackPlan):
        super().__init__(daemon=True)
        self.model, self.plan = model, plan
        self.digest: str | None = None
        self.error: BaseException | None = None
        self.stop = False

    def run(self) -> None:
        try:
            self.digest = _ranges_digest(self.model, self.plan, stop=lambda: self.stop)
        except BaseException as e:  # reported by the caller
            self.error = e


def _bin_matches(model: Model, plan: PackPlan, bin_path: Path, src_path: Path, want: dict[str, Any]) -> bool:
    """True only when an existing experts.bin was cut from exactly these source bytes: its size is the table's,
    its ``experts.bin.src.json`` matches (shards, table hash, bytes) and records a ``ranges_sha256`` equal to the
    digest of every source byte range now (:func:`_ranges_digest`; a changed model of the same name and size is
    caught, whatever byte changed). Shortcut without reading: when the record also holds every shard's whole-file
    sha256 and the digest cache has the same digest for each shard as it is now (device, inode, size, mtime and
    ctime unchanged since hashing, :func:`stratatools.core.fsutil.cached_sha256`), the ranges are unchanged too."""
    try:
        if not bin_path.is_file() or bin_path.stat().st_size != plan.total_bytes:
            return False
    except OSError:
        return False
    rec = _read_json(src_path)
    if not isinstance(rec, dict) or {k: v for k, v in rec.items() if k not in _SRC_DIGESTS} != want:
        return False
    recorded = rec.get("ranges_sha256")
    if not isinstance(recorded, str):
        return False
    shas = rec.get("shards_sha256")
    if isinstance(shas, list) and len(shas) == len(model.files) and \
            all(cached_sha256(f.path) == h for f, h in zip(model.files, shas)):
        return True  # every whole shard provably unchanged since it was hashed (digest cache): so are the ranges
    return _ranges_digest(model, plan) == recorded


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` at ``dst`` (no data copied); a copy where the file system has no hard links."""
    import shutil

    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _write_experts_bin(model: Model, plan: PackPlan, path: Path, progress: Callable[[int], Any] | None) -> int:
    """Copy every expert slice into a new ``path`` (created exclusively, never through a symlink) at its place in
    the arena, fsync it; returns the bytes copied. Raises OSError / StrataError."""
    copier = _Copier()
    copied = 0
    fds = [os.open(f.path, os.O_RDONLY) for f in model.files]
    try:
        dst = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        try:
            try:
                os.posix_fallocate(dst, 0, plan.total_bytes)
            except AttributeError:
                os.ftruncate(dst, plan.total_bytes)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise
                os.ftruncate(dst, plan.total_bytes)
            for fd in fds:
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                except (OSError, AttributeError):
                    pass
            # role by role: each source tensor is read front to back (sequential reads, as cp does);
            # each expert's slice lands at its place in the [gate][up][down] blob of the arena
            for lp in plan.layers:
                role_off = 0
                blob = lp.row.blob_bytes
                for t, s in zip(lp.tensors, lp.slice_bytes):
                    fd = fds[t.shard]
                    base = lp.row.offset + role_off
                    for e in range(plan.n_expert):
                        copier.copy(fd, t.offset + e * s, s, dst, base + e * blob)
                    role_off += s
                    copied += s * plan.n_expert
                    if progress is not None:
                        progress(s * plan.n_expert)
            if copied != plan.total_bytes or os.fstat(dst).st_size != plan.total_bytes:
                raise StrataError(f"{path}: wrote {copied} bytes, expected {plan.total_bytes}")
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        for fd in fds:
            os.close(fd)
    return copied


class _Hasher(threading.Thread):
    """sha256 of the shard files in a background thread, while experts.bin is copied.

    Each shard is first looked up in the digest cache (:func:`stratatools.core.fsutil.cached_sha256`; skipped with
    ``refresh``); the others are hashed through memory-mapped windows (:func:`stratatools.core.fsutil.sha256_fd`,
    hashlib releases the GIL) and recorded in the cache. ``sources`` says, per path, ``"cache"`` or ``"computed"``.
    """

    def __init__(self, paths: list[Path], refresh: bool = False):
        super().__init__(daemon=True)
        self.paths = paths
        self.refresh = refresh
        self.result: dict[str, str] = {}
        self.sources: dict[str, str] = {}
        self.error: BaseException | None = None
        self.stop = False

    def run(self) -> None:
        try:
            for p in self.paths:
                h = None if self.refresh else cached_sha256(p)
                if h is not None:
                    self.result[str(p)], self.sources[str(p)] = h, "cache"
                    continue
                started = time.time_ns()
                fd = os.open(p, os.O_RDONLY)
                try:
                    st = os.fstat(fd)
                    h = sha256_fd(fd, st.st_size, stop=lambda: self.stop)
                finally:
                    os.close(fd)
                if h is None:
                    return
                store_sha256(p, h, st, started)
                self.result[str(p)], self.sources[str(p)] = h, "computed"
        except BaseException as e:  # reported by the caller
            self.error = e


@dataclass
class PackResult:
    """What :func:`pack_model` did.

    Attributes:
        packdir: the pack folder.
        model: the model path given.
        shards: shard file names.
        version, n_expert, n_layers, total_bytes: the table's.
        layers: the table rows.
        experts_bin: ``"written"``, ``"reused"``, ``"kept"`` (an existing matching experts.bin, no flag) or ``"none"``.
        bytes_copied: experts.bin bytes written this run.
        seconds: wall time.
        notes: MTP blocks, v4 layers, reuse remarks.
        native_experts_sha256: hash of the table text.
        sha256_sources: per shard name, where its provenance sha256 came from: ``"cache"`` (digest cache) or
            ``"computed"``; empty when hashing was off.
    """

    packdir: Path
    model: Path
    shards: list[str]
    version: int
    n_expert: int
    n_layers: int
    total_bytes: int
    layers: list[PackLayer]
    experts_bin: str
    bytes_copied: int
    seconds: float
    notes: list[str]
    native_experts_sha256: str
    sha256_sources: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"packdir": str(self.packdir), "model": str(self.model), "shards": self.shards,
                "version": self.version, "n_expert": self.n_expert, "n_layers": self.n_layers,
                "total_bytes": self.total_bytes, "experts_bin": self.experts_bin, "bytes_copied": self.bytes_copied,
                "seconds": round(self.seconds, 3), "notes": self.notes,
                "native_experts_sha256": self.native_experts_sha256, "sha256_sources": self.sha256_sources,
                "layers": [ln.to_dict() for ln in self.layers]}


def _guard_packdir(packdir: Path, model: Model, force: bool) -> None:
    inputs = [f.path for f in model.files]
    for i in inputs:  # the native table records the shards' names as UTF-8 text (formats.md 5)
        try:
            i.name.encode("utf-8")
        except UnicodeEncodeError:
            shown = str(i).encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            raise StrataError(f"{shown}: the file name is not valid UTF-8, and the pack records the model's file "
                              f"names for the engine; rename the file (and its other shards) to a UTF-8 name",
                              shown) from None
    outs = [packdir] + [packdir / n for n in (NATIVE_TXT, EXPERTS_BIN, EXPERTS_SRC, NATIVE_TXT + ".json")]
    for o in outs:
        for i in inputs:
            try:
                same = o.exists() and os.path.samefile(o, i)
            except OSError:
                same = False
            if same or o.resolve() == i.resolve():
                raise StrataError(f"{o}: output would overwrite the input {i}; choose another -o folder", o)
    if packdir.exists() and not packdir.is_dir():
        raise StrataError(f"{packdir}: exists and is not a folder; -o takes the pack folder", packdir)
    # what a killed run left beside it (its temp folder, the lock file, aside folders: the publish's keep)
    tidy_output(packdir, keep=lambda n: n not in _PACK_FILES)
    for o in outs[1:]:
        if (o.exists() or o.is_symlink()) and not o.is_file():
            raise StrataError(f"{o}: exists and is not a file; remove it or choose another -o folder", o)
    if not force:
        _refuse_pack(packdir)
        # other files (not the model's own shards, beside which a pack is usually written) need --force
        own = {f.path.name for f in model.files if f.path.parent.resolve() == packdir.resolve()}
        refuse_foreign_folder(packdir, lambda n: n not in _PACK_FILES and n not in own, "pack", "-o")


def _refuse_pack(packdir: Path) -> None:
    """Refuse (without --force) a folder that already holds a pack; run again under the output lock just before
    the swap (:func:`stratatools.core.fsutil.publish_dir`), so a pack another run published meanwhile is kept."""
    if (packdir / NATIVE_TXT).exists():
        raise StrataError(f"{packdir / NATIVE_TXT}: already exists (pass --force to replace the pack)", packdir)




def pack_model(model_path: str | os.PathLike, packdir: str | os.PathLike, experts_bin: bool = False,
               force: bool = False, progress: Callable[[int], Any] | None = None,
               on_start: Callable[[int], Any] | None = None, hash_inputs: bool = True,
               rehash: bool = False) -> PackResult:
    """Write the native pack of a model (formats.md section 5) into ``packdir``.

    Args:
        model_path: a GGUF file or any shard of a set.
        packdir: output folder (created).
        experts_bin: also write ``experts.bin`` (reused when its sidecar and sampled blobs match).
        force: replace an existing pack.
        progress: called with the bytes copied since the last call.
        on_start: called once with the bytes that will be copied (0 when none).
        hash_inputs: record the sha256 of every shard in the provenance sidecar: taken from the digest cache when
            the shard is unchanged since it was last hashed, else computed (a full read of the shard, in a background
            thread while experts.bin is copied) and cached; off, the sidecar records ``"sha256": null``.
        rehash: ignore the digest cache and hash every shard again (refreshing the cache).

    Returns:
        a :class:`PackResult`.

    Raises:
        StrataError: every :func:`plan_pack` error; the output would overwrite an input; an existing pack without
            ``force``; an existing experts.bin cut from another source when ``experts_bin`` is off.
    """
    t0 = time.perf_counter()
    packdir = Path(packdir)
    with open_model(model_path) as model:
        plan = plan_pack(model)
        _guard_packdir(packdir, model, force)
        text = plan.text
        try:  # never publish a table the engine's reader (and ours) would refuse
            parse_native_experts(text, packdir / NATIVE_TXT)
        except StrataError as e:
            raise StrataError(f"{model_path}: this model cannot be packed: the table would be refused on reading "
                              f"({e}); nothing was written", model_path) from None
        want = _experts_src(model, text, plan.total_bytes)
        bin_path, src_path = packdir / EXPERTS_BIN, packdir / EXPERTS_SRC
        notes = list(plan.notes)
        reuse = _bin_matches(model, plan, bin_path, src_path, want)
        if bin_path.exists() and not reuse and not experts_bin:
            raise StrataError(f"{bin_path}: exists but was not cut from this model ({EXPERTS_SRC} or the digest of its "
                              f"source byte ranges does not match); the engine would read it instead of the GGUF: "
                              f"pass --experts-bin to rewrite it, or delete it", bin_path)
        write_bin = experts_bin and not reuse
        state = "written" if write_bin else ("reused" if reuse and experts_bin else ("kept" if reuse else "none"))
        if reuse:
            notes.append(f"{EXPERTS_BIN} matches this model (every source byte range has the digest recorded in "
                         f"{EXPERTS_SRC}); not rewritten")
        hasher = _Hasher([f.path for f in model.files] if hash_inputs else [], refresh=rehash)
        ranges = _RangesDigest(model, plan) if write_bin else None
        copied = 0
        started = False
        try:
            # the whole pack is built in a temp folder beside packdir and published at the end (publish_dir): a
            # kill, full disk or error during the build leaves the previous pack as it was; in a folder that holds
            # other files the pack's files go in one by one, native_experts.txt removed first and renamed in last
            with publish_dir(packdir, inputs=[f.path for f in model.files],
                             keep=lambda n: n not in _PACK_FILES, refuse=None if force else _refuse_pack,
                             last=(NATIVE_TXT,)) as stage:
                hasher.start()
                started = True
                if on_start is not None:
                    on_start(plan.total_bytes if write_bin else 0)
                if write_bin:
                    assert ranges is not None
                    ranges.start()
                    copied = _write_experts_bin(model, plan, stage / EXPERTS_BIN, progress)
                    ranges.join()
                    if ranges.error is not None:
                        raise ranges.error
                elif reuse:
                    _link_or_copy(bin_path, stage / EXPERTS_BIN)
                    _link_or_copy(src_path, stage / EXPERTS_SRC)
                hasher.join()
                if hasher.error is not None:
                    raise StrataError(f"cannot read the model to hash it: {hasher.error}")
                if write_bin:
                    assert ranges is not None
                    src = dict(want, ranges_sha256=ranges.digest)
                    shas = [hasher.result.get(str(f.path)) for f in model.files]
                    if all(isinstance(h, str) for h in shas):
                        src["shards_sha256"] = shas
                    write_json_atomic(stage / EXPERTS_SRC, src)
                from_cache = [Path(k).name for k, v in hasher.sources.items() if v == "cache"]
                if from_cache:
                    notes.append(f"sha256 of {', '.join(from_cache)} from the digest cache (file unchanged since it "
                                 f"was hashed: same device, inode, size, mtime and ctime); --rehash recomputes it")
                prov = build_provenance(
                    "pack",
                    inputs=[{"name": f.path.name, "path": str(f.path.resolve()), "size_bytes": f.size,
                             "sha256": hasher.result.get(str(f.path)), "role": "shard"} for f in model.files],
                    options={"experts_bin": experts_bin, "hash_inputs": hash_inputs},
                    model={"name": str(model.kv.get("general.name", "")),
                           "sha256": hasher.result.get(str(model.files[0].path)),
                           "n_layers": len(plan.layers), "n_expert": plan.n_expert},
                    extra={"pack": {"version": plan.version, "n_expert": plan.n_expert,
                                    "total_bytes": plan.total_bytes,
                                    "native_experts_sha256": want["native_experts_sha256"],
                                    "experts_bin": state in ("written", "reused", "kept")}})
                write_json_atomic(sidecar_path(stage / NATIVE_TXT), prov)
                write_text_atomic(stage / NATIVE_TXT, text)
        except BaseException as e:
            hasher.stop = True
            if ranges is not None:
                ranges.stop = True
            if started:
                hasher.join()
            if isinstance(e, OSError) and not isinstance(e, StrataError):
                where = e.filename if e.filename is not None else packdir
                raise StrataError(f"{where}: cannot write the pack: {e.strerror or e}; nothing was published, the "
                                  f"previous pack is unchanged (check the -o folder and free space)", packdir) from None
            raise
        return PackResult(packdir, Path(model_path), [f.path.name for f in model.files], plan.version,
                          plan.n_expert, len(plan.layers), plan.total_bytes, [lp.row for lp in plan.layers], state,
                          copied, time.perf_counter() - t0, notes, want["native_experts_sha256"],
                          {Path(k).name: v for k, v in hasher.sources.items()})


# ---------------------------------------------------------------------------------------- verifying
@dataclass
class VerifyReport:
    """Result of :func:`verify_pack`: ``ok`` when no problem was found.

    Attributes:
        problems: one line per mismatch (field, layer, expected vs found).
        checked_lines: table lines compared.
        checked_blobs: experts.bin blobs compared with GGUF slices.
    """

    ok: bool
    problems: list[str]
    checked_lines: int
    checked_blobs: int

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "problems": self.problems, "checked_lines": self.checked_lines,
                "checked_blobs": self.checked_blobs}


def verify_pack(pack: Pack, model: Model, samples_per_layer: int = 4, seed: int = 0) -> VerifyReport:
    """Check a pack against a model: re-derive the table and compare every field; compare sampled experts.bin
    blobs (first, last and ``samples_per_layer`` seeded random experts of every layer) with the GGUF slices.

    Raises:
        StrataError: the model itself cannot be packed (see :func:`plan_pack`).
    """
    plan = plan_pack(model)
    problems: list[str] = []
    if pack.n_expert != plan.n_expert:
        problems.append(f"n_expert: pack {pack.n_expert}, model {plan.n_expert}")
    if pack.total_bytes != plan.total_bytes:
        problems.append(f"total: pack {pack.total_bytes}, model {plan.total_bytes}")
    if pack.version != plan.version:
        problems.append(f"version: pack v{pack.version}, model needs v{plan.version}")
    if len(pack.layers) != len(plan.layers):
        problems.append(f"layers: pack {len(pack.layers)}, model {len(plan.layers)} trunk layers")
    fields = ("gu_type", "d_type", "offset", "blob_bytes", "gate_off", "up_off", "down_off", "shards")
    n = 0
    for got, lp in zip(pack.layers, plan.layers):
        n += 1
        for f in fields:
            a, b = getattr(got, f), getattr(lp.row, f)
            if f in ("gate_off", "up_off", "down_off", "shards") and a is None:
                continue  # a 5-column (experts.bin-only) line has no GGUF offsets
            if a != b:
                problems.append(f"layer {got.layer}: {f} pack {a}, model {b}")
    blobs = 0
    binp = pack.experts_bin
    if binp is not None and not problems:
        size = binp.stat().st_size
        if size != pack.total_bytes:
            problems.append(f"experts.bin: {size} bytes, table total {pack.total_bytes}")
        else:
            rng = random.Random(seed)
            with open(binp, "rb") as fh:
                for lp in plan.layers:
                    es = {0, plan.n_expert - 1} | {rng.randrange(plan.n_expert) for _ in range(samples_per_layer)}
                    for e in sorted(es):
                        fh.seek(lp.row.offset + e * lp.row.blob_bytes)
                        blobs += 1
                        if fh.read(lp.row.blob_bytes) != _expert_blob_from_model(model, lp, e):
                            problems.append(f"experts.bin: layer {lp.row.layer} expert {e} differs from the GGUF")
    return VerifyReport(not problems, problems, n, blobs)
