"""Trace readers and writers: every format, tags, chunk boundaries, bad input, random and mutated bytes."""

from __future__ import annotations

import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratatools.core.errors import StrataError
from stratatools.traces.table import DECODE, PREFILL, UNKNOWN, TraceTable, trace_stats
from stratatools.traces.formats import read_trace, write_trace
from stratatools.traces.formats import sniff_format
from stratatools.traces.formats.strata import read_strata


def rec(layer, ids, w=None):
    k = len(ids)
    w = w if w is not None else [0.25] * k
    return struct.pack("<ii", layer, k) + struct.pack(f"<{k}i", *ids) + struct.pack(f"<{k}f", *w)


def tag(t, vals):
    return rec(t, vals, [0.0] * len(vals))


def write(tmp_path, name, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


# -- Strata plain ----------------------------------------------------------------------------------------------------

def test_plain_constant_k_columns(tmp_path):
    data = b"".join(rec(layer, [layer, layer + 1], [0.75, 0.25]) for _ in range(3) for layer in range(4))
    t = read_trace(write(tmp_path, "t.bin", data))
    assert len(t) == 24 and t.meta["source_format"] == "strata" and t.meta["k"] == 2
    assert t.layer.tolist() == [lay for _ in range(3) for lay in range(4) for _ in range(2)]
    assert t.rank.tolist() == [0, 1] * 12
    assert t.expert[:4].tolist() == [0, 1, 1, 2]
    assert t.weight[:2].tolist() == [0.75, 0.25]
    assert t.position.tolist() == [p for p in range(3) for _ in range(8)]
    assert set(np.asarray(t.phase).tolist()) == {DECODE} and set(np.asarray(t.request).tolist()) == {0}


def test_layer_major_window_positions(tmp_path):
    """Verify windows write layer-major; the position is the record's ordinal within its layer."""
    data = b"".join(rec(layer, [p]) for layer in range(3) for p in range(4))
    t = read_trace(write(tmp_path, "t.bin", data))
    assert t.position.tolist() == [0, 1, 2, 3] * 3


def test_variable_k_and_chunk_boundaries(tmp_path):
    rng = np.random.default_rng(0)
    recs = []
    for i in range(400):
        k = int(rng.integers(1, 9)) if i % 50 < 25 else 4
        ids = rng.choice(30, k, replace=False).tolist()  # a record's top-k: distinct ids
        recs.append((int(rng.integers(0, 5)), ids, rng.random(k).astype(np.float32).tolist()))
    data = b"".join(rec(*r) for r in recs)
    p = write(tmp_path, "t.bin", data)
    want_e = [e for _, ids, _ in recs for e in ids]
    want_r = [i for _, ids, _ in recs for i in range(len(ids))]
    for chunk in (64, 100, 4096, 1 << 20):
        t = read_strata(p, chunk_bytes=chunk)
        assert t.expert.tolist() == want_e
        assert t.rank.tolist() == want_r
        assert t.layer.tolist() == [lay for lay, ids, _ in recs for _ in ids]
        assert np.allclose(t.weight, [w for _, _, ws in recs for w in ws])
    assert "k" not in t.meta


def test_zero_weights_become_unit(tmp_path):
    t = read_trace(write(tmp_path, "t.bin", rec(0, [1, 2], [0.0, 0.0]) + rec(0, [3, 4], [0.0, 0.5])))
    assert t.weight.tolist() == [1.0, 1.0, 0.0, 0.5]


def test_untagged_negative_layers_skipped_and_counted(tmp_path):
    t = read_trace(write(tmp_path, "t.bin", rec(0, [1]) + tag(-7, [5, 5]) + rec(1, [2])))
    assert t.expert.tolist() == [1, 2] and t.meta["tags_skipped"] == {"-7": 1}


# -- Strata tagged ---------------------------------------------------------------------------------------------------

def test_tagged_v2_requests_commits_phases(tmp_path):
    L = 2
    data = tag(-2, [2]) + tag(-4, list(range(10))) + tag(-6, [1, 2, 3]) + tag(-3, [7])
    # an uncommitted per-token record, then a prompt window of 2 positions (layer-major), commit phase 0
    data += rec(0, [9])
    data += b"".join(rec(layer, [layer * 10 + p]) for layer in range(L) for p in range(2))
    data += tag(-1, [0, 2, 1, 0])
    # a decode window of 1 position
    data += b"".join(rec(layer, [20 + layer]) for layer in range(L)) + tag(-1, [1, 1, 0, 1])
    data += tag(-3, [8]) + rec(0, [5]) + rec(1, [6]) + tag(-1, [0, 1, 0, 1]) + tag(-42, [1])
    t = read_trace(write(tmp_path, "t.bin", data))
    assert t.meta["source_format"] == "strata-tagged" and t.meta["version"] == 2
    assert t.expert.tolist() == [9, 0, 1, 10, 11, 20, 21, 5, 6]
    assert np.asarray(t.phase).tolist() == [UNKNOWN, PREFILL, PREFILL, PREFILL, PREFILL, DECODE, DECODE, DECODE, DECODE]
    assert np.asarray(t.request).tolist() == [7] * 7 + [8, 8]
    assert t.position.tolist() == [0, 1, 2, 0, 1, 3, 2, 0, 0]
    assert t.meta["tags"] == {"owned": 1, "boot": 1, "request": 2, "commit": 3}
    assert t.meta["tags_skipped"] == {"-42": 1} and t.meta["commits"] == 3 and t.meta["accepted_drafts"] == 1


def test_tagged_v1_phase_tags(tmp_path):
    data = tag(-2, [1]) + tag(-3, [1]) + rec(0, [1]) + tag(-5, [0]) + rec(0, [2]) + tag(-1, [0, 1, 0])
    data += tag(-5, [1]) + rec(0, [3]) + tag(-3, [2]) + rec(0, [4])
    t = read_trace(write(tmp_path, "t.bin", data))
    assert t.meta["version"] == 1
    assert np.asarray(t.phase).tolist() == [UNKNOWN, PREFILL, DECODE, DECODE]
    assert np.asarray(t.request).tolist() == [1, 1, 1, 2]


def test_tagged_writer_round_trip(tmp_path):
    n = 12
    t = TraceTable(request=np.repeat([3, 3, 9], 4), position=np.repeat(np.arange(6), 2), phase=np.repeat([0, 1, 1, 2, 2, 1], 2),
                   layer=np.zeros(n), rank=np.tile([0, 1], 6), expert=np.arange(n), weight=np.linspace(0.1, 1, n))
    out = tmp_path / "t.bin"
    write_trace(t, out, "strata-tagged")
    back = read_trace(out)
    assert back.meta["source_format"] == "strata-tagged"
    for col in ("request", "phase", "layer", "rank", "expert"):
        assert np.asarray(getattr(back, col)).tolist() == np.asarray(getattr(t, col)).tolist(), col
    assert np.array_equal(back.weight, t.weight)


@pytest.mark.parametrize("names,model", [(["a\rb", "second", "c"], "m"), (["x", " x", "p2"], "m"),
                                         (["x", "y", "z"], "mo\rdel"), (["\tx", "x", "x "], " m")])
def test_csv_keeps_request_names_with_a_carriage_return_or_leading_space(tmp_path, names, model):
    """Request names (prompt ids) and the model name that contain a carriage return or start with white space come
    back from our CSV as written: 3 requests, each its own name (a bare CR broke the file for the reader; a leading
    space was dropped by it and merged two requests). Found by a new-user test of ``run -t x.csv``."""
    n = 9
    t = TraceTable(request=np.repeat([0, 1, 2], 3), position=np.tile(np.arange(3), 3), phase=np.ones(n),
                   layer=np.zeros(n), rank=np.zeros(n), expert=np.arange(n), weight=np.full(n, 0.5),
                   meta={"request_names": names, "model_name": model})
    out = tmp_path / "t.csv"
    write_trace(t, out, "csv")
    back = read_trace(out)
    assert back.meta["request_names"] == names
    assert np.asarray(back.request).tolist() == np.asarray(t.request).tolist()
    assert np.asarray(back.expert).tolist() == list(range(n))
    assert trace_stats(back).requests == 3


def test_csv_with_a_bare_carriage_return_is_a_one_line_error(tmp_path, cli):
    """A CSV written before the fix above (a bare CR inside an unquoted prompt_id): a one-line error naming the line,
    exit 2, no traceback."""
    p = tmp_path / "cr.csv"
    p.write_bytes(b"model,prompt_id,token_pos,layer,rank,expert_id,weight,phase\n"
                  b"m,a\rb,0,0,0,1,0.5,decode\nm,c,0,0,0,2,0.5,decode\n")
    with pytest.raises(StrataError, match=r"cr.csv: line 2: 2 fields, expected 8"):
        read_trace(p)
    code, out, err = cli("trace", "stats", p)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and "line 2" in err


# -- round trips through every format ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["strata", "strata-tagged", "parquet", "csv"])
def test_round_trip(tmp_path, kit, fmt):
    src = read_trace(kit / "routing" / "llamacpp-ISTA-mix.routing.csv")
    out = tmp_path / f"t.{fmt}"
    write_trace(src, out, fmt)
    back = read_trace(out)
    assert not (tmp_path / f"t.{fmt}.tmp").exists()
    for col in ("layer", "rank", "expert", "weight"):
        assert np.array_equal(np.asarray(getattr(back, col)), np.asarray(getattr(src, col))), col
    if fmt in ("parquet", "csv", "strata-tagged"):
        assert np.array_equal(np.asarray(back.request), np.asarray(src.request))
    if fmt in ("parquet", "csv"):
        assert np.array_equal(back.position, src.position) and np.array_equal(back.phase, src.phase)
    if fmt == "csv":
        assert back.meta["request_names"] == ["p0", "p1", "p2"]
    if fmt == "parquet":
        assert back.meta["converted_from"] == "csv"
    # deterministic bytes
    out2 = tmp_path / f"u.{fmt}"
    write_trace(src, out2, fmt)
    assert out.read_bytes() == out2.read_bytes()


def test_kit_dump_equals_csv_after_reordering(kit):
    a = read_trace(kit / "routing" / "llamacpp-ISTA-mix.dump-routing.bin")
    c = read_trace(kit / "routing" / "llamacpp-ISTA-mix.routing.csv")
    # the dump is token-major over the 3 prompts; the CSV is layer-major per prompt
    offs = np.cumsum([0, 48, 42])[np.asarray(c.request)]
    key_c = np.lexsort((c.rank, c.layer, c.position + offs))
    key_a = np.lexsort((a.rank, a.layer, a.position))
    assert np.array_equal(a.expert[key_a], c.expert[key_c])
    assert np.array_equal(a.weight[key_a], c.weight[key_c])


def test_llama_csv(tmp_path):
    text = "-3,0,1,2\n-3,1,3,4\n-2,0,5,6\n0,0,7,8\n1,0,9\n\n-1,0,2,3\n0,0,1,4\n"
    t = read_trace(write(tmp_path, "t.csv", text.encode()))
    assert t.meta["source_format"] == "llama-csv"
    assert t.expert.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 1, 4]
    assert np.asarray(t.phase).tolist() == [PREFILL] * 6 + [DECODE] * 3 + [PREFILL] * 2 + [DECODE] * 2
    assert np.asarray(t.request).tolist() == [0] * 9 + [1] * 4
    assert t.rank.tolist() == [0, 1, 0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1]
    assert t.position.tolist()[:2] == [-3, -3]


