"""A prompt's tier bookkeeping, as the GPU runtime feeds it after a batched prefill: T positions x L layers of k
routed experts through each simulator policy, row by row (``Tier.access``, the runtime before) against
``Tier.access_rows`` (one call per layer), in the same run. Prints ms per prompt and the ratio. CPU only.

LFU and LFRU are also timed in their straightforward form (``stratatools.cachesim._tiers_reference``: a scan of the
layer's residents per eviction, eager decay), the baseline of their lazy-heap victim choice, and checked to make the
same decisions (hits and final residency). A second table does the same for decode: every position its own round
(``end_round`` after it, so the LFU/LFRU decay runs every ``decay_every`` positions), one record per layer.

Usage: python bench/bench_tier_rows.py [--tokens 512 --layers 48 --experts 256 --k 10 --slots 1872
                                        --decode-tokens 128]
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
    from stratatools.cachesim._tiers_reference import make_reference_tier
    from stratatools.cachesim.layout import per_layer_split

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--slots", type=int, default=1872)
    ap.add_argument("--decode-tokens", type=int, default=128)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(a.experts, size=a.k, replace=False) for _ in range(a.tokens)])
                    for _ in range(a.layers)])  # [L, T, k]
    cap = per_layer_split(a.layers, slots=a.slots)

    def tier(policy: str):
        if policy.endswith(" (reference)"):
            return make_reference_tier(policy.split()[0], a.layers, a.experts, cap)
        return make_tier(policy, n_layers=a.layers, n_expert=a.experts, slots=a.slots)

    policies = ("static", "lru", "lfu (reference)", "lfu", "lfru (reference)", "lfru")
    print(f"prompt: {a.tokens} positions x {a.layers} layers x k {a.k}, {a.slots} slots, one round")
    print("| policy | access row by row (ms) | access_rows (ms) | ratio | access_rows vs reference | vs lru |")
    print("|---|---:|---:|---:|---:|---:|")
    best: dict[str, float] = {}
    outcome: dict[str, tuple] = {}
    for policy in policies:
        times = []
        for rows in (False, True):
            t = tier(policy)
            got = []
            t0 = time.perf_counter()
            for il in range(a.layers):
                if rows:
                    got.append(t.access_rows(il, ids[il]))
                else:
                    for r in ids[il]:
                        got.append(t.access(il, r))
            times.append(time.perf_counter() - t0)
            outcome.setdefault(policy, (np.concatenate([np.ravel(g) for g in got]), t.resident_mask()))
        best[policy] = times[1]
        ref = best.get(policy.split()[0] + " (reference)")
        same = ""
        if ref is not None and policy in ("lfu", "lfru"):
            r_hits, r_res = outcome[policy + " (reference)"]
            hits, res = outcome[policy]
            if not (np.array_equal(hits, r_hits) and np.array_equal(res, r_res)):
                raise SystemExit(f"{policy}: decisions differ from the reference")
            same = f"{ref / times[1]:.2f}x faster"
        lru = f"{times[1] / best['lru']:.2f}x" if "lru" in best else ""
        print(f"| {policy} | {times[0] * 1e3:.1f} | {times[1] * 1e3:.1f} | {times[0] / times[1]:.2f}x | {same} | {lru} |",
              flush=True)

    T = min(a.decode_tokens, a.tokens)
    print(f"\ndecode: {T} positions, each one round (end_round after every position) x {a.layers} layers x k {a.k}")
    print("| policy | access (ms) | ms per position | vs reference | vs lru |")
    print("|---|---:|---:|---:|---:|")
    dec: dict[str, float] = {}
    for policy in policies:
        t = tier(policy)
        got = []
        t0 = time.perf_counter()
        for p in range(T):
            for il in range(a.layers):
                got.append(t.access(il, ids[il, p]))
            t.end_round()
        dt = time.perf_counter() - t0
        dec[policy] = dt
        outcome[policy] = (np.concatenate(got), t.resident_mask())
        vs = ""
        if policy in ("lfu", "lfru"):
            r_hits, r_res = outcome[policy + " (reference)"]
            if not (np.array_equal(outcome[policy][0], r_hits) and np.array_equal(outcome[policy][1], r_res)):
                raise SystemExit(f"{policy}: decode decisions differ from the reference")
            vs = f"{dec[policy + ' (reference)'] / dt:.2f}x faster"
        lru = f"{dt / dec['lru']:.2f}x" if "lru" in dec else ""
        print(f"| {policy} | {dt * 1e3:.1f} | {dt * 1e3 / T:.3f} | {vs} | {lru} |", flush=True)


if __name__ == "__main__":
    main()
