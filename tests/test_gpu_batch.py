"""Batched decode on a GPU (``run --batch N --device gpu``, :mod:`stratatools.runtime.gpu.batch`) with the kit's BF16
model: every place's logits agree with the batch-1 CUDA-graph decoder to 1e-3 relative with the same greedy tokens
(places at different positions, QSA selection past the full-selection range, a subset of the places in a step);
``run --batch N`` gives the batch-1 tokens; ``simulate`` on a batched run's trace counts its hits. Skips without
CuPy and a GPU, or without the kit."""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest

from stratatools.runtime import gpu

BF16 = "gguf/model-bf16.gguf"
pytestmark = [pytest.mark.kit,
              pytest.mark.skipif(not gpu.available(), reason="CuPy with a CUDA GPU is not available")]


def _prompts(kit_prompts, n):
    ids = [t for _, p in kit_prompts for t in p]
    lens = [9, 3, 14, 6, 11][:n]
    out, a = [], 0
    for m in lens:
        out.append(ids[a:a + m])
        a += m
    return out


@contextlib.contextmanager
def _kit_runtime(kit, model, gemm, monkeypatch, max_ctx=11):
    """The kit's ``model`` loaded on CuPy with both GEMM switches set to ``gemm``, every expert resident: its batch-1
    DecoderRuntime of ``max_ctx`` positions (within the full-selection range by default: no host-side QSA
    selection); skips when the model is not carried; the weights closed after."""
    import cupy as cp

    if not (kit / model).exists():
        pytest.skip(f"{model} not carried")
    monkeypatch.setenv("STRATATOOLS_PREFILL_GEMM", gemm)
    monkeypatch.setenv("STRATATOOLS_BATCH_GEMM", gemm)
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    w = load(kit / model, xp=cp)
    try:
        yield DecoderRuntime(GPURuntime(w, policy=None, miss_mode="host"), max_ctx=max_ctx)
    finally:
        w.close()


def _admit_all(rt, bds, prompts):
    """Prefill prompt i through ``rt``'s decoder and admit it at place i of every BatchDecoder in ``bds``; returns
    each prompt's first new token (the prefill's arg-max)."""
    import cupy as cp

    dec, toks = rt.dec, []
    for i, p in enumerate(prompts):
        dec.load_state(rt.new_state())
        lg, _, _ = dec.prefill(p)
        for bd in bds:
            bd.admit(i)
        toks.append(int(cp.asnumpy(cp.argmax(lg))))
    return toks


@pytest.mark.parametrize("model,gemm", [(BF16, "sgemm"), ("quant/model-ISTA-mix.gguf", "mma"),
                                        ("quant/model-ISTA-mix.gguf", "hgemm")])
