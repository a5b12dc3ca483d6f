"""Dense Q8_0 matvec of the decode step, per matrix shape, on the GPU: the GGUF-block tiled kernel
(``matvec_tiled_kernel<8>``, the earlier fast path) against the re-laid-out ``mv_q8r`` and the streaming ``mv_q8s``
(``runtime/gpu/dense_q8.cu``) and ``mv_q8i`` (``mv_q8s`` with int8 dot products on x quantized per block of 32 to
16-bit fixed point; ``STRATATOOLS_DENSE_KERNEL=int8``); the hyper-connection up projection + mix as ``mv_q8r_mix`` and
as ``mv_q8s`` / ``mv_q8i`` in mix mode. A benchmark, not a timed test: all kernels are timed in the same run, on the
same random valid matrices.

Shapes: those of the full-width synthetic's step (hidden 2560, 4 hyper-connection streams, low rank 320): the
hyper-connection down projection with its inject rows stacked (324 x 10,240), its up projection (10,240 x 320), the
gated-DeltaNet input projections stacked (12,352 x 2,560), its output (2,560 x 4,096), the attention projections
stacked (13,312 x 2,560) and output (2,560 x 6,144). For each: ``--copies`` matrices (more bytes than the L2 cache
together) are multiplied in turn, ``--reps`` launches captured in one CUDA graph and replayed, so the time per launch
includes the launch gaps a step's graph has. Prints microseconds per launch, TB/s (matrix bytes / time) and the
device-to-device copy rate measured in the same run (the ceiling); for ``mv_q8i`` also its speed against ``mv_q8s``
(time of mv_q8s / time of mv_q8i) and the max relative difference of its output from mv_q8s's (max |diff| / max |y|).

Usage: python bench/bench_dense_q8.py [--reps 200] [--copies 8] [--out res.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [("hc down + inject", 324, 10240), ("hc up", 10240, 320), ("GDN in (qkv, z, b, a)", 12352, 2560),
          ("GDN out", 2560, 4096), ("attention q, k, v", 13312, 2560), ("attention out", 2560, 6144)]


def q8_random(rng, rows: int, cols: int) -> np.ndarray:
    """Random valid Q8_0 blocks (fp16 scales around 0.01, codes over the whole int8 range)."""
    nb = rows * cols // 32
    b = np.empty((nb, 34), dtype=np.uint8)
    b[:, :2] = (rng.standard_normal(nb) * 0.01).astype(np.float16).view(np.uint8).reshape(nb, 2)
    b[:, 2:] = rng.integers(0, 256, size=(nb, 32), dtype=np.uint8)
    return b.reshape(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import cupy as cp

    from stratatools.runtime.gpu.kernels import (DQ_THREADS, _device_limits, cuda_unit, dq_launch_shape,
                                                 dqi_launch_shape, dqi_shared_bytes, dqs_launch_shape,
                                                 matvec_tiled_launch, q8_relayout)

    n_sm = _device_limits()[0]
    mod = cp.RawModule(code=cuda_unit("dense_q8.cu"), options=("--std=c++17",))
    k_dq, k_dqs, k_mix = mod.get_function("mv_q8r"), mod.get_function("mv_q8s"), mod.get_function("mv_q8r_mix")
    k_dqi = mod.get_function("mv_q8i")
    # other builds of mv_q8s (window of DQS_U chunks a lane, DQS_MINB blocks per SM), timed beside the default
    variants = [(f"u{u}x{b}", cp.RawModule(code=cuda_unit("dense_q8.cu"),
                                           options=("--std=c++17", f"-DDQS_U={u}", f"-DDQS_MINB={b}")).get_function("mv_q8s"), u, b)
                for u, b in ((5, 4), (8, 2))]
    # other builds of mv_q8i (DQI_U chunks a lane per window, DQI_MINB blocks per SM, DQI_PRE: the first window's
    # loads before x is staged; all without spills)
    ivariants = [(f"i-u{u}x{b}" + ("" if pre else "-nopre"),
                  cp.RawModule(code=cuda_unit("dense_q8.cu"),
                               options=("--std=c++17", f"-DDQI_U={u}", f"-DDQI_MINB={b}",
                                        f"-DDQI_PRE={pre}")).get_function("mv_q8i"), u, b)
                 for u, b, pre in ((6, 4, 0), (4, 5, 0), (7, 3, 1), (12, 2, 1))]
    s = cp.cuda.Stream(non_blocking=True)
    nbytes = 1 << 30
    src, dst = cp.empty(nbytes, dtype=cp.uint8), cp.empty(nbytes, dtype=cp.uint8)
    src.fill(1)
    with s:
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3, s.ptr)
        e0 = s.record()
        for _ in range(5):
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3, s.ptr)
        e1 = s.record()
    e1.synchronize()
    d2d = 2 * 5 * nbytes / (cp.cuda.get_elapsed_time(e0, e1) * 1e-3)
    del src, dst
    rng = np.random.default_rng(0)
    part = cp.zeros(1 << 22, dtype=cp.float32)
    counter = cp.zeros(4096, dtype=cp.int32)
    res = {"copy_d2d_Bps": d2d, "rows": []}
    print(f"device-to-device copy {d2d / 1e12:.2f} TB/s; {a.reps} launches per graph, {a.copies} copies of each matrix")
    print("| matrix | rows x cols | MB | tiled us | tiled TB/s | mv_q8r us | mv_q8r TB/s | row parts | mv_q8s us | "
          "mv_q8s TB/s | mv_q8s / mv_q8r speed | max rel. diff | mv_q8i us | mv_q8i TB/s | mv_q8i / mv_q8s speed | "
          "mv_q8i rel. diff from mv_q8s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def timed(fn) -> float:
        """Seconds per launch of ``fn(i)``, a.reps launches captured in one graph and replayed once."""
        with s:
            fn(0)  # compile, warm
            s.synchronize()
            s.begin_capture()
            for i in range(a.reps):
                fn(i)
            g = s.end_capture()
            g.launch(stream=s)
            e0 = s.record()
            g.launch(stream=s)
            e1 = s.record()
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / a.reps

    for name, rows, cols in SHAPES:
        raws, q8s = [], []
        for _ in range(a.copies):
            raw = q8_random(rng, rows, cols)
            q, d = q8_relayout(raw, rows, cols)
            raws.append(cp.asarray(raw))
            q8s.append((cp.asarray(q), cp.asarray(d)))
        x = cp.asarray(rng.standard_normal(cols).astype(np.float32))
        y1, y2, y3, y5 = (cp.empty(rows, dtype=cp.float32) for _ in range(4))
        gx, ks, shm = dq_launch_shape(rows, cols, n_sm)
        sb, lpr, su, sshm = dqs_launch_shape(rows, cols, n_sm)
        ib, ilpr, iu, ishm = dqi_launch_shape(rows, cols, n_sm)

        def tiled(i):
            matvec_tiled_launch(raws[i % a.copies], x, y1, 8, rows, cols)

        def dq(i):
            qq, dd = q8s[i % a.copies]
            k_dq((gx, ks), (DQ_THREADS,), (qq, dd, x, y2, np.int32(rows), np.int32(cols), np.float32(0.0), part,
                                          counter), shared_mem=shm)

        def dqs(i):
            qq, dd = q8s[i % a.copies]
            k_dqs((sb,), (DQ_THREADS,), (qq, dd, x, y3, np.int32(rows), np.int32(cols), np.float32(0.0),
                                         np.int32(lpr), np.int32(su), np.uint64(0), np.int32(0), np.int32(0)),
                  shared_mem=sshm)

        def dqi(i):
            qq, dd = q8s[i % a.copies]
            k_dqi((ib,), (DQ_THREADS,), (qq, dd, x, y5, np.int32(rows), np.int32(cols), np.float32(0.0),
                                         np.int32(ilpr), np.int32(iu), np.uint64(0), np.int32(0), np.int32(0)),
                  shared_mem=ishm)

        times = {key: timed(fn) for key, fn in (("tiled", tiled), ("dq", dq), ("dqs", dqs), ("dqi", dqi))}
        y4 = cp.empty(rows, dtype=cp.float32)
        vt = {}
        for vname, kv, vu, vb in variants:
            vsb, vlpr, vsu, vshm = dqs_launch_shape(rows, cols, n_sm, u_max=vu, blocks_per_sm=vb)

            def dqv(i, kv=kv, vsb=vsb, vlpr=vlpr, vsu=vsu, vshm=vshm):
                qq, dd = q8s[i % a.copies]
                kv((vsb,), (DQ_THREADS,), (qq, dd, x, y4, np.int32(rows), np.int32(cols), np.float32(0.0),
                                           np.int32(vlpr), np.int32(vsu), np.uint64(0), np.int32(0), np.int32(0)),
                   shared_mem=vshm)

            vt[vname] = timed(dqv)
            vt[vname + "_rel_diff"] = float(cp.abs(y1 - y4).max() / cp.abs(y1).max())
        for vname, kv, vu, vb in ivariants:
            vsb, vlpr, vsu, _ = dqs_launch_shape(rows, cols, n_sm, u_max=vu, blocks_per_sm=vb)

            def dqiv(i, kv=kv, vsb=vsb, vlpr=vlpr, vsu=vsu):
                qq, dd = q8s[i % a.copies]
                kv((vsb,), (DQ_THREADS,), (qq, dd, x, y4, np.int32(rows), np.int32(cols), np.float32(0.0),
                                           np.int32(vlpr), np.int32(vsu), np.uint64(0), np.int32(0), np.int32(0)),
                   shared_mem=dqi_shared_bytes(cols))

            vt[vname] = timed(dqiv)
            vt[vname + "_rel_diff"] = float(cp.abs(y3 - y4).max() / cp.abs(y3).max())
        # all three computed the last copy's product
        diff = max(float(cp.abs(y1 - y2).max() / cp.abs(y1).max()), float(cp.abs(y1 - y3).max() / cp.abs(y1).max()))
        idiff = float(cp.abs(y5 - y3).max() / cp.abs(y3).max())  # mv_q8i against mv_q8s, same last copy
        mb = raws[0].size
        row = {"matrix": name, "rows": rows, "cols": cols, "bytes": int(mb), "tiled_s": times["tiled"],
               "dq_s": times["dq"], "dqs_s": times["dqs"], "row_parts": ks, "dqs_lanes_per_row": lpr,
               "dqs_window": su, "dqs_blocks": sb, "max_rel_diff": diff, "dqi_s": times["dqi"], "dqi_window": iu,
               "dqi_blocks": ib, "dqi_speed_vs_dqs": times["dqs"] / times["dqi"], "dqi_rel_diff_vs_dqs": idiff,
               "variants": vt}
        res["rows"].append(row)
        print(f"| {name} | {rows} x {cols} | {mb / 1e6:.1f} | {times['tiled'] * 1e6:.1f} | "
              f"{mb / times['tiled'] / 1e12:.2f} | {times['dq'] * 1e6:.1f} | {mb / times['dq'] / 1e12:.2f} | {ks} | "
              f"{times['dqs'] * 1e6:.1f} | {mb / times['dqs'] / 1e12:.2f} | {times['dq'] / times['dqs']:.2f} | "
              f"{diff:.1e} | {times['dqi'] * 1e6:.1f} | {mb / times['dqi'] / 1e12:.2f} | "
              f"{times['dqs'] / times['dqi']:.2f} | {idiff:.1e} |", flush=True)
        print("    variants: " + ", ".join(f"{k} {vt[k] * 1e6:.1f} us ({mb / vt[k] / 1e12:.2f} TB/s, diff "
                                          f"{vt[k + '_rel_diff']:.1e})" for k, *_ in variants + ivariants)
              + " (mv_q8s builds: diff from the tiled kernel; mv_q8i builds i-*: from mv_q8s)", flush=True)
        del raws, q8s
    # the hyper-connection up projection + mix (4 streams of 2,560, rank 320): mv_q8r_mix against mv_q8s mix mode
    hc, n, cols = 4, 2560, 320
    q8s = [tuple(cp.asarray(v) for v in q8_relayout(q8_random(rng, hc * n, cols), hc * n, cols))
           for _ in range(a.copies)]
    x = cp.asarray(rng.standard_normal(cols).astype(np.float32))
    hn = cp.asarray(rng.standard_normal(hc * n).astype(np.float32))
    m1, m2, m3 = (cp.empty(n, dtype=cp.float32) for _ in range(3))
    sb, lpr, su, sshm = dqs_launch_shape(n, cols, n_sm, hc=hc)
    ib, ilpr, iu, ishm = dqi_launch_shape(n, cols, n_sm, hc=hc)

    def mix_rows(i):
        qq, dd = q8s[i % a.copies]
        k_mix(((n + 7) // 8,), (DQ_THREADS,), (qq, dd, x, np.float32(hc), hn, m1, np.int32(hc), np.int32(n),
                                               np.int32(cols)), shared_mem=cols * 4)

    def mix_stream(i):
        qq, dd = q8s[i % a.copies]
        k_dqs((sb,), (DQ_THREADS,), (qq, dd, x, m2, np.int32(hc * n), np.int32(cols), np.float32(hc), np.int32(lpr),
                                     np.int32(su), hn, np.int32(hc), np.int32(n)), shared_mem=sshm)

    def mix_int8(i):
        qq, dd = q8s[i % a.copies]
        k_dqi((ib,), (DQ_THREADS,), (qq, dd, x, m3, np.int32(hc * n), np.int32(cols), np.float32(hc), np.int32(ilpr),
                                     np.int32(iu), hn, np.int32(hc), np.int32(n)), shared_mem=ishm)

    t1, t2, t3 = timed(mix_rows), timed(mix_stream), timed(mix_int8)
    mb = q8s[0][0].nbytes + q8s[0][1].nbytes
    diff = float(cp.abs(m1 - m2).max() / cp.abs(m1).max())
    idiff = float(cp.abs(m3 - m2).max() / cp.abs(m2).max())
    res["mix"] = {"rows": hc * n, "cols": cols, "bytes": int(mb), "mv_q8r_mix_s": t1, "mv_q8s_s": t2,
                  "max_rel_diff": diff, "mv_q8i_s": t3, "dqi_speed_vs_dqs": t2 / t3, "dqi_rel_diff_vs_dqs": idiff}
    print(f"| hc up + mix | {hc * n} x {cols} | {mb / 1e6:.1f} | - | - | {t1 * 1e6:.1f} (mv_q8r_mix) | "
          f"{mb / t1 / 1e12:.2f} | 1 | {t2 * 1e6:.1f} | {mb / t2 / 1e12:.2f} | {t1 / t2:.2f} | {diff:.1e} | "
          f"{t3 * 1e6:.1f} | {mb / t3 / 1e12:.2f} | {t2 / t3:.2f} | {idiff:.1e} |", flush=True)
    if a.out:
        from stratatools.core.fsutil import write_text_atomic

        write_text_atomic(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
