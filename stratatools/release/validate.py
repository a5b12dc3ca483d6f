"""``validate-release``: every check the toolchain can make on a release, as named pass/fail/skip checks.

Checks, in order (each one line of reason; details in JSON):

``shards``            the GGUF opens: every shard present, numbered and counted right (split.* keys)
``geometry``          routers present in every trunk layer and agreeing on E; k <= E; MTP reported
``packable``          the native pack can be derived (gate/up share a type, ``*_exps`` 3-D with ne2 = E)
``allocation``        the allocation parses and validates (formats.md 6)
``allocation-model``  Section 1 types equal the GGUF's; kept counts equal the routers' ne1
``survivor-map``      with --full or --previous: the map recovered from router rows equals the text
``profile-geometry``  the profile is STRP v1 of this model's L x E, no duplicate or out-of-range pairs
``profile-stale``     the profile was built for this release: its provenance sidecar or the release
                      registry says so; without either, with --previous, the release must not have
                      re-indexed the experts the profile names
``pack``              a given pack's table equals the one re-derived from the GGUF; sampled experts.bin
                      blobs equal their GGUF slices
``hit-rate``          with --min-hit-rate: the profile's h_expert on the traces (static tier, global
                      admission) at the budget (--slots N or --budget-gib X; default L x round(E x 39/256)
                      slots, at least 1 per layer: the 12 GB card's share of the Coder) is at least the
                      gate; traces are not the profile's build data unless it says so, so this is a
                      held-out number. A requested gate is never a skip: without --traces or a profile
                      it is refused up front (exit 2); a profile that does not load, an unreadable trace
                      or a trace of another model (more layers or experts) fails it

Exit codes: 0 all pass (skips allowed), 1 a check failed, 2 unusable input (a path that does not exist,
a release folder without a model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from stratatools.release.checks import FAIL, PASS, SKIP, Check, CheckSuite
from stratatools.core.errors import StrataError, num_text


@dataclass
class ReleaseInputs:
    """Resolved paths of what is validated. ``model`` is required; everything else optional."""

    model: Path
    alloc: Path | None = None
    profile: Path | None = None
    pack: Path | None = None
    traces: list[Path] = field(default_factory=list)
    full: Path | None = None
    previous: Path | None = None
    previous_alloc: Path | None = None


def _stem_key(p: Path) -> str:
    import re

    m = re.match(r"^(.+)-\d{5}-of-\d{5}\.gguf$", p.name)
    return m.group(1) if m else p.name


def discover(release_dir: str | os.PathLike) -> ReleaseInputs:
    """Find a release's files in a folder: one model (a file or a shard set), at most one
    ``*.rco-allocation.txt``, at most one STRP profile (``*.bin`` starting with ``STRP``), at most one pack
    (a sub-folder with ``native_experts.txt``).

    Raises:
        StrataError: the folder does not exist, holds no GGUF, or holds several models/allocations/profiles
            (name the one you mean with --model/--alloc/--profile).
    """
    d = Path(release_dir)
    if not d.is_dir():
        raise StrataError(f"{d}: not a folder (give a release folder or --model M.gguf)", d)
    ggufs = sorted(p for p in d.glob("*.gguf"))
    models = sorted({_stem_key(p) for p in ggufs})
    if not models:
        raise StrataError(f"{d}: no .gguf file in the release folder (or pass --model)", d)
    if len(models) > 1:
        raise StrataError(f"{d}: holds {len(models)} models ({', '.join(models[:4])}); choose one with --model", d)
    model = next(p for p in ggufs if _stem_key(p) == models[0])
    allocs = sorted(d.glob("*.rco-allocation.txt"))
    if len(allocs) > 1:
        raise StrataError(f"{d}: holds {len(allocs)} allocation files; choose one with --alloc", d)
    profiles = [p for p in sorted(d.glob("*.bin")) if _magic(p) == b"STRP"]
    if len(profiles) > 1:
        raise StrataError(f"{d}: holds {len(profiles)} STRP profiles; choose one with --profile", d)
    packs = sorted(p.parent for p in d.glob("*/native_experts.txt"))
    if len(packs) > 1:
        raise StrataError(f"{d}: holds {len(packs)} packs; choose one with --pack", d)
    return ReleaseInputs(model=model, alloc=allocs[0] if allocs else None,
                         profile=profiles[0] if profiles else None, pack=packs[0] if packs else None)


def _magic(p: Path) -> bytes:
    """The first 4 bytes of a file (b"" when unreadable): a release folder may hold a multi-GB experts.bin."""
    try:
        with open(p, "rb") as fh:
            return fh.read(4)
    except OSError:
        return b""


def _must_exist(p: Path | None, what: str) -> None:
    if p is not None and not p.exists():
        raise StrataError(f"{p}: no such {what}", p)



# ------------------------------------------------------------------------------------------------ checks
def _check_shards(inp: ReleaseInputs, ctx: dict[str, Any]):
    from stratatools.model.gguf import open_model

    try:
        m = open_model(inp.model)
    except StrataError as e:
        return FAIL, str(e), {}
    ctx["model"] = m  # opened once; every later check reads this one (validate_release closes it)
    files = [{"name": f.path.name, "size_bytes": f.size, "tensors": len(f.tensors)} for f in m.files]
    return PASS, f"{len(files)} file(s), {len(m.tensors)} tensors", {"files": files}


def _check_geometry(inp: ReleaseInputs, ctx: dict[str, Any]):
    from stratatools.model.geometry import check_consistency, read_geometry

    try:
        g = read_geometry(ctx["model"])
        check_consistency(ctx["model"])
    except StrataError as e:
        return FAIL, str(e), {}
    ctx["geometry"] = g
    missing = [i for i, le in enumerate(g.layers) if le is None or not le.complete]
    if missing:
        return FAIL, f"trunk layer {missing[0]} lacks a router or an expert tensor ({len(missing)} layers)", {}
    if g.uniform_n_expert is None:
        return FAIL, f"routers disagree on the expert count: {g.expert_counts}", {"expert_counts": g.expert_counts}
    E = g.uniform_n_expert
    if g.n_expert_used is not None and not 0 < g.n_expert_used <= E:
        return FAIL, f"expert_used_count {g.n_expert_used} is not in 1..{E}", {}
    reason = f"{g.arch}, {g.n_trunk} trunk layers x {E} experts (from routers), k {g.n_expert_used}"
    if g.expert_count_kv is not None and g.expert_count_kv != E:
        reason += f"; metadata expert_count {g.expert_count_kv} differs (routers win)"
    if g.mtp_layers:
        reason += "; MTP: " + ", ".join(f"blk.{le.layer} {le.n_expert} experts" for le in g.mtp_layers)
    return PASS, reason, {"n_trunk": g.n_trunk, "n_expert": E, "k": g.n_expert_used,
                          "expert_count_kv": g.expert_count_kv}


def _check_packable(inp: ReleaseInputs, ctx: dict[str, Any]):
    from stratatools.pack.native import plan_pack

    try:
        plan = plan_pack(ctx["model"])
    except StrataError as e:
        return FAIL, str(e), {}
    ctx["blob_bytes"] = [lp.row.blob_bytes for lp in plan.layers]
    return PASS, f"native pack v{plan.version}, {plan.total_bytes} bytes of experts" + (
        f"; {'; '.join(plan.notes)}" if plan.notes else ""), {"version": plan.version, "total_bytes": plan.total_bytes}


def _check_allocation(inp: ReleaseInputs, ctx: dict[str, Any]):
    from stratatools.alloc.allocation import read_allocation

    try:
        a = read_allocation(inp.alloc)
    except StrataError as e:
        return FAIL, str(e), {}
    ctx["alloc"] = a
    warn = list(getattr(a, "warnings", []) or [])
    kept = getattr(a, "n_kept", None)
    reason = f"{inp.alloc.name}: parsed and valid"
    if kept is not None and len(kept):
        ks = sorted(set(int(x) for x in kept))
        reason += f", kept per layer {ks[0] if len(ks) == 1 else ks}"
    if warn:
        reason += f"; {len(warn)} warning(s): {warn[0]}"
    return PASS, reason, {"warnings": warn}


def _check_alloc_model(inp: ReleaseInputs, ctx: dict[str, Any]):
    from stratatools.alloc.allocation import check_against_model

    try:
        r = check_against_model(ctx["alloc"], ctx["model"])
    except StrataError as e:
        return FAIL, str(e), {}
    if r.ok:
        # same types and counts can still be another revision's map (a re-release that only re-indexes):
        # when the registry knows both digests, they must name the same release
        reg = ctx.get("registry")
        if reg is not None:
            a_hit = reg.identify(ctx["alloc"].sha256) if ctx["alloc"].sha256 else None
            m_key = _model_release_key(inp, reg)
            if a_hit and a_hit[0] == "allocation" and m_key and a_hit[1] != m_key:
                return FAIL, (f"the release registry says {inp.alloc.name} belongs to {a_hit[1]} but the model is "
                              f"{m_key} (types and kept counts agree; the expert numbering may not)"), \
                    {**r.to_dict(), "allocation_release": a_hit[1], "model_release": m_key}
        return PASS, "Section 1 types equal the GGUF's; kept counts equal the routers' ne1", r.to_dict()
    parts = []
    if r.type_mismatches:
        t, a, g = r.type_mismatches[0]
        parts.append(f"{len(r.type_mismatches)} type mismatch(es), e.g. {t}: allocation {a}, GGUF {g}")
    if r.missing_in_model:
        parts.append(f"{len(r.missing_in_model)} listed tensor(s) not in the GGUF, e.g. {r.missing_in_model[0]}")
    if r.missing_in_allocation:
        parts.append(f"{len(r.missing_in_allocation)} GGUF tensor(s) not listed, e.g. {r.missing_in_allocation[0]}")
    return FAIL, "; ".join(parts), r.to_dict()


def _check_survivors(inp: ReleaseInputs, ctx: dict[str, Any]):
    from stratatools.alloc.survivors import verify_survivors

    try:
        if inp.full is not None:
            r = verify_survivors(ctx["model"], full=inp.full, alloc=ctx.get("alloc"))
        else:
            other_alloc = None
            if inp.previous_alloc is not None:
                from stratatools.alloc.allocation import read_allocation

                other_alloc = read_allocation(inp.previous_alloc)
            r = verify_survivors(ctx["model"], other=inp.previous,
                                 alloc=ctx.get("alloc") if other_alloc is not None else None, other_alloc=other_alloc)
    except StrataError as e:
        return FAIL, str(e), {}
    ctx["verify"] = r
    d = {"unmatched": r.n_unmatched, "ambiguous": r.n_ambiguous, "disagreements": r.n_disagree,
         "compared_with_allocation": r.compared, "reference": r.reference, "kind": r.kind}
    if r.kind == "other":
        moved = sum(int((np.asarray(x.match) != np.arange(len(x.match))).sum()) for x in r.layers)
        d["dense_indices_reindexed"] = moved
    if not r.ok:
        return FAIL, (f"router rows vs {Path(r.reference).name}: {r.n_unmatched} unmatched, {r.n_ambiguous} ambiguous, "
                      f"{r.n_disagree} disagree with the allocation"), d
    what = "equals the allocation's map" if r.compared else "every row resolved (no allocation compared)"
    extra = f"; {d['dense_indices_reindexed']} dense indices re-indexed since the previous revision" if r.kind == "other" else ""
    return PASS, f"router-derived map vs {Path(r.reference).name}: {what}{extra}", d


def _check_profile_geometry(inp: ReleaseInputs, ctx: dict[str, Any]):
    from stratatools.profiles.strp import read_profile

    g = ctx.get("geometry")
    if g is None or g.uniform_n_expert is None:
        return SKIP, "model geometry unknown (see geometry)", {}
    try:
        p = read_profile(inp.profile, expect=(g.n_trunk, g.uniform_n_expert))
    except StrataError as e:
        return FAIL, str(e), {}
    ctx["profile"] = p
    if p.n_ranked == 0:  # the engine would cache nothing from it: a profile of no pairs is no profile
        return FAIL, f"{inp.profile}: the profile ranks no (layer, expert) pair; rebuild it from traces", \
            {"n_ranked": 0, "trailer": p.trailer, "warnings": p.warnings}
    reason = f"STRP v{p.version}, {p.n_layers} x {p.n_expert}, {p.n_ranked} ranked pairs, trailer {p.trailer}"
    if p.warnings:
        reason += f"; warning: {p.warnings[0]}"
    return PASS, reason, {"n_ranked": p.n_ranked, "trailer": p.trailer, "warnings": p.warnings}


def _model_release_key(inp: ReleaseInputs, reg) -> str | None:
    """The registry key of the model under test from its shard digests alone (None when unknown)."""
    from stratatools.model.gguf import shard_siblings

    sibs = shard_siblings(inp.model)
    return _first_known(sibs if sibs else [inp.model], reg)


def _first_known(cands, reg) -> str | None:
    from stratatools.core.fsutil import sha256_file_cached

    for c in cands:
        try:
            hit = reg.identify(sha256_file_cached(c)[0])
        except OSError:
            continue
        if hit:
            return hit[1]
    return None


def _release_key_of(inp: ReleaseInputs, reg) -> str | None:
    """The registry key of the release under test, from its allocation or shard digests."""
    if inp.alloc is not None:
        k = _first_known([inp.alloc], reg)
        if k:
            return k
    return _model_release_key(inp, reg)


def _check_stale(inp: ReleaseInputs, ctx: dict[str, Any]):
    from stratatools.core.fsutil import sha256_file
    from stratatools.core.provenance import read_sidecar

    reg = ctx["registry"]
    try:
        side = read_sidecar(inp.profile)
    except StrataError as e:
        return FAIL, str(e), {}
    here_alloc_sha = ctx["alloc"].sha256 if ctx.get("alloc") is not None else None
    here_key = _release_key_of(inp, reg)
    details: dict[str, Any] = {"release": here_key}
    # 1. provenance sidecar (only when it describes this very file)
    prof_sha = sha256_file(inp.profile)
    out_rec = side.get("output") if side and isinstance(side.get("output"), dict) else None
    if out_rec and out_rec.get("sha256") and out_rec["sha256"] != prof_sha:
        details["sidecar_output_sha256"] = out_rec["sha256"]
        return FAIL, (f"{inp.profile.name}.json describes another file (its output digest {str(out_rec['sha256'])[:12]}… "
                      f"is not this profile's): the profile was replaced after the sidecar was written; rebuild "
                      f"or remap it with stratatools, or delete the stale sidecar"), details
    if side:
        a = side.get("allocation") if isinstance(side.get("allocation"), dict) else None
        m = side.get("model") if isinstance(side.get("model"), dict) else None
        details["sidecar"] = {"allocation": a, "model": m}
        if a and a.get("sha256") and here_alloc_sha:
            if a["sha256"] == here_alloc_sha:
                return PASS, f"provenance: built for this allocation ({a.get('name')})", details
            return FAIL, (f"stale profile: its provenance says it was built for allocation {a.get('name')} "
                          f"({str(a.get('sha256'))[:12]}…, {a.get('release') or 'unknown release'}), not "
                          f"{inp.alloc.name}; fix: stratatools remap-profile --from-alloc OLD --to-alloc NEW"), details
        if a and a.get("release") and here_key:
            if a["release"] == here_key:
                return PASS, f"provenance: built for {here_key}", details
            return FAIL, f"stale profile: built for {a['release']}, this release is {here_key}", details
    # 2. registry
    hit = reg.identify(prof_sha)
    if hit and hit[0] == "profile":
        details["registry_profile"] = hit[1]
        if here_key is None:
            details["note"] = "release not in the registry"
        elif hit[1] == here_key:
            return PASS, f"registry: profile built for {here_key}, this release", details
        else:
            return FAIL, (f"stale profile: the release registry says {inp.profile.name} was built for {hit[1]}, "
                          f"but this release is {here_key}; remap it (stratatools remap-profile) or rebuild it "
                          f"(stratatools make-profile)"), details
    # 3. re-indexing since the previous revision
    v = ctx.get("verify")
    if v is not None and v.kind == "other":
        moved = sum(int((np.asarray(x.match) != np.arange(len(x.match))).sum()) for x in v.layers)
        details["dense_indices_reindexed"] = moved
        p = ctx.get("profile")
        if moved and p is not None:
            changed = 0
            for lyr, x in enumerate(v.layers):
                sel = p.pairs[p.pairs[:, 0] == lyr, 1]
                changed += int((np.asarray(x.match)[sel] != sel).sum())
            details["pairs_reindexed"] = changed
            return FAIL, (f"profile has no provenance for this release and the release re-indexed {moved} dense "
                          f"indices since {Path(v.reference).name}: {changed} of {p.n_ranked} ranked pairs would "
                          f"name another expert if it was built for that revision; remap or rebuild it"), details
        if not moved:
            return PASS, f"no provenance, but no expert was re-indexed since {Path(v.reference).name}", details
    return SKIP, ("cannot tell which release the profile was built for: no provenance sidecar, not in the release "
                  "registry; pass --previous Q.gguf to check for re-indexing"), details


def _check_pack(inp: ReleaseInputs, ctx: dict[str, Any]):
    from stratatools.pack.native import read_pack, verify_pack

    try:
        pk = read_pack(inp.pack)
        r = verify_pack(pk, ctx["model"])
    except StrataError as e:
        return FAIL, str(e), {}
    if not r.ok:
        return FAIL, f"{len(r.problems)} mismatch(es), first: {r.problems[0]}", r.to_dict()
    return PASS, (f"native_experts.txt equals the re-derived table ({r.checked_lines} layers); "
                  f"{r.checked_blobs} sampled experts.bin blobs equal their GGUF slices"), r.to_dict()


def _check_hit_rate(inp: ReleaseInputs, ctx: dict[str, Any], min_hit_rate: float, slots: int | None,
                    budget_gib: float | None):
    import contextlib

    g = ctx["geometry"]
    p = ctx["profile"]
    L, E = g.n_trunk, g.uniform_n_expert
    make_bar = ctx.get("progress")
    with (make_bar("hit-rate gate", 2) if make_bar is not None else contextlib.nullcontext()) as bar:
        return _hit_rate(inp, ctx, p, L, E, min_hit_rate, slots, budget_gib, bar)


def _hit_rate(inp, ctx, p, L, E, min_hit_rate, slots, budget_gib, bar):
    """The gate's replay: one scan pass and one replay pass of the static tier, ``bar`` advanced by 1 for each."""
    from stratatools.cachesim.replay import EntryStream, LayerLimit, simulate_many
    from stratatools.core.errors import OtherModelInput
    from stratatools.profiles.diff import default_slots_per_layer
    from stratatools.traces.sources import open_traces

    n_mtp = len(ctx["geometry"].mtp_layers or ())
    try:
        tables = open_traces([str(t) for t in inp.traces], None, L, E)  # files, folders, globs or datasets, read chunk by chunk
        # replayed chunk by chunk: memory independent of trace length. Entries of the model's MTP blocks (layers
        # L..L+n_mtp-1) are left out of the gate, as make-profile leaves them out, and counted; traces of more
        # layers, or expert ids at or past the model's expert count, are another model's: unusable input, refused
        # (exit 2, as simulate and tune), not a failed gate
        ent = EntryStream(tables, L, E, progress=bar, max_layers=LayerLimit(L + n_mtp, True))
    except OtherModelInput:  # layers past the model (OtherModelTrace) or expert ids past its expert count
        raise
    except StrataError as e:
        return FAIL, str(e), {}
    kw: dict[str, Any] = {}
    if budget_gib is not None:
        if not ctx.get("blob_bytes"):
            return FAIL, "a byte budget needs the blob sizes of the native pack (see packable); gate with --slots", {}
        kw["budget_bytes"] = int(budget_gib * (1 << 30))
        kw["blob_bytes"] = ctx.get("blob_bytes")
    else:
        kw["slots"] = slots if slots is not None else L * default_slots_per_layer(E)  # documented default
        if ctx.get("blob_bytes"):
            kw["blob_bytes"] = ctx["blob_bytes"]
    try:
        r = simulate_many(ent, [dict(policy="static", profile=p, **kw)], progress=bar)[0]
    except OtherModelInput:
        raise
    except StrataError as e:
        return FAIL, str(e), {}
    budget = f"{budget_gib} GiB" if budget_gib is not None else f"{kw['slots']} slots"
    if budget_gib is None and slots is None:
        budget += (f" (default: {default_slots_per_layer(E)} per layer, 39/256 of {E} experts; "
                   f"set --slots or --budget-gib)")
    left = int(ent.skipped.get("layer", 0))  # within L + n_mtp (checked above): the MTP blocks' entries
    d = {"h_expert": r.h_expert, "h_layer": r.h_layer, "budget": budget, "min_hit_rate": min_hit_rate,
         "entries": ent.n_counted, "warmup": ent.n_warmup, "left_out_mtp": left}
    msg = f"h_expert {r.h_expert:.4f} at {budget} on {len(inp.traces)} trace(s) (gate {min_hit_rate:.4f})"
    if left:
        where = f"layer {L}" if n_mtp == 1 else f"layers {L}..{L + n_mtp - 1}"
        msg += (f"; left out: {left:,} entries of the MTP block{'s' if n_mtp > 1 else ''} ({where}), as make-profile "
                f"leaves them out")
    return (PASS if r.h_expert >= min_hit_rate else FAIL), msg, d


