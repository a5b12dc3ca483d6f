"""The Qwen4Exp text forward, one code path for numpy and CuPy (the array module ``xp``).

Numerics follow transformers 5.23's ``Qwen4ExpForCausalLM`` (the oracle; read, not copied), in float32,
for one sequence at a time:

* token embedding, repeated into ``hc_count`` hyper-connection streams ``H`` of width ``hc * n_embd``;
* per layer: the PLE n-gram layer (PLE layers only) adds to ``H``; the attention hyper-connection mixes ``H``
  into one ``n_embd`` input, the mixer (gated DeltaNet or QSA attention) runs, its output is injected back
  into every stream with per-stream weights; the same around the MoE;
* the output hyper-connection mixer (no final norm) and the LM head.

Caches (:class:`SequenceState`): GDN conv state (last ``K-1`` pre-conv inputs) and recurrent state
``S[v_head, k_dim, v_dim]``; attention K/V (after norm and RoPE); the indexer's raw keys and its pooled
block keys; the PLE token context (last ``ngram-1`` ids) and its dilated conv state. Prefill runs the GDN
recurrence sequentially (exactly the recurrence transformers' chunked kernel computes), so a prefill
followed by decode steps equals one long prefill.

QSA token selection (per query at position p, visible tokens 0..p, ``ratio`` = compress ratio,
``budget`` = indexer top-k tokens):

* ``selection="transformers"`` (default): the ``(p+1)//ratio`` complete blocks are scored
  (mean of raw keys, k-norm, RoPE at the block start; ``sum_heads relu(q.k) / sqrt(d)``), the best
  ``min(budget//ratio, n_blocks)`` whole blocks plus the incomplete tail are attended (transformers'
  ``Qwen4ExpTextQSAIndexer``); ties (ReLU-zero scores) fall as ``torch.topk`` breaks them on the CPU
  (:func:`stratatools.runtime.topk.torch_topk_indices`);
* ``selection="llamacpp"``: llama.cpp's rule (kit README sections 6 and 8.2): every visible cell gets its
  block's score (tail cells rank first), and the top ``budget + ratio - 1`` cells are taken, so a short
  tail leaves room for part of the next-best block. Ties inside a block are broken the way libstdc++'s
  ``std::partial_sort`` (used by ggml's CPU ``top_k``) breaks them, emulated in :mod:`stratatools.runtime.topk`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from stratatools.core.errors import StrataError

from stratatools.runtime.config import Qwen4ExpConfig
from stratatools.runtime.topk import qsa_select_mask
from stratatools.runtime.weights import Weights

SELECTIONS = ("transformers", "llamacpp")


# ----------------------------------------------------------------------------------------------------------
# small ops (xp-generic)
# ----------------------------------------------------------------------------------------------------------
def _rmsnorm(xp: Any, x: Any, w: Any | None, eps: float, group: int | None = None) -> Any:
    shp = x.shape
    if group is not None:
        x = x.reshape(*shp[:-1], shp[-1] // group, group)
    y = x * (1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + xp.float32(eps)))
    if group is not None:
        y = y.reshape(shp)
    if w is not None:
        y = y * w
    return y.astype(xp.float32, copy=False)


def _sigmoid(xp: Any, x: Any) -> Any:
    return (1.0 / (1.0 + xp.exp(-x))).astype(xp.float32, copy=False)


def _silu(xp: Any, x: Any) -> Any:
    return x * _sigmoid(xp, x)


def _softplus(xp: Any, x: Any) -> Any:
    # torch.nn.functional.softplus (beta 1, threshold 20)
    return xp.where(x > 20, x, xp.log1p(xp.exp(xp.minimum(x, 20)))).astype(xp.float32, copy=False)


def _l2norm(xp: Any, x: Any, eps: float = 1e-6) -> Any:
    return x * (1.0 / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + xp.float32(eps)))


def _softmax(xp: Any, x: Any, axis: int = -1) -> Any:
    m = xp.max(x, axis=axis, keepdims=True)
    e = xp.exp(x - m)
    return e / xp.sum(e, axis=axis, keepdims=True)


def _to_host(a: Any) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) else a)


class Rope:
    """NEOX-style rotary embedding on the first ``n_rot`` dims of a head (partial rotary).

    inv_freq = theta^(-2i/n_rot), i < n_rot/2, computed in float32 as transformers does. Text positions are
    the same on every mrope axis, so the mrope sections reduce to plain RoPE.
    """

    def __init__(self, xp: Any, n_rot: int, theta: float):
        self.xp = xp
        self.n_rot = n_rot
        ar = np.arange(0, n_rot, 2, dtype=np.float32) / np.float32(n_rot)
        self.inv_freq = (np.float32(1.0) / (np.float32(theta) ** ar)).astype(np.float32)

    def cos_sin(self, pos: np.ndarray) -> tuple[Any, Any]:
        """cos and sin tables for token positions ``pos`` [T]: two float32 arrays [T, n_rot] (each half repeated,
        NEOX layout) on ``xp``.
        """
        c, s = self.cos_sin_host(pos)
        return self.xp.asarray(c), self.xp.asarray(s)

    def cos_sin_host(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`cos_sin` as numpy arrays (for a caller that uploads them itself)."""
        f = np.asarray(pos, dtype=np.float32)[:, None] * self.inv_freq[None, :]
        f = np.concatenate([f, f], axis=-1)
        return np.cos(f), np.sin(f)

    def apply(self, x: Any, cos: Any, sin: Any) -> Any:
        """x [T, heads, d]; cos/sin [T, n_rot]."""
        xp = self.xp
        r = self.n_rot
        xr = x[..., :r]
        half = r // 2
        rot = xp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
        c = cos[:, None, :]
        s = sin[:, None, :]
        out = xr * c + rot * s
        return xp.concatenate([out, x[..., r:]], axis=-1).astype(xp.float32, copy=False)