def test_gpu_batched_steps_match_the_graph_decoder(kit, kit_prompts, model, gemm, monkeypatch):
    """Places of a BatchDecoder against the batch-1 CUDA-graph decoder: logits within 1e-3, the same greedy tokens
    (the dense GEMMs as SGEMMs, or with ``STRATATOOLS_PREFILL_GEMM`` and ``STRATATOOLS_BATCH_GEMM`` both ``mma``, on
    the tensor cores from the quantized matrices, or both ``hgemm``, cuBLAS fp16 GEMMs of the matrices' hi/lo halves;
    prefill and batched steps both)."""
    import cupy as cp

    if not (kit / model).exists():
        pytest.skip(f"{model} not carried")
    monkeypatch.setenv("STRATATOOLS_PREFILL_GEMM", gemm)
    monkeypatch.setenv("STRATATOOLS_BATCH_GEMM", gemm)

    from stratatools.runtime.gpu.batch import BatchDecoder
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    prompts = _prompts(kit_prompts, 4)
    steps = 10
    w = load(kit / model, xp=cp)
    try:
        grt = GPURuntime(w, policy=None, miss_mode="host")
        rt = DecoderRuntime(grt, max_ctx=32)
        ref_lg, ref_tok = [], []
        for p in prompts[:3]:  # batch 1: the CUDA-graph decoder
            st = rt.new_state()
            lg, _ = rt.forward(p, st)
            ls, ts = [], []
            for _ in range(steps + 1):
                t = rt.argmax(lg)
                ts.append(t)
                ls.append(cp.asnumpy(lg).astype(np.float64))
                lg, _ = rt.forward([t], st)
            ref_lg.append(ls)
            ref_tok.append(ts)
        rt.finish()  # the last step's bookkeeping (lag) before the decoder is used directly
        dec = rt.dec
        bd = BatchDecoder(dec, 3)
        toks = []
        for i, p in enumerate(prompts[:3]):
            dec.load_state(rt.new_state())
            lg, _, _ = dec.prefill(p)
            bd.admit(i)
            toks.append(int(cp.asnumpy(cp.argmax(lg))))
        assert toks == [r[0] for r in ref_tok]
        done = [0, 0, 0]
        worst = 0.0
        for s in range(steps):
            places = [2, 0] if s % 3 == 2 else [0, 1, 2]
            lg, nxt, ids, _ = bd.step(places, [toks[p] for p in places])
            lh = cp.asnumpy(lg).astype(np.float64)
            for j, p in enumerate(places):
                ref = ref_lg[p][done[p] + 1]
                worst = max(worst, float(np.abs(lh[j] - ref).max() / np.abs(ref).max()))
                done[p] += 1
                assert int(nxt[j]) == ref_tok[p][done[p]], (s, p)
                toks[p] = int(nxt[j])
        assert worst <= 1e-3, worst
        assert bd.stats["graph_steps"] == 0  # a long-context decoder (QSA past position 11): every step eager
    finally:
        w.close()


@pytest.mark.parametrize("model,gemm", [(BF16, "sgemm"), ("quant/model-ISTA-mix.gguf", "mma"),
                                        ("quant/model-ISTA-mix.gguf", "hgemm")])
def test_gpu_graph_steps_equal_eager_steps(kit, kit_prompts, model, gemm, monkeypatch):
    """The batched step replayed from its CUDA graph gives the eager step's tokens and routing and its logits within
    1e-5, over steps of every place with a subset step (eager) and a re-admitted place between them (hgemm: its
    weight splits and fp16 cuBLAS GEMMs recorded in the graph)."""
    import cupy as cp

    if not (kit / model).exists():
        pytest.skip(f"{model} not carried")
    monkeypatch.setenv("STRATATOOLS_PREFILL_GEMM", gemm)
    monkeypatch.setenv("STRATATOOLS_BATCH_GEMM", gemm)
    from stratatools.runtime.gpu.batch import BatchDecoder
    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.weights import load

    ids = [t for _, p in kit_prompts for t in p]
    prompts = [ids[0:2], ids[2:3], ids[3:5], ids[5:6]]
    w = load(kit / model, xp=cp)
    try:
        # within the full-selection range (11 positions on the kit's models): no host-side QSA selection
        rt = DecoderRuntime(GPURuntime(w, policy=None, miss_mode="host"), max_ctx=11)
        dec = rt.dec
        bds = [BatchDecoder(dec, 3), BatchDecoder(dec, 3)]
        bds[1].static_inputs = False

        def admit(i, p):
            dec.load_state(rt.new_state())
            lg, _, _ = dec.prefill(p)
            for bd in bds:
                bd.admit(i)
            return int(cp.asnumpy(cp.argmax(lg)))

        toks = [admit(i, prompts[i]) for i in range(3)]
        assert not dec.long
        for s in range(8):
            places = [2, 0] if s == 4 else [0, 1, 2]
            if s == 6:
                toks[1] = admit(1, prompts[3])
            got = [bd.step(places, [toks[p] for p in places]) for bd in bds]
            # the graph step's SGEMMs are cuBLAS calls of their own (runtime/gpu/blas.py), the eager step's CuPy's
            la, lb = cp.asnumpy(got[0][0]), cp.asnumpy(got[1][0])
            assert np.abs(la - lb).max() <= 1e-5 * np.abs(lb).max(), s
            assert np.array_equal(got[0][1], got[1][1]) and np.array_equal(got[0][2], got[1][2]), s
            np.testing.assert_allclose(got[0][3], got[1][3], rtol=1e-5, atol=1e-6)
            for j, p in enumerate(places):
                toks[p] = int(got[0][1][j])
        assert "graph_error" not in bds[0].stats, bds[0].stats.get("graph_error")
        assert bds[0].stats["graph_steps"] == 6 and bds[1].stats["static_steps"] == 0
    finally:
        w.close()


