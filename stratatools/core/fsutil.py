"""File-system helpers shared by every writer: atomic writes, output guards, hashing, JSON sidecars."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from stratatools.core.errors import StrataError


# ------------------------------------------------------------------------------------- the write path
# Every output of the project is written here (decision, issue 14):
# * a file goes to a unique temp name in the target's own folder, created with O_CREAT|O_EXCL|O_NOFOLLOW (a planted
#   symlink or file at that name is never followed or truncated), is written, fsync'ed, renamed over the target,
#   and the folder is fsync'ed (the rename survives a crash); an output checked absent without --force
#   (:func:`guard_output`) is renamed in with no-replace instead, so a file another run published meanwhile stays;
# * the target must be a regular file or absent (never a device, FIFO, socket or folder: a rename would replace the
#   node) and must not be an input of the command, nor the registry named by $STRATATOOLS_REGISTRY;
# * any OSError (ENOSPC, EACCES, EIO...) removes the temp and becomes a one-line StrataError naming the target;
# * a multi-file output (a pack, a synth release, a report or demo folder) is built in a unique sibling temp folder
#   and swapped in whole (:func:`publish_dir`), under an advisory lock beside it (:func:`output_lock`).
REGISTRY_ENV = "STRATATOOLS_REGISTRY"
_TMP_TAG = ".stratatools-tmp"       # in every temp file/folder name we create (recognised on clean-up)
_ASIDE_TAG = ".stratatools-old"     # a previous output folder moved aside during a swap
_LOCK_SUFFIX = ".stratatools-lock"  # the advisory lock (and swap journal) beside an output
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _fail(path: str | os.PathLike, e: BaseException, what: str = "cannot write") -> StrataError:
    """A one-line StrataError for an OSError ``e`` met while writing ``path``."""
    msg = getattr(e, "strerror", None) or str(e) or type(e).__name__
    hint = {errno.ENOSPC: " (free some space)",
            errno.ENAMETOOLONG: " (choose a shorter name or path)"}.get(getattr(e, "errno", None), "")
    return StrataError(f"{path}: {what}: {msg}{hint}; nothing was changed", path)


def registry_input() -> list[Path]:
    """The registry named by ``$STRATATOOLS_REGISTRY`` (an input of every command that reads it), or []."""
    v = os.environ.get(REGISTRY_ENV)
    return [Path(v)] if v else []


def _same(a: Path, b: Path) -> bool:
    try:
        if os.path.samefile(a, b):
            return True
    except OSError:
        pass
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):
        return False


def check_target(path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """Refuse an output path that exists and is not a regular file (a folder, device, FIFO, socket; a symlink is
    judged by what it points to and replaced itself, never its target), or that is one of ``inputs`` or the
    ``$STRATATOOLS_REGISTRY`` file. Returns the path. Raises StrataError (one line, with the fix)."""
    p = Path(path)
    for i in list(inputs) + registry_input():
        if _same(p, Path(i)):
            raise StrataError(f"{p}: output would overwrite the input {i}; choose another output path", p)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return p
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StrataError(f"{p}: symlink loop; remove it or choose another output path", p) from None
        if e.errno == errno.ENOTDIR:
            raise StrataError(f"{p}: a parent of this path is not a folder; choose another output path", p) from None
        raise _fail(p, e) from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, FIFO or socket)"
        raise StrataError(f"{p}: exists and is {kind}; outputs are written only to regular files: choose another "
                          f"output path", p)
    return p


def fsync_dir(folder: str | os.PathLike) -> None:
    """fsync a folder so renames in it survive a crash (best effort where the file system refuses)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


# SIGTERM and temp names (issue 14): the CLI's SIGTERM handler raises SystemExit so every ``finally`` cleans up.
# Python runs that handler between any two bytecodes, so a temp created by a call that returns just before the
# handler runs would be unknown to the clean-up code. Each creation therefore runs inside :func:`signals_deferred`
# and its clean-up guard is installed before it: the handler (:func:`terminate`) only notes the signal while a
# creation is in progress, and the exit is raised as the creation's block ends, inside the guard, which then knows
# the temp's name. Python handlers run in the main thread only, so this holds whatever thread the kernel picks.
# Ctrl-C (SIGINT) takes the same path: the CLI's SIGINT handler raises KeyboardInterrupt outside a creation and,
# inside one, notes exit 130 the same way (:func:`interrupt`).
#
# Signals and publication (where a SIGINT/SIGTERM can land once an output is new, and what each window gives):
# * a file (:func:`commit_temp`, :func:`write_files_atomic`): the rename is the last act of a held block. A signal
#   held back before it stops the publication (:func:`_stop_if_signalled`: the old output stays, exit 130/143 is
#   true); one that arrives during the rename is raised as the block ends, after it. A file set is renamed whole
#   in one block (before, a signal between two renames published half a set: a new sidecar beside the old file).
# * after a file's rename, up to the command's return (fsync of the folder, the command's next outputs and last
#   messages): an exit 130/143 here leaves that file new and whole. This window is not closed: a file is not known
#   to be the command's last output (a command may write more, or work on), and holding the signal to the end
#   would make Ctrl-C wait for that work. The file is recorded (:func:`files_written`) and the CLI's "interrupted"
#   line names it, so the exit code and its message do not claim the output was left as it was.
# * a folder swapped whole: the swap and :func:`commit_point` are one held block; after it signals are dropped and
#   the command exits 0 (README "Exit codes"). A folder published in place: :func:`commit_point` comes before the
#   first change, see :func:`_publish_in_place` for its SIGKILL window.
# * no-replace publication (:func:`guard_output`) is recorded per process, in ``_NO_REPLACE``: two processes that
#   both checked an absent output cannot both publish it (renameat2 RENAME_NOREPLACE), but two threads of one
#   process share the record and the first publication drops it, so the second thread replaces the first one's
#   file. The project publishes from the main thread only; this is not closed.
_DEFER: dict[str, Any] = {"depth": 0, "pending": None, "committed": False, "cli": False, "publishing": 0,
                          "written": 0, "written_paths": []}
_WRITTEN_KEPT = 64  # the last file outputs recorded for the CLI's "interrupted" line (files_written)


_NOTES: list[str] = []  # what the clean-up and the publish did, for the command to show (take_notes)
_NOTES_KEPT = 64


def _record(notes: Iterable[str]) -> list[str]:
    """Add ``notes`` to what :func:`take_notes` returns (the last 64 kept; one already there is not repeated:
    a command's clean-up and its publish may both find a folder they keep); returns them as a list."""
    notes = list(notes)
    _NOTES[:] = (_NOTES + [n for i, n in enumerate(notes) if n not in _NOTES and n not in notes[:i]])[-_NOTES_KEPT:]
    return notes


def take_notes() -> list[str]:
    """The notes recorded since the last call, oldest first, and forget them: one line each on what the clean-up
    of a killed run's leftovers (:func:`tidy_output`) and a folder publish (:func:`publish_dir`) did beside an
    output ("...: removed a leftover of an interrupted run", "...: kept: it holds ..., move what you need"). The
    CLI prints them on stderr (``note: ...``) and adds them to a command's JSON where it has a ``notes`` list."""
    out = list(_NOTES)
    _NOTES.clear()
    return out


def files_written(since: int = 0) -> tuple[int, list[str]]:
    """(the number of file outputs this process has published outside folder outputs, the paths of those
    numbered ``since`` and after, of the last 64 kept). The CLI takes the count as a command starts, and after an
    interrupt names the files the command had already published, new and whole."""
    n = _DEFER["written"]
    first = n - len(_DEFER["written_paths"])
    return n, [p for i, p in enumerate(_DEFER["written_paths"], first) if i >= since]


def pending_signal() -> int | None:
    """The exit code (130 / 143) of a Ctrl-C or SIGTERM recorded by :func:`interrupt` / :func:`terminate` and not
    raised yet (its exception was swallowed), else None."""
    return _DEFER["pending"]


def _stop_if_signalled() -> None:
    """Inside :func:`signals_deferred`, just before an output's rename: a SIGINT/SIGTERM held back meanwhile
    stops the publication here (its exit is raised now; the caller's guard removes the temp), so the previous
    output stays and the exit code says so truthfully."""
    if _DEFER["pending"] is not None:
        code, _DEFER["pending"] = _DEFER["pending"], None
        raise SystemExit(code)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Run a block (create a temp and record its name) with the CLI's SIGTERM exit held back to the block's end
    (see the note above). Blocks nest; a SIGTERM seen meanwhile raises ``SystemExit(143)`` as the outermost one
    ends."""
    _DEFER["depth"] += 1
    try:
        yield
    finally:
        _DEFER["depth"] -= 1
        if _DEFER["depth"] == 0 and _DEFER["pending"] is not None:
            code, _DEFER["pending"] = _DEFER["pending"], None
            raise SystemExit(code)


def _held(code: int) -> bool:
    """Inside :func:`signals_deferred`: note exit ``code`` for the block's end and say so. After
    :func:`commit_point` the signal is dropped (the output is published: the command finishes and exits 0)."""
    if _DEFER["committed"]:
        return True
    if _DEFER["depth"] > 0:
        _DEFER["pending"] = code
        return True
    return False


def terminate(code: int) -> None:
    """Exit through ``SystemExit(code)`` now, or, inside :func:`signals_deferred`, as that block ends (the CLI's
    SIGTERM handler calls this). The code is recorded as pending first (unless the output is already published,
    :func:`commit_point`): a SystemExit raised inside a ctypes callback (llvmlite, while numba writes its cache) is
    printed as "Exception ignored" and swallowed, and the pending code still stops the run at the next publication,
    held block or the CLI's check once the command returns, with nothing more published."""
    if not _DEFER["committed"]:
        _DEFER["pending"] = code
    if not _held(code):
        raise SystemExit(code)


