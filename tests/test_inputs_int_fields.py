"""Integer fields of text traces (token_pos, layer, rank, expert_id, window; llama-csv pos, layer and ids) written
as floats, exponents or hex (``1e3``, ``3.0``, ``0x10``) are refused with the line number (was: the per-entry
CSV reader read ``1e3`` as expert 1000 and ``3.0`` as 3, since pandas casts integral floats to int)."""

from __future__ import annotations

import pytest

from stratatools.core.errors import StrataError
from stratatools.traces.formats.text import read_kit_csv, read_llama_csv

HEADER = "model,prompt_id,token_pos,layer,rank,expert_id,weight"
ROWS = ["m,p,0,0,0,1,0.5", "m,p,0,0,1,2,0.25", "m,p,1,0,0,3,0.5", "m,p,1,0,1,4,0.25"]


def _kit(tmp_path, field: int, value: str, line: int = 3, header: str = HEADER, rows=None) -> str:
    rows = list(rows or ROWS)
    f = rows[line - 2].split(",")
    f[field] = value
    rows[line - 2] = ",".join(f)
    p = tmp_path / "t.csv"
    p.write_text(header + "\n" + "\n".join(rows) + "\n")
    return p


@pytest.mark.parametrize("value", ["1e3", "3.0", "1E1", "2.", "0x10", " 1e1", "1.5e3", "+1e1", "٣"])
@pytest.mark.parametrize("field,name", [(2, "token_pos"), (3, "layer"), (4, "rank"), (5, "expert_id")])
def test_kit_csv_integer_field_written_as_a_float_is_refused(tmp_path, value, field, name):
    p = _kit(tmp_path, field, value)
    with pytest.raises(StrataError) as ei:
        read_kit_csv(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: line 3: field {name} is {value!r}, expected an integer"), msg
    assert "\n" not in msg


def test_kit_csv_window_written_as_a_float_is_refused(tmp_path):
    rows = [r + ",decode,-1" for r in ROWS]
    p = _kit(tmp_path, 8, "2.0", line=4, header=HEADER + ",phase,window", rows=rows)
    with pytest.raises(StrataError, match=r": line 4: field window is '2\.0', expected an integer"):
        read_kit_csv(p)


def test_kit_csv_quoted_names_still_check_the_integer_fields(tmp_path):
    rows = ['"m,1","p",0,0,0,1,0.5,"decode"', '"m,1","p",0,0,1,1e1,0.5,"decode"']
    p = tmp_path / "q.csv"
    p.write_text(HEADER + ",phase\n" + "\n".join(rows) + "\n")
    with pytest.raises(StrataError, match=r": line 3: field expert_id is '1e1', expected an integer"):
        read_kit_csv(p)


def test_kit_csv_integers_with_spaces_signs_and_exponent_weights_still_read(tmp_path):
    """What is legal stays legal: spaces after commas, a plus sign, leading zeros, CRLF, exponent weights and
    names holding e, E and dots."""
    rows = ["qwen.E-e,p.1e3, 0, +0,0, 07,1e-05", "qwen.E-e,p.1e3,0,0,1,12,2.5E-1"]
    p = tmp_path / "ok.csv"
    p.write_bytes((HEADER + "\r\n" + "\r\n".join(rows) + "\r\n").encode())
    t = read_kit_csv(p)
    assert t.expert.tolist() == [7, 12] and t.layer.tolist() == [0, 0]
    assert t.weight.tolist() == pytest.approx([1e-05, 0.25])


def test_kit_csv_error_line_counts_blank_lines(tmp_path):
    p = tmp_path / "b.csv"
    p.write_text(HEADER + "\n" + ROWS[0] + "\n\n" + "m,p,0,0,1,3.0,0.5\n")
    with pytest.raises(StrataError, match=r": line 4: field expert_id is '3\.0'"):
        read_kit_csv(p)


@pytest.mark.parametrize("value", ["1e3", "3.0", "0x10"])
def test_llama_csv_integer_field_written_as_a_float_is_refused(tmp_path, value):
    p = tmp_path / "t.llama.csv"
    p.write_text(f"0,0,1,2\n0,1,{value},2\n")
    with pytest.raises(StrataError, match=rf": line 2: field id0 is {value!r}, expected an integer"):
        read_llama_csv(p)


def test_cli_refuses_a_float_expert_id_exit_2(tmp_path, cli):
    p = _kit(tmp_path, 5, "1e3")
    code, out, err = cli("trace", "stats", p)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "line 3: field expert_id is '1e3', expected an integer" in lines[0], err


def _float_expert_parquet(tmp_path, values):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stratatools.traces.formats import write_trace
    from stratatools.traces.table import TraceTable

    n = len(values)
    t = TraceTable(request=np.zeros(n, np.int32), position=np.arange(n) // 2, phase=np.ones(n, np.int8),
                   layer=np.zeros(n, np.int16), rank=np.arange(n) % 2, expert=np.arange(n),
                   weight=np.full(n, 0.5, np.float32), meta={})
    good = tmp_path / "good.parquet"
    write_trace(t, good, "parquet")
    tab = pq.read_table(good)
    i = tab.column_names.index("expert")
    tab = tab.set_column(i, "expert", pa.array(values, pa.float64()))
    bad = tmp_path / "float.parquet"
    pq.write_table(tab, bad)
    return bad


def test_parquet_float_expert_column_is_refused_by_both_readers(tmp_path):
    from stratatools.traces.formats import read_trace
    from stratatools.traces.sources import open_source

    p = _float_expert_parquet(tmp_path, [1000.0, 3.7, 1.0, 2.0])
    want = rf"{p}: column expert is double, expected an integer type"
    with pytest.raises(StrataError, match=want):
        read_trace(p)
    with pytest.raises(StrataError, match=want):
        for _ in open_source(p).chunks(2):
            pass


@pytest.mark.parametrize("value", ["1e3", "3.0", "0x3", "٣", "３"])
def test_allocation_expert_index_that_is_not_a_decimal_integer_is_refused(kit, tmp_path, value):
    """The rco-allocation reader takes ASCII decimal indices only (was: '٣', an Arabic-Indic three, read as 3)."""
    from stratatools.alloc.allocation import read_allocation

    lines = (kit / "pruned" / "coder-revA.rco-allocation.txt").read_text(encoding="utf-8").split("\n")
    i = next(i for i, ln in enumerate(lines) if ln.startswith("blk.0.ffn_gate_exps.weight[3]:"))
    lines[i] = lines[i].replace("[3]", f"[{value}]")
    p = tmp_path / "a.txt"
    p.write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(StrataError, match=rf"{p}: line {i + 1}: not an allocation entry"):
        read_allocation(p)


def test_kit_csv_with_bare_carriage_returns_still_checks_the_integer_fields(tmp_path):
    """Rows ended by a bare CR (which pandas splits at) after a header ended by LF: checked row by row."""
    p = tmp_path / "cr.csv"
    p.write_bytes((HEADER + "\n" + "\r".join(["m,p,0,0,0,1,0.5", "m,p,0,0,1,1e1,0.5"]) + "\n").encode())
    with pytest.raises(StrataError, match=r": line 3: field expert_id is '1e1', expected an integer"):
        read_kit_csv(p)
