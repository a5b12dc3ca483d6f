"""A prompt's tier bookkeeping, as the GPU runtime feeds it after a batched prefill: T positions x L layers of k
routed experts through each simulator policy, row by row (``Tier.access``, the runtime before) against
``Tier.access_rows`` (one call per layer), in the same run. Prints ms per prompt and the ratio. CPU only.

LFU and LFRU are also timed in their straightforward form (``stratatools.cachesim._tiers_reference``: a scan of the
layer's residents per eviction, eager decay), the baseline of their lazy-heap victim choice, and checked to make the
same decisions (hits and final residency). A second table does the same for decode: every position its own round
(``end_round`` after it, so the LFU/LFRU decay runs every ``decay_every`` positions), one record per layer.

Times are the process's CPU time (``time.process_time``: a shared machine's other jobs do not inflate it as they do
the wall clock), each the best of ``--repeat`` runs on a fresh tier; every LFU/LFRU run is checked to make its reference's decisions.

Usage: python bench/bench_tier_rows.py [--tokens 512 --layers 48 --experts 256 --k 10 --slots 1872
                                        --decode-tokens 128 --repeat 3]
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
    ap.add_argument("--repeat", type=int, default=3)
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
    outcome: dict[str, tuple] = {}

    def timed(policy: str, key: str, feed) -> float:
        """Best CPU seconds of ``feed(tier) -> list of hit arrays`` over the repeats; the decisions of the first run
        are kept under ``key`` (an LFU/LFRU run is checked against its reference's)."""
        best = float("inf")
        for i in range(max(1, a.repeat)):
            t = tier(policy)
            t0 = time.process_time()
            got = feed(t)
            best = min(best, time.process_time() - t0)
            if i == 0:
                outcome[key] = (np.concatenate([np.ravel(g) for g in got]), t.resident_mask())
        ref = key.replace(policy, policy + " (reference)")
        if policy in ("lfu", "lfru") and not all(np.array_equal(x, y) for x, y in zip(outcome[key], outcome[ref])):
            raise SystemExit(f"{key}: decisions differ from the reference")
        return best

    def by_row(t):
        return [t.access(il, r) for il in range(a.layers) for r in ids[il]]

    def by_layer(t):
        return [t.access_rows(il, ids[il]) for il in range(a.layers)]

    T = min(a.decode_tokens, a.tokens)

    def decode(t):
        got = []
        for p in range(T):
            for il in range(a.layers):
                got.append(t.access(il, ids[il, p]))
            t.end_round()
        return got

    print(f"prompt: {a.tokens} positions x {a.layers} layers x k {a.k}, {a.slots} slots, one round; CPU ms, best of "
          f"{a.repeat}")
    print("| policy | access row by row (ms) | access_rows (ms) | ratio | access_rows vs reference | vs lru |")
    print("|---|---:|---:|---:|---:|---:|")
    rows_t: dict[str, float] = {}
    for policy in policies:
        one = timed(policy, "rows " + policy, by_row)
        rows_t[policy] = timed(policy, "layer " + policy, by_layer)
        ref = rows_t.get(policy + " (reference)")
        vs = f"{ref / rows_t[policy]:.2f}x faster" if ref else ""
        lru = f"{rows_t[policy] / rows_t['lru']:.2f}x" if "lru" in rows_t else ""
        print(f"| {policy} | {one * 1e3:.1f} | {rows_t[policy] * 1e3:.1f} | {one / rows_t[policy]:.2f}x | {vs} | {lru} |",
              flush=True)

    print(f"\ndecode: {T} positions, each one round (end_round after every position) x {a.layers} layers x k {a.k}; "
          f"CPU ms, best of {a.repeat}")
    print("| policy | access (ms) | ms per position | vs reference | vs lru |")
    print("|---|---:|---:|---:|---:|")
    dec: dict[str, float] = {}
    for policy in policies:
        dt = dec[policy] = timed(policy, "decode " + policy, decode)
        ref = dec.get(policy + " (reference)")
        vs = f"{ref / dt:.2f}x faster" if ref else ""
        lru = f"{dt / dec['lru']:.2f}x" if "lru" in dec else ""
        print(f"| {policy} | {dt * 1e3:.1f} | {dt * 1e3 / T:.3f} | {vs} | {lru} |", flush=True)


if __name__ == "__main__":
    main()
