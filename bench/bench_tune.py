"""Benchmark: what successive halving saves in `stratatools tune`, as ratios to an exhaustive search measured in the
same run (the same drawn settings, every one scored on every fold), plus peak RSS.

Workload: the seeded decode-heavy bursty trace of stratatools.cachesim.workload (default parameters, the one the
tests use; ``--requests N`` makes it longer), 288 slots, 5 folds by request. Prints, for both searches: replays,
wall seconds, the best setting's held-out h_expert, and the ratios (replays, time) and the score gap.
Usage: .venv/bin/python bench/bench_tune.py [--candidates 81] [--requests 20]
"""

from __future__ import annotations

import argparse
import resource
import time

from stratatools.cachesim.tune import tune
from stratatools.cachesim.workload import Workload, generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", type=int, default=81)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--slots", type=int, default=288)
    a = ap.parse_args()
    w = Workload(requests=a.requests)
    table = generate(w)
    print(f"workload: {len(table):,} routed entries, {w.requests} requests, {w.n_layers} x {w.n_expert}, "
          f"top-{w.top_k}; {a.candidates} settings drawn, {a.slots} slots, 5 folds")
    # warm the compiled kernels so neither side pays the JIT
    tune([table], w.n_layers, w.n_expert, slots=a.slots, k=5, candidates=1)
    out = {}
    for name, eta in (("successive halving", 3), ("exhaustive", a.candidates + 10)):
        t0 = time.perf_counter()
        r = tune([table], w.n_layers, w.n_expert, slots=a.slots, k=5, candidates=a.candidates, eta=eta)
        dt = time.perf_counter() - t0
        out[name] = (r.evaluated, dt, r.best.mean("h_expert"), r.defaults.mean("h_expert"))
        print(f"{name:>19}: {r.evaluated:5d} replays, {dt:7.2f} s, best held-out h_expert "
              f"{100 * out[name][2]:.2f}% (defaults {100 * out[name][3]:.2f}%), rungs "
              + ", ".join(f"{x['settings']}x{x['folds']}" for x in r.rungs))
    sh, ex = out["successive halving"], out["exhaustive"]
    print(f"ratios (halving / exhaustive): replays {sh[0] / ex[0]:.3f}, time {sh[1] / ex[1]:.3f}; "
          f"best score gap {100 * (sh[2] - ex[2]):+.2f} points")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
