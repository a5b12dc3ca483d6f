"""Programmatic dependent launch (stratatools.runtime.gpu.launch, pdl.cuh), checked without a GPU: every kernel the
decoder may launch with the attribute begins with PDL_ENTRY() (only constant weight loads before it), the ctypes
structures have cuda.h's layout, kernel arguments become the C values CuPy would pass, and the wrapper leaves other
kernels alone. (tests/test_gpu_decode.py checks on the device that the step is the same bit for bit.)"""

from __future__ import annotations

import ctypes
import re
import types

import numpy as np
import pytest

from stratatools.core.errors import StrataError
from stratatools.runtime.gpu import kernels as K
from stratatools.runtime.gpu import launch as L

STEP_FILES = ("decode_step.cu", "fused_step.cu", "attn_step.cu", "qsa_step.cu", "dense_q8.cu", "moe_staged.cu")
#: the prefill's and the batched step's kernel files (launch.batch_kernel)
BATCH_FILES = ("qmm.cu", "prefill.cu", "gdn_prep.cu", "attn_batch.cu")
#: kernels whose first weight loads come before PDL_ENTRY(), and the parameters those loads must not touch
LATE_ENTRY = {"mv_q8r": ("x", "y", "part", "counter", "xdiv"), "mv_q8i": ("x", "y", "hn", "xdiv")}


def _bodies(files: tuple[str, ...] = STEP_FILES) -> dict[str, str]:
    """{kernel name: body text} of every __global__ kernel of ``files``."""
    out = {}
    for f in files:
        src = K.cuda_source(f)
        for m in re.finditer(r"__global__ void (?:__launch_bounds__\((?:[^()]|\([^()]*\))*\) )?(\w+)\(", src):
            i, depth = m.end(), 1
            while depth:
                depth += (src[i] == "(") - (src[i] == ")")
                i += 1
            j = src.index("{", i)
            k, depth = j + 1, 1
            while depth:
                depth += (src[k] == "{") - (src[k] == "}")
                k += 1
            out[m.group(1)] = src[j + 1:k - 1]
    return out


def test_every_step_kernel_begins_with_pdl_entry():
    bodies = _bodies()
    assert set(bodies) == set(L.PDL_KERNELS)  # every kernel of the step files, and nothing else
    for name, body in bodies.items():
        assert body.count("PDL_ENTRY();") == 1, name
        before = body.split("PDL_ENTRY();")[0]
        if name in LATE_ENTRY:
            code = re.sub(r"//[^\n]*", "", before)
            assert "__ldg(" in code and "__syncthreads" not in code and "stage" not in code, name
            for p in LATE_ENTRY[name]:
                assert not re.search(rf"(?<![.\w]){p}\b", code), (name, p)  # (not .x of a dim3)
        else:
            assert before.strip() == "", (name, before[:80])


def test_every_batch_kernel_begins_with_pdl_entry():
    bodies = _bodies(BATCH_FILES)
    assert set(bodies) == set(L.BATCH_PDL_KERNELS)  # every kernel of the files, and nothing else
    assert not set(bodies) & set(L.PDL_KERNELS)
    for name, body in bodies.items():
        assert body.count("PDL_ENTRY();") == 1, name
        before = re.sub(r"//[^\n]*", "", body.split("PDL_ENTRY();")[0])
        if name == "qmm_dense_ring":  # set-up from its arguments, the tokens' rows, then its first weights' copies
            assert before.count("qmm_ring_issue<QMM_ISSUE_W>(") == 1 and "qmm_ring_copy" not in before
            assert before.count("qmm_ring_issue") == 1 and "qmm_stage" not in before
            assert not re.search(r"\b(?:Y|P|cnt|xsc|xhi|xlo)\s*\[", before) and "__ldg" not in before
            assert not re.search(r"\bdst\s*\[|atomic", before)
        elif name in ("pf_gdn_step_rwce", "pf_gdn_step_rwcs"):  # the places' state (only the kernel writes it)
            assert re.sub(r"\s+", " ", before).strip() in (
                "float s[PF_GDN_RW_ROWS]; pf_gdn_step_rw_load<%s>(S, dk, dv, (int)blockIdx.y, (int)blockIdx.x, s);"
                % cs for cs in ("false", "true")), name
        elif name == "qmm_f32_nt":  # its slice of the weights (constant) into shared memory
            assert before.count("__ldg(") == 1 and "W +" in before and "__syncthreads" not in before
            assert not re.search(r"\b(?:X|P)\s*[\[+]", before)
        else:
            assert before.strip() == "", (name, before[:80])
    units = [K.cuda_unit(f) for f in BATCH_FILES]
    assert all("griddepcontrol.wait;" in u and not re.search(r'^\s*#include "', u, re.M) for u in units)


