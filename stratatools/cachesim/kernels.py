"""Compiled batch replay: the rules of :mod:`.tiers`, run over a whole entry stream at once.

Why numba: the static tier is a table look-up and vectorises in plain numpy, but LRU, LFU, LFRU, Belady and
the adaptive tier carry state from one entry to the next (an eviction changes every later answer), and the
adaptive tier's swap step sorts per layer every few rounds; pure numpy cannot express that without a
Python-level loop per entry or per round, which is orders of magnitude short of the targets (bench/
bench_cachesim.py measures the per-entry Python loop as its baseline). numba (a well-kept JIT on PyPI, wheels
for CPython 3.10-3.13, supports numpy 2.4 from numba 0.63 on; checked with numba 0.68.1 / numpy 2.4.6)
compiles these loops; it is a plain PyPI dependency, so a fresh machine installs it with the project.
When numba cannot be imported the same functions run as ordinary Python (slow, same results), and
:data:`HAVE_NUMBA` says so.

Every kernel walks entries in trace order; ``rnd[i]`` is entry i's round number, and a change of round
between two entries means ``end_round()`` (the rounds a tier counts are the rounds that carry entries).

Streaming: each policy has a ``*_chunk`` kernel that replays one chunk of entries into a caller-owned hits
array [n] and adds its copies to a caller-owned ``loads`` int64 [L]; everything the policy carries from one
entry to the next (residency, recency lists, counts, pool budget, round counters in a small int64 ``st``
array) lives in arrays the caller passes again with the next chunk, so a trace is replayed in chunks of any
size with results equal to one call over the whole stream (tests/test_cachesim_stream.py). The adaptive tier
ends its last round with :func:`adaptive_end`. The ``*_kernel`` functions are the whole-stream wrappers
(one chunk), each returning ``hits`` (bool [N]) and ``loads`` (int64 [L], host->VRAM copies).
Equality with the online objects is tested in tests/test_cachesim_equiv.py.
"""

from __future__ import annotations

import numpy as np

from stratatools.core.jit import HAVE_NUMBA, njit  # noqa: F401  (HAVE_NUMBA re-exported)


@njit(cache=True, nogil=True)
def _scale_all(a, f):
    """``a *= f`` over a 2-D array, in place (the decay of the adaptive tier's usage and the LFU/LFRU counts)."""
    for x in range(a.shape[0]):
        for y in range(a.shape[1]):
            a[x, y] *= f



@njit(cache=True, nogil=True)
def static_chunk(layer, expert, res, cap, occupied, pool, slot_bytes, per_layer, admit, hits, loads):
    """Static tier with arrival admission into free slots, over one chunk. ``res``/``cap``/``occupied`` and
    ``pool`` (int64 [2]: pool slots, pool bytes; -1 bytes = no byte budget) carry between chunks."""
    n = layer.shape[0]
    pool_slots = pool[0]
    pool_bytes = pool[1]
    for i in range(n):
        l = layer[i]
        e = expert[i]
        if res[l, e]:
            hits[i] = True
            continue
        hits[i] = False
        if not admit:
            continue
        if per_layer:
            if occupied[l] >= cap[l]:
                continue
        else:
            if pool_slots == 0:
                continue
            if pool_bytes >= 0:
                if pool_bytes < slot_bytes[l]:
                    pool_slots = 0
                    continue
                pool_bytes -= slot_bytes[l]
            if pool_slots > 0:
                pool_slots -= 1
            cap[l] += 1
        res[l, e] = True
        occupied[l] += 1
        loads[l] += 1
    pool[0] = pool_slots
    pool[1] = pool_bytes


def static_kernel(layer, expert, res, cap, occupied, pool_slots, pool_bytes, slot_bytes, per_layer, admit):
    """Static tier over a whole stream (:func:`static_chunk`). ``res``/``cap``/``occupied`` are modified."""
    hits = np.zeros(len(layer), dtype=np.bool_)
    loads = np.zeros(len(cap), dtype=np.int64)
    pool = np.array([pool_slots, pool_bytes], dtype=np.int64)
    static_chunk(layer, expert, res, cap, occupied, pool, slot_bytes, per_layer, admit, hits, loads)
    return hits, loads


@njit(cache=True, nogil=True)
def _adapt_step(res, usage, cap, occupied, per_layer, floor, margin, max_moves, inflight_l, inflight_e, loads):
    L, E = usage.shape
    mg = np.zeros(L * E, dtype=np.float64)
    ml = np.zeros(L * E, dtype=np.int64)
    mc = np.zeros(L * E, dtype=np.int64)
    mv = np.zeros(L * E, dtype=np.int64)
    nm = 0
    cand = np.empty(E, dtype=np.int64)
    vict = np.empty(E, dtype=np.int64)
    key = np.empty(E, dtype=np.float64)
    for l in range(L):
        nc = 0
        nv = 0
        for e in range(E):
            if res[l, e]:
                vict[nv] = e
                nv += 1
            elif usage[l, e] >= floor:
                cand[nc] = e
                nc += 1
        if nc == 0:
            continue
        for j in range(nc):
            key[j] = -usage[l, cand[j]]
        oc = np.argsort(key[:nc], kind="mergesort")
        cs = cand[:nc][oc]
        for j in range(nv):
            key[j] = usage[l, vict[j]]
        ov = np.argsort(key[:nv], kind="mergesort")
        vs = vict[:nv][ov]
        free = cap[l] - occupied[l] if per_layer else 0
        if free < 0:
            free = 0
        nf = min(free, nc)
        for j in range(nf):
            mg[nm] = usage[l, cs[j]]
            ml[nm] = l
            mc[nm] = cs[j]
            mv[nm] = -1
            nm += 1
        for j in range(nc - nf):
            if j >= nv:
                break
            c = cs[nf + j]
            v = vs[j]
            if not (usage[l, c] > usage[l, v] + margin):
                break
            mg[nm] = usage[l, c] - usage[l, v]
            ml[nm] = l
            mc[nm] = c
            mv[nm] = v
            nm += 1
    order = np.argsort(-mg[:nm], kind="mergesort")
    nin = 0
    swaps = 0
    for t in range(min(nm, max_moves)):
        m = order[t]
        l = ml[m]
        if mv[m] >= 0:
            res[l, mv[m]] = False
            swaps += 1
        else:
            occupied[l] += 1
        inflight_l[nin] = l
        inflight_e[nin] = mc[m]
        nin += 1
        loads[l] += 1
    return nin, swaps



