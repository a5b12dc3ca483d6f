"""Readers and writers of every routing-trace format, behind :func:`read_trace` / :func:`write_trace`.

Formats (names used by ``--from`` / ``--to``):

* ``strata``: Strata ``--dump-routing`` binary; reading also accepts the tagged variant (v1/v2) and tells them
  apart by the first record (``strata.py``);
* ``strata-tagged``: writing only: the tagged variant, version 1, with request and phase tags;
* ``llama-csv``: ``llama-moe-trace`` rows ``pos,layer,id0..`` (``text.py``);
* ``csv``: per-entry CSV with the kit's columns (``model,prompt_id,token_pos,layer,rank,expert_id,weight``),
  plus ``phase`` when we write it (``text.py``);
* ``parquet``: our canonical table (``parquet.py``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from stratatools.core.errors import StrataError
from stratatools.traces.table import TraceTable

READ_FORMATS = ("strata", "llama-csv", "csv", "parquet")
WRITE_FORMATS = ("strata", "strata-tagged", "parquet", "csv")
_LLAMA_ROW = re.compile(rb"^\s*-?\d+\s*,\s*\d+\s*(,\s*-?\d+\s*)+$")


def sniff_format(path: str | os.PathLike) -> str:
    """Tell a trace's format from its first bytes: ``PAR1`` -> parquet; a kit header -> csv; a numeric
    ``pos,layer,ids`` first line -> llama-csv; a line of text with commas and neither -> an error naming the
    expected CSV columns; anything else -> strata (binary).

    Raises:
        StrataError: missing file, directory, empty file, a CSV whose header is not recognised.
    """
    from stratatools.core.fsutil import check_input

    p = check_input(path, "routing trace")
    try:
        with open(p, "rb") as fh:
            head = fh.read(4096)
    except FileNotFoundError:
        raise StrataError(f"{p}: no such file", p) from None
    except IsADirectoryError:
        raise StrataError(f"{p}: is a directory, expected a routing trace", p) from None
    if not head:
        raise StrataError(f"{p}: byte 0: empty file: no routing records", p)
    if head[:4] == b"PAR1":
        return "parquet"
    first = head.split(b"\n", 1)[0].rstrip(b"\r").lstrip(b"\xef\xbb\xbf")
    if first.replace(b" ", b"").startswith(b"model,prompt_id,"):
        return "csv"
    if _LLAMA_ROW.match(first) and b"\x00" not in head:
        return "llama-csv"
    if _looks_like_text(head, first):
        from stratatools.traces.formats.text import KIT_COLUMNS

        raise StrataError(f"{p}: line 1: the CSV header {first[:120].decode('utf-8', 'replace')!r} is not "
                          f"recognised; expected {','.join(KIT_COLUMNS)}[,phase[,window]] (a per-entry CSV) or "
                          f"headerless pos,layer,id0,id1,... rows (llama-csv)", p)
    return "strata"


def _looks_like_text(head: bytes, first: bytes) -> bool:
    """True when a file's first bytes are a line of text with a comma (a CSV), never a Strata binary: every
    Strata record starts with small int32s (layer, k), so a binary trace has NUL bytes in its first 8 bytes."""
    if b"\x00" in head[:4096] or b"," not in first:
        return False
    try:
        first.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(ch >= 0x20 or ch in (0x09,) for ch in first)


def read_trace(path: str | os.PathLike, fmt: str | None = None, n_layers: int | None = None,
               n_expert: int | None = None, *, sha256: bool = True) -> TraceTable:
    """Read any supported routing trace into a :class:`~stratatools.traces.table.TraceTable`.

    Args:
        path: the trace file.
        fmt: one of :data:`READ_FORMATS` (``strata-tagged`` is accepted as ``strata``); None sniffs it.
        n_layers: trunk layers of the target model, when known: expert ids of layers below it are checked
            against ``n_expert``; layers at or above it (an MTP block) are kept and left for the caller.
        n_expert: experts per layer of the target model (dense indices for a pruned model).
        sha256: record the file's sha256 in ``meta["source_sha256"]`` (False skips hashing the Strata binary,
            for callers that hash it anyway; the text and Parquet readers always hash).
    Raises:
        StrataError: an unknown format name and every reader's bad-input cases (one line, byte offset or line).
    """
    from stratatools.core.fsutil import check_input

    check_input(path, "routing trace")
    if fmt is None:
        fmt = sniff_format(path)
    if fmt == "strata-tagged":
        fmt = "strata"
    from stratatools.traces.semantics import check_semantics

    if fmt == "strata":
        from stratatools.traces.formats.strata import read_strata
        t = read_strata(path, n_layers, n_expert, sha256=sha256)
        check_semantics(t, path)
        return t
    if fmt == "llama-csv":
        from stratatools.traces.formats.text import read_llama_csv
        t = read_llama_csv(path, n_layers, n_expert)
        check_semantics(t, path, distinct=False)  # the text readers check ids per record, naming the line
        return t
    if fmt == "csv":
        from stratatools.traces.formats.text import read_kit_csv
        t = read_kit_csv(path, n_layers, n_expert)
        check_semantics(t, path, distinct=False)
        return t
    if fmt == "parquet":
        from stratatools.traces.formats.parquet import read_parquet
        t = read_parquet(path, n_layers, n_expert)
        check_semantics(t, path)
        return t
    raise StrataError(f"unknown trace format {fmt!r} (use {', '.join(READ_FORMATS)})")


def write_trace(table: TraceTable, path: str | os.PathLike, fmt: str) -> int:
    """Write ``table`` as ``fmt`` (one of :data:`WRITE_FORMATS`) atomically. Overwrites ``path``: callers
    guard it (:func:`stratatools.core.fsutil.guard_output`). Returns the entries the format could not hold and
    left out: plain ``strata`` holds decode positions only and leaves prefill entries out
    (:func:`.strata.drop_prefill`; callers say so, :func:`.strata.plain_prefill_note`); 0 otherwise. Raises
    StrataError for an unknown format or a table the format cannot hold (plain ``strata``: one whose entries are all
    prefill), and for a table the readers would refuse (:func:`~stratatools.traces.semantics.check_semantics`: a
    repeated id in one record, a bad phase, weight or rank), before anything is written."""
    from stratatools.traces.semantics import check_semantics

    if fmt in WRITE_FORMATS:
        check_semantics(table, f"{path} (not written)")
    if fmt == "strata":
        from stratatools.traces.formats.strata import write_strata
        return write_strata(table, path, tagged=False)
    if fmt == "strata-tagged":
        from stratatools.traces.formats.strata import write_strata
        return write_strata(table, path, tagged=True)
    if fmt == "parquet":
        from stratatools.traces.formats.parquet import write_parquet
        write_parquet(table, path)
        return 0
    if fmt == "csv":
        from stratatools.traces.formats.text import write_csv
        write_csv(table, path)
        return 0
    raise StrataError(f"unknown output format {fmt!r} (use {', '.join(WRITE_FORMATS)})")


__all__ = ["read_trace", "write_trace", "sniff_format", "READ_FORMATS", "WRITE_FORMATS"]


from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402


@dataclass
class ConvertResult:
    """What ``trace convert`` did.

    Attributes:
        input, output: paths. from_format, to_format: format names. entries: routed entries written.
        records: (token, layer) records written. output_bytes: size of the written file. meta: the input's
        metadata. dropped_prefill, dropped_prefill_records: prefill entries and records left out (``--to strata``
        holds decode positions only; see :func:`.strata.drop_prefill`).
    """

    input: str
    output: str
    from_format: str
    to_format: str
    entries: int
    records: int
    output_bytes: int
    meta: dict[str, Any] = field(default_factory=dict)
    dropped_prefill: int = 0
    dropped_prefill_records: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["meta"] = {k: v for k, v in self.meta.items() if k != "request_names"}
        return d


# A trace file's extension names its format: Strata binary (.bin: tagged or plain), CSV (.csv), Parquet (.parquet,
# .pq). A writer given a format that disagrees with the extension refuses (a .csv file holding Parquet is opened as
# text by every tool that trusts the name); .json/.jsonl are refused whatever the format (no trace format is JSON,
# and <file>.json is where this project puts provenance sidecars). Other extensions take the format given.
TRACE_EXTENSIONS = {".bin": ("strata-tagged", "strata"), ".csv": ("csv",), ".parquet": ("parquet",),
                    ".pq": ("parquet",)}
_NOT_TRACE_EXTENSIONS = (".json", ".jsonl")


def format_by_extension(path: str | os.PathLike) -> str | None:
    """The trace format ``path``'s extension names (:data:`TRACE_EXTENSIONS`, the first for .bin:
    strata-tagged), or None."""
    got = TRACE_EXTENSIONS.get(Path(path).suffix.lower())
    return got[0] if got else None


def check_trace_name(path: str | os.PathLike, fmt: str | None, option: str) -> None:
    """Refuse a trace output whose extension disagrees with the format ``fmt`` chosen by ``option`` (e.g.
    ``--trace-format``, ``--to``), or is .json/.jsonl. Raises StrataError naming the file and the fix."""
    s = Path(path).suffix.lower()
    if s in _NOT_TRACE_EXTENSIONS:
        raise StrataError(f"{path}: a routing trace is not JSON (it is Strata binary, CSV or Parquet); name the file "
                          f"for its format: .bin (Strata tagged, the default), .csv or .parquet", path)
    if fmt and s in TRACE_EXTENSIONS and fmt not in TRACE_EXTENSIONS[s]:
        want = {"csv": ".csv", "parquet": ".parquet"}.get(fmt, ".bin")
        raise StrataError(f"{path}: the extension {s} says {TRACE_EXTENSIONS[s][0]}, {option} says {fmt}; name the "
                          f"file {Path(path).stem}{want} or change {option}", path)


def convert_trace(src: str | os.PathLike, out: str | os.PathLike, to: str, fmt: str | None = None,
                  force: bool = False, n_layers: int | None = None, n_expert: int | None = None) -> ConvertResult:
    """Read ``src`` (any format, sniffed unless ``fmt``) and write it to ``out`` as ``to``.

    Raises:
        StrataError: an unknown output format; ``out`` is the input or exists without ``force``; every reader
            error. The output is written through ``<out>.tmp`` and renamed.
    """
    from stratatools.core.fsutil import guard_output
    from stratatools.traces.formats.strata import all_prefill_error, drop_prefill, record_bounds

    if to not in WRITE_FORMATS:
        raise StrataError(f"unknown output format {to!r} (use {', '.join(WRITE_FORMATS)})")
    guard_output(out, [src], force)
    table = read_trace(src, fmt, n_layers, n_expert)
    dropped = dropped_recs = 0
    if to == "strata":
        n = len(table)
        table, dropped, dropped_recs = drop_prefill(table)
        if n and not len(table):
            raise all_prefill_error(out, n)
    write_trace(table, out, to)
    return ConvertResult(str(src), str(out), str(table.meta.get("source_format")), to, len(table),
                         int(len(record_bounds(table))), Path(out).stat().st_size, dict(table.meta),
                         dropped, dropped_recs)


__all__ += ["convert_trace", "ConvertResult"]

