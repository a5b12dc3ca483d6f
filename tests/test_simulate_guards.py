"""simulate/compare: traces of another model (more layers) refused, left-out entries named, --report folders.

Each case is an input a new-user break test found passing silently (or merging into the wrong folder)."""

from __future__ import annotations

import json
import shutil

from test_release_gates import _extra_layer_trace


def test_simulate_refuses_a_trace_of_more_layers(kit, cli, tmp_path):
    t = _extra_layer_trace(kit, tmp_path / "l10.csv")
    p = kit / "pruned"
    code, out, err = cli("simulate", "-t", t, "--model", p / "coder-revB.gguf", "--slots", "32", "--no-sweep")
    assert code == 2 and "routes layers up to 9" in err and "8 trunk layers" in err and "MTP" not in err, err
    assert len(err.strip().splitlines()) == 1
    code, out, err = cli("compare", "-t", t, "-p", p / "expected-profile-revA-remapped-to-revB.bin",
                         "--slots", "32")
    assert code == 2 and "routes layers up to 9" in err, err
    # the same trace of the model's own layers replays with nothing left out, and says nothing about it
    code, out, err = cli("simulate", "-t", p / "coder-revB.routing.csv", "--model", p / "coder-revB.gguf",
                         "--slots", "32", "--no-sweep")
    assert code == 0 and "left out" not in err, err


def test_simulate_says_what_it_left_out(kit, cli, tmp_path):
    p = kit / "pruned"
    lines = (p / "coder-revB.routing.csv").read_text().splitlines()
    t = tmp_path / "phased.csv"  # the first 4 positions of every prompt are its prefill
    t.write_text("\n".join([lines[0] + ",phase"] + [ln + ("," + ("prefill" if int(ln.split(",")[2]) < 4
                                                                       else "decode")) for ln in lines[1:]]) + "\n")
    code, out, err = cli("simulate", "-t", t, "--model", p / "coder-revB.gguf",
                         "--slots", "32", "--no-sweep", "--cold", "--json")
    sk = json.loads(out)["skipped"]
    assert code == 0 and sk["prefill"] > 0
    assert f"left out of the replay: {sk['prefill']:,} prefill entries (--cold)" in " ".join(err.split())


def test_report_into_a_folder_of_traces_is_refused(kit, cli, tmp_path):
    tr = tmp_path / "tr"
    tr.mkdir()
    t = tr / "o.csv"
    shutil.copy(kit / "pruned/coder-revB.routing.csv", t)
    (tr / "other.csv").write_text("keep me\n")
    base = ("simulate", "-t", t, "--model", kit / "pruned/coder-revB.gguf", "--slots", "32", "--no-sweep")
    for extra in ((), ("--force",)):
        code, _, err = cli(*base, "--report", tr, *extra)
        assert code == 2 and "holds the input" in err, err
        assert sorted(x.name for x in tr.iterdir()) == ["o.csv", "other.csv"]
    # a folder of other files, no input in it: refused without --force, added beside them with it
    other = tmp_path / "notes"
    other.mkdir()
    (other / "n.txt").write_text("mine\n")
    code, _, err = cli(*base, "--report", other)
    assert code == 2 and "not a report" in err and "n.txt" in err, err
    assert [x.name for x in other.iterdir()] == ["n.txt"]
    code, _, err = cli(*base, "--report", other, "--force")
    assert code == 0, err
    assert (other / "n.txt").read_text() == "mine\n" and (other / "report.json").exists()
    # a previous report: --force replaces it, without it is refused
    code, _, err = cli(*base, "--report", other)
    assert code == 2 and "already exists" in err


