"""Folder outputs (--report, pack -o, synth OUTDIR): each case is an input a new-user break test found failing.

* the published folder kept none of the replaced folder's permissions (a 0700 or setgid folder came back 0755);
* --force onto a folder of other files lost files another program wrote there while the report was built;
* --report "" gave advice that failed; a subfolder in a report folder failed only after the whole run;
* a killed run's temp folder and lock stayed until a --force run; compare --report printed no "wrote" line."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stratatools.core import fsutil
from stratatools.core.errors import StrataError
from stratatools.core.fsutil import publish_dir, write_bytes_atomic

OWN = ("a.txt", "b.txt", "report.json")


def _keep(n: str) -> bool:
    return n not in OWN


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def _leftovers(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if "stratatools-" in n)


def _sim(kit, *extra):
    p = kit / "pruned"
    return ("simulate", "-t", p / "coder-revB.routing.csv", "--model", p / "coder-revB.gguf", "--slots", "48",
            "--no-sweep", *extra)


def _dead_pid() -> int:
    pr = subprocess.Popen([sys.executable, "-c", "pass"])
    pr.wait()
    return pr.pid


# ------------------------------------------------------------------------------------------- permissions
@pytest.mark.parametrize("mode", [0o700, 0o2750, 0o1770])
@pytest.mark.parametrize("others", [False, True])
def test_published_folder_keeps_the_replaced_folders_mode(tmp_path, mode, others):
    """Swapped (only a previous output there) or filled in place (other files there): same mode, and the temp
    folder has it before the swap (no moment with a wider mode)."""
    t = tmp_path / "out"
    t.mkdir()
    (t / "a.txt").write_text("old\n")
    if others:
        (t / "theirs.txt").write_text("keep\n")
    os.chmod(t, mode)
    seen = []
    with publish_dir(t, keep=_keep, step=lambda n: seen.append(n)) as stage:
        assert _mode(stage) == mode  # before anything is written into it
        write_bytes_atomic(stage / "a.txt", b"new\n")
    assert _mode(t) == mode and (t / "a.txt").read_text() == "new\n"
    assert seen == (["a.txt"] if others else [""])
    assert _leftovers(tmp_path) == []


def test_whole_folder_output_keeps_mode_and_group(tmp_path):
    t = tmp_path / "demo"
    t.mkdir()
    os.chmod(t, 0o700)
    gid = os.stat(t).st_gid
    with publish_dir(t) as stage:
        (stage / "x").write_text("1")
    assert _mode(t) == 0o700 and os.stat(t).st_gid == gid


def test_simulate_report_keeps_a_private_setgid_folder(kit, cli, tmp_path):
    perm = tmp_path / "perm"
    perm.mkdir()
    os.chmod(perm, 0o2750)
    for extra in ((), ("--force",)):
        code, _, err = cli(*_sim(kit, "--report", perm, *extra))
        assert code == 0, err
        assert _mode(perm) == 0o2750, oct(_mode(perm))


def test_pack_onto_a_private_folder_keeps_it_private(kit, cli, tmp_path):
    out = tmp_path / "packB"
    out.mkdir()
    os.chmod(out, 0o700)
    for extra in ((), ("--force",)):
        code, _, err = cli("pack", kit / "pruned/coder-revB.gguf", "-o", out, "--no-hash", *extra)
        assert code == 0, err
        assert _mode(out) == 0o700 and (out / "native_experts.txt").is_file()


# --------------------------------------------------------------------------------- other programs' files
def test_file_written_during_the_publish_is_kept(tmp_path, monkeypatch):
    """A file another program writes into the folder after the build (between the last step and the publish)
    survives: the folder holds other files, so the output's files are renamed in one by one."""
    t = tmp_path / "live"
    t.mkdir()
    (t / "log-0.txt").write_text("0")
    (t / "a.txt").write_text("old")
    real = fsutil._fsync_tree

    def late(folder):
        real(folder)
        (t / "log-late.txt").write_text("late")

    monkeypatch.setattr(fsutil, "_fsync_tree", late)
    with publish_dir(t, keep=_keep) as stage:
        write_bytes_atomic(stage / "a.txt", b"new")
    assert (t / "log-late.txt").read_text() == "late" and (t / "log-0.txt").read_text() == "0"
    assert (t / "a.txt").read_text() == "new" and _leftovers(tmp_path) == []


