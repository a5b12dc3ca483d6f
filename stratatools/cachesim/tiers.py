"""Online tier objects: one routed record at a time, the policy code the runtime uses.

Each tier answers ``access(layer, experts) -> bool[k]`` (resident at the time of use, entry by entry, in
the order given), ``end_round()`` after every round (one decode position, or one verify window), and
``stats()``. These classes are the reference semantics of every policy; the batch replay
(:mod:`stratatools.cachesim.kernels`) runs the same rules compiled and is tested equal to them on random
traces (tests/test_cachesim_equiv.py).

Policies (``make_tier(policy, ...)``):

* ``static``: Strata's static tier: start-up fill from the profile (slot i holds rank i, global or
  per-layer admission, see :mod:`.layout`); free slots (a profile shorter than the tier, or no profile) are
  filled on a miss in arrival order; nothing is ever evicted.
* ``adaptive``: ``static`` plus Strata's adaptive swaps (cache-policy.md "The adaptive tier").
  Decisions: usage is counted after the entry's hit is decided; a step that is skipped because copies are
  still in flight also skips the decay; ties sort candidates by (usage desc, expert asc), victims by
  (usage asc, expert asc), moves by gain desc then (layer, move order); free slots (per-layer mode only:
  the layer's unfilled slots) are offered before swaps; a copy issued at the end of round r lands at the
  end of round ``r + copy_delay_rounds`` (default 1: not resident during the next round, resident from
  the one after; 0 = at once). An evicted expert is non-resident at once.
  Strata 0.2.x knobs (off by default, so the 0.1.4x results are unchanged; cache-policy.md "Strata 0.2.x"):
  ``lag`` (STRATA_ADAPT_LAG): a round's routing is added to the usage ``lag - 1`` rounds late (not decayed
  meanwhile), so a move is decided from windows at least ``lag`` old. ``pace_bytes`` (paced mode): the step runs
  every ``adapt_every`` rounds whatever is in flight, and queues its moves (best first); at the end of every round
  the queue is pumped while the copies' rounded bytes fit the budget (the first that does not fit stops the round;
  a move no longer valid, e.g. its candidate admitted on a miss meanwhile, is dropped); the next step drops what
  is still queued. A victim leaves when its copy is submitted; a copy lands ``copy_delay_rounds`` after its
  submission; experts in flight are neither candidates nor victims. ``upper_slots``: a second GPU's tier (fill
  :func:`.layout.plan_upper`); a hit in either tier is a hit; experts it holds or loads are not candidates for
  the first tier, and the first tier's copies of experts it holds count as usage 0 as victims (evicted first);
  each tier has its own ``max_moves`` and pace budget, the first tier's moves are made first; ``disjoint``
  (STRATA_DISJOINT_ADAPT=1) also keeps the first tier's experts (held, loading or queued) out of the upper
  tier's candidates. Arrival admission fills the first tier only; the upper tier's free slots (per-layer: a
  layer's own; global admission: the pool a short profile left) are offered to its top candidates first.
* ``lru``: per-layer least-recently-used at entry granularity; starts empty; a miss always loads.
* ``lfu``: per-layer least-frequently-used; counts of every access decay by ``decay`` (0.7) every
  ``decay_every`` (4) rounds; a miss loads and evicts the resident with the smallest count (ties: the
  smallest expert index); starts empty. (The victim comes from a lazy heap per layer, O(log cap) per eviction;
  :mod:`._tiers_reference` is the plain scan it is tested equal to.)
* ``lfru``: two partitions per layer: privileged (LRU, ``ceil(cap * privileged_frac)`` slots,
  ``privileged_frac`` 0.5) and unprivileged (LFU with the same decayed counts). A miss enters the
  privileged partition; the privileged LRU expert is demoted to the unprivileged one, whose smallest-count
  expert is evicted when it overflows; a hit in the unprivileged partition promotes the expert.
* ``belady``: offline optimum per layer: an optimal free start-up fill (the ``cap`` experts used first),
  then on a miss load into a free slot, else evict the resident expert whose next use is farthest away,
  or bypass when the missed expert's own next use is no nearer (ties bypass). Needs the whole entry
  sequence up front (:class:`BeladyTier`).

Per-layer baselines (lru, lfu, lfru, belady) take ``cap`` (slots per layer) from
:func:`.layout.per_layer_split` unless ``cap=`` is given (e.g. the split of a global-admission tier).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from heapq import heapify, heappop, heappush, heappushpop, heapreplace
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile
from stratatools.cachesim.layout import TierPlan, per_layer_split, plan_tier, plan_upper, _blob_arrays

POLICIES = ("static", "adaptive", "lru", "lfu", "lfru", "belady")
ADAPTIVE_DEFAULTS = {"usage_floor": 2.0, "margin": 1.5, "adapt_every": 4, "max_moves": 96, "decay": 0.7,
                     "copy_delay_rounds": 1, "lag": 1, "pace_bytes": 0, "upper_slots": 0, "disjoint": 0}
# Strata 0.2.x knobs (cache-policy.md "Strata 0.2.x"); their defaults leave the 0.1.4x behaviour unchanged
V02_PARAMS = ("lag", "pace_bytes", "upper_slots", "disjoint")
STRATA_VERSIONS = ("0.1", "0.2")
LFU_DEFAULTS = {"decay": 0.7, "decay_every": 4}
LFRU_DEFAULTS = {"decay": 0.7, "decay_every": 4, "privileged_frac": 0.5}
NEVER = np.iinfo(np.int64).max
MAX_COUNT = 2**31 - 1  # largest count/round parameter (adapt_every, max_moves, lag, ...)


def check_adaptive_params(p: dict) -> None:
    """Range checks of a full adaptive parameter dict; StrataError naming the parameter and the fix."""
    # each range names the option that sets it (run / simulate), its value and the engine default
    # (the upper bounds keep every value inside the int64 arrays and numba kernels the tiers run on; the CLI options
    # have the same ones, stratatools.cli.common)
    for key, opt, lo, hi, what in (("adapt_every", "--adapt-every", 1, MAX_COUNT, "rounds between adaptations; engine "
                                    "default 4"),
                                   ("max_moves", "--adapt-swaps", 0, MAX_COUNT, "moves per adaptation; engine default 96"),
                                   ("copy_delay_rounds", None, 0, MAX_COUNT, "engine default 1"),
                                   ("pace_bytes", "--adapt-pace-bytes", 0, 2**50, "0 = off"),
                                   ("upper_slots", "--upper-slots", 0, 2**40, "0 = off")):
        if int(p[key]) < lo:
            via = f"{opt} or --set adaptive.{key}=N" if opt else f"--set adaptive.{key}=N"
            raise StrataError(f"adaptive tier: {opt or key} {p[key]} must be at least {lo} ({what}; {via})")
        if int(p[key]) > hi:
            via = f"{opt} or --set adaptive.{key}=N" if opt else f"--set adaptive.{key}=N"
            raise StrataError(f"adaptive tier: {opt or key} {p[key]} must be at most {hi} ({what}; {via})")
    if not 1 <= int(p["lag"]) <= MAX_COUNT:
        raise StrataError(f"adaptive tier: --adapt-lag {p['lag']} must be from 1 to {MAX_COUNT} (STRATA_ADAPT_LAG: "
                          f"1 = the engine default; --adapt-lag or --set adaptive.lag=N)")
    if int(p["disjoint"]) not in (0, 1):
        raise StrataError(f"adaptive tier: disjoint {p['disjoint']} must be 0 or 1 (STRATA_DISJOINT_ADAPT)")
    if not 0.0 <= float(p["decay"]) <= 1.0:
        raise StrataError(f"adaptive tier: decay {p['decay']} must be in [0, 1] (--adapt-decay)")


def _with_defaults(name: str, params: dict, defaults: dict) -> dict:
    """``defaults`` updated by ``params``; StrataError "unknown <name> parameter(s): ..." for keys not in it."""
    unknown = set(params) - set(defaults)
    if unknown:
        raise StrataError(f"unknown {name} parameter(s): {', '.join(sorted(unknown))}")
    return {**defaults, **params}


class Tier:
    """Base class: hit accounting shared by every policy.

    Attributes:
        n_layers, n_expert: L, E.
        cap: int64 [L] slots per layer.
        blob_bytes: int64 [L] actual blob bytes per layer (1 each when unknown).
    """

    policy = "base"

    def __init__(self, n_layers: int, n_expert: int, cap: np.ndarray, blob_bytes: np.ndarray):
        self.n_layers, self.n_expert = int(n_layers), int(n_expert)
        self.cap = np.asarray(cap, dtype=np.int64).copy()
        self.blob_bytes = np.asarray(blob_bytes, dtype=np.int64)
        self.rounds = 0
        self.records = 0
        self.all_hit_records = 0
        self.layer_entries = np.zeros(self.n_layers, dtype=np.int64)
        self.layer_hits = np.zeros(self.n_layers, dtype=np.int64)
        self.layer_loads = np.zeros(self.n_layers, dtype=np.int64)  # host->VRAM copies during the replay

    # subclasses implement _access(layer, experts) -> list[bool]
    def access(self, layer: int, experts) -> np.ndarray:
        """Route one record: ``experts`` (int array [k], distinct) of ``layer``; returns bool [k] resident at use.

        Raises StrataError for a layer or expert out of range.
        """
        layer = int(layer)
        ex = [int(e) for e in np.asarray(experts).ravel()]
        if not 0 <= layer < self.n_layers:
            raise StrataError(f"layer {layer} is out of range for a tier of {self.n_layers} layers")
        for e in ex:
            if not 0 <= e < self.n_expert:
                raise StrataError(f"layer {layer}: expert {e} is out of range for {self.n_expert} experts")
        hits = self._access(layer, ex)
        h = np.asarray(hits, dtype=bool)
        nh = int(h.sum())
        self.layer_entries[layer] += len(ex)
        self.layer_hits[layer] += nh
        self.records += 1
        self.all_hit_records += int(nh == len(ex))
        return h

    def access_rows(self, layer: int, rows) -> np.ndarray:
        """T records of one layer in order (``rows``: int [T, k], each row distinct experts): the same ``_access``
        calls in the same order and the same counters as T :meth:`access` calls, with the range checks done once
        for all rows (the runtime feeds a prompt's positions this way). Returns bool [T, k].

        Raises StrataError for a layer or expert out of range (before any of the rows is counted).
        """
        layer = int(layer)
        r = np.asarray(rows, dtype=np.int64)
        r = r.reshape(r.shape[0] if r.ndim else 1, -1)
        if not 0 <= layer < self.n_layers:
            raise StrataError(f"layer {layer} is out of range for a tier of {self.n_layers} layers")
        bad = (r < 0) | (r >= self.n_expert)
        if bad.any():
            raise StrataError(f"layer {layer}: expert {int(r[bad][0])} is out of range for {self.n_expert} experts")
        out = self._access_block(layer, r)
        nh = out.sum(axis=1)
        self.layer_entries[layer] += int(r.size)
        self.layer_hits[layer] += int(nh.sum())
        self.records += int(r.shape[0])
        self.all_hit_records += int((nh == r.shape[1]).sum())
        return out

    def _access_block(self, layer: int, r: np.ndarray) -> np.ndarray:
        """:meth:`_access` of the checked rows ``r`` int64 [T, k] in order: hit bool [T, k] (a policy whose state
        does not change in some case overrides it with one gather)."""
        out = np.empty(r.shape, dtype=bool)
        for t, ex in enumerate(r.tolist()):
            out[t] = self._access(layer, ex)
        return out

    def end_round(self) -> None:
        """Close a round (one decode position or verify window)."""
        self.rounds += 1

    def resident_mask(self) -> np.ndarray:
        """bool [L, E]: experts resident now (copies in flight excluded)."""
        raise NotImplementedError

    def resident_row(self, layer: int) -> np.ndarray:
        """bool [E]: ``resident_mask()[layer]`` without building the other layers' rows (the runtime's tier
        asks after every access)."""
        res = getattr(self, "res", None)
        if res is not None:
            return res[layer].copy()
        return self.resident_mask()[layer]

    def stats(self) -> dict[str, Any]:
        """Counters so far: entries, hits, h_expert, records, h_layer, hit/entry bytes, loads, moved_bytes,
        per-layer entries/hits/loads (lists of L ints)."""
        ent = int(self.layer_entries.sum())
        hits = int(self.layer_hits.sum())
        eb = int((self.layer_entries * self.blob_bytes).sum())
        hb = int((self.layer_hits * self.blob_bytes).sum())
        return {"policy": self.policy, "rounds": self.rounds, "entries": ent, "hits": hits,
                "h_expert": hits / ent if ent else float("nan"), "records": self.records,
                "all_hit_records": self.all_hit_records,
                "h_layer": self.all_hit_records / self.records if self.records else float("nan"),
                "entry_bytes": eb, "hit_bytes": hb, "h_bytes": hb / eb if eb else float("nan"),
                "loads": int(self.layer_loads.sum()),
                "moved_bytes": int((self.layer_loads * self.blob_bytes).sum()),
                "layer_entries": self.layer_entries.tolist(), "layer_hits": self.layer_hits.tolist(),
                "layer_loads": self.layer_loads.tolist()}


class StaticTier(Tier):
    """Strata's static tier (see the module docstring). Built from a :class:`TierPlan`."""

    policy = "static"

    def __init__(self, plan: TierPlan, admit_on_miss: bool = True):
        super().__init__(plan.n_layers, plan.n_expert, plan.cap, plan.blob_bytes)
        self.plan = plan
        self.res = plan.resident.copy()
        self.occupied = self.res.sum(1).astype(np.int64)  # resident + copies in flight, per layer
        self.pool_slots = int(plan.pool_slots)
        self.pool_bytes = int(plan.pool_bytes)
        self.slot_bytes = plan.slot_bytes
        self.admit_on_miss = bool(admit_on_miss)
        self.per_layer = plan.admission == "per-layer"

    def _admit(self, layer: int, e: int) -> None:
        """Arrival-order admission of a missed expert into a free slot, if there is one."""
        if self.per_layer:
            if self.occupied[layer] >= self.cap[layer]:
                return
        else:
            if self.pool_slots == 0:
                return
            if self.pool_bytes >= 0:
                if self.pool_bytes < self.slot_bytes[layer]:
                    self.pool_slots = 0  # the first blob that does not fit closes the pool
                    return
                self.pool_bytes -= int(self.slot_bytes[layer])
            if self.pool_slots > 0:
                self.pool_slots -= 1
            self.cap[layer] += 1
        self.res[layer, e] = True
        self.occupied[layer] += 1
        self.layer_loads[layer] += 1

    def _access(self, layer: int, experts: list[int]) -> list[bool]:
        row = self.res[layer]
        out = [bool(row[e]) for e in experts]
        if self.admit_on_miss:
            for e, h in zip(experts, out):
                if not h:
                    self._admit(layer, e)
        return out

    def _admits_none(self, layer: int) -> bool:
        """True when no miss of ``layer`` can be admitted now (no admission, a full layer, a closed pool): its
        accesses then change nothing."""
        if not self.admit_on_miss:
            return True
        if self.per_layer:
            return bool(self.occupied[layer] >= self.cap[layer])
        return self.pool_slots == 0

    def _access_block(self, layer: int, r: np.ndarray) -> np.ndarray:
        # a full static tier (the runtime's usual case: the profile fills every slot) only looks up: one gather
        # instead of a Python loop over the prompt's rows (same hits, no state to change)
        if type(self)._access is StaticTier._access and self._admits_none(layer):
            return self.res[layer][r]
        return super()._access_block(layer, r)

    def resident_mask(self) -> np.ndarray:
        return self.res.copy()