def interrupt(code: int = 130) -> None:
    """Ctrl-C: raise KeyboardInterrupt now, or, inside :func:`signals_deferred`, note exit ``code`` (130 = 128 +
    SIGINT) for that block's end, as :func:`terminate` does (the CLI's SIGINT handler calls this). As there, the
    code is recorded as pending first (unless the output is already published): a KeyboardInterrupt raised inside
    a ctypes callback (llvmlite, while numba compiles) is swallowed, and the pending code still stops the run at
    the next publication or the CLI's check once the command returns, with nothing more published."""
    if not _DEFER["committed"]:
        _DEFER["pending"] = code
    if not _held(code):
        raise KeyboardInterrupt


def cli_signals(installed: bool) -> None:
    """Called by the CLI as a command starts: ``installed`` says whether its SIGINT/SIGTERM handlers
    (:func:`interrupt`, :func:`terminate`) are in place (the real process) or not (an in-process run); clears the
    state :func:`commit_point` set."""
    _DEFER.update(committed=False, pending=None, cli=bool(installed))


def commit_point(final: bool = True) -> None:
    """The command's output is published (a folder swapped in): from here a Ctrl-C or SIGTERM no longer stops it,
    so it finishes its clean-up and last messages and exits 0 instead of reporting an interruption after the
    fact (README "Exit codes"). A signal held back meanwhile (:func:`signals_deferred`) is dropped; in the CLI's
    own process SIGINT and SIGTERM are ignored from here to the exit (SIG_IGN, which also covers the
    interpreter's shutdown, when Python's handlers are gone). ``final`` False (a folder output published inside
    another one, as the demo's steps are): signals are dropped only until that inner output's clean-up ends."""
    _DEFER["committed"] = True
    _DEFER["pending"] = None
    if _DEFER["cli"] and final:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in ("SIGINT", "SIGTERM"):
                if hasattr(signal, name):
                    signal.signal(getattr(signal, name), signal.SIG_IGN)


# Names derived from an output's name (the temp ``.<name>.<pid>-<hex>.stratatools-tmp``, the aside
# ``...stratatools-old``, the lock ``.<name>.stratatools-lock``) add up to 38 bytes to it (a pid of up to 10 digits):
# where that would pass the file system's NAME_MAX, ``<name>`` is replaced by its stem (:func:`_stem`), the same
# for the writer and for the clean-up code that finds a dead writer's leftovers by that prefix.
_DERIVED_ROOM = len("..") + 10 + len("-") + 8 + max(len(_TMP_TAG), len(_ASIDE_TAG), len(_LOCK_SUFFIX))


def _name_max(folder: Path) -> int:
    """NAME_MAX (bytes) of the file system that holds ``folder`` or, while it does not exist, its nearest existing
    parent (where it will be created); 255 where the system does not say."""
    p = folder if str(folder) else Path(".")
    for q in [p, *p.parents]:
        try:
            n = os.pathconf(q, "PC_NAME_MAX")
        except (OSError, ValueError):
            continue
        return n if n and n > 0 else 255
    return 255


def _stem(target: Path) -> str:
    """What stands for ``target``'s name in the temp, aside and lock names derived from it: the name itself, or,
    when the longest derived name would not fit in NAME_MAX, the name's first bytes (cut on a character boundary),
    ``~`` and 16 hex digits of the sha256 of the whole name (so two long names sharing their first bytes differ).
    Raises StrataError when the name itself is longer than NAME_MAX (the OS would refuse the output)."""
    name = target.name
    raw = os.fsencode(name)
    nm = _name_max(target.parent)
    if len(raw) > nm:
        raise StrataError(f"{target}: the name is {len(raw)} bytes, and this file system takes names of at most "
                          f"{nm} bytes; choose a shorter name", target)
    room = nm - _DERIVED_ROOM
    if len(raw) <= room:
        return name
    k = max(0, room - 17)
    while 0 < k < len(raw) and (raw[k] & 0xC0) == 0x80:  # not inside a UTF-8 character
        k -= 1
    return os.fsdecode(raw[:k]) + "~" + hashlib.sha256(raw).hexdigest()[:16]


def _unique(folder: Path, name: str, tag: str = _TMP_TAG) -> Path:
    return folder / f".{_stem(folder / name)}.{os.getpid()}-{secrets.token_hex(4)}{tag}"


def probe_writable(target: str | os.PathLike) -> None:
    """Check, before long work, that ``target``'s folder takes a new file: create the unique temp the write would
    create (:func:`create_temp`; the folder is made if missing) and remove it at once, with SIGTERM/SIGINT held back
    meanwhile. Raises StrataError naming the target (read-only file system, permissions, a parent that is a file)."""
    with signals_deferred():
        fd, tmp = create_temp(target)
        try:
            os.close(fd)
        finally:
            os.unlink(tmp)


def create_temp(target: str | os.PathLike, mode: int = 0o666) -> tuple[int, Path]:
    """Create a fresh temp file beside ``target`` (``O_CREAT|O_EXCL|O_NOFOLLOW``, unique name); returns (fd, path).

    Raises StrataError naming the target when the folder cannot be created or written."""
    t = Path(target)
    folder = t.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _fail(t, e, "cannot create its folder") from None
    _clean_stale_temps(folder, t.name)
    for _ in range(16):
        tmp = _unique(folder, t.name)
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode), tmp
        except FileExistsError:
            continue
        except OSError as e:
            raise _fail(t, e) from None
    raise StrataError(f"{t}: cannot create a unique temp file beside it; nothing was changed", t)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _clean_stale_temps(folder: Path, name: str) -> None:
    """Remove temp files a killed writer of ``name`` left in ``folder``: only regular files (or symlinks, which
    are removed themselves, never followed) named ``.<name>.<pid>-<hex>.stratatools-tmp`` (``<name>`` its
    :func:`_stem`) whose process is gone. Best effort."""
    for p in _dead_leftovers(folder / name, _TMP_TAG):
        try:
            if p.is_symlink() or p.is_file():
                os.unlink(p)
        except OSError:
            pass


# Outputs that must not replace an existing file (issue: two runs at once). guard_output() without --force checks
# that the output is absent and records it here; the rename that publishes it is then a no-replace one
# (:func:`_publish_file`), so an output that appeared after the check (another run, same path) is never replaced:
# this run fails with "already exists" and its temp is removed. Once published, the entry is dropped (the file is
# ours: a later rewrite by the same command replaces it). guard_output(..., force=True) drops it too.
_NO_REPLACE: set[str] = set()


def _key(p: str | os.PathLike) -> str:
    return os.path.normpath(os.path.abspath(os.fspath(p)))


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux renameat2(a, b, flags); True when done, False when the call or the flag is unsupported. Raises
    OSError (FileExistsError for RENAME_NOREPLACE onto an existing path)."""
    fn = _RENAMEAT2.get("fn", 0)
    if fn == 0:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        except (OSError, AttributeError):
            fn = None
        _RENAMEAT2["fn"] = fn
    if fn is None:
        return False
    import ctypes

    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


_RENAMEAT2: dict[str, Any] = {}
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` only if ``dst`` does not exist, in one step: renameat2(RENAME_NOREPLACE), else
    (old kernel, file system without it) a hard link ``dst`` -> ``src``'s inode then unlink ``src`` (link fails
    when ``dst`` exists), else, for a folder or a file system without hard links, a check and a rename (the only
    non-atomic case). Raises FileExistsError when ``dst`` exists, or another OSError."""
    if _renameat2(src, dst, _RENAME_NOREPLACE):
        return
    if not os.path.isdir(src) or os.path.islink(src):
        try:
            os.link(src, dst, follow_symlinks=False)
        except FileExistsError:
            raise
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
        else:
            os.unlink(src)
            return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def _exists_error(t: Path) -> StrataError:
    return StrataError(f"{t}: already exists (pass --force to replace it; another run created it while this one "
                       f"ran)", t)


def _publish_file(tmp: Path, t: Path) -> None:
    """Rename the finished temp ``tmp`` to ``t``: over it, or, when guard_output recorded ``t`` without --force,
    only if ``t`` is still absent (:func:`rename_noreplace`). Raises StrataError when ``t`` appeared meanwhile
    (``tmp`` is removed), OSError otherwise. Callers run it inside :func:`signals_deferred` after
    :func:`_stop_if_signalled` (see "Signals and publication")."""
    k = _key(t)
    if k not in _NO_REPLACE:
        os.rename(tmp, t)
    else:
        try:
            rename_noreplace(tmp, t)
        except FileExistsError:
            _unlink_quiet(tmp)
            raise _exists_error(t) from None
        _NO_REPLACE.discard(k)
    if _DEFER["publishing"] == 0:  # an output of its own, not a file of a folder being built
        _DEFER["written"] += 1
        _DEFER["written_paths"] = (_DEFER["written_paths"] + [str(t)])[-_WRITTEN_KEPT:]