def test_concurrent_writer_loses_nothing_and_report_json_comes_last(tmp_path):
    """A writer thread adds a file before each file is published (driven by the step hook, no sleeping); every
    one of its files is there afterwards, untouched; the previous report.json is removed first and the new one
    renamed in last, after a stale own file of the previous output is removed."""
    t = tmp_path / "live"
    t.mkdir()
    (t / "log-start.txt").write_text("s")
    (t / "b.txt").write_text("previous output's file the new one lacks")
    (t / "report.json").write_text("previous")
    go, done = threading.Event(), threading.Event()
    stop = []

    def writer():
        i = 0
        while True:
            go.wait()
            go.clear()
            if stop:
                return
            (t / f"log-{i}.txt").write_text(str(i))
            i += 1
            done.set()

    th = threading.Thread(target=writer)
    th.start()
    order, present = [], {}

    def step(name):
        order.append(name)
        present[name] = sorted(os.listdir(t))
        done.clear()
        go.set()
        assert done.wait(5)

    try:
        with publish_dir(t, keep=_keep, last=["report.json"], step=step) as stage:
            write_bytes_atomic(stage / "report.json", b"{}")
            write_bytes_atomic(stage / "a.txt", b"A")
    finally:
        stop.append(1)
        go.set()
        th.join()
    assert order == ["a.txt", "report.json"]
    # the previous marker went first (its absence says "incomplete"), the stale file before the new marker
    assert "report.json" not in present["a.txt"] and "b.txt" in present["a.txt"]
    assert "a.txt" in present["report.json"] and "b.txt" not in present["report.json"]
    assert (t / "report.json").read_text() == "{}"
    assert sorted(os.listdir(t)) == ["a.txt", "log-0.txt", "log-1.txt", "log-start.txt", "report.json"]
    assert [(t / f"log-{i}.txt").read_text() for i in range(2)] == ["0", "1"]
    assert _leftovers(tmp_path) == []


def test_simulate_force_into_a_folder_with_a_subfolder_keeps_it(kit, cli, tmp_path):
    """A report folder holding a subfolder: --force adds the report beside it (it used to fail after the whole
    run with "holds 'sub', which is not a regular file")."""
    d = tmp_path / "inp"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "x.txt").write_text("mine\n")
    code, _, err = cli(*_sim(kit, "--report", d))
    assert code == 2 and "not a report" in err and "--force" in err, err
    code, _, err = cli(*_sim(kit, "--report", d, "--force"))
    assert code == 0, err
    assert (d / "sub" / "x.txt").read_text() == "mine\n"
    assert json.loads((d / "report.json").read_text())["entries"] == 4320


def test_report_name_taken_by_a_folder_is_refused_before_the_work(kit, cli, tmp_path, monkeypatch):
    from stratatools.cli import sim_cmds

    def no_work(*a, **k):
        raise AssertionError("the simulation ran before the check")

    monkeypatch.setattr(sim_cmds, "run", no_work)
    d = tmp_path / "inp"
    (d / "report.json").mkdir(parents=True)
    for extra in ((), ("--force",)):
        code, _, err = cli(*_sim(kit, "--report", d, *extra))
        assert code == 2 and "report.json: is a folder" in err and "--force" not in err, err
    with pytest.raises(StrataError, match="is a folder"):
        with publish_dir(d, keep=lambda n: n != "report.json"):
            raise AssertionError("the build started")


# ---------------------------------------------------------------------------------------- empty paths
@pytest.mark.parametrize("cmd", ["simulate", "compare"])
def test_report_empty_path_is_refused(kit, cli, cmd):
    p = kit / "pruned"
    args = ["-t", p / "coder-revB.routing.csv", "--slots", "48"]
    args += ["--model", p / "coder-revB.gguf"] if cmd == "simulate" else \
        ["-p", p / "expected-profile-revA-remapped-to-revB.bin"]
    code, _, err = cli(cmd, *args, "--report", "")
    assert code == 2 and "--report '': the path is empty; give a folder" in err, err
    assert len(err.strip().splitlines()) == 1


def test_other_folder_outputs_refuse_an_empty_path(kit, cli):
    code, _, err = cli("pack", kit / "pruned/coder-revB.gguf", "-o", "")
    assert code == 2 and "the path is empty" in err, err
    code, _, err = cli("synth", "")
    assert code == 2 and "the path is empty" in err, err


# ---------------------------------------------------------------------------------- killed runs' leftovers
def _plant_leftovers(parent: Path, name: str, pid: int) -> tuple[Path, Path]:
    tmp = parent / f".{name}.{pid}-0badcafe.stratatools-tmp"
    tmp.mkdir()
    (tmp / "report.md").write_text("half\n")
    lock = parent / f".{name}.stratatools-lock"
    lock.write_text(json.dumps({"paths": [str(tmp)]}))
    return tmp, lock


def test_refused_run_cleans_a_killed_runs_leftovers(kit, cli, tmp_path):
    rep = tmp_path / "rep"
    code, _, err = cli(*_sim(kit, "--report", rep))
    assert code == 0, err
    tmp, lock = _plant_leftovers(tmp_path, "rep", _dead_pid())
    code, _, err = cli(*_sim(kit, "--report", rep))
    assert code == 2 and "already exists" in err, err
    assert not tmp.exists() and not lock.exists() and _leftovers(tmp_path) == []


