"""Batched decode (``run --batch N``, issue 12 item 3) on the full-width synthetic model: aggregate decode tok/s at
N = 1, 8, 32 against the batch-1 CUDA-graph decoder measured in the same run. A benchmark, not a timed test.

Steps: synthesize the model (``stratatools synth --full-width --layers L --experts E --types gu=Q2_0,down=Q2_0``,
or reuse it), load it once (every expert resident), build a :class:`stratatools.runtime.gpu.engine.DecoderRuntime`;
then

1. batch 1 (the reference): prompt 0 prefilled, ``--steps`` greedy decode steps through the CUDA graph: tok/s, the
   tokens and the first step's logits;
2. for each N of ``--n``: a :class:`stratatools.runtime.gpu.batch.BatchDecoder` with N places, N prompts of
   ``--prompt`` tokens (distinct slices of the prompt suite) prefilled into them, two warm-up steps, then ``--steps``
   timed batched steps (greedy, synchronised by the per-step read-back of tokens and routing): aggregate tok/s =
   N x steps / seconds, ratio to batch 1; place 0 runs prompt 0, so its tokens and first logits are compared with
   the batch-1 run (same tokens expected; logits relative error <= 1e-3); then, where the step can be queued
   (``BatchDecoder.queue_ready``: device staging, every expert resident), ``--steps`` + 2 more steps queued one
   ahead (each launched from the device's arg-max before the host reads the step before, tokens and routing read
   back every step), timed from the third: the ``queued`` tok/s a recording run (``run_batched``) gets while every
   place is busy, place 0's tokens again against batch 1's;
3. a per-part breakdown of one step at the largest N (host-timed with a device synchronisation between parts);
4. end to end at the largest N: :func:`stratatools.runtime.gpu.batch.run_batched` over 2 N prompts with
   ``--steps`` new tokens each (prefills, continuous batching and the per-place accounting included).

Prints every row and writes ``--out`` JSON. llama-batched-bench is run by bench_gpu_model.py (the lead's bench).

``--variants default,before,mma,hgemm,sgemm`` times the step at every N for each variant (:data:`VARIANTS`: this
tree's step, the step before the attention / GDN kernels and the pipelined expert kernels, the tensor-core GEMMs, the
fp16 hi/lo cuBLAS GEMMs, SGEMM; ``eager``, ``mma-eager``, ``hgemm-eager`` without the CUDA graph) in the same run.

Usage: python bench/bench_gpu_batch.py --workdir /tmp/bb [--layers 8 --experts 256 --prompt 64 --steps 16
       --n 1,8,32 --variants default,before,mma,hgemm --reuse --gguf M --out res.json]
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
sys.path.insert(0, str(ROOT / "bench"))


#: Step variants (environment of the BatchDecoder and its prefills): ``default`` (this tree's choices), ``before``
#: (the array-code attention and GDN, staged expert kernels: the step as measured before them), ``mma`` (dense
#: projections, the shared expert and the routed-expert jobs of the step on the tensor-core GEMMs,
#: STRATATOOLS_BATCH_GEMM=mma), ``hgemm`` (the step's dense projections and shared expert through fp16 hi/lo cuBLAS
#: GEMMs, its routed experts on the tensor-core jobs, the prefills likewise: STRATATOOLS_BATCH_GEMM=hgemm and
#: STRATATOOLS_PREFILL_GEMM=hgemm), ``sgemm`` (the step's default, with the prefills on SGEMM too); ``eager``,
#: ``mma-eager`` and ``hgemm-eager``: those steps launched from Python every time (STRATATOOLS_BATCH_GRAPH=0, no
#: CUDA graph); ``moekc256`` / ``kc256`` / ``kc256all``: the expert job / dense / both tensor-core kernels staging 256
#: values of k at a time (STRATATOOLS_QMM_MOE_KC, STRATATOOLS_QMM_KC); ``noside``: the shared expert after the routed
#: ones (STRATATOOLS_SHARED_SIDE=0); ``job8``: the routed-expert jobs of 8 tokens (STRATATOOLS_BATCH_JOB=8);
#: ``fp16jobs``: the Q2_0 expert jobs on the fp16 hi-lo kernels (STRATATOOLS_QMM_JOBS_I8=0); ``fill3`` / ``fill4``: the
#: dense launches' split of k aiming at 3 / 4 blocks a SM (STRATATOOLS_QMM_SHORT_FILL); ``cpsum``: the split of k's
#: slices added by CuPy (STRATATOOLS_QMM_SUM=0); ``blockroute``: the router a block a token (STRATATOOLS_ROUTE_WARP=0);
#: ``old``: both of the last two; ``noring``: the dense Q8R launches up to 32 tokens on ``qmm_dense`` instead of
#: ``qmm_dense_ring`` (STRATATOOLS_QMM_RING=0); ``ring4`` / ``ring8`` / ``ring128``: rings of 4 or 8 stages of 64
#: values, 3 of 128; ``nojring``: the integer expert jobs' weights in registers (STRATATOOLS_QMM_JOBS_RING=0);
#: ``jring4`` / ``jring128`` / ``jring6``: their rings of 4 x 256, 4 x 128, 6 x 128 values; ``jpad0`` / ``jring4p0`` /
#: ``jring2p0``: 3 / 4 / 2 x 256 with staged rows unpadded (smaller stages; ``jring2p0`` is the default since the
#: nineteenth pass); ``jring3``: the earlier default 3 x 256 padded; ``jring2p16`` / ``jring2k128``: 2 x 256 padded,
#: 2 x 128 unpadded; ``norings``: neither ring; ``nohcf``: the hyper-connections' launches unfused (the inject, the
#: norm, the mix and their splits each a launch: STRATATOOLS_HC_FUSED=0); ``nojoin``: a GDN layer's four
#: in-projections, a hyper-connection's down and inject projections, the shared expert's gate and up each a product
#: (STRATATOOLS_JOINED_PROJ=0); ``nofuse``: the hyper-connections' launches unfused and no joined products;
#: ``hoststage``: the graph step's inputs made on the host (STRATATOOLS_BATCH_DEV_STAGE=0; no queued steps);
#: ``gdnheads``: the batched GDN recurrence's grid heads first (STRATATOOLS_GDN_STEP_COLS=0); ``noplan``: the rings'
#: copies worked out each chunk instead of from each thread's plan (STRATATOOLS_QMM_COPY_PLAN=0); ``shq80``: the
#: shared expert's products from its Q8_0 blocks on the fp16 kernel (STRATATOOLS_Q8R_SHARED=0);
#: ``ring3f4`` / ``ring2f4`` / ``ring4f3``: dense rings of 3, 2, 4 stages of 64 values (4, 5, 3 blocks a SM) with the
#: split of k aimed at 4, 4, 3 blocks a SM; ``kg2`` / ``kg2b`` / ``kg4``: dense rings whose blocks hold 2 or 4 groups
#: of 4 warps sharing the rows (2 x 64, 4 x 64 values with 2 groups; 3 x 128 with 4). Every fp16-ring variant sets
#: the integer dense ring off (STRATATOOLS_QMM_DENSE_I8=0; ``noi8``: only that); ``i8r2`` / ``i8r4`` / ``i8r6``: the
#: integer ring of 2, 4, 6 stages of 64 values with one group; ``i8kg2`` / ``i8r6b``: 4 / 6 x 64 with 2 groups;
#: ``i8r4k`` / ``i8r6k``: 4 / 6 x 128 with 2 groups; ``i8kg4``: 3 x 128 with 4; ``i8x256``: 3 x 256 with one (the
#: default: 3 x 128 with 2); ``w8``: both dense rings with groups of 8 warps (STRATATOOLS_QMM_RING_WARPS=8, 128 rows a
#: block), ``w8kg1``: the integer ring 3 x 128 with one group of 8 warps; ``w2`` / ``w2r4``: groups of 2 warps (32
#: rows a block, twice the blocks), the integer ring 3 / 4 x 128 with two groups.
_F16 = {"STRATATOOLS_QMM_DENSE_I8": "0"}  # (the fp16 ring variants: the integer dense ring off)
VARIANTS = {"default": {}, "before": {"STRATATOOLS_BATCH_ATTN": "0", "STRATATOOLS_GDN_PREP": "0",
                                      "STRATATOOLS_MOE_KERNEL": "staged"},
            "mma": {"STRATATOOLS_BATCH_GEMM": "mma"},
            "moekc256": {"STRATATOOLS_QMM_MOE_KC": "256"}, "kc256": {"STRATATOOLS_QMM_KC": "256"},
            "kc256all": {"STRATATOOLS_QMM_MOE_KC": "256", "STRATATOOLS_QMM_KC": "256"},
            "noside": {"STRATATOOLS_SHARED_SIDE": "0"}, "job8": {"STRATATOOLS_BATCH_JOB": "8"},
            "fp16jobs": {"STRATATOOLS_QMM_JOBS_I8": "0"},
            "fill3": {"STRATATOOLS_QMM_SHORT_FILL": "3"}, "fill4": {"STRATATOOLS_QMM_SHORT_FILL": "4"},
            "noi8": {"STRATATOOLS_QMM_DENSE_I8": "0"},
            "i8r2": {"STRATATOOLS_QMM_DENSE_I8": "2:64"}, "i8r4": {"STRATATOOLS_QMM_DENSE_I8": "4:64"},
            "i8r6": {"STRATATOOLS_QMM_DENSE_I8": "6:64"}, "i8kg2": {"STRATATOOLS_QMM_DENSE_I8": "4:64:2"},
            "i8r6b": {"STRATATOOLS_QMM_DENSE_I8": "6:64:2"}, "i8r4k": {"STRATATOOLS_QMM_DENSE_I8": "4:128:2"},
            "i8r6k": {"STRATATOOLS_QMM_DENSE_I8": "6:128:2"}, "i8kg4": {"STRATATOOLS_QMM_DENSE_I8": "3:128:4"},
            "i8x256": {"STRATATOOLS_QMM_DENSE_I8": "3:256"}, "w8": {"STRATATOOLS_QMM_RING_WARPS": "8"},
            "w8kg1": {"STRATATOOLS_QMM_RING_WARPS": "8", "STRATATOOLS_QMM_DENSE_I8": "3:128"},
            "w2": {"STRATATOOLS_QMM_RING_WARPS": "2"},
            "w2r4": {"STRATATOOLS_QMM_RING_WARPS": "2", "STRATATOOLS_QMM_DENSE_I8": "4:128:2"},
            "noring": {**_F16, "STRATATOOLS_QMM_RING": "0"}, "ring4": {**_F16, "STRATATOOLS_QMM_RING": "4:64"},
            "ring8": {**_F16, "STRATATOOLS_QMM_RING": "8:64"}, "ring128": {**_F16, "STRATATOOLS_QMM_RING": "3:128"},
            "nojring": {"STRATATOOLS_QMM_JOBS_RING": "0"}, "jring4": {"STRATATOOLS_QMM_JOBS_RING": "4:256"},
            "jring128": {"STRATATOOLS_QMM_JOBS_RING": "4:128"}, "jring6": {"STRATATOOLS_QMM_JOBS_RING": "6:128"},
            "jpad0": {"STRATATOOLS_QMM_JOBS_RING": "3:256:0"}, "jring4p0": {"STRATATOOLS_QMM_JOBS_RING": "4:256:0"},
            "jring2p0": {"STRATATOOLS_QMM_JOBS_RING": "2:256:0"}, "jring3": {"STRATATOOLS_QMM_JOBS_RING": "3:256"},
            "nohcf": {"STRATATOOLS_HC_FUSED": "0"}, "nojoin": {"STRATATOOLS_JOINED_PROJ": "0"},
            "nofuse": {"STRATATOOLS_HC_FUSED": "0", "STRATATOOLS_JOINED_PROJ": "0"},
            "hoststage": {"STRATATOOLS_BATCH_DEV_STAGE": "0"},
            "gdnheads": {"STRATATOOLS_GDN_STEP_COLS": "0"},
            "noplan": {"STRATATOOLS_QMM_COPY_PLAN": "0"}, "nobpdl": {"STRATATOOLS_BATCH_PDL": "0"},
            "sgemmrt": {"STRATATOOLS_BATCH_ROUTER": "0"}, "gdnlate": {"STRATATOOLS_GDN_STEP_EARLY": "0"},
            "gdncs": {"STRATATOOLS_GDN_STEP_EARLY": "cs"},
            "old24": {"STRATATOOLS_BATCH_PDL": "0", "STRATATOOLS_BATCH_ROUTER": "0"},
            "shq80": {"STRATATOOLS_Q8R_SHARED": "0"},
            "jring2p16": {"STRATATOOLS_QMM_JOBS_RING": "2:256:16"}, "jring2k128": {"STRATATOOLS_QMM_JOBS_RING": "2:128:0"},
            "ring3f4": {**_F16, "STRATATOOLS_QMM_RING": "3:64", "STRATATOOLS_QMM_SHORT_FILL": "4"},
            "ring2f4": {**_F16, "STRATATOOLS_QMM_RING": "2:64", "STRATATOOLS_QMM_SHORT_FILL": "4"},
            "ring4f3": {**_F16, "STRATATOOLS_QMM_RING": "4:64", "STRATATOOLS_QMM_SHORT_FILL": "3"},
            "kg2": {**_F16, "STRATATOOLS_QMM_RING": "2:64:2"}, "kg2b": {**_F16, "STRATATOOLS_QMM_RING": "4:64:2"},
            "kg4": {**_F16, "STRATATOOLS_QMM_RING": "3:128:4"},
            "norings": {**_F16, "STRATATOOLS_QMM_JOBS_RING": "0", "STRATATOOLS_QMM_RING": "0"},
            "cpsum": {"STRATATOOLS_QMM_SUM": "0"}, "blockroute": {"STRATATOOLS_ROUTE_WARP": "0"},
            "old": {"STRATATOOLS_QMM_SUM": "0", "STRATATOOLS_ROUTE_WARP": "0"},
            "hgemm": {"STRATATOOLS_PREFILL_GEMM": "hgemm", "STRATATOOLS_BATCH_GEMM": "hgemm"},
            "eager": {"STRATATOOLS_BATCH_GRAPH": "0"},
            "mma-eager": {"STRATATOOLS_BATCH_GEMM": "mma", "STRATATOOLS_BATCH_GRAPH": "0"},
            "hgemm-eager": {"STRATATOOLS_PREFILL_GEMM": "hgemm", "STRATATOOLS_BATCH_GEMM": "hgemm",
                            "STRATATOOLS_BATCH_GRAPH": "0"},
            "sgemm": {"STRATATOOLS_PREFILL_GEMM": "sgemm", "STRATATOOLS_BATCH_GEMM": "sgemm"}}


def queued_steps(cp, bd, toks: list, steps: int, ref_tok: list, var: str) -> dict:
    """``steps`` + 2 steps of all places queued one ahead (BatchDecoder.launch / collect: each step launched from the
    device's arg-max before the host reads the step before, the tokens and routing read back every step as a
    recording run reads them), continuing the synchronous steps from ``toks``; timed from the third collected step:
    aggregate tok/s and ms a step; place 0's tokens against batch 1's (``ref_tok`` continued)."""
    n = bd.n
    start = len(ref_tok) - (steps + 2) - 1  # the batch-1 index of toks[0] (the sync loop ran steps + 2)
    got0 = [toks[0]]
    bd.stats["wait_s"] = 0.0
    bd.launch(toks)
    t0 = time.perf_counter()
    for s in range(steps + 2):
        if s + 1 < steps + 2:
            bd.launch()
        _, nxt, _, _ = bd.collect()
        got0.append(int(nxt[0]))
        if s == 1:
            t0 = time.perf_counter()
            bd.stats["wait_s"] = 0.0
    dt = time.perf_counter() - t0
    agg = n * steps / dt
    same = got0 == ref_tok[start:start + len(got0)]
    out = {"queued_tok_s": agg, "queued_step_ms": dt / steps * 1e3, "queued_tokens_equal_batch1": same,
           "queued_wait_ms": bd.stats["wait_s"] / steps * 1e3, "stage_errors": bd.stage_errors()}
    print(f"{var:9s} N={n:3d}: {agg:9.1f} tok/s aggregate queued ({dt / steps * 1e3:7.2f} ms/step, wait in collect "
          f"{out['queued_wait_ms']:.2f} ms a step); place 0 tokens vs batch 1 {'equal' if same else 'DIFFER'}; "
          f"staging errors {out['stage_errors']}", flush=True)
    return out


def step_profile(cp, bd, places: list, toks: list, steps: int, var: str) -> dict:
    """Per-kernel device time of ``steps`` batched steps (CUPTI through torch.profiler, as bench_gpu_run's decode
    profile) and the steps' wall time: the share of the wall the device is busy says whether kernels or the host's
    launches bound the step. Prints the 14 longest kernels; returns {"wall_ms", "device_ms", "launches", "rows"}."""
    from bench_gpu_run import profile_run

    state = {"toks": toks}

    def one() -> None:
        _, nxt, _, _ = bd.step(places, state["toks"])
        state["toks"] = [int(v) for v in nxt]

    got = profile_run(cp, one, steps, shapes=True)
    if got:
        dev, wall = got["device_ms"], got["wall_ms"]
        print(f"\nkernels of one {var} step at N={len(places)} (profiled): {dev:.2f} ms of device time in "
              f"{got['launches']} launches, wall {wall:.2f} ms (device busy {dev / wall:.0%})\n| kernel | ms/step | "
              f"launches/step | share |\n|---|---:|---:|---:|", flush=True)
        for r in got["rows"][:14]:
            print(f"| {r[0]} | {r[1]:.3f} | {r[2]} | {r[3]:.3f} |", flush=True)
        print("\nby launch grid (kernel, grid, block: ms/step, launches/step, us a launch):", flush=True)
        for r in got.get("grids", [])[:40]:
            print(f"  {r[0]} {r[1]} {r[2]}: {r[3]:.3f} ms, {r[4]:.0f}, {r[5]:.1f} us", flush=True)
        tl = got.get("timeline") or {}
        if tl:
            print(f"timeline: wall {tl['wall']:.2f} ms, main stream busy {tl['main_busy']:.2f} ms "
                  f"({tl['main_kernels']:.0f} kernels), device idle {tl.get('device_idle', 0.0):.2f} ms", flush=True)
    return got


def timed_greedy(cp, rt, st, lg, steps: int, keep_first: bool = False):
    """``steps`` greedy batch-1 steps of the decoder runtime ``rt`` from logits ``lg`` on state ``st``, timed between
    device synchronisations. Returns (tokens, tok/s, the last logits, the first step's logits as float64 numpy or
    None; ``keep_first`` reads them back inside the timed loop, as the reference run always has)."""
    toks, first = [], None
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for s in range(steps):
        tok = rt.argmax(lg)
        toks.append(tok)
        lg, _ = rt.forward([tok], st)
        if keep_first and s == 0:
            first = cp.asnumpy(lg).astype(np.float64)
    cp.cuda.Device().synchronize()
    return toks, steps / (time.perf_counter() - t0), lg, first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/bb")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--n", default="1,8,32")
    ap.add_argument("--b1-steps", type=int, default=0, metavar="STEPS",
                    help="also time batch 1 over this many greedy steps of prompt 0 afresh (the reference run's "
                         "--steps are a short window); 0: no such row")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--gguf", default=None, help="an existing model to use (no synth)")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--variants", default="default",
                    help="comma-separated step variants, each timed at every N (a variant named again is timed again: "
                         "its rows' names get #2, #3, ...): " + ", ".join(VARIANTS))
    ap.add_argument("--both-orders", action="store_true",
                    help="time the variants again in the reverse order after the first pass (the order a call times "
                         "them in has moved a queued step by 0.2-0.5 ms: bench/gpu-notes.md, twenty-second pass); "
                         "no --kernel-profile then (a profile between two timings would make the orders unequal)")
    ap.add_argument("--kernel-profile", type=int, default=0, metavar="STEPS",
                    help="per-kernel device time of STEPS steps at the largest N for every variant (torch.profiler), "
                         "against the steps' wall time")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.b1_steps < 0:
        ap.error(f"--b1-steps {a.b1_steps}: give 0 (no such row) or more steps")
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    from bench_gpu_run import env_vars, full_width_model, print_breakdown, suite_prompt_ids

    gguf, synth_s = full_width_model(wd, a.layers, a.experts, a.reuse, a.gguf)
    res: dict = {"args": vars(a), "synth_s": synth_s}

    import cupy as cp

    from stratatools.runtime.gpu.batch import BatchDecoder, run_batched
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    ns = [int(v) for v in a.n.split(",")]
    nmax = max(ns)
    ids = suite_prompt_ids(gguf, a.prompt * 2 * nmax + 64)
    prompts = [ids[i * a.prompt:(i + 1) * a.prompt] for i in range(2 * nmax)]
    t0 = time.perf_counter()
    w = load(gguf, xp=cp)
    grt = GPURuntime(w, policy=None, miss_mode="host")
    # (the queued steps continue each variant's synchronous ones: 2 x (steps + 2) positions after the prompt)
    rt = DecoderRuntime(grt, max_ctx=a.prompt + max(2 * (a.steps + 2), a.b1_steps) + 8)
    res["load_s"] = time.perf_counter() - t0
    print(f"loaded in {res['load_s']:.0f} s", flush=True)

    # 1. batch 1 through the CUDA graph
    st = rt.new_state()
    lg, _ = rt.forward(prompts[1][:16], st)  # compiles, captures, uploads the dense matrices
    st = rt.new_state()
    lg, _ = rt.forward(prompts[0], st)
    ref_tok, b1, lg, first = timed_greedy(cp, rt, st, lg, a.steps, keep_first=True)
    ref_lg = [first]
    more, _, lg, _ = timed_greedy(cp, rt, st, lg, a.steps + 5)  # (the reference for the queued steps' tokens)
    ref_tok += more
    res["batch1_graph_tok_s"] = b1
    print(f"batch 1 (CUDA graph decoder): {b1:8.1f} tok/s", flush=True)
    if a.b1_steps > 0:  # the same decoder over a longer window, from the prompt again
        st = rt.new_state()
        lg, _ = rt.forward(prompts[0], st)
        long_tok, b1l, lg, _ = timed_greedy(cp, rt, st, lg, a.b1_steps)
        n_same = min(len(long_tok), len(ref_tok))
        same = long_tok[:n_same] == ref_tok[:n_same]
        res["batch1_graph_long"] = {"steps": a.b1_steps, "tok_s": b1l, "tokens_equal": bool(same)}
        print(f"batch 1 (CUDA graph decoder, {a.b1_steps} steps): {b1l:8.1f} tok/s; first {n_same} tokens vs the "
              f"reference run {'equal' if same else 'DIFFER'}", flush=True)
    rt.finish()  # the last step's bookkeeping (lag) before the decoder is used directly

    dec = rt.dec
    rows = {}
    bd = None
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if a.both_orders:
        variants += variants[::-1]
        if a.kernel_profile:
            print("--both-orders: no kernel profiles (they would run between the timed variants)", flush=True)
            a.kernel_profile = 0
    labels, seen = [], {}  # (a variant's second and later runs: name#k)
    for v in variants:
        seen[v] = seen.get(v, 0) + 1
        labels.append(v if seen[v] == 1 else f"{v}#{seen[v]}")
    for (var, label), n in [(vl, n) for vl in zip(variants, labels) for n in ns]:
        with env_vars(VARIANTS[var]):
            if bd is not None:
                del bd
                bd = None
            bd = BatchDecoder(dec, n)
            first = []
            for p in range(n):
                dec.load_state(rt.new_state())
                lgp, _, _ = dec.prefill(prompts[p])
                bd.admit(p)
                first.append(int(cp.asnumpy(cp.argmax(lgp))))
            toks = list(first)
            got0 = []
            places = list(range(n))
            t0 = time.perf_counter()
            for s in range(a.steps + 2):
                if s == 2:
                    cp.cuda.Device().synchronize()
                    t0 = time.perf_counter()
                    bd.stats["stage_s"] = bd.stats["wait_s"] = 0.0
                lgb, nxt, _, _ = bd.step(places, toks)
                if s == 0:
                    lg0 = cp.asnumpy(lgb[0]).astype(np.float64)
                got0.append(toks[0])
                toks = [int(v) for v in nxt]
            dt = time.perf_counter() - t0
            agg = n * a.steps / dt
            rel = float(np.abs(lg0 - ref_lg[0]).max() / np.abs(ref_lg[0]).max())
            same = got0[:a.steps] == ref_tok[:a.steps] if a.steps <= len(got0) else None
            row = rows[n if label == "default" else f"{label}:{n}"] = {
                "aggregate_tok_s": agg, "step_ms": dt / a.steps * 1e3, "ratio_to_batch1": agg / b1,
                "place0_first_logits_rel": rel, "place0_tokens_equal_batch1": same, "state_bytes": bd.state_bytes(),
                "pool_bytes": int(cp.get_default_memory_pool().total_bytes()),
                "graph_steps": int(bd.stats["graph_steps"]), "graph_error": bd.stats.get("graph_error"),
                "graph_pool_bytes": int(bd._gpool.total_bytes()) if bd._gpool is not None else 0,
                "host_stage_ms": bd.stats.get("stage_s", 0.0) / a.steps * 1e3,
                "wait_ms": bd.stats.get("wait_s", 0.0) / a.steps * 1e3}
            how = (f"graph ({bd.stats['graph_steps']} replays)" if bd.stats["graph_steps"]
                   else "eager" + (f": {bd.stats['graph_error']}" if bd.stats.get("graph_error") else ""))
            print(f"{label:9s} N={n:3d}: {agg:9.1f} tok/s aggregate ({dt / a.steps * 1e3:7.2f} ms/step), "
                  f"{agg / b1:5.2f}x batch 1; place 0 vs batch 1: first logits rel {rel:.2e}, tokens "
                  f"{'equal' if same else 'DIFFER'}; {how}; host staging {row['host_stage_ms']:.2f} ms, "
                  f"wait for the replay {row['wait_ms']:.2f} ms a step", flush=True)
            if bd.queue_ready()[0]:
                try:
                    row.update(queued_steps(cp, bd, toks, a.steps, ref_tok, label))
                except Exception as e:  # noqa: BLE001 - report it and keep the call's other rows
                    import traceback

                    traceback.print_exc()
                    row["queued"] = f"failed: {type(e).__name__}: {e}"
                    print(f"{label:9s} N={n:3d}: queued steps FAILED: {row['queued']}", flush=True)
            else:
                row["queued"] = bd.queue_ready()[1]
                print(f"{label:9s} N={n:3d}: no queued steps ({row['queued']})", flush=True)
            if a.kernel_profile > 0 and n == nmax and label == var:  # (once a variant)
                res.setdefault("kernel_profile", {})[var] = step_profile(cp, bd, places, toks, a.kernel_profile, var)
    res["rows"] = rows
    # 3. breakdown at the largest N (the last variant's step)
    if bd is not None:
        with env_vars(VARIANTS[variants[-1]]):
            bd.timing = {}
            bd._tlast = None
            t0 = time.perf_counter()
            bd.step(list(range(nmax)), toks)
            cp.cuda.Device().synchronize()
            tot = time.perf_counter() - t0
            bd.timing.pop("end", None)
            res["breakdown_s"] = dict(bd.timing)
            print_breakdown(f"one step at N={nmax}", bd.timing, tot)
            bd.timing = None
            del bd
    # 4. end to end (prefills + continuous batching + accounting)
    if not a.no_e2e:
        bd = BatchDecoder(dec, nmax)
        t0 = time.perf_counter()
        out, tot = run_batched(dec, bd, prompts[:2 * nmax], a.steps, -1)
        wall = time.perf_counter() - t0
        res["e2e"] = {**tot, "wall_s": wall, "decode_tok_s": tot["decode_forwards"] / tot["decode_s"],
                      "prefill_tok_s": sum(map(len, prompts[:2 * nmax])) / tot["prefill_s"]}
        print(f"end to end, {2 * nmax} prompts x {a.steps} new at N={nmax}: decode {res['e2e']['decode_tok_s']:.1f} "
              f"tok/s aggregate over {tot['steps']} steps ({tot['mean_active']:.1f} per step), prefill "
              f"{res['e2e']['prefill_tok_s']:.1f} tok/s, wall {wall:.1f} s", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
