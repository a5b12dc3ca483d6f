"""The batched gated-DeltaNet element-wise kernels (stratatools/runtime/gpu/gdn_prep.cu) checked on the CPU: the CUDA
source compiled as host C++ (host_kernel_shim.cuh runs each block as one thread) against the numpy formulas of the
prefill's and the batched step's GDN (stratatools.runtime.model _silu, _l2norm, _sigmoid, _softplus, _rmsnorm): one
sequence of T rows with a conv state (prefill, T below and above K-1), and T sequences of one row each (batched decode
places), with fewer blocks than rows (grid stride). Skips without a C++ compiler."""

from __future__ import annotations


import numpy as np
import pytest

from hostlib import CXX, build_host_lib, shared_within
from hostlib import rand32 as _f
from stratatools.runtime.gpu import kernels as K
from stratatools.runtime.model import _l2norm, _rmsnorm, _sigmoid, _silu, _softplus

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the host copy of the kernels")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_host_lib(tmp_path_factory.mktemp("gdnprep"), "gdn_prep.cu")


def _p(a: np.ndarray) -> int:
    assert a.dtype == np.float32 and a.flags.c_contiguous
    return a.ctypes.data


@pytest.mark.parametrize("nseq,length,Kc,nk,dk,nv,dv,blocks,parts", [
    (1, 9, 4, 2, 8, 4, 6, 3, 1),     # prefill: one sequence, more rows than K - 1
    (1, 2, 4, 2, 8, 4, 6, 7, 1),     # prefill chunk shorter than the conv state
    (5, 1, 4, 1, 16, 2, 8, 2, 1),    # batched decode: five places of one row
    (3, 4, 1, 2, 4, 2, 4, 5, 1),     # no conv history (K = 1)
    (5, 1, 4, 2, 8, 4, 6, 3, 3),     # rows in parts: 7 units of 8 channels in parts of 3, 3, 1 (q / k / v mixed)
    (4, 1, 4, 1, 16, 2, 8, 4, 3),    # 3 units in 3 parts: one q head, one k head, the v channels
    (2, 1, 2, 2, 8, 3, 8, 1, 9),     # more parts than the 7 units: the last parts have none
])
def test_pf_gdn_prep_matches_numpy(lib, nseq, length, Kc, nk, dk, nv, dv, blocks, parts):
    rng = np.random.default_rng(nseq * 100 + length * 10 + Kc)
    C = 2 * nk * dk + nv * dv
    R = nseq * length
    qkv, state, wc = _f(rng, R, C), _f(rng, nseq, Kc - 1, C), _f(rng, C, Kc, scale=0.5)
    b, a = _f(rng, R, nv), _f(rng, R, nv, scale=3.0)
    a[0, 0] = 25.0  # softplus past its threshold
    ssm_a, dt_bias = -np.abs(_f(rng, nv)), _f(rng, nv)
    qscale = np.float32(dk ** -0.5)
    outs = [np.full(s, np.nan, dtype=np.float32) for s in ((nseq, Kc - 1, C), (R, nk, dk), (R, nk, dk), (R, nv * dv),
                                                           (R, nv), (R, nv))]
    st_out, qn, kn, v, beta, decay = outs
    from stratatools.runtime.gpu.prefill import gdn_prep_shared

    with shared_within(lib, gdn_prep_shared(nk, dk)):
        lib.host_pf_gdn_prep(blocks, parts, _p(qkv), _p(state), _p(st_out), _p(wc), C, Kc, nseq, length, _p(b), _p(a),
                             _p(ssm_a), _p(dt_bias), nk, dk, nv, qscale, _p(qn), _p(kn), _p(v), _p(beta), _p(decay),
                             C, nv)
    # numpy: the prefill's _gdn per sequence
    for s in range(nseq):
        rows = slice(s * length, (s + 1) * length)
        xin = np.concatenate([state[s], qkv[rows]], axis=0)
        conv = np.zeros((length, C), dtype=np.float32)
        for kk in range(Kc):
            conv = conv + xin[kk:kk + length] * wc[:, kk][None, :]
        conv = _silu(np, conv)
        q = _l2norm(np, conv[:, :nk * dk].reshape(length, nk, dk)) * np.float32(dk ** -0.5)
        k = _l2norm(np, conv[:, nk * dk:2 * nk * dk].reshape(length, nk, dk))
        np.testing.assert_allclose(qn[rows], q, rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(kn[rows], k, rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(v[rows], conv[:, 2 * nk * dk:], rtol=2e-6, atol=1e-7)
        np.testing.assert_array_equal(st_out[s], xin[xin.shape[0] - (Kc - 1):] if Kc > 1 else st_out[s])
    np.testing.assert_allclose(beta, _sigmoid(np, b), rtol=1e-6)
    want = np.exp(ssm_a[None, :] * _softplus(np, a + dt_bias[None, :])).astype(np.float32)
    np.testing.assert_allclose(decay, want, rtol=2e-6)


@pytest.mark.parametrize("R,nv,dv,wlen,gate,blocks,parts", [(6, 4, 8, 8, 1, 4, 1), (3, 2, 16, 32, 0, 1, 1),
                                                           (1, 3, 5, 5, 1, 2, 1), (4, 5, 8, 8, 1, 2, 2),
                                                           (2, 3, 4, 12, 0, 1, 5)])
def test_pf_gdn_out_matches_numpy(lib, R, nv, dv, wlen, gate, blocks, parts):
    rng = np.random.default_rng(R * nv + dv)
    o, z, w = _f(rng, R, nv * dv, scale=2.0), _f(rng, R, nv * dv), _f(rng, wlen) + 1
    y = np.full((R, nv * dv), np.nan, dtype=np.float32)
    eps = 1e-6
    lib.host_pf_gdn_out(blocks, parts, _p(o), _p(z), _p(w), wlen, eps, gate, R, nv, dv, _p(y), nv * dv)
    on = _rmsnorm(np, o.reshape(R, nv, dv), w if wlen == dv else w.reshape(nv, dv), eps)
    act = _sigmoid(np, z) if gate else _silu(np, z)
    np.testing.assert_allclose(y, (on.reshape(R, nv * dv) * act), rtol=2e-6, atol=1e-7)


def test_gdn_kernels_take_rows_of_a_wider_array(lib):
    """pf_gdn_prep's qkv, b and a and pf_gdn_out's z given as columns of one wider array (the batched step's joined
    in-projection: rows ldq / ldb / ldz floats apart) give the bits of the contiguous copies."""
    from stratatools.runtime.gpu.prefill import gdn_prep_shared

    rng = np.random.default_rng(12)
    nseq, Kc, nk, dk, nv, dv = 5, 4, 2, 8, 4, 6
    C, R = 2 * nk * dk + nv * dv, nseq
    wide = _f(rng, R, C + nv * dv + 2 * nv + 3)  # [qkv | z | b | a | 3 spare]
    qkv, z = wide[:, :C], wide[:, C:C + nv * dv]
    b, a = wide[:, C + nv * dv:C + nv * dv + nv], wide[:, C + nv * dv + nv:C + nv * dv + 2 * nv]
    state, wc = _f(rng, nseq, Kc - 1, C), _f(rng, C, Kc, scale=0.5)
    ssm_a, dt_bias = -np.abs(_f(rng, nv)), _f(rng, nv)
    ld = wide.shape[1]
    res = []
    for args in ((qkv, b, a, ld, ld), tuple(np.ascontiguousarray(x) for x in (qkv, b, a)) + (C, nv)):
        q8, b8, a8, ldq, ldb = args
        outs = [np.full(sh, np.nan, dtype=np.float32) for sh in ((nseq, Kc - 1, C), (R, nk, dk), (R, nk, dk),
                                                               (R, nv * dv), (R, nv), (R, nv))]
        with shared_within(lib, gdn_prep_shared(nk, dk)):
            lib.host_pf_gdn_prep(2, 3, q8.ctypes.data, _p(state), _p(outs[0]), _p(wc), C, Kc, nseq, 1, b8.ctypes.data,
                                 a8.ctypes.data, _p(ssm_a), _p(dt_bias), nk, dk, nv, np.float32(dk ** -0.5),
                                 *[_p(x) for x in outs[1:]], ldq, ldb)
        res.append(outs)
    for x, y in zip(*res):
        assert np.array_equal(x, y)
    o, w = _f(rng, R, nv * dv, scale=2.0), _f(rng, dv) + 1
    ys = []
    for zz, ldz in ((z, ld), (np.ascontiguousarray(z), nv * dv)):
        y = np.full((R, nv * dv), np.nan, dtype=np.float32)
        lib.host_pf_gdn_out(3, 2, _p(o), zz.ctypes.data, _p(w), dv, 1e-6, 1, R, nv, dv, _p(y), ldz)
        ys.append(y)
    assert np.array_equal(ys[0], ys[1]) and not np.isnan(ys[0]).any()


# -- the wiring in the batched paths (ChunkPrefill._gdn, BatchDecoder._gdn) on a stand-in for CuPy ----------------
# The GPU branch of each runs with device arrays that are numpy arrays and gdn_prep.cu's kernels from the host build;
# the recurrence and the dense products are the numpy ones. Against the array-code branch on a small synthetic model:
# the same output and the same conv and recurrent states afterwards.


class _HostKernel:
    def __init__(self, lib, name):
        self.lib, self.name = lib, name
        self.params = K.kernel_signatures("gdn_prep.cu")[name]

    def __call__(self, grid, block, args, shared_mem=0):
        assert len(args) == len(self.params)
        conv = []
        for a, (t, p) in zip(args, self.params):
            if "*" in t:
                assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous, (self.name, p)
                conv.append(a.ctypes.data)
            else:
                assert type(a) is {"int": np.int32, "float": np.float32}[t], (self.name, p, type(a))
                conv.append(a)
        with shared_within(self.lib, shared_mem):  # the bytes the launcher asks the device for
            getattr(self.lib, f"host_{self.name}")(grid[0], 1, *conv)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from stratatools.cli import run_captured
    import io

    d = tmp_path_factory.mktemp("gdnwire")
    out, err = io.StringIO(), io.StringIO()
    code = run_captured(["synth", str(d / "rel"), "--layers", "2", "--experts", "8", "--k", "2", "--no-revisions",
                         "--json"], out, err)
    assert code == 0, err.getvalue()
    return d / "rel" / "synth-canonical.gguf"


def _on_kernels(monkeypatch, lib, obj, recur_name):
    """Run obj's GPU branch of _gdn on numpy arrays: fake CuPy, host kernels, numpy recurrence and products."""
    import types

    from stratatools.runtime.gpu import prefill as P

    mod = types.SimpleNamespace(get_function=lambda name: _HostKernel(lib, name))
    monkeypatch.setattr(P, "_gdn_module", lambda: mod)
    fake = types.SimpleNamespace(ascontiguousarray=np.ascontiguousarray, float32=np.float32, empty=np.empty)
    w = obj.w
    orig = getattr(obj, recur_name)

    def numpy_recur(*a, **k):
        obj.gpu = False
        try:
            return orig(*a, **k)
        finally:
            obj.gpu = True

    monkeypatch.setattr(obj, "cp", fake, raising=False)
    monkeypatch.setattr(obj, "_weight", lambda name: w.get(name).reshape(w.get(name).shape[0], -1))
    monkeypatch.setattr(obj, recur_name, numpy_recur)
    monkeypatch.setattr(obj, "gpu", True)


def test_prefill_and_batched_gdn_use_the_kernels_like_the_array_code(lib, small_model, monkeypatch):
    from stratatools.runtime.gpu.batch import BatchDecoder
    from stratatools.runtime.gpu.decode import StaticDecoder
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    w = load(small_model, None)
    try:
        rt = Qwen4ExpRuntime(w)
        cfg = w.cfg
        il = next(i for i in range(cfg.n_layer) if cfg.recurrent[i])
        dec = StaticDecoder(rt, max_ctx=16)
        rng = np.random.default_rng(3)
        x = _f(rng, 7, cfg.n_embd)
        def both_ways(owner, make, recur_name, xx, before=lambda: None):
            """``make()._gdn(il, xx)`` on the array code and on the host kernels, each from the same conv / SSM
            states of ``owner`` (``before`` runs first each time): outputs and next states agree; returns the
            states given and both runs' (output, conv, ssm)."""
            conv0 = _f(rng, *owner.conv[il].shape)
            ssm0 = _f(rng, *owner.ssm[il].shape, scale=0.1)
            results = []
            for kernels in (False, True):
                obj = make()
                owner.conv[il][...] = conv0
                owner.ssm[il][...] = ssm0
                before()
                with monkeypatch.context() as m:
                    if kernels:
                        _on_kernels(m, lib, obj, recur_name)
                    y = obj._gdn(il, xx)
                results.append((np.array(y), owner.conv[il].copy(), owner.ssm[il].copy()))
            for a, b in zip(*results):
                np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6 * float(np.abs(a).max()))
            return conv0, results

        conv0, results = both_ways(dec, dec.prefiller, "_gdn_recur", x)
        assert not np.array_equal(results[0][1], conv0)  # the conv state moved on
        # batched decode: places 2 and 0 of 3, each with its own conv state
        bd = BatchDecoder(dec, 3)
        conv_p, results = both_ways(bd, lambda: bd, "_gdn_step_b", _f(rng, 2, cfg.n_embd),
                                    lambda: bd._places(np.array([2, 0]), np.zeros(2, dtype=np.int64)))
        assert np.array_equal(results[1][1][1], conv_p[1])  # place 1 was not in the step
    finally:
        w.close()


def test_pf_gdn_prep_updates_the_state_in_place_for_one_row_a_sequence(lib):
    """pf_gdn_prep with state_out = state (every sequence one row: the batched step) leaves in the state the bits a
    separate state_out gets, and the same outputs."""
    from stratatools.runtime.gpu.prefill import gdn_prep_shared

    rng = np.random.default_rng(13)
    nseq, Kc, nk, dk, nv, dv = 4, 4, 2, 8, 4, 6
    C = 2 * nk * dk + nv * dv
    qkv, state0, wc = _f(rng, nseq, C), _f(rng, nseq, Kc - 1, C), _f(rng, C, Kc, scale=0.5)
    b, a = _f(rng, nseq, nv), _f(rng, nseq, nv)
    ssm_a, dt_bias = -np.abs(_f(rng, nv)), _f(rng, nv)
    res = []
    for inplace in (False, True):
        state = state0.copy()
        st_out = state if inplace else np.full_like(state, np.nan)
        outs = [np.full(sh, np.nan, dtype=np.float32) for sh in ((nseq, nk, dk), (nseq, nk, dk), (nseq, nv * dv),
                                                               (nseq, nv), (nseq, nv))]
        with shared_within(lib, gdn_prep_shared(nk, dk)):
            lib.host_pf_gdn_prep(3, 2, _p(qkv), _p(state), _p(st_out), _p(wc), C, Kc, nseq, 1, _p(b), _p(a),
                                 _p(ssm_a), _p(dt_bias), nk, dk, nv, np.float32(dk ** -0.5), *[_p(x) for x in outs],
                                 C, nv)
        res.append([st_out] + outs)
    for x, y in zip(*res):
        assert np.array_equal(x, y)
    assert np.array_equal(res[1][0][:, :-1], state0[:, 1:]) and np.array_equal(res[1][0][:, -1], qkv)
