"""The GPU decode path of ``stratatools run --device gpu``: :class:`StaticDecoder` (CUDA graphs replayed per token,
quantized dense matvecs, experts through the tier's slot table) behind the ``forward``/``new_state`` interface
of :class:`stratatools.runtime.model.Qwen4ExpRuntime`, so that :func:`stratatools.runtime.model.generate` and
the run loop drive it unchanged.

A prompt (a call of more than one token) runs as a batched prefill (:meth:`StaticDecoder.prefill`: chunks of
tokens through SGEMMs over matrices dequantized one at a time, experts grouped by expert; no float32 copy of any
dense matrix is kept); with ``prefill="steps"`` (or ``STRATATOOLS_PREFILL=steps``) it is fed token by token through
the decode graph instead, each token's routing read back after its step. Either way the call's records are fed to
the tier layer-major at its end (:meth:`StaticDecoder.account`), the order of the CPU path's batched prefill, so
both count the same hits. During the prompt the tier's residency does not change (every expert is read from its
slot or from host memory).

Host work off the critical path (``lag``, the default): a one-token call launches its step first and only then does
the previous step's bookkeeping (:meth:`StaticDecoder.account`: the tier's policy, the route hooks, and the round
ends the caller asked for meanwhile, held by :meth:`GPUExpertTier.hold`) while the device runs, then waits for its
own step's copy-back. The policy sees the same calls in the same order (accesses of step t, end of round t, accesses
of step t+1, ...), so the hits counted do not change; only the VRAM moves a round ends lands one step later: they
are queued on the decoder's stream after the step already running (which still reads the old slot table: a slot
is refilled only after it), and the next step reads the new table. :meth:`finish` (called by
:func:`stratatools.runtime.model.generate` at its end) settles the last step. ``STRATATOOLS_DECODE_LAG=0`` turns it
off (bookkeeping right after each step, before the next launch; queued decoding is then off too). See
docs/cache-model.md.

Queued decode (``queue``; ``STRATATOOLS_DECODE_QUEUE``, default ``auto``: on for a GPU decoder whose token and PLE
tables fit :data:`stratatools.runtime.gpu.decode.QUEUE_AUTO_TABLE_BYTES`; ``0`` turns it off, and so do
``STRATATOOLS_DECODE_LAG=0`` and ``STRATATOOLS_ASYNC_SWAPS=1``): greedy decoding
(:func:`stratatools.runtime.model.generate` calls :meth:`DecoderRuntime.decode_queued`) launches step t+1 before it
reads step t: step t+1 takes step t's arg-max on the device (its token-dependent inputs are staged by a kernel), so
the device never waits for the host between steps. The host then reads step t's token and routing and does its
bookkeeping while step t+1 runs, in the order of ``lag`` (accesses of step t, end of round t, then step t+1), so the
policy, the counted hits and the trace are the same; VRAM moves land as with ``lag``. A step launched after the one
that produced the stop token is not counted, traced or returned: it ran on a token that ends the sequence, so the
decoder's state is one position past the returned state's (a further forward on that state is refused) and the
device's miss-fetch counters include it.

``async_swaps`` (with ``lag``; ``STRATATOOLS_ASYNC_SWAPS=1``, off by default until measured): the copies of the
experts a round admits run on a stream of their own, after the step that may still read their slots, alongside the
next step, which still reads those experts from host memory; the table points at the new slots from the step
after (:meth:`GPUExpertTier.defer_admissions`). The policy and the counted hits are unchanged.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.runtime.model import RoutingRecord, SequenceState

from stratatools.runtime.gpu.decode import DECODE_QUEUE_ENV, StaticDecoder, queue_status


#: Queued greedy decoding (module docstring): ``auto`` (default), ``1`` or ``0``.
QUEUE_ENV = DECODE_QUEUE_ENV


class DecoderRuntime:
    """``forward``-compatible wrapper of a :class:`StaticDecoder` over a
    :class:`stratatools.runtime.gpu.runtime.GPURuntime`.

    Args:
        rt: the GPU runtime (weights on CuPy, its :class:`GPUExpertTier`).
        max_ctx: positions per sequence (prompt + new tokens), up to the model's context length (QSA selection runs
            on the device past :func:`stratatools.runtime.gpu.decode.max_full_context`).
        graph: replay the step from a CUDA graph (default) or launch it eagerly.
        fused: the decoder's fused kernels (:class:`StaticDecoder` ``fused``; False: the earlier fast step).
        lag: one-token calls do the previous step's bookkeeping while their own step runs (module docstring); None:
            on unless the environment sets ``STRATATOOLS_DECODE_LAG=0``.
        async_swaps: admitted experts copied alongside the next step (module docstring; needs ``lag``); None: on
            when the environment sets ``STRATATOOLS_ASYNC_SWAPS=1``.
        prefill: how a multi-token call runs: ``batched`` (:meth:`StaticDecoder.prefill`) or ``steps`` (one decode
            step per token); default: the environment's ``STRATATOOLS_PREFILL``, else ``batched``.
        prefill_chunk: tokens per batched forward (default :data:`stratatools.runtime.gpu.prefill.CHUNK`).
        queue: queued greedy decoding (module docstring); None: as ``STRATATOOLS_DECODE_QUEUE`` says (default
            ``auto``, :func:`stratatools.runtime.gpu.decode.queue_status`). Off (``queue_reason`` says why) when the
            decoder cannot stage a step's inputs on the device.
    Raises:
        StrataError: from :class:`StaticDecoder` (context over the model's context length, unsupported types); an
            unknown ``prefill`` mode.
    """

    def __init__(self, rt: Any, max_ctx: int, graph: bool = True, fused: bool = True, lag: bool | None = None,
                 async_swaps: bool | None = None, prefill: str | None = None, prefill_chunk: int | None = None,
                 queue: bool | None = None):
        self.rt, self.cfg, self.xp = rt, rt.cfg, rt.xp
        self.selection = rt.selection
        self.dec = StaticDecoder(rt, max_ctx=max_ctx, fused=fused)
        self._graph = bool(graph)
        self._captured = False
        self._prepared = False
        self.lag = (os.environ.get("STRATATOOLS_DECODE_LAG", "1") != "0") if lag is None else bool(lag)
        #: the last one-token call's routing (ids, weights [1, L, k], positions), not yet fed to the tier (lag)
        self._pending: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        if async_swaps is None:
            async_swaps = os.environ.get("STRATATOOLS_ASYNC_SWAPS", "0") == "1"
        self.async_swaps = bool(async_swaps) and self.lag and getattr(rt, "tier", None) is not None
        if self.async_swaps:
            rt.tier.defer_admissions(rt.xp.cuda.Stream(non_blocking=True))
        mode = prefill if prefill is not None else (os.environ.get("STRATATOOLS_PREFILL") or "batched")
        if mode not in ("batched", "steps"):
            raise StrataError(f"prefill mode {mode!r} (STRATATOOLS_PREFILL) is not one of batched, steps")
        self.prefill_mode = mode
        self.prefill_chunk = prefill_chunk
        #: queued greedy decoding (module docstring): asked for, and possible (device staging of the step's inputs)
        self.queue, self.queue_reason = queue_status(rt.w.model, self.cfg, queue, self.async_swaps, self.dec.gpu,
                                                     lag=self.lag)
        self.discarded_steps = 0

    def finish(self) -> None:
        """Feed the routing of the last step to the tier and the route hooks and close the rounds ended since (with
        ``lag``), on the decoder's stream: after it the tier's counters and residency are those of every step run.
        Idempotent; a no-op without ``lag``."""
        tier = getattr(self.rt, "tier", None)
        if self.async_swaps:
            ev = tier.promote()  # admissions of the last bookkeeping: the next step reads their slots after their copies
            if ev is not None:
                self.dec.wait_before_next(ev)
            tier.copies_after(self.dec.last_step_event())  # new copies wait for the step now running
        if self._pending is None and (tier is None or not tier.holding()):
            return
        with self.dec._stream:  # the tier's slot copies follow the steps already launched
            if self._pending is not None:
                ids, w, pos = self._pending
                self._pending = None
                self.dec.account(ids, w, pos)
            if tier is not None:
                tier.release()

    def prepare(self) -> None:
        """One-time set-up before the first prompt: capture the step's graph and compile the batched prefill's
        kernels (what the first :meth:`forward` would otherwise do inside its timed prompt). Idempotent."""
        if self._prepared:
            return
        if self._graph and not self._captured:
            self.dec.capture()
            self._captured = True
        if self.prefill_mode == "batched":
            self.dec.prefiller(self.prefill_chunk).compile()
        if self.queue and self.dec.gpu:  # the staging kernel compiled and its tables uploaded before the first prompt
            with self.dec._ordered():
                self.dec._dstage_init()
            self.dec.synchronize()
        self._prepared = True

    def argmax(self, logits: Any) -> int:
        """Arg-max of logits this runtime returned: for the decoder's last step, the token it already copied back
        with its routing (no extra kernel or transfer); otherwise computed on the device."""
        if logits is self.dec.logits:
            return self.dec.next_token()
        v = self.xp.argmax(logits)
        return int(v.get() if hasattr(v, "get") else v)

    @property
    def route_hooks(self) -> list:
        return self.rt.route_hooks

    def new_state(self) -> SequenceState:
        """A fresh sequence (the decoder's buffers are reset at its first forward call)."""
        return self.rt.new_state()

    def forward(self, ids: Any, state: SequenceState, logits: str = "last") -> tuple[Any, RoutingRecord]:
        """Run ``ids`` after ``state`` (a batched prefill for several tokens, or one decoder step per token: see the
        module docstring); returns the last token's logits [vocab] (device array) and the routing record of the call.

        Raises StrataError for ``logits`` other than ``last``, a state that is not this decoder's current sequence,
        or a context past ``max_ctx``.
        """
        if logits not in ("last", "none"):
            raise StrataError("the GPU decode path returns the last token's logits only")
        ids = [int(t) for t in np.asarray(ids).reshape(-1)]
        dec = self.dec
        if self.lag and len(ids) == 1 and self._captured and state.pos > 0 and state.pos == dec.pos:
            return self._forward_one(ids[0], state)
        self.finish()
        if state.pos == 0:
            dec.load_state(state)
        elif state.pos != dec.pos:
            raise StrataError(f"sequence at position {state.pos} but the decoder holds {dec.pos}; one sequence at a time")
        self.prepare()
        L = self.cfg.n_layer
        rid: list[list[np.ndarray]] = [[] for _ in range(L)]
        rw: list[list[np.ndarray]] = [[] for _ in range(L)]
        pos0 = dec.pos
        if len(ids) > 1 and self.prefill_mode == "batched":
            lg, bi, bw = dec.prefill(ids, chunk=self.prefill_chunk)
            state.pos = dec.pos
            rec = RoutingRecord(np.arange(pos0, dec.pos, dtype=np.int64), [bi[:, il].copy() for il in range(L)],
                                [bw[:, il].copy() for il in range(L)])
            dec.account(bi, bw, rec.positions)
            return lg, rec
        lg = None
        for t in ids:
            lg = dec.step(t)
            i, w = dec.routing(account=False)
            for il in range(L):
                rid[il].append(i[il])
                rw[il].append(w[il])
        state.pos = dec.pos
        rec = RoutingRecord(np.arange(pos0, dec.pos, dtype=np.int64), [np.stack(a) for a in rid],
                            [np.stack(a) for a in rw])
        # the tier and the hooks see the call's records layer-major, as in the batched CPU forward; the slot table
        # follows before the next step
        dec.account(np.stack(rec.ids, axis=1), np.stack(rec.weights, axis=1), rec.positions)
        return lg, rec

    def decode_queued(self, logits: Any, state: SequenceState, max_new_tokens: int, stop: int,
                      on_forward: Any = None) -> tuple[list[int], list[RoutingRecord], str] | None:
        """Greedy decoding after a prompt with step t+1 launched before step t is read (module docstring):
        ``logits`` are the prompt's last logits, ``state`` the sequence this decoder holds (after the prompt).
        Returns (new token ids, one routing record per decode step, ``"stop"`` or ``"length"``) as
        :func:`stratatools.runtime.model.generate` builds them, or None when queued decoding is off (``queue``)
        or ``max_new_tokens`` < 1, in which case nothing ran.

        The routing of each step is fed to the tier and the route hooks, and ``on_forward("decode")`` called, in the
        order :func:`~stratatools.runtime.model.generate` with ``lag`` uses. Raises StrataError from the decoder (a
        context past ``max_ctx``)."""
        if not self.queue or max_new_tokens < 1:
            return None
        dec = self.dec
        self.finish()
        if state.pos != dec.pos:
            raise StrataError(f"sequence at position {state.pos} but the decoder holds {dec.pos}; one sequence at a time")
        self.prepare()
        L = self.cfg.n_layer
        last = dec.pos + max_new_tokens - 2  # the position of the last decode step this call may run
        if max_new_tokens > 1 and last >= dec.max_ctx:
            raise StrataError(f"position {last} is past the static decoder's {dec.max_ctx} positions")
        new = [int(self.argmax(logits))]
        records: list[RoutingRecord] = []
        if new[0] == stop:
            return new, records, "stop"
        if len(new) >= max_new_tokens:
            return new, records, "length"
        if dec.gpu:
            dec.set_device_token(new[0])
        else:
            dec.next_token_dev = np.int64(new[0])
        dec.step(None)  # step 1: the token after the prompt
        launched = [dec.pos - 1]  # positions of the steps launched and not read yet
        while True:
            # the step in flight makes token len(new) + 1; one more step is needed unless that token ends the run
            ahead = len(new) + 1 < max_new_tokens
            if ahead:
                dec.step(None)
                launched.append(dec.pos - 1)
            tok, ids, w = dec.read_step(back=1 if ahead else 0)
            pos = np.array([launched.pop(0)], dtype=np.int64)
            # the accesses and the round end (the caller's on_forward) on the decoder's stream: the slot copies they
            # make follow the steps already launched, which may still read the slots they refill
            with dec._stream if dec.gpu else contextlib.nullcontext():
                dec.account(ids[None], w[None], pos)
                if on_forward is not None:
                    on_forward("decode")
            records.append(RoutingRecord(pos, [ids[il][None] for il in range(L)], [w[il][None] for il in range(L)]))
            if not 0 <= tok < self.cfg.n_vocab:  # (the output head has more rows than the token table)
                raise StrataError(f"token id {tok} is outside the vocabulary [0, {self.cfg.n_vocab})")
            new.append(int(tok))
            if tok == stop or len(new) >= max_new_tokens:
                break
        if launched:  # a step queued after the stop token: waited for, not counted (module docstring)
            dec.read_step(back=0)
            self.discarded_steps += len(launched)
            dec.stats["discarded_steps"] = dec.stats.get("discarded_steps", 0) + len(launched)
        state.pos = int(pos[0]) + 1
        return new, records, "stop" if new[-1] == stop else "length"

    def _forward_one(self, token: int, state: SequenceState) -> tuple[Any, RoutingRecord]:
        """One decode token with ``lag``: launch the step, settle the previous step's bookkeeping while it runs
        (:meth:`finish`), wait for this step's copy-back; its bookkeeping is left pending, and the tier holds the
        round ends asked for until then."""
        dec = self.dec
        lg = dec.step(token)
        self.finish()
        i, w = dec.routing(account=False)
        state.pos = dec.pos
        pos = np.array([dec.pos - 1], dtype=np.int64)
        self._pending = (i[None], w[None], pos)
        tier = getattr(self.rt, "tier", None)
        if tier is not None:
            tier.hold()
        L = self.cfg.n_layer
        return lg, RoutingRecord(pos, [i[il][None] for il in range(L)], [w[il][None] for il in range(L)])
