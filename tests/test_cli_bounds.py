"""Bad input found by a new-user break test: huge integers (OverflowError / numba TypingError tracebacks), NaN
sizes, huge synth shapes (unbounded allocation), two tier sizes at once, messages naming options that do not exist,
an admission value checked after the tier, a decode line counting the prefill's tokens, a Parquet error cut
mid-sentence. Each is one line naming the option (or file) and the fix, exit 2."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys

import pytest

from stratatools.cli import run_captured
from stratatools.core.errors import StrataError

HUGE = "99999999999999999999"


def _cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_captured([str(a) for a in args], out, err)
    return code, out.getvalue(), err.getvalue()


def _numeric_options():
    """Every int and float option of every command: (command words, option, 'int' | 'float')."""
    import typer.main

    from stratatools.cli import app

    out = []

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, path + [name])
            return
        for p in cmd.params:
            if p.param_type_name != "option":
                continue
            t = p.bare_type() if hasattr(p, "bare_type") else getattr(p.type, "name", "")
            kind = "int" if t in ("int", "integer", "list[int]") else "float" if t in ("float", "list[float]") else None
            if kind:
                out.append((tuple(path), p.opts[0], kind))

    walk(typer.main.get_command(app), [])
    return out


# The reporter's inputs first (simulate / validate-release / run with a huge --slots, --upper-slots, --adapt-lag),
# then every other integer option of every command.
HUGE_INT_CASES = [
    (("simulate",), "--slots"), (("simulate",), "--upper-slots"), (("simulate",), "--adapt-lag"),
    (("validate-release",), "--slots"), (("run",), "--slots"),
    (("simulate",), "--kfold"), (("simulate",), "--adapt-every"), (("simulate",), "--adapt-swaps"),
    (("simulate",), "--adapt-pace-bytes"),
    (("compare",), "--slots"), (("compare",), "--adapt-every"), (("compare",), "--adapt-swaps"),
    (("compare",), "--adapt-lag"), (("compare",), "--adapt-pace-bytes"), (("compare",), "--upper-slots"),
    (("run",), "--max-new-tokens"), (("run",), "--adapt-every"), (("run",), "--adapt-swaps"), (("run",), "--adapt-lag"),
    (("run",), "--adapt-pace-bytes"), (("run",), "--upper-slots"), (("run",), "--batch"),
    (("tune",), "--slots"), (("tune",), "--kfold"), (("tune",), "--candidates"), (("tune",), "--eta"),
    (("tune",), "--seed"),
    (("synth",), "--experts"), (("synth",), "--keep"), (("synth",), "--swap"), (("synth",), "--layers"),
    (("synth",), "--hidden"), (("synth",), "--expert-ff"), (("synth",), "--k"), (("synth",), "--shards"),
    (("synth",), "--seed"),
    (("remap-profile",), "--slots"), (("profile-diff",), "--slots-per-layer"),
    (("make-profile",), "--n-layer"), (("make-profile",), "--n-expert"),
    (("profile", "show"), "--top"), (("profile", "show"), "--n-layer"), (("profile", "show"), "--n-expert"),
    (("trace", "convert"), "--n-layer"), (("trace", "convert"), "--n-expert"),
    (("trace", "stats"), "--n-expert"), (("trace", "stats"), "--window"),
]


@pytest.mark.parametrize("cmd,opt", HUGE_INT_CASES, ids=[" ".join(c) + " " + o for c, o in HUGE_INT_CASES])
def test_huge_integer_is_one_line_naming_the_option_and_its_range(cmd, opt):
    """The option is refused while the command line is parsed: nothing else is read, whatever else is missing."""
    code, out, err = _cli(*cmd, opt, HUGE)
    assert code == 2, (cmd, opt, err)
    assert out == "" and err.count("\n") == 1, err
    assert f"invalid value for '{opt}'" in err and "must be an integer from " in err and f"(got {HUGE})" in err, err
    assert "Traceback" not in err


def test_every_integer_option_is_bounded():
    """A new integer option must get a bound (common.int_range) and a row above."""
    ints = {(c, o) for c, o, k in _numeric_options() if k == "int"}
    assert ints == set(HUGE_INT_CASES), ints ^ set(HUGE_INT_CASES)


@pytest.mark.parametrize("cmd,opt", sorted({(c, o) for c, o, k in _numeric_options() if k == "float"}))
def test_nan_and_infinite_floats_are_one_line(cmd, opt):
    for v in ("nan", "inf"):
        code, out, err = _cli(*cmd, opt, v)
        assert code == 2 and out == "" and err.count("\n") == 1, (cmd, opt, err)
        assert f"invalid value for '{opt}'" in err and "must be a finite number" in err and f"(got {v})" in err, err


def test_run_budget_nan_says_finite_number():
    code, _, err = _cli("run", "m.gguf", "-p", "p.txt", "--budget-gib", "nan")
    assert code == 2 and "'--budget-gib': must be a finite number, at least 0 and at most 1048576 (got nan)" in err, err


def test_bounds_at_the_edge_pass_the_parser():
    """The largest allowed value goes on to the command (here: a missing input), the next one is refused."""
    code, _, err = _cli("simulate", "--slots", 2**40, "-t", "nosuch.csv")
    assert code == 2 and "nosuch.csv" in err and "invalid value" not in err, err
    code, _, err = _cli("simulate", "--slots", 2**40 + 1, "-t", "nosuch.csv")
    assert code == 2 and "must be an integer from 0 to 1099511627776 (got 1099511627777)" in err, err


def test_adaptive_params_set_through_set_are_bounded_too():
    """--set adaptive.lag=HUGE reached the numba kernel (TypingError) as --adapt-lag did."""
    from stratatools.cachesim.tiers import ADAPTIVE_DEFAULTS, check_adaptive_params

    for key, opt in (("lag", "--adapt-lag"), ("adapt_every", "--adapt-every"), ("max_moves", "--adapt-swaps"),
                     ("upper_slots", "--upper-slots"), ("pace_bytes", "--adapt-pace-bytes")):
        with pytest.raises(StrataError, match=f"{opt} {HUGE} must be"):
            check_adaptive_params({**ADAPTIVE_DEFAULTS, key: int(HUGE)})
    check_adaptive_params({**ADAPTIVE_DEFAULTS, "lag": 2**31 - 1})


# ------------------------------------------------------------------ --slots with --budget-gib, --admission


def test_run_refuses_slots_and_budget_together(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("hello\n")
    code, _, err = _cli("run", tmp_path / "m.gguf", "-p", p, "--device", "cpu", "--slots", 4, "--budget-gib", 1)
    assert code == 2 and err.count("\n") == 1, err
    assert "--slots 4 and --budget-gib 1 both size the tier: give --slots N or --budget-gib X, not both" in err, err


@pytest.mark.parametrize("cmd", ["simulate", "compare"])
def test_simulate_refuses_slots_and_budget_together(tmp_path, cmd):
    code, _, err = _cli(cmd, "-t", tmp_path / "t.csv", "-p", tmp_path / "p.bin", "--slots", 6, "--budget-gib", 1)
    assert code == 2 and err.count("\n") == 1, err
    assert "--slots 6 and --budget-gib 1 both size the tier: give --slots N or --budget-gib X, not both" in err, err


def test_run_rejects_an_unknown_admission_before_asking_for_a_tier(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("hello\n")
    code, _, err = _cli("run", tmp_path / "m.gguf", "-p", p, "--device", "cpu", "--admission", "foo")
    assert code == 2 and err.count("\n") == 1, err
    assert "--admission 'foo': unknown; use global or per-layer" in err and "there is none" not in err, err


# ------------------------------------------------------------------ synth: option names, types, sizes


@pytest.mark.parametrize("args,want", [
    (["--layers", "0"], "invalid value for '--layers': must be an integer from 1 to 4096 (got 0)"),
    (["--experts", "0"], "invalid value for '--experts': must be an integer from 1 to 65535 (got 0)"),
    (["--layers", "1", "--experts", "8", "--keep", "4", "--swap", "1"],
     "synth: --layers 1 is too few: the model's PLE layer 1 (0-based) must be one of its linear-attention trunk "
     "layers; use --layers 2 or more"),
    (["--types", "gu=Q9_9"], "--types gu=Q9_9: unknown or unwritable type 'Q9_9' (synth writes: BF16, F16, F32, "),
])
def test_synth_messages_name_real_options(tmp_path, args, want):
    code, _, err = _cli("synth", tmp_path / "i", *args)
    assert code == 2 and err.count("\n") == 1, err
    assert want in err, err
    assert "--n-layers" not in err and "--n-expert" not in err
    assert not (tmp_path / "i").exists()


def test_synth_types_list_is_what_synth_writes():
    from stratatools.synth.model import writable_types

    ts = writable_types()
    assert {"Q8_0", "Q4_0", "Q2_0", "BF16", "F32", "IQ2_XS", "IQ4_NL"} <= set(ts) and "Q9_9" not in ts
    assert ts == sorted(ts)


def test_synth_config_messages_name_options_or_fields():
    from stratatools.synth.model import SynthConfig

    for kw, want in ((dict(n_layers=0), "synth: --layers 0 must be at least 1"),
                     (dict(n_expert=0), "synth: --experts 0 must be at least 1"),
                     (dict(shared_ff=0), "synth: SynthConfig.shared_ff 0 must be at least 1"),
                     (dict(vocab_size=3), "synth: SynthConfig.vocab_size 3 must be at least 260")):
        with pytest.raises(StrataError) as ei:
            SynthConfig(**kw).validate()
        assert str(ei.value).startswith(want), ei.value
    SynthConfig(n_layers=2, n_expert=8, keep=4, swap=1).validate()  # the smallest --layers that has the PLE layer


def test_synth_footprint_counts_bytes_without_allocating():
    from stratatools.synth.model import SynthConfig, estimate_bytes, footprint

    cfg = SynthConfig()
    written, held = footprint(cfg)
    assert written == 3 * estimate_bytes(cfg)
    w1, h1 = footprint(SynthConfig(hidden=1 << 20, revisions=False))  # 512 x 2^20 float32 embeddings x 4 copies
    assert w1 > 1000 * 2**30 and h1 == (256 << 20) + 4 * 4 * (1 << 20) * 512, (w1, h1)


def test_synth_refuses_what_memory_cannot_hold(tmp_path, monkeypatch):
    import stratatools.synth.model as sm

    monkeypatch.setattr(sm, "available_memory", lambda: 100 << 20)
    code, _, err = _cli("synth", tmp_path / "s", "--layers", 2, "--experts", 8)
    assert code == 2 and err.count("\n") == 1, err
    assert ("synth: --layers 2 --hidden 256 --experts 8 --expert-ff 64 --keep 4 needs about 0.25 GiB of memory while "
            "writing, and 0.10 GiB is available; lower --hidden") in err, err
    assert not (tmp_path / "s").exists()


def test_synth_refuses_what_the_disk_cannot_hold(tmp_path):
    code, _, err = _cli("synth", tmp_path / "s", "--hidden", 1 << 22, "--layers", 4096, "--no-revisions")
    assert code == 2 and err.count("\n") == 1, err
    assert "synth: --layers 4096 --hidden 4194304 --experts 32 --expert-ff 64 " in err, err
    assert "lower --hidden" in err and not (tmp_path / "s").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS / /proc")
def test_synth_huge_hidden_under_ulimit_is_one_line(tmp_path):
    """The reporter's input: `synth --hidden 1048576` under `ulimit -v` was an ArrayMemoryError traceback."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    r = subprocess.run([sys.executable, "-m", "stratatools", "synth", str(tmp_path / "h"), "--hidden", "1048576"],
                       capture_output=True, text=True, timeout=300, preexec_fn=limit,
                       env={**os.environ, "NUMBA_DISABLE_JIT": os.environ.get("NUMBA_DISABLE_JIT", "0")})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "synth: --layers 8 --hidden 1048576 " in r.stderr and "lower --hidden" in r.stderr, r.stderr
    assert "of memory while writing" in r.stderr, r.stderr


