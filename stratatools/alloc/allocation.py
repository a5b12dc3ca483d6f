"""ISTA-DASLab ``rco-allocation.txt`` maps: parsing, validation, survivor maps, diffs (formats.md section 6).

The file is UTF-8 text, one entry per line; ``#`` lines are comments (the header states the kept count, the
original count and the layer count in the Coder's file). Two entry shapes, told apart by shape only:

* **Section 1**, one per GGUF tensor: ``<tensor name>: <TYPE>``.
* **Section 2**, pruned releases only, one per (layer, role, original expert index):
  ``blk.<L>.ffn_<gate|up|down>_exps.weight[<I>]: <TYPE or nothing>``; an empty type means expert I was
  pruned. Pruned lines may end in ``": "`` or ``":"``.

The reader tolerates a BOM, CRLF line ends, tabs and repeated spaces around the colon. The GGUF stores the
survivors densely renumbered in **ascending original index** (ISTA's RCO code and the public re-pruner both
do so), so new index k of layer L is the k-th smallest kept original index of that layer; the order of the
lines inside a layer is not trusted (the parser records when kept entries are listed out of order).

Parsing is one pass of a compiled regular expression per line (C speed) into numpy arrays; validation and
diffs are vectorised. A 48 x 512 -> 256 file (74,952 entries) parses and validates in well under a second
(bench/bench_alloc.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.model.ggml_types import TYPES_BY_NAME

if TYPE_CHECKING:
    from stratatools.model.gguf import Model

ROLES = ("gate", "up", "down")

# A Section 2 entry: blk.<L>.ffn_<role>_exps.weight[<I>]: <TYPE or nothing>
# (re.ASCII: indices are decimal ASCII digits; without it \d also takes other scripts' digits, which int() reads)
_S2 = re.compile(r"[ \t]*blk\.(\d{1,6})\.ffn_(gate|up|down)_exps\.weight\[(\d{1,7})\][ \t]*:[ \t]*([A-Za-z0-9_]*)[ \t\r]*",
                 re.ASCII)
# A Section 1 entry: <tensor name>: <TYPE>  (names have no spaces, colons, brackets or '#')
_S2_ALL = re.compile(r"^[ \t]*blk\.(\d{1,6})\.ffn_(gate|up|down)_exps\.weight\[(\d{1,7})\][ \t]*:[ \t]*([A-Za-z0-9_]*)[ \t\r]*$",
                     re.MULTILINE | re.ASCII)
_S1 = re.compile(r"[ \t]*([A-Za-z0-9_.\-]+)[ \t]*:[ \t]*([A-Za-z0-9_]*)[ \t\r]*")
_BLANK_OR_COMMENT = re.compile(r"[ \t\r]*(#.*)?")
_HDR_KEPT = re.compile(r"(\d+)\s+of\s+(\d+)", re.ASCII)
_HDR_LAYERS = re.compile(r"(\d+)\s+layers", re.ASCII)

MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16


@dataclass
class SurvivorMap:
    """Per layer, which original experts survive and which dense (new) index each one has.

    New index k of layer L is the k-th smallest kept original index of L (formats.md section 6: ISTA's RCO
    code and the public re-pruner pack survivors in ascending original index).

    Attributes:
        n_original: experts per layer before pruning (E_full, 512 for the Coder).
        kept: per layer, int64 array of the kept original indices, ascending (length = n_kept of the layer).
        source: where the map came from (an allocation file, or ``routers`` for a router-derived map).
    """

    n_original: int
    kept: list[np.ndarray]
    source: str = ""

    @property
    def n_layers(self) -> int:
        """Number of layers in the map."""
        return len(self.kept)

    @property
    def n_kept(self) -> list[int]:
        """Kept experts per layer."""
        return [int(len(k)) for k in self.kept]

    @property
    def uniform_n_kept(self) -> int | None:
        """The kept count when every layer keeps the same number, else None."""
        s = set(self.n_kept)
        return s.pop() if len(s) == 1 else None

    def n_kept_required(self, what: str = "a STRP profile") -> int:
        """The uniform kept count; raises StrataError when layers keep different numbers of experts."""
        e = self.uniform_n_kept
        if e is None:
            raise StrataError(f"{self.source or 'allocation'}: layers keep different numbers of experts "
                              f"({min(self.n_kept)}..{max(self.n_kept)}); {what} needs one expert count per layer")
        return e

    def dense_table(self) -> np.ndarray:
        """int64 [n_layers, n_original]: the dense index of each original expert, -1 when pruned."""
        t = np.full((self.n_layers, self.n_original), -1, dtype=np.int64)
        for layer, k in enumerate(self.kept):
            t[layer, k] = np.arange(len(k))
        return t

    def orig_table(self) -> np.ndarray:
        """int64 [n_layers, max kept]: the original index of each dense index, -1 past a layer's kept count."""
        width = max(self.n_kept) if self.kept else 0
        t = np.full((self.n_layers, width), -1, dtype=np.int64)
        for layer, k in enumerate(self.kept):
            t[layer, :len(k)] = k
        return t

    def to_rows(self) -> list[tuple[int, int, int]]:
        """(layer, new index, original index) for every survivor, layer-major."""
        return [(layer, i, int(o)) for layer, k in enumerate(self.kept) for i, o in enumerate(k.tolist())]

    def equals(self, other: "SurvivorMap") -> bool:
        """True when both maps keep the same original indices, in the same order, in every layer."""
        return (self.n_layers == other.n_layers and
                all(np.array_equal(a, b) for a, b in zip(self.kept, other.kept)))


