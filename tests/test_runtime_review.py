"""Review findings for the runtime and ``stratatools run``: each test is an input that broke it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stratatools.runtime.model import Qwen4ExpRuntime
from stratatools.runtime.weights import load

pytestmark = pytest.mark.kit


def _strict_json(text: str):
    def bad(tok: str):
        raise ValueError(f"non-standard JSON constant {tok}")

    return json.loads(text, parse_constant=bad)


@pytest.fixture(scope="module")
def ista_pack(kit, tmp_path_factory):
    from stratatools.pack.native import pack_model

    pk = tmp_path_factory.mktemp("rv") / "pack"
    pack_model(kit / "quant" / "model-ISTA-mix.gguf", pk)
    return pk


def test_trace_out_never_replaces_a_pack_file_or_shard(kit, ista_pack, tmp_path, cli):
    """--trace-out naming the pack's own table (or a shard of the model) is refused even with --force."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    table = ista_pack / "native_experts.txt"
    before = table.read_bytes()
    code, _, err = cli("run", ista_pack, "--prompts", prompts, "-n", "0", "--trace-out", table, "--force")
    assert code == 2 and "input" in err and err.strip().count("\n") == 0, err
    assert table.read_bytes() == before
    # a GGUF shard set: shard 2 is an input too, although only shard 1 was named
    shards = sorted((kit / "gguf" / "split").glob("*.gguf"))
    link = tmp_path / "s"
    link.mkdir()
    for s in shards:
        (link / s.name).symlink_to(s)
    code, _, err = cli("run", link / shards[0].name, "--prompts", prompts, "-n", "0",
                       "--trace-out", link / shards[1].name, "--force")
    assert code == 2 and "input" in err, err


def test_json_is_strict_when_no_decode_ran(ista_pack, tmp_path, cli):
    """-n 1 (or 0) leaves the decode phase empty: its hit rate is null, not NaN (invalid JSON)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\n")
    code, out, err = cli("run", ista_pack, "--prompts", prompts, "-n", "1", "--slots", "8", "--json")
    assert code == 0, err
    res = _strict_json(out)
    assert res["tier"]["decode"]["entries"] == 0 and res["tier"]["decode"]["h_expert"] is None
    assert res["tier"]["prefill"]["entries"] > 0
    assert res["h_expert"] == pytest.approx(res["tier"]["prefill"]["hits"] / res["tier"]["prefill"]["entries"])
    code, out, err = cli("run", ista_pack, "--prompts", prompts, "-n", "1", "--slots", "8")
    assert code == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("value", ["inf", "1e300"])
def test_huge_budget_is_a_one_line_error_or_runs(ista_pack, tmp_path, cli, value):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    code, out, err = cli("run", ista_pack, "--prompts", prompts, "-n", "0", "--budget-gib", value)
    assert "Traceback" not in err and code in (0, 2), err
    if code == 2:
        assert "--budget-gib" in err and err.strip().count("\n") == 0, err


def test_policy_without_a_tier_is_refused(ista_pack, tmp_path, cli):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    code, _, err = cli("run", ista_pack, "--prompts", prompts, "-n", "0", "--policy", "adaptive")
    assert code == 2 and "--slots" in err and err.strip().count("\n") == 0, err


@pytest.mark.parametrize("policy", ["belady", "foo"])
def test_unknown_or_offline_policy_is_refused_naming_the_option(ista_pack, tmp_path, cli, policy):
    """run's tier is online: --policy belady (simulate's offline bound) and unknown names are one line naming
    --policy and the policies run takes (belady is not offered), before the model is loaded."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    code, out, err = cli("run", ista_pack, "--prompts", prompts, "-n", "2", "--slots", "4", "--policy", policy)
    assert code == 2 and out == "" and err.strip().count("\n") == 0, err
    assert f"--policy {policy}" in err and "static, adaptive, lru, lfu, lfru" in err, err
    assert "belady)" not in err and "future=" not in err, err


def test_token_id_prompts_report_decoded_text(kit, ista_pack, tmp_path, cli):
    """The kit's prompts.json gives token ids; the generated text is still decoded (not shown as ids)."""
    from stratatools.runtime.tokenizer import BPETokenizer
    from stratatools.model.gguf import open_model

    code, out, err = cli("run", ista_pack, "--prompts", kit / "routing" / "prompts.json", "-n", "3", "--json")
    assert code == 0, err
    res = _strict_json(out)
    with open_model(kit / "quant" / "model-ISTA-mix.gguf") as m:
        tok = BPETokenizer.from_gguf(m)
    for r in res["requests"]:
        assert len(r["new_ids"]) == 3
        assert r["text"] == tok.decode(r["new_ids"]) and r["text"] is not None
    code, out, err = cli("run", ista_pack, "--prompts", kit / "routing" / "prompts.json", "-n", "3")
    assert code == 0, err
    first = res["requests"][0]
    assert repr(first["text"][:40]) in out
    assert " ".join(map(str, first["new_ids"])) not in out


def test_utf8_bom_is_not_a_token(ista_pack, tmp_path, cli):
    plain = tmp_path / "a.txt"
    plain.write_bytes(b"hello world\r\nsecond line\r\n")
    bom = tmp_path / "b.txt"
    bom.write_bytes(b"\xef\xbb\xbfhello world\r\nsecond line\r\n")
    bomj = tmp_path / "c.json"
    bomj.write_bytes(b'\xef\xbb\xbf{"prompts": ["hello world", "second line"]}')
    counts = []
    for f in (plain, bom, bomj):
        code, out, err = cli("run", ista_pack, "--prompts", f, "-n", "0", "--json")
        assert code == 0, err
        counts.append([r["prompt_tokens"] for r in _strict_json(out)["requests"]])
    assert counts[0] == counts[1] == counts[2]


