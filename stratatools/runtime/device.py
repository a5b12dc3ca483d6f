"""Where ``stratatools run`` computes (``--device auto|cpu|gpu``) and how much device memory it may use
(``--vram-gib``).

:func:`resolve_device`: ``auto`` picks the GPU when CuPy imports and sees a CUDA device, else the CPU; ``gpu``
without them is a one-line error. :func:`plan_vram`: the device footprint of the GPU decode path (the quantized
dense weights as stored in the GGUF, small float32 vectors, K/V and recurrent caches, a fixed reserve for the
CUDA context, graph and memory pool, the batched prefill's temporaries) and, from what is left of ``--vram-gib``, the number of expert slots; or the
memory a requested ``--slots N`` needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stratatools.core.errors import StrataError

DEVICES = ("auto", "cpu", "gpu")
GIB = 1 << 30
#: Bytes set aside for what the plan does not itemise: CuPy's pool rounding, the graph's private pool, router
#: and FFN scratch, the CUDA context's own allocations. Measured peaks are reported next to the plan.
RESERVE_BYTES = 768 << 20
ALIGN = 256


def resolve_device(device: str) -> str:
    """``cpu`` or ``gpu`` for a ``--device`` value.

    Raises:
        StrataError: an unknown value; ``gpu`` when CuPy is missing or sees no CUDA GPU.
    """
    if device not in DEVICES:
        raise StrataError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        return "cpu"
    from stratatools.runtime import gpu

    ok = gpu.available()
    if device == "gpu" and not ok:
        raise StrataError("--device gpu: CuPy with a CUDA GPU is not available (pip install cupy-cuda12x or "
                          "cupy-cuda13x, check nvidia-smi), or use --device cpu")
    return "gpu" if ok else "cpu"


@dataclass
class VramPlan:
    """The GPU path's device memory, in bytes.

    Attributes:
        dense: quantized dense matrices (GGUF bytes, uploaded as stored) and float32 small tensors.
        caches: K/V caches of the attention layers for ``max_ctx`` positions, GDN and PLE states, and for long
            contexts the QSA indexer caches (raw keys, block keys) and selection/attention scratch.
        reserve: :data:`RESERVE_BYTES`.
        slot_bytes: bytes of one expert slot (largest layer's blob rounded up to 256).
        slots: expert slots that fit (or were asked for).
        budget: ``--vram-gib`` in bytes (None: no budget).
        prefill: the batched prefill's temporaries (:func:`prefill_bytes`).
        staging: the decode step's miss fetch staging
            (:func:`stratatools.runtime.gpu.decode.fetch_staging_bytes`; 0 in zero-copy mode). Planned whenever a
            fetch mode is set, also where every expert gets a slot (a cold LRU tier still misses while it fills).
        batch_step: ``run --batch N``: the batched step's temporaries held by its CUDA graph's own memory pool
            (:func:`batch_step_bytes`; 0 at batch 1 or with ``STRATATOOLS_BATCH_GRAPH=0``).
        stage_tables: where queued decode steps run (``STRATATOOLS_DECODE_QUEUE``, default ``auto``:
            :func:`stratatools.runtime.gpu.decode.queue_status`), the token and PLE embedding tables as stored, which
            the device staging of a step's inputs keeps in VRAM
            (:func:`stratatools.runtime.gpu.decode.stage_table_bytes`; 0 otherwise).
    """

    dense: int
    caches: int
    reserve: int
    slot_bytes: int
    slots: int
    budget: int | None
    prefill: int = 0
    staging: int = 0
    batch_step: int = 0
    stage_tables: int = 0

    @property
    def fixed(self) -> int:
        """Everything but the expert slots."""
        return self.dense + self.caches + self.reserve + self.prefill + self.staging + self.batch_step + self.stage_tables

    @property
    def total(self) -> int:
        """The planned footprint: fixed + slots."""
        return self.fixed + self.slots * self.slot_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"dense_bytes": self.dense, "cache_bytes": self.caches, "reserve_bytes": self.reserve,
                "prefill_bytes": self.prefill, "staging_bytes": self.staging, "batch_step_bytes": self.batch_step,
                "stage_tables_bytes": self.stage_tables,
                "slot_bytes": self.slot_bytes, "slots": self.slots, "planned_bytes": self.total,
                "budget_bytes": self.budget}


def dense_device_bytes(model: Any, cfg: Any, indexer: bool = False) -> int:
    """Bytes the GPU decode path keeps on the device for everything but routed experts: every trunk tensor as
    stored (quantized matrices are multiplied from their blocks), except the routed experts, the token and PLE
    embedding tables (rows are read on the host) and, unless ``indexer`` (contexts past the full-selection range,
    where the step runs QSA's indexer), the indexer's tensors; float32 for the rest is small (norms, biases,
    convolutions) and counted at 4 bytes a value."""
    total = 0
    for t in model.iter_tensors():
        name = t.name
        if "_exps." in name or name in ("token_embd.weight", "per_layer_token_embd.weight"):
            continue
        if ".indexer." in name and not indexer:
            continue
        if name.startswith("blk.") and int(name.split(".")[1]) >= cfg.n_layer:
            continue  # next-token-prediction block: not run
        n = 1
        for d in t.ne:
            n *= int(d)
        dims = sum(1 for d in t.ne if int(d) > 1)
        total += int(t.nbytes) if dims >= 2 else 4 * n
    return total


def long_context(cfg: Any, max_ctx: int, selection: str = "transformers") -> bool:
    """Whether the static decoder runs QSA's indexer and selection for ``max_ctx`` positions (past the range in
    which every cell is attended): see :class:`stratatools.runtime.gpu.decode.StaticDecoder`."""
    from stratatools.runtime.gpu.decode import max_full_context

    return max_ctx > max_full_context(cfg, selection)


def cache_bytes(cfg: Any, max_ctx: int, selection: str = "transformers") -> int:
    """K/V caches (float32, ``max_ctx`` positions) of the attention layers, GDN conv/recurrent states, PLE conv
    states of the static decoder, and the split attention's scratch
    (:func:`stratatools.runtime.gpu.decode.split_attention_bytes`); for long contexts (:func:`long_context`) also
    the QSA indexer caches and the selection scratch (:func:`stratatools.runtime.gpu.decode.qsa_cache_bytes`)."""
    n = 0
    for il in range(cfg.n_layer):
        if cfg.recurrent[il]:
            n += 4 * cfg.ssm_dt_rank * cfg.ssm_d_state * cfg.ssm_head_v_dim
            n += 4 * 8 * (2 * cfg.ssm_n_group * cfg.ssm_d_state + cfg.ssm_dt_rank * cfg.ssm_head_v_dim)
        else:
            n += 2 * 4 * max_ctx * cfg.n_head_kv * cfg.head_dim
    span = max(cfg.ple_conv_kernel - 1, 0) * cfg.ple_ngram
    n += 4 * span * cfg.hc_count * cfg.n_embd * len(cfg.ple_layers)
    from stratatools.runtime.gpu.decode import qsa_cache_bytes, split_attention_bytes

    # the CuPy step's split attention scratch, inside the QSA path's bytes for a long context
    n += qsa_cache_bytes(cfg, max_ctx) if long_context(cfg, max_ctx, selection) else split_attention_bytes(cfg, max_ctx)
    return n


def prefill_bytes(model: Any, cfg: Any, max_ctx: int) -> int:
    """Device bytes of the batched prefill's temporaries (:class:`stratatools.runtime.gpu.prefill.ChunkPrefill` with
    its default chunk, at most ``max_ctx`` tokens, and expert group): see
    :func:`stratatools.runtime.gpu.prefill.prefill_scratch_bytes`; the largest dense matrix is taken over the trunk's
    matrices other than the embedding tables and the output head (which runs as a matvec); the routed experts' share
    of the path ``STRATATOOLS_PREFILL_GEMM`` selects (``mma`` and ``hgemm``: the tensor-core jobs; the dense share,
    twice the largest matrix as float32, also covers ``hgemm``'s transient fp16 pair of 4 bytes a weight); twice that
    where the prefill's CUDA graph is on
    (:data:`stratatools.runtime.gpu.prefill.GRAPH_ENV`: the graph keeps a chunk's temporaries in a memory pool of its
    own)."""
    from stratatools.runtime.gpu.prefill import CHUNK, GROUP, graph_enabled, prefill_scratch_bytes
    from stratatools.runtime.gpu.qmm import prefill_gemm

    big = 0
    for t in model.iter_tensors():
        name = t.name
        if "_exps." in name or name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
            continue
        n = 1
        for d in t.ne:
            n *= int(d)
        big = max(big, n)
    ff, n = int(cfg.n_ff_exp), int(cfg.n_embd)
    one = prefill_scratch_bytes(cfg, 3 * ff * n * 4, min(CHUNK, max(1, int(max_ctx))), GROUP, big, int(max_ctx),
                                experts="mma" if prefill_gemm() in ("mma", "hgemm") else "rows")
    return 2 * one if graph_enabled() else one


def batch_step_bytes(model: Any, cfg: Any, batch: int, max_ctx: int) -> int:
    """Device bytes of one batched step's temporaries for ``batch`` places, as the graph's own pool keeps them
    (:class:`stratatools.runtime.gpu.batch.BatchDecoder`; the eager steps' temporaries come from the pool the prefill
    uses, planned by :func:`prefill_bytes`): :func:`stratatools.runtime.gpu.prefill.prefill_scratch_bytes` for a
    chunk of ``batch`` tokens, the largest dense matrix taken over the trunk and, where the step's GEMMs write a
    transient copy of it (``STRATATOOLS_BATCH_GEMM=sgemm``: float32, 8 bytes a weight planned; ``hgemm``: the fp16
    pair, 4 bytes a weight, within that; ``mma``: a head of a type the tensor-core kernels do not read, which is
    dequantized to float32 every step), the output head. 0 for ``batch`` <= 1 or with ``STRATATOOLS_BATCH_GRAPH=0``."""
    from stratatools.runtime.gpu.batch import graph_enabled
    from stratatools.runtime.gpu.prefill import GROUP, prefill_scratch_bytes
    from stratatools.runtime.gpu.qmm import batch_gemm, supports

    if batch <= 1 or not graph_enabled():
        return 0
    gemm = batch_gemm()
    skip = ("token_embd.weight", "per_layer_token_embd.weight")
    big = 0
    for t in model.iter_tensors():
        if "_exps." in t.name or t.name in skip:
            continue
        if (t.name == "output.weight" and gemm == "mma" and t.type.name in ("Q8_0", "Q2_0")
                and supports(t.type.name, int(t.ne[0]))):
            continue  # read quantized by the tensor-core kernels
        n = 1
        for d in t.ne:
            n *= int(d)
        big = max(big, n)
    ff, n = int(cfg.n_ff_exp), int(cfg.n_embd)
    return prefill_scratch_bytes(cfg, 3 * ff * n * 4, int(batch), GROUP, big, int(max_ctx),
                                 experts="mma" if gemm in ("mma", "hgemm") else "rows")


def plan_vram(model: Any, cfg: Any, blob_bytes: list[int], max_ctx: int, vram_gib: float | None,
              slots: int | None, n_expert_total: int, selection: str = "transformers", batch: int = 1) -> VramPlan:
    """Plan the GPU path's device memory.

    Args:
        model: the GGUF (:class:`stratatools.model.gguf.Model`); cfg: its runtime config.
        blob_bytes: routed-expert blob bytes per layer.
        max_ctx: positions the caches hold.
        vram_gib: the budget (None: none; then ``slots`` or every expert).
        slots: requested slot count (None: as many as fit, at most every expert).
        n_expert_total: routed experts of all layers together.
        selection: the QSA selection rule (decides where the full-selection range ends).
        batch: sequences decoded together (``run --batch``): above 1 the caches are planned for the decoder's own
            sequence (the prefill) and ``batch`` places of :class:`stratatools.runtime.gpu.batch.BatchDecoder`, plus
            the batched step's small float32 matrices (256 MiB at most) and its graph's temporaries
            (:func:`batch_step_bytes`).
    Returns:
        the :class:`VramPlan`.
    Raises:
        StrataError: a budget that is not a finite size > 0; a budget below the dense weights and caches; a
            ``slots`` request that does not fit (the message says how much memory it needs); an unknown
            ``STRATATOOLS_MISS_FETCH`` or ``STRATATOOLS_DECODE_QUEUE`` value.
    """
    sb = (max(blob_bytes) + ALIGN - 1) // ALIGN * ALIGN
    long = long_context(cfg, max_ctx, selection)
    caches = cache_bytes(cfg, max_ctx, selection) * (1 + int(batch) if batch > 1 else 1)
    if batch > 1:  # the batched step's small float32 matrices (stratatools.runtime.gpu.batch.SMALL_F32_TOTAL at most)
        caches += 256 << 20
    from stratatools.runtime.gpu.decode import fetch_staging_bytes, miss_fetch_mode, queue_status, stage_table_bytes

    # the token and PLE tables stay on the device when queued steps run (one sequence at a time: --batch has none)
    queued = int(batch) <= 1 and queue_status(model, cfg)[0]

    plan = VramPlan(dense_device_bytes(model, cfg, indexer=long), caches, RESERVE_BYTES,
                    sb, 0, None, prefill_bytes(model, cfg, max_ctx),
                    fetch_staging_bytes(miss_fetch_mode(), cfg.n_expert_used, sb, min(cfg.n_expert)),
                    batch_step_bytes(model, cfg, batch, max_ctx),
                    stage_table_bytes(model, cfg) if queued else 0)
    if vram_gib is None:
        plan.slots = n_expert_total if slots is None else int(slots)
        return plan
    if not (math.isfinite(vram_gib) and vram_gib > 0):
        raise StrataError(f"--vram-gib {vram_gib} is not a finite size > 0 (GiB)")
    budget = int(vram_gib * GIB)
    plan.budget = budget
    if plan.fixed > budget:
        parts = [("the dense weights", plan.dense), (f"caches for {max_ctx} positions", plan.caches),
                 ("prefill scratch", plan.prefill), ("miss staging", plan.staging),
                 ("the batched step", plan.batch_step), ("token and PLE tables", plan.stage_tables)]
        named = ", ".join(f"{what} ({n / GIB:.2f} GiB)" for what, n in parts if n or what == "the dense weights")
        raise StrataError(f"--vram-gib {vram_gib:g}: {named} and reserve ({plan.reserve / GIB:.2f} GiB) need "
                          f"{plan.fixed / GIB:.2f} GiB before any expert slot; give at least that")
    fit = (budget - plan.fixed) // sb
    if slots is not None:
        if slots > fit:
            need = plan.fixed + int(slots) * sb
            raise StrataError(f"--slots {slots} does not fit in --vram-gib {vram_gib:g}: it needs {need / GIB:.2f} GiB "
                              f"({plan.fixed / GIB:.2f} GiB dense weights, caches, prefill scratch and reserve + {slots} x {sb} bytes); "
                              f"at most {fit} slots fit")
        plan.slots = int(slots)
    else:
        plan.slots = int(min(fit, n_expert_total))
    return plan
