"""Benchmark: reading text routing traces (the kit's per-entry CSV and llama.cpp's ``llama-moe-trace`` CSV).

Generates, in a temp folder (removed at the end; page cache warm: this measures parsing, not the disk), a
per-entry CSV of ``--entries`` routed entries (k = 8, 48 layers, 128 experts, ``phase`` column, as ``trace
convert --to csv`` writes it) and a llama-csv of the same routing. Then, per round (``--rounds``, medians
reported), in a fresh process for each checkout given with ``--src`` (default: this one):
  * ``read_kit_csv`` and ``read_llama_csv`` (the whole reader: parse, validation, table), CPU seconds;
  * the baseline measured in the same process: ``pandas.read_csv`` of the per-entry CSV with the reader's
    dtypes and nothing else (no validation), CPU seconds.
Prints entries/s and the ratio reader / baseline (the reader's cost over a bare parse; lower is better).
Given several ``--src`` folders (e.g. ``--src /path/to/old-checkout --src .``), the checkouts take turns within
every round, for a before/after on a busy machine.

    nice .venv/bin/python bench/bench_trace_csv.py [--entries 2000000] [--rounds 3] [--src DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np

L, E, K = 48, 128, 8

_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[3])  # the checkout to measure (python -c puts the current folder first otherwise)
import io, json, time
import pandas as pd
import stratatools
from stratatools.traces.formats.text import read_kit_csv, read_llama_csv
assert stratatools.__file__.startswith(sys.argv[3]), (stratatools.__file__, sys.argv[3])
kit, llama = sys.argv[1], sys.argv[2]
clk = time.process_time
read_kit_csv(kit.replace('.csv', '-small.csv'))  # warm-up: imports, lazy module loads
t = clk(); read_kit_csv(kit); kit_s = clk() - t
t = clk(); read_llama_csv(llama); llama_s = clk() - t
dt = {"model": str, "prompt_id": str, "token_pos": "int64", "layer": "int64", "rank": "int64",
      "expert_id": "int64", "weight": "float64", "phase": str}
t = clk()
with open(kit, encoding="utf-8") as fh:
    pd.read_csv(io.StringIO(fh.read()), dtype=dt, engine="c", keep_default_na=False, na_filter=False)
base_s = clk() - t
print(json.dumps({"kit_s": kit_s, "llama_s": llama_s, "base_s": base_s}))
"""


def generate(folder: str, n_entries: int, seed: int = 0) -> tuple[str, str]:
    """Write ``trace.csv`` (per-entry, with phase), ``trace-small.csv`` and ``trace.llama.csv`` into ``folder``."""
    from stratatools.traces.formats.text import write_csv
    from stratatools.traces.table import TraceTable

    rng = np.random.default_rng(seed)
    rec = max(n_entries // K, 1)
    lay = np.repeat(np.arange(rec) % L, K)
    pos = np.repeat(np.arange(rec) // L, K)
    ids = np.argsort(rng.random((rec, E), dtype=np.float32), axis=1)[:, :K].astype(np.int64)
    w = rng.random(rec * K).astype(np.float32)
    n = rec * K

    def table(m: int) -> TraceTable:
        return TraceTable(request=np.zeros(m, np.int32), position=pos[:m], phase=np.ones(m, np.int8),
                          layer=lay[:m], rank=np.tile(np.arange(K), m // K), expert=ids.ravel()[:m], weight=w[:m],
                          meta={"model_name": "qwen4exp-tiny", "request_names": ["prompt-0"]})

    kit = os.path.join(folder, "trace.csv")
    write_csv(table(n), kit)
    write_csv(table(K * 64), os.path.join(folder, "trace-small.csv"))
    llama = os.path.join(folder, "trace.llama.csv")
    rows = np.column_stack([pos[::K], lay[::K], ids])
    with open(llama, "w", encoding="ascii") as fh:
        for a in range(0, len(rows), 1 << 16):
            fh.write("\n".join(",".join(map(str, r)) for r in rows[a:a + (1 << 16)].tolist()) + "\n")
    return kit, llama


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=float, default=2e6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--src", action="append", default=None, help="a checkout whose stratatools to run (repeatable)")
    args = ap.parse_args()
    srcs = [os.path.abspath(s) for s in (args.src or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])]
    tmp = tempfile.mkdtemp(prefix="bench-trace-csv-")
    try:
        kit, llama = generate(tmp, int(args.entries))
        n = int(args.entries) // K * K
        print(f"entries {n:,}; per-entry CSV {os.path.getsize(kit) / 2**20:.1f} MiB, llama-csv "
              f"{os.path.getsize(llama) / 2**20:.1f} MiB")
        res: dict[str, list[dict]] = {s: [] for s in srcs}
        for _ in range(args.rounds):
            for s in srcs:
                out = subprocess.run([sys.executable, "-c", _CHILD, kit, llama, s], check=True, cwd=tmp,
                                     capture_output=True, text=True).stdout
                res[s].append(json.loads(out.strip().splitlines()[-1]))
        for s in srcs:
            med = {k: statistics.median(r[k] for r in res[s]) for k in ("kit_s", "llama_s", "base_s")}
            print(f"[{s}] csv reader {med['kit_s']:.3f} s ({n / med['kit_s'] / 1e6:.2f} M entries/s), "
                  f"bare pandas.read_csv {med['base_s']:.3f} s, ratio {med['kit_s'] / med['base_s']:.2f}; "
                  f"llama-csv reader {med['llama_s']:.3f} s ({n / med['llama_s'] / 1e6:.2f} M entries/s, "
                  f"{med['llama_s'] / med['base_s']:.2f} x the bare parse)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
