"""Hand-worked cases for the Strata 0.2.x tier behaviours (compiled replay checked equal to the online objects)."""

from __future__ import annotations

import numpy as np
import pytest

from stratatools.cachesim import make_tier, plan_tier
from stratatools.cachesim.replay import run_policy
from stratatools.core.errors import StrataError

from test_cachesim_tiers import entries, prof


def both(seq, L, E, policy, **kw):
    """(hits, loads, info) of the compiled replay, checked equal to the online objects."""
    ent = entries(seq, L, E)
    h1, l1, i1 = run_policy(ent, policy, **kw)
    h2, l2, i2 = run_policy(ent, policy, engine="python", **kw)
    assert np.array_equal(h1, h2) and np.array_equal(l1, l2)
    for k in ("adapt_steps", "swaps", "dropped_moves", "upper_hits"):
        assert i1.get(k) == i2.get(k), k
    return h1.tolist(), l1.tolist(), i1


# one layer, experts 0..3, profile in index order, 2 slots: {0, 1} resident; 2 and 3 are used twice, then 1, then 1, 3
PACE_SEQ = [[(0, [2, 3])], [(0, [2, 3])], [(0, [1])], [(0, [1, 3])]]
PACE_KW = dict(profile=prof(1, 4), slots=2, adapt_every=1, decay=1.0, copy_delay_rounds=0)


def test_paced_copies_drop_moves_not_sent_by_the_next_adapt():
    # end of round 2: usage 2:2, 3:2 -> moves (2 for 0), (3 for 1), gain 2 each. A budget of one slot a round
    # sends (2 for 0) only. End of round 3 (next adapt): (3 for 1) is dropped; usage 1:1 now, and 3 (2.0) no
    # longer beats 1 by more than 1.5, so nothing replaces it: 1 stays resident (hit in rounds 3 and 4), 3 misses.
    h, loads, info = both(PACE_SEQ, 1, 4, "adaptive", pace_bytes=1, **PACE_KW)
    assert h == [False, False, False, False, True, True, False]
    assert loads == [1] and info["dropped_moves"] == 1 and info["swaps"] == 1
    # unpaced (pace_bytes 0, the default): both moves are sent at once, 1 is evicted, 3 hits in round 4
    h, loads, info = both(PACE_SEQ, 1, 4, "adaptive", **PACE_KW)
    assert h == [False, False, False, False, False, False, True] and loads == [2]


def test_paced_budget_is_bytes_rounded_to_256():
    # blob 300 bytes -> 512-byte slots: a 1000-byte budget sends one copy a round, 1024 sends two
    kw = dict(PACE_KW, blob_bytes=[300])
    _, loads, info = both(PACE_SEQ, 1, 4, "adaptive", pace_bytes=1000, **kw)
    assert loads == [1] and info["dropped_moves"] == 1
    _, loads, info = both(PACE_SEQ, 1, 4, "adaptive", pace_bytes=1024, **kw)
    assert loads == [2] and info["dropped_moves"] == 0


def test_free_slots_of_a_layer_are_filled_first():
    # per-layer, 3 slots for one layer, a profile of two pairs: {0, 1} resident, one free slot.
    # end of round 4: usage 3:4, 2:2. The top candidate 3 takes the free slot (nobody evicted); then 2 pairs with
    # the lowest victim 0 (2 > 0 + 1.5). Copies land after round 5: round 6 sees 0 evicted, 1, 2, 3 resident.
    seq = [[(0, [2, 3])], [(0, [2, 3])], [(0, [3])], [(0, [3])], [(0, [])], [(0, [0, 1, 2, 3])]]
    seq[4] = [(0, [1])]
    p = prof(1, 4, [(0, 0), (0, 1)])
    h, loads, info = both(seq, 1, 4, "adaptive", profile=p, slots=3, admission="per-layer", admit_on_miss=False)
    assert h[-4:] == [False, True, True, True]
    assert loads == [2] and info["swaps"] == 1  # one free-slot copy, one swap
    t = make_tier("adaptive", profile=p, slots=3, admission="per-layer", admit_on_miss=False)
    for rnd in seq[:5]:
        for l, es in rnd:
            t.access(l, es)
        t.end_round()
    assert t.resident_mask()[0].tolist() == [False, True, True, True] and t.occupied.tolist() == [3]


