"""A prompt's tier bookkeeping, as the GPU runtime feeds it after a batched prefill: T positions x L layers of k
routed experts through each simulator policy, row by row (``Tier.access``, the runtime before) against
``Tier.access_rows`` (one call per layer), in the same run. Prints ms per prompt and the ratio. CPU only.

Usage: python bench/bench_tier_rows.py [--tokens 512 --layers 48 --experts 256 --k 10 --slots 1872]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from stratatools.cachesim import make_tier

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--slots", type=int, default=1872)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(a.experts, size=a.k, replace=False) for _ in range(a.tokens)])
                    for _ in range(a.layers)])  # [L, T, k]
    print(f"{a.tokens} positions x {a.layers} layers x k {a.k}, {a.slots} slots")
    print("| policy | access row by row (ms) | access_rows (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for policy in ("static", "lru", "lfu", "lfru"):
        times = []
        for rows in (False, True):
            t = make_tier(policy, n_layers=a.layers, n_expert=a.experts, slots=a.slots)
            t0 = time.perf_counter()
            for il in range(a.layers):
                if rows:
                    t.access_rows(il, ids[il])
                else:
                    for r in ids[il]:
                        t.access(il, r)
            times.append(time.perf_counter() - t0)
        print(f"| {policy} | {times[0] * 1e3:.1f} | {times[1] * 1e3:.1f} | {times[0] / times[1]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
