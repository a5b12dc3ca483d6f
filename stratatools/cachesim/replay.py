"""Replay traces through tiers: entries, rounds, metrics, the bandwidth model.

Definitions (cache-policy.md "Hit-rate definitions"; every report names which one it shows):

* ``h_expert``: hits / routed (token, layer, expert) entries; hit = resident at the time of use.
* ``h_layer``: share of records (one token's routing of one layer) whose k experts were all resident.
* ``h_bytes``: hits weighted by their layer's blob bytes (host-memory traffic is what it decides).
* ``moved_bytes``: host->VRAM copies during the replay (misses admitted, adaptive copies, baseline loads),
  in actual blob bytes; the start-up fill is reported apart as ``fill_bytes``.
* Bandwidth model (:class:`BandwidthModel`, stated in every report): each routed entry reads its expert's
  blob once, from VRAM on a hit and from host memory on a miss; copies cross PCIe and are not overlapped
  with compute; everything but routed experts is left out. ``time_per_token_s`` = (hit bytes / VRAM GB/s +
  miss bytes / host GB/s + moved bytes / PCIe GB/s) / tokens, GB = 1e9 bytes. It ranks policies by traffic;
  it does not predict an engine's tokens/s.

Rounds (what the adaptive tier's ``adapt_every`` and the LFU/LFRU decay count): one decode position (request,
position); a trace with verify windows (``TraceTable.window``, from the commit records of a tagged Strata trace,
or a ``window`` column of our Parquet/CSV; else an ndarray ``meta["window"]`` [N]) makes one round per
(request, window) for the entries inside a window, and one per position for those outside every window (-1).
A request whose positions go back in file order is batched (layer-major: llama.cpp's ubatch capture, the kit's
routing CSVs): each batch, up to where the layer goes back, is one round, as a verify window is.
``Entries.rounds_by`` / ``SimResult.rounds_by`` say which applied (``positions``, ``windows``,
``windows+positions``, ``batches`` or ``...+batches``). The runtime (``stratatools run``) writes each prefill batch
as a window, so its rounds come back exactly: one per forward batch (:data:`stratatools.traces.table.ROUNDS`).

Phases: ``phase="decode"`` (the default) replays every entry and counts the decode ones: the prefill warms the
cache as it did in the engine, and its entries are in :attr:`Entries.count` as False (``warmup`` in reports);
``cold=True`` drops the known prefill entries instead, so the decode starts on the cache as the fill left it
(Strata's ``--dump-routing`` writes decode positions only; llama.cpp traces mark prompt processing with negative
positions). ``phase="all"`` replays and counts everything. Metrics count the counted entries only; copies
(``loads``, ``moved_bytes``) are those of the whole replay, warm-up included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile
from stratatools.traces.table import PREFILL, TraceTable, rounds_kind
from stratatools.cachesim import kernels as K
from stratatools.cachesim.layout import _blob_arrays, per_layer_split, plan_tier, plan_upper
from stratatools.cachesim.tiers import (ADAPTIVE_DEFAULTS, LFRU_DEFAULTS, LFU_DEFAULTS, POLICIES, _with_defaults,
                                        check_adaptive_params, make_tier)


@dataclass(frozen=True)
class BandwidthModel:
    """Stated bandwidths in GB/s (1e9 bytes/s): host memory (misses read there), PCIe (host->VRAM copies),
    VRAM (hits). Defaults: dual-channel DDR5 ~60, PCIe 4.0 x16 ~25, a 12 GB consumer card ~900."""

    host_gbps: float = 60.0
    pcie_gbps: float = 25.0
    vram_gbps: float = 900.0

    def to_dict(self) -> dict[str, float]:
        return {"host_gbps": self.host_gbps, "pcie_gbps": self.pcie_gbps, "vram_gbps": self.vram_gbps}


@dataclass
class Entries:
    """A trace flattened for replay: routed entries in order, with round and record ids.

    Attributes:
        layer, expert: int64 [N].
        rnd: int64 [N] round id (non-decreasing; a change means a new round).
        record: int64 [N] record id (one token's routing of one layer).
        request: int64 [N] request id (dense over all input traces; folds never split one).
        token: int64 [N] token id: one per (request, position), or per round where positions are unknown.
        n_layers, n_expert: the geometry entries were checked against.
        n_tokens: decode positions covered.
        skipped: entries left out (``prefill``, ``layer`` out of range, ``expert`` out of range).
        rounds_by: what a round is (module docstring): ``positions``, ``windows``, ``windows+positions``,
            ``batches`` (layer-major batches) or ``windows+positions+batches``.
        count: bool [N], the entries the metrics count (False: replayed to warm the cache, not counted: the
            prefill under ``phase="decode"``), or None when every entry counts.
    """

    layer: np.ndarray
    expert: np.ndarray
    rnd: np.ndarray
    record: np.ndarray
    request: np.ndarray
    n_layers: int
    n_expert: int
    n_tokens: int
    token: np.ndarray | None = None
    skipped: dict[str, int] = field(default_factory=dict)
    rounds_by: str = "positions"
    count: np.ndarray | None = None

    def __len__(self) -> int:
        return int(len(self.layer))

    @property
    def n_counted(self) -> int:
        """Entries the metrics count (all of them unless some only warm the cache)."""
        return int(len(self.layer)) if self.count is None else int(self.count.sum())

    @property
    def n_warmup(self) -> int:
        """Entries replayed but not counted (the prefill under ``phase="decode"``)."""
        return int(len(self.layer)) - self.n_counted

    def counted(self) -> "Entries":
        """The counted entries alone (self when every entry counts)."""
        return self if self.count is None else self.take(self.count)

    @property
    def n_rounds(self) -> int:
        return int(len(np.unique(self.rnd)))

    def take(self, mask: np.ndarray) -> "Entries":
        """Entries selected by a boolean mask (whole requests, for folds); tokens recounted."""
        tk = self.token[mask] if self.token is not None else self.rnd[mask]
        cnt = None if self.count is None else self.count[mask]
        if cnt is not None and cnt.all():
            cnt = None
        return Entries(self.layer[mask], self.expert[mask], self.rnd[mask], self.record[mask], self.request[mask],
                       self.n_layers, self.n_expert, _count_tokens(tk if cnt is None else tk[cnt]), token=tk,
                       skipped=dict(self.skipped), rounds_by=self.rounds_by, count=cnt)


def _count_tokens(token: np.ndarray) -> int:
    return int(len(np.unique(token))) if len(token) else 0


def merge_traces(tables: Sequence[TraceTable]) -> TraceTable:
    """One table from several traces with request ids made distinct per input (dense, in input order); verify
    windows are kept (:meth:`TraceTable.concat`)."""
    if not tables:
        raise StrataError("no traces given (pass at least one --traces file)")
    parts = []
    base = 0
    for t in tables:
        if len(t) == 0:
            continue
        u, inv = np.unique(t.request, return_inverse=True)
        cols = t.columns()
        cols["request"] = (inv + base).astype(np.int32)
        base += len(u)
        parts.append(TraceTable(**cols, meta=dict(t.meta), window=_table_window(t)))
    if not parts:
        raise StrataError("the traces hold no routed entries")
    return TraceTable.concat(parts)


def _table_window(t: TraceTable) -> np.ndarray | None:
    """Per-entry window ids of a table: ``t.window``, else an int ndarray [N] in ``meta["window"]``, else None."""
    w = t.window
    if w is None:
        m = t.meta.get("window") if isinstance(t.meta, dict) else None
        if isinstance(m, np.ndarray) and m.shape == (len(t),) and m.dtype.kind in "iu":
            w = m
    return w


def prepare_entries(table: TraceTable | Sequence[TraceTable], n_layers: int, n_expert: int, *,
                    phase: str = "decode", cold: bool = False) -> Entries:
    """Flatten traces for replay (rounds, records and phases as in the module docstring).

    Args:
        table: one trace table, or several (merged with :func:`merge_traces`).
        n_layers, n_expert: the tier's geometry; entries outside it (an MTP block, another model) are skipped
            and counted.
        phase: ``decode`` (count decode entries; known prefill entries are replayed uncounted, or dropped with
            ``cold``) or ``all`` (count everything).
        cold: with ``phase="decode"``, drop the known prefill entries (the decode starts on the fill alone).
    Raises:
        StrataError: unknown phase; ``cold`` with ``phase="all"``; no entries left (or none counted).
    """
    if phase not in ("decode", "all"):
        raise StrataError(f"unknown phase filter {phase!r} (use decode or all)")
    if cold and phase != "decode":
        raise StrataError("--cold drops the prefill before the decode is counted; it needs --phase decode")
    t = merge_traces(list(table)) if not isinstance(table, TraceTable) else table
    n = len(t)
    if n == 0:
        raise StrataError("the traces hold no routed entries")
    req = t.request.astype(np.int64)
    pos = t.position.astype(np.int64)
    lay = t.layer.astype(np.int64)
    rank = t.rank.astype(np.int64)
    window = _table_window(t)
    rec_start = np.ones(n, dtype=bool)
    rec_start[1:] = (req[1:] != req[:-1]) | (pos[1:] != pos[:-1]) | (lay[1:] != lay[:-1]) | (rank[1:] <= rank[:-1])
    if window is not None:  # a record never spans two windows
        wv = np.asarray(window)
        rec_start[1:] |= wv[1:] != wv[:-1]
    record = np.cumsum(rec_start) - 1
    rs = np.nonzero(rec_start)[0]
    r_req, r_pos, r_lay = req[rs], pos[rs], lay[rs]
    if window is not None:
        r_win = np.asarray(window, dtype=np.int64)[rs]
        in_w = r_win >= 0
        # windows: key = window id (>= 0); outside them: key = position, shifted below every window id
        r_key = np.where(in_w, r_win, r_pos - (1 << 40))
    else:
        in_w = np.zeros(len(rs), dtype=bool)
        r_key = r_pos
    new_round = np.ones(len(rs), dtype=bool)
    batched = np.zeros(len(rs), dtype=bool)
    if len(rs) > 1:
        unknown = (r_pos[1:] < 0) & ~in_w[1:]
        new_round[1:] = (r_req[1:] != r_req[:-1]) | (r_key[1:] != r_key[:-1]) | (unknown & (r_lay[1:] <= r_lay[:-1]))
        # Batched (layer-major) records outside windows: a request whose positions go back in file order lists
        # each batch layer by layer (llama.cpp's ubatch capture, the kit's routing CSVs, a plain trace of verify
        # windows). Such a batch is one round, like a verify window; a new batch starts where the layer goes back.
        same_req = r_req[1:] == r_req[:-1]
        back = same_req & ~in_w[1:] & ~in_w[:-1] & (r_pos[1:] >= 0) & (r_pos[1:] < r_pos[:-1])
        if back.any():
            batched = np.zeros(len(rs), dtype=bool)
            req_ids = np.unique(r_req[1:][back])
            batched[np.isin(r_req, req_ids) & ~in_w] = True
            b = batched[1:] & batched[:-1] & same_req
            new_round[1:][b] = r_lay[1:][b] < r_lay[:-1][b]
    rec_round = np.cumsum(new_round) - 1
    rnd = rec_round[record]
    keep = np.ones(n, dtype=bool)
    skipped = {"prefill": 0, "layer": 0, "expert": 0}
    pf = None
    if phase == "decode":
        pf = np.asarray(t.phase) == PREFILL
        if cold:
            skipped["prefill"] = int(pf.sum())
            keep &= ~pf
            pf = None
        elif not pf.any():
            pf = None
    ex = t.expert.astype(np.int64)
    bad_l = keep & ((lay < 0) | (lay >= n_layers))
    skipped["layer"] = int(bad_l.sum())
    keep &= ~bad_l
    bad_e = keep & ((ex < 0) | (ex >= n_expert))
    skipped["expert"] = int(bad_e.sum())
    keep &= ~bad_e
    if not keep.any():
        raise StrataError(f"no routed entry of the traces fits {n_layers} layers x {n_expert} experts "
                          f"(skipped: {skipped}); check the traces belong to this model")
    count = None if pf is None else ~pf[keep]
    if count is not None and not count.any():
        raise StrataError("the traces hold prefill entries only, nothing of the decode to count; use --phase all")
    # token id: (request, position) when the position is known, else the round
    tok_key = np.where(pos >= 0, req * (1 << 32) + pos, -(rnd + 1))
    _, token = np.unique(tok_key[keep], return_inverse=True)
    token = token.astype(np.int64)
    rounds_by = rounds_kind(None if window is None else np.asarray(window)[keep])
    if len(rs) > 1 and batched[record[keep]].any():
        rounds_by = "batches" if rounds_by == "positions" else rounds_by + "+batches"
    return Entries(lay[keep], ex[keep], rnd[keep], record[keep], req[keep], int(n_layers), int(n_expert),
                   _count_tokens(token if count is None else token[count]), token=token, skipped=skipped,
                   rounds_by=rounds_by, count=count)


@dataclass
class SimResult:
    """Metrics of one replay (module docstring gives every definition).

    Attributes:
        policy, admission, label: what ran (``label`` names the profile for static/adaptive).
        n_slots: slots of the tier; cap: int [L] slots per layer at the end of the replay.
        entries, hits, records, all_hit_records, tokens, rounds: counts.
        h_expert, h_layer, h_bytes: hit rates (fractions; h_bytes None when blob sizes are unknown).
        moved_bytes, loads, fill_bytes: host->VRAM traffic (bytes, copies, start-up bytes; the byte counts are
            None when blob sizes are unknown).
        layer_h_expert: float [L] per-layer h_expert (nan for a layer without entries).
        time_per_token_s: estimate from ``bandwidth`` in seconds (None when blob sizes are unknown).
        params: policy parameters used.
        rounds_by: what a round was (``positions``, ``windows`` or ``windows+positions``; module docstring).
        tiers: the three-tier cost model's figures (:func:`.costmodel.tier_costs`: h_vram, h_ram, h_ssd, bytes
            per token, tok_s) when a :class:`.costmodel.ThreeTierModel` was given and blob sizes are known.
        layer_entries, layer_hits: int [L] counted entries and hits per layer.
        warmup: entries replayed but not counted (the prefill under ``phase="decode"``; module docstring).
    """

    policy: str
    admission: str
    label: str
    n_slots: int
    cap: list[int]
    entries: int
    hits: int
    records: int
    all_hit_records: int
    tokens: int
    rounds: int
    h_expert: float
    h_layer: float
    h_bytes: float | None
    moved_bytes: int | None
    loads: int
    fill_bytes: int | None
    layer_h_expert: list[float]
    time_per_token_s: float | None
    bandwidth: dict[str, float]
    params: dict[str, Any] = field(default_factory=dict)
    rounds_by: str = "positions"
    tiers: dict[str, float] | None = None
    layer_entries: list[int] = field(default_factory=list)
    layer_hits: list[int] = field(default_factory=list)
    warmup: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["layer_h_expert"] = [None if (x != x) else x for x in self.layer_h_expert]
        return d


def metrics(ent: Entries, hits: np.ndarray, loads: np.ndarray, blob_bytes: np.ndarray,
            bw: BandwidthModel) -> dict[str, Any]:
    """Hit rates and traffic from a hit vector [N] and per-layer loads [L]: over the counted entries
    (:attr:`Entries.count`); ``rounds`` and the loads are those of the whole replay. ``layer_entries`` /
    ``layer_hits``: int [L] counts behind ``layer_h_expert``."""
    L = ent.n_layers
    hits = np.asarray(hits, dtype=bool)
    layer, record = ent.layer, ent.record
    if ent.count is not None:  # only the columns the counts need (no full copy of the entries)
        hits, layer, record = hits[ent.count], layer[ent.count], record[ent.count]
    n = len(hits)
    le = np.bincount(layer, minlength=L)
    lh = np.bincount(layer, weights=hits, minlength=L)
    bb = np.asarray(blob_bytes, dtype=np.float64)
    entry_bytes = float((le * bb).sum())
    hit_bytes = float((lh * bb).sum())
    miss_bytes = entry_bytes - hit_bytes
    # records whose every entry hit: min over the record's entries
    rec_u, rec_inv = np.unique(record, return_inverse=True)
    rec_miss = np.bincount(rec_inv, weights=~hits, minlength=len(rec_u))
    moved = int((np.asarray(loads, dtype=np.int64) * np.asarray(blob_bytes, dtype=np.int64)).sum())
    t = (hit_bytes / (bw.vram_gbps * 1e9) + miss_bytes / (bw.host_gbps * 1e9) + moved / (bw.pcie_gbps * 1e9))
    with np.errstate(invalid="ignore", divide="ignore"):
        layer_h = np.where(le > 0, lh / np.maximum(le, 1), np.nan)
    return {"entries": n, "hits": int(hits.sum()), "records": int(len(rec_u)),
            "all_hit_records": int((rec_miss == 0).sum()), "tokens": ent.n_tokens, "rounds": ent.n_rounds,
            "layer_entries": [int(x) for x in le], "layer_hits": [int(x) for x in lh],
            "h_expert": float(hits.mean()) if n else float("nan"),
            "h_layer": float((rec_miss == 0).mean()) if len(rec_u) else float("nan"),
            "h_bytes": hit_bytes / entry_bytes if entry_bytes else float("nan"),
            "moved_bytes": moved, "loads": int(np.asarray(loads).sum()),
            "layer_h_expert": [float(x) for x in layer_h],
            "time_per_token_s": t / ent.n_tokens if ent.n_tokens else float("nan")}


def _check_params(policy: str, params: dict) -> dict:
    defaults = {"adaptive": ADAPTIVE_DEFAULTS, "lfu": LFU_DEFAULTS, "lfru": LFRU_DEFAULTS}.get(policy, {})
    p = _with_defaults(policy, params, defaults)
    for k, v in params.items():
        if not np.isfinite(float(v)):
            raise StrataError(f"{policy} parameter {k} = {v} is not a finite number")
    if policy == "adaptive":
        check_adaptive_params(p)
    return p


def run_policy(ent: Entries, policy: str, *, profile: Profile | None = None, slots: int | None = None,
               budget_bytes: int | None = None, blob_bytes=None, admission: str = "global", cap=None,
               admit_on_miss: bool = True, engine: str = "compiled",
               **params: Any) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Replay ``ent`` through one policy. Returns (hits bool [N], loads int64 [L], info).

    ``engine="compiled"`` runs :mod:`.kernels`; ``engine="python"`` feeds the online tier objects record by
    record (the reference the compiled path is tested against). ``info`` holds n_slots, cap, fill_bytes,
    admission and the parameters used. Raises StrataError for unknown policies, parameters or budgets.
    """
    if policy not in POLICIES:
        raise StrataError(f"unknown policy {policy!r} (use {', '.join(POLICIES)})")
    if engine not in ("compiled", "python"):
        raise StrataError(f"unknown engine {engine!r}")
    L, E = ent.n_layers, ent.n_expert
    p = _check_params(policy, params)
    bb, _ = _blob_arrays(L, blob_bytes)
    if engine == "python":
        return _run_python(ent, policy, profile, slots, budget_bytes, blob_bytes, admission, cap, admit_on_miss, p)
    lay, ex = ent.layer, ent.expert
    if policy in ("static", "adaptive"):
        plan = plan_tier(L, E, profile, slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes,
                         admission=admission)
        res = plan.resident.copy()
        capv = plan.cap.copy()
        occ = res.sum(1).astype(np.int64)
        per_layer = plan.admission == "per-layer"
        info = {"n_slots": plan.n_slots, "fill_bytes": plan.fill_bytes, "admission": plan.admission}
        no_free = (not admit_on_miss) or (per_layer and (occ >= capv).all()) or (not per_layer and plan.pool_slots == 0)
        if policy == "static":
            if no_free:
                hits = res[lay, ex]
                loads = np.zeros(L, dtype=np.int64)
            else:
                hits, loads = K.static_kernel(lay, ex, res, capv, occ, plan.pool_slots, plan.pool_bytes,
                                              plan.slot_bytes, per_layer, admit_on_miss)
        elif int(p["lag"]) > 1 or int(p["pace_bytes"]) > 0 or int(p["upper_slots"]) > 0:
            hits, loads, extra = _run_adaptive_v2(ent, plan, profile, res, capv, occ, admit_on_miss, p)
            info.update(extra)
        else:
            hits, loads, steps, swaps = K.adaptive_kernel(
                lay, ex, ent.rnd, res, capv, occ, plan.pool_slots, plan.pool_bytes, plan.slot_bytes, per_layer,
                admit_on_miss, float(p["usage_floor"]), float(p["margin"]), int(p["adapt_every"]),
                int(p["max_moves"]), float(p["decay"]), int(p["copy_delay_rounds"]))
            info.update({"adapt_steps": int(steps), "swaps": int(swaps)})
        info["cap"] = capv.tolist()
        info["params"] = p
        return np.asarray(hits, dtype=bool), np.asarray(loads), info
    if cap is None:
        cap = per_layer_split(L, slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes, n_expert=E)
    cap = np.asarray(cap, dtype=np.int64)
    info = {"n_slots": int(cap.sum()), "fill_bytes": 0, "admission": "per-layer", "cap": cap.tolist(), "params": p}
    if policy == "lru":
        hits, loads = K.lru_kernel(lay, ex, cap, E)
    elif policy == "lfu":
        if int(p["decay_every"]) < 1:
            raise StrataError("lfu: decay_every must be >= 1")
        hits, loads = K.lfu_kernel(lay, ex, ent.rnd, cap, E, float(p["decay"]), int(p["decay_every"]))
    elif policy == "lfru":
        frac = float(p["privileged_frac"])
        if not 0.0 < frac <= 1.0 or int(p["decay_every"]) < 1:
            raise StrataError(f"lfru: privileged_frac {frac} must be in (0, 1] and decay_every >= 1")
        pcap = np.array([int(np.ceil(int(c) * frac)) for c in cap], dtype=np.int64)
        hits, loads = K.lfru_kernel(lay, ex, ent.rnd, pcap, cap - pcap, E, float(p["decay"]), int(p["decay_every"]))
    else:  # belady
        nxt, res, cur = K.belady_prepare(lay, ex, L, E, cap)
        info["fill_bytes"] = int((res.sum(1) * bb).sum())
        hits, loads = K.belady_kernel(lay, ex, nxt, res, cur, cap)
    return np.asarray(hits, dtype=bool), np.asarray(loads), info


