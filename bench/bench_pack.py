"""Pack throughput vs ``cp``, and peak RSS, on a generated model of at least 2 GB.

Steps (all in one temp folder, removed at the end):
1. ``synth`` a full-width model (hidden 2560, expert width 640, 512 experts, Q2_0 / IQ2_XS / IQ4_NL experts,
   random valid blocks) with enough layers for >= 2 GB; report its write speed.
2. ``stratatools pack MODEL -o PACK --experts-bin`` in a subprocess; wall time and peak RSS of that child
   (``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``).
3. ``cp`` of a file holding the same number of bytes as experts.bin (the model file cut to that size), in the same
   run, and ``cp`` + ``sync`` (the pack fsyncs experts.bin before publishing it).

Prints the ratios pack / cp (throughput; target >= 0.7) and the peak RSS (target < 300 MB).

Usage: ``python bench/bench_pack.py [--gb 2.0] [--keep]``
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stratatools.synth import SynthConfig, estimate_bytes, synth_release  # noqa: E402


def run_child(args: list[str]) -> tuple[float, int]:
    """Run a command; (wall seconds, peak RSS of all children so far in KiB)."""
    t = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    dt = time.perf_counter() - t
    return dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss


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
    ap.add_argument("--keep", action="store_true", help="keep the temp folder")
    ap.add_argument("--dir", default=None, help="parent folder for the temp files")
    a = ap.parse_args()

    layers = 2
    while estimate_bytes(SynthConfig.full_width(n_layers=layers)) < a.gb * 1e9:
        layers += 1
    cfg = SynthConfig.full_width(n_layers=layers)
    tmp = Path(tempfile.mkdtemp(prefix="bench-pack-", dir=a.dir))
    try:
        rel = synth_release(tmp / "model", cfg)
        model = rel.canonical
        size = model.stat().st_size
        print(f"model: {model.name}, {layers} layers, {size / 1e9:.2f} GB; synth wrote it at "
              f"{rel.write_mib_s:.0f} MiB/s ({rel.canonical_seconds:.1f} s)")

        exe = [sys.executable, "-m", "stratatools.cli.__main__"] if (ROOT / "stratatools/cli/__main__.py").exists() \
            else [sys.executable, "-c", "from stratatools.cli import main; main()"]
        # baseline first: cp of the same number of bytes (the model cut to the experts.bin size)
        from stratatools.gguf import open_model
        from stratatools.pack import plan_pack
        with open_model(model) as m:
            total = plan_pack(m).total_bytes
        src = tmp / "cp-src.bin"
        with open(model, "rb") as fi, open(src, "wb") as fo:
            left = total
            while left:
                b = fi.read(min(left, 16 << 20))
                fo.write(b)
                left -= len(b)
        os.sync()
        res = {}
        for rnd in range(2):  # two rounds, alternating, best of each
            drop_cache_hint(src)
            t_cp, _ = run_child(["cp", str(src), str(tmp / "cp-dst.bin")])
            t0 = time.perf_counter()
            os.sync()
            t_sync = time.perf_counter() - t0
            (tmp / "cp-dst.bin").unlink()
            drop_cache_hint(model)
            t_pack, rss = run_child(exe + ["--quiet", "pack", str(model), "-o", str(tmp / "pack"), "--experts-bin",
                                           "--force"])
            # a rerun would reuse experts.bin: remove it so every round copies
            (tmp / "pack" / "experts.bin").unlink()
            (tmp / "pack" / "experts.bin.src.json").unlink()
            drop_cache_hint(model)
            t_nohash, rss = run_child(exe + ["--quiet", "pack", str(model), "-o", str(tmp / "pack"), "--experts-bin",
                                             "--force", "--no-hash"])
            (tmp / "pack" / "experts.bin").unlink()
            (tmp / "pack" / "experts.bin.src.json").unlink()
            for k, v in (("cp", t_cp), ("cp_sync", t_cp + t_sync), ("pack", t_pack), ("nohash", t_nohash)):
                res[k] = min(res.get(k, v), v)
            print(f"round {rnd + 1}: cp {t_cp:.2f} s (+sync {t_sync:.2f} s), pack --experts-bin {t_pack:.2f} s, "
                  f"with --no-hash {t_nohash:.2f} s")
        peak_mb = rss / 1024  # ru_maxrss is KiB on Linux; the largest child (cp is tiny) is the pack
        gbs = lambda s: total / s / 1e9  # noqa: E731
        print(f"experts.bin bytes: {total:,} ({total / 1e9:.2f} GB)")
        print(f"cp:          {gbs(res['cp']):.2f} GB/s")
        print(f"cp + sync:   {gbs(res['cp_sync']):.2f} GB/s")
        print(f"pack:        {gbs(res['pack']):.2f} GB/s (includes model sha256 for provenance, fsync, process start)")
        print(f"pack --no-hash: {gbs(res['nohash']):.2f} GB/s")
        print(f"ratio pack/cp        = {res['cp'] / res['pack']:.2f}x  (target >= 0.7; sha256 of the whole model "
              f"for provenance included)")
        print(f"ratio pack --no-hash/cp = {res['cp'] / res['nohash']:.2f}x")
        print(f"ratio pack/(cp+sync) = {res['cp_sync'] / res['pack']:.2f}x")
        print(f"peak RSS of pack: {peak_mb:.0f} MB  (target < 300 MB)")
    finally:
        if a.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
