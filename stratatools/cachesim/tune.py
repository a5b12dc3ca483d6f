"""``stratatools tune``: the best tier settings for a workload, scored held-out by request.

What is searched (each a setting of the engine, Strata 0.2.x; cache-policy.md "Strata 0.2.x"):

* profile: ``traces`` (a profile built by make-profile, ``--mode no-base``, on the training folds: what
  ``stratatools make-profile`` on the workload would ship), each given ``--profile`` as it is (``file:NAME``), and
  each given profile reordered by the training folds (``traces+NAME``: make-profile ``--mode reorder --base``);
* admission (global, per-layer), ``--adapt-every``, ``--adapt-swaps``, ``--adapt-decay``, ``STRATA_ADAPT_LAG``
  and the paced mode's per-round byte budget (0 = off), from :data:`SPACE`.

How (:func:`tune`): the requests are split into k folds (:func:`.kfold.fold_of_requests`: a fold never splits a
request); for a fold, every profile choice is built on the other folds and the tier is replayed on the held-out
fold (compiled kernels). Successive halving: ``n_candidates`` settings are drawn (seeded, without repeats) from
the grid; each rung scores the survivors on more folds (rung 0: one fold, the last rung: all k) and keeps the
best ``1/eta`` by their mean over the folds scored so far. The engine's defaults and the community's hand-tuned
settings (``--adapt-every 1 --adapt-swaps 160 --adapt-decay 0.97``, ``STRATA_ADAPT_LAG=2``) are always scored on
every fold. The best of the settings scored on all k folds is reported with its held-out mean and 95%
t-interval (:func:`.kfold.t_interval`) and the paired interval of its per-fold difference to the defaults.

Selection bias, stated: the best is chosen on the same held-out folds it is reported on, so its interval is
slightly optimistic; the reference rows are not selected and are unbiased. The objective is ``hit``
(``h_expert``, VRAM hits per routed entry, first and upper tier together) or ``tok/s`` (:mod:`.costmodel`).

Streaming (the default, no ``mapper``): the traces are chunk sources (or tables) read chunk by chunk, in memory
independent of their length: one pass assigns every request to its fold (merged request id % k, the same folds
as :func:`.kfold.fold_of_requests`) and counts (layer, expert) per fold, from which every fold's training
profiles are built (make-profile's counts of the other folds); each rung (and the two reference rows) is then
one more pass, every fold's held-out entries prepared on the fly (:class:`.replay.EntryStream` folds) and fed to
one adaptive replay per (settings, fold) scored on it (:class:`.replay.RunGroup`).

Scaling seam: with a ``mapper``, every (settings, fold) score is one module-level, picklable task
(:func:`score_task` on a (:class:`FoldData`, settings, keywords) tuple), mapped through it; ``tune --cluster``
passes one that runs them as Dask tasks (:func:`stratatools.core.cluster.run_tasks`). Each rung is one
``mapper`` call. That path holds the traces and the folds' entries in memory (tasks carry them); the results
equal the streamed path's.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.profiles.ranking import make_profile
from stratatools.profiles.strp import Profile
from stratatools.traces.table import TraceTable
from stratatools.cachesim.costmodel import ThreeTierModel, ram_set, tier_costs
from stratatools.cachesim.kfold import fold_count_pass, fold_of_requests, t_interval
from stratatools.cachesim.layout import _blob_arrays, plan_tier
from stratatools.cachesim.replay import Entries, merge_traces, prepare_entries, run_policy

SPACE: dict[str, list[Any]] = {
    "admission": ["global", "per-layer"],
    "adapt_every": [1, 2, 4, 8],
    "max_moves": [32, 96, 160, 256],
    "decay": [0.5, 0.7, 0.85, 0.92, 0.97],
    "lag": [1, 2],
    "pace_slots": [0, 8, 32],  # paced budget per round, in slots of the largest blob (0 = unpaced)
}
ENGINE_DEFAULTS = {"admission": "global", "adapt_every": 4, "max_moves": 96, "decay": 0.7, "lag": 1, "pace_slots": 0}
COMMUNITY = {"admission": "global", "adapt_every": 1, "max_moves": 160, "decay": 0.97, "lag": 2, "pace_slots": 0}
OBJECTIVES = ("hit", "tok/s")
KEYS = ("profile",) + tuple(SPACE)


@dataclass
class Arm:
    """One setting: ``settings`` (profile + :data:`SPACE` keys), its per-fold scores and the rung it reached."""

    name: str
    settings: dict[str, Any]
    folds: dict[int, dict[str, float]] = field(default_factory=dict)
    rung: int = 0

    def mean(self, key: str) -> float:
        return float(np.mean([f[key] for f in self.folds.values()])) if self.folds else float("nan")

    def to_dict(self, key: str) -> dict[str, Any]:
        vals = [self.folds[f][key] for f in sorted(self.folds)]
        m, lo, hi = t_interval(vals) if vals else (float("nan"),) * 3
        out = {"name": self.name, "settings": dict(self.settings), "rung": self.rung, "folds_scored": len(vals),
               "mean": m, "low": lo, "high": hi}
        for k in ("h_expert", "h_layer", "h_vram", "h_ram", "h_ssd", "tok_s", "moved_bytes_per_token"):
            vs = [self.folds[f][k] for f in sorted(self.folds) if self.folds[f].get(k) is not None]
            out[k] = float(np.mean(vs)) if vs else None
        return out


@dataclass
class TuneResult:
    """Outcome of :func:`tune` (``to_dict`` for ``--json``)."""

    objective: str
    k: int
    requests: int
    best: Arm
    defaults: Arm
    community: Arm
    finalists: list[Arm]
    evaluated: int
    candidates: int
    rungs: list[dict[str, int]]
    options: dict[str, Any]
    diff_default: tuple[float, float, float]
    diff_community: tuple[float, float, float]
    cost_model: dict[str, Any] | None
    engine_flags: list[str]
    skipped: dict[str, int] = field(default_factory=dict)  # entries left out of the replay (as simulate's)
    notes: list[str] = field(default_factory=list)  # e.g. the default k fitted to fewer requests

    @property
    def key(self) -> str:
        return "h_expert" if self.objective == "hit" else "tok_s"

    @property
    def significant(self) -> bool:
        """The best beats the defaults: the paired 95% interval of the per-fold difference lies above 0."""
        return self.diff_default[1] > 0

    def to_dict(self) -> dict[str, Any]:
        k = self.key
        return {"objective": self.objective, "score": k, "k": self.k, "requests": self.requests,
                "best": self.best.to_dict(k), "engine_defaults": self.defaults.to_dict(k),
                "community": self.community.to_dict(k), "finalists": [a.to_dict(k) for a in self.finalists],
                "diff_vs_defaults": dict(zip(("mean", "low", "high"), self.diff_default)),
                "diff_vs_community": dict(zip(("mean", "low", "high"), self.diff_community)),
                "significant_vs_defaults": self.significant, "evaluations": self.evaluated,
                "candidates": self.candidates, "rungs": self.rungs, "options": self.options,
                "cost_model": self.cost_model, "engine_flags": self.engine_flags, "skipped": dict(self.skipped),
                "notes": list(self.notes),
                "selection_note": "the best is selected on the folds it is reported on (slightly optimistic)"}


@dataclass
class FoldData:
    """What one held-out fold needs: its entries and the profile choices built on the other folds."""

    ent: Entries
    profiles: dict[str, Profile | None]


def space_for(version: str) -> dict[str, list[Any]]:
    """The search grid for a Strata version: 0.1.4x has neither ``STRATA_ADAPT_LAG`` nor the paced mode."""
    if version == "0.1":
        return {**SPACE, "lag": [1], "pace_slots": [0]}
    return dict(SPACE)


def _grid_sample(n: int, seed: int, space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(space)
    grid = list(itertools.product(*(space[k] for k in keys)))
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(grid))[: max(0, n)]
    return [dict(zip(keys, grid[i])) for i in sorted(idx)]


def score_one(fd: FoldData, settings: dict[str, Any], *, slots: int | None, budget_bytes: int | None,
              blob_bytes, cost: ThreeTierModel | None, pace_unit: int) -> dict[str, float]:
    """Replay one fold's held-out entries through the adaptive tier with ``settings``; returns h_expert, h_layer
    and, with a cost model and blob sizes, the three-tier costs (:func:`.costmodel.tier_costs`)."""
    prof = fd.profiles[settings["profile"]]
    params = _params(settings, pace_unit)
    ent = fd.ent
    hits, loads, _ = run_policy(ent, "adaptive", profile=prof, slots=slots, budget_bytes=budget_bytes,
                                blob_bytes=blob_bytes, admission=settings["admission"], **params)
    lay, ex, rec = ent.layer, ent.expert, ent.record
    if ent.count is not None:  # the prefill warmed the cache; only the decode is scored (replay.prepare_entries)
        hits, lay, ex, rec = hits[ent.count], lay[ent.count], ex[ent.count], rec[ent.count]
    rec_u, rec_inv = np.unique(rec, return_inverse=True)
    all_hit = np.bincount(rec_inv, weights=~hits, minlength=len(rec_u)) == 0
    out = {"h_expert": float(hits.mean()), "h_layer": float(all_hit.mean())}
    if cost is not None and blob_bytes is not None:
        bb, rb = _blob_arrays(ent.n_layers, blob_bytes)
        in_ram = ram_set(prof, ent.n_layers, ent.n_expert, rb, cost.ram_bytes)
        out.update(tier_costs(lay, ex, hits, loads, ent.n_tokens, bb, in_ram, cost))
    return out


def score_task(task: tuple[FoldData, dict[str, Any], dict[str, Any]]) -> dict[str, float]:
    """``score_one(*task[:2], **task[2])``: one picklable task (fold data, settings, budget/cost keywords)."""
    fd, settings, kw = task
    return score_one(fd, settings, **kw)


def engine_flags(settings: dict[str, Any], *, n_slots: int, profile_names: dict[str, str], pace_unit: int,
                 traces_hint: str = "TRACES", geometry: tuple[int, int] | None = None,
                 phase: str = "decode") -> list[str]:
    """The engine command-line flags (and environment) for ``settings``; lines starting ``#`` are notes for
    settings whose engine option name the public sources read did not confirm."""
    p = settings["profile"]
    lines = []
    geo = f" --n-layer {geometry[0]} --n-expert {geometry[1]}" if geometry else ""
    mk = f"# profile: stratatools make-profile {traces_hint} -o workload.strp{geo} --phase {phase}"
    if p == "traces":
        lines.append(f"{mk} --mode no-base")
        prof_arg = "workload.strp"
    elif p.startswith("traces+"):
        base = profile_names.get(p[len("traces+"):], p[len("traces+"):])
        lines.append(f"{mk} --mode reorder --base {base}")
        prof_arg = "workload.strp"
    else:
        prof_arg = profile_names.get(p[len("file:"):], p[len("file:"):])
    flags = f"--expert-cache {n_slots} --expert-profile {prof_arg} --adapt-every {settings['adapt_every']} " \
            f"--adapt-swaps {settings['max_moves']} --adapt-decay {settings['decay']}"
    env = f"STRATA_ADAPT_LAG={settings['lag']} " if int(settings["lag"]) != 1 else ""
    lines.append(env + flags)
    if settings["admission"] != "global":
        lines.append("# per-layer admission: enable the engine's per-layer expert-cache admission")
    if int(settings["pace_slots"]) > 0:
        lines.append(f"# paced mode: per-round copy budget {int(settings['pace_slots']) * pace_unit} bytes")
    return lines


DEFAULT_K = 5  # tune's folds when none are given (fewer when the traces hold fewer requests)


def _fit_k(k: int | None, n_req: int) -> tuple[int, list[str]]:
    """The folds to use: ``k`` as given (checked against the ``n_req`` requests, as fold_of_requests does), or for
    None :data:`DEFAULT_K`, or ``n_req`` when fewer (with a note). Raises StrataError (k < 2, too few requests)."""
    if k is None:
        if n_req < 2:
            raise StrataError(f"the traces hold only {n_req} request; held-out evaluation needs traces of at least "
                              f"2 requests (a fold never splits a request)")
        if n_req >= DEFAULT_K:
            return DEFAULT_K, []
        return n_req, [f"{n_req}-fold: the traces hold {n_req} requests (the default --kfold {DEFAULT_K} needs "
                       f"{DEFAULT_K}); --kfold 2 to {n_req} chooses"]
    if k < 2:
        raise StrataError(f"--kfold {k}: need at least 2 folds")
    if n_req < 2:
        raise StrataError(f"--kfold {k}: the traces hold only {n_req} request; held-out evaluation needs traces "
                          f"of at least 2 requests (a fold never splits a request)")
    if n_req < k:
        raise StrataError(f"--kfold {k}: the traces hold only {n_req} request(s); a fold never splits a request, "
                          f"so use at most {n_req} folds (or traces with more requests)")
    return k, []


def _fold_error(f: int) -> StrataError:
    return StrataError(f"fold {f}: the held-out requests hold no usable entries; use fewer folds (-k)")


class _TableFolds:
    """The folds of traces held in memory (the ``mapper`` path): every fold's :class:`FoldData`, built on first
    use (its held-out entries prepared, its training profiles made by make-profile)."""

    def __init__(self, tables, n_layers: int, n_expert: int, k: int | None, phase: str, count_phase: str,
                 profiles: dict[str, Profile], max_layers: int | None = None):
        from stratatools.cachesim.replay import refuse_extra_layers

        for t in [tables] if isinstance(tables, TraceTable) else list(tables):
            if len(t.layer):
                refuse_extra_layers(t, int(t.layer.max()), n_layers, max_layers)
        self.table = tables if isinstance(tables, TraceTable) else merge_traces(list(tables))
        self.n_requests = int(len(np.unique(self.table.request)))
        self.k, self.notes = _fit_k(k, self.n_requests)
        self.fold = fold_of_requests(self.table.request.astype(np.int64), self.k)
        self.L, self.E, self.phase, self.count_phase, self.given = n_layers, n_expert, phase, count_phase, profiles
        self.cache: dict[int, FoldData] = {}

    def fold_data(self, f: int) -> FoldData:
        if f not in self.cache:
            table, L, E = self.table, self.L, self.E
            train, test = table.take(self.fold != f), table.take(self.fold == f)
            try:
                ent = prepare_entries(test, L, E, phase=self.phase)
            except StrataError:
                raise _fold_error(f) from None
            profs: dict[str, Profile | None] = {"traces": make_profile([train], L, E, mode="no-base",
                                                                        phase=self.count_phase)[0]}
            for n, p in self.given.items():
                profs[f"file:{n}"] = p
                profs[f"traces+{n}"] = make_profile([train], L, E, base=p, mode="reorder", phase=self.count_phase)[0]
            self.cache[f] = FoldData(ent, profs)
        return self.cache[f]

    def profiles(self, f: int) -> dict[str, Profile | None]:
        return self.fold_data(f).profiles

    def skipped(self) -> dict[str, int]:
        """Entries outside the geometry, left out of every fold's replay (``layer``: MTP blocks, ``expert``)."""
        t = self.table
        return {"prefill": 0, "layer": int((t.layer >= self.L).sum()),
                "expert": int(((t.layer < self.L) & (t.expert >= self.E)).sum())}


