"""Tensor-core GEMMs straight from quantized weights (``stratatools/runtime/gpu/qmm.py``, issue 12 items 2 and 3)
against the batched prefill's earlier paths, on the full-width synthetic model. A benchmark, not a timed test: every
comparison runs in the same process on the same loaded model and inputs.

Steps: synthesize the model (``stratatools synth --full-width --layers L --experts E --types gu=Q2_0,down=Q2_0``;
dense matrices Q8_0), or reuse it (``--reuse``, or ``--gguf`` a model made elsewhere), load it once into a
:class:`stratatools.runtime.gpu.engine.DecoderRuntime` (batched prefill) and warm it on a short prompt (the fused step
re-lays out its Q8_0 matrices: ``Q8R``), then:

1. dense: every distinct dense matrix shape of one gated-DeltaNet layer and one attention layer (and the shared
   expert), as the prefill reads it (``ChunkPrefill._raw_dev``: the decoder's Q8R rows or GGUF bytes), for T in
   ``--tokens`` (default 1, 8, 32, 128, 512): ``qmm.dense`` (split of X included) and ``qmm.hgemm`` (the
   ``hgemm`` path: split of X and of the matrix into fp16 hi/lo included, three cuBLAS fp16 GEMMs) against the
   ``sgemm`` path (the matrix dequantized to float32, then cuBLAS SGEMM: what ``_mm`` did), each timed with CUDA
   events over ``--reps`` launches after a warm-up; prints ms, TFLOP/s (2 T R K / time), the ratios sgemm / qmm,
   sgemm / hgemm and qmm / hgemm (> 1: the second faster) and the largest differences of qmm and hgemm from SGEMM
   relative to the SGEMM result's largest magnitude;
2. routed experts of one ``--prompt``-token chunk (layer 0's router on the hidden states of random activations):
   the ``mma`` job path (``_experts_mma``, 16-token jobs) against the ``rows`` path (``_experts_rows``: CUDA-core
   jobs of 8 tokens), ms each, ratio, relative difference;
3. the prefill of a ``--prompt``-token prompt (the prompt suite's text) with ``STRATATOOLS_PREFILL_GEMM=sgemm`` and
   then each ``--prefill-variants`` setting (:data:`PREFILL_VARIANTS`; default ``mma,hgemm``; each after a warm-up
   prefill that compiles its kernels, the best of ``--prefill-reps``): tok/s of each, its ratio to sgemm, the last
   token's logits relative error against sgemm (issue 12 item 4: <= 1e-3) and the router top-k agreement over
   (token, layer) (>= 99.5%), then a per-part breakdown of one prefill of each variant (host-timed with a device
   synchronisation between parts) and, with ``--kernel-profile``, its per-kernel device time (torch.profiler).

Usage: python bench/bench_qmm.py --workdir /tmp/qmm [--layers 8 --experts 256 --prompt 512 --tokens 1,8,32,128,512
       --reps 20 --reuse | --gguf model.gguf] [--skip dense,experts,prefill] [--prefill-variants mma,hgemm]
       [--prefill-reps 3] [--kernel-profile] [--out res.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def cuda_ms(cp, fn, reps: int) -> float:
    """Mean milliseconds of ``fn()`` over ``reps`` calls (CUDA events around the whole loop, after two warm-up
    calls)."""
    for _ in range(2):
        fn()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) / reps


#: Prefill settings (environment of the decoder's prefill): the dense GEMM path (``sgemm``, ``mma``, ``hgemm``), and
#: the tensor-core kernels' chunk of k (``*-kc256``: dense; ``*-moekc256`` / ``*-moekc128``: the expert jobs), the shared expert after
#: the routed ones instead of beside them (``mma-noside``), the GDN recurrence by the block kernel (``mma-gdnchunk``) or the warp kernel
#: (``mma-gdnwarp``, the default's setting), the dense matrices of at least 2M / 8M weights through cuBLAS (``mma-big2m``,
#: ``mma-big8m``: STRATATOOLS_PREFILL_BIG), the routed experts in jobs of 32 tokens (``mma-job32``), the dense kernel with two
#: 16-row tiles a warp (``mma-dense2``: STRATATOOLS_QMM_DENSE2), the chunks eagerly (``mma-eager``), the Q2_0 expert jobs
#: on the fp16 hi-lo kernels (``mma-fp16jobs``: STRATATOOLS_QMM_JOBS_I8=0).
PREFILL_VARIANTS = {
    "sgemm": {"STRATATOOLS_PREFILL_GEMM": "sgemm"}, "mma": {"STRATATOOLS_PREFILL_GEMM": "mma"},
    "hgemm": {"STRATATOOLS_PREFILL_GEMM": "hgemm"},
    "mma-noside": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_SHARED_SIDE": "0"},
    "mma-moekc256": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_QMM_MOE_KC": "256"},
    "mma-moekc128": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_QMM_MOE_KC": "128"},
    "mma-gdnchunk": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_GDN_WARP": "0"},
    "mma-gdnwarp": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_GDN_WARP": "1"},
    "mma-job32": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_PREFILL_JOB": "32"},
    "mma-dense2": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_QMM_DENSE2": "1"},
    "mma-big2m": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_PREFILL_BIG": str(1 << 21)},
    "mma-big8m": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_PREFILL_BIG": str(1 << 23)},
    "mma-eager": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_PREFILL_GRAPH": "0"},
    "mma-fp16jobs": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_QMM_JOBS_I8": "0"},
    "mma-graph-nobig": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_PREFILL_GRAPH": "1", "STRATATOOLS_PREFILL_BIG": "0"},
    "mma-nodense2": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_QMM_DENSE2": "0"},
    "mma-kc256": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_QMM_KC": "256"},
    "mma-kc64": {"STRATATOOLS_PREFILL_GEMM": "mma", "STRATATOOLS_QMM_KC": "64", "STRATATOOLS_QMM_MOE_KC": "64"},
    "hgemm-moekc256": {"STRATATOOLS_PREFILL_GEMM": "hgemm", "STRATATOOLS_QMM_MOE_KC": "256"},
}


def prefill_profile(cp, run, gemm: str, tokens: int) -> dict:
    """Per-kernel device time of one prefill ``run()`` (:func:`bench_gpu_run.profile_run`, as bench_gpu_batch's step
    profile); prints the 16 longest kernels. Returns {"wall_ms", "device_ms", "launches", "rows"} ({} without
    torch)."""
    from bench_gpu_run import profile_run

    got = profile_run(cp, run)
    if got:
        print(f"\nkernels of one {gemm} prefill of {tokens} tokens (profiled): {got['device_ms']:.1f} ms of device "
              f"time in {got['launches']} launches, wall {got['wall_ms']:.1f} ms\n| kernel | ms | launches | share |\n"
              f"|---|---:|---:|---:|", flush=True)
        for r in got["rows"][:16]:
            print(f"| {r[0]} | {r[1]:.2f} | {r[2]} | {r[3]:.3f} |", flush=True)
    return got


def dense_names(model, cfg) -> list[str]:
    """Dense matrices (quantized, two or more rows) of the first recurrent and the first attention layer and of the
    first layer's shared expert and router."""
    want = []
    for rec in (True, False):
        il = next((i for i in range(cfg.n_layer) if bool(cfg.recurrent[i]) == rec), None)
        if il is not None:
            want.append(f"blk.{il}.")
    out = []
    for t in model.iter_tensors():
        if not any(t.name.startswith(p) for p in want) or "_exps." in t.name or len(t.ne) < 2 or int(t.ne[1]) < 2:
            continue
        if t.type.name in ("F32", "F16", "BF16"):
            continue
        out.append(t.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/qmm")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", default="1,8,32,128,512")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip", default="", help="parts to skip: dense, experts, prefill (comma-separated)")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--gguf", default=None, help="a full-width model made elsewhere (skips the synthesis)")
    ap.add_argument("--prefill-variants", default="mma,hgemm",
                    help=f"prefill settings timed after sgemm (comma-separated; {', '.join(PREFILL_VARIANTS)})")
    ap.add_argument("--prefill-reps", type=int, default=3, help="prefills timed per setting (the best counts)")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="per-kernel device time of one prefill of each variant (torch.profiler)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    from bench_gpu_run import full_width_model

    gguf, synth_s = full_width_model(wd, a.layers, a.experts, a.reuse, a.gguf)
    res: dict = {"args": vars(a), "synth_s": synth_s}

    import cupy as cp

    from bench_gpu_run import env_vars, free_device, print_breakdown, suite_prompt_ids
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.prefill import ChunkPrefill
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    ids = suite_prompt_ids(gguf, a.prompt + 64)
    prompt, warm = ids[:a.prompt], ids[a.prompt:a.prompt + 32]
    t0 = time.perf_counter()
    w = load(gguf, xp=cp)
    grt = GPURuntime(w, policy=None, miss_mode="host")
    rt = DecoderRuntime(grt, max_ctx=a.prompt + 72, prefill="batched", prefill_chunk=a.prompt)
    st = rt.new_state()
    rt.forward(warm, st)  # compiles, captures the step (its Q8_0 matrices re-laid out), uploads the dense matrices
    cp.cuda.Device().synchronize()
    res["load_s"] = time.perf_counter() - t0
    print(f"loaded and warmed in {res['load_s']:.0f} s", flush=True)
    dec, cfg = rt.dec, w.cfg
    pf = ChunkPrefill(dec, a.prompt, 8, "rows", gemm="mma")
    pf.compile()
    pf._slots = dec.rt.tier.slot_table()
    pfh = ChunkPrefill(dec, a.prompt, 8, "rows", gemm="hgemm")  # the same kernels; _qmm takes qmm.hgemm
    rng = np.random.default_rng(0)

    # 1. dense shapes ------------------------------------------------------------------------------------------
    if "dense" not in skip:
        rows_out = []
        seen = set()
        names = dense_names(w.model, cfg)
        print(f"\ndense: {len(names)} matrices of layers with a recurrent / attention mixer; T in {a.tokens}")
        print(f"{'matrix':34s} {'type':5s} {'rows x cols':>13s} {'T':>4s} {'sgemm ms':>9s} {'qmm ms':>8s} "
              f"{'hgemm ms':>8s} {'sgemm TF/s':>10s} {'qmm TF/s':>9s} {'hgemm TF/s':>10s} {'s/q':>6s} {'s/h':>6s} "
              f"{'q/h':>6s} {'qmm diff':>9s} {'hgemm diff':>10s}")
        for name in names:
            raw, t, R, Kc = pf._raw_dev(name)
            kind = "Q8R" if type(raw).__name__ == "_Q8RRows" else t.name
            key = (kind, R, Kc)
            if key in seen:
                continue
            seen.add(key)
            for T in [int(v) for v in a.tokens.split(",")]:
                X = cp.asarray(rng.standard_normal((T, Kc)).astype(np.float32))
                yq = pf._qmm(X, raw, t, R, Kc)
                if yq is None:
                    print(f"{name:34s} {kind:5s} {R:6d}x{Kc:<6d}: no qmm kernel for this layout")
                    break

                def run_sgemm():
                    return cp.matmul(X, pf._dequant(raw, t, R, Kc).T)

                ys = run_sgemm()
                yh = pfh._qmm(X, raw, t, R, Kc, name)  # the first call checks the matrix against fp16's range
                rel = float(cp.abs(yq - ys).max() / cp.abs(ys).max())
                rel_h = float(cp.abs(yh - ys).max() / cp.abs(ys).max())
                ms_s = cuda_ms(cp, run_sgemm, a.reps)
                ms_q = cuda_ms(cp, lambda: pf._qmm(X, raw, t, R, Kc), a.reps)
                ms_h = cuda_ms(cp, lambda: pfh._qmm(X, raw, t, R, Kc, name), a.reps)
                fl = 2.0 * T * R * Kc
                r = {"matrix": name, "layout": kind, "rows": R, "cols": Kc, "T": T, "sgemm_ms": ms_s, "qmm_ms": ms_q,
                     "hgemm_ms": ms_h, "sgemm_tflops": fl / ms_s / 1e9, "qmm_tflops": fl / ms_q / 1e9,
                     "hgemm_tflops": fl / ms_h / 1e9, "ratio": ms_s / ms_q, "ratio_sgemm_hgemm": ms_s / ms_h,
                     "ratio_qmm_hgemm": ms_q / ms_h, "rel_diff": rel, "hgemm_rel_diff": rel_h,
                     "hgemm_fits_fp16": pfh._hgemm_fits().get(name)}
                rows_out.append(r)
                print(f"{name:34s} {kind:5s} {R:6d}x{Kc:<6d} {T:4d} {ms_s:9.3f} {ms_q:8.3f} {ms_h:8.3f} "
                      f"{r['sgemm_tflops']:10.2f} {r['qmm_tflops']:9.2f} {r['hgemm_tflops']:10.2f} {r['ratio']:6.2f} "
                      f"{ms_s / ms_h:6.2f} {ms_q / ms_h:6.2f} {rel:9.2e} {rel_h:10.2e}"
                      + ("" if r["hgemm_fits_fp16"] else "  (past fp16: hgemm ran mma)"), flush=True)
        res["dense"] = rows_out
        for T in [int(v) for v in a.tokens.split(",")]:
            sel = [r for r in rows_out if r["T"] == T]
            if sel:
                ts, tq = sum(r["sgemm_ms"] for r in sel), sum(r["qmm_ms"] for r in sel)
                th = sum(r["hgemm_ms"] for r in sel)
                print(f"  T={T:4d}: all shapes once: sgemm {ts:.3f} ms, qmm {tq:.3f} ms, hgemm {th:.3f} ms; "
                      f"sgemm/qmm {ts / tq:.2f}, sgemm/hgemm {ts / th:.2f}, qmm/hgemm {tq / th:.2f}")
        free_device(cp)

    # 2. routed experts of one chunk ---------------------------------------------------------------------------
    if "experts" not in skip:
        T = a.prompt
        x = cp.asarray((rng.standard_normal((T, cfg.n_embd)) * 0.5).astype(np.float32))
        ids_r, _ = pf._route(0, x)
        ly = dec.rt.tier.arena.layers[0]
        y_rows = pf._experts_rows(0, x, ids_r)
        y_mma = pf._experts_mma(0, x, ids_r)
        rel = float(cp.abs(y_mma - y_rows).max() / cp.abs(y_rows).max())
        ms_r = cuda_ms(cp, lambda: pf._experts_rows(0, x, ids_r), max(3, a.reps // 4))
        ms_m = cuda_ms(cp, lambda: pf._experts_mma(0, x, ids_r), max(3, a.reps // 4))
        n_pairs = int(ids_r.size)
        fl = 2.0 * n_pairs * 3 * ly.hidden * ly.ff
        res["experts"] = {"T": T, "pairs": n_pairs, "gu_type": ly.gu_type.name, "d_type": ly.d_type.name,
                          "rows_ms": ms_r, "mma_ms": ms_m, "ratio": ms_r / ms_m, "rel_diff": rel,
                          "rows_tflops": fl / ms_r / 1e9, "mma_tflops": fl / ms_m / 1e9}
        print(f"\nrouted experts, layer 0, {T} tokens x k={pf.k} ({ly.gu_type.name}/{ly.d_type.name}, hidden {ly.hidden}, "
              f"ff {ly.ff}): rows {ms_r:.2f} ms ({fl / ms_r / 1e9:.1f} TFLOP/s useful), mma {ms_m:.2f} ms "
              f"({fl / ms_m / 1e9:.1f} TFLOP/s), rows/mma {ms_r / ms_m:.2f}x, rel diff {rel:.2e}", flush=True)
        free_device(cp)

    # 3. the prefill with both settings -------------------------------------------------------------------------
    if "prefill" not in skip:
        out = {}
        names = ["sgemm"] + [v for v in a.prefill_variants.split(",") if v and v != "sgemm"]
        for name in names:
            if name not in PREFILL_VARIANTS:
                raise SystemExit(f"--prefill-variants: {name!r} is not one of {', '.join(PREFILL_VARIANTS)}")
        for name in names:
            with env_vars(PREFILL_VARIANTS[name]):
                dec.load_state(rt.new_state())
                # a new prefiller a variant: the decoder keeps one while chunk, GEMM path, stream and job size stay
                # the same, and its CUDA graph holds the kernels the first variant chose (a later variant that only
                # changed another switch replayed it)
                dec._prefiller = None
                dec.prefill(warm)  # builds this setting's prefiller, compiles its kernels
                times = []
                g0 = {k: dec.stats.get(k, 0) for k in ("prefill_graph_captures", "prefill_graph_replays")}
                for _ in range(a.prefill_reps):  # the best of the repetitions (the first of a row is the slowest)
                    dec.load_state(rt.new_state())
                    cp.cuda.Device().synchronize()
                    t0 = time.perf_counter()
                    lg, tids, _ = dec.prefill(prompt)
                    lg_h = cp.asnumpy(lg).astype(np.float64)
                    times.append(time.perf_counter() - t0)
                best = min(times)
                out[name] = (best, lg_h, tids)
                # the prefill's CUDA graph (full chunks): the first full chunk runs eagerly and is captured, later
                # ones replay it; the first repetition's time says what a prompt costs before that
                graph = {k: dec.stats.get(k, 0) - g0[k] for k in g0}
                graph["error"] = dec.stats.get("prefill_graph_error")
                res[f"{name}_reps_s"] = times
                res[f"{name}_graph"] = graph
                print(f"prefill {a.prompt} tokens, {name:12s}: {a.prompt / best:9.1f} tok/s ({best:.3f} s, best of "
                      f"{a.prefill_reps}; first {a.prompt / times[0]:.1f} tok/s, median "
                      f"{a.prompt / float(np.median(times)):.1f}; graph captures {graph['prefill_graph_captures']}, "
                      f"replays {graph['prefill_graph_replays']}{', error ' + graph['error'] if graph['error'] else ''})",
                      flush=True)
                if name != "sgemm":
                    p2 = dec.prefiller()
                    dec.load_state(rt.new_state())
                    p2.timing, p2._tlast = {}, None
                    cp.cuda.Device().synchronize()
                    t0 = time.perf_counter()
                    dec.prefill(prompt)
                    cp.cuda.Device().synchronize()
                    tot = time.perf_counter() - t0
                    p2.timing.pop("end", None)
                    res[f"{name}_breakdown_s"] = dict(p2.timing)
                    print_breakdown(f"one {name} prefill", p2.timing, tot)
                    p2.timing = None
                    if a.kernel_profile:
                        dec.load_state(rt.new_state())
                        res[f"{name}_kernels"] = prefill_profile(cp, lambda: dec.prefill(prompt), name, a.prompt)
        ds, ls, is_ = out["sgemm"]
        total = is_.shape[0] * is_.shape[1]
        res["prefill"] = {"sgemm_tok_s": a.prompt / ds}
        for name in names[1:]:
            dm, lm, im = out[name]
            rel = float(np.abs(lm - ls).max() / np.abs(ls).max())
            same = int(sum(set(is_[t, l].tolist()) == set(im[t, l].tolist())
                           for t in range(is_.shape[0]) for l in range(is_.shape[1])))
            res["prefill"].update({f"{name}_tok_s": a.prompt / dm, f"{name}_ratio": ds / dm,
                                   f"{name}_logits_rel": rel, f"{name}_topk_agree": same / total})
            print(f"prefill {name}/sgemm {ds / dm:.2f}x ({a.prompt / dm:.1f} tok/s); last logits rel. error {rel:.2e}; "
                  f"router top-k agreement {same}/{total} = {same / total:.4%}", flush=True)
    if a.out:
        from stratatools.core.fsutil import write_json_atomic

        write_json_atomic(a.out, res)


if __name__ == "__main__":
    main()
