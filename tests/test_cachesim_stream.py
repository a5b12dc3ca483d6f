"""Streaming replay == whole replay: the chunked preparation, every policy, the metrics and the k-fold give
the results of one pass over everything, whatever the chunk size (random traces with interleaved requests,
positions that go back, unknown positions, verify windows, prefill and out-of-range entries)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from stratatools.core.errors import StrataError
from stratatools.cachesim.kfold import kfold_eval, t_interval
from stratatools.cachesim.replay import (EntryStream, merge_traces, prepare_entries, prepare_stream, run_policy,
                                         simulate_many, simulate_policy)
from stratatools.profiles.ranking import make_profile
from stratatools.profiles.strp import Profile
from stratatools.traces.table import PREFILL, TraceTable, rounds_kind, table_chunks


def reference_prepare(table, n_layers, n_expert, phase="decode", cold=False):
    """The whole-array preparation the streaming one replaced, with the phases of the warm replay (the count mask,
    ``cold``): kept verbatim as the oracle."""
    from stratatools.cachesim.replay import _table_window

    if phase not in ("decode", "all"):
        raise StrataError(f"unknown phase filter {phase!r} (use decode or all)")
    if cold and phase != "decode":
        raise StrataError("--cold drops the prefill before the decode is counted; it needs --phase decode")
    t = merge_traces(list(table)) if not isinstance(table, TraceTable) else table
    n = len(t)
    if n == 0:
        raise StrataError("the traces hold no routed entries")
    req = t.request.astype(np.int64)
    pos = t.position.astype(np.int64)
    lay = t.layer.astype(np.int64)
    rank = t.rank.astype(np.int64)
    window = _table_window(t)
    rec_start = np.ones(n, dtype=bool)
    rec_start[1:] = (req[1:] != req[:-1]) | (pos[1:] != pos[:-1]) | (lay[1:] != lay[:-1]) | (rank[1:] <= rank[:-1])
    if window is not None:  # a record never spans two windows
        wv = np.asarray(window)
        rec_start[1:] |= wv[1:] != wv[:-1]
    record = np.cumsum(rec_start) - 1
    rs = np.nonzero(rec_start)[0]
    r_req, r_pos, r_lay = req[rs], pos[rs], lay[rs]
    if window is not None:
        r_win = np.asarray(window, dtype=np.int64)[rs]
        in_w = r_win >= 0
        # windows: key = window id (>= 0); outside them: key = position, shifted below every window id
        r_key = np.where(in_w, r_win, r_pos - (1 << 40))
    else:
        in_w = np.zeros(len(rs), dtype=bool)
        r_key = r_pos
    new_round = np.ones(len(rs), dtype=bool)
    batched = np.zeros(len(rs), dtype=bool)
    if len(rs) > 1:
        unknown = (r_pos[1:] < 0) & ~in_w[1:]
        new_round[1:] = (r_req[1:] != r_req[:-1]) | (r_key[1:] != r_key[:-1]) | (unknown & (r_lay[1:] <= r_lay[:-1]))
        same_req = r_req[1:] == r_req[:-1]
        back = same_req & ~in_w[1:] & ~in_w[:-1] & (r_pos[1:] >= 0) & (r_pos[1:] < r_pos[:-1])
        if back.any():
            batched = np.zeros(len(rs), dtype=bool)
            req_ids = np.unique(r_req[1:][back])
            batched[np.isin(r_req, req_ids) & ~in_w] = True
            b = batched[1:] & batched[:-1] & same_req
            new_round[1:][b] = r_lay[1:][b] < r_lay[:-1][b]
    rec_round = np.cumsum(new_round) - 1
    rnd = rec_round[record]
    keep = np.ones(n, dtype=bool)
    skipped = {"prefill": 0, "layer": 0, "expert": 0}
    pf = None
    if phase == "decode":
        pf = np.asarray(t.phase) == PREFILL
        if cold:
            skipped["prefill"] = int(pf.sum())
            keep &= ~pf
            pf = None
        elif not pf.any():
            pf = None
    ex = t.expert.astype(np.int64)
    bad_l = keep & ((lay < 0) | (lay >= n_layers))
    skipped["layer"] = int(bad_l.sum())
    keep &= ~bad_l
    bad_e = keep & ((ex < 0) | (ex >= n_expert))
    skipped["expert"] = int(bad_e.sum())
    keep &= ~bad_e
    if not keep.any():
        raise StrataError(f"no routed entry of the traces fits {n_layers} layers x {n_expert} experts "
                          f"(skipped: {skipped}); check the traces belong to this model")
    count = None if pf is None else ~pf[keep]
    if count is not None and not count.any():
        raise StrataError("the traces hold prefill entries only, nothing of the decode to count; use --phase all")
    # token id: (request, position) when the position is known, else the round
    tok_key = np.where(pos >= 0, req * (1 << 32) + pos, -(rnd + 1))
    _, token = np.unique(tok_key[keep], return_inverse=True)
    token = token.astype(np.int64)
    rounds_by = rounds_kind(None if window is None else np.asarray(window)[keep])
    if len(rs) > 1 and batched[record[keep]].any():
        rounds_by = "batches" if rounds_by == "positions" else rounds_by + "+batches"
    cnt = np.ones(int(keep.sum()), bool) if count is None else count
    return dict(layer=lay[keep], expert=ex[keep], rnd=rnd[keep], record=record[keep], request=req[keep],
                n_tokens=int(len(np.unique(token[cnt]))), skipped=skipped, rounds_by=rounds_by, count=cnt)


def random_table(rng, L, E, *, windows: bool, n_req: int, n_rec: int) -> TraceTable:
    """Records of k entries: interleaved requests, positions mostly rising per request but sometimes going back
    (layer-major batches) or unknown (-1), some prefill, a layer or expert out of range now and then."""
    cols = {c: [] for c in ("request", "position", "phase", "layer", "rank", "expert", "weight")}
    win = []
    pos_of = {}
    req_ids = rng.choice(1000, size=n_req, replace=False)
    for _ in range(n_rec):
        r = int(rng.choice(req_ids))
        p = pos_of.get(r, 0)
        u = rng.random()
        if u < 0.1:
            p = max(0, p - int(rng.integers(1, 3)))
        elif u < 0.15:
            p = -1
        elif u < 0.6:
            p = p + 1
        pos_of[r] = max(p, 0)
        lay = int(rng.integers(0, L + 1)) if rng.random() < 0.05 else int(rng.integers(0, L))
        k = int(rng.integers(1, min(E, 3) + 1))
        ex = rng.choice(E, size=k, replace=False)
        if rng.random() < 0.03:
            ex[0] = E  # out of range
        ph = PREFILL if rng.random() < 0.1 else 1
        w = int(rng.integers(-1, 4)) if windows else -1
        for j, e in enumerate(ex):
            cols["request"].append(r); cols["position"].append(p); cols["phase"].append(ph)
            cols["layer"].append(lay); cols["rank"].append(j); cols["expert"].append(int(e)); cols["weight"].append(1.0)
            win.append(w)
    return TraceTable(**{k: np.array(v) for k, v in cols.items()}, window=np.array(win) if windows else None)


@st.composite
def traces(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    L = draw(st.integers(1, 3))
    E = draw(st.integers(2, 6))
    n_tab = draw(st.integers(1, 3))
    tabs = [random_table(rng, L, E, windows=draw(st.booleans()), n_req=draw(st.integers(1, 6)),
                         n_rec=draw(st.integers(1, 40))) for _ in range(n_tab)]
    chunk = draw(st.integers(1, 9))
    phase, cold = draw(st.sampled_from([("decode", False), ("decode", True), ("all", False)]))
    return tabs, L, E, chunk, phase, cold


def _same_entries(ent, ref):
    for k in ("layer", "expert", "rnd", "record", "request"):
        assert np.array_equal(getattr(ent, k), ref[k]), k
    assert ent.n_tokens == ref["n_tokens"]
    assert ent.skipped == ref["skipped"]
    assert ent.rounds_by == ref["rounds_by"]
    assert ent.n_rounds == len(np.unique(ref["rnd"]))
    cnt = np.ones(len(ent), bool) if ent.count is None else ent.count
    assert np.array_equal(cnt, ref["count"])
    assert (ent.n_counted, ent.n_warmup) == (int(ref["count"].sum()), int((~ref["count"]).sum()))


@settings(max_examples=150, deadline=None)
@given(traces())
def test_chunked_preparation_equals_whole(case):
    tabs, L, E, chunk, phase, cold = case
    for arg in (tabs, tabs[0]):
        try:
            ref = reference_prepare(arg, L, E, phase=phase, cold=cold)
        except StrataError as e:
            with pytest.raises(StrataError) as got:
                prepare_entries(arg, L, E, phase=phase, cold=cold, chunk=chunk)
            assert str(got.value) == str(e)
            continue
        _same_entries(prepare_entries(arg, L, E, phase=phase, cold=cold), ref)
        _same_entries(prepare_entries(arg, L, E, phase=phase, cold=cold, chunk=chunk), ref)
    try:
        ref = reference_prepare(tabs, L, E, phase=phase, cold=cold)
    except StrataError:
        return
    s = prepare_stream(tabs, L, E, phase=phase, cold=cold, chunk=chunk)
    s.use_cache = True
    parts = list(s.chunks())
    cat = {k: np.concatenate([getattr(p, k) for p in parts]) for k in ("layer", "expert", "rnd", "record", "request")}
    cat["count"] = np.concatenate([np.ones(len(p), bool) if p.count is None else p.count for p in parts])
    for k in cat:
        assert np.array_equal(cat[k], ref[k]), k
    assert (len(s), s.n_counted, s.n_tokens, s.skipped, s.rounds_by, s.n_rounds) == (
        len(ref["layer"]), int(ref["count"].sum()), ref["n_tokens"], ref["skipped"], ref["rounds_by"],
        len(np.unique(ref["rnd"])))
    # a second pass (from the stream's entry cache) gives the same entries and the same round and record changes
    again = list(s.chunks())
    for k in ("layer", "expert"):
        assert np.array_equal(np.concatenate([p_.__dict__[k] for p_ in again]), ref[k]), k
    assert np.array_equal(np.concatenate([np.ones(len(p_), bool) if p_.count is None else p_.count for p_ in again]),
                          ref["count"])
    for k in ("rnd", "record"):
        a = np.concatenate([p_.__dict__[k] for p_ in again])
        assert np.array_equal(np.diff(a) != 0, np.diff(ref[k]) != 0), k


def _runs(L, E, rng):
    perm = rng.permutation(L * E)[: int(rng.integers(0, L * E + 1))]
    prof = Profile(L, E, np.stack([perm // E, perm % E], 1))
    cap = rng.integers(0, E + 1, size=L)
    blob = [int(x) for x in rng.integers(100, 2000, size=L)]
    slots = int(rng.integers(0, L * E + 1))
    ad = dict(adapt_every=int(rng.integers(1, 4)), margin=0.5, usage_floor=1.0, copy_delay_rounds=int(rng.integers(0, 3)),
              decay=0.7, max_moves=int(rng.integers(0, 4)))
    from stratatools.cachesim.costmodel import ThreeTierModel

    cost = ThreeTierModel(900.0, 25.0, 60.0, 6.0, int(sum(blob)))
    return [dict(policy="static", profile=prof, slots=slots, admission="global", blob_bytes=blob, cost=cost),
            dict(policy="static", profile=prof, slots=slots, admission="per-layer"),
            dict(policy="static", profile=prof, budget_bytes=sum(blob) * 2, blob_bytes=blob, admission="global"),
            dict(policy="adaptive", profile=prof, slots=slots, admission="global", **ad),
            dict(policy="adaptive", profile=None, slots=slots, admission="per-layer", **ad),
            dict(policy="adaptive", profile=prof, slots=slots, admission="global", **{**ad, "lag": 2, "upper_slots": 2}),
            dict(policy="adaptive", profile=prof, budget_bytes=sum(blob) * 2, blob_bytes=blob, admission="per-layer",
                 **{**ad, "lag": 3, "pace_bytes": 1500, "upper_slots": 1, "disjoint": 1}),
            dict(policy="lru", cap=cap), dict(policy="lfu", cap=cap, decay=0.5),
            dict(policy="lfru", cap=cap, decay=0.5), dict(policy="belady", cap=cap, blob_bytes=blob, cost=cost),
            dict(policy="belady", slots=slots)]


@settings(max_examples=60, deadline=None)
@given(traces())
def test_every_policy_chunked_equals_whole(case):
    tabs, L, E, chunk, phase, cold = case
    try:
        ent = prepare_entries(tabs, L, E, phase=phase, cold=cold)
    except StrataError:
        return
    rng = np.random.default_rng(len(ent))
    runs = _runs(L, E, rng)
    whole = [simulate_policy(ent, chunk=len(ent), **r).to_dict() for r in runs]
    assert whole[0]["tiers"] is not None and whole[0]["tiers"]["h_vram"] == whole[0]["h_expert"]
    for r, w in zip(runs, whole):
        kw = {k: v for k, v in r.items() if k not in ("policy", "cost")}
        h1, l1, i1 = run_policy(ent, r["policy"], **{k: v for k, v in kw.items()})
        h2, l2, i2 = run_policy(ent, r["policy"], chunk=chunk, **kw)
        assert np.array_equal(h1, h2) and np.array_equal(l1, l2) and i1 == i2, r["policy"]
        c = np.ones(len(ent), bool) if ent.count is None else ent.count  # metrics count the counted entries only
        assert w["hits"] == int(h1[c].sum()) and w["entries"] == int(c.sum()) and w["warmup"] == int((~c).sum())
        assert w["layer_entries"] == np.bincount(ent.layer[c], minlength=L).tolist()
        assert w["layer_hits"] == np.bincount(ent.layer[c][h1[c]], minlength=L).tolist()
        assert w["loads"] == int(l1.sum()) and w["rounds"] == len(np.unique(ent.rnd))
    assert [x.to_dict() for x in simulate_many(ent, runs, chunk=chunk)] == whole
    for cache in (False, True):  # with the entry cache the Belady runs read the second and third passes from it
        stream = prepare_stream(tabs, L, E, phase=phase, cold=cold, chunk=chunk)
        stream.use_cache = cache
        assert [x.to_dict() for x in simulate_many(stream, runs)] == whole


def reference_kfold(tables, L, E, k, policies, phase, cold, **common):
    """The k-fold as it was: materialise every fold, make-profile on the others, replay the fold."""
    table = merge_traces(list(tables))
    u, inv = np.unique(table.request, return_inverse=True)
    fold = (np.arange(len(u)) % k)[inv]
    count_phase = "decode" if phase == "decode" else "all"
    out = {"h": [], "entries": [], "in": {}}
    for f in range(k):
        prof, _ = make_profile([table.take(fold != f)], L, E, mode="no-base", fill="expert-major", phase=count_phase)
        ent = prepare_entries(table.take(fold == f), L, E, phase=phase, cold=cold)
        out["entries"].append(ent.n_counted)
        out["h"].append({p: simulate_policy(ent, p, profile=prof, **common).h_expert for p in policies})
    prof_all, _ = make_profile([table], L, E, mode="no-base", fill="expert-major", phase=count_phase)
    ent_all = prepare_entries(table, L, E, phase=phase, cold=cold)
    out["in"] = {p: simulate_policy(ent_all, p, profile=prof_all, **common).h_expert for p in policies}
    return out


@settings(max_examples=40, deadline=None)
@given(traces(), st.integers(2, 3))
def test_kfold_streamed_equals_materialised(case, k):
    tabs, L, E, chunk, phase, cold = case
    common = dict(slots=max(1, L * E // 2), admission="global")
    pols = ["static", "adaptive"]
    try:
        ref = reference_kfold(tabs, L, E, k, pols, phase, cold, **common)
    except StrataError:
        with pytest.raises(StrataError):
            kfold_eval(tabs, L, E, k, policies=pols, phase=phase, cold=cold, chunk=chunk, **common)
        return
    r = kfold_eval(tabs, L, E, k, policies=pols, phase=phase, cold=cold, chunk=chunk, **common)
    assert [row["entries"] for row in r.folds] == ref["entries"]
    assert [row["h_expert"] for row in r.folds] == ref["h"]
    assert r.in_sample == ref["in"]
    for p in pols:
        assert r.mean[p] == t_interval([h[p] for h in ref["h"]])[0]
    assert r.to_dict() == kfold_eval(tabs, L, E, k, policies=pols, phase=phase, cold=cold, **common).to_dict()


def test_table_chunks_of_a_strata_trace_equal_its_columns(tmp_path):
    from stratatools.traces.formats import read_trace, write_trace

    rng = np.random.default_rng(3)
    t = random_table(rng, 3, 6, windows=False, n_req=1, n_rec=50)
    t = TraceTable(**{**t.columns(), "expert": np.minimum(t.expert, 5), "layer": np.minimum(t.layer, 2)})
    for fmt in ("strata", "strata-tagged"):
        write_trace(t, tmp_path / f"t.{fmt}", fmt)
        back = read_trace(tmp_path / f"t.{fmt}")
        cols = back.columns()
        for rows in (1, 4, 7, 1000):
            parts = list(table_chunks(back, rows))
            for c in ("request", "position", "phase", "layer", "rank", "expert"):
                assert np.array_equal(np.concatenate([p[c] for p in parts]), cols[c]), (fmt, rows, c)


def test_stream_errors_are_one_line():
    t = TraceTable(request=[0, 0], position=[0, 0], phase=[1, 1], layer=[5, 5], rank=[0, 1], expert=[0, 1],
                   weight=[1, 1])
    with pytest.raises(StrataError, match="no routed entry of the traces fits 2 layers"):
        len(prepare_stream([t], 2, 4))
    with pytest.raises(StrataError, match="no routed entries"):
        prepare_stream([TraceTable.empty()], 2, 4)
    with pytest.raises(StrataError, match="unknown phase"):
        prepare_stream([t], 2, 4, phase="prefill")


def test_prefetch_keeps_order_raises_where_the_producer_stopped_and_stops_early():
    import threading

    from stratatools.cachesim.replay import prefetch

    assert list(prefetch(iter(range(50)), depth=2)) == list(range(50))
    assert list(prefetch(iter(range(5)), depth=0)) == list(range(5))

    def bad():
        yield 1
        yield 2
        raise StrataError("t.bin: byte 8: corrupt")

    got = []
    with pytest.raises(StrataError, match="byte 8: corrupt"):
        for x in prefetch(bad()):
            got.append(x)
    assert got == [1, 2]
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    for x in prefetch(endless()):
        if x == 3:
            break
    assert closed.wait(5)
