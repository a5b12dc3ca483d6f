"""`stratatools tune`, the three-tier cost model and the bursty workload generator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stratatools.cachesim.costmodel import ThreeTierModel, ram_set, tier_costs
from stratatools.cachesim.replay import prepare_entries
from stratatools.cachesim.tune import COMMUNITY, ENGINE_DEFAULTS, tune
from stratatools.cachesim.workload import Workload, generate
from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile
from stratatools.traces.table import DECODE, PREFILL


@pytest.fixture(scope="module")
def bursty():
    return generate(Workload(seed=3))


def test_workload_is_seeded_decode_heavy_and_top_k(bursty):
    w = Workload(seed=3)
    again = generate(w)
    assert np.array_equal(again.expert, bursty.expert) and np.array_equal(again.request, bursty.request)
    assert not np.array_equal(generate(Workload(seed=4)).expert, bursty.expert)
    dec = (bursty.phase == DECODE).mean()
    assert dec > 0.9 and (bursty.phase == PREFILL).any()
    # every record routes top_k distinct experts
    rec = bursty.expert.reshape(-1, w.top_k)
    assert all(len(set(r)) == w.top_k for r in rec[:500].tolist())
    assert int(bursty.layer.max()) == w.n_layers - 1 and int(bursty.expert.max()) < w.n_expert
    with pytest.raises(StrataError):
        generate(Workload(top_k=65))


def test_tune_beats_the_defaults_and_the_community_settings(bursty):
    # acceptance: on a decode-heavy bursty trace the held-out hit rate of the settings found is at least the
    # community's and significantly above the engine's defaults (paired 95% interval over folds above 0)
    w = Workload(seed=3)
    res = tune([bursty], w.n_layers, w.n_expert, slots=288, k=5, candidates=40, seed=0)
    assert res.defaults.settings == {"profile": "traces", **ENGINE_DEFAULTS}
    assert res.community.settings == {"profile": "traces", **COMMUNITY}
    assert len(res.defaults.folds) == len(res.community.folds) == len(res.best.folds) == 5
    best, dflt, comm = (a.mean("h_expert") for a in (res.best, res.defaults, res.community))
    assert best >= comm
    assert res.significant and res.diff_default[1] > 0 and best - dflt > 0.02
    d = res.to_dict()
    assert d["best"]["mean"] == pytest.approx(best) and d["significant_vs_defaults"] is True
    assert d["rungs"][0]["folds"] == 1 and d["rungs"][-1]["folds"] == 5
    assert d["rungs"][0]["settings"] > d["rungs"][-1]["settings"]
    flags = [x for x in res.engine_flags if not x.startswith("#")]
    assert len(flags) == 1 and f"--adapt-every {res.best.settings['adapt_every']}" in flags[0]
    assert "--expert-cache 288" in flags[0]


def test_tune_version_01_searches_no_02_knobs(bursty):
    w = Workload(seed=3)
    res = tune([bursty], w.n_layers, w.n_expert, slots=288, k=3, candidates=12, version="0.1")
    for a in res.finalists:
        assert a.settings["lag"] == 1 and a.settings["pace_slots"] == 0
    assert res.community.settings["lag"] == 1
    with pytest.raises(StrataError, match="strata-version"):
        tune([bursty], w.n_layers, w.n_expert, slots=288, version="0.3")
    with pytest.raises(StrataError, match="blob sizes"):
        tune([bursty], w.n_layers, w.n_expert, slots=288, objective="tok/s")


def test_tune_tok_s_objective_with_blob_sizes(bursty):
    w = Workload(seed=3)
    res = tune([bursty], w.n_layers, w.n_expert, budget_bytes=288 * 4096, blob_bytes=[4000] * w.n_layers, k=3,
               candidates=9, objective="tok/s", cost=ThreeTierModel(ram_bytes=400 * 4096))
    d = res.to_dict()
    assert d["score"] == "tok_s" and d["best"]["tok_s"] >= d["engine_defaults"]["tok_s"]
    b = d["best"]
    assert b["h_vram"] + b["h_ram"] + b["h_ssd"] == pytest.approx(1.0) and b["h_ssd"] > 0


def test_ram_set_stops_at_the_first_blob_that_does_not_fit():
    p = Profile(2, 3, np.array([[0, 0], [1, 0], [0, 1], [1, 1], [0, 2], [1, 2]]))
    slot = np.array([512, 768])
    m = ram_set(p, 2, 3, slot, 512 + 768 + 500)  # (0,1) needs 512 more: does not fit, the walk stops
    assert m.tolist() == [[True, False, False], [True, False, False]]
    assert ram_set(p, 2, 3, slot, None).all()
    m = ram_set(None, 2, 3, slot, 3 * 512)  # no profile: flat order layer 0 first
    assert m.tolist() == [[True, True, True], [False, False, False]]


def test_tier_costs_hand_worked():
    # 2 tokens, one layer of 1e9-byte blobs: entries hit, RAM, SSD, hit; one copy over PCIe
    lay = np.zeros(4, dtype=np.int64)
    ex = np.array([0, 1, 2, 0])
    hits = np.array([True, False, False, True])
    in_ram = np.array([[True, True, False]])
    m = ThreeTierModel(vram_gbps=100, pcie_gbps=10, ram_gbps=50, ssd_gbps=5, dense_bytes=0)
    c = tier_costs(lay, ex, hits, np.array([1]), 2, np.array([1_000_000_000]), in_ram, m)
    assert (c["h_vram"], c["h_ram"], c["h_ssd"]) == (0.5, 0.25, 0.25)
    # per token: 1e9 from VRAM (0.01 s), 0.5e9 from RAM (0.01 s), 0.5e9 from SSD (0.1 s), 0.5e9 copied (0.05 s)
    assert c["time_per_token_s"] == pytest.approx(0.17)
    assert c["tok_s"] == pytest.approx(1 / 0.17)
    with pytest.raises(StrataError):
        ThreeTierModel(ssd_gbps=0)


def test_tune_cli(cli, tmp_path, bursty):
    from stratatools.traces.formats import write_trace

    tp = tmp_path / "w.parquet"
    write_trace(bursty, tp, "parquet")
    code, out, err = cli("tune", "-t", str(tp), "--slots", "288", "-k", "3", "--candidates", "9", "--json",
                         "--plot", str(tmp_path / "p.png"), "--json-out", str(tmp_path / "r.json"))
    assert code == 0, err
    d = json.loads(out)
    assert d["k"] == 3 and d["budget"] == "288 slots" and set(d) >= {"best", "engine_defaults", "community"}
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "r.json").read_text())["best"] == d["best"]
    code, out, err = cli("tune", "-t", str(tp), "--slots", "288", "-k", "3", "--candidates", "3")
    assert code == 0 and "engine defaults" in out and "--adapt-every" in out and "engine flags" in out
    # the plot exists: refused without --force
    code, _, err = cli("tune", "-t", str(tp), "--slots", "288", "--plot", str(tmp_path / "p.png"))
    assert code == 2 and "already exists" in err


def test_tune_on_a_dask_cluster_equals_in_process(cli, tmp_path, bursty):
    """--cluster: the (settings, fold) scores run as Dask tasks (2 thread workers); the result is the in-process
    one, value for value."""
    pytest.importorskip("distributed")
    from stratatools.traces.formats import write_trace

    tp = tmp_path / "w.parquet"
    write_trace(bursty, tp, "parquet")
    args = ("tune", "-t", str(tp), "--slots", "288", "-k", "3", "--candidates", "6", "--json")
    code, out, err = cli(*args)
    assert code == 0, err
    code, out_c, err = cli(*args, "--cluster", "local-threads:2")
    assert code == 0, err
    a, b = json.loads(out), json.loads(out_c)
    a.pop("seconds", None), b.pop("seconds", None)
    assert a == b and a["best"]["mean"] > 0 and a["evaluations"] > 0
    code, _, err = cli(*args, "--cluster", "bogus")
    assert code == 2 and "--cluster bogus" in err


@pytest.mark.parametrize("args, msg", [
    (["--slots", "8", "--card", "12GB"], "exactly one budget"),
    ([], "exactly one budget"),
    (["--card", "twelve"], "expected a memory size"),
    (["--card", "1GB"], "1 GB is 1,000,000,000 bytes, less than the --reserve-gib 1.5"),
    (["--card", "12GB"], "blob sizes"),
    (["--slots", "8", "--objective", "speed"], "--objective"),
    (["--slots", "8", "-k", "1"], "'--kfold' / '-k': must be an integer from 2 to 2147483647 (got 1)"),
    (["--slots", "8", "--seed", "-1"], "'--seed': must be an integer from 0 to 9223372036854775807 (got -1)"),
])
def test_tune_cli_errors(cli, tmp_path, bursty, args, msg):
    from stratatools.traces.formats import write_trace

    tp = tmp_path / "w.parquet"
    write_trace(bursty, tp, "parquet")
    code, _, err = cli("tune", "-t", str(tp), *args)
    assert code == 2 and msg in err and "Traceback" not in err


def test_prepare_entries_of_the_workload_drops_prefill(bursty):
    """--cold drops the workload's prefill; the default replays it uncounted (it only warms the cache)."""
    w = Workload(seed=3)
    n_pf = int((bursty.phase == PREFILL).sum())
    ent = prepare_entries(bursty, w.n_layers, w.n_expert, cold=True)
    assert ent.skipped["prefill"] == n_pf and ent.rounds_by == "positions"
    warm = prepare_entries(bursty, w.n_layers, w.n_expert)
    assert warm.skipped["prefill"] == 0 and warm.n_warmup == n_pf and warm.n_counted == len(ent)
    assert warm.n_tokens == ent.n_tokens and warm.n_rounds == ent.n_rounds + w.requests * w.prefill


