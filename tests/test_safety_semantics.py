"""Inputs whose bytes parse but whose meaning is broken are refused (issue 14, "silent garbage")."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from stratatools.core.errors import StrataError


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def tiny_gguf(path: Path, offsets: list[int], align: int = 32) -> Path:
    """A GGUF v3 of len(offsets) F32 tensors of 8 values each at the given data offsets."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(offsets), 1)
    head += _s(b"general.alignment") + struct.pack("<II", 4, align)
    for i, off in enumerate(offsets):
        head += _s(f"t{i}".encode()) + struct.pack("<I", 1) + struct.pack("<Q", 8) + struct.pack("<I", 0)
        head += struct.pack("<Q", off)
    head += b"\0" * ((-len(head)) % align)
    end = max(offsets) + 32
    path.write_bytes(head + b"\0" * (end + (-end) % align))
    return path


def test_gguf_offsets_aligned_and_disjoint(tmp_path):
    from stratatools.model.gguf import open_model

    with open_model(tiny_gguf(tmp_path / "ok.gguf", [0, 32])) as m:
        assert [t.rel_offset for t in m.iter_tensors()] == [0, 32]
    with pytest.raises(StrataError, match="t1: data offset 16 is not a multiple of the alignment 32"):
        open_model(tiny_gguf(tmp_path / "mis.gguf", [0, 16], align=32))
    with pytest.raises(StrataError, match="tensors t0 .* and t1 .* overlap"):
        open_model(tiny_gguf(tmp_path / "ovl.gguf", [0, 0]))


def test_pack_never_writes_a_table_its_reader_refuses(cli, tmp_path):
    import shutil
    from dataclasses import replace

    from stratatools.synth.model import synth_release
    from tests.test_safety_write import TINY

    rel = synth_release(tmp_path / "r", replace(TINY, shards=2, revisions=False))
    for f in rel.canonical_files:
        shutil.copy(f, tmp_path / f.name.replace("synth-", "my model "))
    first = sorted(tmp_path.glob("my model *"))[0]
    code, out, err = cli("pack", first, "-o", tmp_path / "o")
    assert code == 2 and "this model cannot be packed: the table would be refused on reading" in err
    assert not (tmp_path / "o").exists()


def test_allocation_cut_after_section_1(cli, tmp_path):
    from stratatools.synth.model import synth_release
    from tests.test_safety_write import TINY

    rel = synth_release(tmp_path / "r", TINY)
    text = rel.revA.allocation.read_text()
    cut = tmp_path / "cut.txt"
    cut.write_text(text[:text.index("# Section 2")])
    code, out, err = cli("alloc", "check", cut, "--model", rel.revA.path)
    assert code == 2 and "the file is cut after Section 1" in err
    code, out, err = cli("validate-release", "--model", rel.revA.path, "--alloc", cut, "--json")
    assert code == 1


def test_profile_cut_in_trailer_and_empty_profile(cli, tmp_path):
    from stratatools.profiles.strp import Profile, read_profile
    from stratatools.synth.model import synth_release
    from tests.test_safety_write import TINY

    p = tmp_path / "p.bin"
    Profile(2, 8, np.array([[0, 1], [1, 2]])).write(p)
    data = p.read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-5])
    with pytest.raises(StrataError, match="ends inside its trailer"):
        read_profile(tmp_path / "cut.bin")
    rel = synth_release(tmp_path / "r", TINY)
    Profile(2, 4, np.zeros((0, 2), np.int64)).write(tmp_path / "empty.bin")
    code, out, err = cli("validate-release", "--model", rel.revA.path, "--profile", tmp_path / "empty.bin",
                         "--json")
    import json

    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert code == 1 and checks["profile-geometry"]["status"] == "fail"
    assert "ranks no (layer, expert) pair" in checks["profile-geometry"]["reason"]


@pytest.mark.parametrize("col,row,value,msg", [("weight", 3, float("nan"), "non-finite router weight"),
                                               ("phase", 3, 7, "phase 7 is not 0"),
                                               ("rank", 3, -1, "rank -1 is outside")])
def test_trace_semantics(tmp_path, col, row, value, msg):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stratatools.traces.formats import read_trace, write_trace
    from stratatools.traces.table import TraceTable

    n = 8
    tt = TraceTable(np.zeros(n), np.arange(n) // 2, np.ones(n), np.zeros(n), np.tile([0, 1], 4), np.arange(n),
                    np.full(n, 0.5))
    write_trace(tt, tmp_path / "ok.parquet", "parquet")
    assert len(read_trace(tmp_path / "ok.parquet")) == n
    t = pq.read_table(tmp_path / "ok.parquet")
    a = t.column(col).to_numpy().copy()
    a[row] = a[0] if value is None else value
    t = t.set_column(t.column_names.index(col), col, pa.array(a, type=t.schema.field(col).type))
    pq.write_table(t.replace_schema_metadata(t.schema.metadata), tmp_path / "bad.parquet")
    with pytest.raises(StrataError, match=msg):
        read_trace(tmp_path / "bad.parquet")


