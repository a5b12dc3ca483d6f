"""CSV routing traces: llama.cpp's ``llama-moe-trace`` rows and the kit's per-entry CSV (formats.md section 3).

``llama-csv``: no header, one row per (position, layer): ``pos,layer,id0,...,id{k-1}``; a negative position is
prompt processing (phase prefill), others decode. Traces are merged with ``cat``, so a new request starts where
a prompt-processing row follows a decode row. No weights (unit weight). Rows may differ in k.

``csv`` (ours, and the kit's ``routing/*.routing.csv``): header ``model,prompt_id,token_pos,layer,rank,
expert_id,weight`` and optionally a last ``phase`` column (prefill/decode/unknown) that our writer adds. One row
per routed entry; prompt ids become request numbers in order of first appearance (names kept in
``meta["request_names"]``). Without a phase column the phase is unknown. A table with verify windows
(``TraceTable.window``) is written with one more last column, ``window`` (integer, -1 outside every window), after
``phase``; a file with it reads back into ``window``.

Bad input (StrataError with the line number, 1-based, header included):
a non-numeric or missing field; an integer field (positions, layers, ranks, expert ids, windows) that is not
written as a decimal integer (``1e3``, ``3.0``, ``0x10``: refused, never read as 1000 or 3); a negative layer or one above 4096; a negative expert id; an expert id >=
``n_expert`` on a layer below ``n_layers`` (same rule as the Strata reader); a rank outside 0..1023; a
non-finite weight; an empty file or a header without rows; rows of one llama-csv line beyond 1024 ids; an
expert id twice in one llama-csv row or one ``csv`` record (the rows of one prompt, token_pos, layer and phase,
from rank 0 on); a negative ``token_pos`` in ``csv`` (positions count from 0; llama.cpp's negative prompt
positions belong to ``llama-csv``, and a table holding them is written to Parquet, not to ``csv``).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from stratatools.core.errors import OtherModelInput, StrataError
from stratatools.core.fsutil import AtomicFile, sha256_file
from stratatools.traces.table import DECODE, PHASE_NAMES, PREFILL, UNKNOWN, TraceTable
from stratatools.traces.formats.strata import MAX_LAYER, MAX_ROUTE_K
from stratatools.traces.semantics import REPEAT_FIX, check_record_lengths, first_repeat

KIT_COLUMNS = ["model", "prompt_id", "token_pos", "layer", "rank", "expert_id", "weight"]
_PHASE_BY_NAME = {"prefill": PREFILL, "decode": DECODE, "unknown": UNKNOWN, "0": PREFILL, "1": DECODE, "2": UNKNOWN}
_INT_RE = re.compile(r"^\s*[+-]?\d+\s*$", re.ASCII)
# bytes that make an integer field a float to pandas' C parser, which then casts an integral float to int ("1e3" ->
# 1000, "3.0" -> 3): the per-entry reader refuses them in its integer columns (see _check_int_tokens)
_FLOAT_BYTES = np.zeros(256, dtype=bool)
_FLOAT_BYTES[[ord("."), ord("e"), ord("E")]] = True
_CHECK_CHUNK = 1 << 24


def _line_err(path: Any, line: int, what: str, fix: str | None = None, cls: type = StrataError) -> StrataError:
    msg = f"{path}: line {line}: {what}"
    if fix:
        msg += f" ({fix})"
    return cls(msg, path)


def _read_text(path: Path) -> str:
    return _read_bytes_text(path)[1]


def _read_bytes_text(path: Path) -> tuple[bytes, str]:
    """The file's bytes and its UTF-8 text; StrataError for a missing, empty, non-UTF-8 file or a folder."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StrataError(f"{path}: no such file", path) from None
    except IsADirectoryError:
        raise StrataError(f"{path}: is a directory, expected a routing trace", path) from None
    if not data.strip():
        raise StrataError(f"{path}: line 1: empty file: no routing rows", path)
    try:
        return data, data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise _line_err(path, line, f"not UTF-8 text (byte {e.start})", "is this a binary trace? pass --from") from None


