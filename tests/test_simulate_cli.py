"""simulate / compare commands, report files, k-fold, coverage, on synthetic traces and the kit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stratatools.cachesim.kfold import fold_of_requests, t975, t_interval
from stratatools.cachesim.replay import prepare_entries, simulate_policy
from stratatools.cachesim.study import coverage_curve, run_study
from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile
from stratatools.profiles.ranking import make_profile
from stratatools.traces.table import DECODE, PREFILL, TraceTable
from stratatools.traces.formats import write_trace

L, E, K = 4, 16, 3


def synth(n_req=6, n_tok=20, seed=0, prefill=0):
    rng = np.random.default_rng(seed)
    hot = rng.random((L, E)) ** 4 + 1e-3
    cols = {k: [] for k in ("request", "position", "phase", "layer", "rank", "expert", "weight")}
    for r in range(n_req):
        for p in range(-prefill, n_tok):
            for l in range(L):
                es = rng.choice(E, size=K, replace=False, p=hot[l] / hot[l].sum())
                for j, e in enumerate(es):
                    cols["request"].append(r); cols["position"].append(p)
                    cols["phase"].append(PREFILL if p < 0 else DECODE); cols["layer"].append(l)
                    cols["rank"].append(j); cols["expert"].append(int(e)); cols["weight"].append(1.0)
    return TraceTable(**{k: np.array(v) for k, v in cols.items()}, meta={"source_format": "synthetic"})


@pytest.fixture()
def files(tmp_path):
    t = synth(prefill=2)
    tp = tmp_path / "t.parquet"
    write_trace(t, tp, "parquet")
    good, _ = make_profile([t], L, E, mode="no-base")
    rng = np.random.default_rng(9)
    perm = rng.permutation(L * E)
    stale = Profile(L, E, np.stack([perm // E, perm % E], 1))
    gp, sp = tmp_path / "good.bin", tmp_path / "stale.bin"
    good.write(gp)
    stale.write(sp)
    return t, tp, gp, sp


def test_prepare_entries_rounds_tokens_phase():
    t = synth(n_req=2, n_tok=5, prefill=3)
    cold = prepare_entries(t, L, E, cold=True)
    assert len(cold) == cold.n_counted == 2 * 5 * L * K and cold.skipped["prefill"] == 2 * 3 * L * K
    assert cold.n_tokens == 10 and cold.n_rounds == 10 and len(np.unique(cold.record)) == 2 * 5 * L
    assert cold.count is None and cold.n_warmup == 0
    # default: the prefill is replayed (it warms the cache) but only the decode is counted
    warm = prepare_entries(t, L, E)
    assert len(warm) == 2 * 8 * L * K and warm.n_counted == 2 * 5 * L * K and warm.n_warmup == 2 * 3 * L * K
    assert warm.skipped["prefill"] == 0 and warm.n_tokens == 10 and warm.n_rounds == 16
    assert warm.count.tolist() == (np.asarray(t.phase) != PREFILL).tolist()
    with pytest.raises(StrataError, match="--phase decode"):
        prepare_entries(t, L, E, phase="all", cold=True)
    ent_all = prepare_entries(t, L, E, phase="all")
    assert ent_all.n_tokens == 16
    assert prepare_entries(t, 2, E, cold=True).skipped["layer"] == 2 * 5 * 2 * K
    assert prepare_entries(t, 2, E).skipped["layer"] == 2 * 8 * 2 * K  # the warm-up's entries are checked too
    with pytest.raises(StrataError, match="no routed entry"):
        prepare_entries(t.take(t.phase == PREFILL), L, E, cold=True)
    with pytest.raises(StrataError, match="prefill entries only"):
        prepare_entries(t.take(t.phase == PREFILL), L, E)


def test_coverage_measured_equals_static_global():
    t = synth()
    ent = prepare_entries(t, L, E)
    p, _ = make_profile([t], L, E)
    c = coverage_curve(ent, p, points=8)
    for n, m in zip(c["n"], c["measured"]):
        r = simulate_policy(ent, "static", profile=p, slots=n)
        assert r.h_expert == pytest.approx(m)
    assert c["claimed_kind"] == "oracle" and c["claimed"][-1] == pytest.approx(1.0)


def test_t_interval_and_folds():
    assert t975(1) == 12.706 and t975(9) == 2.262 and 1.96 < t975(1000) < 1.98
    m, lo, hi = t_interval([0.5, 0.6, 0.7])
    assert m == pytest.approx(0.6) and hi - m == pytest.approx(4.303 * 0.1 / np.sqrt(3))
    f = fold_of_requests(np.array([5, 5, 7, 9, 9, 11]), 2)
    assert f.tolist() == [0, 0, 1, 0, 0, 1]
    with pytest.raises(StrataError, match="only 2 request"):
        fold_of_requests(np.array([1, 2]), 3)


def test_study_kfold_in_sample_beats_held_out_on_average():
    t = synth(n_req=8, n_tok=15, seed=2)
    p, _ = make_profile([t], L, E)
    st = run_study([t], [p], ["good"], policies=["static", "lru", "belady"], slots=16, kfold=4)
    kf = st.kfold
    assert len(kf.folds) == 4 and sum(r["requests"] for r in kf.folds) == 8
    assert kf.low["static"] <= kf.mean["static"] <= kf.high["static"]
    assert kf.in_sample["static"] == pytest.approx(
        [r.h_expert for r in st.results if r.policy == "static"][0])
    bel = {r.label: r.h_expert for r in st.results if r.policy == "belady"}
    stat = [r.h_expert for r in st.results if r.policy == "static"][0]
    assert bel["good split"] >= stat


def test_simulate_cli_report(cli, files, tmp_path):
    t, tp, gp, sp = files
    rep = tmp_path / "rep"
    code, out, err = cli("simulate", "-t", tp, "-p", gp, "-p", sp, "--slots", 16, "--report", rep, "--kfold", 3)
    assert code == 0, err
    for f in ("report.md", "report.json", "hit_rate_vs_budget.png", "layer_heatmap.png", "coverage.png"):
        assert (rep / f).stat().st_size > 0
    js = json.loads((rep / "report.json").read_text())
    rows = {(r["label"], r["policy"]): r for r in js["results"]}
    good = rows[("good", "static")]["h_expert"]
    stale = rows[("stale", "static")]["h_expert"]
    assert good > stale  # the profile built on these traces beats a random ranking in-sample
    ent = prepare_entries(t, L, E)
    from stratatools.profiles.strp import read_profile
    ref = simulate_policy(ent, "static", profile=read_profile(gp), slots=16)
    assert good == pytest.approx(ref.h_expert)
    assert js["kfold"]["k"] == 3 and "good" in (rep / "report.md").read_text()
    # second run refuses without --force, and the bytes are deterministic with it
    code, _, err = cli("simulate", "-t", tp, "-p", gp, "--slots", 16, "--report", rep)
    assert code == 2 and "--force" in err
    before = {f: (rep / f).read_bytes() for f in ("report.json", "coverage.png", "layer_heatmap.png")}
    code, _, _ = cli("simulate", "-t", tp, "-p", gp, "-p", sp, "--slots", 16, "--report", rep, "--kfold", 3, "--force")
    assert code == 0
    assert all((rep / f).read_bytes() == b for f, b in before.items())


def test_simulate_json_alone_prints_the_study_and_writes_nothing(cli, files, tmp_path, monkeypatch):
    """``--json`` is a switch printing the result on stdout (no ``--report`` needed, no file written); with
    ``--report`` too, stdout is the same JSON as the report's report.json. Without either, the table alone."""
    t, tp, gp, sp = files
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = cli("simulate", "-t", tp, "-p", gp, "--slots", 16, "--policy", "static,lru", "--json")
    assert code == 0, err
    js = json.loads(out)
    from stratatools.profiles.strp import read_profile

    ref = simulate_policy(prepare_entries(t, L, E), "static", profile=read_profile(gp), slots=16)
    assert {(r["label"], r["policy"]) for r in js["results"]} >= {("good", "static")}
    assert [r["h_expert"] for r in js["results"] if r["policy"] == "static"] == [pytest.approx(ref.h_expert)]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no report folder, no file
    rep = tmp_path / "rep"
    code, out2, err = cli("simulate", "-t", tp, "-p", gp, "--slots", 16, "--policy", "static,lru", "--json",
                          "--report", rep)
    assert code == 0, err
    assert json.loads(out2) == js == json.loads((rep / "report.json").read_text())
    code, out3, err = cli("simulate", "-t", tp, "-p", gp, "--slots", 16, "--policy", "static,lru")
    assert code == 0, err
    assert "h_expert" in out3 and "wrote" not in out3 + err and sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["rep"])