@pytest.mark.parametrize("etype,count,msg", [(8, 1 << 20, "string array"), (9, 1 << 20, "nested array"),
                                             (6, 1 << 40, "exceeds the file size")])
def test_gguf_array_counts_are_checked_against_the_file(tmp_path, etype, count, msg):
    """A header-claimed element count larger than the rest of the file is refused before anything is built."""
    from stratatools.model.gguf import open_model

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _s(b"tokenizer.ggml.tokens")
    head += struct.pack("<IIQ", 9, etype, count) + b"\0" * 64
    (tmp_path / "a.gguf").write_bytes(head)
    with pytest.raises(StrataError, match=msg):
        open_model(tmp_path / "a.gguf")


# ------------------------------------------------------------------ distinct ids per record, positions >= 0
def _rec(layer, ids, w=None):
    k = len(ids)
    w = [0.5] * k if w is None else w
    return struct.pack("<ii", layer, k) + struct.pack(f"<{k}i", *ids) + struct.pack(f"<{k}f", *w)


def _tag(t, vals):
    return struct.pack(f"<ii{len(vals)}i{len(vals)}f", t, len(vals), *vals, *([0.0] * len(vals)))


def _repeat_msg(byte: int, e: int, layer: int) -> str:
    return rf"byte {byte}: expert id {e} appears twice in one record \(layer {layer}\) \(a record's top-k"


def test_strata_repeated_id_in_one_record_is_refused_by_every_reader(tmp_path, cli):
    """A record (layer 1, ids 4 7 4) is refused with the byte of the repeat, by the zero-copy path, the
    compiled walker, its uncompiled code and the chunked reader alike; plain and tagged; whole and streamed."""
    from stratatools.traces.formats.strata import read_strata
    from stratatools.traces.formats.strata_walk import read_walk, walk
    from stratatools.traces.sources import StrataTaggedSource, open_source

    good = [_rec(0, [1, 2, 3]), _rec(1, [0, 1, 2])]
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"".join(good) + _rec(1, [4, 7, 4]) + _rec(0, [1, 2, 3]))
    byte = 2 * 32 + 8 + 2 * 4  # third record, its third id
    msg = _repeat_msg(byte, 4, 1)
    with pytest.raises(StrataError, match=msg):
        read_strata(plain)  # zero-copy path declines, the walker names the byte
    with pytest.raises(StrataError, match=msg):
        read_strata(plain, chunk_bytes=64)  # the chunked reference reader
    with pytest.raises(StrataError, match=msg):
        read_walk(plain, plain.stat().st_size, None, None, False, kernel=walk.py_func)
    code, out, err = cli("trace", "stats", plain)
    assert code == 2 and err.count("\n") == 1 and f"byte {byte}: expert id 4 appears twice" in err
    # a repeated id and an out-of-range id in one record: the lower byte is named, by both readers
    rng_bad = tmp_path / "both.bin"
    rng_bad.write_bytes(_rec(0, [5, 5, 99]) + _rec(0, [1, 99, 1]))
    for kw in ({}, {"chunk_bytes": 64}):
        with pytest.raises(StrataError, match=_repeat_msg(8 + 4, 5, 0)):
            read_strata(rng_bad, n_expert=8, **kw)
    other = tmp_path / "other.bin"
    other.write_bytes(_rec(0, [1, 99, 1]))
    for kw in ({}, {"chunk_bytes": 64}):
        with pytest.raises(StrataError, match="byte 12: expert id 99 of layer 0 is out of range"):
            read_strata(other, n_expert=8, **kw)
    # tagged (v2, with a verify window), whole and streamed chunk by chunk
    tagged = tmp_path / "tagged.bin"
    data = _tag(-2, [2]) + _tag(-3, [0]) + b"".join(good) + _tag(-1, [0, 1, 0, 1]) + _rec(0, [3, 3], [0.0, 0.0])
    tagged.write_bytes(data)
    byte = len(data) - 8 - 4  # the second id of the last record
    for kw in ({}, {"chunk_bytes": 64}):
        with pytest.raises(StrataError, match=_repeat_msg(byte, 3, 0)):
            read_strata(tagged, **kw)
    src = open_source(tagged)
    assert isinstance(src, StrataTaggedSource)
    with pytest.raises(StrataError, match=_repeat_msg(byte, 3, 0)):
        for _ in src.chunks(2):
            pass