def _check_ranges(path: Any, line_of: np.ndarray, layer: np.ndarray, expert: np.ndarray,
                  n_layers: int | None, n_expert: int | None) -> None:
    """Shared layer/expert checks; ``line_of[i]`` is the text line of entry i."""
    bad = np.flatnonzero((layer < 0) | (layer > MAX_LAYER))
    if len(bad):
        i = int(bad[0])
        raise _line_err(path, int(line_of[i]), f"layer {int(layer[i])} is out of range 0..{MAX_LAYER}")
    bad = np.flatnonzero(expert < 0)
    if len(bad):
        i = int(bad[0])
        raise _line_err(path, int(line_of[i]), f"expert id {int(expert[i])} is negative")
    if n_expert is not None:
        m = expert >= n_expert
        if n_layers is not None:
            m &= layer < n_layers
        bad = np.flatnonzero(m)
        if len(bad):
            i = int(bad[0])
            raise _line_err(path, int(line_of[i]), f"expert id {int(expert[i])} of layer {int(layer[i])} is out "
                            f"of range for {n_expert} experts", "the trace is for a model with more experts", OtherModelInput)


CUT_FIX = "restore the complete file, or remove the partial last line"


def _check_cut_end(path: Any, text: str, sizes: np.ndarray, line: "int | Callable[[], int]", what: str) -> None:
    """Refuse a text trace cut mid-row: the file does not end with a newline and its last row (llama-csv) or record
    (per-entry CSV) has fewer expert ids than every one before it, all of one size; only then is the cut
    unambiguous (a short row that ends with its newline, or rows of mixed k before, are legal and read).
    ``sizes``: expert ids per row/record in file order; ``line``: the last line's number (or a function giving it,
    called only for the error)."""
    if text.rstrip(" \t").endswith("\n") or len(sizes) < 2:
        return
    k = int(sizes[0])
    last = int(sizes[-1])
    if last < k and bool(np.all(sizes[:-1] == k)):
        raise _line_err(path, line() if callable(line) else line, f"the last {what} has {last} {'expert ids' if what == 'row' else 'entries'} "
                        f"where every {what} before has {k}, and the file does not end with a newline: it was cut "
                        f"mid-{what}", CUT_FIX)


def _int_field(path: Any, line: int, name: str, s: str) -> int:
    if not _INT_RE.match(s):
        raise _line_err(path, line, f"field {name} is {s!r}, expected an integer")
    v = int(s)
    if not -(2 ** 31) <= v < 2 ** 31:
        raise _line_err(path, line, f"field {name} = {v} does not fit in 32 bits")
    return v


# -- llama-moe-trace ------------------------------------------------------------------------------------------------

