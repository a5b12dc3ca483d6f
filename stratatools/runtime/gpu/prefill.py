"""Batched prompt prefill for :class:`stratatools.runtime.gpu.decode.StaticDecoder`: a prompt runs in chunks of up to
``chunk`` tokens, each chunk one batched forward over the decoder's static buffers, leaving the decoder in the state
the same tokens fed one :meth:`StaticDecoder.step` at a time would leave (K/V caches, GDN conv and recurrent states,
QSA indexer raw keys and pooled block keys, PLE conv states and n-gram context, position), up to float rounding.

Per chunk of T tokens (same numerics as :meth:`stratatools.runtime.model.Qwen4ExpRuntime.forward`, in float32):

* dense projections: on CuPy each matrix is dequantized from the GGUF bytes the step already keeps in VRAM
  (``pf_dequant_blobs`` compiled without multiply-add fusion: bit-identical to the numpy dequantizer) into a transient
  float32 array (one matrix at a time, served by CuPy's pool) and multiplied by cuBLAS SGEMM (``X @ W.T``; no TF32);
  the output head runs for the last token only, through the step's quantized matvec;
* the router: ``pf_route`` (``prefill.cu``) for all T tokens at once (softmax/sigmoid, k rounds of arg-max with ties
  to the lower index, weight normalisation: the step's ``route_fused`` rule); the routing comes back to the host once
  per layer (the expert jobs are built there);
* routed experts (``experts="rows"``, the default): the T k (token, expert) pairs are split into jobs of one expert
  and up to :data:`JOB_TOKENS` of its tokens (:func:`expert_jobs`); ``pf_moe_gu`` / ``pf_moe_down`` decode each
  quantized row of a job's expert once and multiply it with the job's tokens, reading the blob through the tier's
  slot table (a VRAM slot, or the mapped pinned host arena for an expert not resident; the tier's residency does not
  change during the prompt); every pair's output lands in its own row and the k rows of a token are summed with the
  router weights in rank order. ``experts="gemm"``: experts (most tokens first) taken ``group`` at a time, their
  blobs dequantized to float32 through the same pointer table (``pf_dequant_blobs``) and each expert's tokens put
  through two batched SGEMMs. ``experts="mma"``: jobs of one expert and up to :data:`JOB_TOKENS_MMA` tokens
  (``STRATATOOLS_PREFILL_JOB``: 8, 16 or 32) on the tensor cores (:mod:`stratatools.runtime.gpu.qmm`: codes exact in
  fp16, the block scale applied once per block, activations split into two halves), Q8_0 and Q2_0 experts (other types
  take the ``rows`` path); on CuPy the routing then stays on the device (the jobs' table is built there, the routing
  comes back once a chunk) and the shared expert runs on a second stream beside the routed ones;
* the gated DeltaNet: projections batched; the causal conv over [conv state; chunk] with SiLU, the q/k L2 norms and
  the per-head beta/decay in one launch, and the output's RMS norm and gate in another (``gdn_prep.cu``; array code
  with ``STRATATOOLS_GDN_PREP=0``); the delta-rule recurrence on CuPy by ``pf_gdn_warp`` (one warp per 4 value
  columns, the state in registers while the warp walks the chunk's tokens in order; :data:`GDN_WARP_ENV` ``0``:
  ``pf_gdn_chunk``, one block per value head and column slice, the state in shared memory);
* attention: the chunk's keys/values (and, on a long-context decoder, its raw indexer keys and newly completed pooled
  block keys) are written into the static caches, then causal attention of the chunk's queries over positions
  ``0 .. pos0+T-1``; where QSA selects (a query past :func:`stratatools.runtime.gpu.decode.max_full_context`'s range)
  the attended cells are picked per query exactly as :meth:`Qwen4ExpRuntime._select` picks them;
* PLE and norms: batched array code; the hyper-connection norm, mix and inject as single kernels on CuPy.

Dense GEMM switch (``STRATATOOLS_PREFILL_GEMM``, :func:`stratatools.runtime.gpu.qmm.prefill_gemm`; or the ``gemm``
argument): ``sgemm`` as above; ``mma`` (default): the dense projections and the shared expert of the decoder's
re-laid-out Q8_0 (``Q8R``) and of GGUF Q8_0 / Q2_0 matrices through :func:`stratatools.runtime.gpu.qmm.dense` (no
float32 copy of the matrix; others keep dequantize + SGEMM), and the routed experts on the ``mma`` path where the
``rows`` path was asked for; ``hgemm``: as ``mma``, but those dense matrices through
:func:`stratatools.runtime.gpu.qmm.hgemm` (each written as a transient fp16 pair Wh + Wl = W, cuBLAS fp16 GEMMs with
float32 accumulation; a matrix with a value past fp16's range goes through ``mma``: checked once per matrix name, one
synchronisation, the answer kept on the decoder). :class:`stratatools.runtime.gpu.batch.BatchDecoder` inherits the
dense part.

With numpy (a decoder over :class:`stratatools.runtime.model.Qwen4ExpRuntime`) the same code runs on the CPU with
float32 matrices from :meth:`Weights.get` and experts from the runtime's ``expert_fn`` (tests check the chunk logic
against numpy decode steps there; the CUDA kernels are checked as host C++).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.runtime.model import _l2norm, _rmsnorm, _sigmoid, _silu, _softmax, _softplus, _to_host
from stratatools.runtime.topk import qsa_select_mask, qsa_selects_all

from stratatools.runtime.gpu.kernels import UNIT, cuda_source, cuda_unit
from stratatools.runtime.gpu.launch import batch_kernel

#: Tokens per chunk (default).
CHUNK = 512
#: Experts whose float32 blobs are dequantized at once (default).
GROUP = 8
#: Bytes the attention of one query block may take with its temporaries (the chunk's queries are split so that one
#: score array [heads, queries, positions] takes at most a quarter of it).
ATTN_SCORE_BYTES = 128 << 20
ROUTE_THREADS = 128
#: ``STRATATOOLS_ROUTE_WARP``: the router on ``pf_route_warp`` (a warp a token, no barrier; 1, the default: 7.1
#: against 13.5 us a launch of 32 tokens x 256 experts, H200, bench/gpu-notes.md) for up to :data:`ROUTE_WARP_MAX_E`
#: experts (prefill.cu 32 PF_RW_VPL), or on ``pf_route`` (a block a token; 0).
ROUTE_WARP_ENV = "STRATATOOLS_ROUTE_WARP"
ROUTE_WARP_DEFAULT = True
ROUTE_WARP_MAX_E = 256


def route_warp() -> bool:
    """:data:`ROUTE_WARP_ENV` as a flag; raises StrataError for a value other than 0 or 1."""
    from stratatools.runtime.gpu.kernels import env_on

    return env_on(ROUTE_WARP_ENV, "the router a warp a token", ROUTE_WARP_DEFAULT)
#: ``STRATATOOLS_HC_FUSED``: the hyper-connections on CuPy as one launch for the pending inject, the norm and its
#: split (``qmm.hc_norm_split``), one for the mix and its split (``qmm.hc_mix``), the down projection's split made by
#: its sums' launch (1, the default), or as the inject, ``rmsnorm_rows``, ``pf_hc_mix`` and the splits each a launch
#: of their own (0: the nineteenth pass's step, bench/gpu-notes.md).
HC_FUSED_ENV = "STRATATOOLS_HC_FUSED"
HC_FUSED_DEFAULT = True
#: ``STRATATOOLS_JOINED_PROJ``: up to 32 rows on the integer dense ring, matrices the decoder stacks in one buffer as
#: one product (1, the default) or each its own (0): a GDN layer's four in-projections (qkv, the output gate, beta,
#: alpha: one launch and no split-k sums instead of four launches and three sums), a hyper-connection's down and
#: inject projections (one product and one launch of its sums, activations and split: ``qmm.dense(hc_rd=)``) and the
#: shared expert's gate and up (where the runtime holds them as one array).
JOINED_ENV = "STRATATOOLS_JOINED_PROJ"
JOINED_DEFAULT = True


def joined_enabled() -> bool:
    """:data:`JOINED_ENV` as a flag; raises StrataError for a value other than 0 or 1."""
    from stratatools.runtime.gpu.kernels import env_on

    return env_on(JOINED_ENV, "the GDN in-projections as one product", JOINED_DEFAULT)


def hc_fused() -> bool:
    """:data:`HC_FUSED_ENV` as a flag; raises StrataError for a value other than 0 or 1."""
    from stratatools.runtime.gpu.kernels import env_on

    return env_on(HC_FUSED_ENV, "the hyper-connections' fused launches", HC_FUSED_DEFAULT)


#: Tokens of one expert job (``prefill.cu`` PF_TT): each weight row is decoded once per job.
JOB_TOKENS = 8
#: Tokens of one expert job of the ``mma`` expert path by default (``qmm.cu``'s JT; qmm.JOB_SIZES).
JOB_TOKENS_MMA = 16
#: The largest job of the ``mma`` path (``STRATATOOLS_PREFILL_JOB``: qmm.JOB_SIZES), which the VRAM plan provides for.
JOB_TOKENS_MMA_MAX = 32
#: Expert paths: ``rows`` (``pf_moe_gu``/``pf_moe_down``: quantized rows decoded once per job of up to
#: :data:`JOB_TOKENS` tokens), ``gemm`` (blobs dequantized to float32 ``group`` at a time, batched SGEMMs) or ``mma``
#: (tensor-core jobs of up to :data:`JOB_TOKENS_MMA` tokens, :mod:`stratatools.runtime.gpu.qmm`).
EXPERT_PATHS = ("rows", "gemm", "mma")


#: ``0`` runs every prefill chunk eagerly; default: on CuPy a chunk of the prefiller's full ``chunk`` tokens replays
#: one CUDA graph (captured after the first such chunk ran eagerly), its inputs staged into buffers the graph reads
#: and the chunk's positions read on the device, so that one graph serves every full chunk of every prompt up to
#: :data:`GRAPH_MAX_POS` (:meth:`ChunkPrefill._graph_ok` lists the other conditions). The graph removes the host's
#: launches (about 3,600 a 512-token chunk of the 48-layer model, as long as its device time) and lets the large
#: dense matrices take cuBLAS (:func:`stratatools.runtime.gpu.qmm.big_matrix_values`). H200, 48 x 256 model,
#: 512-token prompt: 3,301 against 2,915 tokens/s eagerly (bench/gpu-notes.md, fourteenth pass).
GRAPH_ENV = "STRATATOOLS_PREFILL_GRAPH"
#: The graph serves chunks ending at most at this position: its attention (``attn_batch.cu``: each query over its
#: positions on the CUDA cores, the scores of :data:`GRAPH_MAX_POS` positions in shared memory) grows with the
#: position faster than the eager chunk's batched products.
GRAPH_MAX_POS = 4096
#: Most dynamic shared bytes of ``attn_batch.cu``'s ``attn_decode_b`` (its scores: 4 bytes a position of the longest
#: query).
ATTN_B_MAX_SHARED = 200 * 1024


def graph_enabled() -> bool:
    """May a full prefill chunk replay a CUDA graph (:data:`GRAPH_ENV`, default yes)? Raises StrataError for a
    value other than 0 or 1."""
    from stratatools.runtime.gpu.kernels import env_on

    return env_on(GRAPH_ENV, "full chunks through a CUDA graph")


@functools.lru_cache(maxsize=None)
def attn_module() -> Any:
    """``attn_batch.cu`` compiled once (multiply-add fusion allowed): the batched step's attention, and the prefill
    graph's."""
    import cupy

    return cupy.RawModule(code=cuda_unit("attn_batch.cu"), options=("--std=c++17",))