# ----------------------------------------------------------------------------------------------------------
# state
# ----------------------------------------------------------------------------------------------------------
@dataclass
class LayerState:
    """Per-layer caches. GDN: ``conv`` [K-1, C], ``ssm`` [v_heads, k_dim, v_dim]. Attention: ``k``/``v``
    [P, kv_heads, head_dim], ``ik`` raw indexer keys [P, idx_dim], ``bk`` pooled block keys [B, idx_dim]."""

    conv: Any = None
    ssm: Any = None
    k: Any = None
    v: Any = None
    ik: Any = None
    bk: Any = None


@dataclass
class SequenceState:
    """Everything a sequence carries between forward calls.

    Attributes:
        pos: tokens already processed (the next token's position).
        layers: one :class:`LayerState` per trunk layer.
        ple_ctx: the last ``ngram - 1`` token ids (EOS-filled at start), host int64.
        ple_conv: per PLE layer, the dilated conv state [(K-1)*ngram, hc*n_embd].
    """

    pos: int = 0
    layers: list[LayerState] = field(default_factory=list)
    ple_ctx: np.ndarray | None = None
    ple_conv: dict[int, Any] = field(default_factory=dict)


@dataclass
class RoutingRecord:
    """The routing of one forward call: per layer, ids [T, k] (rank order) and weights [T, k] (host arrays)."""

    positions: np.ndarray
    ids: list[np.ndarray]
    weights: list[np.ndarray]


ExpertFn = Callable[[int, int], tuple[Any, Any, Any]]
RouteHook = Callable[[int, np.ndarray, np.ndarray, np.ndarray], None]



