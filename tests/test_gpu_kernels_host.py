"""The GPU decoders' index arithmetic, checked on the CPU: the CUDA decoders of stratatools.runtime.gpu.kernels compiled
as host C++ (g++, no fused multiply-add) must give exactly stratatools.runtime.dequant's values, on random blocks of every
type and on the kit's real tensors. Skips where no C++ compiler is installed."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

from stratatools.runtime.dequant import SUPPORTED_TYPES, dequantize
from stratatools.runtime.gpu import kernels as K
from stratatools.model.ggml_types import type_by_name
from stratatools.model.gguf import open_model

from test_dequant import KIT_FILES, random_blocks, same_bits


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the host copy of the GPU decoders")
    d = tmp_path_factory.mktemp("deqhost")
    src = d / "deq_host.cpp"
    src.write_text(K.host_source())
    so = d / "deq_host.so"
    subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-o", str(so), str(src)],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    lib.deq_host.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
    lib.deq_host.restype = ctypes.c_int
    return lib


def host_dequant(lib, raw: np.ndarray, tname: str) -> np.ndarray:
    t = type_by_name(tname)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.size // t.type_size * t.block_size
    out = np.full(n, np.nan, dtype=np.float32)
    assert lib.deq_host(t.id, raw.ctypes.data, out.ctypes.data, n // 8) == 0
    return out


@pytest.mark.parametrize("tname", SUPPORTED_TYPES)
def test_host_decoders_match_cpu_random(host_lib, tname):
    raw = random_blocks(tname, 48, seed=11 + len(tname))
    ref = dequantize(raw, tname)
    got = host_dequant(host_lib, raw, tname)
    assert same_bits(got, ref), tname
    assert np.count_nonzero(ref) > 0


@pytest.mark.kit
@pytest.mark.parametrize("rel", KIT_FILES)
def test_host_decoders_match_cpu_kit(host_lib, kit, rel):
    if not (kit / rel).exists():
        pytest.skip(f"{rel} is not in this copy of the kit")
    with open_model(kit / rel) as m:
        seen = {}
        for t in m.iter_tensors():
            seen.setdefault(t.type.name, t)
        for tname, info in seen.items():
            raw = np.array(m.raw(info))
            assert same_bits(host_dequant(host_lib, raw, tname), dequantize(raw, tname)), (rel, info.name)


def test_tables_come_from_gguf():
    """The lookup tables in the CUDA source are gguf.quants' own (parsed back from the source text)."""
    from gguf import quants

    src = K.tables_source()

    def arr(name):
        m = re.search(rf"{name}\[(\d+)\] = \{{([^}}]*)\}}", src)
        assert m, name
        return np.array([int(v) for v in m.group(2).split(",")])

    assert np.array_equal(arr("KSIGNS"), np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8))
    assert arr("KVALUES_IQ4NL").tolist() == list(quants.IQ4_NL.kvalues)
    for cls, name in ((quants.IQ2_XS, "GRID_IQ2XS"), (quants.IQ2_S, "GRID_IQ2S"), (quants.IQ3_XXS, "GRID_IQ3XXS"),
                      (quants.IQ3_S, "GRID_IQ3S"), (quants.IQ1_M, "GRID_IQ1")):
        cls.init_grid()
        assert np.array_equal(arr(name), np.asarray(cls.grid).reshape(-1).astype(np.int64)), name


def test_every_supported_type_has_a_kernel_unit():
    for tname in SUPPORTED_TYPES:
        t = type_by_name(tname)
        assert t.id in K.UNIT
        bs, ts = K.UNIT[t.id]
        if t.block_size > 1:
            assert (bs, ts) == (t.block_size, t.type_size)
        else:
            assert bs == 8 and ts == 8 * t.type_size


def test_cuda_sources_are_package_files():
    """The CUDA code is read from the package's .cu/.cuh files (no source text left in the Python modules), and
    every kernel the launchers ask for is defined in what they compile."""
    from pathlib import Path

    import stratatools.runtime.gpu as g
    from stratatools.core.errors import StrataError

    here = Path(g.__file__).parent
    for name in ("prelude.cuh", "decoders.cuh", "quant_kernels.cu", "host_shim.cuh", "decode_step.cu", "qsa_step.cu",
                 "fused_step.cu", "moe_staged.cu", "host_kernel_shim.cuh", "step_common.cuh", "attn_step.cu",
                 "cp_async.cuh", "pdl.cuh"):
        assert (here / name).is_file(), name
        assert K.cuda_source(name) == (here / name).read_text(encoding="utf-8")
    src = K.source()
    assert not re.search(r'^\s*#include "', src, re.M)  # package includes put in place (cuda_unit): NVRTC has no path
    for k in K.KERNEL_TEMPLATES + K.FAST_TEMPLATES + K.PIPE_TEMPLATES:
        assert re.search(rf"__global__ void (__launch_bounds__\(\d+(, \d+)?\) )?{k}\(", src), k
    dec = K.cuda_unit("decode_step.cu")
    for k in ("route_topk", "rmsnorm_rows", "silu_div", "hc_mix", "hc_inject", "dot_sigmoid", "route_fused",
              "route_fused_sg", "put_row"):
        assert f'extern "C" __global__ void {k}(' in dec, k
    qsa = K.cuda_unit("qsa_step.cu")
    for k in ("qsa_pool", "qsa_scores", "qsa_select", "attn_sel_partial", "attn_sel_combine"):
        assert f'extern "C" __global__ void {k}(' in qsa, k
    for py in ("kernels.py", "decode.py"):
        assert "__global__" not in (here / py).read_text(encoding="utf-8"), py
    with pytest.raises(StrataError, match="missing from the installation"):
        K.cuda_source("no-such-file.cu")


def test_step_helpers_are_written_once_and_put_in_place():
    """fused_step.cu and attn_step.cu share step_common.cuh's helpers (sigmoid, softplus, block sum, dynamic shared
    memory) through one #include, which cuda_unit replaces by the header's text (NVRTC gets no include path): the
    helpers are defined in the header only, each unit holds them once and no #include line is left."""
    from pathlib import Path

    import stratatools.runtime.gpu as g

    here = Path(g.__file__).parent
    defs = re.compile(r"float (\w+_)?(sigm|softplus|block_sum|warp_sum)\(float|define \w*DYN_SHARED")
    for name in ("fused_step.cu", "attn_step.cu"):
        raw = K.cuda_source(name)
        assert raw.count('#include "step_common.cuh"') == 1 and not defs.search(raw), name
        unit = K.cuda_unit(name)
        assert not re.search(r"^\s*#\s*include", unit, re.M), name
        assert unit.count("__device__ float step_block_sum(float v, float* red)") == 1, name
        assert unit.count("#define STRATA_STEP_COMMON_CUH") == 1 and K.cuda_source("step_common.cuh") in unit
        assert K.cuda_source("host_kernel_shim.cuh") + unit in K.fused_host_source(name)
    others = [f.name for f in sorted(here.glob("*.cu*")) if f.name != "step_common.cuh"
              and re.search(r"\bstep_(sigm|softplus|block_sum)\b", f.read_text()) and
              '#include "step_common.cuh"' not in f.read_text()]
    assert others == []
    for name in ("quant_kernels.cu", "miss_fetch.cu"):  # files without includes are unchanged
        assert K.cuda_unit(name) == K.cuda_source(name)
