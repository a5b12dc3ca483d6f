"""Long contexts in the GPU fast path (issue 17 item 4): decode speed of the static decoder at 256, 2k and 8k
positions, and ``stratatools run --device gpu`` end to end at a short and an 8k context. A benchmark, not a timed
test: every ratio is against the 256-position figure measured in the same run.

Part 1 (step timing, all experts resident): one decoder per row, its caches filled with random keys/values (K/V,
indexer keys, block keys) up to the row's position, the step captured as a CUDA graph and replayed ``--steps``
times with the routing read back every step (what ``run`` does). Rows: the short-context decoder (QSA attends every
cell: indexer skipped) at 256 positions, and the long-context decoder (indexer, block selection and split
attention on the device) at 256, 2k and 8k positions.

Part 2 (``run_prompts``, the code behind ``stratatools run``): one random-token prompt per ``--contexts`` length
(minus ``--new``) and ``--new`` greedy tokens, with ``--vram-gib`` and LRU, then all resident: decode and
prefill tok/s, hit rate, device memory (the run's own figures: bytes the device lost since the start, CuPy pools,
the plan).

Usage: python bench/bench_gpu_long.py --gguf model.gguf [--contexts 256,8192 --new 64 --vram-gib 12 --out r.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def step_rates(gguf: str, positions: list[int], steps: int) -> list[dict]:
    import cupy as cp

    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    w = load(gguf, xp=cp)
    grt = GPURuntime(w)
    cfg = w.cfg
    lim = max_full_context(cfg, grt.selection)
    rows = []
    rng = cp.random.default_rng(0)
    cases = [("short path", positions[0], positions[0] + steps + 8)] if positions[0] + steps + 8 <= lim else []
    cases += [("QSA path", p, max(positions) + steps + 8) for p in positions]
    for name, pos, max_ctx in cases:
        dec = StaticDecoder(grt, max_ctx=max_ctx)
        for buf in list(dec.kc.values()) + list(dec.vc.values()) + list(dec.ik.values()) + list(dec.bk.values()):
            buf[...] = rng.standard_normal(buf.shape, dtype=cp.float32)
        dec.pos = pos
        assert dec.capture()
        tok = 11
        for _ in range(3):
            dec.step(tok)
            dec.routing(account=False)
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            dec.step(tok + i)
            dec.routing(account=False)
        cp.cuda.Device().synchronize()
        dt = time.perf_counter() - t0
        rows.append({"name": name, "position": pos, "max_ctx": max_ctx, "long": dec.long, "tok_s": steps / dt,
                     "ms_per_token": 1e3 * dt / steps})
        print(f"step timing: {name}, position {pos} (max_ctx {max_ctx}): {steps / dt:.1f} tok/s "
              f"({1e3 * dt / steps:.2f} ms/token)", flush=True)
        del dec
    del grt, w
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def run_rows(gguf: str, contexts: list[int], new: int, vram_gib: float, workdir: Path) -> list[dict]:
    import cupy as cp

    from stratatools.model.gguf import open_model
    from stratatools.runtime.run import run_prompts

    with open_model(gguf) as m:
        vocab = int(m.tensor("token_embd.weight").ne[1])
    rng = np.random.default_rng(0)
    rows = []
    configs = [(c, {"vram_gib": vram_gib, "policy": "lru"}, f"--vram-gib {vram_gib:g}, LRU") for c in contexts]
    configs += [(c, {}, "all resident") for c in contexts]
    for ctx, kw, label in configs:
        pp = workdir / f"prompt_{ctx}.json"
        pp.write_text(json.dumps([{"token_ids": rng.integers(0, vocab, ctx - new).tolist()}]))
        cp.get_default_memory_pool().free_all_blocks()
        t0 = time.perf_counter()
        try:
            r = run_prompts(gguf, pp, max_new_tokens=new, device="gpu", **kw).to_dict()
        except Exception as e:  # noqa: BLE001 - the table shows the failure
            print(f"{label}, {ctx}-token context: failed: {e}", flush=True)
            rows.append({"name": label, "context": ctx, "error": str(e)})
            continue
        d = r["device"]
        row = {"name": label, "context": ctx, "decode": r["tokens_per_s"], "prefill": r["prefill_tokens_per_s"],
               "h_decode": r["h_expert"], "device_used": d["device_used_bytes"], "pool": d["pool_bytes"],
               "engine": d["engine"], "plan": d.get("plan"), "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(f"run {label}, {ctx}-token context: decode {row['decode']:.1f} tok/s, prefill {row['prefill']:.1f} tok/s, "
              f"h {row['h_decode']}, device used {row['device_used'] / 2**30:.2f} GiB, pools {row['pool'] / 2**30:.2f} "
              f"GiB, engine {row['engine']!r}, plan {json.dumps(row['plan'])}, wall {row['wall_s']:.0f} s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--positions", default="256,2048,8192")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--contexts", default="256,8192")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--vram-gib", type=float, default=12.0)
    ap.add_argument("--skip-runs", action="store_true")
    ap.add_argument("--workdir", default="/tmp/bench_long")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    res: dict = {"args": vars(a)}
    res["steps"] = step_rates(a.gguf, [int(x) for x in a.positions.split(",")], a.steps)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    base = next((r["tok_s"] for r in res["steps"] if r["name"] == "short path"), None)
    print("| decoder | position | decode tok/s | ms/token | x short path at 256 |")
    print("|---|---:|---:|---:|---:|")
    for r in res["steps"]:
        print(f"| {r['name']} | {r['position']} | {r['tok_s']:.1f} | {r['ms_per_token']:.2f} | "
              f"{r['tok_s'] / base if base else float('nan'):.3f} |", flush=True)
    if not a.skip_runs:
        res["runs"] = run_rows(a.gguf, [int(x) for x in a.contexts.split(",")], a.new, a.vram_gib, wd)
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
