"""Record the routing of full-width synthetic models with ``stratatools run --device gpu`` (issue 15's setting), for
the simulator bands of ``docs/synthetic-routing.md`` at full width.

For each expert count: synthesize ``--full-width --layers L --experts E --types gu=Q2_0,down=Q2_0``, then record
two traces with the runtime on the GPU and print ``trace stats`` for each:

- ``bands``: the calibration setting of docs/synthetic-routing.md, 12 suite prompts (round robin over the domains,
  first 200 characters each), 33 new tokens each (32 decode steps after the first token);
- ``long``: one prompt of 256 suite tokens and 64 new tokens (the GPU benchmark's prompt): the collapse check over a
  window of 64 decode steps.

The traces (Parquet) and the stats land in ``--out``; replay them anywhere with ``stratatools simulate -t ... --kfold 10``.
The model is deleted after its traces are recorded (a 48 x 512 full-width model is about 36 GB).

Usage (GPU machine): ``python bench/bench_routing_gpu.py --experts 256,512 --out $OUT``
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

ROOT = Path(__file__).resolve().parents[1]


def st(*args: str, env: dict) -> subprocess.CompletedProcess:
    """Run one stratatools command; print its last lines; raise on failure."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "stratatools", *args], capture_output=True, text=True, env=env)
    print(f"$ stratatools {' '.join(args)}  [{time.perf_counter() - t0:.1f} s, exit {p.returncode}]", flush=True)
    if p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-3000:], flush=True)
        raise SystemExit(p.returncode)
    return p


def suite_prompts(n: int, chars: int) -> list[dict]:
    """``n`` suite prompts, round robin over the domains, the first ``chars`` characters of each."""
    suite = json.loads((ROOT / "data" / "prompts" / "suite.json").read_text(encoding="utf-8"))["prompts"]
    by_dom: dict[str, list] = {}
    for p in suite:
        by_dom.setdefault(p["domain"], []).append(p)
    doms = sorted(by_dom)
    picks = []
    i = 0
    while len(picks) < n:
        dm = doms[i % len(doms)]
        j = i // len(doms)
        if j < len(by_dom[dm]):
            picks.append(by_dom[dm][j])
        i += 1
    return [{"prompt_id": p["prompt_id"], "text": p["text"][:chars]} for p in picks]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/fwr")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", default="256,512")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="gpu", help="run's --device (cpu: a quick check of this script on a small "
                    "reduced-width model, with --reduced)")
    ap.add_argument("--reduced", action="store_true", help="reduced width instead of --full-width (quick check)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    bands = wd / "bands.json"
    bands.write_text(json.dumps({"prompts": suite_prompts(12, 200)}))
    sys.path.insert(0, str(ROOT))
    for E in [int(e) for e in a.experts.split(",")]:
        mdir = wd / f"m{E}"
        width = ["--k", "4"] if a.reduced else ["--full-width", "--types", "gu=Q2_0,down=Q2_0"]
        st("synth", str(mdir), *width, "--no-revisions", "--layers", str(a.layers), "--experts", str(E), "--force",
           "--json", env=env)
        gguf = str(sorted(mdir.glob("*.gguf"))[0])
        from bench_gpu_run import suite_prompt_ids  # the benchmark's 256-token suite prompt

        ids = suite_prompt_ids(gguf, 256)
        long_p = wd / "long.json"
        long_p.write_text(json.dumps({"prompts": [{"prompt_id": "suite-256", "token_ids": ids[:256]}]}))
        for name, prompts, n_new in (("bands", bands, 33), ("long", long_p, 64)):
            trace = out / f"fw{a.layers}x{E}-{name}.parquet"
            r = st("run", gguf, "--prompts", str(prompts), "-n", str(n_new), "--device", a.device, "--trace-out",
                   str(trace), "--force", "--json", env=env)
            res = json.loads(r.stdout)
            print(f"{name}: decode {res.get('tokens_per_s')} tok/s, prefill {res.get('prefill_tokens_per_s')} tok/s, "
                  f"new tokens {res.get('new_tokens')}", flush=True)
            for req in res.get("requests", [])[:14]:
                print(f"  {req.get('prompt_id')}: {str(req.get('text', ''))[:100]!r}", flush=True)
            s = st("trace", "stats", str(trace), "--n-expert", str(E), "--window", "32" if name == "bands" else "64",
                   "--json", env=env)
            (out / f"fw{a.layers}x{E}-{name}-stats.json").write_text(s.stdout)
            js = json.loads(s.stdout)
            print(f"{name} verdict: {js.get('verdict')}", flush=True)
        shutil.rmtree(mdir, ignore_errors=True)


if __name__ == "__main__":
    main()
