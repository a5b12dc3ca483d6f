"""Odd output paths and file names: a symlink loop given as an output, a parent that is a file, a model file name
that is not UTF-8. Each is one line with exit 2 (or, for reports naming such a file, valid UTF-8 text), never a
traceback."""

from __future__ import annotations

import os
import shutil
import sys
import xml.dom.minidom

import pytest


@pytest.fixture()
def model(kit, tmp_path):
    m = tmp_path / "a.gguf"
    shutil.copy(kit / "pruned" / "coder-revA.gguf", m)
    return m


def _one_line(code, err, *want):
    assert code == 2, err
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line, err
    for w in want:
        assert w in line, line


def test_symlink_loop_as_an_output_folder_or_report(cli, kit, model, tmp_path):
    # pathlib's resolve() raised RuntimeError('Symlink loop from ...') here: a 55-line traceback, exit 1
    loop = tmp_path / "loop1"
    os.symlink(tmp_path / "loop2", loop)
    os.symlink(loop, tmp_path / "loop2")
    for args in (["pack", model, "-o", loop], ["synth", loop], ["validate-release", "--model", model, "--junit", loop],
                 ["simulate", "-t", kit / "routing" / "llamacpp-ISTA-mix.routing.csv", "--model",
                  kit / "quant" / "model-ISTA-mix.gguf", "--slots", "10", "--report", loop]):
        code, _, err = cli(*args)
        _one_line(code, err, f"{loop}: symlink loop", "remove it or choose another path")
        assert os.path.islink(loop) and os.readlink(loop) == str(tmp_path / "loop2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "loop1", "loop2"]


def test_output_folder_under_a_file(cli, model, tmp_path):
    # was: "cannot create its lock file .pk.stratatools-lock: File exists"
    (tmp_path / "afile").write_text("x\n")
    for args in (["pack", model, "-o", tmp_path / "afile" / "pk"], ["synth", tmp_path / "afile" / "rel"]):
        code, _, err = cli(*args)
        _one_line(code, err, "a parent of this path is not a folder")
    assert (tmp_path / "afile").read_text() == "x\n"


@pytest.mark.skipif(sys.platform == "darwin", reason="the file system refuses names that are not UTF-8")
def test_model_file_name_not_utf8(cli, model, tmp_path):
    # was: UnicodeEncodeError ... surrogates not allowed, exit 1, in pack and in validate-release --junit
    bad = os.path.join(os.fsencode(tmp_path), b"bad\xffname.gguf")
    os.rename(os.fsencode(model), bad)
    name = os.fsdecode(bad)
    code, _, err = cli("pack", name, "-o", tmp_path / "pk")
    _one_line(code, err, "bad\\udcffname.gguf: the file name is not valid UTF-8", "rename the file")
    assert not (tmp_path / "pk").exists()
    code, _, err = cli("validate-release", "--model", name, "--junit", tmp_path / "j.xml", "--json-out",
                       tmp_path / "j.json", "--markdown", tmp_path / "j.md")
    assert code == 0, err
    for f in ("j.xml", "j.json", "j.md"):
        text = (tmp_path / f).read_bytes().decode("utf-8")  # valid UTF-8
        assert "bad\\udcffname.gguf" in text, f
    xml.dom.minidom.parse(str(tmp_path / "j.xml"))


def test_symlink_loop_with_a_quote_in_its_name(cli, model, tmp_path):
    # repr() puts such a path in double quotes: the first fix matched single quotes only
    loop = tmp_path / "it's"
    os.symlink(loop, loop)
    code, _, err = cli("pack", model, "-o", loop)
    _one_line(code, err, f"{loop}: symlink loop")
