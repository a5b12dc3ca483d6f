"""CUDA source of the GPU dequantizers and quantized matrix-vector products, compiled once with CuPy.

The CUDA code lives in files beside this module (``prelude.cuh``: integer types; ``decoders.cuh``: the block
decoders; ``quant_kernels.cu``: dequantize / matvec / expert-FFN kernels; ``host_shim.cuh``: what lets the
decoders compile as host C++; ``step_common.cuh``: helpers the fused decode step's kernel files include), read at
run time with :func:`cuda_source` (:func:`cuda_unit` puts a file's package includes in place). Importing this module needs no CuPy:
it only builds the source text. :func:`module` compiles it (NVRTC through
``cupy.RawModule``) on first use and caches the compiled kernels.

Block layouts are ggml's (llama.cpp ``ggml-common.h``; Q2_0 from formats.md section 1). Every decoder works
on *groups of 8 consecutive values* of a block (value ``8g .. 8g+7``), so one thread decodes 8 values that
share their scale. The arithmetic follows ``gguf.quants`` (gguf 0.19.0) operation by operation, in float32,
compiled with ``--fmad=false`` so that no multiply-add is fused: results are bit-identical to the numpy path
of :mod:`stratatools.runtime.dequant`.

The i-quant grids, sign table and non-linear 4-bit values are not retyped: they are read from
``gguf.quants`` at import time (``IQ2_XS.grid`` etc. after ``init_grid()``) and written into the source as
``__device__`` arrays.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError

# ggml type ids (gguf.GGMLQuantizationType; Q2_0 = 42 per formats.md section 1).
TYPE_IDS: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
    "Q6_K": 14, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23,
    "IQ1_M": 29, "BF16": 30, "Q2_0": 42,
}

#: Kernel "unit" per type: (values, bytes). For quantized types this is the ggml block; the float types
#: use a pseudo-block of 8 values so that every type decodes in groups of 8.
UNIT: dict[int, tuple[int, int]] = {
    0: (8, 32), 1: (8, 16), 30: (8, 16),
    2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 20: (32, 18), 42: (64, 18),
    12: (256, 144), 13: (256, 176), 14: (256, 210), 17: (256, 74), 18: (256, 98), 21: (256, 110),
    22: (256, 82), 23: (256, 136), 29: (256, 56),
}


def _c_array(ctype: str, name: str, values: np.ndarray) -> str:
    vals = ",".join(str(int(v)) for v in np.asarray(values).reshape(-1))
    return f"__device__ const {ctype} {name}[{np.asarray(values).size}] = {{{vals}}};\n"


@functools.lru_cache(maxsize=1)
def tables_source() -> str:
    """The lookup tables as CUDA ``__device__`` arrays, taken from gguf.quants (never retyped)."""
    from gguf import quants

    out = []
    out.append(_c_array("u8", "KSIGNS", np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)))
    out.append(_c_array("i8", "KVALUES_IQ4NL", np.array(quants.IQ4_NL.kvalues, dtype=np.int8)))
    for cls, name, ctype in ((quants.IQ2_XS, "GRID_IQ2XS", "u8"), (quants.IQ2_S, "GRID_IQ2S", "u8"),
                             (quants.IQ3_XXS, "GRID_IQ3XXS", "u8"), (quants.IQ3_S, "GRID_IQ3S", "u8"),
                             (quants.IQ1_M, "GRID_IQ1", "i8")):
        cls.init_grid()
        grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
        as_int = grid.astype(np.int32)
        assert np.array_equal(as_int.astype(np.float32), grid), name  # integer-valued grids only
        out.append(_c_array(ctype, name, as_int))
    return "".join(out)


@functools.lru_cache(maxsize=None)
def cuda_source(name: str) -> str:
    """Text of one CUDA source file shipped in this package (``prelude.cuh``, ``decoders.cuh``,
    ``quant_kernels.cu``, ``host_shim.cuh``, ``decode_step.cu``, ``qsa_step.cu``, ``fused_step.cu``,
    ``moe_staged.cu``, ``host_kernel_shim.cuh``, ``stage_step.cu``, ...), read through importlib.resources.

    Raises StrataError when the file is missing (a broken install: reinstall the wheel)."""
    try:
        return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as e:
        raise StrataError(f"{__package__}/{name}: CUDA source missing from the installation ({e}); "
                          f"reinstall stratatools") from None


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([\w.]+)"[^\n]*\n?', re.M)


@functools.lru_cache(maxsize=None)
def cuda_unit(name: str) -> str:
    """One CUDA source file of this package as a self-contained translation unit: each ``#include "X"`` line of a
    package file (``fused_step.cu`` and ``attn_step.cu`` include ``step_common.cuh``) replaced by X's text, the
    first time X is met (later includes of it drop out; its own guard would make them empty anyway). NVRTC
    (``cupy.RawModule(code=...)``) and the host C++ builds (:func:`fused_host_source`) compile this text, so a
    helper shared by several kernel files is written once.

    Raises StrataError when a file, or a file it includes, is missing (:func:`cuda_source`)."""
    seen: set[str] = set()

    def expand(n: str) -> str:
        seen.add(n)
        return _INCLUDE.sub(lambda m: "" if m.group(1) in seen else expand(m.group(1)), cuda_source(n))

    return expand(name)


def source() -> str:
    """The whole CUDA translation unit (types, tables from gguf.quants, decoders, kernels)."""
    return (cuda_source("prelude.cuh") + tables_source() + cuda_source("decoders.cuh") + cuda_source("quant_kernels.cu")
            + cuda_unit("moe_staged.cu"))


def host_source() -> str:
    """The decoders alone, compilable as host C++17 (``g++``) with a small shim, plus an ``extern "C"``
    entry ``deq_host(type_id, src, dst, n_groups)``: lets the CPU check the GPU decoders' index arithmetic
    against :mod:`stratatools.runtime.dequant` where no GPU exists (tests/test_gpu_kernels_host.py)."""
    cases = "".join(
        f"        case {tid}: for (long long i = 0; i < n_groups; ++i) deq8<{tid}>(src + (i / {bs // 8}) * {ts}, "
        f"(int)(i % {bs // 8}), dst + 8 * i); return 0;\n" for tid, (bs, ts) in sorted(UNIT.items()))
    entry = ('extern "C" int deq_host(int type_id, const u8* src, float* dst, long long n_groups) {\n'
             "    switch (type_id) {\n" + cases + "        default: return -1;\n    }\n}\n")
    return (cuda_source("host_shim.cuh") + cuda_source("prelude.cuh") + tables_source() + cuda_source("decoders.cuh")
            + entry)


KERNEL_TEMPLATES = ("dequant_kernel", "matvec_kernel", "moe_gate_up_kernel", "moe_down_kernel")
OPTIONS = ("--std=c++17", "--fmad=false")
#: Kernels only the fast module (:func:`fast_module`) has: compiled with multiply-add fusion allowed (results differ
#: from the reference kernels by float rounding only; the dequantizers' bit-exactness is the reference module's).
FAST_TEMPLATES = ("matvec_tiled_kernel", "moe_gate_up_staged", "moe_down_staged")
#: Kernels of the fast module instantiated only for :data:`PIPE_TYPES` (moe_staged.cu's pipelined expert kernels).
PIPE_TEMPLATES = ("moe_gate_up_pipe", "moe_down_pipe")
#: ggml type ids the pipelined expert kernels decode (Q8_0, Q2_0).
PIPE_TYPES = (8, 42)
#: The pipelined kernels' integer variants (moe_staged.cu: input quantized to 16-bit fixed point, int8 dot
#: products), instantiated for :data:`PIPE_I8_TYPES` only.
PIPE_I8_TEMPLATES = ("moe_gate_up_pipe_i8", "moe_down_pipe_i8")
PIPE_I8_TYPES = (42,)
#: Reference kernels of which the fast module also holds an FMA build (``kernel(..., fast=True)``).
FAST_ALSO = ("moe_gate_up_kernel", "moe_down_kernel")
FAST_OPTIONS = ("--std=c++17",)
#: Bytes of a row segment one warp stages in shared memory (the CUDA source's SEG_BYTES) and its buffer.
SEG_BYTES = 3072
SEG_BUF = SEG_BYTES + 32
TILED_THREADS = 256


@functools.lru_cache(maxsize=1)
def module() -> Any:
    """Compile (once) and return the ``cupy.RawModule`` with every kernel instantiated for every type."""
    import cupy

    names = [f"{k}<{tid}>" for k in KERNEL_TEMPLATES for tid in sorted(UNIT)]
    return cupy.RawModule(code=source(), options=OPTIONS, name_expressions=names)


def kernel(name: str, type_id: int, fast: bool = False) -> Any:
    """The compiled kernel ``name<type_id>`` (a ``cupy.RawKernel``): from the bit-exact reference module, or with
    ``fast`` (for :data:`FAST_ALSO`; always for :data:`FAST_TEMPLATES`) from the FMA build of the same source."""
    if name in FAST_TEMPLATES or name in PIPE_TEMPLATES + PIPE_I8_TEMPLATES or (fast and name in FAST_ALSO):
        return fast_module().get_function(f"{name}<{int(type_id)}>")
    return module().get_function(f"{name}<{int(type_id)}>")


@functools.lru_cache(maxsize=1)
def fast_module() -> Any:
    """Compile (once) the :data:`FAST_TEMPLATES` and :data:`FAST_ALSO` kernels for every type, and the
    :data:`PIPE_TEMPLATES` for :data:`PIPE_TYPES` and :data:`PIPE_I8_TEMPLATES` for :data:`PIPE_I8_TYPES`, with
    multiply-add fusion allowed (``cupy.RawModule``)."""
    import cupy

    names = [f"{k}<{tid}>" for k in FAST_TEMPLATES + FAST_ALSO for tid in sorted(UNIT)]
    names += [f"{k}<{tid}>" for k in PIPE_TEMPLATES for tid in PIPE_TYPES]
    names += [f"{k}<{tid}>" for k in PIPE_I8_TEMPLATES for tid in PIPE_I8_TYPES]
    return cupy.RawModule(code=source(), options=FAST_OPTIONS, name_expressions=names)


#: moe_staged.cu's MOE_ROW_BUF / MOE_ROW_MAX: one staged row buffer, and the longest row it holds (bytes).
MOE_ROW_BUF = 3104
MOE_ROW_MAX = MOE_ROW_BUF - 32


def launch_big_shared(k: Any, grid: tuple, block: tuple, args: tuple, shm: int, name: str = "",
                      pdl: bool = False) -> None:
    """Launch ``k`` with ``shm`` bytes of dynamic shared memory, opting in past the default 48 KiB when needed; with
    ``pdl``, kernel ``name`` by programmatic dependent launch inside a graph (:func:`launch.pdl`)."""
    if pdl:
        from stratatools.runtime.gpu.launch import pdl as _pdl

        k = _pdl(k, name, True)
    if shm > 48 * 1024 and getattr(k, "max_dynamic_shared_size_bytes", 0) < shm:
        k.max_dynamic_shared_size_bytes = shm
    k(grid, block, args, shared_mem=shm)


def tiled_shared_bytes(cols: int) -> int:
    """Dynamic shared memory of :func:`matvec_tiled` for rows of ``cols`` values (x + one segment buffer a warp)."""
    return cols * 4 + (TILED_THREADS // 32) * SEG_BUF


@functools.lru_cache(maxsize=None)
def _device_limits() -> tuple[int, int]:
    import cupy

    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return int(dev["multiProcessorCount"]), int(dev.get("sharedMemPerMultiprocessor", 228 * 1024))


def matvec_tiled_launch(W: Any, x: Any, y: Any, type_id: int, rows: int, cols: int, silu_div: float = 0.0) -> None:
    """Launch ``matvec_tiled_kernel<type_id>``: ``y[r] = W[r, :] . x`` (CuPy arrays; W uint8, 16-byte aligned;
    x, y float32 contiguous); with ``silu_div`` != 0 the input is ``silu(x / silu_div)`` (applied while x is
    staged). Grid: at most the blocks that fit on the device at once (rows by grid stride)."""
    n_sm, smem_sm = _device_limits()
    shm = tiled_shared_bytes(cols)
    per_sm = max(1, min(2048 // TILED_THREADS, smem_sm // (shm + 1024)))
    blocks = max(1, min((rows + TILED_THREADS // 32 - 1) // (TILED_THREADS // 32), n_sm * per_sm))
    k = kernel("matvec_tiled_kernel", type_id)
    if shm > 48 * 1024 and getattr(k, "max_dynamic_shared_size_bytes", 0) < shm:
        k.max_dynamic_shared_size_bytes = shm
    k((blocks,), (TILED_THREADS,), (W, x, y, np.int32(rows), np.int32(cols), np.float32(silu_div)), shared_mem=shm)


def kernel_signatures(name: str) -> dict[str, list[tuple[str, str]]]:
    """The exported (``extern "C"``) kernels of the CUDA source file ``name``: {kernel: [(C type, parameter)]},
    read from the source text (used to build host entry points and to check launches' argument counts)."""

    out: dict[str, list[tuple[str, str]]] = {}
    for m in re.finditer(r'extern "C" __(?:global)__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\((.*?)\)\s*\{', cuda_source(name), flags=re.S):
        params = []
        for p in m.group(2).split(","):
            p = " ".join(p.split())
            pm = re.match(r"(.*?)(\w+)$", p)
            if pm is None:
                raise StrataError(f"{name}: cannot parse parameter {p!r} of kernel {m.group(1)}")
            params.append((pm.group(1).strip(), pm.group(2)))
        out[m.group(1)] = params
    return out


def fused_host_source(name: str = "fused_step.cu") -> str:
    """``fused_step.cu`` (or another self-contained kernel file written for any block size, e.g. ``dense_q8.cu``)
    as host C++17 (``host_kernel_shim.cuh`` first) with one ``extern "C"`` entry per kernel,
    ``host_<kernel>(grid_x, grid_y, <the kernel's parameters>)``, that runs the grid block by block with one thread
    per block (tests/test_gpu_fused_host.py and tests/test_gpu_dense_q8_host.py check the kernels' logic on the CPU
    through it). The file's package includes (``step_common.cuh``) are put in place (:func:`cuda_unit`)."""
    entries = []
    for k, params in kernel_signatures(name).items():
        decl = ", ".join(f"{t} {n}" for t, n in params)
        call = ", ".join(n for _, n in params)
        entries.append(f'extern "C" void host_{k}(unsigned gx, unsigned gy, {decl}) {{\n'
                       f"    host_run_grid(gx, gy, [&]() {{ {k}({call}); }});\n}}\n")
    return cuda_source("host_kernel_shim.cuh") + cuda_unit(name) + "".join(entries)


#: dense_q8.cu's DQ_RW (rows a warp computes together) and the block size its launches use.
DQ_RW = 2
DQ_THREADS = 256
#: Work of a row part when a Q8_0 matvec is split along its rows: at least this many 16-value chunks.
DQ_MIN_SPLIT_CHUNKS = 32


def q8_relayout(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Split Q8_0 blocks (ggml ``block_q8_0``: fp16 scale d then 32 int8 codes, 34 bytes; llama.cpp
    ggml-common.h) of a ``rows`` x ``cols`` matrix into the layout of ``dense_q8.cu``: int8 codes [rows * cols]
    (row-major) and the fp16 scales' bits, uint16 [rows * cols / 32]. Same bytes as the blocks; no float values are
    made. Raises StrataError when ``raw`` is not ``rows * cols / 32`` blocks or ``cols`` is not a multiple of 32."""
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if cols % 32 or raw.size != rows * (cols // 32) * 34:
        raise StrataError(f"Q8_0 matrix of {raw.size} bytes is not {rows} rows of {cols} values (whole blocks)")
    b = raw.reshape(rows * (cols // 32), 34)
    d = np.ascontiguousarray(b[:, :2]).view(np.uint16).reshape(-1)
    q = np.ascontiguousarray(b[:, 2:]).view(np.int8).reshape(-1)
    return q, d


def device_copy(cp: Any, a: np.ndarray) -> Any:
    """Host array ``a`` uploaded into device memory of its own (``cupy.cuda.Memory``: cudaMalloc, outside every memory
    pool, so that neither a CUDA graph's private pool nor its release can take it back; as qmm.py's split counters).
    With numpy standing for CuPy (the host tests): a copy."""
    if cp is np:
        return np.array(a, copy=True)
    out = cp.ndarray(a.shape, dtype=a.dtype, memptr=cp.cuda.MemoryPointer(cp.cuda.Memory(max(1, int(a.nbytes))), 0))
    out.set(np.ascontiguousarray(a))
    return out


class Q8R:
    """A Q8_0 matrix in ``dense_q8.cu``'s layout on the device (:func:`q8_relayout`): ``q`` int8 codes
    [rows * cols], ``d`` fp16 scale bits uint16 [rows * cols / 32]. ``size``: its device bytes (the GGUF blocks'
    size). ``own``: in device memory of its own (:func:`device_copy`) rather than the current pool's."""

    __slots__ = ("q", "d", "size")

    def __init__(self, cp: Any, raw: np.ndarray, rows: int, cols: int, own: bool = False):
        q, d = q8_relayout(raw, rows, cols)
        up = (lambda a: device_copy(cp, a)) if own else cp.asarray
        self.q, self.d = up(q), up(d)
        self.size = int(q.nbytes + d.nbytes)


def q8r_f32(xp: Any, q: Any, d: Any, row0: int, rows: int, cols: int) -> Any:
    """Rows ``row0 .. row0+rows-1`` of a Q8_0 matrix in :func:`q8_relayout`'s layout (int8 codes [R * cols], fp16
    scale bits uint16 [R * cols / 32]) as float32 [rows, cols] on ``xp``: code times scale, one float32 multiply per
    value as ggml's ``dequantize_row_q8_0`` (ggml-quants.c) does, so bit-identical to the numpy dequantizer of the
    GGUF blocks. The batched prefill and decode read the fused step's re-laid-out matrices through it."""
    a, b = row0 * cols, (row0 + rows) * cols
    qq = q[a:b].reshape(-1, 32).astype(xp.float32)
    dd = d[a // 32:b // 32].view(xp.float16).astype(xp.float32)
    return (qq * dd[:, None]).reshape(rows, cols)


#: dense_q8.cu's DQS_U (chunks of 16 values a lane holds per window in ``mv_q8s``) and DQS_MINB (its blocks per SM).
DQS_U = 8
DQS_BLOCKS_PER_SM = 3
#: The decoder multiplies a matrix through ``mv_q8i`` (or ``mv_q8s``) when it has at least this many rows per SM (the 2,560-row
#: output projections and up); fewer, longer rows (the hyper-connection down projection) go to ``mv_q8r``'s row parts.
DQS_MIN_ROWS_PER_SM = 8
#: Environment variable overriding :data:`DQS_MIN_ROWS_PER_SM` (a whole number; 0 sends every re-laid-out matrix,
#: the hyper-connection down projections included, to ``mv_q8i``), for measuring the split on a device.
DENSE_MIN_ROWS_ENV = "STRATATOOLS_DENSE_MIN_ROWS"


def env_count(name: str, default: int, minimum: int, unit: str) -> int:
    """The whole number (ASCII digits) in environment variable ``name``, else ``default``. Raises StrataError
    naming the variable for another value or one below ``minimum``."""
    import os

    v = os.environ.get(name, "").strip()
    if not v:
        return default
    if not (v.isascii() and v.isdigit()) or int(v) < minimum:
        raise StrataError(f"{name}={v!r}: use a whole number of {unit} ({minimum} or more)")
    return int(v)


#: Whether the fused decode step runs the shared expert on a second stream beside the routed experts' gate/up
#: (``1``, the default) or after the routed experts on the step's stream (``0``); the logits are the same bit for
#: bit (the routed down adds its sum to the shared expert's, a sum of two floats in either order). The batched step
#: (:mod:`stratatools.runtime.gpu.batch`) follows it too, except with ``STRATATOOLS_BATCH_GEMM=hgemm``.
SHARED_SIDE_ENV = "STRATATOOLS_SHARED_SIDE"


def begin_capture(cp: Any, stream: Any) -> None:
    """Start capturing ``stream`` into a CUDA graph in relaxed mode (calls such as kernel attribute settings stay
    allowed, and so is a first allocation of a memory pool; an older CuPy without the mode argument: its default)."""
    mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)
    try:
        stream.begin_capture(mode=mode) if mode is not None else stream.begin_capture()
    except TypeError:
        stream.begin_capture()


def env_on(name: str, meaning: str, default: bool = True) -> bool:
    """Environment flag ``name`` (unset or empty: ``default``); raises StrataError for a value other than 0 or 1,
    saying that 1 means ``meaning``."""
    import os

    v = os.environ.get(name, "").strip() or ("1" if default else "0")
    if v not in ("0", "1"):
        raise StrataError(f"{name}={v!r}: use 1 ({meaning}) or 0")
    return v == "1"


def shared_side() -> bool:
    """:data:`SHARED_SIDE_ENV` as a flag (default on); raises StrataError for a value other than 0 or 1."""
    return env_on(SHARED_SIDE_ENV, "the shared expert beside the routed ones")


_env_on = env_on  # (the name decode.py's flags use)


def env_choice(name: str, choices: tuple[int, ...], default: int) -> int:
    """The whole number (ASCII digits) in environment variable ``name`` when it is one of ``choices``, ``default``
    when unset or empty. Raises StrataError naming the variable and the choices for another value."""
    import os

    v = os.environ.get(name, "").strip()
    if not v:
        return default
    if not (v.isascii() and v.isdigit()) or int(v) not in choices:
        raise StrataError(f"{name}={v!r}: use one of {', '.join(map(str, choices))}")
    return int(v)


def dense_min_rows_per_sm() -> int:
    """Rows per SM from which the decoder's Q8_0 matvec runs ``mv_q8i`` / ``mv_q8s`` rather than ``mv_q8r``:
    :data:`DENSE_MIN_ROWS_ENV`, else :data:`DQS_MIN_ROWS_PER_SM`. Raises StrataError for a value that is not a
    whole number of at least 0."""
    return env_count(DENSE_MIN_ROWS_ENV, DQS_MIN_ROWS_PER_SM, 0, "rows per SM")
#: dense_q8.cu's DQI_U (chunks a lane holds per window in ``mv_q8i``) and DQI_MINB (its blocks per SM).
DQI_U = 5
DQI_BLOCKS_PER_SM = 4
#: Dense kernel choice of the fast step: ``int8`` (the default: ``mv_q8i``, int8 dot products on x quantized per
#: block of 32 to 16-bit fixed point, on tall matrices and the hyper-connection mix, ``mv_q8r`` with row parts on the
#: few-row ones; on the H200 1.4-1.5x ``mv_q8s`` on the 34 MB projections and 1.08x the decode step, logits within
#: 1.7e-5 of the reference step at 48 layers: bench/gpu-notes.md, eighth pass), ``stream`` (the same with
#: ``mv_q8s``, float dot products: the default before) or ``rows`` (``mv_q8r`` / ``mv_q8r_mix`` only; the earlier
#: path, kept for comparison in the benchmarks).
DENSE_KERNEL_ENV = "STRATATOOLS_DENSE_KERNEL"
DENSE_KERNELS = ("int8", "stream", "rows")


def dense_kernel() -> str:
    """The fast step's dense Q8_0 kernel family, from :data:`DENSE_KERNEL_ENV` (default ``int8``); raises
    StrataError for another value."""
    import os

    v = os.environ.get(DENSE_KERNEL_ENV, "int8").strip() or "int8"
    if v not in DENSE_KERNELS:
        raise StrataError(f"{DENSE_KERNEL_ENV}={v!r}: use int8, stream or rows")
    return v


def dqs_launch_shape(nout: int, cols: int, n_sm: int, hc: int = 0, threads: int = DQ_THREADS, u_max: int = DQS_U,
                     blocks_per_sm: int = DQS_BLOCKS_PER_SM) -> tuple[int, int, int, int]:
    """(blocks, lanes per row, chunks per lane per window, dynamic shared bytes) of a ``mv_q8s`` launch with
    ``nout`` outputs (rows, or in mix mode the n outputs of hc rows each) of ``cols`` values (a multiple of 32).
    Lanes per row: the largest power of two <= 32 that leaves each lane at least 4 chunks of 16 values; a lane's
    chunks are cut into the fewest windows of at most ``u_max`` (the module's DQS_U), all of one size. Blocks:
    enough for every output group, at most ``blocks_per_sm`` per SM (the kernel walks the rest). Raises StrataError
    for ``cols`` not a multiple of 32."""
    if cols <= 0 or cols % 32:
        raise StrataError(f"mv_q8s: rows of {cols} values are not whole Q8_0 blocks of 32")
    nch = cols // 16
    lpr = 1
    while lpr * 2 <= 32 and lpr * 2 * 4 <= nch:
        lpr *= 2
    per_lane = -(-nch // lpr)
    windows = -(-per_lane // u_max)
    u = -(-per_lane // windows)
    lanes = min(32, threads)
    nhs = 1
    if hc > 0:
        while nhs * 2 <= hc and lpr * nhs * 2 <= lanes and hc % (nhs * 2) == 0:
            nhs *= 2
    gpw = max(1, lanes // min(lanes, lpr * nhs))
    warps = max(1, (threads + 31) // 32)
    blocks = max(1, min(-(-nout // (gpw * warps)), blocks_per_sm * max(1, n_sm)))
    return blocks, lpr, u, 4 * cols


def dqi_shared_bytes(cols: int) -> int:
    """Dynamic shared bytes of ``mv_q8i`` for rows of ``cols`` values: x's hi and lo int8 planes (``cols`` bytes
    each) and one float scale per block of 32 (dense_q8.cu's DQI_SHARED_BYTES)."""
    return 2 * cols + 4 * (cols // 32)


def dqi_launch_shape(nout: int, cols: int, n_sm: int, hc: int = 0,
                     threads: int = DQ_THREADS) -> tuple[int, int, int, int]:
    """(blocks, lanes per row, chunks per lane per window, dynamic shared bytes) of a ``mv_q8i`` launch: the work
    split of :func:`dqs_launch_shape` (``mv_q8i`` keeps ``mv_q8s``'s) with windows of at most :data:`DQI_U` chunks,
    at most :data:`DQI_BLOCKS_PER_SM` blocks per SM and :func:`dqi_shared_bytes`. (``mv_q8i`` also runs correctly
    with :func:`dqs_launch_shape`'s own shapes.) Raises StrataError for ``cols`` not a multiple of 32."""
    blocks, lpr, u, _ = dqs_launch_shape(nout, cols, n_sm, hc=hc, threads=threads, u_max=DQI_U,
                                         blocks_per_sm=DQI_BLOCKS_PER_SM)
    return blocks, lpr, u, dqi_shared_bytes(cols)


#: Blocks per SM a ``mv_q8r`` launch of few row blocks aims at by splitting its rows (:func:`dq_launch_shape`), and
#: the environment variable that overrides it (a whole number from 1), for measuring the split on a device. 1: the
#: 48 x 256 model's hyper-connection down projections in 7 parts instead of 20 (4, before) decoded 166.5 against
#: 164.4 tokens/s and 169.2 against 167.2 in two calls on an H200 (mv_q8r 0.74 against 0.79 ms a step;
#: bench/gpu-notes.md, twelfth pass).
DQ_SPLIT_BLOCKS_PER_SM = 1
DQ_SPLIT_ENV = "STRATATOOLS_DQ_SPLIT_BLOCKS"


def dq_split_blocks_per_sm() -> int:
    """:data:`DQ_SPLIT_ENV`, else :data:`DQ_SPLIT_BLOCKS_PER_SM`. Raises StrataError for a value that is not a whole
    number of at least 1."""
    return env_count(DQ_SPLIT_ENV, DQ_SPLIT_BLOCKS_PER_SM, 1, "blocks per SM")


def dq_launch_shape(rows: int, cols: int, n_sm: int, threads: int = DQ_THREADS) -> tuple[int, int, int]:
    """(row blocks, row parts, dynamic shared bytes) of a ``mv_q8r`` launch: rows in blocks of DQ_RW rows per warp;
    a matrix with fewer row blocks than twice the SMs (about :func:`dq_split_blocks_per_sm` blocks per SM wanted, 1 by
    default) is split along its rows into parts of at least :data:`DQ_MIN_SPLIT_CHUNKS` chunks of 16 values."""
    rpb = DQ_RW * max(1, (threads + 31) // 32)
    gx = (rows + rpb - 1) // rpb
    nch = cols // 16
    ks = 1
    if gx < 2 * max(1, n_sm):  # too few row blocks to keep every SM busy: split the rows
        ks = max(1, min(nch // DQ_MIN_SPLIT_CHUNKS, -(-dq_split_blocks_per_sm() * max(1, n_sm) // gx)))
    cps = -(-nch // ks)
    ks = -(-nch // cps)  # no empty part
    return gx, ks, 64 * cps


def experts_host_source(type_ids: tuple[int, ...]) -> str:
    """The staged expert kernels (``moe_staged.cu``) with the decoders and ``quant_kernels.cu`` as host C++17, with
    entries ``host_moe_gate_up_staged_<T>(gx, gy, ...)`` / ``host_moe_down_staged_<T>(gx, gy, ...)`` (the kernels'
    parameters; one thread per block) for each ggml type id in ``type_ids``, and ``host_moe_gate_up_pipe_<T>`` /
    ``host_moe_down_pipe_<T>`` for those of :data:`PIPE_TYPES` (``host_moe_gate_up_pipe_i8_<T>`` /
    ``host_moe_down_pipe_i8_<T>`` for :data:`PIPE_I8_TYPES`; tests/test_gpu_fused_host.py)."""
    gu = ("const u64* gate_ptr, const u64* up_ptr, const int* tok, const float* X, float* Hbuf, int H, int F",
          "gate_ptr, up_ptr, tok, X, Hbuf, H, F")
    dn = ("const u64* down_ptr, const float* w, const int* tstart, const float* Hbuf, float* Y, int H, int F, "
          "int accumulate", "down_ptr, w, tstart, Hbuf, Y, H, F, accumulate")
    gup = ("const u64* gate_ptr, const u64* up_ptr, const int* tstart, const float* X, float* Hbuf, int H, int F, "
           "int nstage", "gate_ptr, up_ptr, tstart, X, Hbuf, H, F, nstage")
    dnp = (dn[0] + ", int nstage, int max_jobs", dn[1] + ", nstage, max_jobs")
    kinds = [("moe_gate_up_staged", gu), ("moe_down_staged", dn)]
    entries = []
    for tid in type_ids:
        for name, (decl, call) in (kinds + ([("moe_gate_up_pipe", gup), ("moe_down_pipe", dnp)]
                                            if int(tid) in PIPE_TYPES else [])
                                   + ([("moe_gate_up_pipe_i8", gup), ("moe_down_pipe_i8", dnp)]
                                      if int(tid) in PIPE_I8_TYPES else [])):
            entries.append(f'extern "C" void host_{name}_{int(tid)}(unsigned gx, unsigned gy, {decl}) {{\n'
                           f"    host_run_grid(gx, gy, [&]() {{ {name}<{int(tid)}>({call}); }});\n}}\n")
    return (cuda_source("host_kernel_shim.cuh") + cuda_source("host_shim.cuh") + cuda_source("prelude.cuh")
            + tables_source() + cuda_source("decoders.cuh") + cuda_source("quant_kernels.cu")
            + cuda_unit("moe_staged.cu") + "".join(entries))
