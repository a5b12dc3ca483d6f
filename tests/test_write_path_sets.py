"""The write path's loose ends (each test failed before its fix):

* a file set (a profile and its sidecar) whose second target failed its check after the set was staged (it became
  a folder, another run published it, its rename failed) still published the first file: half a set;
* a refused run cleaned a killed run's temp folder and lock but not the aside folders of dead runs, which only a
  successful publish sorted out;
* what the clean-up and the publish did ("removed a leftover", "kept: ...") was returned or dropped, never shown;
* the demo published with ``keep=None``: a file written into its old output folder during the run was removed with
  the previous demo."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from stratatools.core import fsutil
from stratatools.core.errors import StrataError
from stratatools.core.fsutil import guard_output, publish_dir, write_bytes_atomic


from test_safety_publish_edges import _dead_pid, _leftovers  # noqa: E402


def _rename_fails_for(monkeypatch, target: Path) -> None:
    """os.rename onto ``target`` fails with EIO (a rename of the set failing midway)."""
    real = os.rename

    def rename(src, dst, *x, **k):
        if Path(dst) == target:
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst, *x, **k)

    monkeypatch.setattr(os, "rename", rename)


def _after_staging(monkeypatch, n: int, act) -> None:
    """Run ``act()`` right after the ``n``-th fsync of a temp file (the set is then staged up to that file)."""
    real = os.fsync
    calls = [0]

    def fsync(fd):
        r = real(fd)
        calls[0] += 1
        if calls[0] == n:
            act()
        return r

    monkeypatch.setattr(os, "fsync", fsync)


# ------------------------------------------------------------------------------------------ 1. file sets
@pytest.mark.parametrize("kind", ["folder", "fifo", "published"])
def test_set_whose_second_target_fails_its_check_publishes_nothing(tmp_path, monkeypatch, kind):
    """The second target of a staged set turns into a folder or a FIFO, or (no --force) another run publishes it:
    the first file is not published either, the previous outputs stay, no temp is left, one line naming the
    second file (exit 2)."""
    a, b = tmp_path / "p.bin.json", tmp_path / "p.bin"
    if kind == "published":
        guard_output(a, [], False)
        guard_output(b, [], False)
    else:
        a.write_text("old sidecar")

    def spoil():
        if kind == "folder":
            b.mkdir()
        elif kind == "fifo":
            os.mkfifo(b)
        else:
            b.write_text("the other run's profile")

    _after_staging(monkeypatch, 2, spoil)
    with pytest.raises(StrataError) as ei:
        fsutil.write_files_atomic([(a, b"new sidecar"), (b, b"new profile")])
    monkeypatch.undo()
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(str(b)) and ei.value.exit_code == 2, msg
    assert ("already exists (pass --force" in msg) if kind == "published" else ("choose another output path" in msg)
    assert "nothing of the set was written" in msg and str(a) in msg, msg
    if kind == "published":
        assert not a.exists() and b.read_text() == "the other run's profile"
    else:
        assert a.read_text() == "old sidecar"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("existed", [True, False])
def test_a_rename_that_fails_midway_puts_the_set_back(tmp_path, monkeypatch, existed):
    """The checks pass and the second rename still fails (a race, an I/O error): the first file is put back as it
    was (the previous file, or absent), no temp or backup is left."""
    a, b = tmp_path / "p.bin.json", tmp_path / "p.bin"
    if existed:
        a.write_text("old sidecar")
        b.write_text("old profile")
    _rename_fails_for(monkeypatch, b)
    monkeypatch.setattr(fsutil, "_renameat2", lambda *x: False)  # (no-replace falls back to link + unlink)
    with pytest.raises(StrataError, match="Input/output error") as ei:
        fsutil.write_files_atomic([(a, b"new sidecar"), (b, b"new profile")])
    monkeypatch.undo()
    assert str(ei.value).startswith(str(b))
    if existed:
        assert (a.read_text(), b.read_text()) == ("old sidecar", "old profile")
    else:
        assert not a.exists() and not b.exists()
    assert _leftovers(tmp_path) == []


def test_make_profile_publishes_no_lone_sidecar(tmp_path, monkeypatch):
    """make-profile (no --force): another run publishes the profile while this one stages it; this run publishes
    neither its sidecar nor its profile and says so in one line."""
    from stratatools.profiles.ranking import make_profile_files
    from stratatools.traces.formats import write_trace
    from stratatools.traces.table import TraceTable

    n = 8
    tt = TraceTable(np.zeros(n), np.arange(n) // 2, np.ones(n), np.zeros(n), np.tile([0, 1], 4), np.arange(n) % 4,
                    np.full(n, 0.5))
    write_trace(tt, tmp_path / "t.bin", "strata")
    out = tmp_path / "p.bin"
    _after_staging(monkeypatch, 2, lambda: out.write_bytes(b"the other run's profile"))
    with pytest.raises(StrataError, match=r"p\.bin: already exists \(pass --force"):
        make_profile_files([str(tmp_path / "t.bin")], str(out), 1, 4)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["p.bin", "t.bin"] and out.read_bytes() == b"the other run's profile"


# ------------------------------------------------------------------------------- 2. a refused run sweeps
OWN = ("a.txt", "b.txt", "report.json")


def _keep(n: str) -> bool:
    return n not in OWN


def _aside(tmp_path: Path, pid: int, tag: str = "0123abcd") -> Path:
    d = tmp_path / f".out.{pid}-{tag}.stratatools-old"
    d.mkdir()
    return d


def test_tidy_with_the_outputs_names_sweeps_dead_asides_like_a_publish(tmp_path):
    """tidy_output given the output's names (what a refused run of a folder command calls) sorts out the aside
    folders of dead runs as a publish does: the previous output's files removed, another program's file moved into
    the output folder, a folder with a file that differs from the output's kept (and said so). Without the names it
    does not touch them (it cannot tell a user's file from the output's)."""
    t = tmp_path / "out"
    t.mkdir()
    (t / "a.txt").write_text("current A")
    (t / "report.json").write_text("{}")
    dead = _aside(tmp_path, _dead_pid())
    (dead / "a.txt").write_text("older A")
    (dead / "notes.txt").write_text("only copy")
    clash = _aside(tmp_path, _dead_pid(), "4567cdef")
    (clash / "report.json").write_text("older")
    (clash / "a.txt").write_text("older A")
    (clash / "user.txt").write_text("mine")
    (t / "user.txt").write_text("a different file of that name")
    assert fsutil.tidy_output(t) == [] and dead.is_dir()  # no names given: left alone
    notes = fsutil.tidy_output(t, keep=_keep)
    assert not dead.exists() and (t / "notes.txt").read_text() == "only copy"
    assert os.listdir(clash) == ["user.txt"] and (clash / "user.txt").read_text() == "mine"
    assert sorted(os.listdir(t)) == ["a.txt", "notes.txt", "report.json", "user.txt"]
    assert (t / "a.txt").read_text() == "current A"
    # the note says where the user's file went
    assert f"{dead}: removed a leftover of an interrupted run; moved notes.txt (another program's) into {t}" in notes
    assert any(n.startswith(f"{clash}: kept") for n in notes), notes
    assert _leftovers(tmp_path) == [clash.name]


def _sim(kit, *extra):
    p = kit / "pruned"
    return ("simulate", "-t", p / "coder-revB.routing.csv", "--model", p / "coder-revB.gguf", "--slots", "48",
            "--no-sweep", *extra)


def test_refused_report_run_sweeps_dead_asides_and_says_so(kit, cli, tmp_path):
    """simulate --report onto an existing report (no --force) is refused, and sorts out a dead run's aside first:
    the user's file in it is moved into the report folder, the report's own files are not touched, and the note
    says what was done (on stderr, above the one-line error)."""
    rep = tmp_path / "rep"
    code, _, err = cli(*_sim(kit, "--report", rep))
    assert code == 0, err
    before = {n: (rep / n).read_bytes() for n in os.listdir(rep)}
    aside = tmp_path / f".rep.{_dead_pid()}-0123abcd.stratatools-old"
    aside.mkdir()
    (aside / "report.md").write_text("an older report")
    (aside / "todo.txt").write_text("written into the old report folder")
    code, out, err = cli(*_sim(kit, "--report", rep))
    assert code == 2 and "already exists" in err.splitlines()[-1], err
    assert not aside.exists() and (rep / "todo.txt").read_text() == "written into the old report folder"
    assert {n: (rep / n).read_bytes() for n in os.listdir(rep) if n != "todo.txt"} == before
    flat = "".join(err.split())
    assert "".join(f"note: {aside}: removed a leftover of an interrupted run".split()) in flat, err
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------- 3. notes
def _tiny_release(tmp_path: Path) -> Path:
    from stratatools.synth.model import SynthConfig, synth_release

    cfg = SynthConfig(n_layers=2, hidden=64, n_expert=8, keep=4, swap=1, k=2, expert_ff=64, shared_ff=64,
                      n_head=2, n_head_kv=1, head_dim=32, linear_k_heads=1, linear_v_heads=2, linear_k_dim=32,
                      linear_v_dim=32, hc_lowrank=32, indexer_dim=32, full_attention_interval=2, ple_layers=(0,),
                      vocab_size=300, revisions=False)
    synth_release(tmp_path / "rel", cfg)
    return tmp_path / "rel" / "synth-canonical.gguf"


def test_pack_prints_and_reports_what_it_kept(cli, tmp_path):
    """A dead run's aside beside a pack folder holds a file that differs from the pack folder's file of that name:
    the next pack keeps it and says so: a "note: ... kept" line on stderr, the same text in --json's notes, stdout
    still one JSON document; --quiet drops the line (not the JSON entry)."""
    model = _tiny_release(tmp_path)
    pk = tmp_path / "pk"
    code, _, err = cli("pack", model, "-o", pk)
    assert code == 0, err
    (pk / "mine.txt").write_text("the user's current file")
    aside = tmp_path / f".pk.{_dead_pid()}-0123abcd.stratatools-old"
    aside.mkdir()
    (aside / "mine.txt").write_text("an older version, only here")
    code, out, err = cli("pack", model, "-o", pk, "--force", "--json")
    assert code == 0, err
    doc = json.loads(out)
    kept = [n for n in doc["notes"] if n.startswith(f"{aside}: kept")]
    assert len(kept) == 1 and "mine.txt" in kept[0], doc["notes"]
    assert "".join(f"note: {kept[0]}".split()) in "".join(err.split()), err
    assert (aside / "mine.txt").read_text() == "an older version, only here"
    code, out, err = cli("--quiet", "pack", model, "-o", pk, "--force", "--json")
    assert code == 0 and "note:" not in err, err
    assert any(n.startswith(f"{aside}: kept") for n in json.loads(out)["notes"])


def test_publish_dir_records_its_notes(tmp_path):
    """publish_dir's clean-up notes (a dead run's temp folder removed, an aside kept) are recorded for the
    command to show (take_notes drains them)."""
    fsutil.take_notes()
    t = tmp_path / "out"
    t.mkdir()
    (t / "a.txt").write_text("A")
    tmp = tmp_path / f".out.{_dead_pid()}-0123abcd.stratatools-tmp"
    tmp.mkdir()
    with publish_dir(t, keep=_keep) as st:
        write_bytes_atomic(st / "a.txt", b"A2")
    notes = fsutil.take_notes()
    assert notes == [f"{tmp}: removed a leftover of an interrupted run"] and fsutil.take_notes() == []


# ---------------------------------------------------------------------------------------------- 4. demo
def test_demo_keeps_a_file_written_into_its_old_folder_during_the_run(tmp_path):
    """A file written into the previous demo folder while demo --force runs is carried into the new one (as the
    other folder commands do); the previous demo's own files are replaced; a file present before is kept too."""
    from stratatools.demo.walkthrough import MARKER, run_demo

    out = tmp_path / "demo"
    run_demo(out, lambda argv: (0, "ok"))
    (out / "index.md").write_text("the previous demo's index")
    (out / "before.txt").write_text("there before the run")
    calls = []

    def runner(argv):
        if not calls:
            (out / "during.txt").write_text("written while the demo ran")
        calls.append(argv)
        return 0, "ok"

    run_demo(out, runner, force=True)
    assert (out / "during.txt").read_text() == "written while the demo ran"
    assert (out / "before.txt").read_text() == "there before the run"
    assert (out / MARKER).is_file() and (out / "index.md").read_text() != "the previous demo's index"
    assert _leftovers(tmp_path) == []


