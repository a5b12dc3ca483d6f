"""Trace handling defects found in testing: each failing input as a test (plain Strata and prefill, --where on
partitions, NaN weights in CSV, --partition errors, Parquet page checksums, text traces cut mid-row)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stratatools.core.errors import StrataError
from stratatools.traces.formats import convert_trace, read_trace, write_trace
from stratatools.traces.table import DECODE, PREFILL, TraceTable


def _table(phases: list[int], k: int = 2, layers: int = 3) -> TraceTable:
    """One request: one position per phase entry, every layer, k experts each (ids distinct per record)."""
    req, pos, ph, lay, rank, exp = [], [], [], [], [], []
    for p, phase in enumerate(phases):
        for layer in range(layers):
            for r in range(k):
                req.append(0), pos.append(p), ph.append(phase), lay.append(layer), rank.append(r)
                exp.append((p + layer + 3 * r) % 16)
    n = len(req)
    return TraceTable(request=np.array(req, np.int32), position=np.array(pos, np.int32),
                      phase=np.array(ph, np.int8), layer=np.array(lay, np.int16), rank=np.array(rank, np.int16),
                      expert=np.array(exp, np.int32), weight=np.full(n, 0.5, np.float32),
                      meta={"source_format": "test"})


# -- 1. plain Strata holds decode positions only -------------------------------------------------------------------

def test_plain_strata_writer_leaves_prefill_out(tmp_path):
    t = _table([PREFILL, PREFILL, DECODE, DECODE, DECODE])
    assert write_trace(t, tmp_path / "p.bin", "strata") == 2 * 3 * 2
    back = read_trace(tmp_path / "p.bin")
    assert len(back) == 3 * 3 * 2
    assert set(np.asarray(back.phase).tolist()) == {DECODE}
    dec = t.take(np.asarray(t.phase) == DECODE)
    assert back.expert.tolist() == dec.expert.tolist()
    assert write_trace(t, tmp_path / "t.bin", "strata-tagged") == 0
    assert np.asarray(read_trace(tmp_path / "t.bin").phase).tolist() == np.asarray(t.phase).tolist()


def test_plain_strata_all_prefill_is_refused(tmp_path):
    t = _table([PREFILL, PREFILL])
    with pytest.raises(StrataError, match=r"all 12 routed entries are prefill.*strata-tagged"):
        write_trace(t, tmp_path / "p.bin", "strata")
    assert not (tmp_path / "p.bin").exists()
    write_trace(t, tmp_path / "t.parquet", "parquet")
    with pytest.raises(StrataError, match="all 12 routed entries are prefill"):
        convert_trace(tmp_path / "t.parquet", tmp_path / "c.bin", "strata")
    assert not (tmp_path / "c.bin").exists()


def test_convert_to_plain_strata_says_what_it_left_out(tmp_path, cli):
    t = _table([PREFILL, DECODE, PREFILL, DECODE, DECODE])  # prefill records between decode ones
    src = tmp_path / "t.parquet"
    write_trace(t, src, "parquet")
    code, out, err = cli("trace", "convert", src, "--to", "strata", "-o", tmp_path / "p.bin")
    assert code == 0, err
    assert "warning:" in err and "left out 12 prefill entries (6 records)" in err and "strata-tagged" in err
    assert len(err.strip().splitlines()) == 1
    assert "18 routed entries in 9 records" in out
    back = read_trace(tmp_path / "p.bin")
    assert len(back) == 18 and set(np.asarray(back.phase).tolist()) == {DECODE}
    # the streamed writer, in chunks that cut records and phases: same bytes, same counts
    from stratatools.traces.sources import convert_trace_stream

    for rows in (1, 3, 5, 7):
        r = convert_trace_stream(src, tmp_path / f"s{rows}.bin", "strata", rows=rows)
        assert (r.entries, r.records, r.dropped_prefill, r.dropped_prefill_records) == (18, 9, 12, 6)
        assert (tmp_path / f"s{rows}.bin").read_bytes() == (tmp_path / "p.bin").read_bytes()
    code, out, err = cli("trace", "convert", src, "--to", "strata", "-o", tmp_path / "j.bin", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["dropped_prefill"] == 12 and d["dropped_prefill_records"] == 6 and d["entries"] == 18
    assert "left out 12 prefill entries" in err
    code, out, err = cli("trace", "convert", src, "--to", "strata-tagged", "-o", tmp_path / "t.bin")
    assert code == 0 and "warning" not in err
    write_trace(_table([PREFILL]), tmp_path / "pre.parquet", "parquet")
    code, out, err = cli("trace", "convert", tmp_path / "pre.parquet", "--to", "strata", "-o", tmp_path / "x.bin")
    assert code == 2 and "all 6 routed entries are prefill" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.bin").exists()


# -- 2. --where on a partition key drops the files without that partition ------------------------------------------

def _fleet(tmp_path, cli, src):
    fleet = tmp_path / "fleet"
    for parts in (["server=a", "date=2026-12-01"], ["server=b", "date=2026-12-01"], ["server=c"]):
        args = [x for p in parts for x in ("--partition", p)]
        code, out, err = cli("trace", "convert", src, "--to", "parquet", "--dataset", "-o", fleet, *args)
        assert code == 0, err
    return fleet


def test_where_on_a_partition_key_leaves_out_files_without_it(tmp_path, cli):
    t = _table([PREFILL, DECODE, DECODE, DECODE])
    src = tmp_path / "t.parquet"
    write_trace(t, src, "parquet")
    fleet = _fleet(tmp_path, cli, src)
    from stratatools.traces.sources import expand_traces

    got = expand_traces([str(fleet)], ["date=2026-12-01"])
    assert sorted(k["server"] for _, k in got) == ["a", "b"]
    code, out, err = cli("trace", "stats", fleet, "--where", "date=2026-12-01", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["entries"] == 2 * len(t) and d["meta"]["inputs"] == 2
    code, out, err = cli("trace", "stats", fleet, "--where", "server=c", "--json")
    assert code == 0 and json.loads(out)["entries"] == len(t)
    # a data column is still filtered by rows in every file, a partition key beside it by folders
    code, out, err = cli("trace", "stats", fleet, "--where", "phase=0", "--json")
    assert code == 0 and json.loads(out)["entries"] == 3 * 6
    code, out, err = cli("trace", "stats", fleet, "--where", "phase=1", "--where", "date=2026-12-01", "--json")
    assert code == 0 and json.loads(out)["entries"] == 2 * 18


def test_where_on_a_column_that_is_a_partition_key_elsewhere_filters_rows_where_it_is_not(tmp_path, cli):
    """A data column (``phase``) that is also a partition key of some files: files with the folder are kept by
    it, files without it by their rows (fleet-traces.md: on a data column --where keeps the Parquet rows)."""
    t = _table([PREFILL, DECODE, DECODE])
    src = tmp_path / "t.parquet"
    write_trace(t, src, "parquet")
    fleet = tmp_path / "fleet"
    for args in (["--partition", "phase=1"], ["--partition", "server=x"]):
        assert cli("trace", "convert", src, "--to", "parquet", "--dataset", "-o", fleet, *args)[0] == 0
    code, out, err = cli("trace", "stats", fleet, "--where", "phase=1", "--json")
    assert code == 0, err
    # phase=1 folder: its rows filtered too (12 decode entries); server=x: its 12 decode rows
    assert json.loads(out)["entries"] == 2 * 12


# -- 3. a NaN weight in a CSV names its line ---------------------------------------------------------------------

@pytest.mark.parametrize("w", ["nan", "NaN", "-nan", "NAN", " nan", "inf", "-Infinity"])
def test_non_finite_csv_weight_names_the_line(tmp_path, cli, w):
    rows = ["model,prompt_id,token_pos,layer,rank,expert_id,weight"]
    rows += [f"m,p0,{p},{layer},{r},{layer + r},0.5" for p in range(3) for layer in range(2) for r in range(2)]
    rows[11] = f"m,p0,2,1,1,3,{w}"  # line 12
    f = tmp_path / "bad.csv"
    f.write_text("\n".join(rows) + "\n")
    with pytest.raises(StrataError, match=rf"^{f}: line 12: weight .* is not finite"):
        read_trace(f)
    code, out, err = cli("trace", "stats", f)
    assert code == 2 and err.count("\n") == 1 and "line 12" in err and "not finite" in err and str(f) in err


def test_nan_weight_in_the_kit_csv_names_the_line(tmp_path, kit):
    c = (kit / "routing" / "llamacpp-ISTA-mix.routing.csv").read_text().splitlines(keepends=True)
    f = tmp_path / "nan.csv"
    f.write_text("".join(c[:11] + ["llamacpp-ISTA-mix,p0,2,0,2,10,nan\n"] + c[12:]))
    with pytest.raises(StrataError, match=r"line 12: weight nan is not finite"):
        read_trace(f)


# -- 4. --partition errors name --partition; a repeated key is refused ----------------------------------------------

def test_partition_errors_name_partition_and_refuse_a_repeated_key(tmp_path, cli):
    src = tmp_path / "t.parquet"
    write_trace(_table([DECODE, DECODE]), src, "parquet")
    out = tmp_path / "fleet"
    for args, want in ((["--partition", "=x"], "--partition '=x': expected KEY=VALUE"),
                       (["--partition", "server"], "--partition 'server': expected KEY=VALUE"),
                       (["--partition", "server=a", "--partition", "server=b"],
                        "--partition server=b: key server is given twice (server=a)")):
        code, o, err = cli("trace", "convert", src, "--to", "parquet", "--dataset", "-o", out, *args)
        assert code == 2 and o == "" and err.count("\n") == 1, (args, err)
        assert want in err and "--where" not in err, err
        assert not out.exists()
    code, o, err = cli("trace", "stats", src, "--where", "=x")
    assert code == 2 and "--where '=x': expected COLUMN=VALUE" in err
    from stratatools.traces.sources import parse_where

    assert parse_where(["server=a", "server=b"]) == {"server": ["a", "b"]}  # --where: alternatives


# -- 5. Parquet page checksums: a flipped byte is an error, never other data ---------------------------------------

def _flip_until_refused(path, read, lo: int, hi: int):
    """Flip one byte at a time in [lo, hi) of ``path`` (restored after each), reading it with ``read``; every read
    either gives the original data or raises StrataError. Returns (offsets refused, the refused errors)."""
    orig = path.read_bytes()
    want = read()
    refused, errors = [], []
    for off in range(lo, hi):
        b = bytearray(orig)
        b[off] ^= 0x01
        path.write_bytes(bytes(b))
        try:
            got = read()
        except StrataError as e:
            refused.append(off)
            errors.append(str(e))
            continue
        finally:
            path.write_bytes(orig)
        assert got == want, f"byte {off} flipped: read without error but gave other data"
    return refused, errors


def _data_page_span(path):
    """Byte range of the column chunks' pages (row group 0), from the footer."""
    import pyarrow.parquet as pq

    md = pq.ParquetFile(path).metadata.row_group(0)
    starts, ends = [], []
    for i in range(md.num_columns):
        c = md.column(i)
        s = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
        starts.append(s)
        ends.append(s + c.total_compressed_size)
    return min(starts), max(ends)


