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
    "position": np.int32,  # token position within the request (-1 when unknown)
    "phase": np.int8,      # PREFILL, DECODE or UNKNOWN
    "layer": np.int16,     # trunk layer
    "rank": np.int16,      # rank within the record's top-k (0 = first listed)
    "expert": np.int32,    # expert id as the engine saw it (dense index for a pruned model)
    "weight": np.float32,  # router weight (1.0 when the source has none or writes zeros)
}


@dataclass
class TraceTable:
    """A routing trace as columns of equal length N.

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
