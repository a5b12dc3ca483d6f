"""Review findings on the simulator: each failing input found by hand, kept as a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from stratatools.cachesim.replay import run_policy, simulate_policy
from stratatools.profiles.strp import Profile
from stratatools.profiles.ranking import make_profile
from stratatools.traces.table import DECODE, TraceTable
from stratatools.traces.formats import write_trace

L, E, K = 3, 8, 2


def synth(n_req=4, n_tok=12, seed=1):
    rng = np.random.default_rng(seed)
    cols = {k: [] for k in ("request", "position", "phase", "layer", "rank", "expert", "weight")}
    for r in range(n_req):
        for p in range(n_tok):
            for l in range(L):
                for j, e in enumerate(rng.choice(E, size=K, replace=False)):
                    for c, v in zip(cols, (r, p, DECODE, l, j, int(e), 1.0)):
                        cols[c].append(v)
    return TraceTable(**{k: np.array(v) for k, v in cols.items()}, meta={"source_format": "synthetic"})


@pytest.fixture()
def files(tmp_path):
    t = synth()
    tp = tmp_path / "t.parquet"
    write_trace(t, tp, "parquet")
    prof, _ = make_profile([t], L, E, mode="no-base")
    pp = tmp_path / "p.bin"
    prof.write(pp)
    return t, tp, pp


def test_no_numba_cache_location_still_runs(tmp_path):
    """A read-only install with no writable cache folder: numba cannot cache; the kernels must still compile."""
    code = ("import numpy as np\n"
            "from stratatools.cachesim import kernels as K\n"
            "h, l = K.lru_kernel(np.zeros(3, np.int64), np.array([0, 1, 0]), np.array([1]), 2)\n"
            "print(h.tolist(), l.tolist())\n")
    env = dict(os.environ, NUMBA_CACHE_LOCATOR_CLASSES="IPythonCacheLocator")  # no locator applies
    env.pop("NUMBA_CACHE_DIR", None)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[False, False, False] [3]"


@pytest.mark.parametrize("bad, msg", [("adaptive.adapt_every=0", "adapt_every"),
                                      ("belady.cap=3", "belady"),
                                      ("static.slots=3", "static"),
                                      ("adaptive.decay=nan", "finite"),
                                      ("fifo.size=2", "fifo")])
def test_set_bad_parameters_are_one_line_errors(cli, files, tmp_path, bad, msg):
    t, tp, pp = files
    code, out, err = cli("simulate", "-t", tp, "-p", pp, "--slots", 6, "--no-sweep", "--set", bad,
                         "--report", tmp_path / "r")
    assert code == 2, err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "belady"])
def test_huge_budget_does_not_allocate_per_slot(policy):
    """More slots than experts in a layer: every per-layer policy behaves as with room for every expert."""
    t = synth(n_req=1)
    from stratatools.cachesim.replay import prepare_entries
    ent = prepare_entries(t, L, E)
    h_big, _, _ = run_policy(ent, policy, cap=np.full(L, 10**12, dtype=np.int64))
    h_all, _, _ = run_policy(ent, policy, cap=np.full(L, E, dtype=np.int64))
    assert np.array_equal(h_big, h_all)


def test_cli_huge_slots(cli, files, tmp_path):
    t, tp, pp = files
    # (the largest --slots the CLI takes, 2^40; 10^15 is refused as the command line is read: test_cli_bounds.py)
    code, out, err = cli("compare", "-t", tp, "-p", pp, "--slots", 2**40, "--policy", "static,lfu,lfru,belady",
                         "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert all(r["h_expert"] > 0.5 for r in rows)


def test_without_blob_sizes_bytes_are_not_reported_as_bytes(cli, files, tmp_path):
    """--slots without --pack/--model: blob sizes are unknown, so copies are counted, not bytes."""
    t, tp, pp = files
    rep = tmp_path / "r"
    code, out, err = cli("simulate", "-t", tp, "-p", pp, "--slots", 6, "--policy", "static,lru", "--no-sweep",
                         "--report", rep)
    assert code == 0, err
    js = json.loads((rep / "report.json").read_text())
    lru = [r for r in js["results"] if r["policy"] == "lru"][0]
    assert lru["loads"] > 0
    assert lru["moved_bytes"] is None and lru["h_bytes"] is None and lru["time_per_token_s"] is None
    md = (rep / "report.md").read_text()
    row = [ln for ln in md.splitlines() if ln.startswith("| per-layer split | lru")][0]
    assert f"{lru['loads']} copies" in row and " B |" not in row
    # with blob sizes the same run reports bytes
    r = simulate_policy(_entries(t), "lru", slots=6, blob_bytes=[300, 600, 900])
    hits, loads, _ = run_policy(_entries(t), "lru", slots=6, blob_bytes=[300, 600, 900])
    assert r.moved_bytes == int((loads * np.array([300, 600, 900])).sum()) > 0
    assert 0.0 < r.h_bytes < 1.0 and r.time_per_token_s > 0


def _entries(t):
    from stratatools.cachesim.replay import prepare_entries
    return prepare_entries(t, L, E)


def test_report_never_overwrites_an_input_inside_the_folder(cli, files, tmp_path):
    t, tp, pp = files
    rep = tmp_path / "r"
    rep.mkdir()
    inside = rep / "report.md"  # a profile that happens to sit where the report goes
    inside.write_bytes(pp.read_bytes())
    before = inside.read_bytes()
    for cmd in ("simulate", "compare"):
        code, out, err = cli(cmd, "-t", tp, "-p", inside, "--slots", 6, "--report", rep, "--force")
        assert code == 2 and "input" in err, (cmd, err)
        assert inside.read_bytes() == before


def test_compare_refuses_existing_report_before_simulating(cli, files, tmp_path, monkeypatch):
    t, tp, pp = files
    rep = tmp_path / "r"
    rep.mkdir()
    (rep / "report.json").write_text("{}")
    import stratatools.cachesim.study as study

    def boom(*a, **k):
        raise AssertionError("simulated although the report would be refused")

    monkeypatch.setattr(study, "run_study", boom)
    code, out, err = cli("compare", "-t", tp, "-p", pp, "--slots", 6, "--report", rep)
    assert code == 2 and "--force" in err


def test_table_labels_are_not_cut_in_a_pipe(cli, files, tmp_path):
    """Piped output is 80 columns wide; the profile names must survive whole (they are what is compared)."""
    t, tp, pp = files
    long = tmp_path / "qwen-coder-remapped-profile.bin"
    long.write_bytes(pp.read_bytes())
    code, out, err = cli("compare", "-t", tp, "-p", long, "-p", pp, "--slots", 6)
    assert code == 0, err
    assert "qwen-coder-remapped-profile" in out.replace("\n", "").replace("│", "").replace(" ", "") or \
        "qwen-coder-remapped-profile" in out


def test_sweep_plot_series_distinguishable(files):
    """Every (policy, profile) series of the sweep plot gets its own (colour, line style, marker)."""
    from stratatools.cachesim.study import run_study
    from stratatools.cachesim.report import sweep_styles

    t, tp, pp = files
    profs = [Profile(L, E, np.stack([np.arange(L * E) // E, np.arange(L * E) % E], 1)) for _ in range(3)]
    st = run_study([t], profs, ["a", "b", "c"], slots=6)
    keys = sorted({(r["label"], r["policy"]) for r in st.sweep})
    assert len(keys) == 13
    styles = sweep_styles(keys)
    assert len(set(styles.values())) == len(keys)


def test_json_output_is_strict_json(cli, files, tmp_path):
    t, tp, pp = files
    code, out, err = cli("simulate", "-t", tp, "-p", pp, "--slots", 6, "--no-sweep", "--report", tmp_path / "r",
                         "--json")
    assert code == 0, err
    d = json.loads(out, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    r = json.loads((tmp_path / "r" / "report.json").read_text(),
                   parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert r == d  # the report file holds the same document as stdout
    assert (d["n_layers"], d["n_expert"], d["entries"]) == (L, E, len(t.expert))
    assert d["budget"]["slots"] == 6 and d["sweep"] in ([], None)
    cov = d["coverage"]["p"]["measured"]
    assert cov[0] == 0.0 and cov[-1] == 1.0 and cov == sorted(cov)


@pytest.mark.parametrize("args, msg", [(("--kfold", 0), "'--kfold': must be an integer from 2 to 2147483647 (got 0)"),
                                       (("--admission", "foo", "--policy", "lru"), "admission"),
                                       (("--budget-gib", "nan"), "--budget-gib"),
                                       (("--budget-gib", "inf"), "--budget-gib"),
                                       (("--host-gbps", "nan"), "'--host-gbps' / '--ram-gbps': must be a finite number"),
                                       (("--ram-experts-gb", "nan"),
                                        "'--ram-experts-gib' / '--ram-experts-gb': must be a finite number"),
                                       (("--ram-experts-gib", "-1"),
                                        "'--ram-experts-gib' / '--ram-experts-gb': must be a finite number")])
def test_bad_options_are_one_line_errors(cli, files, tmp_path, args, msg):
    t, tp, pp = files
    code, out, err = cli("simulate", "-t", tp, "-p", pp, "--slots", 6, "--no-sweep", *args, "--report", tmp_path / "r")
    assert code == 2, err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_byte_budget_beyond_the_model_gives_every_expert_a_slot_not_more():
    """A byte budget larger than the whole model: the engine's auto slot count is capped at the profile length
    (L x E), so the per-layer split is E per layer, not an invented slot count."""
    from stratatools.cachesim import per_layer_split, plan_tier

    blob = [300, 600, 900]
    assert per_layer_split(L, budget_bytes=10**9, blob_bytes=blob, n_expert=E).tolist() == [E] * L
    assert per_layer_split(L, budget_bytes=10**9, blob_bytes=blob).tolist()[0] > E  # geometry unknown: as before
    assert per_layer_split(L, budget_bytes=2 * (512 + 768 + 1024), blob_bytes=blob, n_expert=E).tolist() == [2, 2, 2]
    assert per_layer_split(L, slots=10**6, n_expert=E).tolist() == [10**6 // L] * (L - 1) + [10**6 // L + 1]
    pl = plan_tier(L, E, None, budget_bytes=10**9, blob_bytes=blob, admission="per-layer")
    assert pl.cap.tolist() == [E] * L and pl.n_slots == L * E
    r = simulate_policy(_entries(synth()), "lru", budget_bytes=10**9, blob_bytes=blob)
    assert r.n_slots == L * E
