"""Edges of the folder and file write path that earlier break tests left open (each test failed before its fix):

* swap mode: a file another program writes into the old output folder after the last carry-over pass and before
  the swap was removed with the old folder (also when the run is killed right after the swap);
* aside folders (``.stratatools-old``) that no journal names were never swept;
* a run that started while another one cleaned leftovers was refused as "another run is writing";
* a signal between the renames of a file set published half the set; after an interrupt the CLI did not say
  which outputs had already been written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stratatools.core import fsutil
from stratatools.core.errors import StrataError
from stratatools.core.fsutil import publish_dir, write_bytes_atomic

ROOT = str(Path(__file__).resolve().parents[1])
OWN = ("a.txt", "b.txt", "report.json")


def _keep(n: str) -> bool:
    return n not in OWN


def _leftovers(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if "stratatools-" in n)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _old_output(t: Path) -> None:
    """A previous output alone in its folder (so the next publish swaps the folder whole)."""
    t.mkdir()
    (t / "a.txt").write_text("old A")
    (t / "b.txt").write_text("old B, the new output lacks it")
    (t / "report.json").write_text("old")


# ------------------------------------------------------------------------------ 1. swap mode window
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "aside-rename"])
def test_file_written_into_the_old_folder_just_before_the_swap_is_kept(tmp_path, monkeypatch, exchange):
    """Another program writes notes.txt into the old folder after publish_dir's last carry-over pass, just
    before the swap (the exchange, or the portable "old aside, new in"): it ends up in the published folder,
    not deleted with the previous output; the previous output's own files are gone."""
    t = tmp_path / "out"
    _old_output(t)
    real = fsutil._renameat2_exchange

    def exchange_after_a_write(a, b):
        (t / "notes.txt").write_text("written meanwhile")  # the window: after _carry_over, before the swap
        return real(a, b) if exchange else False

    monkeypatch.setattr(fsutil, "_renameat2_exchange", exchange_after_a_write)
    with publish_dir(t, keep=_keep, last=["report.json"]) as st:
        write_bytes_atomic(st / "a.txt", b"new A")
        write_bytes_atomic(st / "report.json", b"{}")
    assert sorted(os.listdir(t)) == ["a.txt", "notes.txt", "report.json"]
    assert (t / "notes.txt").read_text() == "written meanwhile" and (t / "a.txt").read_text() == "new A"
    assert _leftovers(tmp_path) == []


