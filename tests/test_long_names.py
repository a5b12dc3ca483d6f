"""Output names up to the file system's limit (NAME_MAX, 255 bytes on the usual ones): the temp, aside and lock
names derived from them (``.<name>.<pid>-<hex>.stratatools-tmp``, ``.stratatools-old``, ``.stratatools-lock``)
add up to ~40 bytes and failed with the OS's "File name too long"; the name part is now shortened (its first
bytes, ``~`` and 16 hex of its sha256) where needed, the clean-up of dead writers' leftovers still finds them and
never removes a live writer's, and a name the OS itself refuses is one line naming the file and the limit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stratatools.core import fsutil
from stratatools.core.errors import StrataError
from stratatools.core.fsutil import publish_dir, write_bytes_atomic


def _nm(p: Path) -> int:
    return os.pathconf(p, "PC_NAME_MAX")


def _leftovers(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if "stratatools-" in n)


def _dead_pid() -> int:
    pr = subprocess.Popen([sys.executable, "-c", "pass"])
    pr.wait()
    return pr.pid


def _names(tmp_path: Path) -> list[str]:
    nm = _nm(tmp_path)
    return ["n" * nm, "é" * (nm // 2), "n" * (nm - 20), "x" * (nm - 40) + ".json"]


def test_file_outputs_with_names_the_os_accepts(tmp_path):
    for name in _names(tmp_path):
        assert len(os.fsencode(name)) <= _nm(tmp_path)
        write_bytes_atomic(tmp_path / name, b"one\n")
        write_bytes_atomic(tmp_path / name, b"two\n")  # replacing it takes the same path
        assert (tmp_path / name).read_bytes() == b"two\n"
        fsutil.probe_writable(tmp_path / name)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False])
def test_folder_outputs_with_names_the_os_accepts(tmp_path, monkeypatch, exchange):
    if not exchange:  # the swap through an aside folder (.stratatools-old), as without renameat2
        monkeypatch.setattr(fsutil, "_renameat2_exchange", lambda a, b: False)
    for name in _names(tmp_path):
        t = tmp_path / name
        for text in ("old\n", "new\n"):
            with publish_dir(t) as stage:
                write_bytes_atomic(stage / "a.txt", text.encode())
            assert (t / "a.txt").read_text() == text
        (t / "theirs.txt").write_text("keep\n")  # an in-place publish among other files
        with publish_dir(t, keep=lambda n: n != "a.txt") as stage:
            write_bytes_atomic(stage / "a.txt", b"third\n")
        assert (t / "a.txt").read_text() == "third\n" and (t / "theirs.txt").read_text() == "keep\n"
    assert _leftovers(tmp_path) == []


def test_short_names_derive_as_before(tmp_path):
    assert re.fullmatch(r"\.out\.json\.\d+-[0-9a-f]{8}\.stratatools-tmp",
                        fsutil._unique(tmp_path, "out.json").name)
    assert fsutil.lock_path(tmp_path / "out").name == ".out.stratatools-lock"


def test_derived_names_fit_and_are_recognisable(tmp_path):
    nm = _nm(tmp_path)
    long = "n" * nm
    tmp = fsutil._unique(tmp_path, long).name
    aside = fsutil._unique(tmp_path, long, fsutil._ASIDE_TAG).name
    lock = fsutil.lock_path(tmp_path / long).name
    for n in (tmp, aside, lock):
        assert len(os.fsencode(n)) <= nm - 3, n  # room for a pid of 10 digits
    stem = lock[1:-len(fsutil._LOCK_SUFFIX)]
    assert tmp.startswith(f".{stem}.") and aside.startswith(f".{stem}.")
    assert re.fullmatch(r"n+~[0-9a-f]{16}", stem) and len(stem) > 150, stem  # recognisable: its first bytes
    # another long name with the same first bytes gets another stem
    other = fsutil.lock_path(tmp_path / ("n" * (nm - 1) + "m")).name
    assert other != lock and other[:150] == lock[:150]
    # a name of multi-byte characters is cut on a character boundary
    u = fsutil.lock_path(tmp_path / ("é" * (nm // 2))).name
    assert u.encode("utf-8").decode("utf-8") == u and "\udcc3" not in u


def test_sweeps_find_dead_writers_long_temps_and_keep_live_ones(tmp_path):
    nm = _nm(tmp_path)
    long = "n" * nm
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def temp_of(pid: int) -> Path:
            n = fsutil._unique(tmp_path, long).name
            return tmp_path / re.sub(r"\.\d+-([0-9a-f]{8})\.stratatools-tmp$", rf".{pid}-\1.stratatools-tmp", n)

        # file temps: create_temp's sweep
        dead_f, live_f = temp_of(_dead_pid()), temp_of(live.pid)
        dead_f.write_bytes(b"half"), live_f.write_bytes(b"writing")
        write_bytes_atomic(tmp_path / long, b"x")
        assert not dead_f.exists() and live_f.exists()
        live_f.unlink()
        # folder temps: tidy_output and publish_dir's sweep
        dead_d, live_d = temp_of(_dead_pid()), temp_of(live.pid)
        dead_d.mkdir(), live_d.mkdir()
        (tmp_path / long).unlink()
        notes = fsutil.tidy_output(tmp_path / long)
        assert not dead_d.exists() and live_d.is_dir() and len(notes) == 1, notes
        dead_d.mkdir()
        with publish_dir(tmp_path / long) as stage:
            (stage / "a").write_text("1")
        assert not dead_d.exists() and live_d.is_dir()
        # aside folders (a previous output moved aside) of a dead run that no journal names: swept by the next
        # publish (the previous output's own file removed); a live run's is kept
        def aside_of(pid: int) -> Path:
            n = fsutil._unique(tmp_path, long, fsutil._ASIDE_TAG).name
            return tmp_path / re.sub(r"\.\d+-([0-9a-f]{8})\.stratatools-old$", rf".{pid}-\1.stratatools-old", n)

        dead_a, live_a = aside_of(_dead_pid()), aside_of(live.pid)
        for a in (dead_a, live_a):
            a.mkdir()
            (a / "a").write_text("old")
        assert fsutil._dead_asides(tmp_path / long) == [dead_a]
        with publish_dir(tmp_path / long) as stage:
            (stage / "a").write_text("2")
        assert not dead_a.exists() and live_a.is_dir() and (tmp_path / long / "a").read_text() == "2"
    finally:
        live.kill()
        live.wait()


def test_a_name_the_os_refuses_is_one_line(tmp_path, cli):
    nm = _nm(tmp_path)
    t = tmp_path / ("n" * (nm + 1))
    with pytest.raises(StrataError) as e:
        write_bytes_atomic(t, b"x")
    msg = str(e.value)
    assert msg.startswith(str(t)) and "File name too long (choose a shorter name or path)" in msg, msg
    with pytest.raises(StrataError) as e:
        with publish_dir(t):
            pass
    msg = str(e.value)
    assert msg.startswith(str(t)) and f"{nm + 1} bytes" in msg and f"at most {nm} bytes" in msg, msg
    assert msg.endswith("choose a shorter name"), msg
    assert os.listdir(tmp_path) == []


def test_cli_long_names(kit, cli, tmp_path):
    nm = _nm(tmp_path)
    m = kit / "pruned" / "coder-revB.gguf"
    code, out, err = cli("pack", m, "-o", tmp_path / ("p" * nm))
    assert code == 0, err
    assert (tmp_path / ("p" * nm) / "native_experts.txt").is_file()
    code, out, err = cli("pack", m, "-o", tmp_path / ("q" * (nm + 1)))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "shorter name" in err, err
    t = kit / "pruned" / "coder-revB.routing.csv"
    prof = tmp_path / ("s" * (nm - 10) + ".strp")  # its provenance sidecar (+ .json) fits too
    code, out, err = cli("make-profile", t, "-o", prof, "--model", m)
    assert code == 0 and prof.is_file() and Path(f"{prof}.json").is_file(), err
    code, out, err = cli("make-profile", t, "-o", tmp_path / ("s" * (nm + 1)), "--model", m)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "shorter name" in err, err
    assert _leftovers(tmp_path) == []
