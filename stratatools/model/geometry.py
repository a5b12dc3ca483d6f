"""Model geometry of a qwen4exp (or any llama.cpp MoE) GGUF: layers, trunk vs MTP, experts per layer.

The expert count of a layer is the router's ``ne1`` (``blk.L.ffn_gate_inp.weight`` is [n_embd, E]); it is
never taken from a constant or from ``expert_count`` alone (formats.md sections 1 and 5: old packers that
assumed 512 halved every blob of the 256-expert Coder). Trunk layers are ``block_count -
nextn_predict_layers``; an MTP block is the extra ``blk.<n_trunk>`` and may keep a different expert count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from stratatools.core.errors import StrataError
from stratatools.model.ggml_types import GGMLType
from stratatools.model.gguf import Model, TensorInfo, meta_int

ROLES = ("gate", "up", "down")


def router_name(layer: int) -> str:
    """llama.cpp name of layer ``layer``'s router tensor, F32/F16 ``[n_embd, E]`` (formats.md; llama.cpp
    ``LLM_TENSOR_FFN_GATE_INP``).
    """
    return f"blk.{layer}.ffn_gate_inp.weight"


def exps_name(layer: int, role: str) -> str:
    """llama.cpp name of the stacked expert tensor of ``role`` (gate/up/down), ``[n_embd, ff, E]`` (down: ``[ff,
    n_embd, E]``).
    """
    return f"blk.{layer}.ffn_{role}_exps.weight"


@dataclass(frozen=True)
class LayerExperts:
    """The routed experts of one layer.

    Attributes:
        layer: block index.
        n_expert: E, from the router's ne1.
        n_embd: model width (router ne0).
        n_ff: expert FFN width (gate ne1).
        router: the router tensor.
        gate, up, down: the ``*_exps`` tensors (None when missing).
        is_mtp: True for an MTP (draft) block.
    """

    layer: int
    n_expert: int
    n_embd: int
    n_ff: int | None
    router: TensorInfo
    gate: TensorInfo | None
    up: TensorInfo | None
    down: TensorInfo | None
    is_mtp: bool = False

    def role(self, role: str) -> TensorInfo | None:
        """The gate, up or down tensor (None when absent). Raises KeyError for another role name."""
        return {"gate": self.gate, "up": self.up, "down": self.down}[role]

    @property
    def complete(self) -> bool:
        """True when gate, up and down are all present."""
        return self.gate is not None and self.up is not None and self.down is not None

    @property
    def gu_type(self) -> GGMLType | None:
        """GGML type of the gate (and, for a packable layer, up) matrices; None without a gate."""
        return self.gate.type if self.gate is not None else None

    @property
    def d_type(self) -> GGMLType | None:
        """GGML type of the down matrices; None without a down tensor."""
        return self.down.type if self.down is not None else None

    def slice_bytes(self, role: str) -> int:
        """Bytes of one expert's slice of ``role`` (tensor bytes / E). Raises StrataError when missing."""
        t = self.role(role)
        if t is None:
            raise StrataError(f"layer {self.layer}: tensor {exps_name(self.layer, role)} is missing")
        return t.nbytes // self.n_expert

    @property
    def blob_bytes(self) -> int:
        """One expert's ``[gate][up][down]`` bytes: 2*ff*row(gu, n_embd) + n_embd*row(d, ff) (formats.md 5)."""
        return self.slice_bytes("gate") + self.slice_bytes("up") + self.slice_bytes("down")


