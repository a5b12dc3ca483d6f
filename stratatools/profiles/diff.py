"""Is a profile stale? ``profile-diff`` in its two forms (formats.md sections 2 and 6, cache-policy.md).

**Against a re-release** (``profile_vs_allocations``): a profile built for pruned revision OLD (dense
indices) is loaded by the engine on revision NEW, which checks only the shape. Each ranked pair
(layer, dense index) then names ``NEW.orig(layer, index)`` instead of ``OLD.orig(layer, index)``. We count
the pairs that still name the same original expert, the dense indices per layer whose expert changed, the
allocation lines changed per layer, and what happens to the profile's **top-K per layer** (the experts the
per-layer VRAM tier loads at K slots per layer: a 12 GB card holds ~39 per layer of the Coder,
cache-policy.md): which intended experts fall out, which unintended ones come in.

**Two profiles of one model** (``profile_vs_profile``): pairs at the same rank position, top-K per layer
overlap, and the rank correlation of the pairs both rank.

Verdict: the stale fraction is the share of ranked pairs that do not name the same expert at the same rank
(form 1: under the new map; form 2: in the other profile). ``fresh`` at 0, ``tolerable`` up to
``max_stale``, ``stale`` beyond it (the CLI exits 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stratatools.alloc.allocation import Allocation, SurvivorMap, diff_allocations, read_allocation
from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile, read_profile
from stratatools.profiles.remap import built_for, identify_release

# The Coder: a 12 GB card holds ~39 experts per layer of 256 (cache-policy.md); the default K keeps that share.
CODER_SLOTS_PER_LAYER = 39
CODER_N_EXPERT = 256


def default_slots_per_layer(n_expert: int) -> int:
    """K at the 12 GB card's share of the Coder (39 of 256 per layer), at least 1."""
    return max(1, int(round(n_expert * CODER_SLOTS_PER_LAYER / CODER_N_EXPERT)))


def top_k_per_layer(prof: Profile, k: int) -> list[np.ndarray]:
    """Per layer, the first ``k`` experts of that layer in rank order (what per-layer admission loads)."""
    out = []
    lay = prof.pairs[:, 0]
    for layer in range(prof.n_layers):
        out.append(prof.pairs[lay == layer, 1][:k])
    return out


@dataclass
class TopKLayer:
    """Top-K of one layer, in original expert indices (form 1) or indices of the one model (form 2)."""

    layer: int
    k: int
    overlap: int
    fall_out: list[int]
    come_in: list[int]


