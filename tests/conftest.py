"""Shared fixtures: the kit folder (../shared/kit beside the checkout), temp dirs, CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Keep the digest cache ($XDG_CACHE_HOME/stratatools) of the test run out of the user's home."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


def kit_dir() -> Path | None:
    """The kit of real llama.cpp-made files, or None. STRATATOOLS_KIT overrides ../shared/kit."""
    env = os.environ.get("STRATATOOLS_KIT")
    cands = [Path(env)] if env else []
    cands += [ROOT.parent / "shared" / "kit", ROOT / "shared" / "kit"]
    for c in cands:
        if (c / "README.md").exists():
            return c
    return None


@pytest.fixture(scope="session")
def kit() -> Path:
    """Path of ../shared/kit; skips the test when the kit is absent."""
    k = kit_dir()
    if k is None:
        pytest.skip("../shared/kit is absent (set STRATATOOLS_KIT to its folder)")
    return k


@pytest.fixture()
def cli(tmp_path, monkeypatch):
    """Run the stratatools CLI in-process: cli(*args) -> (exit_code, stdout, stderr)."""
    import io

    from stratatools.cli import run_captured

    def run(*args):  # (paths and numbers are passed as their text)
        out, err = io.StringIO(), io.StringIO()
        code = run_captured([str(a) for a in args], out, err)
        return code, out.getvalue(), err.getvalue()

    return run


@pytest.fixture(scope="session")
def kit_prompts(kit) -> list[tuple[str, list[int]]]:
    """The kit's prompts (routing/tokens.tsv) as (prompt id, token ids), in file order; skips without the kit."""
    out = []
    for line in (kit / "routing" / "tokens.tsv").read_text().splitlines():
        if line.strip():
            pid, ids = line.split("\t")
            out.append((pid, [int(x) for x in ids.split()]))
    return out
