"""Routing traces: one columnar table for every trace format (formats.md section 3).

One row per routed entry: (request, position, phase, layer, rank, expert, weight). Rows of one
(request, position, layer) record are consecutive, in rank order; records are in the order the source gave.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
import mmap
from typing import Any

import numpy as np

PREFILL, DECODE, UNKNOWN = 0, 1, 2
PHASE_NAMES = {PREFILL: "prefill", DECODE: "decode", UNKNOWN: "unknown"}

COLUMNS = {
    "request": np.int32,   # request / prompt id (0 when the source has none)
    "position": np.int32,  # token position within the request (Strata binary: ordinal within layer+request)
    "phase": np.int8,      # PREFILL, DECODE or UNKNOWN
    "layer": np.int16,     # trunk layer
    "rank": np.int16,      # rank within the record's top-k (0 = first listed)
    "expert": np.int32,    # expert id as the engine saw it (dense index for a pruned model)
    "weight": np.float32,  # router weight (1.0 when the source has none or writes zeros)
}


@dataclass
class Records:
    """A routing trace kept per record (one record = one token's top-k at one layer), as the Strata reader
    produces it: per-entry columns are derived from it only when asked for (:class:`TraceTable`).

    Attributes (R records, N entries):
        layer: int16 [R]. request: int32 [R]; phase: int8 [R] (either may be a read-only broadcast view).
        k: the entries per record: an int when constant, else int32 [R].
        expert, weight: int32 / float32, [R, k] when k is constant (possibly read-only strided views into the
            memory-mapped trace file), else [N] in record order.
        unit_rows: int64 indices of records whose weights are all zero in the source (read as 1.0), or None.
        mapped: expert/weight are views into a memory-mapped file; building the first per-entry column copies
            them out first (:meth:`own`), so the mapping is released.
        position: int32 [R], or a callable returning it (computed on first use, then cached).
        window: int32 [R] verify-window id of every record (-1: outside every window), or None when the trace
            delimits no windows (see :attr:`TraceTable.window`).
    """

    layer: np.ndarray
    k: Any
    request: np.ndarray
    phase: np.ndarray
    expert: np.ndarray
    weight: np.ndarray
    position: Any
    unit_rows: np.ndarray | None = None
    mapped: bool = False  # expert/weight are views into a memory-mapped file
    mapping: Any = None   # that mmap.mmap (for releasing copied pages early)
    window: np.ndarray | None = None  # int32 [R] verify-window id per record, -1 outside; None: no windows

    def __len__(self) -> int:
        return int(len(self.layer))

    @property
    def constant_k(self) -> bool:
        """True when every record has the same number of entries (``k`` is an int, not an int array [R])."""
        return isinstance(self.k, (int, np.integer))

    @property
    def n_entries(self) -> int:
        """Number of (token, layer, rank) entries N: R*k, or the sum of the per-record k."""
        return int(len(self.layer) * int(self.k)) if self.constant_k else int(len(self.expert))

    def ks(self) -> np.ndarray:
        """Entries per record, int64 [R]."""
        if self.constant_k:
            return np.full(len(self.layer), int(self.k), np.int64)
        return np.asarray(self.k, np.int64)

    def starts(self) -> np.ndarray:
        """First entry row of every record, int64 [R]."""
        if self.constant_k:
            return np.arange(len(self.layer), dtype=np.int64) * int(self.k)
        return np.r_[0, np.cumsum(np.asarray(self.k, np.int64))[:-1]].astype(np.int64) if len(self.layer) else \
            np.zeros(0, np.int64)

    def rec_position(self) -> np.ndarray:
        """Token position of every record, int32 [R] (computed on first use when it was given lazily)."""
        if callable(self.position):
            self.position = np.asarray(self.position(), np.int32)
        return self.position

    def per_entry(self, a: np.ndarray, dtype) -> np.ndarray:
        """A per-record array [R] repeated k times per record -> [N] (a broadcast view when constant)."""
        n = self.n_entries
        if len(a) == 0 or (a.strides == (0,)) or bool((a == a[0]).all()):
            return np.broadcast_to(np.asarray(a[0] if len(a) else 0, dtype=dtype), (n,))
        if self.constant_k:
            k = int(self.k)
            return np.broadcast_to(a.astype(dtype, copy=False)[:, None], (len(a), k)).reshape(-1)
        return np.repeat(a.astype(dtype, copy=False), self.k)

    def own(self) -> None:
        """Copy ids and weights out of the mapped file (unit weights applied), so the mapping is released once
        nothing else refers to it. Done before the first column is built: a consumer of per-entry columns
        then holds the copies instead of copies plus the mapped pages (peak < 2x the file)."""
        R = len(self.layer)
        e = np.empty(self.expert.shape, np.int32)
        w = np.empty(self.weight.shape, np.float32)
        mm = self.mapping
        row_bytes = self.expert.strides[0] if self.expert.ndim == 2 else 0
        step = 1 << 20
        for a in range(0, R, step):  # chunks, dropping the copied pages from this process as it goes
            b = min(R, a + step)
            e[a:b] = self.expert[a:b]
            w[a:b] = self.weight[a:b]
            if mm is not None and row_bytes and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                lo = a * row_bytes // mmap.PAGESIZE * mmap.PAGESIZE
                if b * row_bytes > lo:
                    mm.madvise(mmap.MADV_DONTNEED, lo, b * row_bytes - lo)  # file pages stay in the page cache
        self.expert = e
        if self.unit_rows is not None and len(self.unit_rows):
            w.reshape(R, -1)[self.unit_rows] = 1.0
        self.weight, self.unit_rows, self.mapping = w, None, None

    def column(self, name: str) -> np.ndarray:
        """Materialise one per-entry column (a new array, or a broadcast view for constant columns)."""
        with no_hugepages():
            if self.mapped:
                self.own()
                self.mapped = False
            return self._column(name)

    def _column(self, name: str) -> np.ndarray:
        R = len(self.layer)
        if name == "layer":
            return self.per_entry(self.layer, np.int16)
        if name in ("request", "phase"):
            return self.per_entry(getattr(self, name), COLUMNS[name])
        if name == "position":
            return self.per_entry(self.rec_position(), np.int32)
        if name == "window":
            return self.per_entry(np.asarray(self.window), np.int32)
        if name == "rank":
            if self.constant_k:
                return np.tile(np.arange(int(self.k), dtype=np.int16), R)
            ks = np.asarray(self.k, np.int64)
            n = self.n_entries
            rank = np.ones(n, np.int16)
            if n:
                rank[0] = 0
                rank[np.cumsum(ks)[:-1]] = (1 - ks[:-1]).astype(np.int16)
                np.cumsum(rank, dtype=np.int16, out=rank)
            return rank
        if name == "expert":
            return np.ascontiguousarray(self.expert, dtype=np.int32).reshape(-1)
        if name == "weight":
            w = np.ascontiguousarray(self.weight, dtype=np.float32)
            if self.unit_rows is not None and len(self.unit_rows):
                if np.may_share_memory(w, self.weight):
                    w = w.copy()
                w.reshape(R, -1)[self.unit_rows] = 1.0
            return w.reshape(-1)
        raise KeyError(name)


class TraceTable:
    """A routing trace as columns of equal length N.

    ``TraceTable(request, position, phase, layer, rank, expert, weight, meta)`` builds one from per-entry
    columns. Readers may instead give the compact per-record form (``TraceTable.from_records``; the Strata
    reader does): each column is then derived on first attribute access and cached, so every consumer sees the
    same columns either way, while consumers that know the compact form (:func:`stratatools.profiles.ranking.count_pairs`,
    :func:`trace_stats`, the Strata writer) use ``table.records`` directly without building the columns.

    Columns that are constant over the whole trace (e.g. ``request`` and ``phase`` of a plain Strata trace) may
    be zero-memory read-only broadcast views (``np.broadcast_to``), and the columns derived from the compact form
    are read-only: copy a column before writing into it. A table read from a plain Strata trace maps the file
    (read-only): replacing the file (rename) is safe, truncating it in place while the table is alive is not.

    Verify windows (not one of COLUMNS): ``window`` is an int32 [N] array giving every entry the verify window
    it belongs to (ids are only compared for equality; -1 = outside every window), or None when the trace delimits
    no windows (plain traces, CSV/Parquet without a window column, tagged traces without commit records). The
    tagged Strata reader derives it from commit records (see :mod:`stratatools.traces.formats.strata`); the
    replay makes one round per window where it is set (:func:`stratatools.cachesim.replay.prepare_entries`).
    ``TraceTable(..., window=w)`` gives it to a column-built table; ``take``/``concat`` keep it.

    Attributes:
        request, position, phase, layer, rank, expert, weight: numpy arrays [N] with the dtypes of COLUMNS.
        window: int32 [N] or None (above); ``has_windows`` tells without building it.
        records: the compact per-record form (:class:`Records`) when the reader gave one, else None.
        meta: source format (``source_format``), ``source_sha256``, ``n_layers``/``n_expert`` when known,
            counts of skipped records, anything a reader wants to keep.
    """

    __slots__ = ("_cols", "records", "meta", "_n", "_window")

    def __init__(self, request, position, phase, layer, rank, expert, weight, meta: dict[str, Any] | None = None,
                 window=None):
        n = len(expert)
        cols = {}
        for name, a in zip(COLUMNS, (request, position, phase, layer, rank, expert, weight)):
            dt = COLUMNS[name]
            a = np.asarray(a)
            if a.dtype != dt:
                a = a.astype(dt)
            if a.shape != (n,):
                raise ValueError(f"column {name} has shape {a.shape}, expected ({n},)")
            cols[name] = a
        self._cols = cols
        self.records = None
        self._n = n
        self.meta = dict(meta) if meta is not None else {}
        self._window = None
        self.window = window

    @classmethod
    def from_records(cls, records: Records, meta: dict[str, Any] | None = None) -> "TraceTable":
        """A table over the compact per-record form; columns are derived lazily (see the class docstring)."""
        t = cls.__new__(cls)
        t._cols = {}
        t.records = records
        t._n = records.n_entries
        t.meta = dict(meta) if meta is not None else {}
        t._window = None
        return t

    def _get(self, name: str) -> np.ndarray:
        a = self._cols.get(name)
        if a is None:
            a = self.records.column(name)
            if a.flags.writeable:
                a.flags.writeable = False
            self._cols[name] = a
        return a

    def _set(self, name: str, value) -> None:
        a = np.asarray(value)
        if a.dtype != COLUMNS[name]:
            a = a.astype(COLUMNS[name])
        if a.shape != (self._n,):
            raise ValueError(f"column {name} has shape {a.shape}, expected ({self._n},)")
        if self.records is not None:  # the compact form no longer describes the table: keep columns only
            for k in COLUMNS:
                self._get(k)
            self._window = self.window
            self.records = None
        self._cols[name] = a

    @property
    def has_windows(self) -> bool:
        """True when the table carries verify windows (``window`` is not None); builds no column."""
        if self._window is not None:
            return True
        return self.records is not None and self.records.window is not None

    @property
    def window(self) -> np.ndarray | None:
        """Verify window of every entry, int32 [N] (-1 outside every window), or None (class docstring)."""
        if self._window is None and self.records is not None and self.records.window is not None:
            a = self.records.column("window")
            if a.flags.writeable:
                a.flags.writeable = False
            self._window = a
        return self._window

    @window.setter
    def window(self, value) -> None:
        if value is None:
            self._window = None
            if self.records is not None:
                self.records.window = None
            return
        a = np.asarray(value)
        if a.dtype != np.int32:
            a = a.astype(np.int32)
        if a.shape != (self._n,):
            raise ValueError(f"column window has shape {a.shape}, expected ({self._n},)")
        if self.records is not None:  # per-entry windows need not follow records: keep columns only
            for k in COLUMNS:
                self._get(k)
            self.records = None
        self._window = a

    request = property(lambda self: self._get("request"), lambda self, v: self._set("request", v))
    position = property(lambda self: self._get("position"), lambda self, v: self._set("position", v))
    phase = property(lambda self: self._get("phase"), lambda self, v: self._set("phase", v))
    layer = property(lambda self: self._get("layer"), lambda self, v: self._set("layer", v))
    rank = property(lambda self: self._get("rank"), lambda self, v: self._set("rank", v))
    expert = property(lambda self: self._get("expert"), lambda self, v: self._set("expert", v))
    weight = property(lambda self: self._get("weight"), lambda self, v: self._set("weight", v))

    def __len__(self) -> int:
        return int(self._n)

    def __repr__(self) -> str:
        form = "records" if self.records is not None else "columns"
        return f"TraceTable({self._n} entries, {form}, source_format={self.meta.get('source_format')!r})"

    @classmethod
    def empty(cls, **meta: Any) -> "TraceTable":
        """A table with no entries (every column length 0) and the given metadata."""
        return cls(**{k: np.zeros(0, dt) for k, dt in COLUMNS.items()}, meta=dict(meta))

    def columns(self) -> dict[str, np.ndarray]:
        """The columns by name (trace.COLUMNS order), each [N]."""
        return {k: getattr(self, k) for k in COLUMNS}

    def take(self, mask_or_index: np.ndarray) -> "TraceTable":
        """Rows selected by a boolean mask or an index array; meta and windows are kept."""
        w = self.window
        return TraceTable(**{k: v[mask_or_index] for k, v in self.columns().items()}, meta=dict(self.meta),
                          window=None if w is None else w[mask_or_index])

    @classmethod
    def concat(cls, tables: list["TraceTable"]) -> "TraceTable":
        """Tables one after another; meta of the first. Windows are kept when any table has them: each table's
        window ids are shifted past the previous tables' so windows of different tables never merge, and a
        table without windows gets -1 (rounds by position)."""
        if not tables:
            return cls.empty()
        cols = {k: np.concatenate([getattr(t, k) for t in tables]) for k in COLUMNS}
        window = None
        if any(t.has_windows for t in tables):
            parts, base = [], 0
            for t in tables:
                w = t.window
                if w is None:
                    parts.append(np.full(len(t), -1, np.int32))
                    continue
                w = w.astype(np.int64)
                parts.append(np.where(w >= 0, w + base, -1))
                if len(w):
                    base += max(int(w.max()) + 1, 0)
            window = np.concatenate(parts).astype(np.int32)
        return cls(**cols, meta=dict(tables[0].meta), window=window)


@contextmanager
def no_hugepages():
    """Turn off numpy's transparent-huge-page advice for arrays allocated inside the block, then restore it.

    numpy madvises every large array for huge pages; first-touching gigabytes of them on a busy machine costs
    far more kernel time in page compaction than the parsing itself (1e8 entries: 3.9 s vs 1.2 s system time
    measured here), so the trace reader and counter allocate without it.
    """
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:  # numpy < 2
        try:
            from numpy.core.multiarray import _set_madvise_hugepage  # type: ignore[no-redef]
        except ImportError:
            yield
            return
    prev = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(prev)


def record_bounds(table: TraceTable) -> np.ndarray:
    """Start row of every record (rank 0, or a change of request/position/layer/phase). int64 [n_records]."""
    n = len(table)
    if n == 0:
        return np.zeros(0, np.int64)
    if table.records is not None:  # the reader's records, without building the columns
        return table.records.starts()
    new = table.rank == 0
    new = np.array(new, dtype=bool, copy=True)
    new[0] = True
    for col in ("request", "position", "layer", "phase"):
        a = getattr(table, col)
        if a.strides == (0,):
            continue
        new[1:] |= a[1:] != a[:-1]
    return np.flatnonzero(new)


@dataclass
class LayerStats:
    """Routing statistics of one layer.

    Attributes:
        layer: layer index.
        entries: routed entries of the layer.
        distinct_experts: experts routed at least once.
        concentration: share of the layer's entries taken by its top 10% experts (ceil(0.1 * E) experts, E the
            model's expert count when known, else the largest id + 1).
        entropy_bits: Shannon entropy of the layer's expert distribution, bits (log2 E for uniform routing).
        window_distinct_min / window_distinct_mean: distinct experts the layer used per window of
            :attr:`TraceStats.window` consecutive steps of one request (see :func:`locality_stats`); None when
            the trace has no such window.
        reuse_p50 / reuse_p90: quantiles of the reuse distance (steps since the same request last routed the
            same expert at this layer; first uses left out); None when no expert was reused.
        cold_share: share of the layer's entries that are a request's first use of that expert.
    """

    layer: int
    entries: int
    distinct_experts: int
    concentration: float
    entropy_bits: float
    window_distinct_min: int | None = None
    window_distinct_mean: float | None = None
    reuse_p50: float | None = None
    reuse_p90: float | None = None
    cold_share: float | None = None


@dataclass
class TraceStats:
    """What ``stratatools trace stats`` reports.

    Attributes:
        entries: routed entries; records: (token, layer) records; tokens: distinct (request, position) pairs.
        requests: distinct request ids. layers: distinct layers (count); layer_min/layer_max.
        k_min/k_max: entries per record (k). n_expert: the expert count used for concentration.
        phases: entries per phase name. concentration: share of all entries taken by the top 10% of the
        (layer, expert) pairs. per_layer: :class:`LayerStats` per layer, ascending.
        meta: the trace's metadata (source format, sha256, ...).
        windows: windows the trace delimits (0 when it carries none): verify windows and prefill batches
            (``stratatools run`` writes each prefill batch as a window); prefill_windows: those holding prefill
            records; outside_windows: records outside every window in a trace that has windows. rounds: what a replay round is for this trace
            (:func:`rounds_kind`): ``positions``, ``windows`` or ``windows+positions``.
        window: steps per locality window (distinct experts per window, collapse verdict); locality_phase: the
            entries those statistics use (``decode`` when the trace has decode entries, else ``all``).
        reuse_quantiles: reuse distance p50/p90/p99 over all layers (steps); collapsed_layers: layers that used
            at most k distinct experts in some full window (every step picked the same experts); verdict: one
            line saying whether routing has collapsed.
    """

    entries: int
    records: int
    tokens: int
    requests: int
    layers: int
    layer_min: int | None
    layer_max: int | None
    k_min: int
    k_max: int
    n_expert: int
    phases: dict[str, int]
    concentration: float
    mean_entropy_bits: float
    per_layer: list[LayerStats]
    meta: dict[str, Any]
    windows: int = 0
    outside_windows: int = 0
    rounds: str = "positions"
    prefill_windows: int = 0
    window: int = 64
    locality_phase: str = "decode"
    reuse_quantiles: dict[str, float] = field(default_factory=dict)
    collapsed_layers: list[int] = field(default_factory=list)
    verdict: str = ""

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["meta"] = {k: v for k, v in self.meta.items() if k != "request_names"}
        return d


ROUNDS = """\
A round is one forward batch of one request: a decode step (one position), a verify window (the positions
verified together) or a prefill batch (the prompt's positions run together; one round per chunk when the
prefill is chunked). Its routed entries reach the tier in the order the batch computes them (layer-major: every
position of layer 0, then of layer 1, ...), and the tier's end-of-round work (the adaptive tier's moves every
adapt_every rounds, the LFU/LFRU decay clock) runs after it. In a trace a batch of more than one position is a
window (TraceTable.window; a tagged Strata trace closes it with a commit tag, as the engine does for its verify
and prompt windows), written layer-major; a position outside every window is a round of its own."""


def rounds_kind(window_ids: np.ndarray | None) -> str:
    """What one replay round is, given per-record (or per-entry) window ids (None: the trace has no windows):
    ``positions`` (one position; no windows), ``windows`` (every record is in a window: a verify window or a
    prefill batch) or ``windows+positions`` (windows, and one round per position for the records outside them).
    The definition both the runtime's tier and the replay follow is :data:`ROUNDS`."""
    if window_ids is None:
        return "positions"
    w = np.asarray(window_ids)
    if len(w) == 0 or not (w >= 0).any():
        return "positions"
    return "windows" if bool((w >= 0).all()) else "windows+positions"


