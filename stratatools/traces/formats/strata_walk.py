"""Compiled record walker for Strata ``--dump-routing`` traces (plain and tagged, formats.md section 3).

One pass over the memory-mapped file as an int32 array finds record boundaries and tags, checks every record,
copies route ids/weights into the output columns and fills the per-record compact-form arrays (layer, k,
request, phase, verify window) with exactly the semantics of the chunked reader in :mod:`.strata` (its module
docstring states them: tag numbers, windows closed by commit tags, unit weights, and every refused case with
its byte offset). The chunked reader stays the reference: tests/test_trace_walk.py compares the two on random
and mutated streams (tables, meta, windows, identical one-line errors).

Why numba: record boundaries depend on every earlier record's ``k``, so finding them is a sequential scan; in
numpy it takes a Python-level step per run of equal-k records, which for tagged traces (a commit tag after
every verify window) means tens of thousands of steps. The walker is a plain loop compiled by numba (the same
dependency and cache fallback as :mod:`stratatools.core.jit`). Without numba, :func:`read_walk` is not
used (:data:`HAVE_NUMBA` is False) and :func:`stratatools.traces.formats.strata.read_strata` reads with the
chunked reader, which gives the same results; ``walk.py_func`` (the same code run as Python) is what the tests
use to check the uncompiled walker.

Memory: the file is mapped without pre-faulting and walked in chunks; the mapped pages of each finished chunk
are dropped from the process (``MADV_DONTNEED``; they stay in the page cache), so the peak is the output
columns (8 bytes per entry, about the file size) plus one chunk.
"""

from __future__ import annotations

import hashlib
import mmap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from stratatools.core.jit import HAVE_NUMBA, njit
from stratatools.core.errors import OtherModelInput, StrataError
from stratatools.traces.table import DECODE, UNKNOWN, TraceTable
from stratatools.traces.formats.strata_spec import (MAX_LAYER, MAX_ROUTE_K, MAX_TAG_K, TAG_FORMAT, TAG_NAMES, _err,
                                                    _expand, _k_error, _repeat_err)
from stratatools.traces.repeats import _first_in_span

__all__ = ["HAVE_NUMBA", "walk", "read_walk"]

WALK_CHUNK_BYTES = 64 << 20

# state slots shared between the walker and its driver (int64 array)
S_O, S_NREC, S_NENT, S_NTOTAL, S_NTAGS = 0, 1, 2, 3, 4
S_ERR, S_EOFF, S_EA, S_EB = 5, 6, 7, 8                  # first scan error: code, byte, two values
S_DERR, S_DOFF, S_DA = 9, 10, 11                        # first tag-payload error (raised after the scan)
S_K, S_KVAR = 12, 13                                    # first route k (0: none yet), another k seen
S_SEG, S_LO, S_HI = 14, 15, 16                          # window segment: first record, layer span
S_NWIN, S_REQ, S_PHASE, S_COMMITS, S_ACC, S_WREC = 17, 18, 19, 20, 21, 22
N_STATE = 24

# scan errors
E_K, E_LAYER, E_IDNEG, E_IDBIG, E_WEIGHT, E_REPEAT = 1, 4, 5, 6, 7, 8  # E_K: a refused k (byte: the record's start)
# tag-payload errors (deferred: the chunked reader raises them after scanning the whole file)
D_FMT_EMPTY, D_FMT_VERSION, D_REQUEST, D_PHASE, D_COMMIT = 1, 2, 3, 4, 5


