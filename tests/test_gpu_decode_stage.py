"""Device staging of a decode step's token-dependent inputs on a GPU (StaticDecoder.set_device_token /
_stage_from_device, stage_step.cu): step after step, the input buffer a device-staged decoder holds equals, bit for bit,
what _stage(token) writes in a second decoder fed the same tokens, the token being the previous step's device arg-max
(never read by the host), through an EOS token forced in the middle (the segment reset of the PLE n-grams); the logits
and arg-max of the two decoders are equal, eager and replayed from CUDA graphs, on the kit's BF16 model and on its
ISTA mix (Q8_0 tables). Skips without CuPy; needs the kit."""

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
