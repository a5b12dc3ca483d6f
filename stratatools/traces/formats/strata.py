"""Strata ``--dump-routing`` traces, plain and tagged (formats.md section 3).

Record layout (little-endian, no file header): ``i32 layer, i32 k, k x i32 expert ids, k x f32 router weights``;
a record is ``8 + 8k`` bytes. Source of the format facts: formats.md section 3, Strata ``tools/make_profile.py``
(the per-record reader) and the tagged fork's ``include/strata/core/routing_trace.hpp`` (tag numbers, the commit
tag's phase field in version 2, zeros written for missing weights).

Tagged variant: a first record with layer -2 (format tag, payload ``[version]``) marks the file as tagged. Tag
records have a negative layer and carry their values in the id slots (weights are zero padding):

====  ==========  ===========================================================================
 tag   name        payload / what the reader does with it
====  ==========  ===========================================================================
 -1    commit      ``[window, n_positions, n_accepted(, phase)]``: closes a verify window (below); v2: the phase
                   (0 prompt, 1 decode) of the window's records
 -2    format      ``[version]``, first record; versions 1 and 2 are understood, others read as 2
 -3    request     ``[request_id]``: the route records that follow belong to this request
 -4    owned       flattened ``layer*E + expert`` ids: skipped (counted in meta)
 -5    phase (v1)  ``[0 prefill | 1 decode]``: the phase of the route records that follow
 -6    boot        flattened ids: skipped (counted in meta)
 other             skipped and counted in ``meta["tags_skipped"]``
====  ==========  ===========================================================================

Verify windows (``TraceTable.window``; the replay makes one round per window). A commit closes the last
``n_positions x layers`` route records before it, where layers is the span of layers routed since the previous
commit or request tag, and never reaches past that tag. When a window's records follow the previous commit
directly (the usual case) these are exactly the records since the previous commit; records before them in the
same stretch are the per-token loop's or a failed/cancelled window's and belong to no window (window -1: the
replay gives them one round per position). Source: the fork's ``routing_trace.hpp`` (a window is written
layer-major, positions 0..n-1 of each layer, then its commit tag; "the per-token loop ... writes route records
with NO commit tag after them, and a window that fails or is cancelled leaves its records uncommitted too: a
reader must not fold such records into the next window"). Windows are numbered 0, 1, ... over the file in order
(the commit's own window value is not kept; a commit that closes no record makes no window). Versions 1 and 2
alike. A plain trace, or a tagged one without commits, has no windows (``window`` None: rounds are positions).

Decisions on bad input (each raises :class:`StrataError` with the byte offset of the record; nothing is guessed):

* empty file: refused (an empty trace would silently turn a profile into pure fill);
* a record cut inside its header, ids or weights (the file ends before ``8 + 8k`` bytes): refused, the message
  says which part was cut;
* ``k < 0``; ``k = 0`` or ``k > 1024`` on a route record (or ``k`` above the model's expert count when it is
  known); ``k > 2**20`` on a tag (Strata's own reader bound): refused as corrupt;
* a route layer above 4096: refused (no model has that many layers; the table stores layers as int16);
* an expert id < 0: refused; an expert id >= ``n_expert`` (when given) on a layer below ``n_layers`` (all layers
  when ``n_layers`` is not given): refused, because a trace of another expert numbering would otherwise build a
  silently wrong profile. Layers >= ``n_layers`` (an MTP block, which may keep the canonical expert count) are
  kept in the table; :func:`stratatools.profiles.ranking.count_pairs` leaves them out and counts them;
* an expert id equal to an earlier id of the same record: refused (a router's top-k are k different experts);
* a non-finite weight: refused. A record whose weights are all zero (verify windows) gets unit weights.

Untagged files: negative-layer records are skipped and counted; every route record is decode (Strata writes
decode positions only). Positions are not in the format: a record's position is its ordinal among the route
records of the same layer and request (the token index when every token routes every layer; rejected draft
positions of verify windows count too).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from stratatools.core.errors import OtherModelInput, StrataError
from stratatools.core.fsutil import AtomicFile
from stratatools.traces.table import DECODE, PREFILL, UNKNOWN, TraceTable, no_hugepages, record_bounds
from stratatools.traces.formats.strata_spec import (  # noqa: F401  (re-exported: the format's limits and tags)
    CHUNK_BYTES, MAX_LAYER, MAX_ROUTE_K, MAX_TAG_K, TAG_BOOT, TAG_COMMIT, TAG_FORMAT, TAG_NAMES, TAG_OWNED,
    TAG_PHASE, TAG_REQUEST, _PHASE_OF_VALUE, _err, _expand, _k_error, _repeat_err, _token_major_layers,
    ordinal_positions)
from stratatools.traces.semantics import first_repeat_rows

class _Reader:
    """One pass over a trace file in fixed chunks; route records go straight into preallocated columns."""

    def __init__(self, path: Path, n_layers: int | None, n_expert: int | None, chunk_bytes: int,
                 sha256: bool = True):
        self.path = path
        self.hash = sha256
        self.n_layers = n_layers
        self.n_expert = n_expert
        self.chunk = max(int(chunk_bytes) // 4 * 4, 64)
        self.size = path.stat().st_size
        # upper bounds: every entry takes >= 8 bytes, every route record >= 16; untouched pages cost no memory
        self.expert = np.empty(self.size // 8 + 1, np.int32)
        self.weight = np.empty(self.size // 8 + 1, np.float32)
        self.rec_layer = np.empty(self.size // 16 + 1, np.int16)
        self.rec_k = np.empty(self.size // 16 + 1, np.int32)
        self.n_ent = 0
        self.n_rec = 0
        self.events: list[tuple[int, int, list, int]] = []  # (route records before it, tag, values, byte)
        self.n_records_total = 0
        self.guess: dict[int, int] = {}  # look-ahead per k (tags of another k must not shrink the route runs')
        self.route_ks: set[int] = set()
        self.max_route_k = MAX_ROUTE_K if n_expert is None else min(MAX_ROUTE_K, int(n_expert))

    # -- scanning ---------------------------------------------------------------------------------------------
    def run(self) -> str | None:
        """Read the whole file; returns its sha256 (None when hashing is off)."""
        h = hashlib.sha256() if self.hash else None
        buf = np.empty(self.chunk, np.uint8)
        carry = 0
        base = 0
        with open(self.path, "rb", buffering=0) as fh:
            while True:
                mv = memoryview(buf)
                got_total = 0
                while carry + got_total < len(buf):
                    got = fh.readinto(mv[carry + got_total:])
                    if not got:
                        break
                    if h is not None:
                        h.update(mv[carry + got_total:carry + got_total + got])
                    got_total += got
                avail = carry + got_total
                eof = avail < len(buf)
                words = avail // 4
                a = buf[:words * 4].view("<i4")
                o = self._scan(a, words, base)
                consumed = o * 4
                left = avail - consumed
                if eof:
                    if left:
                        self._cut(buf[consumed:avail], base + consumed)
                    break
                if consumed == 0:
                    # one record larger than the buffer: grow it (k is already checked, so this is bounded)
                    k = int(a[1])
                    del mv, a
                    grown = np.empty(max(2 * len(buf), 8 + 8 * k + 8), np.uint8)
                    grown[:left] = buf[:left]
                    buf = grown
                elif left:
                    buf[:left] = buf[consumed:avail].copy()
                base += consumed
                carry = left
        return h.hexdigest() if h is not None else None

    def _cut(self, tail: np.ndarray, off: int) -> None:
        n = len(tail)
        if n < 8:
            raise _err(self.path, off, f"record cut inside its header ({n} of 8 bytes before the end of the file)",
                       "the trace was truncated; drop the partial last record or re-record")
        layer, k = (int(x) for x in tail[:8].view("<i4"))
        self._check_k(layer, k, off)
        need = 8 + 8 * k
        part = "ids" if n < 8 + 4 * k else "weights"
        raise _err(self.path, off, f"record (layer {layer}, k {k}) cut inside its {part}: {n} of {need} bytes "
                   f"before the end of the file", "the trace was truncated; drop the partial last record or re-record")

    def _check_k(self, layer: int, k: int, off: int) -> None:
        e = _k_error(self.path, layer, k, off, self.max_route_k)
        if e is not None:
            raise e

    def _scan(self, a: np.ndarray, W: int, base: int) -> int:
        """Process the complete records of ``a`` (W int32 words at file byte ``base``); returns words used.

        Runs of records sharing k are found with strided vectorised checks (doubling look-ahead), so a file of
        constant k costs a few numpy calls per chunk; each run is then handled as one 2-D view.
        """
        o = 0
        runs: list[tuple[int, int, int]] = []  # route runs (word offset, records, k), processed at the end
        pending = 0  # route records in those runs (for the index of tags met meanwhile)
        while o + 2 <= W:
            layer0, k = int(a[o]), int(a[o + 1])
            try:
                self._check_k(layer0, k, base + 4 * o)
            except StrataError:
                self._flush(a, runs, base)  # an earlier record's error comes first
                raise
            s = 2 + 2 * k
            m_max = (W - o) // s
            if m_max == 0:
                break
            if layer0 < 0:  # a tag: handled alone, without numpy calls (windows put one after every few hundred)
                vals = [k] if layer0 in (TAG_OWNED, TAG_BOOT) else a[o + 2:o + 2 + min(k, 8)].tolist()
                self.events.append((self.n_rec + pending, layer0, vals, base + 4 * o))
                self.n_records_total += 1
                o += s
                continue
            g = self.guess.get(k, 64)
            m = min(g, m_max)
            ks = a[o + 1:o + 1 + (m - 1) * s + 1:s]
            neq = np.flatnonzero(ks != k)
            if len(neq):
                m = int(neq[0])
                self.guess[k] = max(64, 2 * m)
            elif m == g:
                self.guess[k] = min(g * 4, 1 << 22)
            runs.append((o, m, k))
            pending += m - int(np.count_nonzero(a[o:o + m * s:s] < 0))
            o += m * s
        self._flush(a, runs, base)
        return o

    def _flush(self, a: np.ndarray, runs: list[tuple[int, int, int]], base: int) -> None:
        """Handle a chunk's route runs in order; runs of one k separated only by tags (verify windows and
        their commit tags) are gathered into one 2-D array so the per-call cost is paid once per chunk."""
        if not runs:
            return
        k = runs[0][2]
        if len(runs) > 1 and all(r[2] == k for r in runs):
            s = 2 + 2 * k
            starts = np.array([r[0] for r in runs], np.int64)
            ms = np.array([r[1] for r in runs], np.int64)
            first = np.repeat(starts - np.cumsum(np.r_[0, ms[:-1]]) * s, ms)  # per record: run start - index*s
            rows = first + np.arange(int(ms.sum()), dtype=np.int64) * s        # word offset of every record
            v = np.empty((len(rows), s), np.int32)
            flat = v.reshape(-1)
            pos = 0
            for o, m, _ in runs:  # one memcpy per run
                flat[pos:pos + m * s] = a[o:o + m * s]
                pos += m * s
            self._run(v, k, base, rows * 4 + base)
            return
        for o, m, k in runs:
            s = 2 + 2 * k
            self._run(a[o:o + m * s].reshape(m, s), k, base + 4 * o)

    def _run(self, v: np.ndarray, k: int, off: int, offsets: np.ndarray | None = None) -> None:
        """Route records (and same-k tags) ``v`` [m, 2+2k]; record i starts at byte ``offsets[i]`` when given,
        else at ``off + 4*(2+2k)*i``."""
        m, s = v.shape

        def at(i: int) -> int:  # byte offset of row i of v
            return int(offsets[i]) if offsets is not None else off + 4 * s * i

        lay = v[:, 0]
        route = lay >= 0
        all_route = bool(route.all())
        self.n_records_total += m
        if not all_route:
            tag_rows = np.flatnonzero(~route)
            before = tag_rows - np.arange(len(tag_rows))
            for i, rb in zip(tag_rows.tolist(), before.tolist()):
                t = int(lay[i])
                vals = v[i, 2:2 + min(k, 8)].tolist() if t not in (TAG_OWNED, TAG_BOOT) else [k]
                self.events.append((self.n_rec + rb, t, vals, at(i)))
            if not route.any():
                return
            rows = np.flatnonzero(route)
            rv = v[rows]
        else:
            rows = None
            rv = v
        if k > self.max_route_k:  # the run's k was only checked against its first record's layer
            i = int(rows[0]) if rows is not None else 0
            self._check_k(int(lay[i]), k, at(i))
        nr = len(rv)
        rl = rv[:, 0]

        def rec_off(j: int) -> int:
            return at(int(rows[j]) if rows is not None else j)

        errs: list[tuple[int, StrataError]] = []  # every failed check; the first byte in the file is raised
        if int(rl.max()) > MAX_LAYER:
            j = int(np.argmax(rl > MAX_LAYER))
            errs.append((rec_off(j), _err(self.path, rec_off(j), f"layer {int(rl[j])} is out of range (above "
                                          f"{MAX_LAYER})", "the file is corrupt or not a Strata routing trace")))
        ids = rv[:, 2:2 + k]
        w = rv[:, 2 + k:].view(np.float32)
        e0 = self.n_ent
        # copy first, then check the contiguous copies (one strided pass per column, SIMD reductions after)
        out_e = self.expert[e0:e0 + nr * k]
        out_e.reshape(nr, k)[...] = ids
        out_w = self.weight[e0:e0 + nr * k]
        out_w.reshape(nr, k)[...] = w
        if int(out_e.min()) < 0:
            j, c = np.argwhere(ids < 0)[0]
            o = rec_off(int(j)) + 8 + 4 * int(c)
            errs.append((o, _err(self.path, o, f"expert id {int(ids[j, c])} is negative (layer {int(rl[j])})",
                                 "the file is corrupt")))
        if self.n_expert is not None and int(out_e.max()) >= self.n_expert:
            bad = ids >= self.n_expert
            if self.n_layers is not None:
                bad &= (rl < self.n_layers)[:, None]
            if int(out_e.min()) < 0:
                bad &= ids >= 0
            if bad.any():
                j, c = np.argwhere(bad)[0]
                o = rec_off(int(j)) + 8 + 4 * int(c)
                errs.append((o, _err(self.path, o, f"expert id {int(ids[j, c])} of layer {int(rl[j])} is out of "
                                     f"range for {self.n_expert} experts",
                                     "the trace is for a model with more experts; check --n-expert / --model",
                                     OtherModelInput)))
        rep = first_repeat_rows(out_e.reshape(nr, k))
        if rep is not None:
            j, c = rep
            o = rec_off(j) + 8 + 4 * c
            errs.append((o, _repeat_err(self.path, o, int(ids[j, c]), int(rl[j]))))
        if not np.isfinite(np.add.reduce(out_w, dtype=np.float64)):  # one pass; NaN/inf make the sum non-finite
            fin = np.isfinite(w)
            if not fin.all():
                j, c = np.argwhere(~fin)[0]
                o = rec_off(int(j)) + 8 + 4 * k + 4 * int(c)
                errs.append((o, _err(self.path, o, f"router weight {float(w[j, c])} is not finite (layer "
                                     f"{int(rl[j])})", "the file is corrupt")))
        if errs:
            raise min(errs, key=lambda e: e[0])[1]
        if np.count_nonzero(out_w) != len(out_w):
            wd = out_w.reshape(nr, k)
            zero = ~(wd != 0).any(axis=1)
            if zero.any():
                wd[zero] = 1.0
        self.n_ent += nr * k
        self.rec_layer[self.n_rec:self.n_rec + nr] = rl
        self.rec_k[self.n_rec:self.n_rec + nr] = k
        self.n_rec += nr
        self.route_ks.add(k)


def _window_spans(rec_layer: np.ndarray, bounds: list[int],
                  info: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The route records each commit closes: ``(first, end, phase)``, int64 [W] each, one per commit that closes
    at least one record, in file order; window j is route records ``[first[j], end[j])``.

    A commit closes the last ``n_positions x layers`` route records before it (layers = the span of layers routed
    since the previous commit or request tag), never reaching past that previous tag; records before them in the
    segment (the per-token loop, failed or cancelled windows) belong to no window. Source: the tagged fork's
    ``include/strata/core/routing_trace.hpp`` (a window is written layer-major, positions 0..n-1 per layer, then
    one commit tag; the per-token loop and failed windows write route records with no commit after them, and "a
    reader must not fold such records into the next window"). Vectorised.
    """
    n = len(rec_layer)
    none = np.zeros(0, np.int64)
    if not bounds or n == 0:
        return none, none, none
    end = np.asarray(bounds, np.int64)
    start = np.r_[0, end[:-1]]
    npos = np.array([i[0] for i in info], np.int64)
    ph = np.array([i[1] for i in info], np.int64)
    nonempty = end > start
    if not ((npos > 0) & nonempty).any():
        return none, none, none
    s_, e_ = start[nonempty], end[nonempty]
    # the non-empty segments are consecutive, so reduceat over their starts spans exactly [s_j, e_j)
    lay = rec_layer[:int(e_[-1])].astype(np.int32)
    hi = np.maximum.reduceat(lay, s_)
    lo = np.minimum.reduceat(lay, s_)
    npos_, ph_ = npos[nonempty], ph[nonempty]
    c = npos_ > 0
    cnt = np.minimum(e_ - s_, npos_ * (hi - lo + 1))[c]
    e_, ph_ = e_[c], ph_[c]
    return e_ - cnt, e_, ph_