class AdaptiveTier(StaticTier):
    """Strata's static tier plus its adaptive swaps (cache-policy.md; decisions in the module docstring).

    Params (engine option in brackets; defaults as in the engine):
        usage_floor 2.0, margin 1.5, copy_delay_rounds 1;
        adapt_every 4 [``--adapt-every``], max_moves 96 [``--adapt-swaps``], decay 0.7 [``--adapt-decay``];
        lag 1 [``STRATA_ADAPT_LAG``, 0.2.x]: the routing of a round is counted ``lag - 1`` rounds late, so a swap
            is decided only from windows at least ``lag`` old;
        pace_bytes 0 [paced mode, 0.2.x; 0 = off]: per-round byte budget of submitted copies (rounded blob
            bytes; slots when blob sizes are unknown); moves not submitted by the next adapt are dropped;
        upper_slots 0 [upper tier, 0.2.x]: slots of a second GPU's tier (fill: :func:`.layout.plan_upper`);
        disjoint 0 [``STRATA_DISJOINT_ADAPT``, 0.2.x]: 1 keeps the two tiers' sets disjoint.
    ``upper``: (resident bool [L, E], cap int [L]) of the upper tier (default: empty, when ``upper_slots`` > 0).
    """

    policy = "adaptive"

    def __init__(self, plan: TierPlan, admit_on_miss: bool = True, upper: tuple | None = None, **params: Any):
        super().__init__(plan, admit_on_miss)
        p = _with_defaults("adaptive-tier", params, ADAPTIVE_DEFAULTS)
        self.usage_floor = float(p["usage_floor"])
        self.margin = float(p["margin"])
        self.adapt_every = int(p["adapt_every"])
        self.max_moves = int(p["max_moves"])
        self.decay = float(p["decay"])
        self.copy_delay = int(p["copy_delay_rounds"])
        self.lag = int(p["lag"])
        self.pace = int(p["pace_bytes"])
        self.upper_slots = int(p["upper_slots"])
        self.disjoint = bool(int(p["disjoint"]))
        check_adaptive_params(p)
        L, E = self.n_layers, self.n_expert
        self.R = [self.res]
        self.C = [self.cap]
        self.O = [self.occupied]
        if self.upper_slots > 0:
            if upper is None:
                upper = (np.zeros((L, E), dtype=bool), per_layer_split(L, slots=self.upper_slots)
                         if self.per_layer else np.zeros(L, dtype=np.int64))
            ures, ucap = upper
            self.R.append(np.asarray(ures, dtype=bool).copy())
            self.C.append(np.asarray(ucap, dtype=np.int64).copy())
            self.O.append(self.R[1].sum(1).astype(np.int64))
        self.T = len(self.R)
        # global admission: the upper tier's unfilled slots form a pool its moves take first (the first tier's
        # pool is taken by arrival admission); per-layer admission: each layer's own free slots
        self.upool = [0] + ([max(0, self.upper_slots - int(self.R[1].sum()))] if self.T > 1 else [])
        self.loading = [np.zeros((L, E), dtype=bool) for _ in range(self.T)]
        self.queue: list[list[tuple[int, int, int]]] = [[] for _ in range(self.T)]
        self.usage = np.zeros((L, E), dtype=np.float64)
        self.inflight: list[tuple[int, int, int, int]] = []  # (tier, layer, expert, round it lands)
        self.pending: deque[list[tuple[int, int]]] = deque()
        self.cur: list[tuple[int, int]] = []
        self.land_at = -1
        self.steps = 0
        self.swaps = 0
        self.dropped = 0
        self.upper_hits = 0

    def _access(self, layer: int, experts: list[int]) -> list[bool]:
        r0 = self.res[layer]
        r1 = self.R[1][layer] if self.T > 1 else None
        out = []
        for e in experts:
            if r0[e]:
                out.append(True)
            elif r1 is not None and r1[e]:
                out.append(True)
                self.upper_hits += 1
            else:
                out.append(False)
        if self.admit_on_miss:
            for e, h in zip(experts, out):
                if not h:
                    self._admit(layer, e)
        if self.lag > 1:
            self.cur.extend((layer, e) for e in experts)
        else:
            for e in experts:
                self.usage[layer, e] += 1.0
        return out

    def _moves(self, t: int, excl: np.ndarray, prefer: np.ndarray | None) -> list[tuple[int, int, int]]:
        """Moves of tier ``t``, best first, at most ``max_moves``: (layer, new expert, victim or -1 = free slot).

        ``excl`` [L, E]: experts that are not candidates; ``prefer`` [L, E] or None: victims worth nothing here
        (held by the upper tier: evicted first, their usage counted as 0)."""
        moves: list[tuple[float, int, int, int, int]] = []
        res, cap, occ = self.R[t], self.C[t], self.O[t]
        for l in range(self.n_layers):
            u = self.usage[l]
            row = res[l]
            cand = [e for e in range(self.n_expert) if not row[e] and not excl[l, e] and u[e] >= self.usage_floor]
            if not cand:
                continue
            cand.sort(key=lambda e: (-u[e], e))
            pv = prefer[l] if prefer is not None else np.zeros(self.n_expert, dtype=bool)
            ue = np.where(pv, 0.0, u)
            vict = sorted((e for e in range(self.n_expert) if row[e]), key=lambda e: (ue[e], not pv[e], e))
            free = int(cap[l] - occ[l]) if self.per_layer else self.upool[t]
            order = 0
            nf = min(max(free, 0), len(cand))
            for i in range(nf):
                moves.append((float(u[cand[i]]), l, order, cand[i], -1))
                order += 1
            for j, c in enumerate(cand[nf:]):
                if j >= len(vict):
                    break
                v = vict[j]
                if not (u[c] > ue[v] + self.margin):
                    break
                moves.append((float(u[c] - ue[v]), l, order, c, v))
                order += 1
        moves.sort(key=lambda m: (-m[0], m[1], m[2]))
        return [(l, c, v) for _, l, _, c, v in moves[: self.max_moves]]

    def _valid(self, t: int, l: int, c: int, v: int) -> bool:
        if self.R[t][l, c] or self.loading[t][l, c]:
            return False
        if self.T > 1 and (t == 0 or self.disjoint):
            o = 1 - t
            if self.R[o][l, c] or self.loading[o][l, c]:
                return False
        if v >= 0:
            return bool(self.R[t][l, v])
        return bool(self.O[t][l] < self.C[t][l]) if self.per_layer else self.upool[t] > 0

    def _dispatch(self, t: int, l: int, c: int, v: int, land: int) -> None:
        if v >= 0:
            self.R[t][l, v] = False
            self.swaps += 1
        else:
            self.O[t][l] += 1
            if not self.per_layer:
                self.upool[t] -= 1
                self.C[t][l] += 1
        self.loading[t][l, c] = True
        self.inflight.append((t, l, c, land))
        self.layer_loads[l] += 1

    def _land(self, r: int) -> None:
        keep = []
        for (t, l, e, land) in self.inflight:
            if land <= r:
                self.R[t][l, e] = True
                self.loading[t][l, e] = False
            else:
                keep.append((t, l, e, land))
        self.inflight = keep

    def _pump(self, r: int, budget: int) -> None:
        """Submit queued copies, best first, while their rounded bytes fit ``budget`` (< 0: no limit); a move
        that is no longer valid is dropped without using the budget; the first that does not fit stops."""
        for t in range(self.T):
            q = self.queue[t]
            sent = 0
            while q:
                l, c, v = q[0]
                sb = int(self.slot_bytes[l])
                if budget >= 0 and sent + sb > budget:
                    break
                q.pop(0)
                if not self._valid(t, l, c, v):
                    self.dropped += 1
                    continue
                sent += sb
                self._dispatch(t, l, c, v, r + self.copy_delay)

    def _adapt(self, r: int, budget: int) -> None:
        for t in range(self.T):
            self.dropped += len(self.queue[t])
            self.queue[t] = []
        for t in range(self.T):
            excl = self.loading[t].copy()
            prefer = None
            if self.T > 1 and t == 0:
                excl |= self.R[1] | self.loading[1]
                prefer = self.R[1]
            elif t == 1 and self.disjoint:
                excl |= self.R[0] | self.loading[0]
                for (l, c, _) in self.queue[0]:
                    excl[l, c] = True
            self.queue[t] = self._moves(t, excl, prefer)
            if budget < 0:  # unpaced: every move is submitted at once
                self._pump(r, -1)
        self.usage *= self.decay
        self.steps += 1

    def end_round(self) -> None:
        Tier.end_round(self)
        r = self.rounds
        if self.lag > 1:
            self.pending.append(self.cur)
            self.cur = []
            while len(self.pending) > self.lag - 1:
                for (l, e) in self.pending.popleft():
                    self.usage[l, e] += 1.0
        if self.pace <= 0:
            if r % self.adapt_every == 0 and not self.inflight:
                self._adapt(r, -1)
                self.land_at = r + self.copy_delay
            if self.inflight and r >= self.land_at:
                self._land(r)
            return
        if r % self.adapt_every == 0:
            self._adapt(r, self.pace)
        self._pump(r, self.pace)
        self._land(r)

    def resident_mask(self) -> np.ndarray:
        """bool [L, E]: resident in the first tier (the upper tier's set: :meth:`upper_mask`)."""
        return self.res.copy()

    def upper_mask(self) -> np.ndarray | None:
        """bool [L, E]: resident in the upper tier, or None without one."""
        return self.R[1].copy() if self.T > 1 else None

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s.update({"adapt_steps": self.steps, "swaps": self.swaps, "dropped_moves": self.dropped,
                  "upper_hits": self.upper_hits})
        return s


