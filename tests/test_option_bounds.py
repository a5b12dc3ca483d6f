"""Option bounds and repeated/unknown values found by a tester: each is one line naming the option (or file), the
place and the fix, exit 2, checked before any work starts."""

from __future__ import annotations

import io

import pytest

from stratatools.cli import run_captured
from stratatools.core import cluster as C
from stratatools.core.errors import StrataError


def _cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_captured([str(a) for a in args], out, err)
    return code, out.getvalue(), err.getvalue()


# --- item: --cluster local:N has an upper bound (parser only: never start many workers here) ---

def test_cluster_local_workers_bounded(monkeypatch):
    monkeypatch.setattr(C.os, "cpu_count", lambda: 2)
    assert C.max_local_workers() == 8
    assert C.parse_local("local:8") == ("local", 8)
    assert C.parse_local("local-threads:3") == ("local-threads", 3)
    assert C.parse_local("local") == ("local", None)
    assert C.parse_local("tcp://127.0.0.1:1") is None
    for spec in ("local:9", "local:30", "local:99999", "local-threads:99999"):
        with pytest.raises(StrataError, match=r"^--cluster local(-threads)?:\d+: at most 8 local workers on this "
                                              r"machine \(4 x 2 CPUs\); use a smaller N"):
            C.parse_local(spec)
    with pytest.raises(StrataError, match="need at least one worker"):
        C.parse_local("local:0")
    monkeypatch.setattr(C.os, "cpu_count", lambda: None)
    assert C.max_local_workers() == 4


def test_cluster_local_huge_is_one_line_before_dask(monkeypatch):
    def no_dask():
        raise AssertionError("Dask imported before the spec was checked")
    monkeypatch.setattr(C, "_import", no_dask)
    with pytest.raises(StrataError, match=r"^--cluster local:99999: at most \d+ local workers"):
        with C.open_cluster("local:99999"):
            pass


# --- item: --adapt-swaps 2147483647 allocated max_moves in-flight entries (16 GiB) ---

def test_adaptive_state_capped_at_layers_x_experts():
    from stratatools.cachesim import kernels as K
    usage, il, ie, st = K.adaptive_state(4, 8, 2**31 - 1)
    assert usage.shape == (4, 8) and il.shape == (32,) and ie.shape == (32,)
    assert K.adaptive_state(4, 8, 5)[1].shape == (5,)
    assert K.adaptive_state(4, 8, 0)[1].shape == (1,)


