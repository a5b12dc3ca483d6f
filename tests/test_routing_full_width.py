"""Routing of a FULL-WIDTH synthetic model (hidden 2560, the real DeltaNet / attention geometry) does not collapse.

The realistic routing was calibrated at reduced width (tests/test_routing_acceptance.py, hidden 64 / 128). At hidden
2560 the random Q2_0 expert blocks used to carry a DC gain (their offset codes ``d * (q - 1)`` have mean 0.5 d, 0.39 of
the rms): a matrix of 2560 inputs maps the all-ones direction with ~20x its ordinary gain, so the routed experts'
output grew along one shared direction layer after layer (rms 0.19 -> 24 -> 417 -> 569 per component over layers
0-3 of this model), every token's router input became the same vector and, from layer 2-3 on, every decode step
picked the same 10 experts (the 48 x 256 full-width model on an H200: ~21 distinct experts per layer over 319
positions). Synth now writes balanced random blocks (random scale sign) at full width; this records routing with
``stratatools run --trace-out`` on a 4-layer full-width model and checks it routes like the reduced-width one.
"""

import io
import json

import numpy as np
import pytest

from stratatools.cli import run_captured
from stratatools.core.resources import packaged
from stratatools.synth.model import SynthConfig, synth_release
from stratatools.traces.formats import read_trace
from stratatools.traces.table import trace_stats

L, E = 4, 64
ENTROPY_BAND = (0.70, 0.95)  # per-layer entropy / log2(E) (docs/synthetic-routing.md, the acceptance test's band)


def full_width(**kw):
    """Full width (hidden 2560, 24 x 256 attention, 16/32 x 128 DeltaNet heads), 4 layers (3 DeltaNet + 1 attention),
    64 experts of width 256, k 10, Q2_0 experts (the type of the H200 run)."""
    return SynthConfig.full_width(n_layers=L, n_expert=E, expert_ff=256, shared_ff=256, gu_types=("Q2_0",),
                                  down_types=("Q2_0",), **kw)


def test_full_width_config_balances_its_random_blocks():
    assert full_width().blocks_balanced
    assert not SynthConfig().blocks_balanced and not full_width(routing="legacy").blocks_balanced
    assert not full_width(balanced_blocks=False).blocks_balanced


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One suite prompt (120 characters) and 24 greedy decode tokens on the 4-layer full-width model."""
    d = tmp_path_factory.mktemp("fullwidth")
    rel = synth_release(d / "rel", full_width())
    suite = json.loads(packaged("data", "prompts", "suite.json").read_text(encoding="utf-8"))["prompts"]
    p = sorted(suite, key=lambda q: (q["domain"], q["prompt_id"]))[0]
    (d / "p.json").write_text(json.dumps({"prompts": [{"prompt_id": p["prompt_id"], "text": p["text"][:120]}]}),
                              encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    code = run_captured(["run", str(rel.canonical), "--prompts", str(d / "p.json"), "-n", "24", "--trace-out",
                         str(d / "t.bin"), "--json"], out, err)
    assert code == 0, err.getvalue()
    return read_trace(d / "t.bin"), json.loads(out.getvalue())


def test_full_width_routing_does_not_collapse(recorded):
    table, _ = recorded
    st = trace_stats(table, n_expert=E, window=24)
    assert len(st.per_layer) == L and st.collapsed_layers == [] and st.verdict.startswith("not collapsed"), st.verdict
    # 23 decode steps (the first new token comes from the prefill): unbalanced blocks used 13, 13, 13, 17 distinct
    # experts (layers 0-3), balanced 52, 43, 48, 40
    worst = min(ls.window_distinct_min for ls in st.per_layer)
    assert worst >= 30, worst
    rel = np.array([ls.entropy_bits for ls in st.per_layer]) / np.log2(E)
    assert ENTROPY_BAND[0] <= rel.min() and rel.max() <= ENTROPY_BAND[1], rel  # balanced 0.84 - 0.88


def test_full_width_greedy_text_does_not_loop(recorded):
    _, res = recorded
    reqs = res.get("requests") or res.get("results")
    new = reqs[0].get("new_ids") or reqs[0].get("generated_ids") if isinstance(reqs, list) else None
    assert new is not None and len(new) == 24, reqs[0].keys() if isinstance(reqs, list) else res.keys()
    assert len(set(new)) >= 12, new  # unbalanced blocks: one token 24 times
