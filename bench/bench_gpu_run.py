"""``stratatools run --device gpu`` on the full-width synthetic model, with llama.cpp in the same run (issue 17's
table, issue 12's ratios). A benchmark, not a timed test: every ratio is against numbers measured in this run.

Steps: start the llama.cpp anchor build (``--anchor DIR``: ``llama-anchor.sh``, in the background), synthesize the
model (``stratatools synth --full-width --layers L --experts E --types T``, ``--types`` default
``gu=Q2_0,down=Q2_0``; issue 12's variant: ``--types gu=IQ2_XS,down=IQ4_NL``), measure the
device-to-device copy and pinned host-to-device copy rates, then run one prompt of ``--prompt`` tokens and
``--new`` greedy tokens for each tier configuration (all resident; ``--slots`` with static, adaptive, LRU), and
llama-bench tg128/pp512 on the same GGUF. Prints one row per configuration: decode and prefill tok/s, their
ratio to llama.cpp, decode roofline fraction (bytes the step touches per token / copy rate), decode hit rate,
bytes moved per token, device memory used.

Prompts: the shipped prompt suite (``data/prompts/suite.json`` via :func:`stratatools.core.resources.packaged`),
its texts joined in file order and tokenized with the model's own tokenizer, cut to ``--prompt`` (and ``--long``)
tokens, so that the synthetic model routes as it does on real text.

Decoder comparison (``--compare-steps N``, all resident, one loaded model): the reference step, the earlier fast
step (``fused=False``) and the fused step (:class:`stratatools.runtime.gpu.decode.StaticDecoder`), each replayed
from its graph on the same tokens (prompt, then the reference's greedy tokens): logits relative error and router
top-k agreement of both fast steps against the reference (issue 12 item 4: <= 1e-3, >= 99.5%), and each one's
decode-loop time per step (graph replay + copy-back of next token and routing; the engine's bookkeeping left out).
``--configs`` picks the ``run --device gpu`` rows (``resident``, ``unfused``: all resident on the earlier fast step,
the baseline measured in the same run; ``static`` (two rows: arrival order, and a profile made from routing the
runtime recorded on the next ``--prompt`` tokens of the suite), ``adaptive``, ``lru``, ``vram12``, ``longres`` and
``long`` (all resident and ``--vram-gib 12`` LRU at each ``--long`` context), ``allmiss`` (0 slots: every routed
expert read from pinned host memory; its host->device rate during decode is printed as a fraction of the measured
pinned copy rate, the bound of an all-miss run); ``before`` and ``lrubefore``: all resident and ``--slots`` LRU as
they ran before the re-laid-out Q8_0 matvec and the lagged bookkeeping (``STRATATOOLS_DENSE_Q8=0
STRATATOOLS_DECODE_LAG=0 STRATATOOLS_DECODE_QUEUE=0``), the baseline measured in the same run; ``noqueue``,
``staticprofnoqueue``, ``lrunoqueue``: steps not queued (``STRATATOOLS_DECODE_QUEUE=0``, the default before), ``noside``,
``staticprofnoside``, ``vram12noside``: the shared expert after the routed ones (``STRATATOOLS_SHARED_SIDE=0``, the default
before), ``hcq8i``: every re-laid-out Q8_0 matrix on ``mv_q8i``, the hyper-connection down projections included
(``STRATATOOLS_DENSE_MIN_ROWS=0``), ``hcsplit1``, ``hcsplit2``, ``hcsplit4``: ``mv_q8r``'s row split aiming at 1, 2 or 4 blocks per SM
(``STRATATOOLS_DQ_SPLIT_BLOCKS``, default 1; 4 before), ``routeblock``: the router's top-k by one block
(``STRATATOOLS_ROUTE_WARP=0``, before), ``nopdl``, ``staticprofnopdl``, ``vram12nopdl``: the step's kernels launched
without programmatic dependent launch inside its graphs (``STRATATOOLS_PDL=0``, before), ``int8``, ``staticprofint8``: the Q2_0 experts' integer pipelined kernels for gate/up and down
(``STRATATOOLS_MOE_INT8=1``; the default: gate/up only), ``float``, ``staticproffloat``: neither (``=0``, before), ``queue``
and the like: queued whatever the tables' size (``=1``); ``staticprofmixer``, ``lrumixer``, ``vram12mixer``: the next
layer's prefetch started at the token mixer (``STRATATOOLS_PREFETCH_ORDER=mixer``); ``lruasync``, ``adaptiveasync``: ``--slots`` LRU
and adaptive with the admitted experts copied alongside the next step (``STRATATOOLS_ASYNC_SWAPS=1``); ``pipeexp``,
``allmisspipe``: all resident and 0 slots on the pipelined expert kernels (``STRATATOOLS_MOE_KERNEL=pipe``, shapes from
``STRATATOOLS_MOE_PIPE``), against ``resident`` / ``allmiss`` on the default kernels in the same run;
``staticproffetch``, ``lrufetch``, ``vram12fetch``, ``allmissfetch`` and the same with ``zc``, ``pf`` or ``pf0`` for
``fetch``: those configurations with ``STRATATOOLS_MISS_FETCH=fetch`` / ``zero-copy`` / ``prefetch`` (the default, which
the rows without a suffix run) / ``prefetch`` with ``STRATATOOLS_PREFETCH_EXTRA=0``, each printing its fetched and
prefetched bytes per step and the share of misses a prefetched copy served). The kernel
profile (:func:`profile_plan`: the all-resident step, every selected all-resident row, and with ``--profile-lru``
every selected ``--slots`` LRU row) runs each under its row's ``_env``, as the timed row runs, and prints the dense
Q8_0 matvecs' bandwidth (bytes of the step's Q8_0 matrices / their kernels' time). The expert types have
pipelined kernels only for Q2_0 and Q8_0 (``PIPE_TYPES``): with other ``--types`` the rows that ask for them
(``resident``, ``pipeexp``) run the routed experts on the staged kernels (the shared expert, Q8_0, stays pipelined).

Usage: python bench/bench_gpu_run.py --workdir /tmp/fw [--layers 48 --experts 256 --slots 1872]
       [--long 2048,8192] [--anchor ../shared/anchors] [--configs resident,unfused,lru] [--compare-steps 32]
       [--types gu=IQ2_XS,down=IQ4_NL] [--out res.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


@contextlib.contextmanager
def env_vars(extra: dict):
    """Environment variables set for the enclosed block (the decoder's before/after switches)."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: The state before the faster decode step (GGUF-block Q8_0 matvecs, bookkeeping before each launch).
BEFORE_ENV = {"STRATATOOLS_DENSE_Q8": "0", "STRATATOOLS_DECODE_LAG": "0", "STRATATOOLS_DECODE_QUEUE": "0"}


def dense_q8_bytes(dec) -> int:
    """Bytes of the Q8_0 dense matrices one step of ``dec`` reads (each once a step)."""
    m = dec.w.model
    n = sum(int(raw.size) for raw, t, _, _ in dec._raw.values() if raw is not None and t.id == 8)
    for names, (raw, _) in dec._raw_groups.items():
        if m.tensor(names[0]).type.id == 8:
            n += int(raw.size)
    return n


def kernel_profile(cp, gguf: str, prompt_ids: list, steps: int, slots: int | None, policy: str,
                   fused: bool = True, extra_env: dict | None = None, profile_path: str | None = None,
                   trace_out: str | None = None) -> list:
    """Per-kernel device time of ``steps`` graph-replayed decode steps (CUPTI through torch.profiler, which
    records every CUDA kernel of the process, CuPy's included), everything under the environment ``extra_env``
    (a config row's ``_env``), the tier filled from the STRP ``profile_path`` when given. Returns rows (kernel, total ms,
    calls, share), sorted by time, and a last row ("dense Q8_0 bytes/step", bytes, 0, 0); [] when torch's profiler is
    not there. With ``trace_out`` the run's Chrome trace is written there and a last row ("timeline", the
    :func:`timeline_summary` dict, 0, 0) follows."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception:  # noqa: BLE001
        return []
    from stratatools.cachesim import make_tier
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    # the row's environment for everything the timed row does under it (load, decoder set-up, graph capture on the
    # first forward, the profiled steps): the decoder reads some switches when it captures, not when it is built
    with env_vars(extra_env or {}):
        w = load(gguf, xp=cp)
        pol = None
        if slots is not None:
            bb = [w.experts.blob_bytes(il) for il in range(w.cfg.n_layer)]
            prof_obj = None
            if profile_path is not None:
                from stratatools.profiles.strp import read_profile

                prof_obj = read_profile(profile_path)
            pol = make_tier(policy, n_layers=w.cfg.n_layer, n_expert=max(w.cfg.n_expert), slots=slots, blob_bytes=bb,
                            profile=prof_obj)
        grt = GPURuntime(w, policy=pol, miss_mode="host")
        rt = DecoderRuntime(grt, max_ctx=len(prompt_ids) + steps + 8, fused=fused)
        st = rt.new_state()
        lg, _ = rt.forward(prompt_ids, st)
        tok = int(lg.argmax().get())
        torch.cuda.init()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                lg, _ = rt.forward([tok], st)  # as generate() drives it: the arg-max the step copied back
                tok = rt.argmax(lg)
                grt.tier.end_round()
            rt.finish()
            cp.cuda.Device().synchronize()
    rows = kernel_rows(prof, steps)
    rows.append(["dense Q8_0 bytes/step", dense_q8_bytes(rt.dec), 0, 0.0])
    if trace_out:
        prof.export_chrome_trace(str(trace_out))
        with open(trace_out) as f:
            rows.append(["timeline", timeline_summary(json.load(f).get("traceEvents", []), steps), 0, 0.0])
    del rt, grt, w
    free_device(cp)
    return rows


def _kernel_name(name: str) -> str:
    """A profiler's kernel name without its ``void `` / ``_Z`` prefix and argument list, at most 60 characters."""
    for pre in ("void ", "_Z"):
        name = name[len(pre):] if name.startswith(pre) else name
    return name.split("(")[0][:60]


def _union_len(iv: list) -> float:
    """Total length of the union of intervals [(start, end)] (same unit), in that unit."""
    tot, cur_s, cur_e = 0.0, None, None
    for a, b in sorted(iv):
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                tot += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    return tot + (cur_e - cur_s if cur_e is not None else 0.0)


def timeline_summary(events: list, steps: int, top: int = 8) -> dict:
    """Where the wall time of ``steps`` profiled decode steps goes, from a Chrome trace's events (``traceEvents`` of
    torch.profiler's export: kernels have ``cat`` "kernel", ``ts`` / ``dur`` in us and ``args.stream``).

    The main stream is the one with the most kernel time. Returns, per step in ms: ``wall`` (first kernel start to
    last kernel end, over ``steps``), ``main_busy`` (union of the main stream's kernels), ``main_gaps`` (wall -
    main_busy), ``gap_before`` (the main stream's idle time before each kernel, summed by kernel name, the ``top``
    largest: a long gap before ``fetch_blobs`` is the wait for the prefetch), ``side`` (per other stream: busy ms,
    kernels, and the ms of its kernels that overlap no main-stream kernel), ``overlap`` (ms of side-stream kernel time
    that runs beside a main-stream kernel), and ``kernels`` per step of each stream."""
    ks = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e and "ts" in e]
    if not ks:
        return {}
    by_stream: dict = {}
    for e in ks:
        by_stream.setdefault((e.get("args") or {}).get("stream", -1), []).append(e)
    main = max(by_stream, key=lambda s: sum(float(e["dur"]) for e in by_stream[s] if e.get("cat") == "kernel"))
    n = max(1, int(steps))
    t0 = min(float(e["ts"]) for e in ks)
    t1 = max(float(e["ts"]) + float(e["dur"]) for e in ks)
    mk = sorted(by_stream[main], key=lambda e: float(e["ts"]))
    miv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in mk]
    busy = _union_len(miv)
    gaps: dict = {}
    end = None
    for e, (a, b) in zip(mk, miv):
        if end is not None and a > end:
            nm = _kernel_name(str(e.get("name", "?")))
            gaps[nm] = gaps.get(nm, 0.0) + (a - end)
        end = b if end is None else max(end, b)
    side = {}
    overlap = 0.0
    for s, evs in by_stream.items():
        if s == main:
            continue
        iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs]
        sb = _union_len(iv)
        both = sb + busy - _union_len(iv + miv)  # |side ∩ main| = |side| + |main| - |side ∪ main|
        overlap += both
        names: dict = {}
        for e in evs:
            nm = _kernel_name(str(e.get("name", "?")))
            names[nm] = names.get(nm, 0.0) + float(e["dur"]) / 1e3 / n
        side[str(s)] = {"busy": sb / 1e3 / n, "kernels": len(evs) / n, "alone": (sb - both) / 1e3 / n,
                        "by_kernel": dict(sorted(names.items(), key=lambda kv: -kv[1])[:top])}
    gap_top = dict(sorted(((k, v / 1e3 / n) for k, v in gaps.items()), key=lambda kv: -kv[1])[:top])
    any_busy = _union_len([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ks])
    host: dict = {}  # host time in the CUDA runtime calls that matter between steps
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
            nm = str(e.get("name", "?"))
            if nm in ("cudaGraphLaunch", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaLaunchKernel",
                      "cuLaunchKernel", "cudaStreamSynchronize"):
                host[nm] = host.get(nm, 0.0) + float(e["dur"]) / 1e3 / n
    return {"main_stream": str(main), "wall": (t1 - t0) / 1e3 / n, "main_busy": busy / 1e3 / n,
            "main_gaps": (t1 - t0 - busy) / 1e3 / n, "gap_before": gap_top, "side": side,
            "overlap": overlap / 1e3 / n, "main_kernels": len(mk) / n,
            "device_idle": (t1 - t0 - any_busy) / 1e3 / n, "host_calls": host}