def test_simulate_engine_named_adaptive_options(cli, tmp_path):
    from stratatools.traces.formats import write_trace

    w = Workload(seed=3, requests=6, n_layers=6, decode_min=40, decode_max=60)
    tp = tmp_path / "w.parquet"
    write_trace(generate(w), tp, "parquet")
    pp = tmp_path / "w.strp"
    code, _, err = cli("make-profile", str(tp), "-o", str(pp), "--n-layer", "6", "--n-expert", "64")
    assert code == 0, err

    def h(*extra):
        code, out, err = cli("simulate", "-t", str(tp), "-p", str(pp), "--slots", "72", "--policy", "adaptive",
                             "--no-sweep", "--report", str(tmp_path / "r"), "--force", "--json", *extra)
        assert code == 0, err
        return json.loads(out)["results"][0]

    base = h()
    lag = h("--adapt-every", "1", "--adapt-swaps", "160", "--adapt-decay", "0.97", "--adapt-lag", "2")
    same = h("--set", "adaptive.adapt_every=1", "--set", "adaptive.max_moves=160", "--set", "adaptive.decay=0.97",
             "--set", "adaptive.lag=2")
    assert lag["h_expert"] == same["h_expert"] and lag["h_expert"] != base["h_expert"]
    assert lag["params"]["lag"] == 2 and lag["params"]["max_moves"] == 160
    up = h("--upper-slots", "12", "--disjoint-adapt")
    assert up["params"]["upper_slots"] == 12 and up["params"]["disjoint"] == 1 and up["h_expert"] > base["h_expert"]
    assert h("--strata-version", "0.1")["h_expert"] == base["h_expert"]
    for extra, msg in ((["--strata-version", "0.1", "--adapt-lag", "2"], "Strata 0.2.x behaviour"),
                       (["--adapt-lag", "2", "--set", "adaptive.lag=2"], "both given"),
                       (["--strata-version", "0.3"], "--strata-version"),
                       (["--adapt-lag", "0"], "'--adapt-lag': must be an integer from 1 to 2147483647 (got 0)")):
        code, _, err = cli("simulate", "-t", str(tp), "-p", str(pp), "--slots", "72", "--policy", "adaptive",
                           "--no-sweep", "--report", str(tmp_path / "r"), "--force", *extra)
        assert code == 2 and msg in err, (extra, err)