def _ple_mix(cfg: Any, shifted: list[np.ndarray]) -> np.ndarray:
    """The PLE row ids [rows, n_heads] from the shifted histories ``shifted[s]`` [rows] int64 (the token s back,
    or EOS): n-gram n mixes shifts 0..n-1 as ``XOR_s h[s] * mult[s]`` (int64, wrapping), head j of it takes
    ``mixed mod vocab[j] + offset[j]`` (:meth:`Qwen4ExpRuntime.ple_ngram_ids`; ``cfg`` its model config)."""
    mult = cfg.ple_multipliers
    hpn = cfg.ple_heads_per_ngram
    cols = []
    with np.errstate(over="ignore"):
        for n in range(2, cfg.ple_ngram + 1):
            mixed = shifted[0] * mult[0]
            for s in range(1, n):
                mixed = np.bitwise_xor(mixed, shifted[s] * mult[s])
            for j in range((n - 2) * hpn, (n - 1) * hpn):
                cols.append(np.remainder(mixed, cfg.ple_head_vocab[j]) + cfg.ple_head_offsets[j])
    return np.stack(cols, axis=1)


class Qwen4ExpRuntime:
    """Runs a loaded qwen4exp model (:class:`stratatools.runtime.weights.Weights`).

    Args:
        weights: the loaded model.
        selection: QSA token selection, ``transformers`` (default) or ``llamacpp``.
        expert_fn: ``(layer, expert) -> (gate (ff,n), up (ff,n), down (n,ff))``; default reads
            ``weights.experts`` (the expert tier passes its own, see :mod:`stratatools.runtime.tier`).
        route_hook: called once per layer per forward with (layer, positions [T], ids [T,k], weights [T,k])
            before the routed experts run (the tier's access, the trace recorder).

    Raises:
        StrataError: an unknown selection rule.
    """

    def __init__(self, weights: Weights, selection: str = "transformers", expert_fn: ExpertFn | None = None,
                 route_hook: RouteHook | None = None):
        if selection not in SELECTIONS:
            raise StrataError(f"QSA selection {selection!r} is not one of {', '.join(SELECTIONS)}")
        self.w = weights
        self.cfg: Qwen4ExpConfig = weights.cfg
        self.xp = weights.xp
        self.selection = selection
        self.expert_fn = expert_fn or weights.experts.matrices
        self.route_hooks: list[RouteHook] = [route_hook] if route_hook else []
        self.rope = Rope(self.xp, self.cfg.n_rot, self.cfg.rope_theta)

    # -- state --------------------------------------------------------------------------------------------
    def new_state(self) -> SequenceState:
        """A fresh sequence: empty caches, PLE context of EOS ids."""
        cfg = self.cfg
        st = SequenceState(layers=[LayerState() for _ in range(cfg.n_layer)])
        st.ple_ctx = np.full(max(cfg.ple_ngram - 1, 0), cfg.eos_id, dtype=np.int64)
        return st

    # -- forward ------------------------------------------------------------------------------------------
    def forward(self, ids: Any, state: SequenceState, logits: str = "last") -> tuple[Any, RoutingRecord]:
        """Run ``ids`` (1-D token ids) after what ``state`` holds; updates ``state`` in place.

        Args:
            ids: the new tokens, int.
            state: from :meth:`new_state`, possibly after earlier calls.
            logits: ``last`` (logits of the last token, [vocab]), ``all`` ([T, vocab]) or ``none``.
        Returns:
            (logits, routing record of this call).
        Raises:
            StrataError: a token id outside the vocabulary; an empty call.
        """
        xp = self.xp
        cfg = self.cfg
        ids_h = np.asarray(_to_host(ids), dtype=np.int64).reshape(-1)
        if ids_h.size == 0:
            raise StrataError("no tokens to run")
        if ids_h.min() < 0 or ids_h.max() >= cfg.n_vocab:
            bad = int(ids_h[(ids_h < 0) | (ids_h >= cfg.n_vocab)][0])
            raise StrataError(f"token id {bad} is outside the vocabulary [0, {cfg.n_vocab})")
        T = ids_h.size
        pos = np.arange(state.pos, state.pos + T, dtype=np.int64)
        x = self.w.rows("token_embd.weight", ids_h)  # [T, n]
        H = xp.concatenate([x] * cfg.hc_count, axis=-1)  # [T, hc*n]
        cos, sin = self.rope.cos_sin(pos)
        rec = RoutingRecord(pos, [], [])
        for il in range(cfg.n_layer):
            ls = state.layers[il]
            if il in cfg.ple_layers:
                H = H + self._ple(il, H, ids_h, state)
            mixed, inject = self._hc(f"blk.{il}.hc_attn", H)
            if cfg.recurrent[il]:
                y = self._gdn(il, mixed, ls)
            else:
                y = self._attention(il, mixed, ls, pos, cos, sin)
            H = H + (y[:, None, :] * inject[:, :, None]).reshape(T, -1)
            mixed, inject = self._hc(f"blk.{il}.hc_ffn", H)
            y, top_ids, top_w = self._moe(il, mixed, pos)
            rec.ids.append(top_ids)
            rec.weights.append(top_w)
            H = H + (y[:, None, :] * inject[:, :, None]).reshape(T, -1)
        state.pos += T
        if logits == "none":
            return None, rec
        if logits == "last":
            H = H[-1:]
        out_in, _ = self._hc("output_hc", H, inject=False)
        lg = out_in @ self.w.get("output.weight").T
        return (lg[0] if logits == "last" else lg), rec

    # -- hyper-connections ------------------------------------------------------------------------------
    def _hc(self, prefix: str, H: Any, inject: bool = True) -> tuple[Any, Any]:
        """Gated residual: mix the ``hc`` streams of ``H`` [T, hc*n] into [T, n]; per-stream inject weights [T, hc]."""
        xp = self.xp
        cfg = self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        hn = _rmsnorm(xp, H, self.w.get(f"{prefix}_norm.weight"), cfg.eps, group=n)
        m = _silu(xp, (hn @ self.w.get(f"{prefix}_down.weight").T) / xp.float32(hc))
        m = _sigmoid(xp, m @ self.w.get(f"{prefix}_up.weight").T)
        T = H.shape[0]
        mixed = xp.mean(m.reshape(T, hc, n) * hn.reshape(T, hc, n), axis=1)
        if not inject:
            return mixed, None
        iw = 2.0 * _sigmoid(xp, (hn @ self.w.get(f"{prefix}_inject.weight").T) / xp.float32(hc))
        return mixed, iw.astype(xp.float32)

    # -- PLE --------------------------------------------------------------------------------------------
    def ple_ngram_ids(self, ids: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """Hashed n-gram row ids [T, n_heads] of the PLE table for ``ids`` after context ``ctx``.

        History h = ctx ++ ids. For shift s, the token s back is used unless an EOS lies in between
        (positions i-s .. i-1), in which case EOS is used (segment reset at EOS). For n-gram n in 2..N the
        mixed id is ``XOR_{s<n} h[i-s] * mult[s]`` (int64, wrapping), and head j of that n-gram takes
        ``mixed mod vocab[j] + offset[j]`` (transformers ``Qwen4ExpTextNGramEmbedding``; constants from the
        GGUF's UINT64 arrays).
        """
        cfg = self.cfg
        eos = cfg.eos_id
        h = np.concatenate([ctx, ids]).astype(np.int64)
        C = ctx.size
        T = ids.size
        idx = np.arange(C, C + T)
        is_eos = (h == eos)
        # last EOS strictly before each position (-1 when none)
        last = np.where(is_eos, np.arange(h.size), -1)
        last = np.maximum.accumulate(last)
        prev_eos = np.concatenate([[-1], last[:-1]])[idx]
        shifted = []
        for s in range(cfg.ple_ngram):
            src = idx - s
            ok = (src > prev_eos) & (src >= 0)
            shifted.append(np.where(ok, h[np.maximum(src, 0)], eos).astype(np.int64))
        return _ple_mix(self.cfg, shifted)

    def ple_ngram_ids_rows(self, ids: np.ndarray, ctx: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """:meth:`ple_ngram_ids` of one new token for each of P sequences at once (the batched decode step): row p
        equals ``ple_ngram_ids(ids[p:p+1], ctx[p, K - lens[p]:])``.

        ids: [P] int; ctx: [P, K] int, each sequence's context right-aligned (its last ``lens[p]`` columns; the rest
        is ignored), K = ``ple_ngram - 1``; lens: [P] int in 0..K. Returns [P, n_heads] int64. The per-sequence loop
        called :meth:`ple_ngram_ids` 32 times a step at 32 places (about 2 ms of host time before each replay).
        """
        cfg = self.cfg
        eos = np.int64(cfg.eos_id)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        P, K = int(ids.size), cfg.ple_ngram - 1
        lens = np.asarray(lens, dtype=np.int64).reshape(-1)
        h = np.concatenate([np.asarray(ctx, dtype=np.int64).reshape(P, K), ids[:, None]], axis=1)  # [P, K + 1]
        exists = np.arange(K + 1)[None, :] >= (K - lens)[:, None]
        is_eos = (h == eos) & exists
        # an EOS at one of the columns K - s .. K - 1 (strictly before the new token) cuts shift s off
        cut = np.zeros((P, K + 1), dtype=bool)  # cut[:, s]
        for s in range(1, K + 1):
            cut[:, s] = cut[:, s - 1] | is_eos[:, K - s]
        shifted = [np.where(exists[:, K - s] & ~cut[:, s], h[:, K - s], eos).astype(np.int64) for s in range(K + 1)]
        return _ple_mix(self.cfg, shifted)

    def _ple(self, il: int, H: Any, ids: np.ndarray, state: SequenceState) -> Any:
        xp = self.xp
        cfg = self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        T = ids.size
        rows = self.ple_ngram_ids(ids, state.ple_ctx)  # [T, heads]
        keep = cfg.ple_ngram - 1
        if keep > 0:
            state.ple_ctx = np.concatenate([state.ple_ctx, ids])[-keep:]
        emb = self.w.rows("per_layer_token_embd.weight", rows.reshape(-1)).reshape(T, -1)  # [T, heads*dim]
        p = f"blk.{il}.ple_"
        key = _rmsnorm(xp, emb @ self.w.get(p + "key.weight").T, self.w.get(p + "norm_key.weight"), cfg.eps, group=n)
        value = emb @ self.w.get(p + "value.weight").T  # [T, n]
        q = _rmsnorm(xp, H, self.w.get(p + "norm_query.weight"), cfg.eps, group=n)
        gate = xp.sum(key.reshape(T, hc, n) * q.reshape(T, hc, n), axis=-1, keepdims=True) / xp.float32(math.sqrt(n))
        gate = xp.sqrt(xp.maximum(xp.abs(gate), xp.float32(1e-6))) * xp.sign(gate)
        gv = (_sigmoid(xp, gate) * value[:, None, :]).reshape(T, hc * n)
        gvn = _rmsnorm(xp, gv, self.w.get(p + "norm_conv.weight"), cfg.eps, group=n)
        # dilated depthwise causal conv: kernel K, dilation = ngram size, state (K-1)*dilation inputs
        K, d = cfg.ple_conv_kernel, cfg.ple_ngram
        span = (K - 1) * d
        prev = state.ple_conv.get(il)
        if prev is None:
            prev = xp.zeros((span, hc * n), dtype=xp.float32)
        xin = xp.concatenate([prev, gvn], axis=0)
        state.ple_conv[il] = xin[-span:] if span else xin[:0]
        wc = self.w.get(p + "conv1d.weight")  # [C, K]
        out = xp.zeros((T, hc * n), dtype=xp.float32)
        for k in range(K):
            out = out + xin[k * d:k * d + T] * wc[:, k][None, :]
        return gv + _silu(xp, out)

    # -- gated DeltaNet ---------------------------------------------------------------------------------
    def _gdn(self, il: int, x: Any, ls: LayerState) -> Any:
        xp = self.xp
        cfg = self.cfg
        T = x.shape[0]
        nk, dk, nv = cfg.ssm_n_group, cfg.ssm_d_state, cfg.ssm_dt_rank
        dv = cfg.ssm_head_v_dim
        p = f"blk.{il}."
        qkv = x @ self.w.get(p + "attn_qkv.weight").T  # [T, C]
        z = (x @ self.w.get(p + "attn_gate.weight").T).reshape(T, nv, dv)
        b = x @ self.w.get(p + "ssm_beta.weight").T  # [T, nv]
        a = x @ self.w.get(p + "ssm_alpha.weight").T
        wc = self.w.get(p + "ssm_conv1d.weight")  # [C, K]
        K = wc.shape[1]
        C = wc.shape[0]
        if ls.conv is None:
            ls.conv = xp.zeros((K - 1, C), dtype=xp.float32)
        xin = xp.concatenate([ls.conv, qkv], axis=0)
        ls.conv = xin[-(K - 1):] if K > 1 else xin[:0]
        conv = xp.zeros((T, C), dtype=xp.float32)
        for k in range(K):
            conv = conv + xin[k:k + T] * wc[:, k][None, :]
        conv = _silu(xp, conv)
        q = conv[:, :nk * dk].reshape(T, nk, dk)
        k_ = conv[:, nk * dk:2 * nk * dk].reshape(T, nk, dk)
        v = conv[:, 2 * nk * dk:].reshape(T, nv, dv)
        q = _l2norm(xp, q) * xp.float32(dk ** -0.5)
        k_ = _l2norm(xp, k_)
        rep = nv // nk
        if rep > 1:  # tiled value heads: value head j reads key head j % nk (converter order)
            q = xp.tile(q, (1, rep, 1))
            k_ = xp.tile(k_, (1, rep, 1))
        beta = _sigmoid(xp, b)
        g = self.w.get(p + "ssm_a")[None, :] * _softplus(xp, a + self.w.get(p + "ssm_dt.bias")[None, :])
        decay = xp.exp(g).astype(xp.float32)
        S = ls.ssm if ls.ssm is not None else xp.zeros((nv, dk, dv), dtype=xp.float32)
        out = xp.empty((T, nv, dv), dtype=xp.float32)
        for t in range(T):
            S = S * decay[t][:, None, None]
            kt = k_[t]
            kv = xp.matmul(kt[:, None, :], S)[:, 0, :]  # [nv, dv]
            delta = (v[t] - kv) * beta[t][:, None]
            S = S + kt[:, :, None] * delta[:, None, :]
            out[t] = xp.matmul(q[t][:, None, :], S)[:, 0, :]
        ls.ssm = S
        o = _rmsnorm(xp, out, self.w.get(p + "ssm_norm.weight"), cfg.eps)
        act = _sigmoid(xp, z) if cfg.output_gate == "sigmoid" else _silu(xp, z)
        o = (o * act).reshape(T, nv * dv)
        return o @ self.w.get(p + "ssm_out.weight").T

    # -- QSA attention ----------------------------------------------------------------------------------
    def _select(self, il: int, x: Any, ls: LayerState, pos: np.ndarray, cos: Any, sin: Any, P: int) -> np.ndarray:
        """Boolean mask [T, P] of the cells each new query attends (before the causal mask)."""
        xp = self.xp
        cfg = self.cfg
        T = x.shape[0]
        ratio = cfg.compress_ratios[il]
        if ratio <= 0:
            return np.ones((T, P), dtype=bool)
        p = f"blk.{il}.indexer."
        dih = cfg.idx_head_dim
        qi = (x @ self.w.get(p + "q_proj.weight").T).reshape(T, -1, dih)
        qi = _rmsnorm(xp, qi, self.w.get(p + "q_norm.weight"), cfg.eps)
        qi = self.rope.apply(qi, cos, sin)
        kr = x @ self.w.get(p + "k_proj.weight").T  # [T, dih] (one indexer KV head)
        if kr.shape[1] != dih:
            raise StrataError(f"layer {il}: the indexer has {kr.shape[1] // dih} key heads; the runtime supports one")
        ls.ik = kr if ls.ik is None else xp.concatenate([ls.ik, kr], axis=0)
        nb_all = P // ratio
        have = 0 if ls.bk is None else ls.bk.shape[0]
        if nb_all > have:
            raw = ls.ik[have * ratio:nb_all * ratio].reshape(nb_all - have, ratio, dih)
            pooled = _rmsnorm(xp, xp.mean(raw, axis=1), self.w.get(p + "k_norm.weight"), cfg.eps)
            bc, bs = self.rope.cos_sin(np.arange(have, nb_all, dtype=np.int64) * ratio)
            newbk = self.rope.apply(pooled[:, None, :], bc, bs)[:, 0, :]
            ls.bk = newbk if ls.bk is None else xp.concatenate([ls.bk, newbk], axis=0)
        if nb_all > 0:
            sc = xp.einsum("thd,bd->tbh", qi, ls.bk)
            scores = _to_host(xp.sum(xp.maximum(sc, 0), axis=-1) / xp.float32(math.sqrt(dih)))  # [T, B]
        else:
            scores = np.zeros((T, 0), dtype=np.float32)
        # per query: torch_topk_indices / llamacpp_cells (qsa_select_mask replays them where ties decide)
        mask = qsa_select_mask(self.selection, scores, pos, ratio, cfg.idx_budget, P)
        return mask

    def _attention(self, il: int, x: Any, ls: LayerState, pos: np.ndarray, cos: Any, sin: Any) -> Any:
        xp = self.xp
        cfg = self.cfg
        T = x.shape[0]
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        p = f"blk.{il}."
        qg = (x @ self.w.get(p + "attn_q.weight").T).reshape(T, nh, 2 * hd)
        q = qg[..., :hd]
        gate = qg[..., hd:].reshape(T, nh * hd)
        q = _rmsnorm(xp, q, self.w.get(p + "attn_q_norm.weight"), cfg.eps)
        k = _rmsnorm(xp, (x @ self.w.get(p + "attn_k.weight").T).reshape(T, nkv, hd), self.w.get(p + "attn_k_norm.weight"), cfg.eps)
        v = (x @ self.w.get(p + "attn_v.weight").T).reshape(T, nkv, hd)
        q = self.rope.apply(q, cos, sin)
        k = self.rope.apply(k, cos, sin)
        ls.k = k if ls.k is None else xp.concatenate([ls.k, k], axis=0)
        ls.v = v if ls.v is None else xp.concatenate([ls.v, v], axis=0)
        P = ls.k.shape[0]
        sel = self._select(il, x, ls, pos, cos, sin, P)
        causal = np.arange(P)[None, :] <= pos[:, None]
        allowed = xp.asarray(sel & causal)  # [T, P]
        grp = nh // nkv
        kk = xp.repeat(ls.k, grp, axis=1)  # [P, nh, hd] (head h reads kv head h // grp)
        vv = xp.repeat(ls.v, grp, axis=1)
        att = xp.einsum("thd,phd->htp", q, kk) * xp.float32(hd ** -0.5)
        att = xp.where(allowed[None, :, :], att, xp.float32(-np.inf))
        att = _softmax(xp, att, axis=-1)
        o = xp.einsum("htp,phd->thd", att, vv).reshape(T, nh * hd)
        o = o * _sigmoid(xp, gate)
        return o @ self.w.get(p + "attn_output.weight").T

    # -- MoE --------------------------------------------------------------------------------------------
    def route(self, il: int, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """Router top-k: softmax over E, top k (descending, ties to the lower index), renormalised.

        Returns host arrays ids [T, k] int32 and weights [T, k] float32.
        """
        xp = self.xp
        cfg = self.cfg
        logits = x @ self.w.get(f"blk.{il}.ffn_gate_inp.weight").T  # [T, E]
        if cfg.gating == "sigmoid":
            probs = _sigmoid(xp, logits)
        else:
            probs = _softmax(xp, logits, axis=-1)
        ph = _to_host(probs).astype(np.float32)
        k = cfg.n_expert_used
        ids = np.argsort(-ph, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(ph, ids, axis=-1)
        if cfg.norm_topk:
            w = w / w.sum(axis=-1, keepdims=True)
        w = (w * np.float32(cfg.expert_weights_scale)).astype(np.float32)
        return ids.astype(np.int32), w

    def _moe(self, il: int, x: Any, pos: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray]:
        xp = self.xp
        p = f"blk.{il}."
        ids, w = self.route(il, x)
        for hook in self.route_hooks:
            hook(il, pos, ids, w)
        y = xp.zeros_like(x)
        for e in np.unique(ids).tolist():
            rows, ranks = np.nonzero(ids == e)
            g, u, d = self.expert_fn(il, int(e))
            xs = x[xp.asarray(rows)]
            h = _silu(xp, xs @ g.T) * (xs @ u.T)
            out = (h @ d.T) * xp.asarray(w[rows, ranks])[:, None]
            if len(rows) == len(set(rows.tolist())):
                y[xp.asarray(rows)] += out
            else:  # pragma: no cover - an expert appears once per token
                for i, r in enumerate(rows.tolist()):
                    y[r] += out[i]
        sg = _sigmoid(xp, x @ self.w.get(p + "ffn_gate_inp_shexp.weight").reshape(-1, 1))  # [T, 1]
        hs = _silu(xp, x @ self.w.get(p + "ffn_gate_shexp.weight").T) * (x @ self.w.get(p + "ffn_up_shexp.weight").T)
        y = y + sg * (hs @ self.w.get(p + "ffn_down_shexp.weight").T)
        return y, ids, w


@dataclass
class Generation:
    """One request's result: prompt ids, generated ids, why it stopped, and per-phase routing records."""

    prompt_ids: list[int]
    new_ids: list[int]
    stop: str
    prefill: RoutingRecord
    decode: list[RoutingRecord]
    last_prompt_logits: Any = None


def generate(rt: Qwen4ExpRuntime, prompt_ids: list[int], max_new_tokens: int = 16,
             stop_id: int | None = None, state: SequenceState | None = None,
             on_forward: "Callable[[str], None] | None" = None) -> Generation:
    """Greedy generation: prefill ``prompt_ids`` in one call, then decode one token per call.

    Stops at ``stop_id`` (default: the model's EOS; the stop token is kept in ``new_ids``) or after
    ``max_new_tokens`` new tokens (0: prefill only). ``on_forward(phase)`` is called after every forward
    call, ``"prefill"`` once then ``"decode"`` per step (the runtime's tier ends its rounds there).

    Raises:
        StrataError: an empty prompt, a negative length cap, token ids outside the vocabulary.
    """
    if not prompt_ids:
        raise StrataError("empty prompt: nothing to run")
    if max_new_tokens < 0:
        raise StrataError(f"--max-new-tokens {max_new_tokens} is negative")
    stop = rt.cfg.eos_id if stop_id is None else stop_id
    st = state or rt.new_state()
    lg, pre = rt.forward(prompt_ids, st, logits="last")
    if on_forward is not None:
        on_forward("prefill")
    first_logits = lg
    new: list[int] = []
    dec: list[RoutingRecord] = []
    reason = "length"
    queued = getattr(rt, "decode_queued", None)  # the GPU decoder's queued steps (same tokens, records and counts)
    got = queued(lg, st, max_new_tokens, stop, on_forward) if queued is not None else None
    if got is not None:
        new, dec, reason = got
    while got is None and len(new) < max_new_tokens:
        nxt = int(rt.argmax(lg)) if hasattr(rt, "argmax") else int(_to_host(rt.xp.argmax(lg)))
        new.append(nxt)
        if nxt == stop:
            reason = "stop"
            break
        if len(new) >= max_new_tokens:
            break
        lg, r = rt.forward([nxt], st, logits="last")
        if on_forward is not None:
            on_forward("decode")
        dec.append(r)
    finish = getattr(rt, "finish", None)  # a runtime that does a step's bookkeeping late settles it here
    if finish is not None:
        finish()
    return Generation(list(map(int, prompt_ids)), new, reason if max_new_tokens else "prefill", pre, dec, first_logits)
