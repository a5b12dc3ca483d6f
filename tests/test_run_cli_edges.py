"""``stratatools run`` edge cases on the CPU (numpy) path, on the embedded synthetic release that ``make demo``
uses (``synth --seed 7``: the 32-expert canonical model): prompt ids in JSON prompt files, the JSON shape at every
``--batch``, trace output options that cannot work."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from stratatools.cli import run_captured
from stratatools.core.errors import StrataError
from stratatools.runtime.run import read_prompts


@pytest.fixture(scope="module")
def demo_release(tmp_path_factory):
    """The demo's release (``synth R --seed 7``) and its training prompts."""
    from stratatools.demo.walkthrough import demo_prompts

    d = tmp_path_factory.mktemp("demo-rel")
    err = io.StringIO()
    assert run_captured(["synth", str(d / "rel"), "--seed", "7", "--json"], io.StringIO(), err) == 0, err.getvalue()
    (d / "train.txt").write_text(demo_prompts("train"))
    return d, d / "rel" / "synth-canonical.gguf"


def _one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


# --- prompt_id in JSON prompt files -----------------------------------------------------------------------

def _prompts(tmp_path, items):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"prompts": items}))
    return p


def test_null_prompt_id_gets_the_documented_default(tmp_path):
    """``prompt_id`` is optional (README, run.py): JSON null means "not given", as for ``text``/``token_ids``,
    so the request gets the default ``p<index>``, never the string "None"."""
    got = read_prompts(_prompts(tmp_path, [{"text": "a", "prompt_id": "first"}, {"text": "b", "prompt_id": None},
                                           {"token_ids": [1, 2]}, {"text": "c", "prompt_id": 7}]))
    assert [p.prompt_id for p in got] == ["first", "p1", "p2", "7"]


@pytest.mark.parametrize("bad,what", [([1], "list"), ({"a": 1}, "dict"), (True, "bool"), (1.5, "float"),
                                      ("", "empty")])
def test_prompt_id_of_another_type_is_refused(tmp_path, bad, what):
    p = _prompts(tmp_path, [{"text": "a"}, {"text": "b", "prompt_id": bad}])
    with pytest.raises(StrataError) as e:
        read_prompts(p)
    msg = str(e.value)
    assert str(p) in msg and "prompt #1" in msg and "prompt_id" in msg and "string" in msg and "\n" not in msg


def test_null_prompt_id_runs_and_names_the_request(demo_release, tmp_path, cli):
    d, gguf = demo_release
    p = _prompts(tmp_path, [{"text": "def f(x):", "prompt_id": None}, {"text": "hello", "prompt_id": "h"}])
    code, out, err = cli("run", gguf, "--prompts", p, "-n", "2", "--device", "cpu", "--json")
    assert code == 0, err
    assert [r["prompt_id"] for r in json.loads(out)["requests"]] == ["p0", "h"]


def test_bad_prompt_id_is_a_one_line_cli_error(demo_release, tmp_path, cli):
    d, gguf = demo_release
    p = _prompts(tmp_path, [{"text": "x", "prompt_id": ["a"]}])
    line = _one_line_error(*cli("run", gguf, "--prompts", p, "-n", "1", "--device", "cpu"))
    assert "prompt #0" in line and "prompt_id" in line


# --- JSON Lines prompt files (.jsonl) ----------------------------------------------------------------------

def _jsonl(tmp_path, lines, name="p.jsonl"):
    p = tmp_path / name
    p.write_bytes("".join(ln + "\n" for ln in lines).encode("utf-8"))
    return p


def _as_tuples(prompts):
    return [(q.prompt_id, q.text, q.token_ids) for q in prompts]


@pytest.mark.parametrize("name", ["p.jsonl", "P.JSONL", "p.JsonL"])
def test_jsonl_items_follow_the_json_list_rules(tmp_path, name):
    """One item per non-empty line, each read as an item of a ``.json`` list (never as a text prompt): the same
    prompts, and the defaults ``p<index>`` count items, not lines (blank and whitespace-only lines are skipped)."""
    items = ["def f(x):", {"text": "a", "prompt_id": "first"}, {"text": "b", "prompt_id": None},
             {"token_ids": [1, 2], "text": "ignored"}, {"text": "c\\n d", "prompt_id": 7}]
    lines = [json.dumps(items[0]), "", json.dumps(items[1]), "   \t", json.dumps(items[2]), json.dumps(items[3]),
             "", json.dumps(items[4])]
    got = read_prompts(_jsonl(tmp_path, lines, name))
    assert _as_tuples(got) == [("p0", "def f(x):", None), ("first", "a", None), ("p2", "b", None),
                               ("p3", "ignored", [1, 2]), ("7", "c\\n d", None)]
    # JSON escapes only: the text-lines escape "\n" (two characters) is left as written
    assert got[4].text == "c" + "\\" + "n d"
    assert _as_tuples(got) == _as_tuples(read_prompts(_prompts(tmp_path, items)))


