"""``stratatools run --device gpu`` on the full-width synthetic model, with llama.cpp in the same run (issue 17's
table, issue 12's ratios). A benchmark, not a timed test: every ratio is against numbers measured in this run.

Steps: start the llama.cpp anchor build (``--anchor DIR``: ``llama-anchor.sh``, in the background), synthesize the
model (``stratatools synth --full-width --layers L --experts E --types gu=Q2_0,down=Q2_0``), measure the
device-to-device copy and pinned host-to-device copy rates, then run one prompt of ``--prompt`` tokens and
``--new`` greedy tokens for each tier configuration (all resident; ``--slots`` with static, adaptive, LRU), and
llama-bench tg128/pp512 on the same GGUF. Prints one row per configuration: decode and prefill tok/s, their
ratio to llama.cpp, decode roofline fraction (bytes the step touches per token / copy rate), decode hit rate,
bytes moved per token, device memory used.

Usage: python bench/bench_gpu_run.py --workdir /tmp/fw [--layers 48 --experts 256 --slots 1872]
       [--long 2048,8192] [--anchor ../shared/anchors] [--out res.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def copy_rates(cp, nbytes=2 << 30):
    a = cp.empty(nbytes, dtype=cp.uint8)
    b = cp.empty(nbytes, dtype=cp.uint8)
    a.fill(1)
    s = cp.cuda.get_current_stream()

    def timed(dst, src, n, kind):
        cp.cuda.runtime.memcpyAsync(dst, src, n, kind, s.ptr)
        ts = []
        for _ in range(5):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            cp.cuda.runtime.memcpyAsync(dst, src, n, kind, s.ptr)
            e1.record()
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
        return float(np.median(ts))

    d2d = 2 * nbytes / timed(b.data.ptr, a.data.ptr, nbytes, 3)
    h = cp.cuda.alloc_pinned_memory(nbytes // 2)
    h2d = (nbytes // 2) / timed(b.data.ptr, h.ptr, nbytes // 2, 1)
    del a, b, h
    cp.get_default_memory_pool().free_all_blocks()
    return d2d, h2d


def touched_bytes(path: str, k: int) -> int:
    from stratatools.model.gguf import open_model
    from stratatools.runtime.config import read_config
    from stratatools.runtime.device import dense_device_bytes

    with open_model(path) as m:
        cfg = read_config(m)
        ex = sum(int(t.nbytes) * k // int(t.ne[2]) for t in m.iter_tensors() if "_exps." in t.name)
        return dense_device_bytes(m, cfg) + ex


def free_device(cp) -> None:
    """Return every cached block of CuPy's pools (between configurations, so each measures its own footprint)."""
    import gc

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def kernel_profile(cp, gguf: str, prompt_ids: list, steps: int, slots: int | None, policy: str) -> list:
    """Per-kernel device time of ``steps`` graph-replayed decode steps (CUPTI through torch.profiler, which
    records every CUDA kernel of the process, CuPy's included). Returns rows (kernel, total ms, calls, share),
    sorted by time; [] when torch's profiler is not there."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception:  # noqa: BLE001
        return []
    from stratatools.cachesim import make_tier
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    w = load(gguf, xp=cp)
    pol = None
    if slots is not None:
        bb = [w.experts.blob_bytes(il) for il in range(w.cfg.n_layer)]
        pol = make_tier(policy, n_layers=w.cfg.n_layer, n_expert=max(w.cfg.n_expert), slots=slots, blob_bytes=bb)
    grt = GPURuntime(w, policy=pol, miss_mode="host")
    rt = DecoderRuntime(grt, max_ctx=len(prompt_ids) + steps + 8)
    st = rt.new_state()
    lg, _ = rt.forward(prompt_ids, st)
    tok = int(lg.argmax().get())
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            lg, _ = rt.forward([tok], st)
            tok = int(lg.argmax().get())
            grt.tier.end_round()
        cp.cuda.Device().synchronize()
    agg: dict = {}
    for ev in prof.events():
        if getattr(ev, "device_type", None) is None or "CUDA" not in str(ev.device_type):
            continue
        name = ev.name
        for pre in ("void ", "_Z"):
            name = name[len(pre):] if name.startswith(pre) else name
        name = name.split("(")[0][:60]
        t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        a = agg.setdefault(name, [0.0, 0])
        a[0] += t / 1e3
        a[1] += 1
    total = sum(v[0] for v in agg.values()) or 1.0
    rows = sorted(([k, v[0] / steps, v[1] // steps, v[0] / total] for k, v in agg.items()), key=lambda r: -r[1])
    del rt, grt, w
    free_device(cp)
    return rows


def parse_llama(md: str) -> dict:
    out = {}
    for line in md.splitlines():
        m = re.search(r"\|\s*(pp\d+|tg\d+)\s*\|\s*([\d.]+)\s*±", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/fw")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--slots", type=int, default=1872)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--anchor", default=None)
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--long", default="", help="comma-separated context lengths (e.g. 2048,8192): for each, rows "
                    "all resident and --vram-gib 12 LRU with a prompt of that many tokens minus --new (the static "
                    "decoder selects QSA cells on the device past the full-selection range)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    res: dict = {"args": vars(a)}
    mdir = wd / "model"
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    subprocess.run([sys.executable, "-m", "stratatools", "synth", str(mdir), "--full-width", "--no-revisions",
                    "--layers", str(a.layers), "--experts", str(a.experts), "--types", "gu=Q2_0,down=Q2_0", "--force",
                    "--json"], check=True, capture_output=True, env=env)
    gguf = str(sorted(mdir.glob("*.gguf"))[0])
    res["synth_s"] = time.perf_counter() - t0
    print(f"synth {res['synth_s']:.0f} s: {gguf} ({os.path.getsize(gguf) / 1e9:.1f} GB)", flush=True)
    anchor = None
    if a.anchor:
        anchor = subprocess.Popen(["bash", str(Path(a.anchor) / "llama-anchor.sh"), gguf, str(wd / "llama")],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    import cupy as cp

    from stratatools.runtime.run import run_prompts

    d2d, h2d = copy_rates(cp)
    res["copy_d2d_Bps"], res["copy_h2d_Bps"] = d2d, h2d
    print(f"copy device->device {d2d / 1e12:.2f} TB/s, pinned host->device {h2d / 1e9:.1f} GB/s", flush=True)
    from stratatools.model.gguf import open_model

    with open_model(gguf) as m:
        vocab = int(m.tensor("token_embd.weight").ne[1])
        k = int(m.kv.get(f"{m.arch}.expert_used_count"))
    touched = touched_bytes(gguf, k)
    res["touched_bytes_per_token"] = touched
    rng = np.random.default_rng(0)
    prompts = wd / "prompt.json"
    prompts.write_text(json.dumps([{"token_ids": rng.integers(0, vocab, a.prompt).tolist()}]))
    configs = [("all resident", {}), (f"{a.slots} slots static", {"slots": a.slots, "policy": "static"}),
               (f"{a.slots} slots adaptive", {"slots": a.slots, "policy": "adaptive"}),
               (f"{a.slots} slots LRU", {"slots": a.slots, "policy": "lru"}),
               ("--vram-gib 12, LRU", {"vram_gib": 12.0, "policy": "lru"})]
    plens = {str(prompts): a.prompt}
    for ctx in [int(x) for x in str(a.long).split(",") if x.strip()]:
        lp = wd / f"prompt_long_{ctx}.json"
        plens[str(lp)] = ctx - a.new
        lp.write_text(json.dumps([{"token_ids": rng.integers(0, vocab, ctx - a.new).tolist()}]))
        configs.append((f"all resident, {ctx}-token context", {"_prompts": lp}))
        configs.append((f"--vram-gib 12, LRU, {ctx}-token context", {"_prompts": lp, "vram_gib": 12.0, "policy": "lru"}))
    rows = []
    for name, kw in configs:
        free_device(cp)
        t0 = time.perf_counter()
        kw = dict(kw)
        pp = kw.pop("_prompts", prompts)
        plen = plens[str(pp)]
        try:
            r = run_prompts(gguf, pp, max_new_tokens=a.new, device="gpu", **kw).to_dict()
        except Exception as e:  # noqa: BLE001 - the table shows the failure
            print(f"{name}: failed: {e}", flush=True)
            rows.append({"name": name, "error": str(e)})
            continue
        d = r["device"]
        tc = d["tier"]
        steps = max(r["new_tokens"] - 1, 1)
        row = {"name": name, "decode": r["tokens_per_s"], "prefill": r["prefill_tokens_per_s"],
               "h_decode": r["h_expert"], "moved_per_token": tc["bytes_moved"] / (plen + steps),
               "device_used": d["device_used_bytes"], "pool": d["pool_bytes"], "wall_s": time.perf_counter() - t0,
               "engine": d["engine"], "tier": tc, "plan": d.get("plan")}
        rows.append(row)
        print(f"{name}: decode {row['decode']:.1f} tok/s, prefill {row['prefill']:.1f} tok/s, h {row['h_decode']}, "
              f"moved/token {row['moved_per_token'] / 1e6:.1f} MB, device used {row['device_used'] / 2**30:.2f} GiB",
              flush=True)
    res["rows"] = rows
    prof_rows = {}
    if a.profile_steps > 0:
        ids = json.loads(prompts.read_text())[0]["token_ids"][:32]
        for name, sl, pol in (("all resident", None, "static"), (f"{a.slots} slots LRU", a.slots, "lru")):
            try:
                prof_rows[name] = kernel_profile(cp, gguf, ids, a.profile_steps, sl, pol)
            except Exception as e:  # noqa: BLE001
                print(f"profile {name}: failed: {e}", flush=True)
        res["kernel_profile"] = prof_rows
    llama = {}
    if anchor is not None:
        out, _ = anchor.communicate(timeout=900)
        res["llama_out"] = out
        llama = parse_llama(out)
        print(out[-1500:], flush=True)
    res["llama"] = llama
    tg, pp = llama.get("tg128"), llama.get("pp512")
    roof = d2d / touched
    print(f"\nmodel {a.layers}x{a.experts} Q2_0, prompt {a.prompt}, new {a.new}; roofline {roof:.0f} tok/s "
          f"({touched / 1e6:.0f} MB/token at {d2d / 1e12:.2f} TB/s); llama.cpp tg128 {tg} pp512 {pp}")
    print("| config | decode tok/s | x llama tg128 | roofline | prefill tok/s | x llama pp512 | decode hit rate "
          "| MB moved/token | device GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error'][:80]} |")
            continue
        print(f"| {r['name']} | {r['decode']:.1f} | {r['decode'] / tg if tg else float('nan'):.3f} | "
              f"{r['decode'] / roof:.3f} | {r['prefill']:.1f} | {r['prefill'] / pp if pp else float('nan'):.4f} | "
              f"{r['h_decode'] if r['h_decode'] is None else round(r['h_decode'], 4)} | {r['moved_per_token'] / 1e6:.1f} | "
              f"{r['device_used'] / 2**30:.2f} |")
    for name, pr in prof_rows.items():
        tot = sum(r[1] for r in pr)
        print(f"\nper-kernel device time of one decode step ({name}): {tot:.2f} ms in "
              f"{sum(r[2] for r in pr)} kernels")
        print("| kernel | ms/step | launches/step | share |")
        print("|---|---:|---:|---:|")
        for r in pr[:14]:
            print(f"| {r[0]} | {r[1]:.3f} | {r[2]} | {r[3]:.3f} |")
    for r in rows:
        if "plan" in r and r["plan"]:
            print(f"{r['name']}: plan {json.dumps(r['plan'])}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