def test_file_that_differs_from_the_carried_copy_keeps_the_old_folder(tmp_path, monkeypatch):
    """The window's file has a name the new folder already holds with other bytes (another program replaced
    its file after the carry-over): neither copy is deleted; the previous folder stays aside, named so, with
    only that file left in it."""
    t = tmp_path / "out"
    _old_output(t)
    (t / "notes.txt").write_text("v1")  # another program's file: published in place, not swapped
    real = fsutil._renameat2_exchange

    def replace_notes(a, b):
        new = t / ".notes.new"
        new.write_text("v2, written after the carry-over")
        os.rename(new, t / "notes.txt")  # a rename over it: a new inode the new folder does not link
        return real(a, b)

    monkeypatch.setattr(fsutil, "_renameat2_exchange", replace_notes)
    monkeypatch.setattr(fsutil, "_others", lambda t_, keep: [])  # the race: notes.txt appeared after the check
    with publish_dir(t, keep=_keep) as st:
        write_bytes_atomic(st / "a.txt", b"new A")
    assert (t / "notes.txt").read_text() == "v1" and (t / "a.txt").read_text() == "new A"
    kept = _leftovers(tmp_path)
    assert len(kept) == 1 and kept[0].endswith(".stratatools-old"), kept
    assert os.listdir(tmp_path / kept[0]) == ["notes.txt"]
    assert (tmp_path / kept[0] / "notes.txt").read_text() == "v2, written after the carry-over"


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "aside-rename"])
def test_run_killed_right_after_the_swap_loses_no_file_written_before_it(tmp_path, exchange):
    """A SIGKILL-like exit right after the swap, before the old folder was sorted: the next command naming the
    output (tidy_output) moves the other program's file back into the published folder (the journal names the
    output's own names) and removes the rest of the previous output."""
    t = tmp_path / "out"
    _old_output(t)
    code = f"""
import os, sys
sys.path.insert(0, {ROOT!r})
from stratatools.core import fsutil
real = fsutil._renameat2_exchange
def exchange(a, b):
    with open({str(t / "notes.txt")!r}, "w") as fh:
        fh.write("written meanwhile")
    return real(a, b) if {exchange!r} else False
fsutil._renameat2_exchange = exchange
fsutil.commit_point = lambda final=True: os._exit(9)  # killed right after the swap
with fsutil.publish_dir({str(t)!r}, keep=lambda n: n not in {OWN!r}) as st:
    fsutil.write_bytes_atomic(st / "a.txt", b"new A")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    assert sorted(os.listdir(t)) == ["a.txt"]  # the new output; the old folder with notes.txt is a leftover
    fsutil.tidy_output(t)
    assert sorted(os.listdir(t)) == ["a.txt", "notes.txt"] and (t / "notes.txt").read_text() == "written meanwhile"
    assert _leftovers(tmp_path) == []


# ------------------------------------------------------------------------------ 2. unnamed aside folders
def _aside(tmp_path: Path, pid: int, tag: str = "0123abcd") -> Path:
    a = tmp_path / f".out.{pid}-{tag}.stratatools-old"
    a.mkdir()
    return a


def test_aside_no_journal_names_is_swept_by_the_next_publish(tmp_path):
    """An aside folder of a dead run that no journal names (no lock file at all): the next publish of the output
    removes the previous output's files in it, keeps what the output folder already holds (a hard link), moves
    another program's file the output folder lacks into it, and removes the folder. A live process's aside,
    and one whose file differs from the output's file of that name, are not deleted."""
    t = tmp_path / "out"
    t.mkdir()
    (t / "model.gguf").write_text("the user's model")  # another program's file: an in-place publish
    dead = _aside(tmp_path, _dead_pid())
    (dead / "a.txt").write_text("older output's A")
    (dead / "report.json").write_text("older")
    os.link(t / "model.gguf", dead / "model.gguf")
    (dead / "notes.txt").write_text("only copy")
    clash = _aside(tmp_path, _dead_pid(), "4567cdef")
    (clash / "model.gguf").write_text("another version of the model")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = _aside(tmp_path, live.pid)
        (mine / "a.txt").write_text("a live run's")
        assert not fsutil.lock_path(t).exists()
        with publish_dir(t, keep=_keep, last=["report.json"]) as st:
            write_bytes_atomic(st / "a.txt", b"new A")
            write_bytes_atomic(st / "report.json", b"{}")
        assert sorted(os.listdir(t)) == ["a.txt", "model.gguf", "notes.txt", "report.json"]
        assert [(t / n).read_text() for n in ("a.txt", "model.gguf", "notes.txt")] == \
            ["new A", "the user's model", "only copy"]
        assert not dead.exists() and (mine / "a.txt").read_text() == "a live run's"
        assert os.listdir(clash) == ["model.gguf"] and (clash / "model.gguf").read_text() == \
            "another version of the model"
        assert _leftovers(tmp_path) == sorted([clash.name, mine.name])
    finally:
        live.kill()
        live.wait()


