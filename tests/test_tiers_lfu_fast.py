"""LFU / LFRU victim choice from the lazy per-layer heap == the straightforward scan (``_tiers_reference``): the same
hits, residency, loads and counts on random access sequences full of ties (decay 1.0: integer counts; 0.5: exact
halves; 0.0: every count back to zero; 0.7: rounding), through ``access``, ``access_rows`` and ``end_round``, and the
same through the GPU tier's host-side bookkeeping (its stand-in CuPy from test_gpu_tier_deferred_host)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from stratatools.cachesim import make_tier
from stratatools.cachesim._tiers_reference import make_reference_tier, reference_lfu_victim
from stratatools.cachesim.tiers import LFRUTier, LFUTier, _lfu_victim
from stratatools.core.errors import StrataError

DECAYS = [1.0, 0.5, 0.0, 0.7, 0.9]


@st.composite
def sequences(draw, max_layers=3, max_expert=10):
    """(L, E, cap [L], params, ops): ops are ("row", layer, experts), ("rows", layer, [T, k]) or ("end",)."""
    L = draw(st.integers(1, max_layers))
    E = draw(st.integers(1, max_expert))
    cap = [draw(st.integers(0, E + 1)) for _ in range(L)]
    params = {"decay": draw(st.sampled_from(DECAYS)), "decay_every": draw(st.integers(1, 3))}
    seed = draw(st.integers(0, 2**31 - 1))
    n_ops = draw(st.integers(1, 60))
    rng = np.random.default_rng(seed)
    skew = rng.random(E) ** 3 + 1e-2  # a few hot experts: hits and evictions both
    p = skew / skew.sum()
    ops = []
    for _ in range(n_ops):
        kind = rng.choice(3, p=[0.55, 0.15, 0.3])
        if kind == 2:
            ops.append(("end",))
            continue
        l = int(rng.integers(L))
        k = int(rng.integers(1, min(E, 4) + 1))
        T = 1 if kind == 0 else int(rng.integers(1, 6))
        # distinct experts in a row (as routed), except now and then a repeat (the tier takes them in order)
        rows = np.stack([rng.choice(E, size=k, replace=bool(rng.random() < 0.1), p=p) for _ in range(T)])
        ops.append(("row", l, rows[0]) if kind == 0 else ("rows", l, rows))
    return L, E, cap, params, ops


def _heap_bounded(t) -> None:
    """Memory stays bounded: LFU keeps one heap entry per resident, LFRU at most twice the unprivileged set + 17."""
    for l in range(t.n_layers):
        if isinstance(t, LFUTier):
            assert len(t._heap[l]) == t._n[l] == int(t.res[l].sum())
        else:
            assert t._nu[l] == int((t.where[l] == 2).sum()) <= t.ucap[l]
            assert len(t.priv[l]) == int((t.where[l] == 1).sum()) <= t.pcap[l]
            assert len(t._heap[l]) <= 2 * t._nu[l] + 17


@pytest.mark.parametrize("policy", ["lfu", "lfru"])
@settings(max_examples=150, deadline=None)
@given(case=sequences(), frac=st.sampled_from([0.25, 0.5, 1.0]))
def test_fast_tier_decides_as_the_reference(policy, case, frac):
    L, E, cap, params, ops = case
    if policy == "lfru":
        params = {**params, "privileged_frac": frac}
    bb = np.arange(1, L + 1) * 100
    fast = make_tier(policy, n_layers=L, n_expert=E, cap=cap, blob_bytes=bb, **params)
    ref = make_reference_tier(policy, L, E, cap, bb, **params)
    assert type(fast) is (LFUTier if policy == "lfu" else LFRUTier)
    for i, op in enumerate(ops):
        if op[0] == "end":
            fast.end_round()
            ref.end_round()
            continue
        _, l, x = op
        if op[0] == "row":
            got, want = fast.access(l, x), ref.access(l, x)
        else:
            got, want = fast.access_rows(l, x), ref.access_rows(l, x)
        assert np.array_equal(got, want), (i, op)
        assert np.array_equal(fast.resident_row(l), ref.resident_mask()[l]), (i, op)
        _heap_bounded(fast)
    assert np.array_equal(fast.resident_mask(), ref.resident_mask())
    a, b = fast.stats(), ref.stats()
    assert a.keys() == b.keys() and all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)  # NaN: no entries
    assert np.array_equal(fast.counts, ref.counts)  # the same float64 values


def test_lfu_ties_go_to_the_lowest_expert():
    """Equal counts: the lowest expert id is evicted, whatever the order the residents came in."""
    t = make_tier("lfu", n_layers=1, n_expert=10, cap=[3], decay=1.0)
    t.access(0, [7, 2, 5])  # counts 1 each
    assert t.access(0, [9]).tolist() == [False]  # evicts 2 (lowest of 2, 5, 7)
    assert np.flatnonzero(t.resident_row(0)).tolist() == [5, 7, 9]
    t.access(0, [5, 9])  # counts 5:2, 7:1, 9:2
    t.access(0, [1])  # evicts 7 (count 1)
    t.access(0, [3])  # counts 1:1, 3:1 (new), 5:2, 9:2: evicts 1
    assert np.flatnonzero(t.resident_row(0)).tolist() == [3, 5, 9]
    t.end_round()  # decay 1.0: nothing changes
    assert t.counts[0, [3, 5, 9]].tolist() == [1.0, 2.0, 2.0]


def test_lfu_decay_to_zero_ties_every_count():
    """decay 0.0 every round: the counts of the round before are all 0, so the lowest id goes first."""
    t = make_tier("lfu", n_layers=1, n_expert=8, cap=[2], decay=0.0, decay_every=1)
    t.access(0, [6, 6, 6])  # one miss then two hits: count 3
    t.access(0, [4])
    t.end_round()  # 4 and 6 both 0
    assert t.access(0, [1]).tolist() == [False]
    assert np.flatnonzero(t.resident_row(0)).tolist() == [1, 6]


def test_lfru_tie_in_the_unprivileged_partition():
    """LFRU (cap 4: 2 privileged, 2 unprivileged), decay 1.0: demoted experts of equal count leave lowest id first;
    a promoted expert's stale heap entry is not taken for a resident."""
    t = make_tier("lfru", n_layers=1, n_expert=10, cap=[4], decay=1.0)
    for e in (8, 3, 6, 1):  # priv [6, 1], unpriv {8, 3}, all count 1
        t.access(0, [e])
    assert t.access(0, [8]).tolist() == [True]  # promoted: priv [1, 8], 6 demoted, unpriv {3, 6}
    assert t.access(0, [0]).tolist() == [False]  # priv [8, 0], 1 demoted: unpriv {3, 6, 1} -> 1 evicted
    assert np.flatnonzero(t.resident_row(0)).tolist() == [0, 3, 6, 8]
    assert t.access(0, [5]).tolist() == [False]  # 8 (count 2) demoted: {3, 6, 8} -> 3 evicted
    assert np.flatnonzero(t.resident_row(0)).tolist() == [0, 5, 6, 8]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_victim_from_a_lazy_heap_is_the_scan(data):
    """_lfu_victim on any heap that holds, for every member, an entry with at most its count (plus entries of experts
    that left): the member with the smallest (count, id), as the scan finds it; every entry left keeps the invariant."""
    n = data.draw(st.integers(1, 40))
    counts = data.draw(st.lists(st.sampled_from([0.0, 0.35, 0.5, 1.0, 1.5, 2.0, 3.0]), min_size=n, max_size=n))
    members = set(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)))
    heap = []
    for m in sorted(members):  # one entry at or below the count now, sometimes one more
        for _ in range(data.draw(st.integers(1, 2))):
            heap.append((counts[m] - data.draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])), m))
    for gone in data.draw(st.lists(st.integers(0, n - 1), max_size=10)):
        if gone not in members:
            heap.append((data.draw(st.sampled_from([-1.0, 0.0, 5.0])), gone))
    import heapq
    heapq.heapify(heap)
    want = reference_lfu_victim(sorted(members), np.array(counts))
    where = [int(m in members) for m in range(n)]
    assert _lfu_victim(heap, counts, where, 1) == want
    members.discard(want)
    for m in members:
        assert any(v == m and c <= counts[m] for c, v in heap)