class LRUTier(Tier):
    """Per-layer LRU at entry granularity; starts empty; ``cap`` [L] slots per layer."""

    policy = "lru"

    def __init__(self, n_layers: int, n_expert: int, cap, blob_bytes):
        super().__init__(n_layers, n_expert, cap, blob_bytes)
        self.od: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(self.n_layers)]

    def _access(self, layer: int, experts: list[int]) -> list[bool]:
        od = self.od[layer]
        c = int(self.cap[layer])
        out = []
        for e in experts:
            if e in od:
                od.move_to_end(e)
                out.append(True)
                continue
            out.append(False)
            if c <= 0:
                continue
            if len(od) >= c:
                od.popitem(last=False)
            od[e] = None
            self.layer_loads[layer] += 1
        return out

    def resident_mask(self) -> np.ndarray:
        m = np.zeros((self.n_layers, self.n_expert), dtype=bool)
        for l, od in enumerate(self.od):
            m[l, list(od)] = True
        return m

    def resident_row(self, layer: int) -> np.ndarray:
        m = np.zeros(self.n_expert, dtype=bool)
        m[list(self.od[layer])] = True
        return m


def _lfu_victim(heap: list, cnt: memoryview, where: memoryview, tag: int) -> int:
    """Pop the member with the smallest (count, id) off a layer's lazy heap: the least frequently used, ties to the
    lowest expert id (the same choice as a scan of every member: ``_tiers_reference.reference_lfu_victim``).

    Members are the experts ``v`` with ``where[v] == tag``; ``cnt[v]`` their counts now. ``heap`` holds ``(count, id)``
    entries with every member represented by at least one entry whose count is at most its count now (counts only grow
    between two decays; a decay rebuilds the heap), and may hold entries of experts that left. Pops entries that are no
    longer members, re-files entries whose count has grown since, and stops at the first entry that is exact: it is
    the smallest key of all members. O(log n) amortised per eviction."""
    while True:
        c, v = heap[0]
        if where[v] == tag:
            cur = cnt[v]
            if cur == c:
                heappop(heap)
                return v
            heapreplace(heap, (cur, v))
        else:
            heappop(heap)