def test_jsonl_lines_end_at_newline_only(tmp_path):
    """CRLF line ends are fine, and a U+2028/U+0085 inside a JSON string (written raw, as json.dumps(...,
    ensure_ascii=False) does) does not split the item: lines end at ``\\n`` only."""
    p = tmp_path / "u.jsonl"
    p.write_bytes(b'{"text": "one\xe2\x80\xa8two\xc2\x85three", "prompt_id": "u"}\r\n"x"\r\n')
    assert _as_tuples(read_prompts(p)) == [("u", "one\u2028two\u0085three", None), ("p1", "x", None)]


def test_jsonl_with_only_blank_lines_has_no_prompts(tmp_path):
    p = _jsonl(tmp_path, ["", "  ", ""])
    with pytest.raises(StrataError) as e:
        read_prompts(p)
    assert str(p) in str(e.value) and "no prompts" in str(e.value)


JSONL_BAD = [
    # (the bad line, the words its one-line error must name)
    ('{"text": "x", }', ["not valid JSON", "one JSON value per line"]),
    ('{"text": "x"} {"text": "y"}', ["not valid JSON", "one JSON value per line"]),
    ('["a", "b"]', ["prompt #1", "list", "a string or an object with text/token_ids"]),
    ("12", ["prompt #1", "number", "a string or an object with text/token_ids"]),
    ("null", ["prompt #1", "null", "a string or an object with text/token_ids"]),
    ('{"prompts": ["a"]}', ["prompt #1", "neither text nor token_ids"]),
    ('{"text": 5}', ["prompt #1", "text must be a string"]),
    ('{"token_ids": [1, "2"]}', ["prompt #1", "token_ids must be a list of integers"]),
    ('{"token_ids": []}', ["prompt #1", "no tokens"]),
    ('{"text": ""}', ["prompt #1", "is empty"]),
    ('{"text": "x", "prompt_id": [1]}', ["prompt #1", "prompt_id", "non-empty string", "p1"]),
    ('{"text": "x", "prompt_id": true}', ["prompt #1", "prompt_id", "non-empty string", "p1"]),
]


@pytest.mark.parametrize("bad,words", JSONL_BAD)
def test_jsonl_bad_line_is_one_error_naming_file_and_line(tmp_path, bad, words):
    """The bad item is the second one, on line 3 (line 2 is blank): the error names the file and line 3 (1-based),
    and the item number where there is an item."""
    p = _jsonl(tmp_path, ['"fine"', "", bad, '"after"'])
    _one_line_error_of(p, f"{p}: line 3: ", words)


