"""The qwen4exp runtime on the GPU: the numpy/CuPy forward of :mod:`stratatools.runtime.model` with ``xp=cupy``, its
MoE replaced by the quantized kernels of :mod:`stratatools.runtime.gpu.experts` served through a
:class:`stratatools.runtime.gpu.tier.GPUExpertTier` (routed experts) and read straight from the GGUF bytes in VRAM
(shared expert). Everything else (hyper-connections, GDN, QSA attention, PLE, router) is the CPU runtime's
code running on CuPy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stratatools.runtime.model import Qwen4ExpRuntime

from stratatools.runtime.gpu import require_cupy
from stratatools.runtime.gpu.experts import ExpertJobs, expert_ffn
from stratatools.runtime.gpu.tier import AllResident, GPUExpertTier, HostArena


class GPURuntime(Qwen4ExpRuntime):
    """:class:`stratatools.runtime.model.Qwen4ExpRuntime` with the routed and shared experts on the GPU kernels.

    Args:
        weights: loaded with ``xp=cupy`` (:func:`stratatools.runtime.weights.load`).
        policy: an online tier from :func:`stratatools.cachesim.make_tier`; None = every expert in VRAM.
        miss_mode: ``copy`` or ``host`` (see :class:`GPUExpertTier`).
        kwargs: passed to :class:`Qwen4ExpRuntime` (``selection``, ``route_hook``).
    """

    def __init__(self, weights: Any, policy: Any = None, miss_mode: str = "copy", arena: HostArena | None = None,
                 **kwargs: Any):
        self.cp = require_cupy()
        super().__init__(weights, **kwargs)
        self.arena = arena or HostArena.from_expert_source(weights.experts)
        if policy is None:
            policy = AllResident(len(self.arena.layers), max(ly.n_expert for ly in self.arena.layers))
        self.tier = GPUExpertTier(self.arena, policy, miss_mode=miss_mode)
        self._shared: dict[int, tuple] = {}
        #: layer -> the shared expert's gate and up matrices as one device array of 2 ff rows (where they lie so)
        self._shared_gu: dict[int, Any] = {}

    def _shared_expert(self, il: int):
        got = self._shared.get(il)
        if got is None:
            cp, m = self.cp, self.w.model
            p = f"blk.{il}."
            ts = [m.tensor(p + f"ffn_{r}_shexp.weight") for r in ("gate", "up", "down")]
            raws = [np.asarray(m.raw(t)).reshape(-1) for t in ts]
            if ts[0].type == ts[1].type and raws[0].nbytes % 256 == 0 and raws[1].nbytes % 256 == 0:
                # one buffer, gate then up then down (aligned as separate uploads are): gate and up also read as one
                # matrix of twice the rows (the batched step's one product of both, prefill.py _shared_gate_up)
                buf = cp.asarray(np.concatenate(raws))
                a, b = raws[0].nbytes, raws[0].nbytes + raws[1].nbytes
                dev = [buf[:a], buf[a:b], buf[b:]]
                self._shared_gu[il] = buf[:b]
            else:
                dev = [cp.asarray(np.array(r)) for r in raws]
            hidden, ff = int(ts[0].ne[0]), int(ts[0].ne[1])
            ptrs = [cp.asarray(np.array([int(d.data.ptr)], dtype=np.uint64)) for d in dev]
            got = (dev, ptrs, ts[0].type, ts[2].type, hidden, ff)
            self._shared[il] = got
        return got

    def _moe(self, il: int, x: Any, pos: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray]:
        cp = self.cp
        xp = self.xp
        ids, w = self.route(il, x)
        for hook in self.route_hooks:
            hook(il, pos, ids, w)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        y = self.tier.ffn(il, x, ids, w)
        # shared expert: one job per token, weight = sigmoid(x . w_gate_shexp)
        dev, ptrs, gu_t, d_t, hidden, ff = self._shared_expert(il)
        T = x.shape[0]
        sg = x @ self.w.get(f"blk.{il}.ffn_gate_inp_shexp.weight").reshape(-1)
        sg = (1.0 / (1.0 + xp.exp(-sg))).astype(cp.float32)
        jobs = ExpertJobs(cp.repeat(ptrs[0], T), cp.repeat(ptrs[1], T), cp.repeat(ptrs[2], T),
                          cp.arange(T, dtype=cp.int32), sg, cp.arange(T + 1, dtype=cp.int32))
        expert_ffn(x, jobs, gu_t, d_t, hidden, ff, out=y, accumulate=True)
        return y, ids, w

    def end_round(self) -> None:
        """Close a decode position for the tier's policy."""
        self.tier.end_round()
