"""The ``stratatools`` command. Each command group lives in its own module and registers itself here.

Commands parse options, call one library function, and render its result. A :class:`StrataError` becomes
one line on stderr and exit code 2 (``--debug`` shows the traceback); a failed check exits 1.

May import: :mod:`stratatools.core`, :mod:`stratatools.model`, :mod:`stratatools.pack`, :mod:`stratatools.alloc`, :mod:`stratatools.traces`, :mod:`stratatools.profiles`,
:mod:`stratatools.cachesim`, :mod:`stratatools.release`, :mod:`stratatools.synth`, :mod:`stratatools.runtime`, :mod:`stratatools.demo`.
"""

from __future__ import annotations

import typer

from stratatools.cli import common, entry

app = typer.Typer(
    name="stratatools",
    help="Pack, profile, remap, trace, simulate and validate expert-offloaded MoE releases for Strata.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from stratatools.core.version import __version__

        common.console.print(f"stratatools {__version__}", markup=False, highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print 'stratatools X.Y.Z' and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars or notes on stderr."),
) -> None:
    common.STATE.debug = debug
    common.STATE.quiet = quiet


def _register_all() -> None:
    from stratatools.cli import (model_cmds, profile_cmds, alloc_cmds, trace_cmds, sim_cmds, tune_cmd, run_cmds,
                                 release_cmds, demo_cmd)

    for mod in (model_cmds, profile_cmds, alloc_cmds, trace_cmds, sim_cmds, tune_cmd, run_cmds, release_cmds, demo_cmd):
        mod.register(app)


_register_all()


def run_captured(argv: list[str], out, err=None, width: int | None = None) -> int:
    """Run ``stratatools argv`` in-process with stdout, stderr and both rich consoles writing to the text
    streams ``out`` and ``err`` (``err`` defaults to ``out``); ``width`` fixes the consoles' width. Returns the
    exit code. Used by the tests."""
    return entry.run_captured(app, argv, out, err, width)


def run_text(argv: list[str], width: int = 120) -> tuple[int, str]:
    """Run ``stratatools argv`` in-process; return (exit code, combined stdout+stderr text). A step runner
    for :func:`stratatools.demo.walkthrough.run_demo` (its ``runner``)."""
    return entry.run_text(app, argv, width)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turning project errors into one line and exit code 2."""
    entry.invoke(app, argv)