def test_simulate_cli_errors(cli, files, tmp_path):
    t, tp, gp, sp = files
    code, _, err = cli("simulate", "-t", tp, "-p", gp, "--budget-gib", 1, "--report", tmp_path / "r")
    assert code == 2 and "blob sizes" in err
    code, _, err = cli("simulate", "-t", tp, "-p", gp, "--report", tmp_path / "r")
    assert code == 2 and "no budget" in err
    code, _, err = cli("simulate", "-t", tp, "-p", gp, "--slots", 4, "--kfold", 10, "--report", tmp_path / "r")
    assert code == 2 and "request" in err
    code, _, err = cli("simulate", "-t", tp, "-p", gp, "--slots", 4, "--policy", "fifo", "--report", tmp_path / "r")
    assert code == 2 and "fifo" in err
    code, _, err = cli("simulate", "-t", tmp_path / "nope.bin", "-p", gp, "--slots", 4, "--report", tmp_path / "r")
    assert code == 2 and "no such file" in err
    assert not (tmp_path / "r").exists()


def test_compare_json(cli, files):
    t, tp, gp, sp = files
    code, out, err = cli("compare", "-t", tp, "-p", gp, "-p", sp, "--slots", 16, "--policy", "static,belady", "--json")
    assert code == 0, err
    js = json.loads(out)
    labels = {(r["label"], r["policy"]) for r in js["rows"]}
    assert {("good", "static"), ("stale", "static"), ("good split", "belady"), ("stale split", "belady")} <= labels