class _StreamFolds:
    """The folds of traces read chunk by chunk (module docstring, "Streaming"): one pass counts (layer, expert)
    per fold (make-profile's filter: phase, layer and expert range) and builds every fold's training profiles;
    :meth:`score` replays a batch of (settings, fold) in one more pass. Memory: the per-fold counts, the
    profiles and one chunk, whatever the traces' length."""

    def __init__(self, tables, n_layers: int, n_expert: int, k: int | None, phase: str, count_phase: str,
                 profiles: dict[str, Profile], max_layers: int | None = None):
        from stratatools.cachesim.replay import EntryStream
        from stratatools.profiles.ranking import build_profile

        srcs = [tables] if isinstance(tables, TraceTable) else list(tables)
        L, E = self.L, self.E = int(n_layers), int(n_expert)
        self.main = main = EntryStream(srcs, L, E, phase=phase, max_layers=max_layers)
        n_req = self.n_requests = int(main._req_base[-1] + len(main._req_ids[-1]))
        k, self.notes = _fit_k(k, n_req)  # fold_of_requests' checks, in its order
        self.k = k
        self.folds = {f: EntryStream(None, L, E, phase=phase, fold=(k, f), parent=main) for f in range(k)}
        for fs in self.folds.values():
            fs.summary.light = False  # tokens are needed (the cost model's per-token figures)
        counts = fold_count_pass(main, list(self.folds.values()), k, L, E, count_phase)
        total = counts.sum(0)
        self._profiles = []
        for f in range(k):
            train = (total - counts[f]).astype(np.float64)
            profs: dict[str, Profile | None] = {"traces": build_profile(train, mode="no-base")}
            for n, p in profiles.items():
                profs[f"file:{n}"] = p
                profs[f"traces+{n}"] = build_profile(train, base=p, mode="reorder")
            self._profiles.append(profs)

    def profiles(self, f: int) -> dict[str, Profile | None]:
        return self._profiles[f]

    def skipped(self) -> dict[str, int]:
        """Entries left out of the replay, summed over the folds (each counts its own requests' entries; the
        folds' summaries are made by the scoring passes)."""
        out = {"prefill": 0, "layer": 0, "expert": 0}
        for fs in self.folds.values():
            for key, v in fs.skipped.items():
                out[key] = out.get(key, 0) + int(v)
        return out

    def score(self, batch: list[tuple[dict[str, Any], int]], common: dict[str, Any], progress=None) -> list[dict]:
        """:func:`score_one` of every (settings, fold) in ``batch``, in one pass over the traces."""
        from stratatools.cachesim.replay import RunGroup

        by_fold: dict[int, list[int]] = {}
        for i, (_, f) in enumerate(batch):
            by_fold.setdefault(f, []).append(i)
        kw = {n: common[n] for n in ("slots", "budget_bytes", "blob_bytes")}
        cost = common["cost"] if common["blob_bytes"] is not None else None
        groups = {}
        for f, idx in by_fold.items():
            runs = []
            for i in idx:
                st = batch[i][0]
                runs.append(dict(policy="adaptive", profile=self._profiles[f][st["profile"]],
                                 admission=st["admission"], cost=cost, **kw, **_params(st, common["pace_unit"])))
            groups[f] = RunGroup(self.folds[f], runs)
        raw = max(self.main.raw_entries, 1)
        for f in groups:
            self.folds[f].begin()
        for c in self.main.raw_chunks():
            for f, g in groups.items():
                e = self.folds[f].prepare(c)
                if e is not None:
                    g.feed(e)
            if progress is not None:
                progress.update(advance=len(batch) * len(c["layer"]) / raw)
        out: list[dict] = [{} for _ in batch]
        for f, g in groups.items():
            try:
                self.folds[f].end()
            except StrataError:
                raise _fold_error(f) from None
            for i, r in zip(by_fold[f], g.results()):
                o = {"h_expert": r.h_expert, "h_layer": r.h_layer}
                if cost is not None:
                    o.update(r.tiers)
                out[i] = o
        return out


