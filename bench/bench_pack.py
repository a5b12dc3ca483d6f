"""Pack throughput vs ``cp``, and peak RSS, on a generated model of at least 2 GB.

Steps (all in one temp folder, removed at the end):
1. ``synth`` a full-width model (hidden 2560, expert width 640, 512 experts, Q2_0 / IQ2_XS / IQ4_NL experts,
   random valid blocks) with enough layers for >= 2 GB; report its write speed.
2. Per round (``--rounds``, default 5; medians reported): ``cp`` of a file holding the same number of bytes as
   experts.bin (the model cut to that size), then ``stratatools pack MODEL -o PACK --experts-bin`` in a subprocess
   three ways: a first pack with an empty digest cache (it sha256-hashes the model for the provenance sidecar),
   a re-pack (the digest cache has the model's sha256), and ``--no-hash``. Page cache of the inputs dropped
   before each run; wall time and peak RSS of each child (``os.wait4`` rusage).

Prints the ratios cp time / pack time (throughput; target >= 0.7) and the peak RSS (target < 300 MB).

Usage: ``python bench/bench_pack.py [--gb 2.0] [--rounds 5] [--model M] [--src CHECKOUT] [--keep]``
"""

from __future__ import annotations

import argparse
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

from stratatools.synth.model import SynthConfig, estimate_bytes, synth_release  # noqa: E402


def run_child(args: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run a command; (wall seconds, peak RSS of that child in KiB, from wait4's rusage)."""
    t = time.perf_counter()
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, env=env, cwd=tempfile.gettempdir())
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{args[0]} ... exited with {p.returncode}")
    return dt, ru.ru_maxrss


def drop_cache_hint(path: Path) -> None:
    """Ask the kernel to forget a file's cached pages (best effort) so both copies read the same way."""
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    except (OSError, AttributeError):
        pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0, help="minimum model size in GB (1e9 bytes)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (cp and every pack variant each); medians reported")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder")
    ap.add_argument("--dir", default=None, help="parent folder for the temp files")
    ap.add_argument("--model", default=None, help="use this existing model instead of synthesizing one")
    ap.add_argument("--src", default=str(ROOT), help="folder holding the stratatools package to run (to compare "
                    "another checkout in the same conditions) [this repository]")
    ap.add_argument("--baseline-src", default=None, help="also run this checkout's pack (first run and re-pack) in "
                    "every round, interleaved, for a before/after comparison under the same load")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-pack-", dir=a.dir))
    try:
        if a.model:
            model = Path(a.model)
            print(f"model: {model} ({model.stat().st_size / 1e9:.2f} GB)")
        else:
            layers = 2
            while estimate_bytes(SynthConfig.full_width(n_layers=layers)) < a.gb * 1e9:
                layers += 1
            rel = synth_release(tmp / "model", SynthConfig.full_width(n_layers=layers))
            model = rel.canonical
            print(f"model: {model.name}, {layers} layers, {model.stat().st_size / 1e9:.2f} GB; synth wrote it at "
                  f"{rel.write_mib_s:.0f} MiB/s ({rel.canonical_seconds:.1f} s)")

        env = dict(os.environ, PYTHONPATH=str(Path(a.src).resolve()))
        exe = [sys.executable, "-c", "from stratatools.cli import main; main()"]
        where = subprocess.run([sys.executable, "-c", "import stratatools; print(stratatools.__file__)"], env=env, cwd=tmp,
                               check=True, capture_output=True, text=True).stdout.strip()
        print(f"packing with {where}")
        from stratatools.model.gguf import open_model
        from stratatools.pack.native import plan_pack
        with open_model(model) as m:
            total = plan_pack(m).total_bytes
        # the cp baseline copies the same number of bytes: the model cut to the experts.bin size
        src = tmp / "cp-src.bin"
        with open(model, "rb") as fi, open(src, "wb") as fo:
            left = total
            while left:
                b = fi.read(min(left, 16 << 20))
                fo.write(b)
                left -= len(b)
        os.sync()
        pack = exe + ["--quiet", "pack", str(model), "-o", str(tmp / "pack"), "--experts-bin", "--force"]

        def one_pack(extra: list[str], cache: Path, src_dir: str | None = None) -> tuple[float, int]:
            drop_cache_hint(model)
            e = dict(env, XDG_CACHE_HOME=str(cache))
            if src_dir:
                e["PYTHONPATH"] = str(Path(src_dir).resolve())
            r = run_child(pack + extra, e)
            # a rerun would reuse experts.bin: remove it so every run copies
            (tmp / "pack" / "experts.bin").unlink()
            (tmp / "pack" / "experts.bin.src.json").unlink()
            os.sync()  # the next run starts without this run's dirty pages
            return r

        times: dict[str, list[float]] = {}
        rss: dict[str, int] = {}
        for rnd in range(a.rounds):
            drop_cache_hint(src)
            t_cp, rss["cp"] = run_child(["cp", str(src), str(tmp / "cp-dst.bin")])
            t0 = time.perf_counter()
            os.sync()
            t_sync = time.perf_counter() - t0
            (tmp / "cp-dst.bin").unlink()
            os.sync()
            cache = tmp / f"xdg-cache-{rnd}"  # empty: the model has never been hashed (a first pack)
            t_cold, rss["cold"] = one_pack([], cache)
            t_warm, rss["warm"] = one_pack([], cache)  # the digest cache now knows the model (a re-pack)
            t_nohash, rss["nohash"] = one_pack(["--no-hash"], cache)
            row = [("cp", t_cp), ("cp_sync", t_cp + t_sync), ("cold", t_cold), ("warm", t_warm), ("nohash", t_nohash)]
            if a.baseline_src:
                bcache = tmp / f"xdg-baseline-{rnd}"
                t_bc, rss["base_cold"] = one_pack([], bcache, a.baseline_src)
                t_bw, rss["base_warm"] = one_pack([], bcache, a.baseline_src)
                row += [("base_cold", t_bc), ("base_warm", t_bw)]
            for k, v in row:
                times.setdefault(k, []).append(v)
            print(f"round {rnd + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in row)
                  + f"; load {os.getloadavg()[0]:.1f}", flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios = {k: [c / p for c, p in zip(times["cp"], times[k])] for k in times if k not in ("cp", "cp_sync")}
        gbs = lambda s: total / s / 1e9  # noqa: E731
        print(f"experts.bin bytes: {total:,} ({total / 1e9:.2f} GB); medians of {a.rounds} rounds")
        print(f"cp:                          {gbs(med['cp']):.2f} GB/s")
        print(f"cp + sync:                   {gbs(med['cp_sync']):.2f} GB/s")
        names = {"cold": "pack, first run (sha256)", "warm": "pack, re-pack (digest cache)",
                 "nohash": "pack --no-hash", "base_cold": "baseline pack, first run", "base_warm":
                 "baseline pack, second run"}
        names = {k: v for k, v in names.items() if k in times}
        for k, name in names.items():
            vs_sync = statistics.median(c / p for c, p in zip(times["cp_sync"], times[k]))
            print(f"{name:28s} {gbs(med[k]):.2f} GB/s  ratio to cp: median {statistics.median(ratios[k]):.2f}x "
                  f"(per round {', '.join(f'{r:.2f}' for r in ratios[k])}), to cp+sync {vs_sync:.2f}x; "
                  f"peak RSS {rss[k] / 1024:.0f} MB")
        print("target: ratio >= 0.7, peak RSS < 300 MB (pack times include process start, planning, fsync)")
    finally:
        if a.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
