"""The project's one user-facing error type.

Every error a user can cause (a missing file, bad magic, a wrong geometry, a malformed line) is raised as
:class:`StrataError`. The CLI prints its message on one line and exits with code 2; no traceback is shown
unless ``--debug`` is given. A check that ran and failed (a stale profile, a validation gate) is not an
error: commands report it and exit 1.
"""

from __future__ import annotations

import os


class StrataError(Exception):
    """A problem with the user's input, told in one line.

    The message names the file, the place in it (line number, byte offset, tensor name) and, where there is
    one, the fix. Messages read ``<file>: <place>: <what> (<fix>)``.

    Attributes:
        path: the file concerned, or None.
        exit_code: 2 (unusable input); subclasses never change it.
    """

    exit_code = 2

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        self.path = os.fspath(path) if path is not None else None
        super().__init__(one_line(message))


class OtherModelInput(StrataError):
    """Input that belongs to another model: a routing trace with expert ids at or past the model's expert count,
    or layers past its trunk and MTP blocks. A StrataError (exit 2); its own class so that a caller that turns
    other input errors into a failed check (validate-release's hit-rate gate) lets this one through as unusable
    input, not a failed gate."""


_MAX_MESSAGE = 2000


def one_line(message: str) -> str:
    """``message`` as one printable line: control characters (a newline, NUL, ESC from a file's bytes quoted in
    the message) are written as escapes, and an overlong message is cut (with ``...``)."""
    message = str(message)
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in message):
        message = "".join(c if not (ord(c) < 32 or 127 <= ord(c) < 160) else repr(c)[1:-1] for c in message)
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE - 3] + "..."
    return message



def num_text(x: float) -> str:
    """A number for a message, in as few digits as read back as the same float: ``12`` for 12.0, ``1.5``,
    ``1e-06``, and ``0.9999999`` (not ``1``, which ``{x:g}``'s six digits would print): an echoed option value is
    the value the user gave, never a neighbour."""
    x = float(x)
    short = f"{x:g}"
    if float(short) == x:
        return short
    if x.is_integer() and abs(x) < 1e16:
        return str(int(x))  # 123456789, not 123456789.0
    return repr(x)