@pytest.mark.parametrize("selection", ["transformers", "llamacpp"])
def test_chunked_prefill_equals_one_prefill(kit, kit_prompts, selection):
    """Chunks that start inside a QSA block, cross block boundaries and follow the mid-prompt EOS (p2)."""
    w = load(kit / "gguf" / "model-bf16.gguf")
    try:
        rt = Qwen4ExpRuntime(w, selection=selection)
        ids = kit_prompts[2][1]
        full, frec = rt.forward(ids, rt.new_state(), logits="all")
        st = rt.new_state()
        outs, recs, p = [], [], 0
        for c in (7, 13, 1, 1, 23):
            lg, r = rt.forward(ids[p:p + c], st, logits="all")
            outs.append(lg)
            recs.append(r)
            p += c
        assert p == len(ids)
        np.testing.assert_allclose(np.concatenate(outs), full, rtol=0, atol=5e-6)
        for il in range(w.cfg.n_layer):
            np.testing.assert_array_equal(np.concatenate([r.ids[il] for r in recs]), frec.ids[il])
        assert np.concatenate([r.positions for r in recs]).tolist() == list(range(len(ids)))
    finally:
        w.close()


def test_trace_positions_phases_and_requests(kit, ista_pack, tmp_path, cli):
    """The tagged Strata trace read back: per request, prefill positions 0..P-1 written layer-major as one window
    (the order the batched prefill routes them: one round), then decode positions P.. in order, every layer per
    position, outside every window."""
    from stratatools.traces.table import DECODE, PREFILL
    from stratatools.traces.formats import read_trace

    trace = tmp_path / "t.bin"
    code, out, err = cli("run", ista_pack, "--prompts", kit / "routing" / "prompts.json", "-n", "5",
                         "--trace-out", trace, "--json")
    assert code == 0, err
    res = _strict_json(out)
    t = read_trace(trace)
    k = 4
    for r in res["requests"]:
        m = t.request == r["request"]
        P = r["prompt_tokens"]
        n_dec = len(r["new_ids"]) - 1  # the last new token (EOS or the cap) is never run
        pre = m & (t.phase == PREFILL)
        dec = m & (t.phase == DECODE)
        assert np.unique(t.position[pre]).tolist() == list(range(P))
        assert np.unique(t.position[dec]).tolist() == list(range(P, P + n_dec))
        assert pre.sum() == P * 8 * k and dec.sum() == n_dec * 8 * k
        assert np.all(np.diff(t.layer[pre]) >= 0)  # layer-major prefill
        assert t.position[pre].tolist() == np.tile(np.repeat(np.arange(P), k), 8).tolist()
        assert np.all(np.diff(t.position[dec]) >= 0)
        win = np.asarray(t.window)
        assert len(np.unique(win[pre])) == 1 and (win[dec] == -1).all()
        assert (win[pre] >= 0).all() == (P > 1)  # a one-token prompt is a position, a round either way
    assert math.isclose(float(t.weight[:k].sum()), 1.0, rel_tol=1e-5)


def test_csv_trace_names_model_and_prompts(kit, ista_pack, tmp_path, cli):
    """The CSV trace uses the kit's columns with the GGUF's name and the prompts' ids (was model
    'stratatools-runtime' and prompt ids 0, 1, 2), so it compares directly with the kit's routing CSVs."""
    import csv

    from stratatools.traces.formats import read_trace

    trace = tmp_path / "t.csv"
    code, out, err = cli("run", ista_pack, "--prompts", kit / "routing" / "prompts.json", "-n", "2",
                         "--trace-out", trace)
    assert code == 0, err
    rows = list(csv.DictReader(open(trace)))
    assert {r["model"] for r in rows} == {"model-ISTA-mix.gguf"}
    assert sorted({r["prompt_id"] for r in rows}) == ["p0", "p1", "p2"]
    first = [r for r in rows if r["prompt_id"] == "p0" and r["token_pos"] == "0" and r["layer"] == "0"]
    assert [r["rank"] for r in first] == ["0", "1", "2", "3"] and first[0]["phase"] == "prefill"
    t = read_trace(trace)
    assert len(t) == len(rows) and set(np.unique(t.request).tolist()) == {0, 1, 2}


def test_trace_out_directory_is_refused_before_running(ista_pack, tmp_path, cli):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    d = tmp_path / "out"
    d.mkdir()
    code, _, err = cli("run", ista_pack, "--prompts", prompts, "-n", "0", "--trace-out", d, "--force")
    assert code == 2 and "directory" in err and err.strip().count("\n") == 0, err
    assert d.is_dir() and not list(d.iterdir())


def test_batched_decode_line_is_one_line_at_80_columns(ista_pack, tmp_path):
    """The decode summary of run --batch N stays one line in a pipe (80 columns), like the other summary lines."""
    import io

    from stratatools.cli import run_captured

    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\nthe quick brown fox\n")
    out = io.StringIO()
    code = run_captured(["run", str(ista_pack), "--prompts", str(prompts), "-n", "3", "--batch", "2"], out, io.StringIO(),
                        width=80)
    assert code == 0
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("prefill: ")]
    assert len(lines) == 1 and "tokens/s aggregate over --batch 2 (2.0 sequences per step on average)" in lines[0], \
        out.getvalue()