def test_mtp_block_entries_are_named_not_refused(cli, tmp_path):
    """A trace of a model with an MTP block routes one layer past the trunk: with --model (which names the
    block) it replays, its MTP entries left out and said so; with the profile alone the layer is unexplained."""
    code, _, err = cli("synth", tmp_path / "rel", "--layers", "3", "--experts", "8", "--keep", "4", "--mtp",
                       "--no-revisions")
    assert code == 0, err
    m = tmp_path / "rel/synth-canonical.gguf"
    rows = ["model,prompt_id,token_pos,layer,rank,expert_id,weight"]
    for pos in range(12):
        for layer in range(4):  # 3 trunk layers + the MTP block (layer 3)
            for rank in range(2):
                rows.append(f"m,p0,{pos},{layer},{rank},{(pos + layer + 3 * rank) % 8},0.5")
    t = tmp_path / "mtp.csv"
    t.write_text("\n".join(rows) + "\n")
    code, out, err = cli("simulate", "-t", t, "--model", m, "--slots", "6", "--no-sweep", "--json")
    assert code == 0, err
    assert json.loads(out)["skipped"]["layer"] == 24
    assert "left out of the replay: 24 entries of layers >= 3 (the model's MTP blocks)" in " ".join(err.split())
    code, _, err = cli("make-profile", t, "--model", m, "-o", tmp_path / "p.bin")
    assert code == 0, err
    code, _, err = cli("simulate", "-t", t, "-p", tmp_path / "p.bin", "--slots", "6", "--no-sweep")
    one = " ".join(err.split())
    assert code == 2 and "routes layers up to 3" in one and "entries of layer 3 " in one, err
    assert "if layer 3 is this model's MTP block: pass --model M.gguf" in one, err


def test_tune_refuses_a_trace_of_more_layers(kit, cli, tmp_path):
    """tune on another model's trace (10 layers, the model has 8) stopped on the --kfold check (default 5 folds,
    3 requests) and, with --kfold 2, tuned it and exited 0: now simulate's refusal, one line, exit 2."""
    t = _extra_layer_trace(kit, tmp_path / "l10.csv")
    m = kit / "pruned/coder-revB.gguf"
    for extra in ((), ("--kfold", "2", "--candidates", "3")):
        code, out, err = cli("tune", "-t", t, "--model", m, "--slots", "32", *extra)
        assert code == 2 and "routes layers up to 9" in err and "8 trunk layers" in err, err
        assert str(t) in err and "--kfold" not in err and len(err.strip().splitlines()) == 1, err
    # the profile alone names the geometry too
    code, out, err = cli("tune", "-t", t, "-p", kit / "pruned/expected-profile-revA-remapped-to-revB.bin",
                         "--slots", "32", "--kfold", "2", "--candidates", "3")
    assert code == 2 and "routes layers up to 9" in err, err
    # the model's own trace tunes as before
    code, out, err = cli("tune", "-t", kit / "pruned/coder-revB.routing.csv", "--model", m, "--slots", "32",
                         "--kfold", "2", "--candidates", "3", "--json")
    assert code == 0 and json.loads(out)["k"] == 2, err


def test_tune_in_memory_path_refuses_a_trace_of_more_layers(kit):
    """The mapper path (--cluster) reads the traces whole: the same refusal, before any fold is built."""
    import pytest

    from stratatools.cachesim.tune import tune
    from stratatools.core.errors import StrataError
    from stratatools.traces.formats import read_trace

    t = read_trace(kit / "pruned/coder-revB.routing.csv")
    t.layer[t.layer == 0] = 9
    with pytest.raises(StrataError, match=r"routes layers up to 9 but the model has 8 trunk layers"):
        tune(t, 8, 16, slots=32, k=2, candidates=3, mapper=lambda fn, items: list(map(fn, items)), max_layers=8)


def test_report_published_meanwhile_is_not_replaced(kit, cli, tmp_path, monkeypatch):
    """simulate/compare --report without --force checked the folder (no report), then another run published a
    report there before the swap: the check runs again under the folder's lock, so the other report is kept."""
    import os

    from stratatools.cachesim import report as rep

    p = kit / "pruned"
    real = rep.study_markdown
    for i, cmd in enumerate((("simulate", "--model", p / "coder-revB.gguf", "--no-sweep"),
                             ("compare", "-p", p / "profile-revA.bin"))):
        out = tmp_path / f"rep{i}"

        def other_run_first(study, *a, _out=out, **k):  # the report is rendered after the early check
            md = real(study, *a, **k)
            _out.mkdir(exist_ok=True)
            (_out / "report.json").write_text("theirs")
            return md

        monkeypatch.setattr(rep, "study_markdown", other_run_first)
        code, _o, err = cli(cmd[0], "-t", p / "coder-revB.routing.csv", *cmd[1:], "--slots", "32", "--report", out)
        assert code == 2 and "report.json: already exists (pass --force" in err, (cmd[0], err)
        assert sorted(os.listdir(out)) == ["report.json"] and (out / "report.json").read_text() == "theirs"
        assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith((".", "rep"))) == \
            [f"rep{j}" for j in range(i + 1)], list(tmp_path.iterdir())
