"""Checks of what a routing trace means, shared by every reader (issue 14): a table whose bytes parse but whose
values cannot be routing (a NaN weight, phase 7, a negative rank) is refused. Not checked (decision): an expert
id repeated inside one record; many synthetic traces in use repeat ids, and the simulator counts them as given.

Source of the rules: formats.md section 3 (phases 0 prefill, 1 decode, 2 unknown; ranks 0..k-1 of one record's
top-k; router weights finite).
"""

from __future__ import annotations

import os

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.traces.table import TraceTable


def check_semantics(table: TraceTable, path: str | os.PathLike) -> None:
    """Refuse a trace with a non-finite weight, an unknown phase or a rank outside 0..1023. Works on the compact
    per-record form when the reader gave one (no per-entry columns are built). Raises StrataError naming the file
    and the first bad row (entry index)."""
    n = len(table)
    if n == 0:
        return
    r = table.records
    if r is not None:  # the Strata reader: weights are checked finite there, ranks are 0..k-1 by construction
        _check_phase(np.asarray(r.phase), path, "record")
        return
    _check_phase(np.asarray(table.phase), path, "row")
    _check_entries(np.asarray(table.weight), np.asarray(table.rank), path)


def _check_phase(ph: np.ndarray, path, what: str) -> None:
    if ph.strides == (0,) and len(ph):
        ph = ph[:1]
    bad = (ph < 0) | (ph > 2)
    if bad.any():
        i = int(np.argmax(bad))
        raise StrataError(f"{path}: {what} {i}: phase {int(ph[i])} is not 0 (prefill), 1 (decode) or 2 (unknown)",
                          path)


def _check_entries(weight: np.ndarray, rank: np.ndarray | None, path) -> None:
    fin = np.isfinite(weight)
    if not fin.all():
        i = int(np.argmin(fin))
        raise StrataError(f"{path}: row {i}: non-finite router weight {float(weight[i])}", path)
    if rank is not None:
        bad = (rank < 0) | (rank > 1023)
        if bad.any():
            i = int(np.argmax(bad))
            raise StrataError(f"{path}: row {i}: rank {int(rank[i])} is outside 0..1023", path)
