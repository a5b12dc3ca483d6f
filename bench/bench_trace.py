"""Benchmark: reading Strata --dump-routing traces and make-profile end to end.

Prints, for a generated trace of >= 50M routed entries (k = 10, 48 layers, 512 experts, skewed routing):
  * our reader (stratatools.traces.table.read_trace; alone, + all columns, + count_pairs) vs a per-record struct.unpack loop measured in the same run
    (the loop is timed on a prefix and extrapolated per entry; it only unpacks into Python lists, so the
    ratio is a lower bound of the real gap), entries/s, and peak RSS of a fresh reader process against the
    file size (absolute and above the process's pre-read baseline);
  * the same for a tagged v2 trace (verify windows of 4 positions with commit tags, request tags: k varies),
    read by the compiled record walker (trace_formats/strata_walk.py); each kind is timed in a fresh process
    (cold: the timed read includes importing numba and loading the walker's cached machine code, about 0.35 CPU s
    once per process) and in a warm process (a small trace of the same kind read first, untimed);
  * make-profile end to end (CLI in a fresh process) on 1e8 entries.
Files are generated in a temp dir (page cache warm: this measures parsing, not the disk) and deleted after.

    .venv/bin/python bench/bench_trace.py [--entries 100000000] [--keep DIR [--reuse]]

The reader returns the compact per-record table (plain traces: zero-copy views of the memory-mapped file); the
``columns`` rows add materialising all seven per-entry columns (the like-for-like of the [table] loop), the
``count`` rows add count_pairs (the like-for-like of the [strata] loop). Peak RSS counts the mapped file pages.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

from stratatools.core.fsutil import AtomicFile

L, E, K = 48, 512, 10


def _clock() -> float:
    """CPU seconds of this process (user + system): the machine is shared, so wall time is noisy; both the
    baseline loops and the reader are single-threaded and CPU-bound (the file is in the page cache)."""
    return time.process_time()


def gen_plain(path: str, n_entries: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    n_rec = n_entries // K
    pop = rng.zipf(1.3, size=(L, E)).astype(np.float64)
    logp = np.log(pop / pop.sum(axis=1, keepdims=True)).astype(np.float32)
    with AtomicFile(path) as fh:
        step = 1 << 15
        for a in range(0, n_rec, step):
            m = min(step, n_rec - a)
            lay = (np.arange(a, a + m) % L).astype(np.int32)
            # K distinct ids per record, drawn without replacement with the layer's popularity (Gumbel top-k)
            u = rng.random((m, E), dtype=np.float32)
            g = logp[lay] - np.log(-np.log(np.maximum(u, np.float32(1e-30))))
            ids = np.argpartition(-g, K - 1, axis=1)[:, :K].astype(np.int32)
            out = np.empty((m, 2 + 2 * K), "<i4")
            out[:, 0] = lay
            out[:, 1] = K
            out[:, 2:2 + K] = ids
            out[:, 2 + K:] = (rng.random((m, K), dtype=np.float32) / K).view("<i4")
            fh.write(out.tobytes())


def gen_tagged(path: str, plain: str, n_entries: int) -> None:
    """v2 tagged: format tag, a request tag every 256 windows, windows of 4 positions x 48 layers + commit."""
    per_win = 4 * L
    rec_bytes = 8 + 8 * K
    n_win = n_entries // K // per_win

    def tag(t, vals):
        return struct.pack(f"<ii{len(vals)}i{len(vals)}f", t, len(vals), *vals, *([0.0] * len(vals)))

    with open(plain, "rb") as src, AtomicFile(path) as fh:
        fh.write(tag(-2, [2]))
        for w in range(n_win):
            if w % 256 == 0:
                fh.write(tag(-3, [w // 256]))
            fh.write(src.read(per_win * rec_bytes))
            fh.write(tag(-1, [w, 4, 2, 1]))


def struct_loops(path: str, max_records: int) -> dict[str, tuple[float, int]]:
    """Per-record struct.unpack loops over the first max_records records, seconds and entries for each:

    * ``table``: builds the same columns as read_trace (layer, rank, expert, weight, position) -> numpy arrays;
      the like-for-like baseline of the ratio;
    * ``strata``: Strata tools/make_profile.py's loop (unpack, then count (layer, expert) in a dict);
    * ``unpack``: unpack ids and weights into two lists only (the cheapest possible loop).
    """
    from collections import defaultdict

    with open(path, "rb") as fh:
        blob = fh.read(max_records * (8 + 8 * K))
    unpack = struct.unpack_from
    out = {}

    t0 = _clock()
    off, n_ent = 0, 0
    layers, ranks, ids_all, w_all, pos, seen = [], [], [], [], [], defaultdict(int)
    while off + 8 <= len(blob):
        layer, k = unpack("<ii", blob, off)
        ids = unpack("<%di" % k, blob, off + 8)
        w = unpack("<%df" % k, blob, off + 8 + 4 * k)
        off += 8 + 8 * k
        if layer < 0:
            continue
        p = seen[layer]
        seen[layer] = p + 1
        layers.extend([layer] * k)
        ranks.extend(range(k))
        ids_all.extend(ids)
        w_all.extend(w)
        pos.extend([p] * k)
        n_ent += k
    cols = (np.array(layers, np.int16), np.array(ranks, np.int16), np.array(ids_all, np.int32),
            np.array(w_all, np.float32), np.array(pos, np.int32))
    out["table"] = (_clock() - t0, n_ent)
    del cols, layers, ranks, ids_all, w_all, pos

    t0 = _clock()
    off, n_ent, freq = 0, 0, defaultdict(int)
    while off + 8 <= len(blob):
        layer, k = unpack("<ii", blob, off)
        off += 8
        for e in unpack("<%di" % k, blob, off):
            if 0 <= layer < L and 0 <= e < E:
                freq[(layer, e)] += 1
        off += 8 * k
        n_ent += k
    out["strata"] = (_clock() - t0, n_ent)

    t0 = _clock()
    off, n_ent, ids_all, w_all = 0, 0, [], []
    while off + 8 <= len(blob):
        layer, k = unpack("<ii", blob, off)
        ids_all.extend(unpack("<%di" % k, blob, off + 8))
        w_all.extend(unpack("<%df" % k, blob, off + 8 + 4 * k))
        off += 8 + 8 * k
        n_ent += k
    out["unpack"] = (_clock() - t0, n_ent)
    return out


READER = r"""
import json, sys, time
from stratatools.traces.table import COLUMNS
from stratatools.traces.formats import read_trace

