"""A minimal reader of a native pack's ``native_experts.txt`` (formats.md section 5), for the runtime.

The runtime only needs, per trunk layer, the types, the arena offset, the blob size and the absolute GGUF
offsets (with their shard) of the three role tensors, so it can check the table against the GGUF it runs
and read expert slices either from ``experts.bin`` or straight from the GGUF. The full packer and its
reader belong to :mod:`stratatools.pack`; this module is deliberately small and strict.

Layout (Strata ``expert_layout_load``; formats.md section 5): a header comment line
``# strata native experts v<N>: <columns> (n_expert <E>, total <T>; ...)``, then one line per trunk layer
``layer gu_type d_type offset blob_bytes [gate_off up_off down_off [shard]]``; v3 shard = one file name,
v4 shard = ``gate,up,down`` names where an empty field means shard 1.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from stratatools.errors import StrataError

TABLE_NAME = "native_experts.txt"
ARENA_NAME = "experts.bin"
_HDR = re.compile(r"strata native experts v(\d+)")
_NEXP = re.compile(r"\(n_expert\s+(\d+)")
_TOTAL = re.compile(r"total\s+(\d+)")


@dataclass(frozen=True)
class PackLayer:
    """One line of the table.

    Attributes:
        layer: trunk layer.
        gu_type, d_type: ggml type ids of gate/up and of down.
        offset: byte offset of the layer in the experts.bin arena.
        blob_bytes: one expert's ``[gate][up][down]`` bytes.
        gate_off, up_off, down_off: absolute byte offsets of the role tensors in their GGUF files (None
            when the line has no offsets).
        shards: per role (gate, up, down) the shard file name, or None for shard 1.
        line: 1-based line number in the table.
    """

    layer: int
    gu_type: int
    d_type: int
    offset: int
    blob_bytes: int
    gate_off: int | None
    up_off: int | None
    down_off: int | None
    shards: tuple[str | None, str | None, str | None]
    line: int


@dataclass
class PackTable:
    """A parsed ``native_experts.txt``.

    Attributes:
        path: the table file.
        version: the ``v<N>`` of the header (1..4).
        n_expert: E from ``(n_expert E`` (the engine's source of E).
        total: arena bytes from ``total T`` (None when absent).
        layers: one :class:`PackLayer` per trunk layer, in order.
    """

    path: Path
    version: int
    n_expert: int
    total: int | None
    layers: list[PackLayer] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        return self.path.parent

    @property
    def arena(self) -> Path:
        return self.path.parent / ARENA_NAME


def read_pack_table(path: str | os.PathLike) -> PackTable:
    """Parse a pack's ``native_experts.txt`` (a pack folder or the file itself).

    Raises:
        StrataError: missing file, no header, version > 4, no ``(n_expert E``, a malformed line (named by
            number), layers not contiguous from 0, offsets that are not the running sum of earlier blobs.
    """
    p = Path(path)
    if p.is_dir():
        p = p / TABLE_NAME
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StrataError(f"{p}: no such file (a pack folder holds {TABLE_NAME}; run `stratatools pack` first)", p) from None
    except UnicodeDecodeError:
        raise StrataError(f"{p}: not UTF-8 text; not a native_experts.txt", p) from None
    version = None
    n_expert = None
    total = None
    rows: list[PackLayer] = []
    for ln, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            m = _HDR.search(line)
            if m and version is None:
                version = int(m.group(1))
            m = _NEXP.search(line)
            if m:
                n_expert = int(m.group(1))
                t = _TOTAL.search(line)
                if t:
                    total = int(t.group(1))
            continue
        if version is None:
            raise StrataError(f"{p}: line {ln}: data before the '# strata native experts v<N>:' header", p)
        parts = line.split()
        if len(parts) not in (5, 8, 9):
            raise StrataError(f"{p}: line {ln}: {len(parts)} columns; expected 5, 8 or 9 "
                              f"(layer gu_type d_type offset blob_bytes [gate_off up_off down_off [shard]])", p)
        try:
            nums = [int(x) for x in parts[:8]]
        except ValueError:
            raise StrataError(f"{p}: line {ln}: a number column is not an integer: {line!r}", p) from None
        if any(x < 0 for x in nums):
            raise StrataError(f"{p}: line {ln}: negative value in {line!r}", p)
        shards: tuple[str | None, str | None, str | None] = (None, None, None)
        if len(parts) == 9:
            s = parts[8]
            if "," in s:
                f = s.split(",")
                if len(f) != 3:
                    raise StrataError(f"{p}: line {ln}: shard column {s!r} is not a gate,up,down triple", p)
                shards = tuple(x or None for x in f)  # type: ignore[assignment]
            else:
                shards = (s, s, s)
        offs = nums[5:8] if len(nums) >= 8 else [None, None, None]
        rows.append(PackLayer(nums[0], nums[1], nums[2], nums[3], nums[4], offs[0], offs[1], offs[2], shards, ln))
    if version is None:
        raise StrataError(f"{p}: no '# strata native experts v<N>:' header; not a native_experts.txt", p)
    if not 1 <= version <= 4:
        raise StrataError(f"{p}: line 1: version v{version} is not supported (the engine reads v1..v4)", p)
    if n_expert is None or n_expert <= 0:
        raise StrataError(f"{p}: no '(n_expert E' in any comment line; the expert count is unknown", p)
    running = 0
    for i, r in enumerate(rows):
        if r.layer != i:
            raise StrataError(f"{p}: line {r.line}: layer {r.layer} where layer {i} was expected (layers must be contiguous from 0)", p)
        if r.offset != running:
            raise StrataError(f"{p}: line {r.line}: layer {i} arena offset {r.offset} is not {running} "
                              f"(the running sum of blob_bytes x n_expert of earlier layers)", p)
        running += r.blob_bytes * n_expert
    if total is not None and total != running:
        raise StrataError(f"{p}: header total {total} disagrees with the table's arena size {running}", p)
    return PackTable(p, version, n_expert, total if total is not None else running, rows)