def print_timeline(name: str, tl: dict) -> None:
    """:func:`timeline_summary`'s dict as a few lines."""
    if not tl:
        print(f"timeline {name}: no kernels", flush=True)
        return
    print(f"\ntimeline of one decode step ({name}): wall {tl['wall']:.3f} ms, main stream busy {tl['main_busy']:.3f} ms "
          f"({tl['main_kernels']:.0f} kernels), idle {tl['main_gaps']:.3f} ms; side streams beside main "
          f"{tl['overlap']:.3f} ms")
    print(f"  device idle (no kernel or copy on any stream) {tl.get('device_idle', float('nan')):.3f} ms; host in "
          + ", ".join(f"{k} {v:.3f}" for k, v in tl.get("host_calls", {}).items()) + " ms a step")
    print("  main-stream idle before: " + ", ".join(f"{k} {v:.3f}" for k, v in tl["gap_before"].items()))
    for s, d in tl["side"].items():
        print(f"  stream {s}: busy {d['busy']:.3f} ms ({d['kernels']:.0f} kernels), alone {d['alone']:.3f} ms; "
              + ", ".join(f"{k} {v:.3f}" for k, v in d["by_kernel"].items()), flush=True)


def profile_run(cp: Any, run: Any, steps: int = 1, shapes: bool = False) -> dict:
    """Run ``run()`` ``steps`` times under torch.profiler (CUPTI) after a device synchronisation: {"rows":
    :func:`kernel_rows` per run, "wall_ms", "device_ms", "launches" per run}, or {} without torch. ``shapes``: also
    "grids" (:func:`grid_rows`: kernel time by launch grid, from the Chrome trace) and "timeline"
    (:func:`timeline_summary`)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception:  # noqa: BLE001
        return {}
    import time

    torch.cuda.init()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        cp.cuda.Device().synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    rows = kernel_rows(prof, steps)
    got = {"wall_ms": wall, "device_ms": sum(r[1] for r in rows), "launches": sum(r[2] for r in rows), "rows": rows}
    if shapes:
        import tempfile

        with tempfile.TemporaryDirectory() as td:
            prof.export_chrome_trace(str(Path(td) / "t.json"))
            with open(Path(td) / "t.json") as f:
                ev = json.load(f).get("traceEvents", [])
        got["grids"] = grid_rows(ev, steps)
        got["timeline"] = timeline_summary(ev, steps)
    return got


def grid_rows(events: list, steps: int) -> list:
    """Kernel time by (kernel, grid, block) from a Chrome trace's events: rows [kernel, grid, block, ms a step,
    launches a step, mean us a launch], longest first (the same kernel's launches on matrices of different shapes
    apart)."""
    agg: dict = {}
    for e in events:
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        a = e.get("args") or {}
        key = (_kernel_name(str(e.get("name", "?"))), str(a.get("grid", "?")), str(a.get("block", "?")))
        v = agg.setdefault(key, [0.0, 0])
        v[0] += float(e["dur"])
        v[1] += 1
    n = max(1, int(steps))
    return sorted(([k[0], k[1], k[2], v[0] / 1e3 / n, v[1] / n, v[0] / v[1]] for k, v in agg.items()),
                  key=lambda r: -r[3])


def kernel_rows(prof: Any, steps: int) -> list:
    """A torch.profiler run's CUDA kernels as rows (kernel, ms a step, launches a step, share of the device time),
    longest first, over ``steps`` steps."""
    agg: dict = {}
    for ev in prof.events():
        if getattr(ev, "device_type", None) is None or "CUDA" not in str(ev.device_type):
            continue
        name = _kernel_name(ev.name)
        t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        a = agg.setdefault(name, [0.0, 0])
        a[0] += t / 1e3
        a[1] += 1
    total = sum(v[0] for v in agg.values()) or 1.0
    return sorted(([k, v[0] / steps, v[1] // steps, v[0] / total] for k, v in agg.items()), key=lambda r: -r[1])


#: ``--types`` default: the full-width synthetic's routed experts in Q2_0 (issue 17's table).
DEFAULT_TYPES = "gu=Q2_0,down=Q2_0"


def synth_argv(mdir: str | os.PathLike, layers: int, experts: int, types: str) -> list[str]:
    """``stratatools synth`` arguments of the benchmark's model (``types``: ``--types``, e.g. ``gu=IQ2_XS,down=IQ4_NL``)."""
    return ["synth", str(mdir), "--full-width", "--no-revisions", "--layers", str(layers), "--experts", str(experts),
            "--types", types, "--force", "--json"]