def hwm():  # peak RSS of this process (VmHWM; ru_maxrss would carry the parent's peak across exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

setup = None
if len(sys.argv) > 4:  # warm: read a small trace of the same kind first (imports, compiled walker loaded)
    s0 = time.process_time()
    read_trace(sys.argv[4], sha256=False)
    setup = time.process_time() - s0
base = hwm()
t0, w0 = time.process_time(), time.perf_counter()
t = read_trace(sys.argv[1], sha256=sys.argv[2] == "1")
if sys.argv[3] == "columns":  # every per-entry column materialised (what the [table] loop builds)
    for name in COLUMNS:
        getattr(t, name)
elif sys.argv[3] == "count":  # read + count (layer, expert) pairs (what the [strata] loop does)
    from stratatools.profiles.ranking import count_pairs
    c = count_pairs([t], 48, 512)
dt, wall = time.process_time() - t0, time.perf_counter() - w0
print(json.dumps({"s": dt, "wall": wall, "entries": len(t), "peak": hwm(), "base": base,
                  "fmt": t.meta["source_format"], "compact": t.records is not None, "setup": setup}))
"""

# what each reader mode is compared with: read = the table in its compact form (columns built on demand)
MODES = {"read": "read_trace", "columns": "read_trace + all 7 columns materialised",
         "count": "read_trace + count_pairs"}


def run_reader(path: str, sha256: bool, mode: str = "read", warm: str | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", READER, path, "1" if sha256 else "0", mode] + ([warm] if warm else []),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def rss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=100_000_000)
    ap.add_argument("--loop-records", type=int, default=300_000)
    ap.add_argument("--keep", default=None)
    ap.add_argument("--reuse", action="store_true", help="with --keep: reuse the files generated there before")
    a = ap.parse_args()
    d = a.keep or tempfile.mkdtemp(prefix="bench_trace_")
    try:
        plain = os.path.join(d, "plain.bin")
        tagged = os.path.join(d, "tagged.bin")
        t0 = time.perf_counter()
        if not (a.reuse and os.path.exists(plain) and os.path.getsize(plain) == a.entries // K * (8 + 8 * K)
                and os.path.exists(tagged)):
            gen_plain(plain, a.entries)
            gen_tagged(tagged, plain, a.entries)
        print(f"generated {a.entries:,} entries: plain {os.path.getsize(plain) / 2**20:,.0f} MiB, tagged "
              f"{os.path.getsize(tagged) / 2**20:,.0f} MiB in {time.perf_counter() - t0:.1f} s")
        loops = struct_loops(plain, a.loop_records)
        per_entry = {name: sec / n for name, (sec, n) in loops.items()}
        for name, (sec, n) in loops.items():
            print(f"baseline struct loop [{name}]: {n:,} entries in {sec:.2f} CPU s = {n / sec / 1e6:.2f} M entries/s "
                  f"(first {a.loop_records:,} records; extrapolated per entry below)")
        # small traces of both kinds: an untimed read first writes numba's cache of the tagged walker (a fresh
        # checkout compiles it once), later they warm up the "warm" rows
        small_plain, small_tagged = os.path.join(d, "small_plain.bin"), os.path.join(d, "small_tagged.bin")
        gen_plain(small_plain, 20 * K * 4 * L)
        gen_tagged(small_tagged, small_plain, 20 * K * 4 * L)
        t0 = time.perf_counter()
        run_reader(small_tagged, False)
        print(f"untimed warm-up read of a small tagged trace (writes numba's cache on a first run): "
              f"{time.perf_counter() - t0:.2f} s wall")
        for name, p in (("plain", plain), ("tagged v2", tagged)):
            size = os.path.getsize(p)
            small = small_plain if p == plain else small_tagged
            for mode, sha, warm in (("read", False, None), ("read", True, None), ("read", False, small),
                                    ("read", True, small), ("columns", False, None), ("count", False, None)):
                r = run_reader(p, sha, mode, warm)
                if warm:
                    print(f"  [warm: the process read a small {name} trace first, untimed: imports and the "
                          f"compiled walker's set-up took {r['setup']:.2f} CPU s]")
                ratios = ", ".join(f"{per_entry[k] * r['entries'] / r['s']:.0f}x vs [{k}]" for k in per_entry)
                print(f"{MODES[mode]} {name} ({r['fmt']}, {'warm' if warm else 'fresh'} process, "
                      f"sha256 {'on' if sha else 'off'}, "
                      f"{'compact' if r['compact'] else 'columns'}): {r['entries']:,} entries in "
                      f"{r['s']:.2f} CPU s ({r['wall']:.2f} s wall) = {r['entries'] / r['s'] / 1e6:.1f} M entries/s; "
                      f"{ratios}; peak RSS "
                      f"{r['peak'] / 2**20:,.0f} MiB = {r['peak'] / size:.2f}x the {size / 2**20:,.0f} MiB file "
                      f"({(r['peak'] - r['base']) / size:.2f}x above the {r['base'] / 2**20:.0f} MiB baseline)")
        prof = os.path.join(d, "p.bin")
        t0 = time.perf_counter()
        cmd = [sys.executable, "-c", "from stratatools.cli import main; main()", "--quiet", "make-profile", plain, "-o", prof,
               "--n-layer", str(L), "--n-expert", str(E), "--mode", "no-base", "--json", "--force"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if out.returncode != 0:
            print(out.stderr)
            raise SystemExit(1)
        used = json.loads(out.stdout)["used_entries"]
        print(f"make-profile end to end (fresh process, wall time, incl. sha256 of the input and the sidecar): "
              f"{used:,} entries in {dt:.1f} s = {used / dt / 1e6:.1f} M entries/s")
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