def test_fill_stops_at_the_first_blob_that_does_not_fit():
    # slots of 512, 768 and 256 bytes (300, 600, 100 rounded up to 256); ranking (0,0), (1,0), (2,0); 1000 bytes:
    # 512 fits, 512 + 768 does not -> the fill stops; (2,0) (256, which would fit) is not squeezed in.
    p = prof(3, 2, [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)])
    plan = plan_tier(3, 2, p, budget_bytes=1000, blob_bytes=[300, 600, 100], admission="global")
    assert plan.resident.sum(1).tolist() == [1, 0, 0] and plan.fill_bytes == 300 and plan.pool_slots == 0
    # and arrival admission stays closed: (2,0) misses twice
    seq = [[(0, [0]), (2, [0])], [(2, [0])]]
    for pol in ("static", "adaptive"):
        h, loads, _ = both(seq, 3, 2, pol, profile=p, budget_bytes=1000, blob_bytes=[300, 600, 100])
        assert h == [True, False, False] and loads == [0, 0, 0]
    # with room for exactly 512 + 768 + 256 the three are resident
    plan = plan_tier(3, 2, p, budget_bytes=1536, blob_bytes=[300, 600, 100], admission="global")
    assert plan.resident.sum(1).tolist() == [1, 1, 1]


def test_lag_2_takes_a_swap_only_from_windows_two_old():
    # one slot holding 0; expert 1 used every round; adapt every 2 rounds, copies land at once, no decay.
    seq = [[(0, [1])]] * 5
    kw = dict(profile=prof(1, 4), slots=1, adapt_every=2, copy_delay_rounds=0, decay=1.0)
    h, _, _ = both(seq, 1, 4, "adaptive", **kw)  # lag 1: round 2's adapt sees usage 2 -> swap; hits from round 3
    assert h == [False, False, True, True, True]
    h, _, info = both(seq, 1, 4, "adaptive", lag=2, **kw)
    # lag 2: round 2's adapt sees round 1 only (usage 1 < 2.0); round 4's sees rounds 1-3 -> swap; hit in round 5
    assert h == [False, False, False, False, True] and info["swaps"] == 1


def test_upper_tier_experts_are_not_candidates_for_the_first():
    # first tier {0}, upper tier {1} (ranking 0, 1, 2, 3); 1 is used in every round
    seq = [[(0, [1])]] * 6
    kw = dict(profile=prof(1, 4), slots=1, adapt_every=2, copy_delay_rounds=0, decay=1.0)
    h, loads, _ = both(seq, 1, 4, "adaptive", **kw)  # without an upper tier, 1 is swapped in after round 2
    assert h == [False, False, True, True, True, True] and loads == [1]
    h, loads, info = both(seq, 1, 4, "adaptive", upper_slots=1, **kw)  # the upper tier holds it: never copied
    assert h == [True] * 6 and loads == [0] and info["upper_hits"] == 6 and info["swaps"] == 0


def test_disjoint_keeps_the_two_sets_apart_and_upper_copies_go_first():
    p = prof(1, 4)
    kw = dict(profile=p, slots=1, upper_slots=1, adapt_every=2, copy_delay_rounds=0, decay=1.0)
    seq = [[(0, [2])], [(0, [2])], [(0, [0, 1])], [(0, [0, 1])], [(0, [0, 1, 2])]]
    # End of round 2 (usage 2:2): the first tier swaps 2 in for 0. Not disjoint, the upper tier also swaps 2 in
    # for 1 (2 > 0 + 1.5): both hold 2, so round 3 misses 0 and 1.
    h, _, _ = both(seq, 1, 4, "adaptive", **kw)
    assert h[2:4] == [False, False]
    # End of round 4 (usage 0:2, 1:2, 2:2): the first tier's copy of 2 (held by the upper tier) counts as worth 0
    # and goes first: 0 replaces it (2 > 0 + 1.5). The upper tier's candidates 0, 1 do not beat its 2 (2 > 3.5? no).
    assert h[4:] == [False, False, True, False, True]
    # STRATA_DISJOINT_ADAPT=1: the upper tier may not take 2 (the first tier is loading it), keeps 1: round 3 hits 1
    h, _, _ = both(seq, 1, 4, "adaptive", disjoint=1, **kw)
    assert h[2:4] == [False, True]
    t = make_tier("adaptive", disjoint=1, **kw)
    for rnd in seq:
        for l, es in rnd:
            t.access(l, es)
        t.end_round()
        assert not (t.resident_mask() & t.upper_mask()).any()


