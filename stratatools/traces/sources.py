"""Traces of any size as chunk sources: files, directories, globs and hive-partitioned Parquet datasets.

A *chunk source* is what the streaming consumers (:class:`stratatools.cachesim.replay.EntryStream`,
:func:`stratatools.profiles.ranking.count_pairs`, :func:`trace_stats_sources`) read:
an object with ``name``, ``meta``, ``has_windows`` and ``chunks(rows)``, which yields dicts of per-entry int64
columns (``request, position, phase (int8), layer, rank, expert``, plus ``weight`` float32 and ``window`` when
present) in trace order, about ``rows`` entries at a time. Memory is one chunk, whatever the trace length:

* Parquet files are read in record batches (``pyarrow.dataset``), with ``--where`` filters pushed down;
* tagged Strata traces are walked in chunks by the compiled walker (:mod:`.formats.strata_walk`); records are
  handed on as soon as no later commit can still put them into a verify window (memory: one chunk plus the
  records since the last commit or request tag);
* plain Strata traces are mapped (:func:`.formats.strata.read_strata`) and cut at record boundaries;
* CSV traces (small by nature) are read whole.

Arguments (:func:`expand_traces`): a file; a directory (every Parquet file under it, a hive-partitioned dataset
``key=value/.../part-*.parquet``, else every file directly in it); a glob (``traces/*.bin``, ``**`` recurses).
Each file is one input (request ids are made distinct per file when traces are merged). ``--where KEY=VALUE``
(repeatable; several values of one key are alternatives) keeps the files whose partition ``KEY`` (a
``KEY=VALUE`` folder of its path) is VALUE (files without a ``KEY=`` folder are left out), and for a data column of
a Parquet file the rows whose value is VALUE (files without a ``KEY=`` folder included).
"""

from __future__ import annotations

import glob as _glob
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from stratatools.core.errors import OtherModelInput, StrataError
from stratatools.core.fsutil import check_input
from stratatools.traces.table import COLUMNS, TraceStats, TraceTable, _stats_combine, stats_partial, table_chunks

GLOB_CHARS = set("*?[")


def parse_where(items: Sequence[str] | None) -> dict[str, list[str]]:
    """``--where`` items: ``["server=a", "date=2026-12-01", "server=b"]`` -> ``{"server": ["a", "b"], "date":
    [...]}`` (several values of one key are alternatives).

    Raises StrataError for an item without ``=`` or with an empty key."""
    out: dict[str, list[str]] = {}
    for it in items or []:
        if "=" not in it or not it.split("=", 1)[0].strip():
            raise StrataError(f"--where {it!r}: expected COLUMN=VALUE, e.g. server=a")
        k, v = it.split("=", 1)
        out.setdefault(k.strip(), []).append(v)
    return out


def parse_partition(items: Sequence[str] | None) -> dict[str, str]:
    """``--partition`` items, the folder levels of a dataset partition in order: ``["server=a", "date=2026-12-01"]``
    -> ``{"server": "a", "date": "2026-12-01"}``.

    Raises StrataError naming ``--partition`` for an item without ``=`` or with an empty key, and for a key given
    twice (a partition has one value per key)."""
    out: dict[str, str] = {}
    for it in items or []:
        if "=" not in it or not it.split("=", 1)[0].strip():
            raise StrataError(f"--partition {it!r}: expected KEY=VALUE, e.g. server=a (one folder level)")
        k, v = it.split("=", 1)
        k = k.strip()
        if k in out:
            raise StrataError(f"--partition {it}: key {k} is given twice ({k}={out[k]}); a partition has one value per "
                              f"key: give each key once")
        out[k] = v
    return out


def _partition_keys(path: Path, root: Path | None) -> dict[str, str]:
    """``key=value`` folders of ``path`` (below ``root`` when given)."""
    parts = path.parent.parts
    if root is not None:
        try:
            parts = path.parent.relative_to(root).parts
        except ValueError:
            pass
    out = {}
    for p in parts:
        if "=" in p:
            k, v = p.split("=", 1)
            out[k] = v
    return out


def _is_parquet(p: Path) -> bool:
    if p.suffix == ".parquet":
        return True
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == b"PAR1"
    except OSError:
        return False


