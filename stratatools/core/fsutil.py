"""File-system helpers shared by every writer: atomic writes, output guards, hashing, JSON sidecars."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

from stratatools.core.errors import StrataError


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
            try:
                self.fh.flush()
                os.fsync(self.fh.fileno())
                self.fh.close()
                os.replace(self.tmp, self.path)
            except OSError as e:
                self.fh.close()
                try:
                    self.tmp.unlink()
                except FileNotFoundError:
                    pass
                raise StrataError(f"{self.path}: cannot write: {e.strerror or e} (nothing was changed)", self.path) from None
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


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file (:func:`sha256_fd`: memory-mapped windows, no copies). Raises OSError."""
    with open(path, "rb") as fh:
        digest = sha256_fd(fh.fileno(), os.fstat(fh.fileno()).st_size)
    assert digest is not None
    return digest


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
        tmp = e.with_name(f"{e.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": _digest_key(st), "sha256": digest, "path": str(Path(path).resolve())},
                                  sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, e)
        _prune_digests(e.parent)
        return True
    except OSError:
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
