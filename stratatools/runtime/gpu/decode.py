"""Batch-1 decode with static buffers and no host synchronisation inside the step, capturable as CUDA graphs.

:class:`StaticDecoder` runs one decode position of a loaded qwen4exp model (the same numerics as
:meth:`stratatools.runtime.model.Qwen4ExpRuntime.forward` with one token) over buffers allocated once:

* the per-step inputs (token embedding row, PLE table rows, RoPE cos/sin, position) are computed on the host
  from the token id and uploaded in one copy; everything after that stays on the device (for queued steps,
  :meth:`StaticDecoder._stage_from_device` writes the token-dependent part on the device instead, from the previous
  step's arg-max: ``stage_step.cu``);
* GDN conv/recurrent states, PLE conv states and attention K/V caches (``max_ctx`` positions) are updated
  in place; the position is read on the device, so the same launch sequence serves every position;
* router top-k runs on the device (``decode_step.cu`` ``route_topk``: softmax/sigmoid probabilities from the
  same array code as the CPU path, then k rounds of arg-max with ties to the lower expert index, which is
  what the CPU path's stable descending sort selects); blob addresses come from a device table of the
  tier's VRAM slots, so routing never leaves the device;
* dense matrices are multiplied straight from their GGUF blocks in VRAM (:func:`stratatools.runtime.gpu.experts.matvec`'s
  kernel), experts through :func:`stratatools.runtime.gpu.experts.expert_ffn`, attention split over
  :data:`ATTN_SPLITS` parts a head (``qsa_step.cu`` ``attn_sel_partial`` / ``attn_sel_combine``).

On CuPy the step is captured once into a few CUDA graphs (:meth:`StaticDecoder.capture`, pieces cut before the
layers of :func:`graph_cuts`) and replayed per token:
batch-1 decode is otherwise bound by kernel-launch overhead. The routing of each step stays in device buffers
(``ids`` [L, k], ``weights`` [L, k]) that share one buffer with the arg-max token; after each step one asynchronous
copy brings that buffer into pinned host memory, and :meth:`StaticDecoder.routing` / :meth:`StaticDecoder.next_token`
wait for it (no other transfer or host synchronisation per step; the tier's bookkeeping is batched there).

Partial tiers: the router reads each expert's blob address from a device table (:meth:`GPUExpertTier.slot_table`):
a VRAM slot for a resident expert, the mapped pinned host arena for any other (a zero-copy read over the bus).
:meth:`StaticDecoder.routing` feeds the step's records to the tier's policy (static, adaptive, LRU, LFU, LFRU:
the simulator's code), VRAM follows the policy's resident set, and the table is re-uploaded before the next
step (between graph replays) when experts moved.

QSA token selection: while QSA attends every visible cell (position ``p`` with ``(p+1)//ratio <= budget//ratio``,
``transformers`` rule, or ``p+1 <= budget+ratio-1``, ``llamacpp`` rule, in every attention layer:
:func:`max_full_context`) the indexer does not change the output and is skipped. A decoder built for a longer
context (``max_ctx`` up to the model's context length) runs the indexer inside the step (:meth:`StaticDecoder._qsa`,
kernels in ``qsa_step.cu``): the indexer query (projection, q_norm, RoPE); the raw indexer key into a static
cache [max_ctx, idx_dim]; when ``pos+1`` completes a block, its pooled key (mean of the block's raw keys, k_norm,
RoPE at the block start) into a static block-key cache; block scores ``sum_heads relu(q.k)/sqrt(d)``; the
selected cells, exactly as :meth:`stratatools.runtime.model.Qwen4ExpRuntime._select` picks them (a radix select
finds the threshold; when the tied scores at the threshold are not all taken, one thread replays the CPU's
``torch.topk`` / ``std::partial_sort`` on (score, index) pairs, :mod:`stratatools.runtime.topk`); then attention
over the cell list, split over blocks with an online-softmax merge (any length). Every kernel reads the position
on the device, so the launch sequence is the same for every position and the step stays capturable.

Scope (raises :class:`StrataError` outside it): one sequence; a partial tier needs pinned host memory mapped into
the device; ``max_ctx`` at most the model's ``context_length``; one indexer key head.
With numpy (``xp=numpy``) the same code runs on the CPU (tests check it against the reference forward).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import numpy as np

from stratatools.core.errors import StrataError

from stratatools.runtime.gpu.kernels import SHARED_SIDE_ENV, _env_on, shared_side  # noqa: F401
from stratatools.runtime.gpu.kernels import Q8R, begin_capture, cuda_source, cuda_unit, dense_kernel, env_count
from stratatools.runtime.gpu.launch import pdl, pdl_enabled, pdl_supported
from stratatools.runtime.model import SequenceState, _l2norm, _rmsnorm, _sigmoid, _silu, _softmax, _softplus, _to_host
from stratatools.runtime.topk import llamacpp_cells, torch_topk_indices
from stratatools.runtime.topk import qsa_selects_all as _selects_all


def max_full_context(cfg: Any, selection: str) -> int:
    """The longest context (positions 0..n-1) for which every attention layer selects every cell."""
    best = 1 << 30
    for il in range(cfg.n_layer):
        if cfg.recurrent[il] or cfg.compress_ratios[il] <= 0:
            continue
        r, b = cfg.compress_ratios[il], cfg.idx_budget
        n = 1
        while _selects_all(selection, r, b, n):  # small loop: budget is a few thousand at most
            n += 1
        best = min(best, n)
    return best


#: Parts one head's attention is split into (``attn_sel_partial``'s grid y): the CuPy step attends every context
#: this way (the selected cells past the full-selection range, every position below it). ``attn_decode``, one block a
#: head walking the positions, grew with the context: about 13 us a layer at 32 positions and over 100 at 550
#: (the 48 x 256 model decoded 8.31 ms a step in ``run`` at positions 512-576 against 7.06 at 32; gpu-notes.md).
ATTN_SPLITS = 16


def split_attention_bytes(cfg: Any, max_ctx: int) -> int:
    """Device bytes of the split attention's scratch (float32 scores [heads, max_ctx] and the parts' partials
    [heads, :data:`ATTN_SPLITS`, head_dim + 2])."""
    return 4 * cfg.n_head * max_ctx + 4 * cfg.n_head * ATTN_SPLITS * (cfg.head_dim + 2)


#: The most experts a layer may have for the one-warp router (decode_step.cu: ``route_warp_sg8`` holds 8 probabilities
#: a lane, up to 256 experts, ``route_warp_sg16`` 16, up to this); wider routers take ``route_fused_sg``'s block.
ROUTE_WARP_MAX = 32 * 16
#: ``STRATATOOLS_ROUTE_WARP``: 1 (default) routes the fused step's tokens by one warp from registers
#: (``route_warp_sg8`` / ``16``), 0 by ``route_fused_sg``'s block (before); the same ids and weights bit for bit.
ROUTE_WARP_ENV = "STRATATOOLS_ROUTE_WARP"
#: The widest indexer head the device pooling kernel holds (``qsa_pool``'s shared buffer).
QSA_MAX_DIM = 512


def model_context_length(model: Any) -> int | None:
    """The GGUF's ``{arch}.context_length`` (positions), or None when the file does not say."""
    v = model.kv.get(f"{model.arch}.context_length")
    return None if v is None else int(v)