def check_decay(policy: str, decay: Any) -> None:
    """Refuse an LFU/LFRU ``decay`` that is NaN or infinite (it gave order-dependent victims). Raises StrataError."""
    if not math.isfinite(float(decay)):
        raise StrataError(f"{policy}: decay {decay} must be a finite number (0.7 is the default; "
                          f"--set {policy}.decay=X)")


class _DecayCounts:
    """Decayed access counts: :attr:`counts` float64 [L, E], decayed in place at the round end (one numpy multiply,
    as in the reference and the compiled kernels), read and incremented entry by entry through a memoryview per layer
    (a Python float each, without numpy's per-scalar cost; the same IEEE float64 operations). The residency array
    (``res`` bool or ``where`` int8 [L, E], ``_state``) is read and written the same way. The subclass keeps, per
    layer, a lazy heap of its LFU candidates (:func:`_lfu_victim`); a decay invalidates the heaps, and each layer's is
    rebuilt by ``_rebuild(layer)`` when the layer is next accessed."""

    _state = ""  # the name of the subclass's residency array
    _tag: Any = None  # its value for a member of the heap's partition

    def _init_counts(self, params: dict, defaults: dict) -> dict:
        p = _with_defaults(self.policy, params, defaults)
        self.decay = float(p["decay"])
        self.decay_every = int(p["decay_every"])
        if self.decay_every < 1:
            raise StrataError(f"{self.policy}: decay_every must be >= 1")
        check_decay(self.policy, p["decay"])
        self.counts = np.zeros((self.n_layers, self.n_expert), dtype=np.float64)
        self._epoch = 0  # decays so far (a decay of 1.0 changes nothing and is not counted)
        self._hep = [0] * self.n_layers  # the epoch each layer's heap was built in
        self._heap: list[list[tuple[float, int]]] = [[] for _ in range(self.n_layers)]
        return p

    def _views(self) -> None:
        st = getattr(self, self._state)
        self._cnt = [memoryview(self.counts[l]) for l in range(self.n_layers)]
        self._stv = [memoryview(st[l]) for l in range(self.n_layers)]

    def __getstate__(self) -> dict:  # memoryviews do not pickle: rebuilt over the unpickled arrays
        st = dict(self.__dict__)
        del st["_cnt"], st["_stv"]
        return st

    def __setstate__(self, st: dict) -> None:
        self.__dict__.update(st)
        self._views()

    def _decay_round(self) -> None:
        if self.rounds % self.decay_every == 0 and self.decay != 1.0:  # x * 1.0 == x: nothing to do
            self.counts *= self.decay
            self._epoch += 1

    def _rebuild(self, layer: int) -> None:
        """The layer's heap afresh: one exact entry per member (after a decay, or when stale entries pile up). The
        members are read off the heap itself (every member has an entry), not from a scan of the layer's E experts."""
        cnt, st, tag, h = self._cnt[layer], self._stv[layer], self._tag, self._heap[layer]
        h[:] = [(cnt[v], v) for v in {v for _, v in h if st[v] == tag}]
        heapify(h)
        self._hep[layer] = self._epoch


