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

from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile
from stratatools.traces.table import DECODE, PREFILL, TraceTable

MODES = ("default", "reorder", "no-base")
FILLS = ("expert-major", "layer-major", "none")


@dataclass
class CountResult:
    """Per-pair routing counts and what was left out.

    Attributes:
        counts: float64 [L, E] (integer-valued for ``count`` weighting; scaled by per-trace weights).
        used_entries: routed entries counted.
        skipped_layer: entries whose layer is outside [0, L) (an MTP block, another model).
        skipped_layers: {layer: entries} of those, for the report.
        skipped_expert: entries whose expert is outside [0, E) (the readers refuse these when given E, so this
            is non-zero only for tables built in memory).
        skipped_phase: entries left out by the phase filter.
        per_input: per trace {entries, used, weight, skipped_layer, skipped_phase}.
    """

    counts: np.ndarray
    used_entries: int = 0
    skipped_layer: int = 0
    skipped_expert: int = 0
    skipped_phase: int = 0
    skipped_layers: dict = field(default_factory=dict)
    per_input: list[dict] = field(default_factory=list)


COUNT_CHUNK = 1 << 23
SOURCE_CHUNK = 1 << 20  # entries per chunk read from a chunk source (int64 columns: ~60 MB)


def count_pairs(tables: Sequence[TraceTable], n_layers: int, n_expert: int, *, phase: str = "all",
                weighting: str = "count", weights: Sequence[float] | None = None, progress=None,
                client=None) -> CountResult:
    """Count routed (layer, expert) entries over traces (formats.md section 4, step 1).

    Args:
        tables: traces (TraceTables, or chunk sources of :mod:`stratatools.traces.sources`, read chunk by
            chunk); each may carry its own weight in ``weights`` (default 1.0; a trace's counts are multiplied by
            it before merging).
        n_layers, n_expert: L and E of the model; entries of layers outside [0, L) are left out and counted
            (``skipped_layer``), as are expert ids outside [0, E).
        phase: ``"all"`` (every entry, as Strata's make_profile) or ``"decode"`` (drops entries whose phase is
            known to be prefill; unknown phases are kept).
        weighting: ``"count"`` (each entry counts 1, as Strata) or ``"weight"`` (router weight; a zero weight,
            as in verify windows, counts 1).
    Returns:
        a :class:`CountResult`; counts are accumulated in float64 chunk by chunk (8M entries), so memory stays
        at a few hundred MB for any trace length.
    Raises:
        StrataError: unknown phase/weighting, weights of the wrong length, a negative or non-finite weight.
        progress: optional callable(n_done, n_total) after each trace.
        client: a ``distributed.Client`` (:mod:`stratatools.core.cluster`): each trace (a chunk source with a
            ``spec``) is counted by a task and the counts combined in input order (the same result).
    """
    if phase not in ("all", "decode"):
        raise StrataError(f"unknown phase filter {phase!r} (use decode or all)")
    if weighting not in ("count", "weight"):
        raise StrataError(f"unknown weighting {weighting!r} (use count or weight)")
    if weights is not None and len(weights) != len(tables):
        raise StrataError(f"{len(weights)} trace weights for {len(tables)} traces")
    if weights is not None:
        for w in weights:
            if not np.isfinite(w) or w < 0:
                raise StrataError(f"trace weight {w} must be a finite number >= 0")
    from stratatools.traces.formats.strata import no_hugepages

    with no_hugepages():
        return _count_pairs(tables, n_layers, n_expert, phase, weighting, weights, progress, client)