def qsa_cache_bytes(cfg: Any, max_ctx: int) -> int:
    """Device bytes of the QSA path for ``max_ctx`` positions (float32): per QSA layer the raw indexer keys and the
    pooled block keys; once, the selection scratch (block scores, flags, tie-replay pairs, cell list) and the
    attention scratch (scores [heads, max_ctx], split partials)."""
    n = 0
    for il in range(cfg.n_layer):
        r = cfg.compress_ratios[il]
        if not cfg.recurrent[il] and r > 0:
            n += 4 * cfg.idx_head_dim * (max_ctx + max_ctx // r + 1)
    n += 4 * 5 * (max_ctx + 1) + split_attention_bytes(cfg, max_ctx)
    return n


#: ``STRATATOOLS_DENSE_Q8=0`` keeps the fused step's Q8_0 matrices in their GGUF blocks (``matvec_tiled_kernel``, the
#: earlier kernel; for before/after measurements in one run) instead of :class:`Q8R`'s layout.
DENSE_Q8_ENV = "STRATATOOLS_DENSE_Q8"


def dense_q8_enabled() -> bool:
    """Does the fused step re-lay out Q8_0 matrices for ``dense_q8.cu`` (default yes; see :data:`DENSE_Q8_ENV`)?"""
    return os.environ.get(DENSE_Q8_ENV, "1") != "0"


#: Queued decode steps (:data:`DECODE_QUEUE_ENV`): steps queued behind one another, their token-dependent inputs
#: staged on the device (:meth:`StaticDecoder._stage_from_device`); :func:`stratatools.runtime.device.plan_vram` then
#: plans the token and PLE tables' bytes (:func:`stage_table_bytes`), which the device staging keeps in VRAM. ``auto``
#: (the default, also unset or empty): on for a GPU decoder whose tables take at most :data:`QUEUE_AUTO_TABLE_BYTES`
#: (measured on an H200, 48 x 256 Q2_0, 512-token prompt: 147.0 against 135.5 tokens/s all resident; 95.8 against
#: 93.8 for 1,872 slots static before the split attention; bench/gpu-notes.md, tenth pass); ``1``: on wherever the
#: decoder can stage; ``0``: off.
DECODE_QUEUE_ENV = "STRATATOOLS_DECODE_QUEUE"
#: ``auto`` leaves queued steps off when the token and PLE tables would take more device memory than this (the
#: room would otherwise go to expert slots): 256 MiB.
QUEUE_AUTO_TABLE_BYTES = 256 * 1024 * 1024
#: Table types ``stage_step.cu`` dequantizes (ggml ids: F32, F16, BF16, Q8_0).
STAGE_TYPES = {"F32": 0, "F16": 1, "BF16": 30, "Q8_0": 8}
#: ``stage_step.cu``'s SS_MAX_NGRAM and SS_MAX_ROWS (PLE n-gram size, PLE rows of one step over all PLE layers).
STAGE_MAX_NGRAM = 8
STAGE_MAX_ROWS = 512
#: Threads of the ``stage_step`` block.
STAGE_THREADS = 256


def decode_queue_setting() -> str:
    """:data:`DECODE_QUEUE_ENV` as ``auto`` (unset, empty or ``auto``), ``1`` or ``0``; raises StrataError for
    another value."""
    raw = os.environ.get(DECODE_QUEUE_ENV, "")
    v = raw.strip().lower() or "auto"
    if v not in ("auto", "1", "0"):
        raise StrataError(f"{DECODE_QUEUE_ENV}={raw!r}: use auto, 1 or 0")
    return v


def queue_status(model: Any, cfg: Any, asked: bool | None = None, async_swaps: bool | None = None,
                 gpu: bool = True, lag: bool | None = None) -> tuple[bool, str]:
    """Whether queued decode steps run (:class:`stratatools.runtime.gpu.engine.DecoderRuntime` ``queue``) and, when
    not, why. ``asked``: True / False, or None for :func:`decode_queue_setting` (``auto``: a GPU decoder whose
    :func:`stage_table_bytes` are at most :data:`QUEUE_AUTO_TABLE_BYTES`). Never with ``STRATATOOLS_ASYNC_SWAPS=1``
    (``async_swaps``, None: that variable) or with the bookkeeping before each launch (``lag`` False; None:
    ``STRATATOOLS_DECODE_LAG=0`` asks for that); on a GPU decoder only where :func:`device_stage_check` passes (a
    numpy decoder takes its tokens from the host). Returns (on, reason: "" when on). Raises StrataError for a
    :data:`DECODE_QUEUE_ENV` value other than auto, 1 or 0."""
    setting = "1" if asked else "0" if asked is not None else decode_queue_setting()
    if setting == "0":
        return False, "off (asked for)" if asked is not None else f"{DECODE_QUEUE_ENV}=0"
    if setting == "auto" and not gpu:
        return False, f"{DECODE_QUEUE_ENV}=auto queues on a GPU decoder only (1 queues this one too)"
    if not ((os.environ.get("STRATATOOLS_DECODE_LAG", "1") != "0") if lag is None else lag):
        return False, "not with STRATATOOLS_DECODE_LAG=0 (the bookkeeping before each launch)"
    if (os.environ.get("STRATATOOLS_ASYNC_SWAPS", "0") == "1") if async_swaps is None else async_swaps:
        return False, "not with STRATATOOLS_ASYNC_SWAPS=1"
    if setting == "auto" and gpu:
        tables = stage_table_bytes(model, cfg)
        if tables > QUEUE_AUTO_TABLE_BYTES:
            return False, (f"the token and PLE tables take {tables / 2 ** 20:.1f} MiB of device memory (auto stages "
                           f"at most {QUEUE_AUTO_TABLE_BYTES / 2 ** 20:.0f} MiB; {DECODE_QUEUE_ENV}=1 queues anyway)")
    return device_stage_check(model, cfg) if gpu else (True, "")


def stage_tables(model: Any, cfg: Any) -> list[str]:
    """The tables device staging reads: ``token_embd.weight`` and, for a model with PLE layers,
    ``per_layer_token_embd.weight``."""
    return ["token_embd.weight"] + (["per_layer_token_embd.weight"] if cfg.ple_layers else [])


def stage_table_bytes(model: Any, cfg: Any) -> int:
    """Device bytes of the tables :meth:`StaticDecoder._stage_from_device` uploads (their GGUF bytes as stored;
    tables absent from ``model`` count 0)."""
    return sum(int(model.tensor(n).nbytes) for n in stage_tables(model, cfg) if model.has(n))


def device_stage_check(model: Any, cfg: Any) -> tuple[bool, str]:
    """Whether ``stage_step.cu`` can stage this model's steps: (True, "") or (False, the reason).

    Needs ``token_embd.weight`` (and ``per_layer_token_embd.weight`` with PLE layers) of a type in
    :data:`STAGE_TYPES`, whole Q8_0 blocks per row, an n-gram of at most :data:`STAGE_MAX_NGRAM`, at most
    :data:`STAGE_MAX_ROWS` PLE rows a step, positive head vocabularies and every head's rows
    (offset .. offset + vocab) inside the PLE table.
    """
    for name in stage_tables(model, cfg):
        if not model.has(name):
            return False, f"tensor {name} is missing"
        t = model.tensor(name)
        if t.type.name not in STAGE_TYPES:
            return False, f"tensor {name} is {t.type.name}; device staging reads {', '.join(STAGE_TYPES)}"
        if t.type.name == "Q8_0" and int(t.ne[0]) % 32:
            return False, f"tensor {name}: rows of {int(t.ne[0])} values are not whole Q8_0 blocks"
    t = model.tensor("token_embd.weight")
    if int(t.ne[0]) != cfg.n_embd:
        return False, f"token_embd.weight rows hold {int(t.ne[0])} values, not n_embd {cfg.n_embd}"
    if cfg.ple_layers:
        keep = cfg.ple_ngram - 1
        nh = keep * cfg.ple_heads_per_ngram
        if cfg.ple_ngram > STAGE_MAX_NGRAM:
            return False, f"PLE n-gram size {cfg.ple_ngram} is over {STAGE_MAX_NGRAM}"
        if len(cfg.ple_layers) * nh > STAGE_MAX_ROWS:
            return False, f"{len(cfg.ple_layers)} PLE layers x {nh} heads is over {STAGE_MAX_ROWS} rows a step"
        ne0 = int(model.tensor("per_layer_token_embd.weight").ne[0])
        if len(cfg.ple_layers) * nh * ne0 >= 2 ** 31:
            return False, f"{len(cfg.ple_layers) * nh} PLE rows of {ne0} values are 2^31 values or more a step"
        rows = int(model.tensor("per_layer_token_embd.weight").ne[1])
        vocab = np.asarray(cfg.ple_head_vocab, dtype=np.int64)[:nh]
        off = np.asarray(cfg.ple_head_offsets, dtype=np.int64)[:nh]
        if (vocab <= 0).any() or (off < 0).any() or (off + vocab > rows).any():
            return False, f"PLE head vocabularies/offsets reach outside the table's {rows} rows"
    return True, ""


def stage_table_args(model: Any, cfg: Any, tables: tuple[Any, Any], poff: list[int]) -> tuple[tuple, tuple, np.ndarray,
                                                                                          tuple]:
    """The arguments ``stage_step.cu``'s kernels take about the tables (for :meth:`StaticDecoder._dstage_init` and the
    batched step's ``stage_steps``): (token table (device bytes, ggml type id, rows, row bytes), PLE table (the same
    and its row values; the token table's bytes with zeros when the model has no PLE rows to stage), the int64
    constants [multipliers | head vocabularies | head offsets | poff] (numpy), (n_pl, ngram, heads a n-gram, eos)).
    ``tables``: the device bytes (token, PLE or None); ``poff``: each PLE layer's offset in the caller's input buffer
    (floats). Facts of the formats: :func:`device_stage_check` has accepted the model."""
    keep = max(cfg.ple_ngram - 1, 0)
    n_pl = len(cfg.ple_layers) if keep > 0 else 0
    nh = keep * cfg.ple_heads_per_ngram if n_pl else 0
    t = model.tensor("token_embd.weight")
    tok = (tables[0], np.int32(STAGE_TYPES[t.type.name]), np.int64(int(t.ne[1])),
           np.int64(t.type.row_bytes(int(t.ne[0]))))
    if n_pl:
        t = model.tensor("per_layer_token_embd.weight")
        ple = (tables[1], np.int32(STAGE_TYPES[t.type.name]), np.int64(int(t.ne[1])),
               np.int64(t.type.row_bytes(int(t.ne[0]))), np.int32(int(t.ne[0])))
        prm = np.concatenate([np.asarray(cfg.ple_multipliers, dtype=np.int64)[:cfg.ple_ngram],
                              np.asarray(cfg.ple_head_vocab, dtype=np.int64)[:nh],
                              np.asarray(cfg.ple_head_offsets, dtype=np.int64)[:nh],
                              np.asarray(poff, dtype=np.int64)])
    else:  # no PLE rows: the kernels read no PLE table
        ple = (tables[0], np.int32(0), np.int64(0), np.int64(0), np.int32(1))
        prm = np.zeros(1, dtype=np.int64)
    return tok, ple, prm, (np.int32(n_pl), np.int32(cfg.ple_ngram if n_pl else 0),
                           np.int32(cfg.ple_heads_per_ngram if n_pl else 0), np.int64(cfg.eos_id))


def padded_context(ctx: Any, keep: int, eos: int, width: int | None = None) -> np.ndarray:
    """A PLE n-gram context as the staging kernels read it: its last ``keep`` ids right-aligned in ``width`` (default
    max(keep, 1)) int64 slots, EOS in front of a shorter one (EOS cuts the n-gram there, so it hashes the same)."""
    out = np.full(max(keep, 1) if width is None else width, eos, dtype=np.int64)
    if keep:
        have = np.asarray(ctx, dtype=np.int64).reshape(-1)[-keep:]
        if have.size:
            out[keep - have.size:keep] = have
    return out


#: How the offloaded fused step serves missed experts (a partial tier; ignored when every expert is resident):
#: ``zero-copy`` (the staged expert kernels read a missed blob from the mapped host arena as they compute),
#: ``fetch`` (``miss_fetch.cu`` first copies the layer's missed blobs into device staging with every SM, one burst over
#: the bus; the pipelined expert kernels then read device memory only) or ``prefetch`` (the default; ``fetch``, and while layer l
#: runs, a second stream applies layer l+1's router to layer l's expert input (or its token mixer's input:
#: :data:`PREFETCH_ORDER_ENV`) and copies the predicted misses of layer l+1 ahead; layer l+1's fetch then copies only
#: what the prediction missed). The policy, the hits counted and
#: the results do not depend on the mode (a prediction only decides what is copied early).
MISS_FETCH_ENV = "STRATATOOLS_MISS_FETCH"
MISS_FETCH_MODES = ("zero-copy", "fetch", "prefetch")
#: Threads of a ``fetch_blobs`` block.
FETCH_THREADS = 256


def miss_fetch_mode() -> str:
    """The miss fetch mode from :data:`MISS_FETCH_ENV` (default ``prefetch``: the fastest of the three on every
    partial tier measured, bench/gpu-notes.md); raises StrataError for another value."""
    v = os.environ.get(MISS_FETCH_ENV, "").strip() or "prefetch"
    if v not in MISS_FETCH_MODES:
        raise StrataError(f"{MISS_FETCH_ENV}={v!r}: use one of {', '.join(MISS_FETCH_MODES)}")
    return v


#: Experts the ``prefetch`` mode predicts for the next layer beyond its k (default 0: on synthetic and kit models the
#: top 1.5 k of the next router on this layer's input held 93-98% of the next layer's k, the top k 83-88%; but on the
#: 48 x 256 model at 1,872 slots the top k alone decoded faster (static 88.8 against 82.7 tok/s, LRU 79.3 against
#: 78.8): the extra copies cost more bus time than the late fetches they save; bench/gpu-notes.md, seventh pass).
PREFETCH_EXTRA_ENV = "STRATATOOLS_PREFETCH_EXTRA"


def prefetch_width(k: int, n_expert: int | None = None) -> int:
    """Experts predicted per layer in ``prefetch`` mode: k + :data:`PREFETCH_EXTRA_ENV` (default 0), at most
    ``n_expert`` and 64 (the routing kernel's limit). Raises StrataError for a value that is not a whole number
    (ASCII digits)."""
    extra = env_count(PREFETCH_EXTRA_ENV, 0, 0, "experts")
    return int(min(int(k) + extra, 64, n_expert if n_expert else 64))


#: When the ``prefetch`` mode starts layer l+1's copies: ``first`` (the default: at the start of layer l's experts,
#: beside layer l's own late fetch), ``after`` (once layer l's late fetch is queued: the late copies, which the
#: step waits for, do not share the bus with the prefetch) or ``mixer`` (at the start of layer l's token mixer, layer
#: l+1's router applied to the mixer's input: a layer's mixer longer to copy beside, on a less exact prediction).
PREFETCH_ORDER_ENV = "STRATATOOLS_PREFETCH_ORDER"
PREFETCH_ORDERS = ("first", "after", "mixer")


def prefetch_order() -> str:
    """:data:`PREFETCH_ORDER_ENV` (one of :data:`PREFETCH_ORDERS`, default ``first``); raises StrataError for another
    value."""
    v = os.environ.get(PREFETCH_ORDER_ENV, "").strip() or "first"
    if v not in PREFETCH_ORDERS:
        raise StrataError(f"{PREFETCH_ORDER_ENV}={v!r}: use {', '.join(PREFETCH_ORDERS)}")
    return v


# SHARED_SIDE_ENV, shared_side and the flag reader live in kernels.py (the prefill reads them too, and must not
# import this module).
def route_warp() -> bool:
    """:data:`ROUTE_WARP_ENV` as a flag (default on); raises StrataError for a value other than 0 or 1."""
    return _env_on(ROUTE_WARP_ENV, "the router by one warp from registers")


def fetch_staging_bytes(mode: str, k: int, slot_bytes: int, n_expert: int | None = None) -> int:
    """Device bytes of the miss fetch's staging for ``mode``: one blob entry per routed job (``k`` of them) for the
    layer being computed, and with ``prefetch`` two sets of :func:`prefetch_width` entries for the predicted next
    layer (by layer parity: one is filled while the other is read)."""
    n = {"zero-copy": 0, "fetch": int(k)}.get(mode)
    if n is None:
        n = int(k) + 2 * prefetch_width(k, n_expert)
    return n * int(slot_bytes)


#: Blocks of the prefetch's ``fetch_blobs`` launch, all jobs together: it runs beside the main stream's kernels, so
#: it takes a few SMs only; 32 blocks keep about 0.5 MB of 16-byte loads in flight, several times what the bus needs
#: to run at its rate (about 55 GB/s x 2 us of latency).
PREFETCH_BLOCKS = 32
#: Overrides :data:`PREFETCH_BLOCKS` (a whole number >= 1), read when a decoder with ``prefetch`` misses is built.
PREFETCH_BLOCKS_ENV = "STRATATOOLS_PREFETCH_BLOCKS"


def prefetch_blocks() -> int:
    """Blocks of the prefetch's ``fetch_blobs`` launch: :data:`PREFETCH_BLOCKS_ENV`, default :data:`PREFETCH_BLOCKS`.
    Raises StrataError for a value that is not a whole number (ASCII digits) of at least 1."""
    return env_count(PREFETCH_BLOCKS_ENV, PREFETCH_BLOCKS, 1, "blocks")


def fetch_grid(k: int, blob_bytes: int, n_sm: int) -> int:
    """Blocks per job of a ``fetch_blobs`` launch: enough for about 4 blocks per SM when all ``k`` jobs miss, no
    more than the blob has parts of FETCH_THREADS x 4 loads of 16 bytes."""
    per_block = 16 * FETCH_THREADS * 4
    return max(1, min(max(1, 4 * max(1, n_sm) // max(1, k)), -(-int(blob_bytes) // per_block)))


#: How the fast step's CUDA graph is cut into pieces replayed one after another (``auto``, the default: cuts before
#: layers 2, 8 and 24, scaled to the model's depth; ``1``: one graph; or a comma list of the layers that start a
#: piece). Launching a graph costs host time that grows with its nodes (about 1.4 ms for the 48-layer step on the
#: H200, while the device waits: bench/gpu-notes.md, eighth pass); with a small first piece the device starts after
#: that piece's launch, and each later piece is launched while the earlier ones run. A cut waits for the prefetch of
#: its layer (``prefetch`` misses) before that layer's attention instead of before its experts, so the copy overlaps
#: less at the cuts. ``1,`` (trailing comma) is a single cut before layer 1.
GRAPH_PARTS_ENV = "STRATATOOLS_GRAPH_PARTS"


def graph_cuts(n_layer: int, spec: str | None = None) -> list[int]:
    """The layers that start a new graph piece of the fused step (sorted, each in 1..n_layer-1), from ``spec`` (default:
    :data:`GRAPH_PARTS_ENV`, else ``auto``): ``auto`` cuts at about n_layer/24, n_layer/6 and n_layer/2 (2, 8, 24 for
    48 layers: pieces of 2, 6, 16 and 24 layers, each launched while the ones before it run), ``1`` none, or a comma
    list of layers. Raises StrataError for another value or a layer outside 1..n_layer-1."""
    v = (os.environ.get(GRAPH_PARTS_ENV, "") if spec is None else spec).strip() or "auto"
    n = int(n_layer)
    if v == "auto":
        return sorted({c for c in (max(1, round(n / 24)), round(n / 6), n // 2) if 0 < c < n})
    if v == "1":
        return []
    try:
        cuts = sorted({int(x) for x in v.split(",") if x.strip()})
    except ValueError:
        cuts = [-1]
    if not cuts or any(not 0 < c < n for c in cuts):
        where = f"a comma list of layers from 1 to {n - 1} where a new graph piece starts" if n > 1 else \
            "nothing else (a model of one layer has no cut)"
        raise StrataError(f"{GRAPH_PARTS_ENV}={v!r}: use auto, 1, or {where}")
    return cuts


#: Marks a layer's prefetch event already waited for (at a graph cut): its fetch uses the prefetched copies.
_JOINED = object()


class StaticDecoder:
    """One-token decode steps over static buffers; on CuPy optionally replayed from a CUDA graph.

    Args:
        rt: a :class:`stratatools.runtime.gpu.runtime.GPURuntime` (CuPy) or :class:`stratatools.runtime.model.Qwen4ExpRuntime` (numpy).
        max_ctx: positions the K/V caches hold (prompt + generated), at most the model's context length; past
            :func:`max_full_context` the step runs QSA's indexer and selection (``self.long``).
        fast: on CuPy, the optimised step (default): dense matrices through ``matvec_tiled_kernel`` (16-byte staged
            loads, grid-stride rows), RMS norms, hyper-connection mixing/inject and the router (probabilities, top-k,
            weight normalisation) as fused kernels. ``fast=False`` keeps the reference step (one warp per row
            byte-load matvec, CuPy element-wise ops); the two agree to float rounding (tests/test_gpu_decode.py).
            Ignored on numpy.
        fused: with ``fast``, the per-layer chains as single kernels of ``fused_step.cu`` (compiled with multiply-add
            fusion): the gated-DeltaNet step (``gdn_conv``: conv + SiLU + state shift + beta/decay; ``gdn_recur``:
            L2 norms, delta-rule update, output read, gated RMS norm, each head's columns over several blocks), the
            PLE block, the hyper-connection inject fused with the next RMS norm, SiLU of the mix applied while the
            up-projection stages its input, the router with the shared expert's gate (its row stacked under the
            router's; f32 matvec one block per row; top-k by one warp), experts through the staged-row kernels
            (``moe_staged.cu``, :func:`stratatools.runtime.gpu.experts.expert_ffn` ``fast``). Agrees with the
            reference step by tolerance (tests/test_gpu_decode.py; bench/bench_gpu_run.py on the full-width model).
            ``fused=False`` keeps the earlier fast step (for comparisons).
    Raises:
        StrataError: ``max_ctx`` beyond the model's context length; an indexer with more than one key head or
            wider than :data:`QSA_MAX_DIM` (long contexts); on CuPy, a partial tier whose host arena is not mapped
            into the device, or an expert width that is not whole blocks.
    """

    #: set by :meth:`_stage_from_device`: the device holds a newer PLE context than the host (see :attr:`ple_ctx`)
    _ple_ctx_on_device = False
    #: set by :meth:`set_device_token`, cleared when the host's PLE context moves: ``step(None)`` may stage on the device
    _dev_token_live = False

    def __init__(self, rt: Any, max_ctx: int = 512, fast: bool = True, fused: bool = True):
        self.rt, self.w, self.cfg, self.xp = rt, rt.w, rt.cfg, rt.xp
        cfg = self.cfg
        self.gpu = getattr(self.xp, "__name__", "") == "cupy"
        self.fast = bool(fast) and self.gpu
        self.fused = bool(fused) and self.fast
        n_ctx_model = model_context_length(rt.w.model)
        if n_ctx_model is not None and max_ctx > n_ctx_model:
            raise StrataError(f"max_ctx {max_ctx} is over the model's context length {n_ctx_model}")
        self.max_ctx = int(max_ctx)
        # past the full-selection range the step runs the indexer and attends the selected cells (_qsa); below it,
        # QSA attends every cell and the indexer is skipped
        self.long = max_ctx > max_full_context(cfg, rt.selection)
        xp = self.xp
        n, hc = cfg.n_embd, cfg.hc_count
        self.k = cfg.n_expert_used
        L = cfg.n_layer
        # per-step host inputs: [pos (int32 bits) | x0 (n) | PLE rows per PLE layer | cos | sin]
        self._ple_w = {}
        off = 1
        self._x_sl = (off, off + n)
        off += n
        self._ple_sl = {}
        for il in cfg.ple_layers:
            t = self.w.model.tensor("per_layer_token_embd.weight")
            width = int(t.ne[0]) * cfg.ple_heads_per_ngram * (cfg.ple_ngram - 1)
            self._ple_sl[il] = (off, off + width)
            off += width
        self._cos_sl = (off, off + cfg.n_rot)
        off += cfg.n_rot
        self._sin_sl = (off, off + cfg.n_rot)
        off += cfg.n_rot
        # long contexts: per QSA compress ratio r, cos | sin at the start of the block that pos+1 completes
        self._bcs_sl: dict[int, tuple[int, int]] = {}
        if self.long:
            for r in sorted({cfg.compress_ratios[il] for il in range(L) if self._qsa_layer(il)}):
                self._bcs_sl[r] = (off, off + 2 * cfg.n_rot)
                off += 2 * cfg.n_rot
        self.n_in = off
        if self.gpu:
            import cupyx

            self.stage = cupyx.empty_pinned(self.n_in, dtype=np.float32)
        else:
            self.stage = np.zeros(self.n_in, dtype=np.float32)
        self.inp = xp.zeros(self.n_in, dtype=xp.float32)
        self.pos_dev = self.inp[:1].view(xp.int32)
        # state
        self.conv, self.ssm, self.kc, self.vc, self.ple_conv = {}, {}, {}, {}, {}
        for il in range(L):
            if cfg.recurrent[il]:
                C, K = self.w.get(f"blk.{il}.ssm_conv1d.weight").shape
                self.conv[il] = xp.zeros((K - 1, C), dtype=xp.float32)
                self.ssm[il] = xp.zeros((cfg.ssm_dt_rank, cfg.ssm_d_state, cfg.ssm_head_v_dim), dtype=xp.float32)
            else:
                self.kc[il] = xp.zeros((self.max_ctx, cfg.n_head_kv, cfg.head_dim), dtype=xp.float32)
                self.vc[il] = xp.zeros((self.max_ctx, cfg.n_head_kv, cfg.head_dim), dtype=xp.float32)
        for il in cfg.ple_layers:
            span = (cfg.ple_conv_kernel - 1) * cfg.ple_ngram
            self.ple_conv[il] = xp.zeros((span, hc * n), dtype=xp.float32)
        # QSA indexer caches (long contexts): raw keys [max_ctx, idx_dim], pooled block keys [max_ctx // ratio, idx_dim]
        self.ik, self.bk = {}, {}
        if self.long:
            dih = cfg.idx_head_dim
            if not 0 < dih <= QSA_MAX_DIM:
                raise StrataError(f"indexer key length {dih} is outside 1..{QSA_MAX_DIM}, what the device indexer handles")
            for il in range(L):
                if self._qsa_layer(il):
                    kw = self.w.model.tensor(f"blk.{il}.indexer.k_proj.weight")
                    if int(kw.ne[1]) != dih:
                        raise StrataError(f"layer {il}: the indexer has {int(kw.ne[1]) // dih} key heads; the runtime "
                                          f"supports one")
                    self.ik[il] = xp.zeros((self.max_ctx, dih), dtype=xp.float32)
                    self.bk[il] = xp.zeros((self.max_ctx // cfg.compress_ratios[il] + 1, dih), dtype=xp.float32)
        if self.gpu:
            # the step's outputs the host reads (next token int64, ids [L, k] int32, weights [L, k] float32) live in
            # one device buffer, copied back with one asynchronous copy per step into pinned memory
            import cupyx

            nb = 8 + 8 * L * self.k
            self._out = xp.zeros(nb, dtype=xp.uint8)
            self._tok_dev = self._out[:8].view(xp.int64)
            self.ids = self._out[8:8 + 4 * L * self.k].view(xp.int32).reshape(L, self.k)
            self.weights = self._out[8 + 4 * L * self.k:].view(xp.float32).reshape(L, self.k)
            # two pinned copies used in turn, so that a queued step's copy-back does not overwrite the outputs of the
            # step before it while the host still reads them (DecoderRuntime's queued decode)
            self._out_ring = [cupyx.empty_pinned(nb, dtype=np.uint8) for _ in range(2)]
            self._out_host = self._out_ring[0]
            self._out_event = None
        else:
            self.ids = xp.zeros((L, self.k), dtype=xp.int32)
            self.weights = xp.zeros((L, self.k), dtype=xp.float32)
        self.logits = None
        self.next_token_dev = None
        self.pos = 0
        self.ple_ctx = np.full(max(cfg.ple_ngram - 1, 0), cfg.eos_id, dtype=np.int64)
        # read_step: (pinned copy, event) of the step before the last (CuPy); the last two steps' outputs (numpy);
        # the steps since load_state, so that a step of an earlier sequence is never read
        self._prev_out = self._prev_np = self._last_np = None
        self._seq_steps = 0
        self.graph = None
        self.graphs: list = []  # the captured pieces of the step, replayed in order (graph: the first)
        self._cut_at: set[int] = set()  # layers where capture() starts a new piece (empty outside a capture)
        self._pieces: list = []
        self._pool = None
        self._stream = None
        self._dstage: Any = None  # device staging (_stage_from_device), made when first used
        self.stats = {"steps": 0, "graph_steps": 0}
        if self.gpu:
            self._init_gpu()

    # -- GPU resources ------------------------------------------------------------------------------
    def _fn(self, mod: Any, name: str) -> Any:
        """Kernel ``name`` of CuPy module ``mod``, launched by programmatic dependent launch inside the step's
        graphs when this decoder's ``pdl`` is on (:func:`stratatools.runtime.gpu.launch.pdl`)."""
        return pdl(mod.get_function(name), name, getattr(self, "pdl", False))

    def _route_sg(self, E: int, args: tuple) -> None:
        """Route one token from its stacked router logits (``args``: route_fused_sg's): with ``route_warp``
        (:data:`ROUTE_WARP_ENV`) ``route_warp_sg8`` / ``route_warp_sg16`` (one warp, the probabilities in registers)
        for at most 256 / :data:`ROUTE_WARP_MAX` experts, else ``route_fused_sg`` (one block of roundup32(E) threads,
        E floats of shared memory). All give the same ids and weights bit for bit."""
        if self.route_warp and E <= ROUTE_WARP_MAX:
            (self.k_route_w8 if E <= 256 else self.k_route_w16)((1,), (32,), args)
        else:
            self.k_route_sg((1,), (min(1024, max(32, (E + 31) // 32 * 32)),), args, shared_mem=E * 4)

    def _init_gpu(self) -> None:
        import cupy as cp

        from stratatools.runtime.gpu.experts import ExpertJobs, _check_type

        rt, cfg = self.rt, self.cfg
        self.cp = cp
        # STRATATOOLS_PDL, read once (a captured graph and its eager steps agree); sm_90 and later only
        self.pdl = pdl_enabled() and pdl_supported(cp.cuda.Device().compute_capability)
        self._stream = cp.cuda.Stream(non_blocking=True)
        self.mod = cp.RawModule(code=cuda_unit("decode_step.cu"), options=("--std=c++17",))
        self.k_topk = self._fn(self.mod, "route_topk")
        self.k_put = self._fn(self.mod, "put_row")
        self.k_rms = self._fn(self.mod, "rmsnorm_rows")
        self.k_silu_div = self._fn(self.mod, "silu_div")
        self.k_hc_mix = self._fn(self.mod, "hc_mix")
        self.k_hc_inject = self._fn(self.mod, "hc_inject")
        self.k_dot_sig = self._fn(self.mod, "dot_sigmoid")
        self.k_route = self._fn(self.mod, "route_fused")
        self.k_route_sg = self._fn(self.mod, "route_fused_sg")
        self.k_route_w8 = self._fn(self.mod, "route_warp_sg8")
        self.k_route_w16 = self._fn(self.mod, "route_warp_sg16")
        self.route_warp = route_warp()  # ROUTE_WARP_ENV, read once
        if self.fused:
            self.fmod = cp.RawModule(code=cuda_unit("fused_step.cu"), options=("--std=c++17",))
            self.k_gdn_conv = self._fn(self.fmod, "gdn_conv")
            self.k_gdn_recur = self._fn(self.fmod, "gdn_recur")
            self.k_ple = self._fn(self.fmod, "ple_fused")
            self.k_inject_rms = self._fn(self.fmod, "hc_inject_rms")
            self.k_mv_f32 = self._fn(self.fmod, "matvec_f32_rows")
            self.amod = cp.RawModule(code=cuda_unit("attn_step.cu"), options=("--std=c++17",))
            self.k_attn_prep = self._fn(self.amod, "attn_prep")
            self.k_gate_mul = self._fn(self.amod, "attn_gate_mul")
        # fused step: Q8_0 matrices re-laid out at load time for dense_q8.cu's matvec (row parts: scratch + counters)
        self.dense_q8 = self.fused and dense_q8_enabled()
        if self.dense_q8:
            self.dqmod = cp.RawModule(code=cuda_unit("dense_q8.cu"), options=("--std=c++17",))
            self.k_dq = self._fn(self.dqmod, "mv_q8r")
            self.k_dq_mix = self._fn(self.dqmod, "mv_q8r_mix")
            # STRATATOOLS_DENSE_KERNEL: int8 (mv_q8i, the default: int8 dot products, its own launch shape), stream
            # (mv_q8s in its place: float dot products) or rows (mv_q8r / mv_q8r_mix only)
            choice = dense_kernel()
            self.dense_int8 = choice == "int8"
            self.k_dqs = self._fn(self.dqmod, "mv_q8i" if self.dense_int8 else "mv_q8s")
            self.dense_stream = choice in ("stream", "int8")
            self._dq_part = cp.zeros(0, dtype=cp.float32)
            self._dq_counter = cp.zeros(4096, dtype=cp.int32)
        self._gdn_counter = None
        tier = rt.tier
        L = cfg.n_layer
        # every expert's blob address: its VRAM slot, or (a miss) its place in the mapped pinned host arena; the
        # router kernels read it from this device table, re-uploaded between steps when the tier moved experts
        self.slot = cp.asarray(tier.slot_table())
        self._slot_version = tier.version
        self._slot_host, self._slot_ev, self._slot_i = None, [None, None], 0
        self._wait_next: list[Any] = []
        self.ptrs = cp.zeros((L, 3, self.k), dtype=cp.uint64)
        self.tok0 = cp.zeros(self.k, dtype=cp.int32)
        self.tstart = cp.asarray(np.array([0, self.k], dtype=np.int32))
        ly0 = tier.arena.layers[0]
        self.hbuf = cp.empty(self.k * max(ly.ff for ly in tier.arena.layers), dtype=cp.float32)
        self.shared_tok = cp.zeros(1, dtype=cp.int32)
        self.shared_tstart = cp.asarray(np.array([0, 1], dtype=np.int32))
        # the fused step's shared expert on a stream of its own, beside the routed gate/up (SHARED_SIDE_ENV)
        self._shared_side = cp.cuda.Stream(non_blocking=True) if self.fused and shared_side() else None
        self.hbuf_shared = None
        if self._shared_side is not None:  # its own gate/up scratch: the routed gate/up fills hbuf meanwhile
            m = self.rt.w.model
            self.hbuf_shared = cp.empty(max(int(m.tensor(f"blk.{il}.ffn_gate_shexp.weight").ne[1])
                                            for il in range(cfg.n_layer)), dtype=cp.float32)
        # expert kernels of the fused step (experts.decoder_expert_kernels: $STRATATOOLS_MOE_KERNEL, else pipelined
        # for the shared expert and for the routed ones when every blob is read from device memory); a call whose
        # types have no pipelined kernels (IQ2_XS, IQ4_NL, ...) runs on the staged ones (experts.expert_kernel_path)
        from stratatools.runtime.gpu.experts import decoder_expert_kernels

        # missed experts: read where they are (zero-copy) or fetched into device staging first (MISS_FETCH_ENV)
        self.miss_fetch = "zero-copy"
        partial = getattr(tier.policy, "policy", None) != "all-resident"
        if self.fused and partial and tier.arena.device_ptr is not None:
            self.miss_fetch = miss_fetch_mode()
        if self.miss_fetch != "zero-copy":
            self._init_fetch(tier)
        # every routed blob read from device memory: all resident, or misses fetched into device staging
        self.kernels_routed, self.kernels_shared = decoder_expert_kernels(
            not partial or self.miss_fetch != "zero-copy")
        from stratatools.runtime.gpu.experts import moe_int8

        # the pipelined kernels' integer mode, read once: a captured graph and the eager steps run the same kernels
        self.moe_int8 = moe_int8()
        for ly in tier.arena.layers:
            _check_type(ly.gu_type, ly.hidden, "expert gate/up")
            _check_type(ly.d_type, ly.ff, "expert down")
        del ly0, ExpertJobs
        self._raw: dict[str, tuple[Any, Any, int, int]] = {}
        self._f32_cache: dict[str, Any] = {}
        self._raw_groups: dict[tuple, tuple[Any, list[int]]] = {}
        self._init_split_attention()
        if self.long:
            self._init_qsa()

    def _init_fetch(self, tier: Any) -> None:
        """Kernel and buffers of the miss fetch (:data:`MISS_FETCH_ENV`): the relocated job addresses ``fptrs``
        [L, 3, k], the staging of the layer being computed (k blob entries), the device counters (late fetch: bytes,
        jobs, jobs served by a prefetched copy; prefetch: bytes, jobs, -), and for ``prefetch`` the side stream and
        its buffers by layer parity (input copy, router logits, predicted ids / weights / addresses, staging)."""
        from stratatools.runtime.gpu.kernels import _device_limits

        cp, cfg, k, L = self.cp, self.cfg, self.k, self.cfg.n_layer
        self.fmfmod = cp.RawModule(code=cuda_source("miss_fetch.cu"), options=("--std=c++17",))
        self.k_fetch = self.fmfmod.get_function("fetch_blobs")
        self._fetch_sb = int(np.max(tier.slot_bytes))
        self._host_lo = int(tier.arena.device_ptr)
        self._host_hi = self._host_lo + int(tier.arena.host.nbytes)
        n_sm = _device_limits()[0]
        self._fetch_gx = [fetch_grid(k, ly.blob_bytes, n_sm) for ly in tier.arena.layers]
        self.fptrs = cp.zeros((L, 3, k), dtype=cp.uint64)
        self.fetch_stage = cp.empty(fetch_staging_bytes("fetch", k, self._fetch_sb), dtype=cp.uint8)
        self.fetch_counters = cp.zeros(6, dtype=cp.uint64)
        self._pf_events: dict[int, Any] = {}
        if self.miss_fetch == "prefetch":
            Emax = max(ly.n_expert for ly in tier.arena.layers)
            kp = self.pf_k = prefetch_width(k, min(ly.n_expert for ly in tier.arena.layers))
            self.pf_x = cp.zeros((2, cfg.n_embd), dtype=cp.float32)
            self.pf_logits = cp.zeros((2, Emax + 1), dtype=cp.float32)
            self.pf_ids = cp.zeros((2, kp), dtype=cp.int32)
            self.pf_w = cp.zeros((2, kp), dtype=cp.float32)
            self.pf_ptrs = cp.zeros((2, 3, kp), dtype=cp.uint64)
            self.pf_addr = cp.zeros((2, 3, kp), dtype=cp.uint64)
            self.pf_sg = cp.zeros(2, dtype=cp.float32)
            self.pf_stage = cp.empty(2 * kp * self._fetch_sb, dtype=cp.uint8)
            self._pf_stream = cp.cuda.Stream(non_blocking=True)
            self._pf_blocks = prefetch_blocks()
            self._pf_order = prefetch_order()

    def _router_stack(self, il: int) -> Any:
        """Layer ``il``'s float32 router with the shared expert's gate row stacked under it, as :meth:`mv_many`
        builds and keeps it (created here when the prediction needs it first), or None when the two are not
        stacked that way (another type or width)."""
        names = [f"blk.{il}.ffn_gate_inp.weight", f"blk.{il}.ffn_gate_inp_shexp.weight"]
        got = self._group_buffer(names)
        if got is None or got[2] != 0 or self._raw_groups[tuple(names)][1][1] != 1:
            return None
        return got

    def _prefetch_next(self, il: int, X: Any) -> None:
        """``prefetch`` mode, at the start of layer ``il``'s experts (or of its token mixer: :data:`PREFETCH_ORDER_ENV`
        ``mixer``): on the side stream, after the work queued so far, layer il+1's router on X (this layer's expert
        input, or the mixer's), its top :func:`prefetch_width` through
        ``route_fused_sg`` (layer il+1's slot table) and ``fetch_blobs`` of the predicted misses into the parity's
        staging on :func:`prefetch_blocks` blocks (beside the main stream's work); the event that layer il+1's fetch
        waits for is kept in ``_pf_events``."""
        nxt = self._router_stack(il + 1)
        if nxt is None:
            return
        raw, rows, _tid, cols = nxt
        cp, cfg, k = self.cp, self.cfg, self.pf_k
        p = (il + 1) & 1
        ly = self.rt.tier.arena.layers[il + 1]
        E = rows - 1
        main = cp.cuda.get_current_stream()
        self.pf_x[p, :cols] = X.reshape(-1)[:cols]
        side = self._pf_stream
        fork = cp.cuda.Event(disable_timing=True)  # fork / join events of the capture: no timing
        fork.record(main)
        side.wait_event(fork)
        with side:
            self.k_mv_f32((min(rows, 4096),), (256,), (raw, self.pf_x[p], self.pf_logits[p], np.int32(rows),
                                                      np.int32(cols)))
            self._route_sg(E, (self.pf_logits[p], np.int32(E), np.int32(k), np.int32(cfg.gating == "sigmoid"),
                               np.int32(bool(cfg.norm_topk)), np.float32(cfg.expert_weights_scale),
                               self.slot[il + 1], np.uint64(ly.gate_bytes), self.pf_ids[p], self.pf_w[p],
                               self.pf_ptrs[p, 0], self.pf_ptrs[p, 1], self.pf_ptrs[p, 2], self.pf_sg[p:p + 1]))
            st = self.pf_stage[p * k * self._fetch_sb:(p + 1) * k * self._fetch_sb]
            self.k_fetch((max(1, min(self._fetch_gx[il + 1], self._pf_blocks // k)), k), (FETCH_THREADS,),
                         (self.pf_ptrs[p, 0], self.pf_ids[p], np.int32(k), np.uint64(self._host_lo),
                          np.uint64(self._host_hi), np.uint64(0), np.uint64(0), np.int32(0), st,
                          np.int64(self._fetch_sb), np.int64(ly.blob_bytes), np.int64(ly.gate_bytes),
                          self.pf_addr[p, 0], self.pf_addr[p, 1], self.pf_addr[p, 2], self.fetch_counters[3:]))
            join = cp.cuda.Event(disable_timing=True)
            join.record(side)
            self._pf_events[il + 1] = join

    def _fetch_layer(self, il: int, pt: Any) -> Any:
        """``fetch`` / ``prefetch`` modes, after layer ``il``'s routing: ``fetch_blobs`` relocates the routed jobs'
        addresses ``pt`` [3, k] into ``fptrs[il]``: resident experts unchanged, predicted misses to their prefetched
        copies (after the side stream's event), other misses copied into the staging now. Returns ``fptrs[il]``."""
        cp, k = self.cp, self.k
        ly = self.rt.tier.arena.layers[il]
        fp = self.fptrs[il]
        pf_ids, pf_addr, n_pf = np.uint64(0), np.uint64(0), 0
        ev = self._pf_events.pop(il, None)
        if ev is not None:
            if ev is not _JOINED:
                cp.cuda.get_current_stream().wait_event(ev)
            p = il & 1
            pf_ids, pf_addr, n_pf = self.pf_ids[p], self.pf_addr[p, 0], self.pf_k
        self.k_fetch((self._fetch_gx[il], k), (FETCH_THREADS,),
                     (pt[0], self.ids[il], np.int32(k), np.uint64(self._host_lo), np.uint64(self._host_hi), pf_ids,
                      pf_addr, np.int32(n_pf), self.fetch_stage, np.int64(self._fetch_sb), np.int64(ly.blob_bytes),
                      np.int64(ly.gate_bytes), fp[0], fp[1], fp[2], self.fetch_counters[:3]))
        return fp

    def fetch_stats(self) -> dict[str, Any]:
        """Counters of the miss fetch since the decoder was built (or captured): ``mode``; with a fetch mode also
        ``fetched_bytes`` / ``fetched_jobs`` (copied after the routing), ``prefetched_bytes`` / ``prefetched_jobs``
        (copied ahead on the prediction, used or not) and ``prefetch_used_jobs`` (misses served by a prefetched copy).
        Waits for the device."""
        out: dict[str, Any] = {"mode": getattr(self, "miss_fetch", "zero-copy")}
        if out["mode"] == "zero-copy":
            return out
        self._stream.synchronize()
        c = [int(v) for v in self.fetch_counters.get(stream=self._stream)]
        out.update(fetched_bytes=c[0], fetched_jobs=c[1], prefetch_used_jobs=c[2], prefetched_bytes=c[3],
                   prefetched_jobs=c[4], prefetch_width=getattr(self, "pf_k", 0))
        return out

    def _init_split_attention(self) -> None:
        """The split attention of every CuPy step (qsa_step.cu's ``attn_sel_partial`` over :data:`ATTN_SPLITS`
        parts a head, ``attn_sel_combine``) and its scratch (:func:`split_attention_bytes`)."""
        cp, cfg, mc = self.cp, self.cfg, self.max_ctx
        self.qmod = cp.RawModule(code=cuda_unit("qsa_step.cu"), options=("--std=c++17",))
        self.k_attn_part = self._fn(self.qmod, "attn_sel_partial")
        self.k_attn_comb = self._fn(self.qmod, "attn_sel_combine")
        self.att_sc = cp.zeros(cfg.n_head * mc, dtype=cp.float32)
        self.att_part = cp.zeros(cfg.n_head * ATTN_SPLITS * (cfg.head_dim + 2), dtype=cp.float32)

    def _split_attention(self, il: int, q: Any, o: Any, selected: bool) -> None:
        """``o`` [nh, hd] = attention of the step's query ``q`` [nh, hd] over layer ``il``'s cached positions (all of
        them, or with ``selected`` the cells QSA selected: ``q_cells``), split into :data:`ATTN_SPLITS` parts a head
        and combined."""
        cp, cfg = self.cp, self.cfg
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        cells, ncell = (self.q_cells, self.q_ncell) if selected else (self.pos_dev, self.pos_dev)  # unread when all
        self.k_attn_part((nh, ATTN_SPLITS), (128,), (cp.ascontiguousarray(q), self.kc[il], self.vc[il], cells, ncell,
                                                     np.int32(bool(selected)), self.pos_dev, self.att_sc,
                                                     self.att_part, np.int32(nh), np.int32(nkv), np.int32(hd),
                                                     np.float32(hd ** -0.5), np.int32(self.max_ctx)))
        self.k_attn_comb((nh,), (min(hd, 1024),), (self.att_part, o, np.int32(ATTN_SPLITS), np.int32(hd)))

    def _init_qsa(self) -> None:
        """Kernels and scratch of the device QSA path (qsa_step.cu), shared by the attention layers (they run one
        after another on the decoder's stream)."""
        cp, mc = self.cp, self.max_ctx
        self.k_qsa_pool = self._fn(self.qmod, "qsa_pool")
        self.k_qsa_scores = self._fn(self.qmod, "qsa_scores")
        self.k_qsa_select = self._fn(self.qmod, "qsa_select")
        self.q_scores = cp.zeros(mc + 1, dtype=cp.float32)
        self.q_flags = cp.zeros(mc + 1, dtype=cp.int32)
        self.q_pairs = cp.zeros(2 * (mc + 1), dtype=cp.int32)  # (value, index) pairs of the tie replay
        self.q_cells = cp.zeros(mc + 1, dtype=cp.int32)
        self.q_ncell = cp.zeros(1, dtype=cp.int32)

    def _dense_raw(self, name: str):
        """(device bytes, type, rows, cols) of a matrix for the quantized matvec, or None when it cannot run."""
        got = self._raw.get(name)
        if got is None:
            from stratatools.runtime.gpu.experts import MAX_SHARED_FLOATS
            from stratatools.runtime.gpu.kernels import UNIT

            t = self.w.model.tensor(name)
            cols = int(t.ne[0])
            rows = 1
            for d in t.ne[1:]:
                rows *= int(d)
            if self._q8r_ok(t.type.id, cols):
                got = (Q8R(self.cp, np.asarray(self.w.model.raw(t)), rows, cols), t.type, rows, cols)
            elif t.type.id in UNIT and cols % UNIT[t.type.id][0] == 0 and cols <= MAX_SHARED_FLOATS:
                got = (self.cp.asarray(np.ascontiguousarray(np.asarray(self.w.model.raw(t)))).reshape(-1), t.type, rows, cols)
            else:
                got = (None, t.type, rows, cols)
            self._raw[name] = got
        return got

    def _q8r_ok(self, type_id: int, cols: int) -> bool:
        """Is a matrix of this type and row width multiplied through :class:`Q8R` (fused step, Q8_0, whole blocks,
        x and mv_q8r's own 16 bytes within the default 48 KiB of shared memory)?"""
        return (bool(getattr(self, "dense_q8", False)) and type_id == 8 and cols % 32 == 0
                and 4 * cols + 64 <= 48 * 1024)

    def _dq_launch(self, m: Q8R, x: Any, y: Any, rows: int, cols: int, silu_div: float = 0.0) -> None:
        """``y = W x`` (or ``W silu(x / silu_div)``) for a :class:`Q8R` matrix: ``mv_q8i`` (``mv_q8s`` with
        ``STRATATOOLS_DENSE_KERNEL=stream``) for matrices of at least
        :func:`~stratatools.runtime.gpu.kernels.dense_min_rows_per_sm` rows per SM (unless
        ``STRATATOOLS_DENSE_KERNEL=rows``), else ``mv_q8r`` (split along the rows when they are few)."""
        from stratatools.runtime.gpu.kernels import DQ_THREADS, _device_limits, dense_min_rows_per_sm, dq_launch_shape

        cp = self.cp
        n_sm = _device_limits()[0]
        if self.dense_stream and rows >= dense_min_rows_per_sm() * n_sm:
            blocks, lpr, u, shm = self._dqs_shape(rows, cols, n_sm)
            self.k_dqs((blocks,), (DQ_THREADS,), (m.q, m.d, x, y, np.int32(rows), np.int32(cols), np.float32(silu_div),
                                                 np.int32(lpr), np.int32(u), np.uint64(0), np.int32(0), np.int32(0)),
                       shared_mem=shm)
            return
        gx, ks, shm = dq_launch_shape(rows, cols, n_sm)
        if ks > 1:
            if gx > int(self._dq_counter.size):
                raise StrataError(f"{rows} x {cols} matrix: {gx} row groups, more than the matvec's counters")
            if int(self._dq_part.size) < ks * rows:  # grows before the capture (the eager run meets every matrix)
                self._dq_part = cp.zeros(ks * rows, dtype=cp.float32)
        self.k_dq((gx, ks), (DQ_THREADS,), (m.q, m.d, x, y, np.int32(rows), np.int32(cols), np.float32(silu_div),
                                            self._dq_part, self._dq_counter), shared_mem=shm)

    def _dqs_shape(self, nout: int, cols: int, n_sm: int, hc: int = 0) -> tuple[int, int, int, int]:
        """Launch shape of ``self.k_dqs``: :func:`~stratatools.runtime.gpu.kernels.dqi_launch_shape` for ``mv_q8i``,
        else :func:`~stratatools.runtime.gpu.kernels.dqs_launch_shape`."""
        from stratatools.runtime.gpu.kernels import dqi_launch_shape, dqs_launch_shape

        return (dqi_launch_shape if self.dense_int8 else dqs_launch_shape)(nout, cols, n_sm, hc=hc)

    @contextlib.contextmanager
    def _ordered(self) -> Iterator[None]:
        """Run the enclosed device work on the decoder's stream, ordered after the caller's stream's earlier work
        and before its later work (events, no host wait)."""
        if not self.gpu:
            yield
            return
        cur = self.cp.cuda.get_current_stream()
        s = self._stream
        s.wait_event(cur.record())
        with s:
            yield
        cur.wait_event(s.record())

    # -- array helpers --------------------------------------------------------------------------------
    def mv(self, name: str, x: Any) -> Any:
        """``W x`` for the matrix ``name`` (numpy (out, in)) and a 1-D float32 ``x``."""
        if self.gpu:  # cuBLAS cannot be captured by CuPy (seen on the H200), so every matrix goes through the kernel
            raw, t, rows, cols = self._dense_raw(name)
            if raw is not None:
                from stratatools.runtime.gpu.experts import THREADS, WARPS_PER_BLOCK
                from stratatools.runtime.gpu.kernels import kernel

                x = self.cp.ascontiguousarray(x, dtype=self.cp.float32)
                y = self.cp.empty(rows, dtype=self.cp.float32)
                if isinstance(raw, Q8R) or (self.fast and int(raw.data.ptr) % 16 == 0):
                    self._launch_mv(raw, x, y, t.id, rows, cols)
                    return y
                grid = ((rows + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK,)
                kernel("matvec_kernel", t.id)(grid, (THREADS,), (raw, x, y, np.int32(rows), np.int32(cols)),
                                              shared_mem=cols * 4)
                return y
        W = self.w.get(name)
        return (W.reshape(W.shape[0], -1) @ x.reshape(-1)).astype(self.xp.float32, copy=False)

    def mv_many(self, names: list[str], x: Any) -> list[Any]:
        """``[W x for W in names]`` for matrices that share the input ``x``. On the fast path, matrices of one
        type and width are multiplied in one launch: their rows are stacked at load time into one device buffer
        (row-major blocks, so stacking is concatenation; no copy kept per matrix) and the results are views of
        one output. Each row is computed exactly as :meth:`mv` computes it."""
        if not self.fast:
            return [self.mv(n, x) for n in names]
        from stratatools.runtime.gpu.experts import MAX_SHARED_FLOATS
        from stratatools.runtime.gpu.kernels import UNIT

        cp = self.cp
        m = self.w.model
        groups: dict[tuple[int, int], list[int]] = {}
        for i, n in enumerate(names):
            t = m.tensor(n)
            cols = int(t.ne[0])
            if t.type.id in UNIT and cols % UNIT[t.type.id][0] == 0 and cols <= MAX_SHARED_FLOATS and n not in self._raw:
                groups.setdefault((t.type.id, cols), []).append(i)
        out: list[Any] = [None] * len(names)
        for (tid, cols), idx in groups.items():
            if len(idx) < 2:
                continue
            key = tuple(names[i] for i in idx)
            self._group_buffer(list(key))
            raw, rows = self._raw_groups[key]
            xx = cp.ascontiguousarray(x, dtype=cp.float32)
            y = cp.empty(sum(rows), dtype=cp.float32)
            self._launch_mv(raw, xx, y, tid, sum(rows), cols)
            o = 0
            for i, r in zip(idx, rows):
                out[i] = y[o:o + r]
                o += r
        for i, n in enumerate(names):
            if out[i] is None:
                out[i] = self.mv(n, x)
        return out

    def _group_buffer(self, names: list[str]) -> tuple[Any, int, int, int] | None:
        """The stacked device buffer of the matrices ``names`` (all of one type and row width, each multiplied by the
        fast path's kernels: :meth:`mv_many`'s condition), built at first use and kept in ``_raw_groups``, as
        (buffer, rows in all, type id, cols); None when they cannot be stacked."""
        from stratatools.runtime.gpu.experts import MAX_SHARED_FLOATS
        from stratatools.runtime.gpu.kernels import UNIT

        key = tuple(names)
        m = self.w.model
        got = self._raw_groups.get(key)
        metas = []
        for n in names:
            t = m.tensor(n)
            cols = int(t.ne[0])
            rows = 1
            for d in t.ne[1:]:
                rows *= int(d)
            metas.append((t, rows, cols))
        tid, cols = metas[0][0].type.id, metas[0][2]
        if got is None:
            if len(names) < 2 or any(t.type.id != tid or c != cols or n in self._raw
                                     for (t, _r, c), n in zip(metas, names)):
                return None
            if tid not in UNIT or cols % UNIT[tid][0] or cols > MAX_SHARED_FLOATS:
                return None
            host = np.concatenate([np.asarray(m.raw(t)).reshape(-1) for t, _r, _c in metas])
            nrow = [r for _t, r, _c in metas]
            got = (Q8R(self.cp, host, sum(nrow), cols) if self._q8r_ok(tid, cols) else self.cp.asarray(host), nrow)
            self._raw_groups[key] = got
        return got[0], int(sum(got[1])), int(tid), int(cols)

    def _launch_mv(self, raw: Any, x: Any, y: Any, type_id: int, rows: int, cols: int) -> None:
        """``y = W x`` on the fast path: float32 matrices (the router) through the fused step's ``matvec_f32_rows``
        (one block per row, float4 loads) when fused, everything else through ``matvec_tiled_kernel``."""
        if isinstance(raw, Q8R):
            self._dq_launch(raw, x, y, rows, cols)
            return
        if self.fused and type_id == 0:
            self.k_mv_f32((min(rows, 4096),), (256,), (raw, x, y, np.int32(rows), np.int32(cols)))
            return
        from stratatools.runtime.gpu.kernels import matvec_tiled_launch

        matvec_tiled_launch(raw, x, y, type_id, rows, cols)

    def _put(self, buf: Any, row: Any) -> None:
        """buf[pos] = row at the device-held position."""
        if self.gpu:
            n = int(row.size)
            self.k_put(((n + 255) // 256,), (256,), (self.cp.ascontiguousarray(row, dtype=self.cp.float32), buf,
                                                    self.pos_dev, np.int32(n)))
        else:
            buf[self.pos] = row.reshape(buf.shape[1:])

    def _rms(self, x: Any, w: Any, group: int | None = None) -> Any:
        """stratatools.runtime.model._rmsnorm over the last axis (or groups of ``group`` values); fused kernel when fast."""
        xp = self.xp
        if self.fast:
            cp = self.cp
            g = int(group if group is not None else x.shape[-1])
            wl = int(w.size) if w is not None else 1
            if w is not None and x.size % g == 0 and ((w.dtype == cp.float32 and w.flags.c_contiguous and
                                                  x.size % wl == 0 and (wl == x.size or wl == x.shape[-1]))):
                xc = cp.ascontiguousarray(x, dtype=cp.float32)
                out = cp.empty(x.shape, dtype=cp.float32)
                self.k_rms((int(x.size) // g,), (256,), (xc, w, out, np.int32(g), np.int32(wl),
                                                        np.float32(self.cfg.eps)))
                return out
        return _rmsnorm(xp, x, w, self.cfg.eps, group=group)

    def _hc_fast(self, prefix: str, H: Any, inject: bool = True):
        """:meth:`_hc` with fused kernels: returns (mixed, raw inject logits [hc] or None); see :meth:`_inject`."""
        cp, cfg = self.cp, self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        hn = self._rms(H, self.w.get(f"{prefix}_norm.weight"), group=n)
        if inject:
            d, v = self.mv_many([f"{prefix}_down.weight", f"{prefix}_inject.weight"], hn)
        else:
            d, v = self.mv(f"{prefix}_down.weight", hn), None
        m = cp.empty_like(d)
        nd = int(d.size)
        self.k_silu_div(((nd + 255) // 256,), (256,), (d, m, np.int32(nd), np.float32(hc)))
        u = self.mv(f"{prefix}_up.weight", m)
        mixed = cp.empty(n, dtype=cp.float32)
        self.k_hc_mix(((n + 255) // 256,), (256,), (u, hn, mixed, np.int32(hc), np.int32(n)))
        if not inject:
            return mixed, None
        return mixed, v

    def _inject(self, H: Any, y: Any, v: Any) -> None:
        """In place: H[h*n + i] += y[i] * 2 sigmoid(v[h] / hc) (the residual of :meth:`_body`)."""
        hc, n = self.cfg.hc_count, self.cfg.n_embd
        tot = hc * n
        self.k_hc_inject(((tot + 255) // 256,), (256,), (H, self.cp.ascontiguousarray(y, dtype=self.cp.float32), v,
                                                        np.int32(hc), np.int32(n)))

    # -- the fused step (fused_step.cu) ---------------------------------------------------------------
    def _f32(self, name: str) -> Any:
        """A small dense tensor as a contiguous float32 device array (norm weights, conv kernels, gates); made once
        (a tensor stored transposed or in another type would otherwise be copied by a kernel in every step)."""
        got = self._f32_cache.get(name)
        if got is None:
            got = self.cp.ascontiguousarray(self.w.get(name), dtype=self.cp.float32)
            self._f32_cache[name] = got
        return got

    def _norm_inject(self, H: Any, prefix: str, y: Any = None, v: Any = None) -> Any:
        """One launch: (with y) the residual H_h += y * 2 sigmoid(v[h] / hc) in place, then the RMS norm of each
        stream of H with ``{prefix}_norm.weight``; returns the normed copy [hc * n]."""
        cp, cfg = self.cp, self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        w = self._f32(f"{prefix}_norm.weight")
        hn = cp.empty(hc * n, dtype=cp.float32)
        yy = cp.ascontiguousarray(y, dtype=cp.float32) if y is not None else None
        null = np.uint64(0)
        self.k_inject_rms((hc,), (1024,), (H, null if yy is None else yy, null if v is None else v, np.int32(hc),
                                           np.int32(n), w, np.int32(w.size), np.float32(cfg.eps), hn))
        return hn

    def _hc_from_hn(self, prefix: str, hn: Any, inject: bool = True):
        """:meth:`_hc_fast` after the norm: (mixed [n], raw inject logits [hc] or None)."""
        cp, cfg = self.cp, self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        if inject:
            d, v = self.mv_many([f"{prefix}_down.weight", f"{prefix}_inject.weight"], hn)
        else:
            d, v = self.mv(f"{prefix}_down.weight", hn), None
        raw, t, rows, cols = self._dense_raw(f"{prefix}_up.weight")
        d = cp.ascontiguousarray(d, dtype=cp.float32)
        if isinstance(raw, Q8R) and rows == hc * n and self.dense_stream:  # up projection + mix in one launch
            from stratatools.runtime.gpu.kernels import DQ_THREADS, _device_limits

            mixed = cp.empty(n, dtype=cp.float32)  # (mv_q8s, or mv_q8i: the same arguments)
            blocks, lpr, u, shm = self._dqs_shape(n, cols, _device_limits()[0], hc=hc)
            self.k_dqs((blocks,), (DQ_THREADS,), (raw.q, raw.d, d, mixed, np.int32(rows), np.int32(cols),
                                                 np.float32(hc), np.int32(lpr), np.int32(u), hn, np.int32(hc),
                                                 np.int32(n)), shared_mem=shm)
            return mixed, v
        if isinstance(raw, Q8R) and hc <= 8 and rows == hc * n:  # up projection + mix in one launch (mv_q8r_mix)
            from stratatools.runtime.gpu.kernels import DQ_THREADS

            mixed = cp.empty(n, dtype=cp.float32)
            wpb = DQ_THREADS // 32
            self.k_dq_mix(((n + wpb - 1) // wpb,), (DQ_THREADS,), (raw.q, raw.d, d, np.float32(hc), hn, mixed,
                                                                np.int32(hc), np.int32(n), np.int32(cols)),
                          shared_mem=cols * 4)
            return mixed, v
        if isinstance(raw, Q8R):  # silu(d / hc) applied while staging d
            u = cp.empty(rows, dtype=cp.float32)
            self._dq_launch(raw, d, u, rows, cols, silu_div=float(hc))
        elif raw is not None and t.id != 0 and int(raw.data.ptr) % 16 == 0:  # silu(d / hc) applied while staging d
            from stratatools.runtime.gpu.kernels import matvec_tiled_launch

            u = cp.empty(rows, dtype=cp.float32)
            matvec_tiled_launch(raw, d, u, t.id, rows, cols, silu_div=float(hc))
        else:
            m = cp.empty_like(d)
            nd = int(d.size)
            self.k_silu_div(((nd + 255) // 256,), (256,), (d, m, np.int32(nd), np.float32(hc)))
            u = self.mv(f"{prefix}_up.weight", m)
        mixed = cp.empty(n, dtype=cp.float32)
        self.k_hc_mix(((n + 255) // 256,), (256,), (u, hn, mixed, np.int32(hc), np.int32(n)))
        return mixed, v

    def _ple_fused(self, il: int, H: Any) -> None:
        """:meth:`_ple` added to H in place: the two stacked projections, then one ``ple_fused`` launch."""
        cfg = self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        a, b = self._ple_sl[il]
        p = f"blk.{il}.ple_"
        kraw, value = self.mv_many([p + "key.weight", p + "value.weight"], self.inp[a:b])
        cp = self.cp
        kraw = cp.ascontiguousarray(kraw, dtype=cp.float32)
        value = cp.ascontiguousarray(value, dtype=cp.float32)
        if int(kraw.size) != hc * n or int(value.size) != n:
            raise StrataError(f"layer {il}: PLE projections of {kraw.size} and {value.size} values; the fused step "
                              f"expects {hc * n} and {n}")
        wk, wq, wcn = self._f32(p + "norm_key.weight"), self._f32(p + "norm_query.weight"), self._f32(p + "norm_conv.weight")
        wc = self._f32(p + "conv1d.weight")
        self.k_ple((hc,), (1024,), (H, kraw, value, wk, np.int32(wk.size), wq, np.int32(wq.size), wcn,
                                    np.int32(wcn.size), self.ple_conv[il], wc, np.int32(cfg.ple_conv_kernel),
                                    np.int32(cfg.ple_ngram), np.int32(n), np.int32(hc), np.float32(cfg.eps)))

    def _gdn_fused(self, il: int, x: Any) -> Any:
        """:meth:`_gdn` in four launches: the stacked input projections, ``gdn_conv``, ``gdn_recur``, ``ssm_out``."""
        cp, cfg = self.cp, self.cfg
        nk, dk, nv = cfg.ssm_n_group, cfg.ssm_d_state, cfg.ssm_dt_rank
        dv = cfg.ssm_head_v_dim
        p = f"blk.{il}."
        qkv, z, b, a = self.mv_many([p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight",
                                     p + "ssm_alpha.weight"], x)
        wc = self._f32(p + "ssm_conv1d.weight")
        C, K = wc.shape
        conv = cp.empty(C, dtype=cp.float32)
        beta = cp.empty(nv, dtype=cp.float32)
        decay = cp.empty(nv, dtype=cp.float32)
        self.k_gdn_conv(((C + 255) // 256,), (256,), (cp.ascontiguousarray(qkv), self.conv[il], wc, np.int32(C),
                                                      np.int32(K), cp.ascontiguousarray(b), cp.ascontiguousarray(a),
                                                      self._f32(p + "ssm_a"), self._f32(p + "ssm_dt.bias"),
                                                      np.int32(nv), conv, beta, decay))
        # columns of a head split over ncb blocks (about one block per SM in all), 256 threads each
        ncb = max(1, min(dv, 128 // max(nv, 1)))
        cw = -(-dv // ncb)
        threads = 256
        rs = max(1, threads // cw)
        nw = self._f32(p + "ssm_norm.weight")
        o = cp.empty(nv * dv, dtype=cp.float32)
        obuf = cp.empty(nv * dv, dtype=cp.float32)
        sspart = cp.empty(nv * ncb, dtype=cp.float32)
        if self._gdn_counter is None or self._gdn_counter.size < nv:
            self._gdn_counter = cp.zeros(nv, dtype=cp.int32)  # every head's last block resets its count
        shm = (2 * dk + (rs + 1) * cw) * 4
        if shm > 48 * 1024:
            raise StrataError(f"layer {il}: GDN heads of {dk} x {dv} exceed the fused step's shared memory")
        self.k_gdn_recur((nv, ncb), (threads,), (conv, beta, decay, self.ssm[il], cp.ascontiguousarray(z), nw,
                                                 np.int32(nw.size), np.int32(nk), np.int32(dk), np.int32(dv),
                                                 np.float32(cfg.eps), np.int32(cfg.output_gate == "sigmoid"), obuf,
                                                 sspart, self._gdn_counter, o),
                         shared_mem=shm)
        return self.mv(p + "ssm_out.weight", o)

    def _moe_fused(self, il: int, x: Any) -> Any:
        """:meth:`_moe_fast` with the shared gate's row stacked under the router's (one matvec, one routing
        launch that also writes the shared gate) and the FMA build of the expert kernels."""
        from stratatools.runtime.gpu.experts import ExpertJobs, expert_ffn

        cp, cfg, k = self.cp, self.cfg, self.k
        p = f"blk.{il}."
        logits, sgl = self.mv_many([p + "ffn_gate_inp.weight", p + "ffn_gate_inp_shexp.weight"], x)
        E = int(logits.size)
        if k > 64:
            raise StrataError(f"the fused router handles at most 64 experts per token, not {k}")
        ly = self.rt.tier.arena.layers[il]
        pt = self.ptrs[il]
        w = self.weights[il]
        sg = cp.empty(1, dtype=cp.float32)
        X = cp.ascontiguousarray(x.reshape(1, -1), dtype=cp.float32)
        prefetch = self.miss_fetch == "prefetch" and il + 1 < cfg.n_layer
        if prefetch and self._pf_order == "first":
            self._prefetch_next(il, X)
        block = (min(1024, max(32, (E + 31) // 32 * 32)),)
        route = (np.int32(E), np.int32(k), np.int32(cfg.gating == "sigmoid"), np.int32(bool(cfg.norm_topk)),
                 np.float32(cfg.expert_weights_scale), self.slot[il], np.uint64(ly.gate_bytes), self.ids[il], w,
                 pt[0], pt[1], pt[2])
        if int(sgl.size) == 1 and int(sgl.data.ptr) == int(logits.data.ptr) + 4 * E:  # stacked: logits[E] is the gate
            self._route_sg(E, (logits,) + route + (sg,))
        else:
            self.k_route((1,), block, (cp.ascontiguousarray(logits),) + route, shared_mem=E * 4)
            sgw = self._f32(p + "ffn_gate_inp_shexp.weight").reshape(-1)
            self.k_dot_sig((1,), (256,), (X, sgw, np.int32(X.size), sg))
        if self.miss_fetch != "zero-copy":
            pt = self._fetch_layer(il, pt)
        if prefetch and self._pf_order == "after":  # the next layer's copies start after this layer's late ones
            self._prefetch_next(il, X)
        dev, sptrs, gu_t, d_t, hidden, ff = self.rt._shared_expert(il)
        y = cp.empty((1, cfg.n_embd), dtype=cp.float32)
        jobs = ExpertJobs(pt[0], pt[1], pt[2], self.tok0, w, self.tstart)
        sj = ExpertJobs(sptrs[0], sptrs[1], sptrs[2], self.shared_tok, sg, self.shared_tstart)
        i8 = self.moe_int8
        if self._shared_side is None:
            expert_ffn(X, jobs, ly.gu_type, ly.d_type, ly.hidden, ly.ff, out=y, hbuf=self.hbuf, fast=True,
                       kernels=self.kernels_routed, int8=i8, pdl=self.pdl)
            expert_ffn(X, sj, gu_t, d_t, hidden, ff, out=y, accumulate=True, hbuf=self.hbuf, fast=True,
                       kernels=self.kernels_shared, int8=i8, pdl=self.pdl)
            return y.reshape(-1)
        # the shared expert on the side stream (its own scratch) beside the routed gate/up; the routed down adds
        # to its result: y = shared + routed, the same float sum as routed + shared. The side stream is joined
        # back whatever raises (a capture left with an unjoined stream would hide the first error).
        main, side = cp.cuda.get_current_stream(), self._shared_side
        fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
        fork.record(main)
        side.wait_event(fork)
        try:
            with side:
                expert_ffn(X, sj, gu_t, d_t, hidden, ff, out=y, hbuf=self.hbuf_shared, fast=True,
                           kernels=self.kernels_shared, int8=i8, pdl=self.pdl)
        finally:
            join.record(side)
        joined: list[bool] = []

        def wait_shared() -> None:
            main.wait_event(join)
            joined.append(True)
        try:
            expert_ffn(X, jobs, ly.gu_type, ly.d_type, ly.hidden, ly.ff, out=y, accumulate=True, hbuf=self.hbuf,
                       fast=True, kernels=self.kernels_routed, before_down=wait_shared, int8=i8,
                       pdl=self.pdl)
        finally:
            if not joined:
                main.wait_event(join)
        return y.reshape(-1)

    def _body_fused(self) -> None:
        """:meth:`_body` on the fused kernels: every residual update carries the next RMS norm."""
        cp, cfg = self.cp, self.cfg
        a, b = self._x_sl
        H = cp.ascontiguousarray(cp.concatenate([self.inp[a:b]] * cfg.hc_count), dtype=cp.float32)
        self._pf_events = {}  # prefetch mode: side-stream events by layer, each joined by that layer's fetch
        self._pf_mixer = self.miss_fetch == "prefetch" and self._pf_order == "mixer"
        hn = None
        L = cfg.n_layer
        for il in range(L):
            if il in self._cut_at:
                self._cut(il)
            if il in cfg.ple_layers:
                self._ple_fused(il, H)
                hn = None
            if hn is None:
                hn = self._norm_inject(H, f"blk.{il}.hc_attn")
            mixed, v = self._hc_from_hn(f"blk.{il}.hc_attn", hn)
            if self._pf_mixer and il + 1 < L:  # PREFETCH_ORDER_ENV=mixer: layer il+1's copies start here
                self._prefetch_next(il, cp.ascontiguousarray(mixed.reshape(1, -1), dtype=cp.float32))
            y = self._gdn_fused(il, mixed) if cfg.recurrent[il] else self._attention(il, mixed)
            hn = self._norm_inject(H, f"blk.{il}.hc_ffn", y, v)
            mixed, v = self._hc_from_hn(f"blk.{il}.hc_ffn", hn)
            y = self._moe_fused(il, mixed)
            if il + 1 < L and (il + 1) in cfg.ple_layers:
                self._norm_inject(H, f"blk.{il + 1}.hc_attn", y, v)  # the PLE block changes H before the next norm
                hn = None
            else:
                hn = self._norm_inject(H, f"blk.{il + 1}.hc_attn" if il + 1 < L else "output_hc", y, v)
        if hn is None:
            hn = self._norm_inject(H, "output_hc")
        out_in, _ = self._hc_from_hn("output_hc", hn, inject=False)
        self.logits = self.mv("output.weight", out_in)
        self._tok_dev[...] = cp.argmax(self.logits)
        self.next_token_dev = self._tok_dev[0]

    # -- host side ------------------------------------------------------------------------------------
    def _host_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        from stratatools.runtime.weights import dequantize

        t = self.w.model.tensor(name)
        ne0 = int(t.ne[0])
        rb = t.type.row_bytes(ne0)
        raw = self.w.model.raw(t)
        out = np.empty((ids.size, ne0), dtype=np.float32)
        for i, u in enumerate(ids.tolist()):
            if not 0 <= u < int(t.ne[1]):
                raise StrataError(f"{self.w.model.path}: tensor {name}: row id {u} out of range [0, {int(t.ne[1])})")
            out[i] = _to_host(dequantize(raw[u * rb:(u + 1) * rb], t.type, ne0, xp=np))
        return out

    def load_state(self, state: SequenceState) -> None:
        """Copy a sequence's caches (after a prefill with ``rt.forward``) into the static buffers.

        Raises StrataError when the sequence is already longer than ``max_ctx``.
        """
        if state.pos > self.max_ctx:
            raise StrataError(f"the sequence holds {state.pos} positions; the static decoder was built for {self.max_ctx}")
        with self._ordered():
            self._load_state(state)

    def _load_state(self, state: SequenceState) -> None:
        xp = self.xp
        for il, ls in enumerate(state.layers):
            if self.cfg.recurrent[il]:
                if ls.conv is not None:
                    self.conv[il][...] = ls.conv
                    self.ssm[il][...] = ls.ssm
                else:
                    self.conv[il][...] = 0
                    self.ssm[il][...] = 0
            else:
                self.kc[il][...] = 0
                self.vc[il][...] = 0
                if ls.k is not None:
                    P = int(ls.k.shape[0])
                    self.kc[il][:P] = ls.k
                    self.vc[il][:P] = ls.v
                if il in self.ik:
                    self.ik[il][...] = 0
                    self.bk[il][...] = 0
                    if ls.ik is not None:
                        self.ik[il][:int(ls.ik.shape[0])] = ls.ik
                    if ls.bk is not None:
                        self.bk[il][:int(ls.bk.shape[0])] = ls.bk
        for il in self.cfg.ple_layers:
            prev = state.ple_conv.get(il)
            self.ple_conv[il][...] = 0 if prev is None else xp.asarray(prev)
        self.ple_ctx = np.array(state.ple_ctx, dtype=np.int64, copy=True)
        self.pos = int(state.pos)
        self._seq_steps = 0  # no step of this sequence has run (read_step)

    def _stage_position(self, s: np.ndarray) -> None:
        """The position-dependent inputs of the step at ``self.pos`` into the staging vector ``s`` [n_in]: the rope
        cos / sin, and per QSA compress ratio those of the block that pos+1 completes (used by qsa_pool only then)."""
        cfg = self.cfg
        f = np.float32(self.pos) * self.rt.rope.inv_freq
        f = np.concatenate([f, f])
        a, b = self._cos_sl
        s[a:b] = np.cos(f)
        a, b = self._sin_sl
        s[a:b] = np.sin(f)
        for r, (a, b) in self._bcs_sl.items():
            f = np.float32(max((self.pos + 1) // r - 1, 0) * r) * self.rt.rope.inv_freq
            f = np.concatenate([f, f])
            s[a:a + cfg.n_rot] = np.cos(f)
            s[a + cfg.n_rot:b] = np.sin(f)

    def _stage(self, token: int) -> None:
        cfg = self.cfg
        if not 0 <= token < cfg.n_vocab:
            raise StrataError(f"token id {token} is outside the vocabulary [0, {cfg.n_vocab})")
        if self.pos >= self.max_ctx:
            raise StrataError(f"position {self.pos} is past the static decoder's {self.max_ctx} positions")
        s = self.stage
        s[:1].view(np.int32)[0] = self.pos
        ids = np.array([token], dtype=np.int64)
        a, b = self._x_sl
        s[a:b] = self._host_rows("token_embd.weight", ids)[0]
        ctx = self.ple_ctx
        keep = cfg.ple_ngram - 1
        for il in cfg.ple_layers:  # same context handling as Qwen4ExpRuntime._ple, layer by layer
            rows = self.rt.ple_ngram_ids(ids, ctx)
            if keep > 0:
                ctx = np.concatenate([ctx, ids])[-keep:]
            a, b = self._ple_sl[il]
            s[a:b] = self._host_rows("per_layer_token_embd.weight", rows.reshape(-1)).reshape(-1)
        self.ple_ctx = ctx
        self._stage_position(s)
        if self.gpu:
            self.inp.set(s, stream=self._stream)
        else:
            self.inp[...] = s

    # -- device staging (queued steps, issue 17) -------------------------------------------------------
    @property
    def ple_ctx(self) -> np.ndarray:
        """The PLE n-gram context (int64 [ple_ngram - 1]) the next step starts from. After device-staged steps
        (:meth:`_stage_from_device`, which advance the device's copy only) the first read takes it back from the
        device (:meth:`device_ple_ctx`: waits for the decoder's stream), so host staging (:meth:`_stage`, the
        prefill, :meth:`set_device_token`) continues from the right context."""
        if self._ple_ctx_on_device:
            self._ple_ctx_on_device = False
            self._ple_ctx = self.device_ple_ctx()
        return self._ple_ctx

    @ple_ctx.setter
    def ple_ctx(self, value: np.ndarray) -> None:
        self._ple_ctx_on_device = False
        self._dev_token_live = False  # the host moved on (host staging, prefill, a new sequence): the device is stale
        self._ple_ctx = value

    def device_stage_ready(self) -> tuple[bool, str]:
        """Can this decoder stage a step's token-dependent inputs on the device (:meth:`_stage_from_device`)?

        Returns (True, "") or (False, the reason): a CPU decoder, a missing token or PLE table, a table type outside
        :data:`STAGE_TYPES`, or PLE constants ``stage_step.cu`` does not take (:func:`device_stage_check`). Cheap:
        uploads and compiles nothing.
        """
        if not self.gpu:
            return False, "device staging needs a CuPy decoder (this one runs on numpy)"
        return device_stage_check(self.w.model, self.cfg)

    def _dstage_init(self) -> Any:
        """The device staging state, made on first use (on the decoder's stream): ``stage_step.cu`` compiled, the
        token (and PLE) tables' raw bytes uploaded, the int64 constants, the device PLE context, the error word and
        two pinned host buffers for the position part. Raises StrataError when :meth:`device_stage_ready` says no."""
        if self._dstage is not None:
            return self._dstage
        ok, why = self.device_stage_ready()
        if not ok:
            raise StrataError(f"{self.w.model.path}: device staging is unavailable: {why}")
        import types

        import cupyx

        cp, cfg, model = self.cp, self.cfg, self.w.model
        d = types.SimpleNamespace()
        d.kernel = cp.RawModule(code=cuda_source("stage_step.cu"), options=("--std=c++17",)).get_function("stage_step")
        keep = max(cfg.ple_ngram - 1, 0)
        n_pl = len(cfg.ple_layers) if keep > 0 else 0
        with self._stream:
            tok_tab = cp.asarray(model.raw(model.tensor("token_embd.weight")))
            ple_tab = cp.asarray(model.raw(model.tensor("per_layer_token_embd.weight"))) if n_pl else None
            tok, ple, prm, tail = stage_table_args(model, cfg, (tok_tab, ple_tab),
                                                   [self._ple_sl[il][0] for il in cfg.ple_layers] if n_pl else [])
            d.prm = cp.asarray(prm)
            d.ctx = cp.full(max(keep, 1), cfg.eos_id, dtype=cp.int64)
            d.err = cp.zeros(1, dtype=cp.int32)
        d.tables = (tok_tab, ple_tab)
        d.keep = keep
        d.args = ((self._tok_dev, d.ctx, self.inp) + tok + (np.int32(self._x_sl[0]), np.int32(cfg.n_embd)) + ple
                  + (d.prm,) + tail + (d.err,))
        d.host = [cupyx.empty_pinned(self.n_in, dtype=np.float32) for _ in range(2)]
        d.events = [None, None]  # per pinned buffer: recorded after the copies that read it
        d.i = 0
        self._dstage = d
        return d

    def set_device_token(self, token: int) -> None:
        """Make the next :meth:`_stage_from_device` stage ``token`` exactly as :meth:`_stage` would now: ``token`` into
        the device arg-max word ``_tok_dev`` and the host's PLE context ``ple_ctx`` into the device context (on the
        decoder's stream, ordered after the caller's stream; a context shorter than ``ple_ngram - 1`` is filled with
        EOS in front, which hashes the same). Uploads the tables on first use.

        Raises StrataError for a token outside the vocabulary or when device staging is unavailable
        (:meth:`device_stage_ready`).
        """
        token = int(token)
        if not 0 <= token < self.cfg.n_vocab:
            raise StrataError(f"token id {token} is outside the vocabulary [0, {self.cfg.n_vocab})")
        with self._ordered():
            d = self._dstage_init()
            ctx = padded_context(self.ple_ctx, d.keep, self.cfg.eos_id, int(d.ctx.size))
            self._tok_dev.set(np.array([token], dtype=np.int64), stream=self._stream)
            d.ctx.set(ctx, stream=self._stream)
        self._dev_token_live = True  # step(None) may stage from the device (each such step keeps it so)

    def _stage_from_device(self) -> None:
        """:meth:`_stage` for the token in ``_tok_dev`` (the previous step's arg-max, or :meth:`set_device_token`'s),
        without the host reading it: the host writes the position part (pos, cos, sin, block cos/sin for ``pos``, as
        :meth:`_stage`) into one of two pinned buffers used in turn (waiting for the copy that last read it), copies
        it into ``inp`` on the decoder's stream, then ``stage_step`` writes x0 and the PLE rows and advances the
        device PLE context (:attr:`ple_ctx` reads it back when the host next needs it).

        Raises StrataError for a position past ``max_ctx`` or when device staging is unavailable.
        """
        if self.pos >= self.max_ctx:
            raise StrataError(f"position {self.pos} is past the static decoder's {self.max_ctx} positions")
        d = self._dstage_init()
        cp = self.cp
        i = d.i
        d.i ^= 1
        if d.events[i] is not None:
            d.events[i].synchronize()
        s = d.host[i]
        s[:1].view(np.int32)[0] = self.pos
        self._stage_position(s)
        h2d, st = cp.cuda.runtime.memcpyHostToDevice, self._stream.ptr
        a = self._cos_sl[0]
        cp.cuda.runtime.memcpyAsync(self.inp.data.ptr, s.ctypes.data, 4, h2d, st)
        cp.cuda.runtime.memcpyAsync(self.inp.data.ptr + 4 * a, s.ctypes.data + 4 * a, 4 * (self.n_in - a), h2d, st)
        d.events[i] = self._stream.record()
        with self._stream:
            d.kernel((1,), (STAGE_THREADS,), d.args)
        self._ple_ctx_on_device = True

    def device_ple_ctx(self) -> np.ndarray:
        """The device PLE context (int64 [ple_ngram - 1]) the next device-staged step starts from; waits for the
        decoder's stream. Raises StrataError when device staging is unavailable."""
        d = self._dstage_init()
        self._stream.synchronize()
        return d.ctx.get()[:d.keep]

    def device_stage_errors(self) -> int:
        """``stage_step``'s sticky error bits since device staging began: 1 a token outside the token table, 2 a PLE
        row outside its table (0: none); waits for the decoder's stream."""
        d = self._dstage_init()
        self._stream.synchronize()
        return int(d.err.get()[0])

    # -- the step -------------------------------------------------------------------------------------
    def _hc(self, prefix: str, H: Any, inject: bool = True):
        xp, cfg = self.xp, self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        hn = _rmsnorm(xp, H, self.w.get(f"{prefix}_norm.weight"), cfg.eps, group=n)
        m = _silu(xp, self.mv(f"{prefix}_down.weight", hn) / xp.float32(hc))
        m = _sigmoid(xp, self.mv(f"{prefix}_up.weight", m))
        mixed = xp.mean(m.reshape(hc, n) * hn.reshape(hc, n), axis=0)
        if not inject:
            return mixed, None
        iw = 2.0 * _sigmoid(xp, self.mv(f"{prefix}_inject.weight", hn) / xp.float32(hc))
        return mixed, iw.astype(xp.float32)

    def _ple(self, il: int, H: Any) -> Any:
        xp, cfg = self.xp, self.cfg
        hc, n = cfg.hc_count, cfg.n_embd
        a, b = self._ple_sl[il]
        emb = self.inp[a:b]
        p = f"blk.{il}.ple_"
        kraw, value = self.mv_many([p + "key.weight", p + "value.weight"], emb)
        key = self._rms(kraw, self.w.get(p + "norm_key.weight"), group=n)
        q = self._rms(H, self.w.get(p + "norm_query.weight"), group=n)
        gate = xp.sum(key.reshape(hc, n) * q.reshape(hc, n), axis=-1, keepdims=True) / xp.float32(np.sqrt(n))
        gate = xp.sqrt(xp.maximum(xp.abs(gate), xp.float32(1e-6))) * xp.sign(gate)
        gv = (_sigmoid(xp, gate) * value[None, :]).reshape(hc * n)
        gvn = self._rms(gv, self.w.get(p + "norm_conv.weight"), group=n)
        K, d = cfg.ple_conv_kernel, cfg.ple_ngram
        span = (K - 1) * d
        buf = self.ple_conv[il]
        xin = xp.concatenate([buf, gvn[None, :]], axis=0)  # [span + 1, C]
        if span:
            buf[...] = xin[1:]
        wc = self.w.get(p + "conv1d.weight")
        out = xp.zeros(hc * n, dtype=xp.float32)
        for k in range(K):
            out = out + xin[k * d] * wc[:, k]
        return gv + _silu(xp, out)

    def _gdn(self, il: int, x: Any) -> Any:
        xp, cfg = self.xp, self.cfg
        nk, dk, nv = cfg.ssm_n_group, cfg.ssm_d_state, cfg.ssm_dt_rank
        dv = cfg.ssm_head_v_dim
        p = f"blk.{il}."
        qkv, z, b, a = self.mv_many([p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight",
                                     p + "ssm_alpha.weight"], x)
        z = z.reshape(nv, dv)
        wc = self.w.get(p + "ssm_conv1d.weight")
        C, K = wc.shape
        cbuf = self.conv[il]
        xin = xp.concatenate([cbuf, qkv[None, :]], axis=0)  # [K, C]
        if K > 1:
            cbuf[...] = xin[1:]
        conv = xp.zeros(C, dtype=xp.float32)
        for k in range(K):
            conv = conv + xin[k] * wc[:, k]
        conv = _silu(xp, conv)
        q = conv[:nk * dk].reshape(nk, dk)
        k_ = conv[nk * dk:2 * nk * dk].reshape(nk, dk)
        v = conv[2 * nk * dk:].reshape(nv, dv)
        q = _l2norm(xp, q) * xp.float32(dk ** -0.5)
        k_ = _l2norm(xp, k_)
        rep = nv // nk
        if rep > 1:
            q = xp.tile(q, (rep, 1))
            k_ = xp.tile(k_, (rep, 1))
        beta = _sigmoid(xp, b)
        g = self.w.get(p + "ssm_a") * _softplus(xp, a + self.w.get(p + "ssm_dt.bias"))
        decay = xp.exp(g).astype(xp.float32)
        S = self.ssm[il] * decay[:, None, None]
        kv = xp.sum(k_[:, :, None] * S, axis=1)  # [nv, dv]
        delta = (v - kv) * beta[:, None]
        S = S + k_[:, :, None] * delta[:, None, :]
        out = xp.sum(q[:, :, None] * S, axis=1)
        self.ssm[il][...] = S
        o = self._rms(out, self.w.get(p + "ssm_norm.weight"))
        act = _sigmoid(xp, z) if cfg.output_gate == "sigmoid" else _silu(xp, z)
        return self.mv(p + "ssm_out.weight", (o * act).reshape(nv * dv))

    def _rope(self, x: Any) -> Any:
        """x [heads, d]: the runtime's Rope.apply at this step's position (cos/sin from the inputs)."""
        a, b = self._cos_sl
        c, s = self._sin_sl
        return self.rt.rope.apply(x[None], self.inp[a:b][None], self.inp[c:s][None])[0]

    def _qsa_layer(self, il: int) -> bool:
        """An attention layer with QSA block selection (compress ratio > 0)."""
        return not self.cfg.recurrent[il] and self.cfg.compress_ratios[il] > 0

    def _qsa(self, il: int, qraw: Any, kraw: Any) -> Any:
        """The indexer of one attention layer at this step's position: caches the raw key, pools a completed block,
        scores the complete blocks and selects the attended cells (Qwen4ExpRuntime._select for one query). Returns
        a boolean mask [pos+1] on numpy; on CuPy the cells are left in ``q_cells[:q_ncell]``."""
        cfg = self.cfg
        r, dih, budget = cfg.compress_ratios[il], cfg.idx_head_dim, cfg.idx_budget
        p = f"blk.{il}.indexer."
        qi = self._rope(self._rms(qraw.reshape(-1, dih), self.w.get(p + "q_norm.weight")))
        self._put(self.ik[il], kraw)
        sq = np.float32(np.sqrt(dih))
        if self.gpu:
            cp = self.cp
            a, _ = self._bcs_sl[r]
            n_rot = cfg.n_rot
            self.k_qsa_pool((1,), (128,), (self.ik[il], self.bk[il], self.w.get(p + "k_norm.weight"),
                                           self.inp[a:a + n_rot], self.inp[a + n_rot:a + 2 * n_rot], self.pos_dev,
                                           np.int32(r), np.int32(dih), np.int32(n_rot), np.float32(cfg.eps)))
            nbmax = self.max_ctx // r + 1
            self.k_qsa_scores((max(1, min(1024, (nbmax + 3) // 4)),), (128,),
                              (cp.ascontiguousarray(qi), self.bk[il], self.pos_dev, self.q_scores, np.int32(r),
                               np.int32(qi.shape[0]), np.int32(dih), sq))
            self.k_qsa_select((1,), (1024,), (self.q_scores, self.pos_dev, np.int32(r), np.int32(budget),
                                              np.int32(self.rt.selection != "transformers"), self.q_flags, self.q_pairs,
                                              self.q_cells, self.q_ncell))
            return None
        pos = self.pos
        P = pos + 1
        if P % r == 0:  # the block pos completes: same arithmetic as Qwen4ExpRuntime._select
            b = P // r - 1
            raw = self.ik[il][b * r:P].reshape(1, r, dih)
            pooled = _rmsnorm(np, np.mean(raw, axis=1), self.w.get(p + "k_norm.weight"), cfg.eps)
            bc, bs = self.rt.rope.cos_sin(np.array([b * r], dtype=np.int64))
            self.bk[il][b] = self.rt.rope.apply(pooled[:, None, :], bc, bs)[0, 0]
        nb = P // r
        mask = np.zeros(P, dtype=bool)
        if nb > 0:
            sc = np.einsum("thd,bd->tbh", qi[None], self.bk[il][:nb])
            scores = (np.sum(np.maximum(sc, 0), axis=-1) / sq)[0]
        else:
            scores = np.zeros(0, dtype=np.float32)
        if self.rt.selection == "transformers":
            for blk in torch_topk_indices(scores, min(budget // r, nb)):
                mask[blk * r:(blk + 1) * r] = True
            mask[nb * r:P] = True
        else:
            mask[llamacpp_cells(scores, r, pos, budget + r - 1, P)] = True
        return mask

    def _attention(self, il: int, x: Any) -> Any:
        xp, cfg = self.xp, self.cfg
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        p = f"blk.{il}."
        names = [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]
        sel = self.long and self._qsa_layer(il)
        if sel:
            names += [p + "indexer.q_proj.weight", p + "indexer.k_proj.weight"]
        qraw, kraw, vraw, *idx = self.mv_many(names, x)
        if self.fused and self.gpu and not sel:
            fused = self._attention_fused(il, qraw, kraw, vraw)
            if fused is not None:
                return fused
        qg = qraw.reshape(nh, 2 * hd)
        q = qg[:, :hd]
        gate = qg[:, hd:].reshape(nh * hd)
        q = self._rms(q, self.w.get(p + "attn_q_norm.weight"))
        k = self._rms(kraw.reshape(nkv, hd), self.w.get(p + "attn_k_norm.weight"))
        v = vraw.reshape(nkv, hd)
        q = self._rope(q)
        k = self._rope(k)
        self._put(self.kc[il], k)
        self._put(self.vc[il], v)
        mask = self._qsa(il, idx[0], idx[1]) if sel else None
        scale = np.float32(hd ** -0.5)
        if self.gpu:
            o = self.cp.empty((nh, hd), dtype=self.cp.float32)
            self._split_attention(il, q, o, bool(sel))
            o = o.reshape(nh * hd)
        else:
            P = self.pos + 1
            grp = nh // nkv
            kk = np.repeat(self.kc[il][:P], grp, axis=1)
            vv = np.repeat(self.vc[il][:P], grp, axis=1)
            att = np.einsum("hd,phd->hp", q, kk) * scale
            if mask is not None:
                att = np.where(mask[None, :], att, np.float32(-np.inf))
            att = _softmax(np, att, axis=-1)
            o = np.einsum("hp,phd->hd", att, vv).reshape(nh * hd).astype(np.float32)
        o = o * _sigmoid(xp, gate)
        return self.mv(p + "attn_output.weight", o)

    def _attention_fused(self, il: int, qraw: Any, kraw: Any, vraw: Any) -> Any:
        """:meth:`_attention` without QSA selection on ``attn_step.cu``: ``attn_prep`` (q/k norms, rope, cache
        rows), the scores as the unfused step runs them, ``attn_gate_mul``, the output projection. None (the caller
        runs the unfused code) when a norm weight is neither per head nor per tensor or a head exceeds 1,024 values."""
        cp, cfg = self.cp, self.cfg
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        p = f"blk.{il}."
        wq, wk = self._f32(p + "attn_q_norm.weight"), self._f32(p + "attn_k_norm.weight")
        if (wq.size not in (hd, nh * hd) or wk.size not in (hd, nkv * hd) or hd > 1024 or cfg.n_rot > hd
                or int(qraw.size) != nh * 2 * hd or int(kraw.size) != nkv * hd or int(vraw.size) != nkv * hd):
            return None
        qraw, kraw, vraw = (cp.ascontiguousarray(a, dtype=cp.float32) for a in (qraw, kraw, vraw))
        a, _ = self._cos_sl
        c, _ = self._sin_sl
        q = cp.empty((nh, hd), dtype=cp.float32)
        threads = min(1024, (hd + 31) // 32 * 32)
        self.k_attn_prep((nh + nkv,), (threads,), (qraw, kraw, vraw, wq, np.int32(wq.size), wk, np.int32(wk.size),
                                                    self.inp[a:], self.inp[c:], np.int32(cfg.n_rot), np.int32(nh),
                                                    np.int32(nkv), np.int32(hd), np.float32(cfg.eps), self.pos_dev, q,
                                                    self.kc[il], self.vc[il]), shared_mem=hd * 4)
        o = cp.empty((nh, hd), dtype=cp.float32)
        self._split_attention(il, q, o, False)
        g = cp.empty(nh * hd, dtype=cp.float32)
        n = nh * hd
        self.k_gate_mul((min(1024, (n + 255) // 256),), (256,), (o, qraw, np.int32(nh), np.int32(hd), g))
        return self.mv(p + "attn_output.weight", g)

    def _moe(self, il: int, x: Any) -> Any:
        xp, cfg = self.xp, self.cfg
        p = f"blk.{il}."
        logits = self.mv(p + "ffn_gate_inp.weight", x)
        if self.fast:
            return self._moe_fast(il, x, logits)
        probs = _sigmoid(xp, logits) if cfg.gating == "sigmoid" else _softmax(xp, logits, axis=-1)
        probs = probs.astype(xp.float32, copy=False)
        k = self.k
        if self.gpu:
            from stratatools.runtime.gpu.experts import ExpertJobs, expert_ffn

            cp = self.cp
            E = int(probs.size)
            ly = self.rt.tier.arena.layers[il]
            w = cp.empty(k, dtype=cp.float32)
            pt = self.ptrs[il]
            self.k_topk((1,), (min(1024, max(32, (E + 31) // 32 * 32)),),
                        (cp.ascontiguousarray(probs), np.int32(E), np.int32(k), self.slot[il], np.uint64(ly.gate_bytes),
                         self.ids[il], w, pt[0], pt[1], pt[2]), shared_mem=E * 4)
        else:
            ids = np.argsort(-probs, kind="stable")[:k]
            self.ids[il] = ids
            w = probs[ids]
        if cfg.norm_topk:
            w = w / w.sum()
        w = (w * xp.float32(cfg.expert_weights_scale)).astype(xp.float32)
        self.weights[il] = w
        sgw = self.w.get(p + "ffn_gate_inp_shexp.weight").reshape(-1)
        sg = _sigmoid(xp, xp.sum(x * sgw, keepdims=True))  # [1]
        if self.gpu:
            dev, sptrs, gu_t, d_t, hidden, ff = self.rt._shared_expert(il)
            y = cp.empty((1, cfg.n_embd), dtype=cp.float32)
            X = cp.ascontiguousarray(x.reshape(1, -1))
            jobs = ExpertJobs(pt[0], pt[1], pt[2], self.tok0, w, self.tstart)
            expert_ffn(X, jobs, ly.gu_type, ly.d_type, ly.hidden, ly.ff, out=y, hbuf=self.hbuf)
            sj = ExpertJobs(sptrs[0], sptrs[1], sptrs[2], self.shared_tok, sg.astype(cp.float32), self.shared_tstart)
            expert_ffn(X, sj, gu_t, d_t, hidden, ff, out=y, accumulate=True, hbuf=self.hbuf)
            return y.reshape(-1)
        y = np.zeros(cfg.n_embd, dtype=np.float32)
        for r, e in enumerate(self.ids[il].tolist()):
            g, u, d = self.rt.expert_fn(il, int(e))
            h = _silu(np, g @ x) * (u @ x)
            y += (d @ h) * w[r]
        hs = _silu(np, self.mv(p + "ffn_gate_shexp.weight", x)) * self.mv(p + "ffn_up_shexp.weight", x)
        return y + sg * self.mv(p + "ffn_down_shexp.weight", hs)

    def _moe_fast(self, il: int, x: Any, logits: Any) -> Any:
        """:meth:`_moe` on the GPU with the router (probabilities, top-k, weights) and the shared gate fused."""
        from stratatools.runtime.gpu.experts import ExpertJobs, expert_ffn

        cp, cfg, k = self.cp, self.cfg, self.k
        p = f"blk.{il}."
        E = int(logits.size)
        if k > 64:
            raise StrataError(f"the fused router handles at most 64 experts per token, not {k}")
        ly = self.rt.tier.arena.layers[il]
        pt = self.ptrs[il]
        w = self.weights[il]
        self.k_route((1,), (min(1024, max(32, (E + 31) // 32 * 32)),),
                     (cp.ascontiguousarray(logits), np.int32(E), np.int32(k), np.int32(cfg.gating == "sigmoid"),
                      np.int32(bool(cfg.norm_topk)), np.float32(cfg.expert_weights_scale), self.slot[il],
                      np.uint64(ly.gate_bytes), self.ids[il], w, pt[0], pt[1], pt[2]), shared_mem=E * 4)
        X = cp.ascontiguousarray(x.reshape(1, -1), dtype=cp.float32)
        sgw = self.w.get(p + "ffn_gate_inp_shexp.weight").reshape(-1)
        sg = cp.empty(1, dtype=cp.float32)
        self.k_dot_sig((1,), (256,), (X, cp.ascontiguousarray(sgw, dtype=cp.float32), np.int32(X.size), sg))
        dev, sptrs, gu_t, d_t, hidden, ff = self.rt._shared_expert(il)
        y = cp.empty((1, cfg.n_embd), dtype=cp.float32)
        jobs = ExpertJobs(pt[0], pt[1], pt[2], self.tok0, w, self.tstart)
        expert_ffn(X, jobs, ly.gu_type, ly.d_type, ly.hidden, ly.ff, out=y, hbuf=self.hbuf)
        sj = ExpertJobs(sptrs[0], sptrs[1], sptrs[2], self.shared_tok, sg, self.shared_tstart)
        expert_ffn(X, sj, gu_t, d_t, hidden, ff, out=y, accumulate=True, hbuf=self.hbuf)
        return y.reshape(-1)

    def _cut(self, il: int) -> None:
        """During :meth:`capture`, before layer ``il``: end the graph piece being captured (the prefetch of layer il,
        forked in it, is joined first and marked :data:`_JOINED` for layer il's fetch) and start the next one."""
        cp = self.cp
        ev = self._pf_events.get(il)
        if ev is not None and ev is not _JOINED:
            self._stream.wait_event(ev)
            self._pf_events[il] = _JOINED
        self._pieces.append(self._stream.end_capture())
        begin_capture(cp, self._stream)

    def _body(self) -> None:
        """Everything after the input upload: layers, output mixer, LM head, arg-max (no host reads)."""
        if self.fused:
            self._body_fused()
            return
        xp, cfg = self.xp, self.cfg
        a, b = self._x_sl
        H = xp.concatenate([self.inp[a:b]] * cfg.hc_count)
        if self.fast:
            H = self.cp.ascontiguousarray(H, dtype=self.cp.float32)
        for il in range(cfg.n_layer):
            if il in cfg.ple_layers:
                H = H + self._ple(il, H)
            if self.fast:
                mixed, v = self._hc_fast(f"blk.{il}.hc_attn", H)
                y = self._gdn(il, mixed) if cfg.recurrent[il] else self._attention(il, mixed)
                self._inject(H, y, v)
                mixed, v = self._hc_fast(f"blk.{il}.hc_ffn", H)
                self._inject(H, self._moe(il, mixed), v)
                continue
            mixed, inject = self._hc(f"blk.{il}.hc_attn", H)
            y = self._gdn(il, mixed) if cfg.recurrent[il] else self._attention(il, mixed)
            H = H + (y[None, :] * inject[:, None]).reshape(-1)
            mixed, inject = self._hc(f"blk.{il}.hc_ffn", H)
            y = self._moe(il, mixed)
            H = H + (y[None, :] * inject[:, None]).reshape(-1)
        out_in, _ = (self._hc_fast if self.fast else self._hc)("output_hc", H, inject=False)
        self.logits = self.mv("output.weight", out_in)
        if self.gpu:
            self._tok_dev[...] = xp.argmax(self.logits)
            self.next_token_dev = self._tok_dev[0]
        else:
            self.next_token_dev = xp.argmax(self.logits)

    # -- public ---------------------------------------------------------------------------------------
    def step(self, token: int | None) -> Any:
        """Run one token at the current position; returns the logits [vocab] (device array on CuPy).

        ``token`` None: the previous step's arg-max, which stays on the device (its inputs are staged by a kernel:
        ``_stage_from_device``; on numpy the host value), so that the step can be queued before the host has read
        the previous one (:meth:`stratatools.runtime.gpu.engine.DecoderRuntime.decode_queued`); the first such step
        takes the token :meth:`set_device_token` wrote.

        Raises StrataError for a token outside the vocabulary or a position past ``max_ctx``.
        """
        with self._ordered():
            self._refresh_slots()
            if token is not None:
                self._stage(int(token))
            elif self.gpu:
                if not self._dev_token_live:
                    raise StrataError("step(None) needs set_device_token() first: the device holds no token and PLE "
                                      "context of this sequence's current position")
                self._stage_from_device()
            else:
                self._stage(int(self.next_token_dev))
            if self.graph is not None:
                for g in self.graphs:  # in capture order (pieces: GRAPH_PARTS_ENV)
                    g.launch(stream=self._stream)
                self.stats["graph_steps"] += 1
            elif self.gpu and self._pool is not None:
                with self.cp.cuda.using_allocator(self._pool.malloc):
                    self._body()
            else:
                self._body()
            if self.gpu:  # one copy of the step's host-read outputs; read by next_token() / routing()
                n = int(self._out.nbytes)
                if self._out_event is not None:
                    self._prev_out = (self._out_host, self._out_event)
                self._out_host = self._out_ring[self.stats["steps"] % 2]
                self.cp.cuda.runtime.memcpyAsync(self._out_host.ctypes.data, self._out.data.ptr, n,
                                                 self.cp.cuda.runtime.memcpyDeviceToHost, self._stream.ptr)
                self._out_event = self._stream.record()
            else:  # numpy: the outputs of the last two steps, as the pinned copies hold them on CuPy
                self._prev_np = self._last_np
                self._last_np = (int(self.next_token_dev), _to_host(self.ids).copy(), _to_host(self.weights).copy())
        self.pos += 1
        self._seq_steps += 1
        self.stats["steps"] += 1
        return self.logits

    def wait_before_next(self, event: Any) -> None:
        """Make the next step (its slot-table upload and replay) wait for ``event`` (copies into slots it reads)."""
        self._wait_next.append(event)

    def last_step_event(self) -> Any:
        """The event recorded after the last step launched (None before the first; CuPy only)."""
        return self._out_event if self.gpu else None

    def prefiller(self, chunk: int | None = None, group: int | None = None, experts: str = "rows") -> Any:
        """The :class:`stratatools.runtime.gpu.prefill.ChunkPrefill` :meth:`prefill` uses with these options, the
        dense GEMM path of ``STRATATOOLS_PREFILL_GEMM``, the shared expert's stream (:data:`SHARED_SIDE_ENV`) and the
        expert jobs' size (``STRATATOOLS_PREFILL_JOB``) (made once and kept while they stay the same; its kernels are compiled as it is made and by its
        ``compile()``)."""
        from stratatools.runtime.gpu.prefill import CHUNK, GROUP, ChunkPrefill
        from stratatools.runtime.gpu.qmm import job_tokens, prefill_gemm

        c, g = int(chunk or CHUNK), int(group or GROUP)
        pf = getattr(self, "_prefiller", None)
        gemm = prefill_gemm() if self.gpu else "sgemm"  # (a CPU decoder ignores the GPU switch: ChunkPrefill)
        side = bool(self.gpu and shared_side() and gemm != "hgemm")  # the shared expert's stream (SHARED_SIDE_ENV)
        jt = job_tokens() if self.gpu else getattr(pf, "_jt", None)  # the expert jobs' size (qmm.JOB_ENV)
        if pf is None or (pf.chunk, pf.group, pf.asked[0], pf.gemm, pf._shared_side is not None, pf._jt) != (
                c, g, experts, gemm, side, jt):
            pf = self._prefiller = ChunkPrefill(self, c, g, experts)
        return pf

    def prefill(self, ids: Any, chunk: int | None = None, group: int | None = None,
                experts: str = "rows") -> tuple[Any, np.ndarray, np.ndarray]:
        """Run a prompt in batched chunks (:class:`stratatools.runtime.gpu.prefill.ChunkPrefill`) from the current
        position: the decoder ends in the state that one :meth:`step` per token would leave (up to float rounding).
        Returns (last token's logits [vocab], routing ids [T, L, k] int32, weights [T, L, k] float32, host arrays);
        nothing is fed to the tier or the route hooks (:meth:`account` does that).

        Args:
            chunk: tokens per batched forward (default :data:`stratatools.runtime.gpu.prefill.CHUNK`).
            group: experts dequantized at once on the ``gemm`` expert path (default
                :data:`stratatools.runtime.gpu.prefill.GROUP`).
            experts: the routed-expert path (:data:`stratatools.runtime.gpu.prefill.EXPERT_PATHS`).
        Raises:
            StrataError: an empty prompt, a token outside the vocabulary, a context past ``max_ctx``; an unknown
                expert path.
        """
        pf = self.prefiller(chunk, group, experts)
        with self._ordered():
            self._refresh_slots()  # copies into slots the prefill reads (async swaps) are waited for first
            out = pf.run(ids)
        self.stats["prefill_tokens"] = self.stats.get("prefill_tokens", 0) + int(out[1].shape[0])
        return out

    def _refresh_slots(self) -> None:
        """Upload the tier's slot table when experts moved since the last upload (same device buffer: the
        captured graph reads it at replay); first the waits asked for by :meth:`wait_before_next`."""
        if self.gpu:
            for ev in self._wait_next:
                self._stream.wait_event(ev)
            self._wait_next = []
        tier = getattr(self.rt, "tier", None)
        if not self.gpu or tier is None or tier.version == self._slot_version:
            return
        # through one of two pinned buffers (a truly asynchronous copy: the host does not wait for the step that
        # may still be running; the buffer's previous copy is waited for first, long done by then)
        import cupyx

        if self._slot_host is None:
            self._slot_host = [cupyx.empty_pinned(self.slot.shape, dtype=np.uint64) for _ in range(2)]
            self._slot_ev = [None, None]
        i = self._slot_i
        if self._slot_ev[i] is not None:
            self._slot_ev[i].synchronize()
        self._slot_host[i][...] = tier.slot_table()
        self.slot.set(self._slot_host[i], stream=self._stream)
        self._slot_ev[i] = self._stream.record()
        self._slot_i ^= 1
        self._slot_version = tier.version
        self.stats["slot_uploads"] = self.stats.get("slot_uploads", 0) + 1

    def next_token(self) -> int:
        """Arg-max of the last step's logits (on CuPy: waits for the step's copy-back, no further transfer)."""
        if self.gpu:
            self._wait_out()
            return int(self._out_host[:8].view(np.int64)[0])
        return int(self.next_token_dev)

    def read_step(self, back: int = 0) -> tuple[int, np.ndarray, np.ndarray]:
        """The outputs of the last step (``back`` 0) or of the step before it (``back`` 1): (arg-max token, routing
        ids [L, k] int32, weights [L, k] float32), host copies; waits for that step's copy-back only. Raises
        StrataError when that step has not run."""
        if back not in (0, 1):
            raise StrataError(f"read_step(back={back}): the decoder keeps the outputs of the last two steps")
        if self._seq_steps <= back:  # (a step of an earlier sequence does not count)
            raise StrataError("no decode step has run yet")
        L, k = self.cfg.n_layer, self.k
        if not self.gpu:
            got = self._last_np if back == 0 else self._prev_np
            return got[0], got[1].copy(), got[2].copy()
        buf, ev = (self._out_host, self._out_event) if back == 0 else self._prev_out
        ev.synchronize()
        return (int(buf[:8].view(np.int64)[0]), buf[8:8 + 4 * L * k].view(np.int32).reshape(L, k).copy(),
                buf[8 + 4 * L * k:].view(np.float32).reshape(L, k).copy())

    def _wait_out(self) -> None:
        if self._out_event is None:
            raise StrataError("no decode step has run yet")
        self._out_event.synchronize()

    def routing(self, account: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """The last step's routing, host arrays ids [L, k] int32 and weights [L, k]; with ``account`` also the
        bookkeeping (:meth:`account`) for this one position."""
        if self.gpu:
            self._wait_out()
            L, k = self.cfg.n_layer, self.k
            ids = self._out_host[8:8 + 4 * L * k].view(np.int32).reshape(L, k).copy()
            w = self._out_host[8 + 4 * L * k:].view(np.float32).reshape(L, k).copy()
        else:
            ids, w = _to_host(self.ids).copy(), _to_host(self.weights).copy()
        if account:
            self.account(ids[None], w[None], np.array([self.pos - 1], dtype=np.int64))
        return ids, w

    def account(self, ids: np.ndarray, w: np.ndarray, positions: np.ndarray) -> None:
        """Feed T positions' routing (ids, weights [T, L, k]) to the tier's policy and the route hooks, layer-major
        (layer 0's records of every position, then layer 1's ...), the order in which the batched forward of
        :class:`stratatools.runtime.model.Qwen4ExpRuntime` meets them: a prompt fed token by token then counts
        the same hits as the CPU path's one batched prefill."""
        tier = getattr(self.rt, "tier", None)
        for il in range(self.cfg.n_layer):
            if tier is not None and hasattr(tier, "access_rows"):
                tier.access_rows(il, ids[:, il])  # the same counts; VRAM follows once a layer, not once a position
            elif tier is not None:
                for t in range(ids.shape[0]):
                    tier.access(il, ids[t, il].astype(np.int64))
            for hook in self.rt.route_hooks:
                hook(il, positions, ids[:, il], w[:, il])

    def capture(self) -> bool:
        """Capture the step body into CUDA graphs (CuPy only): ``graphs``, the pieces cut before the layers of
        :func:`graph_cuts` (one graph with ``STRATATOOLS_GRAPH_PARTS=1``), ``graph`` the first of them (set once
        captured); later :meth:`step` calls replay them in order.

        The body is run once eagerly first (compiles kernels, fills a private memory pool), with what it writes
        saved to host memory and restored around it (:meth:`_snapshot`: the recurrent states and the cache rows of
        the staged position, not the caches), then captured with every allocation served from that pool, so the
        pool holds the step's temporaries only (nothing that grows with ``max_ctx``).
        Returns False on numpy.
        """
        if not self.gpu:
            return False
        cp = self.cp
        self._pool = self._pool or cp.cuda.MemoryPool()
        cp.cuda.Device().synchronize()  # earlier work of any stream (prefill, load_state) is done
        with cp.cuda.using_allocator(self._pool.malloc), self._stream:
            saved = self._snapshot()
            self._body()
            self._stream.synchronize()
            self._restore(saved)
            self._stream.synchronize()
            self._pieces = []
            self._cut_at = set(graph_cuts(self.cfg.n_layer)) if self.fused else set()
            begin_capture(cp, self._stream)
            try:
                self._body()
            finally:
                self._cut_at = set()
                if self._stream.is_capturing():  # (a failed cut may have ended it: keep the first error)
                    self._pieces.append(self._stream.end_capture())
        cp.cuda.Device().synchronize()
        self.graphs, self._pieces = self._pieces, []
        self.graph = self.graphs[0]
        if getattr(self, "miss_fetch", "zero-copy") != "zero-copy":
            with self._stream:  # count replays only (not the eager run and the capture above)
                self.fetch_counters.fill(0)
        del saved
        return True

    def _written_pos(self) -> int:
        """The position the next :meth:`_body` writes (on CuPy the staged position on the device, which the
        kernels read; on numpy ``self.pos``)."""
        if self.gpu:
            self.cp.cuda.Device().synchronize()
            return int(self.pos_dev.get()[0])
        return int(self.pos)

    def _snapshot(self) -> list[tuple[Any, Any, np.ndarray]]:
        """Host copies of everything one :meth:`_body` at the staged position can write, as (buffer, row or None,
        copy): the GDN and PLE states whole (their size does not depend on ``max_ctx``); of the K/V and indexer
        key caches only the row of that position, of the block-key caches only the block it may complete. Nothing
        is allocated on the device, and the copies' size does not grow with ``max_ctx`` (a copy of the caches would
        stay in the graph's memory pool after the capture; see :meth:`capture`). Restored by :meth:`_restore`."""
        p = self._written_pos()
        out: list[tuple[Any, Any, np.ndarray]] = []
        for a in list(self.conv.values()) + list(self.ssm.values()) + list(self.ple_conv.values()):
            out.append((a, None, np.array(_to_host(a), copy=True)))
        rows = [(a, p) for a in list(self.kc.values()) + list(self.vc.values()) + list(self.ik.values())]
        rows += [(self.bk[il], (p + 1) // self.cfg.compress_ratios[il] - 1) for il in self.bk]
        for a, r in rows:
            if 0 <= r < int(a.shape[0]):
                out.append((a, r, np.array(_to_host(a[r]), copy=True)))
        return out

    def _restore(self, saved: list[tuple[Any, Any, np.ndarray]]) -> None:
        """Write back a :meth:`_snapshot` (on CuPy on the decoder's stream)."""
        for a, r, h in saved:
            view = a if r is None else a[r]
            if self.gpu:
                view.set(h, stream=self._stream)
            else:
                view[...] = h

    @staticmethod
    def snapshot_bytes(saved: list[tuple[Any, Any, np.ndarray]]) -> int:
        """Host bytes of a :meth:`_snapshot`."""
        return sum(int(h.nbytes) for _, _, h in saved)

    def state_buffer_bytes(self) -> int:
        """Bytes of the decoder's static state buffers (GDN conv/recurrent states, PLE conv states, K/V caches, QSA
        indexer and block-key caches and, on CuPy, the split attention's scratch and the QSA selection scratch): what
        :func:`stratatools.runtime.device.cache_bytes` plans for ``max_ctx`` positions."""
        n = sum(int(a.nbytes) for a in self._mutable())
        if self.gpu:
            n += int(self.att_sc.nbytes + self.att_part.nbytes)
        if self.gpu and self.long:
            n += sum(int(a.nbytes) for a in (self.q_scores, self.q_flags, self.q_pairs, self.q_cells))
        return n

    def _mutable(self) -> list:
        """Buffers the step changes (the warm-up run before a capture writes them; they are restored)."""
        return (list(self.conv.values()) + list(self.ssm.values()) + list(self.ple_conv.values())
                + list(self.kc.values()) + list(self.vc.values()) + list(self.ik.values()) + list(self.bk.values()))

    def synchronize(self) -> None:
        """Wait for the decoder's CUDA stream to finish (no-op on the CPU path)."""
        if self.gpu:
            self._stream.synchronize()