def _paint(n: int, first: np.ndarray, end: np.ndarray, value: np.ndarray, outside: int, dtype) -> np.ndarray:
    """``out[first[j]:end[j]] = value[j]`` over disjoint spans, ``outside`` elsewhere (difference array)."""
    d = np.zeros(n + 1, np.int64)
    np.add.at(d, first, value + 1)
    np.add.at(d, end, -(value + 1))
    v = np.cumsum(d[:n])
    return np.where(v > 0, v - 1, outside).astype(dtype)


def _window_phases(rec_layer: np.ndarray, bounds: list[int], info: list[tuple[int, int]]) -> np.ndarray:
    """Phases of v2 route records: a commit's phase goes to the records it closes (:func:`_window_spans`);
    records outside every window stay unknown. int8 [n]."""
    first, end, ph = _window_spans(rec_layer, bounds, info)
    return _paint(len(rec_layer), first, end, ph, UNKNOWN, np.int8)


def _window_ids(rec_layer: np.ndarray, bounds: list[int], info: list[tuple[int, int]]) -> np.ndarray | None:
    """Verify window of every route record: windows numbered 0, 1, ... in file order over the commits that close
    at least one record (:func:`_window_spans`), -1 outside every window; None when no commit closes a record.
    int32 [n]."""
    first, end, _ = _window_spans(rec_layer, bounds, info)
    if len(first) == 0:
        return None
    return _paint(len(rec_layer), first, end, np.arange(len(first), dtype=np.int64), -1, np.int32)


