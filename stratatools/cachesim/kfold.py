"""Held-out evaluation: k-fold by request (a fold never splits a request or a prompt).

Folds: the distinct request ids (made distinct per input trace by :func:`.replay.merge_traces`) in ascending
order, request i going to fold ``i % k``. For each fold, a profile is built as
:func:`stratatools.profiles.ranking.make_profile` would on the other k-1 folds and scored on the held-out fold; the
in-sample number builds and scores on everything. Interval: mean +- t(0.975, k-1) * sd / sqrt(k), the
two-sided 95% Student-t interval over the k fold scores (sd with k-1 degrees of freedom).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile
from stratatools.traces.table import PREFILL, TraceTable
from stratatools.cachesim.replay import BandwidthModel

# two-sided 95% Student-t quantiles t(0.975, df), df 1..30, then 40, 60, 120 and the normal limit
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
         2.042]
_T975_TAIL = [(40, 2.021), (60, 2.000), (120, 1.980)]


def t975(df: int) -> float:
    """t quantile 0.975 with ``df`` degrees of freedom (table, linear in 1/df between 30, 40, 60, 120, inf)."""
    if df < 1:
        return float("nan")
    if df <= 30:
        return _T975[df - 1]
    pts = [(30, _T975[-1])] + _T975_TAIL + [(math.inf, 1.960)]
    for (d0, t0), (d1, t1) in zip(pts, pts[1:]):
        if df <= d1:
            x0, x1, x = 1 / d0, (0.0 if d1 == math.inf else 1 / d1), 1 / df
            return t0 + (t1 - t0) * (x0 - x) / (x0 - x1)
    return 1.960


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high) of the 95% t-interval; low = high = mean for a single value."""
    v = np.asarray(values, dtype=np.float64)
    m = float(v.mean())
    if len(v) < 2:
        return m, m, m
    half = t975(len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))
    return m, m - half, m + half


def fold_count_pass(main: Any, folds: Sequence[Any], k: int, L: int, E: int, phase: str,
                    advance: Any = None) -> np.ndarray:
    """One pass over ``main``'s raw chunks (an :class:`~stratatools.cachesim.replay.EntryStream`): each fold
    stream of ``folds`` scans its requests (``scan_fold`` / ``end_scan``), and (layer, expert) entries are counted
    per fold (merged request id % k) with make-profile's filter (layer and expert in range; under
    ``phase="decode"`` prefill entries left out). ``advance(n)`` is called with each chunk's entry count.

    Returns counts int64 [k, L, E].
    """
    counts = np.zeros(k * L * E, dtype=np.int64)
    for c in main.raw_chunks():
        for fs in folds:
            fs.scan_fold(c)
        lay, ex = c["layer"], c["expert"]
        keep = (lay >= 0) & (lay < L) & (ex >= 0) & (ex < E)
        if phase == "decode":
            keep &= c["phase"] != PREFILL
        fk = (c["request"] % k)[keep]
        counts += np.bincount(fk * (L * E) + lay[keep] * E + ex[keep], minlength=k * L * E)
        if advance is not None:
            advance(len(lay))
    for fs in folds:
        fs.end_scan()
    return counts.reshape(k, L, E)

@dataclass
class KFoldResult:
    """Held-out and in-sample scores.

    Attributes:
        k: folds; requests: distinct requests; policies: the policies scored.
        folds: per fold ``{"fold", "requests", "entries", "h_expert": {policy: x}, "h_layer": {...}}``.
        mean, low, high: per policy, held-out h_expert mean and 95% interval.
        in_sample: per policy, h_expert of the profile built on all traces, scored on all.
    """

    k: int
    requests: int
    policies: list[str]
    folds: list[dict[str, Any]] = field(default_factory=list)
    mean: dict[str, float] = field(default_factory=dict)
    low: dict[str, float] = field(default_factory=dict)
    high: dict[str, float] = field(default_factory=dict)
    in_sample: dict[str, float] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def fold_of_requests(request: np.ndarray, k: int) -> np.ndarray:
    """Fold index per entry: distinct request ids ascending, the i-th one in fold ``i % k``. int64 [N]."""
    u, inv = np.unique(request, return_inverse=True)
    if k < 2:
        raise StrataError(f"--kfold {k}: need at least 2 folds")
    if len(u) < 2:
        raise StrataError(f"--kfold {k}: the traces hold only {len(u)} request; held-out evaluation needs traces "
                          f"of at least 2 requests (a fold never splits a request)")
    if len(u) < k:
        raise StrataError(f"--kfold {k}: the traces hold only {len(u)} request(s); a fold never splits a request, "
                          f"so use at most {len(u)} folds (or traces with more requests)")
    return (np.arange(len(u)) % k)[inv]