def _top_share(counts: np.ndarray, n_slots: int) -> float:
    tot = counts.sum()
    if tot <= 0:
        return 0.0
    top = max(1, int(np.ceil(0.1 * n_slots)))
    part = np.sort(counts)[::-1][:top]
    return float(part.sum() / tot)


_DENSE_CELLS = 1 << 22  # trace_stats counts on a dense (layer, expert) grid up to this size (or 8 x the entries)


def trace_stats(table: TraceTable, n_expert: int | None = None, window: int = 64) -> TraceStats:
    """Summarise a trace: tokens, layers, k, distinct experts, concentration (top 10%) and entropy per layer.

    Args:
        table: the trace.
        n_expert: experts per layer for the concentration denominator; default ``meta["n_expert"]`` or the
            largest expert id + 1.
        window: steps per locality window (:func:`locality_stats`; the collapse verdict).
    Returns:
        a :class:`TraceStats`. Memory: a few int64 temporaries of the table's length, plus the (layer, expert)
        count grid only when it is small (else the distinct pairs are counted sparsely: ids and layers come
        from the file and are not trusted to size an allocation).
    """
    n = len(table)
    if n_expert is None:
        n_expert = table.meta.get("n_expert")
    rec = table.records if (table.records is not None and table.records.constant_k) else None
    # compact form: layers per record, ids [R, k]; else the columns (both read in chunks of ~8M entries)
    lay_src, ids_src = (rec.layer, rec.expert) if rec is not None else (table.layer, table.expert)
    emax = int(ids_src.max()) if n else -1
    E = int(n_expert) if n_expert else emax + 1
    E = max(E, emax + 1)
    lmin = int(lay_src.min()) if n else None
    lmax = int(lay_src.max()) if n else None
    nl = (lmax - lmin + 1) if n else 0
    # dense counts when the (layer, expert) grid is small next to the trace; else only the pairs that occur
    # (an id of 2^31-1 in a 16-byte file must not allocate a 16 GiB grid: ids and layers come from the file)
    dense = nl * E <= max(_DENSE_CELLS, 8 * n)
    counts = np.zeros(nl * E if dense else 0, np.int64)
    keys: list[np.ndarray] = []
    step = (1 << 23) // (int(rec.k) if rec is not None else 1)
    for a in range(0, len(lay_src) if n else 0, step):  # chunked: int64 temporaries stay small
        b = min(len(lay_src), a + step)
        lay = lay_src[a:b].astype(np.int64) - lmin
        flat = lay[:, None] * E + ids_src[a:b] if rec is not None else lay * E + ids_src[a:b]
        if dense:
            counts += np.bincount(flat.reshape(-1), minlength=nl * E)
        else:
            u, c = np.unique(flat.reshape(-1), return_counts=True)
            keys.append(np.stack([u, c]))
    if dense:
        counts = counts.reshape(nl, E)
        layer_counts = [counts[i] for i in range(nl)]
        all_counts = counts.ravel()
    else:
        u = np.concatenate([k[0] for k in keys]) if keys else np.zeros(0, np.int64)
        w = np.concatenate([k[1] for k in keys]) if keys else np.zeros(0, np.int64)
        uk, inv = np.unique(u, return_inverse=True)
        all_counts = np.bincount(inv, weights=w).astype(np.int64) if len(uk) else np.zeros(0, np.int64)
        lay_of = uk // E
        layer_counts = [all_counts[lay_of == i] for i in range(nl)]
    per: list[LayerStats] = []
    for i in range(nl):
        c = layer_counts[i]
        tot = int(c.sum())
        if tot == 0:
            continue
        p = c[c > 0] / tot
        per.append(LayerStats(layer=i + (lmin or 0), entries=tot, distinct_experts=int((c > 0).sum()),
                              concentration=_top_share(c, E), entropy_bits=float(-(p * np.log2(p)).sum()) + 0.0))
    if table.records is not None:
        r = table.records
        starts = r.starts()
        ks = r.ks()
        req, pos, rph = np.asarray(r.request), r.rec_position(), np.asarray(r.phase)
        rec_phase = rph
        ph = np.bincount(rph.astype(np.int64).clip(0, 2), weights=ks, minlength=3).astype(np.int64) if n \
            else np.zeros(3, int)
    else:
        starts = record_bounds(table)
        ks = np.diff(np.r_[starts, n])
        req = np.asarray(table.request)[starts]
        pos = np.asarray(table.position)[starts]
        rec_phase = np.asarray(table.phase)[starts]
        ph = np.bincount(np.asarray(table.phase).astype(np.int64).clip(0, 2), minlength=3) if n else np.zeros(3, int)
    tokens = len(np.unique(req.astype(np.int64) * (1 << 32) + (pos.astype(np.int64) & 0xFFFFFFFF))) if n else 0
    phases = {PHASE_NAMES[i]: int(ph[i]) for i in range(3) if ph[i]}
    if table.records is not None:
        rwin = None if table.records.window is None else np.asarray(table.records.window)
    else:
        rwin = None if table.window is None else np.asarray(table.window)[starts]
    if rwin is not None and n:
        inw = rwin >= 0
        key = np.asarray(req, np.int64)[inw] * (1 << 32) + rwin[inw].astype(np.int64)  # (request, window)
        n_windows = int(len(np.unique(key)))
        outside = int((~inw).sum()) if n_windows else 0
        n_prefill_w = int(len(np.unique(key[np.asarray(rec_phase)[inw] == PREFILL])))
    else:
        n_windows = outside = n_prefill_w = 0
    kmax = int(ks.max()) if n else 0
    loc = locality_stats(table, window) if n else None
    collapsed: list[int] = []
    rq: dict[str, float] = {}
    lphase = "decode"
    if loc is not None:
        lphase = loc["phase"]
        rq = loc["reuse_quantiles"]
        for ls in per:
            d = loc["layers"].get(ls.layer)
            if d is None:
                continue
            ls.window_distinct_min, ls.window_distinct_mean = d["window_min"], d["window_mean"]
            ls.reuse_p50, ls.reuse_p90, ls.cold_share = d["reuse_p50"], d["reuse_p90"], d["cold_share"]
            if d["window_min"] is not None and d["window_min"] <= kmax and loc["window_steps"] >= 2:
                collapsed.append(ls.layer)
    verdict = _verdict(collapsed, per, window, kmax, loc)
    return TraceStats(entries=n, records=len(starts), tokens=tokens, requests=len(np.unique(req)) if n else 0,
                      layers=len(per), layer_min=lmin, layer_max=lmax, k_min=int(ks.min()) if n else 0,
                      k_max=int(ks.max()) if n else 0, n_expert=E, phases=phases,
                      concentration=_top_share(all_counts, nl * E) if n else 0.0,
                      mean_entropy_bits=float(np.mean([s.entropy_bits for s in per])) if per else 0.0,
                      per_layer=per, meta=dict(table.meta), windows=n_windows, outside_windows=outside,
                      prefill_windows=n_prefill_w, rounds=rounds_kind(rwin if n else None), window=window, locality_phase=lphase,
                      reuse_quantiles=rq, collapsed_layers=collapsed, verdict=verdict)


