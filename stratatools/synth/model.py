"""Synthetic qwen4exp releases: a canonical model, two expert-pruned revisions and their allocation maps.

What is mirrored from the real converter output (the kit's ``dumps/model-bf16.gguf.gguf-dump.txt`` and kit
README section 3, written by llama.cpp's ``convert_hf_to_gguf.py``): every tensor name, its ne shape as a function
of the config, the file order, the tensors that stay F32 (routers, every norm, ``ssm_a``, ``ssm_dt.bias``,
``ssm_conv1d``, the shared-expert gate) or BF16 (indexer projections), ``ple_conv1d`` in F16 in quantized files,
and the metadata keys (``qwen4exp.*``, ``general.*``, ``tokenizer.ggml.*``). The PLE hash constants
(``ple.layer_multipliers``, ``ple.head_offsets``, ``ple.head_vocab_sizes``) are computed the way transformers'
``Qwen4ExpTextNGramEmbedding`` does (splitmix64 multipliers, primes after ``ngram_vocab_size_base``), so a runtime
that reads them gets consistent values.

Weights: N(0, 0.02) matrices, routers N(0, 0.1) (top-k margins), norms 1 + N(0, 0.1) (stored folded, like the
converter), ``ssm_a`` = -exp(U(0, ln 16)), ``ssm_dt.bias`` N(0, 0.5) - the scales of the kit's model. Every tensor
has its own generator seeded from (seed, crc32(name)), so the bytes are the same for a seed whatever else changes.

The tokenizer is byte-level BPE (``tokenizer.ggml.model`` gpt2, pre qwen2): the 256 byte tokens in GPT-2's
byte-to-unicode order, merges learned here from a fixed built-in text, and ``<|endoftext|>`` (EOS and padding),
``<|im_start|>``, ``<|im_end|>``. Every file says ``stratatools.synthetic = true`` and its ``general.name`` ends in
``(synthetic)``.

Pruned revisions are cut from the written canonical file, like ISTA's pruned releases: survivors of each trunk
layer kept in ascending original index (formats.md section 6), router rows and expert slices copied byte for byte,
every other tensor unchanged; an MTP block keeps the canonical expert count. ``revB`` drops ``swap`` of revA's
survivors per layer and brings back ``swap`` pruned experts, so the dense numbering shifts (a re-indexing
re-release). Each revision gets a ``.rco-allocation.txt`` in the ISTA layout (header, Section 1 per tensor,
Section 2 per (layer, role, original index) with an empty type for pruned experts).

Large models (``SynthConfig.full_width``) write random but valid blocks (:func:`stratatools.model.quantize.random_blocks`)
in chunks, so memory stays bounded and the write runs at disk speed.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.core.fsutil import publish_dir, refuse_foreign_folder, tidy_output, write_text_atomic
from stratatools.model.ggml_types import GGMLType, type_by_name
from stratatools.model.gguf_write import ARRAY, BOOL, F32 as VF32, I32, STRING, U16, U32, U64, GGUFWriterStream
from stratatools.model.quantize import can_quantize, quantize, random_blocks
from stratatools.synth.routing import ROUTINGS, full_values, preset, structured_names

if TYPE_CHECKING:  # the GGUF reader is imported only to cut pruned revisions (start-up of a plain synth)
    from stratatools.model.gguf import Model, TensorInfo

ARCH = "qwen4exp"
_CHUNK_VALUES = 1 << 20     # floats generated per chunk when quantizing
_CHUNK_BYTES = 1 << 20      # bytes per chunk handed to the writer (random blocks and copies)
# Random blocks are drawn in frames of 16 MiB (the bit generator's words are rounded up per frame, as they always
# were, so a seed gives the same bytes) and handed on in ~1 MiB pieces: a piece is not fresh memory to fault in and
# is still in the CPU caches when write() copies it (16 MiB chunks cost up to about twice the CPU time per MiB;
# docs/synthetic-routing.md, "Full width, and write speed").
_RANDOM_FRAME_BYTES = 16 << 20
# From this width on, random blocks are balanced (random scale sign; SynthConfig.balanced_blocks): the DC gain of the
# offset codes grows with the row width (mean x n) and collapses routing in wide models.
BALANCED_MIN_HIDDEN = 1024
# Wide models (balanced blocks) write the attention output projection at this share of the nominal rms 0.02: a random
# matrix's gain is 0.02 * sqrt(n_in), about 1.6 for 6144 -> 2560, so at full width every attention layer added a
# token-independent vector of ~0.3 rms per component (the value projection of the shared direction, averaged over
# positions), against 0.01 at reduced width; 1/16 brings it back to ~0.02 (docs/synthetic-routing.md).
WIDE_ATTN_OUT_SCALE = 1.0 / 16.0


# ------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class SynthConfig:
    """Shape and content of a synthetic qwen4exp release. Defaults are the kit's tiny model (kit README section 2).

    Attributes (shapes in model terms; ``E`` experts per trunk layer):
        n_layers: trunk layers. hidden: n_embd. n_expert: E of the canonical model. keep: survivors per layer
        in the pruned revisions. swap: revA survivors replaced in revB. k: experts used per token.
        expert_ff / shared_ff: routed / shared expert width. n_head, n_head_kv, head_dim: attention.
        linear_*: gated-DeltaNet heads and head dims. conv_kernel: DeltaNet conv width. hc_count, hc_lowrank:
        hyper-connections. indexer_*: QSA indexer. full_attention_interval: layer l is full attention when
        l % interval == interval - 1. ple_layers: 0-based PLE layers (must be linear-attention layers).
        ple_embed_dim: PLE width (None = hidden). ngram_size, heads_per_ngram, ngram_vocab_base,
        ngram_divisible_by, ple_seed: the PLE n-gram hash. vocab_size: tokenizer size target.
        mtp: add one MTP block (``nextn_predict_layers`` 1) that keeps the canonical E in pruned revisions.
        shards: files per model (gguf-split layout and keys). seed: all random content.
        gu_types / down_types: expert types, cycled over layers. dense_type: other matrices (falls back to
        Q8_0, then F16, where the row width does not fit). embd_type: token_embd/output/per_layer_token_embd.
        random_experts / random_dense: write random valid blocks instead of quantized normals (fast, any
        d-first type); None (default) means random blocks wherever the type has them, except under the legacy
        routing (which reproduces the old bytes) and for the tensors the routing model sets. revisions: also write revA/revB. name: ``general.name`` stem.
        routing, skew, locality: the routing model (:mod:`stratatools.synth.routing`): ``realistic`` (default),
        ``bursty``, ``uniform`` or ``legacy``; the Zipf exponent of per-layer popularity; the share of the router
        input taken by the per-request context (topic) at depth. skew / locality None (default): the routing's
        own values (realistic 2.1 / 0.3, bursty 1.0 / 0.6; ``routing.PRESETS``).
        balanced_blocks: random valid blocks with a random scale sign (``random_blocks(balanced=True)``), so the
        offset codes of Q2_0 / Q4_0 / Q8_0 ... add no DC gain; None (default): on when ``hidden`` is at least
        ``BALANCED_MIN_HIDDEN`` (1024) and the routing is not legacy. Wide models need it: with the unbalanced
        blocks of earlier versions the Q2_0 experts' DC gain (0.39 of the rms per input) grows a shared direction
        layer after layer and routing collapses from layer ~3 on at hidden 2560 (docs/synthetic-routing.md);
        below that width the gain is small and the old bytes are kept (the calibration rests on them). With it,
        the attention output projection is also written at ``WIDE_ATTN_OUT_SCALE`` (1/16) of the nominal rms.
    """

    n_layers: int = 8
    hidden: int = 256
    n_expert: int = 32
    keep: int = 16
    swap: int = 4
    k: int = 4
    expert_ff: int = 64
    shared_ff: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    linear_k_heads: int = 2
    linear_v_heads: int = 4
    linear_k_dim: int = 64
    linear_v_dim: int = 64
    conv_kernel: int = 4
    hc_count: int = 4
    hc_lowrank: int = 32
    indexer_heads: int = 2
    indexer_kv_heads: int = 1
    indexer_dim: int = 32
    indexer_top_k: int = 8
    compress_ratio: int = 4
    full_attention_interval: int = 4
    ple_layers: tuple[int, ...] = (1,)
    ple_embed_dim: int | None = None
    ngram_size: int = 3
    heads_per_ngram: int = 2
    ngram_vocab_base: int = 1000
    ngram_divisible_by: int = 128
    ple_seed: int = 1234
    ple_conv_kernel: int = 4
    vocab_size: int = 512
    context_length: int = 4096
    rope_theta: float = 1e7
    rms_eps: float = 1e-6
    mtp: bool = False
    shards: int = 1
    seed: int = 0
    gu_types: tuple[str, ...] = ("Q8_0", "Q4_0")
    down_types: tuple[str, ...] = ("Q2_0",)
    dense_type: str = "Q8_0"
    embd_type: str = "BF16"
    random_experts: bool | None = None
    random_dense: bool | None = None
    revisions: bool = True
    name: str = "Qwen4Exp Synth"
    routing: str = "realistic"
    skew: float | None = None
    locality: float | None = None
    balanced_blocks: bool | None = None

    def __post_init__(self) -> None:
        # skew / locality left out (None): the routing's own defaults (routing.PRESETS)
        sk, lo = preset(self.routing)
        if self.skew is None:
            object.__setattr__(self, "skew", sk)
        if self.locality is None:
            object.__setattr__(self, "locality", lo)

    @classmethod
    def full_width(cls, n_layers: int = 8, seed: int = 0, **kw: Any) -> "SynthConfig":
        """The real release's expert geometry for GPU benchmarks (formats.md section 1): hidden 2560, expert width
        640, 512 experts, k 10, 24/2 heads of 256; gate/up alternate Q2_0 and IQ2_XS, down Q2_0 and IQ4_NL; random
        valid blocks; no pruned revisions unless asked; context length 131,072 positions, so that the long-context
        benchmarks (8k and more, issue 17) run within the model's own limit."""
        base = dict(n_layers=n_layers, hidden=2560, n_expert=512, keep=256, swap=64, k=10, expert_ff=640,
                    shared_ff=640, n_head=24, n_head_kv=2, head_dim=256, linear_k_heads=16, linear_v_heads=32,
                    linear_k_dim=128, linear_v_dim=128, hc_lowrank=320, indexer_heads=8, indexer_kv_heads=1,
                    indexer_dim=128, indexer_top_k=2048, gu_types=("Q2_0", "IQ2_XS"), down_types=("Q2_0", "IQ4_NL"),
                    dense_type="Q8_0", embd_type="BF16", random_experts=True, random_dense=True, revisions=False,
                    context_length=131072, seed=seed, name="Qwen4Exp Synth full-width")
        base.update(kw)
        return cls(**base)  # type: ignore[arg-type]

    @property
    def blocks_balanced(self) -> bool:
        """Are random valid blocks written with a random scale sign (see ``balanced_blocks``)?"""
        if self.balanced_blocks is None:
            return self.routing != "legacy" and self.hidden >= BALANCED_MIN_HIDDEN
        return bool(self.balanced_blocks)

    # derived shapes
    @property
    def n_blocks(self) -> int:
        return self.n_layers + (1 if self.mtp else 0)

    @property
    def hc_width(self) -> int:
        return self.hidden * self.hc_count

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    @property
    def ple_dim(self) -> int:
        return self.ple_embed_dim or self.hidden

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def rope_dim(self) -> int:
        return self.head_dim // 4

    def is_full(self, layer: int) -> bool:
        """Full (QSA) attention block? The MTP block is one."""
        if layer >= self.n_layers:
            return True
        return layer % self.full_attention_interval == self.full_attention_interval - 1

    def experts_random(self, t: GGMLType) -> bool:
        """Are routed experts of type ``t`` written as random valid blocks (see ``random_experts``)?"""
        if self.random_experts is None:
            return self.routing != "legacy" and t.name in _random_ok()
        return bool(self.random_experts)

    def dense_random(self, t: GGMLType) -> bool:
        """Are dense (non-expert) matrices of type ``t`` written as random valid blocks (see ``random_dense``)?"""
        if t.block_size <= 1:
            return False
        if self.random_dense is None:
            return self.routing != "legacy" and t.name in _random_ok()
        return bool(self.random_dense)

    def gu_type(self, layer: int) -> GGMLType:
        return type_by_name(self.gu_types[layer % len(self.gu_types)])

    def down_type(self, layer: int) -> GGMLType:
        return type_by_name(self.down_types[layer % len(self.down_types)])

    def validate(self) -> None:
        """Raise StrataError (naming the option) for an inconsistent config."""
        def bad(msg: str) -> StrataError:
            return StrataError(f"synth: {msg}")
        for nm in ("n_layers", "hidden", "n_expert", "keep", "k", "expert_ff", "shared_ff", "n_head", "head_dim",
                   "shards", "vocab_size", "full_attention_interval"):
            if getattr(self, nm) < 1:
                raise bad(f"{option_name(nm)} {getattr(self, nm)} must be at least 1")
        MAX_LAYERS, MAX_EXPERTS = 4096, 1 << 16  # the bounds of stratatools.profiles.strp.check_dims
        if self.n_layers > MAX_LAYERS or self.n_expert > MAX_EXPERTS:
            raise bad(f"--layers {self.n_layers} x --experts {self.n_expert}: at most {MAX_LAYERS} layers and "
                      f"{MAX_EXPERTS} experts (what a profile can address)")
        if self.k > self.n_expert:
            raise bad(f"--k {self.k} is more than --experts {self.n_expert}")
        if self.revisions and self.keep > self.n_expert:
            raise bad(f"--keep {self.keep} is more than --experts {self.n_expert}")
        if self.revisions and self.k > self.keep:
            raise bad(f"--k {self.k} is more than the {self.keep} experts a pruned layer keeps")
        if self.revisions and not 0 <= self.swap <= min(self.keep, self.n_expert - self.keep):
            raise bad(f"--swap {self.swap} must be between 0 and min(keep, experts - keep)")
        if self.n_expert > 65535:
            raise bad("at most 65535 experts")
        for nm in ("seed", "ple_seed"):  # stored as a GGUF int64 and fed to numpy's seed sequence (non-negative)
            v = getattr(self, nm)
            if not isinstance(v, int) or not 0 <= v < 1 << 63:
                raise bad(f"{option_name(nm)} {v} must be an integer from 0 to 2^63-1")
        if self.vocab_size < 260:
            raise bad(f"{option_name('vocab_size')} {self.vocab_size} must be at least 260 (256 bytes + specials)")
        if self.head_dim % 16:
            raise bad(f"{option_name('head_dim')} {self.head_dim} must be a multiple of 16 (rope sections)")
        for layer in self.ple_layers:
            periodic_full = layer % self.full_attention_interval == self.full_attention_interval - 1
            if layer >= self.n_layers and not periodic_full:  # a linear-attention layer, once there are enough
                raise bad(f"--layers {self.n_layers} is too few: the model's PLE layer {layer} (0-based) must be one of "
                          f"its linear-attention trunk layers; use --layers {layer + 1} or more")
            if not 0 <= layer < self.n_layers or self.is_full(layer):
                raise bad(f"PLE layer {layer} ({option_name('ple_layers')}) must be a linear-attention trunk layer "
                          f"(layer l is full attention when l % {self.full_attention_interval} == "
                          f"{self.full_attention_interval - 1})")
        if self.ple_layers and self.ple_dim % self.ngram_heads:
            raise bad(f"PLE width {self.ple_dim} is not divisible by the {self.ngram_heads} n-gram heads")
        for i in range(self.n_blocks):
            for t, width, role in ((self.gu_type(i), self.hidden, "gate/up"), (self.down_type(i), self.expert_ff, "down")):
                if width % t.block_size:
                    raise bad(f"{role} type {t.name} needs rows of a multiple of {t.block_size}, the row is {width} "
                              f"wide (choose another --types entry)")
                if not (self.experts_random(t) or can_quantize(t)):
                    if t.name not in _random_ok():
                        raise bad(f"{role} type {t.name} cannot be written")
        for nm in ("dense_type", "embd_type"):
            type_by_name(getattr(self, nm))
        if self.routing not in ROUTINGS:
            raise bad(f"--routing {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if not (math.isfinite(self.skew) and 0.0 <= self.skew <= 8.0):
            raise bad(f"--skew {self.skew} must be between 0 and 8")
        if not (math.isfinite(self.locality) and 0.0 <= self.locality < 1.0):
            raise bad(f"--locality {self.locality} must be at least 0 and below 1")
        if self.routing != "legacy" and self.linear_v_dim % 2:
            raise bad(f"--routing {self.routing} needs an even linear value head width (it is {self.linear_v_dim})")


# SynthConfig fields set by `stratatools synth` options; the others are library-only (SynthConfig.<field>)
_OPTIONS = {"n_layers": "--layers", "n_expert": "--experts", "hidden": "--hidden", "keep": "--keep", "swap": "--swap",
            "k": "--k", "expert_ff": "--expert-ff", "shards": "--shards", "seed": "--seed"}


def option_name(field_name: str) -> str:
    """How a message names a :class:`SynthConfig` field: the ``synth`` option that sets it (``n_layers`` ->
    ``--layers``), else ``SynthConfig.<field>`` (a field only the library sets)."""
    return _OPTIONS.get(field_name, f"SynthConfig.{field_name}")


def writable_types() -> list[str]:
    """Type names ``synth --types`` accepts: those :func:`stratatools.model.quantize.quantize` has a quantizer for
    and those :func:`stratatools.model.quantize.random_blocks` can fill; sorted."""
    from stratatools.model.ggml_types import TYPES_BY_NAME

    return sorted(n for n in TYPES_BY_NAME if can_quantize(n) or n in _random_ok())


def _random_ok() -> set[str]:
    from stratatools.model.quantize import random_block_types
    return set(random_block_types())


# ------------------------------------------------------------------------------------------ tokenizer
_CORPUS = """
The router of every layer scores each expert and the top k experts run for the token. A profile ranks the
pairs of layer and expert by how often they are routed, hottest first, and the cache fills its slots in that
order. When a release prunes experts, the survivors are renumbered densely in ascending original index, so a
profile made for one revision names the wrong experts in the next one. The hit rate tells how many routed
experts were already resident in the fast tier. A trace records, for every position and layer, the experts the
router chose and their weights. Shards hold the tensors of one model; the first shard carries the metadata.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class ExpertCache:
    def __init__(self, slots):
        self.slots = slots
        self.resident = {}

    def lookup(self, layer, expert):
        key = (layer, expert)
        if key in self.resident:
            return self.resident[key]
        return None

for layer in range(48):
    print(layer, layer * 512, "experts per layer", 10, "active")
import numpy as np
x = np.zeros((4, 256), dtype=np.float32)
result = [value * 2 for value in range(100) if value % 3 == 0]
"""

_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_PRETOK = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z_]+| ?[0-9]| ?[^\sA-Za-z0-9_]+|\s+(?!\S)|\s+")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level mapping (printable bytes map to themselves); the runtime tokenizer's table."""
    from stratatools.runtime.tokenizer import BYTE_ENC

    return dict(BYTE_ENC)