def expand_traces(args: Sequence[str], where: Sequence[str] | None = None) -> list[tuple[Path, dict[str, str]]]:
    """Trace arguments -> the files they name, each with its partition keys, in a stable order (arguments in
    order; inside a directory or glob, sorted paths).

    Raises:
        StrataError: no argument; a missing path; a glob that matches nothing; a directory without traces;
            a ``--where`` key that is neither a partition key of any file nor a Parquet column; every file
            filtered out.
    """
    if not args:
        raise StrataError("no traces given (pass one or more trace files, folders or globs)")
    wh = parse_where(where)
    files: list[tuple[Path, Path | None]] = []
    for a in args:
        s = str(a)
        if any(c in s for c in GLOB_CHARS) and not Path(s).exists():
            hits = sorted(Path(h) for h in _glob.glob(s, recursive=True))
            hits = [check_input(h, "trace") for h in hits if h.is_file()]
            if not hits:
                raise StrataError(f"{s}: the glob matches no file (check the pattern and quote it so the shell "
                                  f"does not expand it)")
            root = Path(s.split("*")[0].split("?")[0].split("[")[0])
            root = root if root.is_dir() else root.parent
            files += [(h, root) for h in hits]
            continue
        p = check_input(Path(s), "trace")  # a FIFO, socket, device or symlink loop: one line, never opened
        if not p.exists():
            raise StrataError(f"{p}: no such file or folder", p)
        if p.is_dir():
            pq = sorted(x for x in p.rglob("*") if x.is_file() and x.suffix == ".parquet")
            if not pq:
                pq = sorted(x for x in p.iterdir() if x.is_file() and not x.name.startswith("."))
            if not pq:
                raise StrataError(f"{p}: the folder holds no trace files", p)
            files += [(x, p) for x in pq]
        else:
            files.append((p, None))
    out = [(f, _partition_keys(f, root)) for f, root in files]
    if wh:
        known = set().union(*(set(k) for _, k in out)) if out else set()
        data_cols = set(COLUMNS) | {"window"}
        for key in wh:
            if key not in known and key not in data_cols:
                have = ", ".join(sorted(known)) or "none"
                raise StrataError(f"--where {key}=...: no partition key or column {key!r} (partition keys: {have}; "
                                  f"columns: {', '.join(COLUMNS)}, window)")
        # a partition key: only files whose KEY=VALUE folder matches (a file without that folder has no such
        # partition); a data column without a folder in some file: those files are kept, filtered by rows
        out = [(f, k) for f, k in out if all(k[key] in vals if key in k else key in data_cols
                                                  for key, vals in wh.items() if key in known)]
        if not out:
            raise StrataError("--where " + " ".join(f"{k}={'|'.join(v)}" for k, v in wh.items())
                              + ": no trace file is left (check the values against the folder names)")
    return out


class TableSource:
    """A trace read whole (CSV, small traces), walked by :func:`stratatools.traces.table.table_chunks`."""

    def __init__(self, table: TraceTable, name: str = ""):
        self.table, self.name = table, name
        self.meta = dict(table.meta)
        self.has_windows = table.has_windows

    def __len__(self) -> int:
        return len(self.table)

    def chunks(self, rows: int) -> Iterator[dict]:
        return table_chunks(self.table, rows, columns=("request", "position", "phase", "layer", "rank", "expert",
                                                       "weight"))