def _one_line_error_of(p, prefix: str, words) -> None:
    """read_prompts(p) raises a one-line StrataError starting with ``prefix`` and holding every word of ``words``."""
    with pytest.raises(StrataError) as e:
        read_prompts(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(prefix), msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("bad,words", [b for b in JSONL_BAD if "prompt #1" in b[1]])
def test_json_list_items_get_the_same_errors(tmp_path, bad, words):
    """A ``.json`` list item is checked by the same rules, with the same words (no line: the item is named)."""
    p = tmp_path / "p.json"
    p.write_text('{"prompts": ["fine", ' + bad + ', "after"]}')
    _one_line_error_of(p, f"{p}: prompt #1", words)


def test_jsonl_runs_and_names_the_requests(demo_release, tmp_path, cli):
    d, gguf = demo_release
    p = _jsonl(tmp_path, [json.dumps({"text": "def f(x):", "prompt_id": "code"}), "", json.dumps("hello"),
                          json.dumps({"text": "x = 1", "prompt_id": 12})], name="x.jsonl")
    code, out, err = cli("run", gguf, "--prompts", p, "-n", "2", "--device", "cpu", "--json")
    assert code == 0, err
    reqs = json.loads(out)["requests"]
    assert [r["prompt_id"] for r in reqs] == ["code", "p1", "12"]
    assert [r["request"] for r in reqs] == [0, 1, 2]
    assert all(r["prompt_tokens"] > 0 and r["new_tokens"] == 2 for r in reqs)


def test_bad_jsonl_line_is_a_one_line_cli_error(demo_release, tmp_path, cli):
    d, gguf = demo_release
    p = _jsonl(tmp_path, ['"a"', '{"text": "b"'])
    line = _one_line_error(*cli("run", gguf, "--prompts", p, "-n", "1", "--device", "cpu"))
    assert str(p) in line and "line 2" in line and "not valid JSON" in line


# --- duplicate prompt ids --------------------------------------------------------------------------------

@pytest.mark.parametrize("items,i,j,dup", [
    ([{"text": "a", "prompt_id": "x"}, "b", {"text": "c", "prompt_id": "x"}], 0, 2, "x"),
    ([{"text": "a", "prompt_id": "p1"}, "b"], 0, 1, "p1"),            # an explicit id equal to a default
    (["a", {"text": "b", "prompt_id": "p0"}], 0, 1, "p0"),
    ([{"text": "a", "prompt_id": 7}, {"text": "b", "prompt_id": "7"}], 0, 1, "7"),  # 7 and "7" name the same request
])
def test_duplicate_prompt_id_is_refused(tmp_path, items, i, j, dup):
    """Request names key traces and reports: two prompts with one id are refused, naming both and the id."""
    p = _prompts(tmp_path, items)
    with pytest.raises(StrataError) as e:
        read_prompts(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}: "), msg
    assert f"prompt #{i}" in msg and f"prompt #{j}" in msg and json.dumps(dup) in msg, msg
    assert "give each prompt its own prompt_id" in msg
    assert msg.index(f"prompt #{i}") < msg.index(f"prompt #{j}")


def test_duplicate_prompt_id_in_jsonl_names_both_lines(tmp_path):
    p = _jsonl(tmp_path, ['"a"', "", '{"text": "b", "prompt_id": "p3"}', '"c"', "", '{"text": "d"}',
                          '{"text": "e", "prompt_id": "p3"}'])
    # items: #0 line 1 (p0), #1 line 3 ("p3"), #2 line 4 (p2), #3 line 6 (default p3): #1 and #3 collide
    with pytest.raises(StrataError) as e:
        read_prompts(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}: "), msg
    assert "prompt #1 (line 3)" in msg and "prompt #3 (line 6)" in msg and '"p3"' in msg, msg
    assert "give each prompt its own prompt_id" in msg


def test_distinct_prompt_ids_are_kept(tmp_path):
    """Not a duplicate: ids that differ only in case, or a default-looking id whose default is not taken."""
    got = read_prompts(_prompts(tmp_path, [{"text": "a", "prompt_id": "A"}, {"text": "b", "prompt_id": "a"},
                                           {"text": "c", "prompt_id": "p9"}, "d"]))
    assert [q.prompt_id for q in got] == ["A", "a", "p9", "p3"]


def test_duplicate_prompt_id_is_a_one_line_cli_error(demo_release, tmp_path, cli):
    d, gguf = demo_release
    p = _prompts(tmp_path, [{"text": "a", "prompt_id": "same"}, {"text": "b", "prompt_id": "same"}])
    line = _one_line_error(*cli("run", gguf, "--prompts", p, "-n", "1", "--device", "cpu"))
    assert "prompt #0" in line and "prompt #1" in line and '"same"' in line


# --- the JSON's shape does not depend on --batch ------------------------------------------------------------

def _paths(obj, prefix=""):
    """Every key path of a JSON value (lists: the union over their items, as ``[]``)."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(prefix + k)
            out |= _paths(v, prefix + k + ".")
    elif isinstance(obj, list):
        for v in obj:
            out |= _paths(v, prefix + "[].")
    return out


BATCH_EXTRA = {"batch." + k for k in ("places", "steps", "mean_active", "decode_forwards", "decode_tokens_per_s",
                                      "state_bytes", "graph_steps", "queued_steps", "engine")}


def test_batch_json_has_the_same_keys_as_without_batch(demo_release, cli):
    """``--batch 1`` is the default path: the same keys at every level; ``--batch N`` adds only the batched
    decode's figures inside ``batch`` (README, RunResult), and the outputs are the same."""
    d, gguf = demo_release
    common = ("run", gguf, "--prompts", d / "train.txt", "-n", "3", "--device", "cpu", "--slots", "20", "--json")
    runs = {}
    for name, extra in (("default", ()), ("b1", ("--batch", "1")), ("b2", ("--batch", "2"))):
        code, out, err = cli(*common, *extra)
        assert code == 0, err
        runs[name] = json.loads(out)
    base = _paths(runs["default"])
    assert {"requests.[].prompt_id", "tier.decode.h_expert", "device.device", "options.batch", "batch.batch"} <= base
    assert _paths(runs["b1"]) == base
    assert runs["b1"]["batch"] == runs["default"]["batch"] == {"batch": 1}
    assert runs["b1"]["options"] == runs["default"]["options"]
    assert _paths(runs["b2"]) == base | BATCH_EXTRA
    assert runs["b2"]["batch"]["batch"] == runs["b2"]["options"]["batch"] == 2
    for r in ("b1", "b2"):
        assert [q["new_ids"] for q in runs[r]["requests"]] == [q["new_ids"] for q in runs["default"]["requests"]]
        assert runs[r]["tier"]["decode"]["entries"] == runs["default"]["tier"]["decode"]["entries"] > 0


# --- a trace output of '-' -----------------------------------------------------------------------------------

@pytest.mark.parametrize("opt", ["-t", "--trace-out"])
@pytest.mark.parametrize("fmt", [None, "csv", "parquet"])
def test_trace_out_dash_is_refused_and_writes_no_file(demo_release, tmp_path, monkeypatch, opt, fmt, cli):
    """A routing trace is never written to stdout (binary layouts, and --json owns stdout): '-' is refused
    before the model loads, and no file named '-' appears."""
    d, gguf = demo_release
    monkeypatch.chdir(tmp_path)
    args = ["run", gguf, "--prompts", d / "train.txt", "-n", "1", "--device", "cpu", opt, "-"]
    line = _one_line_error(*cli(*args, *(["--trace-format", fmt] if fmt else [])))
    assert "--trace-out -" in line and "stdout" in line and "file path" in line
    assert not (tmp_path / "-").exists()


def test_trace_convert_output_dash_is_refused(tmp_path, monkeypatch, cli):
    src = tmp_path / "t.csv"
    src.write_text("0,0,1,2\n0,1,3,4\n")
    monkeypatch.chdir(tmp_path)
    for extra in ([], ["--dataset"]):
        to = "parquet" if extra else "csv"
        line = _one_line_error(*cli("trace", "convert", src, "-o", "-", "--to", to, *extra))
        assert "--output -" in line and "stdout" in line and "file path" in line
        assert not (tmp_path / "-").exists()


# --- --trace-format without --trace-out ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["csv", "strata", "parquet"])
def test_trace_format_without_trace_out_is_refused(demo_release, fmt, cli):
    d, gguf = demo_release
    line = _one_line_error(*cli("run", gguf, "--prompts", d / "train.txt", "-n", "1", "--device", "cpu",
                                 "--trace-format", fmt))
    assert f"--trace-format {fmt}" in line and "--trace-out" in line


def test_trace_format_takes_any_case_and_a_bad_one_names_the_option(demo_release, tmp_path, cli):
    """``--trace-format CSV`` was refused while a ``.CSV`` extension was accepted; an unknown format's error now names
    the option (found by a new-user test)."""
    d, gguf = demo_release
    code, out, err = cli("run", gguf, "--prompts", d / "train.txt", "-n", "1", "--device", "cpu",
                         "--trace-out", tmp_path / "t.txt", "--trace-format", "CSV", "--json")
    assert code == 0, err
    assert (tmp_path / "t.txt").read_text().startswith("model,prompt_id,")
    line = _one_line_error(*cli("run", gguf, "--prompts", d / "train.txt", "-n", "1", "--device", "cpu",
                                 "--trace-out", tmp_path / "u.bin", "--trace-format", "bogus"))
    assert "--trace-format 'bogus' is not one of" in line and not (tmp_path / "u.bin").exists()


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(demo_release, tmp_path, cli):
    """A single text line whose bytes cannot fit the model's context whatever its tokens (a token covers at most the
    vocabulary's longest token) is refused from its byte count, before the tokenizer builds its token list (a 20 MB
    line took 12 s and 665 MB before its context error; found by a new-user test); a prompt that may fit is
    tokenized and refused with its exact count."""
    import time

    from stratatools.model.gguf import open_model
    from stratatools.runtime.tokenizer import BPETokenizer

    d, gguf = demo_release
    with open_model(gguf) as m:
        ctx = int(m.kv[f"{m.arch}.context_length"])
        longest = max(len(t.encode("utf-8", "replace")) for t in BPETokenizer.from_gguf(m).tokens)
    big = tmp_path / "big.txt"
    big.write_text("ab " * (ctx * longest))  # 3 ctx longest bytes: at least 3 ctx tokens
    t0 = time.perf_counter()
    line = _one_line_error(*cli("run", gguf, "--prompts", big, "-n", "1", "--device", "cpu"))
    assert time.perf_counter() - t0 < 20
    assert "prompt #0" in line and f"at least {3 * ctx} tokens" in line and f"context length {ctx}" in line
    near = tmp_path / "near.txt"
    near.write_text("x" * (ctx + 5))  # may fit by its bytes (a token can cover several), so tokenized: too long
    line = _one_line_error(*cli("run", gguf, "--prompts", near, "-n", "1", "--device", "cpu"))
    assert "prompt #0" in line and "positions, over the model's context length" in line


# --- output paths that name no file (found by a new-user test) ---------------------------------------------

@pytest.mark.parametrize("raw, says", [("newdir/", "names a folder; give a file name"),
                                       ("nodir/x/", "names a folder; give a file name"),
                                       ("", "the path is empty"), (" ", "the path is empty")])
def test_trace_out_that_names_no_file_is_refused(tmp_path, monkeypatch, cli, raw, says):
    """``--trace-out newdir/`` wrote a regular file named ``newdir`` (the Path type drops the slash);
    ``--trace-out ''`` said ``.: exists and is a folder``. Both are refused as the options are parsed."""
    monkeypatch.chdir(tmp_path)
    line = _one_line_error(*cli("run", "no-model.gguf", "--prompts", "p.txt", "--trace-out", raw))
    assert f"--trace-out {raw!r}" in line if not raw.strip() else f"--trace-out {raw}:" in line
    assert says in line and os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, opt", [
    (("pack", "m.gguf", "-o"), "-o"), (("synth",), "OUTDIR"), (("demo",), "OUT"),
    (("make-profile", "t.csv", "--n-layer", "2", "--n-expert", "4", "-o"), "--output"),
    (("remap-profile", "p.bin", "-o"), "--out"), (("alloc", "export", "a.txt", "-o"), "--out"),
    (("tune", "-t", "t.csv", "--slots", "4", "--json-out"), "--json-out"),
    (("trace", "convert", "t.csv", "--to", "csv", "-o"), "--output"),
])
@pytest.mark.parametrize("raw", ["-", ""])
def test_every_output_path_refuses_dash_and_empty(tmp_path, monkeypatch, cli, args, opt, raw):
    """``pack -o -`` made a folder named '-' where run and trace convert refused '-': every output option and
    argument refuses '-' (no file or folder output goes to stdout) and an empty path, before any work."""
    monkeypatch.chdir(tmp_path)
    line = _one_line_error(*cli(*args, raw))
    assert line.startswith(f"error: {opt} {raw!r}:" if raw == "" else f"error: {opt} -:"), line
    assert ("stdout" in line) if raw == "-" else ("the path is empty" in line)
    assert os.listdir(tmp_path) == []


