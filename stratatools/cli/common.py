"""Shared CLI plumbing: consoles, global flags, JSON output, progress bars."""

from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import typer
from rich.console import Console

from stratatools.core.cluster import MAX_WORKERS_PER_CPU

# No markup, emoji or highlighting is ever read from text: file names, tensor names, reasons and messages come from
# user input ("[/]" would raise MarkupError, "[shard]" would vanish, ":-1:" would become an emoji). Styled words are
# built explicitly with rich.text.Text (see styled()).
console = Console(highlight=False, markup=False, emoji=False)
err_console = Console(stderr=True, highlight=False, markup=False, emoji=False)


def styled(*parts: "str | tuple[str, str]") -> Any:
    """A rich Text from plain strings (shown as they are) and (text, style) pairs: the one way to colour output."""
    from rich.text import Text

    t = Text()
    for p in parts:
        if isinstance(p, tuple):
            t.append(p[0], style=p[1])
        else:
            t.append(p)
    return t


@dataclass
class _State:
    debug: bool = False
    quiet: bool = False


STATE = _State()


def emit_json(obj: Any) -> None:
    """Print ``obj`` as JSON on stdout (no rich markup)."""
    from stratatools.core.fsutil import _json_default

    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")
    sys.stdout.flush()


def note(msg: str) -> None:
    """A remark on stderr, suppressed by --quiet."""
    if not STATE.quiet:
        err_console.print(msg, markup=False, highlight=False)


def write_notes() -> list[str]:
    """What the write path did beside this command's outputs (a killed run's leftover removed, a folder kept
    beside the output because it holds another program's file: :func:`stratatools.core.fsutil.take_notes`),
    printed on stderr as ``note: ...`` lines (not under --quiet) and returned, for a command's JSON ``notes``.
    The CLI prints what a command did not take itself when it ends (:func:`stratatools.cli.entry.invoke`)."""
    from stratatools.core.fsutil import take_notes

    notes = take_notes()
    if not STATE.quiet:
        try:
            for n in notes:
                err_console.print(f"note: {n}", markup=False, highlight=False, soft_wrap=True)
        except (OSError, ValueError):  # stderr gone or full: the notes are dropped, the command's result stands
            pass
    return notes


def warn(msg: str) -> None:
    """A warning on stderr (always shown)."""
    err_console.print(f"warning: {msg}", markup=False, highlight=False)


class _NullBar:
    def update(self, advance: int = 0, **_: Any) -> None:  # noqa: D401
        pass


@contextmanager
def progress_bar(description: str, total: int | None, bytes_: bool = True) -> Iterator[Any]:
    """A rich progress bar on a terminal's stderr; silent in pipes and with --quiet.

    Yields an object with ``update(advance=n)``.
    """
    if STATE.quiet or not err_console.is_terminal:
        yield _NullBar()
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    cols = [TextColumn("{task.description}", markup=False), BarColumn()]
    if bytes_:
        cols += [DownloadColumn(), TransferSpeedColumn()]
    else:
        cols.append(TextColumn("{task.completed:,.0f}" + ("" if total is None else "/{task.total:,.0f}"), markup=False))
    cols.append(TimeRemainingColumn())
    with Progress(*cols, console=err_console, transient=True) as p:
        task = p.add_task(description, total=total)

        class _Bar:
            def update(self, advance: int = 0, **kw: Any) -> None:
                p.update(task, advance=advance, **kw)

        yield _Bar()