def test_gpu_run_batch_equals_batch1_and_simulate(kit, kit_prompts, cli, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"token_ids": p} for p in _prompts(kit_prompts, 5)]))
    code, text, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "8", "--device", "gpu", "--slots", "24",
                          "--policy", "lru", "--json")
    assert code == 0, err
    base = json.loads(text)
    trace = tmp_path / "t.bin"
    code, text, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "8", "--device", "gpu", "--slots", "24",
                          "--policy", "lru", "--batch", "3", "--trace-out", trace, "--json")
    assert code == 0, err
    got = json.loads(text)
    assert got["batch"]["batch"] == 3 and got["batch"]["decode_tokens_per_s"] > 0
    assert [r["new_ids"] for r in got["requests"]] == [r["new_ids"] for r in base["requests"]]
    code, text, err = cli("simulate", "-t", trace, "--model", kit / BF16, "--policy", "lru", "--slots", "24",
                          "--no-sweep", "--report", tmp_path / "rep", "--json")
    assert code == 0, err
    r = json.loads(text)["results"][0]
    tier = got["tier"]
    assert (r["entries"], r["hits"], r["rounds"]) == (tier["decode"]["entries"], tier["decode"]["hits"], tier["rounds"])
    assert r["layer_hits"] == tier["decode"]["layer_hits"]


@pytest.mark.parametrize("model,gemm", [(BF16, "sgemm"), ("quant/model-ISTA-mix.gguf", "mma")])
def test_gpu_batched_shared_expert_beside_the_routed_ones_gives_the_same_steps(kit, kit_prompts, model, gemm,
                                                                               monkeypatch):
    """STRATATOOLS_SHARED_SIDE=1 (the batched step's shared expert on a second stream beside the routed experts)
    against =0: the same logits, tokens and routing bit for bit over graph-replayed steps of three places."""
    import cupy as cp

    from stratatools.runtime.gpu.batch import BatchDecoder
    from stratatools.runtime.gpu.decode import SHARED_SIDE_ENV

    ids = [t for _, p in kit_prompts for t in p]
    prompts = [ids[0:2], ids[2:3], ids[3:5]]
    with _kit_runtime(kit, model, gemm, monkeypatch) as rt:
        bds = []
        for flag in ("0", "1"):
            monkeypatch.setenv(SHARED_SIDE_ENV, flag)
            bds.append(BatchDecoder(rt.dec, 3))
        assert bds[0]._shared_side is None and bds[1]._shared_side is not None
        toks = _admit_all(rt, bds, prompts)
        for s in range(6):
            got = [bd.step([0, 1, 2], toks) for bd in bds]
            assert np.array_equal(cp.asnumpy(got[0][0]), cp.asnumpy(got[1][0])), s
            assert np.array_equal(got[0][1], got[1][1]) and np.array_equal(got[0][2], got[1][2]), s
            toks = [int(t) for t in got[0][1]]
        assert bds[1].stats["graph_steps"] >= 4, bds[1].stats