class ParquetSource:
    """One Parquet trace file: schema, metadata and row counts through ``pyarrow.dataset`` (``--where`` filters
    as its expressions), rows in record batches of its row groups (``pyarrow.parquet``), filtered per batch."""

    def __init__(self, path: Path, n_layers: int | None = None, n_expert: int | None = None,
                 where: dict[str, list[str]] | None = None, partition: dict[str, str] | None = None):
        import pyarrow as pa
        import pyarrow.dataset as pads

        from stratatools.traces.formats.parquet import (UNREADABLE_FIX, WINDOW, arrow_reason, parquet_file_format,
                                                        stored_meta)

        self.path, self.name = Path(path), str(path)
        self.n_layers, self.n_expert = n_layers, n_expert
        try:
            self.ds = pads.dataset(str(path), format=parquet_file_format())
            schema = self.ds.schema
            _ = schema.names  # decoded here: a column name that is not UTF-8 is the same one-line error
        except (pa.ArrowException, OSError, ValueError) as e:
            raise StrataError(f"{path}: byte 0: not a readable Parquet trace ({arrow_reason(e)}); {UNREADABLE_FIX}",
                              path) from None
        self.schema = schema
        missing = [c for c in COLUMNS if c not in schema.names]
        if missing:
            raise StrataError(f"{path}: Parquet schema lacks column(s) {', '.join(missing)}; expected "
                              f"{', '.join(COLUMNS)} (write it with `stratatools trace convert --to parquet`)", path)
        self.has_windows = WINDOW in schema.names
        meta = stored_meta(schema)
        meta.update({"source_format": "parquet", "source_path": str(path), "source_bytes": self.path.stat().st_size})
        if partition:
            meta["partition"] = dict(partition)
        self.meta = meta
        expr = None
        self.filter_cols: dict[str, list] = {}
        for key, vals in (where or {}).items():
            if key not in schema.names:
                continue
            f = schema.field(key)
            try:
                vs = [int(v) if pa.types.is_integer(f.type) else v for v in vals]
            except ValueError:
                raise StrataError(f"--where {key}={vals[0]}: column {key} holds integers") from None
            e = pads.field(key).isin(vs)
            expr = e if expr is None else expr & e
            self.filter_cols[key] = vs
        self.filter = expr

    def __len__(self) -> int:
        return int(self.ds.count_rows(filter=self.filter))

    def signature(self) -> tuple:
        """Column names and types (for checking that the files of a dataset agree)."""
        return tuple((f.name, str(f.type)) for f in self.schema if f.name in COLUMNS or f.name == "window")

    def chunks(self, rows: int) -> Iterator[dict]:
        import pyarrow as pa

        cols = list(COLUMNS) + (["window"] if self.has_windows else [])
        row = 0
        # pyarrow.parquet's row-group reader, not the dataset scanner: the scanner's read-ahead and row-group
        # caching took 721 MB on a 1e8-entry dataset where iter_batches takes 326 MB (measured here)
        import pyarrow.compute as pc

        from stratatools.traces.formats.parquet import (UNREADABLE_FIX, arrow_reason, check_integer_column,
                                                        open_parquet_file)
        from stratatools.traces.semantics import ChunkChecker

        check = ChunkChecker(self.path)  # phases, weights, ranks, distinct ids per record (as read_trace checks)
        def batches():  # a corrupt page or footer is a one-line error naming the file, as in read_parquet
            try:
                pf = open_parquet_file(self.path)
                want, got = pf.metadata.num_rows, 0
                it = pf.iter_batches(batch_size=max(int(rows), 1),
                                     columns=cols + [k for k in self.filter_cols if k not in cols], use_threads=False)
                for b in it:
                    got += b.num_rows
                    yield b
            except (pa.ArrowException, OSError, ValueError) as e:
                raise StrataError(f"{self.path}: not a readable Parquet trace ({arrow_reason(e)}); {UNREADABLE_FIX}",
                                  self.path) from None
            if got != want:  # a damaged page header (not under the page CRC) can end the batches early
                raise StrataError(f"{self.path}: not a readable Parquet trace (its pages hold {got:,} of the "
                                  f"{want:,} rows its footer states); {UNREADABLE_FIX}", self.path)

        for b in batches():
            if self.filter_cols:
                keep = None
                for k, vs in self.filter_cols.items():
                    m = pc.is_in(b.column(k), value_set=pa.array(vs, type=b.schema.field(k).type))
                    keep = m if keep is None else pc.and_(keep, m)
                b = b.filter(keep)
            out = {}
            for name in cols:
                c = b.column(name)
                if c.null_count:
                    raise StrataError(f"{self.path}: column {name} has {c.null_count} null values", self.path)
                check_integer_column(self.path, name, c.type)
                try:
                    a = c.to_numpy(zero_copy_only=False)
                except (pa.ArrowException, ValueError) as e:
                    raise StrataError(f"{self.path}: column {name}: {arrow_reason(e)}",
                                      self.path) from None
                out[name] = np.asarray(a, np.int8 if name == "phase" else np.float32 if name == "weight"
                                       else np.int64)
            lay, exp = out["layer"], out["expert"]
            for name, a in (("layer", lay), ("expert", exp)):
                if len(a) and int(a.min()) < 0:
                    i = int(np.argmax(a < 0))
                    raise StrataError(f"{self.path}: row {row + i}: {name} {int(a[i])} is negative", self.path)
            if self.n_expert is not None and len(exp):
                bad = exp >= self.n_expert
                if self.n_layers is not None:
                    bad &= lay < self.n_layers
                if bad.any():
                    i = int(np.argmax(bad))
                    raise OtherModelInput(f"{self.path}: row {row + i}: expert id {int(exp[i])} of layer {int(lay[i])} "
                                      f"is out of range for {self.n_expert} experts (the trace is for a model with "
                                      f"more experts)", self.path)
            check(out)
            row += len(lay)
            yield out