@dataclass
class Allocation:
    """A parsed ``rco-allocation.txt``.

    Attributes:
        path: the file (for messages).
        header: the comment lines before the first entry, without ``#``.
        header_kept / header_original / header_layers: what the header says (``16 of 32 ... 8 layers``), or None.
        header_count_line: the 1-based line of the header's ``K of N`` count, or None.
        tensor_types: Section 1, tensor name -> upper-case type name.
        tensor_lines: Section 1, tensor name -> 1-based line number.
        entry_group: per entry in file order, -1 for Section 1, else the Section 2 layer. int32 [n_entries].
        entry_index: per entry in file order, its index in Section 1 (``tensor_types`` order) or in the
            Section 2 arrays. int64 [n_entries].
        layer, role, orig, line: Section 2 entries in file order: layer, role (0 gate, 1 up, 2 down),
            original index, 1-based line number. int64 arrays [n_s2].
        type_code: Section 2, index into ``type_names``; 0 is ``""`` (pruned). int64 [n_s2].
        type_names: the distinct type names of Section 2, ``""`` first.
        n_layers: Section 2 layers (0 when there is no Section 2).
        n_original: original experts per layer (header's count when stated, else the largest index + 1).
        kept_mask: bool [n_layers, n_original] (gate's set; validation made sure up and down agree).
        out_of_order_layers: layers whose kept entries are not listed in ascending original index.
        warnings: non-fatal findings (header disagreements, mixed types).
    """

    path: str
    header: list[str] = field(default_factory=list)
    header_kept: int | None = None
    header_original: int | None = None
    header_layers: int | None = None
    tensor_types: dict[str, str] = field(default_factory=dict)
    tensor_lines: dict[str, int] = field(default_factory=dict)
    entry_group: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    entry_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    layer: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    role: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    orig: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    line: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    type_code: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    type_names: list[str] = field(default_factory=lambda: [""])
    n_layers: int = 0
    n_original: int = 0
    kept_mask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), bool))
    out_of_order_layers: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sha256: str | None = None
    header_count_line: int | None = None

    # -- derived ---------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """File name of the allocation map (no folder)."""
        return Path(self.path).name

    @property
    def title(self) -> str:
        """The first header line (e.g. ``RCO allocation map: coder revA ...``), or ''."""
        return self.header[0] if self.header else ""

    @property
    def pruned(self) -> bool:
        """True when the file has a Section 2 (a pruned release)."""
        return self.n_layers > 0

    @property
    def n_entries(self) -> int:
        """Number of Section 1 entries (rows of the map)."""
        return int(len(self.entry_group))

    @property
    def n_kept(self) -> list[int]:
        """Surviving experts per layer (Section 2), or [] for an unpruned map."""
        return [int(x) for x in self.kept_mask.sum(axis=1)] if self.pruned else []

    def survivor_map(self) -> SurvivorMap:
        """The :class:`SurvivorMap` (ascending original index per layer). Raises StrataError without Section 2."""
        if not self.pruned:
            raise StrataError(f"{self.path}: no Section 2 (per-expert) entries: not the allocation of a pruned "
                              f"release, so there is no survivor map", self.path)
        return SurvivorMap(self.n_original, [np.nonzero(row)[0].astype(np.int64) for row in self.kept_mask],
                           source=self.path)

    def expert_types(self) -> np.ndarray:
        """object [n_layers, 3, n_original]: each (layer, role, original index)'s type name, '' when pruned."""
        t = np.full((self.n_layers, 3, self.n_original), "", dtype=object)
        names = np.array(self.type_names, dtype=object)
        t[self.layer, self.role, self.orig] = names[self.type_code]
        return t

    def type_histogram(self) -> dict[str, int]:
        """Kept Section 2 entries per type name (all roles)."""
        counts = np.bincount(self.type_code, minlength=len(self.type_names))
        return {n: int(c) for n, c in zip(self.type_names, counts) if n and c}

    def summary(self) -> dict[str, Any]:
        """A JSON-able summary (what ``alloc show`` prints)."""
        n_kept = self.n_kept
        return {
            "path": self.path, "sha256": self.sha256, "title": self.title,
            "header": {"kept": self.header_kept, "original": self.header_original, "layers": self.header_layers},
            "n_entries": self.n_entries, "n_section1": len(self.tensor_types), "n_section2": int(len(self.layer)),
            "pruned": self.pruned, "n_layers": self.n_layers, "n_original": self.n_original,
            "n_kept_per_layer": n_kept, "uniform_n_kept": (n_kept[0] if n_kept and len(set(n_kept)) == 1 else None),
            "total_kept": int(sum(n_kept)), "total_pruned": int(self.n_layers * self.n_original - sum(n_kept)),
            "kept_types": self.type_histogram(),
            "out_of_order_layers": self.out_of_order_layers,
            "survivor_order": ("ascending original index (listed in that order)" if not self.out_of_order_layers else
                               f"ascending original index (kept entries of {len(self.out_of_order_layers)} layers "
                               f"are listed in another order; the map does not follow the listing)"),
            "warnings": list(self.warnings),
        }