# adaptive state ``st`` (int64 [8]): in-flight copies, landing round, rounds, steps, swaps, has_prev, prev_rnd,
# pool slots; plus pool bytes in ``pool`` and the usage / in-flight arrays.
ADAPTIVE_ST = 7


@njit(cache=True, nogil=True)
def _adaptive_end_round(res, cap, occupied, per_layer, floor, margin, adapt_every, max_moves, decay, copy_delay,
                        usage, infl_l, infl_e, st, loads):
    st[2] += 1  # rounds
    if st[2] % adapt_every == 0 and st[0] == 0:
        nin, sw = _adapt_step(res, usage, cap, occupied, per_layer, floor, margin, max_moves, infl_l, infl_e,
                              loads)
        st[0] = nin
        st[4] += sw
        _scale_all(usage, decay)
        st[3] += 1
        st[1] = st[2] + copy_delay
    if st[0] > 0 and st[2] >= st[1]:
        for t in range(st[0]):
            res[infl_l[t], infl_e[t]] = True
        st[0] = 0


@njit(cache=True, nogil=True)
def adaptive_chunk(layer, expert, rnd, res, cap, occupied, pool, slot_bytes, per_layer, admit, floor, margin,
                   adapt_every, max_moves, decay, copy_delay, usage, infl_l, infl_e, st, hits, loads):
    """Static tier + Strata's adaptive swaps (rules in :mod:`.tiers`) over one chunk; state carried in
    ``res``/``cap``/``occupied``/``pool``/``usage``/``infl_*``/``st`` (see :func:`adaptive_state`)."""
    n = layer.shape[0]
    pool_slots = pool[0]
    pool_bytes = pool[1]
    for i in range(n):
        if st[5] != 0 and rnd[i] != st[6]:
            _adaptive_end_round(res, cap, occupied, per_layer, floor, margin, adapt_every, max_moves, decay,
                                copy_delay, usage, infl_l, infl_e, st, loads)
        st[5] = 1
        st[6] = rnd[i]
        l = layer[i]
        e = expert[i]
        if res[l, e]:
            hits[i] = True
        else:
            hits[i] = False
            if admit:
                ok = True
                if per_layer:
                    if occupied[l] >= cap[l]:
                        ok = False
                else:
                    if pool_slots == 0:
                        ok = False
                    elif pool_bytes >= 0:
                        if pool_bytes < slot_bytes[l]:
                            pool_slots = 0
                            ok = False
                        else:
                            pool_bytes -= slot_bytes[l]
                    if ok:
                        if pool_slots > 0:
                            pool_slots -= 1
                        cap[l] += 1
                if ok:
                    res[l, e] = True
                    occupied[l] += 1
                    loads[l] += 1
        usage[l, e] += 1.0
    pool[0] = pool_slots
    pool[1] = pool_bytes


def adaptive_state(n_layers, n_expert, max_moves):
    """Fresh adaptive carry: (usage float64 [L, E], in-flight layer/expert int64 [M], st) with
    M = max(min(max_moves, L x E), 1): one adaptation offers each (layer, expert) at most once, so no more than
    L x E copies are ever in flight, whatever ``max_moves`` (``--adapt-swaps``, up to 2**31 - 1) says."""
    m = max(min(int(max_moves), int(n_layers) * int(n_expert)), 1)
    return (np.zeros((n_layers, n_expert), dtype=np.float64), np.empty(m, dtype=np.int64),
            np.empty(m, dtype=np.int64), np.zeros(ADAPTIVE_ST, dtype=np.int64))


def adaptive_end(res, cap, occupied, per_layer, floor, margin, adapt_every, max_moves, decay, copy_delay, usage,
                 infl_l, infl_e, st, loads):
    """End the stream's last round (the adaptive tier's final ``end_round``)."""
    _adaptive_end_round(res, cap, occupied, per_layer, floor, margin, adapt_every, max_moves, decay, copy_delay,
                        usage, infl_l, infl_e, st, loads)


def adaptive_kernel(layer, expert, rnd, res, cap, occupied, pool_slots, pool_bytes, slot_bytes, per_layer, admit,
                    floor, margin, adapt_every, max_moves, decay, copy_delay):
    """Adaptive tier over a whole stream (:func:`adaptive_chunk` + :func:`adaptive_end`). Returns hits, loads,
    steps, swaps."""
    L, E = res.shape
    hits = np.zeros(len(layer), dtype=np.bool_)
    loads = np.zeros(L, dtype=np.int64)
    pool = np.array([pool_slots, pool_bytes], dtype=np.int64)
    usage, il, ie, st = adaptive_state(L, E, max_moves)
    args = (floor, margin, adapt_every, max_moves, decay, copy_delay, usage, il, ie, st)
    adaptive_chunk(layer, expert, rnd, res, cap, occupied, pool, slot_bytes, per_layer, admit, *args, hits, loads)
    adaptive_end(res, cap, occupied, per_layer, *args, loads)
    return hits, loads, int(st[3]), int(st[4])