def test_aside_left_by_a_failed_removal_is_swept_by_the_next_run(tmp_path):
    """A run whose removal of the previous output failed (here: the removal skipped) clears its journal and
    leaves an aside no journal names; the next swap of the same output removes it (all of it is the previous
    output's own files) and leaves nothing beside the output."""
    t = tmp_path / "out"
    _old_output(t)
    code = f"""
import sys
sys.path.insert(0, {ROOT!r})
from stratatools.core import fsutil
fsutil._renameat2_exchange = lambda a, b: False  # the portable swap: old aside, new in
real = fsutil._remove_tree
fsutil._remove_tree = lambda p: None if p.name.endswith(".stratatools-old") else real(p)
with fsutil.publish_dir({str(t)!r}, keep=lambda n: n not in {OWN!r}) as st:
    fsutil.write_bytes_atomic(st / "a.txt", b"A2")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    left = _leftovers(tmp_path)
    assert len(left) == 1 and left[0].endswith(".stratatools-old") and not fsutil.lock_path(t).exists(), left
    with publish_dir(t, keep=_keep) as st:
        write_bytes_atomic(st / "a.txt", b"A3")
    assert sorted(os.listdir(t)) == ["a.txt"] and (t / "a.txt").read_text() == "A3"
    assert _leftovers(tmp_path) == []


# ------------------------------------------------------------------------------ 3. a run meets a cleaner
def _dead_runs_leftovers(tmp_path: Path) -> Path:
    """The temp folder and lock file (journal naming the folder) of a killed run of ``out``."""
    d = tmp_path / f".out.{_dead_pid()}-0123abcd.stratatools-tmp"
    d.mkdir()
    (d / "a.txt").write_text("half built")
    fsutil.lock_path(tmp_path / "out").write_text('{"paths": ["%s"]}' % d)
    return d


def test_run_that_starts_while_another_cleans_leftovers_waits_for_it(tmp_path, monkeypatch):
    """Run A cleans what a killed run left beside the output (tidy_output, holding the lock); run B starts a
    publish of the same output meanwhile. B is not refused as "another run is writing" (nobody is): it waits for
    the cleaner, then publishes."""
    t = tmp_path / "out"
    left = _dead_runs_leftovers(tmp_path)
    cleaning, go = threading.Event(), threading.Event()
    real_remove = fsutil._remove_tree

    def slow_remove(p):  # the cleaner, mid-way through its work, until B has found the lock taken
        if threading.current_thread().name == "cleaner":
            cleaning.set()
            assert go.wait(10)
        real_remove(p)

    def wait(s):  # B's poll: the first one lets the cleaner finish
        go.set()
        threading.Event().wait(s)

    monkeypatch.setattr(fsutil, "_remove_tree", slow_remove)
    monkeypatch.setattr(fsutil, "_lock_wait", wait)
    notes: list[str] = []
    a = threading.Thread(target=lambda: notes.extend(fsutil.tidy_output(t)), name="cleaner")
    a.start()
    try:
        assert cleaning.wait(10)
        with publish_dir(t) as st:
            (st / "a.txt").write_text("B's")
    finally:
        go.set()
        a.join(10)
    assert go.is_set() and (t / "a.txt").read_text() == "B's" and not left.exists()
    assert any("leftover" in n for n in notes) and _leftovers(tmp_path) == []


def test_a_cleaner_that_does_not_finish_is_named_as_one(tmp_path, monkeypatch):
    """The wait is bounded: a cleaner still at work after it is named as a cleaner (not as a writer); a run that
    holds the lock to write is refused at once, as before."""
    t = tmp_path / "out"
    monkeypatch.setattr(fsutil, "_CLEAN_WAIT_S", 0.3)
    with fsutil.output_lock(t) as lock:
        lock.set_journal({"cleaning": os.getpid()})
        with pytest.raises(StrataError, match="cleaning up what an interrupted run left"):
            with fsutil.output_lock(t):
                pass
        lock.set_journal({"paths": [str(tmp_path / ".out.1-0123abcd.stratatools-tmp")]})
        with pytest.raises(StrataError, match="another stratatools run is writing this output"):
            with fsutil.output_lock(t):
                pass
        lock.set_journal({})


# ------------------------------------------------------------------------------ 4. signals and file renames
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signal_between_the_renames_of_a_file_set_publishes_the_set_whole(tmp_path, monkeypatch, sig):
    """A profile and its sidecar are one set (write_files_atomic). A signal that lands right after the first
    rename used to stop the second: a new sidecar beside the old profile. Now the renames are one held block:
    the set is published whole, then the command exits 128 + signal."""
    from stratatools.cli import entry

    signum = getattr(signal, sig)
    handler = entry._interrupted if sig == "SIGINT" else entry._terminated
    a, b = tmp_path / "p.bin.json", tmp_path / "p.bin"
    a.write_text("old sidecar")
    b.write_text("old profile")
    real = os.rename
    sent = []

    def rename_then_signal(src, dst, *x, **k):
        real(src, dst, *x, **k)
        if not sent:
            sent.append(dst)
            handler(signum, None)

    monkeypatch.setattr(os, "rename", rename_then_signal)
    with pytest.raises((SystemExit, KeyboardInterrupt)) as ei:
        fsutil.write_files_atomic([(a, b"new sidecar"), (b, b"new profile")])
    monkeypatch.undo()
    assert sent == [a] and (a.read_text(), b.read_text()) == ("new sidecar", "new profile")
    assert isinstance(ei.value, SystemExit) and ei.value.code == 128 + signum
    assert sorted(os.listdir(tmp_path)) == ["p.bin", "p.bin.json"]


@pytest.mark.parametrize("where", ["file", "set"])
def test_signal_held_back_before_the_rename_publishes_nothing(tmp_path, monkeypatch, where):
    """A signal held back before the rename stops the publication: the previous file stays, no temp is left,
    exit 130. "file": it lands as the target is checked once more, inside the rename's held block; "set": it
    lands while a file set is staged inside an enclosing held block (before, the set was renamed in and the
    exit came after it)."""
    from stratatools.cli import entry

    out = tmp_path / "out.txt"
    out.write_text("previous")
    real = fsutil.check_target

    def check_then_signal(p, inputs=()):
        entry._interrupted(signal.SIGINT, None)
        return real(p, inputs)

    with pytest.raises((SystemExit, KeyboardInterrupt)) as ei:
        if where == "file":
            fd, tmp = fsutil.create_temp(out)
            monkeypatch.setattr(fsutil, "check_target", check_then_signal)
            fsutil.commit_temp(fd, tmp, out)
        else:
            with fsutil.signals_deferred():
                entry._interrupted(signal.SIGINT, None)
                fsutil.write_files_atomic([(out, b"new")])
    monkeypatch.undo()
    assert getattr(ei.value, "code", 130) == 130 and out.read_text() == "previous"
    assert os.listdir(tmp_path) == ["out.txt"] and fsutil._DEFER["pending"] is None


def test_cli_names_a_file_it_published_before_an_interrupt(kit, cli, tmp_path, monkeypatch):
    """Ctrl-C right after a command's output was renamed in: exit 130 (interrupted), and the message names the
    output as written whole (it used to say only "interrupted", as if the output had been left as it was)."""
    from stratatools.cli import entry

    out = tmp_path / "t.bin"
    real = os.rename
    sent = []

    def rename_then_signal(src, dst, *x, **k):
        real(src, dst, *x, **k)
        if Path(dst) == out and not sent:
            sent.append(1)
            entry._interrupted(signal.SIGINT, None)

    monkeypatch.setattr(os, "rename", rename_then_signal)
    code, _o, err = cli("trace", "convert", kit / "pruned" / "coder-revB.routing.csv", "-o", out, "--to", "strata",
                        "--force")
    monkeypatch.undo()
    assert sent and code == 130, (code, err)
    joined = "".join(err.split())
    assert "interrupted;alreadywritten,whole,beforeit:" in joined and str(out) in joined, err
    assert out.stat().st_size > 0 and [n for n in os.listdir(tmp_path) if "stratatools" in n] == []


# ------------------------------------------------------------------------------ 4. the in-place SIGKILL window
def test_finishing_a_killed_in_place_publish_removes_the_old_marker_first(tmp_path):
    """A run killed just after its in-place publish was journalled (before it removed the previous marker), then
    the run that finishes it (tidy_output) killed after its first rename: the folder must not show the previous
    output's marker beside a mix of old and new files (it used to: the roll-forward renamed files in before
    touching the marker). A third run completes the new output, marker last."""
    t = tmp_path / "shared"
    t.mkdir()
    (t / "notes.txt").write_text("mine")
    (t / "a.txt").write_text("old A")
    (t / "b.txt").write_text("old B")
    (t / "report.json").write_text("previous")
    first = f"""
