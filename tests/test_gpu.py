"""GPU kernels and the GPU expert tier (CuPy). Skips cleanly where CuPy has no GPU (CI).

* dequantization: bit-identical to the numpy path for every supported type (random blocks, kit tensors);
* quantized matvec and routed-expert FFN: against float64 references built from the numpy dequantizer;
* the tier: hit counts are the cachesim policy's, results equal the all-in-VRAM result in both miss modes.
"""

from __future__ import annotations

import numpy as np
import pytest

from stratatools.runtime import gpu
from stratatools.runtime.dequant import SUPPORTED_TYPES, dequantize
from stratatools.model.ggml_types import type_by_name
from stratatools.model.gguf import open_model

from test_dequant import KIT_FILES, random_blocks, same_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")]

QUANT = [t for t in SUPPORTED_TYPES if type_by_name(t).block_size > 1]


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.mark.parametrize("tname", SUPPORTED_TYPES)
def test_gpu_dequant_identical_random(cp, tname):
    raw = random_blocks(tname, 1000, seed=3 + len(tname))
    ref = dequantize(raw, tname)
    got = dequantize(raw, tname, xp=cp)
    assert isinstance(got, cp.ndarray) and got.dtype == cp.float32
    assert same_bits(cp.asnumpy(got), ref), tname
    dev = dequantize(cp.asarray(raw), type_by_name(tname).id, ref.size, xp=cp)  # device input, id, count
    assert same_bits(cp.asnumpy(dev), ref)


@pytest.mark.kit
@pytest.mark.parametrize("rel", KIT_FILES)
def test_gpu_dequant_identical_kit(cp, kit, rel):
    path = kit / rel
    if not path.exists():
        pytest.skip(f"{rel} not carried")
    with open_model(path) as m:
        per_type: dict[str, int] = {}
        for t in m.iter_tensors():
            if per_type.get(t.type.name, 0) >= 3:
                continue
            per_type[t.type.name] = per_type.get(t.type.name, 0) + 1
            raw = np.array(m.raw(t))
            assert same_bits(cp.asnumpy(dequantize(raw, t.type, xp=cp)), dequantize(raw, t.type)), (rel, t.name)


def _rand_x(n, seed):
    return np.random.default_rng(seed).normal(0, 1, n).astype(np.float32)