def test_batch_kernel_wraps_only_the_listed_kernels(monkeypatch):
    class Fn:  # stands for a CuPy RawKernel (a driver handle, a call)
        kernel = types.SimpleNamespace(ptr=0x1234)

        def __init__(self):
            self.calls = []

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            self.calls.append((grid, block, args, shared_mem))

    fn = Fn()
    k = L.batch_kernel(fn, "qmm_dense_ring<4, 3, 128, 2, 1, 4>")
    assert isinstance(k, L.PdlKernel) and k.switch is L.batch_pdl_on and k.fn is fn
    assert L.batch_kernel(k, "qmm_jobs") is k
    other = Fn()
    assert L.batch_kernel(other, "route_topk") is other and L.batch_kernel(other, "cupy_copy") is other
    assert L.batch_kernel(object(), "qmm_jobs").__class__ is object  # no driver handle: left alone
    monkeypatch.setenv(L.BATCH_PDL_ENV, "2")
    with pytest.raises(StrataError, match=L.BATCH_PDL_ENV):
        L.pdl_enabled(env=L.BATCH_PDL_ENV)
    for v, on in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv(L.BATCH_PDL_ENV, v)
        assert L.pdl_enabled(env=L.BATCH_PDL_ENV) is on
    monkeypatch.setenv(L.PDL_ENV, "0")  # the decode step's switch is another variable
    assert L.pdl_enabled(env=L.BATCH_PDL_ENV) is True and L.pdl_enabled() is False


def test_step_files_include_pdl_header_and_it_is_a_no_op_on_the_host():
    for f in STEP_FILES:
        unit = K.cuda_unit(f)
        assert "griddepcontrol.wait;" in unit and "griddepcontrol.launch_dependents;" in unit, f
        assert not re.search(r'^\s*#include "', unit, re.M), f
    hdr = K.cuda_source("pdl.cuh")
    assert hdr.count("__CUDA_ARCH__ >= 900") == 2  # host builds and older devices compile both away


def test_launch_structures_have_the_driver_layout():
    assert ctypes.sizeof(L._LaunchAttribute) == 72
    assert L._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(L._LaunchConfig) == 56
    assert (L._LaunchConfig.sharedMemBytes.offset, L._LaunchConfig.hStream.offset, L._LaunchConfig.attrs.offset,
            L._LaunchConfig.numAttrs.offset) == (24, 32, 40, 48)
    attr = L._LaunchAttribute(L._ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1)
    raw = bytes(attr)
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")
    assert L.launch_config((0,), (0, 2), 0, 0, attr).gridDimX == 1  # at least 1 a dimension, as CuPy launches
    assert L.launch_config((0,), (0, 2), 0, 0, attr).blockDimY == 2
    cfg = L.launch_config((7, 3), (256,), 4096, 0xABC0, attr)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (7, 3, 1, 256, 1, 1)
    assert cfg.sharedMemBytes == 4096 and cfg.hStream == 0xABC0 and cfg.numAttrs == 1
    assert cfg.attrs.contents.id == 6 and cfg.attrs.contents.value == 1


def test_kernel_params_are_the_values_cupy_passes():
    arr = types.SimpleNamespace(data=types.SimpleNamespace(ptr=0x7F0000001000))
    mem = types.SimpleNamespace(ptr=0x7F0000002000)
    cases = [(np.int32(-5), ctypes.c_int32, -5), (np.float32(1.5), ctypes.c_float, 1.5),
             (np.uint64(2 ** 63 + 7), ctypes.c_uint64, 2 ** 63 + 7), (np.int64(-2 ** 40), ctypes.c_int64, -2 ** 40),
             (np.bool_(True), ctypes.c_bool, True), (arr, ctypes.c_uint64, 0x7F0000001000),
             (mem, ctypes.c_uint64, 0x7F0000002000), (None, ctypes.c_uint64, 0)]  # (None: CuPy's null pointer)
    for a, ctype, want in cases:
        p = L.kernel_param(a)
        assert type(p) is ctype and p.value == want, (a, p)
    assert bytes(L.kernel_param(np.float32(1.5))) == np.float32(1.5).tobytes()
    for bad in ("x", 3, 0.25, True):  # Python scalars: their C width would be a guess
        with pytest.raises(TypeError):
            L.kernel_param(bad)
    with pytest.raises(TypeError):
        L.kernel_param(np.complex64(1))