def read_llama_csv(path: str | os.PathLike, n_layers: int | None = None, n_expert: int | None = None) -> TraceTable:
    """Read a ``llama-moe-trace`` CSV (``pos,layer,id0..``); see the module docstring. Raises StrataError."""
    path = Path(path)
    text = _read_text(path)
    pos_l: list[int] = []
    layer_l: list[int] = []
    ks: list[int] = []
    ids: list[int] = []
    lines: list[int] = []
    for ln, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if not s:
            continue
        parts = s.split(",")
        if len(parts) < 3:
            raise _line_err(path, ln, f"{len(parts)} fields, expected pos,layer,id0[,id1...]")
        if len(parts) - 2 > MAX_ROUTE_K:
            raise _line_err(path, ln, f"{len(parts) - 2} expert ids in one row (more than {MAX_ROUTE_K})")
        pos_l.append(_int_field(path, ln, "pos", parts[0]))
        layer_l.append(_int_field(path, ln, "layer", parts[1]))
        for j, p in enumerate(parts[2:]):
            ids.append(_int_field(path, ln, f"id{j}", p))
        ks.append(len(parts) - 2)
        lines.append(ln)
    if not ks:
        raise StrataError(f"{path}: line 1: empty file: no routing rows", path)
    rec_k = np.array(ks, np.int64)
    _check_cut_end(path, text, rec_k, lines[-1], "row")
    rec_pos = np.array(pos_l, np.int64)
    rec_layer = np.array(layer_l, np.int64)
    expert = np.array(ids, np.int64)
    line_of = np.repeat(np.array(lines), rec_k)
    _check_ranges(path, line_of, np.repeat(rec_layer, rec_k), expert, n_layers, n_expert)
    rec_starts = np.cumsum(rec_k) - rec_k
    i = first_repeat(expert, rec_starts)
    if i >= 0:
        r = int(np.searchsorted(rec_starts, i, side="right")) - 1
        c = i - int(rec_starts[r])
        raise _line_err(path, lines[r], f"expert id {int(expert[i])} appears twice in one row (id{c} repeats an "
                        f"earlier id)", REPEAT_FIX)
    rec_phase = np.where(rec_pos < 0, PREFILL, DECODE).astype(np.int8)
    new_req = np.r_[False, (rec_phase[1:] == PREFILL) & (rec_phase[:-1] == DECODE)]
    rec_req = np.cumsum(new_req).astype(np.int32)
    starts = np.cumsum(rec_k) - rec_k
    rank = np.arange(len(expert)) - np.repeat(starts, rec_k)
    meta = {"source_format": "llama-csv", "source_path": str(path), "source_sha256": sha256_file(path),
            "source_bytes": path.stat().st_size, "records": len(rec_k), "route_records": len(rec_k)}
    if len(set(ks)) == 1:
        meta["k"] = ks[0]
    if n_layers is not None:
        meta["n_layers"] = int(n_layers)
    if n_expert is not None:
        meta["n_expert"] = int(n_expert)
    return TraceTable(request=np.repeat(rec_req, rec_k), position=np.repeat(rec_pos, rec_k),
                      phase=np.repeat(rec_phase, rec_k), layer=np.repeat(rec_layer, rec_k), rank=rank,
                      expert=expert, weight=np.ones(len(expert), np.float32), meta=meta)


# -- the kit's / our per-entry CSV ------------------------------------------------------------------------------------

def _slow_kit_scan(path: Path, text: str, has_phase: bool, has_window: bool = False) -> None:
    """Find and raise the first bad line (the fast parser only says that one exists)."""
    ncol = len(KIT_COLUMNS) + (1 if has_phase else 0) + (1 if has_window else 0)
    rdr = csv.reader(io.StringIO(text, newline=""))
    ln = 1
    while True:
        try:
            row = next(rdr)
        except StopIteration:
            break
        except csv.Error as e:  # e.g. a bare carriage return inside an unquoted field
            raise _line_err(path, rdr.line_num, f"not a CSV row ({e}); quote a field that holds a line break") from None
        ln = rdr.line_num
        if ln == 1:
            continue
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != ncol:
            raise _line_err(path, ln, f"{len(row)} fields, expected {ncol} ({','.join(KIT_COLUMNS)}"
                            f"{',phase' if has_phase else ''}{',window' if has_window else ''})")
        for name, val in zip(KIT_COLUMNS[2:6], row[2:6]):
            _int_field(path, ln, name, val)
        try:
            w = float(row[6])
        except ValueError:
            raise _line_err(path, ln, f"field weight is {row[6]!r}, expected a number") from None
        if not math.isfinite(w):  # nan, NaN, -nan: the fast parser refuses them (inf it reads, then checks)
            raise _line_err(path, ln, f"weight {w} is not finite")
        if has_phase and row[7].strip().lower() not in _PHASE_BY_NAME:
            raise _line_err(path, ln, f"field phase is {row[7]!r}, expected prefill, decode or unknown")
        if has_window:
            _int_field(path, ln, "window", row[8])
    raise StrataError(f"{path}: could not be parsed as a routing CSV", path)


def _scan_int_fields(path: Any, text: str, line0: int, ncol: int, int_cols: tuple[int, ...]) -> None:
    """Check the integer fields of ``text`` (whole CSV lines; its first line is line ``line0`` of the file) row by
    row with the csv module and raise the first that is not an integer; rows of another width are left alone."""
    rdr = csv.reader(io.StringIO(text, newline=""))
    for row in rdr:
        if len(row) == ncol:
            for c in int_cols:
                _int_field(path, line0 - 1 + rdr.line_num, KIT_COLUMNS[c] if c < len(KIT_COLUMNS) else "window",
                           row[c])


