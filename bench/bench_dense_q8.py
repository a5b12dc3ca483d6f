"""Dense Q8_0 matvec of the decode step, per matrix shape, on the GPU: the GGUF-block tiled kernel
(``matvec_tiled_kernel<8>``, the earlier fast path) against the re-laid-out ``mv_q8r`` (``runtime/gpu/dense_q8.cu``).
A benchmark, not a timed test: both kernels are timed in the same run, on the same random valid matrices.

Shapes: those of the full-width synthetic's step (hidden 2560, 4 hyper-connection streams, low rank 320): the
hyper-connection down projection with its inject rows stacked (324 x 10,240), its up projection (10,240 x 320), the
gated-DeltaNet input projections stacked (12,352 x 2,560), its output (2,560 x 4,096), the attention projections
stacked (13,312 x 2,560) and output (2,560 x 6,144). For each: ``--copies`` matrices (more bytes than the L2 cache
together) are multiplied in turn, ``--reps`` launches captured in one CUDA graph and replayed, so the time per launch
includes the launch gaps a step's graph has. Prints microseconds per launch, TB/s (matrix bytes / time) and the
device-to-device copy rate measured in the same run (the ceiling).

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

    from stratatools.runtime.gpu.kernels import (DQ_THREADS, _device_limits, cuda_source, dq_launch_shape,
                                                 matvec_tiled_launch, q8_relayout)

    n_sm = _device_limits()[0]
    k_dq = cp.RawModule(code=cuda_source("dense_q8.cu"), options=("--std=c++17",)).get_function("mv_q8r")
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
    print("| matrix | rows x cols | MB | tiled us | tiled TB/s | mv_q8r us | mv_q8r TB/s | row parts | max rel. diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, rows, cols in SHAPES:
        raws, q8s = [], []
        for _ in range(a.copies):
            raw = q8_random(rng, rows, cols)
            q, d = q8_relayout(raw, rows, cols)
            raws.append(cp.asarray(raw))
            q8s.append((cp.asarray(q), cp.asarray(d)))
        x = cp.asarray(rng.standard_normal(cols).astype(np.float32))
        y1, y2 = cp.empty(rows, dtype=cp.float32), cp.empty(rows, dtype=cp.float32)
        gx, ks, shm = dq_launch_shape(rows, cols, n_sm)

        def tiled(i):
            matvec_tiled_launch(raws[i % a.copies], x, y1, 8, rows, cols)

        def dq(i):
            qq, dd = q8s[i % a.copies]
            k_dq((gx, ks), (DQ_THREADS,), (qq, dd, x, y2, np.int32(rows), np.int32(cols), np.float32(0.0), part,
                                          counter), shared_mem=shm)

        times = {}
        for key, fn in (("tiled", tiled), ("dq", dq)):
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
            times[key] = cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / a.reps
        diff = float(cp.abs(y1 - y2).max() / cp.abs(y1).max())  # both computed the last copy's product
        mb = raws[0].size
        row = {"matrix": name, "rows": rows, "cols": cols, "bytes": int(mb), "tiled_s": times["tiled"],
               "dq_s": times["dq"], "row_parts": ks, "max_rel_diff": diff}
        res["rows"].append(row)
        print(f"| {name} | {rows} x {cols} | {mb / 1e6:.1f} | {times['tiled'] * 1e6:.1f} | "
              f"{mb / times['tiled'] / 1e12:.2f} | {times['dq'] * 1e6:.1f} | {mb / times['dq'] / 1e12:.2f} | {ks} | "
              f"{diff:.1e} |", flush=True)
        del raws, q8s
    if a.out:
        from stratatools.core.fsutil import write_text_atomic

        write_text_atomic(a.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