@njit(cache=True, nogil=True)
def walk(a, end, st, max_route_k, n_layers, n_expert, tagged, version1, expert, weight, rec_layer, rec_k,
         rec_req, rec_phase, rec_win, tags):
    """Walk the records of ``a`` (int32 [W], the whole file) starting at word ``st[S_O]``, as long as a record
    starts before word ``end``. ``weight`` is the float32 output column viewed as int32 (bits are copied).
    ``n_layers``/``n_expert`` are -1 when unknown. ``tagged``: the first record is a format tag; ``version1``:
    its version is 1 (phase tags give phases) rather than 2+ (commit tags give them).

    Returns 0 when it reached ``end``; 1 when the next record does not fit in the file (``st[S_O]`` is where
    it starts; the driver reports the cut); 2 on a bad record (``st[S_ERR..S_EB]``). Tag-payload problems are
    recorded in ``st[S_DERR..S_DA]`` (first one only) and the walk goes on, as the chunked reader checks them
    after the scan. Word, entry and record indices are uint64 (no negative-index wraparound code in the loops;
    every sum stays uint64, never mixed with signed values).
    """
    U1 = np.uint64(1)
    U2 = np.uint64(2)
    U3 = np.uint64(3)
    U4 = np.uint64(4)
    U5 = np.uint64(5)
    W = np.uint64(a.shape[0])
    endu = np.uint64(end)
    o = np.uint64(st[S_O])
    n = np.uint64(st[S_NREC])
    ne = np.uint64(st[S_NENT])
    nt = np.uint64(st[S_NTAGS])
    seg = np.uint64(st[S_SEG])
    ntot = st[S_NTOTAL]
    lo = st[S_LO]
    hi = st[S_HI]
    nwin = st[S_NWIN]
    req = st[S_REQ]
    phase = st[S_PHASE]
    kfirst = st[S_K]
    kvar = st[S_KVAR]
    status = 0
    bound = np.uint32(0x80000000)
    while o < endu:
        if o + U2 > W:
            status = 1
            break
        layer = np.int64(a[o])
        k = np.int64(a[o + U1])
        off = np.int64(o) * 4
        if k < 0 or ((k < 1 or k > max_route_k) if layer >= 0 else k > MAX_TAG_K):  # as strata._k_error
            st[S_ERR] = E_K
            st[S_EOFF] = off
            st[S_EA] = layer
            st[S_EB] = k
            status = 2
            break
        ku = np.uint64(k)
        s = U2 + U2 * ku
        if o + s > W:
            status = 1
            break
        ntot += 1
        if layer < 0:
            tags[nt] = layer
            nt += U1
            if tagged:
                if o == 0:  # the format tag
                    if k == 0:
                        if st[S_DERR] == 0:
                            st[S_DERR] = D_FMT_EMPTY
                            st[S_DOFF] = 0
                    elif a[U2] < 1:
                        if st[S_DERR] == 0:
                            st[S_DERR] = D_FMT_VERSION
                            st[S_DOFF] = 8
                            st[S_DA] = a[U2]
                elif layer == -3:  # request
                    if k < 1:
                        if st[S_DERR] == 0:
                            st[S_DERR] = D_REQUEST
                            st[S_DOFF] = off
                    else:
                        req = np.int64(a[o + U2])
                        seg = n
                        lo = np.int64(1) << 40
                        hi = -1
                elif layer == -5:  # phase (version 1 only)
                    if version1:
                        if k < 1:
                            if st[S_DERR] == 0:
                                st[S_DERR] = D_PHASE
                                st[S_DOFF] = off
                        else:
                            pv = a[o + U2]
                            phase = 0 if pv == 0 else (1 if pv == 1 else 2)  # PREFILL, DECODE, UNKNOWN
                elif layer == -1:  # commit
                    if k < 3:
                        if st[S_DERR] == 0:
                            st[S_DERR] = D_COMMIT
                            st[S_DOFF] = off
                            st[S_DA] = k
                    else:
                        st[S_COMMITS] += 1
                        acc = np.int64(a[o + U4])
                        if acc > 0:
                            st[S_ACC] += acc
                        npos = np.int64(a[o + U3])
                        ph = 2
                        if k >= 4:
                            pv = a[o + U5]
                            ph = 0 if pv == 0 else (1 if pv == 1 else 2)
                        if npos > 0 and n > seg:
                            cnt = npos * (hi - lo + 1)
                            avail = np.int64(n - seg)
                            if cnt > avail:
                                cnt = avail
                            first = n - np.uint64(cnt)
                            for r in range(first, n):
                                rec_win[r] = nwin
                            if not version1:
                                for r in range(first, n):
                                    rec_phase[r] = ph
                            nwin += 1
                            st[S_WREC] += cnt
                        seg = n
                        lo = np.int64(1) << 40
                        hi = -1
            o += s
            continue
        if layer > MAX_LAYER:
            st[S_ERR] = E_LAYER
            st[S_EOFF] = off
            st[S_EA] = layer
            status = 2
            break
        # ids: negative ids are >= 2**31 as uint32; the expert bound applies below n_layers (all layers if unknown).
        # Copy first, check after (branch-free loops): the largest id as uint32, the OR of the weights' magnitude
        # bits (0: all zero), the smallest "exponent xor all-ones" (0: an inf/NaN).
        lim = bound
        if n_expert >= 0 and (n_layers < 0 or layer < n_layers):
            lim = np.uint32(n_expert)
        io = o + U2
        mx = np.uint32(0)
        for c in range(ku):
            v = a[io + c]
            expert[ne + c] = v
            mx = max(mx, np.uint32(v))
        # an id twice in the record: rank of the first repeat (-1: none); the lower byte of this and a range
        # error is reported, as the chunked reader does
        rep = np.int64(-1)
        if k > 1:
            rep = _first_in_span(expert, np.int64(ne), np.int64(ne) + k)
            if rep >= 0:
                rep -= np.int64(ne)
        if mx >= lim:
            bad = np.int64(0)
            for c in range(k):
                if np.uint32(a[io + np.uint64(c)]) >= lim:
                    bad = c
                    break
            if rep < 0 or bad < rep:
                v = np.int64(a[io + np.uint64(bad)])
                st[S_ERR] = E_IDNEG if v < 0 else E_IDBIG
                st[S_EOFF] = off + 8 + 4 * bad
                st[S_EA] = v
                st[S_EB] = layer
                status = 2
                break
        if rep >= 0:
            st[S_ERR] = E_REPEAT
            st[S_EOFF] = off + 8 + 4 * rep
            st[S_EA] = np.int64(a[io + np.uint64(rep)])
            st[S_EB] = layer
            status = 2
            break
        wo = io + ku
        nz = np.int32(0)
        fin = np.int32(0x7F800000)
        for c in range(ku):
            b = a[wo + c]
            weight[ne + c] = b
            nz |= b & 0x7FFFFFFF
            fin = min(fin, (b & 0x7F800000) ^ 0x7F800000)
        if fin == 0:
            bad = np.int64(0)
            for c in range(k):
                if (a[wo + np.uint64(c)] & 0x7F800000) == 0x7F800000:
                    bad = c
                    break
            st[S_ERR] = E_WEIGHT
            st[S_EOFF] = off + 8 + 4 * k + 4 * bad
            st[S_EA] = a[wo + np.uint64(bad)]
            st[S_EB] = layer
            status = 2
            break
        if nz == 0:  # all weights zero (verify windows): unit weights
            for c in range(ku):
                weight[ne + c] = 0x3F800000
        ne += ku
        rec_layer[n] = layer
        rec_req[n] = req
        rec_phase[n] = phase
        rec_win[n] = -1
        if layer < lo:
            lo = layer
        if layer > hi:
            hi = layer
        if kfirst != k:  # rec_k is written once k varies (earlier records all had kfirst)
            if kfirst == 0:
                kfirst = k
            elif kvar == 0:
                kvar = 1
                for r in range(n):
                    rec_k[r] = kfirst
        if kvar:
            rec_k[n] = k
        n += U1
        o += s
    st[S_O] = np.int64(o)
    st[S_NREC] = np.int64(n)
    st[S_NENT] = np.int64(ne)
    st[S_NTOTAL] = ntot
    st[S_NTAGS] = np.int64(nt)
    st[S_SEG] = np.int64(seg)
    st[S_LO] = lo
    st[S_HI] = hi
    st[S_NWIN] = nwin
    st[S_REQ] = req
    st[S_PHASE] = phase
    st[S_K] = kfirst
    st[S_KVAR] = kvar
    return status