def commit_temp(fd: int, tmp: Path, target: str | os.PathLike) -> None:
    """fsync and close ``fd``, rename ``tmp`` over ``target`` (checked again: a regular file or absent), fsync the
    folder. On any error the temp is removed and a one-line StrataError naming the target is raised."""
    t = Path(target)
    try:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        with signals_deferred():  # the rename is the last act under held signals ("Signals and publication")
            check_target(t)
            _stop_if_signalled()
            _publish_file(tmp, t)
    except BaseException as e:
        _unlink_quiet(tmp)
        if isinstance(e, OSError):
            raise _fail(t, e) from None
        raise
    try:
        fsync_dir(t.parent)
    except OSError as e:
        raise _fail(t, e, "written, but the folder could not be synced") from None


def _unlink_quiet(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


class _FdRaw(io.RawIOBase):
    """An unbuffered writable file over a descriptor; every write goes through ``os.write`` (the one place a
    test injects ENOSPC)."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, b) -> int:  # type: ignore[override]
        return os.write(self._fd, b)

    def seek(self, off: int, whence: int = 0) -> int:
        return os.lseek(self._fd, off, whence)

    def tell(self) -> int:
        return os.lseek(self._fd, 0, os.SEEK_CUR)

    def close(self) -> None:  # the fd is closed by AtomicFile
        super().close()


class AtomicFile:
    """Context manager yielding a file object for ``path``; on success the data is fsync'ed and renamed over
    ``path`` (see the write-path notes above), on an exception the temp is removed and ``path`` stays untouched.

    Args:
        path: the output.
        mode: ``"wb"`` (binary) or ``"w"`` (UTF-8 text, LF line ends).
        inputs: paths the output must not be (the command's inputs); the registry is always added.

    Raises:
        StrataError: the target is not a regular file or is an input; any OSError while writing (one line,
            naming ``path``).
    """

    def __init__(self, path: str | os.PathLike, mode: str = "wb", inputs: Iterable[str | os.PathLike] = ()):
        if mode not in ("w", "wb"):
            raise ValueError(f"AtomicFile mode {mode!r}: only 'w' and 'wb'")
        self.path = Path(path)
        self.mode = mode
        self.inputs = list(inputs)
        self.fh: Any = None
        self.tmp: Path | None = None
        self._fd = -1

    def __enter__(self):
        check_target(self.path, self.inputs)
        try:  # (a SIGTERM exit held back during the creation is raised here, inside the guard: see signals_deferred)
            with signals_deferred():
                self._fd, self.tmp = create_temp(self.path)
            buf = io.BufferedWriter(_FdRaw(self._fd), 1 << 20)
            # a file name that is not UTF-8 reaches text as lone surrogates (os.fsdecode): written as \udcXX escapes,
            # so a report naming such a file stays valid UTF-8 instead of failing
            self.fh = buf if self.mode == "wb" else io.TextIOWrapper(buf, encoding="utf-8", errors="backslashreplace",
                                                                     newline="\n")
        except BaseException:  # __exit__ is not called when __enter__ raises
            if self.tmp is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                _unlink_quiet(self.tmp)
            raise
        return self.fh

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert self.tmp is not None
        if exc_type is None:
            try:
                self.fh.flush()
            except OSError as e:
                self._abort()
                raise _fail(self.path, e) from None
            self._detach()
            commit_temp(self._fd, self.tmp, self.path)
            return False
        self._abort()
        if isinstance(exc, OSError):
            raise _fail(self.path, exc) from None
        return False

    def _detach(self) -> None:
        try:
            raw = self.fh.detach() if self.mode == "wb" else self.fh.detach().detach()
            raw.close()
        except (OSError, ValueError):
            pass

    def _abort(self) -> None:
        try:
            self.fh.close()  # may try to flush the rest and fail again
        except (OSError, ValueError):
            pass
        try:
            os.close(self._fd)
        except OSError:
            pass
        assert self.tmp is not None
        _unlink_quiet(self.tmp)


def write_bytes_atomic(path: str | os.PathLike, data: bytes, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Write ``data`` to ``path`` through :class:`AtomicFile`. Raises StrataError (one line) on any failure."""
    with AtomicFile(path, inputs=inputs) as fh:
        fh.write(data)


def write_text_atomic(path: str | os.PathLike, text: str, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Write UTF-8 ``text`` (LF line ends) to ``path`` through :class:`AtomicFile`."""
    write_bytes_atomic(path, text.encode("utf-8", "backslashreplace"), inputs)  # see AtomicWriter: \udcXX escapes


def write_json_atomic(path: str | os.PathLike, obj: Any, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Write ``obj`` as indented, key-sorted JSON (deterministic bytes) through :class:`AtomicFile`."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n", inputs)


def write_files_atomic(items: "list[tuple[str | os.PathLike, bytes]]",
                       inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Write several files as one output set: every temp file is written and fsync'ed first (a full disk or any
    error then removes them all and changes nothing), then every target is checked again (a regular file or
    absent; absent still where :func:`guard_output` recorded it without --force), and only then are they renamed in
    the order given (put the file whose presence marks completion last: an artefact after its sidecar). A target
    refused there refuses the whole set: nothing is published. A rename that fails midway (an I/O error, a race
    after the checks) puts back the files renamed before it (each previous file is kept as a hard link until the
    set is in). Raises StrataError (one line, naming the refused file and, for a set, that none was written)."""
    staged: list[tuple[int, Path, Path]] = []
    try:
        for path, data in items:
            t = check_target(path, inputs)
            with signals_deferred():  # created and recorded as one step (see signals_deferred)
                fd, tmp = create_temp(t)
                staged.append((fd, tmp, t))
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fsync(fd)
            except OSError as e:
                raise _fail(t, e) from None
    except BaseException:
        for fd, tmp, _t in staged:
            try:
                os.close(fd)
            except OSError:
                pass
            _unlink_quiet(tmp)
        raise
    for fd, _tmp, _t in staged:
        os.close(fd)
    # the whole set is renamed in one held block: a signal held back before the first rename publishes nothing,
    # one that arrives during the renames is raised after the last ("Signals and publication"). Every target is
    # checked again before the first rename (a target that became a folder, a FIFO, a link to one, or, without
    # --force, a file another run published since the staging refuses the whole set, not its second half), and a
    # rename that still fails midway (a race after the checks, an I/O error) puts the files renamed before it back
    done: list[tuple[Path, Path | None, bool]] = []  # (target renamed, a hard link to its previous file, existed)
    i = 0
    try:
        with signals_deferred():
            _stop_if_signalled()
            for _fd, _tmp, t in staged:
                check_target(t)
                if _key(t) in _NO_REPLACE and os.path.lexists(t):
                    raise _exists_error(t)
            for i, (_fd, tmp, t) in enumerate(staged):
                existed = os.path.lexists(t)
                prev = _backup(t) if existed and i < len(staged) - 1 else None
                nr = _key(t) in _NO_REPLACE
                try:
                    _publish_file(tmp, t)
                except BaseException:
                    if prev is not None:
                        _unlink_quiet(prev)
                    raise
                done.append((t, prev, existed))
                if nr:
                    _NO_REPLACE.add(_key(t))  # (until the whole set is in: an undone file is again absent)
            i = len(staged)
    except BaseException as e:
        for _f, rest, _r in staged[i:]:
            _unlink_quiet(rest)
        lost: list[Path] = []
        if i < len(staged):  # (a signal raised as the block ends comes after the whole set is in: it stays)
            lost = _undo_set(done)
        else:
            _drop_backups(done)
        if lost:  # (no hard links: the previous file could not be kept) say so rather than "nothing was changed"
            t = staged[min(i, len(staged) - 1)][2]
            why = _fail(t, e).args[0].rsplit("; nothing was changed", 1)[0] if isinstance(e, OSError) else str(e)
            raise StrataError(f"{why}; {', '.join(map(str, lost))} of this set was already replaced and could not "
                              f"be put back: run again to write the whole set", t) from None
        if isinstance(e, OSError):
            raise _fail(staged[min(i, len(staged) - 1)][2], e) from None
        if isinstance(e, StrataError) and len(staged) > 1:
            names = ", ".join(str(t) for _fd, _tmp, t in staged)
            raise StrataError(f"{e}; nothing of the set was written ({names} stay as they were)", e.path) from None
        raise
    _drop_backups(done)
    for d in {t.parent for _f, _tmp, t in staged}:
        fsync_dir(d)


def _backup(t: Path) -> Path | None:
    """A hard link to the file ``t`` under a unique temp name beside it (what a failed set puts back), or None
    when the file system takes no hard link (that file then cannot be put back)."""
    for _ in range(16):
        b = _unique(t.parent, t.name)
        try:
            os.link(t, b, follow_symlinks=False)
            return b
        except FileExistsError:
            continue
        except OSError:
            return None
    return None


def _drop_backups(done: "list[tuple[Path, Path | None, bool]]") -> None:
    """The set is in: its targets are this run's own files (a rewrite replaces them), the backups go."""
    for t, prev, _existed in done:
        _NO_REPLACE.discard(_key(t))
        if prev is not None:
            _unlink_quiet(prev)


def _undo_set(done: "list[tuple[Path, Path | None, bool]]") -> list[Path]:
    """Put back the files of a set renamed before a later one failed, newest first: the previous file (its hard
    link) renamed over the new one, or the new one removed where there was none. Where the previous file could not
    be linked (no hard links) or put back, the new one stays: returns those targets. Best effort."""
    lost: list[Path] = []
    for t, prev, existed in reversed(done):
        try:
            if prev is not None:
                os.rename(prev, t)
            elif not existed:
                os.unlink(t)
            else:
                lost.append(t)
        except OSError:
            lost.append(t)
            if prev is not None:
                _unlink_quiet(prev)
    if done:
        try:
            fsync_dir(done[0][0].parent)
        except OSError:
            pass
    return lost[::-1]


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file (:func:`sha256_fd`: memory-mapped windows, no copies). Raises OSError."""
    with open(path, "rb") as fh:
        digest = sha256_fd(fh.fileno(), os.fstat(fh.fileno()).st_size)
    assert digest is not None
    return digest


def guard_output(out: str | os.PathLike, inputs: Iterable[str | os.PathLike], force: bool) -> Path:
    """Refuse an output that is one of the inputs (or the registry), that exists and is not a regular file, or
    that exists (a dangling symlink included) without ``force``.

    Without ``force`` the output is also recorded for a no-replace publication: the write that publishes it later
    (:class:`AtomicFile`, :func:`write_files_atomic`) fails with "already exists (pass --force ...)" instead of
    replacing a file that another run created after this check (two runs at once).

    Temp files a killed writer of ``out`` left beside it are removed first (the rules of the write's own sweep,
    :func:`_clean_stale_temps`), so a refused run cleans up too.

    Returns the output as a Path. Raises StrataError with the fix.
    """
    return guard_outputs([out], inputs, force)[0]


def guard_outputs(outs: Iterable[str | os.PathLike], inputs: Iterable[str | os.PathLike], force: bool) -> list[Path]:
    """:func:`guard_output` for the files of one output set (a profile and its sidecar): the dead writers' temp
    files of every file are removed first, so a run refused for the first file still cleans up beside the others.
    Returns the outputs as Paths. Raises StrataError with the fix."""
    outs, inputs = [Path(o) for o in outs], list(inputs)
    for o in outs:
        _clean_stale_temps(o.parent, o.name)
    return [_guard_checked(o, inputs, force) for o in outs]


def _guard_checked(out: Path, inputs: list, force: bool) -> Path:
    """:func:`guard_output` after its clean-up."""
    out = check_target(out, inputs)
    if (out.exists() or out.is_symlink()) and not force:
        raise StrataError(f"{out}: already exists (pass --force to replace it)", out)
    if force:
        _NO_REPLACE.discard(_key(out))
    else:  # published with a no-replace rename: a file another run creates meanwhile is not replaced
        _NO_REPLACE.add(_key(out))
    return out


def refuse_stdout(out: str | os.PathLike | None, option: str, what: str, example: str) -> None:
    """Refuse ``-`` as an output path where the output cannot go to stdout (a binary layout, or one written
    through a temp file and renamed); ``option`` names the option (``--trace-out``), ``what`` the output, and
    ``example`` a file path to suggest. Without this, ``-`` would be a file literally named ``-``.

    Raises StrataError (one line, with the fix) when ``out`` is ``-``.
    """
    if out is not None and str(out) == "-":
        raise StrataError(f"{option} -: {what} is not written to stdout; give a file path, e.g. {option} {example}")


# ----------------------------------------------------------------------------------------------- inputs
def check_input(path: str | os.PathLike, what: str = "input") -> Path:
    """Refuse, without opening it, an input that would hang or mislead a reader: a FIFO, socket or device (an
    ``open`` of a FIFO blocks until a writer comes), or a symlink loop. A missing file or a folder is left to
    the caller's own message. Returns the path. Raises StrataError (one line, with the fix)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StrataError(f"{p}: symlink loop (the link points back at itself); point it at the real {what}",
                              p) from None
        return p
    if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
        return p
    kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
    raise StrataError(f"{p}: is {kind}, not a regular file; give the {what} as a file (save the stream to a file "
                      f"first)", p)


# ------------------------------------------------------------------------------- whole-folder outputs
class _Lock:
    def __init__(self, target: Path, fd: int, path: Path):
        self.target, self.fd, self.path = target, fd, path

    def journal(self) -> dict[str, Any]:
        try:
            raw = b""
            while True:  # the whole file: a swap's journal lists the output's own names and may pass 64 KiB
                chunk = os.pread(self.fd, 1 << 20, len(raw))
                if not chunk:
                    break
                raw += chunk
            rec = json.loads(raw.decode("utf-8")) if raw.strip() else {}
            return rec if isinstance(rec, dict) else {}
        except (OSError, ValueError):
            return {}

    def set_journal(self, rec: dict[str, Any]) -> None:
        data = json.dumps(rec, sort_keys=True).encode("utf-8")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)


def lock_path(target: str | os.PathLike) -> Path:
    """The advisory lock file of an output: ``.<name>.stratatools-lock`` beside it (``<name>``: :func:`_stem`)."""
    t = Path(target)
    return t.parent / f".{_stem(t)}{_LOCK_SUFFIX}"


@contextmanager
def output_lock(target: str | os.PathLike) -> Iterator[_Lock]:
    """Hold an exclusive advisory lock (``fcntl.flock``) on ``.<name>.stratatools-lock`` beside ``target`` for the
    duration of a write. A second writer of the same output does not wait: it raises StrataError at once (one
    line: another run is writing it), except behind a run that is only cleaning up leftovers (:func:`tidy_output`),
    which it waits for, a bounded time (:func:`_take_lock`). The lock file also carries the swap journal of
    :func:`publish_dir`.

    Lock file lifetime: it is removed when the holder leaves with an empty journal (nothing for a later run to
    recover); a run killed mid-swap leaves it, journal inside, for the next writer. Removing a lock file races
    with a run that opened it just before the unlink and locks it just after the holder closes it: that run
    would hold a lock on a file no path names any more, while a third run creates and locks a new one. So a
    run, once it holds the lock, checks that the path still names the inode it locked, and starts over when not
    (the usual rule for removable lock files); and the holder unlinks only the inode it holds.
    """
    import fcntl

    t = Path(target)
    lp = lock_path(t)
    try:
        lp.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a parent is a file: say so, not "File exists"
        raise StrataError(f"{t}: a parent of this path is not a folder; choose another output path", t) from None
    except OSError as e:
        raise _fail(t, e, f"cannot create its lock file {lp.name}") from None
    fd, locked = -1, False
    try:
        for _ in range(100):
            with signals_deferred():  # the fd is known to the clean-up below as soon as the file exists
                try:
                    fd = os.open(lp, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o666)
                except OSError as e:
                    raise _fail(t, e, f"cannot create its lock file {lp.name}") from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StrataError(f"{lp}: lock file is not a regular file; remove it", lp)
            _take_lock(fd, t, lp)
            locked = True
            if _names_inode(lp, st):
                break
            # the previous holder removed the file between our open and our lock: take the new one
            with signals_deferred():
                os.close(fd)
                fd, locked = -1, False
        else:
            raise StrataError(f"{t}: could not take the lock {lp.name} (it kept being replaced); try again", t)
        yield _Lock(t, fd, lp)
    finally:
        with signals_deferred():  # a signal does not leave the lock file behind
            if fd >= 0:
                try:
                    if not locked and stat.S_ISREG(os.fstat(fd).st_mode):  # stopped (SIGTERM) before locking it
                        try:
                            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                            locked = True
                        except OSError:
                            pass
                    if locked and _journal_empty(fd) and _names_inode(lp, os.fstat(fd)):
                        os.unlink(lp)  # still holding the lock: a run that opened it meanwhile starts over (above)
                except OSError:
                    pass  # left in place: harmless, the next run takes it
                finally:
                    try:
                        os.close(fd)
                    except OSError:
                        pass


_CLEAN_WAIT_S = 10.0   # how long a run waits for another one that only cleans leftovers (tidy_output) to finish
_WRITER_GRACE_S = 0.5  # how long an empty journal is read again: a cleaner marks itself just after it locks


def _lock_wait(s: float) -> None:
    """Sleep ``s`` seconds between two tries of a lock a cleaner holds (a test hook)."""
    import time

    time.sleep(s)


def _take_lock(fd: int, t: Path, lp: Path) -> None:
    """``flock`` the lock file ``fd`` of output ``t`` (exclusive, never blocking). When another process holds it,
    its journal (readable without the lock) says what it does: ``{"cleaning": pid}`` is :func:`tidy_output`
    cleaning up what a killed run left (a short job); this run then tries again every 50 ms, up to
    ``_CLEAN_WAIT_S`` seconds, and then says that a cleaner is still at work. Any other holder is writing the
    output: refused at once (an empty journal is read again for ``_WRITER_GRACE_S``, the moment between a
    cleaner's lock and its mark, or between its last step and its release). Raises StrataError (one line)."""
    import fcntl
    import time

    start = time.monotonic()
    seen_cleaner = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        try:
            raw = os.pread(fd, 1 << 16, 0)
            rec = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        except (OSError, ValueError):
            rec = None
        pid = rec.get("cleaning") if isinstance(rec, dict) else None
        cleaner = isinstance(pid, int) and not isinstance(pid, bool) and _pid_alive(pid)
        seen_cleaner = seen_cleaner or cleaner
        waited = time.monotonic() - start
        if (cleaner or seen_cleaner) and waited >= _CLEAN_WAIT_S:
            raise StrataError(f"{t}: another stratatools run is cleaning up what an interrupted run left beside this "
                              f"output and has not finished in {_CLEAN_WAIT_S:g} s ({lp.name} is locked); try again "
                              f"when it has", t)
        if not (cleaner or (rec == {} and (seen_cleaner or waited < _WRITER_GRACE_S))):
            raise StrataError(f"{t}: another stratatools run is writing this output now ({lp.name} is "
                              f"locked); wait for it to finish or choose another output path", t)
        _lock_wait(0.05)


def _names_inode(p: Path, st: os.stat_result) -> bool:
    """True when path ``p`` (not followed) is the file ``st`` describes."""
    try:
        cur = os.stat(p, follow_symlinks=False)
    except OSError:
        return False
    return (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino)


def _journal_empty(fd: int) -> bool:
    """True when the lock file holds no swap journal (empty, or ``{}``); False when it cannot be read."""
    try:
        raw = os.pread(fd, 1 << 16, 0)
    except OSError:
        return False
    return raw.strip() in (b"", b"{}")


def _ours(p: Path, target: Path) -> bool:
    """True for a temp or aside folder this module made for ``target`` (name pattern), never anything else."""
    n = p.name
    return p.parent == target.parent and n.startswith(f".{_stem(target)}.") and (
        n.endswith(_TMP_TAG) or n.endswith(_ASIDE_TAG))


def recover(lock: _Lock) -> list[str]:
    """Finish or undo a swap that a killed run left half done (under ``lock``): when the output is missing and the
    journal names an aside folder, the aside is renamed back; leftover temp/aside folders named in the journal are
    then removed (only those, and only when their names are ours). When the journal names the output's own names
    (a swap's), an entry of such a folder with another name is another program's file: it is moved into the output
    folder, or, where that holds a different entry of that name, the folder is kept (:func:`_retire`). Returns
    notes of what was done."""
    t = lock.target
    j = lock.journal()
    notes: list[str] = []
    names = [Path(x) for x in j.get("paths", []) if isinstance(x, str)]
    names = [p for p in names if _ours(p, t)]
    own = j.get("own")  # a swap's journal: the output's own names (see publish_dir)
    own_p = (lambda n, s=frozenset(x for x in own if isinstance(x, str)): n in s) if isinstance(own, list) else None
    ip = j.get("in_place")
    if isinstance(ip, str) and Path(ip) in names and Path(ip).is_dir() and t.is_dir() and not t.is_symlink():
        _finish_in_place(t, Path(ip), j.get("last", []), j.get("stale", []))
        notes.append(f"{t}: finished publishing the output an interrupted run left half done")
    aside = [p for p in names if p.name.endswith(_ASIDE_TAG) and p.exists()]
    if not os.path.lexists(t) and aside:
        os.rename(aside[0], t)
        notes.append(f"{t}: restored the previous output left aside by an interrupted run")
    failed = False
    for p in names:
        if os.path.lexists(p):
            try:
                kept = _retire(p, t, own_p)  # another program's file in it is moved back into the output, not lost
            except OSError:
                failed = True  # the journal keeps naming it: a later run tries again
                continue
            notes.append(f"{p}: removed a leftover of an interrupted run" if kept is None else kept)
    if j and not failed:
        lock.set_journal({})
        fsync_dir(t.parent)
    return notes


def _finish_in_place(t: Path, tmp: Path, last: Any, stale: Any) -> None:
    """Roll an in-place publish (:func:`_publish_in_place`) that a kill cut short forward: the files still in the
    complete temp folder ``tmp`` are renamed into ``t``, the journal's stale files of the previous output removed,
    its markers (``last``) renamed in last. Only plain names are used (no separators, no ``.``/``..``)."""
    def plain(v: Any) -> bool:
        return isinstance(v, str) and v not in ("", ".", "..") and os.sep not in v and "/" not in v

    marks = [n for n in (last if isinstance(last, list) else []) if plain(n)]
    # a marker still in the temp folder is not published yet: the one in t (if any) is the previous output's, and
    # it goes before anything else moves (the killed run may have been stopped before it removed it), so that a
    # kill of this run too never leaves the previous marker beside a mix of old and new files
    gone = False
    for n in marks:
        p = t / n
        if os.path.lexists(tmp / n) and (p.is_symlink() or p.is_file()):
            os.unlink(p)
            gone = True
    if gone:
        fsync_dir(t)
    left = sorted(n for n in os.listdir(tmp) if n not in marks)
    for n in left:
        if not os.path.isdir(t / n) or os.path.islink(t / n):
            os.rename(tmp / n, t / n)
    for n in (stale if isinstance(stale, list) else []):
        if plain(n) and n not in marks and not (tmp / n).exists():
            p = t / n
            if p.is_symlink() or p.is_file():
                _unlink_quiet(p)
    for n in marks:
        if os.path.lexists(tmp / n):
            os.rename(tmp / n, t / n)
    fsync_dir(t)


def _own_names(t: Path, tmp: Path, keep: Callable[[str], bool] | None) -> list[str] | None:
    """The names a swap treats as the output's own (None: all of them, ``keep`` None): every entry of the new
    build ``tmp`` except those carried over from ``t`` (names ``keep`` accepts that ``t`` holds), and the previous
    output's entries in ``t`` (names ``keep`` refuses). Any other name found in the previous output after the
    swap is another program's file, written after the carry-over."""
    if keep is None:
        return None
    try:
        old = os.listdir(t)
    except (FileNotFoundError, NotADirectoryError):
        old = []
    theirs = {n for n in old if keep(n)}
    return sorted((set(os.listdir(tmp)) | set(old)) - theirs)


def _own_pred(keep: Callable[[str], bool] | None) -> Callable[[str], bool]:
    """``keep``'s complement: True for the output's own names (every name when ``keep`` is None)."""
    return (lambda n: True) if keep is None else (lambda n: not keep(n))


def _same_entry(a: Path, b: Path) -> bool:
    """True when ``b`` holds what ``a`` holds: the same inode (a hard link), the same symlink target, or a regular
    file of the same bytes (a copy). Not followed."""
    import filecmp

    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    if (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino):
        return True
    try:
        if stat.S_ISLNK(sa.st_mode) and stat.S_ISLNK(sb.st_mode):
            return os.readlink(a) == os.readlink(b)
        if stat.S_ISREG(sa.st_mode) and stat.S_ISREG(sb.st_mode) and sa.st_size == sb.st_size:
            return filecmp.cmp(a, b, shallow=False)
    except OSError:
        pass
    return False


def _retire(old: Path, t: Path, own: Callable[[str], bool] | None, moved_names: list[str] | None = None) -> str | None:
    """Remove ``old`` (a previous output folder after a swap, a dead run's temp or aside folder), first moving
    back into the output folder ``t`` each entry that is not the output's own (``own(name)`` False: another
    program's file written into the old folder after the last carry-over) and that ``t`` lacks. An entry ``t``
    already holds (:func:`_same_entry`: carried over) needs nothing. An entry that cannot be moved back (``t``
    holds a different entry of that name) is never deleted: ``old`` is kept with those entries only, renamed to
    an aside name (``.<name>.<pid>-<hex>.stratatools-old``) if it had a temp name; a later publish tries again
    (:func:`_sweep_asides`). ``own`` None, or ``t`` not a folder: ``old`` is removed whole (all of it is the
    output's). Returns None when ``old`` is gone, else a note naming the kept folder; the names moved into ``t``
    are appended to ``moved_names`` when given. Raises OSError."""
    if not os.path.lexists(old):
        return None
    if own is None or old.is_symlink() or not old.is_dir() or t.is_symlink() or not t.is_dir():
        _remove_tree(old)
        return None
    left: list[str] = []
    moved = False
    for e in list(os.scandir(old)):
        n, src = e.name, Path(e.path)
        if own(n) or _LOCK_SUFFIX in n or _same_entry(src, t / n):
            continue
        try:
            rename_noreplace(src, t / n)
            moved = True
            if moved_names is not None:
                moved_names.append(n)
        except OSError:
            left.append(n)
    if moved:
        fsync_dir(t)
    if not left:
        _remove_tree(old)
        if not os.path.lexists(old):
            return None
        # not all removed (an entry written into it meanwhile, through an open handle, or one that cannot be
        # removed): what is left is kept under an aside name, which only _sweep_asides removes, with these checks
        left = sorted(os.listdir(old))
    for e in list(os.scandir(old)):
        if e.name not in left:
            _remove_tree(Path(e.path))
    if not old.name.endswith(_ASIDE_TAG):
        dst = _unique(t.parent, t.name, _ASIDE_TAG)
        os.rename(old, dst)
        old = dst
    fsync_dir(t.parent)
    return (f"{old}: kept: it holds {', '.join(sorted(left))}, another program's file(s) written into the previous "
            f"output, and {t} holds a different entry of that name; move what you need, then remove it")


def _remove_tree(p: Path) -> None:
    import shutil

    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        _unlink_quiet(p)


def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux renameat2 RENAME_EXCHANGE); False when unsupported."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