def test_text_traces_repeated_id_and_negative_position(tmp_path, cli):
    from stratatools.traces.formats import read_trace

    ok = tmp_path / "ok.csv"
    ok.write_text("-1,0,2,3\n0,0,1,4\n")
    assert read_trace(ok).expert.tolist() == [2, 3, 1, 4]
    bad = tmp_path / "bad.csv"
    bad.write_text("-1,0,2,3\n\n0,0,1,4,1\n")
    with pytest.raises(StrataError, match=r"bad.csv: line 3: expert id 1 appears twice in one row \(id2 repeats "
                                          r"an earlier id\) \(a record's top-k expert ids are distinct"):
        read_trace(bad)
    head = "model,prompt_id,token_pos,layer,rank,expert_id,weight\n"
    kit = tmp_path / "kit.csv"
    # prompt p0 position 0 layer 0: ids 5, 6; the same ids at layer 1 and for prompt p1 are other records
    kit.write_text(head + "m,p0,0,0,0,5,0.5\nm,p0,0,0,1,6,0.5\nm,p0,0,1,0,5,1\nm,p1,0,1,0,5,1\n")
    assert read_trace(kit).expert.tolist() == [5, 6, 5, 5]
    kit.write_text(head + "m,p0,0,0,0,5,0.5\nm,p0,0,0,1,6,0.5\nm,p0,0,0,2,5,0.5\n")
    with pytest.raises(StrataError, match=r"kit.csv: line 4: expert_id 5 appears twice in one record \(prompt p0, "
                                          r"token_pos 0, layer 0\)"):
        read_trace(kit)
    kit.write_text(head + "m,p0,-5,0,0,5,0.5\n")
    with pytest.raises(StrataError, match=r"kit.csv: line 2: token_pos -5 is out of range 0\.\."):
        read_trace(kit)
    code, out, err = cli("trace", "stats", kit)
    assert code == 2 and err.count("\n") == 1 and "line 2: token_pos -5" in err
    # a table with llama.cpp's negative prompt positions is not written as csv (its reader would refuse it)
    code, out, err = cli("trace", "convert", ok, "-o", tmp_path / "o.csv", "--to", "csv")
    assert code == 2 and "row 0: position -1 is negative" in err and "--to parquet" in err
    assert not (tmp_path / "o.csv").exists()
    code, out, err = cli("trace", "convert", ok, "-o", tmp_path / "o.parquet", "--to", "parquet")
    assert code == 0 and read_trace(tmp_path / "o.parquet").position.tolist() == [-1, -1, 0, 0]


def _parquet_with(tmp_path, name, expert):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stratatools.traces.formats import write_trace
    from stratatools.traces.table import TraceTable

    n = len(expert)
    good = TraceTable(np.zeros(n), np.arange(n) // 2, np.ones(n), np.zeros(n), np.tile([0, 1], n // 2),
                      np.arange(n), np.full(n, 0.5))
    write_trace(good, tmp_path / "tmp.parquet", "parquet")
    t = pq.read_table(tmp_path / "tmp.parquet")
    t = t.set_column(t.column_names.index("expert"), "expert", pa.array(np.asarray(expert, np.int32)))
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, p)
    (tmp_path / "tmp.parquet").unlink()
    return p


def test_parquet_repeated_id_whole_and_streamed_across_chunks(tmp_path, cli):
    """Records are rows (request, position, layer, phase) from rank 0 on; row 5 repeats row 4's id. Streamed in
    chunks of 5 rows, that record spans two chunks and is still caught (the row counts from the file's start)."""
    from stratatools.traces.formats import read_trace
    from stratatools.traces.sources import open_traces

    ok = _parquet_with(tmp_path, "ok.parquet", [1, 2, 2, 1, 3, 4, 0, 7])
    assert read_trace(ok).expert.tolist() == [1, 2, 2, 1, 3, 4, 0, 7]
    for rows in (1, 3, 5, 100):
        assert sum(len(c["expert"]) for s in open_traces([str(ok)]) for c in s.chunks(rows)) == 8
    bad = _parquet_with(tmp_path / "ds" / "server=a", "part-0.parquet", [1, 2, 2, 1, 3, 3, 0, 7])
    msg = (r"row 5: expert id 3 appears twice in one record \(request 0, position 2, layer 0, rank 1\) "
           r"\(a record's top-k")
    with pytest.raises(StrataError, match=msg):
        read_trace(bad)
    for rows in (1, 5, 100):
        with pytest.raises(StrataError, match=msg):
            for s in open_traces([str(tmp_path / "ds")]):
                for _ in s.chunks(rows):
                    pass
    code, out, err = cli("trace", "stats", tmp_path / "ds")
    assert code == 2 and err.count("\n") == 1 and "row 5: expert id 3 appears twice" in err
    code, out, err = cli("make-profile", tmp_path / "ds", "-o", tmp_path / "p.bin", "--n-layer", "1",
                         "--n-expert", "8")
    assert code == 2 and "row 5: expert id 3 appears twice" in err and not (tmp_path / "p.bin").exists()