def expert_jobs(ids: np.ndarray, tt: int = JOB_TOKENS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the (token, expert) pairs of a routing ``ids`` [T, k] into jobs of one expert and up to ``tt`` of its
    tokens (experts in increasing id, tokens in increasing order). Returns (expert of each job [J] int64, token of
    each job slot [J tt] int32 (-1: empty), pair index t k + r of each slot [J tt] int32 (-1: empty))."""
    ids = np.asarray(ids)
    k = ids.shape[1]
    flat = ids.reshape(-1).astype(np.int64)
    N = flat.size
    order = np.argsort(flat, kind="stable")
    uniq, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    rank = np.arange(N) - np.repeat(starts, counts)
    njob = -(-counts // tt)
    jstart = np.concatenate([[0], np.cumsum(njob)[:-1]]).astype(np.int64)
    slot = np.repeat(jstart, counts) * tt + (rank // tt) * tt + rank % tt
    J = int(njob.sum())
    tok = np.full(J * tt, -1, dtype=np.int32)
    dst = np.full(J * tt, -1, dtype=np.int32)
    tok[slot] = order // k
    dst[slot] = order
    return np.repeat(uniq, njob), tok, dst


#: ``0`` keeps the gated DeltaNet's element-wise parts of the batched paths as array code (the earlier path, for
#: comparisons); default: ``gdn_prep.cu``'s two kernels (conv + SiLU + norms + beta/decay, then norm + gate).
GDN_PREP_ENV = "STRATATOOLS_GDN_PREP"
#: Threads of a ``pf_gdn_prep`` / ``pf_gdn_out`` block.
GDN_PREP_THREADS = 256


#: The prefill's delta-rule recurrence: ``0`` ``pf_gdn_chunk`` (a block per head and column slice, the state in shared
#: memory, three barriers a token), ``1`` (default) ``pf_gdn_warp`` (a warp per :data:`GDN_WARP_COLUMNS` value
#: columns, the state in registers, no barrier) where the keys have at most :data:`GDN_WARP_MAX_DK` values (else the
#: block kernel). H200, 48 x 256 model, 512-token prefill: 29.2 against 40.9 ms (bench/gpu-notes.md).
GDN_WARP_ENV = "STRATATOOLS_GDN_WARP"
#: prefill.cu PF_GDN_CPW (value columns a warp) and 32 PF_GDN_RPL (key rows of the warp's registers)
GDN_WARP_COLUMNS = 4
GDN_WARP_MAX_DK = 128
#: Warps of a ``pf_gdn_warp`` block.
GDN_WARP_WARPS = 4
#: ``pf_gdn_step_rw`` (the batched decode step's recurrence): the largest key head it holds (8 warps of
#: :data:`GDN_STEP_RW_ROWS` rows) and the state rows a thread holds (prefill.cu PF_GDN_RW_ROWS).
GDN_STEP_MAX_DK = 128
GDN_STEP_RW_ROWS = 16


def gdn_step_rw_launch(dk: int, dv: int) -> tuple[int, int]:
    """``pf_gdn_step_rw``'s (blocks along the value columns, threads a block) for heads of ``dk`` x ``dv``: 32
    columns a block, a warp a :data:`GDN_STEP_RW_ROWS` state rows (dk <= :data:`GDN_STEP_MAX_DK`)."""
    return -(-int(dv) // 32), 32 * -(-int(dk) // GDN_STEP_RW_ROWS)


#: ``STRATATOOLS_GDN_STEP_COLS``: the batched step's recurrence launched with one head's column parts next to each other
#: in the grid (``pf_gdn_step_rwc``: the blocks started together read and write whole states; 1, the default) or the
#: heads first (``pf_gdn_step_rw``: every head's same column part first; 0). The same bits either way.
GDN_STEP_COLS_ENV = "STRATATOOLS_GDN_STEP_COLS"


#: ``STRATATOOLS_GDN_STEP_EARLY``: the batched step's recurrence (its column-parts grid) loads its places' state
#: before griddepcontrol.wait where S is the state buffer itself (prefill.cu ``pf_gdn_step_rwce``; 1, the default),
#: the same with loads and stores that evict first (``cs``: ``pf_gdn_step_rwcs``), or after it (0:
#: ``pf_gdn_step_rwc``).
GDN_STEP_EARLY_ENV = "STRATATOOLS_GDN_STEP_EARLY"
GDN_STEP_EARLY = ("0", "1", "cs")


def gdn_step_early() -> str:
    """:data:`GDN_STEP_EARLY_ENV`: one of :data:`GDN_STEP_EARLY` (unset or empty: ``1``); raises StrataError for
    another value."""
    import os

    v = os.environ.get(GDN_STEP_EARLY_ENV, "").strip() or "1"
    if v not in GDN_STEP_EARLY:
        raise StrataError(f"{GDN_STEP_EARLY_ENV}={v!r}: use 1 (the state loaded before the wait), cs (and evicting "
                          f"first) or 0")
    return v


def gdn_step_cols() -> bool:
    """:data:`GDN_STEP_COLS_ENV` as a flag (default on); raises StrataError for a value other than 0 or 1."""
    from stratatools.runtime.gpu.kernels import env_on

    return env_on(GDN_STEP_COLS_ENV, "a head's column parts next to each other in the recurrence's grid")


def gdn_kernel() -> str:
    """:data:`GDN_WARP_ENV` as the kernel it names: ``chunk`` (0) or ``warp`` (1, the default when unset or empty).
    Raises StrataError for another value."""
    from stratatools.runtime.gpu.kernels import env_on

    return "warp" if env_on(GDN_WARP_ENV, "a warp per value columns; 0: a block per head and column slice") else "chunk"


def gdn_chunk_shared(dk: int, cw: int, rs: int) -> int:
    """Dynamic shared bytes of ``pf_gdn_chunk`` (prefill.cu) for keys of ``dk``, ``cw`` value columns a block and ``rs``
    row slices: the state slice [dk, cw], double-buffered q and k [2, dk] each and v columns [2, cw], the delta
    [cw], the row-slice partial sums [rs, cw] and the decay/beta pairs [2, 2]."""
    return (dk * cw + 4 * dk + (rs + 3) * cw + 4) * 4


def gdn_prep_enabled() -> bool:
    """Do the batched paths (prefill, batched decode) run the GDN's element-wise parts through ``gdn_prep.cu``
    (:data:`GDN_PREP_ENV`, default yes)?"""
    import os

    return os.environ.get(GDN_PREP_ENV, "1") != "0"


@functools.lru_cache(maxsize=None)
def _gdn_module() -> Any:
    """``gdn_prep.cu`` compiled once (multiply-add fusion allowed)."""
    import cupy

    return cupy.RawModule(code=cuda_unit("gdn_prep.cu"), options=("--std=c++17",))


def gdn_prep_shared(nk: int, dk: int) -> int:
    """Dynamic shared bytes of ``pf_gdn_prep`` (gdn_prep.cu): one row's q and k heads after the conv, 2 nk dk floats."""
    return 2 * nk * dk * 4


#: Blocks the GDN element-wise kernels aim for: a launch of few rows (the batched step: one a place) splits each row's
#: channels or heads over this many blocks in all (``pf_gdn_prep`` / ``pf_gdn_out`` parts).
GDN_PREP_BLOCKS = 512


def gdn_parts(rows: int, units: int) -> int:
    """Parts a row of ``units`` channel units (or head groups) is split into for a launch over ``rows`` rows: about
    :data:`GDN_PREP_BLOCKS` blocks in all, at least 1, at most ``units``, and none without units (the kernels give a
    part ceil(units / parts) of them)."""
    p = max(1, min(int(units), -(-GDN_PREP_BLOCKS // max(1, int(rows)))))
    return -(-int(units) // -(-int(units) // p))


def gdn_prep_launch(xp: Any, qkv: Any, state: Any, wc: Any, b: Any, a: Any, ssm_a: Any, dt_bias: Any, nseq: int,
                    nk: int, dk: int, nv: int, dv: int, in_place: bool = False) -> tuple[Any, Any, Any, Any, Any, Any]:
    """``pf_gdn_prep`` over ``nseq`` sequences of R / nseq rows each: qkv [R, C], state [nseq, K-1, C] (each
    sequence's previous K-1 conv inputs), wc [C, K], b / a [R, nv], ssm_a / dt_bias [nv] (float32 on the device;
    qkv, b and a contiguous or rows of a wider array, b and a the same row stride: :func:`row_stride`; the rest
    contiguous). Returns (qn [R, nk, dk] L2-normalised and scaled by dk^-1/2, kn [R, nk, dk], v [R, nv dv] after
    conv + SiLU, beta [R, nv], decay [R, nv], the next conv state [nseq, K-1, C]: new arrays; with ``in_place`` and
    one row a sequence, the state is ``state`` itself, updated). Raises StrataError when R is not a multiple of
    ``nseq``, the widths disagree or b's and a's rows are not alike."""
    R, C = int(qkv.shape[0]), int(qkv.shape[1])
    K = int(wc.shape[1])
    if nseq < 1 or R % nseq or C != 2 * nk * dk + nv * dv or int(wc.shape[0]) != C:
        raise StrataError(f"GDN prep: {R} rows of {C} values in {nseq} sequences do not match heads "
                          f"2 x {nk} x {dk} + {nv} x {dv} and a conv of {int(wc.shape[0])} channels")
    ldq, ldb = row_stride(qkv), row_stride(b)
    if row_stride(a) != ldb or tuple(a.shape) != (R, nv) or tuple(b.shape) != (R, nv):
        raise StrataError(f"GDN prep: beta and alpha inputs {tuple(b.shape)} / {tuple(a.shape)} are not [{R}, {nv}] "
                          "rows alike")
    f32 = xp.float32
    qn, kn = xp.empty((R, nk, dk), dtype=f32), xp.empty((R, nk, dk), dtype=f32)
    v = xp.empty((R, nv * dv), dtype=f32)
    beta, decay = xp.empty((R, nv), dtype=f32), xp.empty((R, nv), dtype=f32)
    st_out = state if in_place and R == nseq else xp.empty((nseq, K - 1, C), dtype=f32)
    units = 2 * nk + -(-(nv * dv) // dk)
    batch_kernel(_gdn_module().get_function("pf_gdn_prep"), "pf_gdn_prep")(
        (max(1, min(R, 65535)), gdn_parts(R, units)), (GDN_PREP_THREADS,),
        (qkv, state, st_out, wc, np.int32(C), np.int32(K), np.int32(nseq), np.int32(R // nseq), b, a, ssm_a, dt_bias,
         np.int32(nk), np.int32(dk), np.int32(nv), np.float32(dk ** -0.5), qn, kn, v, beta, decay, np.int32(ldq),
         np.int32(ldb)),
        shared_mem=gdn_prep_shared(nk, dk))
    return qn, kn, v, beta, decay, st_out


def row_stride(x: Any) -> int:
    """The row stride in floats of a float32 2-D array whose rows are contiguous (a contiguous array, or columns of a
    wider one: the batched step's joined products); raises StrataError for another array (the kernels that take a
    row stride index the values of a row as consecutive floats)."""
    if x.ndim != 2 or x.dtype != np.float32 or (x.shape[1] > 1 and int(x.strides[1]) != 4) or int(x.strides[0]) % 4:
        raise StrataError(f"GDN: an input of shape {tuple(x.shape)} and strides {tuple(x.strides)} is not float32 rows "
                          "of consecutive values")
    return int(x.strides[0]) // 4 if x.shape[0] > 1 else int(x.shape[1])


def gdn_out_launch(xp: Any, o: Any, z: Any, norm_w: Any, eps: float, sigmoid_gate: bool, nv: int, dv: int) -> Any:
    """``pf_gdn_out``: per value head RMS norm of the recurrence output o [R, nv dv] times ``norm_w`` (dv or nv dv
    floats) times the gate's activation of z [R, nv dv] (sigmoid, else SiLU; contiguous or rows of a wider array:
    :func:`row_stride`); returns a new [R, nv dv] array."""
    R = int(o.shape[0])
    ldz = row_stride(z)
    y = xp.empty((R, nv * dv), dtype=xp.float32)
    batch_kernel(_gdn_module().get_function("pf_gdn_out"), "pf_gdn_out")(
        (max(1, min(R, 65535)), gdn_parts(R, -(-nv // (GDN_PREP_THREADS // 32)))), (GDN_PREP_THREADS,),
        (o, z, norm_w, np.int32(norm_w.size), np.float32(eps), np.int32(bool(sigmoid_gate)), np.int32(R),
         np.int32(nv), np.int32(dv), y, np.int32(ldz)))
    return y


@functools.lru_cache(maxsize=None)
def _module(exact: bool, type_ids: tuple[int, ...]) -> Any:
    """``prefill.cu`` compiled (once per argument set) with the templates instantiated only for ``type_ids`` (the
    types the model uses: compiling every type's decoder takes NVRTC tens of seconds): ``exact``: the dequantizer
    ``pf_dequant_blobs`` without multiply-add fusion (bit-identical to the numpy dequantizer); else the expert kernels
    ``pf_moe_gu``/``pf_moe_down`` with it. Both hold the ``extern "C"`` kernels."""
    import cupy

    from stratatools.runtime.gpu.kernels import tables_source

    src = (cuda_source("prelude.cuh") + tables_source() + cuda_source("decoders.cuh") + cuda_unit("prefill.cu"))
    kinds = ("pf_dequant_blobs",) if exact else ("pf_moe_gu", "pf_moe_down")
    names = [f"{k}<{tid}>" for k in kinds for tid in type_ids]
    opts = ("--std=c++17", "--fmad=false") if exact else ("--std=c++17",)
    return cupy.RawModule(code=src, options=opts, name_expressions=names)


def host_source(type_ids: tuple[int, ...]) -> str:
    """``prefill.cu`` with the decoders as host C++17 (``host_kernel_shim.cuh``: one thread per block), with entries
    ``host_<kernel>(grid_x, grid_y, <the kernel's parameters>)`` for its ``extern "C"`` kernels and
    ``host_pf_dequant_blobs_<T>(grid_x, grid_y, ptrs, off, n_groups, dst)``, ``host_pf_moe_gu_<T>(...)`` and
    ``host_pf_moe_down_<T>(...)`` (the templates' parameters) for each ggml type id in ``type_ids``
    (tests/test_gpu_prefill_host.py)."""
    from stratatools.runtime.gpu.kernels import kernel_signatures, tables_source

    entries = []
    for k, params in kernel_signatures("prefill.cu").items():
        decl = ", ".join(f"{t} {n}" for t, n in params)
        call = ", ".join(n for _, n in params)
        entries.append(f'extern "C" void host_{k}(unsigned gx, unsigned gy, {decl}) {{\n'
                       f"    host_run_grid(gx, gy, [&]() {{ {k}({call}); }});\n}}\n")
    gu = ("const u64* job_ptr, const int* job_tok, const float* X, float* Hbuf, int H, int F",
          "job_ptr, job_tok, X, Hbuf, H, F")
    dn = ("const u64* job_ptr, long long doff, const int* job_dst, const float* Hbuf, float* out, int H, int F",
          "job_ptr, doff, job_dst, Hbuf, out, H, F")
    for tid in type_ids:
        for name, (decl, call) in (("pf_moe_gu", gu), ("pf_moe_down", dn)):
            entries.append(f'extern "C" void host_{name}_{int(tid)}(unsigned gx, unsigned gy, {decl}) {{\n'
                           f"    host_run_grid(gx, gy, [&]() {{ {name}<{int(tid)}>({call}); }});\n}}\n")
        entries.append(f'extern "C" void host_pf_dequant_blobs_{int(tid)}(unsigned gx, unsigned gy, const u64* ptrs, '
                       f"long long off, long long n_groups, float* dst) {{\n"
                       f"    host_run_grid(gx, gy, [&]() {{ pf_dequant_blobs<{int(tid)}>(ptrs, off, n_groups, dst); }});\n}}\n")
    return (cuda_source("host_kernel_shim.cuh") + cuda_source("host_shim.cuh") + cuda_source("prelude.cuh")
            + tables_source() + cuda_source("decoders.cuh") + cuda_unit("prefill.cu") + "".join(entries))


def prefill_scratch_bytes(cfg: Any, blob_bytes_f32: int, chunk: int = CHUNK, group: int = GROUP,
                          max_dense_values: int = 0, max_ctx: int = 1 << 30, experts: str = "rows") -> int:
    """Device bytes the batched prefill's temporaries need at most (an estimate for the ``--vram-gib`` plan): about
    twelve chunk-wide activations of the hyper-connection width; one dense matrix as float32 (``max_dense_values``
    values) twice (dequantized and in flight: 8 bytes a weight; the ``hgemm`` path's transient fp16 pair Wh + Wl
    takes 4 bytes a weight, ``mma`` none, so this covers all three GEMM paths); the attention scores with their
    temporaries (at most :data:`ATTN_SCORE_BYTES`, less for short contexts); the per-pair expert outputs [chunk k,
    n_embd] three times (outputs, weighted, summed) and, on the ``rows`` expert path, the jobs' hidden activations
    (every expert's last job padded to :data:`JOB_TOKENS`), on the ``gemm`` path ``group`` expert blobs as float32
    (``blob_bytes_f32`` each) with their gathered inputs and outputs (every expert of a group padded to the chunk)."""
    n, hc, k = cfg.n_embd, cfg.hc_count, cfg.n_expert_used
    ff = cfg.n_ff_exp
    E = max(cfg.n_expert) if isinstance(cfg.n_expert, (list, tuple)) else int(cfg.n_expert)
    act = 12 * chunk * hc * n * 4
    experts_b = 3 * (chunk * k + 1) * n * 4
    if experts == "rows":
        experts_b += (chunk * k + E * (JOB_TOKENS - 1)) * ff * 4
    elif experts == "mma":  # the jobs' hidden rows and their hi/lo halves, the input's halves
        # (the device table's capacity: ceil(chunk k / jt) + E jobs of jt rows, jt up to JOB_TOKENS_MMA_MAX)
        experts_b += 2 * (chunk * k + JOB_TOKENS_MMA_MAX - 1 + E * JOB_TOKENS_MMA_MAX) * ff * 4 + chunk * n * 4
    else:
        experts_b += group * blob_bytes_f32 + group * chunk * (n + 3 * ff) * 4 * 2
    attn = min(ATTN_SCORE_BYTES, 4 * 4 * cfg.n_head * chunk * max(1, min(max_ctx, 1 << 30)))
    return int(act + experts_b + 2 * 4 * max_dense_values + attn)


class _SharedTail:
    """The shared expert's output ys [T, n] (unscaled) and gate logits (column ``goff`` of g [T, ld]) that the routed
    outputs' sum adds (:meth:`ChunkPrefill._moe_sum`); ``ready()`` makes the main stream wait for the shared expert's
    stream (once; no stream: nothing to wait for)."""

    def __init__(self, ys: Any, g: Any, goff: int, main: Any, join: Any):
        self.ys, self.g, self.goff = ys, g, int(goff)
        self._main, self._join = main, join

    def ready(self) -> None:
        if self._join is not None:
            self._main.wait_event(self._join)
            self._join = None


def _is_q8r(buf: Any) -> bool:
    """Is a decoder's matrix buffer a :class:`stratatools.runtime.gpu.kernels.Q8R` (codes ``q`` and scales ``d`` in
    ``dense_q8.cu``'s layout) rather than GGUF block bytes?"""
    return getattr(buf, "q", None) is not None and getattr(buf, "d", None) is not None


def _same_memory(a: Any, b: Any) -> bool:
    """Are the device arrays a and b the same values (data, shape and strides)? False for host arrays."""
    try:
        return (int(a.data.ptr) == int(b.data.ptr) and tuple(a.shape) == tuple(b.shape)
                and tuple(a.strides) == tuple(b.strides))
    except (AttributeError, TypeError):  # (numpy: .data is a buffer without a device pointer)
        return False


class _Q8RRows:
    """Rows ``row0 ..`` of a decoder's :class:`Q8R` buffer (one matrix of a stacked group), for :meth:`ChunkPrefill._dequant`."""

    __slots__ = ("m", "row0")

    def __init__(self, m: Any, row0: int):
        self.m, self.row0 = m, int(row0)


class ChunkPrefill:
    """The batched prefill of one :class:`StaticDecoder` (see module docstring).

    Args:
        dec: the decoder whose buffers the prefill fills.
        chunk: tokens per batched forward (1..).
        group: experts dequantized at once (``gemm`` expert path).
        experts: the routed-expert path, one of :data:`EXPERT_PATHS` (``rows`` becomes ``mma`` when ``gemm`` is
            ``mma`` or ``hgemm``).
        gemm: the dense GEMM path, ``sgemm``, ``mma`` or ``hgemm`` (module docstring); None: from
            ``STRATATOOLS_PREFILL_GEMM``.
    Raises:
        StrataError: a chunk or group below 1; an unknown expert or GEMM path.
    """

    def __init__(self, dec: Any, chunk: int = CHUNK, group: int = GROUP, experts: str = "rows",
                 gemm: str | None = None):
        from stratatools.runtime.gpu.qmm import GEMMS, prefill_gemm

        if chunk < 1 or group < 1:
            raise StrataError(f"prefill chunk {chunk} and expert group {group} must be at least 1")
        if experts not in EXPERT_PATHS:
            raise StrataError(f"expert path {experts!r} is not one of {', '.join(EXPERT_PATHS)}")
        # the environment's switch is the GPU path's (on numpy it would only regroup the float32 job products; a
        # CPU run ignores the GPU-only settings, as it ignores the others)
        self.gemm = (prefill_gemm() if dec.gpu else "sgemm") if gemm is None else str(gemm)
        if self.gemm not in GEMMS:
            raise StrataError(f"prefill GEMM path {self.gemm!r} is not one of {', '.join(GEMMS)}")
        self.asked = (experts, gemm)  # the arguments (StaticDecoder.prefiller compares them)
        self.experts = "mma" if (experts == "rows" and self.gemm in ("mma", "hgemm")) else experts
        self.dec, self.rt, self.w, self.cfg, self.xp = dec, dec.rt, dec.w, dec.cfg, dec.xp
        self.gpu = dec.gpu
        self.chunk, self.group = int(chunk), int(group)
        self.k = self.cfg.n_expert_used
        from stratatools.runtime.gpu.qmm import job_tokens

        # tokens of a tensor-core expert job (qmm.JOB_ENV; the batched step's qmm.BATCH_JOB_ENV)
        self._jt = job_tokens(batch=self._batch_step) if self.gpu else JOB_TOKENS_MMA
        self._small: dict[str, Any] = {}
        self.timing: dict[str, float] | None = None  # set to {} to collect per-part host-side timings (synchronises)
        if self.gpu:
            import cupy as cp

            self.cp = cp
            ex = {t for ly in dec.rt.tier.arena.layers for t in (ly.gu_type.id, ly.d_type.id) if t in UNIT}
            dense = {t.type.id for t in self.w.model.iter_tensors()
                     if "_exps." not in t.name and t.type.id in UNIT and t.type.name not in ("F32", "F16", "BF16")}
            self._tids = {True: tuple(sorted(ex | dense)), False: tuple(sorted(ex))}
            mod = _module(False, self._tids[False])
            self.k_route = batch_kernel(mod.get_function("pf_route"), "pf_route")
            self.k_route_warp = batch_kernel(mod.get_function("pf_route_warp"), "pf_route_warp")
            self.k_gdn = batch_kernel(mod.get_function("pf_gdn_chunk"), "pf_gdn_chunk")
            self.k_moe_sum = batch_kernel(mod.get_function("pf_moe_sum"), "pf_moe_sum")
            self.k_moe_sum_shared = batch_kernel(mod.get_function("pf_moe_sum_shared"), "pf_moe_sum_shared")
            self.k_gdn_warp = batch_kernel(mod.get_function("pf_gdn_warp"), "pf_gdn_warp")
            self.k_gdn_step_rw = batch_kernel(mod.get_function("pf_gdn_step_rw"), "pf_gdn_step_rw")
            self.k_gdn_step_rwc = batch_kernel(mod.get_function("pf_gdn_step_rwc"), "pf_gdn_step_rwc")
            self.k_gdn_step_rwce = batch_kernel(mod.get_function("pf_gdn_step_rwce"), "pf_gdn_step_rwce")
            self.k_gdn_step_rwcs = batch_kernel(mod.get_function("pf_gdn_step_rwcs"), "pf_gdn_step_rwcs")
            from stratatools.runtime.gpu.kernels import shared_side

            # the shared expert on a second stream beside the routed experts (kernels.SHARED_SIDE_ENV; the batched
            # step's too); not with hgemm, whose fp16 cuBLAS GEMMs would share one cuBLAS handle (and its workspace)
            # across the streams
            self._shared_side = (cp.cuda.Stream(non_blocking=True)
                                 if shared_side() and self.gemm != "hgemm" else None)
        #: (ids [L, T, k] int32, weights [L, T, k] float32) on the device while a chunk runs on CuPy: the layers whose
        #: MoE routes on the device (:meth:`_moe_on_device`, listed in ``_dev_layers``) leave their routing there,
        #: read back once at the chunk's end
        self._dev_route: tuple[Any, Any] | None = None
        self._dev_layers: list[int] = []
        #: the CUDA graph of a full chunk (:data:`GRAPH_ENV`): its input and output buffers, the graph, its memory pool
        self._pgraph: dict[str, Any] | None = None
        self._graph_error: str | None = None  # why the capture failed (full chunks then stay eager)
        self._graph_layers_ok: bool | None = None  # (:meth:`_graph_layers`, asked once)

    # -- public -----------------------------------------------------------------------------------------
    def compile(self) -> None:
        """Build the CUDA modules a chunk uses (the FMA kernels and the exact dequantizer; CuPy caches them), so that
        a timed prompt does not include their compilation. A no-op on numpy."""
        if self.gpu:  # CuPy compiles a RawModule at its first kernel lookup (pf_route is in both modules)
            for exact in (False, True):
                _module(exact, self._tids[exact]).get_function("pf_route")
            if self.gemm in ("mma", "hgemm") or self.experts == "mma":
                from stratatools.runtime.gpu import qmm

                qmm.module().get_function("qmm_split")

    def run(self, ids: Any) -> tuple[Any, np.ndarray, np.ndarray]:
        """Run the prompt ``ids`` from the decoder's position on; returns (logits of the last token [vocab] (device
        array on CuPy), routing ids [T, L, k] int32, weights [T, L, k] float32 (host)).

        Raises StrataError for an empty call, a token outside the vocabulary or a context past ``max_ctx``.
        """
        dec, cfg = self.dec, self.cfg
        toks = np.asarray(ids, dtype=np.int64).reshape(-1)
        if toks.size == 0:
            raise StrataError("no tokens to run")
        if toks.min() < 0 or toks.max() >= cfg.n_vocab:
            bad = int(toks[(toks < 0) | (toks >= cfg.n_vocab)][0])
            raise StrataError(f"token id {bad} is outside the vocabulary [0, {cfg.n_vocab})")
        if dec.pos + toks.size > dec.max_ctx:
            raise StrataError(f"position {dec.max_ctx} is past the static decoder's {dec.max_ctx} positions "
                              f"(prompt of {toks.size} tokens at position {dec.pos})")
        if self.gpu:
            self._slots = dec.rt.tier.slot_table()
        rid, rw = [], []
        lg = None
        for a in range(0, toks.size, self.chunk):
            part = toks[a:a + self.chunk]
            lg, i, w = self._chunk(part, last=a + self.chunk >= toks.size)
            rid.append(i)
            rw.append(w)
        return lg, np.concatenate(rid, axis=0), np.concatenate(rw, axis=0)

    # -- helpers ----------------------------------------------------------------------------------------
    def _tic(self, key: str) -> None:
        if self.timing is None:
            return
        import time

        if self.gpu:
            self.cp.cuda.get_current_stream().synchronize()
        now = time.perf_counter()
        last = getattr(self, "_tlast", None)
        if last is not None:
            self.timing[self._tkey] = self.timing.get(self._tkey, 0.0) + now - last
        self._tlast, self._tkey = now, key

    def _push(self, key: str) -> None:
        """Time what follows under ``key`` until :meth:`_pop` (breakdown only)."""
        if self.timing is not None:
            self._tstack = getattr(self, "_tstack", []) + [self._tkey]
            self._tic(key)

    def _pop(self) -> None:
        if self.timing is not None:
            self._tic(self._tstack.pop())

    def _f32(self, name: str) -> Any:
        """A small tensor as float32 on xp (norm weights, conv kernels, biases), kept."""
        a = self._small.get(name)
        if a is None:
            a = self.xp.ascontiguousarray(self.w.get(name), dtype=self.xp.float32)
            self._small[name] = a
        return a

    def _raw_dev(self, name: str) -> tuple[Any, Any, int, int]:
        """(device bytes of matrix ``name`` as the step holds them, type, rows, cols): the decoder's own copy (its
        per-matrix buffer, or a slice of a stacked group buffer; a :class:`_Q8RRows` where the fused step keeps the
        matrix re-laid out for ``dense_q8.cu``), else a transient upload."""
        dec, cp = self.dec, self.cp
        t = self.w.model.tensor(name)
        cols = int(t.ne[0])
        rows = int(np.prod([int(d) for d in t.ne[1:]])) if len(t.ne) > 1 else 1
        got = dec._raw.get(name)
        if got is not None and got[0] is not None:
            return (_Q8RRows(got[0], 0) if _is_q8r(got[0]) else got[0]), t.type, rows, cols
        for key, (buf, _rows) in dec._raw_groups.items():
            if name in key:
                if _is_q8r(buf):  # the fused step's re-laid-out Q8_0 group: this matrix's rows of it
                    return _Q8RRows(buf, int(sum(_rows[:key.index(name)]))), t.type, rows, cols
                off = 0
                for nm in key:
                    nb = int(self.w.model.tensor(nm).nbytes)
                    if nm == name:
                        return buf[off:off + nb], t.type, rows, cols
                    off += nb
        self._no_upload_in_capture(name)
        return cp.asarray(np.ascontiguousarray(np.asarray(self.w.model.raw(t))).reshape(-1)), t.type, rows, cols

    def _held(self, name: str) -> bool:
        """Does the decoder hold matrix ``name`` on the device (its own buffer or a stacked group's), so that
        :meth:`_raw_dev` gives it without an upload?"""
        dec = self.dec
        got = dec._raw.get(name)
        return (got is not None and got[0] is not None) or any(name in key for key in dec._raw_groups)

    def _no_upload_in_capture(self, what: str) -> None:
        """Raise StrataError where the prefill's graph is being captured: a host upload (a transient matrix, a pointer
        table) would be recorded as a copy from host memory, so the capture fails here instead (and full chunks stay
        eager, :meth:`_graph_capture`)."""
        if self._in_graph:
            from stratatools.runtime.gpu.qmm import _capturing

            if _capturing(self.cp):
                raise StrataError(f"{what}: a host upload inside the prefill's graph capture")

    def _fn(self, exact: bool, kind: str, tid: int) -> Any:
        """Kernel ``kind<tid>`` of :func:`_module` (a type the model did not list gets a module of its own)."""
        tids = self._tids[exact] if tid in self._tids[exact] else (int(tid),)
        return batch_kernel(_module(exact, tids).get_function(f"{kind}<{int(tid)}>"), kind)

    def _dequant(self, raw: Any, t: Any, rows: int, cols: int) -> Any:
        """Device bytes of a matrix of type ``t`` as float32 [rows, cols], bit-identical to the numpy dequantizer
        (float types by a view or a cast; block types by ``pf_dequant_blobs`` without multiply-add fusion)."""
        cp = self.cp
        if isinstance(raw, _Q8RRows):
            from stratatools.runtime.gpu.kernels import q8r_f32

            return q8r_f32(cp, raw.m.q, raw.m.d, raw.row0, rows, cols)
        if t.name in ("F32", "F16", "BF16") or t.id not in UNIT:
            from stratatools.runtime.gpu.dequant import dequantize

            return dequantize(raw, t, rows * cols).reshape(rows, cols)
        if int(raw.size) != rows * t.row_bytes(cols) or cols % UNIT[t.id][0]:
            raise StrataError(f"{t.name} matrix of {rows} x {cols} values: {int(raw.size)} bytes are not whole rows")
        out = cp.empty((rows, cols), dtype=cp.float32)
        ng = rows * cols // 8
        self._no_upload_in_capture(f"{t.name} matrix of {rows} x {cols} values")
        ptr = cp.asarray(np.array([int(raw.data.ptr)], dtype=np.uint64))
        self._fn(True, "pf_dequant_blobs", t.id)((max(1, min(-(-ng // 256), 8192)), 1), (256,),
                                                 (ptr, np.int64(0), np.int64(ng), out))
        return out

    def _weight(self, name: str) -> Any:
        """Matrix ``name`` as float32 [rows, cols] (numpy order): on CuPy dequantized now (transient)."""
        if not self.gpu:
            W = self.w.get(name)
            return W.reshape(W.shape[0], -1) if W.ndim > 1 else W.reshape(1, -1)
        raw, t, rows, cols = self._raw_dev(name)
        return self._dequant(raw, t, rows, cols)

    def _mm(self, X: Any, name: str, act: int = 0, div: float = 1.0, planes: bool = False) -> Any:
        """X [T, in] @ W.T for the matrix ``name`` [out, in]: [T, out] float32 (on the ``mma`` GEMM path through
        :meth:`_qmm` where the matrix's layout allows, also on the ``hgemm`` path). ``act`` (``qmm.ACT_*``): the
        output through silu(y / div) or 2 sigmoid(y / div) (:meth:`_act`; on the ``mma`` path the product's own
        epilogue). ``planes``: where the integer dense ring makes the product, (out, its ``"i8d"`` split) instead."""
        self._push("dense")
        out = None
        if self.gpu and self.gemm in ("mma", "hgemm"):
            raw, t, rows, cols = self._raw_dev(name)
            out = self._qmm(X, raw, t, rows, cols, name, act=act, div=div, planes=planes)
        if out is None:
            W = self._weight(name)
            out = self._act(self._sgemm(X, W), act, div)
        self._pop()
        return out

    def _act(self, y: Any, act: int, div: float) -> Any:
        """``qmm.ACT_SILU``: silu(y / div); ``qmm.ACT_SIG2``: 2 sigmoid(y / div) (float32; on CuPy in place through
        :func:`stratatools.runtime.gpu.qmm.act_rows`, the kernel of the products' own epilogue); else y."""
        from stratatools.runtime.gpu import qmm

        if act == qmm.ACT_NONE:
            return y
        if self.gpu:
            return qmm.act_rows(self.cp.ascontiguousarray(y, dtype=self.cp.float32), act, div)
        a = y / np.float32(div)
        return _silu(np, a) if act == qmm.ACT_SILU else (2.0 * _sigmoid(np, a)).astype(np.float32)

    def _qmm(self, X: Any, raw: Any, t: Any, rows: int, cols: int, key: str | None = None, act: int = 0,
             div: float = 1.0, planes: bool = False) -> Any:
        """X [T, cols] @ W.T on the tensor cores (:func:`stratatools.runtime.gpu.qmm.dense`; on the ``hgemm`` path
        :func:`stratatools.runtime.gpu.qmm.hgemm`, through ``dense`` for a matrix whose values do not fit fp16) for a
        matrix's device bytes as :meth:`_raw_dev` gives them: the decoder's re-laid-out Q8_0 rows (:class:`_Q8RRows`)
        or GGUF Q8_0 / Q2_0 blocks. ``key``: the matrix's name (hgemm's fp16 check is made once per name; None: on
        every call). ``act`` / ``div``: as :meth:`_mm`'s. None where the layout has no qmm kernel (the caller
        dequantizes). ``planes``: on the integer dense ring (out, its ``"i8d"`` split: :func:`qmm.dense`'s)."""
        from stratatools.runtime.gpu import qmm

        cp = self.cp
        if X.ndim != 2 or int(X.shape[0]) == 0 or int(X.shape[1]) != cols:
            return None
        args = self._qmm_args(raw, t, rows, cols)
        if args is None:
            return None
        big = self.gemm == "hgemm" or self._big_hgemm(rows, cols, int(X.shape[0]))
        xs = self._split(X, "f16" if big else qmm.split_kind(args[0], int(X.shape[0]), cols, args[1], args[2]))
        X = cp.ascontiguousarray(X, dtype=cp.float32)
        if big:
            fits = self._hgemm_fits()
            if fits.get(key) is not False:
                out = qmm.hgemm(X, *args, xs=xs, check=key is None or key not in fits)
                if key is not None:
                    fits[key] = out is not None
                if out is not None:
                    return self._act(out, act, div)
        i8d = planes and isinstance(xs, qmm.DensePlanes)
        return qmm.dense(X, *args, xs=xs, act=act, act_div=div, planes=i8d)

    @staticmethod
    def _qmm_args(raw: Any, t: Any, rows: int, cols: int) -> tuple[Any, ...] | None:
        """:func:`stratatools.runtime.gpu.qmm.dense`'s (layout, codes, scales, rows, cols) for a matrix's device bytes
        as :meth:`_raw_dev` gives them, or None where the layout has no qmm kernel."""
        from stratatools.runtime.gpu import qmm

        if isinstance(raw, _Q8RRows):
            if not qmm.supports("Q8R", cols):
                return None
            a = raw.row0 * cols
            return ("Q8R", raw.m.q[a:a + rows * cols], raw.m.d[a // 32:(a + rows * cols) // 32], rows, cols)
        if t.name not in ("Q8_0", "Q2_0") or not qmm.supports(t.name, cols):
            return None
        if int(raw.nbytes) != rows * t.row_bytes(cols) or int(raw.data.ptr) % 2:
            return None
        return (t.name, raw, None, rows, cols)

    def _big_hgemm(self, rows: int, cols: int, T: int) -> bool:
        """On the ``mma`` path: does this [rows, cols] matrix times T rows go through the hgemm path's cuBLAS GEMMs
        (:func:`stratatools.runtime.gpu.qmm.big_matrix_values`: a large matrix, a long chunk; by default only in the
        prefill's graph, whose replay has no host cost for cuBLAS's extra launches; never in the batched step, nor on
        the shared expert's stream, whose cuBLAS calls could meet the main stream's)?"""
        from stratatools.runtime.gpu import qmm

        if self.gemm != "mma" or self._in_static or T < qmm.BIG_MIN_TOKENS:
            return False
        big = qmm.big_matrix_values(graph=self._in_graph)
        if not big or rows * cols < big:
            return False
        side = self._shared_side
        return side is None or int(self.cp.cuda.get_current_stream().ptr) != int(side.ptr)

    def _hgemm_fits(self) -> dict[str, bool]:
        """Matrix name -> do its values fit fp16 (the ``hgemm`` path's check, made once): kept on the decoder, so that
        its later prefillers and batched decoders do not check again (its matrices do not change)."""
        holder = getattr(self, "dec", None)
        holder = self if holder is None else holder
        fits = getattr(holder, "_hgemm_fits_by_name", None)
        if fits is None:
            fits = {}
            setattr(holder, "_hgemm_fits_by_name", fits)
        return fits

    def _rows(self, name: str, ids: np.ndarray) -> Any:
        """Rows ``ids`` of a table (token / PLE embedding), dequantized on the host in one call: [len(ids), ne0]
        float32 on xp (the step's per-row decoding, vectorised)."""
        return self.xp.asarray(self._rows_host(name, ids))

    def _rows_host(self, name: str, ids: np.ndarray) -> np.ndarray:
        """:meth:`_rows` as a numpy array (contiguous float32). Raises StrataError for a row id out of range."""
        from stratatools.runtime.weights import dequantize

        t = self.w.model.tensor(name)
        ne0 = int(t.ne[0])
        rb = t.type.row_bytes(ne0)
        n_rows = int(t.ne[1])
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= n_rows):
            raise StrataError(f"{self.w.model.path}: tensor {name}: row id out of range [0, {n_rows})")
        raw = np.asarray(self.w.model.raw(t)).reshape(n_rows, rb)
        got = raw[ids].reshape(-1)
        out = _to_host(dequantize(got, t.type, ids.size * ne0, xp=np)).reshape(ids.size, ne0)
        return np.ascontiguousarray(out, dtype=np.float32)

    # -- the chunk --------------------------------------------------------------------------------------
    def _chunk(self, toks: np.ndarray, last: bool) -> tuple[Any, np.ndarray, np.ndarray]:
        dec, cfg, xp = self.dec, self.cfg, self.xp
        T = int(toks.size)
        if self._graph_ok(T):
            return self._chunk_graph(toks, last)
        pos0 = dec.pos
        L, k = cfg.n_layer, self.k
        self._tic("embed")
        x0 = self._rows("token_embd.weight", toks)
        H = xp.concatenate([x0] * cfg.hc_count, axis=-1)  # [T, hc n]
        positions = np.arange(pos0, pos0 + T, dtype=np.int64)
        cos, sin = self.rt.rope.cos_sin(positions)
        ple_rows = self._ple_rows(toks) if cfg.ple_layers else {}
        ids_out = np.zeros((T, L, k), dtype=np.int32)
        w_out = np.zeros((T, L, k), dtype=np.float32)
        if self.gpu:
            cp = self.cp
            self._dev_route = (cp.empty((L, T, k), dtype=cp.int32), cp.empty((L, T, k), dtype=cp.float32))
            self._dev_layers = []
        try:
            H = self._layers(H, ple_rows, ids_out, w_out, pos0, cos, sin)
            if self._dev_layers:
                self._routing_back(self._dev_route, self._dev_layers, ids_out, w_out)
        finally:
            self._dev_route, self._dev_layers = None, []
        dec.pos = pos0 + T
        lg = self._head(H) if last else None
        self._tic("end")
        return lg, ids_out, w_out

    def _routing_back(self, route: tuple[Any, Any], lay: list[int], ids_out: np.ndarray, w_out: np.ndarray) -> None:
        """The routing the device kept for the layers ``lay`` (``route``: ids / weights [L, T, k]) into the host's
        ``ids_out`` / ``w_out`` [T, L, k]: one copy back a chunk."""
        ids_out[:, lay] = np.transpose(self.cp.asnumpy(route[0][lay]), (1, 0, 2))
        w_out[:, lay] = np.transpose(self.cp.asnumpy(route[1][lay]), (1, 0, 2))

    def _head(self, H: Any) -> Any:
        """The last row's logits [vocab] from the streams H [T, hc n]: the output hyper-connection, then the decoder's
        quantized matvec of the output head."""
        self._tic("head")
        out_in, _ = self._hc("output_hc", H[-1:], inject=False)
        return self.dec.mv("output.weight", self.xp.ascontiguousarray(out_in[0]))

    # -- the chunk's CUDA graph (GRAPH_ENV) -----------------------------------------------------------------
    def _graph_ok(self, T: int) -> bool:
        """Does this chunk of T tokens run through the prefill's CUDA graph (:data:`GRAPH_ENV`)? On CuPy, a chunk of
        the full ``chunk`` tokens ending at most at :data:`GRAPH_MAX_POS` (and ``max_ctx``), no timed breakdown, no
        earlier failed capture, and layers the graph can hold (:meth:`_graph_layers`)."""
        dec = self.dec
        if not self.gpu or self._batch_step or self.timing is not None or self._graph_error is not None:
            return False
        if T != self.chunk or dec.pos + T > self._graph_span() or not graph_enabled():
            return False
        if self._graph_layers_ok is None:
            self._graph_layers_ok = self._graph_layers(T)
        return self._graph_layers_ok

    def _graph_span(self) -> int:
        """Positions the prefill's graph serves: a chunk ends at most here (``max_ctx``, :data:`GRAPH_MAX_POS`)."""
        return min(self.dec.max_ctx, GRAPH_MAX_POS)

    def _graph_layers(self, T: int) -> bool:
        """The position-independent part of :meth:`_graph_ok`: a decoder without the QSA indexer caches (no
        selection on the host), every layer's routed experts on the tensor-core jobs with their table built on the
        device (the routing stays there), every attention layer within ``attn_batch.cu``'s limits for the positions
        the graph serves (:meth:`_attn_kernels_ok`) and, where QSA could select, within its full-selection range; the
        tensor-core dense path (a matrix the other paths dequantize would be uploaded inside the capture, which
        refuses it: :meth:`_no_upload_in_capture`)."""
        from stratatools.runtime.gpu import qmm

        dec, cfg = self.dec, self.cfg
        if getattr(dec, "long", False) or self.experts != "mma" or self.gemm not in ("mma", "hgemm"):
            return False
        P = self._graph_span()
        for il in range(cfg.n_layer):
            if not (self._mma_experts_ok(il)
                    and qmm.device_jobs_ok(T * self.k, self.rt.tier.arena.layers[il].n_expert)):
                return False
            if cfg.recurrent[il]:
                continue
            if not self._attn_kernels_ok(il, P):
                return False
            # (the eager chunk refuses a position past QSA's full-selection range on a decoder without its caches)
            if dec._qsa_layer(il) and not qsa_selects_all(self.rt.selection, cfg.compress_ratios[il], cfg.idx_budget,
                                                          P - 1):
                return False
        return True

    def _chunk_graph(self, toks: np.ndarray, last: bool) -> tuple[Any, np.ndarray, np.ndarray]:
        """:meth:`_chunk` through the prefill's CUDA graph: the chunk's token rows, PLE rows, rope tables and positions
        are staged into the buffers the graph reads; the first full chunk runs eagerly (its result) and is then
        captured (:meth:`_graph_capture`), later ones replay the graph. The routing comes back once, and the last
        chunk's output head runs after the graph."""
        dec, cfg, xp, cp = self.dec, self.cfg, self.xp, self.cp
        T, pos0 = int(toks.size), dec.pos
        L, k = cfg.n_layer, self.k
        positions = np.arange(pos0, pos0 + T, dtype=np.int64)
        x0 = self._rows("token_embd.weight", toks)
        cos, sin = self.rt.rope.cos_sin(positions)
        ple = {il: self._ple_emb(il, r, T) for il, r in (self._ple_rows(toks) if cfg.ple_layers else {}).items()}
        g = self._pgraph
        if g is None:
            g = self._pgraph = {
                "x0": xp.empty_like(x0), "cos": xp.empty_like(cos), "sin": xp.empty_like(sin),
                "pos": xp.zeros(T, dtype=xp.int32), "pl": xp.zeros(T, dtype=xp.int32),
                "ple": {il: xp.empty_like(e) for il, e in ple.items()},
                "ids": xp.empty((L, T, k), dtype=xp.int32), "w": xp.empty((L, T, k), dtype=xp.float32),
                "graph": None, "pool": None, "H": None, "layers": None}
        g["x0"][...] = x0
        g["cos"][...] = cos
        g["sin"][...] = sin
        g["pos"][...] = xp.asarray(positions.astype(np.int32))
        for il, e in ple.items():
            g["ple"][il][...] = e
        ids_out = np.zeros((T, L, k), dtype=np.int32)
        w_out = np.zeros((T, L, k), dtype=np.float32)
        st = dec.stats
        if g["graph"] is None:
            H, lay = self._graph_capture(g, ids_out, w_out)
        else:
            g["graph"].launch(stream=cp.cuda.get_current_stream())
            H, lay = g["H"], g["layers"]
            st["prefill_graph_replays"] = st.get("prefill_graph_replays", 0) + 1
        if lay:
            self._routing_back((g["ids"], g["w"]), lay, ids_out, w_out)
        dec.pos = pos0 + T
        return (self._head(H) if last else None), ids_out, w_out

    def _graph_capture(self, g: dict, ids_out: np.ndarray, w_out: np.ndarray) -> tuple[Any, list[int]]:
        """Run the graph body eagerly (this chunk's result; the device copies its first run makes stay in the
        default pool, which outlives the graph), then capture it into a graph whose temporaries come from a memory
        pool of its own (capturing runs nothing). A capture that fails leaves the eager result and keeps later full
        chunks eager (the reason in ``dec.stats["prefill_graph_error"]``). Returns (H, layers routed on the
        device)."""
        from stratatools.runtime.gpu.kernels import begin_capture

        cp, st = self.cp, self.dec.stats
        s = cp.cuda.get_current_stream()
        H, lay = self._graph_body(g, ids_out, w_out)
        s.synchronize()
        pool = cp.cuda.MemoryPool()
        try:
            with cp.cuda.using_allocator(pool.malloc):
                begin_capture(cp, s)
                try:
                    out = self._graph_body(g, np.zeros_like(ids_out), np.zeros_like(w_out))
                finally:
                    graph = s.end_capture()
        except Exception as e:  # noqa: BLE001 - any capture failure: stay eager, say why in the stats
            self._graph_error = st["prefill_graph_error"] = f"{type(e).__name__}: {e}"[:300]
            return H, lay
        g.update(graph=graph, pool=pool, H=out[0], layers=out[1])
        st["prefill_graph_captures"] = st.get("prefill_graph_captures", 0) + 1
        return H, lay

    def _graph_body(self, g: dict, ids_out: np.ndarray, w_out: np.ndarray) -> tuple[Any, list[int]]:
        """The chunk from the graph's buffers (what the graph holds): the trunk over the staged token rows with the
        positions on the device (:meth:`_attention_graph`), the routing into the graph's routing buffers. Returns
        (H [T, hc n], the layers whose routing stayed on the device; the others' went into ``ids_out`` /
        ``w_out``)."""
        xp, cfg = self.xp, self.cfg
        self._in_graph = True
        self._dev_route, self._dev_layers = (g["ids"], g["w"]), []
        try:
            H = xp.concatenate([g["x0"]] * cfg.hc_count, axis=-1)
            H = self._layers(H, {il: None for il in cfg.ple_layers}, ids_out, w_out, None, g["cos"], g["sin"])
            return H, list(self._dev_layers)
        finally:
            self._in_graph = False
            self._dev_route, self._dev_layers = None, []

    def _layers(self, H: Any, ple_rows: dict, ids_out: np.ndarray, w_out: np.ndarray, pos: Any, cos: Any,
                sin: Any) -> Any:
        """The trunk over the streams H [T, hc n]: per layer the PLE block, the token mixer (:meth:`_gdn` or
        :meth:`_attention`, given ``pos``) and :meth:`_moe`, each between the hyper-connections; returns H. The
        routing [T, L, k] goes into ``ids_out`` / ``w_out`` where :meth:`_moe` returns it on the host (not None).
        The batched decoder runs the same trunk with its per-place versions of those methods."""
        cfg = self.cfg
        T = int(H.shape[0])
        pend = None  # a block's output and inject weights not yet added into H (the next norm's launch adds them)
        for il in range(cfg.n_layer):
            if il in cfg.ple_layers:
                H = self._inject_pending(H, pend)
                pend = None
                self._tic("ple")
                H = H + self._ple(il, H, ple_rows[il])
            self._tic("hc")
            mixer = f"blk.{il}." + ("attn_qkv" if cfg.recurrent[il] else "attn_q") + ".weight"  # (its first matrix)
            H, mixed, inject = self._hc_in(f"blk.{il}.hc_attn", H, pend, self._ring_split(mixer, T))
            with self._shared_split(mixed):  # the mixer's projections read one split of its input
                if cfg.recurrent[il]:
                    self._tic("gdn")
                    y = self._gdn(il, mixed)
                else:
                    self._tic("attention")
                    y = self._attention(il, mixed, pos, cos, sin)
            self._tic("hc")
            H, mixed, inject = self._hc_in(f"blk.{il}.hc_ffn", H, (y, inject), self._jobs_split_kind(il))
            self._tic("moe")
            with self._shared_split(mixed):  # router, routed and shared experts: one split
                y, i, w = self._moe(il, mixed)
            if i is not None:
                ids_out[:, il] = i
                w_out[:, il] = w
            self._tic("hc")
            pend = (y, inject)
        return self._inject_pending(H, pend)

    def _mm_joined(self, X: Any, names: list[str], allow: bool = True) -> list[Any]:
        """X [T, in] @ W.T for each matrix of ``names``: a list of [T, out] float32. With ``allow``, where the decoder
        stacks a first run of them (two or more, in this order) in one Q8R buffer (its fast path's group) and T rows
        take the integer dense ring (:data:`JOINED_ENV`), that run is one product and its results are column views of
        its output (rows of the views lie apart: for the kernels that take a row stride); the others :meth:`_mm`."""
        from stratatools.runtime.gpu import qmm

        out: list[Any] = []
        if allow and X.ndim == 2:
            for k in range(len(names), 1, -1):  # (the longest first run the decoder stacks)
                got = self._joined(tuple(names[:k]), int(X.shape[0]), int(X.shape[1]))
                if got is None:
                    continue
                args, rows = got
                self._push("dense")
                Y = qmm.dense(self.cp.ascontiguousarray(X, dtype=self.cp.float32), *args, xs=self._split(X, "i8d"))
                self._pop()
                o = 0
                for r in rows:
                    out.append(Y[:, o:o + r])
                    o += r
                break
        return out + [self._mm(X, n) for n in names[len(out):]]

    def _joined(self, names: tuple[str, ...], T: int, cols: int) -> tuple[tuple[Any, ...], list[int]] | None:
        """Where the decoder stacks the matrices ``names`` (in this order) in one Q8R buffer and T rows of ``cols``
        values take the integer dense ring (:data:`JOINED_ENV`, the ``mma`` path): (:func:`qmm.dense`'s arguments for
        the stacked rows, each matrix's rows); else None."""
        from stratatools.runtime.gpu import qmm

        if not (self.gpu and self.gemm == "mma" and joined_enabled() and T <= 8 * qmm.TILES[1]):
            return None  # (hgemm: every product on its fp16 path, none joined on the ring)
        got = self.dec._raw_groups.get(names)
        if got is None or not _is_q8r(got[0]):
            return None
        rows = [int(r) for r in got[1]]
        args = self._qmm_args(_Q8RRows(got[0], 0), None, sum(rows), cols)
        if args is None or qmm.split_kind(args[0], T, cols, args[1], args[2]) != "i8d":
            return None
        return args, rows

    @staticmethod
    def _rows_ok(x: Any) -> bool:
        """Are x's rows float32 values one after another (:func:`row_stride` takes it)?"""
        try:
            row_stride(x)
        except StrataError:
            return False
        return True

    def _inject_pending(self, H: Any, pend: tuple[Any, Any] | None) -> Any:
        """H with a pending block output added (``pend`` = (y, inject weights): :meth:`_inject`), or H."""
        return H if pend is None else self._inject(H, *pend)

    def _hc_in(self, prefix: str, H: Any, pend: tuple[Any, Any] | None,
               kind: str | None = None) -> tuple[Any, Any, Any]:
        """(H, mixed, inject weights): H with the pending block output ``pend`` added (:meth:`_inject_pending`), then
        :meth:`_hc` of it. On CuPy one launch adds, norms and splits (:meth:`_hc_gpu_in`), and ``kind`` (``"i8"``,
        ``"i8d"``; None: none) names the split of mixed that the launch of the mix makes beside it, for the block
        after it (:meth:`_shared_split` finds it)."""
        if self.gpu:
            return self._hc_gpu_in(prefix, H, True, pend, kind)
        H = self._inject_pending(H, pend)
        mixed, inject = self._hc(prefix, H)
        return H, mixed, inject

    def _ring_split(self, name: str, T: int) -> str | None:
        """``"i8d"`` where :meth:`_qmm` makes the product of the matrix ``name`` over T rows on the integer dense ring
        (it then reads that split of X: the launches that make X can make it beside), else None (another path, a
        layout without the ring, or a matrix the decoder does not hold: nothing is uploaded to find out)."""
        from stratatools.runtime.gpu import qmm

        if not self.gpu or self.gemm != "mma" or T > 8 * qmm.TILES[1] or not self._held(name):
            return None
        raw, t, rows, cols = self._raw_dev(name)
        args = self._qmm_args(raw, t, rows, cols)
        if args is None or self._big_hgemm(rows, cols, T):
            return None
        return "i8d" if qmm.split_kind(args[0], T, cols, args[1], args[2]) == "i8d" else None

    def _jobs_split_kind(self, il: int) -> str | None:
        """``"i8"`` where layer ``il``'s routed experts run as the integer tensor-core jobs (:meth:`_mma_jobs`: their
        rows read :func:`stratatools.runtime.gpu.qmm.split_i8` of the MoE's input), else None."""
        from stratatools.runtime.gpu import qmm

        if not self.gpu or self.experts != "mma" or not self._mma_experts_ok(il):
            return None
        ly = self.rt.tier.arena.layers[il]
        return "i8" if qmm.jobs_i8(ly.gu_type.id, ly.d_type.id) else None

    def _ew(self, name: str, params: str, out: str, body: str) -> Any:
        """A cached CuPy element-wise kernel."""
        k = self._kernels.get(name) if hasattr(self, "_kernels") else None
        if k is None:
            self._kernels = getattr(self, "_kernels", {})
            k = self._kernels[name] = self.cp.ElementwiseKernel(params, out, body, name)
        return k

    def _sigmoid_x(self, x: Any) -> Any:
        """sigmoid(x) in float32 (the array code's ``_sigmoid``); on CuPy one element-wise launch with the same
        operations and roundings (the array code's negation, exp, sum and quotient are four launches)."""
        if not self.gpu:
            return _sigmoid(self.xp, x)
        return self._ew("pf_sigmoid", "float32 x", "float32 y", "y = 1.0f / (1.0f + expf(-x));")(x)

    def _silu_x(self, x: Any, u: Any = None) -> Any:
        """silu(x) in float32 (``_silu``), times ``u`` when given (``silu(x) * u``, the product rounded after the
        silu's); on CuPy one element-wise launch with the array code's operations and roundings."""
        if not self.gpu:
            y = _silu(self.xp, x)
            return y if u is None else y * u
        if u is None:
            return self._ew("pf_silu", "float32 x", "float32 y", "y = x * (1.0f / (1.0f + expf(-x)));")(x)
        return self._ew("pf_silu_mul", "float32 x, float32 u", "float32 y",
                        "y = (x * (1.0f / (1.0f + expf(-x)))) * u;")(x, u)

    def _inject(self, H: Any, y: Any, iw: Any) -> Any:
        """H + y [T, n] injected into every stream with the weights iw [T, hc] (in place on CuPy)."""
        xp, cfg = self.xp, self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        T = H.shape[0]
        if not self.gpu:
            return H + (y[:, None, :] * iw[:, :, None]).reshape(T, -1)
        k = self._ew("pf_inject", "raw float32 y, raw float32 iw, int32 hc, int32 n", "float32 H",
                     "long long t = i / ((long long)hc * n); int r = (int)(i - t * hc * n); int h = r / n;"
                     " H = H + y[t * n + (r - h * n)] * iw[t * hc + h];")
        k(self.cp.ascontiguousarray(y, dtype=xp.float32), self.cp.ascontiguousarray(iw, dtype=xp.float32),
          np.int32(hc), np.int32(n), H)
        return H

    def _hc(self, prefix: str, H: Any, inject: bool = True) -> tuple[Any, Any]:
        xp, cfg = self.xp, self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        T = H.shape[0]
        if self.gpu:
            return self._hc_gpu(prefix, H, inject)
        hn = _rmsnorm(xp, H, self._f32(f"{prefix}_norm.weight"), cfg.eps, group=n)
        m = _silu(xp, self._mm(hn, f"{prefix}_down.weight") / xp.float32(hc))
        m = _sigmoid(xp, self._mm(m, f"{prefix}_up.weight"))
        mixed = xp.sum(m.reshape(T, hc, n) * hn.reshape(T, hc, n), axis=1) / xp.float32(hc)
        if not inject:
            return mixed.astype(xp.float32, copy=False), None
        iw = 2.0 * _sigmoid(xp, self._mm(hn, f"{prefix}_inject.weight") / xp.float32(hc))
        return mixed.astype(xp.float32, copy=False), iw.astype(xp.float32)

    def _hc_gpu(self, prefix: str, H: Any, inject: bool = True) -> tuple[Any, Any]:
        """:meth:`_hc` on CuPy (:meth:`_hc_gpu_in` without a pending inject)."""
        return self._hc_gpu_in(prefix, H, inject)[1:]

    def _hc_gpu_in(self, prefix: str, H: Any, inject: bool = True, pend: tuple[Any, Any] | None = None,
                   kind: str | None = None) -> tuple[Any, Any, Any]:
        """:meth:`_hc_in` on CuPy: (H, mixed, inject weights or None). Rows of a multiple of 64 values: the pending
        inject, the norm over the T hc streams and, where the down projection reads the integer dense ring, the
        split of the normed streams in one launch (``qmm.hc_norm_split``); else the inject, then the decoder's
        ``rmsnorm_rows``. The mix: :meth:`_hc_gpu_mix` (its split of ``kind``)."""
        from stratatools.runtime.gpu import qmm

        cp, cfg = self.cp, self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        T = int(H.shape[0])
        w = self._f32(f"{prefix}_norm.weight")
        fused = n % 64 == 0 and hc_fused()
        if not (fused and H.dtype == cp.float32 and H.flags.c_contiguous):
            H = cp.ascontiguousarray(self._inject_pending(H, pend), dtype=cp.float32)
            hn = cp.empty_like(H)
            self.dec.k_rms((T * hc,), (256,), (H, w, hn, np.int32(n), np.int32(w.size), np.float32(cfg.eps)))
        else:
            y, iw = pend if pend is not None else (None, None)
            split = self._ring_split(f"{prefix}_down.weight", T)
            hn, planes = qmm.hc_norm_split(H, w, cfg.eps, hc, n, y, iw, split)
            if planes is not None:
                self._pre = (hn, {split: planes})
        with self._shared_split(hn):  # down and inject read the same normed streams
            return (H, *self._hc_gpu_mix(prefix, hn, T, inject, kind, fused))

    def _hc_gpu_mix(self, prefix: str, hn: Any, T: int, inject: bool, kind: str | None,
                    fused: bool) -> tuple[Any, Any]:
        """The mix of :meth:`_hc_gpu_in` over its normed streams hn: with ``fused`` (:data:`HC_FUSED_ENV`, rows of a
        multiple of 64) the launches that make each split beside their outputs (``kind``: the mix's), else one
        element-wise mix."""
        from stratatools.runtime.gpu import qmm

        cp, cfg = self.cp, self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        # silu(down hn / hc), and the split of it that the up projection reads from the launch of its sums
        joined = self._hc_joined(prefix, hn, T) if fused and inject else None
        if joined is not None:  # down and inject as one product: m, its split and the inject weights
            m, mp, _ = joined
        else:
            m = self._mm(hn, f"{prefix}_down.weight", act=qmm.ACT_SILU, div=hc,
                         planes=fused and self._ring_split(f"{prefix}_up.weight", T) is not None)
            m, mp = m if isinstance(m, tuple) else (m, None)
        if mp is not None:
            self._pre = (m, {"i8d": mp})
        with self._shared_split(m):
            u = cp.ascontiguousarray(self._mm(m, f"{prefix}_up.weight"))
        if fused:  # the mix and the split of it that the next block reads first: one launch
            mixed, planes = qmm.hc_mix(u, hn, hc, n, kind)
            if planes is not None:
                self._pre = (mixed, {kind: planes})
        else:
            mixed = cp.empty((T, n), dtype=cp.float32)
            self._ew("pf_hc_mix", "raw float32 u, raw float32 hn, int32 hc, int32 n", "float32 out",
                     "long long t = i / n; int c = (int)(i - t * n); float s = 0.0f;"
                     " for (int h = 0; h < hc; ++h) { long long o = (t * hc + h) * n + c;"
                     " s += (1.0f / (1.0f + expf(-u[o]))) * hn[o]; } out = s / (float)hc;")(u, hn, np.int32(hc),
                                                                                           np.int32(n), mixed)
        if not inject:
            return mixed, None
        if joined is not None:
            return mixed, joined[2]
        return mixed, self._mm(hn, f"{prefix}_inject.weight", act=qmm.ACT_SIG2, div=hc)  # 2 sigmoid(inject hn / hc)

    def _hc_joined(self, prefix: str, hn: Any, T: int) -> tuple[Any, Any, Any] | None:
        """The hyper-connection ``prefix``'s down and inject projections of the normed streams hn [T, hc n] as one
        product where the decoder stacks the two matrices in one Q8R buffer and T rows take the integer dense ring
        (:data:`JOINED_ENV`): (silu(down hn / hc) [T, rows], its ``"i8d"`` split, 2 sigmoid(inject hn / hc) [T, hc])
        from one product and one launch of its sums (``qmm.dense(hc_rd=)``); else None."""
        from stratatools.runtime.gpu import qmm

        got = self._joined((f"{prefix}_down.weight", f"{prefix}_inject.weight"), T, int(hn.shape[1]))
        if got is None or got[1][0] % 64:
            return None
        args, rows = got
        self._push("dense")
        res = qmm.dense(hn, *args, xs=self._split(hn, "i8d"), act_div=float(self.cfg.hc_count), hc_rd=rows[0])
        self._pop()
        return res

    # -- PLE ----------------------------------------------------------------------------------------------
    def _ple_rows(self, toks: np.ndarray) -> dict[int, np.ndarray]:
        """PLE table row ids [T, heads] per PLE layer, with the step's context handling (the context advances after
        every PLE layer of every token); updates the decoder's context."""
        dec, cfg, rt = self.dec, self.cfg, self.rt
        keep = cfg.ple_ngram - 1
        ctx = dec.ple_ctx
        layers = list(cfg.ple_layers)
        if len(layers) == 1:  # one PLE layer: T single-token calls = one call over the T tokens
            rows = {layers[0]: rt.ple_ngram_ids(toks, ctx)}
            if keep > 0:
                ctx = np.concatenate([ctx, toks])[-keep:]
        else:
            per: dict[int, list[np.ndarray]] = {il: [] for il in layers}
            for t in toks.tolist():
                one = np.array([t], dtype=np.int64)
                for il in layers:
                    per[il].append(rt.ple_ngram_ids(one, ctx))
                    if keep > 0:
                        ctx = np.concatenate([ctx, one])[-keep:]
            rows = {il: np.concatenate(v, axis=0) for il, v in per.items()}
        dec.ple_ctx = ctx
        return rows

    def _ple_emb(self, il: int, rows: np.ndarray, T: int) -> Any:
        """The PLE table rows ``rows`` [T, heads] of layer ``il`` as [T, heads ne0] float32 on xp (the batched
        decoder's graph step reads them from a buffer filled before its replay instead, and so does the prefill's graph
        body)."""
        if self._in_graph:
            return self._pgraph["ple"][il]
        return self._rows("per_layer_token_embd.weight", rows.reshape(-1)).reshape(T, -1)

    def _ple(self, il: int, H: Any, rows: np.ndarray) -> Any:
        xp, cfg = self.xp, self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        T = H.shape[0]
        emb = self._ple_emb(il, rows, T)
        p = f"blk.{il}.ple_"
        key = _rmsnorm(xp, self._mm(emb, p + "key.weight"), self._f32(p + "norm_key.weight"), cfg.eps, group=n)
        value = self._mm(emb, p + "value.weight")
        q = _rmsnorm(xp, H, self._f32(p + "norm_query.weight"), cfg.eps, group=n)
        gate = xp.sum(key.reshape(T, hc, n) * q.reshape(T, hc, n), axis=-1, keepdims=True) / xp.float32(math.sqrt(n))
        gate = xp.sqrt(xp.maximum(xp.abs(gate), xp.float32(1e-6))) * xp.sign(gate)
        gv = (self._sigmoid_x(gate) * value[:, None, :]).reshape(T, hc * n)
        gvn = _rmsnorm(xp, gv, self._f32(p + "norm_conv.weight"), cfg.eps, group=n)
        out = self._causal_conv("ple", il, gvn, self._f32(p + "conv1d.weight"), cfg.ple_ngram)
        return gv + self._silu_x(out)

    # -- the causal convolutions' states (a subclass with several sequences overrides the two accessors) ---------
    def _conv_state(self, which: str, il: int) -> Any:
        """Layer ``il``'s causal-conv state, ``which`` ``gdn`` (K-1 previous inputs) or ``ple`` ((K-1) d), as
        [sequences, history, C]: here the decoder's one sequence (a view of its buffer)."""
        return (self.dec.conv if which == "gdn" else self.dec.ple_conv)[il][None]

    def _set_conv_state(self, which: str, il: int, st: Any) -> None:
        """Store :meth:`_conv_state`'s next value ``st`` [sequences, history, C] (none where ``st`` is the buffer)."""
        buf = (self.dec.conv if which == "gdn" else self.dec.ple_conv)[il]
        if not _same_memory(buf[None], st):
            buf[...] = st[0]

    def _causal_conv(self, which: str, il: int, xnew: Any, wc: Any, dil: int = 1) -> Any:
        """Depthwise causal conv of ``xnew`` [R, C] (the R / S rows of each of the S sequences of
        :meth:`_conv_state`, in order) over [state; rows] with kernel ``wc`` [C, K] and dilation ``dil``:
        out[s, u] = sum_k xin[s, u + k dil] wc[:, k]; the state moves on by the rows. Returns [R, C]."""
        xp = self.xp
        st = self._conv_state(which, il)
        S, span, C = int(st.shape[0]), int(st.shape[1]), int(xnew.shape[1])
        L = int(xnew.shape[0]) // S
        xin = xp.concatenate([st, xnew.reshape(S, L, C)], axis=1)  # [S, span + L, C]
        if span:
            self._set_conv_state(which, il, xin[:, -span:])
        out = xp.zeros((S, L, C), dtype=xp.float32)
        for kk in range(int(wc.shape[1])):
            out = out + xin[:, kk * dil:kk * dil + L] * wc[:, kk][None, None, :]
        return out.reshape(S * L, C)

    def _gdn_core(self, il: int, q: Any, kn: Any, v: Any, beta: Any, decay: Any, T: int) -> Any:
        """The delta-rule recurrence of the GDN layer ``il`` over the rows (:meth:`_gdn_recur`, timed apart)."""
        self._push("gdn_recur")
        out = self._gdn_recur(il, q, kn, v, 0, beta, decay, T)
        self._pop()
        return out

    # -- gated DeltaNet -----------------------------------------------------------------------------------
    def _gdn(self, il: int, x: Any) -> Any:
        xp, cfg = self.xp, self.cfg
        T = x.shape[0]
        nk, dk, nv = cfg.ssm_n_group, cfg.ssm_d_state, cfg.ssm_dt_rank
        dv = cfg.ssm_head_v_dim
        p = f"blk.{il}."
        prep = self.gpu and gdn_prep_enabled()
        # [T, C], [T, nv dv], [T, nv] twice: on the GDN kernels' path one product where the decoder stacks the four
        # matrices (columns of its output: the kernels take rows apart)
        qkv, z, b, a = self._mm_joined(x, [p + n + ".weight" for n in ("attn_qkv", "attn_gate", "ssm_beta",
                                                                        "ssm_alpha")], prep)
        wc = self._f32(p + "ssm_conv1d.weight")  # [C, K]
        C, K = wc.shape
        if prep:  # gdn_prep.cu: the same formulas in two launches
            cp = self.cp
            c32 = functools.partial(cp.ascontiguousarray, dtype=cp.float32)
            state = c32(self._conv_state("gdn", il))
            b, a = (b, a) if self._rows_ok(b) and self._rows_ok(a) and b.strides == a.strides else (c32(b), c32(a))
            qn, kn, v, beta, decay, st = gdn_prep_launch(
                cp, qkv if self._rows_ok(qkv) else c32(qkv), state, wc, b, a, self._f32(p + "ssm_a").reshape(-1),
                self._f32(p + "ssm_dt.bias").reshape(-1), int(state.shape[0]), nk, dk, nv, dv, in_place=True)
            if K > 1:
                self._set_conv_state("gdn", il, st)  # (nothing to copy where the launch updated the buffer itself)
            out = self._gdn_core(il, qn, kn, v, beta, decay, T)
            y = gdn_out_launch(cp, out, z if self._rows_ok(z) else c32(z), self._f32(p + "ssm_norm.weight").reshape(-1),
                               cfg.eps, cfg.output_gate == "sigmoid", nv, dv)
            return self._mm(y, p + "ssm_out.weight")
        z = z.reshape(T, nv, dv)
        conv = _silu(xp, self._causal_conv("gdn", il, qkv, wc))
        q = _l2norm(xp, conv[:, :nk * dk].reshape(T, nk, dk)) * xp.float32(dk ** -0.5)
        kn = _l2norm(xp, conv[:, nk * dk:2 * nk * dk].reshape(T, nk, dk))
        beta = _sigmoid(xp, b)
        decay = xp.exp(self._f32(p + "ssm_a")[None, :] * _softplus(xp, a + self._f32(p + "ssm_dt.bias")[None, :]))
        decay = decay.astype(xp.float32)
        v = xp.ascontiguousarray(conv[:, 2 * nk * dk:], dtype=xp.float32)  # [T, nv dv]
        out = self._gdn_core(il, q, kn, v, beta, decay, T)
        o = _rmsnorm(xp, out.reshape(T, nv, dv), self._f32(p + "ssm_norm.weight"), cfg.eps)
        act = _sigmoid(xp, z) if cfg.output_gate == "sigmoid" else _silu(xp, z)
        return self._mm((o * act).reshape(T, nv * dv), p + "ssm_out.weight")

    def _gdn_recur(self, il: int, q: Any, kn: Any, conv: Any, voff: int, beta: Any, decay: Any, T: int) -> Any:
        """The delta-rule recurrence over the chunk (state ``dec.ssm[il]`` updated in place): out [T, nv dv]."""
        cfg = self.cfg
        nk, dk, nv, dv = cfg.ssm_n_group, cfg.ssm_d_state, cfg.ssm_dt_rank, cfg.ssm_head_v_dim
        S = self.dec.ssm[il]
        if self.gpu:
            cp = self.cp
            v = cp.ascontiguousarray(conv)
            out = cp.empty((T, nv * dv), dtype=cp.float32)
            if dk <= GDN_WARP_MAX_DK and gdn_kernel() == "warp":
                self.k_gdn_warp((nv, -(-dv // (GDN_WARP_COLUMNS * GDN_WARP_WARPS))), (32 * GDN_WARP_WARPS,),
                                (cp.ascontiguousarray(q), cp.ascontiguousarray(kn), np.uint64(int(v.data.ptr) + 4 * voff),
                                 np.int32(v.shape[1]), cp.ascontiguousarray(beta), cp.ascontiguousarray(decay), S, out,
                                 np.int32(T), np.int32(nk), np.int32(nv), np.int32(dk), np.int32(dv)))
                return out
            ncb = max(1, min(dv, -(-128 // max(nv, 1))))  # about one block per SM in all
            cw = -(-dv // ncb)
            threads = 256 if cw >= 32 else 128
            rs = max(1, threads // cw)
            shm = gdn_chunk_shared(dk, cw, rs)
            if shm > 96 * 1024:
                raise StrataError(f"layer {il}: GDN heads of {dk} x {dv} exceed the prefill kernel's shared memory")
            if shm > 48 * 1024 and getattr(self.k_gdn, "max_dynamic_shared_size_bytes", 0) < shm:
                self.k_gdn.max_dynamic_shared_size_bytes = shm
            self.k_gdn((nv, ncb), (threads,), (cp.ascontiguousarray(q), cp.ascontiguousarray(kn),
                                               np.uint64(int(v.data.ptr) + 4 * voff), np.int32(v.shape[1]), cp.ascontiguousarray(beta),
                                               cp.ascontiguousarray(decay), S, out, np.int32(T), np.int32(nk),
                                               np.int32(nv), np.int32(dk), np.int32(dv)), shared_mem=shm)
            return out
        rep = nv // nk
        qt = np.tile(q, (1, rep, 1)) if rep > 1 else q
        kt = np.tile(kn, (1, rep, 1)) if rep > 1 else kn
        v = conv[:, voff:].reshape(T, nv, dv)
        out = np.empty((T, nv, dv), dtype=np.float32)
        St = S.copy()
        for t in range(T):
            St = St * decay[t][:, None, None]
            kv = np.sum(kt[t][:, :, None] * St, axis=1)
            delta = (v[t] - kv) * beta[t][:, None]
            St = St + kt[t][:, :, None] * delta[:, None, :]
            out[t] = np.sum(qt[t][:, :, None] * St, axis=1)
        S[...] = St
        return out.reshape(T, nv * dv)

    # -- attention ----------------------------------------------------------------------------------------
    def _attn_qkv(self, il: int, x: Any, cos: Any, sin: Any) -> tuple[Any, Any, Any, Any]:
        """Attention layer ``il``'s projections of the rows ``x`` [T, n]: queries [T, heads, hd] and keys [T, kv
        heads, hd] RMS-normed and roped, values [T, kv heads, hd], and the output gate's input [T, heads hd]."""
        xp, cfg = self.xp, self.cfg
        T = x.shape[0]
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        p = f"blk.{il}."
        qg = self._mm(x, p + "attn_q.weight").reshape(T, nh, 2 * hd)
        q = qg[..., :hd]
        gate = qg[..., hd:].reshape(T, nh * hd)
        q = _rmsnorm(xp, q, self._f32(p + "attn_q_norm.weight"), cfg.eps)
        kk = _rmsnorm(xp, self._mm(x, p + "attn_k.weight").reshape(T, nkv, hd), self._f32(p + "attn_k_norm.weight"),
                      cfg.eps)
        v = self._mm(x, p + "attn_v.weight").reshape(T, nkv, hd)
        return self.rt.rope.apply(q, cos, sin), self.rt.rope.apply(kk, cos, sin), v, gate

    def _attention(self, il: int, x: Any, pos0: int, cos: Any, sin: Any) -> Any:
        if self._in_graph:
            return self._attention_graph(il, x, cos, sin)
        xp, cfg, dec = self.xp, self.cfg, self.dec
        T = x.shape[0]
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        p = f"blk.{il}."
        q, kk, v, gate = self._attn_qkv(il, x, cos, sin)
        P = pos0 + T
        dec.kc[il][pos0:P] = kk
        dec.vc[il][pos0:P] = v
        allowed = self._allowed(il, x, pos0, T, cos, sin)  # host bool [T, P] or None (causal only)
        grp = nh // nkv
        scale = xp.float32(hd ** -0.5)
        Kc = xp.transpose(dec.kc[il][:P], (1, 2, 0))  # [nkv, hd, P]
        Vc = xp.transpose(dec.vc[il][:P], (1, 0, 2))  # [nkv, P, hd]
        qh = xp.transpose(q.reshape(T, nkv, grp, hd), (1, 2, 0, 3))  # [nkv, grp, T, hd]
        o = xp.empty((nkv, grp, T, hd), dtype=xp.float32)
        tq = max(1, min(T, ATTN_SCORE_BYTES // 4 // max(1, nh * P * 4)))
        cols = np.arange(P)
        for a in range(0, T, tq):
            b = min(T, a + tq)
            sc = xp.matmul(qh[:, :, a:b], Kc[:, None]) * scale  # [nkv, grp, b-a, P]
            mask = cols[None, :] <= (pos0 + np.arange(a, b))[:, None]
            if allowed is not None:
                mask &= allowed[a:b]
            sc = xp.where(xp.asarray(mask)[None, None], sc, xp.float32(-np.inf))
            att = _softmax(xp, sc, axis=-1)
            o[:, :, a:b] = xp.matmul(att, Vc[:, None])
        o = xp.transpose(o, (2, 0, 1, 3)).reshape(T, nh * hd)
        o = o * self._sigmoid_x(gate)
        return self._mm(xp.ascontiguousarray(o, dtype=xp.float32), p + "attn_output.weight")

    def _attention_graph(self, il: int, x: Any, cos: Any, sin: Any) -> Any:
        """:meth:`_attention` in the prefill's graph body: ``attn_batch.cu``'s kernels (:meth:`_attn_kernels`) over
        the decoder's caches as those of one place, each row at its position in the graph's position buffer (so the
        graph serves chunks at any position; the decoder has no QSA indexer caches, :meth:`_graph_layers`)."""
        g, dec = self._pgraph, self.dec
        return self._attn_kernels(il, x, cos, sin, dec.kc[il][None], dec.vc[il][None], g["pl"], g["pos"],
                                  self._graph_span(), attn_module())

    def _attn_kernels_ok(self, il: int, P: int) -> bool:
        """Can ``attn_batch.cu`` run attention layer ``il`` for queries up to P positions long: norm weights per head
        or per tensor, heads of at most 1,024 values, the scores of P positions within :data:`ATTN_B_MAX_SHARED`?"""
        cfg = self.cfg
        hd, p = cfg.head_dim, f"blk.{il}."
        return bool(hd <= 1024 and cfg.n_rot <= hd and 4 * int(P) <= ATTN_B_MAX_SHARED
                    and self._f32(p + "attn_q_norm.weight").size in (hd, cfg.n_head * hd)
                    and self._f32(p + "attn_k_norm.weight").size in (hd, cfg.n_head_kv * hd))

    def _attn_kernels(self, il: int, x: Any, cos: Any, sin: Any, kc: Any, vc: Any, pl_d: Any, pos_d: Any, P: int,
                      mod: Any, between: Any = None) -> Any:
        """Attention layer ``il`` of the rows x [T, n] on ``attn_batch.cu`` (``mod``; the caller checked
        :meth:`_attn_kernels_ok` for P): the q / k / v projections, ``attn_prep_b`` (q and k RMS norms, rope with the
        rows' cos / sin [T, n_rot], row r's key and value into the caches kc / vc [places, max_ctx, nkv, hd] at place
        ``pl_d[r]``, position ``pos_d[r]``: int32 device arrays [T]), then ``between()`` when given, ``attn_decode_b``
        (each query over its place's positions 0 .. ``pos_d[r]``, scores for P > every ``pos_d[r]`` positions in
        shared memory, the output gate) and the output projection. Returns [T, n] float32."""
        cp, cfg = self.cp, self.cfg
        T = int(x.shape[0])
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        p = f"blk.{il}."
        wq, wk = self._f32(p + "attn_q_norm.weight"), self._f32(p + "attn_k_norm.weight")
        c32 = functools.partial(cp.ascontiguousarray, dtype=cp.float32)
        qraw = c32(self._mm(x, p + "attn_q.weight"))  # [T, nh 2 hd]
        kraw = c32(self._mm(x, p + "attn_k.weight"))  # [T, nkv hd]
        vraw = c32(self._mm(x, p + "attn_v.weight"))
        mc = int(kc.shape[1])
        q = cp.empty((T, nh, hd), dtype=cp.float32)
        threads = min(1024, (hd + 31) // 32 * 32)
        batch_kernel(mod.get_function("attn_prep_b"), "attn_prep_b")((nh + nkv, T), (threads,), (
            qraw, kraw, vraw, wq, np.int32(wq.size), wk, np.int32(wk.size), c32(cos), c32(sin), np.int32(cfg.n_rot),
            np.int32(nh), np.int32(nkv), np.int32(hd), np.float32(cfg.eps), pl_d, pos_d, np.int32(mc), q, kc, vc),
            shared_mem=hd * 4)
        if between is not None:
            between()
        o = cp.empty((T, nh * hd), dtype=cp.float32)
        k = batch_kernel(mod.get_function("attn_decode_b"), "attn_decode_b")
        if 4 * P > 48 * 1024 and getattr(k, "max_dynamic_shared_size_bytes", 0) < 4 * P:
            k.max_dynamic_shared_size_bytes = 4 * P
        k((nh, T), (128,), (q, kc, vc, pl_d, pos_d, np.int32(mc), qraw, o, np.int32(nh), np.int32(nkv), np.int32(hd),
                            np.float32(hd ** -0.5)), shared_mem=4 * int(P))
        return self._mm(o, p + "attn_output.weight")

    def _allowed(self, il: int, x: Any, pos0: int, T: int, cos: Any, sin: Any) -> np.ndarray | None:
        """QSA: on a long-context decoder, cache the chunk's raw indexer keys and pool the blocks it completes (the
        step's ``_qsa`` caches); when some query of the chunk is past the full-selection range, the attended cells
        per query (``Qwen4ExpRuntime._select``'s rule) as a host mask [T, P]; else None."""
        dec, cfg, xp = self.dec, self.cfg, self.xp
        if not dec._qsa_layer(il):
            return None
        r, dih, budget = cfg.compress_ratios[il], cfg.idx_head_dim, cfg.idx_budget
        P = pos0 + T
        full = qsa_selects_all(self.rt.selection, r, budget, P - 1)
        if not dec.long:
            if not full:  # cannot happen: a decoder without the indexer stays in the full-selection range
                raise StrataError(f"position {P - 1} is past the full-selection range of a decoder built without QSA")
            return None
        p = f"blk.{il}.indexer."
        kr = self._mm(x, p + "k_proj.weight")  # [T, dih]
        dec.ik[il][pos0:P] = kr
        have, nb_all = pos0 // r, P // r
        if nb_all > have:
            raw = dec.ik[il][have * r:nb_all * r].reshape(nb_all - have, r, dih)
            pooled = _rmsnorm(xp, xp.mean(raw, axis=1), self._f32(p + "k_norm.weight"), cfg.eps)
            bc, bs = self.rt.rope.cos_sin(np.arange(have, nb_all, dtype=np.int64) * r)
            dec.bk[il][have:nb_all] = self.rt.rope.apply(pooled[:, None, :], bc, bs)[:, 0, :]
        if full:
            return None
        qi = self._mm(x, p + "q_proj.weight").reshape(T, -1, dih)
        qi = _rmsnorm(xp, qi, self._f32(p + "q_norm.weight"), cfg.eps)
        qi = self.rt.rope.apply(qi, cos, sin)
        if nb_all > 0:
            sc = xp.einsum("thd,bd->tbh", qi, dec.bk[il][:nb_all])
            scores = _to_host(xp.sum(xp.maximum(sc, 0), axis=-1) / xp.float32(math.sqrt(dih)))
        else:
            scores = np.zeros((T, 0), dtype=np.float32)
        return qsa_select_mask(self.rt.selection, scores, np.arange(pos0, P), r, budget, P)

    # -- MoE ----------------------------------------------------------------------------------------------
    def _route(self, il: int, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """Router top-k of T tokens: host ids [T, k] int32, weights [T, k] float32 (and device copies on CuPy)."""
        xp, cfg, k = self.xp, self.cfg, self.k
        logits = self._mm(x, f"blk.{il}.ffn_gate_inp.weight")  # [T, E]
        T, E = logits.shape
        if self.gpu:
            cp = self.cp
            if k > E:
                raise StrataError(f"layer {il}: {k} experts per token but only {E} experts")
            ids = cp.empty((T, k), dtype=cp.int32)
            w = cp.empty((T, k), dtype=cp.float32)
            self._route_launch(logits, ids, w)
            self._w_dev = w
            return cp.asnumpy(ids), cp.asnumpy(w)
        probs = _sigmoid(xp, logits) if cfg.gating == "sigmoid" else _softmax(xp, logits, axis=-1)
        ph = np.asarray(probs, dtype=np.float32)
        ids = np.argsort(-ph, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(ph, ids, axis=-1)
        if cfg.norm_topk:
            w = w / w.sum(axis=-1, keepdims=True)
        w = (w * np.float32(cfg.expert_weights_scale)).astype(np.float32)
        self._w_dev = w
        return ids.astype(np.int32), w

    def _moe_on_device(self, il: int, T: int) -> bool:
        """Does layer ``il``'s MoE of T tokens run with its routing left on the device (CuPy, a chunk's routing
        buffers set, the tensor-core expert jobs, a job table :func:`stratatools.runtime.gpu.qmm.device_jobs_ok`
        builds)?"""
        from stratatools.runtime.gpu import qmm

        return bool(self.gpu and self._dev_route is not None and self.experts == "mma" and self._mma_experts_ok(il)
                    and qmm.device_jobs_ok(T * self.k, self.rt.tier.arena.layers[il].n_expert))

    def _moe(self, il: int, x: Any) -> tuple[Any, np.ndarray | None, np.ndarray | None]:
        """Layer ``il``'s MoE of the rows x [T, n]: (y [T, n], routing ids [T, k], weights [T, k]); the routing is
        None where it stays on the device (:meth:`_moe_on_device`: the chunk reads it back at its end)."""
        xp, k = self.xp, self.k
        p = f"blk.{il}."
        T, n = x.shape
        if self._moe_on_device(il, int(T)):
            y = self._moe_gpu(il, x, self._dev_route[0][il], self._dev_route[1][il])
            self._dev_layers.append(il)
            return y, None, None
        x = xp.ascontiguousarray(x, dtype=xp.float32)
        ids, w = self._route(il, x)
        self._tic("experts")
        path = {"rows": self._experts_rows, "gemm": self._experts, "mma": self._experts_mma}[self.experts]
        ya = path(il, x, ids)  # [T k, n], unweighted
        wd = self._w_dev
        y = xp.sum(ya.reshape(T, k, n) * xp.asarray(wd).reshape(T, k, 1), axis=1)
        self._tic("shared")
        sg = self._sigmoid_x(self._mm(x, p + "ffn_gate_inp_shexp.weight"))  # [T, 1]
        y = y + self._shared_ffn(il, x, sg)
        return y.astype(xp.float32, copy=False), ids, w

    def _route_launch(self, logits: Any, ids: Any, w: Any, E: int | None = None) -> None:
        """The router of the rows ``logits`` [T, ld] (CuPy float32; the experts' logits in its first E columns, all
        of them by default) into ``ids`` int32 [T, k] and ``w`` float32 [T, k] on the device: ``pf_route_warp`` (a
        warp a token) where :data:`ROUTE_WARP_ENV` is on and E <= :data:`ROUTE_WARP_MAX_E`, else ``pf_route`` (a
        block a token)."""
        cp, cfg, k = self.cp, self.cfg, self.k
        T, ld = (int(v) for v in logits.shape)
        E = ld if E is None else int(E)
        args = (cp.ascontiguousarray(logits), np.int32(T), np.int32(ld), np.int32(E), np.int32(k),
                np.int32(cfg.gating == "sigmoid"), np.int32(bool(cfg.norm_topk)), np.float32(cfg.expert_weights_scale),
                ids, w)
        if E <= ROUTE_WARP_MAX_E and route_warp():
            self.k_route_warp((-(-T // (ROUTE_THREADS // 32)),), (ROUTE_THREADS,), args)
        else:
            self.k_route((min(T, 65535),), (ROUTE_THREADS,), args, shared_mem=(E + 2 * ROUTE_THREADS) * 4)

    def _moe_gpu(self, il: int, x: Any, ids: Any, w: Any) -> Any:
        """Layer ``il``'s MoE of the rows x [T, n] on CuPy with its routing left on the device: the router for T
        tokens (:meth:`_route_launch`) into ``ids`` int32 [T, k] / ``w`` float32 [T, k] (device views the caller reads
        later), the routed experts (:meth:`_routed_gpu`: blob addresses from the decoder's slot table) and the shared
        expert, on a second stream beside the routed experts where ``_shared_side`` is set
        (:data:`stratatools.runtime.gpu.kernels.SHARED_SIDE_ENV`). Returns y [T, n] float32. Raises StrataError when
        k exceeds the layer's experts."""
        cp, k = self.cp, self.k
        p = f"blk.{il}."
        T, n = x.shape
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        W = self._router_gate_w(il)
        if W is not None:  # one product: the experts' logits [T, E], then the shared expert's gate logit
            logits = self._router_mm(x, W)
            E = int(W.shape[0]) - 1
            g, goff = logits, E
        else:
            logits = self._mm(x, p + "ffn_gate_inp.weight")  # [T, E]
            E = int(logits.shape[1])
            g, goff = None, 0
        if k > E:
            raise StrataError(f"layer {il}: {k} experts per token but only {E} experts")
        self._route_launch(logits, ids, w, E)
        if g is None:  # (made here, before the side stream forks: it only reads it)
            g = cp.ascontiguousarray(self._mm(x, p + "ffn_gate_inp_shexp.weight"), dtype=cp.float32)  # [T, 1]
        # the shared expert beside the routed ones (not while the breakdown is timed: its stream would not be
        # synchronised by the timer); its output, unscaled, is added with its gate by the routed outputs' sum
        side = self._shared_side if self.timing is None else None
        main = join = None
        if side is not None:
            # the split of x that both branches' tensor-core GEMMs read is made here first, so the side stream only
            # reads it (and no cuBLAS call of the side stream runs beside one of the main stream)
            if self.gemm == "mma" and self._xs_memo is not None and self._xs_memo[0] is x:
                # (a split not kept for x would be made by each GEMM that reads it, on its stream: the kind the
                # shared expert's products read, "i8d" for its Q8R copies on the integer ring, else "f16" for its
                # GGUF blocks, is made here, so that the side stream only reads the memo)
                self._split(x, "i8d" if self._shared_q8r(il, int(x.shape[0])) is not None else "f16")
            main = cp.cuda.get_current_stream()
            fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
            fork.record(main)
            side.wait_event(fork)
            try:
                with side:
                    ys = self._shared_ffn(il, x, None)
            finally:
                join.record(side)
        else:
            self._tic("shared")
            ys = self._shared_ffn(il, x, None)
        tail = _SharedTail(ys, g, goff, main, join)
        try:
            y = self._routed_gpu(il, x, ids, w, int(T), int(n), tail)
        finally:
            tail.ready()
        return y

    def _routed_gpu(self, il: int, x: Any, ids: Any, w: Any, T: int, n: int, tail: Any = None) -> Any:
        """The routed experts of :meth:`_moe_gpu` for the T tokens x [T, n] with their routing ids / w [T, k] on the
        device: the tensor-core jobs, their table built there (:meth:`_experts_mma_dev`), the k outputs of a token
        summed with its weights in rank order (and the shared expert's output ``tail`` with its gate:
        :meth:`_moe_sum`). Returns [T, n] float32."""
        self._tic("experts")
        ya = self._experts_mma_dev(il, x, ids)  # [T k, n] unweighted
        return self._moe_sum(ya, w, T, n, tail)

    def _moe_sum(self, ya: Any, w: Any, T: int, n: int, tail: Any = None, k: int | None = None) -> Any:
        """The routed outputs ya [T k, n] of T tokens weighted by their router weights w [T, k] and summed in rank
        order (``pf_moe_sum``, CuPy): [T, n] float32. With ``tail`` (:class:`_SharedTail`) the shared expert's
        output is added as ``+ sigmoid(g) ys`` by the same launch (``pf_moe_sum_shared``), once its stream is
        done."""
        cp = self.cp
        k = self.k if k is None else int(k)
        y = cp.empty((T, n), dtype=cp.float32)
        grid, args = (max(1, min(-(-T * n // 256), 8192)),), (cp.ascontiguousarray(ya, dtype=cp.float32),
                                                              cp.ascontiguousarray(w, dtype=cp.float32),
                                                              np.int32(T), np.int32(k), np.int32(n))
        if tail is None:
            self.k_moe_sum(grid, (256,), (*args, y))
            return y
        tail.ready()
        self.k_moe_sum_shared(grid, (256,), (*args, cp.ascontiguousarray(tail.ys), tail.g,
                                             np.int32(tail.g.shape[1]), np.int32(tail.goff), y))
        return y

    def _router_gate_w(self, il: int) -> Any:
        """Layer ``il``'s router rows with the shared expert's gate row after them, float32 [E + 1, n], where the step
        keeps such a matrix (one SGEMM gives both; the batched decoder); here None (two products)."""
        return None

    def _router_mm(self, x: Any, W: Any) -> Any:
        """x [T, n] @ W.T for the router matrix of :meth:`_router_gate_w`: ``qmm_f32_nt`` for up to 32 rows on the
        device (:func:`stratatools.runtime.gpu.qmm.f32_nt`, :data:`stratatools.runtime.gpu.qmm.ROUTER_ENV`), else
        :meth:`_sgemm`. Returns float32 [T, E + 1]."""
        from stratatools.runtime.gpu import qmm

        if self.gpu and qmm.router_kernel() and qmm.f32_nt_applies(x, W):
            return qmm.f32_nt(x, W)
        return self._sgemm(x, W)

    def _shared_ffn(self, il: int, x: Any, sg: Any) -> Any:
        """Layer ``il``'s shared expert for x [T, n] times its gate sg [T, 1]: sg * down(silu(gate x) * up x) (sg
        None: unscaled)."""
        gu = self._shared_gate_up(il, x)
        hs = self._silu_x(*gu) if gu is not None else self._silu_x(self._shared_mm(il, x, 0), self._shared_mm(il, x, 1))
        down = self._shared_mm(il, hs, 2)
        return down if sg is None else sg * down

    def _shared_gate_up(self, il: int, x: Any) -> tuple[Any, Any] | None:
        """Layer ``il``'s shared expert's gate and up products of x [T, n] as one product where the runtime holds the
        two matrices as one array (``_shared_gu``, or its Q8R copy: :meth:`_shared_q8r`) and T rows take the
        tensor-core GEMMs (:data:`JOINED_ENV`): (gate x, up x) as column views [T, ff] of its output; else None."""
        from stratatools.runtime.gpu import qmm

        if (not self.gpu or not joined_enabled() or self.gemm not in ("mma", "hgemm") or x.ndim != 2
                or int(x.shape[0]) > 8 * qmm.TILES[1]):
            return None
        _dev, _ptrs, gu_t, _d_t, hidden, ff = self.rt._shared_expert(il)  # (made first: it sets _shared_gu)
        q8r = self._shared_q8r(il, int(x.shape[0]))
        joint = _Q8RRows(q8r[0], 0) if q8r is not None else getattr(self.rt, "_shared_gu", {}).get(il)
        if joint is None:
            return None
        out = self._qmm(x, joint, gu_t, 2 * ff, hidden, f"blk.{il}.ffn_gate_up_shexp")
        return None if out is None else (out[:, :ff], out[:, ff:])

    def _shared_mm(self, il: int, X: Any, which: int) -> Any:
        """X @ W.T for the shared expert's gate (0), up (1) or down (2) matrix (down from its Q8R copy where
        :meth:`_shared_q8r` makes one)."""
        name = f"blk.{il}.ffn_{('gate', 'up', 'down')[which]}_shexp.weight"
        if not self.gpu:
            return self._mm(X, name)
        dev, _ptrs, gu_t, d_t, hidden, ff = self.rt._shared_expert(il)
        t = gu_t if which < 2 else d_t
        rows, cols = (ff, hidden) if which < 2 else (hidden, ff)
        if self.gemm in ("mma", "hgemm"):
            q8r = self._shared_q8r(il, int(X.shape[0])) if which == 2 and X.ndim == 2 else None
            out = self._qmm(X, _Q8RRows(q8r[1], 0) if q8r is not None else dev[which], t, rows, cols, name)
            if out is not None:
                return out
        W = self._dequant(dev[which], t, rows, cols)
        return self._sgemm(X, W)

    def _shared_q8r(self, il: int, T: int) -> tuple[Any, Any] | None:
        """Layer ``il``'s shared expert as Q8R copies on the device (:class:`stratatools.runtime.gpu.kernels.Q8R`: (gate
        and up as one matrix [2 ff, hidden], down [hidden, ff]), for products of T rows that take the integer dense
        ring (:func:`stratatools.runtime.gpu.qmm.dense_i8`: up to 32 rows on the ``mma`` path; its GGUF Q8_0 blocks
        went through the fp16 hi / lo kernel and an fp16 split of x, 34 us a layer of the 32-sequence step, H200,
        bench/gpu-notes.md twenty-third pass), else None. Every layer's copies are made at the first call (the same
        bytes re-laid out, :func:`stratatools.runtime.gpu.kernels.q8_relayout`: 1.06 bytes a weight more on the
        device), outside a graph's capture (:meth:`_no_upload_in_capture`), in device memory of their own
        (:func:`stratatools.runtime.gpu.kernels.device_copy`: the first batched step's eager pass allocates from its
        decoder's graph pool, which a failed capture or the decoder's end would give back); kept on the runtime for
        every decoder."""
        from stratatools.runtime.gpu import qmm

        if self.gemm != "mma" or T > 8 * qmm.TILES[1] or not qmm.q8r_shared() or qmm.dense_i8() is None:
            return None
        rt = self.rt
        got = getattr(rt, "_shared_q8r", None)
        if got is None:
            from stratatools.runtime.gpu.kernels import Q8R

            self._no_upload_in_capture("the shared experts' Q8R copies")
            got = {}
            m = self.w.model
            for j in range(self.cfg.n_layer):
                try:
                    ts = [m.tensor(f"blk.{j}.ffn_{r}_shexp.weight") for r in ("gate", "up", "down")]
                except StrataError:  # (a layer without a shared expert)
                    continue
                if any(t.type.name != "Q8_0" for t in ts):
                    continue
                hidden, ff = int(ts[0].ne[0]), int(ts[0].ne[1])
                raws = [np.asarray(m.raw(t)).reshape(-1) for t in ts]
                got[j] = (Q8R(self.cp, np.concatenate(raws[:2]), 2 * ff, hidden, own=True),
                          Q8R(self.cp, raws[2], hidden, ff, own=True))
            rt._shared_q8r = got
        return got.get(il)

    #: set by the batched decoder while it runs (or captures) its graph step: GEMMs through a capturable cuBLAS call
    _in_static = False
    #: set while the prefill's graph body runs or is captured (:meth:`_graph_body`): inputs from the graph's buffers,
    #: positions on the device, GEMMs through capturable calls
    _in_graph = False
    _pgraph: dict[str, Any] | None = None
    #: the shared expert's stream beside the routed experts (CuPy, :meth:`_moe_gpu`); None: after them
    _shared_side: Any = None
    #: set on the batched decoder: its step's settings (expert job size) rather than the prefill's
    _batch_step = False
    #: tokens of a tensor-core expert job (set from the environment in __init__ on CuPy)
    _jt = JOB_TOKENS_MMA
    _dev_route: tuple[Any, Any] | None = None
    _dev_layers: list[int] = []
    #: [X, its splits by kind] while :meth:`_shared_split` is open for X
    _xs_memo: list[Any] | None = None
    #: (X, its splits by kind) made by the launch that made X, for the next :meth:`_shared_split` of X
    _pre: tuple[Any, dict[str, Any]] | None = None

    @contextlib.contextmanager
    def _shared_split(self, X: Any) -> Any:
        """Within the block, the tensor-core GEMMs and expert jobs given exactly the array ``X`` (the same object)
        share one :func:`stratatools.runtime.gpu.qmm.split` of it instead of splitting it once per matrix (the
        batched step split the same rows into fp16 halves 16 times a layer). The block must not write into ``X``.
        The split is made at the first use, so a block whose GEMMs take another path splits nothing."""
        prev, pre = self._xs_memo, self._pre
        self._pre = None  # (splits the launch that made X made beside it: _hc_gpu_in, _hc_gpu_mix)
        self._xs_memo = [X, dict(pre[1]) if pre is not None and pre[0] is X else {}]
        try:
            yield
        finally:
            self._xs_memo = prev

    def _split(self, X: Any, kind: str = "f16") -> tuple[Any, ...]:
        """The split of the rows ``X`` [T, K] (CuPy) of ``kind`` (:func:`stratatools.runtime.gpu.qmm.split_kind`):
        ``"f16"`` :func:`stratatools.runtime.gpu.qmm.split`, ``"i8d"`` its ``split_i8`` with ``dense=True``, ``"i8"``
        its ``split_i8`` (the expert jobs' planes); reused
        while a :meth:`_shared_split` of ``X`` is open."""
        from stratatools.runtime.gpu import qmm

        def make() -> tuple[Any, ...]:
            Xc = self.cp.ascontiguousarray(X, dtype=self.cp.float32)
            return qmm.split_i8(Xc, dense=kind == "i8d") if kind in ("i8", "i8d") else qmm.split(Xc)

        memo = self._xs_memo
        if memo is not None and memo[0] is X:
            if kind not in memo[1]:
                memo[1][kind] = make()
            return memo[1][kind]
        return make()

    def _sgemm(self, X: Any, W: Any) -> Any:
        """X [T, K] @ W.T for W [R, K]: float32 [T, R] (xp's matmul; in the batched decoder's graph step
        and the prefill's graph body :func:`stratatools.runtime.gpu.blas.sgemm_nt`, which a stream capture may
        record)."""
        if self.gpu and (self._in_static or self._in_graph):
            from stratatools.runtime.gpu.blas import sgemm_nt

            return sgemm_nt(X, W)
        return self.xp.matmul(X, W.T).astype(self.xp.float32, copy=False)

    def _experts_mma(self, il: int, x: Any, ids: np.ndarray) -> Any:
        """:meth:`_experts_rows`' contract on the tensor cores: jobs of one expert and up to :data:`JOB_TOKENS_MMA`
        tokens (:func:`expert_jobs`), ``qmm_moe_gu`` (gate and up, silu(gate) * up into the jobs' hidden rows) and
        ``qmm_moe_down`` (each pair's unweighted output row) reading the blobs through the slot table; experts of
        another type than Q8_0 / Q2_0 (or rows that are not whole blocks) go through :meth:`_experts_rows`. On numpy
        the same jobs with float32 matrices."""
        if not self.gpu:
            return self._experts_rows(il, x, ids, JOB_TOKENS_MMA)
        cp = self.cp
        if not self._mma_experts_ok(il):
            return self._experts_rows(il, x, ids)
        tt = self._jt
        je, jt, jd = expert_jobs(ids, tt)
        return self._mma_jobs(il, x, cp.asarray(self._slots[il][je].astype(np.uint64)), cp.asarray(jt),
                              cp.asarray(jd), int(ids.size), tt)

    def _mma_experts_ok(self, il: int) -> bool:
        """Do layer ``il``'s routed experts have tensor-core job kernels (Q8_0 / Q2_0 rows of whole blocks)?"""
        from stratatools.runtime.gpu import qmm

        ly = self.rt.tier.arena.layers[il]
        return bool(qmm.supports(ly.gu_type.id, ly.hidden) and qmm.supports(ly.d_type.id, ly.ff)
                    and ly.gu_type.id in (8, 42) and ly.d_type.id in (8, 42))

    def _experts_mma_dev(self, il: int, x: Any, ids: Any) -> Any:
        """:meth:`_experts_mma` with the routing ``ids`` [T, k] int32 left on the device: the job table built there
        (:func:`stratatools.runtime.gpu.qmm.moe_jobs`, blob addresses from the decoder's device slot table), spare
        jobs empty. CuPy only; the caller checks :meth:`_mma_experts_ok`. Returns [T k, n] unweighted."""
        from stratatools.runtime.gpu import qmm

        ly = self.rt.tier.arena.layers[il]
        tt = self._jt
        ptr, jt, jd = qmm.moe_jobs(ids.reshape(-1), int(ids.shape[-1]), ly.n_expert, self.dec.slot[il], tt)
        return self._mma_jobs(il, x, ptr, jt, jd, int(ids.size), tt)

    def _mma_jobs(self, il: int, x: Any, ptr: Any, jt: Any, jd: Any, N: int, tt: int = JOB_TOKENS_MMA) -> Any:
        """Run the tensor-core expert jobs (blob addresses ``ptr`` [J], slots ``jt`` / ``jd`` [J tt] on the device,
        ``tt`` tokens a job) of layer ``il`` over the rows ``x``: the N pairs' unweighted outputs [N, n]."""
        from stratatools.runtime.gpu import qmm

        cp = self.cp
        ly = self.rt.tier.arena.layers[il]
        hidden, ff = ly.hidden, ly.ff
        J = int(ptr.size)
        if qmm.jobs_i8(ly.gu_type.id, ly.d_type.id):  # integer Q2_0 jobs: empty slots are neither written nor split
            hbuf = cp.empty((J * tt, ff), dtype=cp.float32)
            qmm.moe_gate_up_i8(ptr, jt, self._split(x, "i8"), hbuf, hidden, ff, tt)
            out = cp.empty((N, int(x.shape[1])), dtype=cp.float32)
            qmm.moe_down_i8(ptr, 2 * ly.gate_bytes, jd, qmm.split_i8(hbuf, jd), out, hidden, ff, tt)
            return out
        xs = self._split(x)
        hbuf = cp.zeros((J * tt, ff), dtype=cp.float32)  # empty slots stay zero (their halves are split too)
        qmm.moe_gate_up(ptr, jt, xs, ly.gu_type.id, hbuf, hidden, ff, tt)
        hs = qmm.split(hbuf)
        out = cp.empty((N, int(x.shape[1])), dtype=cp.float32)
        qmm.moe_down(ptr, 2 * ly.gate_bytes, jd, hs, ly.d_type.id, out, hidden, ff, tt)
        return out

    def _experts_rows(self, il: int, x: Any, ids: np.ndarray, tt: int = JOB_TOKENS) -> Any:
        """:meth:`_experts` through jobs of one expert and up to :data:`JOB_TOKENS` tokens (:func:`expert_jobs`): on
        CuPy ``pf_moe_gu`` + ``pf_moe_down`` read the quantized blobs through the slot table; on numpy the same jobs
        (of up to ``tt`` tokens) with float32 matrices."""
        T, n = x.shape
        N = int(ids.size)
        je, jt, jd = expert_jobs(ids, tt if not self.gpu else JOB_TOKENS)
        J = int(je.size)
        if not self.gpu:
            out = np.zeros((N, n), dtype=np.float32)
            for j in range(J):
                g, u, d = (np.asarray(a, dtype=np.float32) for a in self.rt.expert_fn(il, int(je[j])))
                tok, dst = jt[j * tt:(j + 1) * tt], jd[j * tt:(j + 1) * tt]
                X = np.where((tok >= 0)[:, None], x[np.maximum(tok, 0)], np.float32(0))
                h = self._silu_mul(X @ g.T, X @ u.T)
                y = h @ d.T
                out[dst[dst >= 0]] = y[dst >= 0]
            return out
        cp = self.cp
        from stratatools.runtime.gpu.kernels import launch_big_shared

        ly = self.rt.tier.arena.layers[il]
        hidden, ff = ly.hidden, ly.ff
        for t, cols, what in ((ly.gu_type, hidden, "gate/up"), (ly.d_type, ff, "down")):
            if t.id not in UNIT or cols % UNIT[t.id][0] or cols % 8:
                raise StrataError(f"layer {il}: expert {what} rows of {cols} {t.name} values have no prefill kernel")
        ptr = cp.asarray(self._slots[il][je].astype(np.uint64))
        tok = cp.asarray(jt)
        dst = cp.asarray(jd)
        xx = cp.ascontiguousarray(x, dtype=cp.float32)
        hbuf = cp.empty((J * JOB_TOKENS, ff), dtype=cp.float32)
        out = cp.empty((N, n), dtype=cp.float32)
        warps = 8
        gx = max(1, -(-ff // (8 * warps)))
        launch_big_shared(self._fn(False, "pf_moe_gu", ly.gu_type.id), (gx, J), (32 * warps,),
                          (ptr, tok, xx, hbuf, np.int32(hidden), np.int32(ff)), JOB_TOKENS * hidden * 4)
        gx = max(1, -(-hidden // (8 * warps)))
        launch_big_shared(self._fn(False, "pf_moe_down", ly.d_type.id), (gx, J), (32 * warps,),
                          (ptr, np.int64(2 * ly.gate_bytes), dst, hbuf, out, np.int32(hidden), np.int32(ff)),
                          JOB_TOKENS * ff * 4)
        return out

    def _experts(self, il: int, x: Any, ids: np.ndarray) -> Any:
        """Routed experts of T tokens grouped by expert: [T k, n] float32 where row t k + r is expert ids[t, r]'s
        output for token t (unweighted)."""
        xp, k = self.xp, self.k
        T, n = x.shape
        flat = ids.reshape(-1).astype(np.int64)
        N = flat.size
        order = np.argsort(flat, kind="stable")  # pairs sorted by expert (token order inside an expert)
        se = flat[order]
        uniq, starts, counts = np.unique(se, return_index=True, return_counts=True)
        rank = np.arange(N) - np.repeat(starts, counts)  # place of each sorted pair among its expert's pairs
        by_count = np.argsort(-counts, kind="stable")  # experts with the most tokens first: little padding per group
        slot = np.empty(uniq.size, dtype=np.int64)
        slot[by_count] = np.arange(uniq.size)
        ge = slot[np.searchsorted(uniq, se)]  # each sorted pair's expert's place in by_count order
        groups, toks, dsts = [], [], []
        off = 0
        for g0 in range(0, uniq.size, self.group):
            sel = by_count[g0:g0 + self.group]
            G, Tm = int(sel.size), int(counts[sel].max())
            m = (ge >= g0) & (ge < g0 + G)
            tok = np.full((G, Tm), T, dtype=np.int32)  # row T of the padded input is zeros
            dst = np.full((G, Tm), N, dtype=np.int32)  # row N of the output is scratch
            tok[ge[m] - g0, rank[m]] = order[m] // k
            dst[ge[m] - g0, rank[m]] = order[m]
            toks.append(tok.reshape(-1))
            dsts.append(dst.reshape(-1))
            groups.append((g0, G, Tm, off))
            off += G * Tm
        tok_d = xp.asarray(np.concatenate(toks))
        dst_d = xp.asarray(np.concatenate(dsts))
        experts = uniq[by_count]
        ptrs = self.cp.asarray(self._slots[il][experts].astype(np.uint64)) if self.gpu else None
        Xp = xp.concatenate([x, xp.zeros((1, n), dtype=xp.float32)], axis=0)
        out = xp.empty((N + 1, n), dtype=xp.float32)
        for g0, G, Tm, o in groups:
            Wgu, Wd = self._expert_weights(il, experts[g0:g0 + G], None if ptrs is None else ptrs[g0:g0 + G])
            Xg = Xp[tok_d[o:o + G * Tm]].reshape(G, Tm, n)
            hgu = xp.matmul(Xg, xp.swapaxes(Wgu, 1, 2))  # [G, Tm, 2 ff]
            ff = Wd.shape[2]
            h = self._silu_mul(hgu[..., :ff], hgu[..., ff:])
            yg = xp.matmul(h, xp.swapaxes(Wd, 1, 2))  # [G, Tm, n]
            out[dst_d[o:o + G * Tm]] = yg.reshape(G * Tm, n)
        return out[:N]

    def _silu_mul(self, g: Any, u: Any) -> Any:
        """silu(g) * u in float32 (one fused kernel on CuPy)."""
        if not self.gpu:
            return (_silu(np, g) * u).astype(np.float32, copy=False)
        k = getattr(self, "_k_silu_mul", None)
        if k is None:
            k = self._k_silu_mul = self.cp.ElementwiseKernel(
                "float32 g, float32 u", "float32 y", "y = g * (1.0f / (1.0f + expf(-g))) * u", "pf_silu_mul")
        return k(g, u)

    def _expert_weights(self, il: int, experts: np.ndarray, ptrs: Any = None) -> tuple[Any, Any]:
        """float32 gate+up [G, 2 ff, n] and down [G, n, ff] of the given experts of layer ``il`` (on CuPy read
        through ``ptrs``, their blob addresses on the device: the tier's slot table)."""
        if not self.gpu:
            gu, dd = [], []
            for e in experts.tolist():
                g, u, d = self.rt.expert_fn(il, int(e))
                gu.append(np.concatenate([np.asarray(g), np.asarray(u)], axis=0))
                dd.append(np.asarray(d))
            return np.stack(gu).astype(np.float32), np.stack(dd).astype(np.float32)
        cp = self.cp
        ly = self.rt.tier.arena.layers[il]
        hidden, ff = ly.hidden, ly.ff
        G = int(experts.size)
        gu = cp.empty((G, 2 * ff, hidden), dtype=cp.float32)
        dd = cp.empty((G, hidden, ff), dtype=cp.float32)
        for arr, t, off, nv in ((gu, ly.gu_type, 0, 2 * ff * hidden), (dd, ly.d_type, 2 * ly.gate_bytes, hidden * ff)):
            if t.id not in UNIT:
                raise StrataError(f"layer {il}: expert type {t.name} has no GPU dequantizer")
            ng = nv // 8
            blocks = max(1, min(-(-ng // 256), 4096))
            self._fn(True, "pf_dequant_blobs", t.id)((blocks, G), (256,),
                                                                  (ptrs, np.int64(off), np.int64(ng), arr))
        return gu, dd