def _run_adaptive_v2(ent: Entries, plan, profile, res, capv, occ, admit_on_miss: bool, p: dict):
    """The Strata 0.2.x adaptive kernel (lag, paced copies, upper tier); ``capv`` is updated in place."""
    T = 2 if int(p["upper_slots"]) > 0 else 1
    L, E = ent.n_layers, ent.n_expert
    R = np.zeros((T, L, E), dtype=bool)
    C = np.zeros((T, L), dtype=np.int64)
    R[0], C[0] = res, capv
    if T == 2:
        R[1], C[1] = plan_upper(plan, profile, int(p["upper_slots"]))
    O = R.sum(2).astype(np.int64)
    upool = np.zeros(T, dtype=np.int64)
    if T == 2 and plan.admission != "per-layer":
        upool[1] = max(0, int(p["upper_slots"]) - int(R[1].sum()))
    ridx = np.zeros(len(ent), dtype=np.int64)
    if len(ent) > 1:
        ridx[1:] = np.cumsum(ent.rnd[1:] != ent.rnd[:-1])
    hits, loads, steps, swaps, dropped, uh = K.adaptive_v2_kernel(
        ent.layer, ent.expert, ridx, R, C, O, upool, plan.pool_slots, plan.pool_bytes, plan.slot_bytes,
        plan.admission == "per-layer", admit_on_miss, float(p["usage_floor"]), float(p["margin"]),
        int(p["adapt_every"]), int(p["max_moves"]), float(p["decay"]), int(p["copy_delay_rounds"]), int(p["lag"]),
        int(p["pace_bytes"]), bool(int(p["disjoint"])))
    capv[:] = C[0]
    return hits, loads, {"adapt_steps": int(steps), "swaps": int(swaps), "dropped_moves": int(dropped),
                         "upper_hits": int(uh)}


