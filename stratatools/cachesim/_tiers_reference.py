"""Straightforward LFU / LFRU tiers: the rules of :mod:`.tiers` written the plain way (a scan of the residents per
eviction, eager decay of every count). Not used by the simulator or the runtime: :class:`.tiers.LFUTier` and
:class:`.tiers.LFRUTier` make the same decisions faster, and are tested equal to these on random access sequences
(tests/test_tiers_lfu_fast.py); bench/bench_tier_rows.py times them as its baseline.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.cachesim.tiers import LFRU_DEFAULTS, LFU_DEFAULTS, Tier, _with_defaults


def reference_lfu_victim(members: list[int], cnt: np.ndarray) -> int:
    """The member with the smallest (count, id): the least frequently used, ties to the lowest expert id."""
    if len(members) <= 16:
        return min(members, key=lambda x: (cnt[x], x))
    m = np.fromiter(members, dtype=np.int64, count=len(members))
    c = cnt[m]
    return int(m[c == c.min()].min())


class _RefDecayCounts:
    def _init_counts(self, params: dict, defaults: dict) -> dict:
        p = _with_defaults(self.policy, params, defaults)
        self.decay = float(p["decay"])
        self.decay_every = int(p["decay_every"])
        if self.decay_every < 1:
            raise StrataError(f"{self.policy}: decay_every must be >= 1")
        self.counts = np.zeros((self.n_layers, self.n_expert), dtype=np.float64)
        return p

    def _decay_round(self) -> None:
        if self.rounds % self.decay_every == 0:
            self.counts *= self.decay


class ReferenceLFUTier(_RefDecayCounts, Tier):
    """Per-layer LFU with decayed counts (rules: :mod:`.tiers`), one scan of the residents per eviction."""

    policy = "lfu"

    def __init__(self, n_layers: int, n_expert: int, cap, blob_bytes, **params: Any):
        Tier.__init__(self, n_layers, n_expert, cap, blob_bytes)
        self._init_counts(params, LFU_DEFAULTS)
        self.res = np.zeros((self.n_layers, self.n_expert), dtype=bool)
        self.members: list[list[int]] = [[] for _ in range(self.n_layers)]

    def _access(self, layer: int, experts: list[int]) -> list[bool]:
        cnt = self.counts[layer]
        row = self.res[layer]
        mem = self.members[layer]
        c = int(self.cap[layer])
        out = []
        for e in experts:
            cnt[e] += 1.0
            if row[e]:
                out.append(True)
                continue
            out.append(False)
            if c <= 0:
                continue
            if len(mem) >= c:
                v = reference_lfu_victim(mem, cnt)
                mem.remove(v)
                row[v] = False
            mem.append(e)
            row[e] = True
            self.layer_loads[layer] += 1
        return out

    def end_round(self) -> None:
        super().end_round()
        self._decay_round()

    def resident_mask(self) -> np.ndarray:
        return self.res.copy()


class ReferenceLFRUTier(_RefDecayCounts, Tier):
    """Per-layer LFRU (rules: :mod:`.tiers`), one scan of the unprivileged residents per eviction."""

    policy = "lfru"

    def __init__(self, n_layers: int, n_expert: int, cap, blob_bytes, **params: Any):
        Tier.__init__(self, n_layers, n_expert, cap, blob_bytes)
        p = self._init_counts(params, LFRU_DEFAULTS)
        frac = float(p["privileged_frac"])
        if not 0.0 < frac <= 1.0:
            raise StrataError(f"lfru: privileged_frac {frac} must be in (0, 1]")
        self.pcap = np.array([math.ceil(int(c) * frac) for c in self.cap], dtype=np.int64)
        self.ucap = self.cap - self.pcap
        self.priv: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(self.n_layers)]
        self.unpriv: list[list[int]] = [[] for _ in range(self.n_layers)]

    def _demote(self, layer: int) -> None:
        pv, up = self.priv[layer], self.unpriv[layer]
        if len(pv) > self.pcap[layer]:
            d, _ = pv.popitem(last=False)
            up.append(d)
            if len(up) > self.ucap[layer]:
                cnt = self.counts[layer]
                v = reference_lfu_victim(up, cnt)
                up.remove(v)

    def _access(self, layer: int, experts: list[int]) -> list[bool]:
        pv, up = self.priv[layer], self.unpriv[layer]
        cnt = self.counts[layer]
        out = []
        for e in experts:
            cnt[e] += 1.0
            if e in pv:
                pv.move_to_end(e)
                out.append(True)
            elif e in up:
                up.remove(e)
                pv[e] = None
                self._demote(layer)
                out.append(True)
            else:
                out.append(False)
                if self.cap[layer] <= 0:
                    continue
                pv[e] = None
                self.layer_loads[layer] += 1
                self._demote(layer)
        return out

    def end_round(self) -> None:
        super().end_round()
        self._decay_round()

    def resident_mask(self) -> np.ndarray:
        m = np.zeros((self.n_layers, self.n_expert), dtype=bool)
        for l in range(self.n_layers):
            m[l, list(self.priv[l]) + self.unpriv[l]] = True
        return m

    def resident_row(self, layer: int) -> np.ndarray:
        m = np.zeros(self.n_expert, dtype=bool)
        m[list(self.priv[layer]) + self.unpriv[layer]] = True
        return m


def make_reference_tier(policy: str, n_layers: int, n_expert: int, cap, blob_bytes=None, **params: Any) -> Tier:
    """A reference ``lfu`` or ``lfru`` tier (``cap`` int [L] slots per layer; ``blob_bytes`` [L], default 1 each).
    Raises StrataError for another policy or a bad parameter."""
    bb = np.ones(int(n_layers), dtype=np.int64) if blob_bytes is None else np.asarray(blob_bytes, dtype=np.int64)
    if policy == "lfu":
        return ReferenceLFUTier(n_layers, n_expert, cap, bb, **params)
    if policy == "lfru":
        return ReferenceLFRUTier(n_layers, n_expert, cap, bb, **params)
    raise StrataError(f"no reference tier for policy {policy!r} (use lfu or lfru)")
