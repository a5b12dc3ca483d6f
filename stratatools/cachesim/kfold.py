"""Held-out evaluation: k-fold by request (a fold never splits a request or a prompt).

Folds: the distinct request ids (made distinct per input trace by :func:`.replay.merge_traces`) in ascending
order, request i going to fold ``i % k``. For each fold, a profile is built with
:func:`stratatools.profiles.ranking.make_profile` on the other k-1 folds and scored on the held-out fold; the
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
from stratatools.profiles.ranking import make_profile
from stratatools.traces.table import TraceTable
from stratatools.cachesim.replay import BandwidthModel, merge_traces, prepare_entries, simulate_policy

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
    if len(u) < k:
        raise StrataError(f"--kfold {k}: the traces hold only {len(u)} request(s); a fold never splits a request, "
                          f"so use at most {len(u)} folds (or traces with more requests)")
    return (np.arange(len(u)) % k)[inv]


def kfold_eval(tables: Sequence[TraceTable] | TraceTable, n_layers: int, n_expert: int, k: int, *,
               policies: Sequence[str] = ("static",), slots: int | None = None, budget_bytes: int | None = None,
               blob_bytes=None, admission: str = "global", phase: str = "decode", mode: str = "no-base",
               fill: str = "expert-major", base: Profile | None = None, bandwidth: BandwidthModel | None = None,
               policy_params: dict[str, dict] | None = None, cold: bool = False) -> KFoldResult:
    """k-fold held-out evaluation of profiles built by make-profile (module docstring).

    Args:
        policies: tiers that use the profile (``static``, ``adaptive``).
        mode, fill, base: make-profile options (formats.md 4; ``no-base`` by default: traces then fill).
        phase: replay phase filter, also used for counting (``decode`` counts decode entries only).
        cold: drop the prefill from the replay instead of replaying it uncounted (:func:`.replay.prepare_entries`).
    Raises:
        StrataError: fewer requests than folds, k < 2, budget or policy problems.
    """
    table = tables if isinstance(tables, TraceTable) else merge_traces(list(tables))
    pp = policy_params or {}
    for p in policies:
        if p not in ("static", "adaptive"):
            raise StrataError(f"k-fold scores profile-driven tiers (static, adaptive), not {p!r}")
    fold = fold_of_requests(table.request.astype(np.int64), k)
    count_phase = "decode" if phase == "decode" else "all"
    res = KFoldResult(k=k, requests=int(len(np.unique(table.request))), policies=list(policies),
                      options={"mode": mode, "fill": fill, "phase": phase, "cold": cold, "admission": admission,
                               "slots": slots, "budget_bytes": budget_bytes})
    common = dict(slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes, admission=admission,
                  bandwidth=bandwidth)
    for f in range(k):
        train = table.take(fold != f)
        test = table.take(fold == f)
        prof, _ = make_profile([train], n_layers, n_expert, base=base, mode=mode, fill=fill, phase=count_phase)
        try:
            ent = prepare_entries(test, n_layers, n_expert, phase=phase, cold=cold)
        except StrataError:
            raise StrataError(f"fold {f}: the held-out requests hold no usable entries; use fewer folds") from None
        row: dict[str, Any] = {"fold": f, "requests": int(len(np.unique(test.request))), "entries": ent.n_counted,
                               "h_expert": {}, "h_layer": {}}
        for p in policies:
            r = simulate_policy(ent, p, profile=prof, **common, **pp.get(p, {}))
            row["h_expert"][p] = r.h_expert
            row["h_layer"][p] = r.h_layer
        res.folds.append(row)
    prof_all, _ = make_profile([table], n_layers, n_expert, base=base, mode=mode, fill=fill, phase=count_phase)
    ent_all = prepare_entries(table, n_layers, n_expert, phase=phase, cold=cold)
    for p in policies:
        m, lo, hi = t_interval([row["h_expert"][p] for row in res.folds])
        res.mean[p], res.low[p], res.high[p] = m, lo, hi
        res.in_sample[p] = simulate_policy(ent_all, p, profile=prof_all, **common, **pp.get(p, {})).h_expert
    return res