def test_adaptive_huge_swaps_same_result_as_all_moves():
    """--adapt-swaps 2**31-1 gives the same hits/loads/swaps as L x E (every move an adaptation can offer)."""
    import numpy as np

    from stratatools.cachesim import kernels as K
    rng = np.random.default_rng(3)
    L, E, n = 3, 6, 4000
    layer = np.tile(np.arange(L, dtype=np.int64), n // L + 1)[:n]
    expert = rng.integers(0, E, n).astype(np.int64)
    rnd = (np.arange(n) // (L * 2)).astype(np.int64)
    outs = []
    for moves in (L * E, 2**31 - 1):
        res = np.zeros((L, E), dtype=np.bool_)
        res[:, :2] = True
        cap = np.full(L, 3, dtype=np.int64)
        occ = res.sum(axis=1).astype(np.int64)
        hits, loads, steps, swaps = K.adaptive_kernel(layer, expert, rnd, res, cap, occ, 0, -1,
                                                      np.ones(L, dtype=np.int64), True, True, 0.5, 0.1, 1, moves,
                                                      0.7, 1)
        outs.append((hits.copy(), loads.copy(), steps, swaps, res.copy()))
    a, b = outs
    assert a[2] > 0 and a[3] > 0
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2:4] == b[2:4]
    assert np.array_equal(a[4], b[4])


# --- item: a SIGTERM whose SystemExit is swallowed (an llvmlite ctypes callback) still ends the run with 143 ---

def _rec(layer, ids):
    import struct
    k = len(ids)
    return struct.pack("<ii", layer, k) + struct.pack(f"<{k}i", *ids) + struct.pack(f"<{k}f", *([1.0 / k] * k))


def _swallowed_sigterm(sig: str = "SIGTERM"):
    """The CLI's SIGTERM (or SIGINT) handler run where its exception is dropped (as a ctypes callback drops it)."""
    import signal

    from stratatools.cli import entry
    handler = entry._terminated if sig == "SIGTERM" else entry._interrupted
    try:
        handler(getattr(signal, sig), None)
    except BaseException:  # noqa: BLE001 - what ctypes does: "Exception ignored on calling ctypes callback"
        pass


@pytest.fixture
def clean_signals():
    from stratatools.core import fsutil
    fsutil.cli_signals(False)
    yield
    fsutil.cli_signals(False)


@pytest.mark.parametrize("sig, want", [("SIGTERM", 143), ("SIGINT", 130)])
def test_swallowed_sigterm_exits_143_and_publishes_nothing(tmp_path, monkeypatch, clean_signals, sig, want):
    """A SIGTERM or Ctrl-C whose exception a ctypes callback swallowed (numba compiling): the run still stops
    with 143 / 130 before publishing (a swallowed Ctrl-C used to let make-profile publish and exit 0)."""
    from stratatools.profiles import ranking
    t = tmp_path / "t.bin"
    t.write_bytes(_rec(0, [1]) + _rec(0, [2]))
    real = ranking.build_profile

    def build(*a, **k):
        _swallowed_sigterm(sig)
        return real(*a, **k)
    monkeypatch.setattr(ranking, "build_profile", build)
    out = tmp_path / "p.strp"
    code, _, err = _cli("make-profile", t, "-o", out, "--n-layer", 1, "--n-expert", 4)
    assert code == want, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin"]
    # the next command is not affected
    monkeypatch.setattr(ranking, "build_profile", real)
    code, _, err = _cli("make-profile", t, "-o", out, "--n-layer", 1, "--n-expert", 4)
    assert code == 0, err and out.exists()


def test_swallowed_ctrl_c_that_broke_the_compiler_exits_130_without_traceback(tmp_path, monkeypatch, clean_signals):
    """A Ctrl-C swallowed inside numba's compiler leaves it half-built, and the next use raises RuntimeError ("no
    compiled object yet"): the run ends as interrupted (130, one line), not with the compiler's traceback."""
    from stratatools.profiles import ranking
    t = tmp_path / "t.bin"
    t.write_bytes(_rec(0, [1]) + _rec(0, [2]))

    def build(*a, **k):
        _swallowed_sigterm("SIGINT")
        raise RuntimeError("no compiled object yet for <Library 'expand_records'>")
    monkeypatch.setattr(ranking, "build_profile", build)
    code, _, err = _cli("make-profile", t, "-o", tmp_path / "p.strp", "--n-layer", 1, "--n-expert", 4)
    assert code == 130 and "Traceback" not in err and "interrupted" in err and err.count("\n") == 1, (code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin"]


def test_swallowed_sigterm_without_output_exits_143_at_the_end(kit, monkeypatch, clean_signals):
    """A command that publishes no file: the pending exit is raised as the command returns."""
    from stratatools.cli import common
    seen = []
    real = common.console.print

    def printing(*a, **k):
        if not seen:
            seen.append(1)
            _swallowed_sigterm()
        return real(*a, **k)
    monkeypatch.setattr(common.console, "print", printing)
    code, out, err = _cli("inspect", kit / "quant" / "model-ISTA-mix.gguf")
    assert seen and code == 143, (code, err)


# --- item: make-profile refuses a trace routing layers beyond the model's trunk + MTP blocks ---

def test_make_profile_refuses_another_models_layers(tmp_path):
    t = tmp_path / "t.bin"
    t.write_bytes(_rec(0, [1]) + _rec(7, [2]) + _rec(9, [3]))  # layer 9 of an 8-layer model, no MTP block
    out = tmp_path / "p.strp"
    code, _, err = _cli("make-profile", t, "-o", out, "--n-layer", 8, "--n-expert", 4)
    assert code == 2, err
    line = " ".join(err.split())
    assert line.startswith(f"error: {t}: the trace routes layers up to 9 but the model has 8 trunk layers (0..7); "
                           f"its entries of layers 8..9 would be left out, so it is another model's trace"), line
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "p.strp.json").exists()
    # layer 8 exactly: the hint that it may be an MTP block the geometry did not name
    t.write_bytes(_rec(0, [1]) + _rec(8, [2]))
    code, _, err = _cli("make-profile", t, "-o", out, "--n-layer", 8, "--n-expert", 4)
    assert code == 2 and "pass --model M.gguf, which names it" in " ".join(err.split()), err


def test_make_profile_leaves_out_the_models_mtp_block(tmp_path):
    """A model that declares an MTP block (nextn_predict_layers 1): its layer is left out with a warning; a layer
    beyond it is refused."""
    code, _, err = _cli("synth", tmp_path / "rel", "--layers", "3", "--experts", "8", "--keep", "4", "--mtp",
                        "--no-revisions")
    assert code == 0, err
    m = tmp_path / "rel/synth-canonical.gguf"
    t = tmp_path / "t.bin"
    t.write_bytes(_rec(0, [1]) + _rec(2, [5]) + _rec(3, [0, 7]))
    out = tmp_path / "p.strp"
    code, o, err = _cli("make-profile", t, "-o", out, "--model", m, "--mode", "no-base", "--json")
    assert code == 0, err
    import json
    res = json.loads(o)
    assert res["skipped_layer"] == 2 and res["skipped_layers"] == {"3": 2} and "left out" in err
    t.write_bytes(_rec(0, [1]) + _rec(4, [5]))
    code, _, err = _cli("make-profile", t, "-o", tmp_path / "q.strp", "--model", m)
    line = " ".join(err.split())
    assert code == 2 and "routes layers up to 4 but the model has 3 trunk layers + 1 MTP (0..3)" in line, err
    assert "pass --model" not in line


# --- item: make-profile --n-expert 65536 (README and strp.MAX_EXPERTS: 65,536; u16 ids 0..65535) ---

def test_make_profile_takes_65536_experts(tmp_path):
    from stratatools.profiles.strp import read_profile
    t = tmp_path / "t.bin"
    t.write_bytes(_rec(0, [65535]) + _rec(0, [65535, 7]))
    out = tmp_path / "p.strp"
    code, _, err = _cli("make-profile", t, "-o", out, "--n-layer", 1, "--n-expert", 65536, "--mode", "no-base")
    assert code == 0, err
    p = read_profile(out)
    assert (p.n_layers, p.n_expert) == (1, 65536)
    assert p.pairs[:2].tolist() == [[0, 65535], [0, 7]]
    # past the pair bound: one line naming the options, before any trace is read
    code, _, err = _cli("make-profile", t, "-o", tmp_path / "q.strp", "--n-layer", 4096, "--n-expert", 65536)
    line = " ".join(err.split())
    assert code == 2 and "4096 layers x 65536 experts is out of range for a profile" in line, err
    assert "at most 16777216 pairs" in line and "--n-layer/--n-expert" in line


# --- item: synth --types with a repeated role used the last value silently ---

@pytest.mark.parametrize("spec,want", [
    ("gu=Q8_0,gu=Q4_0", "--types: role 'gu' is given twice (gu=Q8_0,gu=Q4_0); give each role once (use gu=A/B"),
    ("down=Q8_0, dense=Q8_0,down=Q2_0", "--types: role 'down' is given twice"),
    ("embd=BF16,embd=BF16", "--types: role 'embd' is given twice"),
    ("dense=Q8_0/Q4_0", "--types dense=Q8_0/Q4_0: one type for dense"),
])
def test_synth_types_repeated_role_refused(tmp_path, spec, want):
    code, _, err = _cli("synth", tmp_path / "rel", "--types", spec)
    assert code == 2 and " ".join(err.split()).startswith(f"error: {want}"), err
    assert not (tmp_path / "rel").exists()


def test_synth_types_parse_once_each():
    from stratatools.cli.model_cmds import _parse_types
    assert _parse_types("gu=Q8_0/Q4_0,down=Q2_0,dense=Q8_0") == {"gu_types": ("Q8_0", "Q4_0"),
                                                                "down_types": ("Q2_0",), "dense_type": "Q8_0"}


# --- item: simulate --policy "" ran all six policies; --policy static,static printed two rows ---

def test_policy_list_refuses_empty_and_dedups():
    from stratatools.cli.sim_cmds import _policy_list
    from stratatools.cachesim.study import DEFAULT_POLICIES
    assert _policy_list(None, DEFAULT_POLICIES) == []
    assert _policy_list(["static,static", "lru", "static"], DEFAULT_POLICIES) == ["static", "lru"]
    for bad in ([""], ["static,,lru"], [" "], ["static,"]):
        with pytest.raises(StrataError, match=r"^--policy .*: an empty policy name \(use one or more of static"):
            _policy_list(bad, DEFAULT_POLICIES)
    with pytest.raises(StrataError, match=r"^--policy 'bogus': unknown"):
        _policy_list(["static,bogus"], DEFAULT_POLICIES)


def test_simulate_policy_empty_and_repeated(tmp_path):
    import json
    t = tmp_path / "t.bin"
    t.write_bytes(b"".join(_rec(layer, [(i + layer) % 4]) for i in range(20) for layer in range(2)))
    prof = tmp_path / "p.strp"
    code, _, err = _cli("make-profile", t, "-o", prof, "--n-layer", 2, "--n-expert", 4, "--mode", "no-base")
    assert code == 0, err
    base = ("simulate", "-t", t, "-p", prof, "--slots", 3, "--no-sweep", "--json")
    code, _, err = _cli(*base, "--policy", "")
    assert code == 2 and "--policy '': an empty policy name" in " ".join(err.split()), err
    code, out, err = _cli(*base, "--policy", "static,static", "--policy", "static")
    assert code == 0, err
    assert [r["policy"] for r in json.loads(out)["results"]] == ["static"]


# --- item: the allocation parser accepted type names ggml does not know ---

def test_allocation_unknown_type_refused_with_its_line(tmp_path):
    from stratatools.alloc.allocation import format_allocation, parse_allocation
    t = format_allocation([[0, 1], [2, 3]], 4, section1={"blk.0.ffn_gate_exps.weight": "Q2_0"},
                          expert_types=("Q2_0", "Q4_0", "Q2_0"))
    assert parse_allocation(t.encode()).warnings == []
    lines = t.split("\n")
    n = next(i for i, ln in enumerate(lines) if ln.startswith("blk.0.ffn_gate_exps.weight[1]:")) + 1
    bad = t.replace("blk.0.ffn_gate_exps.weight[1]: Q2_0", "blk.0.ffn_gate_exps.weight[1]: Q9_9")
    with pytest.raises(StrataError, match=rf"^<allocation>: line {n}: blk\.0\.ffn_gate_exps\.weight\[1\]: unknown "
                                          r"type 'Q9_9' \(not a ggml type name"):
        parse_allocation(bad.encode())
    n1 = next(i for i, ln in enumerate(lines) if ln.startswith("blk.0.ffn_gate_exps.weight:")) + 1
    bad1 = bad.replace("blk.0.ffn_gate_exps.weight: Q2_0", "blk.0.ffn_gate_exps.weight: Q4_X")
    with pytest.raises(StrataError, match=rf"^<allocation>: line {min(n, n1)}: .*unknown type 'Q4_"):
        parse_allocation(bad1.encode())
    f = tmp_path / "rco-allocation.txt"
    f.write_text(bad)
    code, _, err = _cli("alloc", "check", f)
    assert code == 2 and f"{f}: line {n}: blk.0.ffn_gate_exps.weight[1]: unknown type 'Q9_9'" in " ".join(err.split()), err


# --- item: a global option after the command only said "no such option" ---

@pytest.mark.parametrize("opt", ["--quiet", "-q", "--debug"])
def test_global_option_after_the_command_hints_where_it_goes(tmp_path, opt):
    code, _, err = _cli("run", tmp_path / "m.gguf", "--prompts", tmp_path / "p.txt", opt)
    assert code == 2
    assert " ".join(err.split()) == (f"error: stratatools run: no such option: {opt}: {opt} is a global option; put "
                                     f"it before the command ('stratatools {opt} run ...')"), err
    code, _, err = _cli("trace", "stats", tmp_path / "t.bin", opt)
    assert code == 2 and f"('stratatools {opt} trace stats ...')" in " ".join(err.split()), err


def test_unknown_option_keeps_its_help_hint(tmp_path):
    code, _, err = _cli("run", tmp_path / "m.gguf", "--bogus")
    assert code == 2 and " ".join(err.split()) == ("error: stratatools run: no such option: --bogus (run "
                                                   "'stratatools run --help' for its options)"), err
    code, _, err = _cli("inspect", tmp_path / "m.gguf", "--version")
    assert code == 2 and "put it before the command ('stratatools --version')" in " ".join(err.split()), err