def test_tidy_never_removes_a_live_writers_temp(tmp_path):
    t = tmp_path / "out"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = tmp_path / f".out.{live.pid}-0123abcd.stratatools-tmp"
        mine.mkdir()
        dead = tmp_path / f".out.{_dead_pid()}-0123abcd.stratatools-tmp"
        dead.mkdir()
        notes = fsutil.tidy_output(t)
        assert mine.is_dir() and not dead.exists() and len(notes) == 1
        # a live writer holding the lock: nothing is touched
        dead.mkdir()
        with fsutil.output_lock(t):
            assert fsutil.tidy_output(t) == [] and dead.is_dir()
    finally:
        live.kill()
        live.wait()


def test_compare_report_says_what_it_wrote(kit, cli, tmp_path):
    p = kit / "pruned"
    code, _, err = cli("compare", "-t", p / "coder-revB.routing.csv", "-p",
                       p / "expected-profile-revA-remapped-to-revB.bin", "--slots", "48", "--policy", "static",
                       "--report", tmp_path / "cmp")
    assert code == 0, err
    joined = "".join(err.split())  # (the console may wrap the line)
    assert joined.startswith("wrote") and str(tmp_path / "cmp" / "report.json") in joined, err


def test_publish_killed_midway_into_a_shared_folder_is_finished_by_the_next_run(tmp_path):
    """A SIGKILL-like exit in the middle of an in-place publish (the previous marker removed, one new file moved):
    the folder has no marker; the next writer's clean-up rolls the publish forward from the complete temp folder
    (journal in the lock file): the new output whole, the marker last, the stale file gone, other files untouched."""
    t = tmp_path / "shared"
    t.mkdir()
    (t / "notes.txt").write_text("mine")
    (t / "b.txt").write_text("previous output's file the new one lacks")
    (t / "a.txt").write_text("old A")
    (t / "report.json").write_text("previous")
    code = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from stratatools.core.fsutil import publish_dir, write_bytes_atomic
OWN = ("a.txt", "b.txt", "c.txt", "report.json")
def step(name):
    if name == "c.txt":
        os._exit(9)  # killed after a.txt was moved in, before c.txt and the marker
with publish_dir({str(t)!r}, keep=lambda n: n not in OWN, last=["report.json"], step=step) as stage:
    write_bytes_atomic(stage / "a.txt", b"new A")
    write_bytes_atomic(stage / "c.txt", b"new C")
    write_bytes_atomic(stage / "report.json", b"{{}}")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    assert not (t / "report.json").exists() and (t / "a.txt").read_text() == "new A"  # half done, no marker
    assert len(_leftovers(tmp_path)) == 2  # the complete temp folder and the lock with its journal
    notes = fsutil.tidy_output(t)
    assert any("finished publishing" in n for n in notes), notes
    assert sorted(os.listdir(t)) == ["a.txt", "c.txt", "notes.txt", "report.json"]
    assert [(t / n).read_text() for n in ("a.txt", "c.txt", "notes.txt", "report.json")] == ["new A", "new C", "mine",
                                                                                             "{}"]
    assert _leftovers(tmp_path) == []


def test_pack_and_synth_into_a_folder_of_other_files_need_force(kit, cli, tmp_path):
    """A folder that holds other files (a shared folder such as /tmp) is refused without --force by pack and
    synth, as by --report: one line naming a file there and both ways out; nothing is written. The model's own
    folder is not such a folder for pack (a pack is written beside its GGUF)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "someone-elses.txt").write_text("theirs")
    for argv in (("pack", kit / "pruned" / "coder-revB.gguf", "-o", shared), ("synth", shared, "--layers", "2")):
        code, _, err = cli(*argv)
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1, err
        assert "not a" in err and "someone-elses.txt" in err and "--force" in err, err
        assert sorted(os.listdir(shared)) == ["someone-elses.txt"]
    code, _, err = cli("synth", shared, "--layers", "2", "--force")
    assert code == 0, err
    assert (shared / "release.json").is_file() and (shared / "someone-elses.txt").read_text() == "theirs"


def test_symlinked_output_folder_is_named_as_a_link(kit, cli, tmp_path):
    """-o naming a symbolic link to a folder is refused (no write through the link) with a message that says it is
    a link and what to give instead, not "not a folder"."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "lnk"
    link.symlink_to(real)
    code, _, err = cli("pack", kit / "pruned" / "coder-revB.gguf", "-o", link, "--force")
    assert code == 2 and "symbolic link" in err and "own path" in err, err
    assert os.listdir(real) == []
