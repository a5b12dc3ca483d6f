"""What ``stratatools simulate`` / ``compare`` compute: profiles x policies at one budget, a budget sweep, the
coverage curves and the optional k-fold, as one :class:`Study` (rendered by :mod:`stratatools.cachesim.report`).

Same budget (see :mod:`.layout`): the static and adaptive tiers get the slot count / byte budget and the
admission mode; per-layer baselines (lru, lfu, lfru, belady) get the per-layer admission split of the same
budget (label ``per-layer split``). With global admission the split depends on the profile, so Belady is
also run under each profile's split (label ``<profile> split``): that run bounds the profile's static and
adaptive tiers, which never move a slot to another layer.

Coverage curve of a profile: x = n, the first n ranked pairs; measured = share of the replayed entries whose
pair is among them (what the static tier with global admission and n slots hits); claimed = the share the
profile's own float32 frequency table gives its first n pairs when the file carries one, else the curve of
the best possible ranking for these traces (``oracle``: pairs by count on these traces).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile
from stratatools.traces.table import TraceTable
from stratatools.cachesim.kfold import KFoldResult, kfold_eval
from stratatools.cachesim.layout import rounded_blob_bytes
from stratatools.cachesim.replay import BandwidthModel, Entries, EntryStream, SimResult, check_runs, simulate_many

DEFAULT_POLICIES = ("static", "adaptive", "lru", "lfu", "lfru", "belady")
PROFILE_POLICIES = ("static", "adaptive")
SWEEP_FRACTIONS = (0.125, 0.25, 0.5, 1.0, 2.0)


@dataclass
class Study:
    """Everything a simulate report shows.

    Attributes:
        n_layers, n_expert: geometry.
        traces: per input ``{"name", "entries"}``; entries/tokens/requests/skipped: of the replay (entries and
            tokens: those counted); warmup: entries replayed but not counted (the prefill under --phase decode).
        phase, cold: the phase counted and whether the prefill was dropped (``--cold``).
        budget: ``{"slots", "budget_bytes"}`` as given; admission; bandwidth; policies; profiles (names).
        results: :class:`SimResult` at the main budget (static/adaptive per profile, baselines once, Belady
            per profile split under global admission).
        sweep: rows ``{"x", "unit", "label", "policy", "h_expert", "h_bytes"}`` (x in slots or GiB).
        coverage: per profile ``{"n", "measured", "claimed", "claimed_kind"}``.
        kfold: the held-out evaluation, when asked.
    """

    n_layers: int
    n_expert: int
    traces: list[dict[str, Any]]
    entries: int
    tokens: int
    requests: int
    skipped: dict[str, int]
    budget: dict[str, Any]
    admission: str
    bandwidth: dict[str, float]
    policies: list[str]
    profiles: list[str]
    results: list[SimResult] = field(default_factory=list)
    sweep: list[dict[str, Any]] = field(default_factory=list)
    coverage: dict[str, dict[str, Any]] = field(default_factory=dict)
    kfold: KFoldResult | None = None
    blob_bytes: list[int] | None = None
    cost_model: dict[str, Any] | None = None
    warmup: int = 0
    phase: str = "decode"
    cold: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("results", "kfold")}
        d["results"] = [r.to_dict() for r in self.results]
        d["kfold"] = self.kfold.to_dict() if self.kfold is not None else None
        d["hit_rate_definitions"] = {
            "h_expert": "hits / routed (token, layer, expert) entries; hit = resident at the time of use",
            "h_layer": "share of (token, layer) records whose k experts were all resident",
            "h_bytes": "hits weighted by the layer's blob bytes",
        }
        return d


def unique_names(names: Sequence[str]) -> list[str]:
    """Make labels unique by appending #2, #3, ... to repeats."""
    out, seen = [], {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def coverage_curve(ent: Entries | EntryStream, profile: Profile, points: int = 64) -> dict[str, Any]:
    """Claimed vs measured coverage of a profile's first n pairs (module docstring), from the entries' pair
    counts."""
    L, E = ent.n_layers, ent.n_expert
    N = profile.n_ranked
    grid = np.unique(np.linspace(0, N, points + 1).round().astype(np.int64))
    pc = ent.pair_counts().ravel()
    n_cov = int(pc.sum())  # the counted entries (the prefill under --phase decode only warms the cache)
    rank = profile.rank_table().astype(np.int64).ravel()
    ok = rank >= 0
    hist = np.bincount(rank[ok], weights=pc[ok], minlength=N).astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(hist)])
    measured = cum[grid] / max(n_cov, 1)
    if profile.trailer == "freq" and profile.freq is not None:
        f = profile.freq.ravel()[profile.flat()].astype(np.float64)
        tot = float(profile.freq.sum())
        cf = np.concatenate([[0.0], np.cumsum(f)]) / (tot if tot > 0 else 1.0)
        claimed, kind = cf[grid], "frequency table"
    else:
        counts = pc.astype(np.float64)
        cs = np.concatenate([[0.0], np.cumsum(np.sort(counts)[::-1])]) / max(n_cov, 1)
        claimed, kind = cs[np.minimum(grid, L * E)], "oracle"
    return {"n": grid.tolist(), "measured": [float(x) for x in measured], "claimed": [float(x) for x in claimed],
            "claimed_kind": kind}