class StrataTaggedSource:
    """A tagged Strata trace walked in chunks (module docstring); the same entries, positions, phases and
    windows as :func:`stratatools.traces.formats.strata.read_strata`, without holding the trace."""

    has_windows = True  # window -1 everywhere when the trace has no commits (replay and stats alike)

    def __init__(self, path: Path, n_layers: int | None = None, n_expert: int | None = None,
                 chunk_bytes: int | None = None):
        self.path, self.name = Path(path), str(path)
        self.n_layers, self.n_expert = n_layers, n_expert
        self.chunk_bytes = chunk_bytes
        self.meta = {"source_format": "strata-tagged", "source_path": str(path),
                     "source_bytes": self.path.stat().st_size}

    def chunks(self, rows: int) -> Iterator[dict]:
        from stratatools.traces.formats import strata_walk as SW

        return _walk_chunks(self.path, self.n_layers, self.n_expert, int(rows), SW, self.chunk_bytes)

    def record_chunks(self, rows: int) -> Iterator[dict]:
        """The trace's records in chunks of about ``rows`` entries: dicts of int64 columns ``request, position,
        phase (int8), layer, window`` and ``k`` (route ids of the record; the entries of :meth:`chunks` are
        each record repeated ``k`` times with rank 0..k-1). Cheaper than :meth:`chunks` for what is a property
        of records (a replay's scan pass)."""
        from stratatools.traces.formats import strata_walk as SW

        return _walk_chunks(self.path, self.n_layers, self.n_expert, int(rows), SW, self.chunk_bytes,
                            per_record=True)