def test_sniffing(tmp_path, kit):
    assert sniff_format(kit / "routing" / "llamacpp-ISTA-mix.routing.csv") == "csv"
    assert sniff_format(kit / "routing" / "llamacpp-ISTA-mix.dump-routing.bin") == "strata"
    assert sniff_format(write(tmp_path, "a.txt", b"0,1,2,3\n")) == "llama-csv"
    src = read_trace(kit / "routing" / "llamacpp-ISTA-mix.dump-routing.bin")
    write_trace(src, tmp_path / "x.pq", "parquet")
    assert sniff_format(tmp_path / "x.pq") == "parquet"


def test_stats_values():
    # layer 0: expert 0 x8, experts 1 and 2 once each (E=10 -> top 10% = 1 expert); layer 1: uniform over 2
    lay = np.array([0] * 10 + [1] * 4)
    exp = np.array([0] * 8 + [1, 2] + [0, 1, 0, 1])
    t = TraceTable(request=np.zeros(14), position=np.r_[np.arange(10), np.arange(4)], phase=np.ones(14),
                   layer=lay, rank=np.zeros(14), expert=exp, weight=np.ones(14))
    s = trace_stats(t, n_expert=10)
    l0, l1 = s.per_layer
    assert l0.distinct_experts == 3 and l0.concentration == pytest.approx(0.8)
    assert l1.entropy_bits == pytest.approx(1.0) and l1.concentration == pytest.approx(0.5)
    p = np.array([0.8, 0.1, 0.1])
    assert l0.entropy_bits == pytest.approx(float(-(p * np.log2(p)).sum()))
    assert s.tokens == 10 and s.k_min == s.k_max == 1 and s.layers == 2
    # 20 (layer, expert) pairs -> the top 2 pairs: (0,0) with 8 and one of layer 1 with 2 -> 10/14
    assert s.concentration == pytest.approx(10 / 14)


