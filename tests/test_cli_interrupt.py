"""Ctrl-C while ``python -m stratatools`` is still importing its modules: a quiet exit 130, never a traceback.

Deterministic: a ``sitecustomize`` on PYTHONPATH installs an import hook that sends the process SIGINT at the
moment a chosen module starts to import (the handler then runs inside that import, as a key press in the first
tenth of a second would)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

_HOOK = '''
import os, signal, sys

class _SigintAt:
    """Send SIGINT to this process the first time module NAME is looked up."""
    fired = False

    def find_spec(self, name, path=None, target=None):
        if name == os.environ["SIGINT_AT_IMPORT"] and not _SigintAt.fired:
            _SigintAt.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, _SigintAt())
'''


def _sigint_default() -> None:
    """In the child before exec: SIGINT to its default, so that Python installs its own handler at start-up. A test
    run started in the background by a shell without job control inherits SIGINT ignored, and a program started that
    way rightly ignores Ctrl-C (these tests then saw exit 0 and no handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(tmp_path: Path, module: str, argv: list[str]) -> subprocess.CompletedProcess:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_HOOK, encoding="utf-8")
    env = dict(os.environ, SIGINT_AT_IMPORT=module,
               PYTHONPATH=os.pathsep.join([str(hook)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("STRATATOOLS_DEBUG", None)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=120,
                          preexec_fn=_sigint_default)


@pytest.mark.parametrize("module", ["stratatools.core.errors", "typer", "stratatools.cli.sim_cmds"])
def test_sigint_during_imports_is_quiet_130(tmp_path, module):
    r = _run(tmp_path, module, ["-m", "stratatools", "--version"])
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) <= 1, r.stderr
    assert r.stdout == ""


def test_sigint_during_imports_console_script(tmp_path):
    """The ``stratatools`` command (pyproject's entry point) takes the same path."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    target = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]["stratatools"]
    mod, _, func = target.partition(":")
    r = _run(tmp_path, "typer", ["-c", f"import sys; from {mod} import {func}; sys.exit({func}())", "--version"])
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) <= 1, r.stderr


def test_sigint_hook_really_fires(tmp_path):
    """The hook does deliver the signal: without it the command prints its version; a module that is never
    imported leaves the run alone."""
    r = _run(tmp_path, "no_such_module_xyz", ["-m", "stratatools", "--version"])
    assert r.returncode == 0 and r.stdout.startswith("stratatools "), (r.returncode, r.stderr[-2000:])


def test_importing_the_package_leaves_sigint_alone():
    """A program that imports stratatools (not ``python -m stratatools``) keeps Python's Ctrl-C handling."""
    code = ("import signal, stratatools, stratatools.__main__, stratatools.cli; "
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       preexec_fn=_sigint_default)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