@pytest.mark.parametrize("model,gemm", [(BF16, "sgemm"), ("quant/model-ISTA-mix.gguf", "mma")])
def test_gpu_device_staged_and_queued_steps_equal_host_staged_steps(kit, kit_prompts, model, gemm, monkeypatch):
    """The graph step staged on the device (``stage_steps``) against the same step staged on the host
    (STRATATOOLS_BATCH_DEV_STAGE=0): logits, tokens and routing bit for bit over synchronous steps; then queued steps
    (each launched from the device's arg-max before the host reads the step before) give the same tokens and routing
    step for step and leave the same positions and PLE contexts; the queue's misuse is refused."""
    import cupy as cp

    from stratatools.core.errors import StrataError
    from stratatools.runtime.gpu.batch import DEV_STAGE_ENV, BatchDecoder

    ids = [t for _, p in kit_prompts for t in p]
    prompts = [ids[0:2], ids[2:3], ids[3:5]]
    with _kit_runtime(kit, model, gemm, monkeypatch) as rt:
        dec = rt.dec
        bds = []
        for flag in ("0", "1", "1"):
            monkeypatch.setenv(DEV_STAGE_ENV, flag)
            bds.append(BatchDecoder(dec, 3))
        host, devs, q = bds
        assert host.queue_ready()[0] is False and "DEV_STAGE" in host.queue_ready()[1]
        assert q.queue_ready() == (True, "")
        toks = _admit_all(rt, bds, prompts)
        with pytest.raises(StrataError, match="needs every place's token"):
            q.launch()
        first = list(toks)
        ref = []
        for s in range(6):
            got = [bd.step([0, 1, 2], toks) for bd in (host, devs)]
            assert np.array_equal(cp.asnumpy(got[0][0]), cp.asnumpy(got[1][0])), s
            for a, b in zip(got[0][1:], got[1][1:]):
                assert np.array_equal(a, b), s
            ref.append(got[0][1:])
            toks = [int(t) for t in got[0][1]]
        assert devs._dstage is not None and host._dstage is None and devs.stats["graph_steps"] >= 4
        assert [list(c) for c in devs.ple_ctx] == [list(c) for c in host.ple_ctx]
        # queued: two in flight, each next step from the device's tokens
        q.launch(first)
        with pytest.raises(StrataError, match="not collected"):
            q.step([0, 1, 2], first)
        with pytest.raises(StrataError, match="not collected"):
            q.admit(0)
        q.launch()
        assert q.queued == 2
        with pytest.raises(StrataError, match="queued already"):
            q.launch()
        out = [q.collect()[1:]]
        for s in range(1, 6):
            if s + 1 < 6:
                q.launch()
            out.append(q.collect()[1:])
        assert q.queued == 0
        with pytest.raises(StrataError, match="no queued step"):
            q.collect()
        for s, (a, b) in enumerate(zip(out, ref)):
            for x, y in zip(a, b):
                assert np.array_equal(x, y), s
        assert q.pos.tolist() == host.pos.tolist()
        assert [list(c) for c in q.ple_ctx] == [list(c) for c in host.ple_ctx]
        assert q.stage_errors() == 0 and q.stats["graph_steps"] >= 4 and q.stats["queued_steps"] == 5
        # one place: the read-back arrays are copies, not views of a pinned slot a later step rewrites
        one = BatchDecoder(dec, 1)
        one.launch(_admit_all(rt, [one], prompts[:1]))
        one.launch()
        got = [one.collect(), one.collect()]
        assert all(not np.shares_memory(a, sl[key]) for r in got for a in r[1:] for sl in one._rb for key in sl)
        assert got[0][1][0] == ref[0][0][0]  # (place 0 of the three-place steps: the same prompt)