class LFUTier(_DecayCounts, Tier):
    """Per-layer LFU with decayed counts; starts empty. Residents in ``res`` bool [L, E] (and a count per layer), the
    victim from a lazy heap with one entry per resident (:func:`_lfu_victim`): O(log cap) per eviction instead of a
    scan of the layer's residents."""

    policy = "lfu"
    _state, _tag = "res", True

    def __init__(self, n_layers: int, n_expert: int, cap, blob_bytes, **params: Any):
        Tier.__init__(self, n_layers, n_expert, cap, blob_bytes)
        self._init_counts(params, LFU_DEFAULTS)
        self.res = np.zeros((self.n_layers, self.n_expert), dtype=bool)
        self._n = [0] * self.n_layers  # residents per layer
        self._capl = self.cap.tolist()  # slots per layer as ints
        self._views()

    def _access(self, layer: int, experts: list[int]) -> list[bool]:
        if self._hep[layer] != self._epoch:
            self._rebuild(layer)
        cnt, row, heap = self._cnt[layer], self._stv[layer], self._heap[layer]
        c = self._capl[layer]
        n = self._n[layer]
        out = []
        put = out.append
        loads = 0
        for e in experts:
            x = cnt[e] + 1.0
            cnt[e] = x
            if row[e]:
                put(True)
                continue
            put(False)
            if c <= 0:
                continue
            if n >= c:
                top = heap[0]
                v = top[1]
                if cnt[v] == top[0]:  # the heap's top is nearly always exact: evict it and file e in one step
                    heapreplace(heap, (x, e))
                else:
                    v = _lfu_victim(heap, cnt, row, True)
                    heappush(heap, (x, e))
                row[v] = False
            else:
                heappush(heap, (x, e))
                n += 1
            row[e] = True
            loads += 1
        self._n[layer] = n
        if loads:
            self.layer_loads[layer] += loads
        return out

    def end_round(self) -> None:
        super().end_round()
        self._decay_round()

    def resident_mask(self) -> np.ndarray:
        return self.res.copy()


