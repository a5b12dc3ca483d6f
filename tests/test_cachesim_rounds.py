"""Rounds of layer-major (batched) traces: one captured batch of a request is one round, as a verify window is."""

from __future__ import annotations

import numpy as np

from stratatools.cachesim.replay import prepare_entries
from stratatools.traces.table import UNKNOWN, TraceTable
from stratatools.traces.formats import read_trace


def _table(order: str, n_pos: int = 3, n_layers: int = 2, requests: int = 1) -> TraceTable:
    rows = []
    for r in range(requests):
        if order == "token-major":
            cells = [(p, l) for p in range(n_pos) for l in range(n_layers)]
        else:
            cells = [(p, l) for l in range(n_layers) for p in range(n_pos)]
        rows += [(r, p, l, 0, (p + l) % 4) for p, l in cells]
    a = np.array(rows)
    n = len(a)
    return TraceTable(request=a[:, 0], position=a[:, 1], phase=np.full(n, UNKNOWN), layer=a[:, 2], rank=a[:, 3],
                      expert=a[:, 4], weight=np.ones(n))


def test_token_major_rounds_are_positions():
    ent = prepare_entries(_table("token-major", n_pos=3), 2, 4, phase="all")
    assert ent.n_rounds == 3 and ent.rounds_by == "positions"
    assert ent.rnd.tolist() == [0, 0, 1, 1, 2, 2]


def test_layer_major_batch_is_one_round_per_request():
    ent = prepare_entries(_table("layer-major", n_pos=3, requests=2), 2, 4, phase="all")
    assert ent.n_rounds == 2 and ent.rounds_by == "batches"
    assert ent.rnd.tolist() == [0] * 6 + [1] * 6
    assert ent.n_tokens == 6  # tokens still count (request, position) pairs


def test_kit_csv_rounds(kit):
    t = read_trace(kit / "pruned/coder-revB.routing.csv")
    ent = prepare_entries(t, 8, 16, phase="all")
    assert ent.n_rounds == 3  # three prompts, each captured as one layer-major ubatch
    assert ent.n_tokens == 135


def test_compare_takes_bandwidth_and_policy_options(kit, cli):
    p = kit / "pruned"
    args = ("compare", "-t", p / "coder-revB.routing.csv", "-p", p / "profile-revA.bin", "--model",
            p / "coder-revB.gguf", "--slots", "48", "--policy", "static", "--json")
    import json

    code, out, err = cli(*args)
    assert code == 0, err
    fast = json.loads(out)["rows"][0]
    code, out, err = cli(*args, "--host-gbps", "6", "--vram-gbps", "90")
    assert code == 0, err
    slow = json.loads(out)["rows"][0]
    assert slow["h_expert"] == fast["h_expert"]
    key = next(k for k in fast if "time_per_token" in k or k.startswith("ms"))
    assert abs(slow[key] - 10 * fast[key]) <= 1e-9 * max(1.0, abs(slow[key]))  # every byte is 10x slower
    code, _, err = cli(*args, "--host-gbps", "nan")
    assert code == 2
