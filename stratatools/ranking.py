"""Building profiles from routing traces, as Strata's ``tools/make_profile.py`` does (formats.md section 4).

1. Count (layer, expert) occurrences over all traces (weights ignored in the default ``count`` weighting).
2. Sort by count descending; ties by smaller layer, then smaller expert.
3. Concatenate without repeats, by mode: ``default`` base, traces, fill; ``reorder`` traces, base, fill;
   ``no-base`` traces, fill.
4. Fill every pair not yet ranked, ``expert-major`` ((0,0), (1,0), ..., (L-1,0), (0,1), ...) by default or
   ``layer-major`` ((0,0), (0,1), ...).
5. n_ranked = slots = L*E.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import StrataError
from .profile import Profile
from .trace import DECODE, TraceTable

MODES = ("default", "reorder", "no-base")
FILLS = ("expert-major", "layer-major", "none")


@dataclass
class CountResult:
    """Per-pair routing counts and what was left out.

    Attributes:
        counts: float64 [L, E] (integer-valued for ``count`` weighting).
        used_entries: routed entries counted.
        skipped_layer: entries whose layer is outside [0, L) (an MTP block, another model).
        skipped_expert: entries whose expert is outside [0, E).
        skipped_phase: entries left out by the phase filter.
    """

    counts: np.ndarray
    used_entries: int = 0
    skipped_layer: int = 0
    skipped_expert: int = 0
    skipped_phase: int = 0
    per_input: list[dict] = field(default_factory=list)


def count_pairs(tables: Sequence[TraceTable], n_layers: int, n_expert: int, *, phase: str = "all",
                weighting: str = "count", weights: Sequence[float] | None = None) -> CountResult:
    """Count routed (layer, expert) entries over traces.

    Args:
        tables: traces; each may carry its own weight in ``weights`` (default 1.0).
        phase: ``"all"`` or ``"decode"`` (drops entries whose phase is known to be prefill).
        weighting: ``"count"`` (each entry counts 1, as Strata) or ``"weight"`` (router weight; a zero weight,
            as in verify windows, counts 1).
    Raises:
        StrataError: unknown phase/weighting, or weights of the wrong length.
    """
    if phase not in ("all", "decode"):
        raise StrataError(f"unknown phase filter {phase!r} (use decode or all)")
    if weighting not in ("count", "weight"):
        raise StrataError(f"unknown weighting {weighting!r} (use count or weight)")
    if weights is not None and len(weights) != len(tables):
        raise StrataError(f"{len(weights)} trace weights for {len(tables)} traces")
    res = CountResult(np.zeros(n_layers * n_expert, dtype=np.float64))
    for i, t in enumerate(tables):
        w_in = 1.0 if weights is None else float(weights[i])
        keep = np.ones(len(t), dtype=bool)
        if phase == "decode":
            ph = t.phase != 0  # PREFILL == 0; unknown phases are kept
            res.skipped_phase += int((~ph).sum())
            keep &= ph
        lay = t.layer.astype(np.int64)
        exp = t.expert.astype(np.int64)
        bad_l = keep & ((lay < 0) | (lay >= n_layers))
        res.skipped_layer += int(bad_l.sum())
        keep &= ~bad_l
        bad_e = keep & ((exp < 0) | (exp >= n_expert))
        res.skipped_expert += int(bad_e.sum())
        keep &= ~bad_e
        flat = lay[keep] * n_expert + exp[keep]
        if weighting == "count":
            c = np.bincount(flat, minlength=n_layers * n_expert).astype(np.float64)
        else:
            w = t.weight[keep].astype(np.float64)
            w = np.where(w == 0, 1.0, w)
            c = np.bincount(flat, weights=w, minlength=n_layers * n_expert)
        res.counts += w_in * c
        res.used_entries += int(keep.sum())
        res.per_input.append({"entries": int(len(t)), "used": int(keep.sum()), "weight": w_in})
    res.counts = res.counts.reshape(n_layers, n_expert)
    return res


def order_by_count(counts: np.ndarray) -> np.ndarray:
    """Flat indices of pairs with count > 0, count descending, ties by (layer, expert) ascending. int64 [n]."""
    flat = counts.ravel()
    nz = np.nonzero(flat > 0)[0]
    # stable sort on -count keeps the ascending flat order (= layer, then expert) among ties
    return nz[np.argsort(-flat[nz], kind="stable")]


def fill_order(n_layers: int, n_expert: int, fill: str) -> np.ndarray:
    """Flat indices of every pair in fill order (``expert-major`` or ``layer-major``)."""
    flat = np.arange(n_layers * n_expert, dtype=np.int64)
    if fill == "layer-major":
        return flat
    if fill == "expert-major":
        return flat.reshape(n_layers, n_expert).T.ravel()
    raise StrataError(f"unknown fill {fill!r} (use expert-major, layer-major or none)")


def concat_unique(parts: Sequence[np.ndarray], size: int) -> np.ndarray:
    """Concatenate flat-index arrays keeping each index's first occurrence, in order."""
    if not parts:
        return np.zeros(0, dtype=np.int64)
    allv = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    seen = np.zeros(size, dtype=bool)
    _, first = np.unique(allv, return_index=True)
    keep = np.zeros(len(allv), dtype=bool)
    keep[first] = True
    del seen
    return allv[keep]


def build_profile(counts: np.ndarray, *, base: Profile | None = None, mode: str = "default",
                  fill: str = "expert-major") -> Profile:
    """Rank pairs from counts [L, E] as Strata's make_profile does; see the module docstring.

    Raises:
        StrataError: unknown mode or fill, or a base of another geometry.
    """
    L, E = counts.shape
    if mode not in MODES:
        raise StrataError(f"unknown mode {mode!r} (use {', '.join(MODES)})")
    if base is not None and (base.n_layers, base.n_expert) != (L, E):
        raise StrataError(f"base profile is {base.n_layers} x {base.n_expert}, the model is {L} x {E}")
    traced = order_by_count(counts)
    base_flat = base.flat() if (base is not None and mode != "no-base") else np.zeros(0, dtype=np.int64)
    parts = [base_flat, traced] if mode == "default" else [traced, base_flat]
    if fill != "none":
        parts.append(fill_order(L, E, fill))
    flat = concat_unique(parts, L * E)
    pairs = np.stack([flat // E, flat % E], axis=1)
    return Profile(L, E, pairs)


def make_profile(tables: Sequence[TraceTable], n_layers: int, n_expert: int, *, base: Profile | None = None,
                 mode: str = "default", fill: str = "expert-major", phase: str = "all",
                 weighting: str = "count", weights: Sequence[float] | None = None) -> tuple[Profile, CountResult]:
    """Count traces and build the profile; returns (profile, counts report). See :func:`count_pairs`."""
    res = count_pairs(tables, n_layers, n_expert, phase=phase, weighting=weighting, weights=weights)
    return build_profile(res.counts, base=base, mode=mode, fill=fill), res


__all__ = ["CountResult", "count_pairs", "order_by_count", "fill_order", "build_profile", "make_profile",
           "MODES", "FILLS", "DECODE"]
