"""Checks of what a routing trace means, shared by every reader (issue 14): a table whose bytes parse but whose
values cannot be routing (a NaN weight, phase 7, a negative rank, an expert id twice in one record) is refused.

Source of the rules: formats.md section 3 (phases 0 prefill, 1 decode, 2 unknown; ranks 0..k-1 of one record's
top-k; router weights finite). A record is one token's top-k at one layer: the router picks k *different*
experts, so an id repeated inside one record cannot come from a router (a corrupt file, or a generator that drew
ids with replacement; the simulator would count such an entry as a hit on an expert loaded a moment before).

The repeated-id search (:func:`first_repeat`, :func:`first_repeat_rows`): records of one k up to 16 (every
trace in practice) are compared in numpy, k*(k-1)/2 vector compares, without loading numba; other shapes use the
compiled loop of :mod:`stratatools.traces.repeats` (about k*(k-1)/2 compares per record, a sort for k > 32; a
numpy sort without numba). The streaming readers check chunk by chunk (:class:`ChunkChecker`).
"""

from __future__ import annotations

import os

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.traces.table import TraceTable

REPEAT_FIX = ("a record's top-k expert ids are distinct: the file is corrupt, or its generator drew ids with "
              "replacement; draw them without replacement")
MAX_RECORD = 1024  # entries of one record at most (the formats' largest k, MAX_ROUTE_K in formats.strata_spec)
_PAIRWISE_NP = 16  # records of one k up to this are compared in numpy, column against column


def check_semantics(table: TraceTable, path: str | os.PathLike, *, distinct: bool = True) -> None:
    """Refuse a trace with a non-finite weight, an unknown phase, a rank outside 0..1023 or an expert id twice in
    one record (records as :func:`stratatools.traces.table.record_bounds` delimits them). Works on the compact
    per-record form when the reader gave one (no per-entry columns are built; the Strata readers check ids and
    weights themselves). ``distinct=False`` skips the repeated-id check (the text readers make it themselves, to
    name a line). Raises StrataError naming the file, the first bad row (entry index) and the fix."""
    n = len(table)
    if n == 0:
        return
    r = table.records
    if r is not None:  # the Strata reader: weights, ranks (0..k-1 by construction) and distinct ids checked there
        _check_phase(np.asarray(r.phase), path, "record")
        return
    _check_phase(np.asarray(table.phase), path, "row")
    _check_entries(np.asarray(table.weight), np.asarray(table.rank), path)
    if distinct:
        from stratatools.traces.table import record_bounds

        starts = record_bounds(table)
        check_record_lengths(starts, n, path)
        i = first_repeat(np.asarray(table.expert), starts)
        if i >= 0:
            raise repeat_error(path, "row", i, table)


def repeat_error(path, what: str, i: int, table=None, cols: dict | None = None, base: int = 0,
                 where: int | None = None) -> StrataError:
    """The one-line error for entry ``i`` whose expert id repeats an earlier id of its record: ``{path}: {what}
    {N}: expert id .. appears twice in one record (request, position, layer, rank) (fix)``, N being ``where``
    when given (a line number), else ``base + i``. Columns come from ``table`` or the chunk dict ``cols``."""
    get = (lambda c: np.asarray(getattr(table, c))) if table is not None else (lambda c: np.asarray(cols[c]))
    lay, e = int(get("layer")[i]), int(get("expert")[i])
    req, pos, rank = int(get("request")[i]), int(get("position")[i]), int(get("rank")[i])
    at = base + i if where is None else where
    return StrataError(f"{path}: {what} {at}: expert id {e} appears twice in one record (request {req}, position "
                       f"{pos}, layer {lay}, rank {rank}) ({REPEAT_FIX})", path)


def check_record_lengths(starts: np.ndarray, n: int, path, what: str = "row", base: int = 0, place=None) -> None:
    """Refuse a record of more than MAX_RECORD (1024) entries: ranks that never restart at 0 inside one
    (request, position, layer) would make one unbounded record. The error names ``{what} {base + first entry}``,
    or ``{what} {place(first entry)}`` when ``place`` maps an entry to a line."""
    if len(starts) == 0:
        return
    lens = np.diff(np.r_[starts, n])
    if int(lens.max()) > MAX_RECORD:
        r = int(np.argmax(lens > MAX_RECORD))
        at = base + int(starts[r]) if place is None else int(place(int(starts[r])))
        raise StrataError(f"{path}: {what} {at}: a record of {int(lens[r])} entries (more than "
                          f"{MAX_RECORD}; each token's top-k at one layer is one record, ranks 0..k-1)", path)


def first_repeat(expert: np.ndarray, starts: np.ndarray) -> int:
    """Index of the first entry whose expert id equals an earlier id of its record, or -1.

    Args:
        expert: int [N], entries in record order.
        starts: int64 [R], first entry of every record, ascending, ``starts[0] == 0`` (record r ends where r+1
            starts; the last one at N).
    "First" is the smallest index i such that ``expert[i] == expert[j]`` for some earlier j of the same record.
    Records of one k up to 16 are compared column against column in numpy (k*(k-1)/2 vector compares; no
    compiler loaded); other shapes use the compiled loop of :mod:`stratatools.traces.repeats`.
    """
    n = len(expert)
    R = len(starts)
    if n < 2 or R == n:
        return -1
    if n % R == 0:
        k = n // R
        if k <= _PAIRWISE_NP and int(starts[-1]) == (R - 1) * k and (R < 2 or bool((np.diff(starts) == k).all())):
            rc = _first_repeat_rows_np(np.asarray(expert).reshape(R, k))
            return -1 if rc is None else rc[0] * k + rc[1]
    from stratatools.traces import repeats

    return repeats.first_repeat(expert, np.ascontiguousarray(starts, np.int64))