@contextmanager
def publish_dir(target: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (),
                keep: Callable[[str], bool] | None = None,
                refuse: Callable[[Path], None] | None = None,
                last: Iterable[str] = (), step: Callable[[str], None] | None = None,
                whole: bool = False) -> Iterator[Path]:
    """Build a folder output in a unique sibling temp folder and swap it in whole on success.

    Yields the (empty) temp folder to write into. On success the temp folder replaces ``target`` in one step
    (``renameat2(RENAME_EXCHANGE)`` where the kernel and file system support it, else: old folder renamed aside,
    new one renamed in, old one removed; each step recorded first in the lock file's journal so a run killed
    in between is finished or undone by the next writer, :func:`recover`). On any exception, kill, or full disk
    the previous ``target`` is untouched and the temp folder is removed (or, after a kill, by the next run).
    Holds :func:`output_lock` throughout (a concurrent writer is refused).

    ``keep(name)``: True for the names of an existing ``target`` that are not this output's (other programs'
    files). When ``target`` holds such entries at publish time (any kind: files, subfolders), the folder is not
    swapped: the output's own files are renamed into it one by one from the temp folder (each written through
    the write path already: temp + fsync, then a rename), the other entries are never read, moved or removed
    (a program writing there meanwhile loses nothing), files of a previous output that the new one lacks are
    removed, and the names in ``last`` (markers: report.json, native_experts.txt, release.json) are removed from
    the folder first and renamed in last, so their presence means the output is complete. A kill midway leaves
    each file either old or new, never partial, and no marker; the temp folder with the files not yet moved is
    removed by the next run (:func:`tidy_output`). Without such entries (a new folder, or one holding only a
    previous output) the folder is swapped whole. An existing entry with one of the output's names that is a
    folder is refused before the build (a file cannot replace it). ``keep`` None: the whole folder is this
    output's (always swapped).

    ``whole``: always swap the folder (an output whose own entries are folders, the demo's, cannot be published
    file by file); the entries ``keep`` accepts are carried into the new folder (regular files as hard links,
    symlinks recreated; a folder or special file among them is refused: the caller's ``refuse`` should name it
    before the build), and one written into the old folder after that is moved back as in any swap. A file put
    inside one of the output's own folders that the new build lacks is carried to the same place (with a note).

    Permissions: the published folder keeps an existing ``target``'s mode (permission bits, setgid and sticky
    included) and, where the process may set it, its group; they are set on the temp folder (created 0700)
    before anything is written into it, so a private folder never becomes readable to others, even for a
    moment. A new ``target`` gets the mode a plain mkdir gives (umask, a setgid parent's group).

    After a swap the previous output's folder is removed less any entry another program wrote into it after the
    carry-over (moved into the new folder; :func:`_retire`), and after any publish the aside folders of dead runs
    that no journal names are sorted out the same way (:func:`_sweep_asides`). What the clean-up did (a leftover
    removed, a folder kept beside the output because it holds another program's file) is recorded for
    :func:`take_notes`.

    ``step(name)``: a test hook called before each file of an in-place publish (and with ``""`` before a swap).

    ``refuse(target)``: the caller's "already exists (pass --force)" check, run again under the lock, before the
    build and just before the swap (a run that checked before taking the lock cannot replace an output another
    run published meanwhile); it raises StrataError to refuse. A new ``target`` is renamed in with no-replace
    (:func:`rename_noreplace`).

    Signals: the swap runs with SIGINT/SIGTERM held back (:func:`signals_deferred`) and ends in
    :func:`commit_point`; an interrupt before it leaves the old output and removes the temp folder and the lock,
    one after it is dropped: the command completes and exits 0 (the new output is in place).

    Raises:
        StrataError: the target is an input, a non-folder, a locked output; ``refuse``'s error; a new target that
            appeared meanwhile (already exists); any OSError (one line).
    """
    t = Path(target)
    for i in list(inputs) + registry_input():
        ip = Path(i)
        if _same(t, ip):
            raise StrataError(f"{t}: output folder would replace the input {i}; choose another output folder", t)
        if _inside(ip, t) and not _kept(ip, t, keep):
            raise StrataError(f"{t}: the input {i} is inside this output folder, which is replaced whole; move the "
                              f"input out of it or choose another output folder", t)
    if t.name in ("", ".", "..") or t.resolve() == Path.cwd().resolve():
        raise StrataError(f"{t}: name a new or existing subfolder as the output, not the current folder", t)
    if os.path.lexists(t) and (t.is_symlink() or not t.is_dir()):
        if t.is_symlink():
            raise StrataError(f"{t}: is a symbolic link (to {os.readlink(t)}); an output folder is not written "
                              f"through a link: give the folder's own path", t)
        raise StrataError(f"{t}: exists and is not a folder; choose another output folder", t)
    if not whole:
        check_own_entries(t, keep)
    last = list(last)
    _DEFER["publishing"] += 1
    try:
        with output_lock(t) as lock:
            try:
                _record(recover(lock))
                left = [x for x in lock.journal().get("paths", []) if isinstance(x, str) and os.path.lexists(x)]
                if left:  # a publish now would overwrite the journal that names it (and may hold a user's file)
                    raise StrataError(f"{t}: {left[0]} is left from an interrupted run and could not be sorted out "
                                      f"(check its permissions and free space); nothing was changed", t)
                _record(f"{p}: removed a leftover of an interrupted run" for p in _clean_dead_temps(t, lock))
            except OSError as e:
                raise _fail(t, e, "cannot create its temp folder") from None
            tmp = _unique(t.parent, t.name)
            made = False  # the temp folder is ours (mkdir succeeded): only then does the guard below remove it
            swapped = False  # tmp names the previous output (the swap is done)
            try:
                # the guard is in place before the folder exists; the journal names it first (a SIGKILL is undone by
                # the next run), and mkdir + "made" are one step for a SIGTERM (signals_deferred)
                if refuse is not None:
                    refuse(t)
                try:
                    lock.set_journal({"paths": [str(tmp)]})
                    try:
                        old = os.stat(t, follow_symlinks=False)
                    except FileNotFoundError:
                        old = None
                    with signals_deferred():
                        if old is None:
                            os.mkdir(tmp)
                        else:
                            os.mkdir(tmp, 0o700)
                        made = True
                    if old is not None:
                        _copy_mode(old, tmp)
                except OSError as e:
                    raise _fail(t, e, "cannot create its temp folder") from None
                yield tmp
                _fsync_tree(tmp)
                if refuse is not None:
                    refuse(t)
                if keep is not None and not whole and _others(t, keep):
                    _publish_in_place(t, tmp, keep, last, step, lock)
                    _remove_tree(tmp)
                    lock.set_journal({})
                    _record(_sweep_asides(t, keep))
                    return
                if step is not None:
                    step("")
                # entries that appeared since the check above (a race): kept if files; with ``whole`` also the files
                # put inside the output's own folders
                _carry_over(t, tmp, keep, nested=whole)
                # An entry another program writes into the old folder after _carry_over (the window up to the swap,
                # or later through an open folder handle) is in the previous output's folder after the swap. It is
                # not removed with it: _retire moves it back into the new folder. The journal names the output's
                # own names, so that recover() does the same for a run killed between the swap and _retire.
                own = _own_names(t, tmp, keep)
                with signals_deferred():  # the swap and commit_point are one step for SIGINT/SIGTERM
                    if os.path.lexists(t):
                        aside = _unique(t.parent, t.name, _ASIDE_TAG)
                        lock.set_journal({"paths": [str(tmp), str(aside)], **({} if own is None else {"own": own})})
                        if not _renameat2_exchange(tmp, t):
                            os.rename(t, aside)
                            os.rename(tmp, t)
                            tmp = aside
                        # tmp now holds the previous output
                        swapped = True
                    else:
                        try:
                            rename_noreplace(tmp, t)
                        except FileExistsError:
                            raise _exists_error(t) from None
                    commit_point(final=_DEFER["publishing"] == 1)
                fsync_dir(t.parent)
            except BaseException as e:
                recover_exc = e
                with signals_deferred():  # a second signal does not cut the clean-up short
                    try:
                        if not os.path.lexists(t):
                            recover(lock)  # puts an aside folder back
                        if made and os.path.lexists(tmp):
                            # the new build, or after the swap the previous output (other programs' files moved back)
                            _record(filter(None, [_retire(tmp, t, _own_pred(keep) if swapped else None)]))
                        lock.set_journal({})
                    except OSError:
                        pass
                if isinstance(recover_exc, OSError):
                    raise _fail(t, recover_exc) from None
                raise
            try:  # the previous output, less other programs' files (moved back into the new folder)
                _record(filter(None, [_retire(tmp, t, _own_pred(keep))]))
            except OSError:
                pass  # the output is published; the journal keeps naming the old folder: the next run sorts it out
            else:
                lock.set_journal({})
            _record(_sweep_asides(t, keep))  # and older aside folders no journal names
    finally:
        # outside the CLI's process, or for a folder inside another one (the demo's), signals are dropped only
        # until this folder is out
        if not _DEFER["cli"] or _DEFER["publishing"] > 1:
            _DEFER["committed"] = False
        _DEFER["publishing"] -= 1


