"""GPUExpertTier's deferred admissions (DecoderRuntime ``async_swaps``) checked on the CPU: the tier's bookkeeping runs
against a stand-in for CuPy in which device memory is host memory and every asynchronous copy happens at once, so the
logic (which table entry points where, when; what is copied into which slot; what is counted) is checked without a
GPU. Against the same tier with immediate copies: the same counters, and after promote() the same slot table with
each slot holding its expert's bytes; before promote() an admitted expert is read from host memory."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from stratatools.cachesim import make_tier
from stratatools.model.ggml_types import type_by_name
from stratatools.runtime.gpu import tier as T


class _Ptr:
    def __init__(self, p: int):
        self.ptr = p


class _DevArray(np.ndarray):
    """numpy array with CuPy's ``.data.ptr``."""

    @property
    def data(self):  # noqa: D401 - CuPy's attribute
        return _Ptr(self.ctypes.data)


class _Event:
    def synchronize(self) -> None:
        pass


class _Stream:
    ptr = 0

    def record(self) -> _Event:
        return _Event()

    def wait_event(self, ev: _Event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Pinned:
    def __init__(self, n: int, flags: int = 0):
        self.buf = (ctypes.c_uint8 * n)()
        self.ptr = ctypes.addressof(self.buf)

    def __buffer__(self, flags):  # Python >= 3.12
        return memoryview(self.buf)


def _fake_cupy() -> types.SimpleNamespace:
    def empty(n, dtype=np.uint8):
        return np.zeros(n, dtype=dtype).view(_DevArray)

    runtime = types.SimpleNamespace(
        memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n),
        pointerGetAttributes=lambda ptr: types.SimpleNamespace(devicePointer=ptr))

    def pinned_pointer(mem, off):
        return mem

    cuda = types.SimpleNamespace(runtime=runtime, PinnedMemory=_Pinned, PinnedMemoryPointer=pinned_pointer,
                                 alloc_pinned_memory=lambda n: _Pinned(n), get_current_stream=lambda: _Stream(),
                                 Stream=lambda non_blocking=True: _Stream())
    return types.SimpleNamespace(empty=empty, uint8=np.uint8, cuda=cuda)


@pytest.fixture
def fake_cupy(monkeypatch):
    cp = _fake_cupy()
    monkeypatch.setattr(T, "require_cupy", lambda: cp)
    return cp


def _arena(monkeypatch) -> T.HostArena:
    # np.frombuffer needs the buffer protocol on Python < 3.12 too: hand it the ctypes array itself
    orig = np.frombuffer
    monkeypatch.setattr(T.np, "frombuffer", lambda b, **kw: orig(b.buf if isinstance(b, _Pinned) else b, **kw))
    q2 = type_by_name("Q2_0")
    layers = [T.LayerExperts(8, q2, q2, 64, 64) for _ in range(3)]
    arena = T.HostArena(layers)
    rng = np.random.default_rng(0)
    arena.host[:] = rng.integers(0, 256, size=arena.nbytes, dtype=np.uint8)
    return arena


def _where(t: T.GPUExpertTier) -> list:
    """The slot table as ("slot", offset) or ("host", address) per entry (the tiers' VRAM buffers differ)."""
    lo, hi = t.vram_ptr, t.vram_ptr + int(t.vram.size)
    return [("slot", v - lo) if lo <= v < hi else ("host", v) for v in t.slot_table().reshape(-1).tolist()]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_deferred_admissions_match_immediate(fake_cupy, monkeypatch, policy):
    arena = _arena(monkeypatch)
    assert arena.device_ptr == arena.host.ctypes.data
    L, E = 3, 8
    bb = [ly.blob_bytes for ly in arena.layers]
    tiers = {}
    for name in ("now", "deferred"):
        tiers[name] = T.GPUExpertTier(arena, make_tier(policy, n_layers=L, n_expert=E, slots=L * 3, blob_bytes=bb),
                                      miss_mode="host")
    td, tn = tiers["deferred"], tiers["now"]
    td.defer_admissions(fake_cupy.cuda.Stream())
    rng = np.random.default_rng(1)
    host = lambda l, e: arena.device_ptr + arena.offset(l, e)  # noqa: E731
    promoted_any = False
    for step in range(40):
        ev = td.promote()  # what the last step's bookkeeping admitted is in its slots now
        promoted_any |= ev is not None
        assert _where(td) == _where(tn)
        for l in range(L):
            for e, off in td.slot_of[l].items():  # every resident expert's slot holds its bytes
                got = np.ctypeslib.as_array((ctypes.c_uint8 * bb[l]).from_address(td.vram_ptr + off))
                assert np.array_equal(got, arena.blob(l, e)), (step, l, e)
        td.copies_after(fake_cupy.cuda.Stream().record())
        ids = rng.integers(0, E, size=(L, 2))
        for t in (tn, td):
            for l in range(L):
                t.access(l, ids[l])
            t.end_round()
        # admitted this round: resident for the policy and the counters, still read from host memory
        tab = td.slot_table()
        for l, e, off in td._admitting:
            assert td.slot_of[l][e] == off and tab[l, e] == host(l, e)
        assert tn.counters.to_dict() == td.counters.to_dict()
        assert [dict(d) for d in tn.slot_of] == [dict(d) for d in td.slot_of]
    assert promoted_any and tn.counters.admit_copies > 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "static"])