@njit(cache=True, nogil=True)
def _ordinal_insert(tab_key, tab_val, key, add):
    """Open-addressing table (any key but -1, which marks an empty slot; size a power of two): the value stored for ``key`` (0 when
    new), then add ``add`` to it. Returns (old value, 1 if the key was new)."""
    mask = tab_key.shape[0] - 1
    h = (key * np.int64(-7046029254386353131)) & mask
    while True:
        k = tab_key[h]
        if k == key:
            v = tab_val[h]
            tab_val[h] = v + add
            return v, 0
        if k == -1:
            tab_key[h] = key
            tab_val[h] = add
            return np.int64(0), 1
        h = (h + 1) & mask


@njit(cache=True, nogil=True)
def _ordinal_rehash(old_key, old_val, tab_key, tab_val):
    """Move every entry of one table into a larger empty one."""
    for i in range(old_key.shape[0]):
        if old_key[i] != -1:
            _ordinal_insert(tab_key, tab_val, old_key[i], old_val[i])


@njit(cache=True, nogil=True)
def expand_records(e, kvar, k_fixed, rec_k, rec_layer, rec_req, rec_phase, rec_win, tab_key, tab_val,
                   o_req, o_pos, o_phase, o_lay, o_rank, o_win, per_record=False):
    """The first ``e`` compact-form records as per-entry columns (one entry per route id): request, position
    (the record's ordinal among the earlier records of the same (request, layer), counted in the table
    ``tab_key``/``tab_val`` carried across chunks: key request x 8192 + layer), phase, layer, rank (0..k-1)
    and window. ``per_record``: one row per record instead, its ``k`` in ``o_rank``. Returns (rows written,
    keys added to the table); the caller keeps the table at most half full (:func:`_ordinal_rehash`)."""
    j = 0
    added = 0
    for i in range(e):
        la = np.int64(rec_layer[i])
        r = np.int64(rec_req[i])
        p, new = _ordinal_insert(tab_key, tab_val, r * 8192 + la, np.int64(1))
        added += new
        k = np.int64(rec_k[i]) if kvar else k_fixed
        ph = rec_phase[i]
        w = np.int64(rec_win[i])
        if per_record:
            o_req[j] = r
            o_pos[j] = p
            o_phase[j] = ph
            o_lay[j] = la
            o_rank[j] = k
            o_win[j] = w
            j += 1
            continue
        for q in range(k):
            o_req[j] = r
            o_pos[j] = p
            o_phase[j] = ph
            o_lay[j] = la
            o_rank[j] = q
            o_win[j] = w
            j += 1
    return j, added