def _verdict(collapsed: list[int], per: list[LayerStats], window: int, k: int, loc: dict | None) -> str:
    if loc is None or not per:
        return "no routing to judge"
    w = loc["window_steps"]
    span = f"{w} {loc['phase']} steps" + ("" if w == window else f" (no request has {window})")
    if w < 2:
        return f"not judged: no request has 2 {loc['phase']} steps"
    if collapsed:
        first = collapsed[0]
        return (f"COLLAPSED: {len(collapsed)} of {len(per)} layers (first: layer {first}) used at most k={k} distinct "
                f"experts over {span}: every step routes the same experts")
    worst = min((ls for ls in per if ls.window_distinct_min is not None), key=lambda x: x.window_distinct_min)
    return (f"not collapsed: every layer used more than k={k} distinct experts per {span} "
            f"(fewest: {worst.window_distinct_min} at layer {worst.layer})")


def locality_stats(table: TraceTable, window: int = 64) -> dict[str, Any] | None:
    """Temporal locality of a trace, per layer: distinct experts per window of ``window`` steps and reuse distances.

    A step is one position of one request (decode entries only when the trace has any, else every entry); steps
    are numbered 0.. per request in position order, window w holds steps [w*window, (w+1)*window). Only full
    windows count, unless no request has one (then each request's steps form one partial window and
    ``full_windows`` is 0). The reuse distance of an entry is its step minus the step at which the same request
    last routed the same expert at the same layer (first uses are counted as cold, not as distances).

    Returns:
        ``{"phase", "window_steps", "layers": {layer: {"window_min", "window_mean", "full_windows", "reuse_p50", "reuse_p90",
        "cold_share"}}, "reuse_quantiles": {"p50", "p90", "p99"}}``, or None for an empty trace.
        Memory: several int64 arrays of the trace's length (the columns are built).
    Raises:
        ValueError: ``window`` < 1.
    """
    if window < 1:
        raise ValueError("window must be at least 1")
    if len(table) == 0:
        return None
    ph = np.asarray(table.phase)
    sel = ph == DECODE
    phase = "decode"
    if not sel.any():
        sel = np.ones(len(table), bool)
        phase = "all"
    req = np.asarray(table.request)[sel].astype(np.int64)
    pos = np.asarray(table.position)[sel].astype(np.int64)
    lay = np.asarray(table.layer)[sel].astype(np.int64)
    ex = np.asarray(table.expert)[sel].astype(np.int64)
    tok_key = req * (1 << 32) + (pos & 0xFFFFFFFF)
    utok, tok = np.unique(tok_key, return_inverse=True)  # ascending: grouped by request, positions in order
    ureq = utok >> 32
    first = np.r_[0, np.flatnonzero(np.diff(ureq)) + 1]
    start_of = np.repeat(first, np.diff(np.r_[first, len(utok)]))
    step_tok = np.arange(len(utok)) - start_of
    steps_per_req = np.diff(np.r_[first, len(utok)])
    full = bool((steps_per_req >= window).any())
    step = step_tok[tok]
    ntok_req = steps_per_req[np.searchsorted(first, np.arange(len(utok)), side="right") - 1][tok]
    win = step // window if full else np.zeros_like(step)
    if full:
        keep = (win + 1) * window <= ntok_req
    else:
        keep = np.ones(len(step), bool)
    # ids come from the file: re-index them densely instead of trusting their range (no packed keys that could
    # overflow, no allocation sized by an id)
    ulay, lay_i = np.unique(lay, return_inverse=True)
    _, ex_i = np.unique(ex, return_inverse=True)
    _, req_i = np.unique(req, return_inverse=True)
    layers: dict[int, dict[str, Any]] = {}
    # distinct experts per (request, window, layer): unique (group, expert) keys, then keys per group; the keys
    # pack dense indices in lexicographic order, as row-wise uniques would sort them (far cheaper); row-wise when
    # the packed key could overflow
    nw = int(win.max()) + 1 if len(win) else 1
    nr = int(req_i.max()) + 1 if len(req_i) else 1
    nl, ne = max(len(ulay), 1), int(ex_i.max()) + 1 if len(ex_i) else 1
    if nr * nw < 2 ** 62:
        tw = np.unique(req_i[keep] * nw + win[keep], return_inverse=True)[1].reshape(-1)
    else:
        tw = np.unique(np.stack([req_i[keep], win[keep]], axis=1), axis=0, return_inverse=True)[1].reshape(-1)
    ntw = int(tw.max()) + 1 if len(tw) else 1
    if ntw * nl * ne < 2 ** 62:
        u3 = np.unique((tw * nl + lay_i[keep]) * ne + ex_i[keep])
        grp, cnt = np.unique(u3 // ne, return_counts=True)
        glay = ulay[grp % nl] if len(grp) else np.zeros(0, np.int64)
    else:
        grp_rows = np.unique(np.stack([tw, lay_i[keep], ex_i[keep]], axis=1), axis=0)
        grp, cnt = np.unique(grp_rows[:, :2], axis=0, return_counts=True)
        glay = ulay[grp[:, 1]] if len(grp) else np.zeros(0, np.int64)
    # reuse distances: sort by (request, layer, expert, step)
    order = np.lexsort((step, ex_i, lay_i, req_i))
    same = np.zeros(len(order), bool)
    if len(order) > 1:
        same[1:] = ((req_i[order][1:] == req_i[order][:-1]) & (lay_i[order][1:] == lay_i[order][:-1])
                    & (ex_i[order][1:] == ex_i[order][:-1]))
    dist = np.diff(step[order], prepend=0)
    lay_o = lay[order]
    all_d = dist[same]
    for layer in ulay.tolist():
        c = cnt[glay == layer]
        m = lay_o == layer
        d = dist[m & same]
        layers[int(layer)] = {
            "window_min": int(c.min()) if len(c) else None,
            "window_mean": float(c.mean()) if len(c) else None,
            "full_windows": int(len(c)) if full else 0,
            "reuse_p50": float(np.percentile(d, 50)) if len(d) else None,
            "reuse_p90": float(np.percentile(d, 90)) if len(d) else None,
            "cold_share": float(1.0 - len(d) / max(1, int(m.sum()))),
        }
    rq = {f"p{q}": float(np.percentile(all_d, q)) for q in (50, 90, 99)} if len(all_d) else {}
    return {"phase": phase, "layers": layers, "reuse_quantiles": rq,
            "window_steps": window if full else int(steps_per_req.max())}


CHUNK_COLUMNS = ("request", "position", "phase", "layer", "rank", "expert")


def table_chunks(table: TraceTable, rows: int, columns=CHUNK_COLUMNS):
    """Walk a table in chunks of about ``rows`` entries, without building its full per-entry columns.

    Yields dicts ``{column: array [n]}`` for ``columns`` (names of COLUMNS, and ``window`` when the table has
    verify windows), int64 except ``phase`` (int8) and ``weight`` (float32). A table in the compact per-record
    form (:class:`Records`) is cut at record boundaries and only the chunk's entries are expanded (the trace file
    stays mapped, memory ~ ``rows``); a column-built table is cut every ``rows`` entries (records may span two
    chunks; consumers carry state across). Concatenating the chunks gives the table's columns.
    """
    rows = max(int(rows), 1)
    n = len(table)
    want = list(columns) + (["window"] if table.has_windows and "window" not in columns else [])
    rec = table.records
    if rec is None:
        cols = {c: (table.window if c == "window" else getattr(table, c)) for c in want}
        for a in range(0, n, rows):
            b = min(n, a + rows)
            yield {c: _chunk_dtype(c, v[a:b]) for c, v in cols.items()}
        return
    R = len(rec)
    if R == 0:
        return
    starts = rec.starts()
    ks = rec.ks() if not rec.constant_k else None
    kc = int(rec.k) if rec.constant_k else 0
    pos_all = rec.rec_position() if "position" in want else None
    ra = 0
    while ra < R:
        rb = int(np.searchsorted(starts, starts[ra] + rows, side="left"))
        rb = min(max(rb, ra + 1), R)
        kk = np.full(rb - ra, kc, np.int64) if rec.constant_k else ks[ra:rb]
        ea = int(starts[ra])
        eb = int(starts[rb]) if rb < R else rec.n_entries
        out = {}
        for c in want:
            if c in ("layer", "request", "phase", "position", "window"):
                src = {"layer": rec.layer, "request": rec.request, "phase": rec.phase, "position": pos_all,
                       "window": rec.window}[c]
                out[c] = _chunk_dtype(c, np.repeat(np.asarray(src[ra:rb]), kk))
            elif c == "rank":
                if rec.constant_k:
                    out[c] = np.tile(np.arange(kc, dtype=np.int64), rb - ra)
                else:
                    rank = np.ones(eb - ea, np.int64)
                    if eb > ea:
                        rank[0] = 0
                        rank[np.cumsum(kk)[:-1]] = 1 - kk[:-1]
                        np.cumsum(rank, out=rank)
                    out[c] = rank
            elif c in ("expert", "weight"):
                src = rec.expert if c == "expert" else rec.weight
                a = np.asarray(src[ra:rb]).reshape(-1) if rec.constant_k else np.asarray(src[ea:eb])
                if c == "weight" and rec.unit_rows is not None and len(rec.unit_rows):
                    a = a.astype(np.float32).reshape(rb - ra, -1) if rec.constant_k else a.astype(np.float32)
                    u = rec.unit_rows[(rec.unit_rows >= ra) & (rec.unit_rows < rb)] - ra
                    if rec.constant_k:
                        a[u] = 1.0
                        a = a.reshape(-1)
                    else:
                        for r in u.tolist():
                            s0 = int(starts[ra + r]) - ea
                            a[s0:s0 + int(kk[r])] = 1.0
                out[c] = _chunk_dtype(c, a)
        yield out
        ra = rb


def _chunk_dtype(name: str, a: np.ndarray) -> np.ndarray:
    if name == "phase":
        return np.asarray(a, np.int8)
    if name == "weight":
        return np.asarray(a, np.float32)
    return np.asarray(a, np.int64)



class Distinct:
    """Distinct int64 values seen so far (sorted runs compacted as they grow; memory ~ distinct values)."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.size = 0
        self.base = 0

    def add(self, v: np.ndarray) -> None:
        if len(v):
            u = np.unique(v)
            self.parts.append(u)
            self.size += len(u)
            if self.size > 2 * self.base + (1 << 20):
                self._compact()

    def _compact(self) -> None:
        if len(self.parts) == 1 and self.size == self.base:  # already one sorted distinct run
            return
        u = np.unique(np.concatenate(self.parts)) if self.parts else np.zeros(0, np.int64)
        self.parts = [u]
        self.size = self.base = len(u)

    def values(self) -> np.ndarray:
        self._compact()
        return self.parts[0]

    def __len__(self) -> int:
        return int(len(self.values()))


def stats_partial(src, rows: int = 1 << 20, progress=None) -> dict:
    """Counts of one source for :func:`trace_stats_sources` (mergeable: sums, minima, maxima, a pair table)."""
    C = np.zeros((0, 0), np.int64)
    lo = None
    n = records = 0
    kmin, kmax = None, None
    ph = np.zeros(3, np.int64)
    any_in = any_out = False
    tok, reqs, wins, pwins = Distinct(), Distinct(), Distinct(), Distinct()
    prev = None   # last entry (req, pos, lay, phase)
    run = 0       # entries of the open record
    out_src = 0
    pairs = None  # SparsePairs once the dense grid would be too large
    for c in src.chunks(rows):
        m = len(c["layer"])
        if not m:
            continue
        lay, ex = c["layer"], c["expert"]
        req, pos, rank, phs = c["request"], c["position"], c["rank"], np.asarray(c["phase"], np.int64)
        n += m
        # pair counts in a growing [layer - lo, expert] table while it stays small next to the entries seen;
        # else (ids and layers come from the file: an id of 2^24 must not size an allocation) sparse counts
        l0, l1, e1 = int(lay.min()), int(lay.max()), int(ex.max())
        if pairs is None:
            nlo = l0 if lo is None else min(lo, l0)
            nhi = max(l1, (lo + C.shape[0] - 1) if lo is not None else l1)
            ne = max(e1 + 1, C.shape[1])
            if (nhi - nlo + 1) * ne > max(_DENSE_CELLS, 8 * n):
                pairs = SparsePairs()
                if lo is not None:
                    pairs.add_dense(C, lo)
                C, lo = np.zeros((0, 0), np.int64), None
        if pairs is not None:
            pairs.add(lay, ex)
        else:
            if lo is None or nlo != lo or nhi - nlo + 1 != C.shape[0] or ne != C.shape[1]:
                G = np.zeros((nhi - nlo + 1, ne), np.int64)
                if lo is not None:
                    G[lo - nlo:lo - nlo + C.shape[0], :C.shape[1]] = C
                C, lo = G, nlo
            C += np.bincount((lay - lo) * C.shape[1] + ex, minlength=C.size).reshape(C.shape)
        ph += np.bincount(phs.clip(0, 2), minlength=3)
        new = rank == 0
        new[1:] |= (req[1:] != req[:-1]) | (pos[1:] != pos[:-1]) | (lay[1:] != lay[:-1]) | (phs[1:] != phs[:-1])
        if prev is None:
            new[0] = True
        else:
            new[0] |= bool(req[0] != prev[0] or pos[0] != prev[1] or lay[0] != prev[2] or phs[0] != prev[3])
        prev = (req[-1], pos[-1], lay[-1], phs[-1])
        st = np.flatnonzero(new)
        lens = np.diff(np.r_[st, m])
        if len(st):
            if st[0] > 0:
                run += int(st[0])
            if run:  # the record carried from the previous chunk is complete
                kmin = run if kmin is None else min(kmin, run)
                kmax = run if kmax is None else max(kmax, run)
            full = lens[:-1]
            if len(full):
                kmin = int(full.min()) if kmin is None else min(kmin, int(full.min()))
                kmax = int(full.max()) if kmax is None else max(kmax, int(full.max()))
            run = int(lens[-1])
        else:
            run += m
        records += len(st)
        rq, rp = req[st], pos[st]
        key = rq * (1 << 32) + (rp & 0xFFFFFFFF)
        tok.add(key[np.r_[True, key[1:] != key[:-1]]] if len(key) > 1 else key)
        reqs.add(rq[np.r_[True, rq[1:] != rq[:-1]]] if len(rq) > 1 else rq)
        w = c.get("window")
        if w is not None:
            rw = w[st]
            inw = rw >= 0
            any_in |= bool(inw.any())
            any_out |= bool((~inw).any())
            wkey = rq[inw] * (1 << 32) + rw[inw]
            wins.add(wkey)
            pwins.add(wkey[phs[st][inw] == PREFILL])
            out_src += int((~inw).sum())
        if progress is not None:
            progress(m)
    if run:
        kmin = run if kmin is None else min(kmin, run)
        kmax = run if kmax is None else max(kmax, run)
    nw = len(wins)
    return {"C": C, "lo": lo, "pairs": pairs, "n": n, "records": records, "kmin": kmin, "kmax": kmax, "ph": ph,
            "tokens": len(tok), "requests": len(reqs), "windows": nw, "outside": out_src if nw else 0,
            "prefill_windows": len(pwins), "any_in": any_in, "any_out": any_out}


class SparsePairs:
    """(layer, expert) pair counts kept as sorted unique keys and counts (memory ~ distinct pairs, whatever the
    ids' size), compacted as they grow."""

    def __init__(self) -> None:
        self.keys: list[np.ndarray] = []
        self.counts: list[np.ndarray] = []
        self.size = self.base = 0

    @staticmethod
    def key(lay: np.ndarray, ex: np.ndarray) -> np.ndarray:
        return ((np.asarray(lay, np.int64) + 32768) << 32) | (np.asarray(ex, np.int64) & 0xFFFFFFFF)

    def add(self, lay: np.ndarray, ex: np.ndarray) -> None:
        u, c = np.unique(self.key(lay, ex), return_counts=True)
        self._push(u, c.astype(np.int64))

    def add_dense(self, C: np.ndarray, lo: int) -> None:
        li, ei = np.nonzero(C)
        self._push(self.key(li + lo, ei), C[li, ei].astype(np.int64))

    def add_pairs(self, other: "SparsePairs") -> None:
        k, c = other.merged()
        self._push(k, c)

    def _push(self, k: np.ndarray, c: np.ndarray) -> None:
        if len(k):
            self.keys.append(k)
            self.counts.append(c)
            self.size += len(k)
            if self.size > 2 * self.base + (1 << 20):
                self.merged()

    def merged(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, counts), keys sorted and unique."""
        if not self.keys:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        u, inv = np.unique(np.concatenate(self.keys), return_inverse=True)
        c = np.bincount(inv.reshape(-1), weights=np.concatenate(self.counts)).astype(np.int64)
        self.keys, self.counts = [u], [c]
        self.size = self.base = len(u)
        return u, c


def _union_cells(parts: list[dict], n_expert: int | None) -> int:
    """Cells of the dense grid that would hold every part's counts."""
    los = [(p["lo"], p["lo"] + p["C"].shape[0] - 1, p["C"].shape[1]) for p in parts if p["lo"] is not None]
    if not los:
        return 0
    ne = max(max(x[2] for x in los), int(n_expert or 0))
    return (max(x[1] for x in los) - min(x[0] for x in los) + 1) * ne


def _stats_combine_sparse(parts: list[dict], meta: dict, n_expert: int | None) -> TraceStats:
    """:func:`_stats_combine` from sparse pair counts (a part whose ids would make a dense grid too large)."""
    acc = SparsePairs()
    for p in parts:
        if p.get("pairs") is not None:
            acc.add_pairs(p["pairs"])
        elif p["lo"] is not None:
            acc.add_dense(p["C"], p["lo"])
    keys, cnt = acc.merged()
    lay = (keys >> 32) - 32768
    ex = keys & 0xFFFFFFFF
    n = sum(p["n"] for p in parts)
    emax = int(ex.max()) if len(ex) else -1
    E = max(int(n_expert) if n_expert else emax + 1, emax + 1)
    ul, first = np.unique(lay, return_index=True)
    bounds = list(first) + [len(lay)]
    per: list[LayerStats] = []
    for i, L in enumerate(ul.tolist()):
        cc = cnt[bounds[i]:bounds[i + 1]]
        tot = int(cc.sum())
        if tot == 0:
            continue
        pr = cc / tot
        per.append(LayerStats(layer=int(L), entries=tot, distinct_experts=int(len(cc)),
                              concentration=_top_share(cc, E), entropy_bits=float(-(pr * np.log2(pr)).sum())))
    ks = [p["kmin"] for p in parts if p["kmin"] is not None]
    ph = sum((p["ph"] for p in parts), np.zeros(3, np.int64))
    any_in = any(p["any_in"] for p in parts)
    any_out = any(p["any_out"] for p in parts)
    lmin, lmax = (int(ul[0]), int(ul[-1])) if len(ul) else (None, None)
    n_cells = (lmax - lmin + 1) * E if len(ul) else 0
    return TraceStats(entries=n, records=sum(p["records"] for p in parts), tokens=sum(p["tokens"] for p in parts),
                      requests=sum(p["requests"] for p in parts), layers=len(per), layer_min=lmin, layer_max=lmax,
                      k_min=int(min(ks) if ks else 0),
                      k_max=int(max([p["kmax"] for p in parts if p["kmax"] is not None] or [0])), n_expert=E,
                      phases={PHASE_NAMES[i]: int(ph[i]) for i in range(3) if ph[i]},
                      concentration=_top_share(cnt, n_cells) if n else 0.0,
                      mean_entropy_bits=float(np.mean([x.entropy_bits for x in per])) if per else 0.0,
                      per_layer=per, meta=meta, windows=sum(p["windows"] for p in parts),
                      outside_windows=sum(p["outside"] for p in parts),
                      rounds="positions" if not any_in else ("windows+positions" if any_out else "windows"))


def _stats_combine(parts: list[dict], meta: dict, n_expert: int | None) -> TraceStats:
    n = sum(p["n"] for p in parts)
    if any(p.get("pairs") is not None for p in parts) or (n and _union_cells(parts, n_expert) > max(_DENSE_CELLS,
                                                                                                    8 * n)):
        return _stats_combine_sparse(parts, meta, n_expert)
    C = np.zeros((0, 0), np.int64)
    lo = None
    for p in parts:
        if p["lo"] is None:
            continue
        P, plo = p["C"], p["lo"]
        if lo is None:
            C, lo = P.copy(), plo
            continue
        nlo, nhi = min(lo, plo), max(lo + C.shape[0], plo + P.shape[0]) - 1
        ne = max(C.shape[1], P.shape[1])
        G = np.zeros((nhi - nlo + 1, ne), np.int64)
        G[lo - nlo:lo - nlo + C.shape[0], :C.shape[1]] += C
        G[plo - nlo:plo - nlo + P.shape[0], :P.shape[1]] += P
        C, lo = G, nlo
    ks = [p["kmin"] for p in parts if p["kmin"] is not None]
    kmin = min(ks) if ks else 0
    kmax = max([p["kmax"] for p in parts if p["kmax"] is not None] or [0])
    ph = sum((p["ph"] for p in parts), np.zeros(3, np.int64))
    any_in = any(p["any_in"] for p in parts)
    any_out = any(p["any_out"] for p in parts)
    emax = C.shape[1] - 1 if n else -1
    E = int(n_expert) if n_expert else emax + 1
    E = max(E, emax + 1)
    if n:
        lmin, lmax = lo, lo + C.shape[0] - 1
        counts = np.zeros((C.shape[0], E), np.int64)
        counts[:, :C.shape[1]] = C
    else:
        lmin = lmax = None
        counts = np.zeros((0, E), np.int64)
    per: list[LayerStats] = []
    for i in range(counts.shape[0]):
        cc = counts[i]
        tot = int(cc.sum())
        if tot == 0:
            continue
        p = cc[cc > 0] / tot
        per.append(LayerStats(layer=i + (lmin or 0), entries=tot, distinct_experts=int((cc > 0).sum()),
                              concentration=_top_share(cc, E), entropy_bits=float(-(p * np.log2(p)).sum())))
    phases = {PHASE_NAMES[i]: int(ph[i]) for i in range(3) if ph[i]}
    rounds = "positions" if not any_in else ("windows+positions" if any_out else "windows")
    records = sum(p["records"] for p in parts)
    tokens = sum(p["tokens"] for p in parts)
    requests = sum(p["requests"] for p in parts)
    n_windows = sum(p["windows"] for p in parts)
    outside = sum(p["outside"] for p in parts)
    prefill_w = sum(p.get("prefill_windows", 0) for p in parts)
    return TraceStats(entries=n, records=records, tokens=tokens, requests=requests, layers=len(per),
                      layer_min=lmin, layer_max=lmax, k_min=int(kmin or 0), k_max=int(kmax or 0), n_expert=E,
                      phases=phases, concentration=_top_share(counts.ravel(), counts.size) if n else 0.0,
                      mean_entropy_bits=float(np.mean([s.entropy_bits for s in per])) if per else 0.0,
                      per_layer=per, meta=meta, windows=n_windows, outside_windows=outside, rounds=rounds,
                      prefill_windows=prefill_w)
