"""The fused decode-step kernels (stratatools/runtime/gpu/fused_step.cu) checked on the CPU: the CUDA source compiled as
host C++ (host_kernel_shim.cuh runs each block as one thread), every kernel against the numpy formulas of
stratatools.runtime.model that the reference decode step uses, on random inputs at small and at full-width head
shapes. decode_step.cu (the router with the shared gate) must at least compile as host C++. Skips without a C++
compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from hostlib import rand32 as _rand
from stratatools.runtime.gpu import kernels as K
from stratatools.runtime.model import _l2norm, _rmsnorm, _sigmoid, _silu, _softplus

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the host copy of the fused kernels")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    d = tmp_path_factory.mktemp("fusedhost")
    src = d / "fused_host.cpp"
    src.write_text(K.fused_host_source())
    so = d / "fused_host.so"
    subprocess.run([CXX, "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(so), str(src)], check=True,
                   capture_output=True)
    h = ctypes.CDLL(str(so))
    ctype = {"int": ctypes.c_int, "float": ctypes.c_float}
    for name, params in K.kernel_signatures("fused_step.cu").items():
        f = getattr(h, f"host_{name}")
        f.argtypes = [ctypes.c_uint, ctypes.c_uint] + [ctypes.c_void_p if "*" in t else ctype[t] for t, _ in params]
        f.restype = None
    return h


def _p(a):
    return None if a is None else a.ctypes.data


def close(a, b, tol=2e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) <= tol


def test_kernel_signatures_parse():
    sig = K.kernel_signatures("fused_step.cu")
    assert set(sig) == {"gdn_conv", "gdn_recur", "ple_fused", "hc_inject_rms", "matvec_f32_rows"}
    assert sig["hc_inject_rms"][0] == ("float* __restrict__", "H") and sig["hc_inject_rms"][-1][1] == "hn"
    assert ("int", "K") in sig["gdn_conv"]


@pytest.mark.parametrize("nk,dk,nv,dv,Kc,gate,ncb", [(2, 8, 4, 8, 4, "sigmoid", 3), (16, 128, 32, 128, 4, "silu", 4),
                                                     (1, 16, 3, 24, 1, "sigmoid", 1)])
def test_gdn_step_matches_numpy(lib, nk, dk, nv, dv, Kc, gate, ncb):
    """gdn_conv + gdn_recur = the decoder's numpy _gdn after its projections (conv, SiLU, state shift, L2 norms,
    tiled key groups, beta/decay, delta rule, output read, gated RMS norm); gdn_recur with each head's columns
    split over ncb blocks (uneven split included), its per-head counters back at 0 afterwards."""
    rng = np.random.default_rng(nk * 100 + dv)
    C = 2 * nk * dk + nv * dv
    qkv, z = _rand(rng, C), _rand(rng, nv * dv)
    b, a = _rand(rng, nv), _rand(rng, nv, scale=8.0)  # scale 8: softplus's threshold branch is met
    ssm_a = -np.exp(rng.uniform(0, np.log(16), nv)).astype(np.float32)
    dt = _rand(rng, nv, scale=0.5)
    wc = _rand(rng, C, Kc, scale=0.5)
    state = _rand(rng, max(Kc - 1, 0), C)
    S = _rand(rng, nv, dk, dv, scale=0.1)
    nw = _rand(rng, dv) + 1
    eps = 1e-6
    # numpy reference (stratatools.runtime.gpu.decode.StaticDecoder._gdn on numpy)
    xin = np.concatenate([state, qkv[None, :]], axis=0)
    conv = np.zeros(C, dtype=np.float32)
    for k in range(Kc):
        conv = conv + xin[k] * wc[:, k]
    conv = _silu(np, conv)
    q = _l2norm(np, conv[:nk * dk].reshape(nk, dk)) * np.float32(dk ** -0.5)
    kk = _l2norm(np, conv[nk * dk:2 * nk * dk].reshape(nk, dk))
    v = conv[2 * nk * dk:].reshape(nv, dv)
    q, kk = np.tile(q, (nv // nk, 1)), np.tile(kk, (nv // nk, 1))
    beta = _sigmoid(np, b)
    decay = np.exp(ssm_a * _softplus(np, a + dt)).astype(np.float32)
    S1 = S * decay[:, None, None]
    kv = np.sum(kk[:, :, None] * S1, axis=1)
    delta = (v - kv) * beta[:, None]
    S1 = S1 + kk[:, :, None] * delta[:, None, :]
    o = _rmsnorm(np, np.sum(q[:, :, None] * S1, axis=1), nw, eps)
    act = _sigmoid(np, z.reshape(nv, dv)) if gate == "sigmoid" else _silu(np, z.reshape(nv, dv))
    ref = (o * act).reshape(-1)
    # host kernels
    st, SS = state.copy(), S.copy()
    cbuf, bt, dc = (np.empty(n, np.float32) for n in (C, nv, nv))
    lib.host_gdn_conv(3, 1, _p(qkv), _p(st), _p(wc), C, Kc, _p(b), _p(a), _p(ssm_a), _p(dt), nv, _p(cbuf), _p(bt), _p(dc))
    assert close(cbuf, conv) and close(bt, beta) and close(dc, decay)
    assert np.array_equal(st, xin[1:])  # the state holds the last K-1 inputs, oldest first
    out = np.full(nv * dv, np.nan, np.float32)
    obuf, sspart = np.empty(nv * dv, np.float32), np.empty(nv * ncb, np.float32)
    counter = np.zeros(nv, np.int32)
    lib.host_gdn_recur(nv, ncb, _p(cbuf), _p(bt), _p(dc), _p(SS), _p(z), _p(nw), dv, nk, dk, dv, eps,
                       int(gate == "sigmoid"), _p(obuf), _p(sspart), _p(counter), _p(out))
    assert close(SS, S1) and close(out, ref, 1e-4)
    assert not counter.any()


@pytest.mark.parametrize("hc,n,Kc,d,per_stream", [(2, 16, 3, 2, False), (4, 2560, 4, 3, True), (3, 8, 1, 2, True)])
def test_ple_fused_matches_numpy(lib, hc, n, Kc, d, per_stream):
    """ple_fused = the decoder's numpy _ple after its projections, added to H, conv state shifted."""
    rng = np.random.default_rng(hc * n)
    C = hc * n
    H, kraw, value = _rand(rng, C), _rand(rng, C), _rand(rng, n)
    wl = C if per_stream else n
    wk, wq, wcn = (_rand(rng, wl) + 1 for _ in range(3))
    span = (Kc - 1) * d
    buf = _rand(rng, span, C)
    wconv = _rand(rng, C, Kc, scale=0.5)
    eps = 1e-6
    key = _rmsnorm(np, kraw, wk if per_stream else np.tile(wk, hc), eps, group=n)
    q = _rmsnorm(np, H, wq if per_stream else np.tile(wq, hc), eps, group=n)
    gate = np.sum(key.reshape(hc, n) * q.reshape(hc, n), axis=-1, keepdims=True) / np.float32(np.sqrt(n))
    gate = np.sqrt(np.maximum(np.abs(gate), np.float32(1e-6))) * np.sign(gate)
    gv = (_sigmoid(np, gate) * value[None, :]).reshape(C)
    gvn = _rmsnorm(np, gv, wcn if per_stream else np.tile(wcn, hc), eps, group=n)
    xin = np.concatenate([buf, gvn[None, :]], axis=0)
    out = np.zeros(C, dtype=np.float32)
    for k in range(Kc):
        out = out + xin[k * d] * wconv[:, k]
    ref = H + gv + _silu(np, out)
    HH, bb = H.copy(), buf.copy()
    lib.host_ple_fused(hc, 1, _p(HH), _p(kraw), _p(value), _p(wk), wl, _p(wq), wl, _p(wcn), wl, _p(bb), _p(wconv),
                       Kc, d, n, hc, eps)
    assert close(HH, ref, 1e-5)
    assert close(bb, xin[1:]) if span else bb.size == 0