def _params(settings: dict[str, Any], pace_unit: int) -> dict[str, Any]:
    """The adaptive tier's parameters of a setting."""
    return {"adapt_every": int(settings["adapt_every"]), "max_moves": int(settings["max_moves"]),
            "decay": float(settings["decay"]), "lag": int(settings["lag"]),
            "pace_bytes": int(settings["pace_slots"]) * int(pace_unit)}


def tune(tables: TraceTable | Sequence[TraceTable], n_layers: int, n_expert: int, *, slots: int | None = None,
         budget_bytes: int | None = None, blob_bytes=None, profiles: dict[str, Profile] | None = None,
         k: int | None = DEFAULT_K, candidates: int = 81, eta: int = 3, objective: str = "hit", cost: ThreeTierModel | None = None,
         seed: int = 0, phase: str = "decode", mapper: Callable | None = None,
         progress: Any = None, version: str = "0.2", trace_paths: Sequence[str] | None = None,
         profile_paths: dict[str, str] | None = None, max_layers: int | None = None) -> TuneResult:
    """Search tier settings by successive halving over k folds by request (module docstring).

    Args:
        tables: the workload's traces: TraceTables or chunk sources (:mod:`stratatools.traces.sources`; read
            chunk by chunk unless a ``mapper`` is given, which needs TraceTables); n_layers, n_expert: geometry.
        slots / budget_bytes (+ blob_bytes): the first tier's budget (as for ``simulate``).
        profiles: given profiles by name (searched as ``file:NAME`` and ``traces+NAME``).
        k: folds (>= 2, at most the requests); None: :data:`DEFAULT_K`, or the traces' request count when they
            hold fewer (said in the result's ``notes``); candidates: settings drawn from :data:`SPACE` besides the two references; eta: the
            halving factor (>= 2); objective: ``hit`` or ``tok/s`` (needs blob sizes); cost: the three-tier model.
        mapper: ``map``-like callable used for the (settings, fold) scores (the scaling seam; module docstring);
            None (default): the streamed path, in memory independent of the traces' length.
        progress: object with ``update(advance=n)`` (:func:`stratatools.cli.common.progress_bar`), or None.
        version: ``0.2`` (default) or ``0.1``: Strata 0.1.4x has no lag or paced mode, so those stay off.
        trace_paths, profile_paths: file names for the printed engine command lines (profile name -> path).
        max_layers: refuse traces that route layer ``max_layers`` or above (another model's: the trunk plus its
            MTP blocks; :func:`~stratatools.cachesim.replay.refuse_extra_layers`), before the folds are made.
            None: entries outside ``n_layers`` are skipped.
    Raises:
        StrataError: bad k/eta/candidates/objective, too few requests, no budget, tok/s without blob sizes, a
            trace of more layers than ``max_layers``.
    """
    if objective not in OBJECTIVES:
        raise StrataError(f"--objective {objective!r}: use hit or tok/s")
    if objective == "tok/s" and blob_bytes is None:
        raise StrataError("--objective tok/s needs blob sizes: pass --pack or --model")
    if eta < 2 or candidates < 0:
        raise StrataError(f"successive halving needs eta >= 2 and candidates >= 0 (got {eta}, {candidates})")
    if slots is None and budget_bytes is None:
        raise StrataError("no budget: give --slots N, --budget-gib X or --card SIZE")
    if version not in ("0.1", "0.2"):
        raise StrataError(f"--strata-version {version!r}: use 0.1 or 0.2")
    space = space_for(version)
    profiles = dict(profiles or {})
    count_phase = "decode" if phase == "decode" else "all"
    if mapper is None:
        folds = _StreamFolds(tables, n_layers, n_expert, k, phase, count_phase, profiles, max_layers)
    else:
        folds = _TableFolds(tables, n_layers, n_expert, k, phase, count_phase, profiles, max_layers)
    k = folds.k
    key = "h_expert" if objective == "hit" else "tok_s"
    if cost is None and blob_bytes is not None:
        cost = ThreeTierModel()
    _, rb = _blob_arrays(n_layers, blob_bytes)
    pace_unit = int(rb.max())
    choices = ["traces"] + [f"file:{n}" for n in profiles] + [f"traces+{n}" for n in profiles]

    ref_profile = f"file:{next(iter(profiles))}" if profiles else "traces"
    defaults = Arm("engine defaults", {"profile": ref_profile, **ENGINE_DEFAULTS})
    comm = dict(COMMUNITY, lag=COMMUNITY["lag"] if COMMUNITY["lag"] in space["lag"] else 1)
    community = Arm("community (hand-tuned)", {"profile": ref_profile, **comm})
    sampled = _grid_sample(candidates, seed, space)
    rng = np.random.default_rng(seed + 1)
    arms = [Arm(f"candidate {i}", {"profile": choices[int(rng.integers(len(choices)))], **s})
            for i, s in enumerate(sampled)]
    seen = {tuple(a.settings[x] for x in KEYS) for a in (defaults, community)}
    uniq = []
    for a in arms:
        t = tuple(a.settings[x] for x in KEYS)
        if t not in seen:
            seen.add(t)
            uniq.append(a)
    arms = uniq
    # rungs: enough halvings to bring the draw down to about eta settings on the last rung (all k folds)
    n_rungs = max(1, min(math.ceil(math.log(len(arms)) / math.log(eta)) if len(arms) > 1 else 1, k))
    folds_at = [max(1, round(k * (i + 1) / n_rungs)) for i in range(n_rungs)]
    folds_at[-1] = k
    evaluated = 0
    common = dict(slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes, cost=cost, pace_unit=pace_unit)

    def run(batch: list[tuple[Arm, int]]) -> None:
        nonlocal evaluated
        todo = [(a, f) for a, f in batch if f not in a.folds]
        if not todo:
            return
        if mapper is None:
            outs = folds.score([(dict(a.settings), f) for a, f in todo], common, progress)
        else:
            outs = mapper(score_task, [(folds.fold_data(f), dict(a.settings), common) for a, f in todo])
        for (a, f), o in zip(todo, outs):
            a.folds[f] = o
            evaluated += 1
            if progress is not None and mapper is not None:
                progress.update(advance=1)

    rungs = []
    alive = arms
    for i, nf in enumerate(folds_at):
        run([(a, f) for a in alive for f in range(nf)])
        for a in alive:
            a.rung = i
        rungs.append({"rung": i, "folds": nf, "settings": len(alive)})
        if i < len(folds_at) - 1:
            keep = max(1, math.ceil(len(alive) / eta))
            alive = sorted(alive, key=lambda a: (-a.mean(key), a.name))[:keep]
    run([(a, f) for a in (defaults, community) for f in range(k)])
    defaults.rung = community.rung = len(folds_at) - 1
    finalists = [a for a in arms + [defaults, community] if len(a.folds) == k]
    # ties go to the engine's defaults, then the community settings: a tie is no reason to change a flag
    rank = {id(defaults): 0, id(community): 1}
    finalists.sort(key=lambda a: (-a.mean(key), rank.get(id(a), 2), a.name))
    best = finalists[0]

    def paired(a: Arm, b: Arm) -> tuple[float, float, float]:
        return t_interval([a.folds[f][key] - b.folds[f][key] for f in range(k)])

    # the engine's slot count: as given, or what the byte budget holds with the best's profile (fold 0's build)
    plan = plan_tier(n_layers, n_expert, folds.profiles(0)[best.settings["profile"]], slots=slots,
                     budget_bytes=budget_bytes, blob_bytes=blob_bytes, admission=best.settings["admission"])
    n_slots = int(slots) if slots is not None else int(plan.n_slots)
    flags = engine_flags(best.settings, n_slots=n_slots, profile_names=dict(profile_paths or {n: n for n in profiles}),
                         pace_unit=pace_unit, traces_hint=" ".join(trace_paths or ["TRACES"]),
                         geometry=(n_layers, n_expert), phase=count_phase)
    return TuneResult(objective, k, folds.n_requests, best, defaults, community, finalists,
                      evaluated, len(arms), rungs,
                      {"slots": slots, "budget_bytes": budget_bytes, "eta": eta, "seed": seed, "phase": phase,
                       "profiles": choices, "space": space, "strata_version": version, "pace_unit_bytes": pace_unit},
                      paired(best, defaults), paired(best, community),
                      cost.to_dict() if cost is not None else None, flags, folds.skipped(), list(folds.notes))


