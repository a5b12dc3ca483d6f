"""Compiled search for an expert id repeated inside one record (numba through :mod:`stratatools.core.jit`), used
by :mod:`stratatools.traces.semantics` for records its numpy path does not take (mixed k, k > 16) and by the Strata
record walker (:mod:`stratatools.traces.formats.strata_walk`). Without numba, a stable sort by (record, id) in
numpy gives the same answers."""

from __future__ import annotations

import numpy as np

from stratatools.core.jit import HAVE_NUMBA, njit

_PAIRWISE_K = 32  # records up to this long are compared pairwise; longer ones are sorted


def first_repeat(expert: np.ndarray, starts: np.ndarray) -> int:
    """As :func:`stratatools.traces.semantics.first_repeat` (``starts`` int64, contiguous)."""
    if HAVE_NUMBA:
        return int(_first_repeat_nb(expert, starts, len(expert)))
    return _first_repeat_np(expert, starts)


def first_repeat_rows(ids: np.ndarray) -> tuple[int, int] | None:
    """As :func:`stratatools.traces.semantics.first_repeat_rows`."""
    R, k = ids.shape
    if HAVE_NUMBA:
        i = int(_first_repeat_rows_nb(ids))
    else:
        i = _first_repeat_np(np.ascontiguousarray(ids).reshape(-1), np.arange(R, dtype=np.int64) * k)
    return None if i < 0 else (i // k, i % k)


@njit(cache=True, nogil=True)
def _first_in_span(a, lo, hi):  # pragma: no cover - compiled
    """First index in [lo, hi) repeating an earlier id of the span, or -1 (pairwise when short, else sorted)."""
    if hi - lo <= _PAIRWISE_K:
        for c in range(lo + 1, hi):
            v = a[c]
            for j in range(lo, c):
                if a[j] == v:
                    return c
        return -1
    o = np.argsort(a[lo:hi], kind="mergesort")  # stable: of equal ids, the later one comes second
    best = -1
    for t in range(1, hi - lo):
        if a[lo + o[t]] == a[lo + o[t - 1]]:
            c = lo + o[t]
            if best < 0 or c < best:
                best = c
    return best


@njit(cache=True, nogil=True)
def _first_repeat_nb(expert, starts, n):  # pragma: no cover - compiled
    R = starts.shape[0]
    for r in range(R):
        lo = starts[r]
        hi = starts[r + 1] if r + 1 < R else n
        if hi - lo > 1:
            c = _first_in_span(expert, lo, hi)
            if c >= 0:
                return c
    return -1


@njit(cache=True, nogil=True)
def _first_repeat_rows_nb(ids):  # pragma: no cover - compiled
    R, k = ids.shape
    if k > _PAIRWISE_K:
        row = np.empty(k, np.int64)
        for r in range(R):
            for c in range(k):
                row[c] = ids[r, c]
            c = _first_in_span(row, 0, k)
            if c >= 0:
                return r * k + c
        return -1
    for r in range(R):
        for c in range(1, k):
            v = ids[r, c]
            for j in range(c):
                if ids[r, j] == v:
                    return r * k + c
    return -1


def _first_repeat_np(expert: np.ndarray, starts: np.ndarray) -> int:
    """:func:`first_repeat` without numba: a stable sort by (record, id); of two equal neighbours the later
    entry repeats; the smallest such entry is the answer. O(N log N) time, O(N) memory."""
    n = len(expert)
    rec = np.zeros(n, np.int64)
    rec[starts[1:]] = 1
    np.cumsum(rec, out=rec)
    o = np.lexsort((expert, rec))
    eq = (rec[o[1:]] == rec[o[:-1]]) & (np.asarray(expert)[o[1:]] == np.asarray(expert)[o[:-1]])
    if not eq.any():
        return -1
    return int(o[1:][eq].min())
