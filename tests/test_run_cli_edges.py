"""``stratatools run`` edge cases on the CPU (numpy) path, on the embedded synthetic release that ``make demo``
uses (``synth --seed 7``: the 32-expert canonical model): prompt ids in JSON prompt files, the JSON shape at every
``--batch``, trace output options that cannot work."""

from __future__ import annotations

import io
import json

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
                                      "state_bytes", "engine")}


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
