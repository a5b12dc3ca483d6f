"""``stratatools synth`` write speed vs ``cp`` of a file of the same size, and peak RSS.

Steps (one temp folder, removed at the end); per round (``--rounds``, default 3; medians reported):
1. ``stratatools synth`` in a subprocess: a reduced-width model (NOT ``--full-width``: hidden 1024, expert width
   256, 128 experts, the default types, default realistic routing, no revisions) with enough layers for
   ``--mib`` MiB; wall time and the child's peak RSS (``os.wait4`` rusage).
2. ``cp`` of a file holding the same number of bytes (the written model), to a new file in the same folder.

Prints MiB/s of both, the ratio synth / cp (1.0 = disk speed) and the peak RSS. Targets: >= 200 MiB/s and a
peak RSS that does not grow with the model (compare ``--mib 256`` and ``--mib 1024``).

Usage: ``python bench/bench_synth.py [--mib 512] [--rounds 3] [--keep]``
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stratatools.synth.model import SynthConfig, estimate_bytes  # noqa: E402

SHAPE = dict(hidden=1024, expert_ff=256, n_expert=128, shared_ff=256, revisions=False)


def run_child(args: list[str], out: Path) -> tuple[float, int]:
    """Run a command with stdout to ``out``; (wall seconds, peak RSS of that child in KiB)."""
    t = time.perf_counter()
    with open(out, "wb") as fh:
        p = subprocess.Popen(args, stdout=fh, cwd=tempfile.gettempdir())
        _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t
    if status != 0:
        raise SystemExit(f"{' '.join(args)} failed (status {status})")
    return dt, ru.ru_maxrss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=512.0, help="model size to write (MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the temp folder")
    a = ap.parse_args()
    per_layer = estimate_bytes(SynthConfig(n_layers=8, **SHAPE)) // 8
    layers = max(1, int(a.mib * (1 << 20) // per_layer))
    tmp = Path(tempfile.mkdtemp(prefix="bench-synth-"))
    exe = [sys.executable, "-m", "stratatools"]
    rows = []
    try:
        for r in range(a.rounds):
            out = tmp / f"r{r}"
            dt, rss = run_child(exe + ["synth", str(out), "--layers", str(layers), "--hidden", "1024", "--expert-ff",
                                       "256", "--experts", "128", "--no-revisions", "--json"], tmp / "out.json")
            inproc = json.loads((tmp / "out.json").read_text())["canonical_write_mib_s"]
            model = out / "synth-canonical.gguf"
            size = model.stat().st_size
            t = time.perf_counter()
            subprocess.run(["cp", str(model), str(tmp / "copy.bin")], check=True)
            with open(tmp / "copy.bin", "rb+") as fh:
                os.fsync(fh.fileno())
            dcp = time.perf_counter() - t
            os.unlink(tmp / "copy.bin")
            shutil.rmtree(out)
            rows.append((size, dt, dcp, rss, inproc))
            print(f"round {r + 1}: synth {size / dt / 2**20:.0f} MiB/s ({inproc:.0f} MiB/s without start-up), "
                  f"cp {size / dcp / 2**20:.0f} MiB/s, "
                  f"peak RSS {rss / 1024:.0f} MiB", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    size = rows[0][0]
    ds = statistics.median(x[1] for x in rows)
    dc = statistics.median(x[2] for x in rows)
    rss = max(x[3] for x in rows)
    inproc = statistics.median(x[4] for x in rows)
    print(f"model {size / 2**20:.0f} MiB ({layers} layers, hidden 1024, 128 experts, not --full-width)")
    print(f"synth {size / ds / 2**20:.0f} MiB/s (process wall time, start-up included); cp {size / dc / 2**20:.0f} MiB/s; "
          f"ratio synth/cp {dc / ds:.2f}; without process start-up {inproc:.0f} MiB/s (ratio {inproc * dc / (size / 2**20):.2f}); "
          f"peak RSS {rss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