def test_simulate_study_three_tier_costs():
    from stratatools.cachesim.report import study_markdown
    from stratatools.cachesim.study import run_study
    from stratatools.profiles.ranking import make_profile

    w = Workload(seed=3, requests=4, n_layers=4, decode_min=30, decode_max=40)
    tb = generate(w)
    prof, _ = make_profile([tb], 4, 64, mode="no-base")
    blob = [1_000_000] * 4
    cost = ThreeTierModel(ram_bytes=128 * 1_000_192)
    st = run_study([tb], [prof], ["p"], policies=["static", "lru"], budget_bytes=48 * 1_000_192, blob_bytes=blob,
                   sweep=False, cost=cost)
    s = st.results[0]
    t = s.tiers
    assert t["h_vram"] == pytest.approx(s.h_expert)
    assert t["h_vram"] + t["h_ram"] + t["h_ssd"] == pytest.approx(1.0) and t["h_ssd"] > 0
    assert t["moved_bytes_per_token"] == 0  # a full profile leaves no free slot: the static tier copies nothing
    per_tok = (t["vram_bytes_per_token"] / 900e9 + t["ram_bytes_per_token"] / 60e9
               + t["ssd_bytes_per_token"] / 6e9)
    assert t["tok_s"] == pytest.approx(1 / per_tok)
    md = study_markdown(st)
    assert "## Three-tier cost model" in md and "| static | p |" in md
    assert st.to_dict()["cost_model"]["ssd_gbps"] == 6.0
    # without a cost model nothing changes
    st0 = run_study([tb], [prof], ["p"], policies=["static"], budget_bytes=48 * 1_000_192, blob_bytes=blob,
                    sweep=False)
    assert st0.results[0].tiers is None and st0.cost_model is None and "Three-tier" not in study_markdown(st0)