def full_width_model(workdir: str | os.PathLike, layers: int, experts: int, reuse: bool, gguf: str | None = None,
                     types: str = DEFAULT_TYPES) -> tuple[str, float]:
    """The GGUF a GPU bench runs on: ``gguf`` when given, else ``stratatools synth`` (:func:`synth_argv`) into
    ``workdir/model{layers}x{experts}`` (kept when ``reuse`` finds a GGUF there). Returns (path, seconds it took) and
    prints the model's size."""
    t0 = time.perf_counter()
    if gguf:
        path = str(gguf)
    else:
        mdir = Path(workdir) / f"model{layers}x{experts}"
        if not (reuse and list(mdir.glob("*.gguf"))):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            subprocess.run([sys.executable, "-m", "stratatools"] + synth_argv(mdir, layers, experts, types),
                           check=True, capture_output=True, env=env)
        path = str(sorted(mdir.glob("*.gguf"))[0])
    dt = time.perf_counter() - t0
    print(f"model {path} ({os.path.getsize(path) / 1e9:.1f} GB), synth/reuse {dt:.0f} s", flush=True)
    return path, dt


def print_breakdown(title: str, timing: dict, total_s: float) -> None:
    """A per-part breakdown (``timing``: part -> seconds, host-timed with a synchronisation between parts), largest
    first, in ms and as a share of ``total_s``."""
    print(f"breakdown of {title} (synchronised parts, {total_s * 1e3:.1f} ms in all):")
    for k, v in sorted(timing.items(), key=lambda kv: -kv[1]):
        print(f"  {k:10s} {v * 1e3:8.2f} ms  {v / total_s:6.1%}")


def profile_plan(configs: list, want: set, slots: int, profile_lru: bool) -> list:
    """The kernel profiles to take, as (title, slots, policy, fused, env) with each row's own ``_env`` (and
    ``_fused``): the all-resident fused step first (always), then every selected all-resident row that changes the
    step (an ``_env`` or ``_fused``), and with ``profile_lru`` the ``lru`` row (selected or not) and every other
    selected ``--slots`` LRU row. ``configs``: the (key, title, kw) rows of :func:`main`."""
    plan = [("all resident (fused)", None, "static", True, {})]
    for key, title, kw in configs:
        if any(k in kw for k in ("_prompts", "_profile", "vram_gib")):
            continue
        env, fused = dict(kw.get("_env", {})), kw.get("_fused", True)
        if key in want and "slots" not in kw and (env or not fused):
            plan.append((title, None, "static", fused, env))
        elif (profile_lru and (key in want or key == "lru") and kw.get("slots") == slots
              and kw.get("policy") == "lru"):
            plan.append((title, slots, "lru", fused, env))
    return plan


