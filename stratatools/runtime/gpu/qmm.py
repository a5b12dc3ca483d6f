"""Tensor-core GEMMs straight from quantized weights (``qmm.cu`` with the ``mma.cuh`` wrapper), for the batched
prefill and the batched decode (issue 12 items 2 and 3).

``Y[T, R] = X[T, K] W[R, K]^T`` with W in one of :data:`LAYOUTS`: the decoder's re-laid-out Q8_0 (``Q8R``: int8
codes [R, K] and fp16 scales [R, K / 32], :func:`stratatools.runtime.gpu.kernels.q8_relayout`), or GGUF ``Q8_0`` /
``Q2_0`` block bytes. X is float32; it is split once per call (:func:`split`) into two fp16 halves of ``x 2^-e_t``
(``e_t`` a power of two per row), the weights enter ``mma.m16n8k16`` as their exact integer codes and each block's
scale multiplies the block's float32 partial sum once: the result agrees with a float64 reference to about 1e-6
relative (see the header of ``qmm.cu``). The routed experts of the prefill run as jobs of one expert and up to
:data:`JOB_TOKENS` tokens (:func:`moe_gate_up` / :func:`moe_down`, the job table of
:func:`stratatools.runtime.gpu.prefill.expert_jobs`).

:data:`GEMM_ENV` (``STRATATOOLS_PREFILL_GEMM``) picks the prefill's dense path: ``mma`` (default: these kernels where
the layout allows; 1.80x the SGEMM path on the 48 x 256 model's 512-token prefill, H200, bench/gpu-notes.md),
``sgemm`` (dequantize to float32, cuBLAS SGEMM) or ``hgemm`` (:func:`hgemm`: the matrix written once as two fp16
matrices Wh + Wl = W exactly (``qmm_wsplit``), X split as for ``mma``, three cuBLAS fp16 GEMMs with float32
accumulation into one float32 Y, then the rows' scales; same ~1e-6 precision; a matrix whose values do not fit fp16
falls back to ``mma``; measured slower than ``mma`` on that prefill, 1,446 against 1,773 tok/s: at 512 tokens each
matrix's split and three GEMM launches cost more than the tensor-core kernels). :data:`BATCH_GEMM_ENV`
(``STRATATOOLS_BATCH_GEMM``) picks the batched decode step's, default ``mma`` (with the step's CUDA graph the fastest
at 1, 8 and 32 sequences: 41 / 265 / 649 tok/s against 21 / 131 / 364 for ``sgemm`` and 23 / 166 / 495 for
``hgemm``). Importing this module needs no CuPy.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.runtime.gpu.kernels import cuda_source, cuda_unit, env_choice, env_count, env_on, launch_big_shared
from stratatools.runtime.gpu.launch import batch_kernel

#: Weight layouts the kernels read: name -> the kernels' template id F (qmm.cu).
LAYOUTS: dict[str, int] = {"Q8R": 0, "Q8_0": 8, "Q2_0": 42}
#: Values of one quantization block (one fp16 scale) per layout id.
BLOCK_VALUES: dict[int, int] = {0: 32, 8: 32, 42: 64}
#: Bytes of one GGUF block per layout id (Q8R: codes only, no blocks).
BLOCK_BYTES: dict[int, int] = {0: 32, 8: 34, 42: 18}
#: Token tiles (8 NT tokens a block) the dense kernel is instantiated for.
TILES = (2, 4, 8)
#: Threads a block (qmm.cu QMM_THREADS: 4 warps, 16 weight rows each).
THREADS = 128
ROWS_PER_BLOCK = 16 * (THREADS // 32)
#: Tokens of one expert job (qmm.cu's JT): the default, and the sizes the job kernels are instantiated for.
JOB_TOKENS = 16
JOB_SIZES = (8, 16, 32)
#: The prefill's job size (``STRATATOOLS_PREFILL_JOB``, one of :data:`JOB_SIZES`) and the batched step's
#: (``STRATATOOLS_BATCH_JOB``: one or two tokens an expert at 32 sequences; jobs of 8 measured 828 against 794
#: tok/s of 16 at 32 sequences on the H200, bench/gpu-notes.md, fourteenth pass).
JOB_ENV = "STRATATOOLS_PREFILL_JOB"
JOB_DEFAULT = 16
BATCH_JOB_ENV = "STRATATOOLS_BATCH_JOB"
BATCH_JOB_DEFAULT = 8
SPLIT_THREADS = 256
#: qmm.cu QMM_KC: values of k a chunk of staged activations holds.
KC = 128
#: Environment knobs of the chunk of k (values; 64, 128 or 256) the dense kernels and the expert job kernels stage at a
#: time (``qmm.cu`` QMM_KC; each family from a module built with its own): a larger chunk keeps more weight bytes in
#: flight a lane, a smaller one more blocks a SM (shared memory). Default :data:`KC` for both (Q2_0 expert jobs:
#: :data:`MOE_KC_DEFAULT`). ``STRATATOOLS_QMM_MOE_KC=256`` applies to Q8_0 expert jobs too, whose gate/up kernel then
#: spills registers (nvcc sm_90: 640 bytes; slower, the same results).
KC_ENV, MOE_KC_ENV = "STRATATOOLS_QMM_KC", "STRATATOOLS_QMM_MOE_KC"
KCS = (64, 128, 256)
#: Environment switch of the prefill's dense GEMMs.
GEMM_ENV = "STRATATOOLS_PREFILL_GEMM"
#: Environment switch of the batched decode step's dense GEMMs (and, with ``mma``, its routed-expert jobs).
BATCH_GEMM_ENV = "STRATATOOLS_BATCH_GEMM"
GEMMS = ("sgemm", "mma", "hgemm")
#: ``STRATATOOLS_QMM_DENSE2``: dense launches of more than 32 tokens over a matrix of a multiple of 128 rows take
#: two 16-row tiles a warp (``qmm_dense<F, DENSE2_NT, 2>``: half the shared-memory reads of activation fragments a
#: product, the block's tokens staged once for 128 rows) and no k split: unset or empty (``auto``) where those blocks
#: alone fill the SMs (H200, 512-token prefill: the large Q8R matrices 59 -> 42 ms; the shared expert's few rows,
#: which need the k split, 7.9 -> 11.6 ms with it: bench/gpu-notes.md, fourteenth pass), ``1`` wherever it applies,
#: ``0`` never.
DENSE2_ENV = "STRATATOOLS_QMM_DENSE2"
DENSE2_NT = 4
DENSE2_ROWS = 2 * ROWS_PER_BLOCK  # rows of one block (4 warps of 32 rows)
#: On the ``mma`` prefill path, dense matrices of at least this many weights (``STRATATOOLS_PREFILL_BIG``, a whole
#: number; 0: none) multiplied with at least :data:`BIG_MIN_TOKENS` rows go through :func:`hgemm` (cuBLAS fp16 GEMMs,
#: the same ~1e-6 precision) instead of the tensor-core kernel: cuBLAS is faster on the large shapes, the tensor-core
#: kernels on the small ones and without the per-matrix split of W (bench/gpu-notes.md).
BIG_ENV = "STRATATOOLS_PREFILL_BIG"
#: Eager chunks: none (cuBLAS's extra launches cost more host time than they save device time there).
BIG_DEFAULT = 0
#: The prefill's CUDA graph (no host cost a launch): matrices of 2M weights and more (H200, 512-token prefill:
#: 149 against 177 ms of device time, bench/gpu-notes.md).
BIG_GRAPH_DEFAULT = 1 << 21
BIG_MIN_TOKENS = 128
#: Threads of a ``qmm_wsplit`` block.
WSPLIT_THREADS = 256


def _gemm_from(env: str, default: str) -> str:
    v = os.environ.get(env, default).strip().lower() or default
    if v not in GEMMS:
        raise StrataError(f"{env}={v!r}: use sgemm, mma or hgemm")
    return v


def prefill_gemm() -> str:
    """The batched prefill's dense GEMM path from :data:`GEMM_ENV`: ``mma`` (default), ``sgemm`` or ``hgemm``.
    Raises StrataError for another value."""
    return _gemm_from(GEMM_ENV, "mma")


def dense2() -> str:
    """:data:`DENSE2_ENV`: ``auto`` (unset or empty), ``1`` or ``0``. Raises StrataError for another value."""
    import os

    v = os.environ.get(DENSE2_ENV, "").strip() or "auto"
    if v not in ("auto", "0", "1"):
        raise StrataError(f"{DENSE2_ENV}={v!r}: use 1 (two 16-row tiles a warp for longer X), 0, or leave it unset "
                          "(where the blocks fill the SMs)")
    return v


def dense2_launch(T: int, rows: int, n_sm: int = 0) -> tuple[int, int, int] | None:
    """The launch of the two-tile dense kernel for T tokens and ``rows`` weight rows: (NT, grid x, grid y), or None
    where it does not apply (T up to 32, rows not a multiple of :data:`DENSE2_ROWS`, fewer blocks than ``n_sm``)."""
    if T <= 8 * TILES[1] or rows % DENSE2_ROWS:
        return None
    gx, gy = rows // DENSE2_ROWS, -(-int(T) // (8 * DENSE2_NT))
    return None if gx * gy < int(n_sm) else (DENSE2_NT, gx, gy)


def big_matrix_values(graph: bool = False) -> int:
    """:data:`BIG_ENV`: the weights from which the ``mma`` prefill's dense matrices take :func:`hgemm` (0: none);
    unset or empty: :data:`BIG_GRAPH_DEFAULT` in the prefill's CUDA graph (``graph``), :data:`BIG_DEFAULT` in an
    eager chunk. Raises StrataError for a value that is not a whole number."""
    return env_count(BIG_ENV, BIG_GRAPH_DEFAULT if graph else BIG_DEFAULT, 0, "weights")


def batch_gemm() -> str:
    """The batched decode step's dense GEMM path from :data:`BATCH_GEMM_ENV`: ``mma`` (default), ``sgemm`` or
    ``hgemm``. Raises StrataError for another value."""
    return _gemm_from(BATCH_GEMM_ENV, "mma")


def device_source() -> str:
    """The CUDA translation unit of the qmm kernels (``prelude.cuh``, ``mma.cuh``, ``qmm.cu``)."""
    return cuda_source("prelude.cuh") + cuda_source("mma.cuh") + cuda_unit("qmm.cu")


def kernel_names() -> list[str]:
    """Name expressions of every kernel the module instantiates."""
    names = ["qmm_split", "qmm_jobs", "qmm_sum_slices", "qmm_act_rows", "qmm_sum_act<1>", "qmm_sum_act<2>",
             "qmm_f32_nt"]
    names += [f"qmm_dense<{f}, {nt}>" for f in sorted(set(LAYOUTS.values())) for nt in TILES]
    names += [f"qmm_dense<{f}, {DENSE2_NT}, 2>" for f in sorted(set(LAYOUTS.values()))]
    names += [f"{k}<{f}, {jt}>" for k in ("qmm_moe_gu", "qmm_moe_down") for f in (8, 42) for jt in JOB_SIZES]
    names += [f"qmm_wsplit<{f}>" for f in sorted(set(LAYOUTS.values()))]
    names += ["qmm_split_i8", "qmm_split_i8d"] + [f"qmm_moe_gu_i8<{jt}>" for jt in JOB_SIZES]
    names += ["qmm_hc_norm_split", "qmm_hc_mix_split<0>", "qmm_hc_mix_split<1>"]
    names += [f"qmm_sum_act_split<{a}>" for a in (ACT_NONE, ACT_SILU, ACT_SIG2)] + ["qmm_sum_hc"]
    names += [f"qmm_moe_down_i8<{jt}>" for jt in JOB_SIZES]
    return names


#: The expert job kernels' default chunk per layout id: Q2_0 256 (its job kernels keep more weight bytes in flight:
#: the 48 x 256 model's gate/up jobs took 33.5 against 37.0 ms a 512-token prefill, 9.5 against 12.3 ms a 32-sequence
#: step, H200, bench/gpu-notes.md), else :data:`KC` (Q8_0's gate/up kernel would spill at 256).
MOE_KC_DEFAULT: dict[int, int] = {42: 256}


def chunk_values(moe: bool = False, layout: Any = None) -> int:
    """The chunk of k (values) of the dense kernels, or with ``moe`` of the expert job kernels of ``layout`` (name or
    id): :data:`KC_ENV` / :data:`MOE_KC_ENV`, default :data:`KC` (experts: :data:`MOE_KC_DEFAULT`). Raises
    StrataError for a value not in :data:`KCS`."""
    default = MOE_KC_DEFAULT.get(_layout_id(layout), KC) if moe and layout is not None else KC
    return env_choice(MOE_KC_ENV if moe else KC_ENV, KCS, default)


@functools.lru_cache(maxsize=None)
def module(kc: int = KC) -> Any:
    """Compile (once per chunk size ``kc``, :func:`chunk_values`) the qmm kernels with multiply-add fusion allowed
    (``cupy.RawModule``; needs sm_80 or newer for ``mma.m16n8k16`` with f32 accumulation)."""
    import cupy

    opts = ("--std=c++17",) + (() if kc == KC else (f"-DQMM_KC={int(kc)}",))
    return cupy.RawModule(code=device_source(), options=opts, name_expressions=kernel_names())


def _fn(name: str, kc: int = KC) -> Any:
    return batch_kernel(module(kc).get_function(name), name)


#: ``qmm_wsplit``'s parameters (declaration, call).
WSPLIT_SIG = ("const u8* w, const u16* wd, long long rb, int R, int K, u16* wh, u16* wl, int* flag",
              "w, wd, rb, R, K, wh, wl, flag")


def host_source() -> str:
    """``mma.cuh`` and ``qmm.cu`` as host C++17 (``host_kernel_shim.cuh``: one thread per block playing its warp's 32
    lanes), with entries ``host_qmm_split(gx, gy, ...)``, ``host_qmm_dense_<F>_<NT>(gx, gy, ...)`` (and
    ``host_qmm_dense_<F>_4_2``, two row tiles a warp; ``host_qmm_dense_ring_<NT>_<S>_<RKC>_<KG>_<I8>``, I8 0:
    :data:`RING_HOST`, 1: :data:`DENSE_I8_HOST`; ``host_qmm_split_i8`` / ``host_qmm_split_i8d``),
    ``host_qmm_moe_gu_<F>_<JT>`` / ``host_qmm_moe_down_<F>_<JT>``, ``host_qmm_wsplit_<F>`` (the kernels' parameters) and the
    wrapper checks ``host_mma_tile(A, B, C, D)`` (A [16, 16], B [16, 8] half bits row-major, C, D [16, 8] float32:
    D = A B + C through the documented fragment layout) and ``host_f2h(x, h, n)`` / ``host_h2f(h, x, n)`` (tests/test_gpu_qmm_host.py)."""
    dense = ("const u8* w, const u16* wd, long long rb, const u16* xhi, const u16* xlo, const float* xsc, float* Y, "
             "long long ldy, int T, int R, int K, int nz, float* P, int* cnt",
             "w, wd, rb, xhi, xlo, xsc, Y, ldy, T, R, K, nz, P, cnt")
    gu = ("const u64* job_ptr, const int* job_tok, const u16* xhi, const u16* xlo, const float* xsc, float* Hbuf, "
          "int H, int Fd", "job_ptr, job_tok, xhi, xlo, xsc, Hbuf, H, Fd")
    dn = ("const u64* job_ptr, long long doff, const int* job_dst, const u16* hhi, const u16* hlo, const float* hsc, "
          "float* out, int H, int Fd", "job_ptr, doff, job_dst, hhi, hlo, hsc, out, H, Fd")
    ent = ['extern "C" void host_qmm_split(unsigned gx, unsigned gy, const float* X, long long ldx, int T, int K, '
           "u16* hi, u16* lo, float* sc) {\n    host_run_grid(gx, gy, [&]() { qmm_split(X, ldx, T, K, hi, lo, sc); });\n}\n",
           'extern "C" void host_qmm_sum_slices(unsigned gx, unsigned gy, const float* P, float* Y, long long n, '
           "int nz) {\n    host_run_grid(gx, gy, [&]() { qmm_sum_slices(P, Y, n, nz); });\n}\n",
           *('extern "C" void host_qmm_sum_act_%d(unsigned gx, unsigned gy, const float* P, float* Y, long long n, '
             "int nz, float div) {\n    host_run_grid(gx, gy, [&]() { qmm_sum_act<%d>(P, Y, n, nz, div); });\n}\n"
             % (a, a) for a in (1, 2)),
           'extern "C" void host_qmm_f32_nt(unsigned gx, unsigned gy, const float* X, const float* W, float* P, int T, '
           "int R, int K) {\n    host_run_grid(gx, gy, [&]() { qmm_f32_nt(X, W, P, T, R, K); });\n}\n",
           'extern "C" void host_qmm_act_rows(unsigned gx, unsigned gy, float* Y, long long n, int act, float div) {\n'
           "    host_run_grid(gx, gy, [&]() { qmm_act_rows(Y, n, act, div); });\n}\n",
           'extern "C" void host_qmm_jobs(unsigned gx, unsigned gy, const int* ids, int N, int k, int E, '
           "const u64* ptr_row, int jmax, int jt, u64* job_ptr, int* job_tok, int* job_dst) {\n    host_run_grid(gx, gy, "
           "[&]() { qmm_jobs(ids, N, k, E, ptr_row, jmax, jt, job_ptr, job_tok, job_dst); });\n}\n"]
    for f in sorted(set(LAYOUTS.values())):
        for nt in TILES:
            ent.append(f'extern "C" void host_qmm_dense_{f}_{nt}(unsigned gx, unsigned gy, {dense[0]}) {{\n'
                       f"    host_run_grid(gx, gy, [&]() {{ qmm_dense<{f}, {nt}>({dense[1]}); }});\n}}\n")
        ent.append(f'extern "C" void host_qmm_dense_{f}_{DENSE2_NT}_2(unsigned gx, unsigned gy, {dense[0]}) {{\n'
                   f"    host_run_grid(gx, gy, [&]() {{ qmm_dense<{f}, {DENSE2_NT}, 2>({dense[1]}); }});\n}}\n")
    rings = [(nt, st, rkc, kg, i8, 4) for i8, cfgs in ((0, RING_HOST), (1, DENSE_I8_HOST)) for nt, st, rkc, kg in cfgs]
    for nt, st, rkc, kg, i8, wg in rings + [(*r, wg) for wg in (8, 2) for r in RING_WG_HOST]:
        inst = ring_instance(nt, (st, rkc, kg), bool(i8), wg)
        entry = f"host_qmm_dense_ring_{nt}_{st}_{rkc}_{kg}_{i8}" + ("" if wg == 4 else f"_{wg}")
        ent.append(f'extern "C" void {entry}(unsigned gx, unsigned gy, {dense[0]}) {{\n'
                   f"    host_run_grid(gx, gy, [&]() {{ {inst}({dense[1]}); }});\n}}\n")
    for f in sorted(set(LAYOUTS.values())):
        ent.append(f'extern "C" void host_qmm_wsplit_{f}(unsigned gx, unsigned gy, {WSPLIT_SIG[0]}) {{\n'
                   f"    host_run_grid(gx, gy, [&]() {{ qmm_wsplit<{f}>({WSPLIT_SIG[1]}); }});\n}}\n")
    for f in (8, 42):
        for jt in JOB_SIZES:
            for name, (decl, call) in (("qmm_moe_gu", gu), ("qmm_moe_down", dn)):
                ent.append(f'extern "C" void host_{name}_{f}_{jt}(unsigned gx, unsigned gy, {decl}) {{\n'
                           f"    host_run_grid(gx, gy, [&]() {{ {name}<{f}, {jt}>({call}); }});\n}}\n")
    gi = ("const u64* job_ptr, const int* job_tok, const u8* xh, const u8* xl, const float* xs, const int* xq, "
          "float* Hbuf, int H, int Fd", "job_ptr, job_tok, xh, xl, xs, xq, Hbuf, H, Fd")
    di = ("const u64* job_ptr, long long doff, const int* job_dst, const u8* hh, const u8* hl, const float* hs, "
          "const int* hq, float* out, int H, int Fd", "job_ptr, doff, job_dst, hh, hl, hs, hq, out, H, Fd")
    jobs_i8 = (("qmm_moe_gu_i8", gi), ("qmm_moe_down_i8", di))
    for jt in JOB_SIZES:
        for name, (decl, call) in jobs_i8:
            ent.append(f'extern "C" void host_{name}_{jt}(unsigned gx, unsigned gy, {decl}) {{\n'
                       f"    host_run_grid(gx, gy, [&]() {{ {name}<{jt}>({call}); }});\n}}\n")
    for st, rkc, pad in JOBS_RING_HOST:
        for jt in JOB_SIZES:
            for name, (decl, call) in jobs_i8:
                ent.append(f'extern "C" void host_{name}_{jt}_{st}_{rkc}_{pad}(unsigned gx, unsigned gy, {decl}) {{\n'
                           f"    host_run_grid(gx, gy, [&]() {{ {name}<{jt}, {st}, {rkc}, {pad}>({call}); }});\n}}\n")
    for sfx in ("", "d"):
        ent.append(f'extern "C" void host_qmm_split_i8{sfx}(unsigned gx, unsigned gy, const float* X, long long ldx, '
                   "int T, int K, const int* rowok, u32* xh, u32* xl, float* xs, int* xq) {\n    host_run_grid(gx, gy, "
                   f"[&]() {{ qmm_split_i8{sfx}(X, ldx, T, K, rowok, xh, xl, xs, xq); }});\n}}\n")
    ent.append('extern "C" void host_qmm_hc_norm_split(unsigned gx, unsigned gy, float* H, const float* y, '
               "const float* iw, int hc, int n, const float* w, int wlen, float eps, float* hn, u32* xh, u32* xl, "
               "float* xs, int* xq) {\n    host_run_grid(gx, gy, [&]() { qmm_hc_norm_split(H, y, iw, hc, n, w, wlen, "
               "eps, hn, xh, xl, xs, xq); });\n}\n")
    for a in (ACT_NONE, ACT_SILU, ACT_SIG2):
        ent.append(f'extern "C" void host_qmm_sum_act_split_{a}(unsigned gx, unsigned gy, const float* P, float* Y, '
                   "int R, int nz, float div, u32* xh, u32* xl, float* xs, int* xq) {\n    host_run_grid(gx, gy, "
                   f"[&]() {{ qmm_sum_act_split<{a}>(P, Y, R, nz, div, xh, xl, xs, xq); }});\n}}\n")
    ent.append('extern "C" void host_qmm_sum_hc(unsigned gx, unsigned gy, const float* P, float* m, float* iw, '
               "int R, int rd, int nz, float div, u32* xh, u32* xl, float* xs, int* xq) {\n    host_run_grid(gx, gy, "
               "[&]() { qmm_sum_hc(P, m, iw, R, rd, nz, div, xh, xl, xs, xq); });\n}\n")
    for o in (0, 1):
        ent.append(f'extern "C" void host_qmm_hc_mix_split_{o}(unsigned gx, unsigned gy, const float* u, '
                   "const float* hn, int hc, int n, int T, float* out, u32* xh, u32* xl, float* xs, int* xq) {\n"
                   f"    host_run_grid(gx, gy, [&]() {{ qmm_hc_mix_split<{o}>(u, hn, hc, n, T, out, xh, xl, xs, xq); "
                   "});\n}\n")
    ent.append(
        'extern "C" void host_mma_tile(const u16* A, const u16* B, const float* C, float* D) {\n'
        "    mma_a a; mma_b b; mma_c c;\n"
        "    for (int l = 0; l < 32; ++l) {\n"
        "        const int g = l >> 2, t = l & 3;\n"
        "        for (int m = 0; m < 4; ++m) {\n"
        "            const int row = g + ((m & 1) ? 8 : 0), col = 2 * t + ((m & 2) ? 8 : 0);\n"
        "            a.x[l][m] = mma_pack(A[row * 16 + col], A[row * 16 + col + 1]);\n"
        "        }\n"
        "        for (int m = 0; m < 2; ++m) {\n"
        "            const int k = 2 * t + (m ? 8 : 0);\n"
        "            b.x[l][m] = mma_pack(B[k * 8 + g], B[(k + 1) * 8 + g]);\n"
        "        }\n"
        "        for (int i = 0; i < 4; ++i) c.x[l][i] = C[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)];\n"
        "    }\n"
        "    mma_sync(c, a, b);\n"
        "    for (int l = 0; l < 32; ++l) {\n"
        "        const int g = l >> 2, t = l & 3;\n"
        "        for (int i = 0; i < 4; ++i) D[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)] = c.x[l][i];\n"
        "    }\n"
        "}\n"
        'extern "C" void host_f2h(const float* x, u16* h, long long n) { for (long long i = 0; i < n; ++i) h[i] = mma_f2h(x[i]); }\n'
        'extern "C" void host_h2f(const u16* h, float* x, long long n) { for (long long i = 0; i < n; ++i) x[i] = mma_h2f(h[i]); }\n')
    return cuda_source("host_kernel_shim.cuh") + device_source() + "".join(ent)


# ---- launchers ---------------------------------------------------------------------------------------------------
def _layout_id(layout: Any) -> int:
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise StrataError(f"qmm: weight layout {layout!r} is not one of {', '.join(LAYOUTS)}")
        return LAYOUTS[layout]
    if int(layout) not in BLOCK_VALUES:
        raise StrataError(f"qmm: weight layout id {layout} is not one of {sorted(BLOCK_VALUES)}")
    return int(layout)


def supports(layout: Any, cols: int) -> bool:
    """Can :func:`dense` multiply a matrix of this layout (name or id; ggml type ids 8 and 42 are the GGUF layouts)
    with rows of ``cols`` values (whole blocks)?"""
    try:
        f = _layout_id(layout)
    except StrataError:
        return False
    return cols > 0 and cols % BLOCK_VALUES[f] == 0


def smem_bytes(layout: Any, nt: int, kc: int = KC) -> int:
    """Dynamic shared memory of a qmm kernel with ``nt`` column tiles of 8 tokens (qmm.cu QmmSmem): two stage buffers
    of the tokens' hi and lo halves, rows of QMM_KC values plus the layout's bank padding."""
    f = _layout_id(layout)
    xs = int(kc) + (40 if f == 42 else 32)
    return 2 * 2 * 8 * int(nt) * xs * 2


def split_threads(K: int) -> int:
    """Threads of a ``qmm_split`` block for rows of K values: about 4 values a thread, whole warps, at most
    :data:`SPLIT_THREADS` (the batched step's expert rows of 640 values took 17.9 us a launch of 2,368 rows with 256
    threads, H200, bench/gpu-notes.md)."""
    return max(32, min(SPLIT_THREADS, 32 * -(-int(K) // 128)))


def split(X: Any) -> tuple[Any, Any, Any]:
    """Split float32 activations X [T, K] (CuPy; K a multiple of 8) into (hi, lo) fp16 bits uint16 [T, K] and the
    row scales sc float32 [T] (powers of two) with X ~= (hi + lo) sc (``qmm_split``). Raises StrataError for another
    shape."""
    import cupy as cp

    if X.ndim != 2 or X.shape[1] % 8 or X.shape[0] < 1:
        raise StrataError(f"qmm: activations of shape {tuple(X.shape)} are not [T >= 1, K] with K a multiple of 8")
    X = cp.ascontiguousarray(X, dtype=cp.float32)
    T, K = (int(s) for s in X.shape)
    hi = cp.empty((T, K), dtype=cp.uint16)
    lo = cp.empty((T, K), dtype=cp.uint16)
    sc = cp.empty(T, dtype=cp.float32)
    _fn("qmm_split")((min(T, 65535),), (split_threads(K),), (X, np.int64(K), np.int32(T), np.int32(K), hi, lo, sc))
    return hi, lo, sc


def token_tile(T: int) -> int:
    """NT (8 NT tokens a block) of a dense launch for T tokens: 2 up to 16 tokens, 4 up to 32, else 8 (a few-row matrix
    over a long chunk gets its blocks from a split of k, :func:`dense_launch`, no longer from smaller token tiles)."""
    return 2 if T <= 16 else (4 if T <= 32 else 8)


#: ``STRATATOOLS_QMM_SHORT_FILL``: up to 32 tokens, the blocks a SM that :func:`dense_launch`'s split of k aims at (2,
#: 3 or 4; the kernel keeps 3 blocks of 4 warps a SM resident at 32 tokens): k is split while the row blocks are
#: fewer than fill / 2 SMs' worth, into at most fill SMs' worth of blocks.
SHORT_FILL_ENV = "STRATATOOLS_QMM_SHORT_FILL"
SHORT_FILL_DEFAULT = 2


def short_fill() -> int:
    """:data:`SHORT_FILL_ENV` (2, 3 or 4; default :data:`SHORT_FILL_DEFAULT`); raises StrataError for another value."""
    return env_choice(SHORT_FILL_ENV, (2, 3, 4), SHORT_FILL_DEFAULT)


def dense_launch(T: int, rows: int, cols: int, layout: Any, n_sm: int, kc: int = KC,
                 rows_block: int = ROWS_PER_BLOCK) -> tuple[int, int, int, int]:
    """The launch of :func:`dense` for T tokens and a [rows, cols] matrix on a device of ``n_sm`` SMs: (NT, grid x,
    grid y, nz). NT from :func:`token_tile` (by T alone); while the row blocks times the token tiles would leave SMs
    idle (fewer than ``n_sm``, or, up to 32 tokens, row blocks fewer than ``n_sm``), k is split into nz slices
    (chunks of :data:`KC` values, at most :data:`SPLIT_MAX`, up to 32 tokens :data:`SPLIT_MAX_SHORT`) for about two
    blocks a SM (the kernel's occupancy), the
    slices' partial sums added by the kernel's last slice of each tile (up to 32 tokens by :func:`dense` after it).
    The 512-token prefill's few-row matrices (hyper-connection down
    projections, GDN gates) ran as 160 blocks that each walked 80 chunks of k before this split. ``rows_block``: the
    weight rows of a block (the rings with 8 warps a group: 128)."""
    f = _layout_id(layout)
    gx = -(-int(rows) // int(rows_block))
    nt = token_tile(T)
    ty = -(-int(T) // (8 * nt))
    chunks = -(-(int(cols) // BLOCK_VALUES[f]) // (int(kc) // BLOCK_VALUES[f]))
    short = T <= 8 * TILES[1]
    fill = short_fill() if short else 2  # blocks a SM the split aims at
    few = 2 * gx * ty < fill * n_sm
    cap = SPLIT_MAX_SHORT if short else SPLIT_MAX
    nz = max(1, min(chunks, cap, (fill * int(n_sm)) // (gx * ty))) if few else 1
    nz = -(-chunks // -(-chunks // nz))  # (slices get ceil(chunks / nz) chunks each: no slice left without any)
    return nt, gx, ty * nz, nz


#: Most k slices of one :func:`dense` launch (the kernel's last slice of a tile, or the sum launch up to 32 tokens,
#: adds them; every measurement since the thirteenth pass's call C has it).
SPLIT_MAX = 16
#: ... and up to 32 tokens, whose slices one sum launch adds: the batched step's few-row matrices (the 4-row
#: hyper-connection inject over 10,240 values, the 320-row down projection) ran 16 slices of 5 chunks each at 10.8 and
#: 15.2 us a launch (H200, bench/gpu-notes.md); a slice of one or two chunks waits on fewer loads in turn.
SPLIT_MAX_SHORT = 64
#: Tile counters one stream's split-k launches of :func:`dense` share (each launch's last slices set theirs back to 0)
SPLIT_COUNTERS = 1 << 15
_counters: dict[tuple[int, int, int], Any] = {}


def _new_counters(cp: Any, n: int) -> Any:
    """n zeroed int32 counters in device memory of their own (``cupy.cuda.Memory``: cudaMalloc, outside every memory
    pool, so that neither a CUDA graph's private pool nor its release can take them back while the module keeps them),
    zeroed on the current stream."""
    mem = cp.cuda.Memory(4 * int(n))
    arr = cp.ndarray((int(n),), dtype=cp.int32, memptr=cp.cuda.MemoryPointer(mem, 0))
    arr.fill(0)
    return arr


def _capturing(cp: Any) -> bool:
    """Is the current stream being captured into a CUDA graph (``Stream.is_capturing``, as launch.py asks it)?"""
    st = cp.cuda.get_current_stream()
    try:
        return bool(st.is_capturing())
    except Exception:  # noqa: BLE001  (a stand-in stream without the call, or a driver that cannot say: not capturing)
        return False


def split_counters(cp: Any) -> Any:
    """The zeroed int32 tile counters [:data:`SPLIT_COUNTERS`] of the current device and stream, or None when there
    are none yet and the stream is being captured (the caller then adds the slices itself). Made once a stream, in
    memory of their own (:func:`_new_counters`); the kernels leave them zero, so launches on one stream may share
    them (they run one after another); another stream gets its own. ``cp`` is part of the key, so that the tests' host
    stand-in for CuPy never meets a device array."""
    key = (id(cp), int(cp.cuda.Device().id), int(cp.cuda.get_current_stream().ptr))
    got = _counters.get(key)
    if got is None:
        if _capturing(cp):
            return None
        got = _counters[key] = _new_counters(cp, SPLIT_COUNTERS)
    return got


def _check_matrix(layout: Any, w: Any, wd: Any, rows: int, cols: int, X: Any = None) -> int:
    """The layout id of a [rows, cols] matrix given as :func:`dense` takes it (and X [T, cols] when given). Raises
    StrataError: an unknown layout, rows that are not whole blocks, weights of the wrong size or alignment, missing
    Q8R scales, X of another width."""
    f = _layout_id(layout)
    bv = BLOCK_VALUES[f]
    if cols <= 0 or cols % bv or rows <= 0:
        raise StrataError(f"qmm: a {rows} x {cols} matrix is not whole blocks of {bv} values")
    if X is not None and (X.ndim != 2 or int(X.shape[1]) != cols):
        raise StrataError(f"qmm: activations {tuple(X.shape)} do not match a matrix of {cols} columns")
    want = rows * cols if f == 0 else rows * (cols // bv) * BLOCK_BYTES[f]
    nbytes = int(w.nbytes)
    if nbytes != want:
        raise StrataError(f"qmm: {nbytes} weight bytes are not a {rows} x {cols} matrix of layout {f} ({want} bytes)")
    if int(w.data.ptr) % (8 if f == 0 else 2):
        raise StrataError(f"qmm: weights at {int(w.data.ptr):#x} are not aligned for layout {f}")
    if f == 0:
        if wd is None or int(wd.size) != rows * cols // 32:
            raise StrataError(f"qmm: Q8R scales missing or not {rows * cols // 32} values")
    return f


#: ``STRATATOOLS_QMM_SUM``: up to 32 tokens, the split of k's slices added by ``qmm_sum_slices`` (1, the default: 1.33
#: against 1.79 ms of the 32-sequence step's 554 sums, H200, bench/gpu-notes.md) or by a CuPy reduction (0); threads a
#: block and threads a run of 4 values (qmm.cu QSUM_G).
SUM_ENV = "STRATATOOLS_QMM_SUM"
SUM_DEFAULT = True
SUM_THREADS = 256
SUM_GROUP = 8

#: The activations :func:`dense` may apply to its output (qmm.cu ``qmm_act``): none; silu(y / div) (the
#: hyper-connection's down projection); 2 sigmoid(y / div) (its inject weights). Up to 32 tokens with a split of k the
#: sum kernel applies them (no launch of their own), else ``qmm_act_rows`` after the product.
ACT_NONE, ACT_SILU, ACT_SIG2 = 0, 1, 2


#: ``STRATATOOLS_QMM_RING``: up to 32 tokens, Q8R matrices whose K is a multiple of the ring's chunk go through
#: ``qmm_dense_ring`` (qmm.cu: the weights copied into a ring of shared-memory stages, several chunks ahead; with one
#: group of warps ``qmm_dense``'s products in its order, with more the groups' sums added in group order): ``S:RKC``
#: or ``S:RKC:KG`` (stages : values of k a stage : groups of 4 warps that share a block's rows and split each stage's
#: k, 128 KG threads a block; one of :data:`RINGS`), ``0`` never. Unset or empty: :data:`RING_DEFAULT` (H200, 32
#: sequences: the step's dense Q8R products 6.80 -> 5.10 ms; 6 x 64 values with one group 5.66, bench/gpu-notes.md).
RING_ENV = "STRATATOOLS_QMM_RING"
RINGS: tuple[tuple[int, int, int], ...] = ((2, 64, 1), (3, 64, 1), (4, 64, 1), (6, 64, 1), (8, 64, 1), (3, 128, 1),
                                           (4, 128, 1), (2, 64, 2), (4, 64, 2), (3, 128, 4))  # (2:128:2: nvcc spills)
RING_DEFAULT: tuple[int, int, int] | None = (4, 64, 2)
#: The ring instances the host build (tests) compiles: (NT, S, RKC, KG).
RING_HOST = tuple((nt, s, rkc, kg) for nt in TILES[:2] for s, rkc, kg in ((2, 64, 1), (4, 64, 1), (3, 128, 1),
                                                                           (2, 64, 2), (3, 128, 4)))


#: ``STRATATOOLS_QMM_DENSE_I8``: up to 32 tokens, the Q8R dense products through the ring on integer activations
#: (``qmm_dense_ring<NT, S, RKC, KG, 1>``: qmm_split_i8d's 16-bit fixed point per block of 64 as two byte planes, the
#: codes as signed bytes of ``mma.m16n8k32``, a k-step a Q8R block; qmm.cu): ``S:RKC[:KG]`` as :data:`RING_ENV`
#: (RKC a multiple of 64, one of :data:`DENSE_I8_RINGS`), ``0`` never (the fp16 ring or ``qmm_dense``). Unset or
#: empty: :data:`DENSE_I8_DEFAULT` (H200, 32 sequences, bench/gpu-notes.md eighteenth pass: the step's dense products
#: and the splits of their X 6.56 -> 5.46 ms, its device time 24.06 -> 22.89 ms; the products alone 1.0-1.1x the fp16
#: ring's). Where it applies (as the fp16 ring: :func:`ring_applies`, K whole chunks of the ring or of
#: :data:`DENSE_I8_SMALL`) it takes the fp16 ring's place; its error is the fixed point's (at most half a step a
#: value: about 1.5e-5 of its block of 64's largest) instead of fp16 hi + lo's.
DENSE_I8_ENV = "STRATATOOLS_QMM_DENSE_I8"
DENSE_I8_RINGS: tuple[tuple[int, int, int], ...] = (
    (2, 64, 1), (4, 64, 1), (6, 64, 1), (2, 64, 2), (4, 64, 2), (6, 64, 2), (3, 128, 1), (4, 128, 1), (3, 128, 2),
    (4, 128, 2), (6, 128, 2), (3, 128, 4), (3, 256, 1))  # (nvcc sm_90 spills 2:128:4 and 2:256:2)
DENSE_I8_DEFAULT: tuple[int, int, int] | None = (3, 128, 2)
#: The integer ring for K that is whole blocks of 64 but not whole chunks of the chosen ring (the 48 x 256 model's
#: K = 320 matrices under a ring of 128 values): 4 stages of 64 values, 2 groups.
DENSE_I8_SMALL: tuple[int, int, int] = (4, 64, 2)
#: Ring instances with 8 and with 2 warps a group the host build (tests) compiles: (NT, S, RKC, KG, I8) (the host
#: plays one warp a block whatever the group's warps: these check the launchers' grids and names).
RING_WG_HOST = tuple((nt, s, rkc, kg, i8) for nt in TILES[:2] for s, rkc, kg, i8 in ((3, 128, 2, 1), (4, 64, 2, 0)))
#: The integer ring instances the host build (tests) compiles: (NT, S, RKC, KG).
DENSE_I8_HOST = tuple((nt, s, rkc, kg) for nt in TILES[:2]
                      for s, rkc, kg in ((2, 64, 1), (4, 64, 2), (3, 128, 2), (3, 128, 4)))


def dense_i8(cols: int | None = None) -> tuple[int, int, int] | None:
    """:data:`DENSE_I8_ENV` as (stages, values of k a stage, groups of warps), or None (``0``); for rows of ``cols``
    values that are not whole chunks of it, :data:`DENSE_I8_SMALL`. Raises StrataError for another value."""
    cfg = _env_ring(DENSE_I8_ENV, DENSE_I8_RINGS, DENSE_I8_DEFAULT, (0, 0, 1),
                    "stages:values of k a stage[:groups of warps], integer activations")
    return DENSE_I8_SMALL if cfg is not None and cols is not None and int(cols) % cfg[1] else cfg


class DensePlanes(tuple):
    """:func:`split_i8` with ``dense=True``: (hi, lo, scales, sums) with the planes in the values' order (the
    integer dense ring's), told apart from the expert jobs' split (another word order) by its type."""


def _dense_i8_ring(f: int, T: int, cols: int, w: Any, wd: Any) -> tuple[int, int, int] | None:
    """The integer ring :func:`dense` takes for T tokens over a matrix of layout id ``f`` (codes ``w``, scales
    ``wd``), or None where it does not apply (:func:`ring_applies`)."""
    cfg = dense_i8(cols)
    ok = f == 0 and ring_applies(f, T, cols, cfg, int(w.data.ptr), int(wd.data.ptr) if wd is not None else 1)
    return cfg if ok else None


def split_kind(layout: Any, T: int, cols: int, w: Any, wd: Any) -> str:
    """Which split of X [T, cols] :func:`dense` takes for this matrix (as :func:`dense` is given it): ``"i8d"`` (the
    integer dense ring, :func:`split_i8` with ``dense=True``) or ``"f16"`` (:func:`split`). Raises StrataError as
    :func:`dense_i8` does."""
    return "i8d" if _dense_i8_ring(_layout_id(layout), T, cols, w, wd) else "f16"


#: ``STRATATOOLS_QMM_RING_WARPS``: warps of a group in both dense rings (:data:`RING_ENV`, :data:`DENSE_I8_ENV`): 4
#: (the default: 64 rows a block), 8 (128 rows a block: the tokens' activations staged once for twice the rows, half
#: the blocks; H200, 32 sequences: the step's products 3.84 -> 4.31 ms, bench/gpu-notes.md nineteenth pass) or 2 (32
#: rows a block: twice the blocks, which the SMs share more evenly; the products alone 132 -> 166 us over the
#: release's nine shapes: the tokens' planes staged twice as often cost more than the balance gave).
RING_WARPS_ENV = "STRATATOOLS_QMM_RING_WARPS"
RING_WARPS_DEFAULT = 4


def ring_warps() -> int:
    """:data:`RING_WARPS_ENV` (2, 4 or 8; default :data:`RING_WARPS_DEFAULT`); raises StrataError for another
    value."""
    return env_choice(RING_WARPS_ENV, (2, 4, 8), RING_WARPS_DEFAULT)


def ring_instance(nt: int, cfg: tuple[int, int, int], i8: bool, wg: int = RING_WARPS_DEFAULT) -> str:
    """The name of ``qmm_dense_ring``'s instance for NT ``nt``, ring ``cfg`` (S, RKC, KG), the integer form ``i8`` and
    ``wg`` warps a group (left out at the template's default of 4)."""
    return f"qmm_dense_ring<{nt}, {cfg[0]}, {cfg[1]}, {cfg[2]}, {int(i8)}{'' if wg == 4 else f', {int(wg)}'}>"


def _ring_name(cfg: tuple[int, ...]) -> str:
    return ":".join(str(v) for v in (cfg[:2] if len(cfg) == 3 and cfg[2] == 1 else cfg))


def _env_ring(name: str, choices: tuple[tuple[int, ...], ...], default: Any, pad: tuple[int, ...], what: str) -> Any:
    """Environment variable ``name`` as a ring: ``0`` -> None, unset or empty -> ``default``, ``a:b[:c]`` -> the tuple
    (shorter forms padded from ``pad``'s tail) when it is one of ``choices``. Raises StrataError for another value."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    if v == "0":
        return None
    parts = v.split(":")
    ok = 2 <= len(parts) <= len(pad) and all(x.isascii() and x.isdigit() for x in parts)
    got = tuple(int(x) for x in parts) + tuple(pad[len(parts):]) if ok else ()
    if got not in choices:
        raise StrataError(f"{name}={v!r}: use 0 or one of {', '.join(_ring_name(r) for r in choices)} ({what})")
    return got


def ring() -> tuple[int, int, int] | None:
    """:data:`RING_ENV` as (stages, values of k a stage, groups of warps), or None (``0``: the ring is not used).
    Raises StrataError for another value."""
    return _env_ring(RING_ENV, RINGS, RING_DEFAULT, (0, 0, 1), "stages:values of k a stage[:groups of warps]")


def ring_stage_bytes(nt: int, rkc: int, warps: int = THREADS // 32, i8: bool = False) -> int:
    """Bytes of one stage of ``qmm_dense_ring`` (qmm.cu QmmRing::stage): codes and scales of 16 rows a warp, the
    hi / lo halves of 8 ``nt`` tokens, RKC values of k; ``i8`` (the integer ring): the tokens' block scales and their
    hi / lo byte planes instead of the halves."""
    ws = xs = int(rkc) + 32
    tok = 8 * int(nt)
    acts = (int(rkc) // 64) * tok * 4 + 2 * tok * xs if i8 else 2 * tok * xs * 2
    return 16 * int(warps) * (ws + int(rkc) // 16) + acts


#: ``STRATATOOLS_QMM_COPY_PLAN``: the rings' copies (the integer expert jobs' ``qi8r_tile``, the integer dense ring)
#: from each thread's plan made once a block (qmm.cu ``QI8RPlan`` / ``QmmRingPlan``: working each chunk's copies out
#: from the thread index took a quarter of the gate/up jobs' instructions, a third of down's and two fifths of the
#: dense ring's, cuobjdump of the H200 build, bench/gpu-notes.md twenty-third pass); ``0``: worked out each chunk. The
#: same bytes staged either way (the same bits).
COPY_PLAN_ENV = "STRATATOOLS_QMM_COPY_PLAN"


def copy_plan() -> bool:
    """:data:`COPY_PLAN_ENV` as a flag (default on); raises StrataError for a value other than 0 or 1."""
    from stratatools.runtime.gpu.kernels import env_on

    return env_on(COPY_PLAN_ENV, "the rings' copies from each thread's plan made once")


#: ``STRATATOOLS_Q8R_SHARED``: the shared expert's products of up to 32 rows (the batched step, short prefills) from
#: Q8R copies of its Q8_0 matrices on the integer dense ring (prefill.py ``ChunkPrefill._shared_q8r``); ``0``: from
#: its GGUF blocks through the fp16 hi / lo kernel.
Q8R_SHARED_ENV = "STRATATOOLS_Q8R_SHARED"


def q8r_shared() -> bool:
    """:data:`Q8R_SHARED_ENV` as a flag (default on); raises StrataError for a value other than 0 or 1."""
    from stratatools.runtime.gpu.kernels import env_on

    return env_on(Q8R_SHARED_ENV, "the shared expert's short products from Q8R copies on the integer ring")


def instances_module(names: tuple[str, ...]) -> Any:
    """Compile (once per set and :func:`copy_plan` setting) the qmm source with only the template instances ``names``
    (the rings' kernels: each ring's instances in a module of their own, so that the main module does not compile
    every ring)."""
    return _instances_module(tuple(names), copy_plan())


@functools.lru_cache(maxsize=None)
def _instances_module(names: tuple[str, ...], plan: bool) -> Any:
    import cupy

    opts = ("--std=c++17",) + (() if plan else ("-DQMM_COPY_PLAN=0",))
    return cupy.RawModule(code=device_source(), options=opts, name_expressions=list(names))


def ring_module(stages: int, rkc: int, kg: int = 1, i8: int = 0, wg: int = RING_WARPS_DEFAULT) -> Any:
    """The ``qmm_dense_ring`` instances of ``stages`` stages of ``rkc`` values and ``kg`` groups of ``wg`` warps (NT 2
    and 4; ``i8`` 1: the integer ring's), compiled once."""
    return instances_module(tuple(ring_instance(nt, (int(stages), int(rkc), int(kg)), bool(i8), int(wg))
                                  for nt in TILES[:2]))


def _ring_fn(name: str, cfg: tuple[int, ...]) -> Any:
    return batch_kernel(ring_module(*cfg).get_function(name), name)


def ring_applies(layout_id: int, T: int, cols: int, cfg: tuple[int, int, int] | None, w_ptr: int = 0,
                 wd_ptr: int = 0) -> bool:
    """Does :func:`dense` take ``qmm_dense_ring`` (ring ``cfg``, :func:`ring`) for T tokens over a matrix of layout id
    ``layout_id`` with rows of ``cols`` values, codes at ``w_ptr`` and scales at ``wd_ptr``: Q8R, up to 32 tokens, cols
    a multiple of the ring's chunk, the codes 16-byte aligned and the scales aligned to a row's chunk of them (RKC / 16
    bytes: the ring's cp.async copies)?"""
    return (cfg is not None and layout_id == 0 and 0 < T <= 8 * TILES[1] and cols % cfg[1] == 0
            and int(w_ptr) % 16 == 0 and int(wd_ptr) % (cfg[1] // 16) == 0)


def sum_kernel() -> bool:
    """:data:`SUM_ENV` as a flag; raises StrataError for a value other than 0 or 1."""
    return env_on(SUM_ENV, "the slices of k added by qmm_sum_slices", SUM_DEFAULT)


def dense(X: Any, layout: Any, w: Any, wd: Any, rows: int, cols: int, xs: tuple[Any, Any, Any] | None = None,
          out: Any = None, act: int = ACT_NONE, act_div: float = 1.0, planes: bool = False, hc_rd: int = 0) -> Any:
    """``Y = X W^T``: X float32 [T, cols] (CuPy), W [rows, cols] in ``layout`` (:data:`LAYOUTS` name, or its id):
    ``Q8R``: ``w`` int8 codes (rows * cols, 8-byte aligned) and ``wd`` fp16 scale bits uint16 (rows * cols / 32);
    ``Q8_0`` / ``Q2_0``: ``w`` the GGUF block bytes uint8 (rows * cols / block * block bytes, 2-byte aligned), ``wd``
    None. ``xs``: X already split as :func:`split_kind` says (:func:`split`, or :func:`split_i8` with ``dense``: the
    integer ring, :data:`DENSE_I8_ENV`); a split of the other kind is not used (X is split here). ``act`` /
    ``act_div``: an activation of the output (:data:`ACT_SILU`, :data:`ACT_SIG2`). Returns ``out`` or a new float32
    [T, rows]; with ``planes`` (out, its :func:`split_i8` ``dense`` planes: made by the sum of the split of k's slices
    where it runs, ``qmm_sum_act_split``, else by a split after the product; None for rows not a multiple of 64).
    ``hc_rd`` (the hyper-connections' down and inject projections as one matrix, rows [0, hc_rd) the down
    projection's, hc_rd a multiple of 64; ``act`` none): (silu(y / act_div) of those rows [T, hc_rd], its
    :func:`split_i8` ``dense`` planes, 2 sigmoid(y / act_div) of the others [T, rows - hc_rd]), contiguous arrays, from
    the sum's launch where it runs (``qmm_sum_hc``), else after the product.

    Raises StrataError: an unknown layout, rows of ``cols`` values that are not whole blocks, weights of the wrong size
    or alignment, X not [T, cols], an unknown ``act``."""
    f = _check_matrix(layout, w, wd, rows, cols, X)
    if act not in (ACT_NONE, ACT_SILU, ACT_SIG2):
        raise StrataError(f"qmm: unknown activation {act!r} (one of {ACT_NONE}, {ACT_SILU}, {ACT_SIG2})")
    if hc_rd and (act != ACT_NONE or planes or int(hc_rd) % 64 or not 0 < int(hc_rd) < int(rows)):
        raise StrataError(f"qmm: hc_rd {hc_rd} of {rows} rows is not a multiple of 64 below them (with no act)")
    bv = BLOCK_VALUES[f]
    T = int(X.shape[0])
    import cupy as cp

    cfg8 = _dense_i8_ring(f, T, cols, w, wd)
    i8 = cfg8 is not None
    if i8:
        hi, lo, sc, _ = xs if isinstance(xs, DensePlanes) else split_i8(X, dense=True)
    else:
        hi, lo, sc = xs if xs is not None and not isinstance(xs, DensePlanes) else split(X)
    if out is None:
        out = cp.empty((T, rows), dtype=cp.float32)
    from stratatools.runtime.gpu.kernels import _device_limits

    kc = chunk_values()
    n_sm = _device_limits()[0]
    cfg = cfg8 if i8 else ring()
    rung = i8 or ring_applies(f, T, cols, cfg, int(w.data.ptr), int(wd.data.ptr) if wd is not None else 1)
    wg = ring_warps() if rung else THREADS // 32
    nt, gx, gy, nz = dense_launch(T, rows, cols, f, n_sm, cfg[1] if rung and cfg else kc, 16 * wg)
    mode = dense2()
    two = None if mode == "0" or rung else dense2_launch(T, rows, n_sm if mode == "auto" else 0)
    if two is not None:  # (no k split: the rows a multiple of 128 give the grid its blocks)
        nt, gx, gy = two
        nz = 1
    rb = cols if f == 0 else (cols // bv) * BLOCK_BYTES[f]
    part = cp.empty((nz, T, rows), dtype=cp.float32) if nz > 1 else out  # each k slice's partial sums
    # the kernel's last slice of a tile adds the slices for longer X (a split leaves gx * tiles < n_sm, far below
    # SPLIT_COUNTERS); up to 32 tokens (the batched step) one sum launch measured faster than the last slices' adds
    # (H200, bench/gpu-notes.md), and so it is where a captured stream has no counters yet
    cnt = split_counters(cp) if nz > 1 and T > 8 * TILES[1] else None
    in_kernel = cnt is not None
    cnt = cnt if in_kernel else np.uint64(0)
    args = (w, wd if wd is not None else w, np.int64(rb), hi, lo, sc, out, np.int64(out.shape[1]), np.int32(T),
            np.int32(rows), np.int32(cols), np.int32(nz), part, cnt)
    if rung and cfg:
        fn = _ring_fn(ring_instance(nt, cfg, i8, wg), (*cfg, int(i8), wg))
        launch_big_shared(fn, (gx, gy), (32 * wg * cfg[2],), args, cfg[0] * ring_stage_bytes(nt, cfg[1], wg, i8))
    else:
        name = f"qmm_dense<{f}, {nt}, 2>" if two is not None else f"qmm_dense<{f}, {nt}>"
        launch_big_shared(_fn(name, kc), (gx, gy), (THREADS,), args, smem_bytes(f, nt, kc))
    done = act == ACT_NONE
    pl = None
    if nz > 1 and not in_kernel:
        if (sum_kernel() and out.flags.c_contiguous and tuple(out.shape) == (T, int(rows))
                and int(out.data.ptr) % 16 == 0):  # (the kernel's float4 stores)
            n = T * int(rows)
            runs = n // 4 if n % 4 == 0 else n
            grid = (-(-runs * SUM_GROUP // SUM_THREADS),)
            if hc_rd and int(rows) % 4 == 0:  # down and inject: their sums, activations and the split: one launch
                rd = int(hc_rd)
                m, iw = cp.empty((T, rd), dtype=cp.float32), cp.empty((T, int(rows) - rd), dtype=cp.float32)
                pl = _planes(cp, T, rd, "i8d")
                _fn("qmm_sum_hc", kc)((T * rd // 64,), (128,), (part, m, iw, np.int32(rows), np.int32(rd),
                                                                np.int32(nz), np.float32(act_div), *pl))
                return m, pl, iw
            if planes and int(rows) % 64 == 0:  # the sums and their split: one launch
                pl = _planes(cp, T, int(rows), "i8d")
                _fn(f"qmm_sum_act_split<{act}>", kc)((n // 64,), (128,), (part, out, np.int32(rows), np.int32(nz),
                                                                        np.float32(act_div), *pl))
            elif act == ACT_NONE:
                _fn("qmm_sum_slices", kc)(grid, (SUM_THREADS,), (part, out, np.int64(n), np.int32(nz)))
            else:
                _fn(f"qmm_sum_act<{act}>", kc)(grid, (SUM_THREADS,), (part, out, np.int64(n), np.int32(nz),
                                                                   np.float32(act_div)))
            done = True
        else:
            cp.sum(part, axis=0, out=out)
    if not done:
        act_rows(out, act, act_div)
    if hc_rd:
        m = act_rows(cp.ascontiguousarray(out[:, :int(hc_rd)]), ACT_SILU, act_div)
        return m, split_i8(m, dense=True), act_rows(cp.ascontiguousarray(out[:, int(hc_rd):]), ACT_SIG2, act_div)
    if planes:
        return out, (pl if pl is not None or int(rows) % 64 else split_i8(out, dense=True))
    return out


def act_rows(Y: Any, act: int, div: float) -> Any:
    """``Y = act(Y / div)`` in place (qmm.cu ``qmm_act_rows``; :data:`ACT_SILU`, :data:`ACT_SIG2`) for a float32
    CuPy array: where :func:`dense`'s sums were not made by the sum kernel. Returns Y. Raises StrataError for a Y that
    is not contiguous float32."""
    if Y.dtype != np.float32 or not Y.flags.c_contiguous:
        raise StrataError("qmm: an activation needs a contiguous float32 array")
    n = int(Y.size)
    if act != ACT_NONE and n:
        _fn("qmm_act_rows")((-(-n // SUM_THREADS),), (SUM_THREADS,), (Y, np.int64(n), np.int32(act), np.float32(div)))
    return Y


#: ``STRATATOOLS_BATCH_ROUTER``: the batched step's router logits (with the shared expert's gate row) by
#: :func:`f32_nt` (1, the default) or cuBLAS's SGEMM (0).
ROUTER_ENV = "STRATATOOLS_BATCH_ROUTER"
ROUTER_DEFAULT = True
#: :func:`f32_nt`'s shape (qmm.cu QF_ROWS, QF_TOK, QF_KS): rows a block, the most tokens, values of k a slice.
F32_ROWS, F32_TOK, F32_KS = 32, 32, 128
F32_THREADS = 256


def router_kernel() -> bool:
    """:data:`ROUTER_ENV` as a flag; raises StrataError for a value other than 0 or 1."""
    return env_on(ROUTER_ENV, "the batched step's router by qmm_f32_nt", ROUTER_DEFAULT)


def f32_nt_applies(X: Any, W: Any) -> bool:
    """Can :func:`f32_nt` take ``X @ W.T`` (float32 contiguous X [T, K], W [R, K], 1 <= T <= :data:`F32_TOK`, K a
    multiple of 4, both 16-byte aligned)?"""
    return (X.ndim == 2 and W.ndim == 2 and X.dtype == np.float32 and W.dtype == np.float32
            and X.flags.c_contiguous and W.flags.c_contiguous and 0 < int(X.shape[0]) <= F32_TOK
            and int(X.shape[1]) == int(W.shape[1]) and int(X.shape[1]) % 4 == 0 and int(X.shape[1]) > 0
            and int(W.shape[0]) > 0 and int(X.data.ptr) % 16 == 0 and int(W.data.ptr) % 16 == 0)


def f32_nt(X: Any, W: Any) -> Any:
    """``X @ W.T`` in float32 for a few tokens (the batched step's router: 32 x 2,560 by 257 rows): ``qmm_f32_nt``,
    each output an fmaf chain over a slice of :data:`F32_KS` values of k in order, the slices added by
    ``qmm_sum_slices`` (one launch each; W's slice is loaded before the kernel's griddepcontrol.wait). X [T, K], W
    [R, K] as :func:`f32_nt_applies` takes them (CuPy). Returns a new float32 [T, R] array. Raises StrataError for
    arrays it does not take."""
    if not f32_nt_applies(X, W):
        raise StrataError(f"qmm: f32_nt takes contiguous aligned float32 [T <= {F32_TOK}, K] and [R, K], K a multiple "
                          f"of 4; got {tuple(X.shape)} and {tuple(W.shape)}")
    import cupy as cp

    T, K = (int(s) for s in X.shape)
    R = int(W.shape[0])
    nz = -(-K // F32_KS)
    out = cp.empty((T, R), dtype=cp.float32)
    part = cp.empty((nz, T, R), dtype=cp.float32) if nz > 1 else out
    _fn("qmm_f32_nt")((-(-R // F32_ROWS), nz), (F32_THREADS,), (X, W, part, np.int32(T), np.int32(R), np.int32(K)))
    if nz > 1:
        n = T * R
        runs = n // 4 if n % 4 == 0 else n
        _fn("qmm_sum_slices")((-(-runs * SUM_GROUP // SUM_THREADS),), (SUM_THREADS,),
                              (part, out, np.int64(n), np.int32(nz)))
    return out


# ---- hgemm: the weights as fp16 hi + lo, cuBLAS fp16 GEMMs with float32 accumulation ------------------------------
def wsplit(layout: Any, w: Any, wd: Any, rows: int, cols: int, flag: Any) -> tuple[Any, Any]:
    """W [rows, cols] (as :func:`dense` takes it) as fp16 bits uint16 (Wh, Wl) [rows, cols] with W = Wh + Wl exactly,
    Wh = fp16(W) rounded to nearest (``qmm_wsplit``); Q2_0 values are exact halves: Wl is None. ``flag`` int32 [1]
    on the device is set to 1 when a value does not fit fp16 (|W| >= 65520: Wh infinite; never cleared here).
    The two arrays are transient (4 bytes a weight, CuPy's pool: within the VRAM plan's dense share of 8 bytes a weight
    of the largest matrix, :func:`stratatools.runtime.gpu.prefill.prefill_scratch_bytes`). Raises StrataError as
    :func:`dense` does."""
    import cupy as cp

    f = _check_matrix(layout, w, wd, rows, cols)
    rb = cols if f == 0 else (cols // BLOCK_VALUES[f]) * BLOCK_BYTES[f]
    wh = cp.empty((rows, cols), dtype=cp.uint16)
    wl = cp.empty((rows, cols), dtype=cp.uint16) if f != 42 else None
    units = rows * (cols // BLOCK_VALUES[f]) * 4
    grid = max(1, min(-(-units // WSPLIT_THREADS), 65535))
    _fn(f"qmm_wsplit<{f}>")((grid,), (WSPLIT_THREADS,),
                            (w, wd if wd is not None else w, np.int64(rb), np.int32(rows), np.int32(cols), wh,
                             wl if wl is not None else wh, flag))
    return wh, wl


def hgemm(X: Any, layout: Any, w: Any, wd: Any, rows: int, cols: int, xs: tuple[Any, Any, Any] | None = None,
          check: bool = True) -> Any:
    """:func:`dense`'s ``Y = X W^T`` through cuBLAS: W as fp16 Wh + Wl (:func:`wsplit`, transient), X split into
    halves hi + lo with row scales sc (:func:`split`, or ``xs``), ``Y = (Wh hi + Wh lo + Wl hi) sc`` (three fp16 GEMMs
    accumulating in float32, :func:`stratatools.runtime.gpu.blas.gemm16`; Q2_0 two, its Wl being zero), within about
    1e-6 of float64 relative to |W| |x| like :func:`dense`. ``check``: read the overflow flag back (one
    synchronisation: not while a stream is captured) and return None when a value of W does not fit fp16 (the caller
    takes :func:`dense`); without it the caller knows W fits (an earlier checked call). Returns a new float32
    [T, rows], or None. Raises StrataError as :func:`dense` does."""
    import cupy as cp

    from stratatools.runtime.gpu import blas

    f = _check_matrix(layout, w, wd, rows, cols, X)
    flag = cp.zeros(1, dtype=cp.int32) if check else cp.empty(1, dtype=cp.int32)
    wh, wl = wsplit(f, w, wd, rows, cols, flag)
    if check and int(flag[0]) != 0:
        return None
    hi, lo, sc = xs if xs is not None else split(X)
    Y = cp.empty((int(X.shape[0]), rows), dtype=cp.float32)
    blas.gemm16(wh, hi, Y, False)
    blas.gemm16(wh, lo, Y, True)
    if wl is not None:
        blas.gemm16(wl, hi, Y, True)
    Y *= sc.reshape(-1, 1)
    return Y


def job_capacity(n_pairs: int, n_expert: int, jt: int = JOB_TOKENS) -> int:
    """Jobs :func:`moe_jobs` provides for ``n_pairs`` (token, expert) pairs over ``n_expert`` experts in jobs of
    ``jt`` tokens: enough for any routing (each expert with pairs has at most one job that is not full)."""
    return -(-int(n_pairs) // int(jt)) + min(int(n_expert), int(n_pairs))


def job_tokens(jt: Any = None, batch: bool = False) -> int:
    """A job size: ``jt`` when given, else the prefill's (:data:`JOB_ENV`, default :data:`JOB_DEFAULT`) or with
    ``batch`` the batched step's (:data:`BATCH_JOB_ENV`, default :data:`BATCH_JOB_DEFAULT`). Raises StrataError for
    one that is not in :data:`JOB_SIZES`."""
    if jt is None:
            return env_choice(*((BATCH_JOB_ENV, JOB_SIZES, BATCH_JOB_DEFAULT) if batch else (JOB_ENV, JOB_SIZES, JOB_DEFAULT)))
    if int(jt) not in JOB_SIZES:
        raise StrataError(f"qmm: expert jobs of {jt} tokens: use one of {', '.join(map(str, JOB_SIZES))}")
    return int(jt)


#: Threads of the ``qmm_jobs`` block.
JOBS_THREADS = 1024
#: Dynamic shared memory one ``qmm_jobs`` block may take (of the 227 KiB an H100 / H200 block may opt into).
JOBS_SHARED_MAX = 160 * 1024


def jobs_shared(n_pairs: int, n_expert: int) -> int:
    """Dynamic shared memory of ``qmm_jobs`` for ``n_pairs`` pairs over ``n_expert`` experts: M sort keys, M the
    power of two >= the pairs, then 3 E + 1 ints (counts, first jobs, first sorted positions, jobs used) and 2
    :data:`JOBS_THREADS` ints (the threads' sums and their scan)."""
    m = 1
    while m < int(n_pairs):
        m <<= 1
    return 4 * (3 * int(n_expert) + 1 + 2 * JOBS_THREADS + m)


def device_jobs_ok(n_pairs: int, n_expert: int) -> bool:
    """Can :func:`moe_jobs` build the table of ``n_pairs`` pairs over ``n_expert`` experts on the device (one block's
    shared memory holds the sort; its keys e N + i fit 32 bits)?"""
    N, E = int(n_pairs), int(n_expert)
    return N >= 1 and E >= 1 and E * N < 2 ** 32 and jobs_shared(N, E) <= JOBS_SHARED_MAX


def moe_jobs(ids: Any, k: int, n_expert: int, ptr_row: Any, jt: int = JOB_TOKENS) -> tuple[Any, Any, Any]:
    """The job table of :func:`stratatools.runtime.gpu.prefill.expert_jobs` built on the device (``qmm_jobs``, one
    block sorting the pairs by expert), so that the batched step and the prefill need not read their routing back:
    ``ids`` int32 [N] (pair t k + r's expert, on the device), ``ptr_row`` uint64 [>= n_expert] the layer's blob
    addresses; ``jt`` the tokens a job (:data:`JOB_SIZES`). Returns (job_ptr uint64 [J], job_tok int32 [J jt], job_dst
    int32 [J jt]) with J = :func:`job_capacity`; the jobs after the routing's are empty (-1 slots), and :func:`moe_gate_up` /
    :func:`moe_down` skip them. Raises StrataError for a routing :func:`device_jobs_ok` refuses (an empty one, or one
    whose sort outgrows a block's shared memory: more than 32,768 pairs at 256 experts)."""
    import cupy as cp

    N, E = int(ids.size), int(n_expert)
    if not device_jobs_ok(N, E):
        raise StrataError(f"qmm: a device job table for {N} pairs over {E} experts is not supported")
    jt = job_tokens(jt)
    J = job_capacity(N, E, jt)
    job_ptr = cp.empty(J, dtype=cp.uint64)
    job_tok = cp.empty(J * jt, dtype=cp.int32)
    job_dst = cp.empty(J * jt, dtype=cp.int32)
    launch_big_shared(_fn("qmm_jobs"), (1,), (JOBS_THREADS,),
                      (cp.ascontiguousarray(ids, dtype=cp.int32), np.int32(N), np.int32(k), np.int32(E), ptr_row,
                       np.int32(J), np.int32(jt), job_ptr, job_tok, job_dst), jobs_shared(N, E))
    return job_ptr, job_tok, job_dst


def _expert_layout(layout: Any, cols: int) -> int:
    """The layout id of expert rows of ``cols`` values, which the job kernels read as GGUF blocks (Q8_0 / Q2_0).
    Raises StrataError for another layout or rows that are not whole blocks."""
    f = _layout_id(layout)
    if f == 0 or cols % BLOCK_VALUES[f]:
        raise StrataError(f"qmm: expert rows of {cols} values in layout {f} have no mma kernel")
    return f


def moe_gate_up(job_ptr: Any, job_tok: Any, xs: tuple[Any, Any, Any], layout: Any, hbuf: Any, hidden: int,
                ff: int, jt: int = JOB_TOKENS) -> None:
    """Gate/up of the routed-expert jobs: ``hbuf[j jt + s] = silu(gate_j x) * (up_j x)`` for x the row
    ``job_tok[j jt + s]`` of the split activations ``xs`` (:func:`split` of X [T, hidden]); ``job_ptr`` uint64 [J]
    device addresses of the experts' blobs (gate [ff, hidden] then up, GGUF ``layout`` Q8_0 or Q2_0 blocks);
    ``job_tok`` int32 [J jt] (-1: empty slot, its row left as it is); ``hbuf`` float32 [J jt, ff]; ``jt`` the tokens a
    job (:data:`JOB_SIZES`).
    Raises StrataError for another layout or rows that are not whole blocks."""
    f = _expert_layout(layout, hidden)
    J = int(job_ptr.size)
    hi, lo, sc = xs
    kc, jt = chunk_values(moe=True, layout=f), job_tokens(jt)
    launch_big_shared(_fn(f"qmm_moe_gu<{f}, {jt}>", kc), (-(-ff // ROWS_PER_BLOCK), J), (THREADS,),
                      (job_ptr, job_tok, hi, lo, sc, hbuf, np.int32(hidden), np.int32(ff)), smem_bytes(f, jt // 8, kc))


#: ``STRATATOOLS_QMM_JOBS_I8``: Q2_0 expert jobs (gate/up and down both Q2_0) on the integer kernels
#: (``qmm_moe_gu_i8`` / ``qmm_moe_down_i8``: codes as unsigned bytes into mma.m16n8k32, activations as 16-bit fixed
#: point per block of 64 values in two byte planes, :func:`split_i8`; 1, the default: the 32-sequence step's gate/up
#: 107.9 against 151.9 us a layer, the 512-token prefill 3,538 against 3,271 tok/s, logits 6.6e-6 from SGEMM, H200,
#: bench/gpu-notes.md); 0: the fp16 hi / lo kernels.
JOBS_I8_ENV = "STRATATOOLS_QMM_JOBS_I8"
JOBS_I8_DEFAULT = True
#: Threads of a ``qmm_split_i8`` block (16 a block of 64 values).
SPLIT_I8_THREADS = 256


def jobs_i8(gu_layout: Any, down_layout: Any) -> bool:
    """Do the expert jobs of these layouts take the integer kernels (:data:`JOBS_I8_ENV`, both Q2_0)? Raises
    StrataError for a switch value other than 0 or 1."""
    on = env_on(JOBS_I8_ENV, "Q2_0 expert jobs on the integer kernels", JOBS_I8_DEFAULT)
    return on and _layout_id(gu_layout) == 42 and _layout_id(down_layout) == 42


def split_i8(X: Any, rowok: Any = None, dense: bool = False) -> tuple[Any, Any, Any, Any]:
    """Quantize float32 activations X [T, K] (CuPy; K a multiple of 64) per block of 64 values to 16-bit fixed point
    (``qmm_split_i8``): (hi, lo) byte planes uint8 [T, K] in the job kernels' word order (``dense``: in the values'
    order, ``qmm_split_i8d``, returned as :class:`DensePlanes`), block scales float32 [T, K / 64] and block sums of q
    int32 [T, K / 64], X[t, k] ~= q s (|error| <= s / 2, s = max |block| / 32767). Rows t with ``rowok[t] < 0``
    (int32 [T] on the device, optional) are left unwritten. Raises StrataError for another shape."""
    import cupy as cp

    if X.ndim != 2 or X.shape[1] % 64 or X.shape[0] < 1:
        raise StrataError(f"qmm: activations of shape {tuple(X.shape)} are not [T >= 1, K] with K a multiple of 64")
    X = cp.ascontiguousarray(X, dtype=cp.float32)
    T, K = (int(s) for s in X.shape)
    pl = _planes(cp, T, K, "i8d" if dense else "i8")
    grid = -(-(T * (K // 64) * 16) // SPLIT_I8_THREADS)
    ok = cp.ascontiguousarray(rowok, dtype=cp.int32) if rowok is not None else None
    _fn("qmm_split_i8d" if dense else "qmm_split_i8", chunk_values(moe=True, layout=42))(
        (grid,), (SPLIT_I8_THREADS,), (X, np.int64(K), np.int32(T), np.int32(K), ok, *pl))
    return pl


def _planes(cp: Any, T: int, K: int, kind: str | None) -> tuple[Any, ...] | None:
    """Empty planes of a split of [T, K] of ``kind`` (:func:`split_i8`'s arrays; ``"i8d"`` as :class:`DensePlanes`),
    or None for no split (``kind`` None). Raises StrataError for another kind."""
    if kind is None:
        return None
    if kind not in ("i8", "i8d"):
        raise StrataError(f"qmm: the integer splits are 'i8' or 'i8d' planes, not {kind!r}")
    got = (cp.empty((T, K), dtype=cp.uint8), cp.empty((T, K), dtype=cp.uint8),
           cp.empty((T, K // 64), dtype=cp.float32), cp.empty((T, K // 64), dtype=cp.int32))
    return DensePlanes(got) if kind == "i8d" else got


def hc_norm_threads(n: int) -> int:
    """Threads of a ``qmm_hc_norm_split`` block for rows of n values: a float4 a thread (n / 4 rounded up to whole
    warps), at most 1,024."""
    return min(1024, -(-int(n) // 128) * 32)


def hc_norm_split(H: Any, w: Any, eps: float, hc: int, n: int, y: Any = None, iw: Any = None,
                  kind: str | None = None) -> tuple[Any, Any]:
    """The hyper-connections' input norm of the streams H float32 [T, hc n] (CuPy, contiguous; rows of n values, n a
    multiple of 64), one launch (``qmm_hc_norm_split``): with ``y`` [T, n] and ``iw`` [T, hc] the pending inject first,
    H += y iw per stream (in place); then hn = rmsnorm(H rows) times ``w`` (float32, repeated over the rows, or None)
    and, with ``kind`` ``"i8d"``, its :func:`split_i8` ``dense`` planes. Returns (hn [T, hc n], planes or None).
    Raises StrataError for H that is not contiguous float32 [T, hc n], n not a multiple of 64, an unknown kind."""
    import cupy as cp

    T = int(H.shape[0]) if H.ndim == 2 else 0
    if (H.dtype != np.float32 or not H.flags.c_contiguous or H.ndim != 2 or T < 1 or int(H.shape[1]) != hc * n
            or n % 64 or n < 64):
        raise StrataError(f"qmm: streams of shape {tuple(H.shape)} are not contiguous float32 [T, {hc} x {n}] "
                          "with rows a multiple of 64 values")
    if kind not in (None, "i8d"):
        raise StrataError(f"qmm: the norm's split is 'i8d', not {kind!r}")
    hn = cp.empty((T, hc * n), dtype=cp.float32)
    pl = _planes(cp, T, hc * n, kind)
    yc = cp.ascontiguousarray(y, dtype=cp.float32) if y is not None else None
    ic = cp.ascontiguousarray(iw, dtype=cp.float32) if y is not None else None
    wc = cp.ascontiguousarray(w, dtype=cp.float32) if w is not None else None
    launch_big_shared(_fn("qmm_hc_norm_split"), (T * hc,), (hc_norm_threads(n),),
                      (H, yc, ic, np.int32(hc), np.int32(n), wc, np.int32(wc.size if wc is not None else 1),
                       np.float32(eps), hn, *(pl[:4] if pl is not None else (None,) * 4)), 8 * n)
    return hn, pl


#: Threads of a ``qmm_hc_mix_split`` block: 16 units of 64 outputs, 16 threads each (its shared memory holds
#: qmm.cu QI8_MIX_UNITS = 16 units; tests/test_gpu_qmm_host.py checks the two agree).
HC_MIX_THREADS = 256


def hc_mix(u: Any, hn: Any, hc: int, n: int, kind: str | None = None) -> tuple[Any, Any]:
    """The hyper-connections' mix (``qmm_hc_mix_split``): out [T, n] = sum over the hc streams of sigmoid(u) hn, over
    hc (u, hn float32 [T, hc n], CuPy), and with ``kind`` (``"i8"``: the expert jobs' planes, ``"i8d"``: the dense
    ring's) its :func:`split_i8` planes from the same launch. Returns (out, planes or None). Raises StrataError for
    shapes that differ or are not [T, hc n] with n a multiple of 64, or an unknown kind."""
    import cupy as cp

    if u.shape != hn.shape or u.ndim != 2 or int(u.shape[1]) != hc * n or n % 64 or n < 64 or int(u.shape[0]) < 1:
        raise StrataError(f"qmm: a mix of {tuple(u.shape)} and {tuple(hn.shape)} is not [T, {hc} x {n}] twice "
                          "with rows a multiple of 64 values")
    T = int(u.shape[0])
    out = cp.empty((T, n), dtype=cp.float32)
    pl = _planes(cp, T, n, kind)
    grid = -(-(T * (n // 64) * 16) // HC_MIX_THREADS)
    _fn(f"qmm_hc_mix_split<{1 if kind != 'i8' else 0}>")(
        (grid,), (HC_MIX_THREADS,), (cp.ascontiguousarray(u, dtype=cp.float32),
                                       cp.ascontiguousarray(hn, dtype=cp.float32), np.int32(hc), np.int32(n),
                                       np.int32(T), out, *(pl[:4] if pl is not None else (None,) * 4)))
    return out, pl


#: ``STRATATOOLS_QMM_JOBS_RING``: the integer expert jobs' weights through a ring of shared-memory stages
#: (qmm.cu ``qi8r_tile``: several chunks of weights in flight a block instead of one chunk of a lane's in registers):
#: ``S:RKC[:PAD]`` (stages : values of k a stage : bytes of padding after a staged row, 16 when left out: rows' banks
#: apart; 0: smaller stages, 4 blocks a SM instead of 3 at 3 x 256 for the gate/up kernel; one of :data:`JOBS_RINGS`),
#: ``0`` never (``qi8_tile``). Unset or empty: :data:`JOBS_RING_DEFAULT` (H200, 32 sequences, bench/gpu-notes.md
#: nineteenth pass: the step's gate/up and down jobs 4.05 + 2.46 ms at ``3:256``, 3.95 + 2.46 at ``3:256:0``, 3.70 +
#: 2.23 at ``2:256:0``: six blocks a SM with one chunk in flight each beat three with two). The same products in the
#: same order either way (the same bits).
JOBS_RING_ENV = "STRATATOOLS_QMM_JOBS_RING"
JOBS_RINGS: tuple[tuple[int, int, int], ...] = ((3, 256, 16), (4, 256, 16), (4, 128, 16), (6, 128, 16), (3, 256, 0),
                                                (4, 256, 0), (2, 256, 0), (2, 256, 16), (2, 128, 0))
JOBS_RING_DEFAULT: tuple[int, int, int] | None = (2, 256, 0)
#: The largest job (tokens) that takes the ring: jobs of 8 (the batched step) ran faster through it, jobs of 16 (the
#: prefill) slower (H200, bench_qmm_jobs.py: 0.260 -> 0.235 ms a layer at 32 tokens in jobs of 8, 0.825 -> 0.902 at 512
#: in jobs of 16; bench/gpu-notes.md).
JOBS_RING_MAX_JT = 8
#: The expert ring instances the host build compiles: (S, RKC, PAD).
JOBS_RING_HOST = ((3, 256, 16), (2, 128, 16), (2, 256, 0))


def jobs_ring() -> tuple[int, int, int] | None:
    """:data:`JOBS_RING_ENV` as (stages, values of k a stage, bytes of padding a staged row), or None (``0``). Raises
    StrataError for another value."""
    return _env_ring(JOBS_RING_ENV, JOBS_RINGS, JOBS_RING_DEFAULT, (0, 0, 16), "stages:values of k a stage[:padding]")


def jobs_ring_stage_bytes(nt: int, nm: int, rkc: int, warps: int = THREADS // 32, pad: int = 16) -> int:
    """Bytes of one stage of the integer jobs' ring (qmm.cu QI8Ring::stage): ``nm`` matrices' rows of 16 a warp (the
    16-byte pieces that cover a chunk of Q2_0 blocks from any even offset, plus ``pad`` bytes), the 8 ``nt`` tokens'
    two byte planes (rows of RKC + 64 bytes)."""
    wp = (14 + 18 * (int(rkc) // 64) + 15) // 16
    return int(nm) * 16 * int(warps) * (16 * wp + int(pad)) + 2 * 8 * int(nt) * (int(rkc) + 64)


def jobs_ring_module(stages: int, rkc: int, pad: int = 16) -> Any:
    """The integer job kernels' ring instances of jobs of up to :data:`JOBS_RING_MAX_JT` tokens (the sizes of
    :data:`JOB_SIZES` the launchers send there), compiled once."""
    return instances_module(tuple(f"{k}<{jt}, {int(stages)}, {int(rkc)}, {int(pad)}>"
                                  for k in ("qmm_moe_gu_i8", "qmm_moe_down_i8") for jt in JOB_SIZES
                                  if jt <= JOBS_RING_MAX_JT))


def _jobs_ring_fn(name: str, cfg: tuple[int, ...]) -> Any:
    return batch_kernel(jobs_ring_module(*cfg).get_function(name), name)


def smem_bytes_i8(nt: int, cols: int, kc: int = KC, ring_cfg: tuple[int, ...] | None = None, nm: int = 1,
                  warps: int = THREADS // 32) -> int:
    """Dynamic shared memory of an integer job kernel (qmm.cu QmmSmemI8) with ``nt`` column tiles over rows of ``cols``
    values: two stage buffers of both byte planes (rows of QMM_KC + 64 bytes), or with ``ring_cfg`` (S, RKC[, PAD])
    the ring's S stages (:func:`jobs_ring_stage_bytes` of ``nm`` matrices, ``warps`` warps), then the 8 nt tokens'
    block scales and sums."""
    lead = 2 * 2 * 8 * int(nt) * (int(kc) + 64) if ring_cfg is None else \
        ring_cfg[0] * jobs_ring_stage_bytes(nt, nm, ring_cfg[1], warps, ring_cfg[2] if len(ring_cfg) > 2 else 16)
    return lead + 8 * (int(cols) // 64) * 8 * int(nt)


def _job_kernel(base: str, jt: int, kc: int, cfg: tuple[int, int, int] | None) -> Any:
    if cfg is None:
        return _fn(f"{base}<{jt}>", kc)
    return _jobs_ring_fn(f"{base}<{jt}, {cfg[0]}, {cfg[1]}, {cfg[2]}>", cfg)


def moe_gate_up_i8(job_ptr: Any, job_tok: Any, xq: tuple[Any, Any, Any, Any], hbuf: Any, hidden: int, ff: int,
                   jt: int = JOB_TOKENS) -> None:
    """:func:`moe_gate_up` for Q2_0 experts on the integer kernel, ``xq`` :func:`split_i8` of X [T, hidden]; the
    weights through the ring of :func:`jobs_ring` where set, for jobs of up to :data:`JOBS_RING_MAX_JT` tokens."""
    J = int(job_ptr.size)
    kc, jt = chunk_values(moe=True, layout=42), job_tokens(jt)
    cfg = jobs_ring() if jt <= JOBS_RING_MAX_JT else None
    launch_big_shared(_job_kernel("qmm_moe_gu_i8", jt, kc, cfg), (-(-ff // ROWS_PER_BLOCK), J), (THREADS,),
                      (job_ptr, job_tok, *xq, hbuf, np.int32(hidden), np.int32(ff)),
                      smem_bytes_i8(jt // 8, hidden, kc, cfg, 2))


def moe_down_i8(job_ptr: Any, doff: int, job_dst: Any, hq: tuple[Any, Any, Any, Any], out: Any, hidden: int, ff: int,
                jt: int = JOB_TOKENS) -> None:
    """:func:`moe_down` for Q2_0 experts on the integer kernel, ``hq`` :func:`split_i8` of hbuf [J jt, ff] (the
    rows of empty slots may be left out: ``rowok`` = ``job_dst``); the weights through the ring of :func:`jobs_ring`
    where set, for jobs of up to :data:`JOBS_RING_MAX_JT` tokens."""
    J = int(job_ptr.size)
    kc, jt = chunk_values(moe=True, layout=42), job_tokens(jt)
    cfg = jobs_ring() if jt <= JOBS_RING_MAX_JT else None
    launch_big_shared(_job_kernel("qmm_moe_down_i8", jt, kc, cfg), (-(-hidden // ROWS_PER_BLOCK), J), (THREADS,),
                      (job_ptr, np.int64(doff), job_dst, *hq, out, np.int32(hidden), np.int32(ff)),
                      smem_bytes_i8(jt // 8, ff, kc, cfg, 1))


def moe_down(job_ptr: Any, doff: int, job_dst: Any, hs: tuple[Any, Any, Any], layout: Any, out: Any, hidden: int,
             ff: int, jt: int = JOB_TOKENS) -> None:
    """Down of the routed-expert jobs: ``out[job_dst[j jt + s]] = down_j h`` for h the row ``j jt + s`` of the split
    hidden activations ``hs`` (:func:`split` of hbuf [J jt, ff]); ``down_j`` at ``job_ptr[j] + doff`` ([hidden, ff],
    GGUF ``layout`` Q8_0 or Q2_0 blocks); ``job_dst`` int32 [J jt] (-1: skipped); ``out`` float32 [N, hidden].
    Raises StrataError for another layout or rows that are not whole blocks."""
    f = _expert_layout(layout, ff)
    J = int(job_ptr.size)
    hi, lo, sc = hs
    kc, jt = chunk_values(moe=True, layout=f), job_tokens(jt)
    launch_big_shared(_fn(f"qmm_moe_down<{f}, {jt}>", kc), (-(-hidden // ROWS_PER_BLOCK), J), (THREADS,),
                      (job_ptr, np.int64(doff), job_dst, hi, lo, sc, out, np.int32(hidden), np.int32(ff)),
                      smem_bytes(f, jt // 8, kc))
