"""The command line's shared conventions: ``--version``, ``python -m stratatools``, ``--json`` as a switch
that prints JSON to stdout, report files as ``--json-out`` / ``--junit`` / ``--markdown``, and help texts that
name documentation sections by title."""

from __future__ import annotations

import re
import subprocess
import sys

import stratatools
from stratatools.core.version import __version__


def test_version_prints_name_and_version(cli):
    code, out, err = cli("--version")
    assert (code, out, err) == (0, f"stratatools {__version__}\n", "")
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    assert stratatools.__version__ == __version__


def test_python_dash_m_runs_the_same_command():
    r = subprocess.run([sys.executable, "-m", "stratatools", "--version"], capture_output=True, text=True,
                       timeout=120)
    assert (r.returncode, r.stdout) == (0, f"stratatools {__version__}\n")