def _run_python(ent, policy, profile, slots, budget_bytes, blob_bytes, admission, cap, admit_on_miss, p):
    L, E = ent.n_layers, ent.n_expert
    kw: dict[str, Any] = {}
    if policy == "belady":
        if cap is None:
            cap = per_layer_split(L, slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes, n_expert=E)
        kw["future"] = (ent.layer, ent.expert)
    tier = make_tier(policy, n_layers=L, n_expert=E, profile=profile, slots=slots, budget_bytes=budget_bytes,
                     blob_bytes=blob_bytes, admission=admission, cap=cap, admit_on_miss=admit_on_miss,
                     **kw, **(p if policy in ("adaptive", "lfu", "lfru") else {}))
    hits = np.zeros(len(ent), dtype=bool)
    bounds = np.nonzero(np.diff(ent.record))[0] + 1
    starts = np.concatenate([[0], bounds]).astype(np.int64)
    ends = np.concatenate([bounds, [len(ent)]]).astype(np.int64)
    lay, ex, rnd = ent.layer, ent.expert, ent.rnd
    for s, e in zip(starts.tolist(), ends.tolist()):
        if s > 0 and rnd[s] != rnd[s - 1]:
            tier.end_round()
        hits[s:e] = tier.access(int(lay[s]), ex[s:e])
    tier.end_round()
    info: dict[str, Any] = {"cap": tier.cap.tolist(), "params": p}
    if hasattr(tier, "plan"):
        info.update({"n_slots": tier.plan.n_slots, "fill_bytes": tier.plan.fill_bytes, "admission": tier.plan.admission})
    else:
        info.update({"n_slots": int(tier.cap.sum()), "fill_bytes": 0, "admission": "per-layer"})
    if policy == "adaptive":
        info.update({"adapt_steps": tier.steps, "swaps": tier.swaps})
        if int(p["lag"]) > 1 or int(p["pace_bytes"]) > 0 or int(p["upper_slots"]) > 0:
            info.update({"dropped_moves": tier.dropped, "upper_hits": tier.upper_hits})
    return hits, tier.layer_loads.copy(), info