def test_access_rows_counts_as_access_and_copies_the_final_set_once(fake_cupy, monkeypatch, policy):
    """A prompt's T positions of a layer through access_rows: the same hits per position, hit / miss counters and
    policy residency as T access() calls; VRAM holds the same experts (each slot its expert's bytes) but only the
    layer's final admissions are copied (an LRU tier of 3 slots a layer over 40 positions of 8 experts: fewer)."""
    arena = _arena(monkeypatch)
    L, E = 3, 8
    bb = [ly.blob_bytes for ly in arena.layers]
    mk = lambda: T.GPUExpertTier(arena, make_tier(policy, n_layers=L, n_expert=E, slots=L * 3,  # noqa: E731
                                                  blob_bytes=bb), miss_mode="host")
    one, rows = mk(), mk()
    seen = {id(one): [0, 0], id(rows): [0, 0]}  # what on_access (the run's per-phase counting) was told
    for t in (one, rows):
        t.on_access = lambda layer, hit, c=seen[id(t)]: c.__setitem__(slice(0, 2), [c[0] + hit.size, c[1] + int(hit.sum())])
    ids = np.random.default_rng(2).integers(0, E, size=(40, L, 2))
    for l in range(L):
        want = np.stack([one.access(l, ids[t, l]) for t in range(ids.shape[0])])
        got = rows.access_rows(l, ids[:, l])
        assert got.shape == (40, 2) and np.array_equal(got, want)
    a, b = one.counters.to_dict(), rows.counters.to_dict()
    for key in ("hits", "misses", "layer_hits", "layer_misses", "miss_host_read_bytes", "miss_copy_bytes"):
        assert a[key] == b[key], key
    assert a["hits"] + a["misses"] == 40 * L * 2 and a["misses"] > 0
    assert seen[id(one)] == seen[id(rows)] == [40 * L * 2, a["hits"]]
    assert [set(d) for d in one.slot_of] == [set(d) for d in rows.slot_of]
    assert np.array_equal(one.policy.resident_mask(), rows.policy.resident_mask())
    for l in range(L):
        for e, off in rows.slot_of[l].items():
            got = np.ctypeslib.as_array((ctypes.c_uint8 * bb[l]).from_address(rows.vram_ptr + off))
            assert np.array_equal(got, arena.blob(l, e)), (l, e)
    if policy != "static":
        assert 0 < b["admit_copies"] <= L * 3 < a["admit_copies"]
        assert b["admit_bytes"] == b["admit_copies"] * bb[0] and b["evictions"] < a["evictions"]


def test_access_rows_all_resident_counts_without_the_policy_loop(fake_cupy, monkeypatch):
    """Every expert resident (AllResident): a prompt's rows all hit, the policy counts every entry, nothing moves."""
    arena = _arena(monkeypatch)
    t = T.GPUExpertTier(arena, T.AllResident(3, 8), miss_mode="host")
    ids = np.random.default_rng(3).integers(0, 8, size=(50, 2))
    got = t.access_rows(1, ids)
    assert got.shape == (50, 2) and got.all()
    assert t.policy.entries == 100 and t.counters.hits.tolist() == [0, 100, 0] and t.counters.misses.sum() == 0
    assert t.access(2, np.array([1, 5])).tolist() == [True, True] and t.policy.entries == 102
    assert t.counters.to_dict()["bytes_moved"] == 0
