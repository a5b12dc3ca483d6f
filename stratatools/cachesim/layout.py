"""Slot layout of Strata's VRAM expert tier: how many slots, which layer owns them, what the start-up fill holds.

Facts (cache-policy.md "The tier"; Strata expert_cache.cpp): start-up fill walks the profile's ranked
pairs in order and admits each, so slot i holds rank i; nothing is evicted at admission. Global admission
(the engine's default) uses one counter over all slots; per-layer admission gives layer l the slots
``[l*q, (l+1)*q)`` with ``q = slots // n_layers`` and the last layer also takes the remainder. Native packs
give each slot its own layer's blob size rounded up to 256 bytes and stop when the byte budget is spent.

Decisions where the doc is silent (tested in tests/test_cachesim_tiers.py and tests/test_cachesim_review.py):

* **Byte budget, global admission**: the fill walks the ranking and stops at the *first* pair whose
  rounded blob no longer fits (slot i holds rank i, so the resident set is always a prefix of the
  ranking; a later, smaller blob is not squeezed in). The same rule applies to arrival admission.
* **Byte budget, per-layer admission**: the slot count N is the largest ``q*L + r`` (``r < L``, the
  remainder going to the last layer) whose layout fits: ``q = budget // sum(rounded blobs)``, then
  ``r = min(L-1, leftover // rounded blob of the last layer)``, at most ``L*E`` (the engine's ``auto`` count is
  capped at the profile length). With ``slots`` also given, N is the smaller.
* **Profile shorter than the slots**: in global mode the unused slots form a free pool; in per-layer mode
  a layer's unfilled slots stay free for that layer. Free slots are filled on a miss ("arrival-order
  admission", what the engine does without a profile) unless ``admit_on_miss=False``.
* **Same budget for per-layer baselines** (LRU, LFU, LFRU, Belady): they need a per-layer split. The
  default split is the per-layer admission layout of the same slot count / byte budget
  (:func:`per_layer_split`). To bound a global-admission tier, Belady is run under *that tier's* split
  (``TierPlan.cap``), since the static and adaptive tiers never move a slot to another layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile

ALIGN = 256
ADMISSIONS = ("global", "per-layer")


def rounded_blob_bytes(blob_bytes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Per-layer slot bytes: blob bytes rounded up to a multiple of 256 (cache-policy.md). int64 [L]."""
    b = np.asarray(blob_bytes, dtype=np.int64)
    return (b + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class TierPlan:
    """The layout of the tier at start-up.

    Attributes:
        n_layers, n_expert: L, E.
        admission: ``"global"`` or ``"per-layer"``.
        resident: bool [L, E], the start-up fill.
        cap: int64 [L], slots owned by each layer (per-layer mode: q or q + remainder; global mode: what the
            fill put there, growing when free pool slots are taken by arrival admission).
        pool_slots: global mode: free slots left in the pool after the fill (-1 = limited by bytes only);
            per-layer mode: 0 (free slots are ``cap - resident.sum(1)``).
        pool_bytes: global mode with a byte budget: bytes left in the pool (-1 = no byte limit).
        n_slots: slots of the tier (filled + free; in global mode with a byte budget only, slots filled).
        slot_bytes: int64 [L] rounded blob bytes per layer (1 each when blob sizes are unknown).
        blob_bytes: int64 [L] actual blob bytes (1 each when unknown), used for byte-weighted rates.
        fill_bytes: bytes copied by the start-up fill (actual blob bytes).
    """

    n_layers: int
    n_expert: int
    admission: str
    resident: np.ndarray
    cap: np.ndarray
    pool_slots: int
    pool_bytes: int
    n_slots: int
    slot_bytes: np.ndarray
    blob_bytes: np.ndarray
    fill_bytes: int

    def to_dict(self) -> dict:
        return {"admission": self.admission, "n_slots": int(self.n_slots), "cap": self.cap.tolist(),
                "filled": int(self.resident.sum()), "pool_slots": int(self.pool_slots),
                "pool_bytes": int(self.pool_bytes), "fill_bytes": int(self.fill_bytes),
                "budget_bytes_used": int((self.resident.sum(1) * self.slot_bytes).sum())}


def _blob_arrays(n_layers: int, blob_bytes) -> tuple[np.ndarray, np.ndarray]:
    if blob_bytes is None:
        one = np.ones(n_layers, dtype=np.int64)
        return one, one.copy()
    b = np.asarray(blob_bytes, dtype=np.int64).ravel()
    if b.shape != (n_layers,):
        raise StrataError(f"blob sizes are given for {len(b)} layers, the profile has {n_layers}; "
                          f"use the pack or model the profile was made for")
    if (b <= 0).any():
        raise StrataError(f"layer {int(np.argmax(b <= 0))}: blob size {int(b[b <= 0][0])} bytes is not positive")
    return b, rounded_blob_bytes(b)


def require_budget_slot(budget_bytes: int, blob_bytes, option: str, needs: str,
                        fix: str = "--budget-gib {gib} or more, or --slots N") -> None:
    """Refuse a byte budget that holds no slot: one smaller than the smallest rounded blob (256-byte aligned,
    cache-policy.md "The tier") of any layer, so every layout of it has 0 slots (the all-miss tier, what
    ``--slots 0`` is). For searches and gates that a 0-slot tier makes meaningless (``tune``, the hit-rate gate
    of ``validate-release``); ``simulate``/``run`` accept it as a measurement.

    Args:
        budget_bytes: the byte budget; blob_bytes: per-layer blob bytes [L] (pack or model).
        option: the option as the user gave it, e.g. ``"--budget-gib 1e-06"``; needs: who needs a slot and why,
            e.g. ``"tune needs at least 1 slot"``; fix: what to give instead, ``{gib}`` standing for the GiB of one
            slot.
    Raises:
        StrataError: one line naming the option, the bytes one slot needs and the smallest budget that holds one.
    """
    import math

    _, rb = _blob_arrays(len(np.asarray(blob_bytes).ravel()), blob_bytes)
    one = int(rb.min())
    if int(budget_bytes) < one:
        gib = one / 2**30
        k = 2 - math.floor(math.log10(gib))  # 3 significant digits, rounded up (the value given must hold a slot)
        raise StrataError(f"{option}: {int(budget_bytes):,} bytes hold no expert slot (one slot needs {one:,} bytes "
                          f"= {one / 2**20:.3g} MiB, this model's smallest expert rounded up to {ALIGN} bytes), "
                          f"the same as --slots 0; {needs}: give " + fix.format(gib=f"{math.ceil(gib * 10**k) / 10**k:.3g}"))


def per_layer_split(n_layers: int, *, slots: int | None = None, budget_bytes: int | None = None,
                    blob_bytes=None, n_expert: int | None = None) -> np.ndarray:
    """Slots per layer under per-layer admission: ``q = N // L`` each, the last layer + ``N % L``. int64 [L].

    N is ``slots``, or the largest layout that fits ``budget_bytes`` (module docstring), or the smaller of both.
    A byte-budget N is capped at ``n_layers * n_expert`` when ``n_expert`` is given (the engine's ``auto`` slot
    count is capped at the profile length, cache-policy.md "The tier"); an explicit ``slots`` is kept as given.
    Raises StrataError when neither limit is given or a byte budget comes without blob sizes.
    """
    L = n_layers
    _, rb = _blob_arrays(L, blob_bytes)
    n = None if slots is None else int(slots)
    if budget_bytes is not None:
        if blob_bytes is None:
            raise StrataError("a byte budget needs per-layer blob sizes: pass --pack or --model (or use --slots)")
        total = int(rb.sum())
        q = int(budget_bytes) // total
        r = min(L - 1, (int(budget_bytes) - q * total) // int(rb[-1]))
        nb = q * L + r
        if n_expert is not None:
            nb = min(nb, L * int(n_expert))
        n = nb if n is None else min(n, nb)
    if n is None:
        raise StrataError("no budget: give a slot count (--slots) or a byte budget (--budget-gib)")
    if n < 0:
        raise StrataError(f"slot count {n} is negative")
    cap = np.full(L, n // L, dtype=np.int64)
    cap[-1] += n % L
    return cap


def plan_tier(n_layers: int, n_expert: int, profile: Profile | None, *, slots: int | None = None,
              budget_bytes: int | None = None, blob_bytes=None, admission: str = "global") -> TierPlan:
    """Lay out the tier and do the start-up fill.

    Args:
        profile: the ranking (None = no profile: every slot starts free, arrival-order admission).
        slots: slot count limit (None = no count limit; at least one of ``slots``/``budget_bytes``).
        budget_bytes: byte budget (needs ``blob_bytes``).
        blob_bytes: per-layer blob bytes [L] from the pack or the model (geometry ``blob_bytes``).
        admission: ``"global"`` or ``"per-layer"``.
    Raises:
        StrataError: unknown admission, no budget, a profile of another geometry.
    """
    L, E = n_layers, n_expert
    if admission not in ADMISSIONS:
        raise StrataError(f"unknown admission {admission!r} (use global or per-layer)")
    if profile is not None and (profile.n_layers, profile.n_expert) != (L, E):
        raise StrataError(f"profile is for {profile.n_layers} layers x {profile.n_expert} experts, "
                          f"the traces/model have {L} x {E}")
    if slots is None and budget_bytes is None:
        raise StrataError("no budget: give a slot count (--slots) or a byte budget (--budget-gib)")
    if budget_bytes is not None and blob_bytes is None:
        raise StrataError("a byte budget needs per-layer blob sizes: pass --pack or --model (or use --slots)")
    bb, rb = _blob_arrays(L, blob_bytes)
    resident = np.zeros((L, E), dtype=bool)
    pairs = profile.pairs if profile is not None else np.zeros((0, 2), dtype=np.int64)
    if admission == "per-layer":
        cap = per_layer_split(L, slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes, n_expert=E)
        if len(pairs):
            lay = pairs[:, 0]
            # k-th occurrence of each layer in rank order is admitted while k < cap[layer]
            order = np.argsort(lay, kind="stable")
            first = np.searchsorted(lay[order], np.arange(L))
            occ = np.empty(len(lay), dtype=np.int64)
            occ[order] = np.arange(len(lay)) - first[lay[order]]
            keep = occ < cap[lay]
            resident[pairs[keep, 0], pairs[keep, 1]] = True
        n_slots = int(cap.sum())
        pool_slots, pool_bytes = 0, -1
    else:
        n = len(pairs) if slots is None else min(int(slots), len(pairs))
        budget_stopped = False
        if budget_bytes is not None and n:
            cum = np.cumsum(rb[pairs[:n, 0]])
            nb = int(np.searchsorted(cum, int(budget_bytes), side="right"))
            budget_stopped = nb < n
            n = nb
        take = pairs[:n]
        resident[take[:, 0], take[:, 1]] = True
        cap = resident.sum(1).astype(np.int64)
        used_bytes = int((cap * rb).sum())
        # the fill stopping on the budget closes the pool (the first pair that did not fit ends admission)
        pool_slots = 0 if budget_stopped else (-1 if slots is None else int(slots) - n)
        pool_bytes = -1 if budget_bytes is None else int(budget_bytes) - used_bytes
        n_slots = n if slots is None else int(slots)
    fill = int((resident.sum(1) * bb).sum())
    return TierPlan(L, E, admission, resident, cap, pool_slots, pool_bytes, n_slots, rb, bb, fill)


def plan_upper(plan: TierPlan, profile: Profile | None, upper_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Start-up fill of the upper tier (Strata 0.2.x: a second GPU's tier above the first; cache-policy.md).

    Decision (the doc is silent on the upper tier's fill): the upper tier takes the ranked pairs the first tier
    did not take, in rank order. With global admission it holds the next ``upper_slots`` of them (slot count
    only; slots a short profile leaves unfilled form the upper tier's free pool, which its adaptive moves take
    first); with per-layer admission its
    slots are split like the first tier's (:func:`per_layer_split` of ``upper_slots``) and each layer takes its
    own next ranked pairs, its unfilled slots staying free for that layer (taken by adaptive moves first).

    Returns (resident bool [L, E], cap int64 [L]). Raises StrataError for a negative slot count.
    """
    L, E = plan.n_layers, plan.n_expert
    u = int(upper_slots)
    if u < 0:
        raise StrataError(f"upper tier slot count {u} is negative")
    res = np.zeros((L, E), dtype=bool)
    pairs = profile.pairs if profile is not None else np.zeros((0, 2), dtype=np.int64)
    if len(pairs):
        pairs = pairs[~plan.resident[pairs[:, 0], pairs[:, 1]]]
    if plan.admission == "per-layer":
        cap = per_layer_split(L, slots=u)
        if len(pairs):
            lay = pairs[:, 0]
            order = np.argsort(lay, kind="stable")
            first = np.searchsorted(lay[order], np.arange(L))
            occ = np.empty(len(lay), dtype=np.int64)
            occ[order] = np.arange(len(lay)) - first[lay[order]]
            keep = occ < cap[lay]
            res[pairs[keep, 0], pairs[keep, 1]] = True
        return res, cap
    take = pairs[:u]
    res[take[:, 0], take[:, 1]] = True
    return res, res.sum(1).astype(np.int64)
