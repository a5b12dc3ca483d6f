"""The ``stratatools`` command. Each command group lives in its own module and registers itself here.

Commands parse options, call one library function, and render its result. A :class:`StrataError` becomes
one line on stderr and exit code 2 (``--debug`` shows the traceback); a failed check exits 1.
"""

from __future__ import annotations

import os
import sys

import typer

from stratatools.core.errors import StrataError
from stratatools.cli import common

app = typer.Typer(
    name="stratatools",
    help="Pack, profile, remap, trace, simulate and validate expert-offloaded MoE releases for Strata.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root(
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
    exit code. Used by the demo and the tests."""
    import contextlib

    err = out if err is None else err
    saved = (common.console.file, common.err_console.file, common.console.width, common.err_console.width)
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        common.console.file, common.err_console.file = out, err
        if width is not None:
            common.console.width = common.err_console.width = width
        try:
            main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            common.console.file, common.err_console.file = saved[0], saved[1]
            common.console.width, common.err_console.width = saved[2], saved[3]
    return code


def run_text(argv: list[str], width: int = 120) -> tuple[int, str]:
    """Run ``stratatools argv`` in-process; return (exit code, combined stdout+stderr text). The demo's
    step runner (:func:`stratatools.demo.walkthrough.run_demo` takes it as ``runner``)."""
    import io

    buf = io.StringIO()
    code = run_captured(argv, buf, width=width)
    return code, buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turning project errors into one line and exit code 2."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        app(args=argv, prog_name="stratatools", standalone_mode=True)
    except StrataError as e:
        if debug or os.environ.get("STRATATOOLS_DEBUG"):
            raise
        common.err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except OSError as e:  # disk full, permission denied, ...: the system's word, one line, not a traceback
        if debug or os.environ.get("STRATATOOLS_DEBUG"):
            raise
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        common.err_console.print(f"error: {where}{e.strerror or e} (check the path, free space and permissions)",
                                 markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        common.err_console.print("interrupted", markup=False)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
