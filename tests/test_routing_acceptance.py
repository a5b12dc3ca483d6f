"""Acceptance: a 48-layer reduced-width synthetic model routes like a real one when the runtime runs it.

Records routing with ``stratatools run --trace-out`` on prompts of the packaged suite and checks (numbers and the
band in docs/synthetic-routing.md): no layer collapsed (>= 4k distinct experts per layer over 64 decode
tokens) and every layer's entropy inside the documented band, for the default (``realistic``) routing and the
``bursty`` setting; with ``--routing bursty`` on this bursty decode workload a static profile scores lower on
held-out prompts than in-sample, and lower than per-layer LRU with the same slots.
"""

import json

import numpy as np
import pytest

from stratatools.cachesim.kfold import kfold_eval
from stratatools.cachesim.replay import prepare_entries, simulate_policy
from stratatools.core.resources import packaged
from stratatools.synth.model import SynthConfig, synth_release
from stratatools.traces.formats import read_trace
from stratatools.traces.table import trace_stats

L, E, K = 48, 64, 4
ENTROPY_BAND = (0.70, 0.95)  # per-layer entropy / log2(E), default realistic routing (docs/synthetic-routing.md)


def reduced(**kw):
    """48 layers, hidden 64, 64 experts, k 4: the real model's structure at a width a CPU test can run."""
    return SynthConfig(n_layers=L, hidden=64, n_expert=E, k=K, expert_ff=32, shared_ff=32, n_head=2, n_head_kv=1,
                       head_dim=64, linear_k_heads=2, linear_v_heads=4, linear_k_dim=16, linear_v_dim=16,
                       hc_lowrank=16, indexer_heads=2, indexer_dim=32, indexer_top_k=64, revisions=False,
                       gu_types=("Q8_0",), down_types=("Q4_0",), **kw)


def _run(model, prompts, path, n_new):
    import io

    from stratatools.cli import run_captured

    path.with_suffix(".json").write_text(json.dumps({"prompts": prompts}), encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    code = run_captured(["run", str(model), "--prompts", str(path.with_suffix(".json")), "-n", str(n_new),
                         "--trace-out", str(path)], out, err)
    assert code == 0, err.getvalue()
    return read_trace(path)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(long, bursty, bursty routing): the default routing on 2 prompts decoding 65 tokens and on 10 prompts (every
    domain twice) decoding 12 tokens; ``--routing bursty`` on the same 10 prompts."""
    d = tmp_path_factory.mktemp("accept")
    rel = synth_release(d / "rel", reduced())
    rel_b = synth_release(d / "rel_b", reduced(routing="bursty"))
    suite = json.loads(packaged("data", "prompts", "suite.json").read_text(encoding="utf-8"))["prompts"]
    by_dom: dict[str, list] = {}
    for p in suite:
        by_dom.setdefault(p["domain"], []).append(p)
    picks = [by_dom[dm][i] for i in range(2) for dm in sorted(by_dom)]
    items = [{"prompt_id": p["prompt_id"], "text": p["text"][:100]} for p in picks]
    return (_run(rel.canonical, items[:2], d / "long.bin", 65), _run(rel.canonical, items, d / "bursty.bin", 12),
            _run(rel_b.canonical, items, d / "bursty-b.bin", 12))


def test_no_layer_collapses_at_depth(recorded):
    st = trace_stats(recorded[0], n_expert=E, window=64)
    assert st.window == 64 and st.collapsed_layers == [] and st.verdict.startswith("not collapsed")
    worst = min(ls.window_distinct_min for ls in st.per_layer)
    assert len(st.per_layer) == L and worst >= 4 * K, worst


@pytest.mark.parametrize("which", [1, 2], ids=["realistic", "bursty"])
def test_entropy_inside_the_documented_band(recorded, which):
    st = trace_stats(recorded[which], n_expert=E)
    rel = np.array([ls.entropy_bits for ls in st.per_layer]) / np.log2(E)
    assert ENTROPY_BAND[0] <= rel.min() and rel.max() <= ENTROPY_BAND[1], (rel.min(), rel.max())


def test_static_profile_held_out_below_in_sample_and_lru(recorded):
    bursty = recorded[2]
    slots = L * E // 8  # 1/8 of every layer's experts, per-layer admission (the bursty decode comparison)
    kf = kfold_eval([bursty], L, E, 5, policies=("static",), slots=slots, admission="per-layer")
    lru = simulate_policy(prepare_entries(bursty, L, E, phase="decode"), "lru", slots=slots, admission="per-layer")
    assert kf.mean["static"] < kf.in_sample["static"], (kf.mean, kf.in_sample)
    assert kf.mean["static"] < lru.h_expert, (kf.mean, lru.h_expert)
    assert 0.05 < kf.mean["static"] < 0.6 and lru.h_expert < 0.95  # neither a collapse nor a uniform spray



def test_default_routing_is_more_profile_friendly_than_bursty(recorded):
    """The default (calibrated) routing: a static profile transfers to held-out prompts (still below in-sample) and
    scores more than on the bursty setting, where recency wins."""
    slots = L * E // 8
    kf = [kfold_eval([recorded[i]], L, E, 5, policies=("static",), slots=slots, admission="per-layer") for i in (1, 2)]
    assert kf[0].mean["static"] < kf[0].in_sample["static"], (kf[0].mean, kf[0].in_sample)
    assert kf[0].mean["static"] > kf[1].mean["static"] + 0.05, (kf[0].mean, kf[1].mean)
