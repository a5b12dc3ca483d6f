"""How a synthetic qwen4exp model routes: the weights that decide which experts the runtime picks.

Three routing models (``SynthConfig.routing``):

``realistic`` (default)
    Routing with the structure real MoE routing has, at any depth, width and expert count:

    * **Skew** (``skew``, default 2.1): every layer has its own popularity order (a seeded permutation per
      router) and router row ``e`` carries a bias ``-skew * ln(rank_e) / sqrt(2 ln E)`` along a direction
      ``c`` that every token embedding holds with the same weight. With Gaussian per-token noise of unit
      scale the top-1 choice then falls off like ``rank^-skew`` (a Zipf head, a long tail); top-k flattens
      it. ``skew`` 0 gives no popularity at all.
    * **Token specificity**: the rest of every router row is a random vector orthogonal to ``c``, scaled so
      the per-token logit noise has unit standard deviation at that layer; token embeddings are random
      (orthogonal to ``c``, rms 1 per component), so each token, at each layer, picks its own experts and a
      layer's hot set is unrelated to another layer's.
    * **Locality** (``locality``, default 0.3): each gated-DeltaNet layer is built as a bank of exponential
      moving averages of the recent residual stream (constant query/key along ``c``, a per-head write rate
      ``beta`` whose half-life is log-uniform in [2, 64] tokens, almost no state decay) and adds that
      context, projected away from ``c``, back to the residual. The context persists across tokens (topic),
      shifts as the text moves on (within a prompt) and starts empty for every request (between prompts).
      ``locality`` is the share of the router input's token-dependent variance that the context takes at
      depth (it is reached over the first GDN layers, geometrically); 0 turns the context off.
    * **Well-conditioned depth**: every other contribution to the residual (attention, experts, shared
      experts, PLE) keeps the small N(0, 0.02) scale while the embedding has rms 1 per component, so no
      shared direction builds up with depth and layer 47 sees the same kind of input as layer 3.

    The value channels of the DeltaNet come in (z, -z) pairs whose output columns are (w, -w), so the
    SiLU's mean cancels and the context carries no constant component.

``bursty``
    ``realistic`` with other defaults: ``skew`` 1.0 and ``locality`` 0.6 (mild popularity, strong topic
    locality). A static profile learned on some prompts covers little of others and per-layer LRU beats it at
    the same slots: the bursty-decode reference point (cache-policy.md) and the acceptance test's setting.

``uniform``
    ``realistic`` with ``skew`` 0 and ``locality`` 0: every expert equally likely, routing by token alone.

``legacy``
    The weights of stratatools <= 0.x: N(0, 0.02) everywhere, one shared direction in the embedding and a
    squared-ramp heat in the routers. Its routing collapses from layer ~5 on in deep models (the residual
    stream is dominated by the DeltaNet outputs' shared direction); kept so old seeds reproduce byte for
    byte.

Every tensor's values depend only on (seed, tensor name, config), never on the order they are written in.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

ROUTINGS = ("realistic", "bursty", "uniform", "legacy")
# Defaults of ``realistic``: calibrated against the published real-routing reference points (docs/synthetic-routing.md:
# static profile held-out / in-sample h_expert at 1/6 of the slots, per-layer LRU at 1/8 and 1/4, on 48 x 256 and
# 48 x 512 reduced-width models replaying the packaged prompt suite).
DEFAULT_SKEW = 2.1
DEFAULT_LOCALITY = 0.3
# ``bursty``: mild popularity, strong topic locality (a static profile learned on other prompts covers little of a
# new one, recency wins: the bursty-decode reference point and the acceptance test's setting).
BURSTY_SKEW = 1.0
BURSTY_LOCALITY = 0.6
PRESETS = {"realistic": (DEFAULT_SKEW, DEFAULT_LOCALITY), "bursty": (BURSTY_SKEW, BURSTY_LOCALITY),
           "uniform": (0.0, 0.0), "legacy": (DEFAULT_SKEW, DEFAULT_LOCALITY)}


def preset(routing: str) -> tuple[float, float]:
    """(skew, locality) a routing uses when they are not given (``realistic`` and ``legacy``: the defaults)."""
    return PRESETS.get(routing, (DEFAULT_SKEW, DEFAULT_LOCALITY))

# The router input is the hyper-connection mix of rms-normalised streams: about MIX_GAIN x rmsnorm(H) (the
# mixing gates are sigmoid(~0) = 0.5). C_SHARE is the weight of the popularity direction c in the embedding
# relative to the token part (rms 1 per component).
MIX_GAIN = 0.5
C_SHARE = 0.5
CONTEXT_RHO = 0.7          # the context reaches 1 - rho^j of its final variance after j GDN layers
HALF_LIFE = (2.0, 64.0)    # per-head EMA half-lives (tokens), log-uniform
GATE_PRE = 3.0             # DeltaNet output-gate pre-activation (sigmoid 0.95)
QK_PRE = 1.0               # rms of the constant query/key pre-activations
V_PRE = 0.25               # rms of the value pre-activations (small: the SiLU stays near linear)
PAIR_DIFF2 = 4.0           # mean squared difference of a normalised (a, b) value pair (calibrated)
REPEAT_PENALTY = 6.0       # output head: logit penalty along a token's own embedding (recent tokens)


@dataclass(frozen=True)
class RoutingModel:
    """The routing knobs of one synthetic model (see the module docstring).

    Attributes:
        kind: ``realistic``, ``uniform`` or ``legacy``.
        skew: Zipf exponent of the per-layer popularity (top-1 choice), >= 0.
        locality: share of the token-dependent router-input variance taken by the context at depth, in [0, 1).
    """

    kind: str = "realistic"
    skew: float = DEFAULT_SKEW
    locality: float = DEFAULT_LOCALITY

    @property
    def structured(self) -> bool:
        """True for the realistic / uniform weights (False: legacy)."""
        return self.kind != "legacy"

    @property
    def eff_skew(self) -> float:
        return 0.0 if self.kind == "uniform" else float(self.skew)

    @property
    def eff_locality(self) -> float:
        return 0.0 if self.kind == "uniform" else float(self.locality)


def routing_model(cfg: Any) -> RoutingModel:
    """The :class:`RoutingModel` of a :class:`stratatools.synth.model.SynthConfig`."""
    return RoutingModel(cfg.routing, cfg.skew, cfg.locality)


# ------------------------------------------------------------------------------------------------ geometry
def hot_direction(seed: int, n: int) -> np.ndarray:
    """The shared unit direction c [n] (float32) of a synthetic model."""
    c = np.random.default_rng([seed, 0x486F74]).standard_normal(n)
    return (c / np.linalg.norm(c)).astype(np.float32)


def _rng(seed: int, key: str, tag: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(key.encode("utf-8")), tag])


def _perp(m: np.ndarray, c: np.ndarray, axis: int) -> np.ndarray:
    """Remove the component along unit ``c`` from every row (axis 1) or column (axis 0) of ``m``."""
    if axis == 1:
        return m - np.outer(m @ c, c).astype(np.float32, copy=False)
    return m - np.outer(c, c @ m).astype(np.float32, copy=False)


def gdn_layers(cfg: Any) -> list[int]:
    """Trunk layers that are gated DeltaNet (linear attention), in order."""
    return [i for i in range(cfg.n_layers) if not cfg.is_full(i)]


def context_gain2(cfg: Any, layer: int, rm: RoutingModel) -> float:
    """Variance (per component, relative to the embedding's token part) the context of GDN ``layer`` adds."""
    lam = rm.eff_locality
    if lam <= 0:
        return 0.0
    total = lam / (1.0 - lam)
    order = gdn_layers(cfg)
    j = order.index(layer)
    return total * (1.0 - CONTEXT_RHO) * CONTEXT_RHO ** j


def context_var(cfg: Any, layer: int, rm: RoutingModel, after: bool = False) -> float:
    """Context variance (per component) in the residual at the input of ``layer`` (``after``: also the
    layer's own GDN output, i.e. what its router sees)."""
    tot = 0.0
    for i in gdn_layers(cfg):
        if i < layer or (after and i == layer):
            tot += context_gain2(cfg, i, rm)
    return tot


def _mix_scales(cfg: Any, layer: int, rm: RoutingModel, after: bool) -> tuple[float, float]:
    """(x . c, |x_perp|) of the expected mixed input of ``layer`` (rmsnorm, times MIX_GAIN)."""
    n = cfg.hidden
    lam = context_var(cfg, min(layer, cfg.n_layers), rm, after)
    rms = math.sqrt((1.0 + lam) + C_SHARE ** 2)
    xc = MIX_GAIN * C_SHARE * math.sqrt(n) / rms
    xp = MIX_GAIN * math.sqrt(n * (1.0 + lam)) / rms
    return xc, xp


# ------------------------------------------------------------------------------------------------ tensors
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def structured_names(cfg: Any) -> re.Pattern[str]:
    """Tensor names whose values the realistic routing sets (they are written as values, not random blocks)."""
    return re.compile(r"^(token_embd\.weight|output\.weight|blk\.\d+\.(ffn_gate_inp\.weight|attn_qkv\.weight|attn_gate\.weight|"
                      r"ssm_beta\.weight|ssm_alpha\.weight|ssm_out\.weight|ssm_a|ssm_dt\.bias|ssm_conv1d\.weight))$")


def full_values(cfg: Any, name: str, ne: tuple[int, ...], seed: int) -> np.ndarray | None:
    """All values of tensor ``name`` [rows, ne0] (float32) under the realistic/uniform routing, or None when
    the tensor keeps its ordinary N(0, 0.02) / norm values. Memory: one dense tensor (the largest is the
    DeltaNet qkv projection, hidden x conv_dim floats)."""
    rm = routing_model(cfg)
    if not rm.structured:
        return None
    n = cfg.hidden
    c = hot_direction(seed, n)
    if name == "token_embd.weight":
        V = ne[1]
        z = _rng(seed, name, 1).standard_normal((V, n), dtype=np.float32)
        z = _perp(z, c, 1)
        z *= (math.sqrt(n) / np.linalg.norm(z, axis=1, keepdims=True)).astype(np.float32)
        return (z + C_SHARE * math.sqrt(n) * c[None, :]).astype(np.float32)
    if name == "output.weight":
        return output_values(cfg, ne[1], seed)
    m = _BLK.match(name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if rest == "ffn_gate_inp.weight":
        return router_values(cfg, layer, ne[1], seed, name)
    if cfg.is_full(layer):
        return None
    vh, vd = cfg.linear_v_heads, cfg.linear_v_dim
    nk, dk = cfg.linear_k_heads, cfg.linear_k_dim
    xc, xp = _mix_scales(cfg, layer, rm, after=False)
    r = _rng(seed, name, 2)
    if rest == "ssm_a":
        return np.full((1, vh), -1e-3, np.float32)
    if rest == "ssm_dt.bias":
        return np.zeros((1, vh), np.float32)
    if rest == "ssm_alpha.weight":
        return np.broadcast_to(np.zeros(n, np.float32), (vh, n))
    if rest == "ssm_conv1d.weight":
        K = ne[0]
        w = np.zeros((ne[1], K), np.float32)
        w[:, K - 1] = 1.0
        return w
    if rest == "attn_gate.weight":  # every row the same: a broadcast view (the writer quantizes one row)
        return np.broadcast_to((np.float32(GATE_PRE / xc) * c).astype(np.float32), (vh * vd, n))
    if rest == "ssm_beta.weight":
        hl = np.exp(_rng(seed, f"blk.{layer}.halflife", 3).uniform(math.log(HALF_LIFE[0]), math.log(HALF_LIFE[1]), vh))
        beta = 1.0 - 2.0 ** (-1.0 / hl)
        logit = np.log(beta / (1.0 - beta))
        return np.outer(logit / xc, c).astype(np.float32)
    if rest == "attn_qkv.weight":
        C = ne[1]
        qk = nk * dk
        w = np.empty((C, n), np.float32)
        a = r.standard_normal(qk).astype(np.float32) * np.float32(QK_PRE / xc)
        w[:qk] = np.outer(a, c)
        w[qk:2 * qk] = np.outer(a, c)
        b = value_basis(cfg, layer, seed) * np.float32(V_PRE * math.sqrt(n) / xp)
        w[2 * qk::2] = b  # value rows in (b, -b) pairs, written in place (no C x n temporary)
        np.negative(b, out=w[2 * qk + 1::2])
        return w
    if rest == "ssm_out.weight":
        g2 = context_gain2(cfg, layer, rm)
        cols = vh * vd
        if g2 <= 0:
            return np.zeros((n, cols), np.float32)
        # o: per head rms-normalised (a, b) pairs whose difference carries the EMA of the value projection;
        # writing it back along the same basis vectors makes the context a recency-weighted copy of the
        # recent residual (its projection on this layer's subspace). Target |ctx|^2 = g2 * n.
        b = value_basis(cfg, layer, seed)  # [cols/2, n], unit rows
        s = math.sqrt(g2 * n / (cols / 2 * PAIR_DIFF2)) / (1.0 / (1.0 + math.exp(-GATE_PRE)))
        w = np.empty((n, cols), np.float32)
        w[:, 0::2] = b.T * np.float32(s)
        w[:, 1::2] = -b.T * np.float32(s)
        return w
    return None


def output_values(cfg: Any, n_vocab: int, seed: int) -> np.ndarray:
    """LM head rows [V, hidden]: random unit-scale logits minus REPEAT_PENALTY along the token's own embedding,
    so greedy decoding avoids the tokens the context (a recency-weighted copy of the residual) holds."""
    n = cfg.hidden
    c = hot_direction(seed, n)
    emb = full_values(cfg, "token_embd.weight", (n, n_vocab), seed)
    tok = _perp(emb, c, 1)
    tok /= np.linalg.norm(tok, axis=1, keepdims=True)
    xn = MIX_GAIN * math.sqrt(n)  # |out_in|: the output mix of the rms-normalised streams
    g = _rng(seed, "output.weight", 7).standard_normal((n_vocab, n), dtype=np.float32)
    g = _perp(g, c, 1) * np.float32(1.0 / xn)
    return (g - np.float32(REPEAT_PENALTY / xn) * tok).astype(np.float32)


def value_basis(cfg: Any, layer: int, seed: int) -> np.ndarray:
    """The unit vectors [vh*vd/2, hidden] (orthogonal to c) one DeltaNet layer averages the residual along
    (read-only; cached for the layer's two tensors)."""
    return _value_basis(cfg.hidden, cfg.linear_v_heads * cfg.linear_v_dim // 2, layer, seed)


@lru_cache(maxsize=2)
def _value_basis(n: int, P: int, layer: int, seed: int) -> np.ndarray:
    c = hot_direction(seed, n)
    b = _rng(seed, f"blk.{layer}.value_basis", 6).standard_normal((P, n), dtype=np.float32)
    b = _perp(b, c, 1)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    b.flags.writeable = False
    return b


def popularity_rank(seed: int, key: str, n_expert: int) -> np.ndarray:
    """Popularity rank (0 = hottest) of every expert of one router: a seeded permutation. int64 [E]."""
    return np.argsort(_rng(seed, key, 4).permutation(n_expert)).astype(np.int64)


def router_values(cfg: Any, layer: int, n_expert: int, seed: int, name: str) -> np.ndarray:
    """Router rows [E, hidden]: unit-scale token noise orthogonal to c plus the Zipf popularity bias along c."""
    rm = routing_model(cfg)
    n = cfg.hidden
    c = hot_direction(seed, n)
    xc, xp = _mix_scales(cfg, layer, rm, after=True)
    g = _rng(seed, name, 5).standard_normal((n_expert, n), dtype=np.float32)
    g = _perp(g, c, 1) * np.float32(1.0 / xp)
    rank = popularity_rank(seed, name, n_expert)
    bias = -rm.eff_skew * np.log1p(rank.astype(np.float64)) / math.sqrt(2.0 * math.log(max(n_expert, 2)))
    bias -= bias.mean()
    return (g + np.outer(bias / xc, c)).astype(np.float32)