def simulate_policy(ent: Entries, policy: str, *, label: str = "", bandwidth: BandwidthModel | None = None,
                    blob_bytes=None, cost=None, **kw: Any) -> SimResult:
    """:func:`run_policy` plus :func:`metrics`, as a :class:`SimResult`.

    ``cost``: a :class:`.costmodel.ThreeTierModel`; with blob sizes, ``tiers`` holds its per-tier hit rates and
    predicted tok/s (the RAM tier ranked by ``kw["profile"]``, flat order without one).

    Without ``blob_bytes`` (a slot budget and no pack/model) byte sizes are unknown: ``h_bytes``,
    ``moved_bytes``, ``fill_bytes`` and ``time_per_token_s`` are None; ``loads`` still counts the copies.
    """
    bw = bandwidth or BandwidthModel()
    hits, loads, info = run_policy(ent, policy, blob_bytes=blob_bytes, **kw)
    bb, _ = _blob_arrays(ent.n_layers, blob_bytes)
    m = metrics(ent, hits, loads, bb, bw)
    fill = int(info["fill_bytes"])
    if blob_bytes is None:  # sizes unknown: no byte-weighted rate, no bytes, no time (loads still count copies)
        m.update(h_bytes=None, moved_bytes=None, time_per_token_s=None)
        fill = None
    tiers = None
    if cost is not None and blob_bytes is not None and len(ent):
        from stratatools.cachesim.costmodel import ram_set, tier_costs

        _, rb = _blob_arrays(ent.n_layers, blob_bytes)
        in_ram = ram_set(kw.get("profile"), ent.n_layers, ent.n_expert, rb, cost.ram_bytes)
        c = ent.count  # the counted entries (the warm-up's copies are in loads, as in moved_bytes)
        lay, ex, h = (ent.layer, ent.expert, hits) if c is None else (ent.layer[c], ent.expert[c], hits[c])
        tiers = tier_costs(lay, ex, h, loads, ent.n_tokens, bb, in_ram, cost)
    params = dict(info.get("params", {}))
    for k in ("adapt_steps", "swaps", "dropped_moves", "upper_hits"):
        if k in info:
            params[k] = info[k]
    return SimResult(policy=policy, admission=info["admission"], label=label, n_slots=int(info["n_slots"]),
                     cap=[int(c) for c in info["cap"]], fill_bytes=fill,
                     bandwidth=bw.to_dict(), params=params, rounds_by=ent.rounds_by, tiers=tiers,
                     warmup=ent.n_warmup, **m)
