"""validate-release's hit-rate gate on a trace with expert ids at or past the model's expert count: the trace is
another model's, refused as unusable input (exit 2, one line naming the trace, the layer, the id and the expert
count, no report written), as a trace with extra layers is (was: a failed gate, exit 1)."""

from __future__ import annotations

import pytest

from test_validate_extra_layers import _validate_revb  # noqa: E402


def _with_id(src, dst, line: int, expert: int) -> str:
    lines = src.read_text().splitlines()
    f = lines[line - 1].split(",")
    f[5] = str(expert)
    lines[line - 1] = ",".join(f)
    dst.write_text("\n".join(lines) + "\n")
    return f[3]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_expert_id_past_the_model_is_refused_exit_2(kit, cli, tmp_path, fmt):
    p = kit / "pruned"
    t = tmp_path / "ids.csv"
    layer = _with_id(p / "coder-revB.routing.csv", t, 40, 16)
    if fmt == "parquet":
        code, out, err = cli("trace", "convert", t, "-o", tmp_path / "ids.parquet", "--to", "parquet")
        assert code == 0, err
        t = tmp_path / "ids.parquet"
    rep = tmp_path / "v.json"
    code, out, err = _validate_revb(cli, p, t, rep)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, out, err)
    place = "line 40" if fmt == "csv" else "row 38"
    assert f"{t}: {place}: expert id 16 of layer {layer} is out of range for 16 experts" in lines[0], lines[0]
    assert "another model" in lines[0] or "model with more experts" in lines[0]
    assert not rep.exists()


def test_ids_within_the_model_still_gate(kit, cli, tmp_path):
    p = kit / "pruned"
    code, out, err = cli("validate-release", "--model", p / "coder-revB.gguf", "--profile",
                         p / "expected-profile-revA-remapped-to-revB.bin", "-t", p / "coder-revB.routing.csv",
                         "--min-hit-rate", "0.99", "--slots", 48, "--json")
    assert code == 1, (out, err)


@pytest.mark.parametrize("fmt", ["strata", "strata-tagged", "csv", "llama-csv", "parquet"])
def test_every_reader_raises_the_other_model_error_for_ids_past_the_model(tmp_path, fmt):
    import numpy as np

    from stratatools.core.errors import OtherModelInput
    from stratatools.traces.formats import read_trace, write_trace
    from stratatools.traces.sources import open_source
    from stratatools.traces.table import TraceTable

    n = 8
    t = TraceTable(request=np.zeros(n, np.int32), position=np.repeat(np.arange(4), 2), phase=np.ones(n, np.int8),
                   layer=np.zeros(n, np.int16), rank=np.tile([0, 1], 4), expert=np.array([0, 1, 2, 3, 4, 20, 5, 6]),
                   weight=np.full(n, 0.5, np.float32), meta={})
    p = tmp_path / f"t.{fmt}"
    if fmt == "llama-csv":
        p.write_text("0,0,0,1\n1,0,2,3\n2,0,4,20\n3,0,5,6\n")
    else:
        write_trace(t, p, fmt)
    with pytest.raises(OtherModelInput, match="expert id 20 of layer 0 is out of range for 16 experts"):
        read_trace(p, fmt, n_layers=4, n_expert=16)
    with pytest.raises(OtherModelInput, match="expert id 20 of layer 0 is out of range for 16 experts"):
        for _ in open_source(p, fmt, n_layers=4, n_expert=16).chunks(4):
            pass