def _walk_chunks(path: Path, n_layers, n_expert, rows: int, SW, chunk_bytes: int | None,
                 per_record: bool = False) -> Iterator[dict]:
    import mmap

    from stratatools.traces.formats.strata_spec import MAX_ROUTE_K, TAG_FORMAT
    from stratatools.traces.table import DECODE, UNKNOWN

    size = path.stat().st_size
    mm = SW._map(path, size)
    if mm is None:
        raise StrataError(f"{path}: cannot be mapped", path)
    W = size // 4
    a = np.frombuffer(mm, dtype="<i4", count=W)
    max_route_k = MAX_ROUTE_K if n_expert is None else min(MAX_ROUTE_K, int(n_expert))
    tagged = W >= 2 and int(a[0]) == TAG_FORMAT and int(a[1]) >= 0
    version = int(a[2]) if tagged and int(a[1]) >= 1 and W >= 3 else 0
    chunk_w = max(int(chunk_bytes) // 4 if chunk_bytes else 2 * max(rows, 1), 64)
    st = np.zeros(SW.N_STATE, np.int64)
    st[SW.S_LO], st[SW.S_HI] = 1 << 40, -1
    st[SW.S_PHASE] = UNKNOWN if tagged else DECODE
    cap_e = chunk_w // 2 + MAX_ROUTE_K + 2
    cap_r = chunk_w // 4 + 4
    bufs = {"expert": np.empty(cap_e, np.int32), "weight": np.empty(cap_e, np.float32)}
    recs = {"layer": np.empty(cap_r, np.int16), "k": np.empty(cap_r, np.int32), "req": np.empty(cap_r, np.int32),
            "phase": np.empty(cap_r, np.int8), "win": np.empty(cap_r, np.int32)}
    tags = np.empty(chunk_w // 2 + 4, np.int32)
    status = 0
    dropped = 0
    can_drop = hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED")

    tab = [np.full(1 << 10, -1, np.int64), np.zeros(1 << 10, np.int64), 0]  # (request, layer) -> records seen

    def emit(e: int) -> dict:
        n_rec = int(st[SW.S_NREC])
        kvar = bool(st[SW.S_KVAR])
        kc = int(st[SW.S_K])
        ne = int(recs["k"][:e].sum()) if kvar else e * kc
        rows_out = e if per_record else ne
        if 2 * (tab[2] + e) > len(tab[0]):  # keep the ordinal table at most half full
            size = len(tab[0])
            while 2 * (tab[2] + e) > size:
                size *= 2
            nk, nv = np.full(size, -1, np.int64), np.zeros(size, np.int64)
            SW._ordinal_rehash(tab[0], tab[1], nk, nv)
            tab[0], tab[1] = nk, nv
        cols = [np.empty(rows_out, np.int64) for _ in range(6)]
        cols[2] = np.empty(rows_out, np.int8)
        # position: the record's ordinal among earlier records of the same (request, layer), across chunks
        got, added = SW.expand_records(e, kvar, kc, recs["k"], recs["layer"], recs["req"], recs["phase"],
                                       recs["win"], tab[0], tab[1], *cols, per_record)
        tab[2] += int(added)
        if per_record:
            out = {"request": cols[0], "position": cols[1], "phase": cols[2], "layer": cols[3], "k": cols[4],
                   "window": cols[5]}
        else:
            out = {"request": cols[0], "position": cols[1], "phase": cols[2], "layer": cols[3], "rank": cols[4],
                   "expert": bufs["expert"][:ne].astype(np.int64), "weight": bufs["weight"][:ne].copy(),
                   "window": cols[5]}
        # keep the records not handed on at the front
        rest_e = int(st[SW.S_NENT]) - ne
        for b in bufs.values():
            b[:rest_e] = b[ne:ne + rest_e]
        for r in recs.values():
            r[:n_rec - e] = r[e:n_rec]
        st[SW.S_NREC] = n_rec - e
        st[SW.S_NENT] = rest_e
        st[SW.S_SEG] = max(int(st[SW.S_SEG]) - e, 0)
        return out

    try:
        while status == 0 and int(st[SW.S_O]) < W:
            end = min(int(st[SW.S_O]) + chunk_w, W)
            need_e = int(st[SW.S_NENT]) + (end - int(st[SW.S_O])) // 2 + MAX_ROUTE_K + 2
            need_r = int(st[SW.S_NREC]) + (end - int(st[SW.S_O])) // 4 + 4
            if need_e > len(bufs["expert"]):  # a long stretch without commit or request tags
                used = int(st[SW.S_NENT])
                for k in bufs:
                    g = np.empty(need_e * 2, bufs[k].dtype)
                    g[:used] = bufs[k][:used]
                    bufs[k] = g
            if need_r > len(recs["layer"]):
                used = int(st[SW.S_NREC])
                for k in recs:
                    g = np.empty(need_r * 2, recs[k].dtype)
                    g[:used] = recs[k][:used]
                    recs[k] = g
            st[SW.S_NTAGS] = 0
            status = SW.walk(a, end, st, max_route_k, -1 if n_layers is None else int(n_layers),
                             -1 if n_expert is None else int(n_expert), tagged, version == 1, bufs["expert"],
                             bufs["weight"].view(np.int32), recs["layer"], recs["k"], recs["req"], recs["phase"],
                             recs["win"], tags)
            if status != 0:
                break
            done = 4 * int(st[SW.S_O]) // mmap.PAGESIZE * mmap.PAGESIZE
            if can_drop and done > dropped:
                mm.madvise(mmap.MADV_DONTNEED, dropped, done - dropped)
                dropped = done
            e = int(st[SW.S_SEG]) if tagged else int(st[SW.S_NREC])
            if e > 0:
                yield emit(e)
        if status == 2:
            raise SW._scan_error(path, st, n_expert, max_route_k)
        o = int(st[SW.S_O])
        if status == 1 or 4 * o < size:
            raise SW._cut_error(path, a, o, size, max_route_k)
        if st[SW.S_DERR]:
            raise SW._tag_error(path, st)
        if int(st[SW.S_NREC]):
            yield emit(int(st[SW.S_NREC]))
    finally:
        del a
        try:
            mm.close()
        except BufferError:
            pass


def open_source(path: str | os.PathLike, fmt: str | None = None, n_layers: int | None = None,
                n_expert: int | None = None, *, where: dict[str, list[str]] | None = None,
                partition: dict[str, str] | None = None):
    """One trace file as a chunk source (module docstring): Parquet in batches, tagged Strata walked in chunks,
    plain Strata mapped, CSV read whole. The source's ``spec`` reopens it elsewhere (a Dask worker):
    ``open_source(*spec[:4], where=spec[4], partition=spec[5])``. Raises every reader's StrataError (the file,
    the byte or row, the fix)."""
    s = _open_source(path, fmt, n_layers, n_expert, where, partition)
    s.spec = (str(path), fmt, n_layers, n_expert, where, partition)
    return s


def _open_source(path, fmt, n_layers, n_expert, where, partition):
    from stratatools.traces.formats import read_trace, sniff_format

    p = Path(path)
    f = fmt or sniff_format(p)
    if f == "parquet":
        return ParquetSource(p, n_layers, n_expert, where, partition)
    if f in ("strata", "strata-tagged"):
        with open(p, "rb") as fh:
            head = np.frombuffer(fh.read(8).ljust(8, b"\0"), "<i4")
        from stratatools.traces.formats.strata_spec import TAG_FORMAT
        from stratatools.traces.formats.strata_walk import HAVE_NUMBA

        if int(head[0]) == TAG_FORMAT and int(head[1]) >= 0 and HAVE_NUMBA and p.stat().st_size >= 8:
            return StrataTaggedSource(p, n_layers, n_expert)
    if where and any(k not in (partition or {}) for k in where):
        raise StrataError(f"{p}: --where on a data column needs Parquet traces (this one is {f})", p)
    return TableSource(read_trace(p, f, n_layers, n_expert, sha256=False), str(p))


def open_traces(args: Sequence[str], fmt: str | None = None, n_layers: int | None = None,
                n_expert: int | None = None, where: Sequence[str] | None = None) -> list:
    """Every file the arguments name (:func:`expand_traces`) as a chunk source (:func:`open_source`).

    Raises:
        StrataError: everything :func:`expand_traces` and the readers refuse, and Parquet files of one dataset
            whose columns or stored geometry (``n_layers``/``n_expert`` in their metadata) disagree.
    """
    wh = parse_where(where)
    out = []
    first_pq = None
    for path, part in expand_traces(args, where):
        s = open_source(path, fmt, n_layers, n_expert, where=wh, partition=part)
        if isinstance(s, ParquetSource):
            if first_pq is None:
                first_pq = s
            else:
                if s.signature() != first_pq.signature():
                    a, b = dict(first_pq.signature()), dict(s.signature())
                    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                    raise StrataError(f"{path}: its schema differs from {first_pq.path} in column(s) "
                                      f"{', '.join(diff)}; the files of one dataset must share one schema", path)
                for g in ("n_layers", "n_expert"):
                    if g in s.meta and g in first_pq.meta and s.meta[g] != first_pq.meta[g]:
                        raise StrataError(f"{path}: written for {g} {s.meta[g]} but {first_pq.path} for "
                                          f"{first_pq.meta[g]}; traces of one dataset must come from one model", path)
        out.append(s)
    return out


def trace_stats_sources(sources, n_expert: int | None = None, progress=None, rows: int = 1 << 20,
                        client=None) -> TraceStats:
    """:func:`trace_stats` over chunk sources (:mod:`stratatools.traces.sources`), read chunk by chunk: memory
    is one chunk plus the distinct tokens and requests, whatever the traces' length. Several sources are one
    fleet (requests, tokens and windows are distinct per source); ``meta`` is the first source's, with
    ``inputs`` (the number of sources) when there are several. Equal to ``trace_stats(table)`` for one trace.

    ``progress``: optional callable(entries) after each chunk (in-process) or (1) per file (Dask).
    ``client``: a ``distributed.Client`` (:mod:`stratatools.core.cluster`): every source is counted by a task
    (reopened from its ``spec`` on the worker) and the partial counts combined in order: the same result.
    """
    sources = list(sources)
    meta = dict(sources[0].meta) if sources else {}
    if len(sources) > 1:
        meta["inputs"] = len(sources)
    if n_expert is None:
        n_expert = meta.get("n_expert")
    if client is not None:
        from stratatools.core.cluster import run_tasks

        class _P:
            def update(self, advance: int = 0, **_):
                if progress is not None:
                    progress(advance)

        parts = run_tasks(client, _stats_task, [(s.spec, rows) for s in sources], name="trace-stats",
                          progress=_P())
    else:
        parts = [stats_partial(s, rows, progress) for s in sources]
    return _stats_combine(parts, meta, n_expert)


def _stats_task(spec, rows):
    return stats_partial(open_source(*spec[:4], where=spec[4], partition=spec[5]), rows)



def convert_trace_stream(src: str | os.PathLike, out: str | os.PathLike, to: str, fmt: str | None = None,
                         force: bool = False, n_layers: int | None = None, n_expert: int | None = None, *,
                         rows: int = 1 << 20, progress=None) -> ConvertResult:
    """:func:`stratatools.traces.formats.convert_trace` chunk by chunk: ``src`` is read as a chunk source
    (:func:`open_source`: Parquet in record batches, tagged Strata walked, plain Strata
    mapped; CSV is read whole) and written as it comes, so memory is about one chunk of ``rows`` entries whatever
    the trace's length. The output reads back as ``convert_trace``'s does (the same table, windows and
    metadata but the reader's walk counts); Strata output is byte-identical. A tagged Strata output with verify
    windows is cut only where a request changes or a window closes (a commit tag), so it holds at most one such
    stretch besides the chunk. Plain Strata holds decode positions only: prefill entries are left out and counted
    (``dropped_prefill``, ``dropped_prefill_records``; :func:`.formats.strata.drop_prefill`).
    ``progress``: callable(entries read) after each chunk.

    Raises:
        StrataError: as ``convert_trace`` (unknown format, output onto the input or existing without
            ``force``, every reader and writer error; plain Strata from a trace that is all prefill).
    """
    from stratatools.core.fsutil import AtomicFile, guard_output, sha256_file
    from stratatools.traces.formats import WRITE_FORMATS, ConvertResult

    if to not in WRITE_FORMATS:
        raise StrataError(f"unknown output format {to!r} (use {', '.join(WRITE_FORMATS)})")
    guard_output(out, [src], force)
    source = open_source(src, fmt, n_layers, n_expert)
    meta = dict(getattr(source, "meta", {}))
    if "source_sha256" not in meta:
        meta["source_sha256"] = sha256_file(src)
    if n_layers is not None:
        meta["n_layers"] = int(n_layers)
    if n_expert is not None:
        meta["n_expert"] = int(n_expert)
    windows = bool(getattr(source, "has_windows", False)) and _has_a_window(source, rows)
    writer = _StreamWriter(to, out, meta, windows)
    entries = records = 0
    with AtomicFile(out, "wb") as fh:
        writer.begin(fh)
        try:
            for c in source.chunks(rows):
                n = len(c["layer"])
                if not n:
                    continue
                entries += n
                records += writer.add(fh, c)
                if progress is not None:
                    progress(n)
            records += writer.end(fh)
            if writer.dropped and entries == writer.dropped:
                from stratatools.traces.formats.strata import all_prefill_error

                raise all_prefill_error(out, entries)
        except BaseException:
            writer.abort()
            raise
    return ConvertResult(str(src), str(out), str(meta.get("source_format")), to, entries - writer.dropped, records,
                         Path(out).stat().st_size, meta, writer.dropped, writer.dropped_records)


def _has_a_window(source, rows: int) -> bool:
    """Whether a source that may carry windows has any (a tagged trace without commit tags has none: its whole
    read gives no window column); a cheap pass over the records where the source offers them."""
    it = source.record_chunks(rows) if hasattr(source, "record_chunks") else source.chunks(rows)
    for c in it:
        w = c.get("window")
        if w is not None and len(w) and int(w.max()) >= 0:
            return True
    return False


class _StreamWriter:
    """One output format written chunk by chunk (:func:`convert_trace_stream`)."""

    def __init__(self, to: str, path, meta: dict, windows: bool):
        self.to, self.path, self.meta, self.windows = to, path, meta, windows
        self.hold: dict | None = None  # entries held back (an open record, or an open window stretch)
        self.state: dict = {}
        self.last = None  # (request, position, layer, phase) of the last entry counted by _records
        self.rows = 0  # entries written (CSV: the row numbers of its errors)
        self.dropped = self.dropped_records = 0  # plain Strata: prefill entries/records left out (decode only)
        self.last_dropped = None  # (request, position, layer, phase) of the last prefill entry left out

    def begin(self, fh) -> None:
        if self.to == "parquet":
            import pyarrow.parquet as pq

            from stratatools.traces.formats.parquet import _schema

            self.schema = _schema(self.meta, self.windows)
            from stratatools.traces.formats.parquet import WRITE_OPTIONS

            self.pw = pq.ParquetWriter(fh, self.schema, **WRITE_OPTIONS)
        elif self.to == "csv":
            from stratatools.traces.formats.text import csv_header

            csv_header(fh, self.windows)
        elif self.to == "strata-tagged":
            from stratatools.traces.formats.strata import TAG_FORMAT, _tag

            fh.write(_tag(TAG_FORMAT, [1]))

    def _table(self, c: dict) -> TraceTable:
        from stratatools.traces.table import COLUMNS

        n = len(c["layer"])
        cols = {k: c[k] if k in c else np.ones(n, np.float32) for k in COLUMNS}
        win = None
        if self.windows:
            win = c["window"] if "window" in c else np.full(n, -1, np.int32)
        return TraceTable(**cols, meta=self.meta, window=win)

    def add(self, fh, c: dict) -> int:
        """Write what of chunk ``c`` can be written now; returns the records written."""
        if self.to == "parquet":
            import pyarrow as pa

            from stratatools.traces.formats.parquet import WINDOW

            from stratatools.traces.table import COLUMNS

            t = self._table(c)
            names = list(COLUMNS) + ([WINDOW] if self.windows else [])
            arrays = [pa.array(np.ascontiguousarray(t.window if k == WINDOW else getattr(t, k)),
                               type=self.schema.field(k).type) for k in names]
            self.pw.write_table(pa.Table.from_arrays(arrays, schema=self.schema))
            return self._records(t)
        if self.to == "csv":
            from stratatools.traces.formats.text import csv_check_positions, csv_rows

            t = self._table(c)
            csv_check_positions(t, self.path, self.rows)
            self.rows += len(t)
            csv_rows(fh, t, self.meta, self.windows)
            return self._records(t)
        # Strata: whole records (and, tagged with windows, whole stretches between request changes and commits)
        if self.to == "strata":  # plain: decode positions only, as the engine's dump (strata.drop_prefill)
            from stratatools.traces.table import PREFILL

            pre = np.asarray(c["phase"]) == PREFILL
            if pre.any():
                self.dropped += int(pre.sum())
                n_rec, self.last_dropped = self._count_records(self._table({k: v[pre] for k, v in c.items()}),
                                                               self.last_dropped)
                self.dropped_records += n_rec
                c = {k: v[~pre] for k, v in c.items()}
                if not len(c["layer"]):
                    return 0
        if self.hold is not None:
            c = {k: np.concatenate([self.hold[k], c[k]]) for k in c if k in self.hold}
        t = self._table(c)
        cut = self._cut(t)
        self.hold = {k: v[cut:] for k, v in c.items()}
        return self._write(fh, t.take(np.arange(len(t)) < cut)) if cut else 0

    def end(self, fh) -> int:
        n = 0
        if self.to == "parquet":
            self.pw.close()
        elif self.hold is not None and len(self.hold["layer"]):
            n = self._write(fh, self._table(self.hold))
        self.hold = None
        return n

    def abort(self) -> None:
        """Close what is open after an error (the output is then discarded)."""
        pw, self.pw = getattr(self, "pw", None), None
        if pw is not None:
            try:
                pw.close()
            except Exception:  # noqa: BLE001 - the error being raised is the one to report
                pass

    def _records(self, t: TraceTable) -> int:
        """Records starting in ``t`` (:func:`.table.record_bounds`' rule, a record continued from the previous
        chunk not counted again)."""
        n, self.last = self._count_records(t, self.last)
        return n

    @staticmethod
    def _count_records(t: TraceTable, last) -> tuple[int, tuple]:
        """Records starting in ``t`` after an entry keyed ``last`` (None: none) and the key of its last entry."""
        from stratatools.traces.table import record_bounds

        n = len(record_bounds(t))
        keys = (t.request, t.position, t.layer, t.phase)
        if n and last is not None and int(t.rank[0]) != 0 and all(int(a[0]) == b for a, b in zip(keys, last)):
            n -= 1
        return int(n), tuple(int(a[-1]) for a in keys)

    def _cut(self, t: TraceTable) -> int:
        """The last row the entries can be cut at: a record start, the last record held back (it may go on);
        tagged with windows, where the request changes or the previous record closed a window."""
        from stratatools.traces.table import record_bounds

        st = record_bounds(t)
        if len(st) < 2:
            return 0
        if self.to == "strata" or not self.windows:
            return int(st[-1])
        cand = st[1:]
        req, win = np.asarray(t.request), np.asarray(t.window)
        ok = (req[cand] != req[cand - 1]) | ((win[cand - 1] >= 0) & (win[cand] != win[cand - 1]))
        idx = np.flatnonzero(ok)
        return int(cand[idx[-1]]) if len(idx) else 0

    def _write(self, fh, t: TraceTable) -> int:
        from stratatools.traces.formats.strata import _check_writable, _write_records, _write_tagged
        from stratatools.traces.table import record_bounds

        _check_writable(t, self.path)
        starts = record_bounds(t)
        ks = np.diff(np.r_[starts, len(t)])
        if self.to == "strata":
            _write_records(fh, t, 0, len(starts), starts, ks, self.path)
        else:
            _write_tagged(fh, t, starts, ks, self.path, self.state)
        return int(len(starts))



__all__ = ["trace_stats_sources", "expand_traces", "parse_where", "parse_partition", "open_source", "open_traces",
           "ParquetSource", "StrataTaggedSource", "TableSource", "convert_trace_stream"]