class LFRUTier(_DecayCounts, Tier):
    """Per-layer LFRU: privileged LRU partition + unprivileged decayed-LFU partition; starts empty. ``where`` int8
    [L, E] says which partition holds each expert (0 none, 1 privileged, 2 unprivileged); the privileged ones in
    recency order in an OrderedDict per layer, the unprivileged victim from a lazy heap (:func:`_lfu_victim`). An
    unprivileged expert's count changes only by a decay (an access promotes it first), so each has an exact entry,
    pushed at its demotion or at the rebuild after a decay; entries of promoted experts are dropped lazily, and the
    heap is rebuilt when they outnumber the members."""

    policy = "lfru"
    _state, _tag = "where", 2

    def __init__(self, n_layers: int, n_expert: int, cap, blob_bytes, **params: Any):
        Tier.__init__(self, n_layers, n_expert, cap, blob_bytes)
        p = self._init_counts(params, LFRU_DEFAULTS)
        frac = float(p["privileged_frac"])
        if not 0.0 < frac <= 1.0:
            raise StrataError(f"lfru: privileged_frac {frac} must be in (0, 1]")
        self.pcap = np.array([math.ceil(int(c) * frac) for c in self.cap], dtype=np.int64)
        self.ucap = self.cap - self.pcap
        self.priv: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(self.n_layers)]
        self.where = np.zeros((self.n_layers, self.n_expert), dtype=np.int8)
        self._limits = list(zip(self.pcap.tolist(), self.ucap.tolist(), self.cap.tolist()))  # as ints, per layer
        self._nu = [0] * self.n_layers  # unprivileged residents per layer
        self._views()

    def _access(self, layer: int, experts: list[int]) -> list[bool]:
        if self._hep[layer] != self._epoch:
            self._rebuild(layer)
        pv, heap = self.priv[layer], self._heap[layer]
        cnt, wh = self._cnt[layer], self._stv[layer]
        pc, uc, c = self._limits[layer]
        nu = self._nu[layer]
        out = []
        put, recent, oldest = out.append, pv.move_to_end, pv.popitem
        loads = 0
        for e in experts:
            x = cnt[e] + 1.0
            cnt[e] = x
            w = wh[e]
            if w == 1:
                recent(e)
                put(True)
                continue
            if w == 2:  # promoted: its heap entry goes stale (dropped when popped, or at a rebuild)
                nu -= 1
                put(True)
                if len(heap) > 2 * nu + 16:
                    wh[e] = 0
                    self._nu[layer] = nu
                    self._rebuild(layer)
            else:
                put(False)
                if c <= 0:
                    continue
                loads += 1
            pv[e] = None
            wh[e] = 1
            if len(pv) > pc:  # demote the privileged LRU expert; evict the unprivileged LFU one on overflow
                d = oldest(False)[0]
                wh[d] = 2
                if nu >= uc:  # file d and take the smallest entry in one step; nearly always the exact victim
                    xv, v = heappushpop(heap, (cnt[d], d))
                    if wh[v] != 2 or cnt[v] != xv:  # an entry left by a promotion (every member has an exact one)
                        v = _lfu_victim(heap, cnt, wh, 2)
                    wh[v] = 0
                else:
                    heappush(heap, (cnt[d], d))
                    nu += 1
        self._nu[layer] = nu
        if loads:
            self.layer_loads[layer] += loads
        return out

    def end_round(self) -> None:
        super().end_round()
        self._decay_round()

    def resident_mask(self) -> np.ndarray:
        return self.where != 0

    def resident_row(self, layer: int) -> np.ndarray:
        return self.where[layer] != 0