@dataclass
class DiffResult:
    """What ``profile-diff`` reports.

    Attributes:
        form: ``"allocations"`` or ``"profiles"``.
        n_layers, n_expert: the profile geometry.
        n_ranked: ranked pairs compared.
        still_same: ranked pairs that still name the same expert (form 1: same original expert under the new
            map; form 2: the same pair at the same rank).
        recoverable: form 1: pairs whose expert still exists in NEW under another index (remap keeps them).
        per_layer_changed: form 1: dense indices per layer whose original expert changed; form 2: rank
            positions per layer (counted at A's pair) whose pair differs.
        per_layer_lines_changed: form 1: allocation lines changed per layer (same position).
        per_layer_pairs_changed: ranked pairs per layer that name another expert now.
        slots_per_layer: K.
        top_k: per layer, :class:`TopKLayer`.
        spearman: form 2: rank correlation over pairs both profiles rank.
        max_stale: the threshold.
        built_for: form 1: what the profile's sidecar (or the release registry) says: ``old``, ``new``,
            ``other`` or ``unknown``; ``built_for_release`` names the release when known.
        notes: remarks for the reader.
    """

    form: str
    n_layers: int
    n_expert: int
    n_ranked: int
    still_same: int
    per_layer_changed: list[int]
    per_layer_pairs_changed: list[int]
    slots_per_layer: int
    top_k: list[TopKLayer]
    max_stale: float
    recoverable: int | None = None
    per_layer_lines_changed: list[int] | None = None
    allocation_lines_changed: int | None = None
    allocation_entries: int | None = None
    groups_changed: int | None = None
    groups_total: int | None = None
    spearman: float | None = None
    built_for: str = "unknown"
    built_for_release: str | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def stale_fraction(self) -> float:
        """Share of ranked (layer, expert) pairs that no longer name the same expert, 0..1 (0 with no pairs)."""
        return 0.0 if self.n_ranked == 0 else 1.0 - self.still_same / self.n_ranked

    @property
    def top_k_overlap(self) -> int:
        """Pairs shared by the two top-k sets, summed over layers."""
        return sum(t.overlap for t in self.top_k)

    @property
    def top_k_total(self) -> int:
        """Size of the top-k sets, summed over layers."""
        return sum(t.k for t in self.top_k)

    @property
    def verdict(self) -> str:
        """``fresh`` (nothing moved), ``tolerable`` (stale_fraction <= max_stale) or ``stale``."""
        if self.form == "allocations" and self.built_for == "new":
            return "fresh"
        s = self.stale_fraction
        if s == 0:
            return "fresh"
        return "tolerable" if s <= self.max_stale else "stale"

    @property
    def exit_code(self) -> int:
        """CLI exit code: 1 when the verdict is ``stale`` (a failed check), else 0."""
        return 1 if self.verdict == "stale" else 0

    def to_dict(self) -> dict[str, Any]:
        d = {"form": self.form, "verdict": self.verdict, "stale_fraction": round(self.stale_fraction, 6),
             "max_stale": self.max_stale, "n_layers": self.n_layers, "n_expert": self.n_expert,
             "n_ranked": self.n_ranked, "still_same": self.still_same, "recoverable": self.recoverable,
             "per_layer_changed": {str(i): v for i, v in enumerate(self.per_layer_changed)},
             "per_layer_pairs_changed": {str(i): v for i, v in enumerate(self.per_layer_pairs_changed)},
             "slots_per_layer": self.slots_per_layer, "top_k_overlap": self.top_k_overlap,
             "top_k_total": self.top_k_total,
             "top_k": [{"layer": t.layer, "k": t.k, "overlap": t.overlap, "fall_out": t.fall_out, "come_in": t.come_in}
                       for t in self.top_k],
             "built_for": self.built_for, "built_for_release": self.built_for_release, "inputs": self.inputs, "notes": self.notes}
        if self.form == "allocations":
            d.update({"per_layer_lines_changed": {str(i): v for i, v in enumerate(self.per_layer_lines_changed or [])},
                      "allocation_lines_changed": self.allocation_lines_changed,
                      "allocation_entries": self.allocation_entries,
                      "groups_changed": self.groups_changed, "groups_total": self.groups_total})
        else:
            d["spearman"] = None if self.spearman is None else round(self.spearman, 6)
        return d

    def to_markdown(self) -> str:
        """A markdown report (what ``profile-diff`` prints without ``--json``)."""
        L = self.n_layers
        pct = 100.0 * self.stale_fraction
        lines = [f"# profile-diff: {self.verdict.upper()}", ""]
        if self.form == "allocations":
            lines.append(f"Profile `{self.inputs.get('profile', '')}` against `{self.inputs.get('old_alloc', '')}` -> "
                         f"`{self.inputs.get('new_alloc', '')}` ({L} layers x {self.n_expert} experts).")
            lines.append("")
            lines.append(f"- **{self.still_same} of {self.n_ranked}** ranked pairs still name the same original expert "
                         f"({pct:.1f}% stale; threshold {100 * self.max_stale:.1f}%).")
            if self.recoverable is not None:
                lines.append(f"- {self.recoverable} of the {self.n_ranked - self.still_same} changed pairs name an expert "
                             f"the new revision still keeps: `stratatools remap-profile` recovers them.")
            if self.allocation_lines_changed is not None:
                lines.append(f"- {self.allocation_lines_changed} of {self.allocation_entries} allocation entries changed "
                             f"at the same position, in {self.groups_changed} of {self.groups_total} groups.")
            rel = f" ({self.built_for_release})" if self.built_for_release else ""
            lines.append(f"- Built for (provenance sidecar or release registry): **{self.built_for}**{rel}.")
        else:
            lines.append(f"Profiles `{self.inputs.get('a', '')}` and `{self.inputs.get('b', '')}` "
                         f"({L} layers x {self.n_expert} experts).")
            lines.append("")
            lines.append(f"- **{self.still_same} of {self.n_ranked}** rank positions hold the same pair ({pct:.1f}% differ; "
                         f"threshold {100 * self.max_stale:.1f}%).")
            if self.spearman is not None:
                lines.append(f"- Spearman rank correlation over pairs both rank: {self.spearman:.4f}.")
        lines.append(f"- Top-{self.slots_per_layer} per layer: {self.top_k_overlap} of {self.top_k_total} "
                     f"intended experts still loaded.")
        for n in self.notes:
            lines.append(f"- Note: {n}")
        alloc_form = self.form == "allocations"
        lines += ["", "| layer | " + ("dense idx changed | alloc lines changed | pairs changed | " if alloc_form
                                        else "positions changed | ") +
                  f"top-{self.slots_per_layer} overlap | fall out | come in |",
                  "|---:|" + ("---:|---:|---:|" if alloc_form else "---:|") + "---:|---|---|"]
        for i in range(L):
            t = self.top_k[i]
            cells = [str(i), str(self.per_layer_changed[i])]
            if alloc_form:
                cells += [str((self.per_layer_lines_changed or [0] * L)[i]), str(self.per_layer_pairs_changed[i])]
            cells += [f"{t.overlap}/{t.k}", _short(t.fall_out), _short(t.come_in)]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", _verdict_line(self)]
        return "\n".join(lines) + "\n"