def _decode(data: bytes, p: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise StrataError(f"{p}: line {line} (byte {e.start}): not UTF-8 text; an rco-allocation.txt is UTF-8", p) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\x00" in text:
        i = text.index("\x00")
        raise StrataError(f"{p}: line {text.count(chr(10), 0, i) + 1}: NUL byte in the text; not an rco-allocation.txt", p)
    return text


def parse_allocation(data: bytes, path: str | os.PathLike | None = None) -> Allocation:
    """Parse and validate the bytes of an ``rco-allocation.txt`` (formats.md section 6).

    Fast path: every line holding ``_exps.weight[`` must be a Section 2 entry; those are extracted by one
    multi-line regex scan (C speed) and their line numbers come from the line classification; the few other
    lines (Section 1, comments) go through a per-line match. When the counts disagree, a per-line pass finds
    the offending line for the message.

    Returns:
        an :class:`Allocation`; its Section 2 arrays are in file order.

    Raises:
        StrataError, naming the line: not UTF-8; no entries at all; a line of neither shape (garbage); a Section 1 tensor
        without a type or listed twice; an (layer, role, original index) listed twice; a layer or role
        missing an original index; gate, up and down keeping different sets; layers not numbered 0..L-1;
        a layer keeping no expert; an index not below the header's original count (or a header count above 65536);
        a type name ggml does not know (the first such line).
    """
    p = os.fspath(path) if path is not None else "<allocation>"
    text = _decode(bytes(data), p)
    lines = text.split("\n")
    is_s2 = np.fromiter(("_exps.weight[" in ln for ln in lines), dtype=bool, count=len(lines))
    s2 = _S2_ALL.findall(text)
    s2_line = np.flatnonzero(is_s2) + 1
    if len(s2) != len(s2_line):
        # some line that looks like a per-expert entry is not one: find it
        for i in s2_line.tolist():
            if _S2.fullmatch(lines[i - 1]) is None:
                _garbage(p, i, lines[i - 1])
        raise StrataError(f"{p}: the per-expert entries could not be read consistently; check the line ends", p)
    header: list[str] = []
    header_no: list[int] = []
    tensor_types: dict[str, str] = {}
    tensor_lines: dict[str, int] = {}
    first_s2 = int(s2_line[0]) if len(s2_line) else len(lines) + 1
    s1_match = _S1.fullmatch
    blank_match = _BLANK_OR_COMMENT.fullmatch
    for i in np.flatnonzero(~is_s2).tolist():
        ln = lines[i]
        m = s1_match(ln)
        if m is not None:
            name, typ = m.groups()
            if not typ:
                raise StrataError(f"{p}: line {i + 1}: tensor {name} has no type (Section 1 lines are "
                                  f"'<tensor>: <TYPE>'; only per-expert lines may be empty)", p)
            if name in tensor_types:
                raise StrataError(f"{p}: line {i + 1}: tensor {name} is listed twice (first at line "
                                  f"{tensor_lines[name]})", p)
            tensor_types[name] = typ.upper()
            tensor_lines[name] = i + 1
            continue
        m = blank_match(ln)
        if m is not None:
            if m.group(1) is not None and not tensor_types and i + 1 < first_s2:
                header.append(m.group(1)[1:].strip())
                header_no.append(i + 1)
            continue
        _garbage(p, i + 1, ln)
    alloc = Allocation(path=p, header=header, tensor_types=tensor_types, tensor_lines=tensor_lines)
    if not tensor_types and not s2:
        raise StrataError(f"{p}: no allocation entries (the file is empty or holds only comments); expected "
                          f"'<tensor>: <TYPE>' and 'blk.L.ffn_<gate|up|down>_exps.weight[I]: <TYPE or nothing>' lines", p)
    for h, h_no in zip(header, header_no):
        m = _HDR_KEPT.search(h)
        if m and alloc.header_kept is None and re.search(r"expert|retain|kept|keep", h, re.I):
            alloc.header_kept, alloc.header_original = int(m.group(1)), int(m.group(2))
            alloc.header_count_line = h_no
        m = _HDR_LAYERS.search(h)
        if m and alloc.header_layers is None:
            alloc.header_layers = int(m.group(1))
    s1_lines = np.fromiter(tensor_lines.values(), dtype=np.int64, count=len(tensor_lines))
    if not s2 and alloc.header_kept is not None and alloc.header_original is not None \
            and alloc.header_kept < alloc.header_original:
        raise StrataError(f"{p}: line {alloc.header_count_line}: the header says {alloc.header_kept} of "
                          f"{alloc.header_original} experts are retained, but there is no Section 2 (per-expert) "
                          f"entry: the file is cut after Section 1; get the whole allocation again", p)
    if s2:
        _build_section2(alloc, s2, s2_line.astype(np.int64))
    # every entry in file order: group (-1 Section 1, else the layer) and index into its section
    all_lines = np.concatenate([s1_lines, alloc.line])
    order = np.argsort(all_lines, kind="stable")
    n1 = len(s1_lines)
    alloc.entry_index = np.concatenate([np.arange(n1), np.arange(len(alloc.line))])[order]
    alloc.entry_group = np.concatenate([np.full(n1, -1, np.int64), alloc.layer])[order].astype(np.int32)
    _check_types(alloc)
    return alloc


def _garbage(p: str, line_no: int, ln: str) -> None:
    shown = ln.strip()
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise StrataError(f"{p}: line {line_no}: not an allocation entry: {shown!r} (expected '<tensor>: <TYPE>', "
                      f"'blk.L.ffn_<gate|up|down>_exps.weight[I]: <TYPE or nothing>' or a '#' comment)", p)


def _build_section2(alloc: Allocation, s2: list, line: np.ndarray) -> None:
    p = alloc.path
    n = len(s2)
    cols = list(zip(*s2))
    # digits only (the regex), bounded widths: int conversion cannot fail
    layer = np.fromiter(map(int, cols[0]), dtype=np.int64, count=n)
    orig = np.fromiter(map(int, cols[2]), dtype=np.int64, count=n)
    role_of = {"gate": 0, "up": 1, "down": 2}
    role = np.fromiter(map(role_of.__getitem__, cols[1]), dtype=np.int64, count=n)
    type_ids: dict[str, int] = {"": 0}
    raw_code: dict[str, int] = {}
    for t in sorted(set(cols[3])):  # few distinct spellings; case-insensitive
        raw_code[t] = type_ids.setdefault(t.upper(), len(type_ids))
    code = np.fromiter(map(raw_code.__getitem__, cols[3]), dtype=np.int64, count=n)
    alloc.layer, alloc.role, alloc.orig, alloc.line = layer, role, orig, line
    alloc.type_code, alloc.type_names = code, list(type_ids)

    # layers 0..L-1, each present
    if layer.max() >= MAX_LAYERS:
        i = int(np.argmax(layer >= MAX_LAYERS))
        raise StrataError(f"{p}: line {line[i]}: layer {layer[i]} is implausible (at most {MAX_LAYERS} layers)", p)
    present = np.zeros(int(layer.max()) + 1, dtype=bool)
    present[layer] = True
    if not present.all():
        missing = int(np.argmin(present))
        raise StrataError(f"{p}: layer {missing} has no per-expert (Section 2) entries but layers up to "
                          f"{len(present) - 1} do; every layer 0..{len(present) - 1} must be listed", p)
    n_layers = len(present)
    n_orig_seen = int(orig.max()) + 1
    from_header = ""
    if alloc.header_original is not None and alloc.header_original >= 1:
        n_orig = alloc.header_original
        if n_orig > MAX_EXPERTS:
            raise StrataError(f"{p}: line {alloc.header_count_line}: the header states {n_orig} original experts per "
                              f"layer, more than {MAX_EXPERTS}; fix the header's 'K of N' count", p)
        if n_orig > n_orig_seen:
            from_header = f"; the header states {n_orig} original experts per layer (line {alloc.header_count_line})"
        if n_orig_seen > n_orig:
            i = int(np.argmax(orig >= n_orig))
            raise StrataError(f"{p}: line {line[i]}: original index {orig[i]} is not below the header's "
                              f"original expert count {n_orig}", p)
    else:
        n_orig = n_orig_seen
    if n_orig > MAX_EXPERTS:
        i = int(np.argmax(orig >= MAX_EXPERTS))
        raise StrataError(f"{p}: line {line[i]}: original index {orig[i]} is implausible (at most {MAX_EXPERTS} experts)", p)

    # duplicates: each (layer, role, original index) once
    key = (layer * 3 + role) * n_orig + orig
    order = np.argsort(key, kind="stable")
    ks = key[order]
    dup = np.nonzero(ks[1:] == ks[:-1])[0]
    if len(dup):
        # the duplicate that appears earliest in the file (its second listing)
        second = order[dup + 1]
        j = int(dup[np.argmin(second)])
        a, b = int(order[j]), int(order[j + 1])
        raise StrataError(f"{p}: line {line[b]}: blk.{layer[b]}.ffn_{ROLES[role[b]]}_exps.weight[{orig[b]}] is "
                          f"listed twice (first at line {line[a]}); each original index appears once per layer and role", p)
    # completeness: every (layer, role) lists 0..n_orig-1
    seen = np.zeros(n_layers * 3 * n_orig, dtype=bool)
    seen[key] = True
    if not seen.all():
        k = int(np.argmin(seen))
        lyr, rest = divmod(k, 3 * n_orig)
        r, o = divmod(rest, n_orig)
        grp = (layer == lyr) & (role == r)
        last = int(line[grp].max()) if grp.any() else 0
        where = f"line {last}: " if last else ""
        raise StrataError(f"{p}: {where}layer {lyr} {ROLES[r]}: original index {o} is missing (each layer and "
                          f"role lists every original index 0..{n_orig - 1}, kept or pruned{from_header})", p)
    kept = np.zeros((n_layers, 3, n_orig), dtype=bool)
    kept[layer, role, orig] = code > 0
    # gate, up and down keep the same set
    for r in (1, 2):
        diff = kept[:, 0, :] != kept[:, r, :]
        if diff.any():
            lyr, o = (int(x) for x in np.argwhere(diff)[0])
            sel = np.nonzero((layer == lyr) & (role == r) & (orig == o))[0]
            ln = int(line[sel[0]])
            state = "kept" if kept[lyr, 0, o] else "pruned"
            other = "pruned" if kept[lyr, 0, o] else "kept"
            raise StrataError(f"{p}: line {ln}: layer {lyr}: original expert {o} is {state} for gate but {other} "
                              f"for {ROLES[r]}; gate, up and down must keep the same experts "
                              f"({int(diff[lyr].sum())} such experts in this layer)", p)
    alloc.n_layers, alloc.n_original = n_layers, n_orig
    alloc.kept_mask = kept[:, 0, :].copy()
    empty = np.flatnonzero(~alloc.kept_mask.any(axis=1))
    if len(empty):
        lyr = int(empty[0])
        raise StrataError(f"{p}: line {int(line[layer == lyr].max())}: layer {lyr} keeps no expert (every entry of the "
                          f"layer is pruned; {len(empty)} such layers); a pruned model keeps at least one expert per "
                          f"layer (its router's ne1)", p)

    # listing order of the kept entries: ascending original index inside each (layer, role)?
    ko = np.nonzero(code > 0)[0]
    grp = layer[ko] * 3 + role[ko]
    o2 = np.lexsort((line[ko], grp))
    g_sorted, orig_sorted = grp[o2], orig[ko][o2]
    bad = (g_sorted[1:] == g_sorted[:-1]) & (orig_sorted[1:] <= orig_sorted[:-1])
    alloc.out_of_order_layers = sorted({int(x) // 3 for x in g_sorted[1:][bad]})
    if alloc.out_of_order_layers:
        alloc.warnings.append(
            f"kept entries of {len(alloc.out_of_order_layers)} layer(s) are not listed in ascending original index "
            f"(first: layer {alloc.out_of_order_layers[0]}); the survivor map still numbers survivors by ascending "
            f"original index, as the GGUF stores them; confirm it with `stratatools alloc verify`")
    # header consistency (free text: warnings only)
    n_kept = alloc.kept_mask.sum(axis=1)
    if alloc.header_layers is not None and alloc.header_layers != n_layers:
        alloc.warnings.append(f"header says {alloc.header_layers} layers, Section 2 lists {n_layers}")
    if alloc.header_kept is not None and not (n_kept == alloc.header_kept).all():
        alloc.warnings.append(f"header says {alloc.header_kept} experts kept per layer, Section 2 keeps "
                              f"{int(n_kept.min())}..{int(n_kept.max())}")
    if len(set(n_kept.tolist())) > 1:
        alloc.warnings.append(f"layers keep different numbers of experts ({int(n_kept.min())}..{int(n_kept.max())}); "
                              f"a STRP profile and Strata's packer need one count for every layer")


def _check_types(alloc: Allocation) -> None:
    # a type ggml does not know cannot be a tensor's type (formats.md section 6: TYPE is a ggml type name):
    # refused at its first line, as a typo or another file's content
    bad: list[tuple[int, str, str]] = [(line, name, t) for name, t in alloc.tensor_types.items()
                                       if t not in TYPES_BY_NAME for line in (alloc.tensor_lines[name],)]
    unknown_codes = [c for c, t in enumerate(alloc.type_names) if t and t not in TYPES_BY_NAME]
    if unknown_codes:
        hit = np.isin(alloc.type_code, unknown_codes)
        i = int(np.argmax(hit))
        g, r, o = int(alloc.layer[i]), int(alloc.role[i]), int(alloc.orig[i])
        bad.append((int(alloc.line[i]), f"blk.{g}.ffn_{ROLES[r]}_exps.weight[{o}]",
                    alloc.type_names[int(alloc.type_code[i])]))
    if bad:
        line, name, t = min(bad)
        raise StrataError(f"{alloc.path}: line {line}: {name}: unknown type {t!r} (not a ggml type name, e.g. "
                          f"Q4_K, Q8_0, BF16; an empty type marks a pruned expert); fix the type", alloc.path)
    if alloc.pruned:
        # one tensor has one type: the kept experts of a (layer, role) should agree with each other and with Section 1
        nt = len(alloc.type_names)
        kept = alloc.type_code > 0
        combos = np.unique((alloc.layer[kept] * 3 + alloc.role[kept]) * nt + alloc.type_code[kept])
        grp, code = combos // nt, combos % nt
        ug, n_types = np.unique(grp, return_counts=True)
        mixed = int((n_types > 1).sum())
        disagree: list[str] = []
        for g, c in zip(grp.tolist(), code.tolist()):
            name = f"blk.{g // 3}.ffn_{ROLES[g % 3]}_exps.weight"
            s1 = alloc.tensor_types.get(name)
            if s1 is not None and s1 != alloc.type_names[c] and (not disagree or disagree[-1] != name):
                disagree.append(name)
        if mixed:
            alloc.warnings.append(f"{mixed} (layer, role) groups keep experts of mixed types")
        if disagree:
            alloc.warnings.append(f"{len(disagree)} expert tensors have per-expert types that differ from their "
                                  f"Section 1 type (first: {disagree[0]})")


def read_allocation(path: str | os.PathLike) -> Allocation:
    """Read and validate an ``rco-allocation.txt``; see :func:`parse_allocation`. Records the file's sha256.

    A binary file (a NUL byte in the first 64 KiB) is refused before the rest is read.

    Raises:
        StrataError: missing file, a directory, and every :func:`parse_allocation` error.
    """
    import hashlib

    from stratatools.core.fsutil import check_input

    path = check_input(path, "allocation")
    try:
        with open(path, "rb") as fh:
            data = fh.read(1 << 16)
            if b"\x00" in data:
                # a binary file (a GGUF or profile given by mistake): refuse it from its first bytes, unread
                _decode(data[:data.index(b"\x00") + 1], os.fspath(path))
            data += fh.read()
    except FileNotFoundError:
        raise StrataError(f"{path}: no such file", path) from None
    except IsADirectoryError:
        raise StrataError(f"{path}: is a directory, expected an rco-allocation.txt", path) from None
    alloc = parse_allocation(data, path)
    alloc.sha256 = hashlib.sha256(data).hexdigest()
    return alloc


# -- checks against a model --------------------------------------------------------------------------------

@dataclass
class ModelCheck:
    """Result of :func:`check_against_model`.

    Attributes:
        model: the model's path.
        type_mismatches: (tensor, allocation type, GGUF type) for Section 1 tensors whose types differ.
        missing_in_model: Section 1 tensors the model does not have.
        missing_in_allocation: model tensors Section 1 does not list.
        router_counts: per layer, the router's ne1 (the model's expert count).
    """

    model: str
    type_mismatches: list[tuple[str, str, str]] = field(default_factory=list)
    missing_in_model: list[str] = field(default_factory=list)
    missing_in_allocation: list[str] = field(default_factory=list)
    router_counts: list[int | None] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.type_mismatches or self.missing_in_model or self.missing_in_allocation)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "ok": self.ok,
                "type_mismatches": [{"tensor": a, "allocation": b, "gguf": c} for a, b, c in self.type_mismatches],
                "missing_in_model": self.missing_in_model, "missing_in_allocation": self.missing_in_allocation,
                "router_counts": self.router_counts}


def check_against_model(alloc: Allocation, model_path: "str | os.PathLike | Model") -> ModelCheck:
    """Compare an allocation with the GGUF it describes (header and router shapes only; no weights are read).

    Section 1 types must equal the GGUF's tensor types (reported, a failed check); every Section 2 layer's
    kept count must equal that layer's router ``ne1`` (formats.md section 1: ``ne1`` is the layer's expert
    count), which is a StrataError: the allocation is not the map of this model.

    Raises:
        StrataError: model errors (see :func:`stratatools.model.gguf.open_model`); kept counts that disagree with
            the routers; Section 2 layers the model lacks; trunk layers with routers that Section 2 lacks (a
            file cut at a layer boundary).
    """
    from stratatools.model.geometry import read_geometry
    from stratatools.model.gguf import use_model

    with use_model(model_path) as m:
        model_path = m.path
        geo = read_geometry(m)
        res = ModelCheck(str(model_path), router_counts=geo.expert_counts)
        for name, typ in alloc.tensor_types.items():
            t = m.tensors.get(name)
            if t is None:
                res.missing_in_model.append(name)
            elif t.type.name != typ:
                res.type_mismatches.append((name, typ, t.type.name))
        if alloc.tensor_types:
            res.missing_in_allocation = [n for n in m.tensors if n not in alloc.tensor_types]
        if alloc.pruned:
            need = max((i + 1 for i, le in enumerate(geo.layers) if le is not None), default=0)
            if alloc.n_layers < need:
                raise StrataError(f"{alloc.path}: line {int(alloc.line.max())}: Section 2 lists {alloc.n_layers} layers "
                                  f"but {Path(model_path).name} has {need} trunk layers with routers; the file is "
                                  f"truncated or is the map of another model", alloc.path)
            all_layers = geo.layers + list(geo.mtp_layers)
            for lyr, n in enumerate(alloc.n_kept):
                le = all_layers[lyr] if lyr < len(all_layers) else None
                if le is None:
                    raise StrataError(f"{alloc.path}: layer {lyr} is listed but {model_path} has no router "
                                      f"blk.{lyr}.ffn_gate_inp.weight; the allocation is for another model", alloc.path)
                if le.n_expert != n:
                    ln = int(alloc.line[alloc.layer == lyr].min())
                    raise StrataError(f"{alloc.path}: line {ln}: layer {lyr} keeps {n} experts but the router of "
                                      f"{Path(model_path).name} has {le.n_expert} (ne1 of blk.{lyr}.ffn_gate_inp.weight); "
                                      f"this allocation is not the map of that model", alloc.path)
    return res


# -- diffs between two allocation files -------------------------------------------------------------------

@dataclass
class AllocationDiff:
    """How two allocation files differ.

    Attributes:
        entries_a, entries_b: entry counts.
        entries_changed: entries whose text differs at the same position (plus the length difference).
        groups_total / groups_changed: groups are Section 1 and each layer's Section 2 entries (1 + L).
        lines_changed_per_layer: per layer, Section 2 entries changed at the same position.
        section1_changed: Section 1 entries changed at the same position.
        dense_changed_per_layer: per layer, dense indices whose original expert differs (a - b maps).
        dropped_per_layer / added_per_layer: original experts kept by A only / by B only.
    """

    entries_a: int
    entries_b: int
    entries_changed: int
    groups_total: int
    groups_changed: int
    section1_changed: int
    lines_changed_per_layer: list[int]
    dense_changed_per_layer: list[int]
    dropped_per_layer: list[int]
    added_per_layer: list[int]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def dense_changes(a: SurvivorMap, b: SurvivorMap) -> list[int]:
    """Per layer, how many dense indices name a different original expert in ``b`` than in ``a``.

    An index that exists in one map only counts as changed. Raises StrataError for different layer counts.
    """
    if a.n_layers != b.n_layers:
        raise StrataError(f"the maps have {a.n_layers} and {b.n_layers} layers; they are not of one model")
    out = []
    for ka, kb in zip(a.kept, b.kept):
        n = min(len(ka), len(kb))
        out.append(int((ka[:n] != kb[:n]).sum()) + abs(len(ka) - len(kb)))
    return out


def _changed_at_position(a: Allocation, b: Allocation) -> np.ndarray:
    """bool [min(n_entries)]: entry i of ``a`` differs from entry i of ``b`` (name, index or type)."""
    n = min(a.n_entries, b.n_entries)
    ga, gb = a.entry_group[:n], b.entry_group[:n]
    ia, ib = a.entry_index[:n], b.entry_index[:n]
    s2a, s2b = ga >= 0, gb >= 0
    changed = s2a != s2b
    both2 = s2a & s2b
    xa, xb = ia[both2], ib[both2]
    # b's type codes in a's numbering (names a lacks get codes past a's)
    names_a = {t: i for i, t in enumerate(a.type_names)}
    remap = np.array([names_a.get(t, len(a.type_names) + j) for j, t in enumerate(b.type_names)], dtype=np.int64)
    diff2 = ((a.layer[xa] != b.layer[xb]) | (a.role[xa] != b.role[xb]) | (a.orig[xa] != b.orig[xb]) |
             (a.type_code[xa] != remap[b.type_code[xb]]))
    changed[np.flatnonzero(both2)] = diff2
    both1 = np.flatnonzero(~s2a & ~s2b)
    if len(both1):
        na, nb = list(a.tensor_types.items()), list(b.tensor_types.items())
        changed[both1] = [na[i] != nb[j] for i, j in zip(ia[both1].tolist(), ib[both1].tolist())]
    return changed


def diff_allocations(a: Allocation, b: Allocation) -> AllocationDiff:
    """Compare two allocation files position by position and as survivor maps (formats.md section 6).

    Raises:
        StrataError: either file lacks Section 2, or their layer counts differ.
    """
    ma, mb = a.survivor_map(), b.survivor_map()
    changed = _changed_at_position(a, b)
    n = len(changed)
    extra = abs(a.n_entries - b.n_entries)
    grp = a.entry_group[:n]
    per_layer = np.bincount(grp[changed & (grp >= 0)], minlength=a.n_layers)[:a.n_layers]
    s1 = int((changed & (grp < 0)).sum())
    dense = dense_changes(ma, mb)
    ka, kb = a.kept_mask, b.kept_mask
    if ka.shape != kb.shape:
        raise StrataError(f"{b.path}: {kb.shape[0]} layers x {kb.shape[1]} original experts, but {a.path} has "
                          f"{ka.shape[0]} x {ka.shape[1]}; they are not revisions of one model")
    groups_changed = int((per_layer > 0).sum()) + (1 if s1 else 0)
    return AllocationDiff(a.n_entries, b.n_entries, int(changed.sum()) + extra, a.n_layers + 1, groups_changed, s1,
                          [int(x) for x in per_layer], dense,
                          [int(x) for x in (ka & ~kb).sum(axis=1)], [int(x) for x in (kb & ~ka).sum(axis=1)])


# -- export -------------------------------------------------------------------------------------------------

EXPORT_FORMATS = ("csv", "parquet", "json")


def export_frame(alloc: Allocation, what: str = "map"):
    """A pandas DataFrame of the survivor map (``map``: layer, new_index, original_index, gate/up/down type)
    or of every Section 2 entry (``entries``: line, layer, role, original_index, type, kept).

    Raises:
        StrataError: unknown ``what``; ``map`` of an allocation without Section 2.
    """
    import pandas as pd

    if what == "map":
        sm = alloc.survivor_map()
        rows = sm.to_rows()
        tt = alloc.expert_types()
        lay = np.array([r[0] for r in rows], dtype=np.int64)
        orig = np.array([r[2] for r in rows], dtype=np.int64)
        df = pd.DataFrame({"layer": lay, "new_index": np.array([r[1] for r in rows], dtype=np.int64),
                           "original_index": orig})
        for r, role in enumerate(ROLES):
            df[f"{role}_type"] = tt[lay, r, orig].astype(str) if len(rows) else np.zeros(0, dtype=str)
        return df
    if what == "entries":
        names = np.array(alloc.type_names, dtype=object)
        return pd.DataFrame({"line": alloc.line, "layer": alloc.layer,
                             "role": np.array(ROLES, dtype=object)[alloc.role] if len(alloc.role) else np.zeros(0, object),
                             "original_index": alloc.orig, "type": names[alloc.type_code].astype(str),
                             "kept": alloc.type_code > 0})
    raise StrataError(f"unknown export table {what!r} (use map or entries)")


def export_allocation(alloc: Allocation, out: str | os.PathLike, fmt: str | None = None, what: str = "map") -> Path:
    """Write :func:`export_frame` to ``out`` as CSV, Parquet or JSON (format from ``fmt`` or the suffix),
    atomically and with deterministic bytes.

    Raises:
        StrataError: unknown format.
    """
    from stratatools.core.fsutil import AtomicFile, write_json_atomic

    out = Path(out)
    fmt = (fmt or out.suffix.lstrip(".")).lower()
    if fmt not in EXPORT_FORMATS:
        raise StrataError(f"{out}: unknown export format {fmt!r} (use --format csv, parquet or json, or a "
                          f".csv/.parquet/.json name)", out)
    df = export_frame(alloc, what)
    if fmt == "csv":
        with AtomicFile(out, "w") as fh:
            df.to_csv(fh, index=False, lineterminator="\n")
    elif fmt == "json":
        write_json_atomic(out, {"source": alloc.name, "sha256": alloc.sha256, "table": what,
                                "columns": list(df.columns),
                                "rows": [list(r) for r in df.itertuples(index=False, name=None)]})
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pandas(df, preserve_index=False)
        table = table.replace_schema_metadata({"stratatools.source": alloc.name,
                                               "stratatools.sha256": alloc.sha256 or "",
                                               "stratatools.table": what})
        with AtomicFile(out, "wb") as fh:
            pq.write_table(table, fh, write_page_checksum=True)  # a CRC in every page header
    return out


def format_allocation(kept: list[np.ndarray] | list[list[int]], n_original: int, *,
                      section1: dict[str, str] | None = None, expert_types: tuple[str, str, str] = ("Q2_0", "Q2_0", "Q2_0"),
                      title: str = "RCO allocation map", pruned_colon: str = ": ", order: str = "ascending",
                      seed: int = 0) -> str:
    """Write an ``rco-allocation.txt`` in ISTA's layout (formats.md section 6): ``#`` header stating kept,
    original and layer counts, Section 1 (``section1`` name -> type), Section 2 for every layer, role and
    original index (kept lines carry the role's type from ``expert_types``; pruned lines end in ``pruned_colon``).

    Args:
        kept: per layer, the kept original indices.
        order: ``ascending`` lists Section 2 by original index; ``shuffled`` permutes each (layer, role)
            group (a file whose line order is not the index order) with ``seed``.
    """
    L = len(kept)
    n_k = sorted({len(k) for k in kept})
    kept_txt = str(n_k[0]) if len(n_k) == 1 else f"{n_k[0]}-{n_k[-1]}"
    out = [f"# {title}", f"# Experts: {kept_txt} of {n_original} retained per layer, {L} layers",
           "# Section 1: per-tensor types", ""]
    for name, typ in (section1 or {}).items():
        out.append(f"{name}: {typ}")
    out += ["", "# Section 2: per-expert allocation (original expert index; empty type = pruned)", ""]
    rng = np.random.default_rng(seed)
    for layer, k in enumerate(kept):
        mask = np.zeros(n_original, dtype=bool)
        mask[np.asarray(k, dtype=np.int64)] = True
        for r, role in enumerate(ROLES):
            idx = np.arange(n_original)
            if order == "shuffled":
                idx = rng.permutation(n_original)
            typ = expert_types[r]
            pre = f"blk.{layer}.ffn_{role}_exps.weight["
            out.extend(f"{pre}{i}]: {typ}" if mask[i] else f"{pre}{i}]{pruned_colon}" for i in idx.tolist())
    return "\n".join(out) + "\n"


__all__ = ["format_allocation", "ROLES", "SurvivorMap", "Allocation", "parse_allocation", "read_allocation", "ModelCheck",
           "check_against_model", "AllocationDiff", "diff_allocations", "dense_changes", "export_frame",
           "export_allocation", "EXPORT_FORMATS"]