def lru_state(n_layers, n_expert):
    """Fresh LRU carry: prv, nxt (int64 [L, E]), inl (bool [L, E]), head, tail, size (int64 [L])."""
    L, E = n_layers, n_expert
    return (np.full((L, E), -1, dtype=np.int64), np.full((L, E), -1, dtype=np.int64), np.zeros((L, E), np.bool_),
            np.full(L, -1, dtype=np.int64), np.full(L, -1, dtype=np.int64), np.zeros(L, dtype=np.int64))


@njit(cache=True, nogil=True)
def lru_chunk(layer, expert, cap, prv, nxt, inl, head, tail, size, hits, loads):
    """Per-layer LRU (doubly linked list per layer, O(1) per entry) over one chunk (state: :func:`lru_state`)."""
    n = layer.shape[0]
    for i in range(n):
        l = layer[i]
        e = expert[i]
        if inl[l, e]:
            hits[i] = True
            if tail[l] == e:
                continue
            p = prv[l, e]
            q = nxt[l, e]
            if p >= 0:
                nxt[l, p] = q
            else:
                head[l] = q
            prv[l, q] = p
            prv[l, e] = tail[l]
            nxt[l, e] = -1
            nxt[l, tail[l]] = e
            tail[l] = e
            continue
        hits[i] = False
        if cap[l] <= 0:
            continue
        if size[l] >= cap[l]:
            h = head[l]
            q = nxt[l, h]
            inl[l, h] = False
            head[l] = q
            if q >= 0:
                prv[l, q] = -1
            else:
                tail[l] = -1
            size[l] -= 1
        inl[l, e] = True
        prv[l, e] = tail[l]
        nxt[l, e] = -1
        if tail[l] >= 0:
            nxt[l, tail[l]] = e
        else:
            head[l] = e
        tail[l] = e
        size[l] += 1
        loads[l] += 1


def lru_kernel(layer, expert, cap, n_expert):
    """Per-layer LRU over a whole stream (:func:`lru_chunk`). Returns hits, loads."""
    L = len(cap)
    hits = np.zeros(len(layer), dtype=np.bool_)
    loads = np.zeros(L, dtype=np.int64)
    lru_chunk(np.asarray(layer, np.int64), np.asarray(expert, np.int64), np.asarray(cap, np.int64),
              *lru_state(L, n_expert), hits, loads)
    return hits, loads


@njit(cache=True, nogil=True)
def _argmin_count(members, ms, cnt):
    best = 0
    for j in range(1, ms):
        a = members[j]
        b = members[best]
        if cnt[a] < cnt[b] or (cnt[a] == cnt[b] and a < b):
            best = j
    return best



def lfu_state(n_layers, n_expert, cap):
    """Fresh LFU carry: cnt float64 [L, E], res bool [L, E], mem int64 [L, mc], ms int64 [L], st int64 [3]
    (rounds, has_prev, prev_rnd)."""
    L, E = n_layers, n_expert
    mc = max(1, min(int(np.max(cap)), E)) if L > 0 else 1  # a layer never holds more than E experts
    return (np.zeros((L, E), np.float64), np.zeros((L, E), np.bool_), np.zeros((L, mc), np.int64),
            np.zeros(L, np.int64), np.zeros(3, np.int64))


@njit(cache=True, nogil=True)
def lfu_chunk(layer, expert, rnd, cap, decay, decay_every, cnt, res, mem, ms, st, hits, loads):
    """Per-layer LFU with decayed counts (rules in :mod:`.tiers`) over one chunk (state: :func:`lfu_state`)."""
    n = layer.shape[0]
    for i in range(n):
        if st[1] != 0 and rnd[i] != st[2]:
            st[0] += 1
            if st[0] % decay_every == 0:
                _scale_all(cnt, decay)
        st[1] = 1
        st[2] = rnd[i]
        l = layer[i]
        e = expert[i]
        cnt[l, e] += 1.0
        if res[l, e]:
            hits[i] = True
            continue
        hits[i] = False
        if cap[l] <= 0:
            continue
        if ms[l] >= cap[l]:
            j = _argmin_count(mem[l], ms[l], cnt[l])
            res[l, mem[l, j]] = False
            mem[l, j] = mem[l, ms[l] - 1]
            ms[l] -= 1
        mem[l, ms[l]] = e
        ms[l] += 1
        res[l, e] = True
        loads[l] += 1


def lfu_kernel(layer, expert, rnd, cap, n_expert, decay, decay_every):
    """Per-layer LFU over a whole stream (:func:`lfu_chunk`). Returns hits, loads."""
    L = len(cap)
    hits = np.zeros(len(layer), dtype=np.bool_)
    loads = np.zeros(L, dtype=np.int64)
    lfu_chunk(layer, expert, rnd, cap, decay, decay_every, *lfu_state(L, n_expert, cap), hits, loads)
    return hits, loads


def lfru_state(n_layers, n_expert, ucap):
    """Fresh LFRU carry: cnt, where, prv, nxt [L, E], head, tail, psize [L], mem [L, mc], ms [L], st [3]."""
    L, E = n_layers, n_expert
    mc = max(1, min(int(np.max(ucap)) + 1, E + 1) if L > 0 else 1)  # at most E experts (+1 before an eviction)
    return (np.zeros((L, E), np.float64), np.zeros((L, E), np.int8), np.full((L, E), -1, np.int64),
            np.full((L, E), -1, np.int64), np.full(L, -1, np.int64), np.full(L, -1, np.int64),
            np.zeros(L, np.int64), np.zeros((L, mc), np.int64), np.zeros(L, np.int64), np.zeros(3, np.int64))


