"""Our canonical trace file: Parquet (pyarrow), one row per routed entry.

Columns and types are :data:`stratatools.traces.table.COLUMNS` (request int32, position int32, phase int8, layer int16,
rank int16, expert int32, weight float32). The table's ``meta`` is stored as JSON under the schema metadata key
``stratatools.traces.table`` (with ``format: stratatools-trace/1``); the source format of the original trace is kept as
``meta["source_format"]`` there and reappears as ``meta["converted_from"]`` on reading. A table with verify
windows (``TraceTable.window``) gets one more column, ``window`` int32 (-1 outside every window), read back into
``window``; files without it read as having no windows.
Rows are written in row groups of 8M entries, zstd-compressed (constant columns cost almost nothing), with a CRC32
checksum in every page header (:data:`WRITE_OPTIONS`); every reader verifies them (:func:`open_parquet_file`,
:func:`parquet_file_format`), so a damaged page is a one-line error naming the file, never other expert ids. Files
without checksums (older ones, other tools') read as before: a page without a CRC is not checked. Page checksums
need pyarrow 15 or later (``write_page_checksum``, ``page_checksum_verification``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from stratatools.core.errors import OtherModelInput, StrataError
from stratatools.core.fsutil import AtomicFile, sha256_file
from stratatools.traces.table import COLUMNS, TraceTable

META_KEY = b"stratatools.traces.table"
FORMAT = "stratatools-trace/1"
ROW_GROUP = 1 << 23
# every Parquet file this project writes: zstd, column statistics, a CRC32 in every page header
WRITE_OPTIONS = {"compression": "zstd", "write_statistics": True, "write_page_checksum": True}


def open_parquet_file(path: str | os.PathLike):
    """``pyarrow.parquet.ParquetFile`` of ``path`` with page checksum verification on (a page whose CRC does not
    match raises ``OSError`` when it is read). Raises what ``ParquetFile`` raises (callers turn it into one line)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path, page_checksum_verification=True)


def parquet_file_format():
    """The ``pyarrow.dataset`` Parquet format with page checksum verification on, for ``pads.dataset(...,
    format=parquet_file_format())`` (scans and row counts with a filter read the pages)."""
    import pyarrow.dataset as pads

    return pads.ParquetFileFormat(
        default_fragment_scan_options=pads.ParquetFragmentScanOptions(page_checksum_verification=True))