def _count_one(t, n_layers: int, n_expert: int, phase: str, weighting: str) -> dict:
    """Counts of one trace (a TraceTable or a chunk source) for :func:`count_pairs`."""
    size = n_layers * n_expert
    skl: dict = {}
    c = np.zeros(size, dtype=np.int64 if weighting == "count" else np.float64)
    used = sk_l = sk_p = sk_e = 0
    rec = t.records if isinstance(t, TraceTable) else None
    if rec is not None and rec.constant_k:
        used, sk_l, sk_p, sk_e = _count_records(rec, n_layers, n_expert, phase, weighting, c, skl)
    if isinstance(t, TraceTable):
        n_t = len(t)
        chunks = ({"layer": t.layer[a:a + COUNT_CHUNK], "expert": t.expert[a:a + COUNT_CHUNK],
                   "phase": t.phase[a:a + COUNT_CHUNK] if phase == "decode" else None,
                   "weight": t.weight[a:a + COUNT_CHUNK] if weighting == "weight" else None}
                  for a in range(0, n_t if rec is None or not rec.constant_k else 0, COUNT_CHUNK))
    else:  # a chunk source (stratatools.traces.sources): read chunk by chunk, whatever its length
        n_t = 0
        chunks = t.chunks(SOURCE_CHUNK)
    for ch in chunks:
        lay = np.asarray(ch["layer"]).astype(np.int64)
        exp = np.asarray(ch["expert"]).astype(np.int64)
        if not isinstance(t, TraceTable):
            n_t += len(lay)
        keep = np.ones(len(lay), dtype=bool)
        if phase == "decode":
            pre = np.asarray(ch["phase"]) == PREFILL
            sk_p += int(pre.sum())
            keep &= ~pre
        bad_l = keep & ((lay < 0) | (lay >= n_layers))
        nbl = int(bad_l.sum())
        if nbl:
            sk_l += nbl
            _tally_layers(lay[bad_l], 1, skl)
            keep &= ~bad_l
        bad_e = keep & ((exp < 0) | (exp >= n_expert))
        sk_e += int(bad_e.sum())
        keep &= ~bad_e
        flat = lay[keep] * n_expert + exp[keep]
        if weighting == "count":
            c += np.bincount(flat, minlength=size)
        else:
            wt = ch.get("weight")
            wt = np.ones(len(lay), np.float32) if wt is None else wt
            w = np.asarray(wt)[keep].astype(np.float64)
            w = np.where(w == 0, 1.0, w)
            c += np.bincount(flat, weights=w, minlength=size)
        used += int(keep.sum())
    return {"c": c, "used": used, "sk_l": sk_l, "sk_p": sk_p, "sk_e": sk_e, "skl": skl, "n": n_t}


def _count_task(spec, n_layers, n_expert, phase, weighting):
    from stratatools.traces.sources import open_source

    return _count_one(open_source(*spec[:4], where=spec[4], partition=spec[5]), n_layers, n_expert, phase,
                      weighting)


def _count_pairs(tables: Sequence[TraceTable], n_layers: int, n_expert: int, phase: str, weighting: str,
                 weights: Sequence[float] | None, progress=None, client=None) -> CountResult:
    size = n_layers * n_expert
    total = np.zeros(size, dtype=np.float64)
    res = CountResult(total)
    if client is not None:
        from stratatools.core.cluster import run_tasks

        class _P:
            def __init__(self):
                self.i = 0

            def update(self, advance: int = 0, **_):
                self.i += advance
                if progress is not None:
                    progress(self.i, len(tables))

        parts = run_tasks(client, _count_task, [(t.spec, n_layers, n_expert, phase, weighting) for t in tables],
                          name="count", progress=_P())
    else:
        parts = None
    for i, t in enumerate(tables):
        w_in = 1.0 if weights is None else float(weights[i])
        r = parts[i] if parts is not None else _count_one(t, n_layers, n_expert, phase, weighting)
        c, used, sk_l, sk_p, n_t = r["c"], r["used"], r["sk_l"], r["sk_p"], r["n"]
        res.skipped_expert += r["sk_e"]
        for k, v in r["skl"].items():
            res.skipped_layers[k] = res.skipped_layers.get(k, 0) + v
        total += w_in * c
        res.used_entries += used
        res.skipped_layer += sk_l
        res.skipped_phase += sk_p
        res.per_input.append({"entries": int(n_t), "used": used, "weight": w_in, "skipped_layer": sk_l,
                              "skipped_phase": sk_p})
        if progress is not None:
            progress(i + 1, len(tables))
    res.counts = total.reshape(n_layers, n_expert)
    return res


def _tally_layers(bad_layers: np.ndarray, per: int, skipped_layers: dict) -> None:
    """Add ``per`` entries to ``skipped_layers[layer]`` for every element of ``bad_layers`` (int64, not empty)."""
    off = int(bad_layers.min())
    hist = np.bincount(bad_layers - off)
    for v in np.flatnonzero(hist):
        skipped_layers[int(v) + off] = skipped_layers.get(int(v) + off, 0) + int(hist[v]) * per


