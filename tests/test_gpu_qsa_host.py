"""The device QSA kernels (stratatools/runtime/gpu/qsa_step.cu), checked on the CPU: compiled as host C++ (one thread
per block, blocks in sequence) and run against the reference code they replace: block selection against
stratatools.runtime.topk (ties included: ReLU scores tie at exactly 0), pooling, block scores and attention over the
selected cells against stratatools.runtime.model's formulas. Skips where no C++ compiler is installed."""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess

import numpy as np
import pytest

from stratatools.runtime.gpu.kernels import cuda_source, cuda_unit
from stratatools.runtime.model import Rope, _rmsnorm, _softmax
from stratatools.runtime.topk import llamacpp_cells, torch_topk_indices

DRIVER = r"""
extern "C" void run_topk(const float* v, int n, int k, int* out, QsaPair* work) {
    for (int i = 0; i < n; ++i) { work[i].v = v[i]; work[i].i = i; }
    qsa_torch_topk(work, n, k);
    for (int j = 0; j < (k < n ? k : n); ++j) out[j] = work[j].i;
}
extern "C" void run_pool(const float* ik, float* bk, const float* knw, const float* bc, const float* bs, const int* posp,
                         int ratio, int dih, int n_rot, float eps) {
    blockIdx.x = 0; gridDim.x = 1;
    qsa_pool(ik, bk, knw, bc, bs, posp, ratio, dih, n_rot, eps);
}
extern "C" void run_scores(const float* q, const float* bk, const int* posp, float* scores, int ratio, int nih, int dih,
                           float sq, int grid) {
    gridDim.x = grid;
    for (int b = 0; b < grid; ++b) { blockIdx.x = b; qsa_scores(q, bk, posp, scores, ratio, nih, dih, sq); }
}
extern "C" void run_select(const float* scores, const int* posp, int ratio, int budget, int rule, int* flags,
                           QsaPair* pairs, int* cells, int* ncell) {
    blockIdx.x = 0; gridDim.x = 1;
    qsa_select(scores, posp, ratio, budget, rule, flags, pairs, cells, ncell);
}
extern "C" void run_attn(const float* q, const float* K, const float* V, const int* cells, const int* ncell, int use_cells,
                         const int* posp, float* sc, float* part, float* out, int nh, int nkv, int hd, float scale,
                         int max_ctx, int S) {
    gridDim.x = nh; gridDim.y = S;
    for (int h = 0; h < nh; ++h) for (int s = 0; s < S; ++s) {
        blockIdx.x = h; blockIdx.y = s;
        attn_sel_partial(q, K, V, cells, ncell, use_cells, posp, sc, part, nh, nkv, hd, scale, max_ctx);
    }
    gridDim.y = 1; gridDim.x = nh;
    for (int h = 0; h < nh; ++h) { blockIdx.x = h; attn_sel_combine(part, out, S, hd); }
}
"""

F = ctypes.POINTER(ctypes.c_float)
P_ = ctypes.c_void_p


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the host copy of the QSA kernels")
    d = tmp_path_factory.mktemp("qsahost")
    src = d / "qsa_host.cpp"
    src.write_text(cuda_source("host_kernel_shim.cuh") + cuda_unit("qsa_step.cu") + DRIVER)
    so = d / "qsa_host.so"
    subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-o", str(so), str(src)],
                   check=True, capture_output=True)
    return ctypes.CDLL(str(so))


_KEEP: list = []


def ptr(a: np.ndarray):
    """The array's address; the array is kept alive until the module's tests end (temporaries are passed)."""
    _KEEP.append(a)
    return ctypes.c_void_p(a.ctypes.data)


def host_topk(lib, v: np.ndarray, k: int) -> list[int]:
    v = np.ascontiguousarray(v, dtype=np.float32)
    out = np.full(max(k, 1), -1, dtype=np.int32)
    work = np.zeros(2 * max(v.size, 1), dtype=np.int32)
    lib.run_topk(ptr(v), ctypes.c_int(v.size), ctypes.c_int(k), ptr(out), ptr(work))
    return out[:min(k, v.size)].tolist()