def _sweep_points(slots, budget_bytes, L, E, blob_bytes) -> list[tuple[dict, float, str]]:
    pts = []
    if budget_bytes is not None:
        full = int((rounded_blob_bytes(blob_bytes) * E).sum())
        vals = sorted({min(full, max(1, int(budget_bytes * f))) for f in SWEEP_FRACTIONS} | {int(budget_bytes)})
        for v in vals:
            pts.append(({"slots": slots, "budget_bytes": v}, v / 2**30, "GiB"))
    else:
        vals = sorted({min(L * E, max(1, int(round(slots * f)))) for f in SWEEP_FRACTIONS} | {int(slots)})
        for v in vals:
            pts.append(({"slots": v, "budget_bytes": None}, float(v), "slots"))
    return pts


def run_study(tables: Sequence[TraceTable], profiles: Sequence[Profile | None], names: Sequence[str], *,
              n_layers: int | None = None, n_expert: int | None = None, trace_names: Sequence[str] | None = None,
              policies: Sequence[str] = DEFAULT_POLICIES, slots: int | None = None, budget_bytes: int | None = None,
              blob_bytes=None, admission: str = "global", phase: str = "decode", kfold: int | None = None,
              bandwidth: BandwidthModel | None = None, sweep: bool = True,
              policy_params: dict[str, dict] | None = None, progress=None, chunk: int | None = None,
              client=None, cost=None, cold: bool = False, max_layers: int | None = None) -> Study:
    """Simulate profiles and policies on traces (module docstring).

    Args:
        tables: traces; profiles / names: the profiles (None = no profile: arrival-order admission) and labels.
        n_layers, n_expert: geometry (default: the profiles'; all must agree).
        policies: any of static, adaptive, lru, lfu, lfru, belady.
        slots / budget_bytes: the budget; blob_bytes: per-layer blob bytes (pack or model).
        kfold: k for the held-out evaluation (profile-driven policies), None to skip.
        progress: object with ``update(advance=n)`` (a progress bar), optional; advanced by the number of
            policy runs (:func:`study_steps`) over the passes, plus 2 for the k-fold's two passes.
        chunk: entries per replay chunk (default :data:`.replay.CHUNK_ENTRIES`; results do not depend on it).
        phase / cold: what is counted and whether the prefill is dropped (:func:`.replay.prepare_entries`).
        cost: a :class:`.costmodel.ThreeTierModel` for the main-budget results (needs blob sizes), optional.
        max_layers: refuse traces that route layer ``max_layers`` or above (another model's: the trunk plus
            the model's MTP blocks is what a trace of this model routes; :class:`.replay.EntryStream`); None:
            skip and count those entries (``Study.skipped``).
        client: a ``distributed.Client`` (:mod:`stratatools.core.cluster`): the summary, every replay
            (budgets x policies x profiles, then the Belady runs) and every k-fold fold run as Dask tasks, each
            a streaming replay of the sources reopened from their ``spec``; the same Study as in-process.

    Streaming: the traces are read chunk by chunk (one scan, one pass for every online policy at every
    budget, and for Belady one pass writing its next-use file plus one replay pass), so memory does not grow
    with their length.
    Raises:
        StrataError: profiles of different geometries, no geometry, bad budget, unknown policies.
    """
    bw = bandwidth or BandwidthModel()
    pp = policy_params or {}
    geo = {(p.n_layers, p.n_expert) for p in profiles if p is not None}
    if len(geo) > 1:
        raise StrataError(f"profiles are for different geometries {sorted(geo)}; compare profiles of one model")
    if geo:
        L, E = geo.pop()
        if (n_layers is not None and n_layers != L) or (n_expert is not None and n_expert != E):
            raise StrataError(f"profiles are for {L} layers x {E} experts, the model has {n_layers} x {n_expert}")
    else:
        if n_layers is None or n_expert is None:
            raise StrataError("no profile and no model: give --profile or --model/--pack for the geometry")
        L, E = n_layers, n_expert
    for p in policies:
        if p not in DEFAULT_POLICIES:
            raise StrataError(f"unknown policy {p!r} (use {', '.join(DEFAULT_POLICIES)})")
    if slots is None and budget_bytes is None:
        raise StrataError("no budget: give --slots N or --budget-gib X")
    if client is not None:
        from stratatools.core.cluster import run_tasks

        specs = [t.spec for t in tables]
        stream = _RemoteStream(*run_tasks(client, _summary_task, [(specs, L, E, phase, chunk, cold, max_layers)],
                                          name="summary")[0])
    else:
        stream = EntryStream(list(tables), L, E, phase=phase, chunk=chunk, progress=progress, cold=cold,
                             max_layers=max_layers)
        # Belady makes two more passes (next uses, replay): the first pass keeps the prepared entries on disk for
        # them (5 bytes per entry); without Belady there is one pass and nothing to keep
        stream.use_cache = "belady" in policies

    def replay(runs: list[dict], weight: float) -> list[SimResult]:
        if client is None:
            return simulate_many(stream, runs, bandwidth=bw, progress=progress, weight=weight)
        from stratatools.core.cluster import run_tasks

        return [r[0] for r in run_tasks(client, _replay_task, [(specs, L, E, phase, chunk, cold, [r], bw)
                                                                    for r in runs],
                                        name="replay", progress=progress)]
    tn = list(trace_names) if trace_names else [f"trace{i}" for i in range(len(tables))]

    def specs_at(budget: dict, main: bool = False) -> list[dict | None]:
        """The runs at one budget in report order (None: a Belady run under a profile's split, added later)."""
        out: list[dict | None] = []
        common = dict(blob_bytes=blob_bytes, cost=cost if main else None)
        for pol in policies:
            if pol in PROFILE_POLICIES:
                for prof, name in zip(profiles, names):
                    out.append(dict(policy=pol, label=name, profile=prof, admission=admission, **common, **budget,
                                    **pp.get(pol, {})))
            else:
                out.append(dict(policy=pol, label="per-layer split", **common, **budget, **pp.get(pol, {})))
        return out

    budgets = [({"slots": slots, "budget_bytes": budget_bytes}, None, None)]
    check_runs(L, E, [r for r in specs_at(budgets[0][0]) if r is not None])  # bad budgets fail before any pass
    if sweep:
        budgets += _sweep_points(slots, budget_bytes, L, E, blob_bytes)
    plans = [specs_at(b, main=(i == 0)) for i, (b, _, _) in enumerate(budgets)]
    n_pass = max(sum(1 for pl in plans for r in pl if r["policy"] != "belady"), 0)
    # pass 1: every online policy at every budget (and the summary: tokens, rounds, pair counts)
    first = [r for pl in plans for r in pl if r["policy"] != "belady"]
    done = iter(replay(first, n_pass)) if first else iter(())
    results = [[next(done) if r["policy"] != "belady" else None for r in pl] for pl in plans]
    if "belady" in policies:
        # pass 2: Belady under every split; with global admission one Belady per profile too, under the largest
        # per-layer split its static/adaptive tiers reached (arrival admission can grow a layer's share in global
        # mode; more slots never hurt the optimum)
        second, where = [], []
        for bi, pl in enumerate(plans):
            for ri, r in enumerate(pl):
                if r["policy"] == "belady":
                    second.append(r)
                    where.append((bi, ri))
            if admission == "global":
                caps: dict[str, np.ndarray] = {}
                for r0 in results[bi]:
                    if r0 is not None and r0.policy in PROFILE_POLICIES:
                        c = np.asarray(r0.cap, dtype=np.int64)
                        caps[r0.label] = np.maximum(caps[r0.label], c) if r0.label in caps else c
                for name, c in caps.items():
                    second.append(dict(policy="belady", label=f"{name} split", cap=c, blob_bytes=blob_bytes,
                                       cost=cost if bi == 0 else None))
                    where.append((bi, None))
        for (bi, ri), r in zip(where, replay(second, len(second))):
            if ri is None:
                results[bi].append(r)
            else:
                results[bi][ri] = r
    st = Study(L, E, [{"name": n, "entries": int(c)} for n, c in zip(tn, stream.source_entries)],
               stream.n_counted, stream.n_tokens,
               stream.n_requests, stream.skipped, {"slots": slots, "budget_bytes": budget_bytes},
               admission, bw.to_dict(), list(policies), list(names),
               blob_bytes=None if blob_bytes is None else [int(b) for b in blob_bytes], warmup=stream.n_warmup,
               phase=phase, cold=cold)
    if cost is not None and blob_bytes is not None:
        st.cost_model = cost.to_dict()
    st.results = results[0]
    for (budget, x, unit), out in zip(budgets[1:], results[1:]):
        for r in out:
            st.sweep.append({"x": x, "unit": unit, "label": r.label, "policy": r.policy,
                             "h_expert": r.h_expert, "h_bytes": r.h_bytes})
    for prof, name in zip(profiles, names):
        if prof is not None:
            st.coverage[name] = coverage_curve(stream, prof)
    if kfold:
        kp = [p for p in policies if p in PROFILE_POLICIES] or ["static"]
        st.kfold = kfold_eval(list(tables), L, E, int(kfold), policies=kp, slots=slots, budget_bytes=budget_bytes,
                              blob_bytes=blob_bytes, admission=admission, phase=phase, cold=cold, bandwidth=bw,
                              policy_params=pp, chunk=chunk, progress=progress,
                              stream=stream if client is None else None, client=client)
    return st