def _copy_mode(old: os.stat_result, folder: Path) -> None:
    """Give ``folder`` the group (where allowed: owner, or a member of it) and then the mode bits of ``old``
    (the group first: changing it may clear setgid)."""
    if hasattr(os, "chown") and old.st_gid != os.stat(folder).st_gid:
        try:
            os.chown(folder, -1, old.st_gid)
        except OSError:
            pass  # not a member of that group: the folder keeps ours, the mode bits below still apply
    os.chmod(folder, stat.S_IMODE(old.st_mode))


def _others(t: Path, keep: Callable[[str], bool]) -> list[str]:
    """Names in the existing folder ``t`` that are not this output's (``keep`` accepts them); [] when absent."""
    try:
        return sorted(e.name for e in os.scandir(t) if keep(e.name))
    except (FileNotFoundError, NotADirectoryError):
        return []


def refuse_foreign_folder(target: str | os.PathLike, keep: Callable[[str], bool], what: str, option: str) -> None:
    """Refuse (the caller's no-``--force`` check) an existing folder output ``target`` that holds entries not
    of this output (``keep`` accepts their names), e.g. a shared folder such as /tmp: writing the output's files
    among them needs ``--force``. Raises StrataError (one line naming a few of them and both ways out)."""
    t = Path(target)
    if not t.is_dir() or t.is_symlink():
        return
    others = sorted(e.name for e in os.scandir(t) if keep(e.name))
    if others:
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        raise StrataError(f"{t}: an existing folder that is not a {what} (it holds {others[0]}{more}); choose a new "
                          f"{option} folder, or pass --force to add the {what} beside its files", t)