ALL_CHECKS = (("shards", "shards complete and consistent"), ("geometry", "geometry from the routers"),
              ("packable", "native pack derivable"), ("allocation", "allocation parses and validates"),
              ("allocation-model", "allocation agrees with the GGUF"),
              ("survivor-map", "survivor map verified from router weights"),
              ("profile-geometry", "profile geometry and integrity"), ("profile-stale", "profile built for this release"),
              ("pack", "pack round trip"), ("hit-rate", "hit-rate gate"))


def check_gate_options(min_hit_rate: float | None, slots: int | None, budget_gib: float | None) -> None:
    """Refuse gate options that cannot mean anything (exit 2 before any check runs).

    Raises:
        StrataError: --min-hit-rate outside 0..1 or not finite, --slots < 1 with --min-hit-rate (at 0 slots
            h_expert is 0 whatever the profile: the gate would test nothing), --budget-gib not a finite
            positive number, or both --slots and --budget-gib.
    """
    import math

    if min_hit_rate is not None and not 0.0 <= min_hit_rate <= 1.0:
        raise StrataError(f"--min-hit-rate {min_hit_rate}: give a fraction between 0 and 1")
    if slots is not None and budget_gib is not None:
        raise StrataError("give --slots N or --budget-gib X for the hit-rate gate, not both")
    if slots is not None and slots < 1 and min_hit_rate is not None:
        # (without a gate, check_gate_inputs says that --slots needs --min-hit-rate, whatever its value)
        # 0 is accepted by run/simulate (the all-miss tier, a measurement); a gate on it tests nothing
        raise StrataError(f"--slots {slots}: the hit-rate gate needs at least 1 slot (with no slot every entry "
                          f"misses, so h_expert is 0 whatever the profile and the gate tests nothing); give the "
                          f"card's slot count, or leave --slots out for the default L x round(E x 39/256)")
    if budget_gib is not None and not (math.isfinite(budget_gib) and budget_gib > 0):
        raise StrataError(f"--budget-gib {budget_gib}: give a finite positive number of GiB")