def config_rows(slots: int) -> list:
    """The ``run --device gpu`` rows as (key, title, run_prompts keywords; ``_env``: environment of the row, its
    kernel profile's too; ``_fused``, ``_profile``, ``_prompts``: see :func:`main`), before the ``--long`` rows."""
    rows = [("resident", "all resident", {}), ("unfused", "all resident, unfused step (before)", {"_fused": False}),
            ("before", "all resident, GGUF-block matvec + bookkeeping before launch (before)", {"_env": BEFORE_ENV}),
            ("rowsdense", "all resident, dense Q8_0 on mv_q8r (before the streaming matvec)",
             {"_env": {"STRATATOOLS_DENSE_KERNEL": "rows"}}),
            ("int8dense", "all resident, dense Q8_0 on mv_q8i (int8 dot products, x in 16-bit fixed point)",
             {"_env": {"STRATATOOLS_DENSE_KERNEL": "int8"}}),
            ("streamdense", "all resident, dense Q8_0 on mv_q8s (float dot products: the default before)",
             {"_env": {"STRATATOOLS_DENSE_KERNEL": "stream"}}),
            ("staticprofstream", f"{slots} slots static on the recorded profile, dense Q8_0 on mv_q8s (before)",
             {"slots": slots, "policy": "static", "_profile": True, "_env": {"STRATATOOLS_DENSE_KERNEL": "stream"}}),
            ("staticprofint8", f"{slots} slots static on the recorded profile, dense Q8_0 on mv_q8i",
             {"slots": slots, "policy": "static", "_profile": True, "_env": {"STRATATOOLS_DENSE_KERNEL": "int8"}}),
            ("stagedexp", "all resident, staged expert kernels (STRATATOOLS_MOE_KERNEL=staged: before)",
             {"_env": {"STRATATOOLS_MOE_KERNEL": "staged"}}),
            ("pipeexp", "all resident, pipelined expert kernels (STRATATOOLS_MOE_KERNEL=pipe)",
             {"_env": {"STRATATOOLS_MOE_KERNEL": "pipe"}}),
            ("allmisspipe", "0 slots, pipelined expert kernels (every expert read from pinned host memory)",
             {"slots": 0, "policy": "static", "_env": {"STRATATOOLS_MOE_KERNEL": "pipe"}}),
            ("lrubefore", f"{slots} slots LRU, GGUF-block matvec + bookkeeping before launch (before)",
             {"slots": slots, "policy": "lru", "_env": BEFORE_ENV}),
            ("lruasync", f"{slots} slots LRU, admissions copied alongside the next step",
             {"slots": slots, "policy": "lru", "_env": {"STRATATOOLS_ASYNC_SWAPS": "1"}}),
            ("adaptiveasync", f"{slots} slots adaptive, admissions copied alongside the next step",
             {"slots": slots, "policy": "adaptive", "_env": {"STRATATOOLS_ASYNC_SWAPS": "1"}}),
            ("static", f"{slots} slots static (arrival order, no profile)", {"slots": slots, "policy": "static"}),
            ("staticprof", f"{slots} slots static, profile recorded by the runtime", {"slots": slots, "policy": "static",
                                                                                   "_profile": True}),
            ("adaptive", f"{slots} slots adaptive", {"slots": slots, "policy": "adaptive"}),
            ("adaptiveprof", f"{slots} slots adaptive, on the profile recorded by the runtime",
             {"slots": slots, "policy": "adaptive", "_profile": True}),
            ("lru", f"{slots} slots LRU", {"slots": slots, "policy": "lru"}),
            ("vram12", "--vram-gib 12, LRU", {"vram_gib": 12.0, "policy": "lru"}),
            ("allmiss", "0 slots (every expert read from pinned host memory)", {"slots": 0, "policy": "static"})]
    # miss fetch modes (decode.MISS_FETCH_ENV; the rows above run the default, prefetch): misses read by the kernels
    # over the bus (zero-copy), copied into device staging by the SMs before the expert kernels (fetch), and the next
    # layer's predicted misses copied ahead on a second stream (prefetch; pf0: the top k only, no extra predictions)
    for mode, tag, extra in (("zero-copy", "zc", {}), ("fetch", "fetch", {}), ("prefetch", "pf", {}),
                             ("prefetch", "pf0", {"STRATATOOLS_PREFETCH_EXTRA": "0"})):
        fe = {"STRATATOOLS_MISS_FETCH": mode, **extra}
        mode = mode + (" (top k only)" if extra else "")
        rows += [(f"staticprof{tag}", f"{slots} slots static on the recorded profile, miss {mode}",
                  {"slots": slots, "policy": "static", "_profile": True, "_env": fe}),
                 (f"lru{tag}", f"{slots} slots LRU, miss {mode}", {"slots": slots, "policy": "lru", "_env": fe}),
                 (f"vram12{tag}", f"--vram-gib 12, LRU, miss {mode}", {"vram_gib": 12.0, "policy": "lru", "_env": fe}),
                 (f"allmiss{tag}", f"0 slots, miss {mode}", {"slots": 0, "policy": "static", "_env": fe})]
    # the step as one CUDA graph (decode.GRAPH_PARTS_ENV=1; the default cuts it into pieces launched while the earlier
    # ones run), and the next layer's prefetch started after the layer's own late fetch (decode.PREFETCH_ORDER_ENV)
    one = {"STRATATOOLS_GRAPH_PARTS": "1"}
    after = {"STRATATOOLS_PREFETCH_ORDER": "after"}
    rows += [("resident1g", "all resident, one graph a step (before)", {"_env": one}),
             ("staticprof1g", f"{slots} slots static on the recorded profile, one graph a step (before)",
              {"slots": slots, "policy": "static", "_profile": True, "_env": one}),
             ("lru1g", f"{slots} slots LRU, one graph a step (before)", {"slots": slots, "policy": "lru", "_env": one}),
             ("staticprofafter", f"{slots} slots static on the recorded profile, prefetch after the late fetch",
              {"slots": slots, "policy": "static", "_profile": True, "_env": after}),
             ("lruafter", f"{slots} slots LRU, prefetch after the late fetch", {"slots": slots, "policy": "lru",
                                                                                "_env": after}),
             ("lruasyncafter", f"{slots} slots LRU, admissions copied alongside the next step, prefetch after the late "
              "fetch", {"slots": slots, "policy": "lru", "_env": {"STRATATOOLS_ASYNC_SWAPS": "1", **after}})]
    # the next layer's prefetch started at the start of the layer's token mixer, on the mixer's input
    mixer = {"STRATATOOLS_PREFETCH_ORDER": "mixer"}
    rows += [("staticprofmixer", f"{slots} slots static on the recorded profile, prefetch from the mixer's input",
              {"slots": slots, "policy": "static", "_profile": True, "_env": mixer}),
             ("lrumixer", f"{slots} slots LRU, prefetch from the mixer's input", {"slots": slots, "policy": "lru",
                                                                                 "_env": mixer}),
             ("vram12mixer", "--vram-gib 12, LRU, prefetch from the mixer's input", {"vram_gib": 12.0, "policy": "lru",
                                                                                     "_env": mixer})]
    # queued decode steps (engine.QUEUE_ENV, default auto: on here): step t+1 launched on the device's arg-max
    # before step t is read; the *noqueue rows read each step before launching the next (the default before)
    q, nq = {"STRATATOOLS_DECODE_QUEUE": "1"}, {"STRATATOOLS_DECODE_QUEUE": "0"}
    rows += [("queue", "all resident, queued steps", {"_env": q}),
             ("staticprofqueue", f"{slots} slots static on the recorded profile, queued steps",
              {"slots": slots, "policy": "static", "_profile": True, "_env": q}),
             ("lruqueue", f"{slots} slots LRU, queued steps", {"slots": slots, "policy": "lru", "_env": q}),
             ("noqueue", "all resident, steps not queued (before)", {"_env": nq}),
             ("staticprofnoqueue", f"{slots} slots static on the recorded profile, steps not queued (before)",
              {"slots": slots, "policy": "static", "_profile": True, "_env": nq}),
             ("lrunoqueue", f"{slots} slots LRU, steps not queued (before)",
              {"slots": slots, "policy": "lru", "_env": nq})]
    # the Q2_0 experts' integer pipelined kernels (experts.MOE_INT8_ENV: their input quantized to 16-bit fixed point,
    # int8 dot products): both launches (1) or neither (0); the default runs the integer gate/up and the float down
    i8, f32 = {"STRATATOOLS_MOE_INT8": "1"}, {"STRATATOOLS_MOE_INT8": "0"}
    rows += [("int8", "all resident, integer expert gate/up and down", {"_env": i8}),
             ("float", "all resident, float expert kernels (before)", {"_env": f32}),
             ("staticprofint8", f"{slots} slots static on the recorded profile, integer expert gate/up and down",
              {"slots": slots, "policy": "static", "_profile": True, "_env": i8}),
             ("staticproffloat", f"{slots} slots static on the recorded profile, float expert kernels (before)",
              {"slots": slots, "policy": "static", "_profile": True, "_env": f32})]
    # every re-laid-out Q8_0 matrix through mv_q8i, the hyper-connection down projections (324 rows) included
    # (kernels.DENSE_MIN_ROWS_ENV=0; by default they take mv_q8r's row parts)
    rows += [("hcq8i", "all resident, the hyper-connection down projections on mv_q8i",
              {"_env": {"STRATATOOLS_DENSE_MIN_ROWS": "0"}})]
    # mv_q8r's row split aiming at 1 or 2 blocks per SM instead of 4 (kernels.DQ_SPLIT_ENV): fewer, longer parts
    rows += [(f"hcsplit{b}", f"all resident, mv_q8r's row parts for {b} block(s) per SM",
              {"_env": {"STRATATOOLS_DQ_SPLIT_BLOCKS": str(b)}}) for b in (1, 2, 4)]
    # the router's top-k by route_fused_sg's block (decode.ROUTE_WARP_ENV=0, before) instead of one warp
    rows += [("routeblock", "all resident, router by one block (before)", {"_env": {"STRATATOOLS_ROUTE_WARP": "0"}})]
    # the shared expert after the routed ones on the step's stream (decode.SHARED_SIDE_ENV=0; the default runs it on a
    # second stream beside the routed gate/up)
    def before_rows(tag: str, what: str, env: dict) -> list:
        """All resident, static on the recorded profile and --vram-gib 12 LRU, each under ``env`` (the earlier way)."""
        return [(f"{tag}", f"all resident, {what} (before)", {"_env": env}),
                (f"staticprof{tag}", f"{slots} slots static on the recorded profile, {what} (before)",
                 {"slots": slots, "policy": "static", "_profile": True, "_env": env}),
                (f"vram12{tag}", f"--vram-gib 12, LRU, {what} (before)", {"vram_gib": 12.0, "policy": "lru", "_env": env})]
    rows += before_rows("noside", "shared expert after the routed ones", {"STRATATOOLS_SHARED_SIDE": "0"})
    # the step's kernels launched without programmatic dependent launch inside its graphs (launch.PDL_ENV=0, before)
    rows += before_rows("nopdl", "no programmatic dependent launch", {"STRATATOOLS_PDL": "0"})
    # blocks of the prefetch's copy launch beside the main stream (decode.PREFETCH_BLOCKS_ENV, default 32)
    for nb in (64, 128):
        fe = {"STRATATOOLS_PREFETCH_BLOCKS": str(nb)}
        rows += [(f"staticprofb{nb}", f"{slots} slots static on the recorded profile, prefetch on {nb} blocks",
                  {"slots": slots, "policy": "static", "_profile": True, "_env": fe}),
                 (f"lrub{nb}", f"{slots} slots LRU, prefetch on {nb} blocks", {"slots": slots, "policy": "lru", "_env": fe})]
    return rows