def check_own_entries(target: str | os.PathLike, keep: Callable[[str], bool] | None) -> None:
    """Refuse, before any work, an existing folder output ``target`` in which one of the output's own names
    (``keep`` refuses it) is a folder or a special file: no output file can replace it, with or without --force.
    Raises StrataError (one line, no --force advice)."""
    t = Path(target)
    if keep is None or not t.is_dir() or t.is_symlink():
        return
    for e in os.scandir(t):
        if keep(e.name) or e.is_symlink() or e.is_file(follow_symlinks=False):
            continue
        kind = "a folder" if e.is_dir(follow_symlinks=False) else "not a regular file"
        raise StrataError(f"{t / e.name}: is {kind}, where this output writes a file of that name; move it away "
                          f"or choose another output folder", t / e.name)


def _publish_in_place(t: Path, tmp: Path, keep: Callable[[str], bool], last: list[str],
                      step: Callable[[str], None] | None, lock: Any = None) -> None:
    """Move the finished files of the temp folder ``tmp`` into the existing folder ``t`` one by one (each a
    rename of a synced file); never touch an entry ``keep`` accepts. Order: the previous output's ``last`` files
    are removed first (from then on their absence says "incomplete"), then the other files are renamed in, then
    files of the previous output that the new one lacks are removed, then the ``last`` files are renamed in.
    :func:`commit_point` comes with the first change. Before it, the lock's journal names the temp folder, the
    markers and the stale files, so that a run killed midway is finished by the next writer (:func:`recover`).

    The SIGKILL window (not closed: closing it would mean swapping the folder, which moves other programs'
    files): from the removal of the first previous marker to the rename of the last new one, the folder holds
    some new and some old files, each whole, and no marker. A SIGKILL there leaves it so, with the complete temp
    folder and the journal, until the next command naming the output finishes the publish (:func:`recover`,
    :func:`_finish_in_place`, which removes a previous marker first too, so a kill of that run never shows the
    previous marker beside a mix). A kill before the journal names the publish (or between the journal's
    truncation and its rewrite) changes nothing in ``t``: the temp folder is then a dead run's and is removed.
    SIGINT/SIGTERM are dropped for the whole sequence (:func:`commit_point`)."""
    names = sorted(os.listdir(tmp))
    marks = [n for n in last if n in names]
    order = [n for n in names if n not in marks] + marks
    stale = [e.name for e in os.scandir(t) if not keep(e.name) and e.name not in names
             and (e.is_symlink() or e.is_file(follow_symlinks=False))]
    if lock is not None:
        lock.set_journal({"paths": [str(tmp)], "in_place": str(tmp), "last": marks, "stale": stale})
    with signals_deferred():  # from the first change on, the output is being published: finish it
        commit_point(final=_DEFER["publishing"] == 1)
        for n in marks:
            p = t / n
            if p.is_symlink() or p.is_file():
                os.unlink(p)
        if marks:
            fsync_dir(t)
        for n in order:
            if n == (marks[0] if marks else None):
                for s_ in stale:
                    _unlink_quiet(t / s_)
                stale = []
            if step is not None:
                step(n)
            src = tmp / n
            if src.is_dir() and not src.is_symlink():
                try:
                    rename_noreplace(src, t / n)
                except FileExistsError:
                    raise StrataError(f"{t / n}: already exists; move it away or choose another output folder",
                                      t / n) from None
            else:
                os.rename(src, t / n)
        for s_ in stale:
            _unlink_quiet(t / s_)
        fsync_dir(t)


