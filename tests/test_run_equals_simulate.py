"""Runtime == simulator: ``stratatools run --trace-out T --json`` then ``stratatools simulate -t T`` with the same
slots, policy and options gives the run's hits per phase and per layer, its rounds and its copied bytes, for every
online policy (issue 17, docs/cache-model.md "Rounds" and "Phases"). CPU, small synthetic model (stratatools synth).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from stratatools.cli import run_captured
from stratatools.cli.sim_cmds import run
from stratatools.profiles.strp import Profile

L, E = 4, 16
PROMPTS = ("def add(a, b):\\n    return a + b\n"
           "x\n"
           "hello world, this is a test of routing through the tier\n")
N_REQ = 3


def _opt(opts: list[str], name: str, conv):
    return conv(opts[opts.index(name) + 1]) if name in opts else None


def _cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_captured([str(a) for a in args], out, err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    d = tmp_path_factory.mktemp("runsim")
    code, _, err = _cli("synth", d / "rel", "--layers", L, "--experts", E, "--keep", 8, "--hidden", 128,
                        "--expert-ff", 64, "--no-revisions", "--json")
    assert code == 0, err
    (d / "p.txt").write_text(PROMPTS)
    rng = np.random.default_rng(3)
    perm = rng.permutation(L * E)[: L * E // 2]  # a profile covering half the pairs: free slots are admitted too
    Profile(L, E, np.stack([perm // E, perm % E], 1)).write(d / "prof.bin")
    return d, d / "rel" / "synth-canonical.gguf"


# (policy, tier options given to both commands, trace suffix): every online policy, global and per-layer
# admission, with and without a profile, slots and a byte budget, the three trace formats that keep phases
CASES = [
    ("static", ["--slots", "24"], "bin"),
    ("static", ["--slots", "40", "--profile", "prof.bin", "--admission", "per-layer"], "parquet"),
    ("adaptive", ["--slots", "24", "--profile", "prof.bin"], "csv"),
    ("adaptive", ["--slots", "32", "--profile", "prof.bin", "--admission", "per-layer"], "bin"),
    ("adaptive", ["--slots", "24", "--profile", "prof.bin", "--adapt-every", "1", "--adapt-lag", "2",
                  "--upper-slots", "8"], "parquet"),
    ("lru", ["--slots", "20"], "bin"),
    ("lfu", ["--slots", "20"], "csv"),
    ("lfru", ["--budget-gib", "0.0005"], "parquet"),
]


def test_run_and_simulate_count_the_same_hits(release, tmp_path):
    d, gguf = release
    swaps = 0
    for i, (policy, opts, ext) in enumerate(CASES):
        opts = [str(d / o) if o.endswith(".bin") else o for o in opts]
        trace = tmp_path / f"t{i}.{ext}"
        code, out, err = _cli("run", gguf, "--prompts", d / "p.txt", "--policy", policy, *opts, "-n", "7",
                              "--trace-out", trace, "--json")
        assert code == 0, err
        tier = json.loads(out)["tier"]
        assert tier["rounds"] == N_REQ + tier["decode"]["entries"] // (L * 4)  # one per prefill, one per step
        # the default phase (decode) through the command, --phase all through the commands' library entry
        # (sim_cmds.run: the same inputs and study, without the report's plots, to keep the test short)
        code, out, err = _cli("simulate", "-t", trace, "--model", gguf, "--policy", policy, *opts, "--no-sweep",
                              "--report", tmp_path / f"rep{i}", "--json")
        assert code == 0, err
        got = {"decode": json.loads(out)["results"][0]}
        st, _ = run([str(trace)], [opts[j + 1] for j, o in enumerate(opts) if o == "--profile"], pack=None,
                    model=str(gguf), slots=_opt(opts, "--slots", int), budget_gib=_opt(opts, "--budget-gib", float),
                    policies=[policy], admission=_opt(opts, "--admission", str) or "global", kfold=None,
                    phase="all", host_gbps=60.0, pcie_gbps=25.0, vram_gbps=900.0, sets=[], sweep=False,
                    adaptive={"every": _opt(opts, "--adapt-every", int), "lag": _opt(opts, "--adapt-lag", int),
                              "upper_slots": _opt(opts, "--upper-slots", int)})
        got["all"] = st.results[0].to_dict()
        for phase, r in got.items():
            want = tier[phase]
            case = (policy, opts, ext, phase)
            assert (r["entries"], r["hits"]) == (want["entries"], want["hits"]), case
            assert r["layer_entries"] == want["layer_entries"] and r["layer_hits"] == want["layer_hits"], case
            assert r["rounds"] == tier["rounds"] and r["moved_bytes"] == tier["moved_bytes"], case
        # the prefill: what --phase all counts beyond --phase decode
        assert got["all"]["hits"] - got["decode"]["hits"] == tier["prefill"]["hits"]
        assert got["decode"]["warmup"] == tier["prefill"]["entries"] and got["all"]["warmup"] == 0
        swaps += got["decode"]["params"].get("swaps", 0)
        assert tier["decode"]["hits"] + tier["prefill"]["hits"] == tier["all"]["hits"]
    assert swaps > 0  # the adaptive tier moved experts, so its rounds were exercised


def test_run_console_prints_hits_and_entries(release, tmp_path):
    d, gguf = release
    code, out, err = _cli("run", gguf, "--prompts", d / "p.txt", "--policy", "lru", "--slots", "20", "-n", "3")
    assert code == 0, err
    code, js, err = _cli("run", gguf, "--prompts", d / "p.txt", "--policy", "lru", "--slots", "20", "-n", "3",
                         "--json")
    tier = json.loads(js)["tier"]
    want = "; ".join(f"{tier[p]['h_expert']:.4f} ({tier[p]['hits']}/{tier[p]['entries']})" for p in
                     ("decode", "prefill", "all"))
    line = [x for x in out.splitlines() if x.startswith("h_expert (decode)")][0]
    assert line.replace("prefill: ", "").replace("all: ", "") == f"h_expert (decode): {want}; {tier['rounds']} rounds"


def test_cold_drops_the_prefill(release, tmp_path):
    """--cold: the replay of the decode entries alone (the cache starts on the fill), rounds = decode steps."""
    from stratatools.cachesim.replay import prepare_entries, simulate_policy
    from stratatools.traces.formats import read_trace
    from stratatools.traces.table import DECODE

    d, gguf = release
    trace = tmp_path / "t.bin"
    code, out, err = _cli("run", gguf, "--prompts", d / "p.txt", "--policy", "lru", "--slots", "20", "-n", "8",
                          "--trace-out", trace, "--json")
    assert code == 0, err
    tier = json.loads(out)["tier"]
    code, out, err = _cli("simulate", "-t", trace, "--model", gguf, "--policy", "lru", "--slots", "20", "--cold",
                          "--no-sweep", "--report", tmp_path / "rep", "--json")
    assert code == 0, err
    r = json.loads(out)["results"][0]
    t = read_trace(trace)
    dec = t.take(np.asarray(t.phase) == DECODE)
    ref = simulate_policy(prepare_entries(dec, L, E, phase="all"), "lru", slots=20)
    assert (r["entries"], r["hits"], r["rounds"]) == (ref.entries, ref.hits, ref.rounds)
    assert r["entries"] == tier["decode"]["entries"] and r["rounds"] == tier["rounds"] - N_REQ and r["warmup"] == 0
    code, _, err = _cli("simulate", "-t", trace, "--model", gguf, "--slots", "20", "--cold", "--phase", "all",
                        "--no-sweep", "--report", tmp_path / "rep2")
    assert code == 2 and "--cold" in err and err.strip().count("\n") == 0


def test_plain_trace_holds_the_runs_decode_positions(release, tmp_path):
    """The plain Strata layout holds decode positions only (as the engine's --dump-routing; it used to hold the
    prefill records too, read back as decode): the run leaves the prefill out and says how many entries; the file
    is the run's tagged trace converted to plain, byte for byte, and replays one round per decode position over the
    run's decode entries."""
    d, gguf = release
    trace, tagged = tmp_path / "plain.bin", tmp_path / "tagged.bin"
    code, out, err = _cli("run", gguf, "--prompts", d / "p.txt", "--policy", "adaptive", "--slots", "24", "-n", "7",
                          "--trace-out", trace, "--trace-format", "strata", "--json")
    assert code == 0, err
    res = json.loads(out)
    tier = res["tier"]
    assert res["trace_dropped_prefill"] == tier["prefill"]["entries"] > 0
    assert f"left out {tier['prefill']['entries']:,} prefill entries" in err
    code, out, err = _cli("run", gguf, "--prompts", d / "p.txt", "--policy", "adaptive", "--slots", "24", "-n", "7",
                          "--trace-out", tagged, "--json")
    assert code == 0, err
    code, out, err = _cli("trace", "convert", tagged, "--to", "strata", "-o", tmp_path / "conv.bin")
    assert code == 0, err
    assert (tmp_path / "conv.bin").read_bytes() == trace.read_bytes()
    st, _ = run([str(trace)], [], pack=None, model=str(gguf), slots=24, budget_gib=None, policies=["adaptive"],
                admission="global", kfold=None, phase="all", host_gbps=60.0, pcie_gbps=25.0, vram_gbps=900.0,
                sets=[], sweep=False)
    r = st.results[0]
    n_prompts = len([ln for ln in (d / "p.txt").read_text().splitlines() if ln.strip()])
    assert (r.entries, r.rounds, r.rounds_by) == (tier["decode"]["entries"], n_prompts * 6, "positions")
