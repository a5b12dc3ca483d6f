"""Benchmark: traces of any size. Generates a tagged Strata trace and a hive-partitioned Parquet dataset of N
routed entries (48 layers x 128 experts, k = 8 distinct ids per record, requests of 256 decode tokens, skewed
routing), then runs the CLI on them, each command in its own process, and prints its wall time, peak RSS
(``os.wait4``'s ru_maxrss of that process) and entries/s:

* ``simulate`` with static, adaptive, LRU and Belady and ``--kfold 5`` (``--no-sweep``), on the tagged trace;
* ``make-profile`` and ``trace stats`` from the tagged trace and from the Parquet dataset.

Throughput per online policy = entries x online policy runs (static, adaptive and LRU at the budget, plus the
k-fold's 2 x (k + 1) static/adaptive replays) / wall time of the whole command; the baseline measured in the same
run is ``trace stats`` on the same trace (one read of every entry), and the ratio says how many online replays
cost one read. Memory at each size is printed side by side (flat = independent of the trace length).

Targets (issue 13): simulate at 1e9 with --kfold 5 < 4 GB peak RSS and >= 20M entries/s per online policy;
make-profile / trace stats from 1e9 tagged and Parquet < 2 GB.

Usage: ``nice python bench/bench_trace_scale.py --sizes 1e7,1e8 --dir /tmp/bench-traces`` (files are kept
between runs of the same size; ``--keep`` leaves them after the run).

Last measured (2026-12-01, shared 2-core machine, load average 4-6; the full table is in docs/fleet-traces.md):
simulate static/adaptive/LRU without k-fold 30.5M entries/s per online policy at 1e8 (37.1M per CPU s; 2.18x the
baseline), 21.9M/s at 1e9 (38.8M per CPU s; wall figures move with the load: 14.7M/s and 19.0M/s in busier runs);
peak RSS 0.41 / 0.50 / 0.65 GB at 1e7 / 1e8 / 1e9; with Belady and --kfold 5 39.2M/s at 1e8, 0.68 GB. With
distinct ids per record (the generator since; readers refuse repeats) 1e8: 22.2M/s per online policy, 0.42 GB;
--kfold 5 37.7M/s, 0.62 GB. make-profile / trace stats from a 1e9
Parquet dataset 0.58 / 0.57 GB, from a 1e9 tagged trace 0.37 / 0.40 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from stratatools.core.fsutil import AtomicFile, publish_dir

L, E, K, TOKENS = 48, 128, 8, 256


def _rank_logp() -> np.ndarray:
    """log-probability of popularity rank r (float64 [E]): ``min(floor(6 X), E-1)`` for X ~ Lomax(1.2) (numpy's
    ``pareto``), i.e. P(rank >= r) = (1 + r/6)^-1.2."""
    r = np.arange(E + 1, dtype=np.float64)
    surv = (1.0 + r / 6.0) ** -1.2
    p = surv[:-1] - surv[1:]
    p[-1] = surv[E - 1]
    return np.log(p)


def _records(rng, n_tok: int, pref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token-major records of one request: layers [n_tok*L], ids [n_tok*L, K] (skewed: Zipf-like ranks mapped
    through a per-layer permutation). The K ranks of a record are distinct, drawn without replacement with the
    rank weights of :func:`_rank_logp` (Gumbel top-k: the K largest ``log p + Gumbel noise``), as a router's
    top-k are K different experts."""
    lay = np.tile(np.arange(L, dtype=np.int32), n_tok)
    g = _rank_logp()[None, :] + rng.gumbel(size=(n_tok * L, E))
    r = np.argpartition(-g, K - 1, axis=1)[:, :K]
    ids = pref[lay[:, None], r].astype(np.int32)
    return lay, ids