# ------------------------------------------------------------------------------------------ output paths
# Output options take the raw text through these parsers (typer's ``parser=``), because a pathlib.Path drops what
# matters here: "newdir/" (a folder) becomes "newdir" (a file of that name), "" becomes "." (the current folder).
def out_file(option: str, example: str, stdout_ok: bool = False, folder_ok: bool = False):
    """A typer ``parser`` for an output FILE option: refuses an empty path, ``-`` (unless ``stdout_ok``: the
    command prints there) and a path ending in ``/`` (a folder); returns the Path. A missing parent folder is
    created when the file is written. Raises StrataError (one line, exit 2) naming ``option`` and a fix with
    ``example``. ``folder_ok``: the option may also name a folder (a trailing ``/`` is kept)."""
    import os
    from pathlib import Path

    from stratatools.core.errors import StrataError

    def parse(raw: Any) -> Any:
        if not isinstance(raw, str):  # a default value, already a Path
            return raw
        if not raw.strip():
            raise StrataError(f"{option} {raw!r}: the path is empty; give a file name, e.g. {option} {example}")
        if raw == "-" and not stdout_ok:
            raise StrataError(f"{option} -: this output is written to a file (through a temp file and a rename), "
                              f"not to stdout; give a file path, e.g. {option} {example}")
        if raw != "-" and not folder_ok and (raw.endswith("/") or raw.endswith(os.sep) or raw.endswith("/.")):
            raise StrataError(f"{option} {raw}: names a folder; give a file name, e.g. {option} "
                              f"{raw.rstrip('/.')}/{example}")
        return raw if raw == "-" else Path(raw)

    return parse


def out_folder(option: str, example: str):
    """A typer ``parser`` for an output FOLDER option or argument: refuses an empty path and ``-`` (a folder named
    ``-`` is never what was meant: no folder output goes to stdout), and the folders no output can be published
    as, each for its own reason: the file system's root or another mount point (a folder output is built in a temp
    folder beside it, in its parent, and renamed in: :func:`stratatools.core.fsutil.publish_dir`), a path ending
    in ``..`` (it names no folder of its own to build beside), a path under a file, a name longer than the file
    system takes. Returns the Path. Raises StrataError (one line, exit 2) naming ``option``, the reason and a fix
    with ``example``."""
    from stratatools.core.errors import StrataError

    eg = example if option.isupper() else f"{option} {example}"  # an argument (OUTDIR) or an option (-o)

    def parse(raw: Any) -> Any:
        if not isinstance(raw, str):
            return raw
        if not raw.strip():
            raise StrataError(f"{option} {raw!r}: the path is empty; give a folder, e.g. {eg}")
        if raw == "-":
            raise StrataError(f"{option} -: this output is a folder, not a stream on stdout; give a folder path, "
                              f"e.g. {eg}")
        return folder_place(option, raw, example)

    return parse


def folder_place(option: str, raw: str, example: str) -> Any:
    """Refuse a folder output path that no folder output can be published as, each for its own reason (see
    :func:`out_folder`): the file system's root, another mount point, a path ending in ``..``, a path under a
    file (or under a broken link), a name longer than NAME_MAX. Returns ``Path(raw)``. Raises StrataError (one line
    naming ``option``, the reason and a fix)."""
    import os
    from pathlib import Path

    from stratatools.core.errors import StrataError

    eg = example if option.isupper() else f"{option} {example}"  # an argument (OUTDIR) or an option (-o)
    opt = "" if option.isupper() else f"{option} "
    p = Path(raw)
    leaf = example.rsplit("/", 1)[-1]
    if p.name == "..":
        raise StrataError(f"{option} {raw}: ends in '..', which names no folder of its own (an output folder is "
                          f"built beside itself under its name, then renamed in); give the folder's own path, "
                          f"e.g. {opt}{os.path.realpath(raw)}", p)
    try:
        mount = os.path.ismount(p)
    except (OSError, ValueError):
        mount = False
    if mount and os.path.realpath(p) == os.path.realpath(os.sep):
        raise StrataError(f"{option} {raw}: the file system's root, which no output folder can replace or be "
                          f"published into (it is built beside its folder, in the parent, and renamed in); "
                          f"give a new subfolder, e.g. {opt}/{example}", p)
    if mount:
        raise StrataError(f"{option} {raw}: a mount point, which no output folder can replace or be published "
                          f"into (it is built beside its folder, on the parent's file system, and renamed in); "
                          f"give a subfolder, e.g. {opt}{raw.rstrip('/')}/{leaf}", p)
    for a in [p, *p.parents][1:]:  # the nearest existing parent must be a folder
        if os.path.lexists(a):
            if not os.path.isdir(a):
                kind = ("a file" if os.path.isfile(a) else "a symbolic link that leads to no folder (a loop or a "
                        "missing target)" if os.path.islink(a) else "not a folder (a device, FIFO or socket)")
                raise StrataError(f"{option} {raw}: a parent of this path is not a folder ({a} is {kind}), so "
                                  f"nothing can be created under it; choose another folder, e.g. {eg}", p)
            try:
                nm = os.pathconf(a, "PC_NAME_MAX")
            except (OSError, ValueError):
                nm = 255
            if nm > 0 and len(os.fsencode(p.name)) > nm:
                raise StrataError(f"{option} {raw}: the name is {len(os.fsencode(p.name))} bytes, and this file "
                                  f"system takes names of at most {nm} bytes; choose a shorter name", p)
            break
    return p