class _Fn:
    """Stands in for a CuPy function: a driver handle and an attribute the launchers set."""
    ptr = 0x1234

    def __init__(self):
        self.max_dynamic_shared_size_bytes = 0


def test_pdl_wraps_only_step_kernels_with_a_handle():
    f = _Fn()
    assert L.pdl(f, "hc_inject_rms", False) is f
    assert L.pdl(f, "fetch_blobs", True) is f  # not a step kernel: no PDL_ENTRY
    nohandle = object()
    assert L.pdl(nohandle, "hc_inject_rms", True) is nohandle
    w = L.pdl(f, "moe_gate_up_pipe_i8<42>", True)
    assert isinstance(w, L.PdlKernel) and w.fn is f and w.name == "moe_gate_up_pipe_i8<42>"
    assert L.pdl(w, "moe_gate_up_pipe_i8<42>", True) is w
    w.max_dynamic_shared_size_bytes = 99 * 1024  # kernels.launch_big_shared opts in through the wrapper
    assert f.max_dynamic_shared_size_bytes == 99 * 1024 and w.max_dynamic_shared_size_bytes == 99 * 1024
    assert w.ptr == 0x1234 and w.pdl_launches == 0 and L.driver_handle(w.fn) == 0x1234


class _RawKernel:
    """Stands in for cupy.RawKernel: the handle is its current device's Function's (a property)."""

    @property
    def kernel(self):
        return types.SimpleNamespace(ptr=0x5678)


def test_pdl_takes_the_handle_of_a_raw_kernel():
    rk = _RawKernel()
    w = L.pdl(rk, "mv_q8i", True)
    assert isinstance(w, L.PdlKernel) and L.driver_handle(rk) == 0x5678


def test_pdl_env(monkeypatch):
    monkeypatch.delenv(L.PDL_ENV, raising=False)
    assert L.pdl_enabled() is True
    monkeypatch.setenv(L.PDL_ENV, "0")
    assert L.pdl_enabled() is False
    assert L.pdl_enabled(" 1 ") is True
    monkeypatch.setenv(L.PDL_ENV, " ")
    assert L.pdl_enabled() is True  # empty: the default, as the other step flags
    assert [L.pdl_supported(c) for c in ("90", "100", "120", "89", "80", "")] == [True, True, True, False, False,
                                                                                    False]
    monkeypatch.setenv(L.PDL_ENV, "yes")
    with pytest.raises(StrataError, match="STRATATOOLS_PDL='yes'"):
        L.pdl_enabled()


def test_route_warp_bound_matches_the_kernel():
    """decode.ROUTE_WARP_MAX is 32 lanes times the widest one-warp router's registers (route_warp_sg16), and the
    narrower one holds 8 a lane (the decoder's 256-expert threshold)."""
    from stratatools.runtime.gpu import decode as D

    src = K.cuda_source("decode_step.cu")
    got = dict(re.findall(r"void route_warp_sg(\d+)\(.*?route_warp_body<(\d+)>", src, flags=re.S))
    assert got == {"8": "8", "16": "16"} and D.ROUTE_WARP_MAX == 32 * 16


def test_route_warp_env(monkeypatch):
    from stratatools.runtime.gpu import decode as D

    monkeypatch.delenv(D.ROUTE_WARP_ENV, raising=False)
    assert D.route_warp() is True
    monkeypatch.setenv(D.ROUTE_WARP_ENV, "0")
    assert D.route_warp() is False
    monkeypatch.setenv(D.ROUTE_WARP_ENV, "2")
    with pytest.raises(StrataError, match="STRATATOOLS_ROUTE_WARP='2'"):
        D.route_warp()