@dataclass
class Geometry:
    """What a model is, as far as the expert tooling cares.

    Attributes:
        arch: ``general.architecture``.
        block_count: all blocks, MTP included.
        n_trunk: trunk layers (block_count - nextn_predict_layers).
        n_mtp: MTP blocks.
        n_embd: ``embedding_length``.
        n_expert_used: ``expert_used_count`` (k).
        expert_count_kv: ``expert_count`` as stored (the canonical count; may differ from the routers).
        layers: per trunk layer, its :class:`LayerExperts` (None for a layer without a router).
        mtp_layers: the MTP blocks' experts, when present.
        full_attention_layers: trunk layers with full (QSA) attention.
        metadata: selected other keys for display.
    """

    arch: str
    block_count: int
    n_trunk: int
    n_mtp: int
    n_embd: int
    n_expert_used: int | None
    expert_count_kv: int | None
    layers: list[LayerExperts | None]
    mtp_layers: list[LayerExperts] = field(default_factory=list)
    full_attention_layers: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def expert_counts(self) -> list[int | None]:
        """E per trunk layer (from the routers)."""
        return [le.n_expert if le else None for le in self.layers]

    @property
    def uniform_n_expert(self) -> int | None:
        """E when every trunk layer agrees, else None."""
        counts = {c for c in self.expert_counts}
        return counts.pop() if len(counts) == 1 and None not in counts else None

    @property
    def n_expert(self) -> int:
        """The single trunk expert count. Raises StrataError when trunk layers disagree."""
        e = self.uniform_n_expert
        if e is None:
            raise StrataError(f"routers disagree on the expert count: {self.expert_counts}")
        return e

    def to_dict(self) -> dict[str, Any]:
        def le_dict(le: LayerExperts | None) -> dict[str, Any] | None:
            if le is None:
                return None
            d = {"layer": le.layer, "n_expert": le.n_expert, "n_ff": le.n_ff, "router_type": le.router.type.name,
                 "is_mtp": le.is_mtp}
            for r in ROLES:
                t = le.role(r)
                d[f"{r}_type"] = t.type.name if t else None
            d["blob_bytes"] = le.blob_bytes if le.complete else None
            return d

        return {
            "arch": self.arch, "block_count": self.block_count, "n_trunk": self.n_trunk, "n_mtp": self.n_mtp,
            "n_embd": self.n_embd, "n_expert_used": self.n_expert_used, "expert_count_kv": self.expert_count_kv,
            "uniform_n_expert": self.uniform_n_expert, "full_attention_layers": self.full_attention_layers,
            "layers": [le_dict(le) for le in self.layers], "mtp_layers": [le_dict(le) for le in self.mtp_layers],
            "metadata": self.metadata,
        }


def _layer_experts(model: Model, layer: int, n_embd: int, is_mtp: bool) -> LayerExperts | None:
    rname = router_name(layer)
    if rname not in model.tensors:
        return None
    router = model.tensors[rname]
    if len(router.ne) != 2:
        raise StrataError(f"{model.path}: tensor {rname} has shape {list(router.ne)}; a router is 2-D [n_embd, E]", model.path)
    e = int(router.ne[1])
    if e < 1 or int(router.ne[0]) < 1:
        raise StrataError(f"{model.path}: tensor {rname} has shape {list(router.ne)}: a router with no experts (or no "
                          f"inputs); a MoE layer needs ne1 >= 1 experts", model.path)
    roles = {r: model.tensors.get(exps_name(layer, r)) for r in ROLES}
    gate = roles["gate"]
    n_ff = int(gate.ne[1]) if gate is not None and len(gate.ne) >= 2 else None
    return LayerExperts(layer, e, int(router.ne[0]), n_ff, router, roles["gate"], roles["up"], roles["down"], is_mtp)


