"""Hand-worked cases for the slot layout and every policy (online objects and compiled replay)."""

from __future__ import annotations

import numpy as np
import pytest

from stratatools.cachesim import make_tier, per_layer_split, plan_tier
from stratatools.cachesim.replay import Entries, run_policy
from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile


def prof(L, E, pairs=None):
    if pairs is None:
        f = np.arange(L * E)
        pairs = np.stack([f // E, f % E], 1)
    return Profile(L, E, pairs)


def entries(seq, L, E):
    """seq: list of rounds, each a list of (layer, [experts]) records."""
    lay, ex, rnd, rec = [], [], [], []
    r = 0
    for t, rounds in enumerate(seq):
        for l, es in rounds:
            for e in es:
                lay.append(l); ex.append(e); rnd.append(t); rec.append(r)
            r += 1
    a = lambda x: np.array(x, dtype=np.int64)
    return Entries(a(lay), a(ex), a(rnd), a(rec), np.zeros(len(lay), np.int64), L, E, len(seq))


def both(seq, L, E, policy, **kw):
    """Hits of the compiled replay, checked equal to the online objects."""
    ent = entries(seq, L, E)
    h1, l1, _ = run_policy(ent, policy, **kw)
    h2, l2, _ = run_policy(ent, policy, engine="python", **kw)
    assert np.array_equal(h1, h2) and np.array_equal(l1, l2)
    return h1.tolist(), l1.tolist()


def test_layout_global_and_per_layer():
    p = prof(2, 4, [(0, 0), (1, 1), (0, 1), (1, 0), (0, 2), (1, 2), (0, 3), (1, 3)])
    g = plan_tier(2, 4, p, slots=3, admission="global")
    assert sorted(zip(*np.nonzero(g.resident))) == [(0, 0), (0, 1), (1, 1)]
    assert g.cap.tolist() == [2, 1] and g.pool_slots == 0
    pl = plan_tier(2, 4, p, slots=5, admission="per-layer")
    assert pl.cap.tolist() == [2, 3]  # q = 2, the last layer takes the remainder
    assert pl.resident.sum(1).tolist() == [2, 3]
    assert pl.resident[0].tolist() == [True, True, False, False]
    assert pl.resident[1].tolist() == [True, True, True, False]


def test_layout_byte_budget():
    p = prof(2, 4, [(0, 0), (1, 1), (0, 1), (1, 0), (0, 2), (1, 2), (0, 3), (1, 3)])
    blob = [300, 600]  # slots of 512 and 768 bytes
    g = plan_tier(2, 4, p, budget_bytes=1300, blob_bytes=blob, admission="global")
    assert int(g.resident.sum()) == 2 and g.pool_slots == 0  # 512 + 768 = 1280; +512 does not fit
    assert g.fill_bytes == 900
    assert per_layer_split(2, budget_bytes=3000, blob_bytes=blob).tolist() == [2, 2]
    assert per_layer_split(2, budget_bytes=3400, blob_bytes=blob).tolist() == [2, 3]
    assert per_layer_split(2, budget_bytes=3400, blob_bytes=blob, slots=3).tolist() == [1, 2]
    with pytest.raises(StrataError, match="blob sizes"):
        plan_tier(2, 4, p, budget_bytes=1000)
    with pytest.raises(StrataError, match="no budget"):
        plan_tier(2, 4, p)


def test_static_profile_and_arrival_admission():
    p = prof(1, 4, [(0, 2), (0, 0), (0, 1), (0, 3)])
    h, loads = both([[(0, [2, 1])], [(0, [0, 2])]], 1, 4, "static", profile=p, slots=2)
    assert h == [True, False, True, True] and loads == [0]
    # no profile: arrival order fills the pool, nothing is evicted
    h, loads = both([[(0, [1])], [(0, [3])], [(0, [1])], [(0, [0])], [(0, [3])], [(0, [0])]], 1, 4, "static",
                    profile=None, slots=2)
    assert h == [False, False, True, False, True, False] and loads == [2]


def test_adaptive_swap_delay_and_margin():
    p = prof(1, 4)  # expert 0 resident with one slot
    seq = [[(0, [1])]] * 6 + [[(0, [0])]]
    h, loads = both(seq, 1, 4, "adaptive", profile=p, slots=1)
    # usage of 1 reaches 4 by round 4 > 0 + 1.5: swap; the copy lands after round 5; 0 was evicted at once
    assert h == [False] * 5 + [True, False] and loads == [1]
    h, _ = both(seq, 1, 4, "adaptive", profile=p, slots=1, copy_delay_rounds=0)
    assert h == [False] * 4 + [True, True, False]
    # margin: candidate 3 uses vs victim 2 uses -> 3 > 3.5 fails, no swap
    seq2 = [[(0, [0])], [(0, [0])], [(0, [1])], [(0, [1, 2])], [(0, [1])], [(0, [1])]]
    h, loads = both(seq2, 1, 4, "adaptive", profile=p, slots=1)
    assert loads == [0] and h == [True, True, False, False, False, False, False]


def test_adaptive_max_moves_keeps_highest_gain_and_decays():
    p = prof(2, 4, [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)])
    seq = [[(0, [3]), (1, [3])], [(0, [3]), (1, [3])], [(0, [3]), (1, [3])], [(1, [3])]]
    t = make_tier("adaptive", profile=p, slots=2, max_moves=1, copy_delay_rounds=0)
    for rnd in seq:
        for l, es in rnd:
            t.access(l, es)
        t.end_round()
    # layer 1's candidate has usage 4 (gain 4) vs layer 0's 3: only layer 1 swaps
    assert t.resident_mask()[1].tolist() == [False, False, False, True]
    assert t.resident_mask()[0].tolist() == [True, False, False, False]
    assert t.usage[0, 3] == pytest.approx(3 * 0.7) and t.usage[1, 3] == pytest.approx(4 * 0.7)
    h, _ = both(seq + [[(0, [3]), (1, [3])]], 2, 4, "adaptive", profile=p, slots=2, max_moves=1,
                copy_delay_rounds=0)
    assert h[-2:] == [False, True]


def test_adaptive_per_layer_free_slots_first():
    p = prof(1, 4, [(0, 0)])  # a one-pair profile, 3 slots: two free slots for the layer
    seq = [[(0, [0, 1, 2])], [(0, [1, 2])], [(0, [1, 2])], [(0, [1, 2])], [(0, [1, 2, 3])], [(0, [1, 2, 3])]]
    h, loads = both(seq, 1, 4, "adaptive", profile=p, slots=3, admission="per-layer", admit_on_miss=False)
    # both candidates take the free slots at the end of round 4 (no victim needed); they land after round 5
    assert loads == [2] and h[-6:] == [False, False, False, True, True, False]


def test_lru():
    h, loads = both([[(0, [0])], [(0, [1])], [(0, [0])], [(0, [2])], [(0, [1])]], 1, 4, "lru", cap=[2])
    assert h == [False, False, True, False, False] and loads == [4]


def test_lru_with_room_for_every_expert_hits_after_first_use():
    rng = np.random.default_rng(3)
    seq = [[(l, rng.choice(8, 3, replace=False).tolist()) for l in range(3)] for _ in range(40)]
    ent = entries(seq, 3, 8)
    h, _, _ = run_policy(ent, "lru", cap=[8, 8, 8])
    key = ent.layer * 8 + ent.expert
    first = np.zeros(len(key), dtype=bool)
    first[np.unique(key, return_index=True)[1]] = True
    assert np.array_equal(h, ~first)


def test_lfu():
    seq = [[(0, [0])], [(0, [0])], [(0, [1])], [(0, [2])], [(0, [1])], [(0, [2])]]
    h, _ = both(seq, 1, 4, "lfu", cap=[2], decay=1.0)
    # 2 evicts 1 (counts 0:2, 1:1); 1 returns (count 2) and evicts 2 (count 1); 2 misses again
    assert h == [False, True, False, False, False, False]


def test_lfru():
    seq = [[(0, [0])], [(0, [1])], [(0, [0])], [(0, [2])], [(0, [1])], [(0, [0])]]
    h, _ = both(seq, 1, 4, "lfru", cap=[2], decay=1.0)
    # 0 priv; 1 priv, 0 demoted; 0 promoted, 1 demoted; 2 priv, 0 demoted -> unpriv {1, 0}: 1 (count 1) evicted
    assert h == [False, False, True, False, False, True]


def test_belady_bypass_and_evict():
    seq = [[(0, [0])], [(0, [1])], [(0, [0])], [(0, [1])], [(0, [1])]]
    h, loads = both(seq, 1, 4, "belady", cap=[1])
    assert h == [True, False, True, False, True] and loads == [1]


def test_make_tier_errors():
    with pytest.raises(StrataError, match="unknown policy"):
        make_tier("fifo", n_layers=1, n_expert=2, slots=1)
    with pytest.raises(StrataError, match="unknown adaptive"):
        make_tier("adaptive", profile=prof(1, 2), slots=1, speed=3)
    with pytest.raises(StrataError, match="offline"):
        make_tier("belady", n_layers=1, n_expert=2, slots=1)
    t = make_tier("lru", n_layers=1, n_expert=2, slots=1)
    with pytest.raises(StrataError, match="out of range"):
        t.access(0, [5])


@pytest.mark.parametrize("policy", ["static", "static-arrival", "static-arrival-per-layer", "static-no-admit",
                                    "adaptive", "lru", "lfu", "lfru", "belady"])
def test_access_rows_is_access_row_by_row(policy):
    """Tier.access_rows (a prompt's positions of one layer at once) gives every policy the same hits, residency and
    stats as access() row by row, over rounds that mix it with single records; bad ids are refused before counting."""
    L, E, k = 3, 12, 3
    rng = np.random.default_rng(5)
    seq = []  # rounds of (layer, rows [T, k])
    for r in range(12):
        T = 5 if r % 4 == 0 else 1
        seq.append([(l, np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])) for l in range(L)])
    future = None
    if policy == "belady":
        lay = np.concatenate([np.full(rows.size, l) for rnd in seq for l, rows in rnd])
        ex = np.concatenate([rows.reshape(-1) for rnd in seq for _, rows in rnd])
        future = (lay, ex)

    def mk():
        if policy in ("static", "adaptive"):
            p = prof(L, E, [(l, e) for l in range(L) for e in range(0, E, 3)])
            extra = {"adapt_every": 2, "copy_delay_rounds": 0} if policy == "adaptive" else {}
            return make_tier(policy, profile=p, slots=L * 4, **extra)
        if policy == "static-arrival":  # a global pool: rows loop while it is open, one gather once it closes
            return make_tier("static", n_layers=L, n_expert=E, slots=L * 4)
        if policy == "static-arrival-per-layer":  # layers fill one by one: both paths in one round
            return make_tier("static", n_layers=L, n_expert=E, slots=L * 4, admission="per-layer")
        if policy == "static-no-admit":
            p = prof(L, E, [(l, e) for l in range(L) for e in range(0, E, 5)])
            return make_tier("static", profile=p, slots=L * 4, admit_on_miss=False)
        return make_tier(policy, n_layers=L, n_expert=E, slots=L * 4, future=future)

    one, rows_t = mk(), mk()
    for rnd in seq:
        for l, rows in rnd:
            want = np.stack([one.access(l, row) for row in rows])
            got = rows_t.access_rows(l, rows)
            assert np.array_equal(got, want), (policy, l)
        one.end_round()
        rows_t.end_round()
    assert rows_t.stats() == one.stats() and 0 < one.stats()["hits"] < one.stats()["entries"]
    assert np.array_equal(rows_t.resident_mask(), one.resident_mask())
    before = rows_t.stats()
    with pytest.raises(StrataError, match=f"layer 1: expert {E} is out of range for {E} experts"):
        rows_t.access_rows(1, np.array([[0, 1, 2], [3, E, 4]]))
    with pytest.raises(StrataError, match="layer 3 is out of range for a tier of 3 layers"):
        rows_t.access_rows(3, np.array([[0, 1, 2]]))
    assert rows_t.stats() == before
