"""The dense tensor-core kernels of the batched step alone (``stratatools/runtime/gpu/qmm.py``, up to 32 tokens):
``qmm_dense`` (each lane's weights in registers, one chunk ahead) against ``qmm_dense_ring`` (the weights through a
ring of shared-memory stages, several chunks ahead; ``STRATATOOLS_QMM_RING``) and the integer ring (the same ring on
16-bit fixed-point activations, ``mma.m16n8k32`` on the codes; ``STRATATOOLS_QMM_DENSE_I8``) on random Q8R matrices
of the release's dense shapes (hidden 2560; enough copies of each that successive launches do not find their weights
in L2). A benchmark, not a timed test: every ring runs in the same process on the same matrices and activations.

For each token count (``--tokens``) and shape (``--shapes``, rows x cols): ``qmm.dense`` with X already split (the
split of k's sum launch included), ``--reps`` launches on successive copies captured into a CUDA graph and one replay
timed with CUDA events (launched from Python one by one, the small matrices measured Python's 40 us a launch), for each
ring in ``--rings`` (``0``: ``qmm_dense``; ``S:RKC[:KG]``: the fp16 ring; ``i8:S:RKC[:KG]``: the integer ring, X
split its way beforehand too; a ``/w8`` or ``/w2`` suffix: groups of 8 or 2 warps, STRATATOOLS_QMM_RING_WARPS);
printed as us a launch, the weights' bytes a second (codes and scales), the ratio to the first ring named (> 1:
faster), and the largest difference from its output relative to its largest value.

Usage: python bench/bench_dense_ring.py [--tokens 32] [--rings 0,4:64:2,i8:4:64:2] [--shapes 12288x2560,...] [--reps 40]
       [--out res.json]
Under Nsight Compute: ``ncu --clock-control none -k regex:qmm_dense -c 8 python bench/bench_dense_ring.py --reps 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: The 48 x 256 model's Q8R matrices a layer reads in the batched step (rows x cols): attention q and gate, the GDN
#: projections, the output projections, attention k / v, the hyper-connection low-rank down projection and inject, the
#: GDN gates.
SHAPES = "12288x2560,8192x2560,4096x2560,2560x4096,2560x6144,512x2560,320x10240,4x10240,32x2560"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32")
    ap.add_argument("--rings", default="i8:3:128:2,i8:3:128/w8,i8:3:128:2/w2,i8:4:128:2/w2,i8:4:64:2/w2")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--bytes", type=float, default=256.0, help="MB of copies a shape (default 256: past L2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import cupy as cp

    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.kernels import begin_capture

    rng = np.random.default_rng(a.seed)
    rings = [r.strip() for r in a.rings.split(",") if r.strip()]
    rows_out = []
    for shape in [s for s in a.shapes.split(",") if s]:
        R, K = (int(v) for v in shape.lower().split("x"))
        n = max(2, min(64, int(a.bytes * 1e6 // (R * K))))
        mats = []
        for _ in range(n):
            q = cp.random.randint(-127, 128, size=R * K, dtype=cp.int32).astype(cp.int8)
            d = (cp.random.standard_normal(R * K // 32, dtype=cp.float32) * 0.02).astype(cp.float16).view(cp.uint16)
            mats.append((q, d))
        nbytes = R * K * (1 + 2 / 32)
        for T in [int(t) for t in a.tokens.split(",") if t]:
            X = cp.asarray(rng.standard_normal((T, K)).astype(np.float32))
            xs, xq = qmm.split(X), qmm.split_i8(X, dense=True)
            res, outs = {}, {}
            for rg in rings:
                i8 = rg.startswith("i8:")
                spec, _, warps = rg.partition("/w")
                os.environ[qmm.DENSE_I8_ENV] = spec[3:] if i8 else "0"
                os.environ[qmm.RING_ENV] = "0" if i8 else spec
                os.environ[qmm.RING_WARPS_ENV] = warps or "4"
                xa = xq if i8 else xs
                out = cp.empty((T, R), dtype=cp.float32)
                st = cp.cuda.Stream(non_blocking=True)
                pool = cp.cuda.MemoryPool()
                with cp.cuda.using_allocator(pool.malloc), st:
                    qmm.dense(X, "Q8R", mats[0][0], mats[0][1], R, K, xs=xa, out=out)  # compile, warm, counters
                    outs[rg] = out.copy()
                    st.synchronize()
                    # the launches captured into a CUDA graph: one replay times the device, not Python's launches
                    begin_capture(cp, st)
                    try:
                        for i in range(a.reps):
                            qm, dm = mats[i % n]
                            qmm.dense(X, "Q8R", qm, dm, R, K, xs=xa, out=out)
                    finally:
                        graph = st.end_capture()
                    graph.launch(st)
                    s, e = cp.cuda.Event(), cp.cuda.Event()
                    s.record(st)
                    graph.launch(st)
                    e.record(st)
                    e.synchronize()
                res[rg] = cp.cuda.get_elapsed_time(s, e) / a.reps * 1e3
            base = rings[0]
            ref = outs[base]
            scale = float(cp.abs(ref).max()) or 1.0
            row = {"rows": R, "cols": K, "tokens": T, "copies": n, "us": res,
                   "tbs": {rg: nbytes / (res[rg] * 1e-6) / 1e12 for rg in rings},
                   "ratio": {rg: res[base] / res[rg] for rg in rings},
                   "rel_diff": {rg: float(cp.abs(outs[rg] - ref).max()) / scale for rg in rings}}
            rows_out.append(row)
            print(f"{R:6d} x {K:5d} T {T:2d}: " + "  ".join(
                f"{rg} {res[rg]:7.1f} us {row['tbs'][rg]:.2f} TB/s x{row['ratio'][rg]:.2f} d{row['rel_diff'][rg]:.0e}"
                for rg in rings), flush=True)
    os.environ.pop(qmm.RING_ENV, None)
    os.environ.pop(qmm.DENSE_I8_ENV, None)
    os.environ.pop(qmm.RING_WARPS_ENV, None)
    tot = {rg: sum(r["us"][rg] for r in rows_out) for rg in rings}
    print("sum over shapes (us): " + "  ".join(f"{rg} {tot[rg]:.1f}" for rg in rings))
    if a.out:
        Path(a.out).write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