def plot_tune(res: TuneResult, top: int = 10) -> bytes:
    """PNG: held-out score (mean and 95% interval) of the top finalists and the two references."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = res.key
    rows = res.finalists[:top]
    for ref in (res.defaults, res.community):
        if ref not in rows:
            rows.append(ref)
    rows = sorted(rows, key=lambda a: a.mean(k))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    ys = np.arange(len(rows))
    ds = [a.to_dict(k) for a in rows]
    m = np.array([d["mean"] for d in ds])
    err = np.array([[d["mean"] - d["low"] for d in ds], [d["high"] - d["mean"] for d in ds]])
    colours = ["tab:green" if a is res.best else "tab:gray" if a is res.defaults else "tab:orange"
               if a is res.community else "tab:blue" for a in rows]
    scale = 100.0 if k == "h_expert" else 1.0
    ax.barh(ys, m * scale, xerr=err * scale, color=colours, capsize=3)
    ax.set_yticks(ys)
    ax.set_yticklabels([_short(a) for a in rows], fontsize=8)
    ax.set_xlabel("held-out h_expert (%)" if k == "h_expert" else "predicted decode tok/s (model)")
    lo = float(np.nanmin(m - err[0])) * scale
    ax.set_xlim(left=max(0.0, lo - 0.05 * abs(lo)))
    ax.set_title(f"tune: {res.k}-fold held-out by request, 95% intervals")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _short(a: Arm) -> str:
    s = a.settings
    return (f"{a.name}: {s['profile']}, {s['admission']}, every {s['adapt_every']}, swaps {s['max_moves']}, "
            f"decay {s['decay']}, lag {s['lag']}, pace {s['pace_slots']}")