def _short(xs: list[int], n: int = 8) -> str:
    s = ", ".join(str(x) for x in xs[:n])
    return s + (f", ... (+{len(xs) - n})" if len(xs) > n else "") if xs else "-"


def _verdict_line(r: DiffResult) -> str:
    if r.verdict == "fresh":
        return "**Verdict: fresh.** The profile names the experts it was built for."
    if r.verdict == "tolerable":
        return f"**Verdict: tolerable** ({100 * r.stale_fraction:.1f}% <= {100 * r.max_stale:.1f}%)."
    fix = (" Fix: `stratatools remap-profile PROFILE --from-alloc OLD --to-alloc NEW -o OUT`."
           if r.form == "allocations" else "")
    return f"**Verdict: STALE** ({100 * r.stale_fraction:.1f}% > {100 * r.max_stale:.1f}%).{fix}"


def _topk_compare(intended: list[np.ndarray], actual: list[np.ndarray], k: int) -> list[TopKLayer]:
    out = []
    for layer, (a, b) in enumerate(zip(intended, actual)):
        sa, sb = set(a.tolist()), set(b.tolist())
        out.append(TopKLayer(layer, len(a), len(sa & sb), sorted(sa - sb), sorted(sb - sa)))
    return out


def profile_vs_allocations(prof: Profile, old: SurvivorMap, new: SurvivorMap, *, slots_per_layer: int | None = None,
                           max_stale: float = 0.0, alloc_old: Allocation | None = None,
                           alloc_new: Allocation | None = None) -> DiffResult:
    """Form 1: how stale is a profile built for ``old`` when the engine loads it on ``new``.

    Args:
        prof: profile of the OLD pruned model (L x E_old, dense indices).
        old, new: survivor maps of the two revisions (same L and original count).
        slots_per_layer: K for the top-K comparison (default: :func:`default_slots_per_layer`).
        alloc_old, alloc_new: the parsed files, for line-level counts (optional).

    Top-K sets are in original indices: intended = OLD.orig of the profile's first K indices per layer;
    actual = NEW.orig of the same indices (what the engine loads now).

    Raises:
        StrataError: the maps are not of one model; the profile's dims differ from OLD's (L, kept).
    """
    if (old.n_layers, old.n_original) != (new.n_layers, new.n_original):
        raise StrataError(f"{new.source}: {new.n_layers} layers x {new.n_original} original experts, but "
                          f"{old.source} has {old.n_layers} x {old.n_original}; not revisions of one model")
    E_old = old.n_kept_required("the profile")
    if (prof.n_layers, prof.n_expert) != (old.n_layers, E_old):
        raise StrataError(f"the profile is {prof.n_layers} layers x {prof.n_expert} experts but {Path(old.source).name} "
                          f"keeps {old.n_layers} x {E_old}; pass the allocation the profile was built for as --old-alloc")
    L = prof.n_layers
    o_old = old.orig_table()
    o_new = new.orig_table()
    width = max(o_old.shape[1], o_new.shape[1])
    o_old = np.pad(o_old, ((0, 0), (0, width - o_old.shape[1])), constant_values=-1)
    o_new = np.pad(o_new, ((0, 0), (0, width - o_new.shape[1])), constant_values=-2)
    lay, idx = prof.pairs[:, 0], prof.pairs[:, 1]
    meant = o_old[lay, idx]
    now = o_new[lay, idx]
    same = meant == now
    kept_new = new.dense_table()[lay, meant] >= 0 if len(lay) else np.zeros(0, bool)
    per_layer_changed = [int((a != b).sum()) for a, b in zip(o_old, o_new)]
    # indices only one revision has count as changed: o_old pads with -1, o_new with -2
    pairs_changed = np.bincount(lay[~same], minlength=L)
    k = slots_per_layer if slots_per_layer is not None else default_slots_per_layer(E_old)
    if k < 1:
        raise StrataError(f"--slots-per-layer {k}: must be 1 or more")
    top = top_k_per_layer(prof, k)
    intended = [o_old[layer, t] for layer, t in enumerate(top)]
    actual = [o_new[layer, t] for layer, t in enumerate(top)]
    actual = [a[a >= 0] for a in actual]
    res = DiffResult("allocations", L, prof.n_expert, prof.n_ranked, int(same.sum()), per_layer_changed,
                     pairs_changed.tolist(), k, _topk_compare(intended, actual, k), max_stale,
                     recoverable=int((~same & kept_new).sum()))
    if alloc_old is not None and alloc_new is not None:
        d = diff_allocations(alloc_old, alloc_new)
        res.per_layer_lines_changed = d.lines_changed_per_layer
        res.allocation_lines_changed = d.entries_changed
        res.allocation_entries = d.entries_a
        res.groups_changed, res.groups_total = d.groups_changed, d.groups_total
    return res