def test_repeat_search_compiled_and_numpy_agree():
    """The numpy column compare (one k up to 16), the compiled search (pairwise up to 32, sorted beyond) and the
    numpy sort fallback give the same first repeat as a brute-force search on random records; the row form agrees
    with the flat form."""
    from stratatools.traces import repeats
    from stratatools.traces import semantics as S

    rng = np.random.default_rng(5)
    for trial in range(300):
        n_rec = int(rng.integers(1, 30))
        ks = rng.integers(1, 80 if trial % 3 == 0 else 6, n_rec)
        if trial % 4 == 1:
            ks[:] = ks[0]  # one k: the numpy column path
        E = int(rng.integers(2, 400))
        expert = np.concatenate([rng.choice(E, min(int(k), E), replace=rng.random() < 0.3) for k in ks])
        ks = np.array([min(int(k), E) for k in ks])
        starts = np.r_[0, np.cumsum(ks)[:-1]].astype(np.int64)
        want = repeats._first_repeat_np(expert, starts)
        assert S.first_repeat(expert, starts) == want
        assert repeats.first_repeat(expert, starts) == want
        brute = -1
        for r, (a, k) in enumerate(zip(starts, ks)):
            seg = expert[a:a + k].tolist()
            hits = [a + c for c in range(k) if seg[c] in seg[:c]]
            if hits:
                brute = hits[0]
                break
        assert want == brute
        k = int(ks[0])
        if (ks == k).all():
            rows = expert.reshape(-1, k)
            for f in (S.first_repeat_rows, repeats.first_repeat_rows):
                got = f(rows)
                assert (got is None and want < 0) or (got is not None and got[0] * k + got[1] == want)


def test_writers_refuse_a_table_their_readers_would_refuse(tmp_path):
    from stratatools.traces.formats import write_trace
    from stratatools.traces.table import TraceTable

    t = TraceTable(np.zeros(4), np.zeros(4), np.ones(4), np.zeros(4), np.arange(4), [3, 1, 3, 2], np.ones(4))
    for fmt in ("strata", "strata-tagged", "parquet", "csv"):
        with pytest.raises(StrataError, match=r"t.out \(not written\): row 2: expert id 3 appears twice in one record"):
            write_trace(t, tmp_path / "t.out", fmt)
        assert os.listdir(tmp_path) == []


def test_chunk_checker_equals_the_whole_table_check():
    """Random tables cut into random chunks: the streamed check refuses exactly the tables the whole-table check
    refuses, naming the same row and message (records spanning chunks, repeated ids, NaN weights)."""
    from stratatools.traces.semantics import ChunkChecker, check_semantics
    from stratatools.traces.table import TraceTable

    rng = np.random.default_rng(11)
    for trial in range(200):
        n_rec = int(rng.integers(1, 40))
        cols = {c: [] for c in ("request", "position", "phase", "layer", "rank", "expert", "weight")}
        for r in range(n_rec):
            k = int(rng.integers(1, 7))
            ids = rng.choice(9, k, replace=rng.random() < 0.04)
            for j, e in enumerate(ids):
                for c, v in zip(cols, (r // 5, r % 5, 1, r % 2, j, int(e), 0.5)):
                    cols[c].append(v)
        t = TraceTable(**{c: np.array(v) for c, v in cols.items()})
        nan = rng.random() < 0.05
        if nan:
            t.weight[int(rng.integers(len(t)))] = np.nan
        try:
            check_semantics(t, "t")
            want = None
        except StrataError as e:
            want = str(e)
        chk = ChunkChecker("t")
        got = None
        try:
            n = len(t)
            cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 6))))
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, n]):
                chk({c: np.asarray(getattr(t, c))[a:b] for c in cols})
        except StrataError as e:
            got = str(e)
        assert (got is None) == (want is None), (trial, got, want)
        if not nan:  # one kind of fault: the same first row and message (with two kinds, each names one of them)
            assert got == want, (trial, got, want)


def test_a_record_that_never_restarts_its_ranks_is_bounded(tmp_path):
    """2000 rows of one (prompt, position, layer) whose rank never returns to 0 would be one record of 2000
    entries: refused (a record has at most 1024), naming the line, instead of growing one record without end."""
    from stratatools.traces.formats import read_trace

    head = "model,prompt_id,token_pos,layer,rank,expert_id,weight\n"
    p = tmp_path / "long.csv"
    p.write_text(head + "m,p,0,0,0,0,1\n" + "".join(f"m,p,0,0,1,{e},1\n" for e in range(1, 2000)))
    with pytest.raises(StrataError, match=r"long.csv: line 2: a record of 2000 entries \(more than 1024"):
        read_trace(p)
