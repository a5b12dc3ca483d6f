"""bench/bench_gpu_run.py's plan, checked without a GPU: each kernel profile runs under its config row's environment
(as the timed row does), ``--types`` reaches ``stratatools synth``, and the IQ2_XS + IQ4_NL model it makes (issue
12's variant) gets the staged expert kernels where the decoder asks for the pipelined ones."""

from __future__ import annotations

import importlib.util
import io
import shutil
from pathlib import Path

import pytest

from stratatools.cli import run_captured

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_run", ROOT / "bench" / "bench_gpu_run.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)  # (imports numpy only; CuPy and torch are imported inside main / the profiles)
    return m


def test_every_profile_runs_under_its_rows_env(bench):
    rows = bench.config_rows(1872)
    by_key = {k: (title, kw) for k, title, kw in rows}
    want = {"resident", "unfused", "before", "rowsdense", "int8dense", "stagedexp", "pipeexp", "allmisspipe", "lruasync", "static",
            "lrufetch", "allmissfetch"}
    plan = bench.profile_plan(rows, want, 1872, profile_lru=True)
    got = {title: (sl, pol, fused, env) for title, sl, pol, fused, env in plan}
    assert plan[0] == ("all resident (fused)", None, "static", True, {})
    for key in ("before", "rowsdense", "int8dense", "stagedexp", "pipeexp"):  # all-resident rows that change the step: their env
        title, kw = by_key[key]
        assert got[title] == (None, "static", True, kw["_env"]) and kw["_env"]
    assert got[by_key["unfused"][0]] == (None, "static", False, {})
    assert got[by_key["lruasync"][0]] == (1872, "lru", True, {"STRATATOOLS_ASYNC_SWAPS": "1"})
    assert got[by_key["lrufetch"][0]] == (1872, "lru", True, {"STRATATOOLS_MISS_FETCH": "fetch"})
    assert got[by_key["lru"][0]] == (1872, "lru", True, {})  # --profile-lru: the plain LRU row, selected or not
    assert by_key["lruzc"][1]["_env"] == {"STRATATOOLS_MISS_FETCH": "zero-copy"}
    assert by_key["vram12pf0"][1]["_env"] == {"STRATATOOLS_MISS_FETCH": "prefetch", "STRATATOOLS_PREFETCH_EXTRA": "0"}
    assert "(top k only)" in by_key["vram12pf0"][0] and "(top k only)" not in by_key["vram12pf"][0]
    for key in ("allmisspipe", "static", "allmissfetch"):  # slot rows other than --slots LRU: not profiled
        assert by_key[key][0] not in got
    assert len(plan) == 10
    assert [t for t, *_ in bench.profile_plan(rows, {"resident", "lru"}, 1872, False)] == ["all resident (fused)"]