@njit(cache=True, nogil=True)
def lfru_chunk(layer, expert, rnd, pcap, ucap, decay, decay_every, cnt, where, prv, nxt, head, tail, psize, mem, ms,
               st, hits, loads):
    """Per-layer LFRU (privileged LRU + unprivileged decayed LFU; rules in :mod:`.tiers`) over one chunk
    (state: :func:`lfru_state`; ``where`` 0 absent, 1 privileged, 2 unprivileged)."""
    n = layer.shape[0]
    for i in range(n):
        if st[1] != 0 and rnd[i] != st[2]:
            st[0] += 1
            if st[0] % decay_every == 0:
                _scale_all(cnt, decay)
        st[1] = 1
        st[2] = rnd[i]
        l = layer[i]
        e = expert[i]
        cnt[l, e] += 1.0
        w = where[l, e]
        hits[i] = False
        if w == 1:
            hits[i] = True
            if tail[l] != e:
                p = prv[l, e]
                q = nxt[l, e]
                if p >= 0:
                    nxt[l, p] = q
                else:
                    head[l] = q
                prv[l, q] = p
                prv[l, e] = tail[l]
                nxt[l, e] = -1
                nxt[l, tail[l]] = e
                tail[l] = e
            continue
        if w == 2:
            hits[i] = True
            for j in range(ms[l]):
                if mem[l, j] == e:
                    for t in range(j, ms[l] - 1):
                        mem[l, t] = mem[l, t + 1]
                    ms[l] -= 1
                    break
        else:
            if pcap[l] + ucap[l] <= 0:
                continue
            loads[l] += 1
        # insert e as the most recent privileged expert
        where[l, e] = 1
        prv[l, e] = tail[l]
        nxt[l, e] = -1
        if tail[l] >= 0:
            nxt[l, tail[l]] = e
        else:
            head[l] = e
        tail[l] = e
        psize[l] += 1
        if psize[l] > pcap[l]:
            d = head[l]
            q = nxt[l, d]
            head[l] = q
            if q >= 0:
                prv[l, q] = -1
            else:
                tail[l] = -1
            psize[l] -= 1
            where[l, d] = 2
            mem[l, ms[l]] = d
            ms[l] += 1
            if ms[l] > ucap[l]:
                j = _argmin_count(mem[l], ms[l], cnt[l])
                where[l, mem[l, j]] = 0
                for t in range(j, ms[l] - 1):
                    mem[l, t] = mem[l, t + 1]
                ms[l] -= 1


def lfru_kernel(layer, expert, rnd, pcap, ucap, n_expert, decay, decay_every):
    """Per-layer LFRU over a whole stream (:func:`lfru_chunk`). Returns hits, loads."""
    L = len(pcap)
    hits = np.zeros(len(layer), dtype=np.bool_)
    loads = np.zeros(L, dtype=np.int64)
    lfru_chunk(layer, expert, rnd, pcap, ucap, decay, decay_every, *lfru_state(L, n_expert, ucap), hits, loads)
    return hits, loads


def belady_state(res, cap):
    """Belady's carry from a start-up fill ``res`` bool [L, E]: (mem int64 [L, mc], ms int64 [L]), the
    residents of every layer in expert order."""
    L, E = res.shape
    mc = max(1, min(int(np.max(cap)), E)) if L > 0 else 1  # a layer never holds more than E experts
    mem = np.zeros((L, mc), dtype=np.int64)
    ms = np.zeros(L, dtype=np.int64)
    for l in range(L):
        es = np.flatnonzero(res[l])
        mem[l, :len(es)] = es
        ms[l] = len(es)
    return mem, ms


@njit(cache=True, nogil=True)
def belady_chunk(layer, expert, nxt_use, res, cur_next, cap, mem, ms, hits, loads):
    """Per-layer Belady with bypass (rules in :mod:`.tiers`) over one chunk; ``nxt_use`` [n] is every entry's
    next use (global entry index, int64 max = never); ``res``/``cur_next``/``mem``/``ms`` carry."""
    n = layer.shape[0]
    for i in range(n):
        l = layer[i]
        e = expert[i]
        nu = nxt_use[i]
        if res[l, e]:
            hits[i] = True
            cur_next[l, e] = nu
            continue
        hits[i] = False
        cur_next[l, e] = nu
        if cap[l] <= 0:
            continue
        if ms[l] < cap[l]:
            mem[l, ms[l]] = e
            ms[l] += 1
            res[l, e] = True
            loads[l] += 1
            continue
        best = 0
        for j in range(1, ms[l]):
            a = mem[l, j]
            b = mem[l, best]
            if cur_next[l, a] > cur_next[l, b] or (cur_next[l, a] == cur_next[l, b] and a < b):
                best = j
        v = mem[l, best]
        if nu < cur_next[l, v]:
            res[l, v] = False
            mem[l, best] = e
            res[l, e] = True
            loads[l] += 1


def belady_kernel(layer, expert, nxt_use, res, cur_next, cap):
    """Per-layer Belady over a whole stream (:func:`belady_chunk`); ``res``/``cur_next`` are modified."""
    L, E = res.shape
    hits = np.zeros(len(layer), dtype=np.bool_)
    loads = np.zeros(L, dtype=np.int64)
    belady_chunk(layer, expert, nxt_use, res, cur_next, cap, *belady_state(res, cap), hits, loads)
    return hits, loads