def _count_records(rec, n_layers: int, n_expert: int, phase: str, weighting: str, c: np.ndarray,
                   skipped_layers: dict) -> tuple[int, int, int, int]:
    """count_pairs on the compact per-record form with a constant k (ids [R, k], possibly strided views into
    the mapped file): layer and phase filters per record, one bincount of ``layer * E + id`` per chunk of
    records. Adds into ``c`` and ``skipped_layers``; returns (used, skipped_layer, skipped_phase,
    skipped_expert) in entries."""
    k = int(rec.k)
    R = len(rec)
    used = sk_l = sk_p = sk_e = 0
    step = max(1, COUNT_CHUNK // k)
    for a in range(0, R, step):
        b = min(R, a + step)
        lay = rec.layer[a:b].astype(np.int64)
        keep = None
        if phase == "decode" and not (rec.phase.strides == (0,) and int(rec.phase[0]) != PREFILL):
            pre = np.asarray(rec.phase[a:b]) == PREFILL
            sk_p += int(pre.sum()) * k
            keep = ~pre
        lo, hi = int(lay.min()), int(lay.max())
        if lo < 0 or hi >= n_layers:
            bad = (lay < 0) | (lay >= n_layers)
            if keep is not None:
                bad &= keep
            bl = lay[bad]
            if len(bl):
                sk_l += len(bl) * k
                _tally_layers(bl, k, skipped_layers)
            keep = ~bad if keep is None else keep & ~bad
        ids = rec.expert[a:b]
        w = rec.weight[a:b] if weighting == "weight" else None
        if keep is not None:
            lay, ids = lay[keep], ids[keep]
            w = w[keep] if w is not None else None
        flat = lay[:, None] * n_expert + ids
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n_expert):
            ok = (ids >= 0) & (ids < n_expert)
            sk_e += int((~ok).sum())
            flat = flat[ok]
            w = w[ok] if w is not None else None
        flat = flat.reshape(-1)
        if w is None:
            c += np.bincount(flat, minlength=len(c))
        else:
            w = np.asarray(w, np.float64).reshape(-1)
            c += np.bincount(flat, weights=np.where(w == 0, 1.0, w), minlength=len(c))
        used += len(flat)
    return used, sk_l, sk_p, sk_e


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


# -- make-profile from files (the library side of `stratatools make-profile`) ---------------------------------------

@dataclass
class MakeProfileResult:
    """What ``make-profile`` built.

    Attributes:
        output: the STRP file; sidecar: its provenance JSON.
        n_layers, n_expert: the model geometry used (L, E).
        mode, fill, phase, weighting: the options.
        inputs: per trace {path, format, sha256, weight, entries, used, skipped_layer, skipped_phase}.
        used_entries, skipped_layer, skipped_layers ({layer: entries}, e.g. an MTP block), skipped_phase: counts.
        traced_pairs: pairs with a non-zero count. from_base, from_traces, from_fill: how many of the L*E
            ranked pairs each source placed.
        profile_sha256: sha256 of the written profile. warnings: messages for the user (not errors).
    """

    output: str
    sidecar: str
    n_layers: int
    n_expert: int
    mode: str
    fill: str
    phase: str
    weighting: str
    inputs: list[dict]
    used_entries: int
    skipped_layer: int
    skipped_layers: dict
    skipped_phase: int
    traced_pairs: int
    from_base: int
    from_traces: int
    from_fill: int
    profile_sha256: str
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["skipped_layers"] = {str(k): v for k, v in sorted(self.skipped_layers.items())}
        return d


def source_counts(profile: Profile, counts: np.ndarray, base: Profile | None, mode: str) -> tuple[int, int, int]:
    """(from_base, from_traces, from_fill): how many ranked pairs each source placed, in the mode's order."""
    flat = profile.flat()
    traced = np.flatnonzero(counts.ravel() > 0)
    base_flat = base.flat() if (base is not None and mode != "no-base") else np.zeros(0, np.int64)
    n_all = len(flat)
    if mode == "default":
        nb = len(np.unique(base_flat))
        nt = int((~np.isin(traced, base_flat)).sum())
    else:
        nt = len(traced)
        nb = int((~np.isin(np.unique(base_flat), traced)).sum())
    return nb, nt, n_all - nb - nt