def test_demo_refuses_a_subfolder_it_cannot_carry_over(tmp_path):
    """A subfolder of another program in a demo folder cannot be carried into the new folder (the demo replaces
    its folder whole): demo --force is refused before any step, one line, and the folder is left as it was."""
    from stratatools.demo.walkthrough import run_demo

    out = tmp_path / "demo"
    run_demo(out, lambda argv: (0, "ok"))
    (out / "photos").mkdir()
    (out / "photos" / "a.jpg").write_text("x")
    ran = []
    with pytest.raises(StrataError, match=r"photos: is a folder that is not the demo's") as ei:
        run_demo(out, lambda argv: ran.append(argv) or (0, "ok"), force=True)
    assert "\n" not in str(ei.value) and ran == [] and (out / "photos" / "a.jpg").read_text() == "x"


def test_a_refused_file_output_sweeps_a_dead_writers_temp(tmp_path):
    """guard_output refusing an existing output (no --force) removes a dead writer's temp file of that output
    first, as the write itself would; a live process's temp stays."""
    out = tmp_path / "t.bin"
    out.write_bytes(b"previous")
    dead = tmp_path / f".t.bin.{_dead_pid()}-0123abcd.stratatools-tmp"
    dead.write_bytes(b"half")
    live = tmp_path / f".t.bin.{os.getppid()}-0123abcd.stratatools-tmp"
    live.write_bytes(b"busy")
    with pytest.raises(StrataError, match="already exists"):
        guard_output(out, [], False)
    assert not dead.exists() and live.exists() and out.read_bytes() == b"previous"


