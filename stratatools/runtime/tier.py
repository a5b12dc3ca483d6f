"""The expert tier inside the runtime: which routed experts sit in the (VRAM) tier, the rest from host memory.

Residency is decided by the simulator's own online tier objects (:func:`stratatools.cachesim.make_tier`:
``static`` = Strata's start-up fill from a STRP profile with global or per-layer admission, ``adaptive`` =
Strata's adaptive swaps, or a baseline such as ``lru``), so the runtime and the simulator apply the same
policy code. The runtime feeds the tier every routed record it really computes, in the order it computes
them: every forward batch is one round (:data:`stratatools.traces.table.ROUNDS`): a prefill is one batched
round (layer-major, as a batched engine runs it), each decode position one round (``end_round`` after it, where
the adaptive tier makes its moves). The run's trace carries the same rounds (the prefill as a window), so
``simulate`` on it gives the same hits per phase and layer.

Data path: an expert resident in the tier is served from the tier's store (``xp`` arrays, filled when the
expert becomes resident: start-up fill and the adaptive tier's copies), any other expert from host memory
(:meth:`stratatools.runtime.weights.ExpertSource.matrices`). Hits and misses are counted per layer and phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from stratatools.cachesim import make_tier
from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile

from stratatools.runtime.weights import Weights

GIB = 1 << 30


@dataclass
class TierCounts:
    """Hits and entries per layer of one phase (numpy int64 [L])."""

    entries: np.ndarray
    hits: np.ndarray

    @classmethod
    def zeros(cls, n_layers: int) -> "TierCounts":
        """Counts of zero for ``n_layers`` layers."""
        return cls(np.zeros(n_layers, np.int64), np.zeros(n_layers, np.int64))

    @property
    def h_expert(self) -> float:
        """hits / entries over all layers (cache-policy.md h_expert), NaN when there were no entries."""
        e = int(self.entries.sum())
        return float(self.hits.sum()) / e if e else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """Totals and per-layer lists; ``h_expert`` is None (JSON null, not NaN) when the phase had no entries."""
        e = self.entries
        return {"entries": int(e.sum()), "hits": int(self.hits.sum()), "misses": int((e - self.hits).sum()),
                "h_expert": self.h_expert if int(e.sum()) else None, "layer_entries": e.tolist(), "layer_hits": self.hits.tolist(),
                "layer_misses": (e - self.hits).tolist()}


class ExpertTier:
    """A tier of routed experts in front of host memory.

    Args:
        weights: the loaded model (blob bytes per layer come from its expert source: pack or GGUF).
        policy: a :data:`stratatools.cachesim.POLICIES` online policy (``static``, ``adaptive``, ``lru``,
            ``lfu``, ``lfru``).
        profile: STRP ranking for ``static``/``adaptive`` (None: arrival-order admission).
        slots / budget_gib: the tier's size in slots or bytes (byte budget: Strata's per-slot blob rounded
            up to 256 bytes, see :mod:`stratatools.cachesim.layout`).
        admission: ``global`` or ``per-layer``.
        store: keep float32 matrices of the resident experts (the numpy/CuPy forward's data path); False when
            a device tier serves the data (:meth:`attach_device`).
        params: policy parameters (adaptive: ``adapt_every``, ``max_moves`` ...).

    Raises:
        StrataError: a profile whose geometry differs from the model's, a pruned model with per-layer expert
            counts, no budget, a budget that is negative or not finite, an unknown policy (from make_tier).
    """

    def __init__(self, weights: Weights, policy: str = "static", profile: Profile | None = None,
                 slots: int | None = None, budget_gib: float | None = None, admission: str = "global",
                 profile_path: str | None = None, store: bool = True, **params: Any):
        cfg = weights.cfg
        n_e = set(cfg.n_expert)
        if len(n_e) != 1:
            raise StrataError(f"the tier needs one expert count for all layers; this model's routers have {sorted(n_e)}")
        self.n_layers, self.n_expert = cfg.n_layer, n_e.pop()
        if profile is not None and (profile.n_layers, profile.n_expert) != (self.n_layers, self.n_expert):
            raise StrataError(
                f"{profile_path or 'profile'}: made for {profile.n_layers} layers x {profile.n_expert} experts, but the model "
                f"has {self.n_layers} x {self.n_expert} (a profile for another model or revision; remap or rebuild it)",
                profile_path)
        if slots is None and budget_gib is None:
            slots = int(profile.slots) if profile is not None else None
            if slots is None:
                raise StrataError("the tier needs --slots N, --budget-gib X or a profile (whose slot count is used)")
        self.blob_bytes = np.array([weights.experts.blob_bytes(il) for il in range(self.n_layers)], dtype=np.int64)
        if budget_gib is not None and not (math.isfinite(budget_gib * GIB) and budget_gib >= 0):
            raise StrataError(f"--budget-gib {budget_gib} is not a finite size >= 0 (GiB)")
        budget = int(budget_gib * GIB) if budget_gib is not None else None
        self.tier = make_tier(policy, n_layers=self.n_layers, n_expert=self.n_expert, profile=profile, slots=slots,
                              budget_bytes=budget, blob_bytes=self.blob_bytes, admission=admission, **params)
        self.policy = policy
        self.slots = slots
        self.budget_bytes = budget
        self.weights = weights
        self.counts = {"prefill": TierCounts.zeros(self.n_layers), "decode": TierCounts.zeros(self.n_layers)}
        self.phase = "prefill"
        self.store: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
        self.copies = 0
        self.keep_store = bool(store)
        self.device: Any = None
        self.rounds = 0
        self._sync()
        self.copies = 0  # the start-up fill is not counted as copies during the run

    def attach_device(self, device_tier: Any) -> None:
        """Let a :class:`stratatools.runtime.gpu.tier.GPUExpertTier` built on this tier's policy (``self.tier``)
        serve the data: it makes the policy accesses (reported back here for the per-phase counts) and ends the
        rounds; :meth:`hook` then only counts nothing twice."""
        self.device = device_tier
        self.store.clear()
        device_tier.on_access = self._count

    def _count(self, layer: int, hit: np.ndarray) -> None:
        c = self.counts[self.phase]
        c.entries[layer] += hit.size
        c.hits[layer] += int(hit.sum())

    def _sync(self) -> None:
        """Make the store hold exactly the resident experts (new ones copied in, evicted ones dropped)."""
        if not self.keep_store or self.device is not None:
            return
        mask = self.tier.resident_mask()
        upper = getattr(self.tier, "upper_mask", lambda: None)()
        if upper is not None:  # an upper tier (a second GPU, Strata 0.2.x) serves its experts from VRAM too
            mask = mask | upper
        want = set(zip(*[a.tolist() for a in np.nonzero(mask)]))
        for key in list(self.store):
            if key not in want:
                del self.store[key]
        for key in sorted(want - set(self.store)):
            self.store[key] = self.weights.experts.matrices(*key)
            self.copies += 1

    def hook(self, layer: int, positions: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> None:
        """Route hook: account one layer's records of a forward call (one record per token)."""
        if self.device is not None:  # the device tier accesses the policy itself (counted through _count)
            return
        c = self.counts[self.phase]
        for t in range(ids.shape[0]):
            hit = self.tier.access(layer, ids[t])
            c.entries[layer] += hit.size
            c.hits[layer] += int(hit.sum())

    def end_round(self) -> None:
        """Close a round (the prefill batch, or one decode position) and apply the tier's moves."""
        self.rounds += 1
        if self.device is not None:
            self.device.end_round()  # the policy's end_round, then VRAM follows
            return
        self.tier.end_round()
        self._sync()

    def matrices(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        """The expert's matrices: from the tier's store when resident, else from host memory."""
        got = self.store.get((layer, expert))
        if got is not None:
            return got
        return self.weights.experts.matrices(layer, expert)

    def stats(self) -> dict[str, Any]:
        """Per-phase hit counts, the simulator tier's own stats, slots, budget, rounds and copies made during the
        run (``moved_bytes``: the simulator tier's host->tier bytes over the whole run, warm-up included)."""
        total = TierCounts(self.counts["prefill"].entries + self.counts["decode"].entries,
                           self.counts["prefill"].hits + self.counts["decode"].hits)
        st = self.tier.stats()
        upper = getattr(self.tier, "upper_mask", lambda: None)()
        if self.device is not None:
            self.copies = int(self.device.counters.admit_copies)
        return {"policy": self.policy, "slots": self.slots, "budget_bytes": self.budget_bytes,
                "resident": int(self.tier.resident_mask().sum()), "copies_during_run": self.copies,
                "upper_resident": None if upper is None else int(upper.sum()), "swaps": st.get("swaps"),
                "rounds": self.rounds,
                "blob_bytes": self.blob_bytes.tolist(), "prefill": self.counts["prefill"].to_dict(),
                "decode": self.counts["decode"].to_dict(), "all": total.to_dict(),
                "h_layer": st.get("h_layer"), "moved_bytes": st.get("moved_bytes")}