@dataclass(frozen=True)
class Tokenizer:
    """A byte-level BPE vocabulary in GGUF form: tokens, token types (1 normal, 3 control), merges, EOS id."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    eos_id: int


@lru_cache(maxsize=8)
def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train a deterministic byte-level BPE on the built-in text up to ``vocab_size`` tokens (fewer when the text
    runs out of pairs that occur twice).

    Each step merges the most frequent adjacent pair (ties: the smallest pair in string order), left to right
    without overlaps in every word. Pair counts are kept up to date incrementally (only the words that hold the
    merged pair are recounted) and the best pair comes from a heap, so a vocabulary costs milliseconds, not a
    recount of the whole text per merge (same merges as the plain recount; tests/test_synth.py checks it)."""
    import heapq

    bmap = byte_to_unicode()
    vocab = [bmap[b] for b in bmap]  # GPT-2 order: '!' .. '~', then the rest
    seen = set(vocab)
    wc = Counter(tuple(bmap[b] for b in w.encode("utf-8")) for w in _PRETOK.findall(_CORPUS))
    words = [list(w) for w in wc]
    counts = list(wc.values())
    pairs: dict[tuple[str, str], int] = {}
    where: dict[tuple[str, str], set[int]] = {}
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pairs[p] = pairs.get(p, 0) + counts[i]
            where.setdefault(p, set()).add(i)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    merges: list[str] = []
    target = vocab_size - len(_SPECIALS)
    while len(vocab) < target:
        while heap and pairs.get(heap[0][1], 0) != -heap[0][0]:
            heapq.heappop(heap)  # stale entry (the pair's count changed since it was pushed)
        if not heap or -heap[0][0] < 2:
            break
        _, (a, b) = heapq.heappop(heap)
        new = a + b
        merges.append(f"{a} {b}")
        if new not in seen:
            vocab.append(new)
            seen.add(new)
        changed: set[tuple[str, str]] = set()
        for i in sorted(where.pop((a, b), ())):
            w, c = words[i], counts[i]
            for p in zip(w, w[1:]):
                pairs[p] -= c
                changed.add(p)
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(new)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for p in zip(out, out[1:]):
                pairs[p] = pairs.get(p, 0) + c
                where.setdefault(p, set()).add(i)
                changed.add(p)
        for p in changed:
            n = pairs.get(p, 0)
            if n > 0:
                heapq.heappush(heap, (-n, p))
            else:
                pairs.pop(p, None)
                where.pop(p, None)
    eos = len(vocab)
    tokens = tuple(vocab) + _SPECIALS
    types = tuple([1] * len(vocab) + [3] * len(_SPECIALS))
    return Tokenizer(tokens, types, tuple(merges), eos)


