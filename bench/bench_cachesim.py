"""Benchmark: routed entries per second of the compiled replay (stratatools.cachesim.kernels) for the static
tier, the adaptive tier, LRU and Belady, each as a ratio to the plain per-entry Python loop of the same policy
(the online tier objects of stratatools.cachesim.tiers) measured in the same run, plus peak RSS.

Workload: a synthetic Coder-shaped trace (48 layers x 256 experts, k = 10, skewed per-layer popularity that
drifts over time), global admission at 1,872 slots (the 12 GB-card Coder figure, ~39 per layer), per-layer
split of the same count for the baselines. Usage: .venv/bin/python bench/bench_cachesim.py [tokens]
"""

from __future__ import annotations

import resource
import sys
import time

import numpy as np

from stratatools.cachesim import kernels
from stratatools.cachesim.replay import Entries, run_policy
from stratatools.profiles.ranking import build_profile

L, E, K = 48, 256, 10
SLOTS = 1872


def make_entries(tokens: int, seed: int = 0) -> Entries:
    rng = np.random.default_rng(seed)
    base = rng.random((L, E)) ** 6
    lay = np.repeat(np.arange(L), K)[None, :].repeat(tokens, 0)
    ex = np.empty((tokens, L, K), dtype=np.int64)
    phase_len = max(1, tokens // 8)
    for t0 in range(0, tokens, phase_len):
        w = base + 0.2 * rng.random((L, E)) ** 6  # drift between phases
        g = rng.gumbel(size=(min(phase_len, tokens - t0), L, E)) + np.log(w + 1e-9)[None]
        ex[t0:t0 + g.shape[0]] = np.argpartition(-g, K, axis=2)[:, :, :K]
    rnd = np.repeat(np.arange(tokens), L * K)
    rec = np.repeat(np.arange(tokens * L), K)
    return Entries(lay.ravel().astype(np.int64), ex.ravel(), rnd, rec, np.zeros(tokens * L * K, np.int64), L, E,
                   tokens)


def timed(f, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
    ent = make_entries(tokens)
    small = ent.take(ent.rnd < max(20, tokens // 40))
    counts_half = np.bincount(small.layer * E + small.expert, minlength=L * E).reshape(L, E).astype(float)
    prof = build_profile(counts_half, mode="no-base")  # ranked on the start only: adaptive has work to do
    cap = np.full(L, SLOTS // L)
    cap[-1] += SLOTS % L
    cases = {
        "static": dict(profile=prof, slots=SLOTS),
        "adaptive": dict(profile=prof, slots=SLOTS),
        "lru": dict(cap=cap),
        "belady": dict(cap=cap),
    }
    print(f"numba: {kernels.HAVE_NUMBA}; entries: {len(ent):,} ({tokens} tokens x {L} layers x k={K}); "
          f"python baseline on {len(small):,} entries")
    t0 = time.perf_counter()
    for pol, kw in cases.items():
        run_policy(small, pol, **kw)  # compile (cached on disk after the first run)
    print(f"JIT warm-up (compile or cache load): {time.perf_counter() - t0:.2f} s")
    print(f"{'policy':<10}{'compiled M/s':>14}{'python M/s':>12}{'ratio':>10}{'h_expert':>10}   target")
    targets = {"static": 20, "adaptive": 5, "lru": 5, "belady": 2}
    for pol, kw in cases.items():
        tc = timed(lambda: run_policy(ent, pol, **kw))
        tp = timed(lambda: run_policy(small, pol, engine="python", **kw), repeat=1)
        h, _, _ = run_policy(ent, pol, **kw)
        hs, _, _ = run_policy(small, pol, **kw)
        hp, _, _ = run_policy(small, pol, engine="python", **kw)
        assert np.array_equal(hs, hp), pol
        rc, rp = len(ent) / tc / 1e6, len(small) / tp / 1e6
        ok = "ok" if rc >= targets[pol] else "MISSED"
        print(f"{pol:<10}{rc:>14.1f}{rp:>12.3f}{rc / rp:>10.0f}{h.mean():>10.4f}   >= {targets[pol]} M/s {ok}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: {rss:.0f} MiB")


if __name__ == "__main__":
    main()