# ------------------------------------------------------------------ run -n 1: what the decode line counts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("bounds")
    code, _, err = _cli("synth", d / "rel", "--layers", 2, "--experts", 8, "--k", 2, "--no-revisions")
    assert code == 0, err
    (d / "p.txt").write_text("hello world\nthe cat sat\nnumbers 1 2 3\n")
    return d / "rel" / "synth-canonical.gguf", d / "p.txt"


def test_run_n1_decode_line_counts_no_decode_steps(tiny):
    """-n 1: each request's one new token comes from its prefill's logits; the line said "decode: 3 new tokens,
    0.0 tokens/s"."""
    m, p = tiny
    code, out, err = _cli("run", m, "-p", p, "--device", "cpu", "-n", 1)
    assert code == 0, err
    line = [ln for ln in out.splitlines() if ln.startswith("prefill: ")][0]
    assert line.endswith("; new tokens: 3 (3 from the prefill logits); decode: no decode step ran"), line
    code, out, err = _cli("run", m, "-p", p, "--device", "cpu", "-n", 3, "--json")
    d = __import__("json").loads(out)
    assert (d["new_tokens"], d["decode_tokens"]) == (9, 6) and d["tokens_per_s"] > 0, d
    assert math.isclose(d["tokens_per_s"], 6 / d["decode_s"], rel_tol=1e-9)


