"""Host C++ builds of the CUDA kernel files of stratatools.runtime.gpu for the ``test_gpu_*_host`` tests: the file
through :func:`stratatools.runtime.gpu.kernels.fused_host_source` (host_kernel_shim.cuh: one thread per block), built
as a shared library, each ``host_<kernel>(grid_x, grid_y, ...)`` entry typed from the kernel's own signature."""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess
from pathlib import Path

from stratatools.runtime.gpu import kernels as K

#: The C++ compiler the host builds use (None: the tests that need it skip).
CXX = shutil.which("g++") or shutil.which("clang++")
_SCALARS = {"int": ctypes.c_int, "float": ctypes.c_float, "long long": ctypes.c_longlong,
            "unsigned long long": ctypes.c_ulonglong}


def build_host_lib(folder: Path, name: str) -> ctypes.CDLL:
    """Compile kernel file ``name`` (e.g. ``attn_step.cu``) in ``folder`` and return the library with every
    ``host_<kernel>`` entry's argument types set: pointers as ``c_void_p``, scalars by their C type."""
    stem = Path(name).stem
    src, so = Path(folder) / f"{stem}_host.cpp", Path(folder) / f"{stem}_host.so"
    src.write_text(K.fused_host_source(name))
    subprocess.run([CXX, "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(so), str(src)], check=True,
                   capture_output=True)
    lib = ctypes.CDLL(str(so))
    for kernel, params in K.kernel_signatures(name).items():
        f = getattr(lib, f"host_{kernel}")
        f.argtypes = [ctypes.c_uint, ctypes.c_uint] + [ctypes.c_void_p if "*" in t else _SCALARS[t]
                                                       for t, _ in params]
        f.restype = None
    return lib


@contextlib.contextmanager
def shared_within(lib: ctypes.CDLL, nbytes: int):
    """Fail when the host kernels run inside the block write dynamic shared memory past ``nbytes`` (what their
    launcher asks the device for; the host build's buffer is larger, so an overrun there goes unseen otherwise)."""
    lib.host_smem_poison.argtypes = lib.host_smem_overrun.argtypes = [ctypes.c_longlong]
    lib.host_smem_poison.restype, lib.host_smem_overrun.restype = None, ctypes.c_longlong
    lib.host_smem_poison(nbytes)
    yield
    over = lib.host_smem_overrun(nbytes)
    assert over == 0, f"{over} bytes written past the {nbytes} dynamic shared bytes the launcher asks for"


def rand32(rng, *shape, scale: float = 1.0):
    """Standard normal float32 values of ``shape`` times ``scale`` from ``rng`` (the host kernel tests' inputs)."""
    import numpy as np

    return (rng.standard_normal(shape) * scale).astype(np.float32)


def gdn_reference(q, kk, v, beta, decay, S0):
    """The gated delta rule in float64 over T tokens: q, kk [T, nk, dk], v [T, nv, dv], beta, decay [T, nv], S0 [nv,
    dk, dv] (value head j reads key group j % nk, as the kernels do). Returns (outputs [T, nv, dv], final state)."""
    import numpy as np

    T, nv = beta.shape
    rep = nv // q.shape[1]
    St = S0.astype(np.float64)
    ref = np.empty((T, nv, v.shape[-1]))
    for t in range(T):
        qt, kt = np.tile(q[t], (rep, 1)), np.tile(kk[t], (rep, 1))
        St = St * decay[t][:, None, None]
        delta = (v[t] - np.sum(kt[:, :, None] * St, axis=1)) * beta[t][:, None]
        St = St + kt[:, :, None] * delta[:, None, :]
        ref[t] = np.sum(qt[:, :, None] * St, axis=1)
    return ref, St


def i8_bound(W, x):
    """The largest error of W x (W [R, K] float64, x [K]) computed by the integer expert jobs: each value of x off by at
    most half a step of its block's 16-bit fixed point (s / 2, s = max |block of 64| / 32767; float rounding of q
    included), float32 sums (2e-6 of |W| |x|). Returns [R] float64."""
    import numpy as np

    x = np.asarray(x, dtype=np.float64)
    s = np.abs(x.reshape(-1, 64)).max(axis=1, keepdims=True) / 32767.0
    e = np.broadcast_to(s * 0.5, (s.shape[0], 64)).reshape(-1) * (1 + 1e-5) + np.abs(x) * 1e-7
    aw = np.abs(W)
    return aw @ e + 2e-6 * (aw @ np.abs(x)) + 1e-30
