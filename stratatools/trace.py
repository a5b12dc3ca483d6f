"""Routing traces: one columnar table for every trace format (formats.md section 3).

One row per routed entry: (request, position, phase, layer, rank, expert, weight). Rows of one
(request, position, layer) record are consecutive, in rank order; records are in the order the source gave.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
class TraceTable:
    """A routing trace as columns of equal length N.

    Columns that are constant over the whole trace (e.g. ``request`` and ``phase`` of a plain Strata trace) may
    be zero-memory read-only broadcast views (``np.broadcast_to``); copy a column before writing into it.

    Attributes:
        request, position, phase, layer, rank, expert, weight: numpy arrays [N] with the dtypes of COLUMNS.
        meta: source format (``source_format``), ``source_sha256``, ``n_layers``/``n_expert`` when known,
            counts of skipped records, anything a reader wants to keep.
    """

    request: np.ndarray
    position: np.ndarray
    phase: np.ndarray
    layer: np.ndarray
    rank: np.ndarray
    expert: np.ndarray
    weight: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.expert)
        for name, dt in COLUMNS.items():
            a = np.asarray(getattr(self, name))
            if a.dtype != dt:
                a = a.astype(dt)
            if a.shape != (n,):
                raise ValueError(f"column {name} has shape {a.shape}, expected ({n},)")
            setattr(self, name, a)

    def __len__(self) -> int:
        return int(len(self.expert))

    @classmethod
    def empty(cls, **meta: Any) -> "TraceTable":
        return cls(**{k: np.zeros(0, dt) for k, dt in COLUMNS.items()}, meta=dict(meta))

    def columns(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in COLUMNS}

    def take(self, mask_or_index: np.ndarray) -> "TraceTable":
        """Rows selected by a boolean mask or an index array; meta is copied."""
        return TraceTable(**{k: v[mask_or_index] for k, v in self.columns().items()}, meta=dict(self.meta))

    @classmethod
    def concat(cls, tables: list["TraceTable"]) -> "TraceTable":
        if not tables:
            return cls.empty()
        cols = {k: np.concatenate([getattr(t, k) for t in tables]) for k in COLUMNS}
        return cls(**cols, meta=dict(tables[0].meta))


def read_trace(path, fmt: str | None = None, n_layers: int | None = None, n_expert: int | None = None, *,
               sha256: bool = True) -> "TraceTable":
    """Read a routing trace of any supported format (sniffed when ``fmt`` is None).

    See :func:`stratatools.trace_formats.read_trace` for the formats, arguments and errors.
    """
    from .trace_formats import read_trace as _read

    return _read(path, fmt, n_layers, n_expert, sha256=sha256)


def write_trace(table: "TraceTable", path, fmt: str) -> None:
    """Write a trace as ``strata``, ``strata-tagged``, ``parquet`` or ``csv`` (atomic; see
    :func:`stratatools.trace_formats.write_trace`)."""
    from .trace_formats import write_trace as _write

    return _write(table, path, fmt)


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
    """

    layer: int
    entries: int
    distinct_experts: int
    concentration: float
    entropy_bits: float


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

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["meta"] = {k: v for k, v in self.meta.items() if k != "request_names"}
        return d


def _top_share(counts: np.ndarray, n_slots: int) -> float:
    tot = counts.sum()
    if tot <= 0:
        return 0.0
    top = max(1, int(np.ceil(0.1 * n_slots)))
    part = np.sort(counts)[::-1][:top]
    return float(part.sum() / tot)


def trace_stats(table: TraceTable, n_expert: int | None = None) -> TraceStats:
    """Summarise a trace: tokens, layers, k, distinct experts, concentration (top 10%) and entropy per layer.

    Args:
        table: the trace.
        n_expert: experts per layer for the concentration denominator; default ``meta["n_expert"]`` or the
            largest expert id + 1.
    Returns:
        a :class:`TraceStats`. Memory: a few int64 temporaries of the table's length.
    """
    n = len(table)
    if n_expert is None:
        n_expert = table.meta.get("n_expert")
    E = int(n_expert) if n_expert else (int(table.expert.max()) + 1 if n else 0)
    E = max(E, int(table.expert.max()) + 1 if n else 0)
    lmin = int(table.layer.min()) if n else None
    lmax = int(table.layer.max()) if n else None
    nl = (lmax - lmin + 1) if n else 0
    counts = np.zeros(nl * E, np.int64)
    for a in range(0, n, 1 << 23):  # chunked: int64 temporaries stay small for any trace length
        b = min(n, a + (1 << 23))
        flat = (table.layer[a:b].astype(np.int64) - lmin) * E + table.expert[a:b]
        counts += np.bincount(flat, minlength=nl * E)
    counts = counts.reshape(nl, E)
    per: list[LayerStats] = []
    for i in range(nl):
        c = counts[i]
        tot = int(c.sum())
        if tot == 0:
            continue
        p = c[c > 0] / tot
        per.append(LayerStats(layer=i + (lmin or 0), entries=tot, distinct_experts=int((c > 0).sum()),
                              concentration=_top_share(c, E), entropy_bits=float(-(p * np.log2(p)).sum())))
    from .trace_formats.strata import record_bounds

    starts = record_bounds(table)
    ks = np.diff(np.r_[starts, n])
    req = np.asarray(table.request)[starts]
    pos = np.asarray(table.position)[starts]
    tokens = len(np.unique(req.astype(np.int64) * (1 << 32) + (pos.astype(np.int64) & 0xFFFFFFFF))) if n else 0
    ph = np.bincount(np.asarray(table.phase).astype(np.int64).clip(0, 2), minlength=3) if n else np.zeros(3, int)
    phases = {PHASE_NAMES[i]: int(ph[i]) for i in range(3) if ph[i]}
    return TraceStats(entries=n, records=len(starts), tokens=tokens, requests=len(np.unique(req)) if n else 0,
                      layers=len(per), layer_min=lmin, layer_max=lmax, k_min=int(ks.min()) if n else 0,
                      k_max=int(ks.max()) if n else 0, n_expert=E, phases=phases,
                      concentration=_top_share(counts.ravel(), counts.size) if n else 0.0,
                      mean_entropy_bits=float(np.mean([s.entropy_bits for s in per])) if per else 0.0,
                      per_layer=per, meta=dict(table.meta))
