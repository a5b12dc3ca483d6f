"""Readers trust no size and never hang (issue 14): a hypothesis campaign per reader under an address-space limit,
and the failing inputs the acceptance campaign found, each as a test."""

from __future__ import annotations


import json
import os
import signal
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from stratatools.core.errors import StrataError

HERE = Path(__file__).parent
READERS = ["gguf", "strp", "alloc", "registry", "native", "strata", "strata-tagged", "csv", "llama-csv", "parquet",
           "sniff", "strata-stream", "parquet-stream"]
EXAMPLES = 25  # per reader in CI (all readers together ~25 s); `python tests/fuzz_worker.py` runs more


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    import fuzz_worker

    d = tmp_path_factory.mktemp("seeds")
    s = fuzz_worker.make_seeds(d)
    return d / "seeds.json", s


def _one_line(code, out, err):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    return lines[0]


def test_hypothesis_campaign_per_reader(seeds):
    """Every reader, mutated seeds (truncations, huge header numbers, flips, splices): only one-line
    StrataErrors or success; no traceback, no hang (20 s alarm each), no MemoryError under RLIMIT_AS
    (1.5 GiB above the interpreter's own mappings)."""
    seeds_json, _ = seeds
    r = subprocess.run([sys.executable, str(HERE / "fuzz_worker.py"), str(seeds_json), str(EXAMPLES), "1536"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert sorted(x["reader"] for x in res) == sorted(READERS)
    for x in res:
        assert x["tried"] == EXAMPLES and x["ok"] + x["strata_error"] + x["hangs"] + len(x["tracebacks"]) == EXAMPLES
        assert x["tracebacks"] == [], (x["reader"], x["tracebacks"][:3])
        assert x["hangs"] == 0 and x["data_loss"] == 0 and x["multi_line"] == [], x
    assert sum(x["strata_error"] for x in res) > EXAMPLES * len(READERS) // 2  # the mutations really break files


# ----------------------------------------------------------------------------- non-regular inputs
def _alarm(seconds):
    def boom(*_):
        raise TimeoutError("the command blocked on its input")
    signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)


@pytest.mark.parametrize("argv", [["trace", "stats", "{x}"], ["inspect", "{x}"], ["profile", "show", "{x}"],
                                  ["alloc", "show", "{x}"], ["make-profile", "{x}", "--n-layer", "2",
                                                             "--n-expert", "8", "-o", "{out}"],
                                  ["validate-release", "--model", "{x}"], ["pack", "{x}", "-o", "{out}"]])
def test_fifo_input_is_refused_not_waited_on(cli, tmp_path, argv):
    fifo = tmp_path / "in"
    os.mkfifo(fifo)
    args = [a.format(x=fifo, out=tmp_path / "o") for a in argv]
    _alarm(10)
    try:
        code, out, err = cli(*args)
    finally:
        signal.alarm(0)
    if argv[0] == "validate-release":  # reported as the failed shards check, not waited on
        assert code == 1 and "is a FIFO" in out.replace("\n", " ").replace("│", " ").replace("  ", " "), out
        return
    line = _one_line(code, out, err)
    assert "is a FIFO, not a regular file" in line and str(fifo) in line
    assert not (tmp_path / "o").exists()


def test_fifo_registry_and_device_inputs(cli, tmp_path, seeds, monkeypatch):
    _, s = seeds
    fifo = tmp_path / "reg"
    os.mkfifo(fifo)
    monkeypatch.setenv("STRATATOOLS_REGISTRY", str(fifo))
    _alarm(10)
    try:
        code, out, err = cli("validate-release", "--model", s["gguf"])
    finally:
        signal.alarm(0)
    assert "is a FIFO" in _one_line(code, out, err)
    monkeypatch.delenv("STRATATOOLS_REGISTRY")
    code, out, err = cli("trace", "stats", "/dev/zero")
    assert "is a device, not a regular file" in _one_line(code, out, err)


@pytest.mark.parametrize("argv", [["make-profile", "{x}", "--n-layer", "2", "--n-expert", "8", "-o", "{out}"],
                                  ["remap-profile", "{x}", "--alloc", "{alloc}", "-o", "{out}"],
                                  ["inspect", "{x}"], ["trace", "stats", "{x}"]])
def test_symlink_loop_is_one_line(cli, tmp_path, seeds, argv):
    _, s = seeds
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    code, out, err = cli(*[x.format(x=a, out=tmp_path / "o", alloc=s["alloc"]) for x in argv])
    assert "symlink loop" in _one_line(code, out, err)


# ------------------------------------------------------------------------ the campaign's tracebacks
def test_zero_expert_router(cli, tmp_path):
    from tests.test_pack_bad import moe_gguf

    p = moe_gguf(tmp_path / "z.gguf", [4, 0])
    for argv in (["inspect", p], ["pack", p, "-o", tmp_path / "o"]):
        line = _one_line(*cli(*argv))
        assert "blk.1.ffn_gate_inp.weight has shape [64, 0]" in line


def test_csv_header_with_spaces_after_commas(cli, tmp_path, seeds):
    from stratatools.traces.formats import read_trace

    _, s = seeds
    lines = Path(s["csv"]).read_text().splitlines()
    p = tmp_path / "sp.csv"
    p.write_text(lines[0].replace(",", ", ") + "\n" + "\n".join(ln.replace(",", ", ") for ln in lines[1:]) + "\n")
    a, b = read_trace(s["csv"]), read_trace(p)
    assert len(a) == len(b) == 24
    for col in ("request", "position", "phase", "layer", "rank", "expert", "weight"):
        assert (getattr(a, col) == getattr(b, col)).all(), col


@pytest.mark.parametrize("meta", ['{"n_expert": "abc"}', '{"n_expert": 1099511627776}', "[" * 50000,
                                  '{"n_layers": [1, 2]}'])
def test_parquet_with_bad_metadata(cli, tmp_path, seeds, meta):
    import pyarrow.parquet as pq

    _, s = seeds
    t = pq.read_table(s["parquet"])
    p = tmp_path / "m.parquet"
    pq.write_table(t.replace_schema_metadata({b"stratatools.traces.table": meta.encode()}), p)
    code, out, err = cli("trace", "stats", p, "--json")
    assert code == 0, err
    st = json.loads(out)
    assert st["entries"] == 24 and st["n_expert"] == 8


def test_deeply_nested_registry_toml(cli, tmp_path, seeds):
    _, s = seeds
    reg = tmp_path / "deep.toml"
    reg.write_text("a = " + "[" * 100000 + "]" * 100000 + "\n")
    line = _one_line(*cli("validate-release", "--model", s["gguf"], "--registry", reg))
    assert "nested too deeply" in line


def test_tiny_trace_with_huge_ids_stays_small():
    """S3: a 16-byte trace naming expert 2^31-1 of layer 4095 is counted sparsely (was a 16 GiB grid)."""
    import tempfile

    from stratatools.traces.formats import read_trace
    from stratatools.traces.table import trace_stats

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.bin"
        p.write_bytes(struct.pack("<iiif", 4095, 1, 2 ** 31 - 1, 1.0))
        tracemalloc.start()
        st = trace_stats(read_trace(p))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    assert st.entries == 1 and st.n_expert == 2 ** 31 and st.per_layer[0].layer == 4095
    assert st.per_layer[0].distinct_experts == 1 and st.per_layer[0].entropy_bits == 0.0


def test_sparse_and_dense_trace_stats_agree(seeds, monkeypatch):
    import stratatools.traces.table as table
    from stratatools.traces.formats import read_trace

    _, s = seeds
    t = read_trace(s["strata-tagged"])
    dense = table.trace_stats(t).to_dict()
    monkeypatch.setattr(table, "_DENSE_CELLS", 0)
    t = read_trace(s["strata-tagged"])
    t.meta["n_expert"] = 1000  # 8 x 24 entries < 2 x 1000 cells: the sparse path
    sparse = table.trace_stats(t).to_dict()
    t.meta["n_expert"] = 1000
    monkeypatch.setattr(table, "_DENSE_CELLS", 1 << 22)
    dense_1000 = table.trace_stats(t).to_dict()
    assert sparse == dense_1000
    assert dense["entries"] == sparse["entries"] == 24


def test_error_messages_are_one_line_whatever_the_file_holds():
    e = StrataError("f.gguf: key 'a\nb\x00\x1b[2J' is bad")
    assert str(e) == "f.gguf: key 'a\\nb\\x00\\x1b[2J' is bad"
    assert len(str(StrataError("x" * 10000))) == 2000


def test_synth_seed_range_in_config():
    from stratatools.synth.model import SynthConfig

    for bad in (-1, 1 << 63):
        with pytest.raises(StrataError, match="--seed"):
            SynthConfig(seed=bad).validate()
    SynthConfig(seed=(1 << 63) - 1).validate()



def test_streamed_stats_of_huge_expert_ids_stay_small(tmp_path):
    """The campaign's find: `trace stats` streamed (chunk sources) grew a dense (layer, expert) grid sized by the
    largest id, 256 MiB for an id of 2^24 in a 100-byte trace (MemoryError under the campaign's limit). Past a
    grid of max(4M cells, 8 x entries) the counts are kept sparse; the figures equal the whole-table path's."""
    import tracemalloc

    import numpy as np

    from stratatools.traces.formats import read_trace, write_trace
    from stratatools.traces.sources import open_traces, trace_stats_sources
    from stratatools.traces.table import TraceTable, _stats_combine, _stats_combine_sparse, stats_partial, trace_stats

    rng = np.random.default_rng(4)
    n_rec, k = 300, 3
    ids = np.stack([rng.choice(20, k, replace=False) for _ in range(n_rec)])
    ids[7, 1] = 1 << 24  # one huge id
    t = TraceTable(np.repeat(np.arange(n_rec) // 100, k), np.repeat(np.arange(n_rec) // 2, k), np.ones(n_rec * k),
                   np.repeat(np.arange(n_rec) % 2, k), np.tile(np.arange(k), n_rec), ids.reshape(-1),
                   np.full(n_rec * k, 0.5))
    for fmt, name in (("parquet", "t.parquet"), ("strata-tagged", "t.bin")):
        write_trace(t, tmp_path / name, fmt)
        tracemalloc.start()
        got = trace_stats_sources(open_traces([str(tmp_path / name)]), rows=64).to_dict()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 32 << 20, peak
        want = trace_stats(read_trace(tmp_path / name)).to_dict()
        for key in ("entries", "records", "tokens", "requests", "layers", "n_expert", "concentration",
                    "mean_entropy_bits"):
            assert got[key] == pytest.approx(want[key]), key
        core = ("layer", "entries", "distinct_experts", "concentration", "entropy_bits")
        assert [{c: x[c] for c in core} for x in got["per_layer"]] == \
            [pytest.approx({c: x[c] for c in core}) for x in want["per_layer"]]
    # the sparse combination equals the dense one on parts that fit a grid
    small = TraceTable(t.request, t.position, t.phase, t.layer, t.rank, np.minimum(t.expert, 19), t.weight)
    write_trace(small, tmp_path / "s.parquet", "parquet")
    parts = [stats_partial(s, 50) for s in open_traces([str(tmp_path / "s.parquet")])]
    assert parts[0]["pairs"] is None
    a = _stats_combine(parts, {}, 24).to_dict()
    b = _stats_combine_sparse(parts, {}, 24).to_dict()
    assert a == b


def test_parquet_column_name_not_utf8_is_one_line_streamed_too(cli):
    """The campaign's find (parquet-stream, 3 of 2000): a footer whose column name is not UTF-8 was a
    UnicodeDecodeError traceback in the chunk source (the whole-file reader already refused it in one line)."""
    from stratatools.traces.formats import read_trace
    from stratatools.traces.sources import open_traces

    p = HERE / "fixtures" / "safety" / "parquet-name-not-utf8.parquet"
    for f in (lambda: read_trace(p), lambda: open_traces([str(p)])):
        with pytest.raises(StrataError, match=r"parquet-name-not-utf8.parquet: byte 0: not a readable Parquet trace "
                                              r"\('utf-8' codec can't decode"):
            f()
    code, out, err = cli("trace", "stats", p)
    assert code == 2 and err.count("\n") == 1 and "not a readable Parquet trace" in err