def test_a_set_that_cannot_be_put_back_says_so(tmp_path, monkeypatch):
    """Where the previous file cannot be kept (no hard links) and the second rename fails, the error does not
    claim that nothing changed: it names the file already replaced."""
    a, b = tmp_path / "p.bin.json", tmp_path / "p.bin"
    a.write_text("old sidecar")
    b.write_text("old profile")
    _rename_fails_for(monkeypatch, b)
    monkeypatch.setattr(fsutil, "_backup", lambda t: None)
    with pytest.raises(StrataError) as ei:
        fsutil.write_files_atomic([(a, b"new sidecar"), (b, b"new profile")])
    monkeypatch.undo()
    msg = str(ei.value)
    assert "Input/output error" in msg and f"{a} of this set was already replaced" in msg, msg
    assert "nothing was changed" not in msg and b.read_text() == "old profile" and _leftovers(tmp_path) == []


def test_remap_refuses_to_write_onto_its_input_profiles_sidecar(cli, tmp_path):
    """remap-profile X -o X.json --force: X.json is X's sidecar, which the run reads (its provenance is carried
    over), so it is an input and is refused like one; it used to be replaced by the binary remapped profile."""
    from stratatools.alloc.allocation import format_allocation
    from stratatools.profiles.strp import Profile

    a = tmp_path / "a.txt"
    a.write_text(format_allocation([[0, 2], [1, 3]], 4))
    src = tmp_path / "shipped.strp"
    Profile(2, 4, [(0, 1), (1, 2)]).write(src)
    side = tmp_path / "shipped.strp.json"
    side.write_text('{"kind": "profile"}\n')
    code, out, err = cli("remap-profile", src, "--alloc", a, "-o", side, "--force")
    assert code == 2 and "input" in err and err.count("\n") == 1, err
    assert side.read_text() == '{"kind": "profile"}\n'


