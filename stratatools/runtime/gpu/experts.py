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

The fast path (``fast=True``, the decode step's) runs ``moe_staged.cu``: its staged-row kernels, or its pipelined
kernels (rows copied to shared memory by cp.async into a ring of slots per warp, decoded 16 values a lane-step;
launch shapes from ``STRATATOOLS_MOE_PIPE``), which the decode step takes for the shared expert and, when every routed
blob is read from device memory, for the routed ones (:func:`decoder_expert_kernels`; ``STRATATOOLS_MOE_KERNEL``
overrides). For Q2_0 the pipelined gate/up launch runs its integer variant by default (input rounded per block of 32
to 16-bit fixed point, int8 dot products: :data:`MOE_INT8_ENV`). ``bench/bench_moe_kernels.py`` times them per shape;
the defaults change only on its numbers and the decode step's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.model.ggml_types import GGMLType

from stratatools.runtime.gpu import require_cupy
from stratatools.runtime.gpu.kernels import (MOE_ROW_BUF, MOE_ROW_MAX, PIPE_I8_TYPES, PIPE_TYPES, UNIT, kernel,
                                             launch_big_shared)

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
        per_token: the most jobs one token has, when the caller knows it (k); sizes the pipelined down kernel's
            shared memory (a token with more jobs than it gets NaN rows).
    """

    gate_ptr: Any
    up_ptr: Any
    down_ptr: Any
    tok: Any
    weight: Any
    tstart: Any
    #: most jobs any one token has (None: not known; the pipelined down kernel then assumes all J for T > 1)
    per_token: int | None = None

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
                      cp.asarray(np.arange(0, J + 1, k, dtype=np.int32)), per_token=int(k))


#: Environment variable that picks the fast path's routed-expert kernels (``expert_ffn(fast=True)``): ``staged``
#: (moe_staged.cu's staged-row kernels; the default) or ``pipe`` (its pipelined kernels: cp.async rings, 16-value
#: units; Q2_0 and Q8_0 only, others stay on ``staged``). bench/bench_moe_kernels.py times both.
MOE_KERNEL_ENV = "STRATATOOLS_MOE_KERNEL"
EXPERT_KERNELS = ("staged", "pipe")
#: Environment variable with the pipelined kernels' launch shapes, ``KEY=THREADSxROWSxSTAGES`` parts joined by commas
#: (threads a block, rows a warp computes, ring slots a warp keeps in flight): keys ``gu`` and ``down`` for calls of
#: several jobs (the routed experts), ``gu1`` and ``down1`` for calls of one job (the decode step's shared expert;
#: they follow ``gu`` / ``down`` when not given); any part may be left out.
MOE_PIPE_ENV = "STRATATOOLS_MOE_PIPE"
#: Most dynamic shared memory a block may opt in to on the devices we run (sm_90: 227 KiB).
PIPE_MAX_SHARED = 227 * 1024
#: moe_staged.cu's MOE_PIPE_PAD (bytes after the last ring slot).
MOE_PIPE_PAD = 16


@dataclass(frozen=True)
class PipeShape:
    """Launch shape of one pipelined expert kernel: ``threads`` a block (a multiple of 32, at most 256), ``rows`` a
    warp computes (the grid is sized so that each warp gets at most that many), ``stages`` ring slots a warp has
    (rows copied ahead while it computes; clipped to its rows)."""

    threads: int = 256
    rows: int = 2
    stages: int = 2


#: Pipelined kernels' shapes when STRATATOOLS_MOE_PIPE does not set them: the fastest of bench_moe_kernels.py's
#: sweep on the H200 (full-width Q2_0 routed experts, 10 jobs; the Q8_0 shared expert, 1 job; bench/gpu-notes.md).
DEFAULT_PIPE = {"gu": PipeShape(256, 2, 2), "down": PipeShape(256, 1, 1), "gu1": PipeShape(256, 1, 1),
                "down1": PipeShape(256, 1, 1)}


def expert_kernel_choice(value: str | None = None) -> str:
    """The fast path's routed-expert kernels: ``value``, else ``$STRATATOOLS_MOE_KERNEL``, else ``staged``.

    Raises:
        StrataError: a name other than those of :data:`EXPERT_KERNELS`.
    """
    v = (value if value is not None else os.environ.get(MOE_KERNEL_ENV, "")).strip() or "staged"
    if v not in EXPERT_KERNELS:
        raise StrataError(f"expert kernels {v!r} ({MOE_KERNEL_ENV}) is not one of {', '.join(EXPERT_KERNELS)}")
    return v


def pipe_shapes(value: str | None = None) -> dict[str, PipeShape]:
    """The pipelined kernels' launch shapes (keys ``gu``, ``down``, ``gu1``, ``down1``; see :data:`MOE_PIPE_ENV`):
    :data:`DEFAULT_PIPE` overridden by ``value`` (else ``$STRATATOOLS_MOE_PIPE``), e.g. ``gu=256x2x2,down=128x4x3``;
    ``gu1`` / ``down1`` take the given ``gu`` / ``down`` unless given themselves.

    Raises:
        StrataError: a malformed part, an unknown key, threads not a multiple of 32 in 32..256, or rows or
            stages outside 1..64 / 1..4.
    """
    v = value if value is not None else os.environ.get(MOE_PIPE_ENV, "")
    given: dict[str, PipeShape] = {}
    for part in filter(None, (p.strip() for p in v.split(","))):
        name, _, spec = part.partition("=")
        nums = spec.split("x")
        if name not in DEFAULT_PIPE or len(nums) != 3 or not all(n.isdigit() for n in nums):
            raise StrataError(f"{MOE_PIPE_ENV}: {part!r} is not KEY=THREADSxROWSxSTAGES with KEY one of "
                              f"{', '.join(DEFAULT_PIPE)} (e.g. gu=256x2x2)")
        th, rows, st = (int(n) for n in nums)
        if th % 32 or not 32 <= th <= 256 or not 1 <= rows <= 64 or not 1 <= st <= 4:
            raise StrataError(f"{MOE_PIPE_ENV}: {part!r}: threads must be a multiple of 32 in 32..256, rows 1..64, "
                              f"stages 1..4")
        given[name] = PipeShape(th, rows, st)
    out = {k: given.get(k, DEFAULT_PIPE[k]) for k in ("gu", "down")}
    for k in ("gu", "down"):
        out[k + "1"] = given.get(k + "1", given.get(k, DEFAULT_PIPE[k + "1"]))
    return out


#: Which of the pipelined kernels run their integer variants (``moe_gate_up_pipe_i8`` / ``moe_down_pipe_i8``: the
#: input quantized per block of 32 to 16-bit fixed point, int8 dot products) for the types that have them
#: (:data:`PIPE_I8_TYPES`: Q2_0): ``gu`` (the default: the gate/up launch; the down launch stays float), ``1`` (both)
#: or ``0`` (neither). On the H200 the integer gate/up is the faster one and the integer down the slower one: the
#: down launch is bound by staging the 10 jobs' h rows, which the quantization makes longer (bench/gpu-notes.md,
#: eleventh pass).
MOE_INT8_ENV = "STRATATOOLS_MOE_INT8"
MOE_INT8_MODES = ("gu", "1", "0")


def moe_int8() -> str:
    """:data:`MOE_INT8_ENV`: one of :data:`MOE_INT8_MODES` (default ``gu``). Raises StrataError for another value."""
    v = os.environ.get(MOE_INT8_ENV, "").strip() or "gu"
    if v not in MOE_INT8_MODES:
        raise StrataError(f"{MOE_INT8_ENV}={v!r}: use gu (integer gate/up kernel), 1 (integer gate/up and down) or 0")
    return v


def pipe_int8(t: GGMLType, int8: bool | str | None = None, part: str = "gu") -> bool:
    """Whether the pipelined ``part`` launch (``gu`` or ``down``) for type ``t`` runs the integer variant: ``int8``
    (a flag; or a mode of :data:`MOE_INT8_MODES`, read for ``part``; None: :func:`moe_int8`'s mode) and ``t`` one of
    :data:`PIPE_I8_TYPES`."""
    if int8 is None or isinstance(int8, str):
        mode = moe_int8() if int8 is None else int8
        if mode not in MOE_INT8_MODES:
            raise StrataError(f"integer expert kernels {mode!r}: use one of {', '.join(MOE_INT8_MODES)}")
        int8 = mode == "1" or (mode == "gu" and part == "gu")
    return bool(int8) and t.id in PIPE_I8_TYPES


def _i8_layout(n: int) -> int:
    """Bytes of moe_staged.cu's quantized-input layout of ``n`` values (mi8_end): two int8 planes, 16-byte aligned,
    a float scale per 32 values, an int sum per 16, the end aligned to 16."""
    def a16(v: int) -> int:
        return (v + 15) // 16 * 16
    return a16(a16(2 * n) + 4 * (n // 32) + 4 * (n // 16))


def _slot_stride(t: GGMLType, ncols: int) -> int:
    return ((t.row_bytes(ncols) + 30) // 16) * 16


def pipe_gu_shared(gu_type: GGMLType, hidden: int, threads: int, stages: int, int8: bool = False) -> int:
    """Dynamic shared bytes of ``moe_gate_up_pipe``: x (hidden floats; with ``int8``, ``moe_gate_up_pipe_i8``'s
    quantized layout) + a ring of ``stages`` slots of a gate and an up row per warp + MOE_PIPE_PAD."""
    x = _i8_layout(hidden) if int8 else hidden * 4
    return x + (threads // 32) * stages * 2 * _slot_stride(gu_type, hidden) + MOE_PIPE_PAD


def pipe_down_shared(d_type: GGMLType, ff: int, max_jobs: int, threads: int, stages: int, int8: bool = False) -> int:
    """Dynamic shared bytes of ``moe_down_pipe``: the token's h rows (max_jobs * ff floats), weights, addresses, a
    ring of ``stages`` slots of max_jobs down rows per warp + MOE_PIPE_PAD; with ``int8`` (``moe_down_pipe_i8``) the
    h rows' quantized layout, the addresses (16-byte aligned) and the same ring."""
    ring = (threads // 32) * stages * max_jobs * _slot_stride(d_type, ff) + MOE_PIPE_PAD
    if int8:
        return _i8_layout(max_jobs * ff) + (8 * max_jobs + 15) // 16 * 16 + ring
    return max_jobs * ff * 4 + 16 * ((max_jobs + 3) // 4) + 16 * ((max_jobs + 1) // 2) + ring


def _pipe_grid(rows_total: int, shape: PipeShape) -> tuple[int, int]:
    """(blocks along the rows, ring slots): blocks so that a warp gets at most shape.rows rows, slots clipped to
    the rows a warp gets."""
    warps = shape.threads // 32
    gx = max(1, -(-rows_total // (warps * shape.rows)))
    items = -(-rows_total // (gx * warps))
    return gx, max(1, min(shape.stages, items))


def staged_gate_up(X: Any, jobs: ExpertJobs, gu_type: GGMLType, hidden: int, ff: int, hbuf: Any,
                   pdl: bool = False) -> None:
    """Launch ``moe_gate_up_staged`` (hbuf[j, :ff] = silu(gate_j x) * up_j x); a row of at most MOE_ROW_MAX bytes,
    X and hbuf 16-byte aligned (the caller checks)."""
    bufs = WARPS_PER_BLOCK * 2 * MOE_ROW_BUF
    per = MOE_ROW_BUF // _slot_stride(gu_type, hidden)  # rows a warp stages at once
    g1 = ((ff + WARPS_PER_BLOCK * per - 1) // (WARPS_PER_BLOCK * per), jobs.n_jobs)
    launch_big_shared(kernel("moe_gate_up_staged", gu_type.id), g1, (THREADS,),
                      (jobs.gate_ptr, jobs.up_ptr, jobs.tok, X, hbuf, np.int32(hidden), np.int32(ff)),
                      hidden * 4 + bufs, "moe_gate_up_staged", pdl)


def staged_down(jobs: ExpertJobs, d_type: GGMLType, hidden: int, ff: int, hbuf: Any, out: Any,
                accumulate: bool, pdl: bool = False) -> None:
    """Launch ``moe_down_staged`` (out[t] (+)= sum_j w_j down_j hbuf[j]); a row of at most MOE_ROW_MAX bytes."""
    g2 = ((hidden + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, jobs.n_tokens)
    launch_big_shared(kernel("moe_down_staged", d_type.id), g2, (THREADS,),
                      (jobs.down_ptr, jobs.weight, jobs.tstart, hbuf, out, np.int32(hidden), np.int32(ff),
                       np.int32(1 if accumulate else 0)), WARPS_PER_BLOCK * 2 * MOE_ROW_BUF, "moe_down_staged", pdl)


def pipe_gate_up(X: Any, jobs: ExpertJobs, gu_type: GGMLType, hidden: int, ff: int, hbuf: Any,
                 shape: PipeShape, int8: bool | str | None = None, pdl: bool = False) -> None:
    """Launch ``moe_gate_up_pipe`` with ``shape`` (:func:`staged_gate_up`'s result up to float rounding, or with the
    integer variant up to the input's 16-bit rounding; Q2_0 / Q8_0; no alignment
    asked of X or hbuf): blocks of one token each, over the token's (job, row) pairs (:func:`pipe_max_jobs` * ff;
    the blocks of a token with fewer jobs find nothing to do); ``moe_gate_up_pipe_i8`` instead when
    :func:`pipe_int8` (``int8``; None: :data:`MOE_INT8_ENV`). Raises StrataError when the shape's shared memory
    exceeds PIPE_MAX_SHARED."""
    gx, st = _pipe_grid(pipe_max_jobs(jobs) * ff, shape)
    i8 = pipe_int8(gu_type, int8)
    shm = pipe_gu_shared(gu_type, hidden, shape.threads, st, i8)
    if shm > PIPE_MAX_SHARED:
        raise StrataError(f"moe_gate_up_pipe: {shape} needs {shm} bytes of shared memory, over {PIPE_MAX_SHARED}")
    name = "moe_gate_up_pipe_i8" if i8 else "moe_gate_up_pipe"
    launch_big_shared(kernel(name, gu_type.id), (gx, jobs.n_tokens),
                      (shape.threads,),
                      (jobs.gate_ptr, jobs.up_ptr, jobs.tstart, X, hbuf, np.int32(hidden), np.int32(ff),
                       np.int32(st)), shm, name, pdl)


def pipe_max_jobs(jobs: ExpertJobs) -> int:
    """Jobs of the busiest token as the pipelined down kernel sizes it: all J for one token, else ``per_token``
    when the job table carries it, else J."""
    if jobs.n_tokens == 1 or jobs.per_token is None:
        return jobs.n_jobs
    return int(jobs.per_token)


def pipe_down(jobs: ExpertJobs, d_type: GGMLType, hidden: int, ff: int, hbuf: Any, out: Any, accumulate: bool,
              shape: PipeShape, int8: bool | str | None = None, pdl: bool = False) -> None:
    """Launch ``moe_down_pipe`` with ``shape`` (:func:`staged_down`'s result up to float rounding; Q2_0 / Q8_0), or
    ``moe_down_pipe_i8`` when :func:`pipe_int8` (``int8``; None: :data:`MOE_INT8_ENV`). Raises StrataError when the
    shape's shared memory exceeds PIPE_MAX_SHARED."""
    mj = pipe_max_jobs(jobs)
    gx, st = _pipe_grid(hidden, shape)
    i8 = pipe_int8(d_type, int8, "down")
    shm = pipe_down_shared(d_type, ff, mj, shape.threads, st, i8)
    if shm > PIPE_MAX_SHARED:
        raise StrataError(f"moe_down_pipe: {shape} for {mj} jobs a token needs {shm} bytes of shared memory, over "
                          f"{PIPE_MAX_SHARED}")
    name = "moe_down_pipe_i8" if i8 else "moe_down_pipe"
    launch_big_shared(kernel(name, d_type.id), (gx, jobs.n_tokens),
                      (shape.threads,),
                      (jobs.down_ptr, jobs.weight, jobs.tstart, hbuf, out, np.int32(hidden), np.int32(ff),
                       np.int32(1 if accumulate else 0), np.int32(st), np.int32(mj)), shm, name, pdl)


def pipe_fits(jobs: ExpertJobs, gu_type: GGMLType, d_type: GGMLType, hidden: int, ff: int,
              shapes: dict[str, PipeShape], int8: str | None = None) -> bool:
    """Whether the pipelined kernels take this call: both types Q2_0 / Q8_0 and both launches' shared memory
    (shapes ``gu`` and ``down``) within PIPE_MAX_SHARED."""
    if gu_type.id not in PIPE_TYPES or d_type.id not in PIPE_TYPES:
        return False
    gx, st = _pipe_grid(pipe_max_jobs(jobs) * ff, shapes["gu"])
    if pipe_gu_shared(gu_type, hidden, shapes["gu"].threads, st, pipe_int8(gu_type, int8)) > PIPE_MAX_SHARED:
        return False
    gx, st = _pipe_grid(hidden, shapes["down"])
    return pipe_down_shared(d_type, ff, pipe_max_jobs(jobs), shapes["down"].threads, st,
                            pipe_int8(d_type, int8, "down")) <= PIPE_MAX_SHARED


def decoder_expert_kernels(from_device: bool) -> tuple[str, str]:
    """The fused decode step's expert kernels, (routed, shared): ``$STRATATOOLS_MOE_KERNEL`` for both when set
    (:func:`expert_kernel_choice`); else ``pipe`` for the shared expert and, when every routed blob is read from
    device memory (``from_device``: the tier holds every expert, or missed experts are fetched into device staging
    first), for the routed ones (1.9x the staged gate/up on device memory on the H200), ``staged`` when misses are
    read over the bus (about 1.7x faster there: bench/bench_moe_kernels.py, bench/gpu-notes.md). A ``pipe`` choice is a wish: :func:`expert_kernel_path` takes the staged kernels for a
    call the pipelined ones cannot run (types outside PIPE_TYPES, shared memory).

    Raises:
        StrataError: a bad ``$STRATATOOLS_MOE_KERNEL``.
    """
    if os.environ.get(MOE_KERNEL_ENV, "").strip():
        k = expert_kernel_choice()
        return k, k
    return ("pipe" if from_device else "staged"), "pipe"


def expert_kernel_path(jobs: Any, gu_type: GGMLType, d_type: GGMLType, hidden: int, ff: int, *, fast: bool,
                       kernels: str | None = None, aligned: bool = True, int8: str | None = None) -> str:
    """Which kernels :func:`expert_ffn` runs for a call: ``pipe`` (moe_staged.cu's pipelined kernels: ``fast``,
    the ``kernels`` choice ``pipe`` (:func:`expert_kernel_choice`) and :func:`pipe_fits` with :func:`pipe_shapes`,
    ``gu1`` / ``down1`` for one job, ``int8`` the integer kernels' mode: :func:`pipe_int8`), else ``staged`` (its
    staged-row kernels: ``fast``, a gate/up row and a down
    row each at most MOE_ROW_MAX bytes, and the x / h buffers 16-byte ``aligned``), else ``warp`` (the
    warp-per-row kernels). ``jobs``: anything with ``n_jobs``, ``n_tokens`` and ``per_token`` (:class:`ExpertJobs`).
    Needs no GPU.

    Raises:
        StrataError: a bad kernel choice or pipe shape (only read with ``fast``).
    """
    if fast and expert_kernel_choice(kernels) == "pipe":
        sh = pipe_shapes()
        one = "1" if jobs.n_jobs == 1 else ""
        if pipe_fits(jobs, gu_type, d_type, hidden, ff, {"gu": sh["gu" + one], "down": sh["down" + one]}, int8):
            return "pipe"
    if fast and aligned and gu_type.row_bytes(hidden) <= MOE_ROW_MAX and d_type.row_bytes(ff) <= MOE_ROW_MAX:
        return "staged"
    return "warp"


def expert_ffn(X: Any, jobs: ExpertJobs, gu_type: GGMLType, d_type: GGMLType, hidden: int, ff: int,
               out: Any = None, accumulate: bool = False, hbuf: Any = None, fast: bool = False,
               kernels: str | None = None, before_down: Any = None, int8: str | None = None,
               pdl: bool = False) -> Any:
    """Routed-expert FFN for T tokens: ``Y[t] (+)= sum_j w_j * down_j(silu(gate_j x_t) * up_j x_t)``.

    Args:
        X: CuPy float32 ``[T, hidden]``.
        jobs: the job table (its pointers must stay valid until the kernels have run).
        gu_type, d_type: ggml types of gate/up and of down.
        hidden, ff: model width and expert width.
        out: optional CuPy float32 ``[T, hidden]`` to write (or add to, with ``accumulate``).
        hbuf: optional CuPy float32 scratch of at least ``J * ff`` values (reused across calls).
        fast: use the kernels' multiply-add-fused build (:func:`stratatools.runtime.gpu.kernels.fast_module`;
            float rounding differs from the bit-exact default, and the integer variants (``int8``) also round their
            input to 16-bit fixed point; :func:`expert_kernel_path` picks): with ``kernels``
            ``pipe`` the pipelined kernels of ``moe_staged.cu`` (Q2_0 / Q8_0 whose shared memory fits, launch shapes
            from :func:`pipe_shapes`: ``gu1`` / ``down1`` for a call of one job; other types fall back), else
            its staged-row kernels when a gate/up row and a down row are each at most ``MOE_ROW_MAX`` bytes, else
            the FMA build of the others.
        kernels: ``staged`` or ``pipe`` (:func:`expert_kernel_choice`; None: ``$STRATATOOLS_MOE_KERNEL``, default
            ``staged``); only read with ``fast``.
        before_down: optional callable run after the gate/up launch is queued and before the down launch (the
            decode step makes the down launch wait there for the shared expert's side stream, whose result it adds
            to).
        int8: the pipelined kernels' integer mode (:data:`MOE_INT8_MODES`; None: :data:`MOE_INT8_ENV` now; the
            decoders read it once when they are built, so that a captured graph and its eager steps agree).
        pdl: launch the staged and pipelined kernels by programmatic dependent launch while a graph is captured
            (:mod:`stratatools.runtime.gpu.launch`; the decoders pass their ``STRATATOOLS_PDL``).
    Returns:
        CuPy float32 ``[T, hidden]``.
    Raises:
        StrataError: unsupported types, widths that are not whole blocks, or a bad kernel choice / pipe shape.
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
        if before_down is not None:
            before_down()
        if not accumulate:
            out.fill(0)
        return out
    if hbuf is None or hbuf.size < J * ff:
        hbuf = cp.empty(J * ff, dtype=cp.float32)
    X = cp.ascontiguousarray(X, dtype=cp.float32)
    mode = moe_int8() if int8 is None else int8
    path = expert_kernel_path(jobs, gu_type, d_type, hidden, ff, fast=fast, kernels=kernels,
                              aligned=int(X.data.ptr) % 16 == 0 and int(hbuf.data.ptr) % 16 == 0,  # (float4 reads)
                              int8=mode)
    if path == "pipe":
        sh = pipe_shapes()
        one = "1" if J == 1 else ""
        pipe_gate_up(X, jobs, gu_type, hidden, ff, hbuf, sh["gu" + one], int8=mode, pdl=pdl)
        if before_down is not None:
            before_down()
        pipe_down(jobs, d_type, hidden, ff, hbuf, out, accumulate, sh["down" + one], int8=mode, pdl=pdl)
        return out
    if path == "staged":
        # staged rows (moe_staged.cu): a warp's rows copied to shared memory, then decoded from there
        staged_gate_up(X, jobs, gu_type, hidden, ff, hbuf, pdl)
        if before_down is not None:
            before_down()
        staged_down(jobs, d_type, hidden, ff, hbuf, out, accumulate, pdl)
        return out
    grid1 = ((ff + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, J)
    kernel("moe_gate_up_kernel", gu_type.id, fast)(
        grid1, (THREADS,), (jobs.gate_ptr, jobs.up_ptr, jobs.tok, X, hbuf, np.int32(hidden), np.int32(ff)),
        shared_mem=hidden * 4)
    if before_down is not None:
        before_down()
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
