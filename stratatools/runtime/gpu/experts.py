"""Quantized matrix-vector products on the GPU that read ggml blocks directly (dequantized in registers,
never through a float copy of the matrix), and the routed-expert FFN built on them.

Layouts (formats.md sections 1 and 5): a matrix of ggml shape ``[cols, rows]`` is ``rows`` rows of
``row_bytes(cols)`` bytes. An expert blob is ``[gate: ff rows of hidden][up: ff rows of hidden]
[down: hidden rows of ff]``, as in ``experts.bin`` and in one expert's slice of the ``*_exps`` tensors.

The routed-expert FFN of one layer for T tokens and J = T*k jobs (job j: token ``tok[j]``, weight ``w[j]``,
its expert's gate/up/down matrices at device addresses ``gate_ptr[j]``, ``up_ptr[j]``, ``down_ptr[j]``):

    h_j = silu(G_j x_t) * (U_j x_t)          (moe_gate_up_kernel, one warp per (job, row))
    y_t = sum_j w_j D_j h_j                   (moe_down_kernel, one warp per (token, output row))

Addresses may point at VRAM slots or at mapped pinned host memory (zero-copy reads of a miss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.model.ggml_types import GGMLType

from stratatools.runtime.gpu import require_cupy
from stratatools.runtime.gpu.kernels import MOE_ROW_BUF, MOE_ROW_MAX, UNIT, launch_big_shared, kernel

WARPS_PER_BLOCK = 8
THREADS = 32 * WARPS_PER_BLOCK
MAX_SHARED_FLOATS = 48 * 1024 // 4


def _check_type(t: GGMLType, ncols: int, what: str) -> None:
    if t.id not in UNIT:
        raise StrataError(f"{what}: ggml type {t.name} has no GPU kernel")
    if ncols % UNIT[t.id][0]:
        raise StrataError(f"{what}: rows of {ncols} values are not whole {t.name} blocks of {UNIT[t.id][0]}")


def matvec(w_raw: Any, t: GGMLType, rows: int, cols: int, x: Any) -> Any:
    """``y = W x`` for a quantized matrix W (``rows`` rows of ``cols`` values, ggml shape ``[cols, rows]``).

    Args:
        w_raw: the matrix bytes, CuPy uint8 (``rows * t.row_bytes(cols)`` bytes).
        t: W's ggml type.
        x: CuPy float32 ``[cols]``.
    Returns:
        CuPy float32 ``[rows]``.
    Raises:
        StrataError: wrong byte size, unsupported type, or cols over 12,288 (shared-memory staging of x).
    """
    cp = require_cupy()
    _check_type(t, cols, "matvec")
    if int(w_raw.size) != rows * t.row_bytes(cols):
        raise StrataError(f"matvec: {w_raw.size} bytes given for {rows} rows of {cols} {t.name} values")
    if cols > MAX_SHARED_FLOATS:
        raise StrataError(f"matvec: rows of {cols} values exceed the {MAX_SHARED_FLOATS} staged in shared memory")
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    y = cp.empty(rows, dtype=cp.float32)
    grid = ((rows + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK,)
    kernel("matvec_kernel", t.id)(grid, (THREADS,), (w_raw, x, y, np.int32(rows), np.int32(cols)),
                                  shared_mem=cols * 4)
    return y


@dataclass
class ExpertJobs:
    """Device-side job table of one routed-expert FFN call (see module docstring).

    Attributes:
        gate_ptr, up_ptr, down_ptr: CuPy uint64 ``[J]`` device addresses of each job's matrices.
        tok: CuPy int32 ``[J]`` token index of each job (jobs sorted by token).
        weight: CuPy float32 ``[J]`` router weight of each job.
        tstart: CuPy int32 ``[T+1]``: token t's jobs are ``tstart[t] .. tstart[t+1]-1``.
    """

    gate_ptr: Any
    up_ptr: Any
    down_ptr: Any
    tok: Any
    weight: Any
    tstart: Any

    @property
    def n_jobs(self) -> int:
        """Number of (token, expert) jobs J."""
        return int(self.tok.size)

    @property
    def n_tokens(self) -> int:
        """Number of tokens T."""
        return int(self.tstart.size) - 1


def make_jobs(blob_ptrs: np.ndarray, weights: np.ndarray, gate_bytes: int, hbuf_tokens: int | None = None) -> ExpertJobs:
    """Build an :class:`ExpertJobs` for T tokens with k experts each from whole-blob addresses.

    Args:
        blob_ptrs: uint64 ``[T, k]`` device address of each routed expert's blob ``[gate][up][down]``.
        weights: float32 ``[T, k]`` router weights.
        gate_bytes: bytes of one expert's gate matrix (= up matrix bytes): ``ff * row_bytes(gu, hidden)``.
    """
    cp = require_cupy()
    blob_ptrs = np.asarray(blob_ptrs, dtype=np.uint64)
    T, k = blob_ptrs.shape
    flat = blob_ptrs.reshape(-1)
    gb = np.uint64(gate_bytes)
    host = np.concatenate([flat, flat + gb, flat + gb + gb]).astype(np.uint64)
    dev = cp.asarray(host)
    J = T * k
    return ExpertJobs(dev[:J], dev[J:2 * J], dev[2 * J:], cp.asarray(np.repeat(np.arange(T, dtype=np.int32), k)),
                      cp.asarray(np.asarray(weights, dtype=np.float32).reshape(-1)),
                      cp.asarray(np.arange(0, J + 1, k, dtype=np.int32)))


def expert_ffn(X: Any, jobs: ExpertJobs, gu_type: GGMLType, d_type: GGMLType, hidden: int, ff: int,
               out: Any = None, accumulate: bool = False, hbuf: Any = None, fast: bool = False) -> Any:
    """Routed-expert FFN for T tokens: ``Y[t] (+)= sum_j w_j * down_j(silu(gate_j x_t) * up_j x_t)``.

    Args:
        X: CuPy float32 ``[T, hidden]``.
        jobs: the job table (its pointers must stay valid until the kernels have run).
        gu_type, d_type: ggml types of gate/up and of down.
        hidden, ff: model width and expert width.
        out: optional CuPy float32 ``[T, hidden]`` to write (or add to, with ``accumulate``).
        hbuf: optional CuPy float32 scratch of at least ``J * ff`` values (reused across calls).
        fast: use the kernels' multiply-add-fused build (:func:`stratatools.runtime.gpu.kernels.fast_module`;
            float rounding differs from the bit-exact default): the staged-row kernels of ``moe_staged.cu`` when
            a gate/up row and a down row are each at most ``MOE_ROW_MAX`` bytes, else the FMA build of the others.
    Returns:
        CuPy float32 ``[T, hidden]``.
    Raises:
        StrataError: unsupported types, or widths that are not whole blocks.
    """
    cp = require_cupy()
    _check_type(gu_type, hidden, "expert gate/up")
    _check_type(d_type, ff, "expert down")
    if hidden > MAX_SHARED_FLOATS:
        raise StrataError(f"expert FFN: hidden {hidden} exceeds the {MAX_SHARED_FLOATS} values staged in shared memory")
    T, J = jobs.n_tokens, jobs.n_jobs
    if out is None:
        out = cp.empty((T, hidden), dtype=cp.float32)
        accumulate = False
    if J == 0:
        if not accumulate:
            out.fill(0)
        return out
    if hbuf is None or hbuf.size < J * ff:
        hbuf = cp.empty(J * ff, dtype=cp.float32)
    X = cp.ascontiguousarray(X, dtype=cp.float32)
    if (fast and gu_type.row_bytes(hidden) <= MOE_ROW_MAX and d_type.row_bytes(ff) <= MOE_ROW_MAX
            and int(X.data.ptr) % 16 == 0 and int(hbuf.data.ptr) % 16 == 0):  # (the kernels read x, h as float4)
        # staged rows (moe_staged.cu): every 16-byte load of a warp's rows in flight at once
        bufs = WARPS_PER_BLOCK * 2 * MOE_ROW_BUF
        per = MOE_ROW_BUF // (((gu_type.row_bytes(hidden) + 30) // 16) * 16)  # rows a warp stages at once
        g1 = ((ff + WARPS_PER_BLOCK * per - 1) // (WARPS_PER_BLOCK * per), J)
        launch_big_shared(kernel("moe_gate_up_staged", gu_type.id), g1, (THREADS,),
                          (jobs.gate_ptr, jobs.up_ptr, jobs.tok, X, hbuf, np.int32(hidden), np.int32(ff)),
                          hidden * 4 + bufs)
        g2 = ((hidden + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, T)
        launch_big_shared(kernel("moe_down_staged", d_type.id), g2, (THREADS,),
                          (jobs.down_ptr, jobs.weight, jobs.tstart, hbuf, out, np.int32(hidden), np.int32(ff),
                           np.int32(1 if accumulate else 0)), bufs)
        return out
    grid1 = ((ff + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, J)
    kernel("moe_gate_up_kernel", gu_type.id, fast)(
        grid1, (THREADS,), (jobs.gate_ptr, jobs.up_ptr, jobs.tok, X, hbuf, np.int32(hidden), np.int32(ff)),
        shared_mem=hidden * 4)
    grid2 = ((hidden + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, T)
    kernel("moe_down_kernel", d_type.id, fast)(
        grid2, (THREADS,), (jobs.down_ptr, jobs.weight, jobs.tstart, hbuf, out, np.int32(hidden), np.int32(ff),
                            np.int32(1 if accumulate else 0)))
    return out


def expert_ffn_reference(x: np.ndarray, blobs: list[np.ndarray], weights: np.ndarray, gu_type: GGMLType,
                         d_type: GGMLType, hidden: int, ff: int) -> np.ndarray:
    """float64 numpy reference of :func:`expert_ffn` for one token (tests): dequantize each blob with
    :func:`stratatools.runtime.dequant.dequantize` and multiply."""
    from stratatools.runtime.dequant import dequantize

    gb = ff * gu_type.row_bytes(hidden)
    y = np.zeros(hidden, dtype=np.float64)
    x64 = np.asarray(x, dtype=np.float64)
    for blob, w in zip(blobs, weights):
        g = dequantize(blob[:gb], gu_type).reshape(ff, hidden).astype(np.float64)
        u = dequantize(blob[gb:2 * gb], gu_type).reshape(ff, hidden).astype(np.float64)
        d = dequantize(blob[2 * gb:], d_type).reshape(hidden, ff).astype(np.float64)
        a = g @ x64
        h = a / (1.0 + np.exp(-a)) * (u @ x64)
        y += float(w) * (d @ h)
    return y