@njit(cache=True, nogil=True)
def next_use_chunk(key, base, last, nxt):
    """Backward pass over one chunk of pair keys (``layer * E + expert``), the chunks taken last to first:
    ``nxt[i]`` = global index of the next entry with the same key (from ``last``, int64 [L*E], int64 max =
    never), then ``last[key[i]] = base + i``."""
    for i in range(key.shape[0] - 1, -1, -1):
        k = key[i]
        nxt[i] = last[k]
        last[k] = base + i


def belady_start(first_use, cap):
    """Belady's start-up fill from every pair's first use (int64 [L, E], int64 max = never): per layer the
    ``cap[l]`` experts used first. Returns bool [L, E]."""
    L, E = first_use.shape
    never = np.iinfo(np.int64).max
    res = np.zeros((L, E), dtype=np.bool_)
    for l in range(L):
        used = np.flatnonzero(first_use[l] != never)
        order = used[np.argsort(first_use[l, used], kind="stable")][: max(int(cap[l]), 0)]
        res[l, order] = True
    return res


def belady_prepare(layer, expert, n_layers, n_expert, cap):
    """Next use of every entry (index of the next entry with the same pair, or int64 max), Belady's start-up
    fill (per layer the ``cap[l]`` experts used first) and each pair's first use; one backward pass, equal to
    :func:`.tiers.next_uses` / :func:`.tiers.belady_start`."""
    never = np.iinfo(np.int64).max
    last = np.full(n_layers * n_expert, never, dtype=np.int64)
    nxt = np.empty(len(layer), dtype=np.int64)
    key = np.asarray(layer, np.int64) * n_expert + np.asarray(expert, np.int64)
    next_use_chunk(key, 0, last, nxt)
    first = last.reshape(n_layers, n_expert)
    return nxt, belady_start(first, cap), first


@njit(cache=True, nogil=True)
def metrics_chunk(layer, record, hits, le, lh, st):
    """Hit metrics of one chunk, accumulated: entries ``le`` and hits ``lh`` per layer (int64 [L]); ``st`` int64
    [5]: records closed, records closed with every entry a hit, has-open-record, open record id, open record's
    misses. Record ids are non-decreasing, so a record is one run (possibly continued in the next chunk)."""
    for i in range(layer.shape[0]):
        l = layer[i]
        le[l] += 1
        h = hits[i]
        if h:
            lh[l] += 1
        r = record[i]
        if st[2] == 0 or r != st[3]:
            if st[2] != 0:
                st[0] += 1
                if st[4] == 0:
                    st[1] += 1
            st[2] = 1
            st[3] = r
            st[4] = 0
        if not h:
            st[4] += 1


@njit(cache=True, nogil=True)
def summary_chunk(lay, ex, rnd, tok, req, cnt, has_cnt, light, n_expert, counts, st, o_tok, o_req):
    """What a stream's summary needs of one chunk of kept entries, in one loop: counted entries (``cnt``, all
    when not ``has_cnt``) and, unless ``light``, their (layer, expert) counts (``counts`` int64 [L*E], added);
    rounds (a change of ``rnd``), negative-token rounds; the runs of the counted positive tokens and of the
    request ids (written to ``o_tok`` / ``o_req``). ``st`` int64 [7] carries counted, rounds, (set, last
    round), negative rounds, (set, last negative token). Returns (token runs, request runs) written."""
    n = lay.shape[0]
    ntk = 0
    nrq = 0
    for i in range(n):
        r = rnd[i]
        if st[2] == 0 or r != st[3]:
            st[1] += 1
        st[2] = 1
        st[3] = r
        c = cnt[i] if has_cnt else True
        if c:
            st[0] += 1
        if light:
            continue
        if c:
            counts[lay[i] * n_expert + ex[i]] += 1
            t = tok[i]
            if t < 0:
                if st[5] == 0 or t != st[6]:
                    st[4] += 1
                st[5] = 1
                st[6] = t
            elif ntk == 0 or o_tok[ntk - 1] != t:
                o_tok[ntk] = t
                ntk += 1
        q = req[i]
        if nrq == 0 or o_req[nrq - 1] != q:
            o_req[nrq] = q
            nrq += 1
    return ntk, nrq


SCAN_ST = 10
"""Slots of :func:`scan_chunk`'s carried state: last entry (set, request, position, layer, rank, window), last
record (set, request, position, in a window)."""


@njit(cache=True, nogil=True)
def scan_chunk(req, pos, lay, rank, win, windows, st, out):
    """First pass of :func:`prepare_chunk`'s rules over one chunk: the requests with layer-major batches (a
    record outside windows whose position goes back from the previous record's of the same request, that one
    outside windows too). Records start as in :func:`prepare_chunk`; ``win`` is ignored unless ``windows``.
    Writes the request ids found to ``out`` (a request repeated in a row once) and returns how many; the last
    entry and record are carried in ``st`` (:data:`SCAN_ST` slots)."""
    n = req.shape[0]
    nb = 0
    for i in range(n):
        r = req[i]
        p = pos[i]
        la = lay[i]
        rk = rank[i]
        w = win[i] if windows else 0
        rs = st[0] == 0 or r != st[1] or p != st[2] or la != st[3] or rk <= st[4] or (windows and w != st[5])
        st[0] = 1
        st[1] = r
        st[2] = p
        st[3] = la
        st[4] = rk
        st[5] = w
        if rs:
            in_w = windows and w >= 0
            if st[6] != 0 and r == st[7] and (not in_w) and st[9] == 0 and p >= 0 and p < st[8]:
                if nb == 0 or out[nb - 1] != r:
                    out[nb] = r
                    nb += 1
            st[6] = 1
            st[7] = r
            st[8] = p
            st[9] = 1 if in_w else 0
    return nb