@pytest.mark.kit
def test_kit_pruned_model_budget(cli, kit, tmp_path):
    d = kit / "pruned"
    code, out, err = cli("compare", "-t", d / "coder-revA.routing.csv", "-p", d / "profile-revA.bin",
                         "--model", d / "coder-revA.gguf", "--budget-gib", 0.01, "--policy", "static,lru", "--json")
    assert code == 0, err
    js = json.loads(out)
    st = [r for r in js["rows"] if r["policy"] == "static"][0]
    assert 0.0 < st["h_expert"] <= 1.0 and js["entries"] == 4320


def test_cold_replay_moves_lru_and_adaptive_at_48x512():
    # docs/synthetic-routing.md once reported the same adaptive and LRU figures warm and cold at 48 x 512; a replay
    # at that geometry must depend on the start state for the tiers that move (LRU, adaptive), not for static
    from stratatools.cachesim.kfold import kfold_eval
    from stratatools.cachesim.replay import prepare_entries, simulate_policy
    from stratatools.traces.table import DECODE, PREFILL, TraceTable

    L, E, k, R, P, D = 48, 512, 10, 10, 16, 8
    rng = np.random.default_rng(3)
    pools = np.argsort(rng.random((R, L, E)), axis=2)[:, :, :40]           # each request's topic: 40 experts/layer
    pick = np.argsort(rng.random((R, P + D, L, 40)), axis=3)[..., :k]       # k of them per token
    ex = np.take_along_axis(pools[:, None, :, :].repeat(P + D, axis=1), pick, axis=3)
    r, p, lay, rk = np.meshgrid(np.arange(R), np.arange(P + D), np.arange(L), np.arange(k), indexing="ij")
    t = TraceTable(r.ravel(), p.ravel(), np.where(p.ravel() < P, PREFILL, DECODE), lay.ravel(), rk.ravel(),
                   ex.ravel(), np.full(ex.size, 0.1))
    slots = L * E // 8
    res = {}
    for cold in (False, True):
        ent = prepare_entries(t, L, E, phase="decode", cold=cold)
        assert ent.n_counted == R * D * L * k and len(ent) == (R * D if cold else R * (P + D)) * L * k
        lru = simulate_policy(ent, "lru", slots=slots, admission="per-layer").h_expert
        kf = kfold_eval(t, L, E, 5, policies=["static", "adaptive"], slots=slots, admission="per-layer", cold=cold)
        res[cold] = (lru, kf.mean["adaptive"], kf.mean["static"])
    (lru_w, ad_w, st_w), (lru_c, ad_c, st_c) = res[False], res[True]
    assert lru_w > lru_c + 0.2          # warm: the request's prefill already loaded its topic
    assert ad_w > ad_c + 0.1 and st_w == st_c  # measured: LRU 0.996 / 0.587, adaptive 0.33 / 0.14, static 0.12


def test_report_dash_is_refused_and_makes_no_folder(cli, files, tmp_path, monkeypatch):
    """``--report -`` is a one-line error (it made a folder named '-'; ``--trace-out -`` was already refused)."""
    t, tp, gp, sp = files
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("simulate", "-t", tp, "-p", gp, "--slots", 16, "--report", "-")
    assert code == 2 and "--report -" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "-").exists()
