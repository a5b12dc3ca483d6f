"""Verify windows from tagged Strata traces: reading, round trips, rounds = windows in the replay and the CLIs."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from stratatools.cachesim import make_tier
from stratatools.cachesim.replay import prepare_entries, simulate_policy
from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile
from stratatools.traces.table import DECODE, PREFILL, UNKNOWN, TraceTable, trace_stats
from stratatools.traces.formats import read_trace, write_trace
from stratatools.traces.formats.strata import read_strata


def rec(layer, ids, w=None):
    k = len(ids)
    w = w if w is not None else [0.0] * k
    return struct.pack("<ii", layer, k) + struct.pack(f"<{k}i", *ids) + struct.pack(f"<{k}f", *w)


def tag(t, vals):
    return rec(t, vals, [0.0] * len(vals))


def window_bytes(ids_by_layer_pos, wid, phase=1):
    """One verify window: layer-major records (layer, [expert]) of n positions, then its commit tag."""
    L, n = len(ids_by_layer_pos), len(ids_by_layer_pos[0])
    body = b"".join(rec(layer, [ids_by_layer_pos[layer][p]]) for layer in range(L) for p in range(n))
    return body + tag(-1, [wid, n, n - 1, phase])


# -- reading -------------------------------------------------------------------------------------------------------

def test_windows_from_commits_and_uncommitted_records(tmp_path):
    L = 2
    data = tag(-2, [2]) + tag(-3, [7])
    data += rec(0, [9]) + rec(1, [8])                              # per-token loop: no commit -> outside
    data += b"".join(rec(layer, [layer * 10 + p]) for layer in range(L) for p in range(2))
    data += tag(-1, [40, 2, 1, 0])                                 # closes only the last 2 x 2 records
    data += b"".join(rec(layer, [20 + layer]) for layer in range(L)) + tag(-1, [41, 1, 0, 1])
    data += tag(-3, [8]) + rec(0, [5]) + rec(1, [6]) + tag(-1, [0, 1, 0, 1])
    data += rec(0, [3])                                            # a failed window's record: outside
    p = tmp_path / "t.bin"
    p.write_bytes(data)
    for chunk in (64, 1 << 25):
        t = read_strata(p, chunk_bytes=chunk)
        assert t.records is not None and t.has_windows
        assert t.records.window.tolist() == [-1, -1, 0, 0, 0, 0, 1, 1, 2, 2, -1]
        assert t.window.tolist() == [-1, -1, 0, 0, 0, 0, 1, 1, 2, 2, -1]
        assert np.asarray(t.phase).tolist() == [UNKNOWN] * 2 + [PREFILL] * 4 + [DECODE] * 4 + [UNKNOWN]
        assert t.meta["windows"] == 3 and t.meta["window_records"] == 8
    st = trace_stats(t)
    assert (st.windows, st.outside_windows, st.rounds) == (3, 3, "windows+positions")


def test_no_windows_for_plain_traces_and_tagged_without_commits(tmp_path):
    plain = tmp_path / "p.bin"
    plain.write_bytes(b"".join(rec(layer, [1]) for _ in range(3) for layer in range(2)))
    tagged = tmp_path / "t.bin"
    tagged.write_bytes(tag(-2, [2]) + tag(-3, [1]) + b"".join(rec(layer, [1]) for _ in range(3) for layer in range(2)))
    for p in (plain, tagged):
        t = read_trace(p)
        assert not t.has_windows and t.window is None
        assert trace_stats(t).rounds == "positions" and trace_stats(t).windows == 0
        ent = prepare_entries(t, 2, 4, phase="all")
        assert ent.rounds_by == "positions" and ent.n_rounds == 3


def test_variable_k_windows(tmp_path):
    data = tag(-2, [1]) + rec(0, [1, 2]) + rec(0, [3]) + tag(-1, [0, 2, 1]) + rec(0, [4, 5, 6]) + tag(-1, [1, 1, 0])
    p = tmp_path / "t.bin"
    p.write_bytes(data)
    t = read_trace(p)
    assert t.window.tolist() == [0, 0, 0, 1, 1, 1]
    assert prepare_entries(t, 1, 8, phase="all").rnd.tolist() == [0, 0, 0, 1, 1, 1]


# -- the adaptive tier counts rounds = windows -------------------------------------------------------------------------

# 3 windows of 2 positions, 1 layer, k 1, expert 1 every position; the profile puts expert 0 in the only slot.
SEQ = [[1, 1], [1, 1], [1, 1]]
ADAPT = dict(adapt_every=2, copy_delay_rounds=0)


def three_windows(tmp_path):
    data = tag(-2, [2]) + tag(-3, [0]) + b"".join(window_bytes([w], i) for i, w in enumerate(SEQ))
    p = tmp_path / "w.bin"
    p.write_bytes(data)
    return read_trace(p)


def online_h(rounds, **params):
    """h_expert of the online AdaptiveTier fed round by round: rounds = list of lists of (layer, expert)."""
    tier = make_tier("adaptive", n_layers=1, n_expert=4, profile=Profile(1, 4, [(0, 0)]), slots=1, **params)
    hits = []
    for r in rounds:
        for layer, e in r:
            hits += tier.access(layer, [e]).tolist()
        tier.end_round()
    return float(np.mean(hits))


def test_adaptive_rounds_are_windows(tmp_path):
    t = three_windows(tmp_path)
    prof = Profile(1, 4, [(0, 0)])
    win = prepare_entries(t, 1, 4)
    assert win.rounds_by == "windows" and win.n_rounds == 3 and win.rnd.tolist() == [0, 0, 1, 1, 2, 2]
    t_pos = three_windows(tmp_path)
    t_pos.window = None
    pos = prepare_entries(t_pos, 1, 4)
    assert pos.rounds_by == "positions" and pos.n_rounds == 6
    # by hand (usage floor 2, margin 1.5, copies land at once): rounds = positions adapts after position 2
    # (usage 2 > 0 + 1.5: expert 1 replaces expert 0), so positions 3..6 hit: 4/6. Rounds = windows adapts
    # after window 2 (position 4): only window 3 hits: 2/6.
    by_window = online_h([[(0, e) for e in w] for w in SEQ], **ADAPT)
    by_position = online_h([[(0, e)] for w in SEQ for e in w], **ADAPT)
    assert by_window == pytest.approx(2 / 6) and by_position == pytest.approx(4 / 6)
    for engine in ("compiled", "python"):
        rw = simulate_policy(win, "adaptive", profile=prof, slots=1, engine=engine, **ADAPT)
        rp = simulate_policy(pos, "adaptive", profile=prof, slots=1, engine=engine, **ADAPT)
        assert rw.h_expert == pytest.approx(by_window) and rw.rounds == 3 and rw.rounds_by == "windows"
        assert rp.h_expert == pytest.approx(by_position) and rp.rounds == 6 and rp.rounds_by == "positions"
        assert rw.params["swaps"] == 1 and rp.params["swaps"] == 1
    # default copy delay (1 round): positions -> adapt after 2, lands after 3: positions 4..6 hit; windows -> never
    assert simulate_policy(pos, "adaptive", profile=prof, slots=1, adapt_every=2).h_expert == pytest.approx(3 / 6)
    assert simulate_policy(win, "adaptive", profile=prof, slots=1, adapt_every=2).h_expert == 0.0


def test_adaptive_layer_major_windows_match_online_tier(tmp_path):
    """Two layers, windows written layer-major: the replay equals the online tier fed window by window."""
    rng = np.random.default_rng(3)
    L, E, W, n = 2, 6, 8, 3
    wins = [rng.integers(0, E, size=(L, n)).tolist() for _ in range(W)]
    data = tag(-2, [2]) + tag(-3, [0]) + b"".join(window_bytes(w, i) for i, w in enumerate(wins))
    p = tmp_path / "lm.bin"
    p.write_bytes(data)
    t = read_trace(p)
    prof = Profile(L, E, [(0, 0), (1, 0), (0, 1), (1, 1)])
    params = dict(adapt_every=2, copy_delay_rounds=0, usage_floor=1.0, margin=0.5)
    tier = make_tier("adaptive", profile=prof, slots=4, **params)
    hits = []
    for w in wins:
        for layer in range(L):
            for e in w[layer]:
                hits += tier.access(layer, [e]).tolist()
        tier.end_round()
    ent = prepare_entries(t, L, E)
    assert ent.n_rounds == W and ent.rounds_by == "windows"
    for engine in ("compiled", "python"):
        r = simulate_policy(ent, "adaptive", profile=prof, slots=4, engine=engine, **params)
        assert r.h_expert == pytest.approx(float(np.mean(hits)))


def test_meta_window_and_mixed_rounds():
    """A column-built table with meta["window"] (an ndarray) or window=; -1 keeps rounds by position."""
    n = 6
    cols = dict(request=np.zeros(n), position=np.arange(n), phase=np.full(n, DECODE), layer=np.zeros(n),
                rank=np.zeros(n), expert=np.ones(n), weight=np.ones(n))
    t = TraceTable(**cols, meta={"window": np.array([-1, -1, 0, 0, 1, 1])})
    ent = prepare_entries(t, 1, 4)
    assert ent.rnd.tolist() == [0, 1, 2, 2, 3, 3] and ent.rounds_by == "windows+positions"
    t2 = TraceTable(**cols, window=[0, 0, 0, -1, -1, 5])
    assert prepare_entries(t2, 1, 4).rnd.tolist() == [0, 0, 0, 1, 2, 3]


def test_merge_keeps_windows_distinct():
    from stratatools.cachesim.replay import merge_traces

    n = 4
    cols = dict(request=np.zeros(n), position=np.arange(n), phase=np.full(n, DECODE), layer=np.zeros(n),
                rank=np.zeros(n), expert=np.ones(n), weight=np.ones(n))
    a = TraceTable(**cols, window=[0, 0, 1, 1])
    b = TraceTable(**cols)
    m = merge_traces([a, b, a])
    assert m.window.tolist() == [0, 0, 1, 1, -1, -1, -1, -1, 2, 2, 3, 3]
    assert np.asarray(m.request).tolist() == [0] * 4 + [1] * 4 + [2] * 4
    ent = prepare_entries(m, 1, 4)
    assert ent.n_rounds == 2 + 4 + 2 and ent.rounds_by == "windows+positions"
    assert TraceTable.concat([b, b]).window is None
    assert m.take(np.arange(12) >= 8).window.tolist() == [2, 2, 3, 3]


# -- round trips -----------------------------------------------------------------------------------------------------

def _windowed_table(tmp_path):
    data = tag(-2, [2]) + tag(-3, [4]) + rec(0, [7]) + rec(1, [6])
    data += window_bytes([[1, 2], [3, 4]], 10) + window_bytes([[5], [0]], 11)
    data += tag(-3, [5]) + window_bytes([[2, 2, 2], [1, 1, 1]], 0, phase=0) + rec(0, [3])
    p = tmp_path / "src.bin"
    p.write_bytes(data)
    return read_trace(p)


@pytest.mark.parametrize("fmt", ["strata-tagged", "parquet", "csv"])
def test_round_trip_keeps_windows(tmp_path, fmt):
    t = _windowed_table(tmp_path)
    assert t.window.tolist() == [-1, -1, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, -1]
    out = tmp_path / f"t.{fmt}"
    write_trace(t, out, fmt)
    back = read_trace(out)
    assert back.window.tolist() == t.window.tolist()
    for col in ("phase", "layer", "rank", "expert"):
        assert np.asarray(getattr(back, col)).tolist() == np.asarray(getattr(t, col)).tolist(), col
    # CSV renumbers requests in order of first appearance: compare the grouping
    assert np.unique(back.request, return_inverse=True)[1].tolist() == \
        np.unique(t.request, return_inverse=True)[1].tolist()
    a, b = prepare_entries(t, 2, 8, phase="all"), prepare_entries(back, 2, 8, phase="all")
    assert a.rnd.tolist() == b.rnd.tolist() and b.rounds_by == "windows+positions"
    if fmt == "strata-tagged":  # writing again gives the same bytes
        out2 = tmp_path / "t2.bin"
        write_trace(back, out2, fmt)
        assert out2.read_bytes() == out.read_bytes()


def test_plain_strata_drops_windows_and_unwindowed_outputs_unchanged(tmp_path):
    t = _windowed_table(tmp_path)
    out = tmp_path / "plain.bin"
    write_trace(t, out, "strata")
    assert read_trace(out).window is None
    cols = {k: np.asarray(getattr(t, k)) for k in ("request", "position", "phase", "layer", "rank", "expert", "weight")}
    nw = TraceTable(**cols)
    write_trace(nw, tmp_path / "n.csv", "csv")
    assert (tmp_path / "n.csv").read_text().split("\n", 1)[0].endswith(",weight,phase")
    write_trace(nw, tmp_path / "n.parquet", "parquet")
    import pyarrow.parquet as pq

    assert "window" not in pq.ParquetFile(tmp_path / "n.parquet").schema_arrow.names
    write_trace(nw, tmp_path / "n.bin", "strata-tagged")
    assert read_trace(tmp_path / "n.bin").meta["commits"] == 0


def test_tagged_writer_refuses_a_window_it_cannot_delimit(tmp_path):
    # records outside windows, then a window of 3 records over 2 layers in the same request: no commit fits
    n = 5
    t = TraceTable(request=np.zeros(n), position=[0, 0, 1, 1, 2], phase=np.full(n, DECODE), layer=[0, 1, 0, 1, 0],
                   rank=np.zeros(n), expert=np.ones(n), weight=np.ones(n), window=[-1, -1, 0, 0, 0])
    with pytest.raises(StrataError, match="window 0 .* not a whole number of positions"):
        write_trace(t, tmp_path / "x.bin", "strata-tagged")
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.bin.tmp").exists()
    # after a commit (no records outside it) any count is closable
    t.window = [0, 0, 1, 1, 1]
    write_trace(t, tmp_path / "y.bin", "strata-tagged")
    assert read_trace(tmp_path / "y.bin").window.tolist() == [0, 0, 1, 1, 1]


def test_bad_csv_window(tmp_path):
    p = tmp_path / "b.csv"
    p.write_text("model,prompt_id,token_pos,layer,rank,expert_id,weight,phase,window\nm,a,0,0,0,1,1.0,decode,-2\n")
    with pytest.raises(StrataError, match="line 2: window -2 is out of range"):
        read_trace(p)
    p.write_text("model,prompt_id,token_pos,layer,rank,expert_id,weight,phase,window\nm,a,0,0,0,1,1.0,decode,x\n")
    with pytest.raises(StrataError, match="line 2: field window"):
        read_trace(p)


# -- CLIs ------------------------------------------------------------------------------------------------------------

def test_cli_stats_and_simulate_say_rounds_are_windows(tmp_path, cli):
    three_windows(tmp_path)
    src = tmp_path / "w.bin"
    code, out, err = cli("trace", "stats", str(src), "--json")
    assert code == 0, err
    d = json.loads(out)
    assert (d["windows"], d["outside_windows"], d["rounds"]) == (3, 0, "windows")
    code, out, err = cli("trace", "stats", str(src))
    assert code == 0 and "rounds: verify windows (3 windows" in out
    prof = tmp_path / "p.strp"
    Profile(1, 4, [(0, 0)]).write(prof)
    rep = tmp_path / "rep"
    code, out, err = cli("simulate", "--traces", str(src), "--profile", str(prof), "--slots", "1", "--policy",
                         "adaptive", "--set", "adaptive.adapt_every=2", "--set", "adaptive.copy_delay_rounds=0",
                         "--no-sweep", "--report", str(rep))
    assert code == 0, err
    assert out.count("rounds: 3 verify windows") == 1
    code, out, err = cli("compare", "--traces", str(src), "--profile", str(prof), "--slots", "1")
    assert code == 0 and out.count("rounds: 3 verify windows") == 1
    md = (rep / "report.md").read_text()
    assert "LFU/LFRU decay): verify windows from the traces' commit records (3 rounds)" in md
    js = json.loads((rep / "report.json").read_text())
    r = [x for x in js["results"] if x["policy"] == "adaptive"][0]
    assert r["rounds_by"] == "windows" and r["h_expert"] == pytest.approx(2 / 6)


# -- property: random tagged streams ---------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PIECE = st.one_of(
    st.tuples(st.just("window"), st.integers(1, 3), st.integers(1, 3), st.integers(0, 1)),  # layers, positions, phase
    st.tuples(st.just("loose"), st.integers(1, 3), st.integers(1, 2), st.just(0)),          # uncommitted records
    st.tuples(st.just("request"), st.integers(0, 5), st.just(0), st.just(0)),
    st.tuples(st.just("empty_commit"), st.just(0), st.just(0), st.just(0)),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_PIECE, max_size=12), st.integers(0, 2 ** 31 - 1))
def test_random_streams_windows_and_tagged_round_trip(pieces, seed):
    import tempfile
    from pathlib import Path

    rng = np.random.default_rng(seed)
    data = tag(-2, [2])
    want = []
    wid = 0
    for kind, L, n, ph in pieces:
        if kind == "request":
            data += tag(-3, [L])
        elif kind == "empty_commit":
            data += tag(-1, [99, 0, 0, 1])
        elif kind == "loose":  # the per-token loop: token-major, no commit
            for _ in range(n):
                for layer in range(L):
                    data += rec(layer, [int(rng.integers(0, 4))])
                    want.append(-1)
        else:
            data += b"".join(rec(layer, [int(rng.integers(0, 4))]) for layer in range(L) for _ in range(n))
            data += tag(-1, [7, n, 0, ph])
            want += [wid] * (L * n)
            wid += 1
    if not want:
        return
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.bin"
        p.write_bytes(data)
        t = read_trace(p)
        got = t.window.tolist() if t.has_windows else [-1] * len(want)
        # a window closes exactly its own records unless loose records of other layer spans precede it
        # in the same stretch; with equal spans (or none before it) the ids are exact
        if all(k != "loose" for k, *_ in pieces):
            assert got == want
        ent = prepare_entries(t, 3, 4, phase="all")
        assert len(ent) == len(want)
        out = Path(d) / "o.bin"
        try:
            write_trace(t, out, "strata-tagged")
        except StrataError as e:
            assert "not a whole number of positions" in str(e)
            return
        back = read_trace(out)
        assert (back.window.tolist() if back.has_windows else [-1] * len(want)) == got
        assert np.asarray(back.request).tolist() == np.asarray(t.request).tolist()
        assert np.asarray(back.phase).tolist() == np.asarray(t.phase).tolist()


def test_cli_stats_names_prefill_batches_apart_from_verify_windows(tmp_path, cli):
    """A run's trace writes each prefill batch as a window: trace stats counts those apart and does not call
    them verify windows (whole read and chunked read alike)."""
    from stratatools.traces.sources import StrataTaggedSource, trace_stats_sources

    pre = tag(-5, [PREFILL]) + window_bytes([[1, 2, 3]], 0, phase=PREFILL)
    dec = tag(-5, [DECODE]) + window_bytes([[1]], 1) + window_bytes([[2]], 2)
    for name, data, want, line in (
            ("p.bin", tag(-2, [2]) + tag(-3, [0]) + pre, (1, 1), "rounds: prefill batches (1 batches"),
            ("m.bin", tag(-2, [2]) + tag(-3, [0]) + pre + dec, (3, 1),
             "rounds: windows (2 verify windows and 1 prefill batches")):
        p = tmp_path / name
        p.write_bytes(data)
        st = trace_stats(read_trace(p))
        assert (st.windows, st.prefill_windows) == want
        assert trace_stats_sources([StrataTaggedSource(p)]).prefill_windows == want[1]
        code, out, err = cli("trace", "stats", str(p), "--json")
        assert code == 0, err
        assert (json.loads(out)["windows"], json.loads(out)["prefill_windows"]) == want
        code, out, err = cli("trace", "stats", str(p))
        assert code == 0 and line in out, out
        assert "verify windows (" not in out
