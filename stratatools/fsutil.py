"""File-system helpers shared by every writer: atomic writes, output guards, hashing, JSON sidecars."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

from .errors import StrataError


class AtomicFile:
    """Context manager writing ``<path>.tmp`` and renaming it over ``path`` on success.

    On an exception the temp file is removed and an existing ``path`` stays untouched (the engine's own
    writers do the same: Strata expert_cache.cpp, STRP save).
    """

    def __init__(self, path: str | os.PathLike, mode: str = "wb"):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.mode = mode
        self.fh = None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.tmp, self.mode)
        return self.fh

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self.fh is not None
        if exc_type is None:
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
            os.replace(self.tmp, self.path)
        else:
            self.fh.close()
            try:
                self.tmp.unlink()
            except FileNotFoundError:
                pass


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file and rename."""
    with AtomicFile(path) as fh:
        fh.write(data)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 ``text`` (LF line ends) to ``path`` through a temp file and rename."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON (deterministic bytes) through a temp file and rename."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, streamed in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            b = fh.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def guard_output(out: str | os.PathLike, inputs: Iterable[str | os.PathLike], force: bool) -> Path:
    """Refuse an output that is one of the inputs, or that exists without ``force``.

    Returns the output as a Path. Raises StrataError with the fix.
    """
    out = Path(out)
    for i in inputs:
        ip = Path(i)
        try:
            same = out.exists() and ip.exists() and os.path.samefile(out, ip)
        except OSError:
            same = False
        if same or out.resolve() == ip.resolve():
            raise StrataError(f"{out}: output would overwrite the input {i}; choose another output path", out)
    if out.exists() and not force:
        raise StrataError(f"{out}: already exists (pass --force to replace it)", out)
    return out