def check_gate_inputs(inp: ReleaseInputs, min_hit_rate: float | None, slots: int | None,
                      budget_gib: float | None) -> None:
    """Refuse, before any check runs, a requested check that could not run on the given inputs: a gate the
    user asked for must never become a green skip in CI.

    ``--min-hit-rate`` needs traces (``--traces``) and a profile (``--profile`` or one in the release
    folder); ``--slots``/``--budget-gib`` only set the gate's budget, so they need ``--min-hit-rate``;
    ``--previous-alloc`` is read by the survivor-map check against ``--previous`` only.

    Raises:
        StrataError: one line naming what is missing and how to fix it (exit 2).
    """
    if min_hit_rate is not None:
        missing = [w for w, ok in (("--traces TRACE", bool(inp.traces)),
                                   ("--profile P.bin (or a profile in the release folder)", inp.profile is not None))
                   if not ok]
        if missing:
            raise StrataError(f"--min-hit-rate {min_hit_rate}: the hit-rate gate needs {' and '.join(missing)}; "
                              f"add {'them' if len(missing) > 1 else 'it'} or drop --min-hit-rate")
    else:
        given = [o for o, v in (("--slots", slots), ("--budget-gib", budget_gib)) if v is not None]
        if given:
            raise StrataError(f"{' and '.join(given)}: only the hit-rate gate's budget, and no gate is set; add "
                              f"--min-hit-rate X (with --traces and --profile) or drop {' and '.join(given)}")
    if inp.previous_alloc is not None and inp.previous is None:
        raise StrataError("--previous-alloc is compared against --previous Q.gguf (the previous revision) and "
                          "nothing else; add --previous or drop --previous-alloc")