def _refuse_extra_layers(res: CountResult, files, n_layers: int, max_layers: int, model_read: bool) -> None:
    """Refuse traces that route a layer >= ``max_layers`` (the trunk plus the model's MTP blocks): another model's
    trace, as simulate/tune/validate-release refuse it. Names the trace (the traces with layers left out) and its highest layer; where
    no model GGUF was read (``model_read`` False) the extra layer may be an MTP block the geometry did not name,
    so the hint says to pass --model."""
    if not res.skipped_layers:
        return
    lmax = max(int(k) for k in res.skipped_layers)
    if lmax < max_layers:
        return
    which = [str(path) for (path, _part), pi in zip(files, res.per_input) if pi.get("skipped_layer")]
    name = which[0] if len(which) == 1 else f"the traces ({', '.join(which[:3])}{', ...' if len(which) > 3 else ''})"
    extra = f" + {max_layers - n_layers} MTP" if max_layers > n_layers else ""
    rng = f"layer {lmax}" if lmax == max_layers else f"layers {max_layers}..{lmax}"
    hint = (f" (if layer {lmax} is this model's MTP block: pass --model M.gguf, which names it)"
            if lmax == max_layers == n_layers and not model_read else "")
    raise StrataError(f"{name}: the trace routes layers up to {lmax} but the model has {n_layers} trunk "
                      f"layers{extra} (0..{max_layers - 1}); its entries of {rng} would be left out, so it is another "
                      f"model's trace: give the model (--model/--pack/--n-layer) the trace was recorded on, or traces "
                      f"of this model{hint}")