def test_v02_kernel_with_defaults_equals_the_01_kernel():
    from stratatools.cachesim.layout import plan_tier as plan
    from stratatools.cachesim.replay import _run_adaptive_v2
    from stratatools.cachesim.tiers import ADAPTIVE_DEFAULTS

    rng = np.random.default_rng(5)
    seq = [[(l, rng.choice(8, 3, replace=False).tolist()) for l in range(3)] for _ in range(80)]
    ent = entries(seq, 3, 8)
    p = prof(3, 8, [(i % 3, (i * 5) % 8) for i in range(24)])
    for adm, every in (("global", 4), ("per-layer", 1), ("global", 2)):
        base = run_policy(ent, "adaptive", profile=p, slots=7, admission=adm, adapt_every=every)
        pl = plan(3, 8, p, slots=7, admission=adm)
        res, capv = pl.resident.copy(), pl.cap.copy()
        hits, loads, extra = _run_adaptive_v2(ent, pl, p, res, capv, res.sum(1), True,
                                              {**ADAPTIVE_DEFAULTS, "adapt_every": every})
        assert np.array_equal(base[0], hits) and np.array_equal(base[1], loads)
        assert extra["swaps"] == base[2]["swaps"] and extra["dropped_moves"] == 0


@pytest.mark.parametrize("bad", [{"lag": 0}, {"pace_bytes": -1}, {"upper_slots": -2}, {"disjoint": 2},
                                 {"decay": 1.5}])
def test_v02_parameters_checked(bad):
    with pytest.raises(StrataError):
        make_tier("adaptive", profile=prof(1, 4), slots=1, **bad)
    with pytest.raises(StrataError):
        run_policy(entries([[(0, [1])]], 1, 4), "adaptive", profile=prof(1, 4), slots=1, **bad)


def test_upper_tier_free_slots_are_filled_first_under_global_admission():
    # first tier {0} (a one-pair profile, 1 slot); upper tier of 2 slots with nothing to fill it at start-up.
    # End of round 2 (usage 1:2, 2:2): the first tier swaps 1 in for 0; the upper tier (disjoint: 1 is loading in
    # the first) takes 2 into a free slot of its pool, evicting nothing. Round 3: 1 and 2 hit, 3 misses.
    seq = [[(0, [1, 2])], [(0, [1, 2])], [(0, [1, 2, 3])]]
    h, loads, info = both(seq, 1, 4, "adaptive", profile=prof(1, 4, [(0, 0)]), slots=1, upper_slots=2, disjoint=1,
                          adapt_every=2, copy_delay_rounds=0, decay=1.0)
    assert h == [False, False, False, False, True, True, False]
    assert loads == [2] and info["swaps"] == 1 and info["upper_hits"] == 1


def test_v02_knobs_stream_in_bounded_memory():
    """The 0.2.x kernel is fed chunk by chunk: with lag 3 it holds only the entries of the last rounds (not the
    trace), and gives the hits of one whole-array run."""
    from stratatools.cachesim.replay import Replay

    rng = np.random.default_rng(2)
    seq = [[(l, rng.choice(8, 2, replace=False).tolist()) for l in range(3)] for _ in range(3000)]
    ent = entries(seq, 3, 8)
    p = prof(3, 8, [(i % 3, (i * 5) % 8) for i in range(24)])
    kw = dict(profile=p, slots=7, adapt_every=2, lag=3, pace_bytes=2, upper_slots=2)
    whole = run_policy(ent, "adaptive", **kw)
    rp = Replay(3, 8, "adaptive", **kw)
    hits = [rp.feed(c) for c in ent.chunks(50)]
    held = len(rp._v2.pend[0])
    loads, info = rp.finish()
    assert held <= 2 * (50 + 3 * 6) and len(ent) == 3000 * 6
    assert np.array_equal(np.concatenate(hits), whole[0]) and np.array_equal(loads, whole[1])
    assert info["swaps"] == whole[2]["swaps"] and info["dropped_moves"] == whole[2]["dropped_moves"]
