"""``stratatools inspect``: what a MoE GGUF (one file or a shard set) holds, as one result object.

Every number comes from the file itself: the expert count of each layer from its router's ne1
(``blk.L.ffn_gate_inp.weight``, formats.md sections 1 and 5), types and blob bytes from the tensor infos and the
block table (formats.md section 1), trunk vs MTP from ``nextn_predict_layers``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.model.geometry import ROLES, check_consistency, read_geometry
from stratatools.model.gguf import open_model


@dataclass
class LayerInfo:
    """One block's routed experts.

    Attributes:
        layer: block index; is_mtp: an MTP (draft) block.
        n_expert: E from the router's ne1.
        n_ff: expert width (gate ne1), None when gate is missing.
        router_type, gate_type, up_type, down_type: ggml type names (None when missing).
        blob_bytes: one expert's [gate][up][down] bytes, None when a role is missing.
        shards: per role (gate, up, down) the 1-based shard number holding it.
    """

    layer: int
    is_mtp: bool
    n_expert: int
    n_ff: int | None
    router_type: str
    gate_type: str | None
    up_type: str | None
    down_type: str | None
    blob_bytes: int | None
    shards: tuple[int | None, int | None, int | None]

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "is_mtp": self.is_mtp, "n_expert": self.n_expert, "n_ff": self.n_ff,
                "router_type": self.router_type, "gate_type": self.gate_type, "up_type": self.up_type,
                "down_type": self.down_type, "blob_bytes": self.blob_bytes, "shards": list(self.shards)}


@dataclass
class ShardInfo:
    """One file of the model: name, size in bytes, tensor count, data section start."""

    name: str
    size_bytes: int
    n_tensors: int
    data_start: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size_bytes": self.size_bytes, "n_tensors": self.n_tensors,
                "data_start": self.data_start}


@dataclass
class InspectReport:
    """Everything ``inspect`` shows.

    Attributes:
        path: the path given; name: ``general.name``; architecture; synthetic: ``stratatools.synthetic``.
        block_count, n_trunk, n_mtp: blocks, trunk layers, MTP blocks.
        n_embd: ``embedding_length``; n_expert_used: k (``expert_used_count``).
        expert_count_kv: ``expert_count`` as stored (may be the canonical count of a pruned file).
        n_expert: the trunk E when all trunk routers agree, else None.
        n_ff: expert width; n_ff_shared: shared expert width.
        full_attention_layers: trunk layers with full attention.
        layers: trunk then MTP :class:`LayerInfo` (layers without a router are skipped and listed in
            ``layers_without_router``).
        expert_bytes: sum over trunk layers of blob_bytes x E.
        shards: the files.
        n_tensors: all tensors.
        problems: reasons a native pack would be refused (empty when packable).
        inconsistency: the one-line reason the metadata does not fit the tensors
            (:func:`stratatools.model.geometry.check_consistency`, which ``run``, ``pack`` and ``validate-release``
            refuse), None when they agree. ``inspect`` shows the report and then exits 2 with this line.
    """

    path: str
    name: str
    architecture: str
    synthetic: bool
    block_count: int
    n_trunk: int
    n_mtp: int
    n_embd: int
    n_expert_used: int | None
    expert_count_kv: int | None
    n_expert: int | None
    n_ff: int | None
    n_ff_shared: int | None
    full_attention_layers: list[int]
    layers: list[LayerInfo]
    layers_without_router: list[int]
    expert_bytes: int
    shards: list[ShardInfo]
    n_tensors: int
    total_bytes: int
    file_type: int | None
    problems: list[str] = field(default_factory=list)
    inconsistency: str | None = None

    @property
    def packable(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "path", "name", "architecture", "synthetic", "block_count", "n_trunk", "n_mtp", "n_embd",
            "n_expert_used", "expert_count_kv", "n_expert", "n_ff", "n_ff_shared", "full_attention_layers",
            "layers_without_router", "expert_bytes", "n_tensors", "total_bytes", "file_type", "problems",
            "inconsistency")}
        d["packable"] = self.packable
        d["layers"] = [ln.to_dict() for ln in self.layers]
        d["shards"] = [s.to_dict() for s in self.shards]
        return d


def inspect_model(path: str | os.PathLike) -> InspectReport:
    """Read a model's header(s) and describe it (no tensor data is read). Metadata that does not fit the tensors
    is not raised here: it is reported in ``inconsistency`` (the caller decides; the CLI exits 2 after showing).

    Raises:
        StrataError: unreadable or invalid GGUF, missing shards, or not a MoE model (``not a MoE model: no
            ffn_gate_inp``).
    """
    from stratatools.pack.native import plan_pack  # the same checks the packer makes

    with open_model(path) as model:
        geo = read_geometry(model)
        infos: list[LayerInfo] = []
        for le in [x for x in geo.layers if x is not None] + list(geo.mtp_layers):
            ts = [le.role(r) for r in ROLES]
            blob = le.blob_bytes if le.complete else None  # a complete layer has every role
            infos.append(LayerInfo(le.layer, le.is_mtp, le.n_expert, le.n_ff, le.router.type.name,
                                   *(t.type.name if t else None for t in ts),  # type: ignore[arg-type]
                                   blob, tuple(t.shard + 1 if t else None for t in ts)))  # type: ignore[arg-type]
        problems: list[str] = []
        try:
            plan_pack(model)
        except StrataError as e:
            problems.append(str(e))
        inconsistency = None
        try:
            check_consistency(model)
        except StrataError as e:
            inconsistency = str(e)
        trunk = [i for i in infos if not i.is_mtp]
        expert_bytes = sum((i.blob_bytes or 0) * i.n_expert for i in trunk)
        sh = model.key("expert_shared_feed_forward_length")
        if sh is None:
            t = model.tensors.get("blk.0.ffn_gate_shexp.weight")
            sh = t.ne[1] if t is not None and len(t.ne) == 2 else None
        ffs = {i.n_ff for i in trunk if i.n_ff is not None}
        ft = model.kv.get("general.file_type")
        return InspectReport(
            path=str(path), name=str(model.kv.get("general.name", "")), architecture=geo.arch,
            synthetic=bool(model.kv.get("stratatools.synthetic", False)), block_count=geo.block_count,
            n_trunk=geo.n_trunk, n_mtp=geo.n_mtp, n_embd=geo.n_embd, n_expert_used=geo.n_expert_used,
            expert_count_kv=geo.expert_count_kv, n_expert=geo.uniform_n_expert,
            n_ff=ffs.pop() if len(ffs) == 1 else None,
            n_ff_shared=_scalar_int(sh),
            full_attention_layers=list(geo.full_attention_layers), layers=infos,
            layers_without_router=[i for i, le in enumerate(geo.layers) if le is None], expert_bytes=expert_bytes,
            shards=[ShardInfo(f.path.name, f.size, len(f.tensors), f.data_start) for f in model.files],
            n_tensors=len(model.tensors), total_bytes=model.total_bytes,
            file_type=_scalar_int(ft), problems=problems, inconsistency=inconsistency)


def _scalar_int(v: Any) -> int | None:
    """An integer metadata scalar as int; None for anything else (arrays, strings, absent)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        return None
    return int(v)