def make_profile_files(traces: Sequence[str], output: str, n_layers: int, n_expert: int, *,
                       weights: Sequence[float] | None = None, base: str | None = None, mode: str = "default",
                       fill: str = "expert-major", phase: str = "all", weighting: str = "count",
                       fmt: str | None = None, force: bool = False, model_info: dict | None = None,
                       extra_inputs: Sequence[str] = (), progress=None,
                       where: Sequence[str] | None = None, client=None,
                       max_layers: "int | None | str" = "model") -> MakeProfileResult:
    """Read traces, count, rank and write a STRP profile plus its provenance sidecar.

    With the defaults (mode ``default``, fill ``expert-major``, phase ``all``, weighting ``count``) the bytes
    equal those of Strata's ``tools/make_profile.py`` on the same traces and base (formats.md section 4), except
    that an expert id >= ``n_expert`` below layer ``n_layers`` is refused here (Strata drops it silently), and so is
    a trace routing a layer beyond the model's trunk and MTP blocks (``max_layers``; Strata leaves it out).

    Args:
        traces: trace files, folders, globs or Parquet datasets (any format; sniffed unless ``fmt``;
            :func:`stratatools.traces.sources.expand_traces`); each file is read chunk by chunk.
        output: profile path (``<output>.json`` gets the sidecar).
        n_layers, n_expert: model geometry (trunk layers; experts per layer, dense for a pruned model).
        weights: per-trace weights (default 1.0 each).
        base: a STRP profile to merge (modes ``default``/``reorder``); ignored with ``no-base`` (warned).
        model_info: {name, path, ...} of the model the geometry came from, for the sidecar.
        extra_inputs: other files the output must not overwrite (the model, the pack table).
        progress: optional callable(n_done, n_total) after each trace file is counted.
        where: ``KEY=VALUE`` filters on partition keys / Parquet columns (``--where``).
        client: a ``distributed.Client``: every trace file is counted by a Dask task (same bytes out).
        max_layers: the layers a trace may route: ``"model"`` (default) = ``n_layers`` plus ``model_info``'s
            ``n_mtp`` (the GGUF's ``nextn_predict_layers``, formats.md; 0 when no model GGUF was read); an int;
            None = any (Strata's ``make_profile``). Entries of layers ``n_layers .. max_layers - 1`` (MTP blocks)
            are left out and counted (a warning); a trace routing a layer >= ``max_layers`` is another model's.
    Raises:
        StrataError: bad options, an output that is an input or exists without ``force``, a base of another
            geometry, a trace routing layers beyond ``max_layers``, and every trace reader error.
    """
    import hashlib
    from pathlib import Path

    from stratatools.core import provenance
    from stratatools.core.fsutil import guard_outputs
    from stratatools.profiles.strp import read_profile
    from stratatools.traces.sources import expand_traces, open_source, parse_where

    if mode not in MODES:
        raise StrataError(f"unknown mode {mode!r} (use {', '.join(MODES)})")
    if fill not in ("expert-major", "layer-major"):
        raise StrataError(f"unknown fill {fill!r} (use expert-major or layer-major)")
    from stratatools.profiles.strp import MAX_EXPERTS, MAX_LAYERS, MAX_PAIRS

    if not (1 <= n_layers <= MAX_LAYERS and 1 <= n_expert <= MAX_EXPERTS and n_layers * n_expert <= MAX_PAIRS):
        raise StrataError(f"model geometry {n_layers} layers x {n_expert} experts is out of range for a profile "
                          f"(1..{MAX_LAYERS} layers, 1..{MAX_EXPERTS} experts, at most {MAX_PAIRS} pairs; STRP "
                          f"stores u16 ids, formats.md 'Expert profile'): check --n-layer/--n-expert or the model")
    if not traces:
        raise StrataError("no traces given (pass one or more trace files)")
    w_arg = list(weights) if weights is not None else [1.0] * len(traces)
    if len(w_arg) != len(traces):
        raise StrataError(f"{len(w_arg)} trace weights for {len(traces)} traces")
    # every argument may be a file, a folder, a glob or a Parquet dataset: one input per file it names
    files: list[tuple[Path, dict]] = []
    w: list[float] = []
    for tp, wt in zip(traces, w_arg):
        got = expand_traces([tp], where)
        files += got
        w += [float(wt)] * len(got)
    paths = [str(f) for f, _ in files]
    sidecar = provenance.sidecar_path(output)
    inputs_guard = paths + ([base] if base else []) + list(extra_inputs)
    guard_outputs([output, sidecar], inputs_guard, force)  # <output>.json is written too (same no-replace publication)
    warns: list[str] = []
    base_prof = None
    if base is not None:
        base_prof = read_profile(base, expect=(n_layers, n_expert))
        if mode == "no-base":
            warns.append(f"--base {base} is ignored in mode no-base")
    prov_inputs = [provenance.describe_file(tp, weight=float(w[i]), role="trace") for i, tp in enumerate(paths)]
    wh = parse_where(where)
    tables = []
    info = []
    for i, (tp, part) in enumerate(files):
        t = open_source(tp, fmt, n_layers, n_expert, where=wh, partition=part)  # read chunk by chunk when counted
        tables.append(t)
        info.append({"path": str(tp), "format": t.meta.get("source_format"), "sha256": prov_inputs[i]["sha256"],
                     "weight": float(w[i])})
    res = count_pairs(tables, n_layers, n_expert, phase=phase, weighting=weighting, weights=w,
                      progress=progress, client=client)
    del tables
    for d, pi in zip(info, res.per_input):
        d.update({k: pi[k] for k in ("entries", "used", "skipped_layer", "skipped_phase")})
    if max_layers == "model":
        n_mtp = int((model_info or {}).get("n_mtp") or 0)
        max_layers = n_layers + n_mtp
    if max_layers is not None:
        _refuse_extra_layers(res, files, n_layers, int(max_layers), model_read="n_mtp" in (model_info or {}))
    prof = build_profile(res.counts, base=base_prof, mode=mode, fill=fill)
    nb, nt, nf = source_counts(prof, res.counts, base_prof, mode)
    if mode == "default" and base_prof is not None and base_prof.complete:
        warns.append(f"the base {base} ranks every pair, so in mode default the traces changed nothing (the output "
                     f"is the base); use --mode reorder or --mode no-base to let the traces decide the top")
    if res.used_entries == 0:
        warns.append("no routed entries were counted (check --phase and the layer count); the ranking is base and "
                     "fill only")
    if res.skipped_layer:
        lays = ", ".join(f"{k}: {v}" for k, v in sorted(res.skipped_layers.items())[:8])
        warns.append(f"{res.skipped_layer} entries of layers >= {n_layers} (an MTP block or another model) were "
                     f"left out ({lays})")
    data = prof.to_bytes()  # written with its sidecar at the end, as one set
    psha = hashlib.sha256(data).hexdigest()
    if base is not None:
        prov_inputs.append(provenance.describe_file(base, role="base"))
    model = {"n_layers": n_layers, "n_expert": n_expert}
    if model_info:
        model.update(model_info)
    rec = provenance.build(
        "profile", prov_inputs,
        options={"mode": mode, "fill": fill, "phase": phase, "weighting": weighting, "format": fmt},
        model=model,
        extra={"output": {"name": Path(output).name, "sha256": psha, "n_ranked": prof.n_ranked},
               "counts": {"used_entries": res.used_entries, "skipped_layer": res.skipped_layer,
                          "skipped_layers": {str(k): v for k, v in sorted(res.skipped_layers.items())},
                          "skipped_phase": res.skipped_phase, "from_base": nb, "from_traces": nt, "from_fill": nf}})
    sc = provenance.write_with_sidecar(output, data, rec, inputs_guard)
    return MakeProfileResult(str(output), str(sc), n_layers, n_expert, mode, fill, phase, weighting, info,
                             res.used_entries, res.skipped_layer, dict(res.skipped_layers), res.skipped_phase,
                             int((res.counts > 0).sum()), nb, nt, nf, psha, warns)


__all__ += ["MakeProfileResult", "make_profile_files", "source_counts"]