def _scan_error(path: Any, st: np.ndarray, n_expert: int | None, max_route_k: int) -> StrataError:
    code, off, va, vb = (int(x) for x in st[[S_ERR, S_EOFF, S_EA, S_EB]])
    if code == E_K:
        return _k_error(path, va, vb, off, max_route_k)
    if code == E_LAYER:
        return _err(path, off, f"layer {va} is out of range (above {MAX_LAYER})",
                    "the file is corrupt or not a Strata routing trace")
    if code == E_IDNEG:
        return _err(path, off, f"expert id {va} is negative (layer {vb})", "the file is corrupt")
    if code == E_REPEAT:
        return _repeat_err(path, off, va, vb)
    if code == E_IDBIG:
        return _err(path, off, f"expert id {va} of layer {vb} is out of range for {n_expert} experts",
                    "the trace is for a model with more experts; check --n-expert / --model", OtherModelInput)
    w = float(np.array([va], np.int64).astype(np.int32).view(np.float32)[0])
    return _err(path, off, f"router weight {w} is not finite (layer {vb})", "the file is corrupt")


def _tag_error(path: Any, st: np.ndarray) -> StrataError:
    code, off, va = (int(x) for x in st[[S_DERR, S_DOFF, S_DA]])
    if code == D_FMT_EMPTY:
        return _err(path, 0, "format tag (-2) carries no version", "the file is corrupt")
    if code == D_FMT_VERSION:
        return _err(path, 8, f"format version {va} is not a positive number", "the file is corrupt")
    if code == D_REQUEST:
        return _err(path, off, "request tag (-3) carries no request id", "the file is corrupt")
    if code == D_PHASE:
        return _err(path, off, "phase tag (-5) carries no phase", "the file is corrupt")
    return _err(path, off, f"commit tag (-1) carries {va} values, expected 3 or 4", "the file is corrupt")


