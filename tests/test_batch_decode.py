"""Batched decode (``stratatools run --batch N``, :mod:`stratatools.runtime.gpu.batch`) on the CPU with numpy, on a
small synthetic model (GDN, attention with QSA past its full-selection range, PLE, hyper-connections):

* every step's logits of every place equal the batch-1 reference forward's (``Qwen4ExpRuntime.forward``, one
  sequence at a time) to 1e-3 relative, with places at different positions and steps over a subset of the places;
* ``run --batch N`` gives every request the tokens and stop of ``run`` at batch 1;
* ``simulate`` on a batched run's trace counts the run's hits per phase and layer (docs/cache-model.md
  "Batched decode": one round per place per step, ascending place order).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from stratatools.cli import run_captured
from stratatools.core.errors import StrataError

L, E = 4, 16
PROMPTS = ("def add(a, b):\\n    return a + b\n"
           "x\n"
           "hello world, this is a test of routing through the tier\n"
           "the quick brown fox\n"
           "import numpy as np\n")


def _cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_captured([str(a) for a in args], out, err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    code, _, err = _cli("synth", d / "rel", "--layers", L, "--experts", E, "--k", 4, "--no-revisions", "--json")
    assert code == 0, err
    (d / "p.txt").write_text(PROMPTS)
    return d, d / "rel" / "synth-canonical.gguf"


def test_batched_step_logits_match_batch1(model):
    from stratatools.runtime.gpu.batch import BatchDecoder
    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    _, gguf = model
    w = load(gguf, None)
    try:
        rt = Qwen4ExpRuntime(w)
        prompts = [[5, 17, 99, 3, 250, 7, 8, 9, 10, 11], [42], [300, 301, 7, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
        max_ctx = 13 + 12
        assert max_ctx > max_full_context(w.cfg, "transformers")  # QSA selects cells in the later steps
        dec = StaticDecoder(rt, max_ctx=max_ctx)
        assert dec.long
        bd = BatchDecoder(dec, 3)
        refs, toks = [], []
        for i in range(3):  # prompt i in place i
            dec.load_state(rt.new_state())
            lg, _, _ = dec.prefill(prompts[i])
            bd.admit(i)
            st = rt.new_state()
            lr, _ = rt.forward(prompts[i], st, logits="last")
            np.testing.assert_allclose(lg, lr, rtol=0, atol=1e-3 * float(np.abs(lr).max()))
            refs.append(st)
            toks.append(int(np.argmax(lr)))
        checked = 0
        for s in range(12):
            places = [2, 0] if s % 4 == 3 else [0, 1, 2]  # a subset of the places, out of order
            if s == 6:  # place 1 finishes; prompt 3 takes it
                dec.load_state(rt.new_state())
                dec.prefill(prompts[3])
                bd.admit(1)
                refs[1] = rt.new_state()
                lr, _ = rt.forward(prompts[3], refs[1], logits="last")
                toks[1] = int(np.argmax(lr))
            pos_before = bd.pos[places].copy()
            lg, nxt, ids, wts = bd.step(places, [toks[p] for p in places])
            assert (bd.pos[places] == pos_before + 1).all()
            for j, p in enumerate(places):
                lr, rec = rt.forward([toks[p]], refs[p], logits="last")
                rel = float(np.abs(lg[j] - lr).max() / np.abs(lr).max())
                assert rel <= 1e-3, (s, p, rel)
                assert int(nxt[j]) == int(np.argmax(lr))
                assert (ids[j] == np.stack([rec.ids[il][0] for il in range(L)])).all()
                toks[p] = int(nxt[j])
                checked += 1
        assert checked == 33 and bd.pos.max() > max_full_context(w.cfg, "transformers")
        with pytest.raises(StrataError, match="distinct"):
            bd.step([0, 0], [1, 2])
        with pytest.raises(StrataError, match="vocabulary"):
            bd.step([0], [w.cfg.n_vocab])
    finally:
        w.close()


def _run(gguf, prompts, *opts):
    code, out, err = _cli("run", gguf, "--prompts", prompts, "--device", "cpu", *opts, "--json")
    assert code == 0, err
    return json.loads(out)


def test_run_batch_outputs_equal_batch1(model):
    d, gguf = model
    base = _run(gguf, d / "p.txt", "-n", "9", "--slots", "20", "--policy", "lru")
    assert base["batch"] == {"batch": 1} and base["options"]["batch"] == 1
    for n in (2, 8):  # 8 places for 5 prompts: 5 places
        got = _run(gguf, d / "p.txt", "-n", "9", "--slots", "20", "--policy", "lru", "--batch", n)
        assert [r["new_ids"] for r in got["requests"]] == [r["new_ids"] for r in base["requests"]]
        assert [r["stop"] for r in got["requests"]] == [r["stop"] for r in base["requests"]]
        b = got["batch"]
        assert b["batch"] == n and b["places"] == min(n, 5)
        assert b["decode_forwards"] == 5 * 8 and got["new_tokens"] == 45  # the first token of each from its prefill
        assert b["steps"] == (8 if n == 8 else 24) and b["decode_tokens_per_s"] == got["tokens_per_s"] > 0
        assert got["tier"]["rounds"] == base["tier"]["rounds"] == 5 + 40
        assert got["tier"]["decode"]["entries"] == base["tier"]["decode"]["entries"]
    pre = _run(gguf, d / "p.txt", "-n", "0", "--batch", "3")
    assert all(r["new_ids"] == [] and r["stop"] == "prefill" for r in pre["requests"])


def test_gpu_only_settings_do_not_stop_a_cpu_batched_run(model, monkeypatch):
    """The GPU path's environment switches set to garbage: a CPU run with --batch 2 decodes as without them (it
    stopped with STRATATOOLS_PREFILL_GEMM's error before; found by a new-user test)."""
    d, gguf = model
    base = _run(gguf, d / "p.txt", "-n", "4", "--batch", "2")
    for var in ("STRATATOOLS_PREFILL_GEMM", "STRATATOOLS_BATCH_GEMM", "STRATATOOLS_GDN_PREP", "STRATATOOLS_BATCH_ATTN",
                "STRATATOOLS_MOE_KERNEL", "STRATATOOLS_MISS_FETCH", "STRATATOOLS_PREFETCH_EXTRA",
                "STRATATOOLS_PREFETCH_BLOCKS", "STRATATOOLS_PREFETCH_ORDER", "STRATATOOLS_GRAPH_PARTS"):
        monkeypatch.setenv(var, "garbage")
    got = _run(gguf, d / "p.txt", "-n", "4", "--batch", "2")
    assert [r["new_ids"] for r in got["requests"]] == [r["new_ids"] for r in base["requests"]]