@pytest.mark.parametrize("inject", [True, False])
@pytest.mark.parametrize("n", [40, 3, 5])  # (3: fewer values than a thread keeps in registers)
def test_hc_inject_rms_matches_numpy(lib, inject, n):
    rng = np.random.default_rng(7)
    hc = 4
    H, y, v, w = _rand(rng, hc * n), _rand(rng, n), _rand(rng, hc), _rand(rng, hc * n)
    H1 = H + (y[None, :] * (2.0 * _sigmoid(np, v / np.float32(hc)))[:, None]).reshape(-1) if inject else H
    ref = _rmsnorm(np, H1, w, 1e-6, group=n)
    HH, hn = H.copy(), np.empty(hc * n, np.float32)
    lib.host_hc_inject_rms(hc, 1, _p(HH), _p(y) if inject else None, _p(v), hc, n, _p(w), w.size, 1e-6, _p(hn))
    assert close(HH, H1) and close(hn, ref)


@pytest.mark.parametrize("rows,cols,shift", [(257, 2560, 0), (5, 30, 0), (7, 64, 1)])
def test_matvec_f32_rows_matches_numpy(lib, rows, cols, shift):
    """float4 path (aligned, cols % 4 == 0) and scalar path (cols % 4 != 0, or x one float off alignment)."""
    rng = np.random.default_rng(rows)
    W = _rand(rng, rows, cols)
    xb = _rand(rng, cols + 1)
    x = xb[shift:shift + cols]
    y = np.full(rows, np.nan, np.float32)
    lib.host_matvec_f32_rows(min(rows, 64), 1, _p(W), _p(x), _p(y), rows, cols)
    assert close(y, W.astype(np.float64) @ x.astype(np.float64), 1e-5)


