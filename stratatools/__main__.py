"""``python -m stratatools`` and the ``stratatools`` command (pyproject's entry point): the CLI, with Ctrl-C
covered from the first line run here on.

The command's modules (typer, rich, numpy, the command groups) take a few tenths of a second to import. Python's
own SIGINT handler would turn a Ctrl-C in that time into a KeyboardInterrupt traceback; :func:`main` installs a
handler first that ends the process quietly with exit status 130 (128 + SIGINT) and one line, ``interrupted``, on
stderr. Nothing has been written yet at that point, so there is nothing to clean up. Once the CLI starts
(:func:`stratatools.cli.entry.invoke`) its own handler replaces this one. Under ``python -m stratatools`` the
package's ``__init__`` installs the handler even earlier, before its own imports. A SIGINT that Python receives
before that (the interpreter's start-up: ``site``, the ``.pth`` files) is outside the project's reach.
"""

import os
import signal


def _interrupted_while_loading(signum, frame):
    """SIGINT while the CLI's modules are still loading: one line and exit 130, no traceback, no unwinding."""
    try:
        os.write(2, b"interrupted\n")
    except OSError:
        pass
    os._exit(128 + signum)


_interrupted_while_loading.stratatools_loading = True  # recognised (and replaced) by the CLI's entry point


def main() -> None:
    """Run the ``stratatools`` command on ``sys.argv`` (exits through SystemExit)."""
    if hasattr(signal, "SIGINT") and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        # only Python's default: a SIGINT the parent set to be ignored (a background job) stays ignored, and
        # under ``python -m`` stratatools/__init__.py has installed the same handler already
        signal.signal(signal.SIGINT, _interrupted_while_loading)
    from stratatools.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
