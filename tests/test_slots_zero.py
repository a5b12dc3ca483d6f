"""``--slots 0`` across the commands (README, "simulate"): a tier of no slots is a measurement where a command
measures a tier (``run``: the GPU bench's all-miss case; ``simulate``/``compare``: its replay, the all-miss cost
baseline) and is refused, with the reason, where a command judges profiles or settings at the budget
(``validate-release``'s hit-rate gate, ``tune``'s search): at 0 slots every profile and setting scores 0 hits.

Also: a JSON prompt with both ``text`` and ``token_ids`` runs the ids (README, "run")."""

from __future__ import annotations

import io
import json

import pytest

from stratatools.cli import run_captured


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    """The demo's canonical synthetic model (``synth R --seed 7``, 32 experts per layer)."""
    d = tmp_path_factory.mktemp("slots0")
    err = io.StringIO()
    assert run_captured(["synth", str(d / "rel"), "--seed", "7", "--json"], io.StringIO(), err) == 0, err.getvalue()
    return d, d / "rel" / "synth-canonical.gguf"


def test_run_with_0_slots_is_all_miss(demo_model, cli):
    d, gguf = demo_model
    p = d / "p.txt"
    p.write_text("def f(x):\n")
    code, out, err = cli("run", gguf, "--prompts", p, "-n", "3", "--device", "cpu", "--slots", "0", "--json")
    assert code == 0, err
    tier = json.loads(out)["tier"]
    assert tier["slots"] == 0
    for ph in ("prefill", "decode"):
        assert tier[ph]["hits"] == 0 and tier[ph]["entries"] > 0 and tier[ph]["misses"] == tier[ph]["entries"]


def test_simulate_and_compare_with_0_slots_are_the_all_miss_baseline(kit, cli):
    p = kit / "pruned"
    code, out, err = cli("simulate", "-t", p / "coder-revB.routing.csv", "--model", p / "coder-revB.gguf",
                         "--slots", "0", "--no-sweep", "--json")
    assert code == 0, err
    rows = json.loads(out)["results"]
    assert rows and all(r["n_slots"] == 0 and r["h_expert"] == 0.0 and r["hits"] == 0 for r in rows), rows
    code, out, err = cli("compare", "-t", p / "coder-revB.routing.csv", "-p", p / "profile-revA.bin",
                         "--slots", "0", "--json")
    assert code == 0, err
    assert {r["h_expert"] for r in json.loads(out)["rows"]} == {0.0}


def test_validate_release_gate_refuses_0_slots_saying_why(kit, cli):
    p = kit / "pruned"
    code, out, err = cli("validate-release", "--model", p / "coder-revB.gguf", "--profile", p / "profile-revA.bin",
                         "-t", p / "coder-revB.routing.csv", "--min-hit-rate", "0.1", "--slots", "0")
    one = " ".join(err.split())
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "--slots 0" in one and "h_expert is 0 whatever the profile" in one and "leave --slots out" in one, err


def test_tune_refuses_0_slots_saying_why(kit, cli):
    p = kit / "pruned"
    code, out, err = cli("tune", "-t", p / "coder-revB.routing.csv", "--model", p / "coder-revB.gguf",
                         "--slots", "0", "--kfold", "2", "--candidates", "3")
    one = " ".join(err.split())
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    # refused by the option's bound (from 1), which says why
    assert "'--slots': must be an integer from 1 to 1099511627776 (got 0); tune needs at least 1 slot" in one, err
    assert "every setting scores the same" in one, err


def test_prompt_with_text_and_token_ids_runs_the_ids(demo_model, cli):
    """README ("run"): token ids win when an item gives both; the text is not tokenized."""
    d, gguf = demo_model
    ids = [5, 9, 11]
    outs = {}
    for name, item in (("both", {"text": "a much longer text than three tokens, surely", "token_ids": ids}),
                       ("ids", {"token_ids": ids}),
                       ("text", {"text": "a much longer text than three tokens, surely"})):
        f = d / f"{name}.json"
        f.write_text(json.dumps([item]))
        code, out, err = cli("run", gguf, "--prompts", f, "-n", "3", "--device", "cpu", "--slots", "8", "--json")
        assert code == 0, err
        outs[name] = json.loads(out)["requests"][0]
    assert outs["both"]["prompt_tokens"] == outs["ids"]["prompt_tokens"] == 3
    assert outs["both"]["new_ids"] == outs["ids"]["new_ids"]
    assert outs["text"]["prompt_tokens"] > 3
