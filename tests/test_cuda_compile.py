"""Every CUDA module the GPU runtime loads compiles for the device (NVRTC, compute_90) with the options and template
instantiations the runtime asks for. NVRTC is a host library (the ``nvidia-cuda-nvrtc`` wheel of the test extra): this
runs without a GPU, so CI catches a kernel that only the host C++ build (the ``*_host`` tests) accepted, e.g. a
device-only construct used wrongly. Skips when libnvrtc is not installed."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
from pathlib import Path

import pytest

from stratatools.runtime.gpu import kernels as K
from stratatools.runtime.gpu.kernels import cuda_source, cuda_unit, tables_source


def _nvrtc():
    """libnvrtc from the nvidia-cuda-nvrtc wheel (nvidia/cu13/lib or nvidia/cuda_nvrtc/lib), else the system's."""
    spec = importlib.util.find_spec("nvidia")
    cands = []
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            cands += sorted(Path(root).glob("*/lib/libnvrtc.so*"))
    found = ctypes.util.find_library("nvrtc")
    if found:
        cands.append(Path(found))
    for c in cands:
        try:
            return ctypes.CDLL(str(c))
        except OSError:
            continue
    return None


LIB = _nvrtc()
pytestmark = pytest.mark.skipif(LIB is None, reason="libnvrtc (the nvidia-cuda-nvrtc wheel) is not installed")


def _compile(name: str, src: str, options: tuple[str, ...], names: list[str] = ()) -> tuple[int, str]:
    """(NVRTC result code, log) of compiling ``src`` for compute_90 with ``options`` and name expressions."""
    prog = ctypes.c_void_p()
    assert LIB.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) == 0
    try:
        for n in names:
            assert LIB.nvrtcAddNameExpression(prog, n.encode()) == 0
        opts = [o.encode() for o in options] + [b"-arch=compute_90"]
        rc = LIB.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        LIB.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(max(1, size.value))
        LIB.nvrtcGetProgramLog(prog, log)
        return rc, log.value.decode(errors="replace")
    finally:
        LIB.nvrtcDestroyProgram(ctypes.byref(prog))


def _modules():
    """(name, source, options, name expressions) of each module, as the runtime builds it (kernels.module /
    fast_module, decode.py's step modules, batch.py, prefill.py, qmm.py)."""
    from stratatools.runtime.gpu import qmm

    step = ("--std=c++17",)
    ref_names = [f"{k}<{t}>" for k in K.KERNEL_TEMPLATES for t in sorted(K.UNIT)]
    fast_names = [f"{k}<{t}>" for k in K.FAST_TEMPLATES + K.FAST_ALSO for t in sorted(K.UNIT)]
    fast_names += [f"{k}<{t}>" for k in K.PIPE_TEMPLATES for t in K.PIPE_TYPES]
    fast_names += [f"{k}<{t}>" for k in K.PIPE_I8_TEMPLATES for t in K.PIPE_I8_TYPES]
    pf = cuda_source("prelude.cuh") + tables_source() + cuda_source("decoders.cuh") + cuda_unit("prefill.cu")
    return [
        ("reference", K.source(), K.OPTIONS, ref_names),
        ("fast", K.source(), K.FAST_OPTIONS, fast_names),
        ("decode_step", cuda_unit("decode_step.cu"), step, []),
        ("fused_step", cuda_unit("fused_step.cu"), step, []),
        ("attn_step", cuda_unit("attn_step.cu"), step, []),
        ("dense_q8", cuda_unit("dense_q8.cu"), step, []),
        ("miss_fetch", cuda_source("miss_fetch.cu"), step, []),
        ("qsa_step", cuda_unit("qsa_step.cu"), step, []),
        ("stage_step", cuda_source("stage_step.cu"), step, []),
        ("attn_batch", cuda_unit("attn_batch.cu"), step, []),
        ("gdn_prep", cuda_unit("gdn_prep.cu"), step, []),
        ("prefill_exact", pf, ("--std=c++17", "--fmad=false"), [f"pf_dequant_blobs<{t}>" for t in (8, 42)]),
        ("prefill_fast", pf, step, [f"{k}<{t}>" for k in ("pf_moe_gu", "pf_moe_down") for t in (8, 42)]),
        ("qmm", qmm.device_source(), step, qmm.kernel_names()),
    ]


@pytest.mark.parametrize("mod", _modules(), ids=lambda m: m[0])
def test_cuda_module_compiles_for_the_device(mod):
    name, src, options, names = mod
    rc, log = _compile(name, src, options, names)
    assert rc == 0, f"{name}: NVRTC error {rc}\n{log[:4000]}"


def test_the_device_compiler_check_can_fail():
    rc, log = _compile("bad", 'extern "C" __global__ void f(float* y) { y[0] = undefined_name; }', ("--std=c++17",))
    assert rc != 0 and "undefined_name" in log