class _RemoteStream:
    """What a study needs of an :class:`EntryStream` replayed on a cluster (its summary, made by a task)."""

    def __init__(self, source_entries, n_layers, n_expert, entries, tokens, requests, skipped, counts, warmup=0):
        self.source_entries, self.n_layers, self.n_expert = source_entries, n_layers, n_expert
        self._n, self.n_tokens, self.n_requests, self.skipped, self._counts = entries, tokens, requests, skipped, counts
        self.n_counted, self.n_warmup = entries, warmup

    def __len__(self) -> int:
        return self._n

    def pair_counts(self) -> np.ndarray:
        return self._counts


def _open_specs(specs):
    from stratatools.traces.sources import open_source

    return [open_source(*s[:4], where=s[4], partition=s[5]) for s in specs]


def _summary_task(specs, L, E, phase, chunk, cold=False, max_layers=None):
    st = EntryStream(_open_specs(specs), L, E, phase=phase, chunk=chunk, cold=cold, max_layers=max_layers)
    st.summarize()
    return (st.source_entries, L, E, st.n_counted, st.n_tokens, st.n_requests, st.skipped, st.pair_counts(),
            st.n_warmup)


def _replay_task(specs, L, E, phase, chunk, cold, runs, bw):
    st = EntryStream(_open_specs(specs), L, E, phase=phase, chunk=chunk, cold=cold)
    return simulate_many(st, runs, bandwidth=bw)