# prepare state ``st`` (int64 [16]): has_pe, pe_req, pe_pos, pe_lay, pe_rank, pe_win, has_pr, pr_req, pr_pos,
# pr_lay, pr_inw, pr_key, pr_bat, last_record, cur_round, cur_bat
PREP_ST = 16


@njit(cache=True, nogil=True)
def prepare_chunk(req, pos, lay, rank, win, phase, expert, windows, back, drop_prefill, mark_prefill, n_layers,
                  n_expert, st, o_lay, o_ex, o_rnd, o_rec, o_req, o_tok, o_cnt, counts):
    """Records, rounds and the kept entries of one chunk, the rules of :func:`.replay.prepare_entries` (module
    docstring there) with the previous chunk's last entry and record carried in ``st``. ``win`` is ignored
    unless ``windows``; ``back`` is the sorted request ids with layer-major batches. Writes the kept entries to
    the ``o_*`` arrays and returns how many; ``o_cnt`` (bool) says whether a kept entry is counted (False: a
    prefill entry replayed to warm the cache, with ``mark_prefill``); ``counts`` int64 [7]: skipped prefill,
    layer, expert; kept entries in a window, outside windows, in a batched record; kept but not counted
    (added)."""
    n = req.shape[0]
    nb = back.shape[0]
    k = 0
    for i in range(n):
        r = req[i]
        p = pos[i]
        la = lay[i]
        rk = rank[i]
        w = win[i] if windows else -1
        rs = st[0] == 0 or r != st[1] or p != st[2] or la != st[3] or rk <= st[4] or (windows and w != st[5])
        st[0] = 1
        st[1] = r
        st[2] = p
        st[3] = la
        st[4] = rk
        st[5] = w
        if rs:
            in_w = windows and w >= 0
            if in_w:
                key = w
            elif windows:
                key = p - (1 << 40)
            else:
                key = p
            bat = False
            if nb > 0 and not in_w:
                lo = 0
                hi = nb
                while lo < hi:
                    mid = (lo + hi) // 2
                    if back[mid] < r:
                        lo = mid + 1
                    else:
                        hi = mid
                bat = lo < nb and back[lo] == r
            if st[6] == 0:
                nr = True
            else:
                unknown = p < 0 and not in_w
                nr = r != st[7] or key != st[11] or (unknown and la <= st[9])
                if nb > 0 and bat and st[12] != 0 and r == st[7]:
                    nr = la < st[9]
            if nr:
                st[14] += 1
            st[13] += 1
            st[15] = 1 if bat else 0
            st[6] = 1
            st[7] = r
            st[8] = p
            st[9] = la
            st[10] = 1 if in_w else 0
            st[11] = key
            st[12] = 1 if bat else 0
        if drop_prefill and phase[i] == 0:
            counts[0] += 1
            continue
        if la < 0 or la >= n_layers:
            counts[1] += 1
            continue
        e = expert[i]
        if e < 0 or e >= n_expert:
            counts[2] += 1
            continue
        o_lay[k] = la
        o_ex[k] = e
        o_rnd[k] = st[14]
        o_rec[k] = st[13]
        o_req[k] = r
        o_tok[k] = r * 4294967296 + p if p >= 0 else -(st[14] + 1)
        if mark_prefill and phase[i] == 0:
            o_cnt[k] = False
            counts[6] += 1
        else:
            o_cnt[k] = True
        if windows:
            if w >= 0:
                counts[3] += 1
            else:
                counts[4] += 1
        if st[15] != 0:
            counts[5] += 1
        k += 1
    return k


@njit(cache=True, nogil=True)
def _moves_v2(t, R, C, O, upool, usage, per_layer, floor, margin, max_moves, excl, prefer, use_prefer,
              ql, qc, qv):
    """Moves of tier ``t`` into the queue arrays ``ql/qc/qv[t]``, best first, at most ``max_moves``; returns
    their count. Same rules and tie-breaks as ``AdaptiveTier._moves``."""
    L, E = usage.shape
    mg = np.zeros(L * E, dtype=np.float64)
    ml = np.zeros(L * E, dtype=np.int64)
    mc = np.zeros(L * E, dtype=np.int64)
    mv = np.zeros(L * E, dtype=np.int64)
    nm = 0
    cand = np.empty(E, dtype=np.int64)
    vict = np.empty(E, dtype=np.int64)
    key = np.empty(E, dtype=np.float64)
    ue = np.empty(E, dtype=np.float64)
    for l in range(L):
        nc = 0
        for e in range(E):
            if (not R[t, l, e]) and (not excl[l, e]) and usage[l, e] >= floor:
                cand[nc] = e
                nc += 1
        if nc == 0:
            continue
        nv = 0
        for e in range(E):  # victims listed preferred first, then by expert (the stable sort keeps that order)
            ue[e] = usage[l, e]
            if use_prefer and prefer[l, e]:
                ue[e] = 0.0
                if R[t, l, e]:
                    vict[nv] = e
                    nv += 1
        for e in range(E):
            if R[t, l, e] and not (use_prefer and prefer[l, e]):
                vict[nv] = e
                nv += 1
        for j in range(nc):
            key[j] = -usage[l, cand[j]]
        oc = np.argsort(key[:nc], kind="mergesort")
        cs = cand[:nc][oc]
        for j in range(nv):
            key[j] = ue[vict[j]]
        ov = np.argsort(key[:nv], kind="mergesort")
        vs = vict[:nv][ov]
        free = C[t, l] - O[t, l] if per_layer else upool[t]
        if free < 0:
            free = 0
        nf = min(free, nc)
        for j in range(nf):
            mg[nm] = usage[l, cs[j]]
            ml[nm] = l
            mc[nm] = cs[j]
            mv[nm] = -1
            nm += 1
        for j in range(nc - nf):
            if j >= nv:
                break
            c = cs[nf + j]
            v = vs[j]
            if not (usage[l, c] > ue[v] + margin):
                break
            mg[nm] = usage[l, c] - ue[v]
            ml[nm] = l
            mc[nm] = c
            mv[nm] = v
            nm += 1
    order = np.argsort(-mg[:nm], kind="mergesort")
    n = min(nm, max_moves)
    for t2 in range(n):
        m = order[t2]
        ql[t, t2] = ml[m]
        qc[t, t2] = mc[m]
        qv[t, t2] = mv[m]
    return n


