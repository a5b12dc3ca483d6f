"""Queued greedy decoding (DecoderRuntime.decode_queued, STRATATOOLS_DECODE_QUEUE): step t+1 is launched before step t
is read, with the arg-max taken from the decoder. Checked on the CPU with the numpy decoder, where "launched" means
computed: against the same decoder driven token by token, the same tokens, routing records, route-hook calls and
tier counts; a step queued after the stop token is computed but not counted, traced or returned, and the state it
leaves behind is refused. (tests/test_gpu_decode_stage.py checks the device staging the GPU needs.)"""

from __future__ import annotations

import numpy as np
import pytest

from stratatools.core.errors import StrataError

BF16 = "gguf/model-bf16.gguf"


def _prompt(kit, n):
    line = (kit / "routing/tokens.tsv").read_text().splitlines()[0]
    return [int(v) for v in line.split("\t")[1].split()][:n]


class _HeldTier:
    """A simulator tier with GPUExpertTier's hold / release of round ends (what DecoderRuntime.finish uses)."""

    def __init__(self, tier):
        self.tier, self.held, self.ends = tier, False, 0

    def access(self, layer, experts):
        return self.tier.access(layer, experts)

    def end_round(self):
        if self.held:
            self.ends += 1
        else:
            self.tier.end_round()

    def hold(self):
        self.held = True

    def holding(self):
        return self.held

    def release(self):
        self.held = False
        for _ in range(self.ends):
            self.tier.end_round()
        self.ends = 0

    def stats(self):
        return self.tier.stats()


def _gen(kit, queue, max_new, stop):
    from stratatools.cachesim import make_tier
    from stratatools.runtime.gpu.decode import max_full_context
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.model import Qwen4ExpRuntime, generate
    from stratatools.runtime.weights import load

    w = load(kit / BF16)
    rt = Qwen4ExpRuntime(w)
    cfg = w.cfg
    rt.tier = _HeldTier(make_tier("lru", n_layers=cfg.n_layer, n_expert=max(cfg.n_expert), slots=cfg.n_layer * 6))
    hooks: list = []
    rt.route_hooks.append(lambda il, pos, ids, wts: hooks.append((il, pos.tolist(), np.asarray(ids).tolist())))
    drt = DecoderRuntime(rt, max_ctx=max_full_context(cfg, "transformers"), graph=False, queue=queue)
    st = drt.new_state()
    rounds = []

    def on_forward(phase):
        rt.tier.end_round()
        rounds.append(phase)

    g = generate(drt, _prompt(kit, 4), max_new_tokens=max_new, stop_id=stop, state=st, on_forward=on_forward)
    return g, drt, st, hooks, rounds, rt.tier.stats()


def _same(a, b):
    assert len(a.decode) == len(b.decode)
    for x, y in zip(a.decode, b.decode):
        assert np.array_equal(x.positions, y.positions)
        assert all(np.array_equal(p, q) for p, q in zip(x.ids, y.ids))
        assert all(np.array_equal(p, q) for p, q in zip(x.weights, y.weights))


@pytest.mark.kit
def test_queued_decode_equals_token_by_token(kit):
    a, da, sa, ha, ra, ta = _gen(kit, False, 6, -1)
    b, db, sb, hb, rb, tb = _gen(kit, True, 6, -1)
    assert not da.queue and db.queue and len(a.new_ids) == 6
    assert b.new_ids == a.new_ids and b.stop == a.stop == "length"
    _same(a, b)
    assert hb == ha and rb == ra == ["prefill"] + ["decode"] * 5
    assert tb == ta and ta["rounds"] == 6 and 0 < ta["hits"] < ta["entries"]
    assert sb.pos == sa.pos == db.dec.pos == 4 + 5 and db.discarded_steps == 0
    assert [r.positions.tolist() for r in b.decode] == [[p] for p in range(4, 9)]


@pytest.mark.kit
def test_queued_decode_stops_at_the_stop_token_and_drops_the_step_after_it(kit):
    a, *_ = _gen(kit, False, 6, -1)
    stop = a.new_ids[2]
    assert stop not in a.new_ids[:2]
    c, dc, sc, hc, rc, tc = _gen(kit, False, 6, stop)
    q, dq, sq, hq, rq, tq = _gen(kit, True, 6, stop)
    assert q.new_ids == c.new_ids == a.new_ids[:3] and q.stop == c.stop == "stop"
    _same(c, q)
    assert hq == hc and rq == rc and tq == tc  # the dropped step reached neither the tier nor the hooks
    assert dq.discarded_steps == 1 and dq.dec.stats["discarded_steps"] == 1
    assert sq.pos == sc.pos == 4 + 2 and dq.dec.pos == sq.pos + 1
    with pytest.raises(StrataError, match="one sequence at a time"):
        dq.forward([1], sq)


@pytest.mark.kit
@pytest.mark.parametrize("max_new", [1, 2])
def test_queued_decode_short_runs(kit, max_new):
    a, *_ = _gen(kit, False, max_new, -1)
    q, dq, sq, *_ = _gen(kit, True, max_new, -1)
    assert q.new_ids == a.new_ids and len(q.new_ids) == max_new and len(q.decode) == max_new - 1
    assert dq.discarded_steps == 0 and dq.dec.pos == sq.pos == 4 + max_new - 1


def test_queue_switch(monkeypatch):
    from stratatools.runtime.gpu import engine

    assert engine.QUEUE_ENV == "STRATATOOLS_DECODE_QUEUE"
    src = engine.DecoderRuntime.decode_queued.__doc__
    assert "None when queued decoding is off" in src


@pytest.mark.kit
def test_queued_decode_refuses_a_run_past_the_context_before_any_step(kit):
    """A call whose decode steps would pass the decoder's positions is refused before it launches anything (the
    token-by-token path would stop at the first step past them)."""
    from stratatools.runtime.gpu.decode import max_full_context
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    w = load(kit / BF16)
    n_ctx = max_full_context(w.cfg, "transformers")
    drt = DecoderRuntime(Qwen4ExpRuntime(w), max_ctx=n_ctx, graph=False, queue=True)
    st = drt.new_state()
    lg, _ = drt.forward(_prompt(kit, 4), st)
    steps = drt.dec.stats["steps"]
    with pytest.raises(StrataError, match=f"position {n_ctx} is past the static decoder's {n_ctx} positions"):
        drt.decode_queued(lg, st, n_ctx - 4 + 2, -1)
    assert drt.dec.stats["steps"] == steps and drt.dec.pos == st.pos == 4
    new, recs, why = drt.decode_queued(lg, st, n_ctx - 4 + 1, -1)  # the last position the decoder holds: runs
    assert len(new) == n_ctx - 4 + 1 and len(recs) == n_ctx - 4 and why == "length" and st.pos == n_ctx