def study_steps(n_profiles: int, policies: Sequence[str], admission: str, sweep: bool) -> int:
    """Progress units of a study (a progress bar's total): its policy runs, plus 1 for the scan of the traces
    and 1 for Belady's next-use pass when Belady runs."""
    per = sum(n_profiles if p in PROFILE_POLICIES else 1 for p in policies)
    if "belady" in policies and admission == "global" and any(p in PROFILE_POLICIES for p in policies):
        per += n_profiles
    return per * (1 + (len(SWEEP_FRACTIONS) + 1 if sweep else 0)) + 1 + ("belady" in policies)


@dataclass
class StudyInputs:
    """Files read for a study: traces (tables + names), profiles (+ names), blob sizes and geometry."""

    tables: list  # chunk sources (stratatools.traces.sources)
    trace_names: list[str]
    profiles: list[Profile]
    names: list[str]
    blob_bytes: list[int] | None
    n_layers: int | None
    n_expert: int | None
    blob_source: str | None
    n_mtp: int = 0  # MTP blocks of the --model (their trace entries are skipped, not another model's)


def load_inputs(traces: Sequence[str], profiles: Sequence[str], *, pack: str | None = None,
                model: str | None = None, where: Sequence[str] | None = None, whole: bool = False) -> StudyInputs:
    """Open traces (files, folders, globs, Parquet datasets with ``where`` filters, as chunk sources of
    :func:`stratatools.traces.sources.open_traces`: read chunk by chunk), read STRP profiles, and the
    per-layer blob bytes from a native pack (``native_experts.txt``, formats.md 5) or a model's geometry.

    Raises:
        StrataError: no traces; both --pack and --model; every reader's errors; a pack/model whose expert
        count differs from the profiles'.
    """
    from pathlib import Path

    from stratatools.profiles.strp import read_profile
    from stratatools.traces.sources import open_traces

    if not traces:
        raise StrataError("no traces given (pass --traces FILE, repeatable)")
    if pack is not None and model is not None:
        raise StrataError("give --pack or --model, not both")
    blob = None
    L = E = None
    src = None
    n_mtp = 0
    if pack is not None:
        from stratatools.pack.native import read_pack

        pk = read_pack(pack)
        blob = [int(r.blob_bytes) for r in pk.layers]
        L, E, src = len(blob), int(pk.n_expert), f"pack {pack}"
    elif model is not None:
        from stratatools.model.geometry import read_geometry
        from stratatools.model.gguf import open_model

        with open_model(model) as m:
            g = read_geometry(m)
        missing = [i for i, le in enumerate(g.layers) if le is None or not le.complete]
        if missing:
            raise StrataError(f"{model}: layer {missing[0]} has no complete routed-expert tensors; "
                              f"blob sizes need gate, up and down of every trunk layer")
        blob = [int(le.blob_bytes) for le in g.layers]
        L, E, src = g.n_trunk, g.n_expert, f"model {model}"
        n_mtp = len(g.mtp_layers or ())
    profs = [read_profile(p) for p in profiles]
    for p, path in zip(profs, profiles):
        if L is not None and (p.n_layers, p.n_expert) != (L, E):
            raise StrataError(f"{path}: profile is for {p.n_layers} layers x {p.n_expert} experts but the "
                              f"{src} has {L} x {E}; remap it or pass the matching pack/model", path)
    tables = open_traces(traces, None, L if L is not None else (profs[0].n_layers if profs else None),
                         E if E is not None else (profs[0].n_expert if profs else None), where)
    if whole:  # callers that need TraceTables (tune) read every file whole
        from stratatools.traces.formats import read_trace

        tables = [t.table if hasattr(t, "table") else read_trace(t.spec[0], t.spec[1], t.spec[2], t.spec[3])
                  for t in tables]
    names = unique_names([Path(p).stem for p in profiles])
    tnames = [Path(str(t.meta.get("source_path") or getattr(t, "name", "") or "trace")).name for t in tables]
    if len(set(tnames)) < len(tnames):  # files of a dataset share names (part-0.parquet): show their folders
        tnames = [str(t.meta.get("source_path") or getattr(t, "name", "")) for t in tables]
    return StudyInputs(tables, tnames, profs, names, blob, L, E, src, n_mtp)