def _cut_error(path: Any, a: np.ndarray, o: int, size: int, max_route_k: int) -> StrataError:
    """The record at word ``o`` does not fit before the end of the file (chunked reader's ``_cut``)."""
    off = 4 * o
    n = size - off
    fix = "the trace was truncated; drop the partial last record or re-record"
    if n < 8:
        return _err(path, off, f"record cut inside its header ({n} of 8 bytes before the end of the file)", fix)
    layer, k = int(a[o]), int(a[o + 1])
    need = 8 + 8 * k
    part = "ids" if n < 8 + 4 * k else "weights"
    return _err(path, off, f"record (layer {layer}, k {k}) cut inside its {part}: {n} of {need} bytes before the "
                f"end of the file", fix)


def _counts(values: np.ndarray) -> list[tuple[int, int]]:
    """(value, count) of an int array in order of first occurrence."""
    if len(values) == 0:
        return []
    u, first, cnt = np.unique(values, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    return [(int(u[i]), int(cnt[i])) for i in order]


def _map(path: Path, size: int):
    try:
        with open(path, "rb") as fh:
            return mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None


def read_walk(path: Path, size: int, n_layers: int | None, n_expert: int | None, sha256: bool,
              chunk_bytes: int = WALK_CHUNK_BYTES, kernel: Any = None) -> TraceTable | None:
    """Read a Strata trace (plain or tagged) with :func:`walk`; same table, meta and errors as the chunked
    reader (:func:`stratatools.traces.formats.strata._read_strata`). Returns None when the file cannot be
    mapped or is shorter than one record header (the chunked reader then reads it).

    Args:
        path, size: the trace file and its size in bytes (> 0).
        n_layers, n_expert: as for :func:`stratatools.traces.formats.strata.read_strata`.
        sha256: hash the file as it is walked (``meta["source_sha256"]``).
        chunk_bytes: bytes walked between drops of the mapped pages (memory: output columns + one chunk).
        kernel: the walker to run (tests pass ``walk.py_func``, the uncompiled code); default :func:`walk`.
    Raises:
        StrataError: every case the chunked reader refuses, with the same one-line message.
    """
    if size < 8:
        return None
    mm = _map(path, size)
    if mm is None:
        return None
    W = size // 4
    a = np.frombuffer(mm, dtype="<i4", count=W)
    kern = walk if kernel is None else kernel
    max_route_k = MAX_ROUTE_K if n_expert is None else min(MAX_ROUTE_K, int(n_expert))
    layer0, k0 = int(a[0]), int(a[1])
    tagged = layer0 == TAG_FORMAT and k0 >= 0
    version = int(a[2]) if tagged and k0 >= 1 and W >= 3 else 0
    version1 = version == 1
    # upper bounds (every entry takes >= 8 bytes, every record >= 8); untouched pages cost no memory
    cap_ent, cap_rec = size // 8 + 1, size // 16 + 1
    expert = np.empty(cap_ent, np.int32)
    weight = np.empty(cap_ent, np.float32)
    rec_layer = np.empty(cap_rec, np.int16)
    rec_k = np.empty(cap_rec, np.int32)
    rec_req = np.empty(cap_rec, np.int32)
    rec_phase = np.empty(cap_rec, np.int8)
    rec_win = np.empty(cap_rec, np.int32)
    tags = np.empty(W // 2 + 1, np.int32)
    st = np.zeros(N_STATE, np.int64)
    st[S_LO], st[S_HI] = 1 << 40, -1
    st[S_REQ] = 0
    st[S_PHASE] = (UNKNOWN if tagged else DECODE)
    h = hashlib.sha256() if sha256 else None
    mv = memoryview(mm)
    chunk_w = max(int(chunk_bytes) // 4, 64)
    can_drop = hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED")
    # the hash runs in a second thread, one chunk behind the walker (both release the GIL); a chunk's pages are
    # dropped once both have passed them
    pool = ThreadPoolExecutor(1) if h is not None else None
    pending: list = []  # (future, end byte) of hash updates in flight, oldest first
    hashed = dropped = 0  # bytes submitted to the hash; bytes whose pages are dropped
    safe = 0              # bytes both walked and hashed
    status = 0
    wv = weight.view(np.int32)
    try:
        while status == 0 and int(st[S_O]) < W:
            end = min(int(st[S_O]) + chunk_w, W)
            status = kern(a, end, st, max_route_k, -1 if n_layers is None else int(n_layers),
                          -1 if n_expert is None else int(n_expert), tagged, version1, expert, wv, rec_layer,
                          rec_k, rec_req, rec_phase, rec_win, tags)
            done = 4 * int(st[S_O])
            if pool is not None:
                while pending and pending[0][0].done() or len(pending) > 1:  # at most one chunk behind
                    fut, upto = pending.pop(0)
                    fut.result()
                    safe = upto
                if status == 0 and done > hashed:
                    pending.append((pool.submit(h.update, mv[hashed:done]), done))
                    hashed = done
            else:
                safe = done
            pg = safe // mmap.PAGESIZE * mmap.PAGESIZE
            if can_drop and pg > dropped:
                mm.madvise(mmap.MADV_DONTNEED, dropped, pg - dropped)  # pages stay in the page cache
                dropped = pg
        if pool is not None:
            for fut, _ in pending:
                fut.result()
            pending = []
        if status == 2:
            raise _scan_error(path, st, n_expert, max_route_k)
        o = int(st[S_O])
        if status == 1 or 4 * o < size:
            raise _cut_error(path, a, o, size, max_route_k)
        if st[S_DERR]:
            raise _tag_error(path, st)
        if h is not None:
            h.update(mv[hashed:size])
        sha = h.hexdigest() if h is not None else None
    finally:
        if pool is not None:
            for fut, _ in pending:  # never unmap under a running hash
                fut.exception()
            pool.shutdown(wait=True)
        del a, mv, wv
        try:
            mm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes when it does
            pass

    n, n_ent, nt = int(st[S_NREC]), int(st[S_NENT]), int(st[S_NTAGS])
    expert.resize(n_ent, refcheck=False)
    weight.resize(n_ent, refcheck=False)
    for arr in (rec_layer, rec_req, rec_phase, rec_win):
        arr.resize(n, refcheck=False)
    const_k = n > 0 and not st[S_KVAR]
    if const_k:
        del rec_k
        k_out: Any = int(st[S_K])
    else:
        rec_k.resize(n, refcheck=False)
        k_out = rec_k
    tags.resize(nt, refcheck=False)

    meta: dict[str, Any] = {"source_format": "strata-tagged" if tagged else "strata", "source_path": str(path),
                            "source_sha256": sha, "source_bytes": size, "records": int(st[S_NTOTAL]),
                            "route_records": n}
    if n_layers is not None:
        meta["n_layers"] = int(n_layers)
    if n_expert is not None:
        meta["n_expert"] = int(n_expert)
    if const_k:
        meta["k"] = int(st[S_K])
    tag_counts: dict[str, int] = {}
    skipped: dict[str, int] = {}
    rec_window = None
    if not tagged:
        for t, c in _counts(tags):
            skipped[str(t)] = c
    else:
        meta["version"] = version
        if version not in (1, 2):
            meta["version_note"] = f"format version {version} is newer than 2; read with version 2 rules"
        for t, c in _counts(tags[1:]):
            name = TAG_NAMES.get(t)
            if name is None or t == TAG_FORMAT:
                skipped[str(t)] = c
            else:
                tag_counts[name] = c
        meta["commits"] = int(st[S_COMMITS])
        meta["accepted_drafts"] = int(st[S_ACC])
        if st[S_NWIN]:
            rec_window = rec_win
            meta["windows"] = int(st[S_NWIN])
            meta["window_records"] = int(st[S_WREC])
    meta["tags"] = tag_counts
    meta["tags_skipped"] = skipped
    if n_ent == 0:
        return TraceTable.empty(**meta)
    return _expand(expert, weight, rec_layer, k_out, rec_req, rec_phase, meta, window=rec_window)