def kfold_eval(tables: Sequence[TraceTable] | TraceTable, n_layers: int, n_expert: int, k: int, *,
               policies: Sequence[str] = ("static",), slots: int | None = None, budget_bytes: int | None = None,
               blob_bytes=None, admission: str = "global", phase: str = "decode", mode: str = "no-base",
               fill: str = "expert-major", base: Profile | None = None, bandwidth: BandwidthModel | None = None,
               policy_params: dict[str, dict] | None = None, chunk: int | None = None,
               progress=None, stream=None, client=None,
               cold: bool = False) -> KFoldResult:
    """k-fold held-out evaluation of profiles built by make-profile (module docstring), streamed.

    Two passes over the traces, in memory independent of their length: the first assigns every request to its
    fold (merged request id % k), counts (layer, expert) per fold and notes each fold's layer-major batches;
    the profiles are built from the counts (fold f's: every count but fold f's, as make-profile would count
    the other folds' traces); the second pass replays every fold's held-out entries (prepared as a trace of
    those requests alone would be) and the in-sample run, chunk by chunk, without materialising any fold.

    Args:
        tables: traces (TraceTables or chunk sources, :func:`.replay.as_source`).
        policies: tiers that use the profile (``static``, ``adaptive``).
        mode, fill, base: make-profile options (formats.md 4; ``no-base`` by default: traces then fill).
        phase: replay phase filter, also used for counting (``decode`` counts decode entries only).
        cold: drop the prefill from the replay instead of replaying it uncounted (:func:`.replay.prepare_entries`).
        chunk: entries per chunk (results do not depend on it); progress: ``update(advance=x)``, advanced by
            1 per pass (2 in all), or by 2 / (k + 1) per Dask task.
        stream: the :class:`.replay.EntryStream` of ``tables`` when the caller has one (its scan is reused).
        client: a ``distributed.Client``: every fold and the in-sample run are Dask tasks (each reopens the
            sources from their ``spec`` and makes both passes for its part); the same result.
    Raises:
        StrataError: fewer requests than folds, k < 2, budget or policy problems.
    """
    kw = dict(policies=list(policies), slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes,
              admission=admission, phase=phase, mode=mode, fill=fill, base=base, bandwidth=bandwidth,
              policy_params=policy_params, chunk=chunk, cold=cold)
    for p in policies:
        if p not in ("static", "adaptive"):
            raise StrataError(f"k-fold scores profile-driven tiers (static, adaptive), not {p!r}")
    if client is None:
        return _kfold(tables, n_layers, n_expert, k, only=None, progress=progress, stream=stream, **kw)
    from stratatools.core.cluster import run_tasks

    specs = [s.spec for s in (tables if isinstance(tables, (list, tuple)) else [tables])]
    if k < 2:
        raise StrataError(f"--kfold {k}: need at least 2 folds")

    class _P:
        def update(self, advance: int = 0, **_):
            if progress is not None:
                progress.update(advance=2 * advance / (k + 1))

    parts = run_tasks(client, _kfold_task, [(specs, n_layers, n_expert, k, f, kw) for f in list(range(k)) + [-1]],
                      name="kfold", progress=_P())
    res = parts[-1]
    res.folds = [p.folds[0] for p in parts[:-1]]
    for p in policies:
        m, lo, hi = t_interval([row["h_expert"][p] for row in res.folds])
        res.mean[p], res.low[p], res.high[p] = m, lo, hi
    return res