V2_ST = 14
"""Scalar slots of :func:`adaptive_v2_chunk`'s carried state: rounds, steps, swaps, dropped moves, upper-tier
hits, landing round, copies in flight, free pool slots, free pool bytes, (set, last round id), lag entries held,
current dense round, (unused)."""


def adaptive_v2_state(T: int, L: int, E: int, max_moves: int, copy_delay: int, pool_slots: int, pool_bytes: int):
    """Carried state of :func:`adaptive_v2_chunk` (usage, loading, move queues, copies in flight, scalars)."""
    # a step queues at most one move per (layer, candidate expert), and a copy is in flight at most once per (tier,
    # layer, expert) (``loading``): the queues and the copy list never need more, whatever max_moves / copy_delay say
    M = max(min(int(max_moves), L * E), 1)
    cap_f = min(T * M * (int(copy_delay) + 2), T * L * E) + 1
    S = np.zeros(V2_ST, np.int64)
    S[5] = -1
    S[7], S[8] = int(pool_slots), int(pool_bytes)
    return (np.zeros((L, E), np.float64), np.zeros((T, L, E), np.bool_), np.zeros((T, M), np.int64),
            np.zeros((T, M), np.int64), np.zeros((T, M), np.int64), np.zeros(T, np.int64), np.zeros(T, np.int64),
            np.zeros(cap_f, np.int64), np.zeros(cap_f, np.int64), np.zeros(cap_f, np.int64),
            np.zeros(cap_f, np.int64), np.zeros((L, E), np.bool_), S)