def write_tagged(path: Path, n_entries: int, seed: int = 0) -> None:
    """A tagged (v1) Strata trace: format tag, then per request a request tag and TOKENS x L records of k ids."""
    rng = np.random.default_rng(seed)
    pref = np.stack([rng.permutation(E) for _ in range(L)])
    per_req = TOKENS * L * K
    n_req = max(1, n_entries // per_req)
    with AtomicFile(path) as fh:
        fh.write(np.array([-2, 1, 1, 0], "<i4").tobytes())  # format tag, version 1
        for q in range(n_req):
            fh.write(np.array([-3, 1, q, 0], "<i4").tobytes())  # request tag
            lay, ids = _records(rng, TOKENS, pref)
            rec = np.empty((len(lay), 2 + 2 * K), "<i4")
            rec[:, 0], rec[:, 1] = lay, K
            rec[:, 2:2 + K] = ids
            rec[:, 2 + K:] = np.float32(1.0 / K).view(np.int32)
            fh.write(rec.tobytes())


def write_dataset(root: Path, n_entries: int, servers: int = 4, seed: int = 1) -> None:
    """A hive-partitioned Parquet dataset ``server=sN/date=2026-12-01/part-0.parquet`` of about n_entries,
    published whole (:func:`stratatools.core.fsutil.publish_dir`)."""
    from stratatools.traces.formats.parquet import _schema

    rng = np.random.default_rng(seed)
    pref = np.stack([rng.permutation(E) for _ in range(L)])
    schema = _schema({"n_layers": L, "n_expert": E, "source_format": "bench"})
    per_req = TOKENS * L * K
    n_req = max(servers, n_entries // per_req)
    with publish_dir(root) as tmp:
        _write_servers(tmp, servers, n_req, per_req, rng, pref, schema)


def _write_servers(tmp: Path, servers: int, n_req: int, per_req: int, rng, pref, schema) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stratatools.traces.formats.parquet import COLUMNS

    for s in range(servers):
        d = tmp / f"server=s{s}" / "date=2026-12-01"
        d.mkdir(parents=True)
        with pq.ParquetWriter(d / "part-0.parquet", schema, compression="zstd") as w:
            reqs = range(s, n_req, servers)
            batch = max(1, (1 << 23) // per_req)
            for a in range(0, len(reqs), batch):
                qs = list(reqs[a:a + batch])
                lays, idss = zip(*(_records(rng, TOKENS, pref) for _ in qs))
                lay = np.repeat(np.concatenate(lays), K)
                ids = np.concatenate(idss).reshape(-1)
                n = len(ids)
                pos = np.repeat(np.tile(np.repeat(np.arange(TOKENS), L), len(qs)), K)
                cols = {"request": np.repeat(np.array(qs), TOKENS * L * K), "position": pos,
                        "phase": np.ones(n), "layer": lay, "rank": np.tile(np.arange(K), n // K), "expert": ids,
                        "weight": np.full(n, 1.0 / K)}
                w.write_table(pa.Table.from_arrays(
                    [pa.array(np.asarray(cols[c], dtype=dt)) for c, dt in COLUMNS.items()], schema=schema))


TIME = "/usr/bin/time"


def _tree_hwm(pid: int) -> int:
    """Largest VmHWM (bytes) among ``pid`` and its descendants (Linux /proc; 0 elsewhere)."""
    best, todo = 0, [pid]
    while todo:
        q = todo.pop()
        try:
            with open(f"/proc/{q}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        best = max(best, int(line.split()[1]) * 1024)
            with open(f"/proc/{q}/task/{q}/children") as fh:
                todo += [int(x) for x in fh.read().split()]
        except (OSError, ValueError):
            pass
    return best


def run(args: list[str], timeout: float) -> dict:
    """Run ``stratatools ARGS`` in a child process; wall s, peak RSS bytes of that command, exit code.

    The peak comes from GNU time's %M when /usr/bin/time exists (a fresh process forks the command, so its
    ru_maxrss is the command's own); else from ``os.wait4`` (Linux then counts this bench process's resident
    memory at the fork as a floor)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "stratatools", "--quiet", *args]
    use_time = os.path.exists(TIME)
    if use_time:
        cmd = [TIME, "-f", "MAXRSS_KB %M %U %S", *cmd]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = t0 + timeout
    hwm = 0  # peak resident memory of the command's processes seen so far (VmHWM; for a command cut off)
    last = 0.0
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        now = time.perf_counter()
        if now - last > 1.0:
            hwm = max(hwm, _tree_hwm(p.pid))
            last = now
        if now > deadline:
            os.killpg(p.pid, 9)
            os.wait4(p.pid, 0)
            return {"wall_s": timeout, "cpu_s": 0.0, "rss_bytes": hwm, "rc": "timeout", "out": "",
                    "err": ["cut off at the time limit; rss_bytes is the peak seen until then"]}
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    out = p.stdout.read().decode(errors="replace")
    err = p.stderr.read().decode(errors="replace")
    rss = ru.ru_maxrss * 1024
    cpu = ru.ru_utime + ru.ru_stime
    lines = err.strip().splitlines()
    if use_time and lines and lines[-1].startswith("MAXRSS_KB "):
        f = lines[-1].split()
        rss, cpu = int(f[1]) * 1024, float(f[2]) + float(f[3])
        lines = lines[:-1]
    return {"wall_s": wall, "cpu_s": cpu, "rss_bytes": rss, "rc": os.waitstatus_to_exitcode(status), "out": out,
            "err": lines[-1:]}


COMMANDS = ("stats_tagged", "stats_parquet", "profile_tagged", "profile_parquet", "simulate_online", "simulate")


def bench_size(n: int, d: Path, timeout: float, commands=COMMANDS, deadline: float | None = None) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    tagged, ds = d / f"trace-{n:.0e}.bin", d / f"ds-{n:.0e}"
    t0 = time.perf_counter()
    def generate(kind: str, path: Path) -> None:
        if not path.exists():  # in a child process: this one stays small (its RSS is no floor for the others)
            subprocess.run([sys.executable, __file__, "--generate", kind, str(path), str(n)], check=True)

    generate("tagged", tagged)
    gen_s = time.perf_counter() - t0
    ents = int((tagged.stat().st_size - 16) // (4 * (2 + 2 * K)) * K)
    geo = ["--n-layer", str(L), "--n-expert", str(E)]
    prof = d / f"p-{n:.0e}.strp"
    res: dict = {"entries": ents, "generate_s": gen_s}
    rep = d / f"rep-{n:.0e}"
    todo = {
        "stats_tagged": ["trace", "stats", str(tagged), "--json"],
        "stats_parquet": ["trace", "stats", str(ds), "--json"],
        "profile_tagged": ["make-profile", str(tagged), "-o", str(prof), *geo, "--force"],
        "profile_parquet": ["make-profile", str(ds), "-o", str(d / "q.strp"), *geo, "--force"],
        "simulate_online": ["simulate", "--traces", str(tagged), "--profile", str(prof), "--slots", str(L * E // 4),
                            "--policy", "static,adaptive,lru", "--no-sweep", "--report", str(rep), "--force",
                            "--json"],
        "simulate": ["simulate", "--traces", str(tagged), "--profile", str(prof), "--slots", str(L * E // 4),
                     "--policy", "static,adaptive,lru,belady", "--kfold", "5", "--no-sweep", "--report", str(rep),
                     "--force", "--json"],
    }
    if any(c.startswith("simulate") for c in commands) and "profile_tagged" not in commands and not prof.exists():
        commands = ("profile_tagged", *commands)
    order = [k for k in COMMANDS if "parquet" not in k] + [k for k in COMMANDS if "parquet" in k]
    for k in order:
        if k in commands:
            if "parquet" in k and not ds.exists():
                left = deadline - time.time() if deadline else None
                if left is not None and left < 600:
                    print(f"# {n:.0e} {k}: not run (no time left to generate the Parquet dataset)", flush=True)
                    continue
                t1 = time.perf_counter()
                generate("dataset", ds)
                res["generate_dataset_s"] = time.perf_counter() - t1
            left = deadline - time.time() if deadline else timeout
            if deadline and left <= 5:
                print(f"# {n:.0e} {k}: not run (--deadline reached)", flush=True)
                continue
            res[k] = run(todo[k], min(timeout, left))
            print(f"# {n:.0e} {k}: {res[k]['wall_s']:.1f} s wall, {res[k]['cpu_s']:.1f} s cpu, "
                  f"{res[k]['rss_bytes'] / 1e9:.2f} GB, rc {res[k]['rc']}", flush=True)
    for k in ("simulate", "simulate_online"):
        if k not in res:
            continue
        try:
            st = json.loads(res[k]["out"])
            res[k]["h_expert"] = {f"{r['policy']}/{r['label']}": round(r["h_expert"], 6) for r in st["results"]}
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    for v in res.values():
        if isinstance(v, dict):
            v.pop("out", None)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1e7", help="comma-separated entry counts, e.g. 1e7,1e8")
    ap.add_argument("--dir", default="bench-out/trace-scale")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per command")
    ap.add_argument("--keep", action="store_true", help="keep the generated traces")
    ap.add_argument("--commands", default=",".join(COMMANDS), help="subset of " + ",".join(COMMANDS))
    ap.add_argument("--deadline", default=None, help="HH:MM (UTC): commands are cut off then")
    ap.add_argument("--generate", nargs=3, metavar=("KIND", "PATH", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.generate:
        kind, path, n = a.generate
        (write_tagged if kind == "tagged" else write_dataset)(Path(path), int(n))
        return
    cmds = tuple(c for c in a.commands.split(",") if c)
    d = Path(a.dir)
    out = {}
    for s in a.sizes.split(","):
        n = int(float(s))
        dl = None
        if a.deadline:
            import datetime as dt

            hh, mm = (int(x) for x in a.deadline.split(":"))
            now = dt.datetime.now(dt.timezone.utc)
            dl = now.replace(hour=hh, minute=mm, second=0, microsecond=0).timestamp()
        out[n] = bench_size(n, d, a.timeout, cmds, dl)
        print(json.dumps({str(n): out[n]}, indent=1), flush=True)
    online = 3 + 2 * (5 + 1)  # static, adaptive, lru at the budget + k-fold: (5 folds + in-sample) x 2 policies
    print("\n(M entries/s of wall time; on a shared machine CPU time says more: M entries per CPU second in the notes)")
    print("\nsize          command            wall s   peak RSS GB   M entries/s   notes")
    for n, r in out.items():
        base = r["stats_tagged"]["wall_s"] if "stats_tagged" in r else None
        for k in COMMANDS:
            if k not in r:
                continue
            v = r[k]
            if v["rc"] == "timeout":
                print(f"{n:<13.0e} {k:<18} {v['wall_s']:8.1f} {v['rss_bytes'] / 1e9:12.2f}   cut off at the time limit "
                      f"(peak RSS seen until then)")
                continue
            eps = r["entries"] / v["wall_s"] / 1e6
            note = f"rc {v['rc']}; cpu {v.get('cpu_s', 0):.1f} s"
            if v.get("cpu_s"):
                note += f" ({r['entries'] / v['cpu_s'] / 1e6:.1f} M/cpu-s)"
            if k == "simulate_online":
                note += f"; per online policy {3 * eps:.1f} M/s"
                if v.get("cpu_s"):
                    note += f", {3 * r['entries'] / v['cpu_s'] / 1e6:.1f} M/cpu-s"
                if base:
                    note += f" ({3 * eps / (r['entries'] / base / 1e6):.2f}x the baseline: trace stats, one read)"
            if k == "simulate":
                note += f"; per online policy (incl. Belady's passes) {online * eps:.1f} M/s"
                if v.get("cpu_s"):
                    note += f", {online * r['entries'] / v['cpu_s'] / 1e6:.1f} M/cpu-s"
            print(f"{n:<13.0e} {k:<18} {v['wall_s']:8.1f} {v['rss_bytes'] / 1e9:12.2f} {eps:13.1f}   {note}")
    sizes = list(out)
    if len(sizes) > 1:
        print("\npeak RSS by size (GB): " + "; ".join(
            f"{k}: " + " / ".join(f"{out[n][k]['rss_bytes'] / 1e9:.2f}" if k in out[n] else "-" for n in sizes)
            for k in COMMANDS))
    if not a.keep:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