def tied_scores(rng, n):
    """Block scores like QSA's: many exact zeros (ReLU), repeated values, some distinct."""
    v = rng.choice(np.array([0.0, 0.0, 0.0, 0.5, 1.25, 2.0], dtype=np.float32), size=n)
    m = rng.random(n) < 0.3
    v[m] = rng.random(int(m.sum())).astype(np.float32)
    return v.astype(np.float32)


def test_torch_topk_sets_with_ties(lib):
    rng = np.random.default_rng(3)
    for n, k in [(1, 1), (5, 2), (17, 4), (64, 1), (200, 3), (300, 60), (1000, 15), (2000, 512), (129, 2)]:
        for _ in range(4):
            v = tied_scores(rng, n)
            got = host_topk(lib, v, k)
            want = torch_topk_indices(v, k)
            assert sorted(got) == sorted(want), (n, k)
    # all tied (every score 0): still the CPU's set, which is not simply the first k
    v = np.zeros(300, dtype=np.float32)
    assert sorted(host_topk(lib, v, 40)) == sorted(torch_topk_indices(v, 40))


def host_select(lib, scores: np.ndarray, pos: int, ratio: int, budget: int, rule: int) -> np.ndarray:
    P = pos + 1
    sc = np.zeros(max(P // ratio, 1), dtype=np.float32)
    sc[:scores.size] = scores
    posa = np.array([pos], dtype=np.int32)
    flags = np.full(P, 7, dtype=np.int32)
    pairs = np.zeros(2 * P, dtype=np.int32)
    cells = np.full(P, -1, dtype=np.int32)
    nc = np.zeros(1, dtype=np.int32)
    lib.run_select(ptr(sc), ptr(posa), ctypes.c_int(ratio), ctypes.c_int(budget), ctypes.c_int(rule), ptr(flags),
                   ptr(pairs), ptr(cells), ptr(nc))
    return cells[:nc[0]]


def ref_cells(scores, pos, ratio, budget, rule):
    P = pos + 1
    nb = P // ratio
    if rule == 0:
        mask = np.zeros(P, dtype=bool)
        for b in torch_topk_indices(scores[:nb], min(budget // ratio, nb)):
            mask[b * ratio:(b + 1) * ratio] = True
        mask[nb * ratio:] = True
        return np.nonzero(mask)[0]
    return np.sort(llamacpp_cells(scores[:nb], ratio, pos, budget + ratio - 1, P))


@pytest.mark.parametrize("rule", [0, 1])
def test_select_matches_cpu_rules(lib, rule):
    rng = np.random.default_rng(5 + rule)
    cases = 0
    for ratio, budget in [(4, 16), (4, 8), (8, 64), (3, 10), (4, 2048)]:
        for pos in list(range(0, 3 * budget + 2 * ratio, max(1, budget // 8))) + [5000]:
            nb = (pos + 1) // ratio
            for kind in ("tied", "distinct", "zeros"):
                if kind == "tied":
                    s = tied_scores(rng, nb)
                elif kind == "distinct":
                    s = rng.permutation(nb).astype(np.float32) + np.float32(0.5)
                else:
                    s = np.zeros(nb, dtype=np.float32)
                got = host_select(lib, s, pos, ratio, budget, rule)
                want = ref_cells(s, pos, ratio, budget, rule)
                assert np.array_equal(got, want), (rule, ratio, budget, pos, kind)
                cases += 1
    assert cases > 100


def test_pool_scores_and_attention_match_reference(lib):
    rng = np.random.default_rng(9)
    ratio, dih, n_rot, nih, eps = 4, 32, 16, 3, 1e-6
    max_ctx = 64
    ik = rng.standard_normal((max_ctx, dih)).astype(np.float32)
    knw = (1 + 0.1 * rng.standard_normal(dih)).astype(np.float32)
    rope = Rope(np, n_rot, 1e4)
    bk = np.zeros((max_ctx // ratio, dih), dtype=np.float32)
    for pos in range(max_ctx):
        P = pos + 1
        b = max(P // ratio - 1, 0)
        bc, bs = rope.cos_sin(np.array([b * ratio]))
        before = bk.copy()
        lib.run_pool(ptr(ik), ptr(bk), ptr(knw), ptr(np.ascontiguousarray(bc[0])), ptr(np.ascontiguousarray(bs[0])),
                     ptr(np.array([pos], dtype=np.int32)), ratio, dih, n_rot, ctypes.c_float(eps))
        if P % ratio:
            assert np.array_equal(bk, before)  # no block completed: nothing written
            continue
        pooled = _rmsnorm(np, np.mean(ik[b * ratio:P].reshape(1, ratio, dih), axis=1), knw, eps)
        want = rope.apply(pooled[:, None, :], bc, bs)[0, 0]
        np.testing.assert_allclose(bk[b], want, rtol=2e-6, atol=2e-6)
    q = rng.standard_normal((nih, dih)).astype(np.float32)
    pos = max_ctx - 2
    nb = (pos + 1) // ratio
    scores = np.full(max_ctx // ratio, -1, dtype=np.float32)
    lib.run_scores(ptr(q), ptr(bk), ptr(np.array([pos], dtype=np.int32)), ptr(scores), ratio, nih, dih,
                   ctypes.c_float(np.float32(math.sqrt(dih))), 3)
    sc = np.einsum("thd,bd->tbh", q[None], bk[:nb])
    want = (np.sum(np.maximum(sc, 0), axis=-1) / np.float32(math.sqrt(dih)))[0]
    np.testing.assert_allclose(scores[:nb], want, rtol=2e-6, atol=1e-7)
    assert scores[nb] == -1  # blocks past the position are left alone
    assert not np.signbit(scores[:nb]).any()
    # attention over a cell list (and over every position) against the masked softmax of the reference
    nh, nkv, hd = 4, 2, 16
    K = rng.standard_normal((max_ctx, nkv, hd)).astype(np.float32)
    V = rng.standard_normal((max_ctx, nkv, hd)).astype(np.float32)
    qa = rng.standard_normal((nh, hd)).astype(np.float32)
    scale = np.float32(hd ** -0.5)
    for use, cells in ((1, np.array([0, 1, 2, 3, 12, 13, 14, 15, 60, 61, 62], dtype=np.int32)),
                       (0, np.arange(pos + 1, dtype=np.int32))):
        for S in (1, 3, 16):
            out = np.zeros((nh, hd), dtype=np.float32)
            sc_buf = np.zeros(nh * max_ctx, dtype=np.float32)
            part = np.zeros(nh * S * (hd + 2), dtype=np.float32)
            lib.run_attn(ptr(qa), ptr(K), ptr(V), ptr(cells), ptr(np.array([cells.size], dtype=np.int32)), use,
                         ptr(np.array([pos], dtype=np.int32)), ptr(sc_buf), ptr(part), ptr(out), nh, nkv, hd,
                         ctypes.c_float(scale), max_ctx, S)
            kk = np.repeat(K[cells], nh // nkv, axis=1)
            vv = np.repeat(V[cells], nh // nkv, axis=1)
            att = _softmax(np, np.einsum("hd,phd->hp", qa, kk) * scale, axis=-1)
            want = np.einsum("hp,phd->hd", att, vv)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    # every position of a short context (the CuPy step's attention below the selection range): parts past the last
    # position hold no cell and drop out of the combine; the cell list is not read (the step passes the position)
    for p_small in (0, 1, 5, 15, 16, 17):
        posp = np.array([p_small], dtype=np.int32)
        out = np.full((nh, hd), np.nan, dtype=np.float32)
        part = np.full(nh * 16 * (hd + 2), np.nan, dtype=np.float32)
        lib.run_attn(ptr(qa), ptr(K), ptr(V), ptr(posp), ptr(posp), 0, ptr(posp), ptr(np.zeros(nh * max_ctx, np.float32)),
                     ptr(part), ptr(out), nh, nkv, hd, ctypes.c_float(scale), max_ctx, 16)
        kk = np.repeat(K[:p_small + 1], nh // nkv, axis=1)
        vv = np.repeat(V[:p_small + 1], nh // nkv, axis=1)
        att = _softmax(np, np.einsum("hd,phd->hp", qa, kk) * scale, axis=-1)
        np.testing.assert_allclose(out, np.einsum("hp,phd->hd", att, vv), rtol=1e-5, atol=1e-6)
