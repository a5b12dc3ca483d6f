"""Batched decode with continuous batching (``stratatools run --batch N``).

:class:`BatchDecoder` holds the state of up to N sequences ("places") with a leading place axis (K/V caches
[N, max_ctx, kv heads, head dim], GDN conv states [N, K-1, C] and recurrent states [N, v heads, dk, dv], PLE conv
states [N, span, hc n]; per place on the host: position and PLE n-gram context) and runs one decode position of
every active place as one batched forward (:meth:`BatchDecoder.step`), the same numerics as one
:meth:`stratatools.runtime.gpu.decode.StaticDecoder.step` per sequence, in float32:

* every per-token part (embedding rows, hyper-connection mixing/inject and norms, the dense projections, the
  router, the shared expert, the output head) is the batched prefill's code (:class:`ChunkPrefill`, of which
  :class:`BatchDecoder` is a subclass) over the N tokens: on CuPy one dequantize-to-float32 + SGEMM per matrix
  for all N tokens (``STRATATOOLS_BATCH_GEMM=mma``: the tensor-core GEMMs from the quantized matrices; ``hgemm``: the
  prefill's fp16 hi/lo cuBLAS GEMMs, :func:`stratatools.runtime.gpu.qmm.hgemm`); with numpy the float32 matrices of
  :meth:`Weights.get`;
* routed experts: on CuPy the per-(token, expert) job kernels (:func:`stratatools.runtime.gpu.experts.expert_ffn`,
  pipelined when every expert is resident, else staged rows, as the batch-1 decoder chooses (with
  ``STRATATOOLS_BATCH_GEMM=mma`` or ``hgemm`` the prefill's tensor-core jobs of one expert and its tokens); one job
  per routed
  entry, blob addresses from the tier's slot table: a VRAM slot, or the mapped pinned host arena for an expert not
  resident); with numpy the prefill's grouped path over ``expert_fn``;
* the gated DeltaNet: the causal conv over each place's [conv state; token] and one delta-rule step for every
  place at once (on CuPy ``gdn_prep.cu``'s conv/norm kernel with each place a sequence of one row, ``pf_gdn_chunk``
  with the places folded into the head axis, then ``gdn_prep.cu``'s output norm and gate: three launches per layer);
* attention: each query over its own place's cache, positions ``0 .. pos``: on CuPy ``attn_batch.cu`` (q/k norms,
  rope and the cache rows in one launch, each query over its place's positions with the output gate in another;
  ``STRATATOOLS_BATCH_ATTN=0`` or a layer where QSA selects cells: the array code), else one masked batched product
  (the places' lengths differ; columns past a place's position are masked out).

A sequence enters a place after its prompt ran through the :class:`StaticDecoder`'s batched prefill
(:meth:`BatchDecoder.admit` copies the decoder's state into the place). :func:`run_batched` is the scheduler: the
first N prompts fill the places; every step feeds each active place its last token; a sequence that stops (EOS
or ``max_new_tokens``) frees its place, which the next prompt takes (its prefill runs, then it joins the next
step).

Tier and trace (docs/cache-model.md "Batched decode"): a prefill is one round (as at batch 1); a batched step
makes one round per active place, in ascending place order: that place's routed entries, layer-major (layer 0 ..
L-1), then the tier's end of round. The trace records them in that order (each decode position a record of its
own request, outside every window), so ``stratatools simulate`` on it replays the same rounds and counts the same
hits. The tier's residency seen by the device is refreshed between steps (as between batch-1 steps).

QSA: on a long-context decoder each place keeps its raw indexer keys and pooled block keys; past the
full-selection range the attended cells of each place are chosen on the host as the prefill chooses them (a mask
over the batched product).

CUDA graph (CuPy): a step of all N places in place order (what continuous batching runs while the queue lasts)
replays one captured graph; the eager step launched about 90 kernels a layer from Python, so the device waited for
the host most of the step. What changes from step to step enters through buffers filled before the replay
(:meth:`BatchDecoder._stage_static`: positions, embedding rows, rope tables, PLE rows; the tier's slot table as at
batch 1), the attention kernels size their scores for ``max_ctx`` positions, and the step's temporaries come from a
memory pool of the graph's own. The first such step runs eagerly from those buffers (its result is the step's) and
is then captured. Eager instead: a step of some of the places, a long-context decoder (QSA selection on the host),
the timed breakdown, ``STRATATOOLS_BATCH_GRAPH=0``, or a capture that failed (``stats["graph_error"]``).

Device staging and queued steps (CuPy, :data:`DEV_STAGE_ENV`): the graph's first launch (``stage_step.cu``
``stage_steps``) makes the embedding, PLE and rope rows from each place's token, position and PLE context, and its
last ones write the step's arg-max and the next positions back into those buffers; the host uploads 32 tokens,
positions and contexts instead of the rows (0.8 ms of host time a step at 32 places, H200). So a step can be launched
from the step before's tokens without the host reading them (:meth:`BatchDecoder.launch` / :meth:`collect`, two
queued at most): the device runs step t+1 while the host reads and accounts step t, and a step's wall time is its
device time.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.runtime.model import RoutingRecord, _rmsnorm, _softmax, _to_host

from stratatools.runtime.gpu.prefill import (GDN_STEP_MAX_DK, ChunkPrefill, _same_memory, attn_module,
                                             gdn_chunk_shared, gdn_step_cols, gdn_step_early, gdn_step_rw_launch)


#: ``0`` keeps the batched step's attention as array code (masked batched products; the earlier path, for
#: comparisons); default: ``attn_batch.cu``'s kernels where QSA does not select cells.
ATTN_KERNELS_ENV = "STRATATOOLS_BATCH_ATTN"


def attn_kernels_enabled() -> bool:
    """Does the batched step run its attention through ``attn_batch.cu`` (:data:`ATTN_KERNELS_ENV`, default yes)?"""
    import os

    return os.environ.get(ATTN_KERNELS_ENV, "1") != "0"


def _attn_module() -> Any:
    """``attn_batch.cu`` (:func:`stratatools.runtime.gpu.prefill.attn_module`; a name of this module, which the host
    tests replace by the host build)."""
    return attn_module()


#: ``0`` runs every batched step eagerly; default: a step of all N places replays a CUDA graph (module docstring).
GRAPH_ENV = "STRATATOOLS_BATCH_GRAPH"


def graph_enabled() -> bool:
    """May the batched step replay a CUDA graph (:data:`GRAPH_ENV`, default yes)?"""
    import os

    return os.environ.get(GRAPH_ENV, "1") != "0"


#: ``0`` stages the graph step's token-dependent inputs on the host (embedding and PLE rows dequantized there, rope
#: rows computed there, one upload); default: ``stage_step.cu``'s ``stage_steps`` writes them on the device at the
#: start of the graph from the places' tokens, positions and PLE contexts, where the decoder can stage
#: (:meth:`stratatools.runtime.gpu.decode.StaticDecoder.device_stage_ready`). Queued steps need it.
DEV_STAGE_ENV = "STRATATOOLS_BATCH_DEV_STAGE"


def dev_stage_enabled() -> bool:
    """May the batched graph step stage its inputs on the device (:data:`DEV_STAGE_ENV`, default yes)?"""
    import os

    return os.environ.get(DEV_STAGE_ENV, "1") != "0"


#: Steps :meth:`BatchDecoder.launch` may have queued (launched, not yet collected) at once.
QUEUE_DEPTH = 2
#: Threads of a ``stage_steps`` block (a block a place).
STAGE_STEPS_THREADS = 512

#: Dense matrices up to this many float32 bytes are kept dequantized by the batched step on CuPy (each once).
SMALL_F32_BYTES = 8 << 20
#: At most this many bytes of such matrices in all (planned by :func:`stratatools.runtime.device.plan_vram`).
SMALL_F32_TOTAL = 256 << 20


class BatchDecoder(ChunkPrefill):
    """Batched decode steps over N places (module docstring).

    Args:
        dec: the :class:`StaticDecoder` whose prefill fills a place (its weights, buffers layout and ``max_ctx``).
        n_places: N, the most sequences decoded together (1..).
    Raises:
        StrataError: ``n_places`` below 1; a decoder whose context reaches past QSA's full-selection range.
    """

    #: the step's expert jobs hold one or two tokens an expert: their size from STRATATOOLS_BATCH_JOB
    _batch_step = True

    def __init__(self, dec: Any, n_places: int):
        if n_places < 1:
            raise StrataError(f"--batch {n_places}: the batch size must be at least 1")
        from stratatools.runtime.gpu.qmm import batch_gemm

        # the step's own GEMM switch (STRATATOOLS_BATCH_GEMM): 32 rows a GEMM are not the prefill's 512
        super().__init__(dec, chunk=max(1, int(n_places)), group=8, gemm=batch_gemm() if dec.gpu else "sgemm")
        cfg, xp = self.cfg, self.xp
        N = self.n = int(n_places)
        self.conv, self.ssm, self.kc, self.vc, self.ple_conv = {}, {}, {}, {}, {}
        for il in range(cfg.n_layer):
            if cfg.recurrent[il]:
                self.conv[il] = xp.zeros((N,) + tuple(dec.conv[il].shape), dtype=xp.float32)
                self.ssm[il] = xp.zeros((N,) + tuple(dec.ssm[il].shape), dtype=xp.float32)
            else:
                self.kc[il] = xp.zeros((N,) + tuple(dec.kc[il].shape), dtype=xp.float32)
                self.vc[il] = xp.zeros((N,) + tuple(dec.vc[il].shape), dtype=xp.float32)
        for il in cfg.ple_layers:
            self.ple_conv[il] = xp.zeros((N,) + tuple(dec.ple_conv[il].shape), dtype=xp.float32)
        # QSA indexer caches (a long-context decoder): raw keys [N, max_ctx, dih], pooled block keys [N, blocks, dih]
        self.ik = {il: xp.zeros((N,) + tuple(a.shape), dtype=xp.float32) for il, a in dec.ik.items()}
        self.bk = {il: xp.zeros((N,) + tuple(a.shape), dtype=xp.float32) for il, a in dec.bk.items()}
        self.pos = np.zeros(N, dtype=np.int64)
        self.ple_ctx = [np.array(dec.ple_ctx, copy=True) for _ in range(N)]
        self.stats: dict[str, Any] = {"steps": 0, "tokens": 0, "static_steps": 0, "graph_steps": 0}
        #: run a step of all places through the static input buffers the graph reads (:meth:`_step_static`); set on
        #: CuPy when a graph may be used, settable on numpy (no capture there: the same code eagerly, for tests)
        self.static_inputs = bool(self.gpu and graph_enabled())
        self._gin: dict[str, Any] | None = None  # the static input buffers
        self._pin: dict[str, Any] | None = None  # their pinned host buffer and its device copy (CuPy)
        self._graph: Any = None
        self._gpool: Any = None
        self._gout: tuple[Any, Any] | None = None
        self._in_static = False  # inside the static body: PLE rows, attention sizes and GEMMs for the graph
        self._dstage: Any = None  # device staging (stage_steps), made at the first static step that stages there
        #: may the graph step stage on the device (:data:`DEV_STAGE_ENV`, the decoder's tables), and why not
        self._dstage_ok = ((False, f"{DEV_STAGE_ENV}=0") if not dev_stage_enabled() else
                           dec.device_stage_ready() if dec.gpu else (False, "device staging needs CuPy"))
        self._queue: deque = deque()  # queued steps (launch / collect), oldest first
        self._rb: list[dict] | None = None  # pinned read-back slots of queued steps
        self._rb_i = 0
        self._dev_live = False  # the device holds the next step's tokens, positions and PLE contexts
        self._last_nxt: np.ndarray | None = None  # the last collected step's tokens (the next step's inputs)
        self._small_w: dict[str, Any] = {}
        self._small_w_bytes = 0
        if self.gpu:
            cp = self.cp
            L, k = cfg.n_layer, self.k
            self._ids_dev = cp.zeros((L, N, k), dtype=cp.int32)
            self._w_all = cp.zeros((L, N, k), dtype=cp.float32)
            self._hbuf = cp.empty(N * k * max(ly.ff for ly in self.rt.tier.arena.layers), dtype=cp.float32)
            self._tok_cache: dict[int, tuple[Any, Any]] = {}
            self._ones: dict[int, Any] = {}  # T -> float32 [T, 1] ones (the shared expert's sum after expert_ffn)
            from stratatools.runtime.gpu.experts import decoder_expert_kernels

            # the routed experts' kernels, as the batch-1 decoder chooses them: pipelined when the tier holds every
            # expert, staged when misses are read over the bus (experts.decoder_expert_kernels)
            full = getattr(self.rt.tier.policy, "policy", None) == "all-resident"
            self._kernels_routed = decoder_expert_kernels(full)[0]
            from stratatools.runtime.gpu.experts import moe_int8

            self._moe_int8 = moe_int8()  # read once: the captured step and the eager steps run the same kernels

    def _weight(self, name: str) -> Any:
        """Matrix ``name`` as float32 [rows, cols]: the prefill's (dequantized now, transient), except that on CuPy
        matrices of at most :data:`SMALL_F32_BYTES` as float32 are kept once dequantized (hyper-connection, router,
        GDN gate matrices: every step needs them and they are small), up to :data:`SMALL_F32_TOTAL` bytes in all."""
        if not self.gpu:
            return super()._weight(name)
        got = self._small_w.get(name)
        if got is not None:
            return got
        W = super()._weight(name)
        if self._keep_small(int(W.size) * 4):
            self._small_w[name] = W
        return W

    def _keep_small(self, nb: int) -> bool:
        """May a float32 matrix of ``nb`` bytes join the kept small matrices (:data:`SMALL_F32_BYTES` each,
        :data:`SMALL_F32_TOTAL` in all)? Counts it in when so."""
        if nb > SMALL_F32_BYTES or self._small_w_bytes + nb > SMALL_F32_TOTAL:
            return False
        self._small_w_bytes += nb
        return True

    def _dequant(self, raw: Any, t: Any, rows: int, cols: int) -> Any:
        """A matrix's device bytes as float32 [rows, cols] through :func:`stratatools.runtime.gpu.dequant.dequantize`
        (bit-identical to the numpy dequantizer, as the prefill's ``pf_dequant_blobs``; its kernels are the decoder's
        reference module): no pointer table is uploaded per matrix, a host-to-device copy the eager step would make
        for every matrix of every step."""
        from stratatools.runtime.gpu.dequant import dequantize
        from stratatools.runtime.gpu.prefill import _Q8RRows

        if isinstance(raw, _Q8RRows):  # the fused step's re-laid-out Q8_0 matrix
            return super()._dequant(raw, t, rows, cols)
        return dequantize(raw, t, rows * cols).reshape(rows, cols)

    def _raw_dev(self, name: str) -> tuple[Any, Any, int, int]:
        """The prefill's device bytes of a dense matrix, uploaded once: the decoder's own copy (its quantized
        matvec's; made now when its step never ran), else a copy kept here (types the matvec does not take)."""
        dec = self.dec
        if name not in dec._raw and not any(name in key for key in dec._raw_groups):
            raw, t, rows, cols = dec._dense_raw(name)
            if raw is None:
                own = getattr(self, "_own_raw", None)
                if own is None:
                    own = self._own_raw = {}
                if name not in own:
                    tt = self.w.model.tensor(name)
                    own[name] = self.cp.asarray(np.ascontiguousarray(np.asarray(self.w.model.raw(tt))).reshape(-1))
                return own[name], t, rows, cols
        return super()._raw_dev(name)

    def state_bytes(self) -> int:
        """Device (or host, numpy) bytes of the places' state buffers and of the small matrices kept as float32."""
        return self._small_w_bytes + int(sum(int(a.nbytes) for d in (self.conv, self.ssm, self.kc, self.vc, self.ple_conv, self.ik, self.bk)
                       for a in d.values()))

    # -- places ---------------------------------------------------------------------------------------
    def admit(self, place: int) -> None:
        """Copy the decoder's sequence (after its prefill) into ``place``: caches up to its position, GDN and PLE
        states, PLE context, position."""
        dec = self.dec
        if not 0 <= place < self.n:
            raise StrataError(f"place {place} is outside 0..{self.n - 1}")
        self._queue_empty("admit a sequence")
        self._dev_live = False  # (the place's position and PLE context change on the host)
        if self.gpu:
            dec.synchronize()
        P = int(dec.pos)
        for il in self.conv:
            self.conv[il][place] = dec.conv[il]
            self.ssm[il][place] = dec.ssm[il]
        for il in self.kc:
            self.kc[il][place, :P] = dec.kc[il][:P]
            self.vc[il][place, :P] = dec.vc[il][:P]
        for il in self.ple_conv:
            self.ple_conv[il][place] = dec.ple_conv[il]
        for il in self.ik:
            self.ik[il][place, :P] = dec.ik[il][:P]
            nb = P // self.cfg.compress_ratios[il]
            self.bk[il][place, :nb] = dec.bk[il][:nb]
        self.ple_ctx[place] = np.array(dec.ple_ctx, dtype=np.int64, copy=True)
        self.pos[place] = P

    # -- the batched step -------------------------------------------------------------------------------
    def step(self, places: Iterable[int], tokens: Iterable[int]) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
        """One decode position of every place in ``places`` (distinct, any order) with its token.

        Returns (logits [n, vocab] float32 (device array on CuPy), greedy next tokens [n] int64, routing ids
        [n, L, k] int32, weights [n, L, k] float32; host arrays), row i for ``places[i]``. Each place's position
        advances by one.

        Raises:
            StrataError: no place, a repeated place, a token outside the vocabulary, a place at ``max_ctx``, queued
            steps not yet collected.
        """
        self._queue_empty("run a step")
        pl = np.asarray(list(places), dtype=np.int64)
        n = int(pl.size)
        if np.unique(pl).size != n or (n and (pl.min() < 0 or pl.max() >= self.n)):
            raise StrataError(f"places {pl.tolist()} must be distinct and within 0..{self.n - 1}")
        toks = self._check_tokens(tokens, n)
        pos = self.pos[pl].copy()
        self._check_positions(pos)
        if self.gpu:
            self.dec._refresh_slots()
            with self.dec._ordered():
                lg, nxt, i, w = self._step(pl, toks, pos)
        else:
            lg, nxt, i, w = self._step(pl, toks, pos)
        self.pos[pl] += 1
        self.stats["steps"] += 1
        self.stats["tokens"] += n
        return lg, nxt, i, w

    def _check_tokens(self, tokens: Iterable[int], n: int) -> np.ndarray:
        """``tokens`` as int64 [n]. Raises StrataError for no place, a count other than n or a token outside the
        vocabulary."""
        V = self.cfg.n_vocab
        toks = np.asarray(list(tokens), dtype=np.int64)
        if n == 0 or toks.size != n:
            raise StrataError(f"a batched step needs one token per place ({n} places, {toks.size} tokens)")
        if toks.min() < 0 or toks.max() >= V:
            raise StrataError(f"token id {int(toks[(toks < 0) | (toks >= V)][0])} is outside the vocabulary [0, {V})")
        return toks

    def _check_positions(self, pos: np.ndarray) -> None:
        if pos.max() >= self.dec.max_ctx:
            raise StrataError(f"position {int(pos.max())} is past the static decoder's {self.dec.max_ctx} positions")

    def _queue_empty(self, what: str) -> None:
        if self._queue:
            raise StrataError(f"cannot {what} while {len(self._queue)} queued step(s) are not collected: "
                              f"call collect() first")

    def _step(self, pl: np.ndarray, toks: np.ndarray, pos: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
        if self._static_ok(pl):
            return self._step_static(pl, toks, pos)
        self._dev_live = False
        cfg, xp = self.cfg, self.xp
        n, L, k = int(pl.size), cfg.n_layer, self.k
        self._places(pl, pos)
        self._tic("embed")
        x0 = self._rows("token_embd.weight", toks)
        H = xp.concatenate([x0] * cfg.hc_count, axis=-1)  # [n, hc n]
        cos, sin = self.rt.rope.cos_sin(pos)
        ple_rows = self._ple_rows_b(toks, pl) if cfg.ple_layers else {}
        ids_out = np.zeros((n, L, k), dtype=np.int32)
        w_out = np.zeros((n, L, k), dtype=np.float32)
        H = self._layers(H, ple_rows, ids_out, w_out, pos, cos, sin)  # the prefill's trunk, per-place methods below
        self._tic("head")
        out_in, _ = self._hc("output_hc", H, inject=False)
        lg = self._mm(xp.ascontiguousarray(out_in, dtype=xp.float32), "output.weight")  # [n, vocab]
        nxt = xp.argmax(lg, axis=-1)
        self._tic("readback")
        if self.gpu:
            ids_out = np.ascontiguousarray(np.transpose(self.cp.asnumpy(self._ids_dev[:, :n]), (1, 0, 2)))
            w_out = np.ascontiguousarray(np.transpose(self.cp.asnumpy(self._w_all[:, :n]), (1, 0, 2)))
        nxt = np.asarray(_to_host(nxt), dtype=np.int64).reshape(-1)
        self._tic("end")
        return lg, nxt, ids_out, w_out

    # -- the graph step ------------------------------------------------------------------------------------
    def _static_ok(self, pl: np.ndarray) -> bool:
        """Does this step run through the static buffers (and on CuPy a graph)? Every place in order, no timed
        breakdown, a decoder without host-side QSA selection, and attention that stays on ``attn_batch.cu``'s
        kernels at every position up to ``max_ctx`` (module docstring)."""
        if not self.static_inputs or self.timing is not None or "graph_error" in self.stats:
            return False
        if pl.size != self.n or not (pl == np.arange(self.n)).all():
            return False
        ok = getattr(self, "_static_layers_ok", None)
        if ok is None:
            ok = self._static_layers_ok = self._static_layers()
        return ok

    def _static_layers(self) -> bool:
        """The position-independent part of :meth:`_static_ok`: no long-context decoder, and every attention layer
        on ``attn_batch.cu`` (kernels on, norm weights per head or per tensor, heads of at most 1,024 values, the
        scores of ``max_ctx`` positions within :data:`stratatools.runtime.gpu.prefill.ATTN_B_MAX_SHARED`); on numpy only the first."""
        cfg, dec = self.cfg, self.dec
        if dec.long:
            return False
        if not self.gpu:
            return True
        return attn_kernels_enabled() and all(self._attn_kernels_ok(il, dec.max_ctx) for il in range(cfg.n_layer)
                                              if not cfg.recurrent[il])

    def _stage_static(self, pl: np.ndarray, toks: np.ndarray, pos: np.ndarray) -> None:
        """Fill the static input buffers for a step of all places (host work and uploads, before a replay).

        Device staging (:meth:`_dev_stage`): only the places' tokens, positions and PLE contexts (each right-aligned,
        EOS in front of a short one, which hashes the same) go up; the graph's first launch (``stage_steps``) writes
        the embedding, PLE and rope rows from them; the host's PLE contexts advance as the device's do. Else the host
        makes those rows: places and positions (as :meth:`_places`), the token embedding rows, the rope tables and each
        PLE layer's rows (the places' PLE contexts advance). On CuPy through one pinned host buffer and one asynchronous
        copy on the decoder's stream (before the replay that reads them) into one device buffer whose views are the
        static buffers (separate uploads and device copies took 1.4 ms of host time a step at 32 places, H200,
        bench/gpu-notes.md); the copy of the step before is waited for before its buffer is written again."""
        cfg, n = self.cfg, self.n
        if self._dev_stage():
            self._upload_pinned({"pos_i32": np.asarray(pos, dtype=np.int32), "tok": np.asarray(toks, dtype=np.int64),
                                 "ctx": self._ctx_rows(pl)})
            if self._dstage is None:
                self._dstage_init()
            self._advance_ctx(pl, toks)
        else:
            cos, sin = self.rt.rope.cos_sin_host(pos)
            parts = {"pos_i32": np.asarray(pos, dtype=np.int32), "x0": self._rows_host("token_embd.weight", toks),
                     "cos": np.asarray(cos, dtype=np.float32), "sin": np.asarray(sin, dtype=np.float32)}
            if cfg.ple_layers:
                for il, r in self._ple_rows_b(toks, pl).items():
                    parts[("ple", il)] = self._rows_host("per_layer_token_embd.weight", r.reshape(-1)).reshape(n, -1)
            if self.gpu:
                self._upload_pinned(parts)
            else:
                if self._gin is None:
                    self._set_gin({k: np.empty_like(a) for k, a in parts.items()})
                for key, a in parts.items():
                    self._gin_part(key)[...] = a
        g = self._gin
        self._pl, self._all = pl, True
        self._pl_dev, self._pl_i32, self._pos_i32 = g["pl"], g["pl_i32"], g["pos_i32"]

    # -- device staging (stage_step.cu stage_steps) --------------------------------------------------------
    def _dev_stage(self) -> bool:
        """Does the graph step stage its inputs on the device? CuPy, static inputs, and at construction
        :data:`DEV_STAGE_ENV` on with a decoder that can stage (:meth:`StaticDecoder.device_stage_ready`;
        ``_dstage_ok`` keeps why not)."""
        return bool(self.gpu and self.static_inputs and self._dstage_ok[0])

    def _keep(self) -> int:
        """PLE context ids a place keeps (ple_ngram - 1 with PLE layers, else 0)."""
        cfg = self.cfg
        return max(cfg.ple_ngram - 1, 0) if cfg.ple_layers else 0

    def _ctx_rows(self, pl: np.ndarray) -> np.ndarray:
        """The places' PLE contexts as int64 [len(pl), max(keep, 1)], right-aligned, EOS in front of a short one."""
        from stratatools.runtime.gpu.decode import padded_context

        keep, eos = self._keep(), self.cfg.eos_id
        return np.stack([padded_context(self.ple_ctx[p], keep, eos) for p in pl.tolist()]).reshape(pl.size, -1)

    def _advance_ctx(self, pl: np.ndarray, toks: np.ndarray) -> None:
        """Each place's host PLE context after a step with its token (advanced once a PLE layer, as
        :meth:`_ple_rows_b` and ``stage_steps`` advance it)."""
        keep, n_pl = self._keep(), len(self.cfg.ple_layers)
        if not keep:
            return
        for p, t in zip(pl.tolist(), np.asarray(toks, dtype=np.int64).tolist()):
            c = np.concatenate([np.asarray(self.ple_ctx[p], dtype=np.int64).reshape(-1),
                                np.full(n_pl, t, dtype=np.int64)])
            self.ple_ctx[p] = c[-keep:].copy()

    def _dstage_init(self) -> None:
        """The device staging state (after the first upload made the token, position and context buffers): the
        device-only buffer whose views become the static x0, rope and PLE buffers, the rope tables of every position
        (Rope.cos_sin_host, so the rows are the host staging's bit for bit), the PLE constants with this buffer's
        offsets, the kernel and its arguments; the token and PLE tables are the decoder's (uploaded once)."""
        import types

        from stratatools.runtime.gpu.decode import stage_table_args
        from stratatools.runtime.gpu.kernels import cuda_source

        cp, cfg, dec, n, g = self.cp, self.cfg, self.dec, self.n, self._gin
        model = self.w.model
        dd = dec._dstage_init()  # (its token and PLE tables on the device, uploaded once)
        keep = self._keep()
        n_pl = len(cfg.ple_layers) if keep else 0
        nh = keep * cfg.ple_heads_per_ngram if n_pl else 0
        cos_t, sin_t = self.rt.rope.cos_sin_host(np.arange(dec.max_ctx))
        nr = int(cos_t.shape[1])
        ple_ne0 = int(model.tensor("per_layer_token_embd.weight").ne[0]) if n_pl else 1
        lay, off = {}, 0
        for key, size in [("x0", n * cfg.n_embd), ("cos", n * nr), ("sin", n * nr)] + [
                (("ple", il), n * nh * ple_ne0) for il in (cfg.ple_layers if n_pl else [])]:
            lay[key] = off
            off += -(-size // 64) * 64
        d = types.SimpleNamespace()
        with dec._stream:
            d.buf = cp.empty(off, dtype=cp.float32)
            d.cos, d.sin = cp.asarray(cos_t, dtype=cp.float32), cp.asarray(sin_t, dtype=cp.float32)
            tok, ple, prm, tail = stage_table_args(model, cfg, dd.tables,
                                                   [lay[("ple", il)] for il in cfg.ple_layers] if n_pl else [])
            d.prm = cp.asarray(prm)
            d.err = cp.zeros(1, dtype=cp.int32)
        d.kernel = cp.RawModule(code=cuda_source("stage_step.cu"), options=("--std=c++17",)).get_function("stage_steps")
        d.grid, d.block = (n,), (STAGE_STEPS_THREADS,)
        d.args = ((g["tok"], g["ctx"], np.int32(max(keep, 1)), g["pos_i32"], d.cos, d.sin, np.int32(dec.max_ctx),
                   np.int32(nr), np.int64(lay["cos"]), np.int64(lay["sin"]), d.buf, np.int64(lay["x0"]),
                   np.int64(cfg.n_embd)) + tok + (np.int32(cfg.n_embd), np.int64(nh * ple_ne0)) + ple
                  + (d.prm,) + tail + (d.err,))

        def view(key: Any, cols: int) -> Any:
            return d.buf[lay[key]:lay[key] + n * cols].reshape(n, cols)

        g["x0"], g["cos"], g["sin"] = view("x0", cfg.n_embd), view("cos", nr), view("sin", nr)
        g["ple"] = {il: view(("ple", il), nh * ple_ne0) for il in (cfg.ple_layers if n_pl else [])}
        self._dstage = d

    def stage_errors(self) -> int:
        """``stage_steps``' sticky error bits since device staging began (0 none; 1 a token outside the token table,
        2 a PLE row outside its table, 4 a position outside ``max_ctx``); waits for the decoder's stream. 0 where the
        step stages on the host."""
        if self._dstage is None:
            return 0
        self.dec._stream.synchronize()
        return int(self._dstage.err.get()[0])

    def _set_gin(self, bufs: dict) -> None:
        """The static input buffers from ``bufs`` (:meth:`_stage_static`'s keys: their arrays are kept), with the
        places' indices."""
        xp, n = self.xp, self.n
        self._gin = {"pl": xp.asarray(np.arange(n, dtype=np.int64)), "pl_i32": xp.asarray(np.arange(n, dtype=np.int32)),
                     **{k: v for k, v in bufs.items() if not isinstance(k, tuple)},
                     "ple": {k[1]: v for k, v in bufs.items() if isinstance(k, tuple)}}

    def _gin_part(self, key: Any) -> Any:
        return self._gin["ple"][key[1]] if isinstance(key, tuple) else self._gin[key]

    def _upload_pinned(self, parts: dict) -> None:
        """:meth:`_stage_static`'s upload on CuPy: ``parts`` (host arrays) into the pinned buffer (made at the first
        step, with the device buffer whose views become the static buffers), then one asynchronous copy."""
        import cupyx

        cp = self.cp
        st = self._pin
        if st is None:
            lay, off = {}, 0
            for key, a in parts.items():
                lay[key] = (off, a.shape, a.dtype)
                off += -(-a.nbytes // 256) * 256
            host = cupyx.empty_pinned(off, dtype=np.uint8)
            dev = cp.empty(off, dtype=cp.uint8)

            def views(buf: Any) -> dict:
                return {k: buf[o:o + int(np.prod(sh)) * np.dtype(dt).itemsize].view(dt).reshape(sh)
                        for k, (o, sh, dt) in lay.items()}

            st = self._pin = {"host": host, "dev": dev, "h": views(host), "ev": None}
            self._set_gin(views(dev))
        if st["ev"] is not None:
            st["ev"].synchronize()  # (the previous step's copy has read the pinned buffer)
        for key, a in parts.items():
            st["h"][key][...] = a
        s = self.dec._stream
        st["dev"].set(st["host"], stream=s)
        ev = st["ev"] = st["ev"] or cp.cuda.Event(disable_timing=True)
        ev.record(s)

    def _ple_emb(self, il: int, rows: Any, T: int) -> Any:
        if self._in_static:
            return self._gin["ple"][il]
        return super()._ple_emb(il, rows, T)

    def _body_static(self, pos: np.ndarray) -> tuple[Any, Any]:
        """The step of all places from the static buffers (what the graph holds): (logits [N, vocab], greedy next
        tokens [N]) on xp; the routing goes to ``_ids_dev`` / ``_w_all`` on CuPy. ``pos`` (host) only answers
        position-independent questions here (the attention's scores are sized for ``max_ctx``)."""
        xp, cfg, g = self.xp, self.cfg, self._gin
        n, L, k = self.n, cfg.n_layer, self.k
        d = self._dstage
        if d is not None:  # the token-dependent inputs from the places' tokens, positions and contexts
            d.kernel(d.grid, d.block, d.args)
        H = xp.concatenate([g["x0"]] * cfg.hc_count, axis=-1)
        ids_out = np.zeros((n, L, k), dtype=np.int32)
        w_out = np.zeros((n, L, k), dtype=np.float32)
        self._in_static = True
        try:
            H = self._layers(H, {il: None for il in cfg.ple_layers}, ids_out, w_out, pos, g["cos"], g["sin"])
            out_in, _ = self._hc("output_hc", H, inject=False)
            lg = self._mm(xp.ascontiguousarray(out_in, dtype=xp.float32), "output.weight")
            nxt = xp.argmax(lg, axis=-1)
            if d is not None:  # the next step's inputs: this step's tokens, the next positions (contexts: stage_steps)
                g["tok"][...] = nxt
                g["pos_i32"] += 1
        finally:
            self._in_static = False
        if not self.gpu:
            self._cpu_routing = (ids_out, w_out)
        return lg, nxt

    def _step_static(self, pl: np.ndarray, toks: np.ndarray, pos: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray,
                                                                                       np.ndarray]:
        """A step of all places through the static buffers: on CuPy the graph's replay (the first such step runs
        eagerly and is then captured, :meth:`_capture`) queued and collected at once; on numpy the same body eagerly.
        :meth:`_step`'s returns (the logits a copy, not the graph's buffer)."""
        if not self.gpu:
            self._stage_timed(pl, toks, pos)
            self.stats["static_steps"] += 1
            lg, nxt = self._body_static(pos)
            ids_out, w_out = self._cpu_routing
            return lg, np.asarray(nxt, dtype=np.int64).reshape(-1), ids_out, w_out
        self._enqueue(toks, pos, logits=True)
        return self._collect()

    def _stage_timed(self, pl: np.ndarray, toks: np.ndarray, pos: np.ndarray) -> None:
        t0 = time.perf_counter()
        self._stage_static(pl, toks, pos)
        self.stats["stage_s"] = self.stats.get("stage_s", 0.0) + (time.perf_counter() - t0)

    def _enqueue(self, toks: np.ndarray | None, pos: np.ndarray, logits: bool) -> None:
        """Queue a graph step of all places on the decoder's stream (CuPy): staged from ``toks`` (host), or from the
        device's tokens, positions and contexts (``toks`` None: the step before's), then its tokens and routing
        copied into a pinned read-back slot (and the logits into a device copy when asked); :meth:`_collect` takes
        them. Positions on the host are the caller's."""
        if self._rb is None:
            import cupyx

            n, L, k = self.n, self.cfg.n_layer, self.k
            self._rb = [{"nxt": cupyx.empty_pinned((n,), dtype=np.int64),
                         "ids": cupyx.empty_pinned((L, n, k), dtype=np.int32),
                         "w": cupyx.empty_pinned((L, n, k), dtype=np.float32)} for _ in range(QUEUE_DEPTH)]
        pl = np.arange(self.n, dtype=np.int64)
        if toks is not None:
            self._stage_timed(pl, toks, pos)
        self.stats["static_steps"] += 1
        if self._graph is None:
            lg, nxt = self._capture(pos)
        else:
            self._graph.launch(stream=self.dec._stream)
            lg, nxt = self._gout
            self.stats["graph_steps"] += 1
        s = self.dec._stream
        with s:
            lg = lg.copy() if logits else None  # (the graph's buffer is the next replay's output)
        slot = self._rb[self._rb_i]
        self._rb_i = (self._rb_i + 1) % QUEUE_DEPTH
        d2h = self.cp.cuda.runtime.memcpyDeviceToHost
        for key, src in (("nxt", nxt), ("ids", self._ids_dev), ("w", self._w_all)):
            dst = slot[key]
            self.cp.cuda.runtime.memcpyAsync(dst.ctypes.data, src.data.ptr, dst.nbytes, d2h, s.ptr)
        self._queue.append({"slot": slot, "ev": s.record(), "lg": lg, "fed": toks is None})
        self._dev_live = self._dstage is not None

    def _collect(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
        """The oldest queued step's (logits or None, tokens [n] int64, routing ids [n, L, k] int32, weights
        [n, L, k] float32), waiting for its copies; a step staged on the device advances the host's PLE contexts by
        its input tokens (the step before's)."""
        q = self._queue.popleft()
        t0 = time.perf_counter()  # (the wait: the step's device time and its host tail)
        q["ev"].synchronize()
        slot = q["slot"]
        # (copies: with one place or one layer the transposed slot is already contiguous, and a view of it would
        # change under the caller when a later step reuses the slot)
        nxt = np.array(slot["nxt"], dtype=np.int64)
        ids_out = np.transpose(slot["ids"], (1, 0, 2)).copy()
        w_out = np.transpose(slot["w"], (1, 0, 2)).copy()
        self.stats["wait_s"] = self.stats.get("wait_s", 0.0) + (time.perf_counter() - t0)
        if q["fed"]:
            self._advance_ctx(np.arange(self.n, dtype=np.int64), self._last_nxt)
        self._last_nxt = nxt.copy()
        return q["lg"], nxt, ids_out, w_out

    # -- queued steps ------------------------------------------------------------------------------------
    def queue_ready(self) -> tuple[bool, str]:
        """Can steps be queued (:meth:`launch`)? (True, "") or (False, the reason): they need the CuPy graph step
        with device staging (:data:`DEV_STAGE_ENV`, :meth:`StaticDecoder.device_stage_ready`), attention on the batch
        kernels (:meth:`_static_ok`), no failed capture, and every expert resident (a partial tier's moves follow each
        step's accounting, which queued steps run a step late)."""
        if not self.gpu or not self.static_inputs:
            return False, "queued steps need the CuPy graph step"
        if not self._dstage_ok[0]:
            return False, f"queued steps need device staging: {self._dstage_ok[1]}"
        if "graph_error" in self.stats:
            return False, f"the step's graph failed: {self.stats['graph_error']}"
        if not self._static_ok(np.arange(self.n)):
            return False, "the step runs eagerly (a long-context decoder, or attention outside the batch kernels)"
        if getattr(self.rt.tier.policy, "policy", None) != "all-resident":
            return False, "queued steps need every expert resident (--policy all-resident)"
        return True, ""

    @property
    def queued(self) -> int:
        """Steps launched and not yet collected."""
        return len(self._queue)

    def launch(self, tokens: Iterable[int] | None = None, logits: bool = False) -> None:
        """Queue one decode position of every place (0..N-1) without waiting for it; :meth:`collect` returns its
        results in launch order. ``tokens`` [N]: each place's token (staged from the host; the queue must be
        empty); None: the tokens of the step launched before (its arg-max, staged on the device without the host
        reading it), so step t+1 runs while the host still reads step t. Each place's position advances by one now.

        Raises:
            StrataError: :meth:`queue_ready` says no; :data:`QUEUE_DEPTH` steps queued; ``tokens`` None before any
            step of all places since the last :meth:`admit` or eager step; a bad token; a place at ``max_ctx``.
        """
        ok, why = self.queue_ready()
        if not ok:
            raise StrataError(why)
        if len(self._queue) >= QUEUE_DEPTH:
            raise StrataError(f"{QUEUE_DEPTH} steps are queued already: collect() one first")
        toks = None
        if tokens is not None:
            self._queue_empty("stage tokens from the host")
            toks = self._check_tokens(tokens, self.n)
        elif not self._dev_live:
            raise StrataError("the first queued step after an admission or a step of some places needs every "
                              "place's token (launch(tokens))")
        pos = self.pos.copy()
        self._check_positions(pos)
        self.dec._refresh_slots()
        with self.dec._ordered():
            self._enqueue(toks, pos, logits)
        self.pos += 1
        self.stats["steps"] += 1
        self.stats["tokens"] += self.n
        if toks is None:
            self.stats["queued_steps"] = self.stats.get("queued_steps", 0) + 1

    def collect(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
        """The oldest queued step's results, as :meth:`step` returns them (logits None unless launched with
        ``logits``); waits for that step. Raises StrataError when nothing is queued."""
        if not self._queue:
            raise StrataError("no queued step to collect: launch() one first")
        return self._collect()

    def _capture(self, pos: np.ndarray) -> tuple[Any, Any]:
        """Run the static body eagerly (this step's result; it compiles the kernels and fills the graph's own memory
        pool), then capture it (capturing runs nothing). A capture that fails leaves the eager result and makes
        later steps eager (``stats["graph_error"]``)."""
        from stratatools.runtime.gpu.kernels import begin_capture

        cp = self.cp
        s = self.dec._stream
        self._gpool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(self._gpool.malloc), s:
            lg, nxt = self._body_static(pos)
            s.synchronize()
            try:
                begin_capture(cp, s)
                try:
                    out = self._body_static(pos)
                finally:
                    graph = s.end_capture()
            except Exception as e:  # noqa: BLE001 - any capture failure: stay eager, say why in the stats
                self.stats["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                self._gpool = None
                return lg, nxt
        self._graph, self._gout = graph, out
        return lg, nxt

    # -- per-place state helpers ----------------------------------------------------------------------------
    def _places(self, pl: np.ndarray, pos: np.ndarray) -> None:
        """The step's places ``pl`` [n] and their positions ``pos`` [n], in the forms the layers read: host and
        device indices, int32 copies for the attention kernels (uploaded once a step), whether every place is active
        in order (``_take`` / ``_put`` then work on whole buffers)."""
        xp = self.xp
        self._pl = pl
        self._pl_dev = xp.asarray(pl)
        self._pl_i32 = xp.asarray(np.asarray(pl, dtype=np.int32))
        self._pos_i32 = xp.asarray(np.asarray(pos, dtype=np.int32))
        self._all = bool(pl.size == self.n and (pl == np.arange(self.n)).all())

    def _take(self, a: Any) -> Any:
        """The active places' rows of a per-place buffer (a view when every place is active in order)."""
        return a if self._all else a[self._pl_dev]

    def _put(self, a: Any, v: Any) -> None:
        if self._all:
            a[...] = v
        else:
            a[self._pl_dev] = v

    # -- PLE -------------------------------------------------------------------------------------------
    def _ple_rows_b(self, toks: np.ndarray, pl: np.ndarray) -> dict[int, np.ndarray]:
        """PLE row ids [n, heads] per PLE layer, each place's context advanced as one decode step advances it (after
        every PLE layer, as the token-by-token step does): all places at once
        (:meth:`~stratatools.runtime.model.Qwen4ExpRuntime.ple_ngram_ids_rows`)."""
        cfg, rt = self.cfg, self.rt
        keep = cfg.ple_ngram - 1
        toks = np.asarray(toks, dtype=np.int64).reshape(-1)
        P = int(toks.size)
        ctx = np.zeros((P, keep), dtype=np.int64)  # each place's context, right-aligned
        lens = np.zeros(P, dtype=np.int64)
        for r, p in enumerate(pl.tolist()):
            c = np.asarray(self.ple_ctx[p], dtype=np.int64).reshape(-1)[-keep:] if keep > 0 else ()
            lens[r] = len(c)
            if len(c):
                ctx[r, keep - len(c):] = c
        rows: dict[int, np.ndarray] = {}
        for il in cfg.ple_layers:
            rows[il] = rt.ple_ngram_ids_rows(toks, ctx, lens)
            if keep > 0:
                ctx = np.concatenate([ctx[:, 1:], toks[:, None]], axis=1)
                lens = np.minimum(lens + 1, keep)
        if keep > 0 and cfg.ple_layers:
            for r, p in enumerate(pl.tolist()):
                self.ple_ctx[p] = ctx[r, keep - int(lens[r]):].copy()
        return rows

    # -- per-place states of the prefill's GDN and PLE code -----------------------------------------------------
    def _conv_state(self, which: str, il: int) -> Any:
        """The active places' causal-conv states [places, history, C] (the prefill's hook; a place is a sequence of
        one row)."""
        return self._take((self.conv if which == "gdn" else self.ple_conv)[il])

    def _set_conv_state(self, which: str, il: int, st: Any) -> None:
        buf = (self.conv if which == "gdn" else self.ple_conv)[il]
        if not (self._all and _same_memory(buf, st)):  # (a launch that updated the buffer itself: nothing to copy)
            self._put(buf, st)

    def _gdn_core(self, il: int, q: Any, kn: Any, v: Any, beta: Any, decay: Any, T: int) -> Any:
        """One delta-rule step of every active place (:meth:`_gdn_step_b`; the prefill's hook)."""
        return self._gdn_step_b(il, q, kn, v, beta, decay)

    def _gdn_step_b(self, il: int, q: Any, kn: Any, v: Any, beta: Any, decay: Any) -> Any:
        """One delta-rule step of every active place (states ``self.ssm[il]`` updated): out [T, nv dv]. Key heads
        are repeated over the value heads (value head h reads key head h mod nk, as the prefill's tiling)."""
        cfg, xp = self.cfg, self.xp
        nk, dk, nv, dv = cfg.ssm_n_group, cfg.ssm_d_state, cfg.ssm_dt_rank, cfg.ssm_head_v_dim
        T = int(q.shape[0])
        rep = nv // nk
        S = self._take(self.ssm[il])  # [T, nv, dk, dv]
        if self.gpu and dk <= GDN_STEP_MAX_DK:
            # the state's rows in registers over a block's warps (prefill.cu pf_gdn_step_rw); places folded into the
            # head axis (head s nv + h is place s's head h), each value head reading its place's key head h mod nk
            # (no repeated copies of q and k)
            cp = self.cp
            S = cp.ascontiguousarray(S)
            out = cp.empty((T, nv * dv), dtype=cp.float32)
            H = T * nv
            gy, th = gdn_step_rw_launch(dk, dv)
            cols = gdn_step_cols() and H < 65536  # (grid y's limit)
            k = self.k_gdn_step_rwc if cols else self.k_gdn_step_rw
            if cols and _same_memory(S, self.ssm[il]):  # (the buffer itself: no kernel of the step but this writes it)
                k = {"0": k, "1": self.k_gdn_step_rwce, "cs": self.k_gdn_step_rwcs}[gdn_step_early()]
            k((gy, H) if cols else (H, gy), (th,), (
                cp.ascontiguousarray(q, dtype=cp.float32), cp.ascontiguousarray(kn, dtype=cp.float32), v,
                np.int32(H * dv), cp.ascontiguousarray(beta), cp.ascontiguousarray(decay), S, out, np.int32(1),
                np.int32(T * nk), np.int32(H), np.int32(dk), np.int32(dv), np.int32(nv), np.int32(nk)))
            if not self._all:
                self._put(self.ssm[il], S)
            return out
        qt = xp.tile(q, (1, rep, 1)) if rep > 1 else q  # [T, nv, dk]
        kt = xp.tile(kn, (1, rep, 1)) if rep > 1 else kn
        if self.gpu:
            cp = self.cp
            S = cp.ascontiguousarray(S)
            out = cp.empty((T, nv * dv), dtype=cp.float32)
            H = T * nv  # places folded into the head axis: head s nv + h is place s's head h, key head the same
            cw = dv
            threads = 256 if cw >= 32 else 128
            rs = max(1, threads // cw)
            shm = gdn_chunk_shared(dk, cw, rs)
            if shm > 96 * 1024:
                raise StrataError(f"layer {il}: GDN heads of {dk} x {dv} exceed the prefill kernel's shared memory")
            if shm > 48 * 1024 and getattr(self.k_gdn, "max_dynamic_shared_size_bytes", 0) < shm:
                self.k_gdn.max_dynamic_shared_size_bytes = shm
            self.k_gdn((H, 1), (threads,), (cp.ascontiguousarray(qt, dtype=cp.float32),
                                            cp.ascontiguousarray(kt, dtype=cp.float32), v, np.int32(H * dv),
                                            cp.ascontiguousarray(beta), cp.ascontiguousarray(decay), S, out,
                                            np.int32(1), np.int32(H), np.int32(H), np.int32(dk), np.int32(dv)),
                       shared_mem=shm)
            if not self._all:
                self._put(self.ssm[il], S)
            return out
        vv = v.reshape(T, nv, dv)
        St = S * decay[:, :, None, None]
        kv = np.sum(kt[:, :, :, None] * St, axis=2)  # [T, nv, dv]
        delta = (vv - kv) * beta[:, :, None]
        St = St + kt[:, :, :, None] * delta[:, :, None, :]
        out = np.sum(qt[:, :, :, None] * St, axis=2)
        self._put(self.ssm[il], St.astype(np.float32))
        return out.reshape(T, nv * dv).astype(np.float32)

    # -- attention -------------------------------------------------------------------------------------------
    def _attention(self, il: int, x: Any, pos: np.ndarray, cos: Any, sin: Any) -> Any:
        if self.gpu and attn_kernels_enabled():
            got = self._attention_kernels(il, x, pos, cos, sin)
            if got is not None:
                return got
        xp, cfg = self.xp, self.cfg
        T = x.shape[0]
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        p = f"blk.{il}."
        q, kk, v, gate = self._attn_qkv(il, x, cos, sin)
        posd = xp.asarray(pos)
        self.kc[il][self._pl_dev, posd] = kk
        self.vc[il][self._pl_dev, posd] = v
        allowed = self._allowed_b(il, x, pos, cos, sin)  # host bool [T, P] or None (causal only)
        P = int(pos.max()) + 1
        grp = nh // nkv
        if self._all:
            Kc, Vc = self.kc[il][:, :P], self.vc[il][:, :P]
        else:
            Kc, Vc = self.kc[il][self._pl_dev, :P], self.vc[il][self._pl_dev, :P]  # [T, P, nkv, hd]
        Kt = xp.transpose(Kc, (0, 2, 3, 1))  # [T, nkv, hd, P]
        Vt = xp.transpose(Vc, (0, 2, 1, 3))  # [T, nkv, P, hd]
        qh = q.reshape(T, nkv, grp, hd)
        sc = xp.matmul(qh, Kt) * xp.float32(hd ** -0.5)  # [T, nkv, grp, P]
        mask = np.arange(P)[None, :] <= pos[:, None]  # [T, P]
        if allowed is not None:
            mask &= allowed
        mask = xp.asarray(mask)
        sc = xp.where(mask[:, None, None, :], sc, xp.float32(-np.inf))
        att = _softmax(xp, sc, axis=-1)
        o = xp.matmul(att, Vt).reshape(T, nh * hd)  # [T, nkv, grp, hd]
        o = o * self._sigmoid_x(gate)
        return self._mm(xp.ascontiguousarray(o, dtype=xp.float32), p + "attn_output.weight")

    def _attention_kernels(self, il: int, x: Any, pos: np.ndarray, cos: Any, sin: Any) -> Any:
        """:meth:`_attention` on ``attn_batch.cu`` (CuPy): ``attn_prep_b`` (q/k norms, rope, each token's key and
        value rows into its place's caches), ``attn_decode_b`` (each query over its place's positions, output gate),
        the output projection. None (the caller runs the array code) where QSA selects cells in this layer, a norm
        weight is neither per head nor per tensor, a head exceeds 1,024 values or the scores of the longest place
        exceed :data:`stratatools.runtime.gpu.prefill.ATTN_B_MAX_SHARED`."""
        from stratatools.runtime.topk import qsa_selects_all

        cfg, dec = self.cfg, self.dec
        P = dec.max_ctx if self._in_static else int(pos.max()) + 1  # (the graph serves every position)
        if dec._qsa_layer(il) and not all(qsa_selects_all(self.rt.selection, cfg.compress_ratios[il], cfg.idx_budget,
                                                          int(pp)) for pp in pos):
            return None
        if not self._attn_kernels_ok(il, P):
            return None
        # the indexer caches of a long-context decoder between the two launches (no selection here)
        return self._attn_kernels(il, x, cos, sin, self.kc[il], self.vc[il], self._pl_i32, self._pos_i32, P,
                                  _attn_module(), lambda: self._allowed_b(il, x, pos, cos, sin))

    def _allowed_b(self, il: int, x: Any, pos: np.ndarray, cos: Any, sin: Any) -> np.ndarray | None:
        """QSA for one position of each place (the prefill's ``_allowed`` per place): on a long-context decoder,
        cache each place's raw indexer key and pool the block it completes; when some place is past the
        full-selection range, the attended cells per place (``Qwen4ExpRuntime._select``'s rule) as a host mask
        [T, max pos + 1]; else None."""
        from stratatools.runtime.topk import qsa_select_mask, qsa_selects_all

        dec, cfg, xp = self.dec, self.cfg, self.xp
        if not dec._qsa_layer(il):
            return None
        r, dih, budget = cfg.compress_ratios[il], cfg.idx_head_dim, cfg.idx_budget
        full = all(qsa_selects_all(self.rt.selection, r, budget, int(pp)) for pp in pos)
        if not dec.long:
            if not full:  # cannot happen: a decoder without the indexer stays in the full-selection range
                raise StrataError(f"position {int(pos.max())} is past the full-selection range of a decoder built "
                                  f"without QSA")
            return None
        p = f"blk.{il}.indexer."
        T = int(pos.size)
        kr = self._mm(x, p + "k_proj.weight")  # [T, dih]
        self.ik[il][self._pl_dev, xp.asarray(pos)] = kr
        done = np.nonzero((pos + 1) % r == 0)[0]
        if done.size:
            pls, b = self._pl[done], (pos[done] + 1) // r - 1
            cells = b[:, None] * r + np.arange(r)[None, :]
            raw = self.ik[il][xp.asarray(pls)[:, None], xp.asarray(cells)]  # [m, r, dih]
            pooled = _rmsnorm(xp, xp.mean(raw, axis=1), self._f32(p + "k_norm.weight"), cfg.eps)
            bc, bs = self.rt.rope.cos_sin(b * r)
            self.bk[il][xp.asarray(pls), xp.asarray(b)] = self.rt.rope.apply(pooled[:, None, :], bc, bs)[:, 0, :]
        if full:
            return None
        qi = self._mm(x, p + "q_proj.weight").reshape(T, -1, dih)
        qi = _rmsnorm(xp, qi, self._f32(p + "q_norm.weight"), cfg.eps)
        qi = self.rt.rope.apply(qi, cos, sin)
        P = int(pos.max()) + 1
        nbm = P // r
        if nbm > 0:
            bk = self.bk[il][self._pl_dev, :nbm]  # [T, nbm, dih]
            sc = xp.einsum("thd,tbd->tbh", qi, bk)
            scores = _to_host(xp.sum(xp.maximum(sc, 0), axis=-1) / xp.float32(math.sqrt(dih)))
        else:
            scores = np.zeros((T, 0), dtype=np.float32)
        return qsa_select_mask(self.rt.selection, scores, pos, r, budget, P)

    # -- MoE on the GPU -------------------------------------------------------------------------------------
    def _jobs_layout(self, T: int) -> tuple[Any, Any]:
        got = self._tok_cache.get(T)
        if got is None:
            cp, k = self.cp, self.k
            got = (cp.asarray(np.repeat(np.arange(T, dtype=np.int32), k)),
                   cp.asarray(np.arange(0, T * k + 1, k, dtype=np.int32)))
            self._tok_cache[T] = got
        return got

    def _moe(self, il: int, x: Any) -> tuple[Any, np.ndarray | None, np.ndarray | None]:
        """The MoE of the places' tokens: on CuPy :meth:`_moe_gpu` (the routing stays on the device and is read back
        once per step: (y, None, None)); on numpy the prefill's."""
        if self.gpu:
            T = int(x.shape[0])
            return self._moe_gpu(il, x, self._ids_dev[il, :T], self._w_all[il, :T]), None, None
        return super()._moe(il, x)

    def _routed_gpu(self, il: int, x: Any, ids: Any, w: Any, T: int, n: int, tail: Any = None) -> Any:
        """The routed experts of :meth:`_moe_gpu` for the T tokens x [T, n] (ids / w: their routing on the device):
        the prefill's tensor-core jobs where the layer has them, else the batch-1 decoder's expert kernels (and then
        the shared expert's ``tail`` added by one sum of weight 1)."""
        from stratatools.runtime.gpu.experts import ExpertJobs, expert_ffn

        cp, k = self.cp, self.k
        ly = self.rt.tier.arena.layers[il]
        if self.experts == "mma" and self._mma_experts_ok(il):
            # STRATATOOLS_BATCH_GEMM=mma / hgemm: the prefill's tensor-core jobs (an expert, its tokens), the job table
            # built on the device from the routing (nothing read back)
            return super()._routed_gpu(il, x, ids, w, T, n, tail)
        self._tic("experts")
        base = self.dec.slot[il][ids.reshape(-1)]  # uint64 [T k] blob addresses
        gb = np.uint64(ly.gate_bytes)
        tok, tstart = self._jobs_layout(T)
        jobs = ExpertJobs(base, base + gb, base + gb + gb, tok, cp.ascontiguousarray(w.reshape(-1)), tstart,
                          per_token=k)
        y = expert_ffn(x, jobs, ly.gu_type, ly.d_type, ly.hidden, ly.ff, hbuf=self._hbuf, fast=True,
                       kernels=self._kernels_routed, int8=self._moe_int8)
        if tail is None:
            return y
        ones = self._ones.get(T)
        if ones is None:
            ones = self._ones[T] = cp.ones((T, 1), dtype=cp.float32)
        return self._moe_sum(y, ones, T, n, tail, k=1)  # (1 y: y's own bits)

    def _router_gate_w(self, il: int) -> Any:
        """Layer ``il``'s router rows and the shared expert's gate row as one float32 [E + 1, n] matrix (one SGEMM a
        step for both), made once and kept with the other small float32 matrices (:data:`SMALL_F32_TOTAL`), where
        both are float matrices (F32 / F16 / BF16: an SGEMM's) of the same width; else None."""
        if not self.gpu:
            return None
        key = f"blk.{il}.router+shexp_gate"
        if key in self._small_w:
            return self._small_w[key]
        names = (f"blk.{il}.ffn_gate_inp.weight", f"blk.{il}.ffn_gate_inp_shexp.weight")
        W = None
        if all(self.w.model.tensor(nm).type.name in ("F32", "F16", "BF16") for nm in names):
            Wr, Wg = (ChunkPrefill._weight(self, nm) for nm in names)  # (transient: only the joined one is kept)
            if Wg.shape[0] == 1 and Wr.shape[1] == Wg.shape[1] and self._keep_small((int(Wr.size) + int(Wg.size)) * 4):
                W = self.cp.ascontiguousarray(self.cp.concatenate([Wr, Wg]), dtype=self.cp.float32)
        self._small_w[key] = W
        return W


@dataclass
class BatchedRequest:
    """One request's outcome in :func:`run_batched` (what :class:`stratatools.runtime.run.RequestResult` holds)."""

    request: int
    prompt_tokens: int
    new_ids: list[int] = field(default_factory=list)
    stop: str = "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_logits: Any = None


def run_batched(dec: Any, bd: BatchDecoder, prompts: list[list[int]], max_new_tokens: int, stop_id: int,
                tier: Any = None, on_record: Callable[[int, int, RoutingRecord], None] | None = None,
                on_done: Callable[[BatchedRequest], None] | None = None,
                keep_logits: bool = False) -> tuple[list[BatchedRequest], dict[str, float]]:
    """Greedy generation of every prompt with continuous batching over ``bd``'s places (module docstring).

    Per prompt, in file order as places free up: its prefill through ``dec`` (one round: ``tier.phase`` prefill,
    the records fed layer-major, ``tier.end_round()``), its first new token from the prefill's logits (as
    :func:`stratatools.runtime.model.generate`); then, while it runs, one position per batched step; each step's
    places are accounted in ascending place order, one round each. While every place holds a request and ``bd`` can
    queue steps (:meth:`BatchDecoder.queue_ready`), step t+1 is launched from the device's tokens before the host
    reads and accounts step t (each request's rounds the same; a request stopping at EOS is seen a step late: its
    place's row of the step queued behind is dropped, and the next prompt's prefill comes after that step, so the
    requests' rounds interleave differently from synchronous steps). ``on_record(request, phase, record)`` gets
    every forward's routing in the order the tier saw it (phase :data:`stratatools.traces.table.PREFILL` /
    ``DECODE``).

    Returns (per-request results in request order, totals: ``prefill_s``, ``decode_s`` (wall seconds of the
    batched steps; of a run of queued steps, from its first launch to its last collect, the host's accounting
    overlapped with the device's steps), ``decode_forwards`` (decode positions run), ``steps`` (steps with a running
    request), ``mean_active``).

    Raises:
        StrataError: an empty prompt, a negative ``max_new_tokens``, a context past the decoder's ``max_ctx``, a fault
        the device staging flagged (:meth:`BatchDecoder.stage_errors`).
    """
    from stratatools.traces.table import DECODE, PREFILL

    if max_new_tokens < 0:
        raise StrataError(f"--max-new-tokens {max_new_tokens} is negative")
    L = bd.cfg.n_layer
    results = [BatchedRequest(i, len(p)) for i, p in enumerate(prompts)]
    queue = list(range(len(prompts)))[::-1]
    place_req: list[int | None] = [None] * bd.n
    last_tok = [0] * bd.n
    t_join = [0.0] * bd.n
    tot = {"prefill_s": 0.0, "decode_s": 0.0, "decode_forwards": 0, "steps": 0, "active_sum": 0}

    def finish(pl: int, now: float) -> None:
        r = results[place_req[pl]]
        r.decode_s = now - t_join[pl]
        place_req[pl] = None
        if on_done is not None:
            on_done(r)

    def admit(pl: int) -> None:
        while queue and place_req[pl] is None:
            ri = queue.pop()
            ids = prompts[ri]
            if not ids:
                raise StrataError(f"prompt #{ri} is empty: nothing to run")
            r = results[ri]
            if tier is not None:
                tier.phase = "prefill"
            t0 = time.perf_counter()
            st = dec.rt.new_state()
            dec.load_state(st)
            lg, bi, bw = dec.prefill(ids)
            positions = np.arange(len(ids), dtype=np.int64)
            dec.account(bi, bw, positions)
            if tier is not None:
                tier.end_round()
                tier.phase = "decode"
            nxt = dec.rt.xp.argmax(lg)
            nxt = int(_to_host(nxt))
            t1 = time.perf_counter()
            r.prefill_s = t1 - t0
            tot["prefill_s"] += t1 - t0
            if keep_logits:
                r.first_logits = np.asarray(_to_host(lg), dtype=np.float32).copy()
            if on_record is not None:
                on_record(ri, PREFILL, RoutingRecord(positions, [bi[:, il].copy() for il in range(L)],
                                                     [bw[:, il].copy() for il in range(L)]))
            if max_new_tokens == 0:
                r.stop = "prefill"
                if on_done is not None:
                    on_done(r)
                continue
            r.new_ids.append(nxt)
            if nxt == stop_id or len(r.new_ids) >= max_new_tokens:
                r.stop = "stop" if nxt == stop_id else "length"
                if on_done is not None:
                    on_done(r)
                continue
            bd.admit(pl)
            place_req[pl] = ri
            last_tok[pl] = nxt
            t_join[pl] = t1

    def account(act: list[int], pos: np.ndarray, nxt: np.ndarray, ids: np.ndarray, w: np.ndarray, now: float) -> list:
        """A step's rows of the places in ``act`` that still hold a request: one round each (ascending place order),
        then their new tokens; returns the places whose request stopped."""
        live = [j for j, pl in enumerate(act) if place_req[pl] is not None]
        tot["steps"] += 1 if live else 0  # (a queued step after every place stopped ran for nobody)
        tot["active_sum"] += len(live)
        tot["decode_forwards"] += len(live)
        for j in live:  # one round per place, ascending place order
            pl = act[j]
            ri = place_req[pl]
            if tier is not None:
                tier.phase = "decode"
            p = pos[j:j + 1]
            dec.account(ids[j:j + 1], w[j:j + 1], p)
            if tier is not None:
                tier.end_round()
            if on_record is not None:
                on_record(ri, DECODE, RoutingRecord(p.copy(), [ids[j, il][None].copy() for il in range(L)],
                                                    [w[j, il][None].copy() for il in range(L)]))
        freed = []
        for j in live:
            pl = act[j]
            r = results[place_req[pl]]
            t = int(nxt[j])
            r.new_ids.append(t)
            last_tok[pl] = t
            if t == stop_id or len(r.new_ids) >= max_new_tokens:
                r.stop = "stop" if t == stop_id else "length"
                finish(pl, now)
                freed.append(pl)
        return freed

    def queued_run() -> list[int]:
        """Steps of every place queued one ahead (:meth:`BatchDecoder.launch`): the first fed from the host, each
        next launched from the device's tokens before the host reads the step before, while no request is due to
        stop by length and every position fits; a request that stops (EOS) is seen a step late, and that place's row
        of the step already queued is dropped. Returns the freed places."""
        act = list(range(bd.n))
        t0 = time.perf_counter()
        bd.launch([last_tok[pl] for pl in act])
        pending = [bd.pos[act] - 1]  # the queued steps' positions
        freed: list[int] = []
        while pending:
            due = any(len(results[place_req[pl]].new_ids) + len(pending) >= max_new_tokens
                      for pl in act if place_req[pl] is not None)
            if (not freed and not due and bd.pos.max() < bd.dec.max_ctx and len(pending) < QUEUE_DEPTH
                    and bd.queue_ready()[0]):  # (a capture that failed in this run's first launch: no more queueing)
                bd.launch()
                pending.append(bd.pos[act] - 1)
            _, nxt, ids, w = bd.collect()
            now = time.perf_counter()
            freed += account(act, pending.pop(0), nxt, ids, w, now)
        tot["decode_s"] += time.perf_counter() - t0
        return freed

    for pl in range(bd.n):
        admit(pl)
    while any(r is not None for r in place_req):
        act = [pl for pl in range(bd.n) if place_req[pl] is not None]
        if len(act) == bd.n and bd.queue_ready()[0]:
            freed = queued_run()
        else:
            pos = bd.pos[act].copy()
            t0 = time.perf_counter()
            lg, nxt, ids, w = bd.step(act, [last_tok[pl] for pl in act])
            t1 = time.perf_counter()
            tot["decode_s"] += t1 - t0
            freed = account(act, pos, nxt, ids, w, t1)
        for pl in freed:
            admit(pl)
    if bd.stage_errors():  # (tokens are checked before they reach the device: a fault of the staging itself)
        raise StrataError(f"the batched step's device staging flagged bad input (bits {bd.stage_errors()}: 1 a token, "
                          f"2 a PLE row, 4 a position out of range); set {DEV_STAGE_ENV}=0 to stage on the host")
    tot["mean_active"] = tot["active_sum"] / tot["steps"] if tot["steps"] else 0.0
    del tot["active_sum"]
    return results, tot