@pytest.mark.parametrize("policy,opts,ext", [
    ("lru", ["--slots", "20"], "bin"),
    ("adaptive", ["--slots", "24", "--adapt-every", "1"], "parquet"),
    ("lfru", ["--slots", "28", "--admission", "per-layer"], "csv"),
])
def test_batched_run_equals_simulate(model, tmp_path, policy, opts, ext):
    d, gguf = model
    trace = tmp_path / f"t.{ext}"
    got = _run(gguf, d / "p.txt", "-n", "7", "--policy", policy, *opts, "--batch", "3", "--trace-out", trace)
    tier = got["tier"]
    assert got["trace_records"] == (sum(r["prompt_tokens"] for r in got["requests"]) + 5 * 6) * L
    code, out, err = _cli("simulate", "-t", trace, "--model", gguf, "--policy", policy, *opts, "--no-sweep",
                          "--report", tmp_path / "rep", "--json")
    assert code == 0, err
    r = json.loads(out)["results"][0]
    want = tier["decode"]
    assert (r["entries"], r["hits"]) == (want["entries"], want["hits"])
    assert r["layer_hits"] == want["layer_hits"] and r["rounds"] == tier["rounds"] == 5 + 5 * 6
    assert r["warmup"] == tier["prefill"]["entries"] and r["moved_bytes"] == tier["moved_bytes"]


def test_batch_below_one_is_refused(model, tmp_path):
    from stratatools.runtime.run import run_prompts

    d, gguf = model
    with pytest.raises(StrataError, match="--batch 0"):
        run_prompts(gguf, d / "p.txt", batch=0)
    code, _, err = _cli("run", gguf, "--prompts", d / "p.txt", "--device", "cpu", "--batch", "0")
    assert code == 2 and "--batch" in err