def test_trace_out_in_a_missing_folder_is_created(demo_release, tmp_path, cli):
    d, gguf = demo_release
    out = tmp_path / "nodir" / "x" / "t.bin"
    code, _o, err = cli("run", gguf, "--prompts", d / "train.txt", "-n", "1", "--device", "cpu", "--trace-out", out,
                        "--json")
    assert code == 0, err
    assert out.read_bytes()[:4] != b"PAR1" and out.stat().st_size > 0 and "names no trace format" not in err


# --- the trace's extension and --trace-format ------------------------------------------------------------

@pytest.mark.parametrize("name, fmt", [("b.csv", "parquet"), ("b.parquet", "csv"), ("b.bin", "csv"),
                                       ("b.csv", "strata-tagged"), ("b.pq", "strata")])
def test_trace_extension_that_disagrees_with_the_format_is_refused(tmp_path, cli, name, fmt):
    """``--trace-out tr/b.csv --trace-format parquet`` wrote Parquet into a .csv file."""
    (tmp_path / "p.txt").write_text("hello\n")
    line = _one_line_error(*cli("run", tmp_path / "none.gguf", "--prompts", tmp_path / "p.txt", "--trace-out",
                                tmp_path / "tr" / name, "--trace-format", fmt))
    assert f"{name}: the extension" in line and f"--trace-format says {fmt}" in line
    assert not (tmp_path / "tr").exists()


