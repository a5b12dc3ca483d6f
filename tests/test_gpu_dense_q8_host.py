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


def ref_matvec(raw: np.ndarray, rows: int, cols: int, x: np.ndarray, xdiv: float = 0.0) -> np.ndarray:
    """float64 W x' from the reference dequantizer, x' = x or silu(x / xdiv) (as mv_q8r / mv_q8s stage it)."""
    W = np.asarray(dequantize(raw, "Q8_0", rows * cols)).reshape(rows, cols).astype(np.float64)
    xin = x.astype(np.float64)
    if xdiv:
        a = (x / np.float32(xdiv)).astype(np.float64)
        xin = a / (1.0 + np.exp(-a))
    return W @ xin


def ref_mix(raw: np.ndarray, hc: int, n: int, cols: int, x: np.ndarray, hn: np.ndarray) -> np.ndarray:
    """float64 hyper-connection mix: sum_h sigmoid((W silu(x / hc))[h n + i]) hn[h n + i] / hc."""
    u = ref_matvec(raw, hc * n, cols, x, float(hc))
    return (1.0 / (1.0 + np.exp(-u)) * hn).reshape(hc, n).sum(axis=0) / hc


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


def test_launch_shape_splits_few_long_rows(monkeypatch):
    # the hyper-connection down projection (320 + 4 stacked rows of 10,240 values) is split along its rows
    monkeypatch.delenv(K.DQ_SPLIT_ENV, raising=False)
    gx, ks, shm = K.dq_launch_shape(324, 10240, n_sm=132)
    assert gx == 21 and ks == 7 and shm == 64 * 92  # about 1 block per SM: 7 parts of 92 chunks
    # STRATATOOLS_DQ_SPLIT_BLOCKS: more blocks per SM wanted, more and shorter parts (2: 13 parts of 50 chunks)
    monkeypatch.setenv(K.DQ_SPLIT_ENV, "2")
    assert K.dq_launch_shape(324, 10240, n_sm=132) == (21, 13, 64 * 50)
    monkeypatch.setenv(K.DQ_SPLIT_ENV, "4")
    assert K.dq_launch_shape(324, 10240, n_sm=132) == (21, 20, 64 * 32)
    for bad in ("0", "-2", "x", "1.5"):
        monkeypatch.setenv(K.DQ_SPLIT_ENV, bad)
        with pytest.raises(StrataError, match="STRATATOOLS_DQ_SPLIT_BLOCKS=.*1 or more"):
            K.dq_launch_shape(324, 10240, n_sm=132)
    monkeypatch.delenv(K.DQ_SPLIT_ENV)
    # a tall matrix fills the device with row blocks alone
    gx, ks, shm = K.dq_launch_shape(12352, 2560, n_sm=132)
    assert (gx, ks, shm) == (772, 1, 64 * 160)
    # host build: one thread per block, one warp of one lane
    gx, ks, _ = K.dq_launch_shape(5, 64, n_sm=1, threads=1)
    assert (gx, ks) == (3, 1)


def host_lib(d, defines: tuple[str, ...] = ()):
    """dense_q8.cu built as host C++ (one thread a block) with ``defines`` (-D options), its entries typed."""
    src = d / "dq8_host.cpp"
    src.write_text(K.fused_host_source("dense_q8.cu"))
    so = d / "dq8_host.so"
    subprocess.run([CXX, "-O1", "-std=c++17", *defines, "-shared", "-fPIC", "-o", str(so), str(src)], check=True,
                   capture_output=True)
    h = ctypes.CDLL(str(so))
    f = h.host_mv_q8r
    P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    f.argtypes = [ctypes.c_uint, ctypes.c_uint, P, P, P, P, I, I, F, P, P]
    f.restype = None
    g = h.host_mv_q8r_mix
    g.argtypes = [ctypes.c_uint, ctypes.c_uint, P, P, P, F, P, P, I, I, I]
    g.restype = None
    s = h.host_mv_q8s
    s.argtypes = [ctypes.c_uint, ctypes.c_uint, P, P, P, P, I, I, F, I, I, P, I, I]
    s.restype = None
    i8 = h.host_mv_q8i
    i8.argtypes = [ctypes.c_uint, ctypes.c_uint, P, P, P, P, I, I, F, I, I, P, I, I]
    i8.restype = None
    h.host_smem_poison.argtypes = [ctypes.c_longlong]
    h.host_smem_overrun.argtypes = [ctypes.c_longlong]
    h.host_smem_overrun.restype = ctypes.c_longlong
    return h


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler to build the host copy of the kernels")
    return host_lib(tmp_path_factory.mktemp("dq8host"))