import os, sys
sys.path.insert(0, {ROOT!r})
from stratatools.core import fsutil
fsutil.commit_point = lambda final=True: os._exit(9)  # killed as the journalled publish starts
with fsutil.publish_dir({str(t)!r}, keep=lambda n: n not in {OWN!r}, last=["report.json"]) as st:
    for n in ("a.txt", "b.txt", "report.json"):
        fsutil.write_bytes_atomic(st / n, ("new " + n).encode())
"""
    r = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    assert (t / "report.json").read_text() == "previous"  # nothing changed yet; the journal names the publish
    second = f"""
import os, sys
sys.path.insert(0, {ROOT!r})
from stratatools.core import fsutil
real = os.rename
def rename(a, b):
    real(a, b)
    os._exit(9)  # the finishing run killed after its first rename
os.rename = rename
fsutil.tidy_output({str(t)!r})
"""
    r = subprocess.run([sys.executable, "-c", second], capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    texts = {n: (t / n).read_text() for n in os.listdir(t)}
    assert texts.get("report.json") != "previous", texts  # no marker claims the mix is the previous output
    fsutil.tidy_output(t)
    assert {n: (t / n).read_text() for n in os.listdir(t)} == {
        "notes.txt": "mine", "a.txt": "new a.txt", "b.txt": "new b.txt", "report.json": "new report.json"}
    assert _leftovers(tmp_path) == []


def test_file_written_into_the_old_folder_while_it_is_removed_is_not_swept_blindly(tmp_path, monkeypatch):
    """After an exchange the previous output has a temp name (.stratatools-tmp), and dead runs' temp folders are
    removed whole. A file written into the old folder while it is being removed (a program with the folder open)
    makes the removal incomplete: what is left is renamed to an aside name, so a later run sorts it out (moves
    the file into the output) instead of deleting it with a dead run's temp folder."""
    t = tmp_path / "out"
    _old_output(t)
    real_remove = fsutil._remove_tree
    wrote = []

    def remove_while_written(p):
        real_remove(p)
        if p.name.endswith(".stratatools-tmp") and not wrote and p.exists() is False:
            p.mkdir()  # the folder a program still has open: its write lands in a fresh entry of that name
            (p / "late.txt").write_text("written during the removal")
            wrote.append(p)

    monkeypatch.setattr(fsutil, "_remove_tree", remove_while_written)
    with publish_dir(t, keep=_keep) as st:
        write_bytes_atomic(st / "a.txt", b"new A")
    monkeypatch.undo()
    left = _leftovers(tmp_path)
    assert wrote and len(left) == 1 and left[0].endswith(".stratatools-old"), left
    assert os.listdir(tmp_path / left[0]) == ["late.txt"]


