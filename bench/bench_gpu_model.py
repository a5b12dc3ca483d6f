"""Whole-model decode benchmark on the GPU (issue 7.4/7.5): every ratio is against a baseline measured in this run.

1. Ceiling: device-to-device copy bandwidth (bytes read + written per second).
2. For each expert type mix, ``stratatools synth --full-width --no-revisions`` writes the full-width synthetic model
   (hidden 2560, expert width 640, 512 experts, k 10, 8 layers) on this machine (time, size), the runtime loads it
   with CuPy (:class:`stratatools.runtime.gpu.runtime.GPURuntime`, every expert in VRAM), prefills a prompt, then decodes at
   batch 1, greedy, after warm-up:
   * ``runtime_eager``: ``GPURuntime.forward`` one token at a time (the generic numpy/CuPy forward);
   * ``static_eager``: :class:`stratatools.runtime.gpu.decode.StaticDecoder` without a graph;
   * ``static_graph``: the same step replayed from one CUDA graph (upload of the token's inputs, graph, arg-max
     read back: one host synchronisation per token); ``static_graph_rec`` also reads the routing back per token
     and does the tier bookkeeping.
   Correctness: the decoder's logits and routed sets against ``GPURuntime.forward`` on the same tokens.
   Roofline: bytes of weights the step touches per token (file bytes: every dense matrix of every layer except
   the QSA indexer, which the full-selection context skips, + k routed expert blobs + the shared expert + router
   + output head) over the copy bandwidth, divided by the measured time per token.
3. transformers eager: ``Qwen4ExpForCausalLM`` with the same config (from the GGUF), random bf16 weights, on the
   same GPU, ``attn_implementation="eager"``, experts implementation ``eager``, decode with its cache.

Usage: python bench/bench_gpu_model.py --workdir /tmp/fw [--layers 8] [--steps 100] [--out res.json]
       python bench/bench_gpu_model.py --run-table [bench_gpu_run.py options]   (``stratatools run --device gpu``
       on the 48x256 model, all resident vs offloaded, with llama-bench in the same run)
Prints a table last; writes JSON with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {"Q2_0": "gu=Q2_0,down=Q2_0", "IQ2_XS+IQ4_NL": "gu=IQ2_XS,down=IQ4_NL"}


def copy_bw(cp, nbytes=4 << 30):
    a = cp.empty(nbytes, dtype=cp.uint8)
    b = cp.empty(nbytes, dtype=cp.uint8)
    a.fill(1)
    s = cp.cuda.get_current_stream()
    for _ in range(2):
        cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, s.ptr)
    ts = []
    for _ in range(10):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, s.ptr)
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * nbytes / float(np.median(ts))


def synth(workdir: Path, name: str, types: str, layers: int) -> dict:
    out = workdir / name.replace("+", "_")
    code = ("import sys; from stratatools.cli import main; main(sys.argv[1:])")
    cmd = [sys.executable, "-c", code, "synth", str(out), "--full-width", "--no-revisions", "--layers", str(layers),
           "--types", types, "--force", "--json"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))})
    sec = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"synth failed ({r.returncode}): {r.stderr[-2000:]}")
    ggufs = sorted(out.glob("*.gguf"))
    size = sum(p.stat().st_size for p in ggufs)
    return {"dir": str(out), "gguf": str(ggufs[0]), "files": [p.name for p in ggufs], "seconds": sec, "bytes": size,
            "gb_s": size / sec / 1e9}


def touched_bytes(w, k: int) -> dict:
    """File bytes the static decode step reads per token (see module docstring)."""
    m, cfg = w.model, w.cfg
    dense = experts = emb = idx = 0
    for t in m.iter_tensors():
        nb = int(t.nbytes)
        name = t.name
        if name in ("token_embd.weight", "per_layer_token_embd.weight"):
            rows = 1 if name == "token_embd.weight" else (cfg.ple_ngram - 1) * cfg.ple_heads_per_ngram * len(cfg.ple_layers)
            emb += rows * t.type.row_bytes(int(t.ne[0]))
        elif "_exps" in name:
            experts += nb * k // int(t.ne[2])
        elif ".indexer." in name:
            idx += nb
        elif name.startswith("blk.") and int(name.split(".")[1]) >= cfg.n_layer:
            continue  # MTP block
        else:
            dense += nb
    return {"dense": dense, "experts": experts, "embedding_rows": emb, "indexer_skipped": idx,
            "total": dense + experts + emb}


def _sync_time(cp, fn, n):
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / n


def bench_variant(cp, gguf: str, steps: int, prompt_len: int, n_check: int, eager_steps: int) -> dict:
    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    res: dict = {}
    t0 = time.perf_counter()
    w = load(gguf, xp=cp)
    rt = GPURuntime(w)
    cp.cuda.Device().synchronize()
    res["load_s"] = time.perf_counter() - t0
    res["arena_bytes"] = rt.arena.nbytes
    cfg = w.cfg
    res["config"] = {k: v for k, v in cfg.to_dict().items() if not k.startswith("ple_mult") and k not in ("ple_head_offsets", "ple_head_vocab")}
    res["touched"] = touched_bytes(w, cfg.n_expert_used)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, min(cfg.n_vocab, 256), prompt_len).tolist()
    # 1. the generic forward, one token per call
    st = rt.new_state()
    t0 = time.perf_counter()
    lg, _ = rt.forward(prompt, st)
    cp.cuda.Device().synchronize()
    res["prefill_s"] = time.perf_counter() - t0
    tok = int(lg.argmax().get())
    for _ in range(2):
        lg, _ = rt.forward([tok], st)
        tok = int(lg.argmax().get())
    t0 = time.perf_counter()
    for _ in range(eager_steps):
        lg, _ = rt.forward([tok], st)
        tok = int(lg.argmax().get())
    res["runtime_eager_s"] = (time.perf_counter() - t0) / eager_steps
    print(f"  runtime eager: {1 / res['runtime_eager_s']:.1f} tok/s", flush=True)
    # 2. static decoder, reference step (fast=False) then optimised step (fast=True): correctness against the
    # forward, eager timing, graph timing
    n_ctx = min(max_full_context(cfg, rt.selection), prompt_len + 2 + eager_steps + n_check + 2 * steps + 64, 4096)
    decs = {}
    for mode, fast in (("ref", False), ("fast", True)):
        r = res if fast else res.setdefault("ref", {})
        dec = decs[mode] = StaticDecoder(rt, max_ctx=n_ctx, fast=fast)
        _bench_decoder(cp, rt, dec, cfg, prompt, n_check, steps, r)
        print(f"  [{mode}] static graph: {1 / r.get('static_graph_s', float('nan')):.1f} tok/s", flush=True)
    try:
        res["matvec_kernels"] = _time_matvecs(cp, decs["fast"])
        mk = res["matvec_kernels"]
        print(f"  dense matvecs per token: reference {mk['ref_s'] * 1e6:.0f} us, tiled {mk['tiled_s'] * 1e6:.0f} us "
              f"({mk['bytes'] / 1e6:.0f} MB)", flush=True)
    except Exception as e:
        res["matvec_error"] = repr(e)
    dec = decs["fast"]
    res["decoder_pos"] = dec.pos
    res["max_ctx"] = n_ctx
    del dec, decs, rt, w
    cp.get_default_memory_pool().free_all_blocks()
    return res


def _check(cp, rt, dec, cfg, prompt, n_check):
    st = rt.new_state()
    lg, _ = rt.forward(prompt, st)
    dec.load_state(st)
    tok = int(lg.argmax().get())
    worst, same, total = 0.0, 0, 0
    for _ in range(n_check):
        ref, rec = rt.forward([tok], st)
        got = dec.step(tok)
        ids, _ = dec.routing()
        r64, g64 = ref.get().astype(np.float64), got.get().astype(np.float64)
        worst = max(worst, float(np.abs(r64 - g64).max() / np.abs(r64).max()))
        same += sum(set(rec.ids[l][0].tolist()) == set(ids[l].tolist()) for l in range(cfg.n_layer))
        total += cfg.n_layer
        tok = int(r64.argmax())
    return {"max_rel_logits": worst, "topk_agree": same / total, "steps": n_check}, tok


def _bench_decoder(cp, rt, dec, cfg, prompt, n_check, steps, res):
    """Correctness (eager and graph) against rt.forward and timings of one StaticDecoder into res."""
    res["check_eager"], tok = _check(cp, rt, dec, cfg, prompt, n_check)

    def step_eager():
        nonlocal tok
        dec.step(tok)
        tok = dec.next_token()

    for _ in range(3):
        step_eager()
    res["static_eager_s"] = _sync_time(cp, step_eager, max(10, steps // 4))
    try:
        t0 = time.perf_counter()
        dec.capture()
        res["capture_s"] = time.perf_counter() - t0
        res["check_graph"], tok = _check(cp, rt, dec, cfg, prompt, n_check)
        for _ in range(5):
            step_eager()
        res["static_graph_s"] = _sync_time(cp, step_eager, steps)

        def step_rec():
            step_eager()
            dec.routing()

        res["static_graph_rec_s"] = _sync_time(cp, step_rec, max(10, steps // 2))
        s = dec._stream
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        reps = 20
        e0.record(s)
        for _ in range(reps):
            for g in dec.graphs:
                g.launch(stream=s)
        e1.record(s)
        e1.synchronize()
        res["graph_replay_device_s"] = cp.cuda.get_elapsed_time(e0, e1) / 1e3 / reps
    except Exception as e:  # report and keep going
        res["graph_error"] = repr(e)
        res["graph_traceback"] = traceback.format_exc()[-3000:]
        print("  graph failed:", repr(e), flush=True)
    res["decoder_pos"] = dec.pos


def _time_matvecs(cp, dec, reps: int = 10) -> dict:
    """Device time of all the dense matvecs of one step (every matrix the step ran, once each, 570+ MB: not
    L2-resident), reference kernel vs tiled kernel: each set captured into one CUDA graph (no launch gaps from
    Python), replays timed with events, median of ``reps``."""
    from stratatools.runtime.gpu.experts import THREADS, WARPS_PER_BLOCK
    from stratatools.runtime.gpu.kernels import kernel, matvec_tiled_launch

    jobs = []
    nbytes = 0
    for name, (raw, t, rows, cols) in dec._raw.items():
        if raw is None or not hasattr(raw, "data"):  # (a re-laid-out Q8_0 matrix has no GGUF blocks to time)
            continue
        x = cp.asarray(np.random.default_rng(1).normal(0, 1, cols).astype(np.float32))
        y = cp.empty(rows, dtype=cp.float32)
        jobs.append((raw, t, rows, cols, x, y))
        nbytes += int(raw.size)

    def run_ref():
        for raw, t, rows, cols, x, y in jobs:
            grid = ((rows + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK,)
            kernel("matvec_kernel", t.id)(grid, (THREADS,), (raw, x, y, np.int32(rows), np.int32(cols)), shared_mem=cols * 4)

    def run_tiled():
        for raw, t, rows, cols, x, y in jobs:
            matvec_tiled_launch(raw, x, y, t.id, rows, cols)

    out = {"bytes": nbytes, "matrices": len(jobs)}
    s = cp.cuda.Stream(non_blocking=True)
    for key, fn in (("ref_s", run_ref), ("tiled_s", run_tiled)):
        with s:
            fn()
            s.synchronize()
            s.begin_capture()
            fn()
            g = s.end_capture()
        g.launch(stream=s)
        ts = []
        for _ in range(reps):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            g.launch(stream=s)
            e1.record(s)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
        out[key] = float(np.median(ts))
    return out


def hf_config(cfg):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    sec = [int(v) for v in cfg.rope_sections[:3]]
    if sum(sec) != cfg.n_rot // 2:
        half = cfg.n_rot // 2
        sec = [half - 2 * (half // 3), half // 3, half // 3]
    idx = next(i for i in range(cfg.n_layer) if not cfg.recurrent[i])
    return Qwen4ExpTextConfig(
        vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head_kv, head_dim=cfg.head_dim, rms_norm_eps=cfg.eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.n_rot / cfg.head_dim,
                         "mrope_section": sec, "mrope_interleaved": True},
        linear_conv_kernel_dim=cfg.ssm_conv_kernel, linear_key_head_dim=cfg.ssm_d_state,
        linear_value_head_dim=cfg.ssm_head_v_dim, linear_num_key_heads=cfg.ssm_n_group,
        linear_num_value_heads=cfg.ssm_dt_rank, moe_intermediate_size=cfg.n_ff_exp,
        shared_expert_intermediate_size=cfg.n_ff_shexp, num_experts_per_tok=cfg.n_expert_used,
        num_experts=max(cfg.n_expert), norm_topk_prob=cfg.norm_topk,
        layer_types=["linear_attention" if r else "full_attention" for r in cfg.recurrent],
        hc_count=cfg.hc_count, hc_lowrank=cfg.hc_lowrank, ple_layer_ids=[l + 1 for l in cfg.ple_layers],
        ple_embed_dim=cfg.ple_head_dim * cfg.ple_heads_per_ngram * (cfg.ple_ngram - 1),
        ple_conv_kernel_size=cfg.ple_conv_kernel, ngram_size=cfg.ple_ngram, heads_per_ngram=cfg.ple_heads_per_ngram,
        ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=1,
        indexer_n_heads=cfg.idx_n_head, indexer_kv_heads=1, indexer_head_dim=cfg.idx_head_dim,
        indexer_budget=cfg.idx_budget, indexer_compress_ratio=cfg.compress_ratios[idx],
        output_gate_type=cfg.output_gate, eos_token_id=cfg.eos_id, max_position_embeddings=8192)


def bench_hf(cfg, steps: int, prompt_len: int, impl: str = "eager") -> dict:
    import torch
    import transformers
    from transformers import Qwen4ExpForCausalLM

    hc = hf_config(cfg)
    hc._experts_implementation = impl
    hc._attn_implementation = "eager"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            m = Qwen4ExpForCausalLM(hc).eval()
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in m.parameters())
    rng = np.random.default_rng(0)
    ids = torch.tensor([rng.integers(0, min(cfg.n_vocab, 256), prompt_len).tolist()], device="cuda")
    with torch.no_grad():
        out = m(input_ids=ids, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[0, -1].argmax()

        def one():
            nonlocal past, nxt
            o = m(input_ids=nxt.view(1, 1), past_key_values=past, use_cache=True)
            past = o.past_key_values
            nxt = o.logits[0, -1].argmax()
            int(nxt.item())

        for _ in range(3):
            one()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            one()
        torch.cuda.synchronize()
        sec = (time.perf_counter() - t0) / steps
    res = {"transformers": transformers.__version__, "torch": torch.__version__, "impl": impl, "dtype": "bfloat16",
           "seconds": sec, "build_s": build_s, "params": n_params}
    del m, past, out
    torch.cuda.empty_cache()
    return res


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--run-table" in argv:  # issue 17/12's table: stratatools run --device gpu against llama.cpp
        import runpy

        argv.remove("--run-table")
        sys.argv = [str(Path(__file__).with_name("bench_gpu_run.py"))] + argv
        runpy.run_path(sys.argv[0], run_name="__main__")
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/fw")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eager-steps", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--check", type=int, default=4)
    ap.add_argument("--hf-steps", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="bench_gpu_model.json")
    a = ap.parse_args(argv)
    import cupy as cp

    res = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "layers": a.layers, "variants": {}}
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    res["copy_bw"] = copy_bw(cp)
    print(f"D2D copy {res['copy_bw'] / 1e12:.2f} TB/s", flush=True)

    def save():
        res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(a.out).write_text(json.dumps(res, indent=2, default=str))

    cfg = None
    for name in a.variants.split(","):
        v: dict = {}
        res["variants"][name] = v
        try:
            v["synth"] = syn = synth(wd, name, VARIANTS[name], a.layers)
            print(f"{name}: synth {syn['bytes'] / 1e9:.2f} GB in {syn['seconds']:.1f} s", flush=True)
            v.update(bench_variant(cp, syn["gguf"], a.steps, a.prompt, a.check, a.eager_steps))
            if cfg is None:
                from stratatools.runtime.weights import load
                cfg = load(syn["gguf"]).cfg
            for f in Path(syn["dir"]).glob("*.gguf"):
                f.unlink()  # disk: one model at a time
        except Exception as e:
            v["error"] = repr(e)
            v["traceback"] = traceback.format_exc()[-3000:]
            print(name, "failed:", repr(e), flush=True)
        save()
    if not a.skip_hf and cfg is not None:
        res["hf"] = []
        for impl in ("eager",):
            try:
                res["hf"].append(bench_hf(cfg, a.hf_steps, a.prompt, impl))
            except Exception as e:
                res["hf"].append({"impl": impl, "error": repr(e), "traceback": traceback.format_exc()[-3000:]})
            print("transformers:", {k: v for k, v in res["hf"][-1].items() if k != "traceback"}, flush=True)
    save()
    bw = res["copy_bw"]
    hf = next((h for h in res.get("hf", []) if "seconds" in h), None)
    print(f"\ndevice {res['device']}; D2D copy {bw / 1e12:.2f} TB/s; peak RSS {res['peak_rss_mib']:.0f} MiB")
    if hf:
        print(f"transformers {hf['transformers']} eager bf16 whole model: {1 / hf['seconds']:.1f} tok/s")
    for name, v in res["variants"].items():
        if "touched" not in v:
            print(name, "error:", v.get("error"))
            continue
        tb = v["touched"]["total"]
        roof = tb / bw
        print(f"{name}: synth {v['synth']['bytes'] / 1e9:.2f} GB in {v['synth']['seconds']:.1f} s; "
              f"touched/token {tb / 1e6:.1f} MB (roofline {1 / roof:.0f} tok/s)")
        for key in ("runtime_eager_s", "static_eager_s", "static_graph_s", "static_graph_rec_s", "graph_replay_device_s"):
            if key in v:
                line = f"   {key[:-2]:22s} {1 / v[key]:8.1f} tok/s  roofline fraction {roof / v[key]:.3f}"
                if hf:
                    line += f"  x{hf['seconds'] / v[key]:.2f} transformers eager"
                print(line)
        for key in ("static_eager_s", "static_graph_s", "graph_replay_device_s"):
            if key in v.get("ref", {}):
                line = f"   ref {key[:-2]:18s} {1 / v['ref'][key]:8.1f} tok/s  roofline fraction {roof / v['ref'][key]:.3f}"
                if hf:
                    line += f"  x{hf['seconds'] / v['ref'][key]:.2f} transformers eager"
                print(line)
        if "matvec_kernels" in v:
            mk = v["matvec_kernels"]
            print(f"   dense matvecs: reference {mk['ref_s'] * 1e6:.0f} us ({mk['bytes'] / mk['ref_s'] / 1e12:.2f} TB/s), "
                  f"tiled {mk['tiled_s'] * 1e6:.0f} us ({mk['bytes'] / mk['tiled_s'] / 1e12:.2f} TB/s)")
        print("   check eager:", v.get("check_eager"), " graph:", v.get("check_graph"), v.get("graph_error", ""))
        if "ref" in v:
            print("   ref check eager:", v["ref"].get("check_eager"), " graph:", v["ref"].get("check_graph"),
                  v["ref"].get("graph_error", ""))


if __name__ == "__main__":
    main()