@pytest.mark.parametrize("model,gemm", [(BF16, "sgemm"), ("quant/model-ISTA-mix.gguf", "mma")])
def test_gpu_run_batched_queued_equals_synchronous(kit, kit_prompts, model, gemm, monkeypatch):
    """run_batched with queued steps (device staging) against synchronous host-staged steps: five prompts over three
    places (admissions while others run, a tail with some places idle), a stop token met mid-run (seen a step late
    by the queue, so the next prompt joins a step later): the same new tokens and stops, and each request's routing
    records in the same order with the same experts and weights within 1e-4 (the requests' records interleave
    differently where a prompt joined later)."""
    from stratatools.runtime.gpu.batch import DEV_STAGE_ENV, BatchDecoder, run_batched

    ids = [t for _, p in kit_prompts for t in p]
    prompts = [ids[0:2], ids[2:3], ids[3:5], ids[5:6], ids[6:8]]
    with _kit_runtime(kit, model, gemm, monkeypatch) as rt:
        dec = rt.dec

        def run(flag, stop_id):
            monkeypatch.setenv(DEV_STAGE_ENV, flag)
            bd = BatchDecoder(dec, 3)
            recs = []
            out, tot = run_batched(dec, bd, prompts, 6, stop_id,
                                   on_record=lambda r, ph, rec: recs.append((r, ph, rec)))
            return bd, out, tot, recs

        _, base, _, _ = run("0", -1)
        stop = base[1].new_ids[2]  # met mid-run by request 1 (and maybe others)
        runs = [run(flag, stop) for flag in ("0", "1")]
        assert runs[0][0].queue_ready()[0] is False and runs[1][0].queue_ready()[0] is True
        assert runs[1][0].stats["graph_steps"] > 0
        (_, oa, ta, ra), (_, ob, tb, rb) = runs
        assert [(r.new_ids, r.stop) for r in oa] == [(r.new_ids, r.stop) for r in ob]
        assert any(r.stop == "stop" for r in oa)
        assert ta["decode_forwards"] == tb["decode_forwards"] and len(ra) == len(rb)
        for req in range(len(prompts)):
            mine = [[(p, c) for r, p, c in recs if r == req] for recs in (ra, rb)]
            assert len(mine[0]) == len(mine[1]) >= 1, req
            for (p1, c1), (p2, c2) in zip(*mine):
                assert p1 == p2 and np.array_equal(c1.positions, c2.positions), req
                for a, b in zip(c1.ids, c2.ids):
                    assert np.array_equal(a, b), req
                # (a request's step may be a graph step in one run and an eager one in the other, and run among
                # other places, where a prompt joined a step later: the router's SGEMM over another count of rows
                # adds in another order, float32 rounding apart; H200, the ISTA mix: 2.0e-5 relative)
                for a, b in zip(c1.weights, c2.weights):
                    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(req))


def _steps_bits(rt, bds, prompts, env, before, now, monkeypatch) -> None:
    """Six steps of the two decoders ``bds`` over ``prompts``, the first with ``env`` = ``before``, the second with
    ``now`` (set before each step: read at the eager step and at the capture): the logits, tokens and routing bit for
    bit, the second decoder's steps replayed from its graph from the third on."""
    import cupy as cp

    toks = _admit_all(rt, bds, prompts)
    for s in range(6):
        got = []
        for flag, bd in zip((before, now), bds):
            monkeypatch.setenv(env, flag)
            got.append(bd.step([0, 1, 2], toks))
        assert np.array_equal(cp.asnumpy(got[0][0]), cp.asnumpy(got[1][0])), s
        for a, b in zip(got[0][1:], got[1][1:]):
            assert np.array_equal(a, b), s
        toks = [int(t) for t in got[0][1]]
    assert bds[1].stats["graph_steps"] >= 4, bds[1].stats


def _kit_prompts3(kit_prompts) -> list[list[int]]:
    ids = [t for _, p in kit_prompts for t in p]
    return [ids[0:2], ids[2:3], ids[3:5]]


@pytest.mark.parametrize("env,before,now", [("STRATATOOLS_GDN_STEP_COLS", "0", "1")])
def test_gpu_switches_keep_the_steps_bits(kit, kit_prompts, monkeypatch, env, before, now):
    """The batched GDN recurrence's grid with one head's column parts together (STRATATOOLS_GDN_STEP_COLS=1, the
    default) against heads first (0), on the kit's Q2_0 model (integer expert jobs, the integer dense ring): the
    batched steps' logits, tokens and routing bit for bit, eager and graph-replayed steps. The state is loaded after
    griddepcontrol.wait (STRATATOOLS_GDN_STEP_EARLY=0), so that the column-parts grid runs pf_gdn_step_rwc itself
    (the default, 1, runs pf_gdn_step_rwce there: test_gpu_gdn_state_loaded_early_keeps_the_steps_bits)."""
    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.batch import BatchDecoder
    from stratatools.runtime.gpu.prefill import GDN_STEP_EARLY_ENV

    monkeypatch.setenv(GDN_STEP_EARLY_ENV, "0")
    with _kit_runtime(kit, "quant/model-Q2_0.gguf", "mma", monkeypatch) as rt:
        ly = rt.dec.rt.tier.arena.layers[0]
        assert qmm.jobs_i8(ly.gu_type.id, ly.d_type.id)
        bds = [BatchDecoder(rt.dec, 3), BatchDecoder(rt.dec, 3)]
        calls = {"pf_gdn_step_rw": 0, "pf_gdn_step_rwc": 0}  # (each decoder's recurrence kernel, counted)
        for bd in bds:
            for attr, name in (("k_gdn_step_rw", "pf_gdn_step_rw"), ("k_gdn_step_rwc", "pf_gdn_step_rwc")):
                def counted(*a, _k=getattr(bd, attr), _n=name, **kw):
                    calls[_n] += 1
                    return _k(*a, **kw)
                setattr(bd, attr, counted)
        _steps_bits(rt, bds, _kit_prompts3(kit_prompts), env, before, now, monkeypatch)
        assert calls["pf_gdn_step_rw"] > 0 and calls["pf_gdn_step_rwc"] > 0, calls  # (both kernels ran)


