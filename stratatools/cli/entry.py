"""Running a typer app as the ``stratatools`` command: error handling (one line, exit 2) and the in-process
runner used by the demo and the tests. Takes the app as an argument, so the command modules (``demo``
runs the CLI step by step) need not import :mod:`stratatools.cli` itself (no import circle).
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import signal
import sys

import typer

from stratatools.core.errors import StrataError, one_line
from stratatools.cli import common

# click's exception classes as typer raises them: click's own module, or (newer typer) typer's copy of click
_CX = sys.modules[typer.BadParameter.__module__]
_NO_ARGS = getattr(_CX, "NoArgsIsHelpError", ())  # a group run without a command: its help (click >= 8.2)


def invoke(app: typer.Typer, argv: list[str] | None = None) -> None:
    """Run ``app`` on ``argv`` (default: ``sys.argv[1:]``), turning a :class:`StrataError` into one line on
    stderr and its exit code (2), an OSError into one line and exit 2, Ctrl-C into exit 130. ``--debug`` or
    ``$STRATATOOLS_DEBUG`` re-raises instead (tracebacks). Exits through :class:`SystemExit`."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    if argv is None and hasattr(signal, "SIGPIPE"):
        # as the program itself: a reader that goes away (| head) ends us the way it ends cat or grep, quietly,
        # exit status 141 (128 + SIGPIPE); every output file is published whole or not at all, so this is safe
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if argv is None and hasattr(signal, "SIGTERM"):
        # kill / timeout / a CI cancel: unwind like Ctrl-C, so temp files and half-built folders are removed
        signal.signal(signal.SIGTERM, _terminated)
    sigint = signal.getsignal(signal.SIGINT)
    if argv is None and (sigint is signal.default_int_handler or getattr(sigint, "stratatools_loading", False)):
        # Ctrl-C: KeyboardInterrupt as before, but held back while a temp is being created and recorded (replaces
        # Python's default or the quiet exit stratatools.__main__ installs while the modules load)
        signal.signal(signal.SIGINT, _interrupted)
    from stratatools.core import fsutil

    if argv is None:  # the real process: its handlers are ours (above); an in-process run leaves the state alone
        fsutil.cli_signals(True)
    n_written, _ = fsutil.files_written()  # an interrupt names the files this command had already published
    # the write path's notes are this command's from here: those of an enclosing command (the demo runs its
    # steps in-process) are set aside and given back as this one ends, its own are printed (common.write_notes)
    outer_notes = fsutil.take_notes()
    try:
        _invoke(app, argv, debug, n_written)
    finally:
        try:
            common.write_notes()
        except (OSError, ValueError):  # stderr gone: the notes are dropped, as every other line
            pass
        fsutil._record(outer_notes)


