"""Benchmark: a Coder-shaped allocation (48 layers x 512 -> 256 experts, 74,952 entries) parsed, validated
and diffed, against a naive per-line Python parser measured in the same run.

Prints seconds per step, the ratio against the baseline, and peak RSS. Files are generated in a temp dir.

    .venv/bin/python bench/bench_alloc.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from stratatools.alloc.allocation import diff_allocations, format_allocation, read_allocation
from stratatools.profiles.strp import Profile
from stratatools.profiles.diff import profile_vs_allocations
from stratatools.profiles.remap import remap_pruned_to_pruned

L, E_FULL, E_KEPT = 48, 512, 256


def coder_like(seed: int) -> tuple[list[np.ndarray], dict[str, str]]:
    """Kept sets of 256 of 512 per layer and a Section 1 of 1,224 tensors (48 x 25 + 24), like the Coder's."""
    rng = np.random.default_rng(seed)
    kept = [np.sort(rng.choice(E_FULL, E_KEPT, replace=False)) for _ in range(L)]
    s1 = {f"global_{i}.weight": "Q8_0" for i in range(24)}
    for layer in range(L):
        for j in range(25):
            s1[f"blk.{layer}.t{j}.weight"] = "F32" if j % 5 == 0 else "Q8_0"
    return kept, s1


def naive_parse(path: Path) -> dict:
    """Baseline: the obvious per-line Python state machine (split/partition, int(), dict of sets)."""
    kept: dict[tuple[int, str], set[int]] = {}
    seen: dict[tuple[int, str], set[int]] = {}
    s1 = {}
    for n, raw in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, typ = line.partition(":")
        if not sep:
            raise ValueError(f"line {n}")
        name, typ = name.strip(), typ.strip()
        if name.endswith("]") and "_exps.weight[" in name:
            head, _, idx = name[:-1].partition("[")
            parts = head.split(".")
            layer, role = int(parts[1]), parts[2][4:-5]
            i = int(idx)
            s = seen.setdefault((layer, role), set())
            if i in s:
                raise ValueError(f"dup line {n}")
            s.add(i)
            if typ:
                kept.setdefault((layer, role), set()).add(i)
        else:
            s1[name] = typ
    return {"kept": {k: sorted(v) for k, v in kept.items()}, "s1": s1}


def timed(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ka, s1 = coder_like(1)
        rng = np.random.default_rng(2)
        kb = []
        for k in ka:  # a re-release: a quarter of the kept experts swapped for pruned ones
            pruned = np.setdiff1d(np.arange(E_FULL), k)
            drop = rng.choice(len(k), E_KEPT // 4, replace=False)
            nk = np.sort(np.concatenate([np.delete(k, drop), rng.choice(pruned, E_KEPT // 4, replace=False)]))
            kb.append(nk)
        pa, pb = Path(d) / "a.rco-allocation.txt", Path(d) / "b.rco-allocation.txt"
        types = ("IQ2_XXS", "IQ2_XXS", "Q2_0")
        pa.write_text(format_allocation(ka, E_FULL, section1=s1, expert_types=types, title="bench revA"))
        pb.write_text(format_allocation(kb, E_FULL, section1=s1, expert_types=types, title="bench revB"))
        size = pa.stat().st_size
        t_base, base = timed(lambda: naive_parse(pa), args.repeat)
        t_parse, a = timed(lambda: read_allocation(pa), args.repeat)
        b = read_allocation(pb)
        assert a.n_entries == 74_952, a.n_entries
        assert all(sorted(base["kept"][(i, "gate")]) == a.survivor_map().kept[i].tolist() for i in range(L))
        flat = np.random.default_rng(3).permutation(L * E_KEPT)
        prof = Profile(L, E_KEPT, np.stack([flat // E_KEPT, flat % E_KEPT], axis=1))
        sa, sb = a.survivor_map(), b.survivor_map()
        t_adiff, ad = timed(lambda: diff_allocations(a, b), args.repeat)
        t_pdiff, pd = timed(lambda: profile_vs_allocations(prof, sa, sb, slots_per_layer=39, alloc_old=a, alloc_new=b),
                            args.repeat)
        t_remap, _ = timed(lambda: remap_pruned_to_pruned(prof, sa, sb), args.repeat)

        def end_to_end():
            x, y = read_allocation(pa), read_allocation(pb)
            return profile_vs_allocations(prof, x.survivor_map(), y.survivor_map(), slots_per_layer=39,
                                          alloc_old=x, alloc_new=y)

        t_e2e, _ = timed(end_to_end, args.repeat)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"allocation: {L} layers x {E_FULL} -> {E_KEPT}, {a.n_entries} entries, {size / 1e6:.2f} MB (best of {args.repeat})")
    print(f"baseline naive per-line parser (no validation):  {t_base * 1e3:8.1f} ms")
    print(f"read_allocation (parse + validate):              {t_parse * 1e3:8.1f} ms   ratio {t_base / t_parse:5.2f}x vs baseline")
    print(f"diff_allocations (position + map):               {t_adiff * 1e3:8.1f} ms   ({ad.entries_changed} entries changed, "
          f"{ad.groups_changed} of {ad.groups_total} groups)")
    print(f"profile_vs_allocations (12,288 pairs, K=39):     {t_pdiff * 1e3:8.1f} ms   ({pd.still_same} pairs still same)")
    print(f"remap_pruned_to_pruned:                          {t_remap * 1e3:8.1f} ms")
    print(f"end to end: parse both + validate + diff:        {t_e2e * 1e3:8.1f} ms   ({'under' if t_e2e < 1 else 'OVER'} 1 s)")
    print(f"peak RSS: {rss:.0f} MiB")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