def suite_prompt_ids(gguf: str, n: int) -> list[int]:
    """``n`` token ids of the packaged prompt suite's texts (file order, joined by blank lines, repeated when
    short), tokenized with the model's tokenizer."""
    from stratatools.core.resources import packaged
    from stratatools.model.gguf import open_model
    from stratatools.runtime.tokenizer import BPETokenizer

    suite = json.loads(packaged("data", "prompts", "suite.json").read_text(encoding="utf-8"))["prompts"]
    with open_model(gguf) as m:
        tok = BPETokenizer.from_gguf(m)
        ids: list[int] = []
        for i in range(100000):
            ids += tok.encode(suite[i % len(suite)]["text"] + "\n\n")
            if len(ids) >= n:
                break
    return ids[:n]


def decode_compare(cp, gguf: str, prompt_ids: list, steps: int, oracle: int = 0) -> dict:
    """Reference, unfused-fast and fused steps of :class:`StaticDecoder` on one loaded model, all resident, graphs
    replayed on the same tokens (see the module docstring). Returns tolerance figures and ms per step; also each fast
    step's error against the reference along the prompt, and (``oracle`` > 0) every step's logits at prompt position
    ``oracle - 1`` against the numpy forward of :mod:`stratatools.runtime.model` on the CPU."""
    from stratatools.runtime.gpu.decode import StaticDecoder
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    w = load(gguf, xp=cp)
    grt = GPURuntime(w, policy=None, miss_mode="host")
    kinds = {"reference": dict(fast=False), "unfused": dict(fast=True, fused=False),
             "fused": dict(fast=True, fused=True), "fused_before": dict(fast=True, fused=True)}
    decs = {}
    for name, kw in kinds.items():
        with env_vars(BEFORE_ENV if name == "fused_before" else {}):  # fused step on the GGUF-block matvec
            d = StaticDecoder(grt, max_ctx=len(prompt_ids) + 2 * steps + 2, **kw)
        d.load_state(grt.new_state())
        d.capture()
        decs[name] = d
    out: dict = {"steps": steps, "prompt": len(prompt_ids)}
    # along the prompt: each fast step against the reference step, per position; and at position ``oracle - 1``
    # every step against the numpy forward (stratatools.runtime.model, the path checked against transformers)
    n_or = min(oracle, len(prompt_ids))
    along = {k: [] for k in kinds if k != "reference"}
    at_oracle = {}
    for i, t in enumerate(prompt_ids):
        lg = {name: d.step(t) for name, d in decs.items()}
        ref = lg["reference"].get().astype(np.float64)
        for k in along:
            along[k].append(float(np.abs(lg[k].get().astype(np.float64) - ref).max() / np.abs(ref).max()))
        if i == n_or - 1:
            at_oracle = {name: v.get().astype(np.float64) for name, v in lg.items()}
    for d in decs.values():
        d.synchronize()
    out["prompt_rel_err_vs_reference"] = {
        k: {"first_over_1e-4": next((i for i, e in enumerate(v) if e > 1e-4), None), "pos0": v[0],
            f"pos{n_or - 1}": v[n_or - 1], "last": v[-1], "max": max(v)} for k, v in along.items()}
    if n_or > 0:
        from stratatools.runtime.model import Qwen4ExpRuntime

        t0 = time.perf_counter()
        cpu_rt = Qwen4ExpRuntime(load(gguf, xp=np))
        oracle_lg, _ = cpu_rt.forward(np.array(prompt_ids[:n_or]), cpu_rt.new_state())
        del cpu_rt
        oracle_lg = np.asarray(oracle_lg, dtype=np.float64)
        out["vs_numpy_forward"] = {"position": n_or - 1, "seconds": time.perf_counter() - t0, **{
            name: float(np.abs(v - oracle_lg).max() / np.abs(oracle_lg).max()) for name, v in at_oracle.items()}}
    print(f"decoder comparison along the prompt: {json.dumps(out)}", flush=True)
    fast = ("unfused", "fused", "fused_before")
    err = {k: [] for k in fast}
    agree = {k: [0, 0] for k in fast}
    tok = decs["reference"].next_token()
    toks = []
    for _ in range(steps):
        toks.append(tok)
        ref = decs["reference"].step(tok).get().astype(np.float64)
        ir, _ = decs["reference"].routing(account=False)
        for k in fast:
            got = decs[k].step(tok).get().astype(np.float64)
            ig, _ = decs[k].routing(account=False)
            err[k].append(float(np.abs(got - ref).max() / np.abs(ref).max()))
            for l in range(ir.shape[0]):
                agree[k][1] += ir.shape[1]
                agree[k][0] += len(set(ir[l].tolist()) & set(ig[l].tolist()))
        tok = int(np.argmax(ref))
    for k in fast:
        out[k] = {"logits_rel_err_max": max(err[k]), "logits_rel_err_median": float(np.median(err[k])),
                  "topk_agreement": agree[k][0] / agree[k][1]}
    # decode-loop time per step: replay + the copy-back of next token and routing, on the same token sequence
    for name, d in decs.items():
        d.synchronize()
        t0 = time.perf_counter()
        for t in toks:
            d.step(t)
            d.routing(account=False)
        out.setdefault(name, {})["ms_per_step"] = (time.perf_counter() - t0) / len(toks) * 1e3
    del decs, grt, w
    free_device(cp)
    return out


