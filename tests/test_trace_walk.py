"""The compiled record walker (trace_formats/strata_walk.py) against the chunked reader (the reference).

Every check reads the same bytes three ways: ``read_strata`` (default: mapped plain path, else the compiled
walker), the walker's uncompiled Python code (``walk.py_func``, what runs without numba) with a tiny chunk, and
the chunked reader (``chunk_bytes`` given), and wants the same table, compact arrays, meta and windows, or the
same one-line error.
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratatools.core.errors import StrataError
from stratatools.traces.table import COLUMNS, DECODE, PREFILL, UNKNOWN
from stratatools.traces.formats.strata import read_strata, record_bounds
from stratatools.traces.formats.strata_walk import HAVE_NUMBA, read_walk, walk

PY_WALK = getattr(walk, "py_func", walk)


def rec(layer, ids, w):
    k = len(ids)
    return struct.pack("<ii", layer, k) + struct.pack(f"<{k}i", *ids) + struct.pack(f"<{k}f", *w)


def tag(t, vals):
    return rec(t, vals, [0.0] * len(vals))


def _outcome(fn):
    try:
        return fn(), None
    except StrataError as e:
        return None, str(e)


def _same(a, b) -> None:
    assert len(a) == len(b)
    assert list(a.meta.items()) == list(b.meta.items())  # same values, same key order
    for name in COLUMNS:
        assert np.array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name))), name
    ra, rb = a.records, b.records
    assert (ra is None) == (rb is None)
    if ra is None:
        return
    assert ra.constant_k == rb.constant_k
    assert np.array_equal(ra.ks(), rb.ks())
    for name in ("layer", "request", "phase"):
        assert np.array_equal(np.asarray(getattr(ra, name)), np.asarray(getattr(rb, name))), name
    assert (ra.window is None) == (rb.window is None)
    if ra.window is not None:
        assert np.array_equal(ra.window, rb.window)
    assert np.array_equal(record_bounds(a), record_bounds(b))


def check_all_paths(p: Path, **kw) -> None:
    size = p.stat().st_size
    ref, ref_err = _outcome(lambda: read_strata(p, chunk_bytes=64, **kw))
    ref2, ref2_err = _outcome(lambda: read_strata(p, chunk_bytes=4096, **kw))
    assert ref_err == ref2_err
    others = [_outcome(lambda: read_strata(p, **kw)),
              _outcome(lambda: read_walk(p, size, kw.get("n_layers"), kw.get("n_expert"), True, chunk_bytes=64,
                                         kernel=PY_WALK)),
              _outcome(lambda: read_walk(p, size, kw.get("n_layers"), kw.get("n_expert"), True, chunk_bytes=64))]
    for t, err in others:
        if t is None and err is None:  # read_walk leaves files shorter than one header to the chunked reader
            assert size < 8
            continue
        assert err == ref_err
        if ref_err is None:
            _same(t, ref)
    if ref_err is None:
        _same(ref2, ref)


# -- hand-made streams -------------------------------------------------------------------------------------------

def test_walker_fills_request_phase_windows_as_the_reference(tmp_path):
    data = tag(-2, [2]) + tag(-3, [7]) + rec(0, [9], [0.5]) + rec(1, [8], [0.5])
    data += b"".join(rec(layer, [layer * 10 + p], [0.0]) for layer in range(2) for p in range(2))
    data += tag(-1, [40, 2, 1, 0]) + tag(-4, [1, 2, 3]) + tag(-9, [1])
    data += rec(0, [3, 4], [0.2, 0.8]) + rec(1, [5, 6], [0.0, 0.0]) + tag(-1, [41, 1, 0, 1]) + tag(-2, [2])
    data += tag(-3, [8]) + rec(0, [5], [1.0]) + tag(-6, [4]) + rec(0, [1], [1.0])
    p = tmp_path / "t.bin"
    p.write_bytes(data)
    t = read_strata(p)
    assert t.meta["source_format"] == "strata-tagged" and "k" not in t.meta
    r = t.records
    assert r.window.tolist() == [-1, -1, 0, 0, 0, 0, 1, 1, -1, -1]
    assert np.asarray(r.request).tolist() == [7] * 8 + [8] * 2
    assert np.asarray(r.phase).tolist() == [UNKNOWN] * 2 + [PREFILL] * 4 + [DECODE] * 2 + [UNKNOWN] * 2
    assert r.ks().tolist() == [1] * 6 + [2, 2, 1, 1]
    assert t.meta["tags"] == {"request": 2, "commit": 2, "owned": 1, "boot": 1}
    assert t.meta["tags_skipped"] == {"-9": 1, "-2": 1}
    assert (t.meta["commits"], t.meta["accepted_drafts"], t.meta["windows"], t.meta["window_records"]) == \
        (2, 1, 2, 6)
    w = np.asarray(t.weight)
    assert w[2:6].tolist() == [1.0] * 4 and w[8:10].tolist() == [1.0, 1.0] and w[6:8].tolist() == \
        pytest.approx([0.2, 0.8])
    check_all_paths(p)
    check_all_paths(p, n_layers=1, n_expert=50)


def test_walker_v1_phase_tags_and_plain_mixed_k(tmp_path):
    v1 = tag(-2, [1]) + tag(-5, [0]) + rec(0, [1, 2], [0.5, 0.5]) + tag(-5, [1]) + rec(0, [3], [1.0])
    v1 += tag(-5, [7]) + rec(1, [2], [1.0]) + tag(-1, [0, 1, 0, 0])
    p = tmp_path / "v1.bin"
    p.write_bytes(v1)
    t = read_strata(p)
    assert np.asarray(t.records.phase).tolist() == [PREFILL, DECODE, UNKNOWN]
    check_all_paths(p)
    plain = rec(0, [1, 2], [0.5, 0.5]) + rec(1, [3], [1.0]) + tag(-3, [4]) + rec(0, [4, 1], [0.0, 0.0])
    p2 = tmp_path / "plain.bin"
    p2.write_bytes(plain)
    t = read_strata(p2)
    assert t.meta["source_format"] == "strata" and t.meta["tags_skipped"] == {"-3": 1}
    assert np.asarray(t.records.phase).tolist() == [DECODE] * 3
    check_all_paths(p2)


@pytest.mark.parametrize("data, want", [
    (tag(-2, []) + rec(0, [1], [1.0]), r"byte 0: format tag \(-2\) carries no version"),
    (tag(-2, [0]) + rec(0, [1], [1.0]), "byte 8: format version 0 is not a positive number"),
    (tag(-2, [2]) + tag(-3, []) + rec(0, [1], [1.0]), r"byte 16: request tag \(-3\) carries no request id"),
    (tag(-2, [1]) + tag(-5, []) + rec(0, [1], [1.0]), r"byte 16: phase tag \(-5\) carries no phase"),
    (tag(-2, [2]) + tag(-1, [1, 2]), r"byte 16: commit tag \(-1\) carries 2 values, expected 3 or 4"),
    # a scan error later in the file comes before a tag-payload error
    (tag(-2, [2]) + tag(-1, [1, 2]) + rec(0, [-1], [1.0]), "byte 48: expert id -1 is negative"),
    (tag(-2, [2]) + rec(5000, [1], [1.0]), "byte 16: layer 5000 is out of range"),
    (tag(-2, [2]) + rec(0, [1], [float("inf")]), "byte 28: router weight inf is not finite"),
    (tag(-2, [2]) + rec(0, [1, 2], [1.0, 1.0])[:-4], "byte 16: record .layer 0, k 2. cut inside its weights"),
    (tag(-2, [2]) + rec(0, [1], [1.0])[:6], "byte 16: record cut inside its header .6 of 8"),
    (tag(-2, [2]) + struct.pack("<ii", -1, 2**21), "byte 20: k = 2097152 on a tag record"),
    (tag(-2, [2]) + struct.pack("<ii", 0, 0), "byte 20: k = 0 on a route record of layer 0"),
])
def test_walker_errors_equal_the_reference(tmp_path, data, want):
    p = tmp_path / "bad.bin"
    p.write_bytes(data)
    with pytest.raises(StrataError, match=want):
        read_strata(p)
    check_all_paths(p)
    check_all_paths(p, n_layers=1, n_expert=2)


def test_walker_is_compiled_when_numba_is_there():
    # the project depends on numba; without it read_strata uses the chunked reader (same results, slower)
    assert HAVE_NUMBA and walk is not PY_WALK


# -- random and mutated streams ----------------------------------------------------------------------------------

_TAGS = [(-1, 3), (-1, 4), (-1, 2), (-3, 1), (-3, 0), (-4, 3), (-5, 1), (-5, 0), (-6, 2), (-2, 1), (-9, 1)]


def tagged_stream(rng, n_items: int, k: int, L: int, E: int, version: int) -> bytes:
    out = [tag(-2, [version])] if version else []
    pos = 0
    for _ in range(n_items):
        u = rng.random()
        if u < 0.2:
            t, nv = _TAGS[int(rng.integers(len(_TAGS)))]
            if t == -1:
                vals = [pos, int(rng.integers(-1, 4)), int(rng.integers(-1, 3)), int(rng.integers(0, 3))][:nv]
                pos += 1
            elif t == -5:
                vals = [int(rng.integers(0, 3))][:nv]
            else:
                vals = rng.integers(0, 9, nv).tolist()
            out.append(tag(t, vals))
        else:
            kk = k if rng.random() < 0.9 else int(rng.integers(1, k + 2))
            w = [0.0] * kk if rng.random() < 0.2 else rng.random(kk).astype(np.float32).tolist()
            out.append(rec(int(rng.integers(0, L)), rng.choice(E, kk, replace=False).tolist(), w))  # distinct ids
    return b"".join(out)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.integers(0, 40), st.sampled_from([0, 1, 2, 3]),
       st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), max_size=3),
       st.integers(0, 64), st.integers(0, 2**31 - 1))
def test_walker_equals_chunked_reader_on_random_streams(k, n_items, version, muts, cut, seed):
    """Random tagged (v1, v2, v3) and plain streams with tags and mixed k, a few bytes mutated and sometimes the
    end cut: every path gives the same table, compact arrays, meta and windows, or the same one-line error."""
    rng = np.random.default_rng(seed)
    data = bytearray(tagged_stream(rng, n_items, k, 3, 8, version))
    for off, b in muts:
        if off < len(data):
            data[off] = b
    if cut and cut < len(data) and seed % 4 == 0:
        data = data[:-cut]
    if not data:
        return
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.bin"
        p.write_bytes(bytes(data))
        check_all_paths(p)
        check_all_paths(p, n_layers=2, n_expert=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=200))
def test_walker_on_random_bytes(data):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.bin"
        p.write_bytes(data)
        check_all_paths(p)


def test_without_numba_read_strata_uses_the_chunked_reader(tmp_path, monkeypatch):
    import stratatools.traces.formats.strata_walk as sw

    p = tmp_path / "t.bin"
    body = b"".join(rec(layer, [layer, 3 + p], [0.0, 0.0]) for layer in range(3) for p in range(2))
    p.write_bytes(tag(-2, [2]) + tag(-3, [5]) + rec(1, [2, 3], [0.5, 0.5]) + body + tag(-1, [0, 2, 1, 1]))
    fast = read_strata(p)
    assert fast.records.window.tolist() == [-1] + [0] * 6
    calls = []
    monkeypatch.setattr(sw, "HAVE_NUMBA", False)
    monkeypatch.setattr(sw, "read_walk", lambda *a, **k: calls.append(1))
    slow = read_strata(p)
    assert not calls
    _same(fast, slow)