# -- bad input: each case decided and documented in the readers' docstrings -----------------------------------------

def err(path, **kw) -> str:
    with pytest.raises(StrataError) as e:
        read_trace(path, **kw)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_bad_strata_records(tmp_path):
    good = rec(0, [1, 2, 3, 4])  # 40 bytes
    m = err(write(tmp_path, "ids.bin", good + good[:8 + 4 * 2]))
    assert "byte 40" in m and "cut inside its ids" in m
    m = err(write(tmp_path, "w.bin", good + good[:8 + 4 * 4 + 4]))
    assert "byte 40" in m and "cut inside its weights" in m
    m = err(write(tmp_path, "h.bin", good + b"\x01\x02\x03"))
    assert "byte 40" in m and "header" in m
    m = err(write(tmp_path, "kneg.bin", good + struct.pack("<ii", 0, -1) + b"\0" * 8))
    assert "byte 44" in m and "negative" in m
    m = err(write(tmp_path, "kbig.bin", good + struct.pack("<ii", 0, 5000) + b"\0" * 64))
    assert "byte 44" in m and "5000" in m
    m = err(write(tmp_path, "ktag.bin", good + struct.pack("<ii", -4, 1 << 21)))
    assert "byte 44" in m
    m = err(write(tmp_path, "kexp.bin", rec(0, list(range(20)))), n_layers=4, n_expert=16)
    assert "byte 4" in m and "k = 20" in m
    m = err(write(tmp_path, "lay.bin", good + rec(70000, [1])))
    assert "byte 40" in m and "layer 70000" in m
    m = err(write(tmp_path, "eneg.bin", good + rec(1, [3, -2])))
    assert "byte 52" in m and "-2" in m
    m = err(write(tmp_path, "erange.bin", good + rec(1, [3, 16])), n_layers=4, n_expert=16)
    assert "byte 52" in m and "expert id 16" in m
    m = err(write(tmp_path, "nan.bin", good + rec(1, [3], [float("nan")])))
    assert "byte 52" in m and "not finite" in m  # record at 40, weight after 8 + 4 bytes
    m = err(write(tmp_path, "empty.bin", b""))
    assert "empty" in m
    m = err(write(tmp_path, "v0.bin", tag(-2, [0]) + good))
    assert "version" in m


