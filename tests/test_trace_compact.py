"""The compact per-record TraceTable (lazy columns) and the memory-mapped plain Strata reader.

Every check compares the fast form with an independent path over the same bytes: the chunked reader
(``chunk_bytes`` given), or a table built from materialised columns.
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
from stratatools.profiles.ranking import count_pairs
from stratatools.traces.table import COLUMNS, PREFILL, TraceTable, trace_stats
from stratatools.traces.formats import read_trace, write_trace
from stratatools.traces.formats.strata import read_strata, record_bounds


def rec(layer, ids, w):
    k = len(ids)
    return struct.pack("<ii", layer, k) + struct.pack(f"<{k}i", *ids) + struct.pack(f"<{k}f", *w)


def plain_bytes(rng, n_rec, k, L, E, zero_rows=()):
    out = []
    for i in range(n_rec):
        w = [0.0] * k if i in zero_rows else rng.random(k).astype(np.float32).tolist()
        out.append(rec(i % L, rng.choice(E, k, replace=False).tolist(), w))  # a top-k: distinct ids
    return b"".join(out)


def columns_copy(t: TraceTable) -> TraceTable:
    """The same trace as plain columns (no compact form): the reference for every fast path."""
    return TraceTable(**{k: np.array(getattr(t, k)) for k in COLUMNS}, meta=dict(t.meta))


def same_table(a: TraceTable, b: TraceTable) -> None:
    assert len(a) == len(b)
    for k in COLUMNS:
        assert np.array_equal(np.asarray(getattr(a, k)), np.asarray(getattr(b, k))), k


def test_plain_trace_is_compact_and_maps_the_file(tmp_path):
    rng = np.random.default_rng(1)
    p = tmp_path / "t.bin"
    p.write_bytes(plain_bytes(rng, 40, 3, 4, 16, zero_rows={5, 17}))
    t = read_strata(p)
    assert t.records is not None and t.records.constant_k and t.records.k == 3
    assert t.records.expert.shape == (40, 3) and not t.records.expert.flags.owndata  # a view, not a copy
    assert t.records.unit_rows.tolist() == [5, 17] and t.records.mapped
    ref = read_strata(p, chunk_bytes=4096)  # the chunked reader: owned copies
    same_table(t, ref)
    # building a column copied ids and weights out of the mapping (unit weights applied): the file is released
    assert not t.records.mapped and t.records.expert.flags.owndata and t.records.unit_rows is None
    assert (t.records.weight[[5, 17]] == 1.0).all()
    _counts_equal(t, 4, 16)
    assert t.meta == ref.meta
    w = t.weight.reshape(40, 3)
    assert (w[[5, 17]] == 1.0).all() and (w[4] != 1.0).all()


def test_lazy_columns_are_cached_read_only_and_setting_one_drops_the_compact_form(tmp_path):
    rng = np.random.default_rng(2)
    p = tmp_path / "t.bin"
    p.write_bytes(plain_bytes(rng, 12, 2, 3, 8))
    t = read_trace(p)
    assert t.layer is t.layer  # cached
    with pytest.raises(ValueError):
        t.expert[0] = 5
    e = np.array(t.expert)
    e[0] = (e[0] + 1) % 8
    t.expert = e
    assert t.records is None and t.expert[0] == e[0]
    assert count_pairs([t], 3, 8).counts.sum() == 24
    assert count_pairs([t], 3, 8).counts[0, e[0]] == count_pairs([columns_copy(t)], 3, 8).counts[0, e[0]]


def test_constructor_take_concat_unchanged(tmp_path):
    rng = np.random.default_rng(3)
    p = tmp_path / "t.bin"
    p.write_bytes(plain_bytes(rng, 10, 2, 2, 8))
    t = read_trace(p)
    sub = t.take(t.layer == 1)
    assert len(sub) == 10 and set(sub.layer.tolist()) == {1} and sub.records is None
    both = TraceTable.concat([t, t])
    assert len(both) == 40 and np.array_equal(both.expert[20:], t.expert)
    with pytest.raises(ValueError):
        TraceTable(request=np.zeros(3), position=np.zeros(3), phase=np.zeros(3), layer=np.zeros(3),
                   rank=np.zeros(3), expert=np.zeros(3), weight=np.zeros(2))


def _counts_equal(t: TraceTable, L: int, E: int) -> None:
    ref = columns_copy(t)
    for phase in ("all", "decode"):
        for weighting in ("count", "weight"):
            a = count_pairs([t], L, E, phase=phase, weighting=weighting)
            b = count_pairs([ref], L, E, phase=phase, weighting=weighting)
            assert np.array_equal(a.counts, b.counts)
            assert (a.used_entries, a.skipped_layer, a.skipped_phase, a.skipped_expert, a.skipped_layers) == \
                (b.used_entries, b.skipped_layer, b.skipped_phase, b.skipped_expert, b.skipped_layers)


def test_count_pairs_and_stats_on_compact_equal_the_column_path(tmp_path):
    rng = np.random.default_rng(4)
    p = tmp_path / "t.bin"
    p.write_bytes(plain_bytes(rng, 60, 4, 5, 12, zero_rows={3}))
    t = read_trace(p)
    _counts_equal(t, 5, 12)
    _counts_equal(t, 4, 12)   # layer 4 (an MTP block) left out and counted per layer
    _counts_equal(t, 5, 10)   # ids 10, 11 outside the model: skipped_expert
    assert count_pairs([t], 4, 12).skipped_layers == {4: 12 * 4}
    a, b = trace_stats(t).to_dict(), trace_stats(columns_copy(t)).to_dict()
    assert a == b and a["records"] == 60 and a["k_min"] == a["k_max"] == 4 and a["tokens"] == 12


def test_tagged_compact_counts_phases(tmp_path):
    """Tagged traces (chunked reader) also give the compact form; the phase filter works per record."""
    def tag(t, vals):
        return rec(t, vals, [0.0] * len(vals))
    data = tag(-2, [1]) + tag(-3, [4]) + tag(-5, [0]) + rec(0, [1, 2], [0.5, 0.5]) + rec(1, [3, 0], [0.5, 0.5])
    data += tag(-5, [1]) + rec(0, [2, 3], [0.0, 0.0]) + rec(1, [1, 3], [0.3, 0.7])
    p = tmp_path / "t.bin"
    p.write_bytes(data)
    t = read_trace(p)
    assert t.records is not None and t.meta["source_format"] == "strata-tagged"
    assert np.asarray(t.phase).tolist() == [PREFILL] * 4 + [1] * 4
    _counts_equal(t, 2, 4)
    assert count_pairs([t], 2, 4, phase="decode").skipped_phase == 4
    assert trace_stats(t).to_dict() == trace_stats(columns_copy(t)).to_dict()


def test_writers_from_compact_give_the_same_bytes(tmp_path):
    rng = np.random.default_rng(5)
    p = tmp_path / "t.bin"
    p.write_bytes(plain_bytes(rng, 30, 3, 3, 9, zero_rows={2}))
    t = read_trace(p)
    for fmt in ("strata", "strata-tagged", "csv", "parquet"):
        write_trace(t, tmp_path / f"a.{fmt}", fmt)
        write_trace(columns_copy(t), tmp_path / f"b.{fmt}", fmt)
        assert (tmp_path / f"a.{fmt}").read_bytes() == (tmp_path / f"b.{fmt}").read_bytes(), fmt


def test_bad_plain_files_still_name_the_byte(tmp_path):
    rng = np.random.default_rng(6)
    good = plain_bytes(rng, 8, 2, 2, 8)
    cases = {
        "id": (good[:24 + 12] + struct.pack("<i", -3) + good[24 + 16:], "byte 36: expert id -3 is negative"),
        "k": (good[:24 + 4] + struct.pack("<i", 0) + good[24 + 8:], "byte 28: k = 0"),
        "nan": (good[:24 + 16] + struct.pack("<f", float("nan")) + good[24 + 20:], "byte 40: router weight nan"),
        "big": (good[:12] + struct.pack("<i", 9) + good[16:], "byte 12: expert id 9 of layer 0 is out of range"),
    }
    for name, (data, want) in cases.items():
        p = tmp_path / f"{name}.bin"
        p.write_bytes(data)
        with pytest.raises(StrataError, match=want):
            read_trace(p, n_layers=2, n_expert=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 5), st.integers(1, 30), st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)),
                                                        max_size=3), st.integers(0, 2**31 - 1))
def test_mapped_reader_equals_chunked_reader(k, n_rec, muts, seed):
    """Random plain traces, with a few bytes mutated: the mapped fast path and the chunked reader agree
    exactly (same table and meta, or the same one-line error)."""
    rng = np.random.default_rng(seed)
    data = bytearray(plain_bytes(rng, n_rec, k, 3, 8, zero_rows={0} if seed % 3 == 0 else ()))
    for off, b in muts:
        if off < len(data):
            data[off] = b
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.bin"
        p.write_bytes(bytes(data))
        for kw in ({}, {"n_layers": 2, "n_expert": 8}):
            try:
                a = read_strata(p, **kw)
            except StrataError as e:
                with pytest.raises(StrataError) as e2:
                    read_strata(p, chunk_bytes=64, **kw)
                assert str(e) == str(e2.value)
                continue
            b = read_strata(p, chunk_bytes=64, **kw)
            same_table(a, b)
            assert a.meta == b.meta
            assert np.array_equal(record_bounds(a), record_bounds(b))