def _check_int_tokens(path: Any, data: bytes, text: str, ncol: int, has_window: bool) -> None:
    """Refuse an integer field of a per-entry CSV that pandas read as a float cast to int (``1e3``, ``3.0``,
    ``2.``): such a field holds a ``.``, ``e`` or ``E``. Raises StrataError (line number, field, value).

    Fast path (no quote character in the file): per chunk of about 16 MiB of whole lines, the positions of the
    commas and newlines (``ncol`` a line) give each line's integer fields (columns 2..5 and ``window``), and a
    sorted list of the chunk's ``.eE`` bytes says whether any lies inside one, in a few numpy passes. A chunk of
    other shape (blank lines, rows of another width) or with a hit is checked again row by row with the csv module,
    which names the line; so is a whole file with quotes (field boundaries then need the CSV grammar)."""
    int_cols = (2, 3, 4, 5) + ((8,) if has_window else ())
    first_nl = data.find(b"\n")
    if first_nl < 0:
        return
    if b'"' in data:
        _scan_int_fields(path, text.split("\n", 1)[1], 2, ncol, int_cols)
        return
    a = np.frombuffer(data, dtype=np.uint8)
    start, line0, n = first_nl + 1, 2, len(data)
    while start < n:
        end = data.find(b"\n", min(start + _CHECK_CHUNK, n) - 1)
        end = n if end < 0 else end + 1
        chunk = a[start:end]
        if chunk[-1] != 10:
            chunk = np.append(chunk, np.uint8(10))
        seps = np.flatnonzero((chunk == 44) | (chunk == 10))
        rows = len(seps) // ncol
        S = seps[:rows * ncol].reshape(rows, ncol)
        regular = len(seps) == rows * ncol and bool((chunk[S[:, -1]] == 10).all())
        hit = not regular
        if regular:
            cand = np.flatnonzero(_FLOAT_BYTES[chunk])
            if len(cand):
                inside = np.searchsorted(cand, S[:, 5]) > np.searchsorted(cand, S[:, 1])
                if has_window:
                    inside |= np.searchsorted(cand, S[:, 8]) > np.searchsorted(cand, S[:, 7])
                hit = bool(inside.any())
        if hit:
            _scan_int_fields(path, data[start:end].decode("utf-8"), line0, ncol, int_cols)
        line0 += data.count(b"\n", start, end)
        start = end


