"""Programmatic dependent launch (PDL) of the batch-1 decode step's kernels (issue 12: the step is ~800 short
launches bound by launch latency, not bytes), and of the prefill's and the batched step's (about 1,500 launches a
32-sequence step: :func:`batch_kernel`, :data:`BATCH_PDL_ENV`).

A kernel launched with the driver's launch attribute ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``
(value 6 of ``CUlaunchAttributeID``, CUDA driver API reference, "Data types used by CUDA driver") may be scheduled
while the kernel before it on the stream still runs, as soon as every block of that kernel has executed
``griddepcontrol.launch_dependents``; it then waits in ``griddepcontrol.wait`` until that kernel has finished. The
kernels of :data:`PDL_KERNELS` begin with ``PDL_ENTRY()`` (``pdl.cuh``): both instructions, after nothing but the
loads of their constant weights, so the launch, the block scheduling and those loads overlap the previous kernel's
end. Stream capture keeps the attribute as a programmatic edge of the CUDA graph.

CuPy's kernel call cannot set launch attributes, so :class:`PdlKernel` calls ``cuLaunchKernelEx`` through ctypes
with the CuPy kernel's own driver handle (:func:`driver_handle`); only while the current stream is being captured (the step's graphs), since a
ctypes launch costs the host more than CuPy's and eager launches gain nothing from it. ``STRATATOOLS_PDL``: ``1``
(default) or ``0``; read when a decoder is built (:func:`pdl_enabled`), which uses it on sm_90 and later devices
only (:func:`pdl_supported`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError

#: Environment variable: 1 (default) launches :data:`PDL_KERNELS` with programmatic dependent launch inside graphs.
PDL_ENV = "STRATATOOLS_PDL"

#: The kernels that begin with PDL_ENTRY() (tests/test_gpu_launch_host.py checks each body), by the name their module
#: exports (templates without their arguments).
PDL_KERNELS = frozenset({
    # decode_step.cu
    "route_topk", "rmsnorm_rows", "silu_div", "hc_mix", "hc_inject", "dot_sigmoid", "route_fused", "route_fused_sg",
    "route_warp_sg8", "route_warp_sg16", "put_row",
    # fused_step.cu
    "gdn_conv", "gdn_recur", "ple_fused", "hc_inject_rms", "matvec_f32_rows",
    # attn_step.cu, qsa_step.cu
    "attn_prep", "attn_gate_mul", "qsa_pool", "qsa_scores", "qsa_select", "attn_sel_partial", "attn_sel_combine",
    # dense_q8.cu (mv_q8r and mv_q8i after their first weight loads)
    "mv_q8r", "mv_q8r_mix", "mv_q8s", "mv_q8i",
    # moe_staged.cu
    "moe_gate_up_staged", "moe_down_staged", "moe_gate_up_pipe", "moe_down_pipe", "moe_gate_up_pipe_i8",
    "moe_down_pipe_i8",
})

#: Environment variable: 1 (default) launches :data:`BATCH_PDL_KERNELS` with programmatic dependent launch inside the
#: prefill's and the batched step's graphs (:func:`batch_kernel`); 0 launches them as CuPy does.
BATCH_PDL_ENV = "STRATATOOLS_BATCH_PDL"

#: The prefill's and the batched step's kernels that begin with PDL_ENTRY() (tests/test_gpu_launch_host.py checks each
#: body): every kernel of qmm.cu, prefill.cu, gdn_prep.cu and attn_batch.cu, by the name its module exports.
BATCH_PDL_KERNELS = frozenset({
    # qmm.cu
    "qmm_split", "qmm_sum_slices", "qmm_sum_act", "qmm_act_rows", "qmm_dense", "qmm_moe_gu", "qmm_moe_down",
    "qmm_wsplit", "qmm_jobs", "qmm_split_i8", "qmm_split_i8d", "qmm_hc_norm_split", "qmm_hc_mix_split", "qmm_sum_hc",
    "qmm_sum_act_split", "qmm_moe_gu_i8", "qmm_moe_down_i8", "qmm_dense_ring", "qmm_f32_nt",
    # prefill.cu
    "pf_route", "pf_route_warp", "pf_moe_sum", "pf_moe_sum_shared", "pf_gdn_chunk", "pf_gdn_step_rw",
    "pf_gdn_step_rwc", "pf_gdn_step_rwce", "pf_gdn_step_rwcs", "pf_gdn_warp", "pf_dequant_blobs", "pf_moe_gu",
    "pf_moe_down",
    # gdn_prep.cu, attn_batch.cu
    "pf_gdn_prep", "pf_gdn_out", "attn_prep_b", "attn_decode_b",
})

#: Launches made with the attribute by :func:`batch_kernel`'s wrappers, by kernel name (tests, notes; the wrappers
#: are made at each kernel lookup, so their own counts do not last).
BATCH_PDL_LAUNCHES: dict[str, int] = {}

#: CUlaunchAttributeID's CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h).
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


def pdl_enabled(value: str | None = None, env: str = PDL_ENV) -> bool:
    """Is programmatic dependent launch on (``value``, else the variable ``env``: :data:`PDL_ENV` or
    :data:`BATCH_PDL_ENV`; unset or empty: on)? Raises StrataError for a value other than 0 or 1."""
    v = (os.environ.get(env, "") if value is None else value).strip() or "1"
    if v not in ("0", "1"):
        raise StrataError(f"{env}={v!r}: use 1 (programmatic dependent launch inside the step's graphs) or 0")
    return v == "1"


def pdl_supported(compute_capability: str) -> bool:
    """Can a device of ``compute_capability`` (CuPy's ``Device.compute_capability``, e.g. ``"90"``) take these
    launches? sm_90 and later only: pdl.cuh compiles griddepcontrol for those alone, so on an older device a kernel
    launched early would not wait for the one before it."""
    try:
        return int(compute_capability) >= 90
    except ValueError:
        return False


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): a 4-byte id, 4 bytes of padding, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


#: The one attribute of every PdlKernel launch (read by the driver at the launch, never written).
_PDL_ATTR = _LaunchAttribute(_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1)


def kernel_param(a: Any) -> ctypes._SimpleCData:
    """One kernel argument as the C value the kernel receives, as CuPy passes it: an array (anything with
    ``.data.ptr``) or a memory pointer (``.ptr``) as its device address, None as a null pointer, a numpy scalar by
    its dtype. Raises TypeError for anything else, Python scalars included: the step's launches pass numpy scalars
    of the kernel's C types, and a Python number's width would be a guess."""
    if a is None:  # (CuPy passes None as a null pointer: the split kernels' absent row mask)
        return ctypes.c_uint64(0)
    if isinstance(a, np.generic):
        try:
            return np.ctypeslib.as_ctypes_type(a.dtype)(a.item())
        except NotImplementedError:
            raise TypeError(f"kernel argument of dtype {a.dtype} has no launch type") from None
    if isinstance(a, (bool, int, float)):
        raise TypeError(f"kernel argument {a!r}: pass a numpy scalar of the kernel's C type")
    data = getattr(a, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return ctypes.c_uint64(int(data.ptr))
    if hasattr(a, "ptr"):
        return ctypes.c_uint64(int(a.ptr))
    raise TypeError(f"kernel argument of type {type(a).__name__} has no launch type")


def launch_config(grid: tuple, block: tuple, shared_mem: int, stream: int,
                  attr: _LaunchAttribute) -> _LaunchConfig:
    """The CUlaunchConfig of one launch with the one attribute ``attr`` (grid and block: 1 to 3 dimensions)."""
    g = tuple(max(1, int(v)) for v in grid) + (1,) * (3 - len(grid))  # (CuPy launches at least 1 per dimension)
    b = tuple(max(1, int(v)) for v in block) + (1,) * (3 - len(block))
    return _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem), ctypes.c_void_p(int(stream)),
                         ctypes.pointer(attr), 1)


@functools.lru_cache(maxsize=1)
def _driver() -> Any:
    """libcuda with cuLaunchKernelEx typed (the library CuPy already loaded)."""
    lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    f = lib.cuLaunchKernelEx
    f.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    f.restype = ctypes.c_int
    return lib


class PdlKernel:
    """A CuPy kernel (``RawModule.get_function``) called as CuPy calls it, ``k(grid, block, args, shared_mem=...)``,
    that launches with programmatic dependent launch while the current stream is being captured and as plain
    CuPy otherwise. Attributes (``max_dynamic_shared_size_bytes``, ...) are the wrapped function's."""

    def __init__(self, fn: Any, name: str, switch: Any = None) -> None:
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "switch", switch)  # None, or a callable asked at each captured launch
        object.__setattr__(self, "pdl_launches", 0)  # launches made with the attribute (tests, notes)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.fn, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self.fn, attr, value)

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: Any = None) -> None:
        import cupy as cp

        st = cp.cuda.get_current_stream() if stream is None else stream
        try:
            capturing = st.is_capturing()
        except cp.cuda.runtime.CUDARuntimeError:  # (the legacy stream while another captures): not ours to capture
            capturing = False
        if not capturing or (self.switch is not None and not self.switch()):
            # eager, or switched off: CuPy's own launch (griddepcontrol.wait returns at once)
            self.fn(grid, block, args, shared_mem=shared_mem, stream=stream)
            return
        params = [kernel_param(a) for a in args]
        ptrs = (ctypes.c_void_p * max(1, len(params)))(*[ctypes.addressof(p) for p in params])
        cfg = launch_config(grid, block, shared_mem, st.ptr, _PDL_ATTR)
        rc = _driver().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(driver_handle(self.fn)), ptrs, None)
        object.__setattr__(self, "pdl_launches", self.pdl_launches + 1)
        if self.switch is not None:
            BATCH_PDL_LAUNCHES[self.name] = BATCH_PDL_LAUNCHES.get(self.name, 0) + 1
        if rc != 0:
            env = PDL_ENV if self.switch is None else BATCH_PDL_ENV
            raise StrataError(f"{self.name}: cuLaunchKernelEx failed with CUDA error {rc}; set {env}=0 to launch "
                              f"without programmatic dependent launch")


