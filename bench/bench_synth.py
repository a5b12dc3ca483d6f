"""``stratatools synth`` write speed (the whole command) vs ``dd conv=fsync`` of the same size, and peak RSS.

Steps (one temp folder, removed at the end). First an untimed warm-up synth of a tiny model, so Python has
compiled the package's bytecode (into a cache under the temp folder, ``PYTHONPYCACHEPREFIX``), as it has for any
installed program; ``--no-bytecode`` runs every round with ``PYTHONDONTWRITEBYTECODE=1`` instead (every module is
compiled from source on every start, which an editable checkout with that variable set pays). Then per round
(``--rounds``, default 3; medians reported):
1. ``stratatools synth`` in a subprocess: a reduced-width model (NOT ``--full-width``: hidden 1024, expert width
   256, 128 experts, the default types, default realistic routing, no revisions) with enough layers for
   ``--mib`` MiB; wall time of the whole process (start-up, imports, tokenizer, write, fsync, exit), the
   in-process write speed it reports (``canonical_write_mib_s``) and the child's peak RSS (``os.wait4``).
2. ``dd if=/dev/zero bs=1M conv=fsync`` of the same number of bytes into the same folder: the disk's speed now.

Prints MiB/s of both, the ratio synth / dd (1.0 = disk speed) and the peak RSS. Targets: >= 200 MiB/s for the
whole command and a peak RSS that does not grow with the model (compare ``--mib 256`` and ``--mib 1024``).
Run it ``nice``d on a shared machine.

Usage: ``python bench/bench_synth.py [--mib 512] [--rounds 3] [--no-bytecode] [--src DIR ...] [--keep]``
(``--src`` runs the ``stratatools`` package found in DIR, e.g. another checkout; given several times, the
checkouts take turns within every round, each next to its own dd, for a before/after on a busy machine.)
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


def run_child(args: list[str], out: Path, env: dict[str, str]) -> tuple[float, int]:
    """Run a command with stdout to ``out``; (wall seconds, peak RSS of that child in KiB)."""
    t = time.perf_counter()
    with open(out, "wb") as fh:  # the child's stdout log in the bench's own scratch folder, not an output
        p = subprocess.Popen(args, stdout=fh, cwd=tempfile.gettempdir(), env=env)
        _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t
    if status != 0:
        raise SystemExit(f"{' '.join(args)} failed (status {status})")
    return dt, ru.ru_maxrss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=512.0, help="model size to write (MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-bytecode", action="store_true", help="PYTHONDONTWRITEBYTECODE=1 (compile on every start)")
    ap.add_argument("--src", type=Path, action="append", help="folder holding the stratatools package to run "
                    "(repeatable; default: this checkout)")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder")
    a = ap.parse_args()
    srcs = [p.resolve() for p in (a.src or [ROOT])]
    per_layer = estimate_bytes(SynthConfig(n_layers=8, **SHAPE)) // 8
    layers = max(1, int(a.mib * (1 << 20) // per_layer))
    tmp = Path(tempfile.mkdtemp(prefix="bench-synth-"))
    exe = [sys.executable, "-m", "stratatools"]
    envs = []
    for i, src in enumerate(srcs):
        env = dict(os.environ, PYTHONPATH=str(src))
        if a.no_bytecode:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        else:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(tmp / f"pycache{i}")
        envs.append(env)
    rows: dict[int, list] = {i: [] for i in range(len(srcs))}
    try:
        for env in envs:
            run_child(exe + ["synth", str(tmp / "warm"), "--layers", "2", "--no-revisions", "--json"], tmp / "out.json",
                      env)
            shutil.rmtree(tmp / "warm")
        for r in range(a.rounds):
            for i, env in enumerate(envs):
                out = tmp / f"r{r}"
                dt, rss = run_child(exe + ["synth", str(out), "--layers", str(layers), "--hidden", "1024",
                                           "--expert-ff", "256", "--experts", "128", "--no-revisions", "--json"],
                                    tmp / "out.json", env)
                inproc = json.loads((tmp / "out.json").read_text())["canonical_write_mib_s"]
                size = (out / "synth-canonical.gguf").stat().st_size
                shutil.rmtree(out)
                t = time.perf_counter()
                subprocess.run(["dd", "if=/dev/zero", f"of={tmp / 'dd.bin'}", "bs=1M",
                                f"count={-(-size // (1 << 20))}", "conv=fsync", "status=none"], check=True)
                ddt = time.perf_counter() - t
                os.unlink(tmp / "dd.bin")
                rows[i].append((size, dt, ddt, rss, inproc))
                tag = f" [{srcs[i]}]" if len(srcs) > 1 else ""
                print(f"round {r + 1}{tag}: synth {size / dt / 2**20:.0f} MiB/s ({inproc:.0f} MiB/s in-process), "
                      f"dd {size / ddt / 2**20:.0f} MiB/s, peak RSS {rss / 1024:.0f} MiB", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    for i, src in enumerate(srcs):
        rs = rows[i]
        size = rs[0][0]
        ds = statistics.median(x[1] for x in rs)
        dd = statistics.median(x[2] for x in rs)
        rss = max(x[3] for x in rs)
        inproc = statistics.median(x[4] for x in rs)
        mib = size / 2**20
        print(f"model {mib:.0f} MiB ({layers} layers, hidden 1024, 128 experts, not --full-width); "
              f"{'no bytecode cache' if a.no_bytecode else 'bytecode cached'}; package {src}")
        print(f"synth {mib / ds:.0f} MiB/s (whole command, median of {len(rs)}); dd conv=fsync {mib / dd:.0f} MiB/s; "
              f"ratio synth/dd {dd / ds:.2f}; in-process {inproc:.0f} MiB/s (ratio {inproc * dd / mib:.2f}); "
              f"start-up and exit {ds - mib / inproc:.2f} s; peak RSS {rss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