def test_a_refused_make_profile_sweeps_the_sidecars_dead_temp_too(cli, tmp_path):
    """make-profile refused because its profile exists (no --force) removes dead writers' temps of both files of
    its set, not only the profile's."""
    from stratatools.traces.formats import write_trace
    from stratatools.traces.table import TraceTable

    n = 8
    tt = TraceTable(np.zeros(n), np.arange(n) // 2, np.ones(n), np.zeros(n), np.tile([0, 1], 4), np.arange(n) % 4,
                    np.full(n, 0.5))
    write_trace(tt, tmp_path / "t.bin", "strata")
    out = tmp_path / "p.strp"
    out.write_bytes(b"previous")
    pid = _dead_pid()
    dead = [tmp_path / f".p.strp.{pid}-0123abcd.stratatools-tmp", tmp_path / f".p.strp.json.{pid}-0123abcd.stratatools-tmp"]
    for d in dead:
        d.write_bytes(b"half")
    code, _, err = cli("make-profile", tmp_path / "t.bin", "-o", out, "--n-layer", 1, "--n-expert", 4)
    assert code == 2 and "already exists" in err, err
    assert not any(d.exists() for d in dead) and out.read_bytes() == b"previous"


def test_quiet_demo_interrupted_after_its_steps_began_prints_no_note(cli, tmp_path, monkeypatch):
    """`-q demo`: the steps run the CLI in-process and reset the global flags; an interrupted demo used to print
    the write path's notes (a dead run's leftover removed) on the way out although -q was given."""
    from stratatools.cli import common, entry

    out = tmp_path / "d"
    leftover = tmp_path / f".d.{_dead_pid()}-0123abcd.stratatools-tmp"
    leftover.mkdir()
    calls = []
    real = entry.run_text

    def stub(app, argv, width=120):
        calls.append(argv[0])
        if len(calls) == 2:
            common.STATE.quiet = False  # as a step's own invocation leaves it
            return 143, "terminated"
        return real(app, argv, width)

    monkeypatch.setattr(entry, "run_text", stub)
    code, _, err = cli("-q", "demo", out)
    assert code == 143 and "note:" not in err and not leftover.exists() and not out.exists(), (code, err)


