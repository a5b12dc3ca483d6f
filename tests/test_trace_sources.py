"""Traces of any size: chunk sources (tagged Strata walked in chunks, Parquet in record batches), folders, globs
and hive-partitioned datasets with --where, and the streamed make-profile / trace stats equal to the whole reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratatools.core.errors import StrataError
from stratatools.traces.formats import read_trace, write_trace
from stratatools.traces.formats.strata_walk import HAVE_NUMBA
from stratatools.traces.sources import (StrataTaggedSource, expand_traces, open_source, open_traces,
                                       trace_stats_sources)
from stratatools.traces.table import TraceTable, trace_stats

from test_trace_walk import tagged_stream

COLS = ("request", "position", "phase", "layer", "rank", "expert", "weight")


LOCALITY = ("window", "locality_phase", "reuse_quantiles", "collapsed_layers", "verdict", "meta")
LAYER_LOCALITY = ("window_distinct_min", "window_distinct_mean", "reuse_p50", "reuse_p90", "cold_share")


def _base(st) -> dict:
    """The statistics a chunked read computes (trace_stats' locality figures need the whole trace)."""
    d = {k: v for k, v in st.to_dict().items() if k not in LOCALITY}
    d["per_layer"] = [{k: v for k, v in pl.items() if k not in LAYER_LOCALITY} for pl in d["per_layer"]]
    return d


def _cat(src, rows):
    parts = list(src.chunks(rows))
    return {c: np.concatenate([p[c] for p in parts]) if parts else np.zeros(0) for c in parts[0]} if parts else {}


@pytest.mark.skipif(not HAVE_NUMBA, reason="the chunked tagged walk needs numba")
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.integers(1, 4), st.integers(0, 60), st.sampled_from([1, 2]), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_tagged_walk_in_chunks_equals_the_whole_read(tmp_path, k, n_items, version, rows, seed):
    rng = np.random.default_rng(seed)
    p = tmp_path / f"t{seed}.bin"
    p.write_bytes(tagged_stream(rng, n_items, k, 3, 6, version))
    try:
        whole = read_trace(p)
    except StrataError as e:
        with pytest.raises(StrataError) as got:
            _cat(StrataTaggedSource(p, chunk_bytes=64), rows)
        assert str(got.value) == str(e)
        return
    got = _cat(StrataTaggedSource(p, chunk_bytes=64), rows)
    if len(whole) == 0:
        assert got == {} or len(got["layer"]) == 0
        return
    for c in COLS:
        assert np.array_equal(got[c], getattr(whole, c)), c
    w = whole.window
    assert np.array_equal(got["window"], w if w is not None else np.full(len(whole), -1))
    assert _base(trace_stats_sources([StrataTaggedSource(p, chunk_bytes=64)], rows=rows)) == _base(trace_stats(whole))


def _table(rng, n_rec, L=4, E=8, req=0, windows=False):
    k = 2
    lay = np.tile(np.arange(L), n_rec // L + 1)[:n_rec]
    ex = np.stack([rng.choice(E, 2, replace=False) for _ in range(n_rec)])
    pos = np.arange(n_rec) // L
    cols = dict(request=np.full(n_rec * k, req), position=np.repeat(pos, k), phase=np.ones(n_rec * k),
                layer=np.repeat(lay, k), rank=np.tile([0, 1], n_rec), expert=ex.reshape(-1),
                weight=np.ones(n_rec * k))
    w = np.repeat(np.where(pos % 3 == 0, pos // 3, -1), k) if windows else None
    return TraceTable(**cols, window=w, meta={"n_layers": L, "n_expert": E})


@pytest.mark.parametrize("fmt", ["strata", "strata-tagged", "parquet", "csv"])
def test_stats_in_chunks_equal_the_whole_read(tmp_path, fmt):
    t = _table(np.random.default_rng(1), 96, windows=fmt in ("strata-tagged", "parquet"))
    p = tmp_path / f"t.{fmt}"
    write_trace(t, p, fmt)
    whole = trace_stats(read_trace(p))
    for rows in (1, 5, 64, 10_000):
        got = trace_stats_sources([open_source(p)], rows=rows)
        assert _base(got) == _base(whole), rows


def _dataset(root: Path, rng) -> dict[str, TraceTable]:
    tabs = {}
    for server in ("a", "b"):
        for day in ("2026-11-30", "2026-12-01"):
            t = _table(rng, 40 + len(tabs) * 8, req=len(tabs))
            d = root / f"server={server}" / f"date={day}"
            d.mkdir(parents=True)
            write_trace(t, d / "part-0.parquet", "parquet")
            tabs[f"{server}/{day}"] = t
    return tabs


def test_folders_globs_and_where(tmp_path):
    tabs = _dataset(tmp_path / "ds", np.random.default_rng(2))
    files = expand_traces([str(tmp_path / "ds")])
    assert [f.relative_to(tmp_path / "ds").parts[:2] for f, _ in files] == [
        ("server=a", "date=2026-11-30"), ("server=a", "date=2026-12-01"), ("server=b", "date=2026-11-30"),
        ("server=b", "date=2026-12-01")]
    assert files[0][1] == {"server": "a", "date": "2026-11-30"}
    assert len(expand_traces([str(tmp_path / "ds" / "server=*" / "date=2026-12-01" / "*.parquet")])) == 2
    assert [k for _, k in expand_traces([str(tmp_path / "ds")], ["server=b"])] == [
        {"server": "b", "date": "2026-11-30"}, {"server": "b", "date": "2026-12-01"}]
    # a data-column filter keeps rows: layer 0 only
    src = open_traces([str(tmp_path / "ds")], where=["server=a", "layer=0"])
    assert len(src) == 2
    assert all((c["layer"] == 0).all() for s in src for c in s.chunks(7))
    st = trace_stats_sources(open_traces([str(tmp_path / "ds")], where=["server=a"]))
    want = sum(len(tabs[k]) for k in tabs if k.startswith("a/"))
    assert st.entries == want and st.requests == 2 and st.meta["inputs"] == 2


def test_bad_dataset_inputs_are_one_line_errors(tmp_path, cli):
    _dataset(tmp_path / "ds", np.random.default_rng(3))
    code, out, err = cli("trace", "stats", str(tmp_path / "nothing-*.parquet"))
    assert code == 2 and "the glob matches no file" in err and len(err.strip().splitlines()) == 1
    code, out, err = cli("trace", "stats", str(tmp_path / "ds"), "--where", "region=eu")
    assert code == 2 and "no partition key or column 'region'" in err and "server" in err
    assert len(err.strip().splitlines()) == 1
    code, out, err = cli("trace", "stats", str(tmp_path / "ds"), "--where", "server=zz")
    assert code == 2 and "no trace file is left" in err
    # one file of another schema (expert as int64) and one of another geometry
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "ds" / "server=c" / "date=2026-12-01"
    bad.mkdir(parents=True)
    t = pq.read_table(tmp_path / "ds" / "server=a" / "date=2026-12-01" / "part-0.parquet")
    pq.write_table(t.set_column(t.schema.get_field_index("expert"), "expert", t.column("expert").cast(pa.int64())),
                   bad / "part-0.parquet")
    code, out, err = cli("trace", "stats", str(tmp_path / "ds"))
    assert code == 2 and "schema differs" in err and "expert" in err and len(err.strip().splitlines()) == 1
    (bad / "part-0.parquet").unlink()
    meta = dict(t.schema.metadata)
    m = json.loads(meta[b"stratatools.traces.table"])
    m["n_expert"] = 16
    meta[b"stratatools.traces.table"] = json.dumps(m).encode()
    pq.write_table(t.replace_schema_metadata(meta), bad / "part-0.parquet")
    code, out, err = cli("trace", "stats", str(tmp_path / "ds"))
    assert code == 2 and "n_expert 16" in err and "one model" in err


def test_make_profile_and_simulate_from_a_dataset_equal_the_files(tmp_path, cli):
    tabs = _dataset(tmp_path / "ds", np.random.default_rng(4))
    files = [str(f) for f, _ in expand_traces([str(tmp_path / "ds")])]
    code, _, err = cli("make-profile", str(tmp_path / "ds"), "-o", str(tmp_path / "a.strp"), "--n-layer", "4",
                       "--n-expert", "8")
    assert code == 0, err
    code, _, err = cli("make-profile", *files, "-o", str(tmp_path / "b.strp"), "--n-layer", "4", "--n-expert", "8")
    assert code == 0, err
    assert (tmp_path / "a.strp").read_bytes() == (tmp_path / "b.strp").read_bytes()
    code, _, err = cli("make-profile", str(tmp_path / "ds"), "--where", "server=a", "-o", str(tmp_path / "c.strp"),
                       "--n-layer", "4", "--n-expert", "8")
    assert code == 0, err
    code, _, err = cli("make-profile", *files[:2], "-o", str(tmp_path / "d.strp"), "--n-layer", "4",
                       "--n-expert", "8")
    assert (tmp_path / "c.strp").read_bytes() == (tmp_path / "d.strp").read_bytes()
    outs = []
    for tr in ([str(tmp_path / "ds")], files):
        args = ["compare", "--profile", str(tmp_path / "a.strp"), "--slots", "12", "--json"]
        for x in tr:
            args += ["--traces", x]
        code, out, err = cli(*args)
        assert code == 0, err
        outs.append(json.loads(out))
    assert outs[0] == outs[1]
    assert outs[0]["entries"] == sum(len(t) for t in tabs.values())


def test_convert_to_a_partitioned_dataset(tmp_path, cli):
    t = _table(np.random.default_rng(5), 96, windows=True)
    src = tmp_path / "t.bin"
    write_trace(t, src, "strata-tagged")
    out = tmp_path / "fleet"
    for server in ("a", "b"):
        code, o, err = cli("trace", "convert", str(src), "-o", str(out), "--to", "parquet", "--dataset",
                           "--partition", f"server={server}", "--partition", "date=2026-12-01", "--json")
        assert code == 0, err
        d = json.loads(o)
        assert d["entries"] == len(t) and d["files"] == [str(out / f"server={server}" / "date=2026-12-01" /
                                                            "part-00000.parquet")]
    code, o, err = cli("trace", "convert", str(src), "-o", str(out), "--to", "parquet", "--dataset",
                       "--partition", "server=a", "--partition", "date=2026-12-01")
    assert code == 2 and "already holds files" in err and len(err.strip().splitlines()) == 1
    code, o, err = cli("trace", "convert", str(src), "-o", str(out), "--to", "csv", "--partition", "server=a")
    assert code == 2 and "need --to parquet --dataset" in err
    whole = trace_stats(read_trace(src))
    got = trace_stats_sources(open_traces([str(out)], where=["server=b"]))
    assert _base(got) == _base(whole)
    both = trace_stats_sources(open_traces([str(out)]))
    assert both.entries == 2 * len(t) and both.requests == 2 and both.windows == 2 * whole.windows


def test_trace_stats_cli_streams_datasets_and_keeps_locality_for_one_small_file(tmp_path, cli):
    _dataset(tmp_path / "ds", np.random.default_rng(8))
    code, out, err = cli("trace", "stats", str(tmp_path / "ds"), "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["verdict"].startswith("locality not computed") and d["meta"]["inputs"] == 4
    one = str(expand_traces([str(tmp_path / "ds")])[0][0])
    code, out, err = cli("trace", "stats", one, "--json")
    assert code == 0, err
    d1 = json.loads(out)
    assert not d1["verdict"].startswith("locality not computed") and d1["per_layer"][0]["reuse_p50"] is not None


@pytest.mark.skipif(not HAVE_NUMBA, reason="the chunked tagged walk needs numba")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.integers(1, 4), st.integers(1, 80), st.sampled_from([1, 2]), st.integers(1, 40), st.integers(0, 2**31 - 1),
       st.sampled_from(["decode", "all"]))
def test_tagged_records_and_streamed_replay_equal_the_whole_read(tmp_path, k, n_items, version, rows, seed, phase):
    """The record chunks a replay's scan pass reads are the entries' records; the prepared stream over the walked
    source (scan on records, replay on entries, any chunk size) equals prepare_entries of the whole read."""
    from stratatools.cachesim.replay import EntryStream, prepare_entries, simulate_policy

    rng = np.random.default_rng(seed)
    p = tmp_path / f"t{seed}.bin"
    p.write_bytes(tagged_stream(rng, n_items, k, 3, 6, version))
    try:
        whole = read_trace(p)
    except StrataError:
        return
    if len(whole) == 0:
        return
    src = StrataTaggedSource(p, chunk_bytes=64)
    ent = _cat(src, rows)
    recs = [c for c in src.record_chunks(rows)]
    rc = {c: np.concatenate([r[c] for r in recs]) for c in recs[0]}
    starts = np.flatnonzero(np.r_[True, ent["rank"][1:] <= ent["rank"][:-1]])
    keep = rc["k"] > 0
    assert int(rc["k"].sum()) == len(ent["rank"])
    for c in ("request", "position", "phase", "layer", "window"):
        assert np.array_equal(rc[c][keep], ent[c][starts]), c
    try:
        ref = prepare_entries(whole, 3, 6, phase=phase)
    except StrataError as e:
        with pytest.raises(StrataError) as got:
            len(EntryStream([src], 3, 6, phase=phase, chunk=rows, merge=False))
        assert str(got.value) == str(e)
        return
    stream = EntryStream([src], 3, 6, phase=phase, chunk=rows, merge=False)
    parts = list(stream.chunks())
    for c in ("layer", "expert", "rnd", "record", "request", "token"):
        assert np.array_equal(np.concatenate([getattr(x, c) for x in parts]), getattr(ref, c)), c
    assert (stream.n_tokens, stream.n_rounds, stream.rounds_by, stream.skipped) == \
        (ref.n_tokens, ref.n_rounds, ref.rounds_by, ref.skipped)
    for pol in ("adaptive", "lru"):
        a = simulate_policy(ref, pol, slots=5, adapt_every=2) if pol == "adaptive" else simulate_policy(ref, pol, slots=5)
        kw = {"adapt_every": 2} if pol == "adaptive" else {}
        b = simulate_policy(EntryStream([src], 3, 6, phase=phase, chunk=rows), pol, slots=5, **kw)
        assert a.to_dict() == b.to_dict(), pol


@pytest.mark.skipif(not HAVE_NUMBA, reason="the chunked tagged walk needs numba")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.integers(1, 4), st.integers(1, 80), st.sampled_from([1, 2]), st.integers(1, 30), st.integers(0, 2**31 - 1))
def test_streamed_convert_equals_the_whole_convert(tmp_path, k, n_items, version, rows, seed):
    """trace convert chunk by chunk: Strata outputs byte-identical to the whole convert, Parquet and CSV outputs
    read back as the same table (windows included), from a walked tagged trace and from a Parquet file read in
    batches that cut records."""
    from stratatools.traces.formats import convert_trace
    from stratatools.traces.sources import convert_trace_stream

    rng = np.random.default_rng(seed)
    p = tmp_path / f"t{seed}.bin"
    p.write_bytes(tagged_stream(rng, n_items, k, 3, 6, version))
    try:
        whole = read_trace(p)
    except StrataError as e:
        with pytest.raises(StrataError) as got:
            convert_trace_stream(p, tmp_path / "x.parquet", "parquet", rows=rows)
        assert str(got.value) == str(e)
        return
    pq_in = tmp_path / f"in{seed}.parquet"
    write_trace(whole, pq_in, "parquet")
    for src in (p, pq_in):
        for to in ("strata", "strata-tagged", "parquet", "csv"):
            a, b = tmp_path / f"a.{to}", tmp_path / f"b.{to}"
            try:
                ra = convert_trace(src, a, to, force=True)
            except StrataError as e:
                with pytest.raises(StrataError) as got:
                    convert_trace_stream(src, b, to, force=True, rows=rows)
                assert str(got.value).replace(str(b), str(a)) == str(e), (src, to)
                continue
            got_n = []
            rb = convert_trace_stream(src, b, to, force=True, rows=rows, progress=got_n.append)
            assert (rb.entries, rb.records, rb.from_format) == (ra.entries, ra.records, ra.from_format), (src, to)
            assert sum(got_n) == ra.entries + ra.dropped_prefill  # progress: entries read
            if to.startswith("strata"):
                assert a.read_bytes() == b.read_bytes(), (src, to)
                continue
            if ra.entries == 0:
                continue
            ta, tb = read_trace(a), read_trace(b)
            for c in COLS:
                assert np.array_equal(getattr(ta, c), getattr(tb, c)), (src, to, c)
            assert (ta.window is None) == (tb.window is None), (src, to)
            if ta.window is not None:
                assert np.array_equal(ta.window, tb.window), (src, to)


def test_streamed_convert_to_csv_refuses_negative_positions_as_the_whole_convert(tmp_path):
    from stratatools.traces.formats import convert_trace
    from stratatools.traces.sources import convert_trace_stream

    t = _table(np.random.default_rng(5), 40)
    pos = np.asarray(t.position).copy()
    pos[37:] = -1
    cols = {**t.columns(), "position": pos}
    src = tmp_path / "neg.parquet"
    write_trace(TraceTable(**cols, meta=dict(t.meta)), src, "parquet")
    with pytest.raises(StrataError) as whole:
        convert_trace(src, tmp_path / "a.csv", "csv")
    with pytest.raises(StrataError) as streamed:
        convert_trace_stream(src, tmp_path / "a.csv", "csv", rows=8)
    assert str(streamed.value) == str(whole.value) and "is negative" in str(whole.value)
    assert not (tmp_path / "a.csv").exists()
