"""The GPU expert tier: routed-expert blobs in VRAM slots, every blob in a pinned host arena for misses.

What lives where (cache-policy.md "The tier"; formats.md section 5):

* :class:`HostArena`: every routed expert of every layer in one pinned (page-locked) host buffer, laid out
  exactly like ``experts.bin``: per layer in order, E blobs back to back, each ``[gate][up][down]``. Filled
  from a GGUF (each expert's slice of ``blk.L.ffn_{gate,up,down}_exps.weight``) or from an ``experts.bin``.
* :class:`GPUExpertTier`: VRAM slots holding blobs, one slot per resident (layer, expert), each slot its
  layer's blob bytes rounded up to 256. *Which* experts are resident is decided by a policy object from
  :func:`stratatools.cachesim.make_tier` (the simulator's code: static fill from a STRP profile, where slot i
  holds rank i; the adaptive tier; LRU, ...). After every access and every round the tier mirrors the
  policy's ``resident_mask()``: newly resident experts are copied host -> VRAM, evicted ones free their slot.
* A hit is computed from its VRAM slot. A miss is served from host memory, either **copied** to a staging
  buffer first (``miss_mode="copy"``) or read by the kernels **directly** over the bus from the mapped
  pinned arena (``miss_mode="host"``, zero-copy).

Counters: hits and misses per layer (the policy's own, identical to the simulator's), bytes copied host ->
VRAM for misses and for admissions, bytes read zero-copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.model.ggml_types import GGMLType

from stratatools.runtime.gpu import require_cupy

ALIGN = 256  # slot bytes are rounded up to this (cache-policy.md, native packs)
MISS_MODES = ("copy", "host")


@dataclass(frozen=True)
class LayerExperts:
    """Geometry of one layer's routed experts.

    Attributes:
        n_expert: experts in the layer (the router's ne1).
        gu_type, d_type: ggml types of gate/up and of down.
        hidden, ff: model width (n_embd) and expert width.
    """

    n_expert: int
    gu_type: GGMLType
    d_type: GGMLType
    hidden: int
    ff: int

    @property
    def gate_bytes(self) -> int:
        """Bytes of one expert's gate matrix (= its up matrix): ff rows of ``row_bytes(gu, hidden)``."""
        return self.ff * self.gu_type.row_bytes(self.hidden)

    @property
    def down_bytes(self) -> int:
        """Bytes of one expert's down matrix: hidden rows of ``row_bytes(d, ff)``."""
        return self.hidden * self.d_type.row_bytes(self.ff)

    @property
    def blob_bytes(self) -> int:
        """``2*ff*row(gu, hidden) + hidden*row(d, ff)`` (formats.md section 5)."""
        return 2 * self.gate_bytes + self.down_bytes


def layers_from_model(model: Any, n_layers: int | None = None) -> list[LayerExperts]:
    """Per-layer expert geometry from a GGUF :class:`stratatools.model.gguf.Model` (trunk layers 0..n_layers-1).

    Raises StrataError when a role tensor is missing, gate and up differ in type, or shapes disagree.
    """
    out = []
    l = 0
    while model.has(f"blk.{l}.ffn_gate_exps.weight") and (n_layers is None or l < n_layers):
        g = model.tensor(f"blk.{l}.ffn_gate_exps.weight")
        u = model.tensor(f"blk.{l}.ffn_up_exps.weight")
        d = model.tensor(f"blk.{l}.ffn_down_exps.weight")
        if g.type.id != u.type.id:
            raise StrataError(f"{model.path}: tensor {u.name}: gate and up experts of layer {l} differ in type "
                              f"({g.type.name} vs {u.type.name})")
        hidden, ff, E = g.ne
        if tuple(u.ne) != (hidden, ff, E) or tuple(d.ne) != (ff, hidden, E):
            raise StrataError(f"{model.path}: layer {l}: expert tensors have shapes {g.ne}, {u.ne}, {d.ne}; "
                              f"expected [n_embd, ff, E] twice and [ff, n_embd, E]")
        out.append(LayerExperts(int(E), g.type, d.type, int(hidden), int(ff)))
        l += 1
    if not out:
        raise StrataError(f"{model.path}: no blk.0.ffn_gate_exps.weight: not a MoE model with routed experts")
    return out


class HostArena:
    """Every routed expert blob in one pinned host buffer, ``experts.bin`` layout.

    Attributes:
        layers: per-layer geometry.
        layer_offset: int64 [L] byte offset of each layer in the arena.
        nbytes: total bytes.
        host: numpy uint8 view of the pinned buffer.
        device_ptr: device address of the same memory (mapped pinned memory, unified addressing), or None
            when the platform cannot map it (then ``miss_mode="host"`` is unavailable).
    """

    def __init__(self, layers: Sequence[LayerExperts]):
        cp = require_cupy()
        self.layers = list(layers)
        sizes = np.array([ly.blob_bytes * ly.n_expert for ly in self.layers], dtype=np.int64)
        self.layer_offset = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.nbytes = int(sizes.sum())
        self._mem = _alloc_mapped_pinned(cp, max(self.nbytes, 1))
        self.host = np.frombuffer(self._mem, dtype=np.uint8, count=self.nbytes)
        self.device_ptr = _device_pointer(cp, self._mem)

    def offset(self, layer: int, expert: int) -> int:
        """Byte offset of (layer, expert)'s blob in the arena."""
        return int(self.layer_offset[layer]) + int(expert) * self.layers[layer].blob_bytes

    def blob(self, layer: int, expert: int) -> np.ndarray:
        """uint8 view of one blob in the arena."""
        o = self.offset(layer, expert)
        return self.host[o:o + self.layers[layer].blob_bytes]

    @classmethod
    def from_gguf(cls, model: Any, n_layers: int | None = None) -> "HostArena":
        """Fill from a GGUF model: blob (l, e) = e-th slices of ``blk.l.ffn_{gate,up,down}_exps.weight``
        (expert axis outermost, formats.md section 1). Streams one tensor at a time from the memory map."""
        layers = layers_from_model(model, n_layers)
        arena = cls(layers)
        for l, ly in enumerate(layers):
            base = int(arena.layer_offset[l])
            view = arena.host[base:base + ly.blob_bytes * ly.n_expert].reshape(ly.n_expert, ly.blob_bytes)
            gb = ly.gate_bytes
            for role, lo, n in (("gate", 0, gb), ("up", gb, gb), ("down", 2 * gb, ly.down_bytes)):
                src = model.raw(f"blk.{l}.ffn_{role}_exps.weight").reshape(ly.n_expert, n)
                view[:, lo:lo + n] = src
        return arena

    @classmethod
    def from_expert_source(cls, source: Any) -> "HostArena":
        """Fill from the runtime's :class:`stratatools.runtime.weights.ExpertSource` (GGUF offsets or experts.bin)."""
        layers = []
        for l, sl in enumerate(source.layers):
            g, d = sl["gate"], sl["down"]
            ff, hidden = g.shape
            layers.append(LayerExperts(int(source.n_expert[l]), g.type, d.type, int(hidden), int(ff)))
        arena = cls(layers)
        for l, ly in enumerate(layers):
            gb = ly.gate_bytes
            for e in range(ly.n_expert):
                g, u, d = source.raw(l, e)
                b = arena.blob(l, e)
                b[:gb] = g
                b[gb:2 * gb] = u
                b[2 * gb:] = d
        return arena

    @classmethod
    def from_experts_bin(cls, path: str, layers: Sequence[LayerExperts], layer_offsets: Sequence[int] | None = None) -> "HostArena":
        """Fill from a pack's ``experts.bin`` (formats.md section 5: per layer, E blobs back to back).

        Raises StrataError when the file is shorter than the table says.
        """
        import os

        arena = cls(layers)
        offs = arena.layer_offset if layer_offsets is None else np.asarray(layer_offsets, dtype=np.int64)
        size = os.path.getsize(path)
        need = int(offs[-1]) + layers[-1].blob_bytes * layers[-1].n_expert
        if size < need:
            raise StrataError(f"{path}: experts.bin is {size} bytes but the pack table needs {need}; "
                              f"re-run stratatools pack --experts-bin", path)
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        for l, ly in enumerate(layers):
            n = ly.blob_bytes * ly.n_expert
            dst = int(arena.layer_offset[l])
            src = int(offs[l])
            step = 64 << 20
            for i in range(0, n, step):
                j = min(n, i + step)
                arena.host[dst + i:dst + j] = mm[src + i:src + j]
        del mm
        return arena


def _alloc_mapped_pinned(cp: Any, nbytes: int) -> Any:
    """Pinned host memory, mapped into the device address space when the platform allows."""
    try:  # cudaHostAllocPortable | cudaHostAllocMapped
        return cp.cuda.PinnedMemoryPointer(cp.cuda.PinnedMemory(nbytes, 1 | 2), 0)
    except Exception:
        return cp.cuda.alloc_pinned_memory(nbytes)


def _device_pointer(cp: Any, mem: Any) -> int | None:
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(mem.ptr)
        dp = int(attrs.devicePointer)
        return dp or None
    except Exception:
        return None


class AllResident:
    """A trivial residency rule for when every expert fits in VRAM: every access hits. Not a cache policy
    (those live in :mod:`stratatools.cachesim`); it only lets :class:`GPUExpertTier` hold the whole model."""

    policy = "all-resident"

    def __init__(self, n_layers: int, n_expert: int):
        self.n_layers, self.n_expert = int(n_layers), int(n_expert)
        self.entries = 0

    def access(self, layer: int, experts: Any) -> np.ndarray:
        n = int(np.asarray(experts).size)
        self.entries += n
        return np.ones(n, dtype=bool)

    def end_round(self) -> None:
        pass

    def resident_mask(self) -> np.ndarray:
        return np.ones((self.n_layers, self.n_expert), dtype=bool)

    def resident_row(self, layer: int) -> np.ndarray:
        return np.ones(self.n_expert, dtype=bool)

    def stats(self) -> dict:
        return {"policy": self.policy, "entries": self.entries, "hits": self.entries, "h_expert": 1.0}


@dataclass
class TierCounters:
    """What the GPU tier did. Bytes are blob bytes (not rounded slot bytes)."""

    hits: np.ndarray
    misses: np.ndarray
    miss_copy_bytes: int = 0
    miss_host_read_bytes: int = 0
    admit_copies: int = 0
    admit_bytes: int = 0
    evictions: int = 0
    fill_bytes: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        h, m = int(self.hits.sum()), int(self.misses.sum())
        return {"hits": h, "misses": m, "h_expert": h / (h + m) if h + m else float("nan"),
                "layer_hits": self.hits.tolist(), "layer_misses": self.misses.tolist(),
                "miss_copy_bytes": self.miss_copy_bytes, "miss_host_read_bytes": self.miss_host_read_bytes,
                "admit_copies": self.admit_copies, "admit_bytes": self.admit_bytes, "evictions": self.evictions,
                "fill_bytes": self.fill_bytes,
                "bytes_moved": self.miss_copy_bytes + self.miss_host_read_bytes + self.admit_bytes}


class GPUExpertTier:
    """VRAM slots for routed experts, driven by a cachesim policy object, misses served from a host arena.

    Args:
        arena: the pinned host arena holding every blob.
        policy: an online tier from :func:`stratatools.cachesim.make_tier` (same code as the simulator);
            its ``access``/``end_round``/``resident_mask`` decide residency and count hits.
        miss_mode: ``"copy"`` (stage each missed blob in VRAM, then compute) or ``"host"`` (kernels read the
            mapped pinned memory directly).
        stream: CuPy stream for the copies (default: the current stream).

    Raises:
        StrataError: geometry of policy and arena differ; unknown miss mode; ``host`` mode without mapped memory.
    """

    def __init__(self, arena: HostArena, policy: Any, miss_mode: str = "copy", stream: Any = None):
        cp = require_cupy()
        self.cp = cp
        if miss_mode not in MISS_MODES:
            raise StrataError(f"unknown miss mode {miss_mode!r} (use {' or '.join(MISS_MODES)})")
        if miss_mode == "host" and arena.device_ptr is None:
            raise StrataError("miss mode 'host' needs pinned memory mapped into the device; use 'copy'")
        L = len(arena.layers)
        if (policy.n_layers, policy.n_expert) != (L, max(ly.n_expert for ly in arena.layers)):
            raise StrataError(f"the tier policy is for {policy.n_layers} layers x {policy.n_expert} experts but the "
                              f"model has {L} x {max(ly.n_expert for ly in arena.layers)}")
        self.arena, self.policy, self.miss_mode = arena, policy, miss_mode
        self.stream = stream
        self._held: int | None = None  # end_round calls queued while held (hold / release)
        # deferred admissions (defer_admissions): their copies' stream, the event they wait for, and the experts
        # copied whose table entries still point at host memory
        self._copy_stream: Any = None
        self._after: Any = None
        self._after_waited = False
        self._admitting: list[tuple[int, int, int]] = []
        self.slot_bytes = np.array([(ly.blob_bytes + ALIGN - 1) // ALIGN * ALIGN for ly in arena.layers], dtype=np.int64)
        self.slot_of: list[dict[int, int]] = [dict() for _ in range(L)]  # expert -> slot byte offset
        self.free: list[list[int]] = [[] for _ in range(L)]
        self.counters = TierCounters(np.zeros(L, dtype=np.int64), np.zeros(L, dtype=np.int64))
        mask = np.asarray(policy.resident_mask(), dtype=bool)
        cap_bytes = self._capacity_bytes(mask)
        self.vram = cp.empty(max(cap_bytes, ALIGN), dtype=cp.uint8)
        self.vram_ptr = int(self.vram.data.ptr)
        self._bump = 0
        self._staging = None
        self._stage_next = 0
        #: staging ring for copy-mode misses: this many slots of the largest blob (grows to twice a token's k)
        self.staging_slots = 16
        #: device addresses read by expert jobs not launched yet (see :meth:`ffn`), and what launches them
        self._pending: set[int] = set()
        self._flush: Any = None
        #: called as on_access(layer, hit bool [n]) after the policy accesses of one call (one record, or a prompt's
        #: records of one layer: :meth:`access_rows`), for per-phase counting by the caller
        self.on_access: Any = None
        #: bumped whenever an expert moves in or out of a slot (the static decoder re-uploads its slot table)
        self.version = 0
        Emax = max(ly.n_expert for ly in arena.layers)
        self._in_vram = np.zeros((L, Emax), dtype=bool)
        #: every expert's blob address (VRAM slot, else mapped host arena, else 0), kept up to date
        self._table = np.zeros((L, Emax), dtype=np.uint64)
        if arena.device_ptr is not None:
            for l, ly in enumerate(arena.layers):
                self._table[l, :ly.n_expert] = np.uint64(arena.device_ptr + int(arena.layer_offset[l])) + \
                    np.arange(ly.n_expert, dtype=np.uint64) * np.uint64(ly.blob_bytes)
        self._sync(mask, initial=True)

    # -- layout -------------------------------------------------------------------------------------
    def _capacity_bytes(self, mask: np.ndarray) -> int:
        """VRAM to reserve: the policy's budget (cap per layer and free pool) in slot bytes."""
        pol = self.policy
        cap = np.asarray(getattr(pol, "cap", mask.sum(1)), dtype=np.int64)
        total = int((np.maximum(cap, mask.sum(1)) * self.slot_bytes).sum())
        plan = getattr(pol, "plan", None)
        if plan is not None:
            if getattr(plan, "pool_bytes", -1) > 0:
                total += int(plan.pool_bytes)
            if getattr(plan, "pool_slots", -1) > 0:
                total += int(plan.pool_slots) * int(self.slot_bytes.max())
        return total

    def _take_slot(self, layer: int) -> int:
        if self.free[layer]:
            return self.free[layer].pop()
        sb = int(self.slot_bytes[layer])
        if self._bump + sb > self.vram.size:  # the policy went over its own budget: grow (rare, counted)
            self._grow(self._bump + sb)
        off = self._bump
        self._bump += sb
        return off

    def _grow(self, need: int) -> None:
        cp = self.cp
        self._before_write(None)  # pending jobs point into the old buffer: launch them first
        if self._copy_stream is not None:  # deferred admissions land in the old buffer first (rare: host wait)
            self._copy_stream.synchronize()
            self._admitting = []  # the table below points at every slot, those copies included
        new = cp.empty(max(need, int(self.vram.size) * 5 // 4), dtype=cp.uint8)
        new[:self._bump] = self.vram[:self._bump]
        self.vram, self.vram_ptr = new, int(new.data.ptr)
        for l, slots in enumerate(self.slot_of):
            for e, off in slots.items():
                self._table[l, e] = np.uint64(self.vram_ptr + off)
        self.version += 1
        self.counters.extra["vram_grown"] = self.counters.extra.get("vram_grown", 0) + 1

    def _before_write(self, dst_ptr: int | None) -> None:
        """Launch the pending expert jobs (:meth:`ffn`) before ``dst_ptr`` (None: any address) is overwritten:
        a copy into a slot or staging entry is ordered on the stream before jobs launched after it."""
        if self._pending and self._flush is not None and (dst_ptr is None or dst_ptr in self._pending):
            self._flush()

    def _copy_in(self, dst_ptr: int, layer: int, expert: int) -> int:
        self._before_write(dst_ptr)
        n = self.arena.layers[layer].blob_bytes
        src = self.arena.host.ctypes.data + self.arena.offset(layer, expert)
        s = self.stream if self.stream is not None else self.cp.cuda.get_current_stream()
        self.cp.cuda.runtime.memcpyAsync(dst_ptr, src, n, 1, s.ptr)  # 1 = cudaMemcpyHostToDevice
        return n

    def _host_addr(self, layer: int, expert: int) -> int:
        dp = self.arena.device_ptr
        return 0 if dp is None else dp + self.arena.offset(layer, expert)

    def _place(self, layer: int, expert: int, off: int | None) -> None:
        """Record that (layer, expert) now sits at slot ``off`` (None: evicted) in the address table."""
        self._in_vram[layer, expert] = off is not None
        self._table[layer, expert] = np.uint64(self.vram_ptr + off if off is not None else self._host_addr(layer, expert))
        self.version += 1

    def _row(self, layer: int) -> np.ndarray:
        f = getattr(self.policy, "resident_row", None)
        return np.asarray(f(layer) if f is not None else self.policy.resident_mask()[layer], dtype=bool)

    def _sync(self, mask: np.ndarray | None = None, initial: bool = False, layers: Sequence[int] | None = None) -> None:
        """Make VRAM hold exactly the policy's resident set (for ``layers``, default all; ``mask``: the policy's
        ``resident_mask()`` when the caller has it)."""
        for l in (range(len(self.slot_of)) if layers is None else layers):
            n = self.arena.layers[l].n_expert
            row = np.asarray(mask[l] if mask is not None else self._row(l), dtype=bool)[:n]
            have = self._in_vram[l, :n]
            if np.array_equal(row, have):
                continue
            slots = self.slot_of[l]
            for e in np.flatnonzero(have & ~row).tolist():
                self.free[l].append(slots.pop(e))
                self._place(l, e, None)
                self.counters.evictions += 1
            for e in np.flatnonzero(row & ~have).tolist():
                off = self._take_slot(l)
                slots[e] = off
                if self._copy_stream is not None and not initial:
                    n_b = self._admit_deferred(l, e, off)
                    self.counters.admit_copies += 1
                    self.counters.admit_bytes += n_b
                    continue
                self._place(l, e, off)
                n_b = self._copy_in(self.vram_ptr + off, l, e)
                if initial:
                    self.counters.fill_bytes += n_b
                else:
                    self.counters.admit_copies += 1
                    self.counters.admit_bytes += n_b

    # -- use ----------------------------------------------------------------------------------------
    def fetch(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Route one token's experts of ``layer``: returns (blob device addresses uint64 [k], hit bool [k]).

        Hits point into VRAM slots; misses into the staging ring (copy mode, :attr:`staging_slots` entries,
        valid until the ring comes round again) or into the mapped host arena (host mode). The addresses are
        valid for work enqueued on the stream before the next fetch or :meth:`end_round` (which may copy
        another expert into a slot); :meth:`ffn` handles that for many tokens.
        """
        ptrs, hit = self._fetch_nosync(layer, experts)
        self._sync(layers=[layer])
        return ptrs, hit

    def _fetch_nosync(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`fetch` without the trailing residency sync (the policy's evictions and admissions)."""
        experts = np.asarray(experts, dtype=np.int64).reshape(-1)
        if 2 * experts.size > self.staging_slots:  # a token's misses must fit the ring twice over
            self._before_write(None)
            self._staging, self._stage_next = None, 0
            self.staging_slots = 2 * int(experts.size)
        hit = np.asarray(self.policy.access(layer, experts), dtype=bool)
        if self.on_access is not None:
            self.on_access(layer, hit)
        ptrs = np.zeros(experts.size, dtype=np.uint64)
        ly = self.arena.layers[layer]
        n_miss = 0
        for i, e in enumerate(experts):
            e = int(e)
            off = self.slot_of[layer].get(e)
            if hit[i] and off is not None:
                ptrs[i] = self.vram_ptr + off
                continue
            if hit[i]:  # resident per the policy but not yet copied (admitted since the last sync)
                off = self._take_slot(layer)
                self.slot_of[layer][e] = off
                self._place(layer, e, off)
                self.counters.admit_copies += 1
                self.counters.admit_bytes += self._copy_in(self.vram_ptr + off, layer, e)
                ptrs[i] = self.vram_ptr + off
                continue
            if self.miss_mode == "host":
                ptrs[i] = self.arena.device_ptr + self.arena.offset(layer, e)
                self.counters.miss_host_read_bytes += ly.blob_bytes
            else:
                st = self._staging_slot(self._stage_next)
                self._stage_next = (self._stage_next + 1) % self.staging_slots
                self.counters.miss_copy_bytes += self._copy_in(st, layer, e)
                ptrs[i] = st
            n_miss += 1
        self.counters.hits[layer] += int(hit.sum())
        self.counters.misses[layer] += int((~hit).sum())
        return ptrs, hit

    def access(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """One record computed elsewhere (the static decoder, which read each expert through :meth:`slot_table`):
        the policy's access, the counters (a miss counts as a zero-copy read of its blob), then VRAM follows the
        policy's resident set. Returns hit bool [k]."""
        return self.access_rows(layer, np.asarray(experts, dtype=np.int64).reshape(1, -1))[0]

    def access_rows(self, layer: int, rows: np.ndarray) -> np.ndarray:
        """T records of one layer in order (a prompt's positions, computed elsewhere: the batched prefill): the
        policy's accesses and the hit / miss counters exactly as T :meth:`access` calls, but VRAM follows the policy's
        resident set once, after the last record, so an expert admitted and evicted again within them is never copied
        (``admit_*``, ``evictions`` and ``bytes_moved`` count the copies and evictions made, so they are smaller).
        ``rows``: expert ids [T, k]. Returns hit bool [T, k]."""
        rows = np.asarray(rows, dtype=np.int64).reshape(len(rows), -1)
        if isinstance(self.policy, AllResident):  # every access hits: no loop needed
            self.policy.entries += int(rows.size)
            hits = np.ones(rows.shape, dtype=bool)
        else:  # the simulator's tiers (Tier.access_rows: the same accesses as row by row, checks once)
            hits = np.asarray(self.policy.access_rows(layer, rows), dtype=bool)
        if self.on_access is not None:
            self.on_access(layer, hits.reshape(-1))
        nh = int(hits.sum())
        self.counters.hits[layer] += nh
        self.counters.misses[layer] += int(hits.size - nh)
        self.counters.miss_host_read_bytes += int(hits.size - nh) * self.arena.layers[layer].blob_bytes
        if not isinstance(self.policy, AllResident):
            self._sync(layers=[layer])
        return hits

    def slot_table(self) -> np.ndarray:
        """uint64 [L, Emax]: device address of every expert's blob: its VRAM slot when resident, else its place
        in the mapped host arena (zero-copy). Raises StrataError when an expert is not resident and the arena
        is not mapped into the device."""
        if self.arena.device_ptr is None:
            for l, ly in enumerate(self.arena.layers):
                if len(self.slot_of[l]) < ly.n_expert:
                    raise StrataError(f"layer {l}: {ly.n_expert - len(self.slot_of[l])} routed experts are not in VRAM and "
                                      f"pinned host memory is not mapped into the device on this platform; the static "
                                      f"decoder needs every expert resident here (give more slots or --vram-gib)")
        return self._table.copy()

    def _staging_slot(self, i: int) -> int:
        """Device address of staging ring entry ``i`` (the ring is allocated once, at the first miss)."""
        cp = self.cp
        sb = int(self.slot_bytes.max())
        if self._staging is None:
            self._staging = cp.empty(self.staging_slots * sb, dtype=cp.uint8)
        return int(self._staging.data.ptr) + i * sb

    def end_round(self) -> None:
        """Close a round (decode position): the policy may swap experts; VRAM follows. While :meth:`hold` is in
        effect the call is queued (counted) and made by :meth:`release`."""
        if self._held is not None:
            self._held += 1
            return
        self.policy.end_round()
        self._sync(np.asarray(self.policy.resident_mask(), dtype=bool))

    def defer_admissions(self, stream: Any) -> None:
        """Decoder mode (:class:`stratatools.runtime.gpu.engine.DecoderRuntime` ``async_swaps``): an expert the
        policy admits is copied into its slot on ``stream`` (a CuPy stream of its own), after the event given to
        :meth:`copies_after` (the step that may still read the slot's previous expert), while the table keeps
        pointing at its host copy; :meth:`promote` later points the table at the slot. The policy's residency and the
        counters are updated at once, as without it (the hits counted do not change); only where the kernels read an
        admitted expert from during one more step differs (host memory, the same bytes)."""
        self._copy_stream = stream

    def copies_after(self, event: Any) -> None:
        """Deferred admissions copied from now on wait for ``event`` (None: no wait)."""
        self._after, self._after_waited = event, False

    def promote(self) -> Any:
        """Point the table at the experts admitted (and copied) before this call that are still in their slots; returns
        an event recorded on the copy stream after their copies (a step that reads the new table must wait for it),
        or None when there was nothing to promote."""
        if not self._admitting:
            return None
        for l, e, off in self._admitting:
            if self.slot_of[l].get(e) == off:
                self._table[l, e] = np.uint64(self.vram_ptr + off)
        self._admitting = []
        self.version += 1
        return self._copy_stream.record()

    def _admit_deferred(self, layer: int, expert: int, off: int) -> int:
        """Copy an admitted expert into slot ``off`` on the copy stream (after :meth:`copies_after`'s event); its
        table entry stays at host memory until :meth:`promote`. Returns the bytes copied."""
        self._in_vram[layer, expert] = True
        self._table[layer, expert] = np.uint64(self._host_addr(layer, expert))
        self.version += 1
        cs = self._copy_stream
        if self._after is not None and not self._after_waited:
            cs.wait_event(self._after)
            self._after_waited = True
        n = self.arena.layers[layer].blob_bytes
        src = self.arena.host.ctypes.data + self.arena.offset(layer, expert)
        self.cp.cuda.runtime.memcpyAsync(self.vram_ptr + off, src, n, 1, cs.ptr)  # 1 = cudaMemcpyHostToDevice
        self._admitting.append((layer, expert, off))
        return n

    def hold(self) -> None:
        """Queue the next :meth:`end_round` calls until :meth:`release`: a decoder has run a step whose accesses it
        has not made yet (:class:`stratatools.runtime.gpu.engine.DecoderRuntime` ``lag``), and the round must close
        after them, as it would have."""
        if self._held is None:
            self._held = 0

    def holding(self) -> bool:
        """Is :meth:`hold` in effect?"""
        return self._held is not None

    def release(self) -> None:
        """End :meth:`hold`: make the queued :meth:`end_round` calls, in order."""
        n, self._held = self._held or 0, None
        for _ in range(n):
            self.end_round()

    def resident_count(self) -> int:
        """Experts now held in VRAM slots, all layers together."""
        return sum(len(d) for d in self.slot_of)

    def stats(self) -> dict:
        """Counters of this tier plus the policy's own ``stats()``."""
        d = self.counters.to_dict()
        d["miss_mode"] = self.miss_mode
        d["resident"] = self.resident_count()
        d["vram_bytes"] = int(self.vram.size)
        d["staging_bytes"] = int(self._staging.size) if self._staging is not None else 0
        d["policy"] = self.policy.stats() if hasattr(self.policy, "stats") else {}
        return d

    def ffn(self, layer: int, X: Any, expert_ids: np.ndarray, weights: np.ndarray, out: Any = None,
            accumulate: bool = False) -> Any:
        """Routed-expert FFN of ``layer`` for T tokens through the tier.

        Args:
            X: CuPy float32 ``[T, hidden]``.
            expert_ids: int ``[T, k]`` (host) routed experts per token; each token is one access (record).
            weights: float32 ``[T, k]`` router weights.
            out / accumulate: as :func:`stratatools.runtime.gpu.experts.expert_ffn`.
        Returns:
            CuPy float32 ``[T, hidden]``.

        Tokens are fetched in order (one policy access each) and their jobs launched in segments: a segment is
        launched as soon as a later fetch is about to copy another expert into a slot (or staging entry) one of
        its jobs reads, so every token computes with the experts it was routed to, whatever the policy evicts
        (results equal the all-resident tier's bit for bit).
        """
        from stratatools.runtime.gpu.experts import expert_ffn, make_jobs

        cp = self.cp
        ids = np.asarray(expert_ids, dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None, :]
        T = ids.shape[0]
        w_all = np.asarray(weights, dtype=np.float32).reshape(ids.shape)
        ly = self.arena.layers[layer]
        X = cp.ascontiguousarray(X, dtype=cp.float32)
        if out is None:
            out = cp.empty((T, ly.hidden), dtype=cp.float32)
            accumulate = False
        seg: list[np.ndarray] = []  # pointers of tokens start .. start+len(seg)-1, not launched yet
        start = [0]

        def flush() -> None:
            a, b = start[0], start[0] + len(seg)
            if b > a:
                jobs = make_jobs(np.stack(seg), w_all[a:b], ly.gate_bytes)
                expert_ffn(X[a:b], jobs, ly.gu_type, ly.d_type, ly.hidden, ly.ff, out=out[a:b],
                           accumulate=accumulate)
                self.counters.extra["ffn_launches"] = self.counters.extra.get("ffn_launches", 0) + 1
            start[0] = b
            seg.clear()
            self._pending.clear()

        self._flush = flush
        try:
            for t in range(T):
                p, _ = self._fetch_nosync(layer, ids[t])
                seg.append(p)
                self._pending.update(int(v) for v in p)
                self._sync(layers=[layer])
            flush()
        finally:
            self._flush = None
            self._pending.clear()
        return out
