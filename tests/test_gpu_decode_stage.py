"""Device staging of a decode step's token-dependent inputs on a GPU (StaticDecoder.set_device_token /
_stage_from_device, stage_step.cu): step after step, the input buffer a device-staged decoder holds equals, bit for bit,
what _stage(token) writes in a second decoder fed the same tokens, the token being the previous step's device arg-max
(never read by the host), through an EOS token forced in the middle (the segment reset of the PLE n-grams); the logits
and arg-max of the two decoders are equal, eager and replayed from CUDA graphs, on the kit's BF16 model and on its
ISTA mix (Q8_0 tables); and the queued greedy decoding built on it (DecoderRuntime.decode_queued) against token by
token generation. Skips without CuPy; needs the kit."""

from __future__ import annotations

import numpy as np
import pytest

from stratatools.core.errors import StrataError
from stratatools.runtime import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.kit,
              pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")]


def _prompt(kit, n):
    line = (kit / "routing/tokens.tsv").read_text().splitlines()[0]
    return [int(v) for v in line.split("\t")[1].split()][:n]


def _recording(dec, stage):
    """Replace dec._stage (what step() calls) by ``stage``, keeping a host copy of dec.inp after each call."""
    snaps = []

    def run(token):
        stage(token)
        dec._stream.synchronize()
        snaps.append(dec.inp.get())

    dec._stage = run
    return snaps


@pytest.mark.parametrize("model", ["gguf/model-bf16.gguf", "quant/model-ISTA-mix.gguf"])
@pytest.mark.parametrize("use_graph", [False, True])
def test_device_staged_steps_equal_host_staged_steps(kit, model, use_graph):
    import cupy as cp

    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    path = kit / model
    if not path.exists():
        pytest.skip(f"{model} not carried")
    rt = GPURuntime(load(path, xp=cp))
    cfg = rt.cfg
    n_ctx = max_full_context(cfg, "transformers")
    st = rt.new_state()
    P = 3
    lg, _ = rt.forward(_prompt(kit, P), st)
    A = StaticDecoder(rt, max_ctx=n_ctx)
    B = StaticDecoder(rt, max_ctx=n_ctx)
    A.load_state(st)
    B.load_state(st)
    assert B.device_stage_ready() == (True, "")
    assert B._dstage is None  # nothing uploaded before device staging is used
    if use_graph:
        assert A.capture() and B.capture()
    with pytest.raises(StrataError, match="outside the vocabulary"):
        B.set_device_token(cfg.n_vocab)
    snap_a = _recording(A, A._stage)
    snap_b = _recording(B, lambda token: B._stage_from_device())
    tok = int(np.argmax(lg.get()))
    B.set_device_token(tok)
    assert B._dstage is not None
    steps = n_ctx - P
    assert steps >= 5
    for i in range(steps):
        if i == 2:  # force an EOS: ple_ctx is read back from the device, then the token set
            tok = cfg.eos_id
            assert np.array_equal(B.ple_ctx, A.ple_ctx)
            B.set_device_token(tok)
        la = A.step(tok).get()
        lb = B.step(-1).get()  # the token argument is not read: B stages from _tok_dev
        assert np.array_equal(snap_a[-1].view(np.uint32), snap_b[-1].view(np.uint32)), f"step {i}: inputs differ"
        assert np.array_equal(B.device_ple_ctx(), A.ple_ctx)
        assert np.array_equal(la, lb), f"step {i}: logits differ"
        tok = A.next_token()
        assert B.next_token() == tok
    assert len(snap_a) == len(snap_b) == steps
    assert B.device_stage_errors() == 0
    assert B.stats["graph_steps"] == (steps if use_graph else 0)
    assert np.array_equal(B.ple_ctx, A.ple_ctx)  # read back from the device
    with pytest.raises(StrataError, match="past the static decoder"):
        B._stage_from_device()


@pytest.mark.parametrize("model", ["gguf/model-bf16.gguf", "quant/model-ISTA-mix.gguf"])
@pytest.mark.parametrize("graph", [False, True])
def test_queued_generate_on_the_gpu_equals_token_by_token(kit, model, graph):
    """DecoderRuntime.decode_queued on the device (steps staged by stage_step from the device arg-max): the same new
    tokens and routing as token by token; afterwards the decoder's PLE context (read back from the device) is the
    token-by-token one, and a further one-token call (host staging) gives the same logits."""
    import cupy as cp

    from stratatools.runtime.gpu.decode import max_full_context
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.model import generate
    from stratatools.runtime.weights import load

    path = kit / model
    if not path.exists():
        pytest.skip(f"{model} not carried")
    out = {}
    for queue in (False, True):
        rt = GPURuntime(load(path, xp=cp))
        drt = DecoderRuntime(rt, max_ctx=max_full_context(rt.cfg, "transformers"), graph=graph, queue=queue)
        assert drt.queue == queue, drt.queue_reason
        st = drt.new_state()
        g = generate(drt, _prompt(kit, 4), max_new_tokens=6, stop_id=-1, state=st)
        ctx = np.array(drt.dec.ple_ctx, copy=True)
        lg, _ = drt.forward([g.new_ids[-1]], st)
        out[queue] = (g, ctx, np.asarray(lg.get() if hasattr(lg, "get") else lg), drt)
    (a, ca, la, da), (b, cb, lb, db) = out[False], out[True]
    assert b.new_ids == a.new_ids and len(a.new_ids) == 6
    assert len(a.decode) == len(b.decode) == 5
    for x, y in zip(a.decode, b.decode):
        assert np.array_equal(x.positions, y.positions)
        assert all(np.array_equal(p, q) for p, q in zip(x.ids, y.ids))
    assert db.dec._dstage is not None and da.dec._dstage is None  # only the queued run staged on the device
    assert np.array_equal(ca, cb)
    np.testing.assert_allclose(lb, la, rtol=0, atol=1e-6 * float(np.abs(la).max()))