def test_tune_mapper_seam_gets_picklable_tasks(bursty):
    import pickle

    w = Workload(seed=3)
    calls = []

    def mapper(f, tasks):
        tasks = list(tasks)
        calls.append(len(tasks))
        return [f(*pickle.loads(pickle.dumps((t,)))) for t in tasks]

    a = tune([bursty], w.n_layers, w.n_expert, slots=288, k=3, candidates=6, mapper=mapper)
    b = tune([bursty], w.n_layers, w.n_expert, slots=288, k=3, candidates=6)
    assert len(calls) >= 2 and sum(calls) == a.evaluated
    assert a.best.settings == b.best.settings and a.best.mean("h_expert") == b.best.mean("h_expert")


def test_tune_tie_goes_to_the_engine_defaults(bursty):
    # every pair fits: every setting hits on every entry after the fill, so nothing beats the defaults
    w = Workload(seed=3)
    res = tune([bursty], w.n_layers, w.n_expert, slots=w.n_layers * w.n_expert, k=3, candidates=6)
    assert res.best is res.defaults and not res.significant
    assert res.diff_default == (0.0, 0.0, 0.0)


def test_tune_geometry_from_a_trace_with_a_huge_expert_id_is_refused(cli, tmp_path):
    # two rows, one naming expert 99,999,999: the inferred geometry must not allocate per expert
    tp = tmp_path / "x.csv"
    tp.write_text("model,prompt_id,token_pos,layer,rank,expert_id,weight\n"
                  "m,p0,0,0,0,99999999,0.5\nm,p1,0,0,0,3,0.5\n")
    code, _, err = cli("tune", "-t", str(tp), "--slots", "8", "-k", "2")
    assert code == 2 and "Traceback" not in err
    assert "x.csv" in err and "100000000 experts" in err and "--model" in err


def test_kfold_on_a_single_request_asks_for_more_requests_not_one_fold():
    from stratatools.cachesim.kfold import fold_of_requests

    with pytest.raises(StrataError) as e:
        fold_of_requests(np.zeros(5, np.int64), 2)
    assert "at least 2 requests" in str(e.value) and "at most 1 folds" not in str(e.value)


def test_tune_streamed_equals_the_whole_table_path(bursty, tmp_path):
    """The streamed path (chunk sources, folds prepared on the fly, one pass per rung) gives the to_dict of the
    path that holds the traces (mapper): given profiles (file: and traces+), prefill replayed, tok/s costs."""
    from stratatools.traces.formats import write_trace
    from stratatools.traces.sources import open_source

    w = Workload(seed=3)
    half = bursty.take(bursty.request % 2 == 0)
    p = tmp_path / "w.parquet"
    write_trace(half, p, "parquet")
    given = {"base": Profile(w.n_layers, w.n_expert, [(i % w.n_layers, (7 * i) % w.n_expert) for i in range(90)])}
    kw = dict(budget_bytes=200 * 4096, blob_bytes=[4000] * w.n_layers, k=3, candidates=8, objective="tok/s",
              cost=ThreeTierModel(ram_bytes=300 * 4096), profiles=given, seed=2)
    whole = tune([bursty, half], w.n_layers, w.n_expert, mapper=lambda f, xs: list(map(f, xs)), **kw).to_dict()
    src = open_source(p, n_layers=w.n_layers, n_expert=w.n_expert)
    streamed = tune([bursty, src], w.n_layers, w.n_expert, **kw).to_dict()
    assert streamed == whole
    assert streamed["requests"] == len(np.unique(bursty.request)) + len(np.unique(half.request))
    assert {f["settings"]["profile"] for f in streamed["finalists"]} >= {"file:base"}
    with pytest.raises(StrataError, match="at most 2 folds"):
        tune([half.take(half.request < 4)], w.n_layers, w.n_expert, slots=8, k=3)