@pytest.mark.parametrize("now,kernel", [("1", "pf_gdn_step_rwce"), ("cs", "pf_gdn_step_rwcs")])
def test_gpu_gdn_state_loaded_early_keeps_the_steps_bits(kit, kit_prompts, monkeypatch, now, kernel):
    """The batched recurrence's state loaded before griddepcontrol.wait (STRATATOOLS_GDN_STEP_EARLY=1, the default;
    cs: loads and stores that evict first) against after it (0), on the kit's Q2_0 model: the batched steps' logits,
    tokens and routing bit for bit, eager and graph-replayed steps (the graph's launches by programmatic dependent
    launch, so the early loads overlap the kernels before); the early kernel was launched in the capture."""
    from stratatools.runtime.gpu import launch
    from stratatools.runtime.gpu.batch import BatchDecoder
    from stratatools.runtime.gpu.prefill import GDN_STEP_EARLY_ENV

    with _kit_runtime(kit, "quant/model-Q2_0.gguf", "mma", monkeypatch) as rt:
        launch.BATCH_PDL_LAUNCHES.clear()
        bds = [BatchDecoder(rt.dec, 3), BatchDecoder(rt.dec, 3)]
        _steps_bits(rt, bds, _kit_prompts3(kit_prompts), GDN_STEP_EARLY_ENV, "0", now, monkeypatch)
    assert launch.BATCH_PDL_LAUNCHES.get(kernel, 0) > 0 and launch.BATCH_PDL_LAUNCHES.get("pf_gdn_step_rwc", 0) > 0


def test_gpu_shared_expert_q8r_copies(kit, kit_prompts, monkeypatch):
    """The shared expert's products of the batched step from Q8R copies on the integer dense ring
    (STRATATOOLS_Q8R_SHARED=1, the default) against its Q8_0 blocks on the fp16 kernel (0), on the kit's ISTA mix
    (its shared expert is Q8_0; the Q2_0 model's is Q2_0, which keeps the blocks):
    every layer's copies made (the same codes and scales as the blocks), the steps' logits within 1e-4 of the
    largest (the ring's 16-bit fixed point against fp16 halves), the same tokens and expert ids."""
    import cupy as cp

    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.batch import BatchDecoder
    from stratatools.runtime.gpu.kernels import q8_relayout

    with _kit_runtime(kit, "quant/model-ISTA-mix.gguf", "mma", monkeypatch) as rt:
        m = rt.dec.rt.w.model
        assert m.tensor("blk.0.ffn_gate_shexp.weight").type.name == "Q8_0"
        bds = [BatchDecoder(rt.dec, 3), BatchDecoder(rt.dec, 3)]
        toks = _admit_all(rt, bds, _kit_prompts3(kit_prompts))
        used = {"0": 0, "1": 0}  # (steps' products from the copies, by setting)
        for bd in bds:
            shared = bd._shared_q8r

            def spy(il, T, _f=shared):
                got = _f(il, T)
                used[os.environ.get(qmm.Q8R_SHARED_ENV, "")] += got is not None
                return got
            bd._shared_q8r = spy
        for s in range(4):
            got = []
            for flag, bd in zip(("0", "1"), bds):
                monkeypatch.setenv(qmm.Q8R_SHARED_ENV, flag)
                got.append(bd.step([0, 1, 2], toks))
            la, lb = cp.asnumpy(got[0][0]), cp.asnumpy(got[1][0])
            assert np.abs(la - lb).max() <= 1e-4 * np.abs(la).max(), s
            assert np.array_equal(got[0][1], got[1][1]) and np.array_equal(got[0][2], got[1][2]), s
            toks = [int(t) for t in got[0][1]]
        assert used["0"] == 0 and used["1"] > 0, used
        copies = rt.dec.rt._shared_q8r
        q8 = [j for j in range(rt.dec.rt.cfg.n_layer)
              if all(m.tensor(f"blk.{j}.ffn_{r}_shexp.weight").type.name == "Q8_0" for r in ("gate", "up", "down"))]
        assert 0 in q8 and sorted(copies) == q8
        t = m.tensor("blk.0.ffn_down_shexp.weight")
        q, d = q8_relayout(np.asarray(m.raw(t)), int(t.ne[1]), int(t.ne[0]))
        assert np.array_equal(cp.asnumpy(copies[0][1].q), q) and np.array_equal(cp.asnumpy(copies[0][1].d), d)