@pytest.mark.parametrize("tname", SUPPORTED_TYPES)
def test_gpu_matvec(cp, tname):
    from stratatools.runtime.gpu.experts import matvec

    t = type_by_name(tname)
    rows, cols = 96, 1024
    raw = random_blocks(tname, rows * cols // t.block_size, seed=5) if t.block_size > 1 else None
    if raw is None:  # float types: finite values only
        vals = np.random.default_rng(5).normal(0, 0.05, rows * cols).astype(np.float32)
        raw = {"F32": vals, "F16": vals.astype(np.float16), "BF16": (vals.view(np.uint32) >> 16).astype(np.uint16)}[tname].view(np.uint8)
    W = dequantize(raw, tname).reshape(rows, cols).astype(np.float64)
    assert np.isfinite(W).all(), f"{tname}: the seeded fixture blocks must dequantize to finite values"
    x = _rand_x(cols, 6)
    y = cp.asnumpy(matvec(cp.asarray(raw), t, rows, cols, cp.asarray(x)))
    ref = W @ x.astype(np.float64)
    err = np.abs(y - ref).max() / (np.abs(ref).max() + 1e-30)
    assert err < 1e-5, (tname, err)


def _rand_matrix(tname, rows, cols, seed):
    t = type_by_name(tname)
    if t.block_size > 1:
        return random_blocks(tname, rows * cols // t.block_size, seed=seed)
    vals = np.random.default_rng(seed).normal(0, 0.05, rows * cols).astype(np.float32)
    return {"F32": vals, "F16": vals.astype(np.float16), "BF16": (vals.view(np.uint32) >> 16).astype(np.uint16)}[tname].view(np.uint8)


@pytest.mark.parametrize("tname", SUPPORTED_TYPES)
def test_gpu_matvec_tiled_matches_reference_kernel(cp, tname):
    """The staged 16-byte-load matvec (StaticDecoder fast step) equals the reference kernel to float rounding, on
    shapes with one segment, several segments (10240 columns), rows whose bytes are not whole 16-byte chunks
    (320 Q8_0 columns: 340 bytes), a row count that is not a multiple of the block's warps, and more rows than
    the grid (grid stride). Every output element is written (NaN poison)."""
    from stratatools.runtime.gpu.experts import matvec
    from stratatools.runtime.gpu.kernels import matvec_tiled_launch

    t = type_by_name(tname)
    shapes = [(96, 1024), (37, 10240), (3001, 256)]
    if 320 % t.block_size == 0:
        shapes.append((45, 320))
    for i, (rows, cols) in enumerate(shapes):
        if cols % (t.block_size if t.block_size > 1 else 8):
            continue
        raw = _rand_matrix(tname, rows, cols, seed=40 + i)
        W = dequantize(raw, tname).reshape(rows, cols).astype(np.float64)
        if not np.isfinite(W).all():
            continue
        x = _rand_x(cols, 7 + i)
        dev, xd = cp.asarray(raw), cp.asarray(x)
        ref_k = cp.asnumpy(matvec(dev, t, rows, cols, xd)).astype(np.float64)
        y = cp.full(rows, cp.nan, dtype=cp.float32)
        matvec_tiled_launch(dev, xd, y, t.id, rows, cols)
        got = cp.asnumpy(y).astype(np.float64)
        assert np.isfinite(got).all(), (tname, rows, cols)
        ref = W @ x.astype(np.float64)
        scale = np.abs(ref).max() + 1e-30
        assert np.abs(got - ref).max() / scale < 1e-5, (tname, rows, cols)
        assert np.abs(got - ref_k).max() / scale < 1e-5, (tname, rows, cols)


CASES = [("Q2_0", "Q2_0", 256), ("IQ3_XXS", "IQ4_NL", 128), ("IQ2_XS", "Q2_0", 128), ("Q4_K", "Q6_K", 256),
         ("IQ2_S", "IQ4_XS", 256), ("IQ3_S", "Q8_0", 96), ("IQ1_M", "Q5_0", 64), ("Q8_0", "BF16", 64),
         ("Q5_K", "Q4_1", 64), ("IQ4_XS", "Q5_1", 64), ("Q4_0", "IQ3_S", 256), ("F16", "F32", 64)]


def _blob_set(gu, d, hidden, ff, E, seed):
    tg, td = type_by_name(gu), type_by_name(d)
    blobs = []
    for e in range(E):
        parts = []
        for t, rows, cols in ((tg, ff, hidden), (tg, ff, hidden), (td, hidden, ff)):
            nvals = rows * cols
            if t.block_size > 1:
                parts.append(random_blocks(t.name, nvals // t.block_size, seed=seed * 100 + e * 3 + len(parts)))
            else:
                v = np.random.default_rng(seed + e).normal(0, 0.05, nvals).astype(np.float32)
                parts.append({"F32": v, "F16": v.astype(np.float16),
                              "BF16": (v.view(np.uint32) >> 16).astype(np.uint16)}[t.name].view(np.uint8))
        blobs.append(np.concatenate(parts))
    return tg, td, blobs


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
@pytest.mark.parametrize("gu,d,ff", CASES)
def test_gpu_expert_ffn(cp, gu, d, ff, fast):
    """expert_ffn against the float64 reference; ``fast``: the staged-row kernels of the FMA build."""
    from stratatools.runtime.gpu.experts import expert_ffn, expert_ffn_reference, make_jobs

    hidden, E, k, T = 512, 6, 3, 4
    tg, td, blobs = _blob_set(gu, d, hidden, ff, E, seed=len(gu) + ff)
    dev = [cp.asarray(b) for b in blobs]
    rng = np.random.default_rng(9)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    w = rng.random((T, k)).astype(np.float32)
    X = rng.normal(0, 1, (T, hidden)).astype(np.float32)
    ptrs = np.array([[dev[e].data.ptr for e in row] for row in ids], dtype=np.uint64)
    jobs = make_jobs(ptrs, w, ff * tg.row_bytes(hidden))
    Y = cp.asnumpy(expert_ffn(cp.asarray(X), jobs, tg, td, hidden, ff, fast=fast))
    for t in range(T):
        ref = expert_ffn_reference(X[t], [blobs[e] for e in ids[t]], w[t], tg, td, hidden, ff)
        assert np.isfinite(ref).all(), (gu, d, t, "the seeded fixture must give a finite reference")
        err = np.abs(Y[t] - ref).max() / (np.abs(ref).max() + 1e-30)
        assert err < 1e-4, (gu, d, t, err)
    # accumulate adds onto an existing output
    Y2 = expert_ffn(cp.asarray(X), jobs, tg, td, hidden, ff, out=cp.asarray(Y), accumulate=True, fast=fast)
    assert np.allclose(cp.asnumpy(Y2), 2 * Y, rtol=1e-6, atol=1e-6)


def _tiny_arena(cp, L=3, E=16, hidden=256, ff=64):
    from stratatools.runtime.gpu.tier import HostArena, LayerExperts

    layers = [LayerExperts(E, type_by_name("Q2_0"), type_by_name("IQ4_NL"), hidden, ff) for _ in range(L)]
    arena = HostArena(layers)
    for l, ly in enumerate(layers):
        for e in range(E):
            gb = ly.gate_bytes
            b = arena.blob(l, e)
            b[:gb] = random_blocks("Q2_0", ff * hidden // 64 // 1, seed=l * 1000 + e)[:gb]
            b[gb:2 * gb] = random_blocks("Q2_0", ff * hidden // 64, seed=l * 1000 + e + 500)
            b[2 * gb:] = random_blocks("IQ4_NL", hidden * ff // 32, seed=l * 1000 + e + 900)
    return arena


@pytest.mark.parametrize("policy,mode", [("static", "copy"), ("static", "host"), ("lru", "copy"), ("adaptive", "copy")])
def test_gpu_tier_matches_all_resident(cp, policy, mode):
    from stratatools.cachesim import make_tier
    from stratatools.profiles.strp import Profile
    from stratatools.runtime.gpu.tier import AllResident, GPUExpertTier

    L, E, k, hidden = 3, 16, 4, 256
    arena = _tiny_arena(cp, L, E, hidden)
    if mode == "host" and arena.device_ptr is None:
        pytest.skip("pinned memory is not mapped on this platform")
    rng = np.random.default_rng(4)
    pairs = np.array([(l, e) for e in range(E) for l in range(L)], dtype=np.uint16)
    prof = Profile(n_layers=L, n_expert=E, pairs=pairs[rng.permutation(len(pairs))])
    bb = [ly.blob_bytes for ly in arena.layers]
    if policy == "lru":
        pol = make_tier("lru", n_layers=L, n_expert=E, slots=L * 6, blob_bytes=bb)
    else:
        pol = make_tier(policy, profile=prof, slots=L * 6, blob_bytes=bb)
    ref_pol = make_tier(policy, n_layers=L, n_expert=E, slots=L * 6, blob_bytes=bb) if policy == "lru" else \
        make_tier(policy, profile=prof, slots=L * 6, blob_bytes=bb)
    tier = GPUExpertTier(arena, pol, miss_mode=mode)
    full = GPUExpertTier(arena, AllResident(L, E))
    assert tier.resident_count() == int(pol.resident_mask().sum())
    hot = rng.permutation(E)[:6]
    for rnd in range(12):
        for l in range(L):
            ids = rng.choice(hot, k, replace=False) if rnd % 3 else rng.choice(E, k, replace=False)
            w = rng.random((1, k)).astype(np.float32)
            x = cp.asarray(rng.normal(0, 1, (1, hidden)).astype(np.float32))
            a = cp.asnumpy(tier.ffn(l, x, ids[None], w))
            b = cp.asnumpy(full.ffn(l, x, ids[None], w))
            assert np.array_equal(a, b)
            ref_pol.access(l, ids)
        tier.end_round()
        ref_pol.end_round()
        assert tier.resident_count() == int(pol.resident_mask().sum())
    st = tier.stats()
    assert st["hits"] == pol.stats()["hits"] == ref_pol.stats()["hits"]
    assert st["hits"] + st["misses"] == 12 * L * k
    assert 0 < st["hits"] < 12 * L * k
    if mode == "copy":
        assert st["miss_copy_bytes"] == st["misses"] * arena.layers[0].blob_bytes
    else:
        assert st["miss_host_read_bytes"] == st["misses"] * arena.layers[0].blob_bytes


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "adaptive"])
@pytest.mark.parametrize("mode", ["copy", "host"])
def test_gpu_tier_multi_token_forward_under_eviction(cp, policy, mode):
    """Regression (issue 17): ffn of many tokens at once under a policy that evicts while the tokens are fetched
    must compute every token with its own experts: bit-equal to the all-resident tier."""
    from stratatools.cachesim import make_tier
    from stratatools.profiles.strp import Profile
    from stratatools.runtime.gpu.tier import AllResident, GPUExpertTier

    L, E, k, hidden, T = 2, 16, 4, 256, 24
    arena = _tiny_arena(cp, L, E, hidden)
    if mode == "host" and arena.device_ptr is None:
        pytest.skip("pinned memory is not mapped on this platform")
    rng = np.random.default_rng(17)
    bb = [ly.blob_bytes for ly in arena.layers]
    if policy == "adaptive":
        pairs = np.array([(l, e) for e in range(E) for l in range(L)], dtype=np.uint16)
        prof = Profile(n_layers=L, n_expert=E, pairs=pairs[rng.permutation(len(pairs))])
        pol = make_tier(policy, profile=prof, slots=L * 5, blob_bytes=bb, adapt_every=1, usage_floor=0.0)
    else:
        pol = make_tier(policy, n_layers=L, n_expert=E, slots=L * 5, blob_bytes=bb)
    tier = GPUExpertTier(arena, pol, miss_mode=mode)
    full = GPUExpertTier(arena, AllResident(L, E))
    evict0 = tier.counters.evictions
    for rnd in range(3):
        for l in range(L):
            ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
            w = rng.random((T, k)).astype(np.float32)
            X = cp.asarray(rng.normal(0, 1, (T, hidden)).astype(np.float32))
            a = cp.asnumpy(tier.ffn(l, X, ids, w))
            b = cp.asnumpy(full.ffn(l, X, ids, w))
            assert np.array_equal(a, b), (policy, mode, rnd, l, int((a != b).any(axis=1).sum()))
        tier.end_round()
    st = tier.stats()
    if policy != "adaptive":  # adaptive swaps only at round ends; the others evict inside each call
        assert tier.counters.evictions > evict0, "the case must evict inside a multi-token call"
    assert st["hits"] + st["misses"] == 3 * L * T * k
    assert 0 < st["misses"]
    if mode == "copy":
        assert st["staging_bytes"] <= 16 * int(tier.slot_bytes.max())  # the miss ring does not grow with T


def test_gpu_arena_from_gguf_matches_slices(cp, kit):
    from stratatools.runtime.gpu.tier import HostArena

    path = kit / "quant/model-ISTA-mix.gguf"
    if not path.exists():
        pytest.skip("ISTA-mix not carried")
    with open_model(path) as m:
        arena = HostArena.from_gguf(m)
        ly = arena.layers[2]
        t = m.tensor("blk.2.ffn_down_exps.weight")
        e = 7
        n = ly.down_bytes
        assert np.array_equal(arena.blob(2, e)[2 * ly.gate_bytes:], np.array(m.raw(t, e * n, n)))
        assert ly.gu_type.name == "IQ2_XS" and ly.d_type.name == "Q2_0"


PIPE_GPU_CASES = [("Q2_0", "Q2_0", 2560, 576, 1, 10), ("Q2_0", "Q2_0", 512, 192, 4, 3), ("Q8_0", "Q8_0", 2560, 576, 1, 1),
                  ("Q2_0", "Q8_0", 256, 64, 3, 2)]
PIPE_GPU_SHAPES = ["", "gu=256x1x1,down=256x1x1", "gu=128x3x3,down=64x4x2", "gu=64x2x2,down=256x8x3",
                   "gu=256x4x4,down=128x4x4"]


@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("shapes", PIPE_GPU_SHAPES, ids=lambda s: s or "default")
@pytest.mark.parametrize("gu,d,hidden,ff,T,k", PIPE_GPU_CASES)
def test_gpu_expert_ffn_pipe(cp, monkeypatch, gu, d, hidden, ff, T, k, shapes, where):
    """expert_ffn(fast=True) with STRATATOOLS_MOE_KERNEL=pipe (moe_gate_up_pipe / moe_down_pipe: cp.async rings)
    against the float64 reference and the staged kernels, at several launch shapes, with blobs at odd offsets of one
    buffer that ends at the last blob (device memory, or mapped pinned host memory: the zero-copy miss case)."""
    from stratatools.runtime.gpu.experts import MOE_KERNEL_ENV, MOE_PIPE_ENV, expert_ffn, expert_ffn_reference, make_jobs
    from stratatools.runtime.gpu.tier import _alloc_mapped_pinned, _device_pointer

    E = k + 2
    tg, td, blobs = _blob_set(gu, d, hidden, ff, E, seed=hidden + ff + k)
    bb = blobs[0].size
    offs = [3 + e * (bb + 5) for e in range(E)]
    size = offs[-1] + bb
    host = np.zeros(size, dtype=np.uint8)
    for o, b in zip(offs, blobs):
        host[o:o + bb] = b
    if where == "device":
        buf = cp.asarray(host)
        base = int(buf.data.ptr)
    else:
        mem = _alloc_mapped_pinned(cp, size)
        dp = _device_pointer(cp, mem)
        if dp is None:
            pytest.skip("pinned memory is not mapped on this platform")
        np.frombuffer(mem, dtype=np.uint8, count=size)[:] = host
        base = dp
    rng = np.random.default_rng(T * 10 + k)
    ids = np.stack([np.concatenate([[E - 1], rng.choice(E - 1, k - 1, replace=False)]) for _ in range(T)])
    w = rng.random((T, k)).astype(np.float32)
    X = rng.normal(0, 1, (T, hidden)).astype(np.float32)
    ptrs = np.array([[base + offs[e] for e in row] for row in ids], dtype=np.uint64)
    jobs = make_jobs(ptrs, w, ff * tg.row_bytes(hidden))
    monkeypatch.setenv(MOE_PIPE_ENV, shapes)
    Yp = cp.asnumpy(expert_ffn(cp.asarray(X), jobs, tg, td, hidden, ff, fast=True, kernels="pipe"))
    Ys = cp.asnumpy(expert_ffn(cp.asarray(X), jobs, tg, td, hidden, ff, fast=True, kernels="staged"))
    for t in range(T):
        ref = expert_ffn_reference(X[t], [blobs[e] for e in ids[t]], w[t], tg, td, hidden, ff)
        err = np.abs(Yp[t] - ref).max() / (np.abs(ref).max() + 1e-30)
        assert err < 1e-4, (t, err)
    assert np.abs(Yp - Ys).max() <= 1e-5 * np.abs(Ys).max()
    monkeypatch.setenv(MOE_KERNEL_ENV, "pipe")  # the environment's choice, and accumulate
    Y2 = expert_ffn(cp.asarray(X), jobs, tg, td, hidden, ff, out=cp.asarray(Yp), accumulate=True, fast=True)
    assert np.allclose(cp.asnumpy(Y2), 2 * Yp, rtol=1e-6, atol=1e-6)