def _spearman(a: Profile, b: Profile) -> float | None:
    ra, rb = a.rank_table().ravel(), b.rank_table().ravel()
    both = (ra >= 0) & (rb >= 0)
    n = int(both.sum())
    if n < 2:
        return None
    x = np.argsort(np.argsort(ra[both], kind="stable"), kind="stable").astype(np.float64)
    y = np.argsort(np.argsort(rb[both], kind="stable"), kind="stable").astype(np.float64)
    x -= x.mean()
    y -= y.mean()
    den = float(np.sqrt((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / den) if den else None


def profile_vs_profile(a: Profile, b: Profile, *, slots_per_layer: int | None = None,
                       max_stale: float = 0.0) -> DiffResult:
    """Form 2: two profiles of one model (same L x E).

    ``still_same`` counts rank positions i (i < A's n_ranked) where B holds the same pair; the stale
    fraction is relative to A's n_ranked. Raises StrataError when the dims differ.
    """
    if (a.n_layers, a.n_expert) != (b.n_layers, b.n_expert):
        raise StrataError(f"the profiles are {a.n_layers} x {a.n_expert} and {b.n_layers} x {b.n_expert}: not of one "
                          f"model; use --old-alloc/--new-alloc to compare across revisions")
    n = min(a.n_ranked, b.n_ranked)
    eq = np.zeros(a.n_ranked, dtype=bool)
    eq[:n] = (a.pairs[:n] == b.pairs[:n]).all(axis=1)
    L = a.n_layers
    changed = np.bincount(a.pairs[~eq, 0], minlength=L).tolist()
    k = slots_per_layer if slots_per_layer is not None else default_slots_per_layer(a.n_expert)
    if k < 1:
        raise StrataError(f"--slots-per-layer {k}: must be 1 or more")
    top = _topk_compare(top_k_per_layer(a, k), top_k_per_layer(b, k), k)
    return DiffResult("profiles", L, a.n_expert, a.n_ranked, int(eq.sum()), changed, changed, k, top, max_stale,
                      spearman=_spearman(a, b))


def _built_for_label(sidecar: dict[str, Any] | None, old: Allocation, new: Allocation) -> tuple[str, str | None]:
    b = built_for(sidecar)
    if b is None:
        return "unknown", None
    sha = b.get("sha256")
    rel = b.get("release")
    if sha and sha == old.sha256:
        return "old", rel
    if sha and sha == new.sha256:
        return "new", rel
    return "other", rel or b.get("name")


def diff_files(profile: str | os.PathLike, other: str | os.PathLike | None = None, *,
               old_alloc: str | os.PathLike | None = None, new_alloc: str | os.PathLike | None = None,
               slots_per_layer: int | None = None, max_stale: float = 0.0) -> DiffResult:
    """``stratatools profile-diff``: either ``profile`` + ``old_alloc`` + ``new_alloc``, or two profiles.

    Uses the profile's provenance sidecar when present to say which release it was built for; a profile
    whose sidecar names NEW's allocation is ``fresh`` (nothing to fix).

    Raises:
        StrataError: wrong option combination; every reader error.
    """
    if not 0.0 <= max_stale <= 1.0:
        raise StrataError(f"--max-stale {max_stale}: must be a fraction between 0 and 1")
    from stratatools.core import provenance

    if other is not None:
        if old_alloc is not None or new_alloc is not None:
            raise StrataError("give either two profiles or one profile with --old-alloc and --new-alloc, not both")
        a, b = read_profile(profile), read_profile(other)
        if (a.n_layers, a.n_expert) != (b.n_layers, b.n_expert):
            raise StrataError(f"{other}: byte 8: {b.n_layers} layers x {b.n_expert} experts but {profile} is "
                              f"{a.n_layers} x {a.n_expert}: not of one model; use --old-alloc/--new-alloc "
                              f"to compare across revisions", other)
        res = profile_vs_profile(a, b, slots_per_layer=slots_per_layer, max_stale=max_stale)
        res.inputs = {"a": str(profile), "b": str(other)}
        ba, bb = built_for(provenance.read_sidecar(profile)), built_for(provenance.read_sidecar(other))
        if ba and bb and ba.get("sha256") != bb.get("sha256"):
            res.notes.append(f"the sidecars say the profiles were built for different allocations "
                             f"({ba.get('release') or ba.get('name')} and {bb.get('release') or bb.get('name')}); "
                             f"compare them across revisions with --old-alloc/--new-alloc instead")
        return res
    if old_alloc is None or new_alloc is None:
        raise StrataError("profile-diff PROFILE needs --old-alloc and --new-alloc (or a second profile)")
    ao, an = read_allocation(old_alloc), read_allocation(new_alloc)
    prof = read_profile(profile)
    sm_old = ao.survivor_map()
    e_old = sm_old.uniform_n_kept
    if e_old is not None and (prof.n_layers, prof.n_expert) != (sm_old.n_layers, e_old):
        raise StrataError(f"{profile}: byte 8: the profile is {prof.n_layers} layers x {prof.n_expert} experts but "
                          f"{ao.name} keeps {sm_old.n_layers} x {e_old}; pass the allocation the profile was built "
                          f"for as --old-alloc", profile)
    res = profile_vs_allocations(prof, ao.survivor_map(), an.survivor_map(), slots_per_layer=slots_per_layer,
                                 max_stale=max_stale, alloc_old=ao, alloc_new=an)
    res.inputs = {"profile": str(profile), "old_alloc": str(old_alloc), "new_alloc": str(new_alloc),
                  "old_release": identify_release(ao.sha256), "new_release": identify_release(an.sha256),
                  "profile_release": identify_release(_sha(profile))}
    label, rel = _built_for_label(provenance.read_sidecar(profile), ao, an)
    if label == "unknown" and res.inputs["profile_release"]:
        # the registry knows this profile file: compare its release with the two allocations'
        pr = res.inputs["profile_release"]
        label = "old" if pr == res.inputs["old_release"] else "new" if pr == res.inputs["new_release"] else "other"
        rel = pr
    res.built_for, res.built_for_release = label, rel
    if label == "new":
        res.notes.append(f"the profile's provenance says it was built for the new allocation ({an.name}): it is fresh "
                         f"there and nothing needs remapping; the counts above assume it was built for {ao.name} "
                         f"(were --old-alloc and --new-alloc swapped?)")
    elif label == "other":
        res.notes.append(f"the profile's provenance names another allocation ({rel}); the numbers assume it was "
                         f"built for {ao.name}")
    return res


def _sha(path: str | os.PathLike) -> str | None:
    from stratatools.core.fsutil import sha256_file

    try:
        return sha256_file(path)
    except OSError:
        return None


def stale_check_and_fix(profile: str | os.PathLike, old_alloc: str | os.PathLike, new_alloc: str | os.PathLike,
                        out: str | os.PathLike, *, fill: str = "layer-major", max_stale: float = 0.0,
                        force: bool = False):
    """For the demo: diff ``profile`` (built for ``old_alloc``) against ``new_alloc``, then remap it to ``out``.

    Returns:
        (DiffResult before, RemapResult, DiffResult of the remapped profile against NEW -> NEW, i.e. fresh).
    """
    from stratatools.profiles.remap import remap_profile_files

    before = diff_files(profile, old_alloc=old_alloc, new_alloc=new_alloc, max_stale=max_stale)
    fixed = remap_profile_files(profile, out, from_alloc=old_alloc, to_alloc=new_alloc, fill=fill, force=force)
    after = diff_files(out, old_alloc=new_alloc, new_alloc=new_alloc, max_stale=max_stale)
    return before, fixed, after


__all__ = ["DiffResult", "TopKLayer", "default_slots_per_layer", "top_k_per_layer", "profile_vs_allocations",
           "profile_vs_profile", "diff_files", "stale_check_and_fix"]
