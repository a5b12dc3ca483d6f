"""Routed-expert kernels of the fast decode step, per shape and variant, on the GPU: the staged-row kernels
(``moe_gate_up_staged`` / ``moe_down_staged``, the default) against the pipelined ones (``moe_gate_up_pipe`` /
``moe_down_pipe``, ``STRATATOOLS_MOE_KERNEL=pipe``) at several launch shapes (threads a block x rows a warp x ring
slots). A benchmark, not a timed test: every variant is timed in the same run on the same random valid experts.

Shapes (the full-width synthetic's decode step: hidden 2560, expert width 576): the routed Q2_0 gate/up and down
of 10 jobs (one token, k = 10), the shared Q8_0 expert's gate/up and down (1 job), and (unless ``--no-zero-copy``)
the routed Q2_0 gate/up and down of 10 jobs whose experts lie in mapped pinned host memory (the miss case: read over
PCIe, zero-copy). For each: enough distinct experts that one pass over them exceeds the 50 MB L2 cache (the launches
cycle through ``--copies`` job tables of distinct experts), ``--reps`` launches captured in one CUDA graph and
replayed, so the time per launch includes the launch gaps a step's graph has. Prints microseconds per launch, the
rate (expert bytes read / time: TB/s on the device, GB/s from host memory), its fraction of the device-to-device
copy rate (or of the pinned host-to-device copy rate) measured in the same run, and the largest difference from the
staged kernel's output on the same jobs relative to that output's largest magnitude. Ends with the fastest pipe
shape per kernel and the environment that selects it. The routed Q2_0 rows also time the integer variants
(``pipe8``: ``moe_gate_up_pipe_i8`` / ``moe_down_pipe_i8``, input quantized to 16-bit fixed point, int8 dot products;
``STRATATOOLS_MOE_INT8``: gate/up by default) at their own shapes.

Usage: python bench/bench_moe_kernels.py [--reps 100] [--no-zero-copy] [--out res.json]
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

HIDDEN, FF, K_ROUTED = 2560, 576, 10
L2_BYTES = 50 << 20
#: pipelined launch shapes tried (threads, rows a warp, ring slots)
PIPE_GU = [(256, 1, 1), (256, 2, 2), (256, 3, 2), (256, 3, 3), (256, 4, 2), (256, 4, 4), (256, 6, 3), (128, 1, 1),
           (128, 2, 2), (128, 3, 3), (64, 1, 1), (64, 2, 2), (32, 1, 1)]
PIPE_DN = [(256, 1, 1), (256, 2, 2), (256, 4, 2), (256, 4, 3), (256, 8, 3), (128, 1, 1), (128, 2, 2), (128, 4, 2),
           (64, 2, 2), (64, 4, 2)]
PIPE_ZC = [(256, 1, 1), (256, 2, 2), (256, 4, 3), (128, 1, 1), (128, 4, 4)]
#: shapes tried for the integer variants (``pipe8``: moe_gate_up_pipe_i8 / moe_down_pipe_i8, Q2_0 only)
PIPE8_GU = [(256, 1, 1), (256, 2, 2), (256, 3, 3), (256, 4, 2), (128, 1, 1), (128, 2, 2), (128, 4, 4), (64, 1, 1),
            (64, 2, 2)]
PIPE8_DN = [(256, 1, 1), (256, 2, 2), (256, 4, 2), (128, 1, 1), (128, 2, 2), (64, 1, 1), (64, 2, 2), (32, 1, 1)]


def q2_random(rng, n_blocks: int) -> np.ndarray:
    """Random valid Q2_0 blocks (fp16 scale around 0.01, then 16 bytes of 2-bit codes)."""
    b = rng.integers(0, 256, size=(n_blocks, 18), dtype=np.uint8)
    b[:, :2] = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return b.reshape(-1)


def q8_random(rng, n_blocks: int) -> np.ndarray:
    """Random valid Q8_0 blocks (fp16 scale around 0.01, then 32 int8 codes)."""
    b = rng.integers(0, 256, size=(n_blocks, 34), dtype=np.uint8)
    b[:, :2] = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return b.reshape(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--no-zero-copy", action="store_true", help="skip the experts-in-pinned-host-memory rows")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t_start = time.time()
    import cupy as cp

    import stratatools.runtime.gpu.experts as E
    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.gpu import kernels as K
    from stratatools.runtime.gpu.tier import _alloc_mapped_pinned, _device_pointer

    # one small module with just the kernels timed here (the fast module compiles every type)
    names = [f"{k}<{t}>" for k in ("moe_gate_up_staged", "moe_down_staged", "moe_gate_up_pipe", "moe_down_pipe")
             for t in (8, 42)] + ["moe_gate_up_pipe_i8<42>", "moe_down_pipe_i8<42>"]
    mod = cp.RawModule(code=K.source(), options=K.FAST_OPTIONS, name_expressions=names)
    E.kernel = lambda name, tid, fast=False: mod.get_function(f"{name}<{int(tid)}>")
    q2, q8 = type_by_name("Q2_0"), type_by_name("Q8_0")
    s = cp.cuda.Stream(non_blocking=True)

    def copy_rate(dst_ptr, src_ptr, nbytes, kind, factor):
        with s:
            cp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, s.ptr)
            e0 = s.record()
            for _ in range(3):
                cp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, s.ptr)
            e1 = s.record()
        e1.synchronize()
        return factor * 3 * nbytes / (cp.cuda.get_elapsed_time(e0, e1) * 1e-3)

    nbytes = 1 << 30
    src, dst = cp.empty(nbytes, dtype=cp.uint8), cp.empty(nbytes, dtype=cp.uint8)
    src.fill(1)
    d2d = copy_rate(dst.data.ptr, src.data.ptr, nbytes, 3, 2)  # read + write
    del src, dst
    rng = np.random.default_rng(0)
    X = cp.asarray((rng.standard_normal((1, HIDDEN)) * 0.5).astype(np.float32))
    hbuf_ref = cp.empty(K_ROUTED * FF, dtype=cp.float32)

    def experts(t_gu, t_d, n_exp, alloc):
        """n_exp random expert blobs [gate][up][down] in one buffer from alloc(nbytes) -> (keep-alive, device
        address, host view or None); returns (keep-alive, base address, blob bytes, gate bytes)."""
        gb = FF * t_gu.row_bytes(HIDDEN)
        blob = 2 * gb + HIDDEN * t_d.row_bytes(FF)
        keep, base, view = alloc(n_exp * blob)
        host = np.empty(blob, dtype=np.uint8)
        for e in range(n_exp):
            gen_gu = q2_random if t_gu.id == 42 else q8_random
            gen_d = q2_random if t_d.id == 42 else q8_random
            host[:2 * gb] = gen_gu(rng, 2 * gb // t_gu.type_size)
            host[2 * gb:] = gen_d(rng, (blob - 2 * gb) // t_d.type_size)
            if view is not None:
                view[e * blob:(e + 1) * blob] = host
            else:
                cp.cuda.runtime.memcpy(base + e * blob, host.ctypes.data, blob, 1)
        return keep, base, blob, gb

    def dev_alloc(n):
        m = cp.cuda.alloc(n)
        return m, int(m.ptr), None

    def host_alloc(n):
        m = _alloc_mapped_pinned(cp, n)
        dp = _device_pointer(cp, m)
        if dp is None:
            raise SystemExit("pinned host memory is not mapped into the device address space on this machine")
        return m, dp, np.frombuffer(m, dtype=np.uint8, count=n)

    def tables(base, blob, gb, k, n_exp):
        """Job tables of k distinct experts each, cycling through all n_exp."""
        out = []
        for c in range(n_exp // k):
            ptrs = np.array([[base + (c * k + m) * blob for m in range(k)]], dtype=np.uint64)
            w = rng.uniform(0.1, 1.0, (1, k)).astype(np.float32)
            out.append(E.make_jobs(ptrs, w, gb))
        return out

    def timed(fn, n_tables, reps):
        with s:
            fn(0)
            s.synchronize()
            s.begin_capture()
            for i in range(reps):
                fn(i % n_tables)
            g = s.end_capture()
            g.launch(stream=s)
            e0 = s.record()
            g.launch(stream=s)
            e1 = s.record()
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / reps

    res: dict = {"copy_d2d_Bps": d2d, "reps": a.reps, "rows": []}

    def save(r):
        if a.out:
            from stratatools.core.fsutil import write_text_atomic

            write_text_atomic(a.out, json.dumps(r, indent=1))
    groups = [("routed Q2_0", q2, q2, K_ROUTED, dev_alloc, PIPE_GU, PIPE_DN, a.reps),
              ("shared Q8_0", q8, q8, 1, dev_alloc, PIPE_GU, PIPE_DN, a.reps)]
    if not a.no_zero_copy:
        groups.append(("routed Q2_0 zero-copy", q2, q2, K_ROUTED, host_alloc, PIPE_ZC, PIPE_ZC, max(4, a.reps // 10)))
    print(f"device-to-device copy {d2d / 1e12:.2f} TB/s; {a.reps} launches per graph; hidden {HIDDEN}, expert width "
          f"{FF}")
    print("| shape | kernel | variant | MB | us/launch | rate | of copy | max rel. diff |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    best: dict = {}
    for gname, t_gu, t_d, k, alloc, shp_gu, shp_dn, reps in groups:
        gb = FF * t_gu.row_bytes(HIDDEN)
        blob = 2 * gb + HIDDEN * t_d.row_bytes(FF)
        zc = alloc is host_alloc
        n_exp = k * max(2, -(-(2 * L2_BYTES) // (k * blob)))  # two L2s' worth, whole tables
        keep, base, blob, gb = experts(t_gu, t_d, n_exp, alloc)
        ceiling = d2d
        if zc:
            hbytes = min(n_exp * blob, 256 << 20)
            dbuf = cp.empty(hbytes, dtype=cp.uint8)
            ceiling = copy_rate(dbuf.data.ptr, keep.ptr, hbytes, 1, 1)
            del dbuf
            print(f"| {gname}: pinned host-to-device copy {ceiling / 1e9:.1f} GB/s | | | | | | | |")
        jt = tables(base, blob, gb, k, n_exp)
        nt = len(jt)
        hb = cp.empty(k * FF, dtype=cp.float32)
        Y = cp.empty((1, HIDDEN), dtype=cp.float32)
        last = (reps - 1) % nt
        # the staged kernels' outputs on the last table: the reference of the diff column
        E.staged_gate_up(X, jt[last], t_gu, HIDDEN, FF, hbuf_ref)
        yref = cp.empty((1, HIDDEN), dtype=cp.float32)
        E.staged_down(jt[last], t_d, HIDDEN, FF, hbuf_ref, yref, False)
        s.synchronize()
        cp.cuda.Device().synchronize()
        href = hbuf_ref[:k * FF].copy()
        i8ok = t_gu.id == 42 and t_d.id == 42 and not zc  # the integer variants: Q2_0, device memory
        for kname, mb, variants in (("gate/up", k * 2 * gb, [None] + [(v, False) for v in shp_gu]
                                     + ([(v, True) for v in PIPE8_GU] if i8ok else [])),
                                    ("down", k * HIDDEN * t_d.row_bytes(FF), [None] + [(v, False) for v in shp_dn]
                                     + ([(v, True) for v in PIPE8_DN] if i8ok else []))):
            for vv in variants:
                v, i8 = vv if vv is not None else (None, False)
                if kname == "gate/up":
                    if v is None:
                        def fn(i, jt=jt):
                            E.staged_gate_up(X, jt[i], t_gu, HIDDEN, FF, hb)
                    else:
                        shape = E.PipeShape(*v)

                        def fn(i, jt=jt, shape=shape, i8=i8):
                            E.pipe_gate_up(X, jt[i], t_gu, HIDDEN, FF, hb, shape, int8=i8)
                    got, ref = hb, href
                else:
                    if v is None:
                        def fn(i, jt=jt):
                            E.staged_down(jt[i], t_d, HIDDEN, FF, href, Y, False)
                    else:
                        shape = E.PipeShape(*v)

                        def fn(i, jt=jt, shape=shape, i8=i8):
                            E.pipe_down(jt[i], t_d, HIDDEN, FF, href, Y, False, shape, int8=i8)
                    got, ref = Y, yref
                vname = "staged" if v is None else ("pipe8 %dx%dx%d" if i8 else "pipe %dx%dx%d") % v
                try:
                    dt = timed(fn, nt, reps)
                except Exception as ex:  # a shape over the shared-memory limit: say so, go on
                    print(f"| {gname} | {kname} | {vname} | | | | | {type(ex).__name__}: {str(ex)[:60]} |")
                    continue
                diff = float(cp.abs(got.reshape(-1) - ref.reshape(-1)).max() / cp.abs(ref).max())
                rate = mb / dt
                row = {"shape": gname, "kernel": kname, "variant": vname, "bytes": int(mb), "s": dt, "Bps": rate,
                       "of_copy": rate / ceiling, "max_rel_diff": diff}
                res["rows"].append(row)
                unit = f"{rate / 1e9:.1f} GB/s" if zc else f"{rate / 1e12:.2f} TB/s"
                print(f"| {gname} | {kname} | {vname} | {mb / 1e6:.2f} | {dt * 1e6:.1f} | {unit} | {rate / ceiling:.2f} | "
                      f"{diff:.1e} |", flush=True)
                key = (gname, kname) if not i8 else (gname + " int8", kname)
                if v is not None and diff < 1e-4 and (key not in best or dt < best[key][1]):
                    best[key] = (v, dt)
                if v is None:
                    best.setdefault(("staged",) + key, dt)
        del keep, jt
        save(res)  # after every group: a later failure keeps what was measured
    print(f"\nfastest pipe shape per kernel (total {time.time() - t_start:.0f} s):")
    for (gname, kname), (v, dt) in sorted((kk, vv) for kk, vv in best.items() if kk[0] != "staged"):
        st = best.get(("staged", gname, kname))
        print(f"  {gname} {kname}: pipe {v[0]}x{v[1]}x{v[2]} {dt * 1e6:.1f} us"
              + (f" vs staged {st * 1e6:.1f} us ({st / dt:.2f}x)" if st else ""))
    four = [(g, kn) for g in ("routed Q2_0", "shared Q8_0") for kn in ("gate/up", "down")]
    if all(("staged",) + kk in best and kk in best for kk in four):
        st = sum(best[("staged",) + kk] for kk in four)
        pb = sum(best[kk][1] for kk in four)
        res["layer_s"] = {"staged": st, "pipe_best": pb}
        print(f"  one decode layer's expert kernels (routed gate/up + down, shared gate/up + down): staged "
              f"{st * 1e6:.1f} us, best pipe shapes {pb * 1e6:.1f} us ({st / pb:.2f}x); x 8 layers: "
              f"{8 * st * 1e3:.3f} ms vs {8 * pb * 1e3:.3f} ms")
    parts = [f"{key}={v[0]}x{v[1]}x{v[2]}" for key, (gname, kname) in
             (("gu", ("routed Q2_0", "gate/up")), ("down", ("routed Q2_0", "down")),
              ("gu1", ("shared Q8_0", "gate/up")), ("down1", ("shared Q8_0", "down")))
             for v in [best.get((gname, kname), (None,))[0]] if v is not None]
    if parts:
        env = f"STRATATOOLS_MOE_KERNEL=pipe STRATATOOLS_MOE_INT8=0 STRATATOOLS_MOE_PIPE={','.join(parts)}"
        res["best_env"] = env
        print(f"  decode step with the best float shapes (gu/down: routed, gu1/down1: the one-job shared expert): {env}")
    i8 = [best.get(("routed Q2_0 int8", kn)) for kn in ("gate/up", "down")]
    fl = [best.get(("routed Q2_0", kn)) for kn in ("gate/up", "down")]
    if all(i8) and all(fl):
        res["routed_int8_s"] = i8[0][1] + i8[1][1]
        mixed = i8[0][1] + fl[1][1]  # the default: integer gate/up, float down
        res["routed_int8_gu_s"] = mixed
        shared = [best.get(("shared Q8_0", kn), (None,))[0] for kn in ("gate/up", "down")]
        one = "".join(f",{k}={'x'.join(map(str, v))}" for k, v in zip(("gu1", "down1"), shared) if v is not None)
        print(f"  routed Q2_0 gate/up + down: float {(fl[0][1] + fl[1][1]) * 1e6:.1f} us, integer gate/up + float "
              f"down {mixed * 1e6:.1f} us, both integer {(i8[0][1] + i8[1][1]) * 1e6:.1f} us; the first with the best "
              f"shapes: STRATATOOLS_MOE_KERNEL=pipe STRATATOOLS_MOE_INT8=gu STRATATOOLS_MOE_PIPE="
              f"gu={'x'.join(map(str, i8[0][0]))},down={'x'.join(map(str, fl[1][0]))}{one}")
    save(res)


if __name__ == "__main__":
    main()