@pytest.fixture(scope="module", params=["DQI_PRE=1", "DQI_PRE=0"])
def lib8(request, tmp_path_factory):
    """The host build for mv_q8i, with and without its first window's loads issued before x is staged."""
    if CXX is None:
        pytest.skip("no C++ compiler to build the host copy of the kernels")
    return host_lib(tmp_path_factory.mktemp("dq8host"), (f"-D{request.param}",))


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
    ref = ref_mix(raw, hc, n, cols, x, hn)
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
    ref = ref_matvec(raw, rows, cols, x, xdiv)
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


def test_stream_launch_shape():
    """mv_q8s's lanes per row and window: every lane at least 4 chunks where the row allows, windows of at most
    DQS_U chunks, all the same size, covering the row; blocks capped at a few per SM."""
    n_sm = 132
    for cols, lpr, u in [(2560, 32, 5), (4096, 32, 8), (6144, 32, 6), (10240, 32, 7), (320, 4, 5), (64, 1, 4),
                         (32, 1, 2)]:
        blocks, lp, uu, shm = K.dqs_launch_shape(12352, cols, n_sm)
        assert (lp, uu) == (lpr, u), cols
        gpw = 32 // lpr
        assert shm == 4 * cols and blocks == min(-(-12352 // (8 * gpw)), K.DQS_BLOCKS_PER_SM * n_sm)
        nch = cols // 16
        per_lane = -(-nch // lp)
        assert uu <= K.DQS_U and -(-per_lane // uu) * uu * lp >= nch
    # the mix's 2,560 outputs of 4 streams (rank 320): 4 lanes a stream, 16 an output, 2 outputs a warp
    blocks, lp, uu, _ = K.dqs_launch_shape(2560, 320, n_sm, hc=4)
    assert (lp, uu, blocks) == (4, 5, 160)
    assert K.dqs_launch_shape(12352, 2560, n_sm, u_max=5, blocks_per_sm=2)[:3] == (264, 32, 5)
    assert K.dqs_launch_shape(10, 2560, n_sm)[0] == 2  # 8 warps a block, one row each
    with pytest.raises(StrataError, match="whole Q8_0 blocks"):
        K.dqs_launch_shape(10, 48, n_sm)


@pytest.mark.parametrize("rows,cols,xdiv,gx,lpr,u", [(37, 64, 0.0, 5, 1, 4), (9, 2560, 0.0, 4, 32, 3),
                                                      (33, 320, 4.0, 64, 4, 5), (5, 10240, 0.0, 2, 32, 7),
                                                      (6, 4096, 0.0, 1, 32, 3), (4, 96, 4.0, 3, 1, 1)])
def test_mv_q8s_matches_numpy(lib, rows, cols, xdiv, gx, lpr, u):
    """The streaming matvec: any grid (more blocks than rows, fewer: blocks walk the rows), windows of u chunks
    with a short last one, the rotated reads of x; y = W x or W silu(x / xdiv)."""
    rng = np.random.default_rng(rows * 7 + cols)
    raw = q8_blocks(rng, rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    ref = ref_matvec(raw, rows, cols, x, xdiv)
    y = np.full(rows + 1, np.nan, dtype=np.float32)  # one past the end: must stay untouched
    lib.host_mv_q8s(gx, 1, q.ctypes.data, d.ctypes.data, x.ctypes.data, y.ctypes.data, rows, cols, xdiv, lpr, u,
                    None, 0, 0)
    assert np.isnan(y[-1])
    err = np.abs(y[:-1] - ref).max() / np.abs(ref).max()
    assert err <= 2e-6, err


@pytest.mark.parametrize("hc,n,cols,gx", [(4, 7, 320, 3), (3, 5, 64, 1), (8, 2, 96, 5)])
def test_mv_q8s_mix_matches_numpy(lib, hc, n, cols, gx):
    """mv_q8s in mix mode = mv_q8r_mix: mixed[i] = sum_h sigmoid((W silu(x / hc))[h n + i]) hn[h n + i] / hc."""
    rng = np.random.default_rng(hc * 31 + n)
    rows = hc * n
    raw = q8_blocks(rng, rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    hn = rng.standard_normal(rows).astype(np.float32)
    ref = ref_mix(raw, hc, n, cols, x, hn)
    mixed = np.full(n, np.nan, dtype=np.float32)
    _, lpr, uu, _ = K.dqs_launch_shape(n, cols, 132, hc=hc)
    lib.host_mv_q8s(gx, 1, q.ctypes.data, d.ctypes.data, x.ctypes.data, mixed.ctypes.data, rows, cols, float(hc),
                    lpr, uu, hn.ctypes.data, hc, n)
    assert np.abs(mixed - ref).max() / np.abs(ref).max() <= 2e-6


def test_dense_kernel_choice(monkeypatch):
    monkeypatch.delenv(K.DENSE_KERNEL_ENV, raising=False)
    assert K.dense_kernel() == "int8"  # the default since the eighth pass's measurement
    monkeypatch.setenv(K.DENSE_KERNEL_ENV, "stream")
    assert K.dense_kernel() == "stream"
    monkeypatch.setenv(K.DENSE_KERNEL_ENV, "rows")
    assert K.dense_kernel() == "rows"
    monkeypatch.setenv(K.DENSE_KERNEL_ENV, " int8 ")
    assert K.dense_kernel() == "int8"
    monkeypatch.setenv(K.DENSE_KERNEL_ENV, "fast")
    with pytest.raises(StrataError, match="STRATATOOLS_DENSE_KERNEL='fast': use int8, stream or rows"):
        K.dense_kernel()


# ---- mv_q8i: x quantized per block of 32 to 16-bit fixed point (two int8 planes), int8 dot products ---------------
QMAX = 32639  # dense_q8.cu DQI_QMAX: 127 * 256 + 127
TINY = 2.0 ** -100  # DQI_TINY: a block whose max |x'| is below it counts as zero


def block_vector(rng, cols: int, kind: str) -> np.ndarray:
    """float32 x [cols] whose blocks of 32 have very different magnitudes (``mixed``: 1e-6 .. 1e6; ``tiny``: 1e-30 ..
    1e-20; ``huge``: 1e15 .. 1e20; ``gauss``: standard normal), block 1 all zero, and in block 0 one value at the
    block's max and one exactly half a quantization step (a rounding tie)."""
    nb = cols // 32
    mags = {"mixed": [1e-6, 1e-3, 1.0, 1e3, 1e6], "tiny": [1e-30, 1e-25, 1e-20], "huge": [1e15, 1e18, 1e20],
            "gauss": [1.0]}[kind]
    x = rng.standard_normal((nb, 32)) * rng.choice(mags, size=(nb, 1))
    if nb > 1:
        x[1] = 0.0
    x = x.astype(np.float32)
    m = np.abs(x[0]).max()
    x[0, 3] = m
    x[0, 5] = np.float32(m / np.float32(QMAX)) * np.float32(100.5)
    return x.reshape(-1)


def stage_input(x: np.ndarray, xdiv: float) -> np.ndarray:
    """float64 x' = x or silu(x / xdiv) (x / xdiv in float32, as the kernels divide)."""
    if not xdiv:
        return x.astype(np.float64)
    a = (x / np.float32(xdiv)).astype(np.float64)
    with np.errstate(over="ignore"):  # exp(-a) = inf for a very negative: silu(a) = -0
        return a / (1.0 + np.exp(-a))


def quantized_input(xs: np.ndarray) -> np.ndarray:
    """float64 v s_b: x' (float32) quantized as mv_q8i stages it (s_b = max |x'| / QMAX, v = rint(x' (1 / s_b))
    clamped to +-QMAX, float32 arithmetic; blocks below TINY are zero)."""
    xb = xs.astype(np.float32).reshape(-1, 32)
    m = np.abs(xb).max(axis=1)
    live = m >= np.float32(TINY)
    s = np.where(live, m / np.float32(QMAX), np.float32(0.0)).astype(np.float32)
    inv = np.where(live, np.float32(1.0) / np.where(live, s, np.float32(1.0)), np.float32(0.0)).astype(np.float32)
    v = np.clip(np.rint((xb * inv[:, None]).astype(np.float32)), -QMAX, QMAX)
    assert np.all(np.abs(v) <= QMAX)
    hi = np.floor((v + 128) / 256)
    assert np.all((v - 256 * hi >= -128) & (v - 256 * hi <= 127)) and np.all(np.abs(hi) <= 127)
    return (v * s.astype(np.float64)[:, None]).reshape(-1)


def int8_bounds(W: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of W x': (the activation-rounding bound sum_j |w_j| s_b(j) / 2, the whole bound). The whole bound
    allows x' within 0.505 s_b (the float32 rounding of 1 / s_b and of x' (1 / s_b) adds up to 0.004 s_b), the max
    of a block below TINY for such a block, and float32 rounding of the chunk terms and their sum:
    (cols / 16 + 16) 2^-24 sum_j |w_j| |x'_j|."""
    m = np.abs(xs).reshape(-1, 32).max(axis=1)
    s = m / QMAX
    A = np.abs(W)
    act = A @ np.repeat(s / 2, 32)
    per = np.repeat(np.where(m >= TINY, 0.505 * s, m), 32)
    acc = (W.shape[1] / 16 + 16) * 2.0 ** -24 * (A @ (np.abs(xs) + per))
    return act, A @ per + acc


def dense_w(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return np.asarray(dequantize(raw, "Q8_0", rows * cols)).reshape(rows, cols).astype(np.float64)


@pytest.mark.parametrize("rows,cols,xdiv,gx,u,kind", [
    (37, 64, 0.0, 5, 4, "mixed"), (9, 2560, 0.0, 4, 3, "mixed"), (33, 320, 4.0, 64, 5, "gauss"),
    (5, 10240, 0.0, 2, 7, "mixed"), (6, 4096, 0.0, 1, 3, "tiny"), (4, 96, 4.0, 3, 1, "mixed"),
    (7, 320, 0.0, 3, 6, "huge"), (11, 10240, 2.5, 4, 6, "mixed"), (3, 2560, 0.0, 2, 5, "gauss")])
def test_mv_q8i_matches_numpy(lib8, rows, cols, xdiv, gx, u, kind):
    """The integer matvec (any grid: fewer blocks than rows, more; windows of u chunks with a short last one, a u
    above DQI_U): y = W x' within the activation rounding bound sum_j |w_j| s_b / 2 plus float32 rounding against
    float64 numpy; and (x = x' only) within float32 rounding of W (v s), x quantized as the kernel does. Stays within
    dqi_shared_bytes of shared memory and writes no output past the rows."""
    rng = np.random.default_rng(rows * 13 + cols)
    raw = q8_blocks(rng, rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    x = block_vector(rng, cols, kind)
    xs = stage_input(x, xdiv)
    W = dense_w(raw, rows, cols)
    ref = W @ xs
    y = np.full(rows + 1, np.nan, dtype=np.float32)  # one past the end: must stay untouched
    shm = K.dqi_shared_bytes(cols)
    lib8.host_smem_poison(shm)
    lib8.host_mv_q8i(gx, 1, q.ctypes.data, d.ctypes.data, x.ctypes.data, y.ctypes.data, rows, cols, xdiv, 1, u,
                     None, 0, 0)
    assert lib8.host_smem_overrun(shm) == 0
    assert np.isnan(y[-1]) and np.all(np.isfinite(y[:-1]))
    err = np.abs(y[:-1] - ref)
    act, bound = int8_bounds(W, xs)
    print(f"mv_q8i {rows}x{cols} xdiv={xdiv} {kind}: max |err| / activation bound {(err / act).max():.3f}, "
          f"/ whole bound {(err / bound).max():.3f}")
    assert np.all(err <= bound)
    if not xdiv:  # exactly the quantized input: only float32 rounding is left
        xq = quantized_input(x)
        tight = (cols / 16 + 16) * 2.0 ** -24 * (np.abs(W) @ np.abs(xq))
        assert np.all(np.abs(y[:-1] - W @ xq) <= tight)


@pytest.mark.parametrize("hc,n,cols,gx,kind", [(4, 7, 320, 3, "gauss"), (3, 5, 64, 1, "mixed"),
                                               (8, 2, 96, 5, "mixed"), (4, 3, 32, 2, "gauss")])
def test_mv_q8i_mix_matches_numpy(lib8, hc, n, cols, gx, kind):
    """mv_q8i in mix mode: mixed[i] = sum_h sigmoid((W silu(x / hc))[h n + i]) hn[h n + i] / hc within the up
    projection's bound through the sigmoid (slope <= 1/4) plus float32 rounding of the mix."""
    rng = np.random.default_rng(hc * 57 + n)
    rows = hc * n
    raw = q8_blocks(rng, rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    x = block_vector(rng, cols, kind) if kind != "mixed" else block_vector(rng, cols, kind) * np.float32(1e-3)
    hn = rng.standard_normal(rows).astype(np.float32)
    ref = ref_mix(raw, hc, n, cols, x, hn)
    W = dense_w(raw, rows, cols)
    xs = stage_input(x, float(hc))
    _, bound = int8_bounds(W, xs)
    mbound = ((0.25 * bound + 8 * 2.0 ** -24) * np.abs(hn)).reshape(hc, n).sum(axis=0) / hc
    mixed = np.full(n + 1, np.nan, dtype=np.float32)
    _, lpr, uu, shm = K.dqi_launch_shape(n, cols, 132, hc=hc)
    lib8.host_smem_poison(shm)
    lib8.host_mv_q8i(gx, 1, q.ctypes.data, d.ctypes.data, x.ctypes.data, mixed.ctypes.data, rows, cols, float(hc),
                     lpr, uu, hn.ctypes.data, hc, n)
    assert lib8.host_smem_overrun(shm) == 0
    assert np.isnan(mixed[-1])
    err = np.abs(mixed[:-1] - ref)
    print(f"mv_q8i mix hc={hc} n={n} cols={cols}: max |err| / bound {(err / mbound).max():.3f}")
    assert np.all(err <= mbound)


def test_mv_q8i_launch_shape():
    """dqi_launch_shape: mv_q8s's lanes per row and windows (at most DQI_U chunks), at most DQI_BLOCKS_PER_SM blocks
    per SM, the two int8 planes and the scales in shared memory (less than mv_q8s's 4 cols)."""
    n_sm = 132
    for cols, lpr, u in [(2560, 32, 5), (4096, 32, 4), (6144, 32, 4), (10240, 32, 5), (320, 4, 5), (64, 1, 4),
                         (32, 1, 2)]:
        blocks, lp, uu, shm = K.dqi_launch_shape(12352, cols, n_sm)
        assert (lp, uu) == (lpr, u), cols
        assert shm == 2 * cols + cols // 8 < 4 * cols
        assert blocks == min(-(-12352 // (8 * (32 // lpr))), K.DQI_BLOCKS_PER_SM * n_sm)
        nch = cols // 16
        assert uu <= K.DQI_U and -(-(-(-nch // lp)) // uu) * uu * lp >= nch
    assert K.dqi_launch_shape(2560, 320, n_sm, hc=4)[:3] == (160, 4, 5)
    with pytest.raises(StrataError, match="whole Q8_0 blocks"):
        K.dqi_launch_shape(10, 48, n_sm)


def test_host_dp4a_is_signed_bytes():
    """The host shim's __dp4a: 4 signed byte products plus the accumulator, as the device instruction (checked
    through a tiny host program against numpy)."""
    if CXX is None:
        pytest.skip("no C++ compiler")
    import tempfile
    from pathlib import Path

    rng = np.random.default_rng(5)
    a = rng.integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32)
    a[0], b[0] = 0x80808080, 0x80808080  # (-128)^2 * 4
    c = rng.integers(-2 ** 20, 2 ** 20, 64).astype(np.int32)
    with tempfile.TemporaryDirectory() as t:
        src = Path(t) / "dp4a.cpp"
        src.write_text(K.cuda_source("host_kernel_shim.cuh") + 'extern "C" void dp(const int* a, const int* b, '
                       "const int* c, int* o, int n) { for (int i = 0; i < n; ++i) o[i] = __dp4a(a[i], b[i], c[i]); }\n")
        so = Path(t) / "dp4a.so"
        subprocess.run([CXX, "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(so), str(src)], check=True,
                       capture_output=True)
        h = ctypes.CDLL(str(so))
        out = np.zeros(64, dtype=np.int32)
        av, bv = a.view(np.int32), b.view(np.int32)
        h.dp(av.ctypes.data_as(ctypes.c_void_p), bv.ctypes.data_as(ctypes.c_void_p),
             c.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(64))
    ref = (a.view(np.int8).reshape(64, 4).astype(np.int64) * b.view(np.int8).reshape(64, 4)).sum(axis=1) + c
    assert np.array_equal(out, ref.astype(np.int32)) and out[0] == 4 * 128 * 128 + c[0]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,xdiv", [(324, 10240, 0.0), (10240, 320, 4.0), (3001, 2560, 0.0)])
def test_mv_q8r_on_the_gpu(rows, cols, xdiv):
    """The device build at the full-width model's shapes (row parts for the hyper-connection down projection, the
    staged SiLU for its up projection), launched as the decoder launches it (two calls: the counters reset)."""
    from stratatools.runtime import gpu

    if not gpu.available():
        pytest.skip("CuPy with a CUDA GPU is not available")
    import cupy as cp

    from stratatools.runtime.gpu.kernels import _device_limits, cuda_unit

    k = cp.RawModule(code=cuda_unit("dense_q8.cu"), options=("--std=c++17",)).get_function("mv_q8r")
    rng = np.random.default_rng(rows)
    raw = q8_blocks(rng, rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    ref = ref_matvec(raw, rows, cols, x, xdiv)
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

    from stratatools.runtime.gpu.kernels import cuda_unit

    k = cp.RawModule(code=cuda_unit("dense_q8.cu"), options=("--std=c++17",)).get_function("mv_q8r_mix")
    hc, n, cols = 4, 2560, 320
    rng = np.random.default_rng(7)
    raw = q8_blocks(rng, hc * n, cols)
    q, d = K.q8_relayout(raw, hc * n, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    hn = rng.standard_normal(hc * n).astype(np.float32)
    ref = ref_mix(raw, hc, n, cols, x, hn)
    mixed = cp.full(n, cp.nan, dtype=cp.float32)
    k(((n + 7) // 8,), (K.DQ_THREADS,), (cp.asarray(q), cp.asarray(d), cp.asarray(x), np.float32(hc), cp.asarray(hn),
                                         mixed, np.int32(hc), np.int32(n), np.int32(cols)), shared_mem=cols * 4)
    assert np.abs(mixed.get() - ref).max() / np.abs(ref).max() <= 2e-6


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,hc,xdiv", [(12352, 2560, 0, 0.0), (2560, 4096, 0, 0.0), (2560, 6144, 0, 4.0),
                                               (1000, 10240, 0, 0.0), (4 * 2560, 320, 4, 4.0), (3 * 50, 64, 3, 3.0)])
def test_mv_q8s_on_the_gpu(rows, cols, hc, xdiv):
    """The device build of the streaming matvec at the full-width model's shapes (lanes per row, windows, rotated
    reads of x and, in mix mode, streams spread over lane groups and summed by shuffles), launched as the decoder
    launches it."""
    from stratatools.runtime import gpu

    if not gpu.available():
        pytest.skip("CuPy with a CUDA GPU is not available")
    import cupy as cp

    from stratatools.runtime.gpu.kernels import _device_limits, cuda_unit

    k = cp.RawModule(code=cuda_unit("dense_q8.cu"), options=("--std=c++17",)).get_function("mv_q8s")
    rng = np.random.default_rng(rows + cols)
    raw = q8_blocks(rng, rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    u = ref_matvec(raw, rows, cols, x, xdiv)
    hn = rng.standard_normal(rows).astype(np.float32)
    n = rows // hc if hc else rows
    ref = (1.0 / (1.0 + np.exp(-u)) * hn).reshape(hc, n).sum(axis=0) / hc if hc else u
    blocks, lpr, uu, shm = K.dqs_launch_shape(n, cols, _device_limits()[0], hc=hc)
    y = cp.full(n + 1, cp.nan, dtype=cp.float32)
    k((blocks,), (K.DQ_THREADS,), (cp.asarray(q), cp.asarray(d), cp.asarray(x), y, np.int32(rows), np.int32(cols),
                                   np.float32(xdiv), np.int32(lpr), np.int32(uu), cp.asarray(hn), np.int32(hc),
                                   np.int32(n)), shared_mem=shm)
    got = y.get()
    assert np.isnan(got[-1])
    assert np.abs(got[:-1] - ref).max() / np.abs(ref).max() <= 2e-6


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no nvcc to compile the device code")
def test_device_build_has_no_spills(tmp_path):
    """dense_q8.cu as the decoder loads it, compiled for sm_90 (nvcc -cubin -O3): every kernel compiles without
    spills, and mv_q8i fits its __launch_bounds__ (DQI_MINB blocks of 256 threads: 64 registers) in fewer registers
    than mv_q8s (register counts printed for the notes)."""
    import re

    src = tmp_path / "dense_q8.cu"
    src.write_text(K.cuda_unit("dense_q8.cu"))
    r = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v", "--std=c++17", "-o",
                        str(tmp_path / "dq.cubin"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    entries = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers",
                         r.stderr + r.stdout, flags=re.S)
    regs = {}
    for name, spill, nreg in entries:
        print(f"{name}: {nreg} registers, {spill} bytes spill stores")
        assert int(spill) == 0, name
        regs[name] = int(nreg)
    assert set(regs) == {"mv_q8r", "mv_q8r_mix", "mv_q8s", "mv_q8i"}
    assert regs["mv_q8i"] <= 65536 // (256 * K.DQI_BLOCKS_PER_SM) and regs["mv_q8i"] < regs["mv_q8s"]
    # the other builds bench_dense_q8.py times: no spills either
    for u, b, pre in ((6, 4, 0), (4, 5, 0), (7, 3, 1), (12, 2, 1)):
        r = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v", "--std=c++17", f"-DDQI_U={u}",
                            f"-DDQI_MINB={b}", f"-DDQI_PRE={pre}", "-o", str(tmp_path / "dqv.cubin"), str(src)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        got = dict((n, (int(sp), int(rg))) for n, sp, rg in re.findall(
            r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers", r.stderr + r.stdout,
            flags=re.S))
        print(f"mv_q8i DQI_U={u} DQI_MINB={b} DQI_PRE={pre}: {got['mv_q8i'][1]} registers")
        assert got["mv_q8i"][0] == 0 and got["mv_q8i"][1] <= 65536 // (256 * b), (u, b, pre)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,hc,xdiv,shape", [(12352, 2560, 0, 0.0, "dqi"), (2560, 4096, 0, 0.0, "dqi"),
                                                     (2560, 6144, 0, 4.0, "dqi"), (1000, 10240, 0, 0.0, "dqi"),
                                                     (3001, 4096, 0, 0.0, "dqs"), (4 * 2560, 320, 4, 4.0, "dqi"),
                                                     (3 * 50, 64, 3, 3.0, "dqi"), (4 * 2560, 320, 4, 4.0, "dqs")])
def test_mv_q8i_on_the_gpu(rows, cols, hc, xdiv, shape):
    """The device build of mv_q8i at the full-width model's shapes (lanes per row, windows, x quantized by the warps'
    shuffles; in mix mode streams over lane groups), launched with dqi_launch_shape as the decoder launches it and
    with mv_q8s's dqs_launch_shape (4,096 columns: windows of 8 > DQI_U chunks; 4 cols shared bytes): within the
    activation rounding bound plus float32 rounding of the float64 reference, per output."""
    from stratatools.runtime import gpu

    if not gpu.available():
        pytest.skip("CuPy with a CUDA GPU is not available")
    import cupy as cp

    from stratatools.runtime.gpu.kernels import _device_limits, cuda_unit

    k = cp.RawModule(code=cuda_unit("dense_q8.cu"), options=("--std=c++17",)).get_function("mv_q8i")
    rng = np.random.default_rng(rows + cols + 1)
    raw = q8_blocks(rng, rows, cols)
    q, d = K.q8_relayout(raw, rows, cols)
    x = block_vector(rng, cols, "gauss" if hc else "mixed")
    W = dense_w(raw, rows, cols)
    xs = stage_input(x, xdiv)
    u = W @ xs
    _, bound = int8_bounds(W, xs)
    hn = rng.standard_normal(rows).astype(np.float32)
    n = rows // hc if hc else rows
    if hc:
        ref = (1.0 / (1.0 + np.exp(-u)) * hn).reshape(hc, n).sum(axis=0) / hc
        bound = ((0.25 * bound + 8 * 2.0 ** -24) * np.abs(hn)).reshape(hc, n).sum(axis=0) / hc
    else:
        ref = u
    fn = K.dqi_launch_shape if shape == "dqi" else K.dqs_launch_shape
    blocks, lpr, uu, shm = fn(n, cols, _device_limits()[0], hc=hc)
    y = cp.full(n + 1, cp.nan, dtype=cp.float32)
    k((blocks,), (K.DQ_THREADS,), (cp.asarray(q), cp.asarray(d), cp.asarray(x), y, np.int32(rows), np.int32(cols),
                                   np.float32(xdiv), np.int32(lpr), np.int32(uu), cp.asarray(hn), np.int32(hc),
                                   np.int32(n)), shared_mem=shm)
    got = y.get()
    assert np.isnan(got[-1])
    err = np.abs(got[:-1].astype(np.float64) - ref)
    print(f"mv_q8i {rows}x{cols} hc={hc} ({shape} shape): max |err| / bound {(err / bound).max():.3f}")
    assert np.all(err <= bound)


def test_dense_min_rows_override(monkeypatch):
    """STRATATOOLS_DENSE_MIN_ROWS overrides the rows per SM from which the decoder's Q8_0 matvec leaves mv_q8r."""
    from stratatools.core.errors import StrataError
    from stratatools.runtime.gpu import kernels as K

    monkeypatch.delenv(K.DENSE_MIN_ROWS_ENV, raising=False)
    assert K.dense_min_rows_per_sm() == K.DQS_MIN_ROWS_PER_SM == 8
    monkeypatch.setattr(K, "DQS_MIN_ROWS_PER_SM", 3)
    assert K.dense_min_rows_per_sm() == 3
    monkeypatch.setenv(K.DENSE_MIN_ROWS_ENV, " 0 ")
    assert K.dense_min_rows_per_sm() == 0
    for bad in ("-1", "2.5", "eight", "٣"):
        monkeypatch.setenv(K.DENSE_MIN_ROWS_ENV, bad)
        with pytest.raises(StrataError, match="STRATATOOLS_DENSE_MIN_ROWS=.*whole number"):
            K.dense_min_rows_per_sm()
