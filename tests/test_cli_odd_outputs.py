"""Odd folder outputs (``pack -o /``, ``-o ..``, a mount point, ``.``, a foreign folder, a file): each refusal
gives its true reason (``-o /`` was refused as "would replace the input", and without --force suggested --force),
before any work and without writing anything."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _one(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture()
def model(kit) -> Path:
    return kit / "pruned" / "coder-revB.gguf"


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_pack_into_the_root_says_root(cli, model, force):
    code, out, err = cli("pack", model, "-o", "/", *force)
    msg = _one(err)
    assert code == 2 and "the file system's root" in msg, msg
    assert "replace the input" not in msg and "--force" not in msg, msg
    assert "-o /packs/mymodel" in msg, msg


def test_pack_into_a_mount_point_says_mount_point(cli, model):
    mnt = next((m for m in ("/proc", "/sys", "/dev") if os.path.ismount(m)), None)
    if mnt is None:
        pytest.skip("no mount point to try")
    code, out, err = cli("pack", model, "-o", mnt)  # without --force: nothing would be written either way
    msg = _one(err)
    assert code == 2 and f"{mnt}: a mount point" in msg and "--force" not in msg, msg
    assert f"-o {mnt}/mymodel" in msg, msg


@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("raw", ["..", "../..", "x/.."])
def test_pack_into_dotdot_says_dotdot(cli, model, tmp_path, monkeypatch, force, raw):
    cwd = tmp_path / "a" / "b"
    (cwd / "x").mkdir(parents=True)
    monkeypatch.chdir(cwd)
    code, out, err = cli("pack", model, "-o", raw, *force)
    msg = _one(err)
    real = os.path.realpath(raw)
    assert code == 2 and f"-o {raw}: ends in '..'" in msg and f"e.g. -o {real}" in msg, msg
    assert "current folder" not in msg or raw == "x/..", msg
    assert sorted(os.listdir(tmp_path)) == ["a"] and sorted(os.listdir(tmp_path / "a")) == ["b"]
    assert sorted(os.listdir(cwd)) == ["x"]


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_pack_into_the_current_folder_says_current_folder(cli, model, tmp_path, monkeypatch, force):
    monkeypatch.chdir(tmp_path)
    for raw in (".", "./", str(tmp_path)):
        code, out, err = cli("pack", model, "-o", raw, *force)
        msg = _one(err)
        assert code == 2 and "not the current folder" in msg, msg
    assert os.listdir(tmp_path) == []


def test_pack_into_a_foreign_folder_or_a_file(cli, model, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    code, out, err = cli("pack", model, "-o", other)
    msg = _one(err)
    assert code == 2 and "an existing folder that is not a pack (it holds notes.txt)" in msg, msg
    f = tmp_path / "afile"
    f.write_text("x\n")
    for force in ([], ["--force"]):
        code, out, err = cli("pack", model, "-o", f, *force)
        msg = _one(err)
        assert code == 2 and f"{f}: exists and is not a folder" in msg, msg
    code, out, err = cli("pack", model, "-o", f / "sub")
    msg = _one(err)
    assert code == 2 and str(f) in msg and "not a folder" in msg and "Traceback" not in err, msg
    assert f.read_text() == "x\n" and sorted(os.listdir(other)) == ["notes.txt"]


def test_synth_and_demo_outputs_take_the_same_checks(cli):
    code, out, err = cli("synth", "/")
    msg = _one(err)
    assert code == 2 and "OUTDIR /: the file system's root" in msg, msg


def test_simulate_report_folder_takes_the_same_checks(cli, kit, tmp_path, monkeypatch):
    t = kit / "pruned" / "coder-revB.routing.csv"
    code, out, err = cli("simulate", "-t", t, "--slots", 8, "--report", "/")
    msg = _one(err)
    assert code == 2 and "--report /: the file system's root" in msg and "--report /sim-report" in msg, msg
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    code, out, err = cli("simulate", "-t", t, "--slots", 8, "--report", "..", "--force")
    msg = _one(err)
    assert code == 2 and "--report ..: ends in '..'" in msg, msg
    assert os.listdir(tmp_path) == ["a"] and os.listdir(tmp_path / "a") == []


def test_pack_under_a_broken_link_says_so(cli, model, tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for parent in (loop, tmp_path / "gone"):
        code, out, err = cli("pack", model, "-o", parent / "sub")
        msg = _one(err)
        assert code == 2 and f"{parent} is a symbolic link that leads to no folder" in msg, msg
    assert sorted(os.listdir(tmp_path)) == ["gone", "loop"]
