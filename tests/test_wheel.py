"""The wheel works with no repository beside it.

Builds the wheel with this venv's pip, installs it with its dependencies into a fresh temp venv (pip's
local cache and configured indexes; skipped, with the reason, only when the package index cannot be
reached), and from a temp working directory, without the repository on ``sys.path``, runs every command's
``--help``, ``stratatools --version``, ``python -m stratatools --help``, ``validate-release`` on a kit release
(the packaged registry names the stale profile) and ``stratatools demo DIR``. One venv serves every check
(module-scoped fixture); 2.5 to 3.5 minutes on 2 busy cores, nearly all of it the install (about 60 s) and
the demo, whose first run compiles the numba kernels (80 to 110 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import kit_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _index_reachable(python: str, where: Path) -> bool:
    """Whether pip can get a distribution (typer, a dependency) from its configured indexes or cache."""
    r = subprocess.run([python, "-m", "pip", "download", "--no-deps", "-q", "-d", str(where), "typer"],
                       capture_output=True, text=True, timeout=180, cwd=where)
    return r.returncode == 0


def _pip(args: list[str], what: str, timeout: int, scratch: Path) -> None:
    """Run pip; when it fails, skip the module if the package index cannot be reached, else fail."""
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=scratch)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        probe = scratch / "probe"
        probe.mkdir(exist_ok=True)
        if not _index_reachable(args[0], probe):
            lines = (r.stdout + r.stderr).splitlines()
            said = next((ln.strip() for ln in lines if "ERROR" in ln or "Could not" in ln), tail[-200:])
            pytest.skip(f"{what}: the package index cannot be reached (pip download typer fails too); "
                        f"pip said: {said}")
        pytest.fail(f"{what} failed (exit {r.returncode}) although the package index answers:\n{tail}")


class Installed:
    """A temp venv with the wheel installed, and a clean environment to run it from a temp folder."""

    def __init__(self, venv: Path, cwd: Path, wheel: Path, env: dict[str, str]):
        self.venv, self.cwd, self.wheel, self.env = venv, cwd, wheel, env
        self.bin = venv / "bin"

    def run(self, *argv, timeout: int = 240) -> subprocess.CompletedProcess:
        """Run a program of the venv (``stratatools``, ``python``) with ``argv`` from the temp folder."""
        exe = str(self.bin / argv[0])
        return subprocess.run([exe, *map(str, argv[1:])], capture_output=True, text=True, cwd=self.cwd,
                              env=self.env, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    _pip([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(dist)],
         "building the wheel", 300, base)
    wheels = sorted(dist.glob("stratatools-*.whl"))
    assert len(wheels) == 1, wheels
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # --no-compile: byte-compiling pandas, numba & co. would double the install time; imports compile lazily.
    _pip([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", str(wheels[0])],
         "installing the wheel and its dependencies", 600, base)
    cwd = base / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "STRATATOOLS_REGISTRY", "STRATATOOLS_DEBUG")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["XDG_CACHE_HOME"] = str(base / "xdg-cache")
    env["COLUMNS"] = "200"
    return Installed(venv, cwd, wheels[0], env)


def test_wheel_carries_the_data_and_the_registry(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    want = {"stratatools/allocations/releases.toml", "stratatools/data/demo/train.txt",
            "stratatools/data/demo/eval.txt", "stratatools/cli/__init__.py", "stratatools/__main__.py"}
    want |= {f"stratatools/{p.relative_to(ROOT / 'stratatools')}"
             for p in (ROOT / "stratatools" / "runtime" / "gpu").glob("*.cu*")}  # CUDA sources, once they exist
    assert want <= names, sorted(want - names)
    assert not any("__pycache__" in n or n.startswith(("tests/", "bench/")) for n in names)


def test_installed_package_is_imported_not_the_repository(installed):
    r = installed.run("python", "-c", "import stratatools, sys; from stratatools.core.resources import packaged; "
                      "print(stratatools.__file__); print(packaged('allocations', 'releases.toml')); "
                      "print(any(p and __import__('os').path.samefile(p, sys.argv[1]) for p in sys.path "
                      "if __import__('os').path.isdir(p)))", ROOT)
    assert r.returncode == 0, r.stderr
    mod, registry, repo_on_path = r.stdout.split()
    assert Path(mod).is_relative_to(installed.venv), mod
    assert Path(registry).is_relative_to(installed.venv) and Path(registry).is_file(), registry
    assert repo_on_path == "False"


def test_version_and_python_dash_m(installed):
    from stratatools.core.version import __version__

    r = installed.run("stratatools", "--version")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"stratatools {__version__}\n", "")
    r = installed.run("python", "-m", "stratatools", "--help")
    assert r.returncode == 0, r.stderr
    for cmd in ("inspect", "pack", "validate-release", "demo", "simulate"):
        assert cmd in r.stdout


def test_every_command_has_help(installed):
    """Every command's ``--help`` through the installed package's entry function, in one process (19 process
    starts would cost a minute; the ``stratatools`` script itself is exercised by the other tests)."""
    script = """
import contextlib, io, json, typer.main
from stratatools.cli import app, main
paths = []
def walk(c, p):
    if hasattr(c, "commands"):
        for n, s in c.commands.items():
            walk(s, p + [n])
    else:
        paths.append(p)
walk(typer.main.get_command(app), [])
res = []
for p in paths:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            main(p + ["--help"])
            code = 0
        except SystemExit as e:
            code = e.code or 0
    res.append([p, code, buf.getvalue()])
print(json.dumps(res))
"""
    r = installed.run("python", "-c", script)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    from test_cli_options import COMMANDS

    # The installed package has the repository's commands, and each one prints its usage.
    assert sorted(tuple(p) for p, _, _ in res) == sorted(tuple(p) for p, _ in COMMANDS)
    for path, code, text in res:
        assert code == 0 and "Usage: stratatools " + " ".join(path) in text, (path, code, text[-500:])


def test_validate_release_recognises_a_kit_release(installed):
    kit = kit_dir()
    if kit is None:
        pytest.skip("../shared/kit is absent (set STRATATOOLS_KIT to its folder)")
    p = kit / "pruned"
    r = installed.run("stratatools", "validate-release", "--model", p / "coder-revB.gguf",
                      "--profile", p / "profile-revA.bin", "--json")
    assert r.returncode == 1, r.stderr
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    stale = checks["profile-stale"]
    # Only the packaged registry can say which release the profile was built for.
    assert stale["status"] == "fail" and "kit-coder@revA" in stale["reason"] and "kit-coder@revB" in stale["reason"]


def test_demo_runs_from_the_wheel(installed):
    out = installed.cwd / "demo"
    r = installed.run("stratatools", "--quiet", "demo", out, "--json", timeout=400)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    res = json.loads(r.stdout)
    assert res["ok"] is True and len(res["steps"]) == 16
    assert [s["exit_code"] for s in res["steps"]] == [s["expected"] for s in res["steps"]]
    assert (out / "index.md").is_file() and (out / "prompts" / "train.txt").read_text(encoding="utf-8").count("\n") == 6