def next_uses(layer: np.ndarray, expert: np.ndarray, n_expert: int) -> np.ndarray:
    """For each entry i, the index of the next entry with the same (layer, expert), or NEVER. int64 [N].

    Vectorised: stable sort by pair, then each entry's successor within its pair group.
    """
    key = np.asarray(layer, dtype=np.int64) * int(n_expert) + np.asarray(expert, dtype=np.int64)
    n = len(key)
    nxt = np.full(n, NEVER, dtype=np.int64)
    if n < 2:
        return nxt
    order = np.argsort(key, kind="stable")
    same = key[order[1:]] == key[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_start(layer: np.ndarray, expert: np.ndarray, n_layers: int, n_expert: int, cap) -> np.ndarray:
    """Belady's free start-up fill: per layer, the ``cap[l]`` experts whose first use comes first. bool [L, E]."""
    key = np.asarray(layer, dtype=np.int64) * int(n_expert) + np.asarray(expert, dtype=np.int64)
    uniq, first = np.unique(key, return_index=True)
    order = np.argsort(first, kind="stable")
    uk = uniq[order]
    ul = uk // n_expert
    # k-th first-used expert of each layer is kept while k < cap[layer]
    srt = np.argsort(ul, kind="stable")
    starts = np.searchsorted(ul[srt], np.arange(n_layers))
    occ = np.empty(len(ul), dtype=np.int64)
    occ[srt] = np.arange(len(ul)) - starts[ul[srt]]
    keep = occ < np.asarray(cap, dtype=np.int64)[ul]
    m = np.zeros(n_layers * n_expert, dtype=bool)
    m[uk[keep]] = True
    return m.reshape(n_layers, n_expert)


class BeladyTier(Tier):
    """Offline optimum per layer (module docstring). ``layer``/``expert``: the whole entry sequence [N], which
    ``access`` must then be called with, record by record, in the same order."""

    policy = "belady"

    def __init__(self, n_layers: int, n_expert: int, cap, blob_bytes, layer: np.ndarray, expert: np.ndarray):
        super().__init__(n_layers, n_expert, cap, blob_bytes)
        self.seq_layer = np.asarray(layer, dtype=np.int64)
        self.seq_expert = np.asarray(expert, dtype=np.int64)
        self.nxt = next_uses(self.seq_layer, self.seq_expert, self.n_expert)
        self.res = belady_start(self.seq_layer, self.seq_expert, self.n_layers, self.n_expert, self.cap)
        first = np.full((self.n_layers, self.n_expert), NEVER, dtype=np.int64)
        key = self.seq_layer * self.n_expert + self.seq_expert
        uniq, idx = np.unique(key, return_index=True)
        first.ravel()[uniq] = idx
        self.cur_next = first
        self.members = [list(np.nonzero(self.res[l])[0].tolist()) for l in range(self.n_layers)]
        self.pos = 0

    def _access(self, layer: int, experts: list[int]) -> list[bool]:
        out = []
        cn = self.cur_next[layer]
        row = self.res[layer]
        mem = self.members[layer]
        c = int(self.cap[layer])
        for e in experts:
            i = self.pos
            if i >= len(self.seq_expert) or self.seq_layer[i] != layer or self.seq_expert[i] != e:
                raise StrataError(f"Belady tier: entry {i} is not the sequence it was built for")
            self.pos += 1
            nu = int(self.nxt[i])
            if row[e]:
                out.append(True)
                cn[e] = nu
                continue
            out.append(False)
            cn[e] = nu
            if c <= 0:
                continue
            if len(mem) < c:
                mem.append(e)
                row[e] = True
                self.layer_loads[layer] += 1
                continue
            v = max(mem, key=lambda x: (cn[x], -x))
            if nu < cn[v]:
                mem.remove(v)
                row[v] = False
                mem.append(e)
                row[e] = True
                self.layer_loads[layer] += 1
        return out

    def resident_mask(self) -> np.ndarray:
        return self.res.copy()


def make_tier(policy: str, *, n_layers: int | None = None, n_expert: int | None = None,
              profile: Profile | None = None, slots: int | None = None, budget_bytes: int | None = None,
              blob_bytes=None, admission: str = "global", cap=None, admit_on_miss: bool = True,
              future: tuple[np.ndarray, np.ndarray] | None = None, **params: Any) -> Tier:
    """Build an online tier.

    Args:
        policy: one of ``static``, ``adaptive``, ``lru``, ``lfu``, ``lfru``, ``belady``.
        n_layers, n_expert: geometry (taken from ``profile`` when omitted).
        profile: the ranking (static/adaptive; None = arrival-order admission only).
        slots / budget_bytes: the budget (slot count and/or bytes; bytes need ``blob_bytes``).
        blob_bytes: per-layer blob bytes [L] (pack ``native_experts.txt`` or model geometry).
        admission: ``global`` or ``per-layer`` (static/adaptive).
        cap: per-layer split [L] for lru/lfu/lfru/belady (default :func:`.layout.per_layer_split`).
        future: ``(layer[N], expert[N])`` for belady: the entry sequence it will be fed.
        params: policy parameters (adaptive: usage_floor, margin, adapt_every, max_moves, decay,
            copy_delay_rounds; lfu/lfru: decay, decay_every; lfru: privileged_frac).
    Raises:
        StrataError: unknown policy or parameter, missing geometry, budget or future.
    """
    if policy not in POLICIES:
        raise StrataError(f"unknown policy {policy!r} (use {', '.join(POLICIES)})")
    if profile is not None:
        n_layers = profile.n_layers if n_layers is None else n_layers
        n_expert = profile.n_expert if n_expert is None else n_expert
    if n_layers is None or n_expert is None:
        raise StrataError("make_tier needs n_layers and n_expert (or a profile)")
    if policy in ("static", "adaptive"):
        plan = plan_tier(n_layers, n_expert, profile, slots=slots, budget_bytes=budget_bytes,
                         blob_bytes=blob_bytes, admission=admission)
        if policy == "static":
            _with_defaults("static-tier", params, {})
            return StaticTier(plan, admit_on_miss)
        up = int(params.get("upper_slots", 0))
        upper = plan_upper(plan, profile, up) if up > 0 else None
        return AdaptiveTier(plan, admit_on_miss, upper=upper, **params)
    bb, _ = _blob_arrays(n_layers, blob_bytes)
    if cap is None:
        cap = per_layer_split(n_layers, slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes,
                              n_expert=n_expert)
    cap = np.asarray(cap, dtype=np.int64)
    if cap.shape != (n_layers,):
        raise StrataError(f"per-layer split has {cap.size} entries for {n_layers} layers")
    if policy == "lru":
        _with_defaults("lru", params, {})
        return LRUTier(n_layers, n_expert, cap, bb)
    if policy == "lfu":
        return LFUTier(n_layers, n_expert, cap, bb, **params)
    if policy == "lfru":
        return LFRUTier(n_layers, n_expert, cap, bb, **params)
    if future is None:
        raise StrataError("the belady tier is offline: pass future=(layer[N], expert[N]) of the whole replay")
    return BeladyTier(n_layers, n_expert, cap, bb, future[0], future[1])
