"""The package layout: no import circle among stratatools' modules, package dependencies that follow the
direction each package's ``__init__`` docstring states ("May import: ..."), and a pyproject ``packages`` list
that names every package folder.

Imports are read with :mod:`ast` (module level and inside functions, ``TYPE_CHECKING`` blocks included), so
the test needs none of the optional dependencies. ``from pkg import name`` depends on ``pkg.name`` when that
is a module, else on ``pkg``; a relative import is resolved against the importing module.

The direction (docs/architecture.md), lowest first; a package may import packages of its own level or below
when its docstring says so, never one above:

    core <- model <- pack/alloc <- traces/profiles <- cachesim <- release/synth/runtime <- demo <- cli
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "stratatools"

# Level of every top-level package of stratatools (the chain above). The root module ``stratatools``
# (``__init__``) sits on core's level: it re-exports the version and the error type only.
LEVELS = {
    "core": 0,
    "model": 1,
    "pack": 2, "alloc": 2,
    "traces": 3, "profiles": 3,
    "cachesim": 4,
    "release": 5, "synth": 5, "runtime": 5,
    "demo": 6,
    "cli": 7,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    """Every module of stratatools: dotted name -> file."""
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(name: str) -> str | None:
    """The stratatools module that an imported dotted name lands on (the longest existing prefix)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in MODULES:
            return cand
        parts.pop()
    return None


def _imports(mod: str, path: Path) -> set[str]:
    """Stratatools modules that ``mod`` imports, anywhere in its file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here_pkg = mod if _is_package(mod) else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here_pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                pkg = ".".join(base + ([node.module] if node.module else []))
            else:
                pkg = node.module or ""
            targets = []
            for a in node.names:
                sub = f"{pkg}.{a.name}"
                targets.append(sub if sub in MODULES else pkg)
        else:
            continue
        for t in targets:
            if t == "stratatools" or t.startswith("stratatools."):
                r = _resolve(t)
                if r is not None and r != mod:
                    out.add(r)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _package_of(mod: str) -> str:
    """Top-level package of a module (``stratatools.runtime.gpu.tier`` -> ``runtime``); the root module and
    ``__main__`` map to ``""`` and ``"__main__"``."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def _allowed_from_docstring(pkg: str) -> set[str]:
    """Packages named on the ``May import:`` line(s) of ``stratatools/<pkg>/__init__.py``."""
    doc = ast.get_docstring(ast.parse((PKG / pkg / "__init__.py").read_text(encoding="utf-8"))) or ""
    m = re.search(r"May import:(.*?)(?:\n\s*\n|\Z)", doc, re.S)
    assert m, f"stratatools/{pkg}/__init__.py: the docstring has no 'May import: ...' paragraph"
    text = m.group(1)
    if re.match(r"\s*nothing", text, re.I):
        return set()
    names = set(re.findall(r":mod:`stratatools\.(\w+)", text))
    unknown = names - set(LEVELS)
    assert not unknown, f"stratatools/{pkg}/__init__.py names unknown packages {sorted(unknown)}"
    return names


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {n: WHITE for n in graph}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = GREY
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if color.get(d, BLACK) == GREY:
                return stack[stack.index(d):] + [d]
            if color.get(d) == WHITE:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        color[n] = BLACK
        return None

    for n in sorted(graph):
        if color[n] == WHITE:
            found = visit(n)
            if found:
                return found
    return None


def test_walker_sees_the_layout():
    # The walk covers every package and reads function-level and relative imports.
    assert set(LEVELS) == {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert len(MODULES) > 60
    assert "stratatools.core.errors" in GRAPH["stratatools.traces.formats.strata"]
    assert "stratatools.cli" in GRAPH["stratatools.__main__"]
    # ``from stratatools.cli import common`` depends on the module cli.common, not only on the package.
    assert "stratatools.cli.common" in GRAPH["stratatools.cli"]


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_among_modules():
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_import_circle_among_packages():
    pkgs: dict[str, set[str]] = {p: set() for p in LEVELS}
    for mod, deps in GRAPH.items():
        src = _package_of(mod)
        if src in LEVELS:
            pkgs[src] |= {_package_of(d) for d in deps if _package_of(d) in LEVELS and _package_of(d) != src}
    cycle = _find_cycle(pkgs)
    assert cycle is None, "package circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("pkg", sorted(LEVELS))
def test_docstring_direction_follows_the_chain(pkg):
    allowed = _allowed_from_docstring(pkg)
    assert pkg not in allowed
    upward = sorted(a for a in allowed if LEVELS[a] > LEVELS[pkg])
    assert not upward, f"stratatools/{pkg}/__init__.py allows importing higher packages {upward}"


@pytest.mark.parametrize("pkg", sorted(LEVELS))
def test_package_imports_follow_its_docstring(pkg):
    allowed = _allowed_from_docstring(pkg) | {pkg}
    bad = sorted(
        f"{mod} -> {dep}"
        for mod, deps in GRAPH.items() if _package_of(mod) == pkg
        for dep in deps if _package_of(dep) not in allowed
    )
    assert not bad, f"imports that stratatools/{pkg}/__init__.py does not allow: {bad}"


def test_root_module_imports_only_core():
    assert {_package_of(d) for d in GRAPH["stratatools"]} <= {"core"}
    assert GRAPH["stratatools.__main__"] == {"stratatools.cli"}


def test_pyproject_lists_every_package():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(conf["tool"]["setuptools"]["packages"])
    folders = {_module_name(p.parent / "__init__.py") for p in PKG.rglob("__init__.py")}
    assert listed == folders | {"stratatools.data", "stratatools.allocations"}
    dirs = conf["tool"]["setuptools"]["package-dir"]
    assert dirs == {"stratatools.data": "data", "stratatools.allocations": "allocations"}
    # Every folder of Python code under stratatools/ is a package (a forgotten __init__.py would silently
    # leave its modules out of the wheel).
    code_dirs = {p.parent for p in PKG.rglob("*.py")}
    assert all((d / "__init__.py").exists() for d in code_dirs)


def test_package_data_ships_every_data_file():
    """Every file under data/ and allocations/ matches a package-data pattern (the wheel test checks the
    built wheel; this catches a forgotten pattern without building one)."""
    import glob

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    pkg_data = conf["tool"]["setuptools"]["package-data"]
    for pkg, folder in (("stratatools.data", "data"), ("stratatools.allocations", "allocations")):
        root = ROOT / folder
        shipped = {m for pat in pkg_data[pkg] for m in glob.glob(pat, root_dir=root, recursive=True)}
        files = {str(p.relative_to(root)) for p in root.rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc" and p.name != "__init__.py"}
        assert files <= shipped, (folder, sorted(files - shipped))
    assert {"demo/train.txt", "demo/eval.txt"} <= {str(p.relative_to(ROOT / "data")) for p in (ROOT / "data").rglob("*.txt")}