# ------------------------------------------------------------------------------ review findings
def test_a_leftover_recover_cannot_sort_out_is_kept_not_swept(tmp_path, monkeypatch):
    """The previous output, left by a killed swap under a temp name the journal names, holds another program's
    file; sorting it out fails (a permission error). tidy_output must not then sweep it as a dead temp (it
    removed it whole, the user's file with it), the journal keeps naming it, and a publish refuses in one line
    instead of overwriting that journal."""
    t = tmp_path / "out"
    d = tmp_path / f".out.{_dead_pid()}-0123abcd.stratatools-tmp"
    d.mkdir()
    (d / "a.txt").write_text("old A")
    (d / "notes.txt").write_text("the user's only copy")
    _old_output(t)
    fsutil.lock_path(t).write_text('{"own": ["a.txt", "b.txt", "report.json"], "paths": ["%s"]}' % d)

    def fail(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fsutil, "_retire", fail)
    fsutil.tidy_output(t)
    assert (d / "notes.txt").read_text() == "the user's only copy"
    assert str(d) in fsutil.lock_path(t).read_text()
    with pytest.raises(StrataError, match="is left from an interrupted run and could not be sorted out"):
        with publish_dir(t, keep=_keep) as st:
            (st / "a.txt").write_text("new A")
    assert (d / "notes.txt").read_text() == "the user's only copy" and (t / "a.txt").read_text() == "old A"
    monkeypatch.undo()  # the obstacle gone: the next run sorts it out, the user's file moved into the output
    with publish_dir(t, keep=_keep) as st:
        (st / "a.txt").write_text("new A")
    assert (t / "a.txt").read_text() == "new A" and not d.exists()
    assert any((p / "notes.txt").exists() and (p / "notes.txt").read_text() == "the user's only copy"
               for p in [t, *tmp_path.iterdir()] if p.is_dir())


def test_a_journal_past_64_kib_is_read_whole(tmp_path):
    """A swap's journal lists the output's own names: 1,800 shards passed 64 KiB, and the truncated journal read
    as empty (the swap it described was then never finished or undone)."""
    t = tmp_path / "out"
    own = [f"synth-canonical-{i:05d}-of-01800.gguf" for i in range(1800)]
    with fsutil.output_lock(t) as lock:
        lock.set_journal({"paths": [str(tmp_path / ".out.1-0123abcd.stratatools-tmp")], "own": own})
        assert len(fsutil.lock_path(t).read_bytes()) > 1 << 16
        assert lock.journal()["own"] == own


def test_names_with_other_digits_are_not_taken_for_a_pid(tmp_path):
    """'²' passes str.isdigit() but not int(): a leftover named '.out.²-abcdabcd.stratatools-tmp' crashed every
    run of 'out' with a ValueError traceback. It is not ours: left alone."""
    t = tmp_path / "out"
    odd = [tmp_path / ".out.\u00b2-abcdabcd.stratatools-tmp", tmp_path / ".out.\u00b2-abcdabcd.stratatools-old"]
    for p in odd:
        p.mkdir()
    fsutil.tidy_output(t)
    with publish_dir(t, keep=_keep) as st:
        (st / "a.txt").write_text("new A")
    assert (t / "a.txt").read_text() == "new A" and all(p.is_dir() for p in odd)