def test_gpu_batch_pdl_keeps_the_steps_bits(kit, kit_prompts, monkeypatch):
    """The batched step's kernels by programmatic dependent launch inside its graph (STRATATOOLS_BATCH_PDL=1, the
    default; the dense ring's first weight copies before its griddepcontrol.wait) against plain launches (0), on the
    kit's Q2_0 model: the batched steps' logits, tokens and routing bit for bit, eager and graph-replayed steps; the
    capture made launches with the attribute of the expert jobs, the dense products, the job table and the router
    (its logits by qmm_f32_nt, its top-k by pf_route_warp)."""
    from stratatools.runtime.gpu import launch, qmm
    from stratatools.runtime.gpu.batch import BatchDecoder

    with _kit_runtime(kit, "quant/model-Q2_0.gguf", "mma", monkeypatch) as rt:
        ly = rt.dec.rt.tier.arena.layers[0]
        assert qmm.jobs_i8(ly.gu_type.id, ly.d_type.id) and qmm.jobs_ring() is not None
        assert qmm.dense_i8() is not None and launch.batch_pdl_on() is True
        launch.BATCH_PDL_LAUNCHES.clear()
        bds = [BatchDecoder(rt.dec, 3), BatchDecoder(rt.dec, 3)]
        _steps_bits(rt, bds, _kit_prompts3(kit_prompts), launch.BATCH_PDL_ENV, "0", "1", monkeypatch)
    got = launch.BATCH_PDL_LAUNCHES
    for name in ("qmm_moe_gu_i8", "qmm_moe_down_i8", "qmm_dense", "qmm_jobs", "pf_route_warp", "qmm_f32_nt"):
        assert sum(n for k, n in got.items() if k.startswith(name)) > 0, (name, got)


def test_gpu_copy_plan_keeps_the_steps_bits(kit, kit_prompts, monkeypatch):
    """The rings' copies from each thread's plan (STRATATOOLS_QMM_COPY_PLAN=1, the default) against worked out each
    chunk (0), on the kit's Q2_0 model (the integer expert jobs' ring, the integer dense ring): the batched steps'
    logits, tokens and routing bit for bit, eager and graph-replayed steps; both builds of the rings' modules ran."""
    from stratatools.runtime.gpu import qmm
    from stratatools.runtime.gpu.batch import BatchDecoder

    seen: dict[bool, int] = {False: 0, True: 0}  # (ring module fetches under each setting)
    fetch = qmm.instances_module

    def spy(names):
        seen[qmm.copy_plan()] += 1
        return fetch(names)

    monkeypatch.setattr(qmm, "instances_module", spy)
    with _kit_runtime(kit, "quant/model-Q2_0.gguf", "mma", monkeypatch) as rt:
        ly = rt.dec.rt.tier.arena.layers[0]
        assert qmm.jobs_i8(ly.gu_type.id, ly.d_type.id) and qmm.jobs_ring() is not None
        assert qmm.dense_i8() is not None
        bds = [BatchDecoder(rt.dec, 3), BatchDecoder(rt.dec, 3)]
        _steps_bits(rt, bds, _kit_prompts3(kit_prompts), qmm.COPY_PLAN_ENV, "0", "1", monkeypatch)
    assert seen[False] > 0 and seen[True] > 0, seen
