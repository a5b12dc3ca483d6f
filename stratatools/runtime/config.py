"""Hyper-parameters of a qwen4exp model, read from its GGUF metadata.

Every key is the one llama.cpp's converter writes (``conversion/qwen4exp.py``; the kit's
``dumps/model-bf16.gguf.gguf-dump.txt`` lists them). Where the converter writes nothing, the default is
what llama.cpp hard-codes for qwen4exp (kit README section 8): softmax gating, normalised top-k, no
expert-weight scale, a **sigmoid** GDN output gate. The HF/GGUF differences the runtime honours:

* ``ple.layers`` is 0-based (HF ``ple_layer_ids`` is 1-based);
* the PLE hash constants are UINT64 arrays (``ple.layer_multipliers``, ``ple.head_offsets``,
  ``ple.head_vocab_sizes``), never recomputed;
* ``attention.compress_ratios`` > 0 marks a QSA layer; 0 means dense attention (llama.cpp's reading);
* the indexer budget is ``attention.indexer.top_k`` (tokens, HF ``indexer_budget``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.model.geometry import check_consistency
from stratatools.model.gguf import Model

ARCH = "qwen4exp"


@dataclass
class Qwen4ExpConfig:
    """What the forward needs to know about a qwen4exp model.

    Attributes (shapes in numpy order; all widths in values):
        n_layer: trunk blocks (``block_count - nextn_predict_layers``).
        n_embd: model width.
        n_vocab: vocabulary size (``token_embd`` ne1).
        n_head, n_head_kv, head_dim: attention heads, KV heads, head width (``attention.key_length``).
        n_rot: rotary dims per head (``rope.dimension_count``; partial rotary, kit README section 8.4).
        rope_theta: ``rope.freq_base``.
        rope_sections: ``rope.dimension_sections`` (mrope; all text positions share one value, so the
            sections only matter for images, which this runtime does not run).
        eps: RMSNorm epsilon.
        recurrent: per layer, True for gated DeltaNet, False for (QSA) attention.
        compress_ratios: per layer QSA block size (0: dense attention).
        n_expert, n_expert_used, n_ff_exp, n_ff_shexp: MoE sizes (E from the routers, never a constant).
        norm_topk, expert_weights_scale, gating: router post-processing (defaults: llama.cpp's).
        ssm_conv_kernel, ssm_d_state (K head width), ssm_n_group (K heads), ssm_dt_rank (V heads),
            ssm_d_inner (V heads x V head width).
        output_gate: GDN gated-norm activation, ``sigmoid`` (llama.cpp) or ``silu``.
        hc_count, hc_lowrank: hyper-connection streams and mixer rank.
        idx_n_head, idx_head_dim, idx_budget: QSA indexer heads, head width, token budget.
        ple_layers: 0-based PLE layers; ple_ngram, ple_heads_per_ngram, ple_conv_kernel, ple_head_dim.
        ple_multipliers, ple_head_offsets, ple_head_vocab: the n-gram hash constants (int64 arrays).
        eos_id: end-of-text token (PLE segment reset and the generation stop token).
    """

    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_theta: float
    rope_sections: list[int]
    eps: float
    recurrent: list[bool]
    compress_ratios: list[int]
    n_expert: list[int]
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    norm_topk: bool
    expert_weights_scale: float
    gating: str
    ssm_conv_kernel: int
    ssm_d_state: int
    ssm_n_group: int
    ssm_dt_rank: int
    ssm_d_inner: int
    output_gate: str
    hc_count: int
    hc_lowrank: int
    idx_n_head: int
    idx_head_dim: int
    idx_budget: int
    ple_layers: list[int]
    ple_ngram: int
    ple_heads_per_ngram: int
    ple_conv_kernel: int
    ple_head_dim: int
    ple_multipliers: np.ndarray = field(repr=False)
    ple_head_offsets: np.ndarray = field(repr=False)
    ple_head_vocab: np.ndarray = field(repr=False)
    eos_id: int = -1

    @property
    def ssm_head_v_dim(self) -> int:
        """Value width of one linear-attention head: ssm_d_inner // ssm_dt_rank."""
        return self.ssm_d_inner // self.ssm_dt_rank

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("ple_multipliers", "ple_head_offsets", "ple_head_vocab"):
            d[k] = [int(x) for x in getattr(self, k)]
        return d


def _req(model: Model, key: str) -> Any:
    v = model.key(key)
    if v is None:
        raise StrataError(f"{model.path}: metadata {model.arch}.{key} is missing; not a complete qwen4exp GGUF", model.path)
    return v


def _list(v: Any) -> list:
    if v is None:
        return []
    if hasattr(v, "tolist"):
        return list(v.tolist())
    if isinstance(v, (list, tuple)):
        return list(v)
    return [v]


def read_config(model: Model, output_gate: str = "sigmoid") -> Qwen4ExpConfig:
    """Read a :class:`Qwen4ExpConfig` from an open qwen4exp model.

    Args:
        model: an open GGUF (:func:`stratatools.model.gguf.open_model`).
        output_gate: GDN output-gate activation; the converter writes no key for it and llama.cpp
            hard-codes ``sigmoid`` (kit README section 8.3); ``silu`` is transformers' default.

    Raises:
        StrataError: not a qwen4exp model, a required key missing, routers of different expert counts,
            metadata that does not fit the tensor shapes or an ``expert_used_count`` outside 1..E, tensors of
            blocks at or above ``block_count`` (:func:`stratatools.model.geometry.check_consistency`).
    """
    if model.arch != ARCH:
        raise StrataError(f"{model.path}: architecture is {model.arch!r}; the runtime runs {ARCH!r} models only", model.path)
    check_consistency(model)
    if output_gate not in ("sigmoid", "silu"):
        raise StrataError(f"output gate {output_gate!r} is not sigmoid or silu")
    bc = int(_req(model, "block_count"))
    nextn = int(model.key("nextn_predict_layers", 0) or 0)
    n_layer = bc - nextn
    n_embd = int(_req(model, "embedding_length"))
    emb = model.tensor("token_embd.weight")
    n_vocab = int(emb.ne[1])
    rec = _list(model.key("attention.recurrent_layers"))
    if not rec:
        fai = int(_req(model, "full_attention_interval"))
        rec = [(i % fai) != fai - 1 for i in range(bc)]
    ratios = [int(x) for x in _list(model.key("attention.compress_ratios"))] or [0] * bc
    n_expert = []
    for il in range(n_layer):
        r = model.tensor(f"blk.{il}.ffn_gate_inp.weight")
        n_expert.append(int(r.ne[1]))
    head_dim = int(_req(model, "attention.key_length"))
    eos = model.key("ple.eos_token_id")
    if eos is None:
        eos = model.kv.get("tokenizer.ggml.eos_token_id", -1)
    ple_layers = [int(x) for x in _list(model.key("ple.layers"))]
    ple_head_dim = int(model.key("embedding_length_per_layer_input", 0) or 0)
    idx_k = None
    for il in range(n_layer):
        name = f"blk.{il}.indexer.k_proj.weight"
        if model.has(name):
            idx_k = model.tensor(name)
            break
    gating_v = model.key("expert_gating_func")
    gating = {None: "softmax", 1: "softmax", 2: "sigmoid"}.get(None if gating_v is None else int(gating_v), "softmax")
    cfg = Qwen4ExpConfig(
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_head=int(_req(model, "attention.head_count")),
        n_head_kv=int(_req(model, "attention.head_count_kv")),
        head_dim=head_dim,
        n_rot=int(model.key("rope.dimension_count", head_dim)),
        rope_theta=float(model.key("rope.freq_base", 10000.0)),
        rope_sections=[int(x) for x in _list(model.key("rope.dimension_sections"))],
        eps=float(model.key("attention.layer_norm_rms_epsilon", 1e-6)),
        recurrent=[bool(x) for x in rec[:n_layer]],
        compress_ratios=ratios[:n_layer],
        n_expert=n_expert,
        n_expert_used=int(_req(model, "expert_used_count")),
        n_ff_exp=int(_list(_req(model, "expert_feed_forward_length"))[0]),
        n_ff_shexp=int(model.key("expert_shared_feed_forward_length", 0) or 0),
        norm_topk=bool(model.key("expert_weights_norm", True)),
        expert_weights_scale=float(model.key("expert_weights_scale", 1.0) or 1.0),
        gating=gating,
        ssm_conv_kernel=int(model.key("ssm.conv_kernel", 4)),
        ssm_d_state=int(model.key("ssm.state_size", 0) or 0),
        ssm_n_group=int(model.key("ssm.group_count", 0) or 0),
        ssm_dt_rank=int(model.key("ssm.time_step_rank", 0) or 0),
        ssm_d_inner=int(model.key("ssm.inner_size", 0) or 0),
        output_gate=output_gate,
        hc_count=int(_req(model, "hyper_connection.count")),
        hc_lowrank=int(model.key("hyper_connection.low_rank", 0) or 0),
        idx_n_head=int(model.key("attention.indexer.head_count", 0) or 0),
        idx_head_dim=int(model.key("attention.indexer.key_length", 0) or 0),
        idx_budget=int(model.key("attention.indexer.top_k", 0) or 0),
        ple_layers=ple_layers,
        ple_ngram=int(model.key("ple.ngram_size", 0) or 0),
        ple_heads_per_ngram=int(model.key("ple.heads_per_ngram", 0) or 0),
        ple_conv_kernel=int(model.key("ple.conv_kernel", 0) or 0),
        ple_head_dim=ple_head_dim,
        ple_multipliers=np.asarray(_list(model.key("ple.layer_multipliers")), dtype=np.uint64).astype(np.int64),
        ple_head_offsets=np.asarray(_list(model.key("ple.head_offsets")), dtype=np.uint64).astype(np.int64),
        ple_head_vocab=np.asarray(_list(model.key("ple.head_vocab_sizes")), dtype=np.uint64).astype(np.int64),
        eos_id=int(eos),
    )
    if idx_k is not None and cfg.idx_head_dim and int(idx_k.ne[1]) % cfg.idx_head_dim:
        raise StrataError(f"{model.path}: tensor {idx_k.name} width {idx_k.ne[1]} is not a multiple of the indexer key length {cfg.idx_head_dim}", model.path)
    if cfg.ple_layers:
        n_heads = (cfg.ple_ngram - 1) * cfg.ple_heads_per_ngram
        if len(cfg.ple_multipliers) != cfg.ple_ngram or len(cfg.ple_head_offsets) != n_heads or len(cfg.ple_head_vocab) != n_heads:
            raise StrataError(
                f"{model.path}: PLE hash constants do not fit ngram_size {cfg.ple_ngram} x heads_per_ngram "
                f"{cfg.ple_heads_per_ngram} (multipliers {len(cfg.ple_multipliers)}, offsets {len(cfg.ple_head_offsets)}, "
                f"vocab sizes {len(cfg.ple_head_vocab)})", model.path)
    return cfg
