"""The GPU decode path of ``stratatools run --device gpu``: :class:`StaticDecoder` (one CUDA graph per token,
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
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.runtime.model import RoutingRecord, SequenceState

from stratatools.runtime.gpu.decode import StaticDecoder


class DecoderRuntime:
    """``forward``-compatible wrapper of a :class:`StaticDecoder` over a
    :class:`stratatools.runtime.gpu.runtime.GPURuntime`.

    Args:
        rt: the GPU runtime (weights on CuPy, its :class:`GPUExpertTier`).
        max_ctx: positions per sequence (prompt + new tokens), up to the model's context length (QSA selection runs
            on the device past :func:`stratatools.runtime.gpu.decode.max_full_context`).
        graph: replay the step from a CUDA graph (default) or launch it eagerly.
        fused: the decoder's fused kernels (:class:`StaticDecoder` ``fused``; False: the earlier fast step).
        prefill: how a multi-token call runs: ``batched`` (:meth:`StaticDecoder.prefill`) or ``steps`` (one decode
            step per token); default: the environment's ``STRATATOOLS_PREFILL``, else ``batched``.
        prefill_chunk: tokens per batched forward (default :data:`stratatools.runtime.gpu.prefill.CHUNK`).
    Raises:
        StrataError: from :class:`StaticDecoder` (context over the model's context length, unsupported types); an
            unknown ``prefill`` mode.
    """

    def __init__(self, rt: Any, max_ctx: int, graph: bool = True, fused: bool = True, prefill: str | None = None,
                 prefill_chunk: int | None = None):
        self.rt, self.cfg, self.xp = rt, rt.cfg, rt.xp
        self.selection = rt.selection
        self.dec = StaticDecoder(rt, max_ctx=max_ctx, fused=fused)
        self._graph = bool(graph)
        self._captured = False
        mode = prefill if prefill is not None else (os.environ.get("STRATATOOLS_PREFILL") or "batched")
        if mode not in ("batched", "steps"):
            raise StrataError(f"prefill mode {mode!r} (STRATATOOLS_PREFILL) is not one of batched, steps")
        self.prefill_mode = mode
        self.prefill_chunk = prefill_chunk

    def argmax(self, logits: Any) -> int:
        """Arg-max of logits this runtime returned: for the decoder's last step, the token it already copied back
        with its routing (no extra kernel or transfer); otherwise computed on the device."""
        if logits is self.dec.logits:
            return self.dec.next_token()
        return int(self.xp.argmax(logits).get())

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
        if state.pos == 0:
            dec.load_state(state)
        elif state.pos != dec.pos:
            raise StrataError(f"sequence at position {state.pos} but the decoder holds {dec.pos}; one sequence at a time")
        if not self._captured and self._graph:
            dec.capture()
            self._captured = True
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