def test_mtp_layer_keeps_canonical_ids(tmp_path):
    """Layer >= n_layers (an MTP block with 512 experts while the trunk has 256) is kept, not refused."""
    p = write(tmp_path, "t.bin", rec(0, [255]) + rec(1, [300, 511]))
    t = read_trace(p, n_layers=1, n_expert=256)
    assert t.expert.tolist() == [255, 300, 511]
    with pytest.raises(StrataError):
        read_trace(p, n_layers=2, n_expert=256)


def test_bad_csv(tmp_path):
    head = "model,prompt_id,token_pos,layer,rank,expert_id,weight\n"
    row = "m,p0,0,0,0,1,0.5\n"
    m = err(write(tmp_path, "a.csv", (head + row + "m,p0,1,x,0,1,0.5\n").encode()))
    assert "line 3" in m and "layer" in m
    m = err(write(tmp_path, "b.csv", (head + row + row + "m,p0,1,0,0,1,abc\n").encode()))
    assert "line 4" in m and "weight" in m
    m = err(write(tmp_path, "c.csv", (head + row + "m,p0,1,0,0,1\n").encode()))
    assert "line 3" in m
    m = err(write(tmp_path, "d.csv", (head + "m,p0,0,0,0,-5,0.5\n").encode()))
    assert "line 2" in m and "-5" in m
    m = err(write(tmp_path, "e.csv", (head + row + "m,p0,0,1,0,40,0.5\n").encode()), n_layers=8, n_expert=32)
    assert "line 3" in m and "40" in m
    m = err(write(tmp_path, "f.csv", head.encode()))
    assert "no routing rows" in m
    m = err(write(tmp_path, "g.csv", ("0,0,1,2\n0,1,3,zz\n").encode()))
    assert "line 2" in m and "id1" in m
    m = err(write(tmp_path, "h.csv", ("0,0,1,2\n\n0,-1,3,4\n").encode()))
    assert "line 3" in m and "layer -1" in m
    m = err(write(tmp_path, "i.csv", ("0,0,1,2\n0,1\n").encode()), fmt="llama-csv")
    assert "line 2" in m
    m = err(write(tmp_path, "j.csv", ("model,prompt,x\n1,2\n").encode()), fmt="csv")
    assert "line 1" in m and "header" in m


