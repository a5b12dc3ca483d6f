"""The re-laid-out Q8_0 matvec of the fast decode step (stratatools/runtime/gpu/dense_q8.cu) checked on the CPU: the CUDA
source compiled as host C++ (host_kernel_shim.cuh runs each block as one thread), against numpy on the reference
dequantizer's values; the load-time re-layout (kernels.q8_relayout) against the reference dequantizer; the launch
shape (row parts) the decoder picks. Skips without a C++ compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from stratatools.core.errors import StrataError
from stratatools.runtime.dequant import dequantize
from stratatools.runtime.gpu import kernels as K

CXX = shutil.which("g++") or shutil.which("clang++")


def q8_blocks(rng, rows: int, cols: int) -> np.ndarray:
    """Random valid Q8_0 bytes: fp16 scales of both signs (one subnormal), codes over the whole int8 range."""
    nb = rows * cols // 32
    d = (rng.standard_normal(nb) * 0.02).astype(np.float16)
    d[0] = np.float16(3e-6)  # subnormal half
    q = rng.integers(-128, 128, size=(nb, 32)).astype(np.int8)
    b = np.empty((nb, 34), dtype=np.uint8)
    b[:, :2] = d.view(np.uint8).reshape(nb, 2)
    b[:, 2:] = q.view(np.uint8)
    return b.reshape(-1)


def test_relayout_matches_dequantizer():
    rng = np.random.default_rng(1)
    rows, cols = 7, 96
    raw = q8_blocks(rng, rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    assert q.dtype == np.int8 and q.size == rows * cols and d.dtype == np.uint16 and d.size == rows * cols // 32
    assert q.nbytes + d.nbytes == raw.nbytes
    W = np.asarray(dequantize(raw, "Q8_0", rows * cols)).reshape(rows, cols)
    got = q.reshape(rows, cols // 32, 32).astype(np.float32) * d.view(np.float16).astype(np.float32).reshape(rows, -1, 1)
    assert np.array_equal(got.reshape(rows, cols), W)
    with pytest.raises(StrataError, match="whole blocks"):
        K.q8_relayout(raw[:-34], rows, cols)
    with pytest.raises(StrataError, match="whole blocks"):
        K.q8_relayout(raw, 14, 48)  # 672 values, but rows of 48 are not whole blocks


def test_launch_shape_splits_few_long_rows():
    # the hyper-connection down projection (320 + 4 stacked rows of 10,240 values) is split along its rows
    gx, ks, shm = K.dq_launch_shape(324, 10240, n_sm=132)
    assert gx == 21 and ks == 20 and shm == 64 * 32
    # a tall matrix fills the device with row blocks alone
    gx, ks, shm = K.dq_launch_shape(12352, 2560, n_sm=132)
    assert (gx, ks, shm) == (772, 1, 64 * 160)
    # host build: one thread per block, one warp of one lane
    gx, ks, _ = K.dq_launch_shape(5, 64, n_sm=1, threads=1)
    assert (gx, ks) == (3, 1)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler to build the host copy of the kernels")
    d = tmp_path_factory.mktemp("dq8host")
    src = d / "dq8_host.cpp"
    src.write_text(K.fused_host_source("dense_q8.cu"))
    so = d / "dq8_host.so"
    subprocess.run([CXX, "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(so), str(src)], check=True,
                   capture_output=True)
    h = ctypes.CDLL(str(so))
    f = h.host_mv_q8r
    P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    f.argtypes = [ctypes.c_uint, ctypes.c_uint, P, P, P, P, I, I, F, P, P]
    f.restype = None
    g = h.host_mv_q8r_mix
    g.argtypes = [ctypes.c_uint, ctypes.c_uint, P, P, P, F, P, P, I, I, I]
    g.restype = None
    return h


@pytest.mark.parametrize("hc,n,cols", [(4, 7, 320), (3, 5, 64), (8, 2, 96)])
def test_mv_q8r_mix_matches_numpy(lib, hc, n, cols):
    """The hyper-connection up projection and mix in one kernel = W silu(x / hc), then decode_step.cu's hc_mix:
    mixed[i] = sum_h sigmoid(u[h n + i]) hn[h n + i] / hc."""
    rng = np.random.default_rng(hc * 100 + n)
    rows = hc * n
    raw = q8_blocks(rng, rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    hn = rng.standard_normal(rows).astype(np.float32)
    W = np.asarray(dequantize(raw, "Q8_0", rows * cols)).reshape(rows, cols).astype(np.float64)
    a = (x / np.float32(hc)).astype(np.float64)
    u = W @ (a / (1.0 + np.exp(-a)))
    ref = (1.0 / (1.0 + np.exp(-u)) * hn).reshape(hc, n).sum(axis=0) / hc
    mixed = np.full(n, np.nan, dtype=np.float32)
    lib.host_mv_q8r_mix(2, 1, q.ctypes.data, d.ctypes.data, x.ctypes.data, float(hc), hn.ctypes.data,
                        mixed.ctypes.data, hc, n, cols)
    assert np.abs(mixed - ref).max() / np.abs(ref).max() <= 2e-6


@pytest.mark.parametrize("rows,cols,ks,xdiv", [(37, 64, 1, 0.0), (5, 10240, 8, 0.0), (33, 320, 1, 4.0),
                                               (9, 2560, 3, 0.0), (4, 96, 5, 4.0)])
def test_mv_q8r_matches_numpy(lib, rows, cols, ks, xdiv):
    """y = W x (and W silu(x / xdiv)) for row counts that do not fill the last row pair, row parts of uneven and
    empty width; the parts' counters are back at zero afterwards."""
    rng = np.random.default_rng(rows * 1000 + cols)
    raw = q8_blocks(rng, rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    W = np.asarray(dequantize(raw, "Q8_0", rows * cols)).reshape(rows, cols).astype(np.float64)
    xin = x.astype(np.float64)
    if xdiv:
        a = (x / np.float32(xdiv)).astype(np.float64)
        xin = a / (1.0 + np.exp(-a))
    ref = W @ xin
    y = np.full(rows, np.nan, dtype=np.float32)
    gx = (rows + K.DQ_RW - 1) // K.DQ_RW  # one-thread blocks: DQ_RW rows each
    part = np.full(ks * rows, np.nan, dtype=np.float32)
    counter = np.zeros(gx, dtype=np.int32)
    lib.host_mv_q8r(gx, ks, q.ctypes.data, d.ctypes.data, x.ctypes.data, y.ctypes.data, rows, cols, xdiv,
                    part.ctypes.data, counter.ctypes.data)
    assert np.all(np.isfinite(y))
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err <= 2e-6, err
    assert not counter.any()


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,xdiv", [(324, 10240, 0.0), (10240, 320, 4.0), (3001, 2560, 0.0)])
def test_mv_q8r_on_the_gpu(rows, cols, xdiv):
    """The device build at the full-width model's shapes (row parts for the hyper-connection down projection, the
    staged SiLU for its up projection), launched as the decoder launches it (two calls: the counters reset)."""
    from stratatools.runtime import gpu

    if not gpu.available():
        pytest.skip("CuPy with a CUDA GPU is not available")
    import cupy as cp

    from stratatools.runtime.gpu.kernels import _device_limits, cuda_source

    k = cp.RawModule(code=cuda_source("dense_q8.cu"), options=("--std=c++17",)).get_function("mv_q8r")
    rng = np.random.default_rng(rows)
    raw = q8_blocks(rng, rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    W = np.asarray(dequantize(raw, "Q8_0", rows * cols)).reshape(rows, cols).astype(np.float64)
    xin = x.astype(np.float64)
    if xdiv:
        a = (x / np.float32(xdiv)).astype(np.float64)
        xin = a / (1.0 + np.exp(-a))
    ref = W @ xin
    gx, ks, shm = K.dq_launch_shape(rows, cols, _device_limits()[0])
    part, counter = cp.zeros(ks * rows, dtype=cp.float32), cp.zeros(max(gx, 1), dtype=cp.int32)
    for _ in range(2):
        y = cp.full(rows, cp.nan, dtype=cp.float32)
        k((gx, ks), (K.DQ_THREADS,), (cp.asarray(q), cp.asarray(d), cp.asarray(x), y, np.int32(rows), np.int32(cols),
                                      np.float32(xdiv), part, counter), shared_mem=shm)
        got = y.get()
        assert np.abs(got - ref).max() / np.abs(ref).max() <= 2e-6
        assert not counter.get().any()


@pytest.mark.gpu
def test_mv_q8r_mix_on_the_gpu():
    """The device build of the fused up projection + mix at the full-width shape (4 streams x 2,560, rank 320)."""
    from stratatools.runtime import gpu

    if not gpu.available():
        pytest.skip("CuPy with a CUDA GPU is not available")
    import cupy as cp

    from stratatools.runtime.gpu.kernels import cuda_source

    k = cp.RawModule(code=cuda_source("dense_q8.cu"), options=("--std=c++17",)).get_function("mv_q8r_mix")
    hc, n, cols = 4, 2560, 320
    rng = np.random.default_rng(7)
    raw = q8_blocks(rng, hc * n, cols)
    q, d = K.q8_relayout(raw, hc * n, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    hn = rng.standard_normal(hc * n).astype(np.float32)
    W = np.asarray(dequantize(raw, "Q8_0", hc * n * cols)).reshape(hc * n, cols).astype(np.float64)
    a = (x / np.float32(hc)).astype(np.float64)
    u = W @ (a / (1.0 + np.exp(-a)))
    ref = (1.0 / (1.0 + np.exp(-u)) * hn).reshape(hc, n).sum(axis=0) / hc
    mixed = cp.full(n, cp.nan, dtype=cp.float32)
    k(((n + 7) // 8,), (K.DQ_THREADS,), (cp.asarray(q), cp.asarray(d), cp.asarray(x), np.float32(hc), cp.asarray(hn),
                                         mixed, np.int32(hc), np.int32(n), np.int32(cols)), shared_mem=cols * 4)
    assert np.abs(mixed.get() - ref).max() / np.abs(ref).max() <= 2e-6
