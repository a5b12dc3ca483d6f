"""A small seeded generator of realistic-looking routing traces for tests and benchmarks of the tier model.

Not a model of any real router (the realistic-routing work in ``synth`` is the place for that); it produces
the three properties the adaptive tier reacts to, so tuning its knobs has something to find:

* **Zipf popularity per layer**: each layer ranks its experts in a random order; expert at rank r has weight
  ``1 / (r + 1) ** zipf_s``.
* **Topic-driven locality**: each topic boosts its own Zipf-ranked subset of experts per layer; a token's
  routing distribution per layer is ``topic_mix * topic + (1 - topic_mix) * base``. Within a request the topic
  drifts: every ``segment`` decode tokens the request keeps its topic with probability ``stay``, else draws a
  new one.
* **Bursty, decode-heavy arrivals**: requests come in bursts of ``burst`` requests on the same topic (topics
  themselves Zipf-popular); each request has a short prefill (``prefill`` tokens, phase prefill) and a long
  decode (``decode_min``..``decode_max`` tokens, phase decode).

Each record routes ``top_k`` distinct experts, drawn without replacement from the layer's distribution
(Gumbel top-k), in descending score order. Output: a :class:`~stratatools.traces.table.TraceTable` whose
entries are ordered by request, position, layer, rank (a plain decode trace: one round per position).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.traces.table import DECODE, PREFILL, TraceTable


@dataclass(frozen=True)
class Workload:
    """Generator parameters (module docstring). The defaults make a small (about 0.45 M entries), decode-heavy,
    bursty trace: 20 requests of 100-200 decode tokens after an 8-token prefill, 24 layers x 64 experts, top-6,
    topics drifting every 32 tokens (kept with probability 0.3), each topic concentrating 95% of a layer's routing
    on its own 10 experts."""

    n_layers: int = 24
    n_expert: int = 64
    top_k: int = 6
    requests: int = 20
    topics: int = 30
    burst: int = 4
    prefill: int = 8
    decode_min: int = 100
    decode_max: int = 200
    segment: int = 32
    stay: float = 0.3
    zipf_s: float = 1.0
    topic_zipf_s: float = 0.5
    topic_size: int = 10
    topic_mix: float = 0.95
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _zipf(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def generate(w: Workload = Workload()) -> TraceTable:
    """Generate a trace (module docstring). Deterministic for a given :class:`Workload` (seed included).

    Raises:
        StrataError: parameters out of range (top_k > n_expert, topic_size > n_expert, counts < 1, mix or stay
            outside [0, 1]).
    """
    L, E, k = int(w.n_layers), int(w.n_expert), int(w.top_k)
    if min(L, E, k, w.requests, w.topics, w.burst, w.segment, w.decode_min) < 1 or w.prefill < 0:
        raise StrataError("workload: layers, experts, top_k, requests, topics, burst, segment and decode_min must be >= 1")
    if k > E or w.topic_size > E or w.topic_size < 1:
        raise StrataError(f"workload: top_k {k} and topic_size {w.topic_size} must be in 1..n_expert ({E})")
    if not (0.0 <= w.topic_mix <= 1.0 and 0.0 <= w.stay <= 1.0) or w.decode_max < w.decode_min:
        raise StrataError("workload: topic_mix and stay must be in [0, 1], decode_max >= decode_min")
    rng = np.random.default_rng(w.seed)
    base = np.zeros((L, E))
    zb = _zipf(E, w.zipf_s)
    for l in range(L):
        base[l, rng.permutation(E)] = zb
    topic = np.zeros((w.topics, L, E))
    zt = _zipf(w.topic_size, w.topic_zipf_s)
    for t in range(w.topics):
        for l in range(L):
            topic[t, l, rng.permutation(E)[: w.topic_size]] = zt
    logp = np.log(w.topic_mix * topic + (1.0 - w.topic_mix) * base[None] + 1e-12)  # [topics, L, E]
    topic_pop = _zipf(w.topics, 1.0)
    cols: dict[str, list[np.ndarray]] = {c: [] for c in ("request", "position", "phase", "layer", "rank", "expert")}
    cur = 0
    for r in range(w.requests):
        if r % w.burst == 0:
            cur = int(rng.choice(w.topics, p=topic_pop))
        n_dec = int(rng.integers(w.decode_min, w.decode_max + 1))
        n_tok = w.prefill + n_dec
        tok_topic = np.empty(n_tok, dtype=np.int64)
        t = cur
        tok_topic[: w.prefill] = t
        for s0 in range(w.prefill, n_tok, w.segment):
            if s0 > w.prefill and rng.random() >= w.stay:
                t = int(rng.choice(w.topics, p=topic_pop))
            tok_topic[s0: s0 + w.segment] = t
        g = rng.gumbel(size=(n_tok, L, E)) + logp[tok_topic]
        top = np.argpartition(-g, k - 1, axis=2)[:, :, :k]
        sc = np.take_along_axis(g, top, axis=2)
        top = np.take_along_axis(top, np.argsort(-sc, axis=2, kind="stable"), axis=2)  # [n_tok, L, k]
        n = n_tok * L * k
        cols["request"].append(np.full(n, r, dtype=np.int64))
        cols["position"].append(np.repeat(np.arange(n_tok), L * k))
        ph = np.where(np.arange(n_tok) < w.prefill, PREFILL, DECODE)
        cols["phase"].append(np.repeat(ph, L * k))
        cols["layer"].append(np.tile(np.repeat(np.arange(L), k), n_tok))
        cols["rank"].append(np.tile(np.arange(k), n_tok * L))
        cols["expert"].append(top.reshape(-1))
    c = {name: np.concatenate(v) for name, v in cols.items()}
    n = len(c["expert"])
    return TraceTable(c["request"], c["position"], c["phase"], c["layer"], c["rank"], c["expert"],
                      np.ones(n, dtype=np.float32), meta={"source_format": "workload", "n_layers": L, "n_expert": E,
                                                           "workload": w.to_dict()})
