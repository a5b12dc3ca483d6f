"""Survivor maps recovered from the weights: router rows matched exactly (formats.md section 6).

Routers (``blk.L.ffn_gate_inp.weight``, [n_embd, E], F32 or BF16) are stored unquantized, and pruning copies
them row by row, so each row of a pruned model's router equals exactly one row of the full model's router
(and rows of two pruned revisions match each other the same way). Matching the rows bit for bit recovers the
survivor map without trusting the allocation text. Only the router tensors are read (a few MB even for the
48 x 512 x 2560 Coder), through the memory map of each shard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stratatools.alloc.allocation import Allocation, SurvivorMap, read_allocation
from stratatools.core.errors import StrataError
from stratatools.model.geometry import read_geometry, router_name
from stratatools.model.gguf import Model, use_model


@dataclass
class LayerMatch:
    """Router rows of one layer matched against the reference model.

    Attributes:
        layer: the layer.
        match: int64 [E_pruned]: the reference row index each pruned row equals; -1 unmatched, -2 ambiguous.
        candidates: for ambiguous rows, pruned index -> every reference row it equals.
        shared: reference rows that more than one pruned row equals.
        expected: int64 [E_pruned] from the allocation file(s) (-1: the expert is not in the reference), or None.
    """

    layer: int
    match: np.ndarray
    candidates: dict[int, list[int]] = field(default_factory=dict)
    shared: list[int] = field(default_factory=list)
    expected: np.ndarray | None = None

    @property
    def unmatched(self) -> list[int]:
        return np.nonzero(self.match == -1)[0].tolist()

    @property
    def ambiguous(self) -> list[int]:
        return np.nonzero(self.match == -2)[0].tolist()

    @property
    def ascending(self) -> bool:
        """True when the matched reference indices increase with the pruned index (ascending packing)."""
        m = self.match[self.match >= 0]
        return bool((np.diff(m) > 0).all())

    def disagreements(self) -> list[int]:
        """Pruned indices where the routers and the allocation disagree (ambiguous rows agree when the
        allocation's choice is among the candidates)."""
        if self.expected is None:
            return []
        bad = []
        for k, (m, e) in enumerate(zip(self.match.tolist(), self.expected.tolist())):
            if m == -2:
                if e not in self.candidates.get(k, []):
                    bad.append(k)
            elif m != e:
                bad.append(k)
        return bad


@dataclass
class VerifyResult:
    """What ``alloc verify`` found.

    Attributes:
        pruned, reference: model paths.
        kind: ``"full"`` (reference is the unpruned model) or ``"other"`` (another pruned revision).
        layers: per trunk layer, a :class:`LayerMatch`.
        compared: whether an allocation map was compared (``expected`` set).
        router_types: (pruned, reference) router type names.
    """

    pruned: str
    reference: str
    kind: str
    layers: list[LayerMatch]
    compared: bool = False
    router_types: tuple[str, str] = ("", "")
    notes: list[str] = field(default_factory=list)
    n_reference: int = 0

    @property
    def n_unmatched(self) -> int:
        return sum(len(x.unmatched) for x in self.layers)

    @property
    def n_ambiguous(self) -> int:
        return sum(len(x.ambiguous) for x in self.layers)

    @property
    def n_disagree(self) -> int:
        return sum(len(x.disagreements()) for x in self.layers)

    @property
    def ok(self) -> bool:
        """Every row resolved (for a full reference: matched once; for another revision: unmatched rows only
        where the allocations say the expert is not kept there) and the allocation agrees."""
        if self.compared:
            return self.n_disagree == 0
        if self.kind == "full":
            return self.n_unmatched == 0 and self.n_ambiguous == 0 and all(not x.shared for x in self.layers)
        return self.n_ambiguous == 0 and all(not x.shared for x in self.layers)

    def survivor_map(self) -> SurvivorMap:
        """The router-derived map (kind ``full``; every row matched once, ascending). Raises StrataError otherwise."""
        if self.kind != "full":
            raise StrataError("a survivor map in original indices needs --full (the unpruned model) as the reference")
        if self.n_unmatched or self.n_ambiguous:
            raise StrataError(f"{self.pruned}: {self.n_unmatched} router rows unmatched and {self.n_ambiguous} "
                              f"ambiguous; the routers do not determine the map")
        if not all(x.ascending for x in self.layers):
            raise StrataError(f"{self.pruned}: survivors are not stored in ascending original index; a survivor map "
                              f"(docs/formats.md, 'ISTA-DASLab *.rco-allocation.txt') cannot describe this model")
        return SurvivorMap(self.n_reference, [x.match.copy() for x in self.layers], source=f"routers of {self.pruned}")

    def to_dict(self) -> dict[str, Any]:
        return {"pruned": self.pruned, "reference": self.reference, "kind": self.kind, "ok": self.ok,
                "compared_with_allocation": self.compared, "router_types": list(self.router_types),
                "unmatched": self.n_unmatched, "ambiguous": self.n_ambiguous, "disagreements": self.n_disagree,
                "notes": self.notes,
                "layers": [{"layer": x.layer, "n_expert": int(len(x.match)), "match": x.match.tolist(),
                            "unmatched": x.unmatched, "ambiguous": {str(k): v for k, v in x.candidates.items()},
                            "shared_reference_rows": x.shared, "ascending": x.ascending,
                            "expected": None if x.expected is None else x.expected.tolist(),
                            "disagreements": x.disagreements()} for x in self.layers]}


def _rows(model: Model, layer: int) -> tuple[np.ndarray, str]:
    """Router rows of ``layer`` as float32 [E, n_embd] (BF16/F16 widened exactly) and the stored type name."""
    t = model.tensor(router_name(layer))
    return np.ascontiguousarray(model.array(t.name), dtype=np.float32), t.type.name


def match_rows(pruned: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, dict[int, list[int]], list[int]]:
    """Match each row of ``pruned`` [Ep, n] to the bit-identical rows of ``ref`` [Er, n].

    Returns:
        (match int64 [Ep]: reference index, -1 none, -2 several; candidates of ambiguous rows;
        reference rows claimed by more than one pruned row).
    """
    index: dict[bytes, list[int]] = {}
    rv = ref.view(np.uint32)
    for j in range(rv.shape[0]):
        index.setdefault(rv[j].tobytes(), []).append(j)
    pv = pruned.view(np.uint32)
    match = np.full(pv.shape[0], -1, dtype=np.int64)
    cands: dict[int, list[int]] = {}
    for k in range(pv.shape[0]):
        hit = index.get(pv[k].tobytes())
        if hit is None:
            continue
        if len(hit) == 1:
            match[k] = hit[0]
        else:
            match[k] = -2
            cands[k] = list(hit)
    m = match[match >= 0]
    u, c = np.unique(m, return_counts=True)
    return match, cands, u[c > 1].tolist()


def _refuse_not_full(mp: Model, mr: Model, gp, gr) -> None:
    """Refuse a ``--full`` reference that cannot be the unpruned model of ``mp``: the pruned file itself (the same
    file, or any shard of its set), or a model whose routers keep no more experts than the pruned one's in every
    trunk layer (its copy, another pruned revision), or fewer in some layer (the two models given the wrong way
    round). Raises StrataError naming the reference, the layer and the counts."""
    ref, pruned = mr.path, mp.path
    for fr in mr.files:
        for fp in mp.files:
            try:
                same = os.path.samefile(fr.path, fp.path)
            except OSError:
                same = False
            if same:
                raise StrataError(f"{ref}: is the pruned model itself ({fp.path}); --full takes the unpruned model it "
                                  f"was cut from (more experts per layer), or use --other for another revision", ref)
    pairs = [(i, lp.n_expert, lr.n_expert) for i, (lp, lr) in enumerate(zip(gp.layers, gr.layers))
             if lp is not None and lr is not None]
    fewer = [x for x in pairs if x[2] < x[1]]
    if fewer:
        i, ep, er = fewer[0]
        raise StrataError(f"{ref}: layer {i} keeps {er} experts, fewer than the {ep} of the pruned model {pruned}; "
                          f"--full takes the unpruned model (were --pruned and --full given the wrong way round?)", ref)
    if pairs and all(er == ep for _, ep, er in pairs):
        raise StrataError(f"{ref}: every trunk layer keeps as many experts as the pruned model {pruned} ({pairs[0][1]} "
                          f"in layer {pairs[0][0]}): it is not the unpruned model; --full takes the model the pruned one "
                          f"was cut from (more experts per layer), or use --other for another revision", ref)


def verify_survivors(pruned: str | os.PathLike | Model, *, full: str | os.PathLike | None = None,
                     other: str | os.PathLike | None = None, alloc: str | os.PathLike | Allocation | None = None,
                     other_alloc: str | os.PathLike | Allocation | None = None) -> VerifyResult:
    """Recover the survivor map of ``pruned`` from its routers and compare it with the allocation text.

    Args:
        pruned: the pruned GGUF (any shard of a set).
        full: the unpruned model: the result maps dense index -> original index.
        other: another pruned revision instead: dense index -> the other's dense index (-1 when the other
            revision does not keep the expert).
        alloc: the pruned model's allocation; compared with the router map when given. With ``other``,
            ``other_alloc`` (the other revision's allocation) is needed too: the expected match is
            ``dense_other(orig_alloc(k))``.

    Raises:
        StrataError: exactly one of full/other is required; layer counts or widths differ; model errors;
            allocation kept counts that disagree with the routers; a ``full`` that is the pruned file itself or
            keeps no more experts than it in every layer (or fewer in one).
    """
    if (full is None) == (other is None):
        raise StrataError("alloc verify needs exactly one reference: --full F.gguf or --other Q.gguf")
    ref_path = full if full is not None else other
    kind = "full" if full is not None else "other"
    a = read_allocation(alloc) if isinstance(alloc, (str, os.PathLike)) else alloc
    b = read_allocation(other_alloc) if isinstance(other_alloc, (str, os.PathLike)) else other_alloc
    with use_model(pruned) as mp, use_model(ref_path) as mr:
        pruned = mp.path
        gp, gr = read_geometry(mp), read_geometry(mr)
        if gp.n_trunk != gr.n_trunk:
            raise StrataError(f"{ref_path}: {gr.n_trunk} trunk layers but {pruned} has {gp.n_trunk}; not the same model", ref_path)
        if gp.n_embd and gr.n_embd and gp.n_embd != gr.n_embd:
            raise StrataError(f"{ref_path}: width {gr.n_embd} but {pruned} has {gp.n_embd}; not the same model", ref_path)
        if kind == "full":
            _refuse_not_full(mp, mr, gp, gr)
        layers: list[LayerMatch] = []
        types = ("", "")
        n_ref = 0
        for layer in range(gp.n_trunk):
            if gp.layers[layer] is None or gr.layers[layer] is None:
                continue
            rp, tp = _rows(mp, layer)
            rr, tr = _rows(mr, layer)
            if rp.shape[1] != rr.shape[1]:
                raise StrataError(f"{ref_path}: router of layer {layer} is {rr.shape[1]} wide but {pruned}'s is "
                                  f"{rp.shape[1]}; not the same model", ref_path)
            types = (tp, tr)
            n_ref = max(n_ref, rr.shape[0])
            match, cands, shared = match_rows(rp, rr)
            layers.append(LayerMatch(layer, match, cands, shared))
    res = VerifyResult(str(pruned), str(ref_path), kind, layers, router_types=types)
    res.n_reference = n_ref
    if types[0] != types[1]:
        res.notes.append(f"router types differ ({types[0]} vs {types[1]}); rows were compared as float32")
    if a is not None:
        sm = a.survivor_map()
        if sm.n_layers != len(layers):
            raise StrataError(f"{a.path}: lists {sm.n_layers} layers but {pruned} has {len(layers)} routers", a.path)
        for x, kept in zip(layers, sm.kept):
            if len(kept) != len(x.match):
                ln = int(a.line[a.layer == x.layer].min())
                raise StrataError(f"{a.path}: line {ln}: layer {x.layer} keeps {len(kept)} experts but the router of "
                                  f"{Path(str(pruned)).name} has {len(x.match)} (ne1); this allocation is not the map "
                                  f"of that model", a.path)
        if kind == "full":
            for x, kept in zip(layers, sm.kept):
                x.expected = kept.copy()
            res.compared = True
        elif b is not None:
            smb = b.survivor_map()
            if smb.n_layers != sm.n_layers or smb.n_original != sm.n_original:
                raise StrataError(f"{b.path}: {smb.n_layers} x {smb.n_original} original experts but {a.path} has "
                                  f"{sm.n_layers} x {sm.n_original}; not revisions of one model", b.path)
            dense_b = smb.dense_table()
            for x, kept in zip(layers, sm.kept):
                x.expected = dense_b[x.layer, kept]
            res.compared = True
        else:
            res.notes.append("with --other, comparing with the text needs --other-alloc too (the other revision's map)")
    if kind == "full" and not all(x.ascending for x in layers if not x.unmatched):
        res.notes.append("the pruned model does not store its survivors in ascending original index in every layer")
    return res


__all__ = ["LayerMatch", "VerifyResult", "match_rows", "verify_survivors"]