def validate_release(inp: ReleaseInputs, *, min_hit_rate: float | None = None, slots: int | None = None,
                     budget_gib: float | None = None, registry: str | os.PathLike | None = None,
                     progress=None) -> CheckSuite:
    """Run every check that the given inputs allow; see the module docstring.

    Args:
        registry: release registry TOML (default: :func:`stratatools.alloc.registry.load_registry`'s).
        progress: ``progress(description, total)`` -> a context manager yielding an object with
            ``update(advance=x)`` (:func:`stratatools.cli.common.progress_bar`), for the hit-rate gate's two passes
            over the traces; None: no progress.

    Raises:
        StrataError: a given path does not exist, the registry does not load, the gate options are
            meaningless (:func:`check_gate_options`) or a requested check lacks its inputs
            (:func:`check_gate_inputs`) (unusable input, exit 2). Problems found inside the
            release's files are failed checks, not errors.
    """
    from stratatools.alloc.registry import load_registry

    check_gate_options(min_hit_rate, slots, budget_gib)
    check_gate_inputs(inp, min_hit_rate, slots, budget_gib)
    _must_exist(inp.model, "model")
    for p, what in ((inp.alloc, "allocation file"), (inp.profile, "profile"), (inp.pack, "pack folder"),
                    (inp.full, "full model"), (inp.previous, "previous revision"),
                    (inp.previous_alloc, "previous allocation")):
        _must_exist(p, what)
    if inp.traces:
        from stratatools.traces.sources import expand_traces

        expand_traces([str(t) for t in inp.traces])  # files, folders, globs, datasets: each must name a trace
    if inp.full is not None and inp.previous is not None:
        raise StrataError("give --full or --previous, not both")
    reg = load_registry(registry)
    suite = CheckSuite(name=inp.model.name, subject={"model": str(inp.model)})
    for k in ("alloc", "profile", "pack", "full", "previous"):
        v = getattr(inp, k)
        if v is not None:
            suite.subject[k] = str(v)
    ctx: dict[str, Any] = {"registry": reg, "progress": progress}
    shards = suite.run("shards", "shards complete and consistent", _check_shards, inp, ctx)
    if shards.status == FAIL:
        for n, t in ALL_CHECKS[1:]:  # every check stays listed (one JUnit testcase each)
            if n == "hit-rate" and min_hit_rate is not None:  # a requested gate is never a skip
                suite.add(Check(n, t, FAIL, f"gate --min-hit-rate {min_hit_rate} not measured: the model does "
                                f"not open (see shards)", {"min_hit_rate": min_hit_rate}))
            else:
                suite.skip(n, t, "the model does not open (see shards)")
        return suite
    try:
        _run_model_checks(suite, inp, ctx, min_hit_rate, slots, budget_gib)
    finally:
        ctx["model"].close()
    return suite