def test_vram_plan_counts_the_places(model, monkeypatch):
    from stratatools.runtime.device import batch_step_bytes, cache_bytes, plan_vram
    from stratatools.runtime.weights import load

    _, gguf = model
    w = load(gguf, None)
    try:
        blob = [w.experts.blob_bytes(il) for il in range(w.cfg.n_layer)]
        one = plan_vram(w.model, w.cfg, blob, 64, None, None, L * E)
        four = plan_vram(w.model, w.cfg, blob, 64, None, None, L * E, batch=4)
        assert one.caches == cache_bytes(w.cfg, 64)
        assert four.caches == 5 * one.caches + (256 << 20)  # the decoder's sequence, 4 places, small f32 matrices
        assert four.dense == one.dense
        # the batched step's graph keeps its temporaries in a pool of its own: planned apart, 0 at batch 1
        assert one.batch_step == 0 and four.batch_step == batch_step_bytes(w.model, w.cfg, 4, 64) > 0
        assert four.fixed - four.batch_step == four.dense + four.caches + four.reserve + four.prefill + four.staging
        # hgemm writes a transient fp16 pair of each matrix, the output head's too: a head larger than the trunk's
        # matrices is planned as the largest one (8 bytes a weight, as sgemm's float32 copy); mma reads a Q8_0 /
        # Q2_0 head quantized, and dequantizes a head of another type (here Q6_K) every step
        from types import SimpleNamespace

        def with_head(tname):
            head = SimpleNamespace(name="output.weight", ne=(w.cfg.n_embd, 10 ** 6), type=SimpleNamespace(name=tname))
            return SimpleNamespace(iter_tensors=lambda: [t for t in w.model.iter_tensors()
                                                         if t.name != "output.weight"] + [head])

        sizes = {}
        for g in ("mma", "hgemm", "sgemm"):
            monkeypatch.setenv("STRATATOOLS_BATCH_GEMM", g)
            sizes[g] = batch_step_bytes(with_head("Q8_0"), w.cfg, 4, 64)
        monkeypatch.setenv("STRATATOOLS_BATCH_GEMM", "mma")
        sizes["mma Q6_K"] = batch_step_bytes(with_head("Q6_K"), w.cfg, 4, 64)
        monkeypatch.delenv("STRATATOOLS_BATCH_GEMM")
        trunk = max(int(np.prod([int(d) for d in t.ne])) for t in w.model.iter_tensors() if "_exps." not in t.name
                    and t.name not in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"))
        assert sizes["hgemm"] - sizes["mma"] == 8 * (w.cfg.n_embd * 10 ** 6 - trunk)
        assert sizes["mma Q6_K"] == sizes["hgemm"]
        assert sizes["hgemm"] > sizes["sgemm"]  # the same head; the mma expert jobs' rows on top
        monkeypatch.setenv("STRATATOOLS_BATCH_GRAPH", "0")
        assert plan_vram(w.model, w.cfg, blob, 64, None, None, L * E, batch=4).batch_step == 0
    finally:
        w.close()


def test_early_stop_frees_the_place_for_the_next_prompt(model):
    """A sequence that meets the stop token mid-way leaves while the others go on; the next prompt takes its place:
    every request's tokens and stop equal generate() at batch 1 with the same stop token."""
    from stratatools.runtime.gpu.batch import BatchDecoder, run_batched
    from stratatools.runtime.gpu.decode import StaticDecoder
    from stratatools.runtime.model import Qwen4ExpRuntime, generate
    from stratatools.runtime.weights import load

    _, gguf = model
    w = load(gguf, None)
    try:
        rt = Qwen4ExpRuntime(w)
        prompts = [[5, 17, 99, 3], [42, 7], [300, 301, 7, 7, 9], [1, 2, 3], [11, 12]]
        free = [generate(rt, p, 8, stop_id=-1).new_ids for p in prompts]
        stop = free[1][2]  # request 1 stops at its third token
        want = [generate(rt, p, 8, stop_id=stop) for p in prompts]
        assert want[1].stop == "stop" and any(g.stop == "length" for g in want)
        dec = StaticDecoder(rt, max_ctx=16)
        bd = BatchDecoder(dec, 2)
        order = []
        got, tot = run_batched(dec, bd, prompts, 8, stop, on_done=lambda r: order.append(r.request))
        assert [r.new_ids for r in got] == [g.new_ids for g in want]
        assert [r.stop for r in got] == [g.stop for g in want]
        assert order.index(1) < order.index(0) or want[0].stop == "stop"  # request 1 left before request 0
        assert tot["decode_forwards"] == sum(len(g.decode) for g in want)
        assert tot["mean_active"] <= 2.0 and tot["steps"] >= tot["decode_forwards"] / 2
    finally:
        w.close()


def test_q8r_rows_dequantize_like_the_gguf_blocks():
    """The batched prefill and decode read the fused step's re-laid-out Q8_0 matrices (dense_q8.cu's layout, one
    matrix or a stacked group) through kernels.q8r_f32: bit-identical to the numpy dequantizer of the GGUF blocks."""
    from stratatools.model.ggml_types import type_by_name
    from stratatools.runtime.dequant import dequantize
    from stratatools.runtime.gpu.kernels import q8_relayout, q8r_f32
    from stratatools.runtime.gpu.prefill import _is_q8r, _Q8RRows

    rng = np.random.default_rng(5)
    rows, cols = 7, 96
    nb = rows * cols // 32
    blocks = np.zeros((nb, 34), dtype=np.uint8)
    blocks[:, :2] = rng.normal(0, 0.02, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    blocks[:, 2:] = rng.integers(-128, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    raw = blocks.reshape(-1)
    want = np.asarray(dequantize(raw, type_by_name("Q8_0"), rows * cols)).reshape(rows, cols)
    q, d = q8_relayout(raw, rows, cols)
    assert q8r_f32(np, q, d, 0, rows, cols).tobytes() == want.tobytes()
    assert q8r_f32(np, q, d, 2, 3, cols).tobytes() == want[2:5].tobytes()  # a matrix inside a stacked group

    class FakeQ8R:
        def __init__(self):
            self.q, self.d, self.size = q, d, q.nbytes + d.nbytes

    assert _is_q8r(FakeQ8R()) and not _is_q8r(np.zeros(4, np.uint8))
    v = _Q8RRows(FakeQ8R(), 2)
    assert v.row0 == 2 and v.m.q is q


def test_plain_strata_trace_with_batch_is_refused(model, tmp_path):
    """The plain layout keeps no request ids or phases: a batched run's trace in it replayed to other hits than
    the run counted (found by a new user: decode hits [198, 207] against [1969, 2414] from simulate)."""
    p = tmp_path / "p.txt"
    p.write_text(PROMPTS)
    out = tmp_path / "t.bin"
    code, _, err = _cli("run", model[1], "-p", p, "-n", 4, "--batch", 3, "--slots", 12, "--policy", "lru", "-t", out,
                        "--trace-format", "strata")
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "--trace-format strata" in err and "strata-tagged" in err and not out.exists()


def test_unwritable_trace_folder_fails_before_the_model_loads(model, tmp_path, monkeypatch):
    """A --trace-out folder that cannot take a file (here: a read-only file system) used to be found only when the
    trace was written, after the whole workload; now before the model is loaded."""
    import errno
    import os

    import stratatools.runtime.run as run_mod

    p = tmp_path / "p.txt"
    p.write_text(PROMPTS)
    ro = tmp_path / "ro"
    ro.mkdir()
    real_open = os.open

    def open_(path, flags, *a, **k):
        if str(path).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a, **k)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the trace folder was checked")

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(run_mod, "load", no_load)
    code, _, err = _cli("run", model[1], "-p", p, "-n", 4, "-t", ro / "t.bin")
    monkeypatch.undo()
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "t.bin" in err and "Read-only" in err
    assert os.listdir(ro) == []


@pytest.mark.parametrize("opt,value", [("--adapt-every", "0"), ("--adapt-swaps", "-5"), ("--adapt-lag", "0"),
                                       ("--adapt-pace-bytes", "-1")])
def test_adaptive_option_errors_name_the_option(model, tmp_path, opt, value):
    """They named internal fields (adapt_every, copy_delay_rounds, max_moves) instead of the option given; the
    option's bounds now refuse them while the command line is parsed (naming the option, the value and the range)."""
    p = tmp_path / "p.txt"
    p.write_text(PROMPTS)
    code, _, err = _cli("run", model[1], "-p", p, "-n", 2, "--slots", 12, "--policy", "adaptive", opt, value)
    assert code == 2 and err.strip().count("\n") == 0, err
    assert f"invalid value for '{opt}': must be an integer from " in err and f"(got {value})" in err, err


def test_static_input_steps_equal_the_eager_steps(model):
    """The graph step's body (static input buffers: positions, embedding rows, rope tables, PLE rows filled before
    the step; on numpy run eagerly) gives the eager step's logits, tokens and routing bit for bit, steps of all places
    and of a subset (eager) interleaved, and a place re-admitted between them."""
    from stratatools.runtime.gpu.batch import BatchDecoder
    from stratatools.runtime.gpu.decode import StaticDecoder, max_full_context
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    _, gguf = model
    w = load(gguf, None)
    try:
        rt = Qwen4ExpRuntime(w)
        prompts = [[5, 17], [42], [300, 301], [1, 2]]
        dec = StaticDecoder(rt, max_ctx=min(11, max_full_context(w.cfg, "transformers")))
        assert not dec.long
        bds = [BatchDecoder(dec, 3), BatchDecoder(dec, 3)]
        bds[0].static_inputs, bds[1].static_inputs = True, False

        def admit(i, p):
            dec.load_state(rt.new_state())
            lg, _, _ = dec.prefill(p)
            for bd in bds:
                bd.admit(i)
            return int(np.argmax(lg))

        toks = [admit(i, prompts[i]) for i in range(3)]
        for s in range(8):
            places = [2, 0] if s % 4 == 3 else [0, 1, 2]
            if s == 5:
                toks[1] = admit(1, prompts[3])
            got = [bd.step(places, [toks[p] for p in places]) for bd in bds]
            for a, b in zip(got[0], got[1]):
                assert np.array_equal(np.asarray(a), np.asarray(b)), s
            for j, p in enumerate(places):
                toks[p] = int(got[0][1][j])
        assert bds[0].stats["static_steps"] == 6 and bds[1].stats["static_steps"] == 0
        assert all(bd.stats["graph_steps"] == 0 for bd in bds)  # no capture on numpy
    finally:
        w.close()


def test_prefill_graph_conditions_and_plan(model, monkeypatch):
    """STRATATOOLS_PREFILL_GRAPH: a chunk takes the prefill's graph only on CuPy, with the full chunk of tokens
    ending within max_ctx and GRAPH_MAX_POS, without a timed breakdown or an earlier failed capture, where the layers
    allow it (asked once); a bad value is refused naming the variable. The VRAM plan provides for the graph's own
    pool: twice the prefill's temporaries with the graph on, once with it off."""
    from stratatools.core.errors import StrataError
    from stratatools.runtime.device import prefill_bytes
    from stratatools.runtime.gpu import prefill as PF
    from stratatools.runtime.gpu.decode import StaticDecoder
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    _, gguf = model
    w = load(gguf, None)
    try:
        dec = StaticDecoder(Qwen4ExpRuntime(w), max_ctx=64)
        pf = dec.prefiller(8)
        monkeypatch.delenv(PF.GRAPH_ENV, raising=False)  # on by default
        assert not pf._graph_ok(8)  # numpy: never
        asked = []
        monkeypatch.setattr(pf, "gpu", True)
        monkeypatch.setattr(pf, "_graph_layers", lambda T: asked.append(T) or True)
        assert pf._graph_ok(8) and pf._graph_ok(8) and asked == [8]
        assert not pf._graph_ok(7)  # a partial chunk
        dec.pos = 57
        assert not pf._graph_ok(8)  # past max_ctx
        dec.pos = 56
        assert pf._graph_ok(8)
        monkeypatch.setattr(PF, "GRAPH_MAX_POS", 63)
        assert not pf._graph_ok(8)
        monkeypatch.setattr(PF, "GRAPH_MAX_POS", 64)
        dec.pos = 0
        pf.timing = {}
        assert not pf._graph_ok(8)
        pf.timing = None
        pf._graph_error = "capture failed"
        assert not pf._graph_ok(8)
        pf._graph_error = None
        monkeypatch.setenv(PF.GRAPH_ENV, "0")
        assert not pf._graph_ok(8)
        monkeypatch.setenv(PF.GRAPH_ENV, "on")
        with pytest.raises(StrataError, match=PF.GRAPH_ENV):
            pf._graph_ok(8)
        monkeypatch.setenv(PF.GRAPH_ENV, "0")
        off = prefill_bytes(w.model, w.cfg, 512)
        monkeypatch.delenv(PF.GRAPH_ENV)
        assert prefill_bytes(w.model, w.cfg, 512) == 2 * off
        assert 2 * off > prefill_bytes(w.model, w.cfg, 511) > off  # (a prefiller's chunk may be shorter than 512)
    finally:
        w.close()


def test_ple_ngram_ids_rows_equal_one_sequence_at_a_time(model):
    """The batched step's PLE row ids of all places at once equal ple_ngram_ids per place: contexts of every length
    from empty to full, EOS in the context (which cuts the n-grams that reach past it) and as the new token."""
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    _, gguf = model
    w = load(gguf, None)
    try:
        rt = Qwen4ExpRuntime(w)
        cfg = w.cfg
        K = cfg.ple_ngram - 1
        assert K >= 2  # (the synthetic model's n-grams reach two tokens back: every case below means something)
        rng = np.random.default_rng(5)
        P = 40
        ids = rng.integers(0, cfg.n_vocab, P)
        ids[3] = cfg.eos_id
        ctx = rng.integers(0, cfg.n_vocab, (P, K))
        lens = rng.integers(0, K + 1, P)
        lens[:K + 1] = np.arange(K + 1)
        eos_at = rng.random((P, K)) < 0.25
        ctx[eos_at] = cfg.eos_id
        got = rt.ple_ngram_ids_rows(ids, ctx, lens)
        for p in range(P):
            want = rt.ple_ngram_ids(ids[p:p + 1], ctx[p, K - lens[p]:])
            assert np.array_equal(got[p:p + 1], want), p
    finally:
        w.close()
