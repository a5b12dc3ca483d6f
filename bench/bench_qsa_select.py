"""Benchmark: QSA cell selection for a chunk of queries past the full-selection range (issues 12/17), the chunk-wide
:func:`stratatools.runtime.topk.qsa_select_mask` against the per-query loop it replaced (torch_topk_indices /
llamacpp_cells per query), measured in the same run; both masks are checked equal.

1. Selection only, full-width indexer settings (``SynthConfig.full_width``: compress ratio 4, budget 2048 tokens,
   8 indexer heads of 128): chunks of 512 queries at positions 6,000.. and ..8,127 (P = 8,128 cells), block
   scores as the runtime makes them (sum over heads of ReLU(q.k) / sqrt(128), random q and k).
2. The numpy forward (``Qwen4ExpRuntime.forward``) prefilling a long prompt on a small synthetic model (reduced
   width, budget 16, ratio 4), with its selection swapped for the per-query loop as the baseline.

    nice .venv/bin/python bench/bench_qsa_select.py [--rows 512] [--llamacpp-rows 64] [--prompt 1024]

``--rows`` / ``--llamacpp-rows``: queries of each chunk timed with the per-query baseline (the rest is
extrapolated linearly; the new path always does the whole chunk). Peak RSS is printed at the end.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stratatools.runtime.topk import qsa_select_mask, qsa_select_per_query  # noqa: E402

RATIO, BUDGET, HEADS, DIH, T = 4, 2048, 8, 128, 512


per_query = qsa_select_per_query  # the per-query rule the runtime ran before (the reference)


def block_scores(rng, n_q: int, n_blocks: int) -> np.ndarray:
    q = rng.standard_normal((n_q, HEADS, DIH)).astype(np.float32)
    k = rng.standard_normal((n_blocks, DIH)).astype(np.float32)
    sc = np.einsum("thd,bd->tbh", q, k)
    return (np.maximum(sc, 0).sum(axis=-1) / np.float32(np.sqrt(DIH))).astype(np.float32)


def selection_bench(rows: dict[str, int]) -> None:
    rng = np.random.default_rng(0)
    qsa_select_mask("llamacpp", np.arange(4, dtype=np.float32)[None], [17], RATIO, 6, 18)  # numba: compile/load
    print(f"selection, chunk of {T} queries, ratio {RATIO}, budget {BUDGET}:")
    for pos0 in (6000, 8128 - T):
        P = pos0 + T
        pos = np.arange(pos0, P)
        sc = block_scores(rng, T, P // RATIO)
        for sel in ("transformers", "llamacpp"):
            n = min(rows[sel], T)
            t0 = time.perf_counter()
            want = per_query(sel, sc[:n], pos[:n], RATIO, BUDGET, P)
            t_old = (time.perf_counter() - t0) * T / n
            stats: dict = {}
            t0 = time.perf_counter()
            got = qsa_select_mask(sel, sc, pos, RATIO, BUDGET, P, stats)
            t_new = time.perf_counter() - t0
            same = bool(np.array_equal(got[:n], want))
            est = "" if n == T else f" (from {n} queries)"
            print(f"  pos {pos0}..{P - 1} {sel:12s} per-query {t_old:8.3f} s{est}  chunk {t_new:7.3f} s  "
                  f"x{t_old / t_new:7.1f}  per-query rows {stats['fallback']}/{T}  equal {same}")
            if not same:
                raise SystemExit("masks differ")


def prefill_bench(n_prompt: int) -> None:
    import stratatools.runtime.model as model
    from stratatools.runtime.weights import load
    from stratatools.synth.model import SynthConfig, synth_release

    with tempfile.TemporaryDirectory() as d:
        cfg = SynthConfig(n_layers=4, indexer_top_k=16, compress_ratio=4, revisions=False,
                          context_length=max(4096, n_prompt))
        w = load(synth_release(Path(d), cfg).canonical)
        rt = model.Qwen4ExpRuntime(w)
        ids = [int(x) for x in np.random.default_rng(1).integers(0, w.cfg.n_vocab, n_prompt)]
        rt.forward(ids[:8], rt.new_state())  # warm-up
        out = {}
        for name, fn in (("per-query", per_query), ("chunk", qsa_select_mask)):
            model.qsa_select_mask = fn
            t0 = time.perf_counter()
            lg, _ = rt.forward(ids, rt.new_state())
            out[name] = (time.perf_counter() - t0, lg)
        model.qsa_select_mask = qsa_select_mask
        (a, la), (b, lb) = out["per-query"], out["chunk"]
        print(f"numpy forward, {n_prompt}-token prompt, {w.cfg.n_layer} layers (small synth, budget 16, ratio 4): "
              f"per-query {a:.2f} s, chunk {b:.2f} s, x{a / b:.1f}, logits equal {bool(np.array_equal(la, lb))}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=T)
    ap.add_argument("--llamacpp-rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    a = ap.parse_args()
    selection_bench({"transformers": a.rows, "llamacpp": a.llamacpp_rows})
    if a.prompt:
        prefill_bench(a.prompt)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