def _invoke(app: typer.Typer, argv: list[str] | None, debug: bool, n_written: int) -> None:
    """:func:`invoke`'s body: run the command and turn its end into an exit (see there)."""
    from stratatools.core import fsutil

    try:
        # standalone_mode=False: click's own errors (unknown option, bad value, missing argument) come back to us
        # as exceptions instead of being printed by typer as multi-line boxed panels; we print them as the one line
        # the project's errors are (naming the option and the fix), exit 2. typer then returns an Exit's code.
        rv = app(args=argv, prog_name="stratatools", standalone_mode=False)
        # a SIGTERM whose exit was swallowed (raised inside a ctypes callback, e.g. while numba writes its
        # cache, or caught by a library's ``except BaseException``) is still pending here: exit 130/143 now
        fsutil._stop_if_signalled()
        # the command has finished (its outputs published, its last line printed): a Ctrl-C or SIGTERM from here
        # would only turn a done job into "interrupted" or a death by signal while the interpreter shuts down
        if argv is None:
            fsutil.commit_point()
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)
    except SystemExit as e:  # a signal held back while a temp was created or a file renamed: exit 130/143 now
        if e.code in (130, 143) and fsutil.files_written(n_written)[1]:
            common.err_console.print(_written_note("interrupted" if e.code == 130 else "terminated", n_written),
                                     markup=False, highlight=False, soft_wrap=True)
        raise
    except _NO_ARGS as e:  # `stratatools trace`: the group's help, as before
        from typer import rich_utils

        rich_utils.rich_format_error(e)
        sys.exit(e.exit_code)
    except _CX.UsageError as e:
        common.err_console.print(usage_line(e), markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except _CX.ClickException as e:
        common.err_console.print(one_line(f"error: {e.format_message()}"), markup=False, highlight=False,
                                 soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Abort:
        common.err_console.print("aborted", markup=False)
        sys.exit(1)
    except StrataError as e:
        if debug or os.environ.get("STRATATOOLS_DEBUG"):
            raise
        common.write_notes()  # what the refused run cleaned up first, above its one-line error
        common.err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except RuntimeError as e:
        code = fsutil.pending_signal()
        if code is not None and not (debug or os.environ.get("STRATATOOLS_DEBUG")):
            # a Ctrl-C / SIGTERM swallowed inside numba's compiler left it half-built ("no compiled object yet"):
            # the run ends as interrupted, not with the compiler's traceback
            common.err_console.print(_written_note("interrupted" if code == 130 else "terminated", n_written),
                                     markup=False, highlight=False, soft_wrap=True)
            sys.exit(code)
        # pathlib's resolve() reports a symlink loop as RuntimeError, not OSError(ELOOP), before Python 3.13
        m = re.fullmatch(r"Symlink loop from ('.*'|\".*\")", str(e))  # the path as repr() quotes it
        if m is None or debug or os.environ.get("STRATATOOLS_DEBUG"):
            raise
        common.err_console.print(one_line(f"error: {ast.literal_eval(m.group(1))}: symlink loop (a link that points "
                                          f"back at itself); remove it or choose another path"),
                                 markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except BrokenPipeError:  # in-process: quiet, with the status a shell reports for SIGPIPE
        _silence_stdout()
        sys.exit(141)
    except OSError as e:  # disk full, permission denied, ...: the system's word, one line, not a traceback
        if debug or os.environ.get("STRATATOOLS_DEBUG"):
            raise
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        common.err_console.print(one_line(f"error: {where}{e.strerror or e} (check the path, free space and "
                                          f"permissions)"),
                                 markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        common.err_console.print(_written_note("interrupted", n_written), markup=False, highlight=False,
                                 soft_wrap=True)
        sys.exit(130)


def _written_note(word: str, since: int) -> str:
    """``word`` ("interrupted"), and the files the command had published before the signal, if any: those are
    new and whole (a signal after a file's rename cannot undo it), the others were left as they were."""
    from stratatools.core import fsutil

    paths = fsutil.files_written(since)[1]
    if not paths:
        return word
    return one_line(f"{word}; already written, whole, before it: {', '.join(paths)}")


def usage_line(e) -> str:
    """One line for a click usage error: ``error: <command>: <click's message> (run '<command> --help' for its
    options)``; click's message names the option or argument and the value, e.g. ``No such option: --bogus`` or
    ``Invalid value for '--slots': ...``."""
    cmd = e.ctx.command_path if e.ctx is not None else "stratatools"
    msg = e.format_message().strip().rstrip(".")
    if msg[:1].isupper() and msg[1:2].islower():
        msg = msg[0].lower() + msg[1:]
    glob = _global_option(e)
    if glob:
        root = e.ctx.find_root().command_path
        sub = cmd[len(root):].strip()
        example = f"{root} {glob}" if glob == "--version" else f"{root} {glob} {sub} ..."
        return one_line(f"error: {cmd}: {msg}: {glob} is a global option; put it before the command "
                        f"('{example}')")
    return one_line(f"error: {cmd}: {msg} (run '{cmd} --help' for its options)")


def _global_option(e) -> str | None:
    """The option of a "no such option" error when it is one of the root command's (global) options, given
    after a subcommand (``stratatools run ... --quiet``); else None."""
    name = getattr(e, "option_name", None)
    ctx = getattr(e, "ctx", None)
    if not name or ctx is None or not isinstance(e, _CX.NoSuchOption):
        return None
    root = ctx.find_root()
    if root is ctx:
        return None
    for p in root.command.params:
        if name in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())):
            return name
    return None


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM handler: raise SystemExit(143) (128 + SIGTERM) so every ``finally`` cleans up on the way out; held
    back while a temp file or folder is being created and recorded, and recorded as pending so that a swallowed
    SystemExit still ends the run (:func:`stratatools.core.fsutil.terminate`)."""
    from stratatools.core.fsutil import terminate

    terminate(128 + signum)


def _interrupted(signum: int, frame: object) -> None:
    """SIGINT handler: KeyboardInterrupt (exit 130 via :func:`main`), or exit 130 held back while a temp file or
    folder is being created and recorded (:func:`stratatools.core.fsutil.interrupt`)."""
    from stratatools.core.fsutil import interrupt

    interrupt(128 + signum)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not report the broken pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def run_captured(app: typer.Typer, argv: list[str], out, err=None, width: int | None = None) -> int:
    """Run ``stratatools argv`` (the commands of ``app``) in-process with stdout, stderr and both rich
    consoles writing to the text streams ``out`` and ``err`` (``err`` defaults to ``out``); ``width`` fixes
    the consoles' width. Returns the exit code."""
    err = out if err is None else err
    saved = (common.console.file, common.err_console.file, common.console.width, common.err_console.width)
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        common.console.file, common.err_console.file = out, err
        if width is not None:
            common.console.width = common.err_console.width = width
        try:
            invoke(app, [str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            common.console.file, common.err_console.file = saved[0], saved[1]
            common.console.width, common.err_console.width = saved[2], saved[3]
    return code


def run_text(app: typer.Typer, argv: list[str], width: int = 120) -> tuple[int, str]:
    """Run ``stratatools argv`` in-process; return (exit code, combined stdout+stderr text)."""
    buf = io.StringIO()
    code = run_captured(app, argv, buf, width=width)
    return code, buf.getvalue()
