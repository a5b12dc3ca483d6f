"""The fused decode step's attention kernels (stratatools/runtime/gpu/attn_step.cu) checked on the CPU: the CUDA source
compiled as host C++ (host_kernel_shim.cuh runs each block as one thread) against the numpy formulas the reference
decode step uses (stratatools.runtime.model._rmsnorm, Rope.apply, _sigmoid), at a small shape and at the full-width
model's heads (partial rotary). Skips without a C++ compiler."""

from __future__ import annotations


import numpy as np
import pytest

from hostlib import CXX, build_host_lib
from hostlib import rand32 as _rand
from stratatools.runtime.model import Rope, _rmsnorm, _sigmoid

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the host copy of the kernels")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_host_lib(tmp_path_factory.mktemp("attnhost"), "attn_step.cu")


@pytest.mark.parametrize("nh,nkv,hd,n_rot,wq_full,pos", [(4, 2, 16, 8, False, 3), (16, 2, 256, 64, False, 700),
                                                         (3, 3, 8, 8, True, 0)])
def test_attn_prep_matches_numpy(lib, nh, nkv, hd, n_rot, wq_full, pos):
    """attn_prep = the decoder's q/k RMS norms (per-head or whole-tensor weights) and rope at the step's position,
    the key and value rows written into the caches at that position and nowhere else."""
    rng = np.random.default_rng(nh * 1000 + hd + pos)
    eps = 1e-6
    qraw, kraw, vraw = _rand(rng, nh * 2 * hd), _rand(rng, nkv * hd), _rand(rng, nkv * hd)
    wq = _rand(rng, nh * hd if wq_full else hd) + 1
    wk = _rand(rng, hd) + 1
    rope = Rope(np, n_rot, 10000.0)
    cos, sin = rope.cos_sin(np.array([pos]))
    cos, sin = np.ascontiguousarray(cos[0], dtype=np.float32), np.ascontiguousarray(sin[0], dtype=np.float32)
    # numpy reference: StaticDecoder._attention before the scores
    q = qraw.reshape(nh, 2 * hd)[:, :hd]
    qn = _rmsnorm(np, q, wq.reshape(nh, hd) if wq_full else wq, eps)
    kn = _rmsnorm(np, kraw.reshape(nkv, hd), wk, eps)
    qref = rope.apply(qn[None], cos[None], sin[None])[0]
    kref = rope.apply(kn[None], cos[None], sin[None])[0]
    max_ctx = pos + 3
    Kc = np.full((max_ctx, nkv, hd), np.nan, dtype=np.float32)
    Vc = np.full((max_ctx, nkv, hd), np.nan, dtype=np.float32)
    qout = np.full((nh, hd), np.nan, dtype=np.float32)
    posv = np.array([pos], dtype=np.int32)
    lib.host_attn_prep(nh + nkv, 1, qraw.ctypes.data, kraw.ctypes.data, vraw.ctypes.data, wq.ctypes.data, wq.size,
                       wk.ctypes.data, wk.size, cos.ctypes.data, sin.ctypes.data, n_rot, nh, nkv, hd, eps,
                       posv.ctypes.data, qout.ctypes.data, Kc.ctypes.data, Vc.ctypes.data)
    assert np.abs(qout - qref).max() / np.abs(qref).max() <= 2e-6
    assert np.abs(Kc[pos] - kref).max() / np.abs(kref).max() <= 2e-6
    assert np.array_equal(Vc[pos], vraw.reshape(nkv, hd))
    others = np.delete(np.arange(max_ctx), pos)
    assert np.isnan(Kc[others]).all() and np.isnan(Vc[others]).all()


@pytest.mark.parametrize("nh,hd,gx", [(4, 16, 1), (16, 256, 7)])
def test_attn_gate_mul_matches_numpy(lib, nh, hd, gx):
    rng = np.random.default_rng(nh + hd)
    o, qraw = _rand(rng, nh * hd), _rand(rng, nh * 2 * hd, scale=3.0)
    ref = o * _sigmoid(np, qraw.reshape(nh, 2 * hd)[:, hd:].reshape(-1))
    out = np.full(nh * hd, np.nan, dtype=np.float32)
    lib.host_attn_gate_mul(gx, 1, o.ctypes.data, qraw.ctypes.data, nh, hd, out.ctypes.data)
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-6