def test_types_reach_synth_and_iq_experts_fall_back_to_staged(bench, tmp_path, monkeypatch):
    """``--types gu=IQ2_XS,down=IQ4_NL`` on the bench's synth command (2 layers x 16 experts, full width) writes
    those types; the all-resident decoder asks for the pipelined routed-expert kernels (PIPE_TYPES: Q8_0, Q2_0),
    and each layer's routed call falls back to the staged ones while the Q8_0 shared expert stays pipelined."""
    from stratatools.model.gguf import open_model
    from stratatools.runtime.gpu import experts as E

    assert bench.DEFAULT_TYPES == "gu=Q2_0,down=Q2_0"
    d = tmp_path / "model"
    out, err = io.StringIO(), io.StringIO()
    try:
        code = run_captured(bench.synth_argv(d, 2, 16, "gu=IQ2_XS,down=IQ4_NL"), out, err)
        assert code == 0, err.getvalue()
        with open_model(d / "synth-canonical.gguf") as m:
            types = {t.name: t.type for t in m.iter_tensors() if "_exps." in t.name or "_shexp." in t.name}
    finally:
        shutil.rmtree(d, ignore_errors=True)  # ~240 MB
    assert {t.name for n, t in types.items() if "gate_exps" in n or "up_exps" in n} == {"IQ2_XS"}
    assert {t.name for n, t in types.items() if "down_exps" in n} == {"IQ4_NL"}

    class Jobs:
        def __init__(self, J, T):
            self.n_jobs, self.n_tokens, self.per_token = J, T, None

    monkeypatch.delenv(E.MOE_KERNEL_ENV, raising=False)
    monkeypatch.delenv(E.MOE_PIPE_ENV, raising=False)
    routed, shared = E.decoder_expert_kernels(from_device=True)
    assert (routed, shared) == ("pipe", "pipe")
    for il in range(2):
        gu, dn = types[f"blk.{il}.ffn_gate_exps.weight"], types[f"blk.{il}.ffn_down_exps.weight"]
        assert E.expert_kernel_path(Jobs(10, 1), gu, dn, 2560, 640, fast=True, kernels=routed) == "staged"
        sg, sd = types[f"blk.{il}.ffn_gate_shexp.weight"], types[f"blk.{il}.ffn_down_shexp.weight"]
        assert E.expert_kernel_path(Jobs(1, 1), sg, sd, 2560, 640, fast=True, kernels=shared) == "pipe"


def test_timeline_summary_finds_the_wait_for_the_prefetch(bench):
    """Two steps of a made-up trace (us): the main stream runs a (0-10), waits, fetch_blobs (30-35), b (35-40), a
    (60-70); the side stream's fetch_blobs runs 5-28 (5 us of it beside a) and a copy 50-60 beside nothing; a CPU
    event is ignored. Halved per step: wall 70 us, main busy 30, idle 40 (20 before fetch_blobs, 20 before a),
    side busy 33 of which 28 alone."""
    def k(name, ts, dur, stream, cat="kernel"):
        return {"cat": cat, "name": f"void {name}(int)", "ts": ts, "dur": dur, "args": {"stream": stream}}

    ev = [k("a", 0, 10, 7), k("fetch_blobs", 30, 5, 7), k("b", 35, 5, 7), k("fetch_blobs", 5, 23, 9),
          k("Memcpy HtoD", 50, 10, 9, cat="gpu_memcpy"), {"cat": "cpu_op", "name": "x", "ts": 0, "dur": 99},
          k("a", 60, 10, 7)]
    tl = bench.timeline_summary(ev, steps=2)
    assert tl["main_stream"] == "7"
    assert tl["wall"] == pytest.approx(70 / 1e3 / 2)
    assert tl["main_busy"] == pytest.approx(30 / 1e3 / 2)
    assert tl["main_gaps"] == pytest.approx(40 / 1e3 / 2)
    assert tl["gap_before"] == pytest.approx({"fetch_blobs": 20 / 1e3 / 2, "a": 20 / 1e3 / 2})
    side = tl["side"]["9"]
    assert side["busy"] == pytest.approx(33 / 1e3 / 2) and side["kernels"] == 1.0
    assert side["alone"] == pytest.approx(28 / 1e3 / 2)  # 5-10 overlaps a; 10-28 and the copy do not
    assert tl["overlap"] == pytest.approx(5 / 1e3 / 2)
    assert side["by_kernel"] == pytest.approx({"fetch_blobs": 23 / 1e3 / 2, "Memcpy HtoD": 10 / 1e3 / 2})
    assert tl["device_idle"] == pytest.approx((70 - 30 - 28) / 1e3 / 2)  # 10-28 is the side fetch, 50-60 the copy
    assert tl["host_calls"] == {}
    ev.append({"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 4})
    assert bench.timeline_summary(ev, steps=2)["host_calls"] == pytest.approx({"cudaGraphLaunch": 4 / 1e3 / 2})
    assert bench.timeline_summary([], 2) == {}