def read_geometry(model: Model) -> Geometry:
    """Derive the :class:`Geometry` of an open model.

    Raises:
        StrataError: ``not a MoE model: no ffn_gate_inp`` when no layer has a router; no ``block_count``.
    """
    arch = model.arch
    bc = model.key("block_count")
    if bc is None:
        raise StrataError(f"{model.path}: metadata {arch or '<arch>'}.block_count is missing; not a llama.cpp model file", model.path)
    bc = meta_int(bc, model.path, f"{arch}.block_count")
    nextn = meta_int(model.key("nextn_predict_layers", 0) or 0, model.path, f"{arch}.nextn_predict_layers")
    if not 0 <= nextn < bc:
        raise StrataError(f"{model.path}: nextn_predict_layers {nextn} is out of range for block_count {bc}", model.path)
    n_trunk = bc - nextn
    n_embd = meta_int(model.key("embedding_length", 0) or 0, model.path, f"{arch}.embedding_length")
    if bc > 100_000:
        raise StrataError(f"{model.path}: metadata {arch}.block_count is {bc}; not a plausible layer count", model.path)
    if not any(router_name(i) in model.tensors for i in range(bc)):
        raise StrataError(f"{model.path}: not a MoE model: no ffn_gate_inp (router) tensor in any of its {bc} blocks", model.path)
    layers = [_layer_experts(model, i, n_embd, False) for i in range(n_trunk)]
    mtp = [le for le in (_layer_experts(model, i, n_embd, True) for i in range(n_trunk, bc)) if le is not None]
    fai = model.key("full_attention_interval")
    rec = model.key("attention.recurrent_layers")
    if rec is not None and hasattr(rec, "__len__") and not isinstance(rec, str):
        full = [i for i in range(min(len(rec), n_trunk)) if not bool(rec[i])]
    elif fai:
        fai = meta_int(fai, model.path, f"{arch}.full_attention_interval")
        full = [i for i in range(n_trunk) if fai > 0 and i % fai == fai - 1]
    else:
        full = []
    used = model.key("expert_used_count")
    ecount = model.key("expert_count")
    meta = {}
    for k in ("general.name", "general.file_type", "general.size_label", "stratatools.synthetic"):
        if k in model.kv:
            meta[k] = model.kv[k]
    for k in ("expert_feed_forward_length", "expert_shared_feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "hyper_connection.count"):
        v = model.key(k)
        if v is not None:
            meta[k] = v.tolist() if hasattr(v, "tolist") else v
    used = meta_int(used, model.path, f"{arch}.expert_used_count") if used is not None else None
    ecount = meta_int(ecount, model.path, f"{arch}.expert_count") if ecount is not None else None
    return Geometry(arch, bc, n_trunk, nextn, n_embd, used, ecount, layers, mtp, full, meta)


_FIX = "the file's metadata and tensors disagree; re-convert it"
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def _meta(model: Model, key: str) -> int | None:
    v = model.key(key)
    if v is None:
        return None
    if hasattr(v, "__len__") and not isinstance(v, str):
        if len(v) == 0:
            return None
        v = v[0]
    return meta_int(v, model.path, f"{model.arch}.{key}")


def check_consistency(model: Model) -> None:
    """Refuse a GGUF whose metadata does not fit its tensors, before anything reshapes them.

    Checks (each only where the keys and tensors it needs are present, so a partial MoE file passes what it
    has): no tensor belongs to a block at or above ``block_count`` (llama.cpp refuses a file with unused
    tensors); ``expert_used_count`` in 1..E of every router; and for qwen4exp every tensor shape the forward
    derives from metadata (llama.cpp ``create_tensor`` checks the same shapes, ``src/llama-model.cpp``):
    attention ``attn_q`` [n_embd, 2*head_count*key_length], ``attn_k``/``attn_v`` [n_embd,
    head_count_kv*key_length], ``attn_q_norm``/``attn_k_norm`` [key_length], ``attn_output``
    [head_count*key_length, n_embd], ``rope.dimension_count`` <= key_length; gated DeltaNet ``attn_qkv``
    [n_embd, 2*group_count*state_size + inner_size], ``attn_gate`` [n_embd, inner_size], ``ssm_alpha``/
    ``ssm_beta`` [n_embd, time_step_rank], ``ssm_a``/``ssm_dt.bias`` [time_step_rank], ``ssm_conv1d``
    [conv_kernel, qkv width], ``ssm_norm`` [inner_size/time_step_rank], ``ssm_out`` [inner_size, n_embd];
    experts [n_embd, expert_feed_forward_length, E] (down transposed); shared expert
    [n_embd, expert_shared_feed_forward_length]; hyper-connection norms/mixers of hyper_connection.count x
    n_embd; the indexer ``q_proj`` a multiple of ``indexer.key_length`` wide; ``token_embd`` n_embd wide.

    Raises:
        StrataError: one line naming the file, the metadata key, the tensor and its shape, and the fix.
    """
    path, arch = model.path, model.arch
    bc = _meta(model, "block_count")
    if bc is not None:
        for name in model.tensors:
            m = _LAYER_RE.match(name)
            if m and int(m.group(1)) >= bc:
                raise StrataError(f"{path}: tensor {name} belongs to block {m.group(1)} but metadata {arch}.block_count "
                                  f"is {bc} (llama.cpp refuses unused tensors); {_FIX}", path)

    def bad(name: str, want: list[int], keys: str) -> None:
        t = model.tensors.get(name)
        if t is None:
            return
        have = [int(x) for x in t.ne]
        if have != want:
            raise StrataError(f"{path}: tensor {name} has shape {have} but metadata {keys} says {want}; {_FIX}", path)

    n_trunk = bc - (_meta(model, "nextn_predict_layers") or 0) if bc is not None else 0
    k = _meta(model, "expert_used_count")
    if k is not None:
        for il in range(n_trunk):
            r = model.tensors.get(router_name(il))
            if r is not None and len(r.ne) == 2 and not 1 <= k <= int(r.ne[1]):
                raise StrataError(f"{path}: metadata {arch}.expert_used_count {k} is not in 1..{int(r.ne[1])} (the experts "
                                  f"of {r.name} {[int(x) for x in r.ne]}); {_FIX}", path)
    if arch != "qwen4exp" or bc is None:
        return
    n = _meta(model, "embedding_length")
    if not n:
        return
    A = f"{arch}."
    bad("token_embd.weight", [n, int(model.tensors["token_embd.weight"].ne[-1])] if "token_embd.weight" in model.tensors else [], A + "embedding_length")
    nh, nkv, hd = _meta(model, "attention.head_count"), _meta(model, "attention.head_count_kv"), _meta(model, "attention.key_length")
    n_rot = _meta(model, "rope.dimension_count")
    hc, r = _meta(model, "hyper_connection.count"), _meta(model, "hyper_connection.low_rank")
    nk, dk = _meta(model, "ssm.group_count"), _meta(model, "ssm.state_size")
    nv, din, K = _meta(model, "ssm.time_step_rank"), _meta(model, "ssm.inner_size"), _meta(model, "ssm.conv_kernel")
    ff, sff = _meta(model, "expert_feed_forward_length"), _meta(model, "expert_shared_feed_forward_length")
    idh = _meta(model, "attention.indexer.key_length")
    if nh is not None and nkv is not None and (nkv < 1 or nh < 1 or nh % nkv):
        raise StrataError(f"{path}: metadata {A}attention.head_count {nh} is not a multiple of {A}attention.head_count_kv "
                          f"{nkv}; {_FIX}", path)
    if hd is not None and n_rot is not None and not (0 < n_rot <= hd and n_rot % 2 == 0):
        raise StrataError(f"{path}: metadata {A}rope.dimension_count {n_rot} is not an even number in 2..{A}attention."
                          f"key_length {hd}; {_FIX}", path)
    if nv is not None and nk is not None and nv and (nk < 1 or nv % nk or (din is not None and din % nv)):
        raise StrataError(f"{path}: metadata {A}ssm.time_step_rank {nv} is not a multiple of {A}ssm.group_count {nk} "
                          f"(or {A}ssm.inner_size {din} not a multiple of it); {_FIX}", path)
    if hc is not None:
        W = hc * n
        for pre in ["output_hc"] + [f"blk.{il}.hc_{s}" for il in range(n_trunk) for s in ("attn", "ffn")]:
            keys = f"{A}hyper_connection.count {hc} x {A}embedding_length {n}"
            bad(f"{pre}_norm.weight", [W], keys)
            if r is not None:
                bad(f"{pre}_down.weight", [W, r], keys + f", {A}hyper_connection.low_rank {r}")
                bad(f"{pre}_up.weight", [r, W], keys + f", {A}hyper_connection.low_rank {r}")
            bad(f"{pre}_inject.weight", [W, hc], keys)
    for il in range(n_trunk):
        p = f"blk.{il}."
        if nh is not None and hd is not None:
            bad(p + "attn_q.weight", [n, 2 * nh * hd], f"{A}attention.head_count {nh} x {A}attention.key_length {hd} (x2, gated)")
            bad(p + "attn_output.weight", [nh * hd, n], f"{A}attention.head_count {nh} x {A}attention.key_length {hd}")
        if nkv is not None and hd is not None:
            for t in ("attn_k", "attn_v"):
                bad(p + t + ".weight", [n, nkv * hd], f"{A}attention.head_count_kv {nkv} x {A}attention.key_length {hd}")
        if hd is not None:
            for t in ("attn_q_norm", "attn_k_norm"):
                bad(p + t + ".weight", [hd], f"{A}attention.key_length {hd}")
        if idh:
            q = model.tensors.get(p + "indexer.q_proj.weight")
            if q is not None and (len(q.ne) != 2 or int(q.ne[1]) % idh):
                raise StrataError(f"{path}: tensor {q.name} has shape {[int(x) for x in q.ne]}, not a multiple of metadata "
                                  f"{A}attention.indexer.key_length {idh} wide; {_FIX}", path)
            bad(p + "indexer.q_norm.weight", [idh], f"{A}attention.indexer.key_length {idh}")
            bad(p + "indexer.k_norm.weight", [idh], f"{A}attention.indexer.key_length {idh}")
            if n_rot is not None and n_rot > idh and p + "indexer.q_proj.weight" in model.tensors:
                raise StrataError(f"{path}: metadata {A}rope.dimension_count {n_rot} exceeds {A}attention.indexer."
                                  f"key_length {idh}; {_FIX}", path)
        if None not in (nk, dk, nv, din) and nv:
            qkv = 2 * nk * dk + din
            keys = f"{A}ssm.group_count {nk}, {A}ssm.state_size {dk}, {A}ssm.inner_size {din}"
            bad(p + "attn_qkv.weight", [n, qkv], keys + " (2*groups*state + inner)")
            if K is not None:
                bad(p + "ssm_conv1d.weight", [K, qkv], keys + f", {A}ssm.conv_kernel {K}")
            bad(p + "attn_gate.weight", [n, din], f"{A}ssm.inner_size {din}")
            bad(p + "ssm_out.weight", [din, n], f"{A}ssm.inner_size {din}")
            bad(p + "ssm_norm.weight", [din // nv], f"{A}ssm.inner_size {din} / {A}ssm.time_step_rank {nv}")
            for t in ("ssm_alpha.weight", "ssm_beta.weight"):
                bad(p + t, [n, nv], f"{A}ssm.time_step_rank {nv}")
            for t in ("ssm_a", "ssm_dt.bias"):
                bad(p + t, [nv], f"{A}ssm.time_step_rank {nv}")
    # routed and shared experts of every block, the MTP blocks (il >= n_trunk) included: they are packed into
    # the tier and read with the trunk's expert width (runtime/config.py n_ff_exp, one width for every block)
    for il in range(max(bc, n_trunk)):
        p = f"blk.{il}."
        mtp = " (MTP block)" if il >= n_trunk else ""
        rt = model.tensors.get(router_name(il))
        E = int(rt.ne[1]) if rt is not None and len(rt.ne) == 2 else None
        bad(router_name(il), [n, E] if E is not None else [], f"{A}embedding_length {n}")
        if ff is not None and E is not None:
            bad(exps_name(il, "gate"), [n, ff, E], f"{A}expert_feed_forward_length {ff}{mtp}")
            bad(exps_name(il, "up"), [n, ff, E], f"{A}expert_feed_forward_length {ff}{mtp}")
            bad(exps_name(il, "down"), [ff, n, E], f"{A}expert_feed_forward_length {ff}{mtp}")
        if sff:
            bad(p + "ffn_gate_shexp.weight", [n, sff], f"{A}expert_shared_feed_forward_length {sff}{mtp}")
            bad(p + "ffn_up_shexp.weight", [n, sff], f"{A}expert_shared_feed_forward_length {sff}{mtp}")
            bad(p + "ffn_down_shexp.weight", [sff, n], f"{A}expert_shared_feed_forward_length {sff}{mtp}")
    _check_ple(model, bad, n, hc, n_trunk)


def _check_ple(model: Model, bad, n: int, hc: int | None, n_trunk: int) -> None:
    """The per-layer-embedding (PLE) tensors against the ``ple.*`` metadata, as runtime/model.py ``_ple`` and
    ``ple_ngram_ids`` use them: ``heads = (ple.ngram_size - 1) * ple.heads_per_ngram`` hashed rows of
    ``per_layer_token_embd`` [embedding_length_per_layer_input, rows] are concatenated to ``heads * d`` values;
    per PLE layer ``ple_key`` [heads*d, hc*n], ``ple_value`` [heads*d, n], ``ple_norm_key``/``ple_norm_query``/
    ``ple_norm_conv`` [hc*n], ``ple_conv1d`` [ple.conv_kernel, hc*n]; the hash constants hold ``ple.ngram_size``
    multipliers and ``heads`` offsets and vocabulary sizes, whose rows (offset + size) fit in the table; every
    ``ple.layers`` entry is a trunk layer. ``bad(name, want, keys)`` raises for a tensor of another shape."""
    path, A = model.path, f"{model.arch}."
    layers = model.key("ple.layers")
    if layers is None:
        return
    layers = list(layers) if hasattr(layers, "__len__") and not isinstance(layers, str) else [layers]
    if not layers:
        return
    ngram, hpn = _meta(model, "ple.ngram_size"), _meta(model, "ple.heads_per_ngram")
    d, K = _meta(model, "embedding_length_per_layer_input"), _meta(model, "ple.conv_kernel")
    for il in (int(x) for x in layers):
        if not 0 <= il < n_trunk:
            raise StrataError(f"{path}: metadata {A}ple.layers names layer {il}, not a trunk layer (0..{n_trunk - 1}); "
                              f"{_FIX}", path)
    heads = (ngram - 1) * hpn if ngram and hpn else None
    table = model.tensors.get("per_layer_token_embd.weight")
    if d and table is not None and (len(table.ne) != 2 or int(table.ne[0]) != d):
        raise StrataError(f"{path}: tensor {table.name} has shape {[int(x) for x in table.ne]} but metadata "
                          f"{A}embedding_length_per_layer_input says rows of {d}; {_FIX}", path)
    if heads:
        for key, want in (("ple.layer_multipliers", ngram), ("ple.head_offsets", heads),
                          ("ple.head_vocab_sizes", heads)):
            v = model.key(key)
            if v is not None and len(v) < want:
                raise StrataError(f"{path}: metadata {A}{key} has {len(v)} values but {A}ple.ngram_size {ngram} "
                                  f"(x {A}ple.heads_per_ngram {hpn}) needs {want}; {_FIX}", path)
        off, voc = model.key("ple.head_offsets"), model.key("ple.head_vocab_sizes")
        if off is not None and voc is not None and table is not None and len(table.ne) == 2:
            top = max(int(off[j]) + int(voc[j]) for j in range(heads))
            if top > int(table.ne[1]):
                raise StrataError(f"{path}: tensor {table.name} has {int(table.ne[1])} rows but metadata "
                                  f"{A}ple.head_offsets + {A}ple.head_vocab_sizes address rows up to {top - 1}; "
                                  f"{_FIX}", path)
    for il in (int(x) for x in layers):
        p = f"blk.{il}.ple_"
        if hc is not None:
            W = hc * n
            keys = f"{A}hyper_connection.count {hc} x {A}embedding_length {n}"
            for t in ("norm_key", "norm_query", "norm_conv"):
                bad(p + t + ".weight", [W], keys)
            if K is not None:
                bad(p + "conv1d.weight", [K, W], keys + f", {A}ple.conv_kernel {K}")
            if heads and d:
                bad(p + "key.weight", [heads * d, W], keys + f", ({A}ple.ngram_size {ngram} - 1) x "
                    f"{A}ple.heads_per_ngram {hpn} x {A}embedding_length_per_layer_input {d}")
        if heads and d:
            bad(p + "value.weight", [heads * d, n], f"({A}ple.ngram_size {ngram} - 1) x {A}ple.heads_per_ngram "
                f"{hpn} x {A}embedding_length_per_layer_input {d}, {A}embedding_length {n}")
