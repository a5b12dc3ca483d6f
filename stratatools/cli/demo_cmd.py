"""CLI: ``demo`` (the whole story on the embedded synthetic release)."""

from __future__ import annotations

from pathlib import Path

import typer

from stratatools.cli import common
from stratatools.cli.common import STATE, console, err_console, styled

_APP: typer.Typer | None = None  # the app ``register`` added the command to


def demo_cmd(
    out: Path = typer.Argument(Path("demo-out"), help="Output folder (index.md links everything).",
                                   parser=common.out_folder("OUT", "demo-out")),
    force: bool = typer.Option(False, "--force", help="Replace an existing demo folder."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout: the steps, their exit codes and times."),
) -> None:
    """Run the whole story on a synthetic release: pack, stale profile caught, remap, rebuild from runtime
    traces, simulate stale vs remapped vs rebuilt, validate-release red then green."""
    from stratatools.demo.walkthrough import run_demo

    quiet = STATE.quiet  # each step runs the CLI in-process, which resets the global flags

    def progress(st) -> None:
        if quiet:
            return
        ok = st.code == st.expect
        mark = ("ok", "green") if ok else ("UNEXPECTED", "bold red")
        err_console.print(styled(mark, f" {st.title}  ", (f"(exit {st.code}, {st.seconds:.1f} s)", "dim")))

    from stratatools.cli.entry import run_text

    try:
        res = run_demo(out, lambda argv: run_text(_APP, argv), force=force, progress=progress)
    finally:  # the steps reset the global flags; a refused or interrupted demo prints its notes under them too
        STATE.quiet = quiet
    notes = common.write_notes()  # (stderr) what the publish did beside the demo folder
    if as_json:
        from stratatools.cli.common import emit_json

        emit_json({"ok": res.ok, "out": str(res.out), "index": str(res.out / "index.md"),
                   "seconds": round(res.seconds, 3), "notes": notes,
                   "steps": [{"title": st.title, "exit_code": st.code, "expected": st.expect,
                              "seconds": round(st.seconds, 3)} for st in res.steps]})
        if not res.ok:
            raise typer.Exit(1)
        return
    console.print(f"demo: {len(res.steps)} steps in {res.seconds:.1f} s -> {res.out / 'index.md'}")
    if not res.ok:
        bad = [s.title for s in res.steps if s.code != s.expect]
        console.print(styled((f"unexpected exit codes in: {', '.join(bad)}", "bold red"), f" (see {res.out / 'logs'})"))
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``demo`` to ``app``; the demo's steps run through that same app, in-process."""
    global _APP
    _APP = app
    app.command("demo")(demo_cmd)