# ------------------------------------------------------------------------------------------ PLE hash
_MASK64 = (1 << 64) - 1


def _splitmix64(v: int) -> int:
    v = (v + 0x9E3779B97F4A7C15) & _MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def ple_layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd multipliers of the PLE n-gram hash (transformers ``_build_layer_multipliers``): splitmix64 of
    ``seed + 10007 * ple_index + golden * (i + 1)``, reduced below (2^63 - 1) // vocab."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * ple_index
    return [2 * (_splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(v: int) -> bool:
    if v < 2:
        return False
    if v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


def ple_head_vocab_sizes(base: int, n_heads: int, ple_index: int = 0) -> list[int]:
    """Head h's n-gram vocabulary is the (ple_index * n_heads + h + 1)-th prime after ``base - 1``."""
    out, p = [], base - 1
    primes = []
    while len(primes) < (ple_index + 1) * n_heads:
        p += 1
        if _is_prime(p):
            primes.append(p)
    out = primes[ple_index * n_heads:]
    return out


# --------------------------------------------------------------------------------------------- tensors
@dataclass
class TSpec:
    """One tensor to write: name, ne, type, how its values are made, and (for copies) a producer."""

    name: str
    ne: tuple[int, ...]
    gtype: GGMLType
    init: str = "normal"
    random: bool = False
    producer: Callable[[], Iterable[Any]] | None = None


_F32_NAMES = re.compile(r"(_norm\.weight|_norm_(key|query|conv)\.weight|\.ssm_a|ssm_dt\.bias|ssm_conv1d\.weight|"
                        r"ffn_gate_inp\.weight|ffn_gate_inp_shexp\.weight|nextn\.(enorm|hnorm|shared_head_norm)\.weight)$")


def _fit(t: GGMLType, ne0: int) -> bool:
    return ne0 % t.block_size == 0


def _dense_type(cfg: SynthConfig, ne0: int) -> GGMLType:
    for name in (cfg.dense_type, "Q8_0", "F16"):
        t = type_by_name(name)
        if _fit(t, ne0):
            return t
    return type_by_name("F32")


def _tensor_list(cfg: SynthConfig, V: int) -> list[TSpec]:
    """Every tensor of the canonical model in converter order (kit dump of model-bf16.gguf), with its ne and type."""
    H, HC, R = cfg.hidden, cfg.hc_width, cfg.hc_lowrank
    specs: list[TSpec] = []
    embd = type_by_name(cfg.embd_type)
    quantized_file = type_by_name(cfg.dense_type).block_size > 1

    def add(name: str, ne: tuple[int, ...], layer: int | None = None) -> None:
        if _F32_NAMES.search(name):
            t, init = type_by_name("F32"), "normal"
            if name.endswith(("_norm.weight",)) or re.search(r"_norm_(key|query|conv)\.weight$|nextn\.(enorm|hnorm|shared_head_norm)", name):
                init = "norm"
            elif name.endswith(".ssm_a"):
                init = "ssm_a"
            elif name.endswith("ssm_dt.bias"):
                init = "dt_bias"
            elif name.endswith("ffn_gate_inp.weight"):
                init = "router"
            specs.append(TSpec(name, ne, t, init))
            return
        if ".indexer." in name:
            specs.append(TSpec(name, ne, type_by_name("BF16")))
            return
        if name.endswith("ple_conv1d.weight"):
            t = type_by_name("F16") if quantized_file else type_by_name(cfg.dense_type)
            specs.append(TSpec(name, ne, t))
            return
        if name in ("token_embd.weight", "output.weight", "per_layer_token_embd.weight"):
            t = embd if _fit(embd, ne[0]) else _dense_type(cfg, ne[0])
            specs.append(TSpec(name, ne, t, "embd" if name == "token_embd.weight" else "normal",
                               random=bool(cfg.random_dense) and not can_quantize(t)))
            return
        if layer is not None and name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            specs.append(TSpec(name, ne, cfg.gu_type(layer), random=cfg.experts_random(cfg.gu_type(layer)) or not can_quantize(cfg.gu_type(layer))))
            return
        if layer is not None and name.endswith("ffn_down_exps.weight"):
            specs.append(TSpec(name, ne, cfg.down_type(layer), random=cfg.experts_random(cfg.down_type(layer)) or not can_quantize(cfg.down_type(layer))))
            return
        t = _dense_type(cfg, ne[0])
        specs.append(TSpec(name, ne, t, random=cfg.dense_random(t)))

    add("output.weight", (H, V))
    add("token_embd.weight", (H, V))
    add("output_hc_norm.weight", (HC,))
    add("output_hc_down.weight", (HC, R))
    add("output_hc_up.weight", (R, HC))
    ple_rows = 0
    if cfg.ple_layers:
        sizes = ple_head_vocab_sizes(cfg.ngram_vocab_base, cfg.ngram_heads)
        ple_rows = math.ceil(sum(sizes) / cfg.ngram_divisible_by) * cfg.ngram_divisible_by
    for i in range(cfg.n_blocks):
        b = f"blk.{i}."
        E = cfg.n_expert
        add(b + "hc_attn_inject.weight", (HC, cfg.hc_count), i)
        add(b + "hc_attn_norm.weight", (HC,), i)
        add(b + "hc_attn_down.weight", (HC, R), i)
        add(b + "hc_attn_up.weight", (R, HC), i)
        if not cfg.is_full(i):
            vh, vd = cfg.linear_v_heads, cfg.linear_v_dim
            add(b + "ssm_a", (vh,), i)
            add(b + "ssm_conv1d.weight", (cfg.conv_kernel, cfg.conv_dim), i)
            add(b + "ssm_dt.bias", (vh,), i)
            add(b + "ssm_alpha.weight", (H, vh), i)
            add(b + "ssm_beta.weight", (H, vh), i)
            add(b + "attn_qkv.weight", (H, cfg.conv_dim), i)
            add(b + "attn_gate.weight", (H, vh * vd), i)
            add(b + "ssm_norm.weight", (vd,), i)
            add(b + "ssm_out.weight", (vh * vd, H), i)
        add(b + "ffn_down_exps.weight", (cfg.expert_ff, H, E), i)
        add(b + "ffn_gate_exps.weight", (H, cfg.expert_ff, E), i)
        add(b + "ffn_up_exps.weight", (H, cfg.expert_ff, E), i)
        add(b + "ffn_gate_inp.weight", (H, E), i)
        add(b + "ffn_down_shexp.weight", (cfg.shared_ff, H), i)
        add(b + "ffn_gate_shexp.weight", (H, cfg.shared_ff), i)
        add(b + "ffn_up_shexp.weight", (H, cfg.shared_ff), i)
        add(b + "ffn_gate_inp_shexp.weight", (H, 1), i)
        add(b + "hc_ffn_inject.weight", (HC, cfg.hc_count), i)
        add(b + "hc_ffn_norm.weight", (HC,), i)
        add(b + "hc_ffn_down.weight", (HC, R), i)
        add(b + "hc_ffn_up.weight", (R, HC), i)
        if i in cfg.ple_layers:
            add(b + "ple_conv1d.weight", (cfg.ple_conv_kernel, HC), i)
            add(b + "ple_key.weight", (cfg.ple_dim, HC), i)
            add(b + "ple_norm_conv.weight", (HC,), i)
            add(b + "ple_norm_key.weight", (HC,), i)
            add(b + "ple_norm_query.weight", (HC,), i)
            if i == cfg.ple_layers[0]:
                add("per_layer_token_embd.weight", (cfg.ple_dim // cfg.ngram_heads, ple_rows))
            add(b + "ple_value.weight", (cfg.ple_dim, H), i)
        if cfg.is_full(i):
            idim = cfg.indexer_dim
            add(b + "indexer.q_proj.weight", (H, cfg.indexer_heads * idim), i)
            add(b + "indexer.k_proj.weight", (H, cfg.indexer_kv_heads * idim), i)
            add(b + "indexer.k_norm.weight", (idim,), i)
            add(b + "indexer.q_norm.weight", (idim,), i)
            add(b + "attn_k_norm.weight", (cfg.head_dim,), i)
            add(b + "attn_k.weight", (H, cfg.n_head_kv * cfg.head_dim), i)
            add(b + "attn_output.weight", (cfg.n_head * cfg.head_dim, H), i)
            add(b + "attn_q_norm.weight", (cfg.head_dim,), i)
            add(b + "attn_q.weight", (H, 2 * cfg.n_head * cfg.head_dim), i)
            add(b + "attn_v.weight", (H, cfg.n_head_kv * cfg.head_dim), i)
        if i >= cfg.n_layers:  # MTP block (no public qwen4exp MTP file to mirror; llama.cpp nextn naming)
            add(b + "nextn.eh_proj.weight", (2 * H, H), i)
            add(b + "nextn.enorm.weight", (H,), i)
            add(b + "nextn.hnorm.weight", (H,), i)
            add(b + "nextn.shared_head_norm.weight", (H,), i)
    if cfg.routing != "legacy":  # the tensors that decide routing are written from values at any width
        pat = structured_names(cfg)
        for sp in specs:
            if sp.random and pat.match(sp.name) and can_quantize(sp.gtype):
                sp.random = False
    return specs


# Skewed routing: real routers have hot and cold experts, and a profile is only worth something when routing
# is skewed. Every token embedding carries a shared unit direction c (times HOT_EMBD), and router row e of
# layer l carries HOT_ROUTER * b_l[e] * c with b_l a per-layer random permutation of a decreasing ramp, so
# each layer has its own hot experts whatever the prompt.
HOT_EMBD = 0.3
HOT_ROUTER = 0.45


def hot_direction(seed: int, n: int) -> np.ndarray:
    """The shared unit direction c [n] (float32) of a synthetic model (module comment above)."""
    c = np.random.default_rng([seed, 0x486F74]).standard_normal(n)
    return (c / np.linalg.norm(c)).astype(np.float32)


def router_heat(seed: int, layer_key: str, n_expert: int) -> np.ndarray:
    """Per-expert heat b [n_expert] in [0, 1] of one router: a random permutation of a squared ramp."""
    ramp = np.linspace(1.0, 0.0, n_expert) ** 2
    perm = np.random.default_rng([seed, zlib.crc32(layer_key.encode("utf-8")), 0x48]).permutation(n_expert)
    return ramp[perm].astype(np.float32)


def _values(rng: np.random.Generator, init: str, shape: tuple[int, ...], *, seed: int = 0, row0: int = 0,
            key: str = "", n_rows: int = 0) -> np.ndarray:
    if init == "norm":
        return 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if init == "router":
        v = 0.1 * rng.standard_normal(shape, dtype=np.float32)
        heat = router_heat(seed, key, n_rows)[row0:row0 + shape[0]]
        return v + HOT_ROUTER * heat[:, None] * hot_direction(seed, shape[1])[None, :]
    if init == "embd":
        v = 0.02 * rng.standard_normal(shape, dtype=np.float32)
        return v + HOT_EMBD * hot_direction(seed, shape[1])[None, :]
    if init == "ssm_a":
        return -np.exp(rng.uniform(0.0, math.log(16.0), shape)).astype(np.float32)
    if init == "dt_bias":
        return 0.5 * rng.standard_normal(shape, dtype=np.float32)
    return 0.02 * rng.standard_normal(shape, dtype=np.float32)


def _producer(spec: TSpec, seed: int, cfg: SynthConfig | None = None) -> Callable[[], Iterator[np.ndarray]]:
    def gen() -> Iterator[np.ndarray]:
        rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode("utf-8"))])
        ne0 = spec.ne[0]
        rows = int(np.prod(spec.ne[1:], dtype=np.int64)) if len(spec.ne) > 1 else 1
        t = spec.gtype
        full = None if (cfg is None or spec.random) else full_values(cfg, spec.name, spec.ne, seed)
        if full is not None:  # the routing model's values (stratatools.synth.routing)
            rpc = max(1, _CHUNK_VALUES // ne0)
            if full.ndim == 2 and full.shape[0] == rows and full.strides[0] == 0:  # one row repeated
                one = quantize(np.ascontiguousarray(full[:1]), t)
                for r0 in range(0, rows, rpc):
                    yield np.repeat(one, min(rpc, rows - r0), axis=0)
                return
            full = full.reshape(rows, ne0)
            for r0 in range(0, rows, rpc):
                yield quantize(np.ascontiguousarray(full[r0:r0 + rpc]), t)
            return
        if spec.random:
            balanced = cfg is not None and cfg.blocks_balanced
            scale = WIDE_ATTN_OUT_SCALE if balanced and spec.name.endswith(".attn_output.weight") else 1.0
            total = t.nbytes(spec.ne) // t.type_size
            frame = max(1, _RANDOM_FRAME_BYTES // t.type_size)
            step = 8 // math.gcd(t.type_size, 8)  # pieces of whole 64-bit words: no word split between pieces
            piece = max(step, _CHUNK_BYTES // t.type_size // step * step)
            for f0 in range(0, total, frame):
                n = min(frame, total - f0)
                for b0 in range(0, n, piece):  # the frame's last piece rounds up to a whole word, like the frame
                    yield random_blocks(t, min(piece, n - b0), rng, balanced=balanced, scale=scale)
            return
        rpc = max(1, _CHUNK_VALUES // ne0)
        for r0 in range(0, rows, rpc):
            n = min(rpc, rows - r0)
            yield quantize(_values(rng, spec.init, (n, ne0), seed=seed, row0=r0, key=spec.name, n_rows=rows), t)
    return gen


# -------------------------------------------------------------------------------------------- writing
KV = tuple[str, Any, int | None, int | None]


def _metadata(cfg: SynthConfig, tok: Tokenizer, variant: str, n_expert_kv: int) -> list[KV]:
    H = cfg.hidden
    kv: list[KV] = []

    def a(key: str, value: Any, vtype: int | None = None, etype: int | None = None) -> None:
        kv.append((key, value, vtype, etype))

    p = ARCH + "."
    file_type = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "BF16": 32}.get(cfg.dense_type, 7)
    a("general.architecture", ARCH)
    a("general.type", "model")
    label = {"canonical": "", "revA": " revA", "revB": " revB"}.get(variant, " " + variant)
    a("general.name", f"{cfg.name}{label} (synthetic)")
    a("general.size_label", f"{n_expert_kv}x{cfg.hidden}h")
    a(p + "block_count", cfg.n_blocks, U32)
    a(p + "context_length", cfg.context_length, U32)
    a(p + "embedding_length", H, U32)
    a(p + "attention.head_count", cfg.n_head, U32)
    a(p + "attention.head_count_kv", cfg.n_head_kv, U32)
    s = cfg.rope_dim // 16
    a(p + "rope.dimension_sections", [3 * s, 3 * s, 2 * s, 0], ARRAY, I32)
    a(p + "rope.freq_base", float(cfg.rope_theta), VF32)
    a(p + "attention.layer_norm_rms_epsilon", float(cfg.rms_eps), VF32)
    a(p + "expert_count", n_expert_kv, U32)
    a(p + "expert_used_count", cfg.k, U32)
    a(p + "attention.key_length", cfg.head_dim, U32)
    a(p + "attention.value_length", cfg.head_dim, U32)
    a("general.file_type", file_type, U32)
    a(p + "expert_feed_forward_length", cfg.expert_ff, U32)
    a(p + "expert_shared_feed_forward_length", cfg.shared_ff, U32)
    a(p + "ssm.conv_kernel", cfg.conv_kernel, U32)
    a(p + "ssm.state_size", cfg.linear_k_dim, U32)
    a(p + "ssm.group_count", cfg.linear_k_heads, U32)
    a(p + "ssm.time_step_rank", cfg.linear_v_heads, U32)
    a(p + "ssm.inner_size", cfg.linear_v_heads * cfg.linear_v_dim, U32)
    a(p + "attention.recurrent_layers", [not cfg.is_full(i) for i in range(cfg.n_blocks)], ARRAY, BOOL)
    a(p + "full_attention_interval", cfg.full_attention_interval, U32)
    a(p + "rope.dimension_count", cfg.rope_dim, U32)
    a(p + "hyper_connection.count", cfg.hc_count, U32)
    a(p + "hyper_connection.low_rank", cfg.hc_lowrank, U32)
    a(p + "attention.indexer.head_count", cfg.indexer_heads, U32)
    a(p + "attention.indexer.key_length", cfg.indexer_dim, U32)
    a(p + "attention.indexer.top_k", cfg.indexer_top_k, U32)
    a(p + "attention.compress_ratios", [cfg.compress_ratio if cfg.is_full(i) else 0 for i in range(cfg.n_blocks)],
      ARRAY, I32)
    if cfg.mtp:
        a(p + "nextn_predict_layers", 1, U32)
    if cfg.ple_layers:
        sizes = ple_head_vocab_sizes(cfg.ngram_vocab_base, cfg.ngram_heads)
        offs = [sum(sizes[:i]) for i in range(len(sizes))]
        a(p + "ple.layers", list(cfg.ple_layers), ARRAY, I32)
        a(p + "ple.ngram_size", cfg.ngram_size, U32)
        a(p + "ple.heads_per_ngram", cfg.heads_per_ngram, U32)
        a(p + "ple.conv_kernel", cfg.ple_conv_kernel, U32)
        a(p + "ple.eos_token_id", tok.eos_id, U32)
        a(p + "embedding_length_per_layer_input", cfg.ple_dim // cfg.ngram_heads, U32)
        a(p + "ple.layer_multipliers", ple_layer_multipliers(len(tok.tokens), cfg.ngram_size, 0, cfg.ple_seed),
          ARRAY, U64)
        a(p + "ple.head_offsets", offs, ARRAY, U64)
        a(p + "ple.head_vocab_sizes", sizes, ARRAY, U64)
    a("general.quantization_version", 2, U32)
    a("tokenizer.ggml.model", "gpt2")
    a("tokenizer.ggml.pre", "qwen2")
    a("tokenizer.ggml.tokens", list(tok.tokens), ARRAY, STRING)
    a("tokenizer.ggml.token_type", list(tok.token_types), ARRAY, I32)
    a("tokenizer.ggml.merges", list(tok.merges), ARRAY, STRING)
    a("tokenizer.ggml.eos_token_id", tok.eos_id, U32)
    a("tokenizer.ggml.padding_token_id", tok.eos_id, U32)
    a("tokenizer.ggml.add_bos_token", False, BOOL)
    a("stratatools.synthetic", True, BOOL)
    a("stratatools.synth.model.variant", variant)
    a("stratatools.synth.model.seed", cfg.seed, U32 if 0 <= cfg.seed < 2**32 else None)
    return kv


def shard_paths(stem: Path, n: int) -> list[Path]:
    """``<stem>.gguf`` or ``<stem>-0000N-of-0000M.gguf`` for N = 1..n (gguf-split naming)."""
    if n == 1:
        return [stem.with_name(stem.name + ".gguf")]
    return [stem.with_name(f"{stem.name}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def write_gguf_set(stem: Path, kv: list[KV], tensors: list[tuple[str, tuple[int, ...], GGMLType, Callable]],
                   n_shards: int = 1) -> list[Path]:
    """Write a model as one file or as ``n_shards`` gguf-split shards (tensors dealt in order, ceil(n/N) per shard;
    shard 1 holds every key plus ``split.no`` u16, ``split.count`` u16, ``split.tensors.count`` i32, the others only
    the three split keys, as llama-gguf-split writes them). Returns the paths in order."""
    paths = shard_paths(stem, n_shards)
    if n_shards > len(tensors):
        raise StrataError(f"synth: {n_shards} shards for {len(tensors)} tensors; use fewer --shards")
    per = math.ceil(len(tensors) / n_shards)
    for s, path in enumerate(paths):
        w = GGUFWriterStream(path)
        if s == 0:
            for key, value, vtype, etype in kv:
                w.add(key, value, vtype, etype)
        if n_shards > 1:
            w.add("split.no", s, U16)
            w.add("split.count", n_shards, U16)
            w.add("split.tensors.count", len(tensors), I32)
        for name, ne, gtype, prod in tensors[s * per:(s + 1) * per]:
            w.add_tensor(name, ne, gtype, prod)
        w.write()
    return paths


# ------------------------------------------------------------------------------------------ revisions
def kept_sets(cfg: SynthConfig) -> dict[str, list[list[int]]]:
    """Survivors per trunk layer (ascending original indices) of revA and revB, from the seed."""
    rng = np.random.default_rng([cfg.seed, 0x5EED])
    a_sets, b_sets = [], []
    for _ in range(cfg.n_layers):
        a = sorted(int(x) for x in rng.choice(cfg.n_expert, cfg.keep, replace=False))
        pruned = sorted(set(range(cfg.n_expert)) - set(a))
        drop = set(int(x) for x in rng.choice(a, cfg.swap, replace=False)) if cfg.swap else set()
        back = set(int(x) for x in rng.choice(pruned, cfg.swap, replace=False)) if cfg.swap else set()
        a_sets.append(a)
        b_sets.append(sorted((set(a) - drop) | back))
    return {"revA": a_sets, "revB": b_sets}


def _pruned_tensors(model: Model, cfg: SynthConfig, kept: list[list[int]]):
    out = []
    exps = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
    router = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")
    for t in model.iter_tensors():
        m = exps.match(t.name) or router.match(t.name)
        layer = int(m.group(1)) if m else -1
        if m and layer < cfg.n_layers:
            ks = kept[layer]
            if router.match(t.name):
                row = t.type.row_bytes(t.ne[0])
                ne = (t.ne[0], len(ks))
                out.append((t.name, ne, t.type, _rows_producer(model, t, ks, row)))
            else:
                s = t.nbytes // t.ne[2]
                ne = (t.ne[0], t.ne[1], len(ks))
                out.append((t.name, ne, t.type, _rows_producer(model, t, ks, s)))
        else:
            out.append((t.name, t.ne, t.type, _copy_producer(model, t)))
    return out


def _rows_producer(model: Model, t: TensorInfo, keep: list[int], size: int):
    def gen():
        for e in keep:
            yield model.raw(t, e * size, size)
    return gen


def _copy_producer(model: Model, t: TensorInfo):
    def gen():
        for o in range(0, t.nbytes, _CHUNK_BYTES):
            yield model.raw(t, o, min(_CHUNK_BYTES, t.nbytes - o))
    return gen


def _allocation_text(model_name: str, source_name: str, cfg: SynthConfig, tensors: list[tuple[str, Any, GGMLType, Any]],
                     kept: list[list[int]], rev: str) -> str:
    """ISTA layout (formats.md section 6): header, Section 1 per tensor, Section 2 per (layer, role, original index)."""
    lines = [f"# RCO allocation map: {model_name} {rev} (synthetic, written by stratatools synth)",
             f"# Source: {source_name}",
             f"# Experts: {cfg.keep} of {cfg.n_expert} retained per layer, {cfg.n_layers} layers",
             "# Section 1: per-tensor types", ""]

    def key(name: str) -> tuple:
        m = re.match(r"^blk\.(\d+)\.(.*)$", name)
        return (1, int(m.group(1)), m.group(2)) if m else (0, 0, name)

    types = {}
    for name, _, gtype, _ in tensors:
        types[name] = gtype.name
    for name in sorted(types, key=key):
        lines.append(f"{name}: {types[name]}")
    lines += ["", "# Section 2: per-expert allocation (original expert index; empty type = pruned)", ""]
    for layer in range(cfg.n_layers):
        ks = set(kept[layer])
        for role in ("gate", "up", "down"):
            tname = f"blk.{layer}.ffn_{role}_exps.weight"
            ty = types[tname]
            for i in range(cfg.n_expert):
                lines.append(f"{tname}[{i}]: {ty if i in ks else ''}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- API
@dataclass
class RevisionInfo:
    """One pruned revision: its GGUF file(s), allocation map, and survivors (original indices) per layer."""

    name: str
    files: list[Path]
    allocation: Path
    kept: list[list[int]]

    @property
    def path(self) -> Path:
        """The first shard (what ``open_model`` takes)."""
        return self.files[0]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "files": [str(p) for p in self.files], "allocation": str(self.allocation),
                "kept": self.kept}


@dataclass
class ReleaseInfo:
    """What :func:`synth_release` wrote.

    Attributes:
        outdir: the folder. config: the :class:`SynthConfig`. canonical_files: the canonical model's file(s).
        revisions: ``revA``/``revB`` :class:`RevisionInfo` (empty when ``config.revisions`` is off).
        manifest: ``release.json``. bytes_written: all GGUF bytes. seconds: wall time.
        canonical_bytes / canonical_seconds: the canonical model alone (write speed).
    """

    outdir: Path
    config: SynthConfig
    canonical_files: list[Path]
    revisions: dict[str, RevisionInfo]
    manifest: Path
    bytes_written: int
    seconds: float
    canonical_bytes: int = 0
    canonical_seconds: float = 0.0

    @property
    def canonical(self) -> Path:
        return self.canonical_files[0]

    @property
    def revA(self) -> RevisionInfo:  # noqa: N802
        return self.revisions["revA"]

    @property
    def revB(self) -> RevisionInfo:  # noqa: N802
        return self.revisions["revB"]

    @property
    def write_mib_s(self) -> float:
        return self.canonical_bytes / (1 << 20) / self.canonical_seconds if self.canonical_seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"outdir": str(self.outdir), "canonical": [str(p) for p in self.canonical_files],
                "revisions": {k: v.to_dict() for k, v in self.revisions.items()}, "manifest": str(self.manifest),
                "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3),
                "canonical_bytes": self.canonical_bytes, "canonical_write_mib_s": round(self.write_mib_s, 1),
                "config": _cfg_dict(self.config)}


def _cfg_dict(cfg: SynthConfig) -> dict[str, Any]:
    d = asdict(cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def synth_release(outdir: str | os.PathLike, cfg: SynthConfig | None = None, force: bool = False,
                  progress: Callable[[int], Any] | None = None) -> ReleaseInfo:
    """Write a synthetic release into ``outdir``: ``synth-canonical.gguf`` (or shards), and unless
    ``cfg.revisions`` is off ``synth-revA.gguf``, ``synth-revB.gguf`` with ``synth-rev{A,B}.rco-allocation.txt``,
    plus ``release.json`` (config, files, survivors). Deterministic for a config.

    Args:
        progress: called with bytes written as tensors complete.

    Raises:
        StrataError: bad config (see :meth:`SynthConfig.validate`); outputs exist and ``force`` is off.
    """
    cfg = cfg or SynthConfig()
    cfg.validate()
    t0 = time.perf_counter()
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise StrataError(f"{outdir}: exists and is not a folder", outdir)
    names = ["canonical"] + (["revA", "revB"] if cfg.revisions else [])
    planned = [p for n in names for p in shard_paths(outdir / f"synth-{n}", cfg.shards)]
    planned += [outdir / "release.json"] + [outdir / f"synth-{n}.rco-allocation.txt" for n in names[1:]]
    planned_names = {p.name for p in planned}
    # what a killed run left beside it (its temp folder, the lock file, aside folders: the publish's keep)
    tidy_output(outdir, keep=lambda n: n not in planned_names)

    def refuse(_t: Path) -> None:  # also run under the output lock just before the swap (publish_dir)
        existing = [p for p in planned if p.exists()]
        if existing:
            raise StrataError(f"{existing[0]}: already exists (pass --force to replace the release)", existing[0])
        refuse_foreign_folder(outdir, lambda n: n not in {p.name for p in planned}, "synth release", "OUT")

    if not force:
        refuse(outdir)
    # the release is built in a temp folder beside outdir: swapped in whole, or, when the folder holds other
    # entries, its files renamed in one by one (publish_dir)
    with publish_dir(outdir, keep=lambda n: n not in planned_names, refuse=None if force else refuse,
                     last=("release.json",)) as stage:
        info = _write_release(stage, cfg, progress, t0)
    return _rebased(info, stage, outdir)


def _rebased(info: ReleaseInfo, stage: Path, outdir: Path) -> ReleaseInfo:
    """``info`` with every path under ``stage`` moved to ``outdir`` (after the swap)."""
    def mv(p: Path) -> Path:
        return outdir / p.relative_to(stage)

    revs = {k: replace(v, files=[mv(p) for p in v.files], allocation=mv(v.allocation))
            for k, v in info.revisions.items()}
    return replace(info, outdir=outdir, canonical_files=[mv(p) for p in info.canonical_files], revisions=revs,
                   manifest=mv(info.manifest))


def _write_release(outdir: Path, cfg: SynthConfig, progress: Callable[[int], Any] | None,
                   t0: float) -> ReleaseInfo:
    tok = build_tokenizer(cfg.vocab_size)
    specs = _tensor_list(cfg, len(tok.tokens))
    tensors = []
    for sp, prod in zip(specs, _pipelined([_producer(sp, cfg.seed, cfg) for sp in specs])):
        if progress is not None:
            prod = _counting(prod, progress)
        tensors.append((sp.name, sp.ne, sp.gtype, prod))
    canon = write_gguf_set(outdir / "synth-canonical", _metadata(cfg, tok, "canonical", cfg.n_expert), tensors,
                           cfg.shards)
    canon_bytes = sum(p.stat().st_size for p in canon)
    canon_s = time.perf_counter() - t0
    written = canon_bytes
    revisions: dict[str, RevisionInfo] = {}
    if cfg.revisions:
        from stratatools.model.gguf import open_model

        sets = kept_sets(cfg)
        with open_model(canon[0]) as model:
            for rev in ("revA", "revB"):
                pt = _pruned_tensors(model, cfg, sets[rev])
                if progress is not None:
                    pt = [(n, ne, t, _counting(p, progress)) for n, ne, t, p in pt]
                files = write_gguf_set(outdir / f"synth-{rev}", _metadata(cfg, tok, rev, cfg.keep), pt, cfg.shards)
                alloc = outdir / f"synth-{rev}.rco-allocation.txt"
                write_text_atomic(alloc, _allocation_text(cfg.name, canon[0].name, cfg, pt, sets[rev], rev))
                revisions[rev] = RevisionInfo(rev, files, alloc, sets[rev])
                written += sum(p.stat().st_size for p in files)
    manifest = outdir / "release.json"
    rec = {"format": "stratatools-synth-release/1", "synthetic": True, "config": _cfg_dict(cfg),
           "vocab_size": len(tok.tokens),
           "canonical": {"files": [{"name": p.name, "size_bytes": p.stat().st_size} for p in canon],
                         "n_expert": cfg.n_expert},
           "revisions": {k: {"files": [{"name": p.name, "size_bytes": p.stat().st_size} for p in v.files],
                             "allocation": v.allocation.name, "n_expert": cfg.keep, "kept": v.kept}
                         for k, v in revisions.items()}}
    write_text_atomic(manifest, json.dumps(rec, indent=2, sort_keys=True) + "\n")
    return ReleaseInfo(outdir, cfg, canon, revisions, manifest, written, time.perf_counter() - t0, canon_bytes, canon_s)


_END = object()
_PREFETCH_MIN = 4 << 20  # tensors at least this large are produced in a helper thread


def _prefetched(prod: Callable[[], Iterable[Any]], depth: int = 2) -> Callable[[], Iterator[Any]]:
    """Run ``prod`` in a helper thread, at most ``depth`` chunks ahead, so making the next chunk (numpy, which
    releases the GIL) overlaps writing this one. Errors of the producer are raised in the caller."""
    import queue
    import threading

    def gen() -> Iterator[Any]:
        q: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()

        def work() -> None:
            try:
                for c in prod():
                    if stop.is_set():
                        return
                    q.put(c)
                q.put(_END)
            except BaseException as e:  # handed to the consumer
                q.put(e)

        t = threading.Thread(target=work, name="synth-producer", daemon=True)
        t.start()
        try:
            while True:
                c = q.get()
                if c is _END:
                    break
                if isinstance(c, BaseException):
                    raise c
                yield c
        finally:
            stop.set()
            while t.is_alive():  # let a blocked put finish
                try:
                    q.get_nowait()
                except queue.Empty:
                    t.join(0.01)
    return gen


def _pipelined(prods: list[Callable[[], Iterable[Any]]], depth: int = 8) -> list[Callable[[], Iterator[Any]]]:
    """Producers for tensors that are consumed in list order (one model file, or shards in order): one helper
    thread makes the chunks of every tensor in turn, at most ``depth`` chunks (1 MiB or so each) ahead of the
    writer, across tensor boundaries, so the writer never waits for a tensor's first chunk and no thread is
    started per tensor. Errors of a producer are raised in the caller; a consumer that stops early (an error while
    writing) stops the helper."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    state: dict[str, Any] = {}

    def work() -> None:
        try:
            for i, prod in enumerate(prods):
                for c in prod():
                    if stop.is_set():
                        return
                    q.put((i, c))
                q.put((i, _END))
        except BaseException as e:  # handed to the consumer
            q.put((-1, e))

    def halt() -> None:
        stop.set()
        t = state.get("thread")
        while t is not None and t.is_alive():  # let a blocked put finish
            try:
                q.get_nowait()
            except queue.Empty:
                t.join(0.01)

    def make(i: int) -> Callable[[], Iterator[Any]]:
        def gen() -> Iterator[Any]:
            if "thread" not in state:
                state["thread"] = threading.Thread(target=work, name="synth-producer", daemon=True)
                state["thread"].start()
            done = False
            try:
                while True:
                    j, c = q.get()
                    if isinstance(c, BaseException):
                        raise c
                    if j != i:
                        raise RuntimeError(f"synth: tensor {j} produced while tensor {i} was written (out of order)")
                    if c is _END:
                        done = True
                        return
                    yield c
            finally:
                if not done:
                    halt()
        return gen
    return [make(i) for i in range(len(prods))]


def _counting(prod: Callable[[], Iterable[Any]], progress: Callable[[int], Any]) -> Callable[[], Iterator[Any]]:
    def gen():
        for c in prod():
            yield c
            progress(c.nbytes if hasattr(c, "nbytes") else len(c))
    return gen


def estimate_bytes(cfg: SynthConfig) -> int:
    """GGUF data bytes of the canonical model (for progress bars)."""
    cfg.validate()
    return sum(sp.gtype.nbytes(sp.ne) for sp in _tensor_list(cfg, len(build_tokenizer(cfg.vocab_size).tokens)))


# Memory the writer holds besides one structured tensor: the pipelined producers' chunks and random frames
# (_pipelined depth 8 x _RANDOM_FRAME_BYTES), the tokenizer, the interpreter and numpy.
_BASE_HOLD_BYTES = 256 << 20
# A structured tensor (routing.full_values) is built with up to ~4 float32 copies alive at once (output.weight:
# the embedding, its projection, the noise and the result).
_HOLD_COPIES = 4


def footprint(cfg: SynthConfig) -> tuple[int, int]:
    """(bytes written, peak bytes held) estimates of :func:`synth_release` for ``cfg``, computed from the tensor
    shapes alone (nothing is allocated).

    Written: the canonical model's GGUF data bytes, times 3 with the pruned revisions (they keep fewer experts, so
    this bounds them). Held: the largest tensor whose values are built whole (the routing model's tensors,
    ``routing.structured_names``; the others stream in ~1 MiB chunks) as float32 with its temporaries, plus the
    writer's pipeline. Raises StrataError for an invalid config (:meth:`SynthConfig.validate`)."""
    cfg.validate()
    specs = _tensor_list(cfg, len(build_tokenizer(cfg.vocab_size).tokens))
    written = sum(sp.gtype.nbytes(sp.ne) for sp in specs) * (3 if cfg.revisions else 1)
    pat = structured_names(cfg)
    whole = [math.prod(sp.ne) for sp in specs if not sp.random and pat.match(sp.name)]
    held = _BASE_HOLD_BYTES + _HOLD_COPIES * 4 * max(whole, default=0)
    return int(written), int(held)


def available_memory() -> int | None:
    """Bytes this process can still allocate: the kernel's MemAvailable (/proc/meminfo), lowered to the headroom
    under an address-space limit (``ulimit -v``: RLIMIT_AS minus the current VmSize). None where neither is known
    (not Linux)."""
    avail: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            vm = 0
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmSize:"):
                        vm = int(line.split()[1]) * 1024
            avail.append(max(0, soft - vm))
    except (ImportError, OSError, ValueError, IndexError):
        pass
    return min(avail) if avail else None


def check_footprint(cfg: SynthConfig, outdir: str | os.PathLike) -> tuple[int, int]:
    """Refuse, before anything is allocated or written, a release that would not fit: the bytes held (see
    :func:`footprint`) over :func:`available_memory`, or the bytes written over the free space of the disk that
    holds ``outdir`` (its nearest existing folder). Returns :func:`footprint`'s (written, held).

    Raises:
        StrataError: naming the size options (--hidden, --experts, --expert-ff, --layers, --keep) and both sizes."""
    import shutil

    written, held = footprint(cfg)
    opts = (f"--layers {cfg.n_layers} --hidden {cfg.hidden} --experts {cfg.n_expert} --expert-ff {cfg.expert_ff}"
            + (f" --keep {cfg.keep}" if cfg.revisions else ""))
    gib = lambda n: f"{n / 2**30:,.2f} GiB"  # noqa: E731
    mem = available_memory()
    if mem is not None and held > mem:
        raise StrataError(f"synth: {opts} needs about {gib(held)} of memory while writing, and {gib(mem)} is "
                          f"available; lower --hidden (or --experts / --expert-ff)")
    d = Path(outdir).absolute()
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        free = shutil.disk_usage(d).free
    except OSError:
        free = None
    if free is not None and written > free:
        raise StrataError(f"synth: {opts} writes about {gib(written)} and {d} has {gib(free)} free; lower --hidden, "
                          f"--experts, --expert-ff or --layers (or add --no-revisions)", d)
    return written, held


def config_with(cfg: SynthConfig, **kw: Any) -> SynthConfig:
    """``cfg`` with some fields replaced (a frozen dataclass helper)."""
    kw = {k: v for k, v in kw.items() if v is not None}
    if "routing" in kw and kw["routing"] != cfg.routing:  # a new routing brings its own skew / locality defaults
        kw.setdefault("skew", None)
        kw.setdefault("locality", None)
    return replace(cfg, **kw)