def test_decode_step_compiles_as_host_cpp(tmp_path):
    """decode_step.cu (router with the shared expert's gate, attention, norms) parses as host C++17 with the shims."""
    src = K.cuda_unit("decode_step.cu")
    shim = K.cuda_source("host_kernel_shim.cuh") + "\n"
    (tmp_path / "d.cpp").write_text(shim + src)
    r = subprocess.run([CXX, "-std=c++17", "-fsyntax-only", str(tmp_path / "d.cpp")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'extern "C" __global__ void route_fused_sg(' in K.cuda_unit("decode_step.cu")


@pytest.fixture(scope="module")
def experts_lib(tmp_path_factory):
    from stratatools.model.ggml_types import type_by_name

    d = tmp_path_factory.mktemp("expertshost")
    tids = tuple(sorted({type_by_name(t).id for t in ("Q2_0", "Q8_0", "IQ2_XS", "IQ4_NL")}))
    (d / "experts_host.cpp").write_text(K.experts_host_source(tids))
    so = d / "experts_host.so"
    subprocess.run([CXX, "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(so), str(d / "experts_host.cpp")],
                   check=True, capture_output=True)
    h = ctypes.CDLL(str(so))
    P, I, U = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
    for tid in tids:
        getattr(h, f"host_moe_gate_up_staged_{tid}").argtypes = [U, U, P, P, P, P, P, I, I]
        getattr(h, f"host_moe_down_staged_{tid}").argtypes = [U, U, P, P, P, P, P, I, I, I]
        if tid in K.PIPE_TYPES:
            getattr(h, f"host_moe_gate_up_pipe_{tid}").argtypes = [U, U, P, P, P, P, P, I, I, I]
            getattr(h, f"host_moe_down_pipe_{tid}").argtypes = [U, U, P, P, P, P, P, I, I, I, I, I]
        if tid in K.PIPE_I8_TYPES:
            getattr(h, f"host_moe_gate_up_pipe_i8_{tid}").argtypes = [U, U, P, P, P, P, P, I, I, I]
            getattr(h, f"host_moe_down_pipe_i8_{tid}").argtypes = [U, U, P, P, P, P, P, I, I, I, I, I]
    h.host_smem_poison.argtypes = [ctypes.c_longlong]
    h.host_smem_overrun.argtypes = [ctypes.c_longlong]
    h.host_smem_overrun.restype = ctypes.c_longlong
    return h


@pytest.mark.parametrize("gu,dn,hidden,ff", [("Q2_0", "Q2_0", 512, 128), ("Q8_0", "Q8_0", 256, 96),
                                             ("IQ2_XS", "IQ4_NL", 512, 64)])
def test_staged_expert_kernels_match_reference(experts_lib, gu, dn, hidden, ff):
    """moe_gate_up_staged + moe_down_staged (16-byte staged rows) = expert_ffn_reference, for 2 tokens x 3 experts
    whose blobs sit at unaligned offsets of one buffer that ends exactly at the last blob (the end guard reads no
    byte past it); then the accumulate mode adds onto Y."""
    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.gpu.experts import expert_ffn_reference

    from test_dequant import random_blocks

    tg, td = type_by_name(gu), type_by_name(dn)
    gb = ff * tg.row_bytes(hidden)
    blob_bytes = 2 * gb + hidden * td.row_bytes(ff)
    rng = np.random.default_rng(hidden + ff)
    blobs = []
    for e in range(4):
        g = random_blocks(gu, 2 * gb // tg.type_size, seed=10 * e + 1)
        dd = random_blocks(dn, (blob_bytes - 2 * gb) // td.type_size, seed=10 * e + 2)
        blobs.append(np.concatenate([g, dd.reshape(-1)]).reshape(-1) if g.ndim == 1 else
                     np.concatenate([g.reshape(-1), dd.reshape(-1)]))
    offs = [6, 6 + blob_bytes + 10, 6 + 2 * blob_bytes + 19, 6 + 3 * blob_bytes + 19]
    arena = np.zeros(offs[-1] + blob_bytes, dtype=np.uint8)
    for o, b in zip(offs, blobs):
        arena[o:o + blob_bytes] = b
    base = arena.ctypes.data
    T, k = 2, 3
    routes = [[0, 3, 1], [3, 2, 0]]  # expert 3 ends at the buffer's end
    w = (rng.uniform(0.1, 1.0, (T, k))).astype(np.float32)
    X = (rng.standard_normal((T, hidden)) * 0.5).astype(np.float32)
    ptr = np.array([base + offs[e] for r in routes for e in r], dtype=np.uint64)
    gate, up, down = ptr, ptr + np.uint64(gb), ptr + np.uint64(2 * gb)
    tok = np.repeat(np.arange(T, dtype=np.int32), k)
    tstart = np.arange(0, T * k + 1, k, dtype=np.int32)
    wf = w.reshape(-1).copy()
    hbuf = np.zeros(T * k * ff, dtype=np.float32)
    Y = np.full((T, hidden), np.nan, dtype=np.float32)
    getattr(experts_lib, f"host_moe_gate_up_staged_{tg.id}")(1, T * k, _p(gate), _p(up), _p(tok), _p(X), _p(hbuf),
                                                             hidden, ff)
    getattr(experts_lib, f"host_moe_down_staged_{td.id}")(2, T, _p(down), _p(wf), _p(tstart), _p(hbuf), _p(Y),
                                                          hidden, ff, 0)
    for t in range(T):
        ref = expert_ffn_reference(X[t], [blobs[e] for e in routes[t]], w[t], tg, td, hidden, ff)
        assert close(Y[t], ref, 1e-4), t
    Y0 = Y.copy()
    getattr(experts_lib, f"host_moe_down_staged_{td.id}")(2, T, _p(down), _p(wf), _p(tstart), _p(hbuf), _p(Y),
                                                          hidden, ff, 1)
    assert close(Y, 2 * Y0, 1e-6)


def _expert_arena(gu, dn, hidden, ff, n_exp, gaps):
    """n_exp random expert blobs [gate][up][down] of types gu / dn in one uint8 buffer, blob e at offset
    sum(gaps[:e + 1]) + e * blob bytes (odd gaps: unaligned rows), the buffer ending exactly at the last blob's end."""
    from stratatools.model.ggml_types import type_by_name

    from test_dequant import random_blocks

    tg, td = type_by_name(gu), type_by_name(dn)
    gb = ff * tg.row_bytes(hidden)
    blob_bytes = 2 * gb + hidden * td.row_bytes(ff)
    blobs = [np.concatenate([random_blocks(gu, 2 * gb // tg.type_size, seed=10 * e + 1).reshape(-1),
                             random_blocks(dn, (blob_bytes - 2 * gb) // td.type_size, seed=10 * e + 2).reshape(-1)])
             for e in range(n_exp)]
    offs = [int(sum(gaps[:e + 1])) + e * blob_bytes for e in range(n_exp)]
    arena = np.zeros(offs[-1] + blob_bytes, dtype=np.uint8)
    for o, b in zip(offs, blobs):
        arena[o:o + blob_bytes] = b
    return tg, td, gb, blobs, offs, arena


# (gate/up type, down type, hidden, ff, tokens x experts per token, blocks a token for gate/up, for down, stages)
PIPE_CASES = [
    ("Q2_0", "Q2_0", 512, 128, (2, 3), 1, 2, 2),    # one block a token: all its (job, row) items through one ring
    ("Q2_0", "Q2_0", 512, 192, (1, 1), 5, 3, 3),    # 1 job; rows not a multiple of the grid (uneven items)
    ("Q8_0", "Q8_0", 256, 96, (2, 2), 7, 5, 1),     # Q8_0, no ring (stage then compute)
    ("Q2_0", "Q8_0", 320, 64, (3, 2), 2, 4, 4),     # mixed types, 4 stages (more than some warps' items)
    ("Q2_0", "Q2_0", 2560, 576, (1, 10), 24, 40, 2),  # the full-width decode step's routed shape
]


@pytest.mark.parametrize("gu,dn,hidden,ff,tk,gx1,gx2,nstage", PIPE_CASES)
def test_pipe_expert_kernels_match_reference(experts_lib, gu, dn, hidden, ff, tk, gx1, gx2, nstage):
    """moe_gate_up_pipe + moe_down_pipe (cp.async rings, 16-value units, pre-scaled Q2_0 inputs) =
    expert_ffn_reference for T tokens x k experts whose blobs sit at odd offsets of one buffer that ends exactly at the
    last blob (routed on every token: the end guard of its last rows is taken), with grids that leave warps uneven
    numbers of rows and stage counts from 1 to 4; the staged kernels agree on the same jobs; then the accumulate mode
    adds onto Y."""
    from stratatools.runtime.gpu.experts import expert_ffn_reference

    T, k = tk
    n_exp = max(k + 1, 3)
    tg, td, gb, blobs, offs, arena = _expert_arena(gu, dn, hidden, ff, n_exp, [3] + [7, 10, 19] * n_exp)
    rng = np.random.default_rng(hidden + ff + k)
    routes = [[n_exp - 1] + list(rng.choice(n_exp - 1, size=k - 1, replace=False)) for _ in range(T)]
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    X = (rng.standard_normal((T, hidden)) * 0.5).astype(np.float32)
    base = arena.ctypes.data
    ptr = np.array([base + offs[e] for r in routes for e in r], dtype=np.uint64)
    gate, up, down = ptr, ptr + np.uint64(gb), ptr + np.uint64(2 * gb)
    tok = np.repeat(np.arange(T, dtype=np.int32), k)
    tstart = np.arange(0, T * k + 1, k, dtype=np.int32)
    wf = w.reshape(-1).copy()
    hbuf = np.full(T * k * ff, np.nan, dtype=np.float32)
    Y = np.full((T, hidden), np.nan, dtype=np.float32)
    getattr(experts_lib, f"host_moe_gate_up_pipe_{tg.id}")(gx1, T, _p(gate), _p(up), _p(tstart), _p(X), _p(hbuf),
                                                           hidden, ff, nstage)
    getattr(experts_lib, f"host_moe_down_pipe_{td.id}")(gx2, T, _p(down), _p(wf), _p(tstart), _p(hbuf), _p(Y),
                                                        hidden, ff, 0, nstage, k)
    for t in range(T):
        ref = expert_ffn_reference(X[t], [blobs[e] for e in routes[t]], w[t], tg, td, hidden, ff)
        assert close(Y[t], ref, 1e-4), t
    hs, Ys = np.zeros_like(hbuf), np.zeros_like(Y)
    getattr(experts_lib, f"host_moe_gate_up_staged_{tg.id}")(1, T * k, _p(gate), _p(up), _p(tok), _p(X), _p(hs),
                                                             hidden, ff)
    getattr(experts_lib, f"host_moe_down_staged_{td.id}")(2, T, _p(down), _p(wf), _p(tstart), _p(hs), _p(Ys),
                                                          hidden, ff, 0)
    assert close(hbuf, hs, 1e-5) and close(Y, Ys, 1e-5)
    Y0 = Y.copy()
    getattr(experts_lib, f"host_moe_down_pipe_{td.id}")(gx2, T, _p(down), _p(wf), _p(tstart), _p(hbuf), _p(Y),
                                                        hidden, ff, 1, nstage, k)
    assert close(Y, 2 * Y0, 1e-6)


# (hidden, ff, jobs of each token, max_jobs of the down launch, blocks a token for gate/up, for down, stages)
PIPE_I8_CASES = [
    (512, 128, (3, 3), 3, 1, 2, 2),     # one block a token for gate/up
    (512, 192, (1,), 1, 5, 3, 3),       # 1 job, uneven items
    (320, 64, (2, 1), 3, 2, 4, 4),      # a token with fewer jobs than max_jobs (the layout sized for max_jobs)
    (2560, 576, (10,), 10, 24, 40, 2),  # the full-width decode step's routed shape
]


@pytest.mark.parametrize("hidden,ff,jobs,max_jobs,gx1,gx2,nstage", PIPE_I8_CASES)
def test_pipe_i8_expert_kernels_match_reference(experts_lib, hidden, ff, jobs, max_jobs, gx1, gx2, nstage):
    """moe_gate_up_pipe_i8 + moe_down_pipe_i8 (inputs quantized per block of 32 to 16-bit fixed point in two int8
    planes, int8 dot products on the 2-bit codes) = expert_ffn_reference within 1e-4 of the output's largest value,
    and the float pipelined kernels within the same, for Q2_0 experts at odd offsets of a buffer that ends at the last
    blob; inputs with an all-zero block and a block below the quantizer's floor (2^-100) give finite rows; neither
    kernel writes shared memory past the bytes experts.pipe_*_shared(int8=True) asks for; accumulate adds onto Y."""
    from stratatools.runtime.gpu import experts as E
    from stratatools.runtime.gpu.experts import expert_ffn_reference

    T, k = len(jobs), max(jobs)
    n_exp = k + 1
    tg, td, gb, blobs, offs, arena = _expert_arena("Q2_0", "Q2_0", hidden, ff, n_exp, [3] + [7, 10, 19] * n_exp)
    rng = np.random.default_rng(hidden + ff + k)
    routes = [[n_exp - 1] + list(rng.choice(n_exp - 1, size=nj - 1, replace=False)) for nj in jobs]
    w = [rng.uniform(0.1, 1.0, len(r)).astype(np.float32) for r in routes]
    X = (rng.standard_normal((T, hidden)) * 0.5).astype(np.float32)
    X[0, 32:64] = 0.0  # an all-zero block
    X[-1, 64:96] = 1e-35  # a block under MI8_TINY: counted as zero
    base = arena.ctypes.data
    ptr = np.array([base + offs[e] for r in routes for e in r], dtype=np.uint64)
    gate, up, down = ptr, ptr + np.uint64(gb), ptr + np.uint64(2 * gb)
    tstart = np.concatenate([[0], np.cumsum(jobs)]).astype(np.int32)
    wf = np.concatenate(w).astype(np.float32)
    J = int(tstart[-1])
    hbuf = np.full(J * ff, np.nan, dtype=np.float32)
    Y = np.full((T, hidden), np.nan, dtype=np.float32)
    shm_gu = E.pipe_gu_shared(tg, hidden, 32, nstage, int8=True)  # the host build runs one warp of one lane a block
    experts_lib.host_smem_poison(shm_gu)
    experts_lib.host_moe_gate_up_pipe_i8_42(gx1, T, _p(gate), _p(up), _p(tstart), _p(X), _p(hbuf), hidden, ff, nstage)
    assert experts_lib.host_smem_overrun(shm_gu) == 0
    shm_dn = E.pipe_down_shared(td, ff, max_jobs, 32, nstage, int8=True)
    experts_lib.host_smem_poison(shm_dn)
    experts_lib.host_moe_down_pipe_i8_42(gx2, T, _p(down), _p(wf), _p(tstart), _p(hbuf), _p(Y), hidden, ff, 0, nstage,
                                         max_jobs)
    assert experts_lib.host_smem_overrun(shm_dn) == 0
    assert np.isfinite(Y).all()
    for t in range(T):
        ref = expert_ffn_reference(X[t], [blobs[e] for e in routes[t]], w[t], tg, td, hidden, ff)
        assert close(Y[t], ref, 1e-4), t
    hf, Yf = np.zeros_like(hbuf), np.zeros_like(Y)
    experts_lib.host_moe_gate_up_pipe_42(gx1, T, _p(gate), _p(up), _p(tstart), _p(X), _p(hf), hidden, ff, nstage)
    experts_lib.host_moe_down_pipe_42(gx2, T, _p(down), _p(wf), _p(tstart), _p(hf), _p(Yf), hidden, ff, 0, nstage,
                                      max_jobs)
    assert close(hbuf, hf, 1e-4) and close(Y, Yf, 1e-4)
    assert not np.array_equal(Y, Yf)  # (the integer path did run: its rounding differs)
    Y0 = Y.copy()
    experts_lib.host_moe_down_pipe_i8_42(gx2, T, _p(down), _p(wf), _p(tstart), _p(hbuf), _p(Y), hidden, ff, 1, nstage,
                                         max_jobs)
    assert close(Y, 2 * Y0, 1e-6)


@pytest.mark.parametrize("i8", [False, True])
def test_pipe_staging_of_unaligned_inputs_gives_the_same_rows(experts_lib, i8):
    """The pipelined kernels stage x and h rows with float4 loads when they are 16-byte aligned and value by value
    otherwise: the same hbuf and Y bit for bit with X and hbuf 4 bytes off alignment (float and integer variants)."""
    hidden, ff, T, k = 512, 128, 2, 3
    tg, td, gb, blobs, offs, arena = _expert_arena("Q2_0", "Q2_0", hidden, ff, k + 1, [3, 7, 10, 19])
    rng = np.random.default_rng(7)
    ptr = np.array([arena.ctypes.data + offs[e] for r in ([0, 1, 2], [3, 1, 0]) for e in r], dtype=np.uint64)
    gate, up, down = ptr, ptr + np.uint64(gb), ptr + np.uint64(2 * gb)
    tstart = np.array([0, 3, 6], dtype=np.int32)
    wf = rng.uniform(0.1, 1.0, T * k).astype(np.float32)
    x = (rng.standard_normal((T, hidden)) * 0.5).astype(np.float32)
    sfx = "pipe_i8_42" if i8 else "pipe_42"
    got = []
    for shift in (0, 1):
        buf = np.zeros(T * hidden + 8, dtype=np.float32)
        o = (-(buf.ctypes.data // 4) % 4) + shift  # 16-byte aligned, or one float past it
        X = buf[o:o + T * hidden].reshape(T, hidden)
        X[:] = x
        hb = np.zeros(T * k * ff + 8, dtype=np.float32)
        oh = (-(hb.ctypes.data // 4) % 4) + shift
        hbuf = hb[oh:oh + T * k * ff]
        assert (X.ctypes.data % 16 == 0) == (shift == 0) and (hbuf.ctypes.data % 16 == 0) == (shift == 0)
        Y = np.zeros((T, hidden), dtype=np.float32)
        getattr(experts_lib, f"host_moe_gate_up_{sfx}")(2, T, _p(gate), _p(up), _p(tstart), _p(X), _p(hbuf), hidden,
                                                       ff, 2)
        getattr(experts_lib, f"host_moe_down_{sfx}")(3, T, _p(down), _p(wf), _p(tstart), _p(hbuf), _p(Y), hidden, ff,
                                                    0, 2, k)
        got.append((hbuf.copy(), Y))
    assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])
    assert np.abs(got[0][1]).max() > 0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_pipe_i8_non_finite_input_gives_nan_rows_as_the_float_kernels_do(experts_lib, bad):
    """A NaN or an infinity in x (or in the h rows) makes the integer kernels' outputs NaN, as the float kernels'
    outputs are not finite: the quantizer marks the block's scale NaN instead of clamping the value into range."""
    hidden, ff = 128, 64
    tg, td, gb, blobs, offs, arena = _expert_arena("Q2_0", "Q2_0", hidden, ff, 2, [0, 2])
    ptr = np.array([arena.ctypes.data + o for o in offs], dtype=np.uint64)
    gate, up, down = ptr, ptr + np.uint64(gb), ptr + np.uint64(2 * gb)
    tstart = np.array([0, 2], dtype=np.int32)
    X = np.ones((1, hidden), dtype=np.float32)
    X[0, 5] = bad
    got = {}
    for sfx in ("pipe_42", "pipe_i8_42"):
        hbuf = np.zeros(2 * ff, dtype=np.float32)
        getattr(experts_lib, f"host_moe_gate_up_{sfx}")(1, 1, _p(gate), _p(up), _p(tstart), _p(X), _p(hbuf), hidden,
                                                       ff, 1)
        got[sfx] = hbuf
    assert not np.isfinite(got["pipe_42"]).any() and np.isnan(got["pipe_i8_42"]).all()
    hbuf = np.ones(2 * ff, dtype=np.float32)
    hbuf[ff + 3] = bad
    wf = np.ones(2, dtype=np.float32)
    Y = np.zeros((1, hidden), dtype=np.float32)
    experts_lib.host_moe_down_pipe_i8_42(2, 1, _p(down), _p(wf), _p(tstart), _p(hbuf), _p(Y), hidden, ff, 0, 1, 2)
    assert np.isnan(Y).all()


def test_moe_int8_flag(monkeypatch):
    from stratatools.core.errors import StrataError
    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.gpu import experts as E

    q2, q8 = type_by_name("Q2_0"), type_by_name("Q8_0")
    monkeypatch.delenv(E.MOE_INT8_ENV, raising=False)
    assert E.moe_int8() == "gu" and E.pipe_int8(q2) and not E.pipe_int8(q2, part="down")
    assert not E.pipe_int8(q8) and E.pipe_int8(q2, True, "down") and not E.pipe_int8(q8, True)
    monkeypatch.setenv(E.MOE_INT8_ENV, "1")
    assert E.pipe_int8(q2) and E.pipe_int8(q2, part="down") and not E.pipe_int8(q8) and not E.pipe_int8(q2, False)
    monkeypatch.setenv(E.MOE_INT8_ENV, "0")
    assert not E.pipe_int8(q2) and not E.pipe_int8(q2, part="down")
    # a mode given with the call wins over the environment (the decoders read it once when built)
    assert E.pipe_int8(q2, "gu") and not E.pipe_int8(q2, "gu", "down") and E.pipe_int8(q2, "1", "down")
    with pytest.raises(StrataError, match="integer expert kernels 'x'"):
        E.pipe_int8(q2, "x")
    for bad in ("on", "2", "down"):
        monkeypatch.setenv(E.MOE_INT8_ENV, bad)
        with pytest.raises(StrataError, match=f"STRATATOOLS_MOE_INT8='{bad}': use gu"):
            E.moe_int8()
    # the integer kernels' shared memory: the quantized layout in place of the floats (2560: 2 x 2560 planes,
    # 80 scales, 160 sums)
    assert E.pipe_gu_shared(q2, 2560, 256, 2, int8=True) == 2 * 2560 + 320 + 640 + 8 * 2 * 2 * 736 + 16
    assert E.pipe_down_shared(q2, 576, 10, 256, 1, int8=True) == (2 * 5760 + 720 + 1440 + 80 + 8 * 10 * 192 + 16)


@pytest.mark.parametrize("kernel", ["host_moe_down_pipe_42", "host_moe_down_pipe_i8_42"])
def test_pipe_down_marks_tokens_over_the_job_bound(experts_lib, kernel):
    """A token with more jobs than the launch's max_jobs gets NaN rows (no write past the shared buffers); a token
    within the bound is computed (float and integer down kernels)."""
    tg, td, gb, blobs, offs, arena = _expert_arena("Q2_0", "Q2_0", 128, 64, 3, [0, 2, 2])
    ptr = np.array([arena.ctypes.data + o for o in (offs[0], offs[1], offs[2])], dtype=np.uint64)
    down = ptr + np.uint64(2 * gb)
    tstart = np.array([0, 1, 3], dtype=np.int32)  # token 0: 1 job, token 1: 2 jobs
    wf = np.ones(3, dtype=np.float32)
    hbuf = np.ones(3 * 64, dtype=np.float32)
    Y = np.zeros((2, 128), dtype=np.float32)
    getattr(experts_lib, kernel)(2, 2, _p(down), _p(wf), _p(tstart), _p(hbuf), _p(Y), 128, 64, 0, 2, 1)
    assert np.isfinite(Y[0]).all() and np.abs(Y[0]).max() > 0 and np.isnan(Y[1]).all()


def test_expert_kernel_choice_and_pipe_shapes(monkeypatch):
    """STRATATOOLS_MOE_KERNEL picks staged (default) or pipe; STRATATOOLS_MOE_PIPE overrides the pipelined launch
    shapes part by part; bad values are one-line StrataErrors naming the variable."""
    from stratatools.core.errors import StrataError
    from stratatools.runtime.gpu import experts as E

    monkeypatch.delenv(E.MOE_KERNEL_ENV, raising=False)
    monkeypatch.delenv(E.MOE_PIPE_ENV, raising=False)
    assert E.expert_kernel_choice() == "staged"
    monkeypatch.setenv(E.MOE_KERNEL_ENV, "pipe")
    assert E.expert_kernel_choice() == "pipe" and E.expert_kernel_choice("staged") == "staged"
    monkeypatch.setenv(E.MOE_KERNEL_ENV, "fastest")
    with pytest.raises(StrataError, match="STRATATOOLS_MOE_KERNEL"):
        E.expert_kernel_choice()
    assert E.pipe_shapes() == E.DEFAULT_PIPE
    sh = E.pipe_shapes("down=128x4x3")
    assert sh["down"] == sh["down1"] == E.PipeShape(128, 4, 3)  # the one-job shape follows the given one
    assert sh["gu"] == E.DEFAULT_PIPE["gu"] and sh["gu1"] == E.DEFAULT_PIPE["gu1"]
    monkeypatch.setenv(E.MOE_PIPE_ENV, "gu=64x1x1, down=256x8x2,gu1=32x1x2")
    assert E.pipe_shapes() == {"gu": E.PipeShape(64, 1, 1), "down": E.PipeShape(256, 8, 2),
                               "gu1": E.PipeShape(32, 1, 2), "down1": E.PipeShape(256, 8, 2)}
    for bad in ("gu=256x2", "up=256x2x2", "gu=100x2x2", "gu=256x2x5", "gu=512x1x1", "gu=256x0x1"):
        with pytest.raises(StrataError, match="STRATATOOLS_MOE_PIPE"):
            E.pipe_shapes(bad)


def test_pipe_launch_sizes():
    """Grid and ring slots of the pipelined launches, and their shared memory as moe_staged.cu lays it out, at the
    full-width shape: (Q2_0 gate/up rows of 720 bytes take 736-byte slots, down rows of 162 bytes 192-byte slots)."""
    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.gpu import experts as E

    q2, q8 = type_by_name("Q2_0"), type_by_name("Q8_0")
    assert E._pipe_grid(576, E.PipeShape(256, 2, 2)) == (36, 2)
    assert E._pipe_grid(576, E.PipeShape(256, 3, 3)) == (24, 3)
    assert E._pipe_grid(576, E.PipeShape(256, 1, 3)) == (72, 1)  # slots clipped to the rows a warp gets
    assert E._pipe_grid(100, E.PipeShape(64, 3, 4)) == (17, 3)  # 17 blocks x 2 warps: at most 3 rows, 3 slots
    assert E.pipe_gu_shared(q2, 2560, 256, 2) == 2560 * 4 + 8 * 2 * 2 * 736 + 16
    assert E.pipe_down_shared(q2, 576, 10, 256, 2) == 10 * 576 * 4 + 16 * 3 + 16 * 5 + 8 * 2 * 10 * 192 + 16
    assert E.pipe_gu_shared(q8, 2560, 256, 4) <= E.PIPE_MAX_SHARED < E.pipe_gu_shared(q8, 2560, 256, 4) + 48 * 1024

    class Jobs:
        def __init__(self, J, T, per_token=None):
            self.n_jobs, self.n_tokens, self.per_token = J, T, per_token

    sh = {"gu": E.DEFAULT_PIPE["gu"], "down": E.DEFAULT_PIPE["down"]}
    assert E.pipe_fits(Jobs(10, 1), q2, q2, 2560, 576, sh)
    assert E.pipe_max_jobs(Jobs(320, 32, 10)) == 10 and E.pipe_max_jobs(Jobs(320, 32)) == 320
    assert E.pipe_fits(Jobs(320, 32, 10), q2, q2, 2560, 576, sh)
    assert not E.pipe_fits(Jobs(320, 32), q2, q2, 2560, 576, sh)  # 320 jobs' h rows do not fit: staged
    assert not E.pipe_fits(Jobs(10, 1), type_by_name("IQ2_XS"), q2, 2560, 576, sh)


@pytest.mark.parametrize("gu,dn,all_resident,env,routed", [
    ("Q2_0", "Q2_0", True, None, "pipe"), ("Q2_0", "Q2_0", False, None, "staged"),
    ("IQ2_XS", "IQ4_NL", True, None, "staged"), ("IQ2_XS", "IQ4_NL", True, "pipe", "staged"),
    ("Q2_0", "IQ4_NL", True, None, "staged"), ("Q8_0", "Q8_0", True, "staged", "staged"),
    ("Q8_0", "Q8_0", False, "pipe", "pipe")])
def test_decoder_expert_kernels_fall_back_for_types_without_pipe(monkeypatch, gu, dn, all_resident, env, routed):
    """The fused decode step's expert kernels on the full-width shape (hidden 2560, ff 640, 10 routed jobs of one
    token; the Q8_0 shared expert, 1 job): the decoder asks for the pipelined kernels (all resident, or
    STRATATOOLS_MOE_KERNEL=pipe), and a call whose types have none (PIPE_TYPES: Q8_0, Q2_0; issue 12's
    IQ2_XS + IQ4_NL) runs on the staged kernels instead of failing; the shared expert stays pipelined."""
    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.gpu import experts as E

    class Jobs:
        def __init__(self, J, T, per_token=None):
            self.n_jobs, self.n_tokens, self.per_token = J, T, per_token

    if env is None:
        monkeypatch.delenv(E.MOE_KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(E.MOE_KERNEL_ENV, env)
    monkeypatch.delenv(E.MOE_PIPE_ENV, raising=False)
    k_routed, k_shared = E.decoder_expert_kernels(from_device=all_resident)
    assert k_shared == (env or "pipe") and k_routed == (env or ("pipe" if all_resident else "staged"))
    gt, dt = type_by_name(gu), type_by_name(dn)
    assert E.expert_kernel_path(Jobs(10, 1), gt, dt, 2560, 640, fast=True, kernels=k_routed) == routed
    q8 = type_by_name("Q8_0")
    assert E.expert_kernel_path(Jobs(1, 1), q8, q8, 2560, 640, fast=True, kernels=k_shared) == (env or "pipe")
    # without fast (the reference step) the warp-per-row kernels; misaligned buffers or rows over MOE_ROW_MAX too
    assert E.expert_kernel_path(Jobs(10, 1), gt, dt, 2560, 640, fast=False, kernels="pipe") == "warp"
    assert E.expert_kernel_path(Jobs(10, 1), gt, dt, 2560, 640, fast=True, kernels="staged", aligned=False) == "warp"
    assert E.expert_kernel_path(Jobs(10, 1), gt, dt, 1 << 15, 640, fast=True, kernels="staged") == (
        "staged" if gt.row_bytes(1 << 15) <= E.MOE_ROW_MAX else "warp")


def test_pipe_tokens_with_different_job_counts(experts_lib):
    """Tokens with 2, 0 and 3 jobs (tstart 0, 2, 2, 5): the pipelined kernels give the staged kernels' h and y (the
    token without jobs: zeros), the gate/up grid sized for the busiest token."""
    tg, td, gb, blobs, offs, arena = _expert_arena("Q2_0", "Q2_0", 256, 128, 5, [1, 3, 5, 7, 9])
    ptr = np.array([arena.ctypes.data + offs[e] for e in (0, 4, 1, 2, 3)], dtype=np.uint64)
    gate, up, down = ptr, ptr + np.uint64(gb), ptr + np.uint64(2 * gb)
    tstart = np.array([0, 2, 2, 5], dtype=np.int32)
    tok = np.array([0, 0, 2, 2, 2], dtype=np.int32)
    rng = np.random.default_rng(5)
    X = rng.standard_normal((3, 256)).astype(np.float32)
    wf = rng.uniform(0.1, 1, 5).astype(np.float32)
    out = {}
    for kind in ("staged", "pipe"):
        hb, Y = np.zeros(5 * 128, np.float32), np.full((3, 256), np.nan, np.float32)
        if kind == "staged":
            experts_lib.host_moe_gate_up_staged_42(1, 5, _p(gate), _p(up), _p(tok), _p(X), _p(hb), 256, 128)
            experts_lib.host_moe_down_staged_42(2, 3, _p(down), _p(wf), _p(tstart), _p(hb), _p(Y), 256, 128, 0)
        else:
            experts_lib.host_moe_gate_up_pipe_42(3, 3, _p(gate), _p(up), _p(tstart), _p(X), _p(hb), 256, 128, 2)
            experts_lib.host_moe_down_pipe_42(2, 3, _p(down), _p(wf), _p(tstart), _p(hb), _p(Y), 256, 128, 0, 2, 3)
        out[kind] = hb, Y
    assert close(out["pipe"][0], out["staged"][0], 1e-5) and close(out["pipe"][1], out["staged"][1], 1e-5)
    assert not out["pipe"][1][1].any() and np.abs(out["pipe"][1][2]).max() > 0