def _kfold_task(specs, n_layers, n_expert, k, f, kw) -> KFoldResult:
    from stratatools.traces.sources import open_source

    srcs = [open_source(*s[:4], where=s[4], partition=s[5]) for s in specs]
    return _kfold(srcs, n_layers, n_expert, k, only=f, **kw)


def _kfold(tables, n_layers: int, n_expert: int, k: int, *, policies, slots, budget_bytes, blob_bytes, admission,
           phase, mode, fill, base, bandwidth, policy_params, chunk, only=None, progress=None,
           stream=None, cold=False) -> KFoldResult:
    """The k-fold's two passes; ``only``: None (every fold and the in-sample run), a fold index (that fold
    alone: ``folds`` holds its row) or -1 (the in-sample run alone)."""
    from stratatools.cachesim.replay import EntryStream, RunGroup
    from stratatools.profiles.ranking import build_profile

    pp = policy_params or {}
    srcs = [tables] if isinstance(tables, TraceTable) else list(tables)
    main = stream if stream is not None else EntryStream(srcs, n_layers, n_expert, phase=phase, chunk=chunk,
                                                                  cold=cold)
    n_req = int(main._req_base[-1] + len(main._req_ids[-1]))
    if k < 2:
        raise StrataError(f"--kfold {k}: need at least 2 folds")
    if n_req < k:
        raise StrataError(f"--kfold {k}: the traces hold only {n_req} request(s); a fold never splits a request, "
                          f"so use at most {n_req} folds (or traces with more requests)")
    L, E = int(n_layers), int(n_expert)
    todo = list(range(k)) if only is None else ([] if only == -1 else [only])
    in_sample = only is None or only == -1
    folds = {f: EntryStream(None, L, E, phase=phase, fold=(k, f), parent=main, cold=cold) for f in todo}
    raw = max(main.raw_entries, 1)
    counts = fold_count_pass(main, list(folds.values()), k, L, E, phase,
                             None if progress is None else (lambda n: progress.update(advance=n / raw)))
    total = counts.sum(0)
    res = KFoldResult(k=k, requests=n_req, policies=list(policies),
                      options={"mode": mode, "fill": fill, "phase": phase, "cold": cold, "admission": admission,
                               "slots": slots, "budget_bytes": budget_bytes})
    common = dict(slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes, admission=admission)
    for f in range(k):
        if counts[f].sum() == 0:
            raise StrataError(f"fold {f}: the held-out requests hold no usable entries; use fewer folds")
    groups = {}
    for f in todo:
        prof = build_profile((total - counts[f]).astype(np.float64), base=base, mode=mode, fill=fill)
        groups[f] = RunGroup(folds[f], [dict(policy=p, profile=prof, **common, **pp.get(p, {}))
                                        for p in policies], bandwidth)
    g_all = None
    if in_sample:
        prof_all = build_profile(total.astype(np.float64), base=base, mode=mode, fill=fill)
        g_all = RunGroup(main, [dict(policy=p, profile=prof_all, **common, **pp.get(p, {})) for p in policies],
                         bandwidth)
    # pass 2: every fold's held-out replay and the in-sample replay, one chunk at a time
    main.begin()
    for fs in folds.values():
        fs.begin()
    for c in main.raw_chunks():
        if g_all is not None:
            e = main.prepare(c)
            if e is not None:
                g_all.feed(e)
        for f, fs in folds.items():
            ef = fs.prepare(c)
            if ef is not None:
                groups[f].feed(ef)
        if progress is not None:
            progress.update(advance=len(c["layer"]) / raw)
    if g_all is not None:
        main.end()
    for f, fs in folds.items():
        fs.end()
        row: dict[str, Any] = {"fold": f, "requests": len(range(f, n_req, k)), "entries": fs.n_counted,
                               "h_expert": {}, "h_layer": {}}
        for p, r in zip(policies, groups[f].results()):
            row["h_expert"][p] = r.h_expert
            row["h_layer"][p] = r.h_layer
        res.folds.append(row)
    if g_all is not None:
        for p, r in zip(policies, g_all.results()):
            res.in_sample[p] = r.h_expert
            if only is None:
                m, lo, hi = t_interval([row["h_expert"][p] for row in res.folds])
                res.mean[p], res.low[p], res.high[p] = m, lo, hi
    return res