@pytest.mark.parametrize("fmt", [None, "csv"])
def test_trace_named_json_is_refused(tmp_path, cli, fmt):
    """``--trace-out tr/a.json`` wrote Strata binary into a .json file: no trace format is JSON."""
    (tmp_path / "p.txt").write_text("hello\n")
    line = _one_line_error(*cli("run", tmp_path / "none.gguf", "--prompts", tmp_path / "p.txt", "--trace-out",
                                tmp_path / "tr" / "a.json", *(["--trace-format", fmt] if fmt else [])))
    assert "a.json: a routing trace is not JSON" in line and not (tmp_path / "tr").exists()


def test_trace_convert_extension_that_disagrees_is_refused(tmp_path, cli):
    src = tmp_path / "t.csv"
    src.write_text("0,0,1,2\n0,1,3,4\n")
    line = _one_line_error(*cli("trace", "convert", src, "-o", tmp_path / "o.csv", "--to", "parquet"))
    assert "o.csv: the extension .csv says csv, --to says parquet" in line and not (tmp_path / "o.csv").exists()


def test_unknown_trace_extension_says_which_format_was_written(demo_release, tmp_path, cli):
    d, gguf = demo_release
    out = tmp_path / "t.trace"
    code, _o, err = cli("run", gguf, "--prompts", d / "train.txt", "-n", "1", "--device", "cpu", "--trace-out", out,
                        "--json")
    assert code == 0, err
    assert "t.trace: .trace names no trace format: writing Strata tagged binary" in err
    from stratatools.traces.formats import read_trace

    assert read_trace(out).meta.get("source_format", "").startswith("strata")


