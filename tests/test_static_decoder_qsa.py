"""The static decoder past the full-selection context (QSA block selection inside the step): its numpy path against
the reference forward Qwen4ExpRuntime.forward on a small synthetic model whose indexer budget (16 tokens, blocks of
4) makes selection start at position 19, for both selection rules, 130 decode positions past that limit."""

from __future__ import annotations

import numpy as np
import pytest

from stratatools.core.errors import StrataError


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from stratatools.synth.model import SynthConfig, synth_release

    d = tmp_path_factory.mktemp("qsa_synth")
    cfg = SynthConfig(n_layers=4, indexer_top_k=16, compress_ratio=4, revisions=False, context_length=256)
    return synth_release(d, cfg).canonical


@pytest.mark.parametrize("selection", ["transformers", "llamacpp"])
def test_numpy_static_decoder_selects_like_forward(small_model, selection):
    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    w = load(small_model)
    rt = Qwen4ExpRuntime(w, selection=selection)
    lim = max_full_context(w.cfg, selection)
    assert lim == 19  # budget 16, ratio 4: position 19 is the first that does not see every cell
    steps = lim + 130
    st = rt.new_state()
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    lg, _ = rt.forward(prompt, st)
    dec = StaticDecoder(rt, max_ctx=len(prompt) + steps)
    assert dec.long
    dec.load_state(st)
    tok = int(np.argmax(lg))
    rng = np.random.default_rng(1)
    worst = 0.0
    partial = 0
    for i in range(steps):
        ref, rec = rt.forward([tok], st)
        got = dec.step(tok)
        ids, _ = dec.routing()
        worst = max(worst, float(np.abs(ref - got).max() / np.abs(ref).max()))
        for il in range(w.cfg.n_layer):
            assert np.array_equal(rec.ids[il][0], ids[il]), (selection, i, il)
        # feed a mix of greedy and random tokens so the keys vary
        tok = int(np.argmax(ref)) if i % 3 else int(rng.integers(0, w.cfg.n_vocab))
    assert worst < 1e-5, worst
    # the last steps really attended a subset: the reference's own selection for the last query
    il = next(i for i in range(w.cfg.n_layer) if not w.cfg.recurrent[i])
    ls = st.layers[il]
    P = ls.k.shape[0]
    x = np.zeros((1, w.cfg.n_embd), dtype=np.float32) + 0.1
    mask = rt._select(il, x, type(ls)(k=ls.k, v=ls.v, ik=ls.ik.copy(), bk=ls.bk.copy()), np.array([P]),
                      *rt.rope.cos_sin(np.array([P])), P + 1)
    partial = int(mask.sum())
    assert partial < (P + 1) // 2  # budget 16 (+ ratio - 1) of ~150 cells


def test_context_past_the_model_is_refused(small_model):
    from stratatools.runtime.gpu.decode import StaticDecoder
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    rt = Qwen4ExpRuntime(load(small_model))
    StaticDecoder(rt, max_ctx=256)
    with pytest.raises(StrataError, match="over the model's context length 256"):
        StaticDecoder(rt, max_ctx=257)