def test_bad_parquet(tmp_path, kit):
    src = read_trace(kit / "routing" / "llamacpp-ISTA-mix.dump-routing.bin")
    write_trace(src, tmp_path / "x.parquet", "parquet")
    data = (tmp_path / "x.parquet").read_bytes()
    m = err(write(tmp_path, "cut.parquet", data[:len(data) // 2]))
    assert "Parquet" in m
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"layer": [1, 2]}), tmp_path / "other.parquet")
    m = err(tmp_path / "other.parquet")
    assert "lacks column" in m


# -- property tests: random and mutated bytes never crash or hang --------------------------------------------------

def _read_any(data: bytes, fmt=None, **kw):
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t")
        with open(p, "wb") as fh:
            fh.write(data)
        try:
            t = read_trace(p, fmt, **kw)
        except StrataError as e:
            assert "\n" not in str(e)
            return None
        assert len(t.expert) == len(t.layer) == len(t.weight)
        return t


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_random_bytes(data):
    _read_any(data)
    _read_any(data, "strata", n_layers=4, n_expert=16)


_VALID = (tag(-2, [2]) + tag(-3, [1]) + rec(0, [1, 2, 3, 4], [0.4, 0.3, 0.2, 0.1]) + rec(1, [5, 6, 7, 8])
          + tag(-1, [0, 1, 0, 1]) + rec(0, [9, 10, 11, 12]) + tag(-4, [1, 2, 3]))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), max_size=6),
       st.integers(0, len(_VALID)))
def test_mutated_strata_bytes(muts, cut):
    b = bytearray(_VALID)
    for i, v in muts:
        b[i] = v
    t = _read_any(bytes(b[:cut]), n_layers=4, n_expert=16)
    if t is not None and len(t):
        assert int(t.expert.min()) >= 0


_CSV = (b"model,prompt_id,token_pos,layer,rank,expert_id,weight\n"
        b"m,p0,0,0,0,1,0.5\nm,p0,0,0,1,3,0.5\nm,p1,0,1,0,2,1.0\n")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_CSV) - 1), st.sampled_from(list(b"0123456789,.-x\n e"))), max_size=5),
       st.integers(0, len(_CSV)))
def test_mutated_csv(muts, cut):
    b = bytearray(_CSV)
    for i, v in muts:
        b[i] = v
    _read_any(bytes(b[:cut]))
    _read_any(bytes(b[:cut]), "csv")
    _read_any(bytes(b[:cut]), "llama-csv")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_parquet(muts):
    from stratatools.traces.formats.parquet import write_parquet

    n = 64
    t = TraceTable(request=np.zeros(n), position=np.arange(n), phase=np.ones(n), layer=np.arange(n) % 4,
                   rank=np.zeros(n), expert=np.arange(n) % 7, weight=np.ones(n))
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t.parquet")
        write_parquet(t, p)
        b = bytearray(open(p, "rb").read())
    for i, v in muts:
        b[i % len(b)] = v
    _read_any(bytes(b))


def test_csv_with_an_unknown_header_is_named_as_a_csv(tmp_path, cli):
    """A CSV whose header is not recognised was reported as a corrupt Strata binary; now one line naming the
    expected columns, from every reader (sniffing, stats, make-profile)."""
    from stratatools.traces.formats import read_trace, sniff_format

    p = tmp_path / "t.csv"
    p.write_text("prompt,pos,layer,expert\nm,0,0,1\n")
    with pytest.raises(StrataError, match=r"line 1: the CSV header 'prompt,pos,layer,expert' is not recognised; "
                                          r"expected model,prompt_id,token_pos,layer,rank,expert_id,weight"):
        sniff_format(p)
    with pytest.raises(StrataError, match="CSV header"):
        read_trace(p)
    code, out, err = cli("trace", "stats", str(p))
    assert code == 2 and "CSV header 'prompt,pos,layer,expert' is not recognised" in err
    assert "Strata" not in err and len(err.strip().splitlines()) == 1
    # binary traces are still sniffed as Strata, headerless llama rows as llama-csv
    q = tmp_path / "t.bin"
    q.write_bytes(np.array([0, 1, 5, 0], "<i4").tobytes())
    assert sniff_format(q) == "strata"
    (tmp_path / "l.csv").write_text("0,1,5,6\n")
    assert sniff_format(tmp_path / "l.csv") == "llama-csv"