# --- --trace-format strata holds decode positions only ------------------------------------------------------------

def test_plain_strata_run_trace_leaves_the_prefill_out_and_says_so(demo_release, tmp_path, cli):
    """``run --trace-format strata`` wrote the prefill records as decode ones (the plain layout keeps no phase); as the
    engine's own dump, it now holds the decode positions only and says how many prefill entries it left out; with
    -n 1 (no decode step) it would be empty and is refused before the run."""
    from stratatools.traces.formats import read_trace
    from stratatools.traces.table import DECODE, PREFILL

    d, gguf = demo_release
    code, out, err = cli("run", gguf, "--prompts", d / "train.txt", "-n", "3", "--device", "cpu",
                         "--trace-out", tmp_path / "t.bin", "--json")
    assert code == 0, err
    tagged = read_trace(tmp_path / "t.bin")
    n_pre = int((np.asarray(tagged.phase) == PREFILL).sum())
    assert n_pre > 0
    code, out, err = cli("run", gguf, "--prompts", d / "train.txt", "-n", "3", "--device", "cpu",
                         "--trace-out", tmp_path / "p.bin", "--trace-format", "strata", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["trace_dropped_prefill"] == n_pre
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning:") and f"left out {n_pre:,} prefill entries" in lines[0]
    assert "strata-tagged" in lines[0]
    plain = read_trace(tmp_path / "p.bin")
    dec = np.asarray(tagged.phase) == DECODE
    assert len(plain) == int(dec.sum()) and plain.expert.tolist() == np.asarray(tagged.expert)[dec].tolist()
    assert res["trace_records"] == int((plain.rank == 0).sum())
    line = _one_line_error(*cli("run", gguf, "--prompts", d / "train.txt", "-n", "1", "--device", "cpu",
                                 "--trace-out", tmp_path / "one.bin", "--trace-format", "strata"))
    assert "--max-new-tokens 1" in line and "decode positions only" in line and "strata-tagged" in line
    assert not (tmp_path / "one.bin").exists()
