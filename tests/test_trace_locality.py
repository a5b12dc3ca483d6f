"""trace stats: distinct experts per window, reuse distances and the collapse verdict."""

import json

import numpy as np

from stratatools.traces.formats import write_trace
from stratatools.traces.table import DECODE, PREFILL, TraceTable, locality_stats, trace_stats


def _table(steps=64, prefill=5):
    """One request: ``prefill`` prefill positions then ``steps`` decode positions, 2 layers, k 2. Layer 0 always
    routes experts 0 and 1 (collapsed); layer 1 cycles through 16 experts (each reused 8 steps later)."""
    rows = []
    for p in range(prefill + steps):
        ph = PREFILL if p < prefill else DECODE
        s = p - prefill
        for layer in (0, 1):
            ex = (0, 1) if layer == 0 else ((2 * s) % 16, (2 * s + 1) % 16)
            for r, e in enumerate(ex):
                rows.append((0, p, ph, layer, r, e, 0.5))
    a = np.array(rows, dtype=np.float64).T
    return TraceTable(a[0].astype(np.int32), a[1].astype(np.int32), a[2].astype(np.int8), a[3].astype(np.int16),
                      a[4].astype(np.int16), a[5].astype(np.int32), a[6].astype(np.float32))


def test_collapsed_layer_is_named():
    st = trace_stats(_table(), n_expert=16)
    l0, l1 = st.per_layer
    assert (l0.window_distinct_min, l1.window_distinct_min) == (2, 16)
    assert (l0.reuse_p50, l1.reuse_p50, l1.reuse_p90) == (1.0, 8.0, 8.0)
    assert l0.cold_share == 2 / 128 and l1.cold_share == 16 / 128
    assert st.collapsed_layers == [0] and st.locality_phase == "decode"
    assert st.verdict.startswith("COLLAPSED: 1 of 2 layers (first: layer 0)")
    assert st.reuse_quantiles["p50"] == 1.0  # half the reused entries are layer 0's


def test_windows_and_partial_windows():
    loc = locality_stats(_table(steps=130), window=64)
    assert loc["window_steps"] == 64 and loc["layers"][1]["full_windows"] == 2  # the 2 left-over steps are dropped
    short = trace_stats(_table(steps=20), n_expert=16)
    assert "no request has 64" in short.verdict and short.collapsed_layers == [0]


def test_not_collapsed_verdict_and_cli_json(cli, tmp_path):
    t = _table()
    t.expert[(t.layer == 0) & (t.phase == DECODE)] += (np.arange(128) % 8).astype(np.int32) * 2
    st = trace_stats(t, n_expert=32)
    assert st.collapsed_layers == [] and st.verdict.startswith("not collapsed")
    path = tmp_path / "t.csv"
    write_trace(_table(), path, "csv")
    code, out, err = cli("trace", "stats", str(path), "--json", "--window", "32")
    d = json.loads(out)
    assert code == 0 and d["window"] == 32 and d["collapsed_layers"] == [0]
    assert d["per_layer"][1]["window_distinct_min"] == 16
    code, out, err = cli("trace", "stats", str(path))
    assert code == 0 and "verdict: COLLAPSED" in out
