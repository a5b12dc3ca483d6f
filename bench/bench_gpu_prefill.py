"""Batched prompt prefill against the token-by-token decode graph on the full-width synthetic model (issue 12 item 2).
A benchmark, not a timed test: both paths run in the same process on the same model and prompt.

Steps: synthesize the model (``stratatools synth --full-width --layers L --experts E --types gu=Q2_0,down=Q2_0``,
or reuse it), load it once, then for each prefill mode (``steps``: one CUDA-graph decode step per prompt token, the
earlier path; ``batched``: :meth:`stratatools.runtime.gpu.decode.StaticDecoder.prefill`; ``batched-gdnarray``: the
batched prefill with the gated DeltaNet's element-wise parts as array code, ``STRATATOOLS_GDN_PREP=0``, the path before
``gdn_prep.cu``, printed as a ratio to ``batched``) build a
:class:`stratatools.runtime.gpu.engine.DecoderRuntime` over the same loaded runtime, warm it on a short prompt, then
time the ``--prompt``-token prompt (the suite's text, tokenized) and decode ``--new`` greedy tokens. Prints prefill
tok/s of both and their ratio, the prompt logits' relative error and the router top-k agreement (issue 12 item 4:
<= 1e-3, >= 99.5%), whether the greedy tokens after the prompt agree, the device memory the batched prefill's
temporaries took (CuPy pool growth), and a per-part breakdown of one batched prefill (host-timed with a device
synchronisation between parts, so the parts add up to more than the plain run).

Usage: python bench/bench_gpu_prefill.py --workdir /tmp/pf [--layers 8 --experts 256 --prompt 512 --new 16
       --chunk 512 --group 8 --slots N --reuse --out res.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/pf")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--slots", type=int, default=None, help="LRU slots per layer (others read from host memory)")
    ap.add_argument("--modes", default="steps,batched")
    ap.add_argument("--try", dest="try_", default="", help="extra batched timings, comma-separated chunk:group:path (path rows, gemm or mma: the tensor-core expert jobs)")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    from bench_gpu_run import free_device, full_width_model, print_breakdown, suite_prompt_ids

    gguf, synth_s = full_width_model(wd, a.layers, a.experts, a.reuse)
    res: dict = {"args": vars(a), "synth_s": synth_s}

    import cupy as cp

    from stratatools.cachesim import make_tier
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    ids = suite_prompt_ids(gguf, a.prompt + 64)
    prompt, warm = ids[:a.prompt], ids[a.prompt:a.prompt + 32]
    t0 = time.perf_counter()
    w = load(gguf, xp=cp)
    L = w.cfg.n_layer
    pol = None
    if a.slots is not None:
        bb = [w.experts.blob_bytes(il) for il in range(L)]
        pol = make_tier("lru", n_layers=L, n_expert=max(w.cfg.n_expert), slots=L * a.slots, blob_bytes=bb)
    grt = GPURuntime(w, policy=pol, miss_mode="host")
    res["load_s"] = time.perf_counter() - t0
    print(f"loaded in {res['load_s']:.0f} s", flush=True)
    pool = cp.get_default_memory_pool()
    import stratatools.runtime.gpu.prefill as pfmod

    pfmod.GROUP = a.group  # the engine's prefill uses the module's defaults for the group
    out: dict = {}
    variants = {"gdnarray": ("STRATATOOLS_GDN_PREP", "0")}  # batched-gdnarray: the GDN's element-wise parts as arrays
    for mode in a.modes.split(","):
        base, _, variant = mode.partition("-")
        for k_, v_ in [variants[variant]] if variant else []:
            os.environ[k_] = v_
        rt = DecoderRuntime(grt, max_ctx=a.prompt + a.new + 8, prefill=base, prefill_chunk=a.chunk)
        st = rt.new_state()
        rt.forward(warm, st)  # compiles, captures the graph, uploads the dense matrices
        cp.cuda.Device().synchronize()
        st = rt.new_state()
        used0 = pool.used_bytes()
        pool_peak0 = pool.total_bytes()
        t0 = time.perf_counter()
        lg, rec = rt.forward(prompt, st)
        lg_h = cp.asnumpy(lg).astype(np.float64)
        dt = time.perf_counter() - t0
        grow = pool.total_bytes() - pool_peak0
        new = []
        t1 = time.perf_counter()
        for _ in range(a.new):
            tok = rt.argmax(lg)
            new.append(tok)
            lg, _ = rt.forward([tok], st)
            grt.tier.end_round()
        dec_s = time.perf_counter() - t1
        r = {"prefill_s": dt, "prefill_tok_s": a.prompt / dt, "decode_tok_s": a.new / dec_s, "new": new,
             "pool_growth_bytes": int(grow), "pool_used_before": int(used0)}
        out[mode] = (r, lg_h, np.stack(rec.ids, axis=1))
        res[mode] = r
        print(f"{mode:8s} prefill {r['prefill_tok_s']:9.1f} tok/s ({dt:.3f} s for {a.prompt}), decode "
              f"{r['decode_tok_s']:.1f} tok/s, pool growth {grow / 2**20:.0f} MiB", flush=True)
        if mode == "batched":
            from stratatools.runtime.gpu.prefill import ChunkPrefill

            pf = rt.dec._prefiller = ChunkPrefill(rt.dec, a.chunk, a.group, "rows")
            rt.dec.load_state(rt.new_state())
            pf.timing = {}
            pf._tlast = None
            cp.cuda.Device().synchronize()
            pool.free_all_blocks()
            b0 = pool.total_bytes()
            t0 = time.perf_counter()
            rt.dec.prefill(prompt, chunk=a.chunk, group=a.group)
            cp.cuda.Device().synchronize()
            tot = time.perf_counter() - t0
            res["prefill_pool_peak_bytes"] = int(pool.total_bytes() - b0)
            print(f"pool growth of one batched prefill from an emptied pool: "
                  f"{res['prefill_pool_peak_bytes'] / 2**20:.0f} MiB", flush=True)
            pf.timing.pop("end", None)
            res["breakdown_s"] = dict(pf.timing)
            print_breakdown("one batched prefill", pf.timing, tot)
            pf.timing = None
            res["tries"] = {}
            for cg in filter(None, a.try_.split(",")):
                c, g, path = cg.split(":")
                c, g = int(c), int(g)
                rt.dec.load_state(rt.new_state())
                rt.dec.prefill(prompt[:64], chunk=c, group=g, experts=path)  # builds the prefiller
                rt.dec.load_state(rt.new_state())
                cp.cuda.Device().synchronize()
                t0 = time.perf_counter()
                _, tids, _ = rt.dec.prefill(prompt, chunk=c, group=g, experts=path)
                cp.cuda.Device().synchronize()
                dt2 = time.perf_counter() - t0
                res["tries"][cg] = a.prompt / dt2
                ref_ids = out["steps"][2] if "steps" in out else None
                agree = "" if ref_ids is None else \
                    f", top-k sets agree with steps {np.mean([set(x.tolist()) == set(y.tolist()) for x, y in zip(ref_ids.reshape(-1, ref_ids.shape[-1]), tids.reshape(-1, tids.shape[-1]))]):.4%}"
                print(f"  batched chunk {c} group {g} experts {path}: {a.prompt / dt2:9.1f} tok/s{agree}", flush=True)
        del rt
        free_device(cp)
        if variant:
            os.environ.pop(variants[variant][0], None)
    for other in [m for m in out if m.startswith("batched-")]:
        (r0, l0, _), (r1, l1, _) = out["batched"] if "batched" in out else out[other], out[other]
        print(f"{other} against batched: prefill {r1['prefill_tok_s'] / r0['prefill_tok_s']:.3f}x, logits rel. "
              f"{float(np.abs(l1 - l0).max() / np.abs(l0).max()):.2e}", flush=True)
        res.setdefault("variants", {})[other] = {"ratio": r1["prefill_tok_s"] / r0["prefill_tok_s"]}
    if "steps" in out and "batched" in out:
        (rs, ls, is_), (rb, lb, ib) = out["steps"], out["batched"]
        rel = float(np.abs(lb - ls).max() / np.abs(ls).max())
        same = int(sum(set(is_[t, l].tolist()) == set(ib[t, l].tolist())
                       for t in range(is_.shape[0]) for l in range(is_.shape[1])))
        total = is_.shape[0] * is_.shape[1]
        res["compare"] = {"prompt_logits_rel": rel, "topk_agree": same / total, "greedy_same": rs["new"] == rb["new"],
                          "speedup": rb["prefill_tok_s"] / rs["prefill_tok_s"]}
        print(f"prompt logits rel. error {rel:.2e}; router top-k agreement {same}/{total} = {same / total:.4%}; "
              f"greedy tokens after the prompt {'equal' if rs['new'] == rb['new'] else 'DIFFER'}; "
              f"batched/steps prefill {res['compare']['speedup']:.1f}x", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