def print_profile(name: str, pr: list, top: int = 16) -> None:
    """Markdown table of :func:`kernel_profile`'s rows (the ``top`` longest kernels) and the dense Q8_0 matvecs'
    bandwidth."""
    nbytes = next((r[1] for r in pr if r[0] == "dense Q8_0 bytes/step"), 0)
    pr = [r for r in pr if r[0] not in ("dense Q8_0 bytes/step", "timeline")]
    tot = sum(r[1] for r in pr)
    print(f"\nper-kernel device time of one decode step ({name}): {tot:.2f} ms in {sum(r[2] for r in pr)} kernels")
    dq = [r for r in pr if r[0].startswith(("mv_q8r", "mv_q8s", "mv_q8i")) or r[0].startswith("matvec_tiled_kernel<8>")]
    if dq and nbytes:
        ms = sum(r[1] for r in dq)
        print(f"dense Q8_0 matvecs: {ms:.3f} ms/step in {sum(r[2] for r in dq)} launches, {nbytes / 1e6:.0f} MB: "
              f"{nbytes / (ms * 1e-3) / 1e12:.2f} TB/s")
    print("| kernel | ms/step | launches/step | share |")
    print("|---|---:|---:|---:|")
    for r in pr[:top]:
        print(f"| {r[0]} | {r[1]:.3f} | {r[2]} | {r[3]:.3f} |", flush=True)


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
    ap.add_argument("--configs", default="resident,unfused,static,staticprof,adaptive,adaptiveprof,lru,vram12,allmiss,longres,long",
                    help="comma list of rows: resident, unfused, static (arrival order), staticprof (a profile the "
                    "runtime recorded), adaptive, adaptiveprof (adaptive on that profile), lru, vram12, allmiss (0 slots: every "
                    "routed expert read from pinned host memory, the PCIe-bound case), longres (all resident "
                    "at each --long context), long (--vram-gib 12 LRU at each --long context)")
    ap.add_argument("--compare-steps", type=int, default=32, help="decoder comparison steps (0: skip)")
    ap.add_argument("--compare-prompt", type=int, default=0, help="decoder comparison: prompt tokens before the "
                    "compared steps (0: --prompt)")
    ap.add_argument("--compare-oracle", type=int, default=8, help="decoder comparison: prompt tokens also run "
                    "through the numpy forward on the CPU, every step's logits compared with it there (0: skip)")
    ap.add_argument("--reuse", action="store_true", help="keep an already synthesized model in the workdir")
    ap.add_argument("--gguf", default=None, help="an existing model to use (no synth; e.g. the one bench_gpu_batch.py "
                    "made with the same --layers / --experts / --types)")
    ap.add_argument("--profile-lru", action="store_true", help="also profile the selected --slots LRU rows' steps")
    ap.add_argument("--timeline", default="", help="comma list of selected rows (e.g. staticprof,lru) whose decode "
                    "steps are also profiled with the row's tier, profile and environment: per-kernel table plus "
                    "where the main stream waits and what the side streams do (Chrome trace kept as "
                    "timeline-ROW.json next to --out)")
    ap.add_argument("--timeline-prompt", type=int, default=32, help="prompt tokens before the --timeline rows' "
                    "profiled steps (default 32; --prompt profiles them at the timed rows' context)")
    ap.add_argument("--types", default=DEFAULT_TYPES, help="routed experts' types, passed to stratatools synth --types "
                    f"(default {DEFAULT_TYPES}; issue 12's variant: gu=IQ2_XS,down=IQ4_NL; pipelined expert kernels "
                    "exist for Q2_0 and Q8_0 only, other types run on the staged ones)")
    ap.add_argument("--expert-kernels", choices=("auto", "staged", "pipe", "warp"), default="auto",
                    help="fast step's routed-expert kernels: auto (the decoder's choice: pipelined when every expert "
                         "is resident, else staged; the shared expert pipelined), staged rows (moe_staged.cu), its pipelined kernels "
                         "(STRATATOOLS_MOE_KERNEL=pipe; launch shapes from STRATATOOLS_MOE_PIPE, see "
                         "bench/bench_moe_kernels.py) or the FMA build of the warp-per-row kernels (for comparison)")
    a = ap.parse_args()
    if a.expert_kernels == "warp":
        import stratatools.runtime.gpu.experts as experts_mod

        experts_mod.MOE_ROW_MAX = 0  # no row fits: expert_ffn(fast=True) takes the warp-per-row kernels
    else:
        from stratatools.runtime.gpu.experts import MOE_KERNEL_ENV, pipe_shapes

        if a.expert_kernels == "auto":
            os.environ.pop(MOE_KERNEL_ENV, None)
        else:
            os.environ[MOE_KERNEL_ENV] = a.expert_kernels  # read by expert_ffn (also in child processes)
        pipe_shapes()  # a malformed STRATATOOLS_MOE_PIPE fails here, not in the middle of a run
    res_expert_kernels = a.expert_kernels
    want = set(a.configs.split(","))
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    res: dict = {"args": vars(a), "expert_kernels": res_expert_kernels}
    mdir = wd / "model"
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    argv = synth_argv(mdir, a.layers, a.experts, a.types)
    stamp = wd / "model.argv.json"  # what made the model in the workdir: --reuse keeps only the same model
    if a.gguf:
        if not Path(a.gguf).is_file():
            sys.exit(f"--gguf {a.gguf}: no such file")
    elif not (a.reuse and list(mdir.glob("*.gguf")) and stamp.is_file() and json.loads(stamp.read_text()) == argv):
        p = subprocess.run([sys.executable, "-m", "stratatools", *argv], capture_output=True, text=True, env=env)
        if p.returncode != 0:
            sys.exit(f"stratatools {' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()[-500:]}")
        stamp.write_text(json.dumps(argv))
    gguf = a.gguf or str(sorted(mdir.glob("*.gguf"))[0])
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
        k = int(m.kv.get(f"{m.arch}.expert_used_count"))
    touched = touched_bytes(gguf, k)
    res["touched_bytes_per_token"] = touched
    long_ctx = [int(x) for x in str(a.long).split(",") if x.strip()]
    suite_ids = suite_prompt_ids(gguf, max([2 * a.prompt] + [c - a.new for c in long_ctx]))
    if a.timeline and not 1 <= a.timeline_prompt <= len(suite_ids):
        raise SystemExit(f"--timeline-prompt {a.timeline_prompt}: give 1 to {len(suite_ids)} (the prompt suite's "
                         "tokens this run reads)")
    record_ids = suite_ids[a.prompt:2 * a.prompt]
    prompts = wd / "prompt.json"
    prompts.write_text(json.dumps([{"prompt_id": "suite", "token_ids": suite_ids[:a.prompt]}]))
    res["prompt_source"] = "data/prompts/suite.json (model tokenizer)"
    cmp_res = None
    if a.compare_steps > 0:
        try:
            cmp_res = decode_compare(cp, gguf, suite_ids[:a.compare_prompt or a.prompt], a.compare_steps,
                                     a.compare_oracle)
            res["decode_compare"] = cmp_res
            print(f"decoder comparison: {json.dumps(cmp_res)}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported, the rows still run
            import traceback

            traceback.print_exc()
            print(f"decoder comparison failed: {e}", flush=True)
    configs = config_rows(a.slots)
    plens = {str(prompts): a.prompt}
    for ctx in long_ctx:
        lp = wd / f"prompt_long_{ctx}.json"
        plens[str(lp)] = ctx - a.new
        lp.write_text(json.dumps([{"prompt_id": f"suite-{ctx}", "token_ids": suite_ids[:ctx - a.new]}]))
        configs.append(("longres", f"all resident, {ctx}-token context", {"_prompts": lp}))
        configs.append(("long", f"--vram-gib 12, LRU, {ctx}-token context",
                        {"_prompts": lp, "vram_gib": 12.0, "policy": "lru"}))
    all_configs = list(configs)
    configs = [(key, name, kw) for key, name, kw in configs if key in want]
    timeline = {x for x in a.timeline.split(",") if x}
    tl_keys = {key for key, _, kw in configs if "vram_gib" not in kw and "_prompts" not in kw}
    if timeline - tl_keys:  # the timeline profiles a row's --slots tier on a short prompt: other rows would mislead
        sys.exit(f"--timeline {','.join(sorted(timeline - tl_keys))}: give rows selected by --configs that have no "
                 f"--vram-gib or --long prompt ({', '.join(sorted(tl_keys)) or 'none selected'})")
    tl_dir = Path(a.out).parent if a.out else wd
    rows = []
    import stratatools.runtime.gpu.engine as engine_mod

    recorded = False
    for key, name, kw in configs:
        free_device(cp)
        t0 = time.perf_counter()
        kw = dict(kw)
        pp = kw.pop("_prompts", prompts)
        if kw.pop("_profile", False):
            # the profile comes from the routing the runtime recorded on other suite text (held out from the prompt)
            rec_trace, prof = wd / "recorded.parquet", wd / "recorded.strp"
            if not recorded:  # (an earlier row of this run made it: the same text, the same profile)
                try:
                    rp = wd / "prompt_record.json"
                    rp.write_text(json.dumps([{"prompt_id": "record", "token_ids": record_ids}]))
                    run_prompts(gguf, rp, max_new_tokens=a.new, device="gpu", trace_out=rec_trace, force=True)
                    subprocess.run([sys.executable, "-m", "stratatools", "--quiet", "make-profile", str(rec_trace),
                                    "--model", gguf, "--mode", "no-base", "-o", str(prof), "--force"], check=True)
                    recorded = True
                    free_device(cp)  # the recording run's pool blocks would hide this row's own device memory
                except Exception as e:  # noqa: BLE001 - the table shows the failure
                    print(f"{name}: recording failed: {e}", flush=True)
                    rows.append({"name": name, "error": f"recording: {e}"})
                    continue
            kw["profile"] = prof
        fused = kw.pop("_fused", True)
        plen = plens[str(pp)]
        orig = engine_mod.DecoderRuntime
        if not fused:
            engine_mod.DecoderRuntime = functools.partial(orig, fused=False)
        extra_env = kw.pop("_env", {})
        try:
            with env_vars(extra_env):
                r = run_prompts(gguf, pp, max_new_tokens=a.new, device="gpu", **kw).to_dict()
        except Exception as e:  # noqa: BLE001 - the table shows the failure
            print(f"{name}: failed: {e}", flush=True)
            rows.append({"name": name, "error": str(e)})
            continue
        finally:
            engine_mod.DecoderRuntime = orig
        d = r["device"]
        tc = d["tier"]
        steps = max(r["new_tokens"] - 1, 1)
        row = {"name": name, "decode": r["tokens_per_s"], "prefill": r["prefill_tokens_per_s"], "setup_s": d.get("setup_s"),
               "h_decode": r["h_expert"], "moved_per_token": tc["bytes_moved"] / (plen + steps),
               "device_used": d["device_used_bytes"], "pool": d["pool_bytes"], "wall_s": time.perf_counter() - t0,
               "engine": d["engine"], "tier": tc, "plan": d.get("plan"),
               "graph_pool": d.get("graph_pool_bytes"), "decoder_state": d.get("decoder_state_bytes"),
               "miss_fetch": d.get("miss_fetch")}
        # host->device traffic of one decode token: its misses (1 - decode hit rate) x k x layers blobs read from
        # pinned memory, plus what the policy copied into slots; as a rate against the measured pinned copy rate
        misses = max(int(tc.get("misses", 0)), 0)
        blob = (tc["miss_host_read_bytes"] + tc["miss_copy_bytes"]) / misses if misses else 0.0
        h_dec = r["h_expert"] if r["h_expert"] is not None else 1.0
        dec_bytes = (1.0 - h_dec) * k * a.layers * blob + tc["admit_bytes"] / (plen + steps)
        row["h2d_bytes_per_decode_token"] = dec_bytes
        row["h2d_rate_fraction"] = dec_bytes * row["decode"] / h2d if h2d else None
        if key in timeline and a.profile_steps > 0:
            free_device(cp)
            try:
                pr = kernel_profile(cp, gguf, suite_ids[:a.timeline_prompt], a.profile_steps, kw.get("slots"), kw.get("policy", "static"),
                                    fused=fused, extra_env=extra_env, profile_path=kw.get("profile"),
                                    trace_out=str(tl_dir / f"timeline-{key}.json"))
                print_profile(f"{name} (timeline run)", pr)
                tl = next((r[1] for r in pr if r[0] == "timeline"), {})
                print_timeline(name, tl)
                row["timeline"] = tl
                row["timeline_kernels"] = [r for r in pr if r[0] != "timeline"]
            except Exception as e:  # noqa: BLE001 - reported, the rows still run
                print(f"timeline {name}: failed: {e}", flush=True)
        rows.append(row)
        if a.out:  # after every row, so that a run stopped by its time limit keeps the rows it made
            Path(a.out).write_text(json.dumps({**res, "rows": rows}, indent=1, default=str))
        print(f"{name}: decode {row['decode']:.1f} tok/s, prefill {row['prefill']:.1f} tok/s, h {row['h_decode']}, "
              f"moved/token {row['moved_per_token'] / 1e6:.1f} MB, device used {row['device_used'] / 2**30:.2f} GiB, "
              f"set-up {row['setup_s']} s", flush=True)
        row["decode_queue"] = d.get("decode_queue")
        if extra_env.get("STRATATOOLS_DECODE_QUEUE") == "1" and not (row["decode_queue"] or {}).get("on"):
            print(f"  queued steps off: {(row['decode_queue'] or {}).get('reason')}", flush=True)
        mf = row["miss_fetch"] or {}
        if mf.get("mode", "zero-copy") != "zero-copy":
            tot = mf["fetched_jobs"] + mf["prefetch_used_jobs"]
            print(f"  miss {mf['mode']}: {mf['fetched_bytes'] / 1e6 / steps:.1f} MB fetched after routing and "
                  f"{mf['prefetched_bytes'] / 1e6 / steps:.1f} MB prefetched per decode step (counts include the "
                  f"prompt's steps when it ran token by token); misses served by a prefetched copy: "
                  f"{mf['prefetch_used_jobs']} of {tot} ({mf['prefetch_used_jobs'] / max(tot, 1):.3f}), "
                  f"prefetched copies used {mf['prefetch_used_jobs']} of {mf['prefetched_jobs']}", flush=True)
    res["rows"] = rows
    prof_rows = {}
    if a.profile_steps > 0:
        ids = suite_ids[:32]
        for name, sl, pol, fu, ev in profile_plan(all_configs, want, a.slots, a.profile_lru):
            try:
                prof_rows[name] = kernel_profile(cp, gguf, ids, a.profile_steps, sl, pol, fused=fu, extra_env=ev)
                print_profile(name, prof_rows[name])
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
    print(f"\nmodel {a.layers}x{a.experts} {a.types}, prompt {a.prompt}, new {a.new}; roofline {roof:.0f} tok/s "
          f"({touched / 1e6:.0f} MB/token at {d2d / 1e12:.2f} TB/s); llama.cpp tg128 {tg} pp512 {pp}")
    print("| config | decode tok/s | x llama tg128 | roofline | prefill tok/s | x llama pp512 | decode hit rate "
          "| MB moved/token | host->device during decode, x pinned copy rate | device GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error'][:80]} |")
            continue
        print(f"| {r['name']} | {r['decode']:.1f} | {r['decode'] / tg if tg else float('nan'):.3f} | "
              f"{r['decode'] / roof:.3f} | {r['prefill']:.1f} | {r['prefill'] / pp if pp else float('nan'):.4f} | "
              f"{r['h_decode'] if r['h_decode'] is None else round(r['h_decode'], 4)} | {r['moved_per_token'] / 1e6:.1f} | "
              f"{r['h2d_rate_fraction'] if r['h2d_rate_fraction'] is None else round(r['h2d_rate_fraction'], 3)} | "
              f"{r['device_used'] / 2**30:.2f} |")
    for name, pr in prof_rows.items():
        print_profile(name, pr)
    if cmp_res:
        print("\n| decode step | ms/step (replay + copy-back) | logits rel. error max (median) | router top-k agreement |")
        print("|---|---:|---:|---:|")
        for k in ("reference", "unfused", "fused_before", "fused"):
            c = cmp_res.get(k, {})
            e = (f"{c['logits_rel_err_max']:.2e} ({c['logits_rel_err_median']:.2e})" if "logits_rel_err_max" in c
                 else "-")
            ag = f"{c['topk_agreement']:.4f}" if "topk_agreement" in c else "-"
            print(f"| {k} | {c.get('ms_per_step', float('nan')):.2f} | {e} | {ag} |")
    for r in rows:
        if "plan" in r and r["plan"]:
            print(f"{r['name']}: plan {json.dumps(r['plan'])}; graph pool {r.get('graph_pool')}, decoder state {r.get('decoder_state')}, device used {r['device_used']}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