def test_parquet_pages_carry_checksums_and_a_flipped_byte_is_refused(tmp_path, cli):
    import pyarrow.parquet as pq

    rng = np.random.default_rng(5)
    t = _table([DECODE] * 40, k=4, layers=4)
    t = TraceTable(**{**t.columns(), "expert": rng.permutation(64)[:4][None].repeat(len(t) // 4, 0).ravel()
                      .astype(np.int32)}, meta=t.meta)
    src = tmp_path / "t.parquet"
    write_trace(t, src, "parquet")
    conv = tmp_path / "c.parquet"
    assert cli("trace", "convert", src, "--to", "parquet", "-o", conv)[0] == 0
    ds = tmp_path / "ds"
    assert cli("trace", "convert", src, "--to", "parquet", "--dataset", "-o", ds, "--partition", "s=a")[0] == 0
    part = ds / "s=a" / "part-00000.parquet"
    from stratatools.traces.sources import open_source

    def via_table(p):
        return lambda: read_trace(p).expert.tolist() + read_trace(p).weight.tolist()

    def via_chunks(p):
        def read():
            out = []
            for c in open_source(p).chunks(7):
                out += c["expert"].tolist() + c["weight"].tolist()
            return out
        return read

    for p in (src, conv, part):  # every writer: pages with a CRC
        assert pq.ParquetFile(p).metadata.row_group(0).num_columns >= 7
        lo, hi = _data_page_span(p)
        refused, errors = _flip_until_refused(p, via_table(p), lo, hi)
        assert refused, f"{p}: no flipped byte in the pages was refused"
        assert all(e.startswith(f"{p}:") and "\n" not in e for e in errors)
        assert any("checksum" in e.lower() or "crc" in e.lower() for e in errors), errors[:3]
        refused2, _ = _flip_until_refused(p, via_chunks(p), lo, hi)
        assert refused2
    # the CLI: one line naming the file, exit 2
    lo, hi = _data_page_span(src)
    orig = src.read_bytes()
    for off in range(lo, hi):
        b = bytearray(orig)
        b[off] ^= 0x01
        src.write_bytes(bytes(b))
        code, out, err = cli("trace", "stats", src)
        if code:
            break
    assert code == 2 and err.startswith(f"error: {src}:") and err.count("\n") == 1, err


def test_parquet_without_page_checksums_still_reads(tmp_path):
    """Files written before the checksums (or by other tools) have none; they read as before."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stratatools.traces.formats.parquet import _schema
    from stratatools.traces.sources import open_source
    from stratatools.traces.table import COLUMNS

    t = _table([DECODE] * 5)
    schema = _schema(t.meta)
    arrays = [pa.array(np.asarray(getattr(t, k)), type=schema.field(k).type) for k in COLUMNS]
    p = tmp_path / "old.parquet"
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), p, write_page_checksum=False)
    back = read_trace(p)
    assert back.expert.tolist() == t.expert.tolist()
    assert sum(len(c["layer"]) for c in open_source(p).chunks(4)) == len(t)


# -- 6. a text trace cut mid-row (no final newline, a short last row or record) ------------------------------------

def _llama_rows(n: int = 50, k: int = 4) -> list[str]:
    return [f"{p},{layer}," + ",".join(str((p + layer + 7 * r) % 32) for r in range(k))
            for p in range(n // 8) for layer in range(8)]


def test_llama_csv_cut_mid_row_is_refused(tmp_path):
    rows = _llama_rows()
    f = tmp_path / "cut.csv"
    f.write_text("\n".join(rows) + "\n199,7,29,13,0")  # k 4 before, 3 ids in the last, unterminated line
    n = len(rows) + 1
    with pytest.raises(StrataError, match=rf"^{f}: line {n}: .*3 expert ids.*4.*newline"):
        read_trace(f)
    # the same short row with its newline is a complete row (variable k is legal): read
    f.write_text("\n".join(rows) + "\n199,7,29,13,0\n")
    assert read_trace(f).meta.get("k") is None and len(read_trace(f)) == 4 * len(rows) + 3
    # a full last row without newline: read
    f.write_text("\n".join(rows) + "\n199,7,29,13,0,1")
    assert len(read_trace(f)) == 4 * (len(rows) + 1)
    # rows of mixed k before: not unambiguous, read
    f.write_text("\n".join(rows + ["198,6,1,2,3"]) + "\n199,7,29,13,0")
    assert len(read_trace(f)) == 4 * len(rows) + 6


def test_kit_csv_cut_inside_the_last_record_is_refused(tmp_path):
    head = "model,prompt_id,token_pos,layer,rank,expert_id,weight"
    rows = [f"m,p0,{p},{layer},{r},{(p + layer + 5 * r) % 32},0.25" for p in range(3) for layer in range(4)
            for r in range(4)]
    f = tmp_path / "cut.csv"
    f.write_text("\n".join([head] + rows[:-2]))  # last record: ranks 0, 1 of 4, no final newline
    with pytest.raises(StrataError, match=rf"^{f}: line {len(rows) - 1}: .*2 entries.*4.*newline"):
        read_trace(f)
    f.write_text("\n".join([head] + rows[:-2]) + "\n")  # terminated: a record of 2 is a record
    assert len(read_trace(f)) == len(rows) - 2
    f.write_text("\n".join([head] + rows))  # whole last record, no newline: read
    assert len(read_trace(f)) == len(rows)