# ------------------------------------------------------------------ a truncated Parquet trace


def test_truncated_parquet_message_is_whole_with_a_fix(tmp_path):
    import numpy as np

    from stratatools.traces.formats import write_trace
    from stratatools.traces.table import TraceTable

    n = 64
    t = TraceTable(request=np.zeros(n, np.int32), position=np.arange(n, dtype=np.int32) // 4,
                   layer=np.zeros(n, np.int32), rank=np.arange(n, dtype=np.int32) % 4,
                   expert=np.arange(n, dtype=np.int32) % 8, weight=np.ones(n, np.float32), phase=np.ones(n, np.int8))
    write_trace(t, tmp_path / "ok.parquet", "parquet")
    data = (tmp_path / "ok.parquet").read_bytes()
    (tmp_path / "x.parquet").write_bytes(data[:len(data) // 2])
    for argv in (["trace", "stats", tmp_path / "x.parquet"],
                 ["simulate", "-t", tmp_path / "x.parquet", "--slots", 4, "--no-sweep"]):
        code, _, err = _cli(*argv)
        assert code == 2 and err.count("\n") == 1, err
        assert err.rstrip().endswith("x.parquet: byte 0: not a readable Parquet trace (Parquet magic bytes not found "
                                      "in footer); the file is cut short, damaged or not Parquet: restore the "
                                      "complete file or write it again, e.g. with `stratatools trace convert --to "
                                      "parquet`"), err


def test_adaptive_v2_state_is_sized_by_the_model_not_the_knobs():
    """--adapt-lag 2 with --adapt-swaps 2147483647 (both in range) asked numpy for 48 GiB of move queues: a step
    never queues more moves than (layer, expert) pairs and a copy is in flight once per (tier, layer, expert)."""
    from stratatools.cachesim.kernels import adaptive_v2_state

    st = adaptive_v2_state(2, 4, 16, 2**31 - 1, 2**31 - 1, 8, 0)
    assert st[2].shape == (2, 64) and st[7].shape == (2 * 4 * 16 + 1,)
    st = adaptive_v2_state(1, 40, 512, 96, 1, 8, 0)  # the engine defaults on a real geometry: as before
    assert st[2].shape == (1, 96) and st[7].shape == (1 * 96 * 3 + 1,)