def test_non_finite_decay_is_refused():
    for pol in ("lfu", "lfru"):
        with pytest.raises(StrataError, match=f"{pol}: decay nan must be a finite number"):
            make_tier(pol, n_layers=1, n_expert=4, cap=[2], decay=float("nan"))


# -- the GPU tier's host-side bookkeeping (no GPU: the stand-in CuPy of test_gpu_tier_deferred_host) ---------------

from test_gpu_tier_deferred_host import _arena, _fake_cupy, _where  # noqa: E402

from stratatools.runtime.gpu import tier as T  # noqa: E402


@pytest.mark.parametrize("policy", ["lfu", "lfru"])
@settings(max_examples=40, deadline=None)
@given(case=sequences(max_layers=3, max_expert=8))
def test_gpu_tier_bookkeeping_with_the_fast_policy_is_the_reference(policy, case):
    """GPUExpertTier driven by the fast policy and by the reference one: the same hits, counters (copies, evictions,
    bytes), slots and slot table after every call, each slot holding its expert's blob."""
    _, _, cap, params, ops = case
    with pytest.MonkeyPatch.context() as mp:
        cp = _fake_cupy()
        mp.setattr(T, "require_cupy", lambda: cp)
        arena = _arena(mp)  # 3 layers x 8 experts
        L, E = 3, 8
        cap = (cap * 3)[:L]
        bb = [ly.blob_bytes for ly in arena.layers]
        fast = T.GPUExpertTier(arena, make_tier(policy, n_layers=L, n_expert=E, cap=cap, blob_bytes=bb, **params),
                               miss_mode="host")
        ref = T.GPUExpertTier(arena, make_reference_tier(policy, L, E, cap, bb, **params), miss_mode="host")
        for i, op in enumerate(ops):
            if op[0] == "end":
                fast.end_round()
                ref.end_round()
                continue
            _, l, x = op
            l, x = l % L, np.asarray(x) % E
            if op[0] == "row":
                got, want = fast.access(l, x), ref.access(l, x)
            else:
                got, want = fast.access_rows(l, x), ref.access_rows(l, x)
            assert np.array_equal(got, want), (i, op)
            assert fast.counters.to_dict() == ref.counters.to_dict(), (i, op)
            assert _where(fast) == _where(ref), (i, op)
        for l in range(L):
            for e, off in fast.slot_of[l].items():
                got = np.asarray(fast.vram[off:off + bb[l]])
                assert np.array_equal(got, arena.blob(l, e)), (l, e)


@pytest.mark.parametrize("policy", ["lfu", "lfru"])
def test_a_pickled_tier_goes_on_as_the_original(policy):
    """The per-layer views of the counts are rebuilt on unpickling (over the unpickled counts, not the original's)."""
    import pickle

    rng = np.random.default_rng(4)
    t = make_tier(policy, n_layers=2, n_expert=6, cap=[3, 2], decay=0.5, decay_every=1)
    for _ in range(10):
        for l in range(2):
            t.access(l, rng.choice(6, size=2, replace=False))
        t.end_round()
    u = pickle.loads(pickle.dumps(t))
    for _ in range(20):
        for l in range(2):
            x = rng.choice(6, size=2, replace=False)
            assert np.array_equal(t.access(l, x), u.access(l, x))
        t.end_round()
        u.end_round()
    assert np.array_equal(t.counts, u.counts) and np.array_equal(t.resident_mask(), u.resident_mask())
    u.access(0, [5])
    assert u.counts[0, 5] == t.counts[0, 5] + 1.0  # u's own counts, not t's
