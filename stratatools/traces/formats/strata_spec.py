"""Strata routing-trace constants, tag ids and error builders, shared by the chunked reader
(:mod:`.strata`) and the compiled walker (:mod:`.strata_walk`). Format facts: docs/formats.md, routing traces."""

from __future__ import annotations

from typing import Any

from stratatools.core.errors import StrataError
import numpy as np

from stratatools.traces.semantics import REPEAT_FIX
from stratatools.traces.table import DECODE, PREFILL, Records, TraceTable

MAX_ROUTE_K = 1024
MAX_TAG_K = 1 << 20
MAX_LAYER = 4096
CHUNK_BYTES = 32 << 20  # > 2 * (8 + 8 * MAX_TAG_K): any record fits in one chunk

TAG_COMMIT, TAG_FORMAT, TAG_REQUEST, TAG_OWNED, TAG_PHASE, TAG_BOOT = -1, -2, -3, -4, -5, -6
TAG_NAMES = {TAG_COMMIT: "commit", TAG_FORMAT: "format", TAG_REQUEST: "request", TAG_OWNED: "owned",
             TAG_PHASE: "phase", TAG_BOOT: "boot"}
_PHASE_OF_VALUE = {0: PREFILL, 1: DECODE}


def _err(path: Any, off: int, what: str, fix: str | None = None, cls: type = StrataError) -> StrataError:
    msg = f"{path}: byte {off}: {what}"
    if fix:
        msg += f" ({fix})"
    return cls(msg, path)


def _repeat_err(path: Any, off: int, expert: int, layer: int) -> StrataError:
    """The error for an expert id at byte ``off`` that repeats an earlier id of its record (shared by the three
    Strata readers, so they name the same byte)."""
    return _err(path, off, f"expert id {expert} appears twice in one record (layer {layer})", REPEAT_FIX)


def _k_error(path: Any, layer: int, k: int, off: int, max_route_k: int) -> StrataError | None:
    """The error for a record header (layer, k) at byte ``off`` whose k is refused, or None when k is valid:
    negative, outside 1..max_route_k on a route record, above MAX_TAG_K on a tag record (the byte named is
    k's, ``off + 4``). Shared by the chunked reader and the compiled walker (:mod:`.strata_walk`)."""
    if k < 0:
        return _err(path, off + 4, f"k = {k} is negative (layer {layer}); not a Strata --dump-routing "
                    f"record", "is this a routing trace? pass --from to name its format")
    if layer >= 0 and not 1 <= k <= max_route_k:
        return _err(path, off + 4, f"k = {k} on a route record of layer {layer} is outside "
                    f"1..{max_route_k}", "the file is corrupt or not a Strata routing trace")
    if layer < 0 and k > MAX_TAG_K:
        return _err(path, off + 4, f"k = {k} on a tag record ({layer}) exceeds {MAX_TAG_K}",
                    "the file is corrupt")
    return None


def ordinal_positions(rec_request: np.ndarray, rec_layer: np.ndarray) -> np.ndarray:
    """Per record, its ordinal among earlier records of the same (request, layer). int32 [n].

    This is the token index of a record when every token routes every layer, whatever the record order
    (token-major decode or layer-major verify windows).
    """
    n = len(rec_layer)
    if n == 0:
        return np.zeros(0, np.int32)
    lay = np.asarray(rec_layer)
    one_request = bool((rec_request == rec_request[0]).all())
    if one_request:
        key = lay.astype(np.int16)
    else:
        _, req_idx = np.unique(rec_request, return_inverse=True)
        key = req_idx.astype(np.int64) * (MAX_LAYER + 2) + lay.astype(np.int64)
    order = np.argsort(key, kind="stable")
    sk = key[order]
    starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
    lens = np.diff(np.r_[starts, n])
    pos_sorted = np.arange(n, dtype=np.int64) - np.repeat(starts, lens)
    out = np.empty(n, np.int32)
    out[order] = pos_sorted
    return out


def _token_major_layers(rec_layer: np.ndarray) -> int:
    """L when the records are token-major over layers 0..L-1 (plain decode traces), else 0."""
    n = len(rec_layer)
    L = int(rec_layer.max()) + 1
    if n % L or int(rec_layer.min()) != 0:
        return 0
    ok = np.array_equal(rec_layer.reshape(-1, L), np.broadcast_to(np.arange(L, dtype=rec_layer.dtype), (n // L, L)))
    return L if ok else 0


def _expand(expert: np.ndarray, weight: np.ndarray, rec_layer: np.ndarray, rec_k: np.ndarray | int,
            rec_request: np.ndarray, rec_phase: np.ndarray, meta: dict,
            unit_rows: np.ndarray | None = None, mapping: Any = None,
            window: np.ndarray | None = None) -> TraceTable:
    """Per-record arrays -> a lazily expanded :class:`TraceTable` (``TraceTable.from_records``). No per-entry
    array is made here: with a constant k, ``expert``/``weight`` become [R, k] views; constant request/phase
    become broadcast views; positions are computed on first use."""
    n_rec = len(rec_layer)
    one_request = bool((rec_request == rec_request[0]).all())
    if isinstance(rec_k, (int, np.integer)):
        rec_k = int(rec_k)
        expert = expert.reshape(n_rec, rec_k)
        weight = weight.reshape(n_rec, rec_k)

    def position() -> np.ndarray:
        L = _token_major_layers(rec_layer) if one_request else 0
        if L:  # each token is L consecutive records: the position is the token index
            return (np.arange(n_rec, dtype=np.int64) // L).astype(np.int32)
        return ordinal_positions(rec_request, rec_layer)

    def const(a: np.ndarray, dtype) -> np.ndarray:
        if len(a) and (a == a[0]).all():
            return np.broadcast_to(np.asarray(a[0], dtype=dtype), (len(a),))
        return a.astype(dtype, copy=False)

    rec = Records(layer=rec_layer.astype(np.int16, copy=False), k=rec_k, request=const(rec_request, np.int32),
                  phase=const(rec_phase, np.int8), expert=expert, weight=weight, position=position,
                  unit_rows=unit_rows, mapped=mapping is not None, mapping=mapping, window=window)
    return TraceTable.from_records(rec, meta)