def _jsonable(meta: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in meta.items():
        if hasattr(v, "tolist"):
            v = v.tolist()
        try:
            json.dumps(v)
        except TypeError:
            continue
        out[k] = v
    return out


WINDOW = "window"


def _schema(meta: dict[str, Any], windows: bool = False):
    import pyarrow as pa

    fields = [pa.field(name, pa.from_numpy_dtype(np.dtype(dt)), nullable=False) for name, dt in COLUMNS.items()]
    if windows:
        fields.append(pa.field(WINDOW, pa.int32(), nullable=False))
    m = dict(_jsonable(meta))
    m["format"] = FORMAT
    return pa.schema(fields, metadata={META_KEY: json.dumps(m, sort_keys=True).encode()})


def write_parquet(table: TraceTable, path: str | os.PathLike) -> None:
    """Write ``table`` as Parquet atomically (``<path>.tmp`` then rename); deterministic bytes for one input."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    windows = table.has_windows
    schema = _schema(table.meta, windows)
    names = list(COLUMNS) + ([WINDOW] if windows else [])
    with AtomicFile(path, "wb") as fh:
        with pq.ParquetWriter(fh, schema, **WRITE_OPTIONS) as w:
            n = len(table)
            for a in range(0, max(n, 1), ROW_GROUP):
                b = min(n, a + ROW_GROUP)
                arrays = [pa.array(np.ascontiguousarray(getattr(table, name)[a:b]), type=schema.field(name).type)
                          for name in names]
                w.write_table(pa.Table.from_arrays(arrays, schema=schema))


def stored_meta(schema) -> dict[str, Any]:
    """The trace metadata stored in a Parquet schema under :data:`META_KEY`, made plausible, with the stored
    ``source_format`` kept as ``converted_from`` and the source keys dropped (the reader sets its own). An
    unreadable value gives ``{}``."""
    meta: dict[str, Any] = {}
    raw = (schema.metadata or {}).get(META_KEY)
    if raw:
        try:
            stored = json.loads(raw)
            if isinstance(stored, dict):
                meta.update(_plausible_meta(stored))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            pass
    if "source_format" in meta:
        meta["converted_from"] = meta.pop("source_format")
    for k in ("source_path", "source_sha256", "source_bytes", "format"):
        meta.pop(k, None)
    return meta


def _plausible_meta(stored: dict) -> dict[str, Any]:
    """The stored metadata entries kept on reading: scalars and lists of scalars; ``n_layers``/``n_expert`` only
    as integers in 1..2^31-1 (the file is not trusted to size anything or to break a later ``int()``)."""
    out: dict[str, Any] = {}
    for k, v in stored.items():
        if k in ("n_layers", "n_expert"):
            if isinstance(v, int) and not isinstance(v, bool) and 1 <= v < 1 << 31:
                out[k] = v
        elif isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v
        elif isinstance(v, list) and all(isinstance(x, (str, int, float, bool)) for x in v):
            out[k] = v
        elif isinstance(v, dict) and all(isinstance(x, (str, int, float, bool)) or x is None for x in v.values()):
            out[k] = v
    return out


UNREADABLE_FIX = ("the file is cut short, damaged or not Parquet: restore the complete file or write it again, e.g. "
                  "with `stratatools trace convert --to parquet`")


def arrow_reason(e: BaseException) -> str:
    """The innermost cause of a pyarrow error as one complete clause, for a one-line message: pyarrow chains its
    causes with ": " ("Error creating dataset. ...: Could not open Parquet input source 'x': Parquet magic bytes not
    found in footer. Either the file is corrupted or ...") and the last link's first sentence says what is wrong
    ("Parquet magic bytes not found in footer"); a UnicodeError's message is kept as it is. Never cut mid-word: a clause over 200 characters ends at a word
    with "...". Falls back to the exception's type name."""
    text = " ".join(str(e).split())
    if isinstance(e, UnicodeError):  # Python's own message is one clause already ("'utf-8' codec can't decode ...")
        return text[:200] or type(e).__name__
    cause = text.rsplit(": ", 1)[-1].strip() if text else ""
    cause = cause.split(". ", 1)[0].rstrip(". ")
    if len(cause) > 200:
        cause = cause[:200].rsplit(" ", 1)[0] + " ..."
    return cause or type(e).__name__


def check_integer_column(path: Any, name: str, typ) -> None:
    """Refuse an integer column of a Parquet trace (every column but ``weight``) stored with a non-integer Arrow
    type (a float64 ``expert`` column would be cast to ints: 1000.0 read as expert 1000, 3.7 as 3).
    Raises StrataError naming the file, the column, its type and the fix."""
    import pyarrow as pa

    if name != "weight" and not pa.types.is_integer(typ):
        raise StrataError(f"{path}: column {name} is {typ}, expected an integer type (write integer ids, "
                          f"positions and layers as integers, e.g. `stratatools trace convert --to parquet`)", path)


def read_parquet(path: str | os.PathLike, n_layers: int | None = None, n_expert: int | None = None) -> TraceTable:
    """Read our Parquet trace. Expert ids are range-checked like the other readers (below ``n_layers``).

    Raises:
        StrataError: not a Parquet file, a missing column, values that do not fit the column types, negative
            layers or expert ids, an expert id >= n_expert below layer n_layers.
    """
    import pyarrow as pa

    path = Path(path)
    if not path.exists():
        raise StrataError(f"{path}: no such file", path)
    try:
        pf = open_parquet_file(path)
        t = pf.read()
    except (pa.ArrowException, OSError, ValueError) as e:
        raise StrataError(f"{path}: byte 0: not a readable Parquet trace ({arrow_reason(e)}); {UNREADABLE_FIX}",
                          path) from None
    missing = [c for c in COLUMNS if c not in t.column_names]
    if missing:
        raise StrataError(f"{path}: Parquet schema lacks column(s) {', '.join(missing)}; expected "
                          f"{', '.join(COLUMNS)} (write it with `stratatools trace convert --to parquet`)", path)
    cols = {}
    for name, dt in COLUMNS.items():
        col = t.column(name)
        if col.null_count:
            raise StrataError(f"{path}: column {name} has {col.null_count} null values", path)
        check_integer_column(path, name, col.type)
        try:
            cols[name] = col.cast(pa.from_numpy_dtype(np.dtype(dt)), safe=True).to_numpy()
        except (pa.ArrowException, ValueError) as e:
            raise StrataError(f"{path}: column {name} does not fit {np.dtype(dt).name} "
                              f"({arrow_reason(e)})", path) from None
    window = None
    if WINDOW in t.column_names:
        col = t.column(WINDOW)
        if col.null_count:
            raise StrataError(f"{path}: column {WINDOW} has {col.null_count} null values", path)
        check_integer_column(path, WINDOW, col.type)
        try:
            window = col.cast(pa.int32(), safe=True).to_numpy()
        except (pa.ArrowException, ValueError) as e:
            raise StrataError(f"{path}: column {WINDOW} does not fit int32 ({arrow_reason(e)})",
                              path) from None
    meta = stored_meta(t.schema)
    meta.update({"source_format": "parquet", "source_path": str(path), "source_sha256": sha256_file(path),
                 "source_bytes": path.stat().st_size})
    lay, exp = cols["layer"], cols["expert"]
    for name, a in (("layer", lay), ("expert", exp)):
        if len(a) and int(a.min()) < 0:
            i = int(np.argmax(a < 0))
            raise StrataError(f"{path}: row {i}: {name} {int(a[i])} is negative", path)
    if n_expert is not None and len(exp):
        bad = exp >= n_expert
        if n_layers is not None:
            bad &= lay < n_layers
        if bad.any():
            i = int(np.argmax(bad))
            raise OtherModelInput(f"{path}: row {i}: expert id {int(exp[i])} of layer {int(lay[i])} is out of "
                                  f"range for {n_expert} experts (the trace is for a model with more experts)", path)
    if n_layers is not None:
        meta["n_layers"] = int(n_layers)
    if n_expert is not None:
        meta["n_expert"] = int(n_expert)
    return TraceTable(**cols, meta=meta, window=window)


def write_parquet_dataset(sources, out_dir: str | os.PathLike, partition: dict[str, str] | None = None, *,
                          force: bool = False, rows: int = 1 << 20, progress=None) -> dict[str, Any]:
    """Write chunk sources (:mod:`stratatools.traces.sources`) as a hive-partitioned Parquet dataset, in memory
    bounded by one chunk of ``rows`` entries whatever the traces' length.

    Layout: ``OUT/KEY=VALUE/.../part-NNNNN.parquet`` (the ``partition`` keys in order; none: the files go in OUT),
    one part file per input file (a trace's requests never span two files, so reading the dataset back gives the
    inputs' replay), each written in row groups of ``rows`` entries, zstd, with our schema (:func:`_schema`).
    The partition folder is written as a hidden temporary folder beside it and renamed into place, so a reader
    never sees half a partition; with ``force`` an existing partition folder is replaced.

    Returns {"output", "files", "entries", "records", "bytes"}. Raises StrataError: an existing partition without
    ``force``, a partition key or value that is not a plain name, and every reader error of the sources.
    """
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    leaf = out
    for k, v in (partition or {}).items():
        for x in (k, v):
            if not x or "/" in x or "=" in x or x.startswith("."):
                raise StrataError(f"--partition {k}={v}: keys and values must be plain names (no '/', '=' or "
                                  f"leading '.')")
        leaf = leaf / f"{k}={v}"
    if leaf.exists() and any(leaf.iterdir()) and not force:
        raise StrataError(f"{leaf}: the partition already holds files (pass --force to replace it)", leaf)
    tmp = leaf.parent / f".{leaf.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    entries = records = 0
    files = []
    try:
        for i, src in enumerate(sources):
            windows = bool(getattr(src, "has_windows", False))
            meta = dict(getattr(src, "meta", {}))
            schema = _schema(meta, windows)
            names = list(COLUMNS) + ([WINDOW] if windows else [])
            name = f"part-{i:05d}.parquet"
            with AtomicFile(tmp / name, "wb") as fh:
                with pq.ParquetWriter(fh, schema, **WRITE_OPTIONS) as w:
                    for c in src.chunks(rows):
                        n = len(c["layer"])
                        if not n:
                            continue
                        if "weight" not in c:
                            c["weight"] = np.ones(n, np.float32)
                        if windows and "window" not in c:
                            c["window"] = np.full(n, -1, np.int32)
                        arrays = [pa.array(np.ascontiguousarray(c[k]).astype(
                            np.dtype(COLUMNS.get(k, np.int32))), type=schema.field(k).type) for k in names]
                        w.write_table(pa.Table.from_arrays(arrays, schema=schema))
                        entries += n
                        records += int((np.asarray(c["rank"]) == 0).sum())
                        if progress is not None:
                            progress(n)
            files.append(str(leaf / name))
        old = None
        if leaf.exists():
            old = leaf.parent / f".{leaf.name}.old-{os.getpid()}"
            os.replace(leaf, old)
        os.replace(tmp, leaf)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(Path(f).stat().st_size for f in files)
    return {"output": str(leaf), "files": files, "entries": entries, "records": records, "bytes": size}