@njit(cache=True, nogil=True)
def adaptive_v2_chunk(layer, expert, rnd, final, R, C, O, upool, slot_bytes, per_layer, admit, floor, margin,
                      adapt_every, max_moves, decay, copy_delay, lag, pace, disjoint, usage, loading, ql, qc, qv, qn,
                      qp, ft, fl, fe, fland, excl, S, pend_l, pend_e, pend_q, hits, loads):
    """Adaptive tier with Strata 0.2.x knobs (``tiers.AdaptiveTier`` rules) over one chunk of entries, the state
    carried between chunks (:func:`adaptive_v2_state`): ``rnd`` int64 [n] round ids (non-decreasing; a change
    ends a round); ``final``: the stream ends after this chunk (its last round ends). ``R`` bool [T, L, E],
    ``C``/``O`` int64 [T, L] (tier 0, then the upper tier when T = 2) are modified; ``upool`` int64 [T]: free
    slots of a global-admission tier its moves may take (0 for tier 0). ``pace`` <= 0 = unpaced. With
    ``lag`` > 1 the entries whose counts are not yet visible wait in ``pend_l/pend_e/pend_q`` (capacity at least
    the held count ``S[11]`` + n; memory: the entries of the last ``lag`` rounds). Writes ``hits`` bool [n],
    adds copies to ``loads`` int64 [L]."""
    n = layer.shape[0]
    T, L, E = R.shape
    rounds = S[0]
    steps = S[1]
    swaps = S[2]
    dropped = S[3]
    upper_hits = S[4]
    land_at = S[5]
    nfl = S[6]
    pool_slots = S[7]
    pool_bytes = S[8]
    has_prev = S[9]
    prev = S[10]
    npend = S[11]
    q_cur = S[12]
    pj = 0  # lag > 1: next held entry whose count is not yet visible
    for i in range(n + 1):
        if i == n:
            if not final:
                break
            boundary = True
        else:
            boundary = has_prev != 0 and rnd[i] != prev
        if boundary:
            rounds += 1
            r = rounds
            if lag > 1:
                while pj < npend and pend_q[pj] + lag <= r:
                    usage[pend_l[pj], pend_e[pj]] += 1.0
                    pj += 1
            do_adapt = (r % adapt_every == 0) and (pace > 0 or nfl == 0)
            if do_adapt:
                for t in range(T):
                    dropped += qn[t] - qp[t]
                    qn[t] = 0
                    qp[t] = 0
                for t in range(T):
                    for l in range(L):
                        for e in range(E):
                            excl[l, e] = loading[t, l, e]
                            if T > 1 and t == 0:
                                excl[l, e] = excl[l, e] or R[1, l, e] or loading[1, l, e]
                            elif t == 1 and disjoint:
                                excl[l, e] = excl[l, e] or R[0, l, e] or loading[0, l, e]
                    if t == 1 and disjoint:
                        for q in range(qp[0], qn[0]):
                            excl[ql[0, q], qc[0, q]] = True
                    qn[t] = _moves_v2(t, R, C, O, upool, usage, per_layer, floor, margin, max_moves, excl,
                                      R[1] if T > 1 else R[0], T > 1 and t == 0, ql, qc, qv)
                    qp[t] = 0
                    if pace <= 0:
                        # unpaced: submit every move now (pump without a budget)
                        for q in range(qn[t]):
                            l = ql[t, q]
                            c = qc[t, q]
                            v = qv[t, q]
                            ok = not (R[t, l, c] or loading[t, l, c])
                            if ok and T > 1 and (t == 0 or disjoint):
                                ok = not (R[1 - t, l, c] or loading[1 - t, l, c])
                            if ok:
                                if v >= 0:
                                    ok = R[t, l, v]
                                elif per_layer:
                                    ok = O[t, l] < C[t, l]
                                else:
                                    ok = upool[t] > 0
                            if not ok:
                                dropped += 1
                                continue
                            if v >= 0:
                                R[t, l, v] = False
                                swaps += 1
                            else:
                                O[t, l] += 1
                                if not per_layer:
                                    upool[t] -= 1
                                    C[t, l] += 1
                            loading[t, l, c] = True
                            ft[nfl] = t
                            fl[nfl] = l
                            fe[nfl] = c
                            fland[nfl] = r + copy_delay
                            nfl += 1
                            loads[l] += 1
                        qp[t] = qn[t]
                _scale_all(usage, decay)
                steps += 1
                land_at = r + copy_delay
            if pace > 0:
                for t in range(T):
                    sent = 0
                    while qp[t] < qn[t]:
                        q = qp[t]
                        l = ql[t, q]
                        c = qc[t, q]
                        v = qv[t, q]
                        sb = slot_bytes[l]
                        if sent + sb > pace:
                            break
                        qp[t] += 1
                        ok = not (R[t, l, c] or loading[t, l, c])
                        if ok and T > 1 and (t == 0 or disjoint):
                            ok = not (R[1 - t, l, c] or loading[1 - t, l, c])
                        if ok:
                            if v >= 0:
                                ok = R[t, l, v]
                            elif per_layer:
                                ok = O[t, l] < C[t, l]
                            else:
                                ok = upool[t] > 0
                        if not ok:
                            dropped += 1
                            continue
                        sent += sb
                        if v >= 0:
                            R[t, l, v] = False
                            swaps += 1
                        else:
                            O[t, l] += 1
                            if not per_layer:
                                upool[t] -= 1
                                C[t, l] += 1
                        loading[t, l, c] = True
                        ft[nfl] = t
                        fl[nfl] = l
                        fe[nfl] = c
                        fland[nfl] = r + copy_delay
                        nfl += 1
                        loads[l] += 1
            if nfl > 0 and (pace > 0 or r >= land_at):
                k = 0
                for q in range(nfl):
                    if fland[q] <= r:
                        R[ft[q], fl[q], fe[q]] = True
                        loading[ft[q], fl[q], fe[q]] = False
                    else:
                        ft[k] = ft[q]
                        fl[k] = fl[q]
                        fe[k] = fe[q]
                        fland[k] = fland[q]
                        k += 1
                nfl = k
            if i == n:
                break
            q_cur += 1
        l = layer[i]
        e = expert[i]
        if R[0, l, e]:
            hits[i] = True
        elif T > 1 and R[1, l, e]:
            hits[i] = True
            upper_hits += 1
        elif admit:
            ok = True
            if per_layer:
                if O[0, l] >= C[0, l]:
                    ok = False
            else:
                if pool_slots == 0:
                    ok = False
                elif pool_bytes >= 0:
                    if pool_bytes < slot_bytes[l]:
                        pool_slots = 0
                        ok = False
                    else:
                        pool_bytes -= slot_bytes[l]
                if ok:
                    if pool_slots > 0:
                        pool_slots -= 1
                    C[0, l] += 1
            if ok:
                R[0, l, e] = True
                O[0, l] += 1
                loads[l] += 1
        has_prev = 1
        prev = rnd[i]
        if lag <= 1:
            usage[l, e] += 1.0
        else:
            pend_l[npend] = l
            pend_e[npend] = e
            pend_q[npend] = q_cur
            npend += 1
    if pj > 0:  # drop the entries counted
        for q in range(pj, npend):
            pend_l[q - pj] = pend_l[q]
            pend_e[q - pj] = pend_e[q]
            pend_q[q - pj] = pend_q[q]
        npend -= pj
    S[0] = rounds
    S[1] = steps
    S[2] = swaps
    S[3] = dropped
    S[4] = upper_hits
    S[5] = land_at
    S[6] = nfl
    S[7] = pool_slots
    S[8] = pool_bytes
    S[9] = has_prev
    S[10] = prev
    S[11] = npend
    S[12] = q_cur


def adaptive_v2_kernel(layer, expert, ridx, R, C, O, upool, pool_slots, pool_bytes, slot_bytes, per_layer, admit,
                       floor, margin, adapt_every, max_moves, decay, copy_delay, lag, pace, disjoint):
    """:func:`adaptive_v2_chunk` over a whole stream at once: ``ridx`` int64 [N] round ids (non-decreasing).
    Returns hits, loads, steps, swaps, dropped moves, upper-tier hits."""
    T, L, E = R.shape
    n = len(layer)
    st = adaptive_v2_state(T, L, E, max_moves, copy_delay, pool_slots, pool_bytes)
    hits = np.zeros(n, np.bool_)
    loads = np.zeros(L, np.int64)
    m = n if lag > 1 else 0
    pend = (np.zeros(m, np.int64), np.zeros(m, np.int64), np.zeros(m, np.int64))
    adaptive_v2_chunk(np.asarray(layer, np.int64), np.asarray(expert, np.int64), np.asarray(ridx, np.int64), True,
                      R, C, O, upool, slot_bytes, per_layer, admit, floor, margin, adapt_every, max_moves, decay,
                      copy_delay, lag, pace, disjoint, *st, *pend, hits, loads)
    S = st[-1]
    return hits, loads, int(S[1]), int(S[2]), int(S[3]), int(S[4])