# Bounds of the CLI's numeric options. A value outside is refused while the command line is parsed (click's usage
# error: one line naming the option and the range, exit 2), before it can overflow an int64 array or a numba
# kernel's argument deep inside a command.
#: --cluster's help, shared by every command that takes it (stratatools.core.cluster bounds local:N)
CLUSTER_HELP = (f"Dask: local[:N] starts a local cluster of N workers (at most {MAX_WORKERS_PER_CPU} x the CPU count), "
                "tcp://HOST:PORT uses a running scheduler; default: in-process.")

MAX_SLOTS = 2**40          # expert slots (--slots, --upper-slots, --top ...): far above any real tier
MAX_COUNT = 2**31 - 1      # counts and rounds (--adapt-every, --adapt-lag, --window, --candidates ...)
MAX_BYTES = 2**50          # byte counts (--adapt-pace-bytes)
MAX_GIB = float(2**20)     # sizes in GiB or GB (--budget-gib, --vram-gib, --ram-experts-gib ...): 1 PiB
MAX_GBPS = 1e9             # bandwidths in GB/s
MAX_SEED = 2**63 - 1       # seeds (numpy seed sequences, stored as GGUF int64)
MAX_LAYERS = 4096          # layers a profile can address (stratatools.profiles.strp)
MAX_EXPERTS = 1 << 16      # experts per layer a profile can address
MAX_NEW_TOKENS = 2**20     # run --max-new-tokens: 1,048,576 (the model's context length limits it further)


def int_range(lo: int, hi: int, why: str | None = None) -> Any:
    """A typer ``callback`` bounding an integer option (or each item of a repeatable one) to ``lo..hi``.

    Returns the value unchanged (None passes: the option was not given). Raises typer.BadParameter ("must be an
    integer from LO to HI (got V)", then ``; why`` when given: the reason for the bound), which the CLI prints as
    one line naming the option, exit 2. Used instead of typer's ``min``/``max``, whose messages (pydantic's under
    typer >= 0.2x) do not name the range."""

    def check(ctx: Any, param: Any, value: Any) -> Any:
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v is not None and not lo <= v <= hi:
                raise typer.BadParameter(f"must be an integer from {lo} to {hi} (got {v})"
                                         + (f"; {why}" if why else ""))
        return value

    check.bounds = (lo, hi)  # type: ignore[attr-defined]
    return check


def float_range(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Any:
    """A typer ``callback`` bounding a float option (or each item of a repeatable one) to a finite ``lo..hi``
    (``lo_open``: above ``lo``; ``hi_open``: below ``hi``). NaN and infinities are refused. Raises
    typer.BadParameter ("must be a finite number, at least LO and at most HI (got V)"), printed as one line naming
    the option, exit 2."""
    def num(x: float) -> str:  # 1048576, not 1.04858e+06
        return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"

    low = f"above {num(lo)}" if lo_open else f"at least {num(lo)}"
    high = f"below {num(hi)}" if hi_open else f"at most {num(hi)}"

    def check(ctx: Any, param: Any, value: Any) -> Any:
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v is None:
                continue
            ok = math.isfinite(v) and (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
            if not ok:
                raise typer.BadParameter(f"must be a finite number, {low} and {high} (got {v})")
        return value

    check.bounds = (lo, hi)  # type: ignore[attr-defined]
    return check
