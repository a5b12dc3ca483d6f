"""Inputs whose bytes parse but whose meaning is broken are refused (issue 14, "silent garbage")."""

from __future__ import annotations

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