def _dead_leftovers(t: Path, tag_suffix: str, folders_only: bool = False) -> list[Path]:
    """Entries beside output ``t`` named ``.<name>.<pid>-<hex8><tag_suffix>`` (``<name>`` its :func:`_stem`) whose
    process is gone (never this one's, never a live one's; a PID of other than ASCII digits is not ours), sorted.
    ``folders_only``: real folders only (no links)."""
    pre = f".{_stem(t)}."
    out: list[Path] = []
    try:
        entries = list(os.scandir(t.parent))
    except OSError:
        return out
    for e in entries:
        n = e.name
        if not (n.startswith(pre) and n.endswith(tag_suffix)):
            continue
        if folders_only and (e.is_symlink() or not e.is_dir()):
            continue
        pid_s, _, tag = n[len(pre):-len(tag_suffix)].partition("-")
        if (pid_s.isascii() and pid_s.isdigit() and len(tag) == 8 and int(pid_s) != os.getpid()
                and not _pid_alive(int(pid_s))):
            out.append(Path(e.path))
    return sorted(out)


def _dead_temps(t: Path) -> list[Path]:
    """Temp folders/files named for output ``t`` (``.<name>.<pid>-<hex>.stratatools-tmp``) whose process is gone."""
    return _dead_leftovers(t, _TMP_TAG)


def _dead_asides(t: Path) -> list[Path]:
    """Aside folders named for output ``t`` (``.<name>.<pid>-<hex>.stratatools-old``, real folders) whose process is
    gone."""
    return _dead_leftovers(t, _ASIDE_TAG, folders_only=True)


def _sweep_asides(t: Path, keep: Callable[[str], bool] | None) -> list[str]:
    """After a publish of ``t`` (under its lock): sort out the aside folders of dead runs that no journal names
    (left where a removal failed, or kept by :func:`_retire`). Provably safe only: their process is gone (a live
    one's is never touched), the output folder ``t`` exists, and each entry is the previous output's own (a name
    ``keep`` refuses; every name when ``keep`` is None), or already in ``t`` (:func:`_same_entry`), or another
    program's file that ``t`` lacks, which is moved into ``t``. A folder holding a file that differs from ``t``'s
    file of that name is kept (never a user's only copy deleted). Best effort; returns notes."""
    notes: list[str] = []
    if t.is_symlink() or not t.is_dir():
        return notes
    for p in _dead_asides(t):
        moved: list[str] = []
        try:
            kept = _retire(p, t, _own_pred(keep), moved)
        except OSError:
            continue
        into = f"; moved {', '.join(sorted(moved))} (another program's) into {t}" if moved else ""
        notes.append(f"{p}: removed a leftover of an interrupted run{into}" if kept is None else kept)
    return notes


def _clean_dead_temps(t: Path, lock: _Lock) -> list[Path]:
    """Remove (under ``t``'s ``lock``) the temp folders of dead writers of ``t``: never a live process's, never one
    the journal still names (a previous output :func:`recover` could not sort out, which may hold another
    program's file: it stays for a later run). Returns the removed paths."""
    named = {Path(x).name for x in lock.journal().get("paths", []) if isinstance(x, str)}
    gone = []
    for p in _dead_temps(t):
        if p.name not in named:
            _remove_tree(p)
            gone.append(p)
    return gone


_UNKNOWN: Any = object()


def tidy_output(target: str | os.PathLike, keep: Callable[[str], bool] | None = _UNKNOWN) -> list[str]:
    """Clean what killed writers left beside a folder output ``target``: when the lock file, a temp folder of a
    dead process or (``keep`` given) an aside folder of one is there, take the lock (not waiting: a live writer
    holds it, then nothing is done), finish or undo a half-done swap (:func:`recover`), remove temp folders whose
    process is gone, sort out the aside folders of dead runs as a publish does (:func:`_sweep_asides`), and remove
    the lock file. Run by every folder-output command before its checks, so a refused run cleans up too.

    ``keep``: the publish's own ``keep`` (names that are not the output's; None: every name is the output's).
    Only with it are aside folders swept: an aside may hold a file another program wrote into the previous output
    folder, the only copy of it, and only the output's names tell such a file from the output's own. Left out,
    the asides wait for the next publish (which knows them).

    While it holds the lock its journal says ``cleaning``, so a run starting meanwhile waits for it
    (:func:`_take_lock`). Returns notes, also recorded for :func:`take_notes`; errors are ignored (best effort)."""
    t = Path(target)
    sweep = keep is not _UNKNOWN
    if not (os.path.lexists(lock_path(t)) or _dead_temps(t) or (sweep and _dead_asides(t))):
        return []  # nothing left behind: do not take the lock (a run starting now would be refused)
    notes: list[str] = []
    try:
        with output_lock(t) as lock:
            # marked as a cleaner: a run that starts meanwhile waits for this one instead of being refused as if
            # another run were writing the output (_take_lock)
            me = {"cleaning": os.getpid()}
            lock.set_journal({**lock.journal(), **me})
            try:
                notes += recover(lock)  # (clears the journal when done; keeps what it could not sort out)
                lock.set_journal({**lock.journal(), **me})
                for p in _clean_dead_temps(t, lock):
                    notes.append(f"{p}: removed a leftover of an interrupted run")
                if sweep and not lock.journal().get("paths"):  # (asides a journal names are recover's)
                    notes += _sweep_asides(t, keep)
            finally:  # the mark goes; what recover could not finish stays in the journal for the next run
                lock.set_journal({k: v for k, v in lock.journal().items() if k != "cleaning"})
    except (StrataError, OSError):
        pass
    return _record(notes)