def test_notes_are_dropped_when_stderr_cannot_be_written(monkeypatch):
    """A command that published its output and has a note still ends normally when stderr is gone (2>/dev/full):
    the note is dropped (and still returned for --json), as every other line to stderr."""
    from stratatools.cli import common

    class Full:
        def write(self, s):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    fsutil.take_notes()
    fsutil._record(["x: kept: it holds y"])
    monkeypatch.setattr(common.STATE, "quiet", False)
    monkeypatch.setattr(common.err_console, "file", Full())
    assert common.write_notes() == ["x: kept: it holds y"]


def test_demo_force_carries_files_inside_its_own_folders(tmp_path, cli):
    """`demo --force` on a demo folder where the user put files inside the demo's own folders (its reports, logs):
    they are carried into the new demo folder with a note, the demo's own files are replaced."""
    out = tmp_path / "d"
    code, _, err = cli("demo", out)
    assert code == 0, err
    (out / "reports" / "my-analysis.md").write_text("my analysis")
    (out / "logs" / "sub").mkdir()
    (out / "logs" / "sub" / "mine.log").write_text("mine")
    own = sorted(p.name for p in (out / "reports").iterdir())
    (out / "index.md").write_text("stale")
    code, _, err = cli("demo", out, "--force")
    assert code == 0, err
    assert (out / "reports" / "my-analysis.md").read_text() == "my analysis"
    assert (out / "logs" / "sub" / "mine.log").read_text() == "mine"
    assert (out / "index.md").read_text() != "stale" and set(own) <= {p.name for p in (out / "reports").iterdir()}
    assert "my-analysis.md: not written by this output; carried into the new folder" in err, err