def first_repeat_rows(ids: np.ndarray) -> tuple[int, int] | None:
    """For records of one k as rows of ``ids`` (int [R, k], any strides, e.g. a view into a mapped file): the
    (row, rank) of the first id equal to an earlier id of its row, or None (same order as :func:`first_repeat`).
    """
    R, k = ids.shape
    if R == 0 or k < 2:
        return None
    if k <= _PAIRWISE_NP:
        return _first_repeat_rows_np(ids)
    from stratatools.traces import repeats

    return repeats.first_repeat_rows(ids)


def _first_repeat_rows_np(ids: np.ndarray) -> tuple[int, int] | None:
    """:func:`first_repeat_rows` in numpy for small k: for each rank c, the rows whose id c equals an earlier id of
    the row; the answer is the smallest (row, rank) over all c."""
    R, k = ids.shape
    best = None
    for c in range(1, k):
        col = ids[:, c]
        hit = col == ids[:, 0]
        for j in range(1, c):
            hit |= col == ids[:, j]
        if hit.any():
            r = int(np.argmax(hit))
            if best is None or (r, c) < best:
                best = (r, c)
    return best


class ChunkChecker:
    """The semantic checks of :func:`check_semantics` over a stream of chunks (dicts of per-entry columns as the
    chunk sources yield them): phases, finite weights, ranks, and distinct ids per record, where a record may
    span two chunks (its first part is carried). Memory: one record. Raises StrataError naming the file and the
    row counted from the start of the stream."""

    KEY = ("request", "position", "layer", "phase")

    def __init__(self, path) -> None:
        self.path = path
        self.row = 0
        self.tail: dict | None = None  # the open record's entries from the previous chunk

    def __call__(self, c: dict) -> None:
        m = len(c["layer"])
        if m == 0:
            return
        path, row = self.path, self.row
        ph = np.asarray(c["phase"])
        bad = (ph < 0) | (ph > 2)
        if bad.any():
            i = int(np.argmax(bad))
            raise StrataError(f"{path}: row {row + i}: phase {int(ph[i])} is not 0 (prefill), 1 (decode) or 2 "
                              f"(unknown)", path)
        _check_entries(np.asarray(c["weight"]), np.asarray(c["rank"]), path, base=row)
        ex, rank = np.asarray(c["expert"]), np.asarray(c["rank"])
        keys = [np.asarray(c[k]) for k in self.KEY]
        new = np.array(rank == 0, dtype=bool, copy=True)
        for a in keys:
            if a.strides != (0,):
                new[1:] |= a[1:] != a[:-1]
        t = self.tail
        new[0] = t is None or bool(new[0]) or any(int(a[0]) != int(t[k][-1]) for k, a in zip(self.KEY, keys))
        starts = np.flatnonzero(new)
        first = int(starts[0]) if len(starts) else m  # entries [0, first) continue the previous chunk's record
        if first:  # the record spanning the boundary: the carried part + this chunk's part (<= MAX_RECORD + m)
            span = {k: np.concatenate([t[k], np.asarray(c[k])[:first]]) for k in t}
            off = len(t["expert"])
            check_record_lengths(np.zeros(1, np.int64), len(span["expert"]), path, base=row - off)
            i = first_repeat(span["expert"], np.zeros(1, np.int64))
            if i >= 0:
                raise repeat_error(path, "row", i, cols=span, base=row - off)
        if len(starts):
            check_record_lengths(starts - first, m - first, path, base=row + first)
            i = first_repeat(ex[first:], starts - first)
            if i >= 0:
                raise repeat_error(path, "row", first + i, cols=c, base=row)
            last = int(starts[-1])
            self.tail = {k: np.array(np.asarray(c[k])[last:]) for k in ("expert", "rank") + self.KEY}
        else:  # the whole chunk continues the carried record (at most MAX_RECORD entries, checked above)
            self.tail = span
        self.row += m


def _check_phase(ph: np.ndarray, path, what: str) -> None:
    if ph.strides == (0,) and len(ph):
        ph = ph[:1]
    bad = (ph < 0) | (ph > 2)
    if bad.any():
        i = int(np.argmax(bad))
        raise StrataError(f"{path}: {what} {i}: phase {int(ph[i])} is not 0 (prefill), 1 (decode) or 2 (unknown)",
                          path)


def _check_entries(weight: np.ndarray, rank: np.ndarray | None, path, base: int = 0) -> None:
    fin = np.isfinite(weight)
    if not fin.all():
        i = int(np.argmin(fin))
        raise StrataError(f"{path}: row {base + i}: non-finite router weight {float(weight[i])}", path)
    if rank is not None:
        bad = (rank < 0) | (rank > 1023)
        if bad.any():
            i = int(np.argmax(bad))
            raise StrataError(f"{path}: row {base + i}: rank {int(rank[i])} is outside 0..1023", path)