def _carry_entry(src: Path, dst: Path) -> None:
    """Put the file or symlink ``src`` at ``dst`` (absent) in the new folder: a symlink recreated, a regular file
    hard-linked, else copied."""
    import shutil

    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _carry_over(t: Path, tmp: Path | None, keep: Callable[[str], bool] | None, nested: bool = False) -> None:
    """Link the entries of the old folder ``t`` that ``keep`` accepts into ``tmp`` (:func:`_carry_entry`). With
    ``tmp`` None only check: a kept entry that is a folder or special file cannot be carried over, so the swap
    (which removes the old folder) is refused instead. ``nested`` (a folder swapped whole whose own entries are
    folders): a file or link inside one of the output's own folders that the new build lacks was put there by
    someone else, and is carried to the same place too, with a note (:func:`take_notes`)."""
    if not t.is_dir() or t.is_symlink():
        return
    for e in os.scandir(t):
        if keep is None or _LOCK_SUFFIX in e.name:
            continue
        if not keep(e.name):
            if nested and tmp is not None and e.is_dir(follow_symlinks=False):
                _carry_nested(t, tmp, Path(e.path))
            continue
        if e.is_symlink() or e.is_file(follow_symlinks=False):
            if tmp is not None and not os.path.lexists(tmp / e.name):
                _carry_entry(Path(e.path), tmp / e.name)
        else:
            raise StrataError(f"{t}: {e.name!r} appeared while the output was built and is not a regular file; "
                              f"run again", t)


def _carry_nested(t: Path, tmp: Path, root: Path) -> None:
    """:func:`_carry_over`'s ``nested`` part for the output's own folder ``root`` of ``t``. Raises StrataError
    when such a file cannot be carried (its folder is a file in the new build, or the link and copy fail)."""
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        rel = Path(dirpath).relative_to(t)
        for name in sorted(files) + sorted(d for d in dirs if (Path(dirpath) / d).is_symlink()):
            src, dst = Path(dirpath) / name, tmp / rel / name
            if os.path.lexists(dst):
                continue  # the output's own file: the new one replaces it
            try:
                dst.parent.mkdir(parents=True, exist_ok=True)
                _carry_entry(src, dst)
            except OSError as e:
                raise StrataError(f"{src}: is not the output's and could not be carried into the new folder "
                                  f"({e.strerror or e}); move it out of {t} and run again", src) from None
            _record([f"{src}: not written by this output; carried into the new folder"])


def _kept(p: Path, folder: Path, keep: Callable[[str], bool] | None) -> bool:
    """True when ``p`` (inside ``folder``) is a top-level file that the new folder carries over (``keep``)."""
    try:
        rel = p.resolve().relative_to(folder.resolve())
    except (OSError, RuntimeError, ValueError):
        return False
    return keep is not None and len(rel.parts) == 1 and keep(rel.parts[0])


def _inside(p: Path, folder: Path) -> bool:
    try:
        return p.resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):
        return False


def _fsync_tree(folder: Path) -> None:
    """fsync every regular file under ``folder`` and the folders themselves (writers through AtomicFile have
    synced their files already; this covers hard links and copies)."""
    for root, _dirs, files in os.walk(folder):
        for f in files:
            fp = os.path.join(root, f)
            try:
                fd = os.open(fp, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


# ------------------------------------------------------------------------------------- digest cache
# A persistent sha256 cache so a multi-GB model is hashed once per file version, not once per command
# (pack, validate-release, profile provenance). Decision and trade-off: see stratatools/pack.py's docstring.
DIGEST_CACHE_ENV = "STRATATOOLS_DIGEST_CACHE"  # "off"/"0"/"no": neither read nor write the cache
_DIGEST_MAX_ENTRIES = 4096                      # oldest entries are pruned beyond this
_DIGEST_SETTLE_NS = 2_000_000_000               # files modified less than 2 s before hashing are not cached
_HASH_WINDOW = 64 << 20                         # bytes mapped at a time while hashing (bounds the RSS)


def digest_cache_dir() -> Path | None:
    """``$XDG_CACHE_HOME/stratatools/sha256`` (``~/.cache/...`` when unset), or None when disabled by
    ``STRATATOOLS_DIGEST_CACHE=off``."""
    if os.environ.get(DIGEST_CACHE_ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stratatools" / "sha256"


def _digest_key(st: os.stat_result) -> dict[str, int]:
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def _digest_entry(st: os.stat_result) -> Path | None:
    d = digest_cache_dir()
    return None if d is None else d / f"{st.st_dev:x}-{st.st_ino:x}.json"


def cached_sha256(path: str | os.PathLike) -> str | None:
    """The sha256 recorded for ``path`` in the digest cache, or None (no entry, stale entry, cache off).

    An entry is used only when the file's (device, inode, size, mtime_ns, ctime_ns) all equal the values
    recorded when it was hashed; any write, truncation, ``touch``, ``chmod`` or replacement of the file changes
    at least one of them (ctime cannot be set by user programs), so a stale digest is never returned.
    """
    try:
        st = os.stat(path)
        e = _digest_entry(st)
        if e is None:
            return None
        rec = json.loads(e.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("key") != _digest_key(st):
        return None
    h = rec.get("sha256")
    return h if isinstance(h, str) and len(h) == 64 else None


def store_sha256(path: str | os.PathLike, digest: str, st_before: os.stat_result, started_ns: int) -> bool:
    """Record ``digest`` for ``path`` when the file did not change while it was hashed (its stat equals
    ``st_before``, taken before the first byte was read) and was last modified at least 2 s before the hash
    started (``started_ns``, time.time_ns()), so a same-size rewrite within one timestamp tick cannot be missed.
    Best effort: returns False (and writes nothing) when the cache is off or not writable."""
    try:
        st = os.stat(path)
        if _digest_key(st) != _digest_key(st_before) or st.st_mtime_ns > started_ns - _DIGEST_SETTLE_NS \
                or st.st_ctime_ns > started_ns - _DIGEST_SETTLE_NS:
            return False
        e = _digest_entry(st)
        if e is None:
            return False
        e.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(e, json.dumps({"key": _digest_key(st), "sha256": digest,
                                         "path": str(Path(path).resolve())}, sort_keys=True) + "\n")
        _prune_digests(e.parent)
        return True
    except (OSError, StrataError):
        return False


def _prune_digests(d: Path) -> None:
    try:
        entries = [p for p in d.iterdir() if p.suffix == ".json"]
        if len(entries) <= _DIGEST_MAX_ENTRIES:
            return
        entries.sort(key=lambda p: p.stat().st_mtime_ns)
        for p in entries[: len(entries) - _DIGEST_MAX_ENTRIES // 2]:
            p.unlink(missing_ok=True)
    except OSError:
        pass


def sha256_fd(fd: int, size: int, stop: Any = None) -> str | None:
    """Hex sha256 of the first ``size`` bytes of an open file, read through 64 MiB memory-mapped windows
    (no copy into a Python buffer; pages are shared with any concurrent reader of the same file, and each
    window is unmapped before the next, so RSS stays under ~64 MiB). ``stop()`` returning true aborts (None)."""
    import mmap

    h = hashlib.sha256()
    off = 0
    while off < size:
        if stop is not None and stop():
            return None
        n = min(_HASH_WINDOW, size - off)
        mm = mmap.mmap(fd, n, access=mmap.ACCESS_READ, offset=off)
        try:
            try:
                mm.madvise(mmap.MADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass
            h.update(mm)
        finally:
            mm.close()
        off += n
    return h.hexdigest()


def sha256_file_cached(path: str | os.PathLike, refresh: bool = False) -> tuple[str, bool]:
    """(hex sha256 of ``path``, True when it came from the digest cache).

    Looks the file up in the digest cache (:func:`cached_sha256`) unless ``refresh``; otherwise hashes it
    (:func:`sha256_fd`) and records the result (:func:`store_sha256`). Raises OSError when the file cannot be read.
    """
    if not refresh:
        h = cached_sha256(path)
        if h is not None:
            return h, True
    import time

    started = time.time_ns()
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        digest = sha256_fd(fd, st.st_size)
    finally:
        os.close(fd)
    assert digest is not None
    store_sha256(path, digest, st, started)
    return digest, False