def _has_handle(fn: Any) -> bool:
    return hasattr(type(fn), "kernel") or hasattr(fn, "ptr")


def driver_handle(fn: Any) -> int:
    """The CUfunction of a CuPy kernel: ``RawKernel.kernel.ptr`` (what ``RawModule.get_function`` returns: the
    current device's ``cupy.cuda.function.Function``) or a ``Function``'s own ``ptr``."""
    return int(fn.kernel.ptr) if hasattr(type(fn), "kernel") else int(fn.ptr)


def pdl(fn: Any, name: str, enabled: bool) -> Any:
    """``fn`` wrapped in :class:`PdlKernel` when ``enabled``, ``name`` (template arguments dropped) is one of
    :data:`PDL_KERNELS` and ``fn`` has a driver handle (a CuPy ``RawKernel`` or ``Function``); else ``fn``
    itself."""
    if (not enabled or name.split("<", 1)[0] not in PDL_KERNELS or isinstance(fn, PdlKernel)
            or not _has_handle(fn)):
        return fn
    return PdlKernel(fn, name)


@functools.lru_cache(maxsize=None)
def _device_takes_pdl(device_id: int) -> bool:
    import cupy as cp

    return pdl_supported(cp.cuda.Device(device_id).compute_capability)


def batch_pdl_on() -> bool:
    """:data:`BATCH_PDL_ENV` on and the current device sm_90 or later (:func:`pdl_supported`): asked by
    :func:`batch_kernel`'s wrappers at each launch made while a stream is captured. Raises StrataError for a value
    of the variable other than 0 or 1."""
    import cupy as cp

    return pdl_enabled(env=BATCH_PDL_ENV) and _device_takes_pdl(cp.cuda.Device().id)


def batch_kernel(fn: Any, name: str) -> Any:
    """A prefill or batched-step kernel ``fn`` (``RawModule.get_function``) of export name ``name`` wrapped in
    :class:`PdlKernel`, which launches it by programmatic dependent launch while the current stream is captured and
    :func:`batch_pdl_on` says so (plain CuPy otherwise); ``fn`` itself for a name not in :data:`BATCH_PDL_KERNELS`
    (template arguments dropped) or a kernel with no driver handle."""
    if name.split("<", 1)[0] not in BATCH_PDL_KERNELS or isinstance(fn, PdlKernel) or not _has_handle(fn):
        return fn
    return PdlKernel(fn, name, batch_pdl_on)
