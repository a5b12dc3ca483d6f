"""The routed-expert job kernels alone (``stratatools/runtime/gpu/qmm.py``): the fp16 hi / lo tensor-core jobs
(``qmm_moe_gu`` / ``qmm_moe_down`` after ``qmm_split``) against the integer ones (``qmm_moe_gu_i8`` /
``qmm_moe_down_i8`` after ``qmm_split_i8``) on random Q2_0 experts of the release's geometry (hidden 2560, expert
width 640; 256 experts a layer, ``--layers`` layers in VRAM so that successive launches do not find their weights in
L2) and random routings (k distinct experts a token). A benchmark, not a timed test: both paths run in the same
process on the same blobs and routings.

For each token count T (``--tokens``, default 32 and 512) and job size: the device job table (``qmm.moe_jobs``),
then each path's gate/up and down launches (splits included) timed with CUDA events over ``--reps`` routings (a new
layer each), printed as ms a layer, the bytes of the touched experts a second (each touched expert's blob read once),
and the ratio fp16 / integer (> 1: the integer path faster), and the largest difference of the integer path's output
from the fp16 path's, relative to the largest output. ``--rings`` times the integer path once per
``STRATATOOLS_QMM_JOBS_RING`` value (``0``: each lane's weights in registers; ``S:RKC``: through a ring of shared-memory
stages) and says whether each gives the first one's bits.

Usage: python bench/bench_qmm_jobs.py [--tokens 32,512] [--jobs 8,16] [--layers 8] [--reps 16] [--rings 0,3:256]
       [--out res.json]
Under Nsight Compute: ``ncu --clock-control none -k regex:qmm_moe -c 4 python bench/bench_qmm_jobs.py --reps 1``.
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

HIDDEN, FF, E, K_USED = 2560, 640, 256, 10


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32,512")
    ap.add_argument("--jobs", default="8,16")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rings", default="0,3:256",
                    help="integer paths timed: STRATATOOLS_QMM_JOBS_RING values (0: the weights in registers)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rings = [r.strip() for r in a.rings.split(",") if r.strip()]
    import cupy as cp

    from stratatools.runtime.gpu import qmm

    rng = np.random.default_rng(a.seed)
    rb_gu, rb_dn = HIDDEN // 64 * 18, FF // 64 * 18
    gate_bytes = FF * rb_gu
    blob = 2 * gate_bytes + HIDDEN * rb_dn
    layers = []
    for _ in range(a.layers):  # random codes, scales about 0.02 (the blocks' fp16 d)
        raw = cp.random.randint(0, 256, size=E * blob, dtype=cp.uint8)
        b2 = raw.reshape(E, blob)
        for off, rows, rb in ((0, 2 * FF, rb_gu), (2 * gate_bytes, HIDDEN, rb_dn)):
            blk = b2[:, off:off + rows * rb].reshape(E, -1, 18)
            d = (cp.random.standard_normal(blk.shape[:2], dtype=cp.float32) * 0.02).astype(cp.float16)
            blk[:, :, :2] = d.view(cp.uint8).reshape(E, -1, 2)
        layers.append((raw, cp.arange(E, dtype=cp.uint64) * blob + np.uint64(raw.data.ptr)))
    rows = []
    for T in [int(t) for t in a.tokens.split(",") if t]:
        for jt in [int(j) for j in a.jobs.split(",") if j]:
            X = cp.asarray(rng.standard_normal((T, HIDDEN)).astype(np.float32))
            routes = [cp.asarray(np.stack([rng.permutation(E)[:K_USED] for _ in range(T)]).astype(np.int32))
                      for _ in range(a.reps)]
            tables = [qmm.moe_jobs(routes[i].reshape(-1), K_USED, E, layers[i % a.layers][1], jt)
                      for i in range(a.reps)]
            touched = sum(len(np.unique(cp.asnumpy(r))) for r in routes) * blob
            N = T * K_USED

            def fp16(tab):
                ptr, tok, dst = tab
                J = int(ptr.size)
                hbuf = cp.zeros((J * jt, FF), dtype=cp.float32)
                qmm.moe_gate_up(ptr, tok, qmm.split(X), "Q2_0", hbuf, HIDDEN, FF, jt)
                out = cp.empty((N, HIDDEN), dtype=cp.float32)
                qmm.moe_down(ptr, 2 * gate_bytes, dst, qmm.split(hbuf), "Q2_0", out, HIDDEN, FF, jt)
                return out

            def int8(tab):
                ptr, tok, dst = tab
                J = int(ptr.size)
                hbuf = cp.empty((J * jt, FF), dtype=cp.float32)
                qmm.moe_gate_up_i8(ptr, tok, qmm.split_i8(X), hbuf, HIDDEN, FF, jt)
                out = cp.empty((N, HIDDEN), dtype=cp.float32)
                qmm.moe_down_i8(ptr, 2 * gate_bytes, dst, qmm.split_i8(hbuf, dst), out, HIDDEN, FF, jt)
                return out

            res = {}
            paths = [("fp16", fp16, None)] + [("int8" if r == "0" else f"int8r{r}", int8, r) for r in rings]
            for name, fn, rg in paths:
                if rg is not None:
                    os.environ[qmm.JOBS_RING_ENV] = rg
                fn(tables[0])  # compile and warm
                cp.cuda.Device().synchronize()
                s, e = cp.cuda.Event(), cp.cuda.Event()
                s.record()
                for tab in tables:
                    fn(tab)
                e.record()
                e.synchronize()
                res[name] = cp.cuda.get_elapsed_time(s, e) / a.reps
            o16 = fp16(tables[0])
            outs = {}
            for name, fn, rg in paths[1:]:
                os.environ[qmm.JOBS_RING_ENV] = rg
                outs[name] = fn(tables[0])
            os.environ.pop(qmm.JOBS_RING_ENV, None)
            first = paths[1][0]
            rel = float(cp.abs(outs[first] - o16).max() / cp.abs(o16).max())
            same = {n: bool(cp.array_equal(o, outs[first])) for n, o in outs.items()}
            row = {"tokens": T, "job": jt, "ms": res, "tbs": {n: touched / a.reps / v / 1e9 for n, v in res.items()},
                   "fp16_ms": res["fp16"], "int8_ms": res[first], "ratio": res["fp16"] / res[first], "rel_diff": rel,
                   "same_bits_as_first_int8": same}
            rows.append(row)
            print(f"T {T:4d} job {jt:2d}: " + "  ".join(f"{n} {v:.3f} ms ({row['tbs'][n]:.2f} TB/s)"
                                                      for n, v in res.items())
                  + f"  fp16/{first} {row['ratio']:.2f}x  rel diff {rel:.2e}  same bits {same}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