def read_kit_csv(path: str | os.PathLike, n_layers: int | None = None, n_expert: int | None = None) -> TraceTable:
    """Read a per-entry routing CSV (kit columns, optional ``phase``); see the module docstring.

    Raises:
        StrataError: a wrong header, a bad field (line number), out-of-range values, an empty file.
    """
    import pandas as pd

    path = Path(path)
    data, text = _read_bytes_text(path)
    first = text.split("\n", 1)[0].strip().lstrip("\ufeff")
    header = [h.strip() for h in first.split(",")]
    has_window = header == KIT_COLUMNS + ["phase", "window"]
    has_phase = header == KIT_COLUMNS + ["phase"] or has_window
    if header != KIT_COLUMNS and not has_phase:
        raise _line_err(path, 1, f"header is {first[:120]!r}, expected {','.join(KIT_COLUMNS)}[,phase[,window]]")
    dtypes = {"model": str, "prompt_id": str, "token_pos": "int64", "layer": "int64", "rank": "int64",
              "expert_id": "int64", "weight": "float64"}
    if has_phase:
        dtypes["phase"] = str
    if has_window:
        dtypes["window"] = "int64"
    try:
        df = pd.read_csv(io.StringIO(text), dtype=dtypes, engine="c", skip_blank_lines=True,
                         keep_default_na=False, na_filter=False, header=0, names=header, skipinitialspace=True)
        if df.shape[1] != len(header):
            raise ValueError("column count")
    except (ValueError, TypeError, pd.errors.ParserError, OverflowError):
        _slow_kit_scan(path, text, has_phase, has_window)
        raise  # unreachable: the slow scan always raises
    if len(df) == 0:
        raise StrataError(f"{path}: line 2: no routing rows after the header", path)
    _check_int_tokens(path, data, text, len(header), has_window)
    # line numbers: blank lines are skipped by the parser, so count them back only when an error needs one
    nonblank = None

    def line_of_rows() -> np.ndarray:
        nonlocal nonblank
        if nonblank is None:
            ls = text.splitlines()
            nonblank = np.array([i + 1 for i, l in enumerate(ls) if l.strip()][1:], dtype=np.int64)
        return nonblank

    class _Lines:
        def __getitem__(self, i):
            return line_of_rows()[i]

    pos = df["token_pos"].to_numpy()
    layer = df["layer"].to_numpy()
    rank = df["rank"].to_numpy()
    expert = df["expert_id"].to_numpy()
    weight = df["weight"].to_numpy()
    window = df["window"].to_numpy() if has_window else None
    ranges = [("token_pos", pos, 0, 2 ** 31 - 1), ("rank", rank, 0, MAX_ROUTE_K - 1),
              ("expert_id", expert, -(2 ** 31), 2 ** 31 - 1)]
    if window is not None:
        ranges.append(("window", window, -1, 2 ** 31 - 1))
    for name, a, lo, hi in ranges:
        bad = np.flatnonzero((a < lo) | (a > hi))
        if len(bad):
            i = int(bad[0])
            raise _line_err(path, int(line_of_rows()[i]), f"{name} {int(a[i])} is out of range {lo}..{hi}")
    _check_ranges(path, _Lines(), layer, expert, n_layers, n_expert)
    bad = np.flatnonzero(~np.isfinite(weight))
    if len(bad):
        i = int(bad[0])
        raise _line_err(path, int(line_of_rows()[i]), f"weight {weight[i]} is not finite")
    codes, names = pd.factorize(df["prompt_id"], sort=False)
    if has_phase:
        # map the few distinct spellings, not every row
        ph_codes, ph_names = pd.factorize(df["phase"], sort=False)
        ph_map = np.array([_PHASE_BY_NAME.get(str(x).strip().lower(), -1) for x in ph_names], dtype=np.int8)
        phase = ph_map[ph_codes]
        if (ph_map < 0).any():
            i = int(np.flatnonzero(phase < 0)[0])
            raise _line_err(path, int(line_of_rows()[i]), f"field phase is {df['phase'].iloc[i]!r}, expected "
                            f"prefill, decode or unknown")
    else:
        phase = np.broadcast_to(np.int8(UNKNOWN), (len(df),))
    # records: consecutive rows of one (prompt, position, layer, phase), a new one at every rank 0
    new = np.array(rank == 0, dtype=bool, copy=True)
    new[0] = True
    for a in (codes, pos, layer, phase):
        if np.asarray(a).strides != (0,):
            new[1:] |= a[1:] != a[:-1]
    starts = np.flatnonzero(new)
    check_record_lengths(starts, len(rank), path, "line", place=lambda i: line_of_rows()[i])
    _check_cut_end(path, text, np.diff(np.r_[starts, len(rank)]), lambda: int(line_of_rows()[len(rank) - 1]),
                   "record")
    i = first_repeat(expert, starts)
    if i >= 0:
        raise _line_err(path, int(line_of_rows()[i]), f"expert_id {int(expert[i])} appears twice in one record "
                        f"(prompt {names[codes[i]]}, token_pos {int(pos[i])}, layer {int(layer[i])})", REPEAT_FIX)
    models = list(pd.unique(df["model"]))
    meta: dict[str, Any] = {"source_format": "csv", "source_path": str(path), "source_sha256": sha256_file(path),
                            "source_bytes": path.stat().st_size, "request_names": [str(x) for x in names],
                            "records": int((rank == 0).sum()), "route_records": int((rank == 0).sum())}
    if len(models) == 1:
        meta["model_name"] = str(models[0])
    if n_layers is not None:
        meta["n_layers"] = int(n_layers)
    if n_expert is not None:
        meta["n_expert"] = int(n_expert)
    return TraceTable(request=codes.astype(np.int32), position=pos, phase=phase, layer=layer, rank=rank,
                      expert=expert, weight=weight.astype(np.float32), meta=meta, window=window)