def _run_model_checks(suite: CheckSuite, inp: ReleaseInputs, ctx: dict[str, Any], min_hit_rate: float | None,
                      slots: int | None, budget_gib: float | None) -> None:
    """Every check after ``shards``, in order, on the model opened by it (``ctx["model"]``)."""
    suite.run("geometry", "geometry from the routers", _check_geometry, inp, ctx)
    suite.run("packable", "native pack derivable", _check_packable, inp, ctx)
    if min_hit_rate is not None and budget_gib is not None and ctx.get("blob_bytes"):
        from stratatools.cachesim.layout import require_budget_slot

        # a budget below one slot is --slots 0 (refused by check_gate_options): unusable input, exit 2
        require_budget_slot(int(budget_gib * (1 << 30)), ctx["blob_bytes"], f"--budget-gib {num_text(budget_gib)}",
                            "the hit-rate gate needs at least 1 slot (with no slot h_expert is 0 whatever the "
                            "profile, so the gate tests nothing)")
    if inp.alloc is not None:
        a = suite.run("allocation", "allocation parses and validates", _check_allocation, inp, ctx)
        if a.status == PASS:
            suite.run("allocation-model", "allocation agrees with the GGUF", _check_alloc_model, inp, ctx)
        else:
            suite.skip("allocation-model", "allocation agrees with the GGUF", "the allocation does not parse")
    else:
        suite.skip("allocation", "allocation parses and validates", "no allocation given (--alloc)")
        suite.skip("allocation-model", "allocation agrees with the GGUF", "no allocation given (--alloc)")
    if inp.full is not None or inp.previous is not None:
        suite.run("survivor-map", "survivor map verified from router weights", _check_survivors, inp, ctx)
    else:
        suite.skip("survivor-map", "survivor map verified from router weights",
                   "needs --full F.gguf (the unpruned model) or --previous Q.gguf (the previous revision)")
    if inp.profile is not None:
        pg = suite.run("profile-geometry", "profile geometry and integrity", _check_profile_geometry, inp, ctx)
        if pg.status == PASS:
            suite.run("profile-stale", "profile built for this release", _check_stale, inp, ctx)
        else:
            suite.skip("profile-stale", "profile built for this release", "the profile does not load (see profile-geometry)")
    else:
        suite.skip("profile-geometry", "profile geometry and integrity", "no profile given (--profile)")
        suite.skip("profile-stale", "profile built for this release", "no profile given (--profile)")
    if inp.pack is not None:
        suite.run("pack", "pack round trip", _check_pack, inp, ctx)
    else:
        suite.skip("pack", "pack round trip", "no pack given (--pack)")
    if min_hit_rate is not None:
        # a gate that was asked for never turns into a skip: the traces and the profile were required up front
        # (check_gate_inputs), so a profile that did not load (or a model whose geometry is unknown) fails it
        if ctx.get("profile") is None:
            suite.add(Check("hit-rate", "hit-rate gate", FAIL,
                            f"gate --min-hit-rate {min_hit_rate} not measured: the profile {inp.profile} did not "
                            f"load for this model (see profile-geometry)", {"min_hit_rate": min_hit_rate}))
        else:
            suite.run("hit-rate", "hit-rate gate", _check_hit_rate, inp, ctx, min_hit_rate, slots, budget_gib)
    else:
        suite.skip("hit-rate", "hit-rate gate", "no gate set (--min-hit-rate)")


