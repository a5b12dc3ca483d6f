"""Remapping expert profiles across expert numberings (formats.md sections 4 and 6).

Two cases:

* **full -> pruned** (``--alloc A``): a profile of the full model (original indices, e.g. 48 x 512) onto the
  pruned model of allocation A (dense indices, 48 x 256).
* **pruned -> pruned** (``--from-alloc OLD --to-alloc NEW``): a profile built on one pruned revision onto
  another; each dense index goes through its original index.

Each ranked pair is mapped through original indices; pairs of experts the target prunes are dropped, as
are repeats (the first occurrence keeps its place); then the target's survivors the ranking never named are
appended: ``layer-major`` (layer 0's leftovers in index order, then layer 1's, ...: how Strata's shipped
Coder profile was built, formats.md section 4), ``expert-major`` ((0,0), (1,0), ..., as make_profile fills)
or ``none``. ``slots`` cuts the result to its first N pairs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stratatools.alloc.allocation import Allocation, SurvivorMap, read_allocation
from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile, read_profile

FILLS = ("layer-major", "expert-major", "none")


@dataclass
class RemapResult:
    """A remapped profile and what happened to each pair.

    Attributes:
        profile: the new profile (dense indices of the target model).
        mode: ``"full-to-pruned"`` or ``"pruned-to-pruned"``.
        fill: the fill order used.
        n_input: ranked pairs of the input profile.
        kept: input pairs carried over, per layer (int list [L]).
        dropped_pruned: input pairs whose expert the target prunes, per layer.
        dropped_repeat: input pairs that repeat an earlier pair, per layer.
        filled: survivors appended by the fill, per layer.
        cut: pairs removed by ``slots``, per layer.
        same_position: for pruned-to-pruned, input pairs whose dense index is unchanged by the remap.
    """

    profile: Profile
    mode: str
    fill: str
    n_input: int
    kept: list[int]
    dropped_pruned: list[int]
    dropped_repeat: list[int]
    filled: list[int]
    cut: list[int]
    slots: int | None = None
    same_position: int | None = None
    notes: list[str] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        return {"input": self.n_input, "kept": sum(self.kept), "dropped_pruned": sum(self.dropped_pruned),
                "dropped_repeat": sum(self.dropped_repeat), "filled": sum(self.filled), "cut": sum(self.cut),
                "output": self.profile.n_ranked}

    def to_dict(self) -> dict[str, Any]:
        L = self.profile.n_layers
        return {"mode": self.mode, "fill": self.fill, "slots": self.slots,
                "n_layers": L, "n_expert": self.profile.n_expert, "totals": self.totals(),
                "same_position": self.same_position,
                "per_layer": [{"layer": i, "kept": self.kept[i], "dropped_pruned": self.dropped_pruned[i],
                               "dropped_repeat": self.dropped_repeat[i], "filled": self.filled[i], "cut": self.cut[i]}
                              for i in range(L)],
                "notes": self.notes}


def fill_pairs(n_layers: int, n_expert: int, taken: np.ndarray, fill: str) -> np.ndarray:
    """Flat indices (``layer*n_expert + expert``) of every pair not in ``taken`` (bool [L*E]), in fill order.

    Raises:
        StrataError: unknown fill.
    """
    if fill == "none":
        return np.zeros(0, dtype=np.int64)
    flat = np.arange(n_layers * n_expert, dtype=np.int64)
    if fill == "expert-major":
        flat = flat.reshape(n_layers, n_expert).T.ravel()
    elif fill != "layer-major":
        raise StrataError(f"unknown fill {fill!r} (use {', '.join(FILLS)})")
    return flat[~taken[flat]]


def remap_pairs(pairs: np.ndarray, table: np.ndarray, n_expert_out: int, *, fill: str = "layer-major",
                slots: int | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Map ranked pairs through a per-layer index table and fill.

    Args:
        pairs: int64 [n, 2] (layer, input index).
        table: int64 [L, E_in]: output index of each input index, -1 when the target drops it.
        n_expert_out: experts per layer of the target.
        fill, slots: see the module docstring.

    Returns:
        (pairs int64 [m, 2], per-layer counts ``kept``, ``dropped_pruned``, ``dropped_repeat``, ``filled``, ``cut``).
    """
    L = table.shape[0]
    lay = pairs[:, 0]
    new = table[lay, pairs[:, 1]] if len(pairs) else np.zeros(0, dtype=np.int64)
    ok = new >= 0
    flat = lay * n_expert_out + np.where(ok, new, 0)
    # first occurrence of each mapped pair keeps its place
    first = np.zeros(len(pairs), dtype=bool)
    idx_ok = np.nonzero(ok)[0]
    if len(idx_ok):
        _, first_pos = np.unique(flat[idx_ok], return_index=True)
        first[idx_ok[first_pos]] = True
    repeat = ok & ~first
    kept_flat = flat[first]
    taken = np.zeros(L * n_expert_out, dtype=bool)
    taken[kept_flat] = True
    filled = fill_pairs(L, n_expert_out, taken, fill)
    out_flat = np.concatenate([kept_flat, filled])
    cut_flat = np.zeros(0, dtype=np.int64)
    if slots is not None:
        if slots < 0:
            raise StrataError(f"--slots {slots}: must be 0 or more")
        cut_flat = out_flat[slots:]
        out_flat = out_flat[:slots]
    counts = {
        "kept": np.bincount(lay[first], minlength=L),
        "dropped_pruned": np.bincount(lay[~ok], minlength=L),
        "dropped_repeat": np.bincount(lay[repeat], minlength=L),
        "filled": np.bincount(filled // max(n_expert_out, 1), minlength=L),
        "cut": np.bincount(cut_flat // max(n_expert_out, 1), minlength=L),
    }
    return np.stack([out_flat // n_expert_out, out_flat % n_expert_out], axis=1), counts


def _check_profile(prof: Profile, L: int, E: int, what: str, path: str) -> None:
    if (prof.n_layers, prof.n_expert) != (L, E):
        raise StrataError(f"{path}: byte 8: the profile is {prof.n_layers} layers x {prof.n_expert} experts but {what} "
                          f"is {L} x {E}; pick the allocation the profile was built for", path)


def remap_full_to_pruned(prof: Profile, alloc: SurvivorMap, *, fill: str = "layer-major", slots: int | None = None,
                         profile_path: str = "<profile>") -> RemapResult:
    """Map a full-model profile (original indices, L x E_full) onto the pruned model of ``alloc``.

    Raises:
        StrataError: the profile's dims differ from (L, E_full); layers keep different counts; unknown fill.
    """
    if fill not in FILLS:
        raise StrataError(f"unknown fill {fill!r} (use {', '.join(FILLS)})")
    E_out = alloc.n_kept_required("the remapped profile")
    _check_profile(prof, alloc.n_layers, alloc.n_original, f"the full model of {Path(alloc.source).name}", profile_path)
    pairs, c = remap_pairs(prof.pairs, alloc.dense_table(), E_out, fill=fill, slots=slots)
    return RemapResult(Profile(alloc.n_layers, E_out, pairs), "full-to-pruned", fill, prof.n_ranked,
                       *(c[k].tolist() for k in ("kept", "dropped_pruned", "dropped_repeat", "filled", "cut")),
                       slots=slots)


def remap_pruned_to_pruned(prof: Profile, old: SurvivorMap, new: SurvivorMap, *, fill: str = "layer-major",
                           slots: int | None = None, profile_path: str = "<profile>") -> RemapResult:
    """Map a profile of pruned revision ``old`` (dense indices) onto revision ``new`` through original indices.

    Raises:
        StrataError: layer or original counts differ between the maps; the profile's dims differ from
            ``old``'s; non-uniform kept counts; unknown fill.
    """
    if fill not in FILLS:
        raise StrataError(f"unknown fill {fill!r} (use {', '.join(FILLS)})")
    if (old.n_layers, old.n_original) != (new.n_layers, new.n_original):
        raise StrataError(f"{new.source}: {new.n_layers} layers x {new.n_original} original experts, but "
                          f"{old.source} has {old.n_layers} x {old.n_original}; not revisions of one model")
    E_in = old.n_kept_required("the input profile")
    E_out = new.n_kept_required("the remapped profile")
    _check_profile(prof, old.n_layers, E_in, f"the pruned model of {Path(old.source).name}", profile_path)
    orig = old.orig_table()                       # [L, E_in] dense(old) -> original
    dense_new = new.dense_table()                 # [L, E_full] original -> dense(new)
    table = np.take_along_axis(dense_new, orig, axis=1)   # [L, E_in] dense(old) -> dense(new) or -1
    pairs, c = remap_pairs(prof.pairs, table, E_out, fill=fill, slots=slots)
    same = int((table[prof.pairs[:, 0], prof.pairs[:, 1]] == prof.pairs[:, 1]).sum()) if prof.n_ranked else 0
    return RemapResult(Profile(new.n_layers, E_out, pairs), "pruned-to-pruned", fill, prof.n_ranked,
                       *(c[k].tolist() for k in ("kept", "dropped_pruned", "dropped_repeat", "filled", "cut")),
                       slots=slots, same_position=same)


def remap_profile_files(profile: str | os.PathLike, out: str | os.PathLike, *, alloc: str | os.PathLike | None = None,
                        from_alloc: str | os.PathLike | None = None, to_alloc: str | os.PathLike | None = None,
                        fill: str = "layer-major", slots: int | None = None, model: str | os.PathLike | None = None,
                        force: bool = False) -> RemapResult:
    """``stratatools remap-profile``: read, remap, write ``out`` atomically with a provenance sidecar.

    Exactly one of ``alloc`` or the pair ``from_alloc``/``to_alloc`` is given. With ``model``, the target's
    geometry (router ``ne1``, trunk layers) must equal the remapped profile's dims. When the input profile
    has a sidecar, its recorded allocation is compared with the one the remap assumes (a note when it differs).

    Raises:
        StrataError: wrong option combination, output guards for ``out`` and its ``<out>.json`` sidecar
            (exists without ``force``, would overwrite an input), and every reader/remap error.
    """
    from stratatools.core import provenance
    from stratatools.core.fsutil import guard_outputs

    if (alloc is None) == (from_alloc is None and to_alloc is None):
        raise StrataError("give either --alloc A (full profile onto a pruned model) or --from-alloc OLD --to-alloc NEW")
    if alloc is None and (from_alloc is None or to_alloc is None):
        raise StrataError("--from-alloc and --to-alloc go together")
    # the input profile's sidecar is read too (its provenance is carried over): an input as well
    inputs = [p for p in (profile, provenance.sidecar_path(profile), alloc, from_alloc, to_alloc, model)
              if p is not None]
    out, _ = guard_outputs([out, provenance.sidecar_path(out)], inputs, force)  # <out>.json is written too
    prof = read_profile(profile)
    src_prov = provenance.read_sidecar(profile)
    notes: list[str] = []
    if alloc is not None:
        a = read_allocation(alloc)
        res = remap_full_to_pruned(prof, a.survivor_map(), fill=fill, slots=slots, profile_path=str(profile))
        target = a
        alloc_inputs = [provenance.describe_file(alloc, role="allocation")]
    else:
        a_old, a_new = read_allocation(from_alloc), read_allocation(to_alloc)
        res = remap_pruned_to_pruned(prof, a_old.survivor_map(), a_new.survivor_map(), fill=fill, slots=slots,
                                     profile_path=str(profile))
        target = a_new
        alloc_inputs = [provenance.describe_file(from_alloc, role="from-allocation"),
                        provenance.describe_file(to_alloc, role="to-allocation")]
        built = built_for(src_prov)
        if built and built.get("sha256") and built["sha256"] not in (a_old.sha256,):
            which = "the --to-alloc allocation" if built["sha256"] == a_new.sha256 else "another allocation"
            notes.append(f"the profile's sidecar says it was built for {which} ({built.get('name')}), not for "
                         f"{a_old.name}; the remap assumes {a_old.name}")
    model_info = None
    if model is not None:
        from stratatools.model.geometry import read_geometry
        from stratatools.model.gguf import open_model

        with open_model(model) as m:
            g = read_geometry(m)
            if (g.n_trunk, g.uniform_n_expert) != (res.profile.n_layers, res.profile.n_expert):
                raise StrataError(f"{model}: the model has {g.n_trunk} layers x {g.uniform_n_expert} experts (routers) "
                                  f"but the remapped profile is {res.profile.n_layers} x {res.profile.n_expert}; "
                                  f"the allocation is not this model's", model)
        model_info = {"name": Path(model).name, "n_layers": g.n_trunk, "n_expert": g.uniform_n_expert,
                      "shards": provenance.describe_shards([f.path for f in m.files])}
    data = res.profile.to_bytes()  # written with its sidecar below, as one set
    inputs_desc = [provenance.describe_file(profile, role="profile")] + alloc_inputs
    if model is not None:
        inputs_desc.append({"name": Path(model).name, "path": str(model), "role": "model"})
    rec = provenance.build(
        "profile", inputs_desc,
        options={"fill": fill, "slots": slots, "mode": res.mode},
        model=model_info or {"n_layers": res.profile.n_layers, "n_expert": res.profile.n_expert},
        allocation=allocation_record(target),
        extra={"remap": res.totals(), "source_profile_built_for": built_for(src_prov)})
    provenance.write_with_sidecar(out, data, rec, inputs)
    res.notes.extend(notes)
    return res


def allocation_record(a: Allocation) -> dict[str, Any]:
    """{name, sha256, title[, release]} of an allocation for a provenance sidecar; ``release`` is the
    registry key (``name@revision``) when allocations/releases.toml knows the digest."""
    rec: dict[str, Any] = {"name": a.name, "sha256": a.sha256, "title": a.title}
    rel = identify_release(a.sha256)
    if rel:
        rec["release"] = rel
    return rec


def identify_release(sha256: str | None) -> str | None:
    """The registry key of an allocation or profile digest, or None (no registry, unknown digest)."""
    if not sha256:
        return None
    try:
        from stratatools.alloc.registry import load_registry

        hit = load_registry().identify(sha256)
    except StrataError:  # the registry is optional here: a broken or absent one just means "unknown"
        return None
    return hit[1] if hit else None


def built_for(sidecar: dict[str, Any] | None) -> dict[str, Any] | None:
    """The allocation a profile's sidecar says it was built for, or None."""
    if not sidecar:
        return None
    a = sidecar.get("allocation")
    return a if isinstance(a, dict) else None


__all__ = ["FILLS", "RemapResult", "fill_pairs", "remap_pairs", "remap_full_to_pruned", "remap_pruned_to_pruned",
           "remap_profile_files", "allocation_record", "identify_release", "built_for"]