def write_csv(table: TraceTable, path: str | os.PathLike, batch_rows: int = 1 << 20) -> None:
    """Write our per-entry CSV: the kit's columns plus ``phase``; deterministic bytes, atomic.

    ``model`` is ``meta["model_name"]`` (or the source format); ``prompt_id`` is the request's name from
    ``meta["request_names"]`` when present, else the request number. Weights are written with 9 significant
    digits (float32 round-trips). A last ``window`` column is added when the table has verify windows.

    Raises:
        StrataError: a table with negative positions (llama.cpp prompt rows): ``csv`` positions count from 0 and
            its reader refuses them; nothing is written.
    """
    csv_check_positions(table, path)
    with AtomicFile(path, "wb") as fh:
        windows = table.has_windows
        csv_header(fh, windows)
        csv_rows(fh, table, table.meta, windows, batch_rows)


def csv_check_positions(table: TraceTable, path: Any, row0: int = 0) -> None:
    """Refuse negative positions (llama.cpp prompt rows): ``csv`` positions count from 0 and its reader refuses
    them. ``row0``: the row number of the table's first row in the whole trace (for a trace written in parts)."""
    if len(table):
        pos = np.asarray(table.position)
        if int(pos.min()) < 0:
            i = int(np.argmax(pos < 0))
            raise StrataError(f"{path}: row {row0 + i}: position {int(pos[i])} is negative; csv positions count from "
                              f"0 (write this trace --to parquet, which keeps llama.cpp's negative prompt positions)",
                              path)


def csv_header(fh, windows: bool) -> None:
    """The header line of :func:`write_csv` (``window`` last when the trace has windows)."""
    fh.write((",".join(KIT_COLUMNS + ["phase"] + (["window"] if windows else [])) + "\n").encode())


def csv_rows(fh, table: TraceTable, meta: dict, windows: bool, batch_rows: int = 1 << 20) -> None:
    """The rows of ``table`` as :func:`write_csv` writes them (``meta`` names the model and the requests); a
    trace written in parts gives the bytes of one call."""
    import pandas as pd

    model = str(meta.get("model_name") or meta.get("source_format") or "trace")
    names = meta.get("request_names")
    # the csv module quotes a field that holds the delimiter, a quote or the line terminator ("\n") but not a bare
    # carriage return, which then breaks the row for every reader; and our reader skips white space after a
    # delimiter, so an unquoted leading space would be lost: with either in a name, every text field is quoted
    odd = [model] + [str(x) for x in (names or [])]
    quoting = csv.QUOTE_NONNUMERIC if any("\r" in x or x[:1].isspace() for x in odd) else csv.QUOTE_MINIMAL
    phase_names = np.array([PHASE_NAMES[PREFILL], PHASE_NAMES[DECODE], PHASE_NAMES[UNKNOWN]], dtype=object)
    for a in range(0, len(table), batch_rows):
        b = min(len(table), a + batch_rows)
        req = np.asarray(table.request[a:b])
        if names and len(req) and 0 <= int(req.min()) and int(req.max()) < len(names):
            pid = np.asarray(names, dtype=object)[req]
        else:
            pid = req
        ph = np.asarray(table.phase[a:b]).astype(np.int64)
        ph = np.where((ph >= 0) & (ph <= 2), ph, UNKNOWN)
        df = pd.DataFrame({"model": model, "prompt_id": pid, "token_pos": np.asarray(table.position[a:b]),
                           "layer": table.layer[a:b], "rank": table.rank[a:b], "expert_id": table.expert[a:b],
                           "weight": np.asarray(table.weight[a:b], dtype=np.float64),
                           "phase": phase_names[ph]})
        if windows:
            df["window"] = np.asarray(table.window[a:b], dtype=np.int64)
        fh.write(df.to_csv(index=False, header=False, float_format="%.9g", lineterminator="\n",
                           quoting=quoting).encode())
