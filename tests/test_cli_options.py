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


def _commands():
    """Every leaf command of the app as (argv prefix, click command)."""
    import typer.main

    from stratatools.cli import app

    out = []

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, path + [name])
        else:
            out.append((path, cmd))

    walk(typer.main.get_command(app), [])
    return out


COMMANDS = _commands()
# Options that write a report FILE must be named --json-out, --junit or --markdown. Everything else that
# writes is an output of the command itself (a pack, a profile, a trace, a folder).
REPORT_FILE_OPTIONS = {"--json-out", "--junit", "--markdown"}
# Folder outputs (report.md, report.json and plots) keep their name.
FOLDER_OPTIONS = {("simulate", "--report"), ("compare", "--report")}


def test_every_command_is_walked():
    names = {" ".join(p) for p, _ in COMMANDS}
    assert names >= {"inspect", "pack", "synth", "remap-profile", "profile-diff", "make-profile", "simulate",
                     "compare", "run", "validate-release", "demo", "profile show", "alloc show", "alloc check",
                     "alloc export", "alloc verify", "trace convert", "trace stats"}


def test_json_is_a_switch_everywhere():
    for path, cmd in COMMANDS:
        opts = {o: p for p in cmd.params if p.param_type_name == "option" for o in p.opts}
        assert "--json" in opts, f"{' '.join(path)} has no --json"
        assert opts["--json"].is_flag, f"{' '.join(path)}: --json takes a value; it must be a switch"
        for name in opts:
            if name in ("--report", "--json-file", "--json-report", "--md", "--xml"):
                assert (path[-1], name) in FOLDER_OPTIONS, f"{' '.join(path)} {name}: use {REPORT_FILE_OPTIONS}"


def test_help_texts_name_sections_by_title(cli):
    """No help text says 'section 4' or '§3' of a document: docs/formats.md has titled sections only."""
    bad = re.compile(r"§\s*\d|(formats|cache-model|cache-policy|design)\.md,?\s*(sections?\s*)?\d|"
                     r"\bsections?\s+\d+\s+of\b", re.I)
    texts = {"(root)": cli("--help")[1]}
    for path, _ in COMMANDS:
        code, out, err = cli(*path, "--help")
        assert code == 0, (path, err)
        texts[" ".join(path)] = out
    for name, text in texts.items():
        flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())
        assert not bad.search(flat), (name, bad.search(flat).group(0))
    assert "docs/formats.md, 'The native pack'" in " ".join(re.sub(r"[│╭╮╰╯─]", " ", texts["pack"]).split())


def test_library_messages_name_sections_by_title():
    """Error messages and other user-facing strings (not docstrings) cite documents by section title."""
    import ast
    from pathlib import Path

    bad = re.compile(r"§\s*\d|(formats|cache-model|cache-policy|design)\.md,?\s*(sections?\s*)?\d", re.I)
    found = []
    for p in sorted((Path(stratatools.__file__).parent).rglob("*.py")):
        tree = ast.parse(p.read_text(encoding="utf-8"))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{p.name}:{n.lineno}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                  and bad.search(n.value)]
    assert not found


def _kit_release(kit):
    p = kit / "pruned"
    return ("validate-release", "--model", p / "coder-revB.gguf", "--alloc", p / "coder-revB.rco-allocation.txt",
            "--profile", p / "profile-revA.bin")


def test_validate_release_json_switch_and_json_out(kit, cli, tmp_path):
    import json

    code, out, err = cli(*_kit_release(kit), "--json")
    assert code == 1, err
    data = json.loads(out)  # stdout is JSON only: no table
    assert data["ok"] is False and data["counts"] == {"pass": 6, "fail": 1, "skip": 3}
    stale = [c for c in data["checks"] if c["name"] == "profile-stale"][0]
    assert stale["status"] == "fail" and "kit-coder@revA" in stale["reason"]

    rep = tmp_path / "r.json"
    code, out, err = cli(*_kit_release(kit), "--json-out", rep, "--markdown", tmp_path / "r.md")
    assert code == 1, err
    assert "profile-stale" in out and "FAIL: 6 passed, 1 failed, 3 skipped" in out  # the table still prints
    assert json.loads(rep.read_text())["counts"] == data["counts"]
    assert (tmp_path / "r.md").read_text().startswith("# validate-release")

    code, _, err = cli(*_kit_release(kit), "--json-out", "-")
    assert code == 2 and "--json" in err and "Traceback" not in err
    code, _, err = cli(*_kit_release(kit), "--json", "--markdown", "-")
    assert code == 2 and "stdout" in err
    code, _, err = cli(*_kit_release(kit), "--json", tmp_path / "x.json")  # the old form: a file after --json
    assert code == 2 and not (tmp_path / "x.json").exists()


def test_profile_diff_markdown_file(kit, cli, tmp_path):
    p = kit / "pruned"
    md = tmp_path / "diff.md"
    code, out, err = cli("profile-diff", p / "profile-revA.bin", "--old-alloc", p / "coder-revA.rco-allocation.txt",
                         "--new-alloc", p / "coder-revB.rco-allocation.txt", "--markdown", md, "--json")
    assert code == 1, err
    import json

    d = json.loads(out)
    assert (d["verdict"], d["still_same"], d["n_ranked"]) == ("stale", 42, 128)
    text = md.read_text()
    assert text.startswith("# profile-diff: STALE") and "**42 of 128**" in text
    code, _, err = cli("profile-diff", p / "profile-revA.bin", "--old-alloc", p / "coder-revA.rco-allocation.txt",
                       "--new-alloc", p / "coder-revB.rco-allocation.txt", "--markdown", md)
    assert code == 2 and "--force" in err and md.read_text() == text


def test_alloc_export_json(kit, cli, tmp_path):
    import json

    out = tmp_path / "map.csv"
    code, o, err = cli("alloc", "export", kit / "pruned/coder-revB.rco-allocation.txt", "-o", out, "--json")
    assert code == 0, err
    d = json.loads(o)
    assert (d["format"], d["table"], d["rows"]) == ("csv", "map", 128)
    assert d["bytes"] == out.stat().st_size and len(out.read_text().splitlines()) == 129


def test_click_usage_errors_are_one_line_naming_the_option_and_the_fix(cli):
    """click's own errors (unknown option, bad value, missing argument) were boxed multi-line panels; they are
    one line naming the command, the option and where to look, exit 2, like every other error."""
    cases = [(["trace", "stats", "--bogus", "x.bin"], "stratatools trace stats: no such option: --bogus"),
             (["simulate", "--traces", "t.bin", "--slots", "abc"], "stratatools simulate: invalid value for '--slots'"),
             (["pack"], "stratatools pack: missing argument 'model'"),
             (["profile", "show", "--top", "x", "p.bin"], "stratatools profile show: invalid value for '--top'"),
             (["nosuchcommand"], "stratatools: no such command 'nosuchcommand'")]
    for argv, want in cases:
        code, out, err = cli(*argv)
        assert code == 2, (argv, code, err)
        assert out == "" and err.count("\n") == 1, (argv, err)
        assert err.startswith(f"error: {want}"), (argv, err)
        cmd = want.split(":")[0]
        assert err.rstrip().endswith(f"(run '{cmd} --help' for its options)"), (argv, err)
        assert "╭" not in err and "Usage:" not in err
    # a group without a command still shows its help (exit 2), and --help still works (exit 0)
    code, out, err = cli("trace")
    assert code == 2 and "Usage: stratatools trace" in out + err and "stats" in out + err
    code, out, err = cli("trace", "stats", "--help")
    assert code == 0 and "Usage: stratatools trace stats" in out