def resolve_inputs(release_dir: str | os.PathLike | None, *, model=None, alloc=None, profile=None, pack=None,
                   traces: Sequence[str | os.PathLike] = (), full=None, previous=None,
                   previous_alloc=None) -> ReleaseInputs:
    """Combine a release folder's discovered files with explicit options (options win).

    Raises:
        StrataError: neither a folder nor --model; and see :func:`discover`.
    """
    if release_dir is None and model is None:
        raise StrataError("give a release folder or --model M.gguf")
    if release_dir is not None and model is None:
        inp = discover(release_dir)
    else:
        if release_dir is not None and not Path(release_dir).is_dir():
            # e.g. the old ``--json FILE`` form, whose FILE now lands here: never ignore a stray argument
            raise StrataError(f"{release_dir}: not a release folder (with --model the only argument is the release "
                              f"folder; reports go to --json-out/--junit/--markdown FILE, --json prints JSON)",
                              release_dir)
        inp = ReleaseInputs(model=Path(model))
    if model is not None:
        inp.model = Path(model)
    for k, v in (("alloc", alloc), ("profile", profile), ("pack", pack), ("full", full), ("previous", previous),
                 ("previous_alloc", previous_alloc)):
        if v is not None:
            setattr(inp, k, Path(v))
    inp.traces = [Path(t) for t in traces]
    return inp