def _fill_segments(n: int, changes: list[tuple[int, int]], initial: int, dtype) -> np.ndarray:
    """Values per record from (first record index, value) change points (in order)."""
    if not changes:
        return np.full(n, initial, dtype=dtype)
    idx = np.array([c[0] for c in changes] + [n], np.int64)
    vals = np.array([initial] + [c[1] for c in changes], dtype=np.int64)
    lens = np.diff(np.r_[0, idx])
    return np.repeat(vals, lens).astype(dtype)


def read_strata(path: str | os.PathLike, n_layers: int | None = None, n_expert: int | None = None,
                chunk_bytes: int = CHUNK_BYTES, *, sha256: bool = True) -> TraceTable:
    """Read a Strata ``--dump-routing`` trace (plain or tagged v1/v2) into a :class:`TraceTable`.

    Three paths with the same results (tables, meta, windows, one-line errors; tests/test_trace_compact.py and
    tests/test_trace_walk.py compare them): a plain trace of constant k is a zero-copy view of the mapped file
    (:func:`_read_plain_fast`); any other trace is walked by the compiled record walker
    (:mod:`.strata_walk`, numba); an explicit ``chunk_bytes``, or no numba, uses the chunked reader
    (:class:`_Reader`, the reference).

    Args:
        path: the trace file.
        n_layers: trunk layers of the model, when known (expert ids are range-checked below it).
        n_expert: experts per layer, when known (bounds k and expert ids).
        chunk_bytes: read size of the chunked reader (given: that reader is used); memory is the output
            columns (8 bytes per entry plus a few per record, constant columns are broadcast views) plus one
            chunk.
        sha256: hash the file while reading it (``meta["source_sha256"]``; costs about a third of the read
            time); callers that hash the file anyway (provenance) pass False.
    Returns:
        the table; ``meta`` has source_format ("strata" or "strata-tagged"), source_sha256, version, records,
        tag counts, k (when constant).
    Raises:
        StrataError: see the module docstring for every refused case (always with the byte offset).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise StrataError(f"{path}: no such file", path) from None
    if path.is_dir():
        raise StrataError(f"{path}: is a directory, expected a routing trace", path)
    if size == 0:
        raise _err(path, 0, "empty file: no routing records", "record a trace with --dump-routing first")
    with no_hugepages():
        if chunk_bytes == CHUNK_BYTES:  # (an explicit chunk size asks for the chunked reader, as tests do)
            t = _read_plain_fast(path, size, n_layers, n_expert, sha256)
            if t is not None:
                return t
            from stratatools.traces.formats.strata_walk import HAVE_NUMBA, read_walk
            if HAVE_NUMBA:  # tagged or mixed-k traces: the compiled walker (same results as the chunked reader)
                t = read_walk(path, size, n_layers, n_expert, sha256)
                if t is not None:
                    return t
        return _read_strata(path, size, n_layers, n_expert, chunk_bytes, sha256)


def _read_strata(path: Path, size: int, n_layers: int | None, n_expert: int | None, chunk_bytes: int,
                 sha256: bool) -> TraceTable:
    r = _Reader(path, n_layers, n_expert, chunk_bytes, sha256)
    sha = r.run()
    n, n_ent = r.n_rec, r.n_ent
    expert, weight = r.expert, r.weight
    expert.resize(n_ent, refcheck=False)
    weight.resize(n_ent, refcheck=False)
    rec_layer = r.rec_layer[:n].copy()
    const_k = len(r.route_ks) == 1
    rec_k = int(next(iter(r.route_ks))) if const_k else r.rec_k[:n].copy()  # an int when k is constant
    del r.rec_layer, r.rec_k

    events = sorted(r.events, key=lambda e: e[3])  # tags inside gathered runs are appended late
    tagged = bool(events) and events[0][3] == 0 and events[0][1] == TAG_FORMAT
    meta: dict[str, Any] = {"source_format": "strata-tagged" if tagged else "strata", "source_path": str(path),
                            "source_sha256": sha, "source_bytes": size, "records": r.n_records_total,
                            "route_records": n}
    if n_layers is not None:
        meta["n_layers"] = int(n_layers)
    if n_expert is not None:
        meta["n_expert"] = int(n_expert)
    if len(r.route_ks) == 1:
        meta["k"] = next(iter(r.route_ks))
    tag_counts: dict[str, int] = {}
    skipped: dict[str, int] = {}

    rec_request = np.zeros(n, np.int32)
    rec_window = None
    if not tagged:
        rec_phase = np.full(n, DECODE, np.int8)
        for _, t, _, _ in events:
            skipped[str(t)] = skipped.get(str(t), 0) + 1
    else:
        fv = events[0][2]
        if len(fv) < 1:
            raise _err(path, 0, "format tag (-2) carries no version", "the file is corrupt")
        version = int(fv[0])
        if version < 1:
            raise _err(path, 8, f"format version {version} is not a positive number", "the file is corrupt")
        meta["version"] = version
        if version not in (1, 2):
            meta["version_note"] = f"format version {version} is newer than 2; read with version 2 rules"
        rec_phase = np.full(n, UNKNOWN, np.int8)
        req_changes: list[tuple[int, int]] = []
        phase_changes: list[tuple[int, int]] = []
        bounds: list[int] = []        # route-record index of every commit and request tag (v2 window ends)
        commit_info: list[tuple[int, int]] = []  # per bound: (n_positions, phase) for a commit, (-1, 0) else
        commits = accepted = 0
        for idx, t, vals, off in events[1:]:
            name = TAG_NAMES.get(t)
            if name is None or (t == TAG_FORMAT):
                skipped[str(t)] = skipped.get(str(t), 0) + 1
                continue
            tag_counts[name] = tag_counts.get(name, 0) + 1
            if t == TAG_REQUEST:
                if len(vals) < 1:
                    raise _err(path, off, "request tag (-3) carries no request id", "the file is corrupt")
                req_changes.append((idx, int(vals[0])))
                bounds.append(idx)
                commit_info.append((-1, 0))
            elif t == TAG_PHASE and version == 1:
                if len(vals) < 1:
                    raise _err(path, off, "phase tag (-5) carries no phase", "the file is corrupt")
                phase_changes.append((idx, _PHASE_OF_VALUE.get(int(vals[0]), UNKNOWN)))
            elif t == TAG_COMMIT:
                if len(vals) < 3:
                    raise _err(path, off, f"commit tag (-1) carries {len(vals)} values, expected 3 or 4",
                               "the file is corrupt")
                commits += 1
                accepted += max(int(vals[2]), 0)
                ph = _PHASE_OF_VALUE.get(int(vals[3]), UNKNOWN) if len(vals) >= 4 else UNKNOWN
                bounds.append(idx)
                commit_info.append((max(int(vals[1]), 0), ph))
        if version == 1:
            rec_phase = _fill_segments(n, phase_changes, UNKNOWN, np.int8)
        else:
            rec_phase = _window_phases(rec_layer, bounds, commit_info)
        rec_request = _fill_segments(n, req_changes, 0, np.int32)
        rec_window = _window_ids(rec_layer, bounds, commit_info)
        meta["commits"] = commits
        meta["accepted_drafts"] = accepted
        if rec_window is not None:
            meta["windows"] = int(rec_window.max()) + 1
            meta["window_records"] = int((rec_window >= 0).sum())
    meta["tags"] = tag_counts
    meta["tags_skipped"] = skipped
    if n_ent == 0:
        t = TraceTable.empty(**meta)
        return t
    return _expand(expert, weight, rec_layer, rec_k, rec_request, rec_phase, meta, window=rec_window)


def _map_file(path: Path, size: int):
    """The file mapped read-only (pre-faulted where the platform can), or None when mapping fails."""
    try:
        with open(path, "rb") as fh:
            if hasattr(mmap, "MAP_SHARED"):
                return mmap.mmap(fh.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                 prot=mmap.PROT_READ)
            return mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None


def _read_plain_fast(path: Path, size: int, n_layers: int | None, n_expert: int | None,
                     sha256: bool) -> TraceTable | None:
    """The common case without copying: a plain trace of one constant k (no tags) is one [R, 2+2k] int32
    array over the memory-mapped file; layers, k, ids and weights are checked with a few whole-array
    reductions, and ids/weights stay strided views into the mapping. Returns None whenever the file is
    anything else or any check fails: the chunked reader then reads it (and names the byte offset of the
    first bad record)."""
    if size % 4 or size < 16:
        return None
    with open(path, "rb") as fh:
        head = fh.read(8)
    if len(head) < 8:
        return None
    layer0, k = (int(x) for x in np.frombuffer(head, "<i4"))
    max_k = MAX_ROUTE_K if n_expert is None else min(MAX_ROUTE_K, int(n_expert))
    if layer0 < 0 or not 1 <= k <= max_k:
        return None
    s = 2 + 2 * k
    if size % (4 * s):
        return None
    mm = _map_file(path, size)
    if mm is None:
        return None
    a = np.frombuffer(mm, dtype="<i4")
    R = len(a) // s
    v = a.reshape(R, s)
    hdr = np.ascontiguousarray(v[:, :2]).view(np.int64).reshape(R)  # (layer, k) pairs, one strided pass
    if not (hdr >> 32 == k).all():
        return None
    lay = hdr.view("<i4")[0::2]
    if int(lay.min()) < 0 or int(lay.max()) > MAX_LAYER:
        return None
    ids = v[:, 2:2 + k]
    bound = (1 << 31) if n_expert is None else int(n_expert)
    if int(ids.view("<u4").max()) >= bound:  # negative ids are >= 2**31 as u32
        return None
    w = v[:, 2 + k:].view("<f4")
    if not np.isfinite(np.add.reduce(w, axis=None, dtype=np.float32)):  # NaN/inf (or overflow): exact reader
        return None
    if first_repeat_rows(ids) is not None:  # an id twice in one record: the exact reader names its byte
        return None
    cand = np.flatnonzero(w[:, 0] == 0)  # a record of all-zero weights starts with a zero weight
    unit_rows = cand[~(w[cand] != 0).any(axis=1)] if len(cand) else None
    rec_layer = lay.astype(np.int16)
    del hdr, lay
    sha = hashlib.sha256(mm).hexdigest() if sha256 else None
    meta: dict[str, Any] = {"source_format": "strata", "source_path": str(path), "source_sha256": sha,
                            "source_bytes": size, "records": R, "route_records": R}
    if n_layers is not None:
        meta["n_layers"] = int(n_layers)
    if n_expert is not None:
        meta["n_expert"] = int(n_expert)
    meta.update({"k": k, "tags": {}, "tags_skipped": {}})
    zeros = np.broadcast_to(np.zeros(1, np.int32), (R,))
    phase = np.broadcast_to(np.full(1, DECODE, np.int8), (R,))
    return _expand(ids, w, rec_layer, k, zeros, phase, meta,
                   unit_rows if unit_rows is not None and len(unit_rows) else None, mapping=mm)


# -- writers ------------------------------------------------------------------------------------------------------

def _check_writable(table: TraceTable, path: Any) -> None:
    if len(table) and (int(table.layer.min()) < 0 or int(table.expert.min()) < 0):
        raise StrataError(f"{path}: the trace has negative layers or expert ids; a Strata trace cannot hold them",
                          path)


PLAIN_PREFILL_FIX = ("write strata-tagged instead (it keeps prefill, request ids and phases), or parquet or csv")


def drop_prefill(table: TraceTable) -> tuple[TraceTable, int, int]:
    """What of ``table`` a plain Strata trace can hold: the plain ``--dump-routing`` layout holds decode positions
    only (formats.md section 3: "batched prefill writes nothing"; every plain record reads back as decode), so
    prefill entries are left out. Entries of phase decode or unknown are kept, in order.

    Returns ``(kept table, prefill entries dropped, prefill records dropped)``; the table itself when nothing
    is dropped."""
    ph = np.asarray(table.phase)
    pre = ph == PREFILL
    n = int(pre.sum())
    if not n:
        return table, 0, 0
    recs = int(len(record_bounds(table.take(pre))))
    return table.take(~pre), n, recs


def plain_prefill_note(path: Any, entries: int, records: int) -> str:
    """The one-line warning for prefill entries a plain Strata output left out (:func:`drop_prefill`)."""
    return (f"{path}: left out {entries:,} prefill entries ({records:,} records): a plain Strata trace holds decode "
            f"positions only (as the engine's --dump-routing); strata-tagged keeps them, with their request ids and "
            f"phases (as do parquet and csv)")


def all_prefill_error(path: Any, entries: int) -> StrataError:
    """A plain Strata output whose entries are all prefill would be empty (and an empty trace is refused)."""
    return StrataError(f"{path}: all {entries:,} routed entries are prefill and a plain Strata trace holds decode "
                       f"positions only (as the engine's --dump-routing), so it would be empty; "
                       f"{PLAIN_PREFILL_FIX}", path)


def _write_records(fh, table: TraceTable, lo: int, hi: int, starts: np.ndarray, ks: np.ndarray,
                   path: Any, batch_records: int = 1 << 20) -> None:
    """Write records [lo, hi) (indices into starts/ks) as Strata route records, vectorised by runs of equal k."""
    i = lo
    while i < hi:
        k = int(ks[i])
        if k > MAX_ROUTE_K:
            raise StrataError(f"{path}: a record has k = {k} > {MAX_ROUTE_K} entries; not writable as Strata", path)
        j = i + 1
        if j < hi and ks[j] == k:
            diff = np.flatnonzero(ks[i:hi] != k)
            j = i + (int(diff[0]) if len(diff) else hi - i)
        for a in range(i, j, batch_records):
            b = min(j, a + batch_records)
            m = b - a
            r0 = int(starts[a])
            rows = slice(r0, r0 + m * k)
            out = np.empty((m, 2 + 2 * k), dtype="<i4")
            out[:, 0] = table.layer[r0:r0 + m * k:k]
            out[:, 1] = k
            out[:, 2:2 + k] = np.asarray(table.expert[rows]).reshape(m, k)
            out[:, 2 + k:] = np.asarray(table.weight[rows], dtype="<f4").reshape(m, k).view("<i4")
            fh.write(out.tobytes())
        i = j


def _tag(t: int, vals: list[int]) -> bytes:
    k = len(vals)
    return np.array([t, k, *vals] + [0] * k, dtype="<i4").tobytes()


def _write_tagged(fh, table: TraceTable, starts: np.ndarray, ks: np.ndarray, path: Any, state: dict) -> None:
    """The tagged body of :func:`write_strata` (everything after the format tag) for ``table``; ``state`` carries
    the last request and phase written (``req``, ``phase``) from one call to the next, so a trace written in parts
    cut at request changes (or, without windows, at record boundaries) gives the bytes of one call."""
    R = len(starts)
    if R == 0:
        return
    req = np.asarray(table.request)[starts]
    ph = np.asarray(table.phase)[starts]
    change = np.r_[True, (req[1:] != req[:-1]) | (ph[1:] != ph[:-1])]
    win = None
    if table.has_windows:
        rec = table.records
        win = np.asarray(rec.window if rec is not None else np.asarray(table.window)[starts], np.int64)
        rlay = np.asarray(rec.layer if rec is not None else np.asarray(table.layer)[starts], np.int64)
        change[1:] |= win[1:] != win[:-1]
    change = np.flatnonzero(change)
    seg_ends = np.r_[change[1:], R]
    prev_req, prev_ph = state.get("req"), state.get("phase")
    bound = run_start = 0  # record index after the last request/commit tag; first record of the open window
    for a, b in zip(change.tolist(), seg_ends.tolist()):
        if req[a] != prev_req:
            fh.write(_tag(TAG_REQUEST, [int(req[a])]))
            prev_req = req[a]
            bound = a
        if ph[a] != prev_ph:
            fh.write(_tag(TAG_PHASE, [int(ph[a])]))
            prev_ph = ph[a]
        if win is not None and win[a] >= 0 and (a == 0 or win[a - 1] != win[a] or req[a - 1] != req[a]):
            run_start = a
        _write_records(fh, table, a, b, starts, ks, path)
        if win is None or win[a] < 0 or (b < R and win[b] == win[a] and req[b] == req[a]):
            continue
        c = b - run_start
        lay = rlay[bound:b]
        span = int(lay.max() - lay.min()) + 1
        if run_start == bound:
            npos = -(-c // span)
        elif c % span == 0:
            npos = c // span
        else:
            raise StrataError(f"{path}: window {int(win[a])} (request {int(req[a])}) has {c} records after "
                              f"records outside windows, not a whole number of positions over {span} layers; "
                              f"a commit tag cannot close exactly its records (write parquet or csv to keep "
                              f"the windows)", path)
        fh.write(_tag(TAG_COMMIT, [int(win[a]), int(npos), 0]))
        bound = b
    state["req"], state["phase"] = prev_req, prev_ph


def write_strata(table: TraceTable, path: str | os.PathLike, tagged: bool = False) -> int:
    """Write a Strata ``--dump-routing`` file (atomically: ``<path>.tmp`` then rename). Returns the prefill
    entries left out (plain only; 0 for tagged).

    Plain: route records of the decode (and unknown-phase) entries only, as the engine's own dump: prefill entries
    are left out (:func:`drop_prefill`; the caller says how many); request, phase and verify windows are lost;
    positions are implied by order.
    Tagged: format tag version 1, then a request tag (-3) at every change of request and a phase tag (-5: 0
    prefill, 1 decode, 2 unknown) at every change of phase, so :func:`read_strata` gives back request and phase;
    when the table has verify windows (``table.window``), a commit tag (-1) ``[window, n_positions, 0]`` after
    the records of every window (a run of consecutive records of one request with one window id >= 0), with
    ``n_positions`` chosen so the reader's rule (module docstring) closes exactly those records: the window
    grouping round-trips (ids come back renumbered 0, 1, ... in order); the per-window count of accepted drafts
    is not kept and is written as 0. Rows of one record must be consecutive (as every reader makes them).

    Raises:
        StrataError: negative layers or ids, or k > 1024; a window that follows records outside windows in the
            same request without being a whole number of positions over their layers (no commit could close
            exactly its records; write Parquet or CSV to keep such windows); plain: a table whose entries are
            all prefill (the file would be empty).
    """
    _check_writable(table, path)
    dropped = 0
    if not tagged:
        n = len(table)
        table, dropped, _ = drop_prefill(table)
        if n and not len(table):
            raise all_prefill_error(path, n)
    starts = record_bounds(table)
    ks = np.diff(np.r_[starts, len(table)])
    with AtomicFile(path) as fh:
        if not tagged:
            _write_records(fh, table, 0, len(starts), starts, ks, path)
            return dropped
        fh.write(_tag(TAG_FORMAT, [1]))
        _write_tagged(fh, table, starts, ks, path, {})
    return 0
