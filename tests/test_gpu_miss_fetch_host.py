"""The offloaded step's miss fetch (stratatools/runtime/gpu/miss_fetch.cu ``fetch_blobs``) checked on the CPU: the CUDA
source compiled as host C++ (host_kernel_shim.cuh runs each block as one thread), with a numpy "host arena" and
"device" staging buffers: missed blobs land byte for byte in their staging entries, resident and prefetched ones are
not copied, the three matrix addresses of every job point at the right bytes, the counters count what happened, for
several grid sizes (one part per block) and for a blob size that is not a multiple of 16. Skips without a C++
compiler."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from hostlib import CXX, build_host_lib, shared_within
from stratatools.runtime.gpu import kernels as K

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the host copy of the kernels")

U64P = ctypes.POINTER(ctypes.c_uint64)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_host_lib(tmp_path_factory.mktemp("missfetch"), "miss_fetch.cu")


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _run(lib, gx, src, ids, arena, pf_ids, pf_addr, staging, slot_bytes, blob_bytes, gate_bytes, counters):
    k = src.size
    out = np.zeros((3, k), dtype=np.uint64)
    lo, hi = _ptr(arena), _ptr(arena) + arena.nbytes
    lib.host_fetch_blobs(gx, k, _ptr(src), _ptr(ids), k, lo, hi,
                         _ptr(pf_ids) if pf_ids is not None else None, _ptr(pf_addr) if pf_addr is not None else None,
                         0 if pf_ids is None else pf_ids.size, _ptr(staging), slot_bytes, blob_bytes, gate_bytes,
                         _ptr(out[0]), _ptr(out[1]), _ptr(out[2]), _ptr(counters) if counters is not None else None)
    return out


def _bytes_at(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(int(addr))).copy()


@pytest.mark.parametrize("blob_bytes,gx", [(4096, 1), (4096, 3), (4096 + 48, 7), (1000 + 3, 4), (16, 9)])
def test_fetch_blobs_copies_misses_and_points_every_job_at_its_bytes(lib, blob_bytes, gx):
    rng = np.random.default_rng(blob_bytes + gx)
    E, k = 12, 6
    gate_bytes = blob_bytes // 3
    arena = rng.integers(0, 256, size=E * blob_bytes, dtype=np.uint8)  # "mapped host memory": expert e at e * blob
    slot_bytes = (blob_bytes + 255) // 256 * 256
    vram = rng.integers(0, 256, size=4 * slot_bytes, dtype=np.uint8)  # resident experts 1, 5 in slots 0, 2
    vram[0:blob_bytes] = arena[1 * blob_bytes:2 * blob_bytes]
    vram[2 * slot_bytes:2 * slot_bytes + blob_bytes] = arena[5 * blob_bytes:6 * blob_bytes]
    resident = {1: _ptr(vram), 5: _ptr(vram) + 2 * slot_bytes}
    ids = np.array([3, 1, 7, 5, 0, 11], dtype=np.int32)
    src = np.array([resident.get(int(e), _ptr(arena) + int(e) * blob_bytes) for e in ids], dtype=np.uint64)
    # expert 7 was prefetched (a copy in device memory); expert 3 was predicted but left in host memory (not copied)
    pf_buf = np.zeros(slot_bytes, dtype=np.uint8)
    pf_buf[:blob_bytes] = arena[7 * blob_bytes:8 * blob_bytes]
    pf_ids = np.array([9, 7, 3], dtype=np.int32)
    pf_addr = np.array([_ptr(vram) + slot_bytes, _ptr(pf_buf), _ptr(arena) + 3 * blob_bytes], dtype=np.uint64)
    staging = np.zeros(k * slot_bytes, dtype=np.uint8)
    counters = np.zeros(3, dtype=np.uint64)
    out = _run(lib, gx, src, ids, arena, pf_ids, pf_addr, staging, slot_bytes, blob_bytes, gate_bytes, counters)
    copied = [0, 4, 5]  # jobs of experts 3, 0, 11: misses without a prefetched copy
    for j, e in enumerate(ids.tolist()):
        want = arena[e * blob_bytes:(e + 1) * blob_bytes]
        if j in copied:
            assert int(out[0, j]) == _ptr(staging) + j * slot_bytes
        elif e == 7:
            assert int(out[0, j]) == _ptr(pf_buf)
        else:
            assert int(out[0, j]) == resident[e]
        assert np.array_equal(_bytes_at(out[0, j], blob_bytes), want)
        assert int(out[1, j]) == int(out[0, j]) + gate_bytes and int(out[2, j]) == int(out[0, j]) + 2 * gate_bytes
    # staging entries of jobs that were not copied stay untouched
    for j in range(k):
        if j not in copied:
            assert not staging[j * slot_bytes:(j + 1) * slot_bytes].any()
    assert counters.tolist() == [3 * blob_bytes, 3, 1]


def test_fetch_blobs_without_prefetch_list_or_counters_and_all_resident(lib):
    rng = np.random.default_rng(5)
    blob_bytes, E, k = 2048, 4, 4
    arena = rng.integers(0, 256, size=E * blob_bytes, dtype=np.uint8)
    vram = arena.copy()  # every expert resident (a separate buffer: not in the host range)
    ids = np.arange(k, dtype=np.int32)
    src = np.array([_ptr(vram) + e * blob_bytes for e in range(k)], dtype=np.uint64)
    staging = np.zeros(k * blob_bytes, dtype=np.uint8)
    out = _run(lib, 2, src, ids, arena, None, None, staging, blob_bytes, blob_bytes, 512, None)
    assert np.array_equal(out[0], src) and not staging.any()
    # all missing, no prefetch list: every blob copied to its own entry
    src2 = np.array([_ptr(arena) + e * blob_bytes for e in range(k)], dtype=np.uint64)
    cnt = np.zeros(3, dtype=np.uint64)
    out = _run(lib, 5, src2, ids, arena, None, None, staging, blob_bytes, blob_bytes, 512, cnt)
    assert np.array_equal(staging, arena)
    assert out[0].tolist() == [_ptr(staging) + j * blob_bytes for j in range(k)]
    assert cnt.tolist() == [k * blob_bytes, k, 0]


# -- the decoder's wiring (StaticDecoder._init_fetch / _prefetch_next / _fetch_layer) on a stand-in for CuPy ---------
# Device memory is host memory (numpy), streams and events record nothing (work runs at once, in call order, which is
# one order the streams allow), fetch_blobs is the host build above, and the router kernels are their numpy formulas.
# What this checks without a GPU: the buffers the wiring allocates, the arguments it passes (checked against the
# kernels' signatures), the layer parity of the prefetch, and that every job of every layer ends up pointing at its
# expert's bytes, with the counters adding up.


class _FakeStream:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def wait_event(self, ev) -> None:
        assert isinstance(ev, _FakeEvent) and ev.recorded

    def record(self):
        ev = _FakeEvent()
        ev.record(self)
        return ev

    def synchronize(self) -> None:
        pass


class _FakeEvent:
    def __init__(self, disable_timing: bool = False):
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True


def _check_args(name: str, args: tuple) -> None:
    """The launch's arguments against the kernel's parameters: count, and numpy scalar types of the right width."""
    params = K.kernel_signatures({"fetch_blobs": "miss_fetch.cu", "matvec_f32_rows": "fused_step.cu",
                                  "route_fused_sg": "decode_step.cu", "route_warp_sg8": "decode_step.cu",
                                  "route_warp_sg16": "decode_step.cu"}[name])[name]
    assert len(args) == len(params), (name, len(args), len(params))
    want = {"int": np.int32, "float": np.float32, "long long": np.int64, "unsigned long long": np.uint64,
            "u64": np.uint64}
    for a, (t, p) in zip(args, params):
        if "*" in t:
            assert isinstance(a, np.ndarray) or (isinstance(a, np.uint64) and int(a) == 0), (name, p, type(a))
        else:
            assert type(a) is want[t], (name, p, t, type(a))


class _FakeKernel:
    def __init__(self, name: str, lib):
        self.name, self.lib = name, lib
        self.calls = 0

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        _check_args(self.name, args)
        self.calls += 1
        if self.name == "fetch_blobs":
            conv = [a.ctypes.data if isinstance(a, np.ndarray) else (None if "*" in t and int(a) == 0 else a)
                    for a, (t, _p) in zip(args, K.kernel_signatures("miss_fetch.cu")["fetch_blobs"])]
            with shared_within(self.lib, shared_mem):  # the bytes the launcher asks the device for
                self.lib.host_fetch_blobs(grid[0], grid[1], *conv)
        elif self.name == "matvec_f32_rows":
            W, x, y, rows, cols = args
            y[:int(rows)] = W.view(np.float32).reshape(int(rows), int(cols)) @ x[:int(cols)]
        else:  # route_fused_sg, route_warp_sg8 / 16 (same arguments, same result)
            lg, E, k, sig, norm, scale, slot, gate_b, ids, w, gp, up, dp, sg = args
            E, k = int(E), int(k)
            z = lg[:E].astype(np.float64)
            p = 1 / (1 + np.exp(-z)) if int(sig) else np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            top = np.argsort(-p, kind="stable")[:k]
            ids[:k] = top
            ww = p[top] / p[top].sum() if int(norm) else p[top]
            w[:k] = ww * float(scale)
            gp[:k] = slot[top]
            up[:k] = slot[top] + np.uint64(int(gate_b))
            dp[:k] = slot[top] + np.uint64(2 * int(gate_b))
            sg[0] = 1 / (1 + np.exp(-float(lg[E])))


def _fake_cupy(lib):
    import types

    class _Module:
        def __init__(self, code: str, options=()):
            self.code = code

        def get_function(self, name: str):
            assert f"void {name}(" in self.code
            return _FakeKernel(name, lib)

    main = _FakeStream()
    cuda = types.SimpleNamespace(Stream=lambda non_blocking=False: _FakeStream(), Event=_FakeEvent,
                                 get_current_stream=lambda: main)
    return types.SimpleNamespace(cuda=cuda, RawModule=_Module, zeros=np.zeros, empty=np.zeros, float32=np.float32,
                                 int32=np.int32, uint64=np.uint64, uint8=np.uint8)


@pytest.mark.parametrize("mode,extra", [("fetch", None), ("prefetch", None), ("prefetch", "0"), ("prefetch", "3")])
def test_decoder_fetch_wiring_points_every_job_at_its_expert(lib, monkeypatch, mode, extra):
    import types

    from stratatools.runtime.gpu import decode as D

    monkeypatch.setattr(K, "_device_limits", lambda: (6, 228 * 1024))
    if extra is None:
        monkeypatch.delenv(D.PREFETCH_EXTRA_ENV, raising=False)
    else:
        monkeypatch.setenv(D.PREFETCH_EXTRA_ENV, extra)
    rng = np.random.default_rng(len(mode) + (0 if extra is None else int(extra)))
    L, E, k, n = 5, 16, 4, 32
    gate_b, blob = 96, 3 * 96 + 16  # gate | up | down (down 112 bytes)
    arena = rng.integers(0, 256, size=L * E * blob, dtype=np.uint8)
    sb = 512
    vram = np.zeros(L * 6 * sb, dtype=np.uint8)
    slot = np.zeros((L, E), dtype=np.uint64)
    resident = []
    for l in range(L):
        res = set(rng.choice(E, size=6, replace=False).tolist())
        resident.append(res)
        for i, e in enumerate(sorted(res)):
            off = (l * 6 + i) * sb
            vram[off:off + blob] = arena[(l * E + e) * blob:(l * E + e + 1) * blob]
        for e in range(E):
            slot[l, e] = (vram.ctypes.data + (l * 6 + sorted(res).index(e)) * sb if e in res
                          else arena.ctypes.data + (l * E + e) * blob)
    ly = types.SimpleNamespace(blob_bytes=blob, gate_bytes=gate_b, n_expert=E)
    arena_ns = types.SimpleNamespace(device_ptr=arena.ctypes.data, host=arena, layers=[ly] * L)
    tier = types.SimpleNamespace(arena=arena_ns, slot_bytes=np.full(L, sb, dtype=np.int64))
    cfg = types.SimpleNamespace(n_layer=L, n_embd=n, gating="softmax", norm_topk=True, expert_weights_scale=1.0)
    d = D.StaticDecoder.__new__(D.StaticDecoder)
    d.cp, d.cfg, d.k, d.miss_fetch = _fake_cupy(lib), cfg, k, mode
    d.rt = types.SimpleNamespace(tier=tier)
    d.slot = slot
    d.ids = np.zeros((L, k), dtype=np.int32)
    d.ptrs = np.zeros((L, 3, k), dtype=np.uint64)
    d._init_fetch(tier)
    assert d.fetch_stage.nbytes == k * sb and d.fptrs.shape == (L, 3, k)
    kp = D.prefetch_width(k, E) if mode == "prefetch" else 0
    if mode == "prefetch":
        assert d.pf_k == kp and d.pf_stage.nbytes == 2 * kp * sb and d.pf_ids.shape == (2, kp)
        assert d.fetch_stage.nbytes + d.pf_stage.nbytes == D.fetch_staging_bytes(mode, k, sb, E)
    routers = [rng.standard_normal((E + 1, n)).astype(np.float32) for _ in range(L)]
    d._router_stack = lambda il: (routers[il].reshape(-1), E + 1, 0, n)
    d.k_mv_f32, d.k_route_sg = _FakeKernel("matvec_f32_rows", lib), _FakeKernel("route_fused_sg", lib)
    d.route_warp = True  # the same routing by one warp (E <= ROUTE_WARP_MAX)
    d.k_route_w8, d.k_route_w16 = _FakeKernel("route_warp_sg8", lib), _FakeKernel("route_warp_sg16", lib)
    # each layer's expert input: the previous layer's plus noise (the prediction sees the previous one)
    xr = [rng.standard_normal(n).astype(np.float32)]
    for _ in range(L - 1):
        xr.append((xr[-1] + 0.5 * rng.standard_normal(n)).astype(np.float32))
    route = _FakeKernel("route_fused_sg", lib)
    misses = 0
    d._pf_events = {}
    for il in range(L):
        X = xr[il].reshape(1, -1)
        if mode == "prefetch" and il + 1 < L:
            d._prefetch_next(il, X)
        lg = (routers[il] @ xr[il]).astype(np.float32)
        route((1,), (32,), (lg, np.int32(E), np.int32(k), np.int32(0), np.int32(1), np.float32(1.0), slot[il],
                            np.uint64(gate_b), d.ids[il], np.zeros(k, np.float32), d.ptrs[il, 0], d.ptrs[il, 1],
                            d.ptrs[il, 2], np.zeros(1, np.float32)))
        fp = d._fetch_layer(il, d.ptrs[il])
        assert fp is d.fptrs[il] or np.shares_memory(fp, d.fptrs)
        for j, e in enumerate(d.ids[il].tolist()):
            a = int(fp[0, j])
            assert np.array_equal(_bytes_at(a, blob), arena[(il * E + e) * blob:(il * E + e + 1) * blob]), (il, j)
            assert int(fp[1, j]) == a + gate_b and int(fp[2, j]) == a + 2 * gate_b
            in_host = arena.ctypes.data <= a < arena.ctypes.data + arena.nbytes
            assert not in_host  # every job reads device memory
            if e in resident[il]:
                assert a == int(slot[il, e])
            else:
                misses += 1
                in_pf = mode == "prefetch" and d.pf_stage.ctypes.data <= a < d.pf_stage.ctypes.data + d.pf_stage.nbytes
                in_late = d.fetch_stage.ctypes.data <= a < d.fetch_stage.ctypes.data + d.fetch_stage.nbytes
                assert in_pf or in_late
                if in_pf:  # the parity of this layer
                    p = il & 1
                    assert d.pf_stage.ctypes.data + p * kp * sb <= a < d.pf_stage.ctypes.data + (p + 1) * kp * sb
    assert not d._pf_events  # every prefetch was joined by its layer's fetch
    c = d.fetch_counters.tolist()
    assert c[1] + c[2] == misses and c[0] == c[1] * blob
    if mode == "prefetch":
        assert c[3] == c[4] * blob and 0 < c[2] <= c[4]
    else:
        assert c[2] == c[3] == c[4] == 0
