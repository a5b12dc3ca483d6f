"""The batched decode step's attention kernels (stratatools/runtime/gpu/attn_batch.cu) checked on the CPU: the CUDA
source compiled as host C++ (host_kernel_shim.cuh runs each block as one thread) against the numpy formulas of
BatchDecoder._attention (stratatools.runtime.model _rmsnorm, Rope.apply, _softmax, _sigmoid), tokens of several
places at different positions, grouped query heads, partial rotary; and the wiring (BatchDecoder._attention_kernels)
on a stand-in for CuPy against the array path on a small synthetic model. Skips without a C++ compiler."""

from __future__ import annotations

import io
import types

import numpy as np
import pytest

from hostlib import CXX, build_host_lib, shared_within
from hostlib import rand32 as _f
from stratatools.runtime.gpu import kernels as K
from stratatools.runtime.model import Rope, _rmsnorm, _sigmoid, _softmax

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the host copy of the kernels")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_host_lib(tmp_path_factory.mktemp("attnbatch"), "attn_batch.cu")


def _p(a):
    assert a.flags.c_contiguous and a.dtype in (np.float32, np.int32)
    return a.ctypes.data


@pytest.mark.parametrize("nh,nkv,hd,n_rot,wq_full", [(4, 2, 16, 8, False), (6, 3, 8, 8, True), (2, 1, 12, 4, False)])
def test_attn_batch_kernels_match_numpy(lib, nh, nkv, hd, n_rot, wq_full):
    rng = np.random.default_rng(nh * 10 + hd)
    N, mc, eps = 4, 9, 1e-6
    places = np.array([3, 0, 2], dtype=np.int32)
    pos = np.array([5, 0, 8], dtype=np.int32)
    T = places.size
    qraw, kraw, vraw = _f(rng, T, nh, 2 * hd), _f(rng, T, nkv, hd), _f(rng, T, nkv, hd)
    wq = _f(rng, nh * hd if wq_full else hd) + 1
    wk = _f(rng, hd) + 1
    rope = Rope(np, n_rot, 10000.0)
    cos, sin = (np.ascontiguousarray(a, dtype=np.float32) for a in rope.cos_sin(pos))
    Kc, Vc = _f(rng, N, mc, nkv, hd), _f(rng, N, mc, nkv, hd)
    K0, V0 = Kc.copy(), Vc.copy()
    q = np.full((T, nh, hd), np.nan, dtype=np.float32)
    with shared_within(lib, hd * 4):  # BatchDecoder._attention_kernels' launch: one head's values
        lib.host_attn_prep_b(nh + nkv, T, _p(qraw), _p(kraw), _p(vraw), _p(wq), wq.size, _p(wk), wk.size, _p(cos),
                             _p(sin), n_rot, nh, nkv, hd, eps, _p(places), _p(pos), mc, _p(q), _p(Kc), _p(Vc))
    # numpy: BatchDecoder._attention's array code
    qn = _rmsnorm(np, qraw[..., :hd], wq.reshape(nh, hd) if wq_full else wq, eps)
    kn = _rmsnorm(np, kraw, wk, eps)
    qref, kref = rope.apply(qn, cos, sin), rope.apply(kn, cos, sin)
    np.testing.assert_allclose(q, qref, rtol=2e-6, atol=1e-6)
    K1, V1 = K0.copy(), V0.copy()
    K1[places, pos], V1[places, pos] = kref, vraw
    np.testing.assert_allclose(Kc, K1, rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(Vc, V1)  # only the tokens' rows changed, values copied
    out = np.full((T, nh * hd), np.nan, dtype=np.float32)
    scale = np.float32(hd ** -0.5)
    with shared_within(lib, 4 * (int(pos.max()) + 1)):  # the launch's scores: the longest place's positions
        lib.host_attn_decode_b(nh, T, _p(q), _p(Kc), _p(Vc), _p(places), _p(pos), mc, _p(qraw), _p(out), nh, nkv,
                               hd, scale)
    grp = nh // nkv
    for t in range(T):
        P = int(pos[t]) + 1
        Kt, Vt = Kc[places[t], :P], Vc[places[t], :P]  # [P, nkv, hd]
        for h in range(nh):
            sc = (Kt[:, h // grp] @ q[t, h]) * scale
            o = _softmax(np, sc) @ Vt[:, h // grp]
            want = o * _sigmoid(np, qraw[t, h, hd:])
            np.testing.assert_allclose(out[t, h * hd:(h + 1) * hd], want, rtol=3e-6, atol=1e-6)


class _HostKernel:
    def __init__(self, lib, name):
        self.lib, self.name = lib, name
        self.params = K.kernel_signatures("attn_batch.cu")[name]
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0):
        assert len(args) == len(self.params)
        conv = []
        for a, (t, p) in zip(args, self.params):
            if "*" in t:
                want = np.int32 if t.startswith("const int") else np.float32
                assert isinstance(a, np.ndarray) and a.dtype == want and a.flags.c_contiguous, (self.name, p)
                conv.append(a.ctypes.data)
            else:
                assert type(a) is {"int": np.int32, "float": np.float32}[t], (self.name, p, type(a))
                conv.append(a)
        with shared_within(self.lib, shared_mem):  # the bytes the launcher asks the device for
            getattr(self.lib, f"host_{self.name}")(grid[0], grid[1], *conv)


def _synth_decoder(tmp_path):
    """The 4-layer, 8-expert synthetic release on numpy: (weights, runtime, a static decoder of 10 positions, its
    first attention layer). The caller closes the weights."""
    from stratatools.cli import run_captured
    from stratatools.runtime.gpu.decode import StaticDecoder
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    out, err = io.StringIO(), io.StringIO()
    assert run_captured(["synth", str(tmp_path / "rel"), "--layers", "4", "--experts", "8", "--k", "2",
                         "--no-revisions", "--json"], out, err) == 0, err.getvalue()
    w = load(tmp_path / "rel" / "synth-canonical.gguf", None)
    rt = Qwen4ExpRuntime(w)
    il = next(i for i in range(w.cfg.n_layer) if not w.cfg.recurrent[i])
    return w, rt, StaticDecoder(rt, max_ctx=10), il


def _on_host_kernels(m, lib, module, name, obj, w):
    """Within the monkeypatch context ``m``: ``module.name`` gives the host build of attn_batch.cu, and ``obj`` (a
    prefiller or batched decoder on numpy) takes the GPU path with a stand-in for CuPy and float32 matrices."""
    mod = types.SimpleNamespace(get_function=lambda kname: _HostKernel(lib, kname))
    m.setattr(module, name, lambda: mod)
    m.setattr(obj, "cp", types.SimpleNamespace(ascontiguousarray=np.ascontiguousarray, asarray=np.asarray,
                                               float32=np.float32, empty=np.empty), raising=False)
    m.setattr(obj, "_weight", lambda wname: w.get(wname).reshape(w.get(wname).shape[0], -1))
    m.setattr(obj, "gpu", True)


def test_batched_attention_on_the_kernels_matches_the_array_code(lib, tmp_path, monkeypatch):
    from stratatools.runtime.gpu import batch as B

    w, rt, dec, il = _synth_decoder(tmp_path)
    cfg = w.cfg
    try:
        bd = B.BatchDecoder(dec, 3)
        rng = np.random.default_rng(11)
        kc0, vc0 = _f(rng, *bd.kc[il].shape), _f(rng, *bd.vc[il].shape)
        x = _f(rng, 2, cfg.n_embd)
        pos = np.array([6, 2])
        cos, sin = rt.rope.cos_sin(pos)
        results = []
        for kernels in (False, True):
            bd.kc[il][...], bd.vc[il][...] = kc0, vc0
            bd._places(np.array([2, 0]), pos)
            with monkeypatch.context() as m:
                if kernels:
                    _on_host_kernels(m, lib, B, "_attn_module", bd, w)
                    y = bd._attention_kernels(il, x, pos, cos, sin)
                    assert y is not None
                else:
                    y = bd._attention(il, x, pos, cos, sin)
            results.append((np.array(y), bd.kc[il].copy(), bd.vc[il].copy()))
        for a, b in zip(*results):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6 * float(np.abs(a).max()))
        assert not np.array_equal(results[1][1][2, 6], kc0[2, 6]) and np.array_equal(results[1][1][1], kc0[1])
    finally:
        w.close()


def test_prefill_graph_attention_on_the_kernels_matches_the_array_code(lib, tmp_path, monkeypatch):
    """ChunkPrefill._attention_graph (the prefill graph's attention: the decoder's caches as those of one place, each
    row at its position from the graph's position buffer) on a stand-in for CuPy against the eager chunk's array
    attention (_attention at pos0) for a chunk after earlier positions: the same outputs and caches; the chunk's rows
    written, the rest of the caches untouched."""
    from stratatools.runtime.gpu import prefill as PF

    w, rt, dec, il = _synth_decoder(tmp_path)
    cfg = w.cfg
    try:
        pf = dec.prefiller(4)
        rng = np.random.default_rng(12)
        kc0, vc0 = _f(rng, *dec.kc[il].shape), _f(rng, *dec.vc[il].shape)
        T, pos0 = 4, 3
        x = _f(rng, T, cfg.n_embd)
        pos = np.arange(pos0, pos0 + T)
        cos, sin = rt.rope.cos_sin(pos)
        results = []
        for kernels in (False, True):
            dec.kc[il][...], dec.vc[il][...] = kc0, vc0
            with monkeypatch.context() as m:
                if kernels:
                    _on_host_kernels(m, lib, PF, "attn_module", pf, w)
                    m.setattr(pf, "_pgraph", {"pl": np.zeros(T, dtype=np.int32), "pos": pos.astype(np.int32)})
                    assert pf._attn_kernels_ok(il, dec.max_ctx) and not pf._attn_kernels_ok(il, PF.ATTN_B_MAX_SHARED)
                    y = pf._attention_graph(il, x, cos, sin)
                else:
                    y = pf._attention(il, x, pos0, cos, sin)
            results.append((np.array(y), dec.kc[il].copy(), dec.vc[il].copy()))
        for a, b in zip(*results):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6 * float(np.abs(a).max()))
        kc = results[1][1]
        assert np.array_equal(kc[:pos0], kc0[:pos0]) and np.array_equal(kc[pos0 + T:], kc0[pos0 + T:])
        assert not np.array_equal(kc[pos0:pos0 + T], kc0[pos0:pos0 + T])
    finally:
        w.close()
