"""What the commands print (issue 14): JUnit valid against both schemas, GitHub annotations, user text never
read as rich markup or emoji, a broken pipe ends quietly."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from lxml import etree

from stratatools.release.checks import FAIL, PASS, SKIP, Check, CheckSuite

FIX = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def schemas():
    return {n: etree.XMLSchema(etree.parse(str(FIX / f))) for n, f in
            (("jenkins", "junit-jenkins-10.xsd"), ("ant", "junit-ant.xsd"))}


def _suite(name="rel [x] & <y>") -> CheckSuite:
    s = CheckSuite(name, subject={"model": "/m/a,b:c.gguf"})
    s.add(Check("shards", "shards", PASS, "3 shards ok", time_s=0.01))
    s.add(Check("profile-stale", "profile", FAIL, "stale: [/] 50% <bad> & \"q\"\nsecond line", time_s=0.2))
    s.add(Check("pack", "pack", SKIP, "no pack given (--pack)"))
    return s


def test_schemas_reject_what_the_old_writer_wrote(schemas):
    """The fixtures are real gates: the former output (skipped on <testsuites>, no hostname/timestamp) fails."""
    old = ('<testsuites name="s" tests="1" failures="0" errors="0" skipped="0"><testsuite name="x" tests="1">'
           '<testcase name="a" classname="c" time="0.1"><system-out>ok</system-out></testcase></testsuite>'
           '</testsuites>')
    doc = etree.fromstring(old.encode())
    assert not schemas["jenkins"].validate(doc)
    assert "skipped" in str(schemas["jenkins"].error_log)
    assert not schemas["ant"].validate(doc)


@pytest.mark.parametrize("suite", [_suite(), CheckSuite("empty"), _suite("")])
def test_junit_is_valid_against_jenkins_and_ant(schemas, suite):
    import junitparser

    text = suite.to_junit()
    doc = etree.fromstring(text.encode("utf-8"))
    for name, xsd in schemas.items():
        assert xsd.validate(doc), f"{name}: {xsd.error_log}"
    xml = junitparser.JUnitXml.fromstring(text.encode("utf-8"))
    cases = {c.name: c for s in xml for c in s}
    assert set(cases) == {c.name for c in suite.checks}
    if "profile-stale" in cases:
        assert any(isinstance(r, junitparser.Failure) for r in cases["profile-stale"].result)
        assert any(isinstance(r, junitparser.Skipped) for r in cases["pack"].result)
        assert cases["shards"].is_passed


def test_github_annotations():
    out = _suite().to_github().splitlines()
    assert out[0] == ("::error file=/m/a%2Cb%3Ac.gguf,title=validate-release profile-stale::stale: [/] 50%25 "
                      "<bad> & \"q\"%0Asecond line")
    assert out[1] == "::notice file=/m/a%2Cb%3Ac.gguf,title=validate-release pack::no pack given (--pack)"
    assert out[2].startswith("::notice title=validate-release::") and out[2].endswith("1 passed, 1 failed, 1 skipped")


def test_cli_junit_and_github(cli, tmp_path, schemas):
    from tests.test_safety_write import TINY
    from stratatools.synth.model import synth_release

    rel = synth_release(tmp_path / "rel", TINY)
    junit = tmp_path / "r.xml"
    code, out, err = cli("validate-release", "--model", rel.revB.path, "--alloc", rel.revA.allocation,
                         "--junit", junit, "--github")
    assert code == 0, err
    lines = out.splitlines()
    assert any(ln.startswith(f"::notice file={rel.revB.path},title=validate-release pack::") for ln in lines), out
    assert lines[-1].startswith("::notice title=validate-release::") and " 0 failed" in lines[-1]
    assert all(ln.startswith("::") for ln in lines)
    doc = etree.parse(str(junit))
    for name, xsd in schemas.items():
        assert xsd.validate(doc), f"{name}: {xsd.error_log}"


def test_user_text_is_never_markup(cli, tmp_path):
    """A file name with [/] (was a MarkupError traceback), [shard] (was eaten) and :-1: (was an emoji)."""
    from tests.test_safety_write import TINY
    from stratatools.synth.model import synth_release

    rel = synth_release(tmp_path / "rel", TINY)
    (tmp_path / "odd [").mkdir()
    odd = tmp_path / "odd [" / "] [shard] :-1:.gguf"  # the path reads ".../odd [/] [shard] :-1:.gguf"
    shutil.copyfile(rel.revA.path, odd)
    code, out, err = cli("inspect", odd)
    assert code == 0, err
    assert "] [shard] :-1:.gguf" in out and "👎" not in out
    code, out, err = cli("validate-release", "--model", odd, "--alloc", rel.revA.allocation)
    assert code in (0, 1) and "Traceback" not in out + err, err
    assert "[shard]" in out and "👎" not in out
    (tmp_path / "b [bold]x[").mkdir()
    bad = tmp_path / "b [bold]x[" / "].gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 4)
    code, out, err = cli("inspect", bad)
    assert code == 2 and str(bad) in err and len(err.strip().splitlines()) == 1


def test_broken_pipe_is_quiet(tmp_path):
    """stdout closed by the reader (| head): no message, the status of a SIGPIPE like cat or grep."""
    env = dict(os.environ, PYTHONUNBUFFERED="0")
    p = subprocess.Popen([sys.executable, "-c", "from stratatools.cli import main; main()", "--help"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()
    err = p.stderr.read()
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGPIPE, (p.returncode, err)
    assert err == b""
