"""Replay traces through tiers: entries, rounds, metrics, the bandwidth model.

Definitions (cache-policy.md "Hit-rate definitions"; every report names which one it shows):

* ``h_expert``: hits / routed (token, layer, expert) entries; hit = resident at the time of use.
* ``h_layer``: share of records (one token's routing of one layer) whose k experts were all resident.
* ``h_bytes``: hits weighted by their layer's blob bytes (host-memory traffic is what it decides).
* ``moved_bytes``: host->VRAM copies during the replay (misses admitted, adaptive copies, baseline loads),
  in actual blob bytes; the start-up fill is reported apart as ``fill_bytes``.
* Bandwidth model (:class:`BandwidthModel`, stated in every report): each routed entry reads its expert's
  blob once, from VRAM on a hit and from host memory on a miss; copies cross PCIe and are not overlapped
  with compute; everything but routed experts is left out. ``time_per_token_s`` = (hit bytes / VRAM GB/s +
  miss bytes / host GB/s + moved bytes / PCIe GB/s) / tokens, GB = 1e9 bytes. It ranks policies by traffic;
  it does not predict an engine's tokens/s.

Rounds (what the adaptive tier's ``adapt_every`` and the LFU/LFRU decay count): one decode position (request,
position); a trace with verify windows (``TraceTable.window``, from the commit records of a tagged Strata trace,
or a ``window`` column of our Parquet/CSV; else an ndarray ``meta["window"]`` [N]) makes one round per
(request, window) for the entries inside a window, and one per position for those outside every window (-1).
A request whose positions go back in file order is batched (layer-major: llama.cpp's ubatch capture, the kit's
routing CSVs): each batch, up to where the layer goes back, is one round, as a verify window is.
``Entries.rounds_by`` / ``SimResult.rounds_by`` say which applied (``positions``, ``windows``,
``windows+positions``, ``batches`` or ``...+batches``). The runtime (``stratatools run``) writes each prefill batch
as a window, so its rounds come back exactly: one per forward batch (:data:`stratatools.traces.table.ROUNDS`).

Phases: ``phase="decode"`` (the default) replays every entry and counts the decode ones: the prefill warms the
cache as it did in the engine, and its entries are in :attr:`Entries.count` as False (``warmup`` in reports);
``cold=True`` drops the known prefill entries instead, so the decode starts on the cache as the fill left it
(Strata's ``--dump-routing`` writes decode positions only; llama.cpp traces mark prompt processing with negative
positions). ``phase="all"`` replays and counts everything. Metrics count the counted entries only; copies
(``loads``, ``moved_bytes``) are those of the whole replay, warm-up included.

Streaming (traces of any size): :class:`EntryStream` prepares the same entries chunk by chunk from chunk sources
(:mod:`stratatools.traces.sources`) with what one chunk needs of the previous one carried over (compiled:
:func:`.kernels.prepare_chunk`); :class:`Replay` runs one policy over chunks keeping only its state
(:mod:`.kernels` ``*_chunk``); :class:`MetricAcc` accumulates the metrics per chunk (no sort); :class:`RunGroup`
feeds one pass to many runs (:func:`simulate_many`; the runs in threads, the next chunks prepared by a reader
thread, :func:`prefetch`: the compiled kernels release the GIL, each run's state is its own, so results do not
depend on it). Belady's next uses come from a backward pass into a temporary file. :func:`prepare_entries`, :func:`run_policy`, :func:`simulate_policy` and :func:`metrics` keep
their whole-array signatures (``simulate_policy`` also takes a stream) and give the same results.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from stratatools.core.errors import OtherModelInput, StrataError
from stratatools.profiles.strp import Profile
from stratatools.traces.table import Distinct as _Distinct, TraceTable
from stratatools.cachesim import kernels as K
from stratatools.cachesim.layout import _blob_arrays, per_layer_split, plan_tier, plan_upper
from stratatools.cachesim.tiers import (ADAPTIVE_DEFAULTS, LFRU_DEFAULTS, LFU_DEFAULTS, POLICIES, _with_defaults,
                                        check_adaptive_params, check_decay, make_tier)


@dataclass(frozen=True)
class BandwidthModel:
    """Stated bandwidths in GB/s (1e9 bytes/s): host memory (misses read there), PCIe (host->VRAM copies),
    VRAM (hits). Defaults: dual-channel DDR5 ~60, PCIe 4.0 x16 ~25, a 12 GB consumer card ~900."""

    host_gbps: float = 60.0
    pcie_gbps: float = 25.0
    vram_gbps: float = 900.0

    def to_dict(self) -> dict[str, float]:
        return {"host_gbps": self.host_gbps, "pcie_gbps": self.pcie_gbps, "vram_gbps": self.vram_gbps}


CHUNK_ENTRIES = 1 << 20
"""Entries per replay chunk (the streaming replay's unit; memory ~ 100 bytes x this, whatever the trace length)."""


@dataclass
class Entries:
    """A trace flattened for replay: routed entries in order, with round and record ids.

    Attributes:
        layer, expert: int64 [N].
        rnd: int64 [N] round id (non-decreasing; a change means a new round).
        record: int64 [N] record id (non-decreasing; one token's routing of one layer).
        request: int64 [N] request id (dense over all input traces; folds never split one).
        token: int64 [N] token key: one per (request, position), or per round where positions are unknown
            (only compared for equality).
        n_layers, n_expert: the geometry entries were checked against.
        n_tokens: decode positions covered.
        skipped: entries left out (``prefill``, ``layer`` out of range, ``expert`` out of range).
        rounds_by: what a round is (module docstring): ``positions``, ``windows``, ``windows+positions``,
            ``batches`` (layer-major batches) or ``windows+positions+batches``.
        count: bool [N], the entries the metrics count (False: replayed to warm the cache, not counted: the
            prefill under ``phase="decode"``), or None when every entry counts.
    """

    layer: np.ndarray
    expert: np.ndarray
    rnd: np.ndarray
    record: np.ndarray
    request: np.ndarray
    n_layers: int
    n_expert: int
    n_tokens: int
    token: np.ndarray | None = None
    skipped: dict[str, int] = field(default_factory=dict)
    rounds_by: str = "positions"
    rounds: int | None = None  # distinct rounds when known (else counted from ``rnd``)
    count: np.ndarray | None = None

    def __len__(self) -> int:
        return int(len(self.layer))

    @property
    def n_counted(self) -> int:
        """Entries the metrics count (all of them unless some only warm the cache)."""
        return int(len(self.layer)) if self.count is None else int(self.count.sum())

    @property
    def n_warmup(self) -> int:
        """Entries replayed but not counted (the prefill under ``phase="decode"``)."""
        return int(len(self.layer)) - self.n_counted

    def counted(self) -> "Entries":
        """The counted entries alone (self when every entry counts)."""
        return self if self.count is None else self.take(self.count)

    @property
    def n_rounds(self) -> int:
        if self.rounds is None:
            self.rounds = int(len(np.unique(self.rnd)))
        return self.rounds

    @property
    def n_requests(self) -> int:
        """Distinct request ids."""
        return int(len(np.unique(self.request)))

    def pair_counts(self) -> np.ndarray:
        """Counted entries per (layer, expert), int64 [L, E]."""
        L, E = self.n_layers, self.n_expert
        lay, ex = (self.layer, self.expert) if self.count is None else (self.layer[self.count], self.expert[self.count])
        return np.bincount(lay * E + ex, minlength=L * E).reshape(L, E)

    def chunks(self, size: int | None = None):
        """The entries in slices (views) of ``size`` (default :data:`CHUNK_ENTRIES`) entries."""
        size = max(int(size or CHUNK_ENTRIES), 1)
        n = len(self)
        for a in range(0, n, size):
            b = min(n, a + size)
            yield Entries(self.layer[a:b], self.expert[a:b], self.rnd[a:b], self.record[a:b], self.request[a:b],
                          self.n_layers, self.n_expert, self.n_tokens,
                          token=None if self.token is None else self.token[a:b], rounds_by=self.rounds_by,
                          count=_all_none(None if self.count is None else self.count[a:b]))

    def take(self, mask: np.ndarray) -> "Entries":
        """Entries selected by a boolean mask (whole requests, for folds); tokens recounted."""
        tk = self.token[mask] if self.token is not None else self.rnd[mask]
        cnt = None if self.count is None else self.count[mask]
        if cnt is not None and cnt.all():
            cnt = None
        return Entries(self.layer[mask], self.expert[mask], self.rnd[mask], self.record[mask], self.request[mask],
                       self.n_layers, self.n_expert, _count_tokens(tk if cnt is None else tk[cnt]), token=tk,
                       skipped=dict(self.skipped), rounds_by=self.rounds_by, count=cnt)


def _all_none(count: np.ndarray | None) -> np.ndarray | None:
    """A count mask, or None when it counts every entry."""
    return None if count is None or count.all() else count


def _count_tokens(token: np.ndarray) -> int:
    return int(len(np.unique(token))) if len(token) else 0


def merge_traces(tables: Sequence[TraceTable]) -> TraceTable:
    """One table from several traces with request ids made distinct per input (dense, in input order); verify
    windows are kept (:meth:`TraceTable.concat`). Builds every column: the streaming path
    (:class:`EntryStream`) merges chunk by chunk instead."""
    if not tables:
        raise StrataError("no traces given (pass at least one --traces file)")
    parts = []
    base = 0
    for t in tables:
        if len(t) == 0:
            continue
        u, inv = np.unique(t.request, return_inverse=True)
        cols = t.columns()
        cols["request"] = (inv + base).astype(np.int32)
        base += len(u)
        parts.append(TraceTable(**cols, meta=dict(t.meta), window=_table_window(t)))
    if not parts:
        raise StrataError("the traces hold no routed entries")
    return TraceTable.concat(parts)


def _table_window(t: TraceTable) -> np.ndarray | None:
    """Per-entry window ids of a table: ``t.window``, else an int ndarray [N] in ``meta["window"]``, else None."""
    w = t.window
    if w is None:
        m = t.meta.get("window") if isinstance(t.meta, dict) else None
        if isinstance(m, np.ndarray) and m.shape == (len(t),) and m.dtype.kind in "iu":
            w = m
    return w


class _Prep:
    """The rounds and records of :func:`prepare_entries`, computed chunk by chunk with what one chunk needs of
    the previous one carried over (last entry, last record, record and round counters).

    Two passes: :meth:`scan` finds the requests whose positions go back (layer-major batches; a property of the
    whole request), :meth:`feed` then yields each chunk's kept entries with global round and record ids.
    """

    def __init__(self, n_layers: int, n_expert: int, phase: str, windows: bool, cold: bool = False):
        self.L, self.E, self.phase, self.windows = int(n_layers), int(n_expert), phase, windows
        self.cold = bool(cold)
        self.back = _Distinct()
        self.reset()

    def reset(self) -> None:
        self.sc = np.zeros(K.SCAN_ST, np.int64)  # last entry and record (scan; kernels.scan_chunk)
        self.st = np.zeros(K.PREP_ST, np.int64)  # the same for feed (kernels.prepare_chunk)
        self.st[13] = self.st[14] = -1  # last record, current round

    def scan(self, c: dict) -> None:
        """First pass over a chunk: note the requests with batched (going-back) positions (compiled:
        :func:`.kernels.scan_chunk`)."""
        n = len(c["request"])
        if not n:
            return
        win = c.get("window") if self.windows else None
        if win is None:
            win = np.full(n, -1, np.int64) if self.windows else np.zeros(1, np.int64)
        out = np.empty(n, np.int64)
        nb = K.scan_chunk(_i64(c["request"]), _i64(c["position"]), _i64(c["layer"]), _i64(c["rank"]), _i64(win),
                          self.windows, self.sc, out)
        if nb:
            self.back.add(out[:nb])

    def end_scan(self) -> None:
        self.back_ids = self.back.values()
        self.reset()

    def feed(self, c: dict):
        """Second pass over a chunk: (kept entries as :class:`Entries` or None, per-chunk facts dict); compiled
        (:func:`.kernels.prepare_chunk`), the state of the last entry and record carried in ``self.st``."""
        n = len(c["request"])
        if not n:
            return None, None
        win = c.get("window") if self.windows else None
        if win is None:
            win = np.full(n, -1, np.int64) if self.windows else np.zeros(1, np.int64)
        out = [np.empty(n, np.int64) for _ in range(6)]
        cnt = np.empty(n, np.bool_)
        counts = np.zeros(7, np.int64)
        decode = self.phase == "decode"
        k = K.prepare_chunk(_i64(c["request"]), _i64(c["position"]), _i64(c["layer"]), _i64(c["rank"]), _i64(win),
                            np.asarray(c["phase"], np.int8), _i64(c["expert"]), self.windows,
                            np.asarray(self.back_ids, np.int64), decode and self.cold, decode and not self.cold,
                            self.L, self.E, self.st, *out, cnt, counts)
        lay, ex, rnd, rec, req, tok = (a[:k] for a in out)
        cnt = _all_none(cnt[:k]) if counts[6] else None
        facts = {"skipped": {"prefill": int(counts[0]), "layer": int(counts[1]), "expert": int(counts[2])},
                 "batched": bool(counts[5])}
        if self.windows:
            facts["in_w"] = bool(counts[3])
            facts["out_w"] = bool(counts[4])
        return Entries(lay, ex, rnd, rec, req, self.L, self.E, 0, token=tok, count=cnt), facts


def _scan_chunks(src, rows: int):
    """What the scan pass reads of a source: its chunks, or, from a source with ``record_chunks`` (a tagged Strata
    trace), its records with k > 0 as chunks of rank-0 entries plus ``_entries`` (the entries they stand for).
    The scan sees the same records either way (a record's entries share request, position, layer and window
    and their ranks rise), for a fraction of the work."""
    rc = getattr(src, "record_chunks", None)
    if rc is None:
        yield from src.chunks(rows)
        return
    for c in rc(rows):
        k = c["k"]
        keep = k > 0
        if not keep.all():
            c = {n: v[keep] for n, v in c.items()}
            k = c["k"]
        c["rank"] = np.zeros(len(k), np.int64)
        c["_entries"] = int(k.sum())
        yield c


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def _runs(a: np.ndarray) -> np.ndarray:
    """The first value of every run of equal values (a cheap first step before np.unique)."""
    if len(a) < 2:
        return a
    return a[np.r_[True, a[1:] != a[:-1]]]


class _Summary:
    """Counts over a whole stream, accumulated chunk by chunk (what :class:`Entries` knows up front)."""

    def __init__(self, L: int, E: int) -> None:
        self.L, self.E = L, E
        self.entries = 0
        self.skipped = {"prefill": 0, "layer": 0, "expert": 0}
        self.pos_tokens = _Distinct()
        # counted (kept entries the metrics count; the rest warm the cache: prefill under phase decode), rounds,
        # (set, last round), negative-token rounds, (set, last negative token): kernels.summary_chunk
        self.st = np.zeros(7, np.int64)
        self.requests = _Distinct()
        self.batched = self.in_w = self.out_w = False
        self.windows = False
        self.counts = np.zeros(L * E, np.int64)
        self.light = False  # True: no tokens, requests or pair counts (k-fold folds report none of them)

    @property
    def counted(self) -> int:
        return int(self.st[0])

    @property
    def rounds(self) -> int:
        return int(self.st[1])

    @property
    def neg_rounds(self) -> int:
        return int(self.st[4])

    def add(self, ent: Entries, facts: dict) -> None:
        for k, v in facts["skipped"].items():
            self.skipped[k] += v
        self.batched |= facts["batched"]
        self.in_w |= facts.get("in_w", False)
        self.out_w |= facts.get("out_w", False)
        n = len(ent)
        if not n:
            return
        self.entries += n
        cnt = ent.count
        light = self.light
        tok = np.empty(0 if light else n, np.int64)
        req = np.empty(0 if light else n, np.int64)
        ntk, nrq = K.summary_chunk(ent.layer, ent.expert, ent.rnd, ent.token if not light else ent.rnd,
                                   ent.request if not light else ent.rnd,
                                   cnt if cnt is not None else np.ones(1, np.bool_), cnt is not None, light, self.E,
                                   self.counts, self.st, tok, req)
        if not light:
            self.pos_tokens.add(tok[:ntk])
            self.requests.add(req[:nrq])

    @property
    def tokens(self) -> int:
        return len(self.pos_tokens) + self.neg_rounds

    @property
    def rounds_by(self) -> str:
        if not self.windows or not self.in_w:
            kind = "positions"
        else:
            kind = "windows+positions" if self.out_w else "windows"
        if self.batched:
            kind = "batches" if kind == "positions" else kind + "+batches"
        return kind


class _TableSource:
    """A trace table as a chunk source (:func:`stratatools.traces.table.table_chunks`)."""

    def __init__(self, table: TraceTable):
        self.table = table
        w = _table_window(table)
        self.window = w if (w is not None and table.window is None) else None  # a meta["window"] array
        self.has_windows = w is not None

    def __len__(self) -> int:
        return len(self.table)

    def chunks(self, rows: int):
        from stratatools.traces.table import table_chunks

        n = 0
        for c in table_chunks(self.table, rows):
            m = len(c["request"])
            if self.window is not None:
                c["window"] = np.asarray(self.window[n:n + m], np.int64)
            n += m
            yield c


def as_source(t):
    """A chunk source (``len``, ``has_windows``, ``chunks(rows)`` -> dicts of int64 columns) from a
    :class:`TraceTable` or anything already shaped like one."""
    return _TableSource(t) if isinstance(t, TraceTable) else t


class LayerLimit(int):
    """The layers a trace may route (the trunk plus the model's MTP blocks, an ``int``), knowing whether they came
    from the model GGUF, which names its MTP blocks (``model_read``). Passed as ``max_layers``; a plain int is a
    limit whose source named no MTP block (a pack, a profile)."""

    model_read: bool

    def __new__(cls, value: int, model_read: bool = False) -> "LayerLimit":
        obj = super().__new__(cls, int(value))
        obj.model_read = bool(model_read)
        return obj

    def __reduce__(self):
        return LayerLimit, (int(self), self.model_read)


def _layers_error(src, lmax: int, n_layers: int, max_layers: int) -> str:
    """The one-line refusal of a trace routing more layers than the model has (see ``EntryStream``); it names the
    trace's highest layer id (its layer ids need not be contiguous). The hint that the extra layer may be an MTP
    block only where no model GGUF was read (``max_layers`` a :class:`LayerLimit` with ``model_read``): a read
    model names its MTP blocks, which ``max_layers`` already covers."""
    meta = getattr(src, "meta", None) or {}
    name = meta.get("source_path") or getattr(src, "name", None) or "a trace"
    extra = f" + {max_layers - n_layers} MTP" if max_layers > n_layers else ""
    rng = f"layer {lmax}" if lmax == max_layers else f"layers {max_layers}..{lmax}"
    hint = lmax == max_layers == n_layers and not getattr(max_layers, "model_read", False)
    return (f"{name}: the trace routes layers up to {lmax} but the model has {n_layers} trunk layers{extra} "
            f"(0..{max_layers - 1}); its entries of {rng} would be left out, so it is another model's trace: give "
            f"the model (--model/--pack/--profile) the trace was recorded on, or traces of this model"
            + (f" (if layer {lmax} is this model's MTP block: pass --model M.gguf, which names it)" if hint else ""))


class OtherModelTrace(OtherModelInput):
    """The refusal of :func:`refuse_extra_layers`: a trace that routes layers past the model's trunk and MTP
    blocks (another model's). A StrataError (exit 2); its own class so that a caller that turns other trace
    errors into a failed check (validate-release's hit-rate gate) can let this one through as unusable input."""


def refuse_extra_layers(src, lmax: int, n_layers: int, max_layers: int | None) -> None:
    """Refuse a trace whose largest routed layer ``lmax`` is ``max_layers`` or above (another model's trace).

    ``src``: the trace (a TraceTable or chunk source; its ``meta["source_path"]`` names it); ``n_layers``: the
    model's trunk layers; ``max_layers``: the trunk plus its MTP blocks, None to accept any layer.

    Raises:
        StrataError: the one-line refusal (:func:`_layers_error`), exit 2 in the CLI.
    """
    if max_layers is not None and lmax >= max_layers:
        raise OtherModelTrace(_layers_error(src, lmax, n_layers, max_layers))


class EntryStream:
    """Traces prepared for replay chunk by chunk, in memory independent of their length.

    The same entries, rounds and records as :func:`prepare_entries` over :func:`merge_traces` of the inputs
    (request ids made dense per input, windows kept apart per input), produced in chunks of about ``chunk``
    entries (default :data:`CHUNK_ENTRIES`). Construction makes one scan pass (distinct requests, window ids,
    requests with layer-major batches); every :meth:`chunks` iteration is one more pass over the sources.
    The summary (:attr:`n_tokens`, :attr:`n_rounds`, :attr:`skipped`, :attr:`rounds_by`, ``len``) is
    accumulated by the first full pass (:meth:`summarize` makes one when none ran yet).

    Args:
        tables: TraceTables or chunk sources (:func:`as_source`).
        n_layers, n_expert: the tier's geometry (entries outside it are skipped and counted).
        phase: ``decode`` (count the decode; known prefill entries are replayed uncounted, or dropped with
            ``cold``) or ``all`` (:func:`prepare_entries`).
        cold: with ``phase="decode"``, drop the known prefill entries.
        merge: make request ids dense per input (False: keep them; only for one input, as
            ``prepare_entries(table)`` does).
        fold: ``(k, f)``: only the requests of fold f of k (merged request id % k == f; see
            :mod:`.kfold`), prepared as a table of those requests alone would be.
        parent: a stream whose merged chunks this one reads (for folds; no own scan of the sources).
        max_layers: refuse (StrataError, in the scan) a trace that routes layer ``max_layers`` or above: the
            trunk plus the model's MTP blocks, whose entries alone are skipped. None: skip and count every
            entry outside ``n_layers`` (the skip counts are in :attr:`skipped`).
        progress: ``update(advance=x)``, advanced by 1 over the scan and by 1 over building Belady's next uses.
    Raises:
        StrataError: unknown phase, ``cold`` with ``phase="all"``, no traces, no entries (or none counted), a
            trace of more layers than ``max_layers``.
    """

    def __init__(self, tables, n_layers: int, n_expert: int, *, phase: str = "decode", chunk: int | None = None,
                 merge: bool = True, fold: tuple[int, int] | None = None, parent: "EntryStream | None" = None,
                 progress=None, cold: bool = False, max_layers: int | None = None):
        if phase not in ("decode", "all"):
            raise StrataError(f"unknown phase filter {phase!r} (use decode or all)")
        if cold and phase != "decode":
            raise StrataError("--cold drops the prefill before the decode is counted; it needs --phase decode")
        self.n_layers, self.n_expert, self.phase = int(n_layers), int(n_expert), phase
        self.cold = bool(cold)
        self.chunk = max(int(chunk or CHUNK_ENTRIES), 1)
        self.fold = fold
        self.parent = parent
        self._belady = None
        self._cache = None
        self.use_cache = False  # keep the prepared entries on disk for later passes (a study makes several)
        self.progress = progress
        if parent is not None:
            self.sources = parent.sources
            self.merge = True
            self.windows = parent.windows
            self._req_base, self._req_ids, self._win_base = parent._req_base, parent._req_ids, parent._win_base
            self.prep = _Prep(n_layers, n_expert, phase, self.windows, cold)
            self.summary = _Summary(self.n_layers, self.n_expert)
            self.summary.windows = self.windows
            self.summary.light = True
            self.complete = False
            return
        if isinstance(tables, TraceTable):
            tables = [tables]
        self.sources = [as_source(t) for t in tables]
        if not self.sources:
            raise StrataError("no traces given (pass at least one --traces file)")
        if not merge and len(self.sources) != 1:
            raise StrataError("merge=False needs exactly one trace")
        self.merge = merge
        self.windows = any(s.has_windows for s in self.sources)
        self.prep = _Prep(n_layers, n_expert, phase, self.windows, cold)
        self.summary = _Summary(self.n_layers, self.n_expert)
        self.summary.windows = self.windows
        self.complete = False
        # scan: per input its entries, distinct requests, window ids and batched requests (in its own ids);
        # inputs without entries are dropped, as merge_traces does
        self._req_ids, self._req_base, self._win_base = [], [], []
        self.source_entries = []
        kept = []
        rb = wb = 0
        backs = []
        for s in self.sources:
            reqs = _Distinct()
            wmax = -1
            n_s = 0
            pp = _Prep(n_layers, n_expert, phase, self.windows)
            lmax = -1
            for c in _scan_chunks(s, self.chunk):
                n_s += c.pop("_entries", None) or len(c["request"])
                if max_layers is not None and len(c["layer"]):
                    lmax = max(lmax, int(c["layer"].max()))
                reqs.add(_runs(c["request"]))
                if "window" in c and len(c["window"]):
                    wmax = max(wmax, int(c["window"].max()))
                pp.scan(c)
            self.source_entries.append(n_s)
            refuse_extra_layers(s, lmax, self.n_layers, max_layers)
            if progress is not None:
                progress.update(advance=1 / len(self.sources))
            if n_s == 0:
                continue
            kept.append(s)
            u = reqs.values()
            self._req_ids.append(u)
            self._req_base.append(rb)
            self._win_base.append(wb)
            b = pp.back.values()
            backs.append(np.searchsorted(u, b) + rb if merge else b)
            rb += len(u)
            wb += max(wmax + 1, 0)
        self.sources = kept
        if not kept:
            raise StrataError("the traces hold no routed entries")
        self.prep.back.add(np.concatenate(backs) if backs else np.zeros(0, np.int64))
        self.prep.end_scan()

    def raw_chunks(self):
        """Merged raw chunks (dicts of int64 columns, request ids dense per input and windows shifted per input
        when merging), one pass over the sources."""
        for i, s in enumerate(self.sources):
            for c in s.chunks(self.chunk):
                if self.merge:
                    c = dict(c)
                    r = c["request"]
                    ids = self._req_ids[i]
                    if len(r) and ids[-1] - ids[0] + 1 == len(ids):  # dense ids: a shift (none for the first)
                        if ids[0] != self._req_base[i]:
                            c["request"] = r + (self._req_base[i] - ids[0])
                    elif len(r):
                        st = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
                        m = np.searchsorted(ids, r[st]) + self._req_base[i]
                        c["request"] = np.repeat(m, np.diff(np.r_[st, len(r)]))
                    if self.windows:
                        w = c.get("window")
                        if w is None:
                            c["window"] = np.full(len(c["request"]), -1, np.int64)
                        elif self._win_base[i] or (len(w) and w.min() < -1):
                            c["window"] = np.where(w >= 0, w + self._win_base[i], -1)
                yield c

    def _select(self, c: dict) -> dict:
        if self.fold is None:
            return c
        k, f = self.fold
        fid = c.get("_fold")
        if fid is None or c.get("_k") != k:
            fid = c["_fold"] = c["request"] % k
            c["_k"] = k
        m = fid == f
        if m.all():
            return {n: v for n, v in c.items() if not n.startswith("_")}
        idx = np.flatnonzero(m)
        return {name: v[idx] for name, v in c.items() if not name.startswith("_")}

    def scan_fold(self, c: dict) -> None:
        """First pass of a fold stream over one merged chunk (see ``parent``)."""
        self.prep.scan(self._select(c))

    def end_scan(self) -> None:
        self.prep.end_scan()

    def begin(self) -> None:
        """Start a pass (the carried state of the previous one is dropped)."""
        self.prep.reset()

    def prepare(self, c: dict) -> Entries | None:
        """One merged raw chunk -> its kept entries (None when it keeps none)."""
        c = self._select(c)
        ent, facts = self.prep.feed(c)
        if ent is None:
            return None
        if not self.complete:
            self.summary.add(ent, facts)
        return ent if len(ent) else None

    def end(self) -> None:
        """End a full pass: the summary is complete; raises StrataError when no entry was kept."""
        if not self.complete:
            self.complete = True
            if self.summary.entries == 0:
                sk = self.summary.skipped
                raise StrataError(f"no routed entry of the traces fits {self.n_layers} layers x {self.n_expert} "
                                  f"experts (skipped: {sk}); check the traces belong to this model")
            if self.summary.counted == 0:
                raise StrataError("the traces hold prefill entries only, nothing of the decode to count; use "
                                  "--phase all")

    def chunks(self, size: int | None = None):
        """One pass: the kept entries, chunk by chunk (``size`` is ignored: the stream's ``chunk`` applies).

        With ``use_cache`` (a study sets it), the first full pass of a stream that is not a fold also writes the
        kept entries compactly to a temporary file (layer and expert as uint16, round and record changes as one flag byte: 5 bytes per
        entry); later passes read them back from there instead of reading and preparing the traces again."""
        if self._cache is not None and self._cache.done:
            yield from self._cache.chunks(self.chunk, self.n_layers, self.n_expert)
            return
        src = self.parent.raw_chunks() if self.parent is not None else self.raw_chunks()
        self.begin()
        cache = None
        if self.parent is None and not self.complete and self.use_cache and self.n_expert < 65536 \
                and self.n_layers < 65536:
            cache = self._cache = _EntryCache()
        try:
            for c in src:
                e = self.prepare(c)
                if e is not None:
                    if cache is not None:
                        cache.write(e)
                    yield e
            self.end()
            if cache is not None:
                cache.close()
        finally:
            if cache is not None and not cache.done:
                cache.drop()
                self._cache = None

    def summarize(self) -> "EntryStream":
        """Make a pass when no full pass ran yet (the summary needs one)."""
        if not self.complete:
            for _ in self.chunks():
                pass
        return self

    def __len__(self) -> int:
        return self.summarize().summary.entries

    @property
    def n_counted(self) -> int:
        """Kept entries the metrics count (:attr:`Entries.n_counted`)."""
        return self.summarize().summary.counted

    @property
    def n_warmup(self) -> int:
        """Kept entries replayed but not counted (the prefill under ``phase="decode"``)."""
        s = self.summarize().summary
        return s.entries - s.counted

    @property
    def raw_entries(self) -> int:
        """Entries of the inputs before any filter (for progress)."""
        src = self.parent if self.parent is not None else self
        return int(sum(src.source_entries))

    @property
    def n_tokens(self) -> int:
        return self.summarize().summary.tokens

    @property
    def n_rounds(self) -> int:
        return self.summarize().summary.rounds

    @property
    def n_requests(self) -> int:
        return len(self.summarize().summary.requests)

    @property
    def skipped(self) -> dict[str, int]:
        return dict(self.summarize().summary.skipped)

    @property
    def rounds_by(self) -> str:
        return self.summarize().summary.rounds_by

    def pair_counts(self) -> np.ndarray:
        """Counted entries per (layer, expert), int64 [L, E]."""
        return self.summarize().summary.counts.reshape(self.n_layers, self.n_expert).copy()

    def next_uses(self) -> "_NextUses":
        """Belady's next-use times (built once per stream: a pass writing pair keys to a temporary file, then a
        backward pass into a memory-mapped int64 file; disk 12 bytes per entry, memory ~ one chunk)."""
        if self._belady is None:
            self._belady = _NextUses.build(self)
        return self._belady


class _EntryCache:
    """Prepared entries kept on disk between passes (see :meth:`EntryStream.chunks`)."""

    def __init__(self) -> None:
        import tempfile
        import weakref

        self._tmp = tempfile.TemporaryDirectory(prefix="stratatools-entries-")
        weakref.finalize(self, self._tmp.cleanup)
        d = self._tmp.name
        self.paths = [os.path.join(d, n) for n in ("layer.u16", "expert.u16", "flags.u8")]
        self._fh = [open(p, "wb") for p in self.paths]  # scratch, not an output: deleted with the directory
        self.n = 0
        self.first_rnd = self.first_rec = None
        self._last = None  # (rnd, record) of the last entry written
        self.done = False

    def write(self, e: Entries) -> None:
        n = len(e)
        if not n:
            return
        if self._last is None:
            self.first_rnd, self.first_rec = int(e.rnd[0]), int(e.record[0])
            prev_r, prev_c = e.rnd[0], e.record[0]
        else:
            prev_r, prev_c = self._last
        fl = np.empty(n, np.uint8)
        dr = np.empty(n, bool)
        dr[0] = e.rnd[0] != prev_r
        dr[1:] = e.rnd[1:] != e.rnd[:-1]
        dc = np.empty(n, bool)
        dc[0] = e.record[0] != prev_c
        dc[1:] = e.record[1:] != e.record[:-1]
        np.add(dr.view(np.uint8), dc.view(np.uint8) << 1, out=fl)
        if e.count is not None:  # bit 2: replayed, not counted
            fl |= (~e.count).view(np.uint8) << 2
        self._fh[0].write(e.layer.astype(np.uint16).tobytes())
        self._fh[1].write(e.expert.astype(np.uint16).tobytes())
        self._fh[2].write(fl.tobytes())
        self._last = (e.rnd[-1], e.record[-1])
        self.n += n

    def close(self) -> None:
        for fh in self._fh:
            fh.close()
        self.done = True

    def drop(self) -> None:
        for fh in self._fh:
            fh.close()
        self._tmp.cleanup()

    def chunks(self, size: int, L: int, E: int):
        if self.n == 0:
            return
        fds = [os.open(p, os.O_RDONLY) for p in self.paths]  # read, not mapped (see _NextUses.build)
        try:
            r0, c0 = self.first_rnd, self.first_rec
            for a in range(0, self.n, size):
                b = min(self.n, a + size)
                f = _pread(fds[2], np.uint8, a, b)
                rnd = r0 + np.cumsum(f & 1, dtype=np.int64)
                rec = c0 + np.cumsum((f >> 1) & 1, dtype=np.int64)
                cnt = _all_none((f & 4) == 0)
                r0, c0 = int(rnd[-1]), int(rec[-1])
                yield Entries(_pread(fds[0], np.uint16, a, b).astype(np.int64),
                              _pread(fds[1], np.uint16, a, b).astype(np.int64), rnd, rec, None, L, E, 0, count=cnt)
        finally:
            for fd in fds:
                os.close(fd)


def _pread(fd: int, dtype, a: int, b: int) -> np.ndarray:
    """Elements a..b-1 of a file of ``dtype`` values (read, not mapped)."""
    it = np.dtype(dtype).itemsize
    data = os.pread(fd, (b - a) * it, a * it)
    return np.frombuffer(data, dtype=dtype)


def _close_and_clean(fd: int, tmp) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    tmp.cleanup()


class _NextUses:
    """Next use of every kept entry of a stream, memory-mapped from a temporary file, plus every pair's first use."""

    def __init__(self, nxt, first, tmp):
        self.nxt, self.first, self._tmp = nxt, first, tmp

    @classmethod
    def build(cls, stream) -> "_NextUses":
        import tempfile
        import weakref

        L, E = stream.n_layers, stream.n_expert
        tmp = tempfile.TemporaryDirectory(prefix="stratatools-belady-")
        kpath = os.path.join(tmp.name, "keys.i32")
        n = 0
        pg = getattr(stream, "progress", None)
        total = max(stream.summary.entries if stream.complete else stream.raw_entries, 1)
        with open(kpath, "wb") as fh:  # scratch, not an output: deleted with the directory
            for e in stream.chunks():
                fh.write((e.layer * E + e.expert).astype(np.int32).tobytes())
                n += len(e)
                if pg is not None:
                    pg.update(advance=0.5 * len(e) / total)
        never = np.iinfo(np.int64).max
        last = np.full(L * E, never, dtype=np.int64)
        if n == 0:
            return cls(np.zeros(0, np.int64), last.reshape(L, E), tmp)
        # files are read and written with pread/pwrite, not mapped: mapped pages would count in the process's
        # resident memory until the kernel evicts them
        npath = os.path.join(tmp.name, "next.i64")
        step = stream.chunk
        kfd = os.open(kpath, os.O_RDONLY)
        nfd = os.open(npath, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(nfd, 8 * n)
            buf = np.empty(step, np.int64)
            for b in range(n, 0, -step):
                a = max(0, b - step)
                keys = _pread(kfd, np.int32, a, b).astype(np.int64)
                out = buf[:b - a]
                K.next_use_chunk(keys, a, last, out)
                os.pwrite(nfd, out.tobytes(), 8 * a)
                if pg is not None:
                    pg.update(advance=0.5 * (b - a) / n)
        finally:
            os.close(kfd)
        os.remove(kpath)
        self = cls(None, last.reshape(L, E), tmp)
        self._fd = nfd
        weakref.finalize(self, _close_and_clean, nfd, tmp)
        return self

    def read(self, a: int, b: int) -> np.ndarray:
        """Next uses of kept entries a..b-1, int64 [b - a]."""
        if self.nxt is not None:
            return self.nxt[a:b]
        return _pread(self._fd, np.int64, a, b)

    @classmethod
    def of_entries(cls, ent: Entries) -> "_NextUses":
        L, E = ent.n_layers, ent.n_expert
        never = np.iinfo(np.int64).max
        last = np.full(L * E, never, dtype=np.int64)
        nxt = np.empty(len(ent), dtype=np.int64)
        K.next_use_chunk(ent.layer * E + ent.expert, 0, last, nxt)
        return cls(nxt, last.reshape(L, E), None)


def prepare_stream(tables, n_layers: int, n_expert: int, *, phase: str = "decode",
                   chunk: int | None = None, cold: bool = False) -> EntryStream:
    """Traces (TraceTables or chunk sources) as an :class:`EntryStream`: the streaming form of
    ``prepare_entries(tables, ...)`` for :func:`simulate_policy` / :func:`simulate_many`."""
    return EntryStream(tables, n_layers, n_expert, phase=phase, chunk=chunk, cold=cold)


def prepare_entries(table: TraceTable | Sequence[TraceTable], n_layers: int, n_expert: int, *,
                    phase: str = "decode", cold: bool = False, chunk: int | None = None) -> Entries:
    """Flatten traces for replay (rounds and records as in the module docstring), all in memory.

    Args:
        table: one trace table (request ids kept), or several (merged as :func:`merge_traces` does).
        n_layers, n_expert: the tier's geometry; entries outside it (an MTP block, another model) are skipped
            and counted.
        phase: ``decode`` (count decode entries; known prefill entries are replayed uncounted, in
            :attr:`Entries.count` as False, or dropped with ``cold``) or ``all`` (count everything).
        cold: with ``phase="decode"``, drop the known prefill entries (the decode starts on the fill alone).
        chunk: entries prepared at a time (the result does not depend on it).
    Raises:
        StrataError: unknown phase; ``cold`` with ``phase="all"``; no entries left (or none counted).

    Memory: ~ 48 bytes per kept entry; :class:`EntryStream` (:func:`prepare_stream`) gives the same entries
    chunk by chunk instead.
    """
    single = isinstance(table, TraceTable)
    st = EntryStream(table if single else list(table), n_layers, n_expert, phase=phase,
                     chunk=chunk or max(len(table) if single else sum(len(t) for t in table), 1), merge=not single,
                     cold=cold)
    parts = list(st.chunks())
    cat = (lambda name: np.concatenate([getattr(p, name) for p in parts])) if parts else \
        (lambda name: np.zeros(0, np.int64))
    sm = st.summary
    count = None
    if sm.counted != sm.entries:
        count = np.concatenate([np.ones(len(p), bool) if p.count is None else p.count for p in parts])
    return Entries(cat("layer"), cat("expert"), cat("rnd"), cat("record"), cat("request"), st.n_layers,
                   st.n_expert, sm.tokens, token=cat("token"), skipped=dict(sm.skipped), rounds_by=sm.rounds_by,
                   rounds=sm.rounds, count=count)


@dataclass
class SimResult:
    """Metrics of one replay (module docstring gives every definition).

    Attributes:
        policy, admission, label: what ran (``label`` names the profile for static/adaptive).
        n_slots: slots of the tier; cap: int [L] slots per layer at the end of the replay.
        entries, hits, records, all_hit_records, tokens, rounds: counts.
        h_expert, h_layer, h_bytes: hit rates (fractions; h_bytes None when blob sizes are unknown).
        moved_bytes, loads, fill_bytes: host->VRAM traffic (bytes, copies, start-up bytes; the byte counts are
            None when blob sizes are unknown).
        layer_h_expert: float [L] per-layer h_expert (nan for a layer without entries).
        time_per_token_s: estimate from ``bandwidth`` in seconds (None when blob sizes are unknown).
        params: policy parameters used.
        rounds_by: what a round was (``positions``, ``windows`` or ``windows+positions``; module docstring).
        tiers: the three-tier cost model's figures (:func:`.costmodel.tier_costs`: h_vram, h_ram, h_ssd, bytes
            per token, tok_s) when a :class:`.costmodel.ThreeTierModel` was given and blob sizes are known.
        layer_entries, layer_hits: int [L] counted entries and hits per layer.
        warmup: entries replayed but not counted (the prefill under ``phase="decode"``; module docstring).
    """

    policy: str
    admission: str
    label: str
    n_slots: int
    cap: list[int]
    entries: int
    hits: int
    records: int
    all_hit_records: int
    tokens: int
    rounds: int
    h_expert: float
    h_layer: float
    h_bytes: float | None
    moved_bytes: int | None
    loads: int
    fill_bytes: int | None
    layer_h_expert: list[float]
    time_per_token_s: float | None
    bandwidth: dict[str, float]
    params: dict[str, Any] = field(default_factory=dict)
    rounds_by: str = "positions"
    tiers: dict[str, float] | None = None
    layer_entries: list[int] = field(default_factory=list)
    layer_hits: list[int] = field(default_factory=list)
    warmup: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["layer_h_expert"] = [None if (x != x) else x for x in self.layer_h_expert]
        return d


class MetricAcc:
    """Hit counts accumulated chunk by chunk (no sort: record ids are non-decreasing, so a record's entries are
    one run, possibly continued in the next chunk; :func:`.kernels.metrics_chunk`)."""

    def __init__(self, n_layers: int) -> None:
        self.le = np.zeros(n_layers, dtype=np.int64)
        self._lh = np.zeros(n_layers, dtype=np.int64)
        self._st = np.zeros(5, dtype=np.int64)

    def add(self, layer: np.ndarray, record: np.ndarray, hits: np.ndarray) -> None:
        if len(hits):
            K.metrics_chunk(np.asarray(layer, np.int64), np.asarray(record, np.int64), np.asarray(hits, np.bool_),
                            self.le, self._lh, self._st)

    @property
    def n(self) -> int:
        return int(self.le.sum())

    @property
    def hits(self) -> int:
        return int(self._lh.sum())

    @property
    def lh(self) -> np.ndarray:
        return self._lh.astype(np.float64)

    @property
    def records(self) -> int:
        return int(self._st[0])

    @property
    def all_hit(self) -> int:
        return int(self._st[1])

    @property
    def _rec(self):
        return int(self._st[3]) if self._st[2] else None

    @property
    def _miss(self) -> int:
        return int(self._st[4])

    def result(self, loads: np.ndarray, blob_bytes: np.ndarray, bw: BandwidthModel, tokens: int,
               rounds: int) -> dict[str, Any]:
        """The metrics dict of :func:`metrics`."""
        records, all_hit = self.records, self.all_hit
        if self._rec is not None:
            records += 1
            all_hit += self._miss == 0
        n, le, lh = self.n, self.le, self.lh
        bb = np.asarray(blob_bytes, dtype=np.float64)
        entry_bytes = float((le * bb).sum())
        hit_bytes = float((lh * bb).sum())
        miss_bytes = entry_bytes - hit_bytes
        moved = int((np.asarray(loads, dtype=np.int64) * np.asarray(blob_bytes, dtype=np.int64)).sum())
        t = (hit_bytes / (bw.vram_gbps * 1e9) + miss_bytes / (bw.host_gbps * 1e9) + moved / (bw.pcie_gbps * 1e9))
        with np.errstate(invalid="ignore", divide="ignore"):
            layer_h = np.where(le > 0, lh / np.maximum(le, 1), np.nan)
        return {"entries": n, "hits": int(self.hits), "records": int(records), "all_hit_records": int(all_hit),
                "tokens": tokens, "rounds": rounds,
                "layer_entries": [int(x) for x in le], "layer_hits": [int(x) for x in self._lh],
                "h_expert": float(self.hits) / n if n else float("nan"),
                "h_layer": float(all_hit) / records if records else float("nan"),
                "h_bytes": hit_bytes / entry_bytes if entry_bytes else float("nan"),
                "moved_bytes": moved, "loads": int(np.asarray(loads).sum()),
                "layer_h_expert": [float(x) for x in layer_h],
                "time_per_token_s": t / tokens if tokens else float("nan")}


def metrics(ent: Entries, hits: np.ndarray, loads: np.ndarray, blob_bytes: np.ndarray,
            bw: BandwidthModel) -> dict[str, Any]:
    """Hit rates and traffic from a hit vector [N] and per-layer loads [L] (record ids non-decreasing): over the
    counted entries (:attr:`Entries.count`); ``rounds`` and the loads are those of the whole replay.
    ``layer_entries`` / ``layer_hits``: int [L] counts behind ``layer_h_expert``."""
    acc = MetricAcc(ent.n_layers)
    _acc_add(acc, None, ent.layer, ent.expert, ent.record, np.asarray(hits, dtype=bool), ent.count)
    return acc.result(loads, blob_bytes, bw, ent.n_tokens, ent.n_rounds)


def _acc_add(acc: MetricAcc, ta, layer, expert, record, hits, count) -> None:
    """Add the counted entries (``count`` bool mask, None: all) to a :class:`MetricAcc` and a ``_TierAcc``."""
    if count is not None:  # only the columns the counts need
        layer, expert, record, hits = layer[count], expert[count], record[count], hits[count]
    acc.add(layer, record, hits)
    if ta is not None:
        ta.add(layer, expert, hits)


def _check_params(policy: str, params: dict) -> dict:
    defaults = {"adaptive": ADAPTIVE_DEFAULTS, "lfu": LFU_DEFAULTS, "lfru": LFRU_DEFAULTS}.get(policy, {})
    p = _with_defaults(policy, params, defaults)
    for k, v in params.items():
        if not np.isfinite(float(v)):
            raise StrataError(f"{policy} parameter {k} = {v} is not a finite number")
    if policy == "adaptive":
        check_adaptive_params(p)
    return p


class Replay:
    """One policy replayed chunk by chunk: :meth:`feed` each chunk of :class:`Entries` in order (its hits come
    back), then :meth:`finish`. Only the policy's state (a few [L, E] arrays) is kept between chunks.

    Arguments as :func:`run_policy`; Belady takes ``next_uses`` (the stream's :class:`_NextUses`).
    Raises StrataError for unknown policies, parameters or budgets.
    """

    def __init__(self, n_layers: int, n_expert: int, policy: str, *, profile: Profile | None = None,
                 slots: int | None = None, budget_bytes: int | None = None, blob_bytes=None,
                 admission: str = "global", cap=None, admit_on_miss: bool = True, next_uses=None, **params: Any):
        if policy not in POLICIES:
            raise StrataError(f"unknown policy {policy!r} (use {', '.join(POLICIES)})")
        L, E = self.L, self.E = int(n_layers), int(n_expert)
        self.policy = policy
        p = self.p = _check_params(policy, params)
        bb, _ = _blob_arrays(L, blob_bytes)
        self.loads = np.zeros(L, dtype=np.int64)
        self.offset = 0
        if policy in ("static", "adaptive"):
            plan = plan_tier(L, E, profile, slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes,
                             admission=admission)
            self.res = plan.resident.copy()
            self.cap = plan.cap.copy()
            self.occ = self.res.sum(1).astype(np.int64)
            self.per_layer = plan.admission == "per-layer"
            self.pool = np.array([plan.pool_slots, plan.pool_bytes], dtype=np.int64)
            self.slot_bytes = plan.slot_bytes
            self.admit = bool(admit_on_miss)
            self.info = {"n_slots": plan.n_slots, "fill_bytes": plan.fill_bytes, "admission": plan.admission}
            self.no_free = (not admit_on_miss) or (self.per_layer and (self.occ >= self.cap).all()) or \
                (not self.per_layer and plan.pool_slots == 0)
            self.plan, self.profile = plan, profile
            # Strata 0.2.x knobs (lag, paced copies, upper tier): their own kernel, streamed as the others
            self.v2 = policy == "adaptive" and (int(p["lag"]) > 1 or int(p["pace_bytes"]) > 0
                                                or int(p["upper_slots"]) > 0)
            if self.v2:
                self._v2 = _AdaptiveV2(L, E, plan, profile, self.res, self.cap, admit_on_miss, p)
            if policy == "adaptive":
                self.ad = (float(p["usage_floor"]), float(p["margin"]), int(p["adapt_every"]), int(p["max_moves"]),
                           float(p["decay"]), int(p["copy_delay_rounds"]))
                self.state = K.adaptive_state(L, E, self.ad[3])
            return
        if cap is None:
            cap = per_layer_split(L, slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes, n_expert=E)
        self.cap = np.asarray(cap, dtype=np.int64)
        self.info = {"n_slots": int(self.cap.sum()), "fill_bytes": 0, "admission": "per-layer",
                     "cap": self.cap.tolist(), "params": p}
        if policy in ("lfu", "lfru"):
            check_decay(policy, p["decay"])
        if policy == "lru":
            self.state = K.lru_state(L, E)
        elif policy == "lfu":
            if int(p["decay_every"]) < 1:
                raise StrataError("lfu: decay_every must be >= 1")
            self.state = K.lfu_state(L, E, self.cap)
        elif policy == "lfru":
            frac = float(p["privileged_frac"])
            if not 0.0 < frac <= 1.0 or int(p["decay_every"]) < 1:
                raise StrataError(f"lfru: privileged_frac {frac} must be in (0, 1] and decay_every >= 1")
            self.pcap = np.array([int(np.ceil(int(c) * frac)) for c in self.cap], dtype=np.int64)
            self.ucap = self.cap - self.pcap
            self.state = K.lfru_state(L, E, self.ucap)
        else:  # belady
            if next_uses is None:
                raise StrataError("belady needs the stream's next-use times")
            self.nu = next_uses
            self.res = K.belady_start(next_uses.first, self.cap)
            self.cur_next = next_uses.first.copy()
            self.state = K.belady_state(self.res, self.cap)
            self.info["fill_bytes"] = int((self.res.sum(1) * bb).sum())

    v2 = False

    def feed(self, ent: Entries) -> np.ndarray:
        """Replay one chunk (entries in stream order); returns its hits, bool [n]."""
        lay, ex = ent.layer, ent.expert
        n = len(lay)
        pol, p = self.policy, self.p
        if self.v2:
            self.offset += n
            return self._v2.feed(lay, ex, ent.rnd)
        if pol == "static" and self.no_free:
            hits = self.res[lay, ex]
        else:
            hits = np.zeros(n, dtype=np.bool_)
            if pol == "static":
                K.static_chunk(lay, ex, self.res, self.cap, self.occ, self.pool, self.slot_bytes, self.per_layer,
                               self.admit, hits, self.loads)
            elif pol == "adaptive":
                K.adaptive_chunk(lay, ex, ent.rnd, self.res, self.cap, self.occ, self.pool, self.slot_bytes,
                                 self.per_layer, self.admit, *self.ad, *self.state, hits, self.loads)
            elif pol == "lru":
                K.lru_chunk(lay, ex, self.cap, *self.state, hits, self.loads)
            elif pol == "lfu":
                K.lfu_chunk(lay, ex, ent.rnd, self.cap, float(p["decay"]), int(p["decay_every"]), *self.state, hits,
                            self.loads)
            elif pol == "lfru":
                K.lfru_chunk(lay, ex, ent.rnd, self.pcap, self.ucap, float(p["decay"]), int(p["decay_every"]),
                             *self.state, hits, self.loads)
            else:
                nxt = np.asarray(self.nu.read(self.offset, self.offset + n))
                K.belady_chunk(lay, ex, nxt, self.res, self.cur_next, self.cap, *self.state, hits, self.loads)
        self.offset += n
        return hits

    def finish(self) -> tuple[np.ndarray, dict[str, Any]]:
        """End the replay: (loads int64 [L], info with n_slots, cap, fill_bytes, admission, params)."""
        info = dict(self.info)
        if self.v2:
            info.update(self._v2.finish())
            self.loads[:] = self._v2.loads
        elif self.policy == "adaptive":
            K.adaptive_end(self.res, self.cap, self.occ, self.per_layer, *self.ad, *self.state, self.loads)
            st = self.state[3]
            info.update({"adapt_steps": int(st[3]), "swaps": int(st[4])})
        if self.policy in ("static", "adaptive"):
            info["cap"] = self.cap.tolist()
            info["params"] = self.p
        return self.loads, info


def run_policy(ent: Entries, policy: str, *, profile: Profile | None = None, slots: int | None = None,
               budget_bytes: int | None = None, blob_bytes=None, admission: str = "global", cap=None,
               admit_on_miss: bool = True, engine: str = "compiled", chunk: int | None = None,
               **params: Any) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Replay ``ent`` through one policy. Returns (hits bool [N], loads int64 [L], info).

    ``engine="compiled"`` runs :mod:`.kernels` (through :class:`Replay`, ``chunk`` entries at a time: the
    result does not depend on it; default one chunk); ``engine="python"`` feeds the online tier objects record
    by record (the reference the compiled path is tested against). ``info`` holds n_slots, cap, fill_bytes,
    admission and the parameters used. Raises StrataError for unknown policies, parameters or budgets.
    """
    if policy not in POLICIES:
        raise StrataError(f"unknown policy {policy!r} (use {', '.join(POLICIES)})")
    if engine not in ("compiled", "python"):
        raise StrataError(f"unknown engine {engine!r}")
    if engine == "python":
        p = _check_params(policy, params)
        return _run_python(ent, policy, profile, slots, budget_bytes, blob_bytes, admission, cap, admit_on_miss, p)
    nu = _NextUses.of_entries(ent) if policy == "belady" else None
    rp = Replay(ent.n_layers, ent.n_expert, policy, profile=profile, slots=slots, budget_bytes=budget_bytes,
                blob_bytes=blob_bytes, admission=admission, cap=cap, admit_on_miss=admit_on_miss, next_uses=nu,
                **params)
    parts = [rp.feed(c) for c in ent.chunks(chunk or max(len(ent), 1))]
    loads, info = rp.finish()
    hits = np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
    return hits, loads, info


class _AdaptiveV2:
    """The Strata 0.2.x adaptive kernel (lag, paced copies, upper tier) replayed chunk by chunk
    (:func:`.kernels.adaptive_v2_chunk`): only its state is carried (the tier arrays, the move queues, the copies
    in flight and, with ``lag`` > 1, the entries of the last ``lag`` rounds whose counts are not yet visible), so
    memory does not grow with the trace. ``capv`` is updated in place at :meth:`finish`."""

    def __init__(self, L: int, E: int, plan, profile, res, capv, admit_on_miss: bool, p: dict):
        T = 2 if int(p["upper_slots"]) > 0 else 1
        R = np.zeros((T, L, E), dtype=bool)
        C = np.zeros((T, L), dtype=np.int64)
        R[0], C[0] = res, capv
        if T == 2:
            R[1], C[1] = plan_upper(plan, profile, int(p["upper_slots"]))
        O = R.sum(2).astype(np.int64)
        upool = np.zeros(T, dtype=np.int64)
        if T == 2 and plan.admission != "per-layer":
            upool[1] = max(0, int(p["upper_slots"]) - int(R[1].sum()))
        self.tier = (R, C, O, upool)
        self.lag = int(p["lag"])
        self.knobs = (np.asarray(plan.slot_bytes, np.int64), plan.admission == "per-layer", bool(admit_on_miss),
                      float(p["usage_floor"]), float(p["margin"]), int(p["adapt_every"]), int(p["max_moves"]),
                      float(p["decay"]), int(p["copy_delay_rounds"]), self.lag, int(p["pace_bytes"]),
                      bool(int(p["disjoint"])))
        self.st = K.adaptive_v2_state(T, L, E, int(p["max_moves"]), int(p["copy_delay_rounds"]), plan.pool_slots,
                                      plan.pool_bytes)
        self.pend = [np.zeros(0, np.int64) for _ in range(3)]
        self.capv = capv
        self.loads = np.zeros(L, dtype=np.int64)

    def feed(self, lay: np.ndarray, ex: np.ndarray, rnd: np.ndarray, final: bool = False) -> np.ndarray:
        """Replay one chunk (entries in stream order, round ids non-decreasing); its hits, bool [n]."""
        n = len(lay)
        if self.lag > 1:
            held = int(self.st[-1][11])
            if held + n > len(self.pend[0]):
                size = max(held + n, 2 * len(self.pend[0]))
                for i, a in enumerate(self.pend):
                    g = np.zeros(size, np.int64)
                    g[:held] = a[:held]
                    self.pend[i] = g
        hits = np.zeros(n, dtype=np.bool_)
        K.adaptive_v2_chunk(_i64(lay), _i64(ex), _i64(rnd), final, *self.tier, *self.knobs, *self.st, *self.pend,
                            hits, self.loads)
        return hits

    def finish(self) -> dict:
        """End the stream (its last round ends); the counters for ``info``."""
        z = np.zeros(0, np.int64)
        self.feed(z, z, z, final=True)
        self.capv[:] = self.tier[1][0]
        S = self.st[-1]
        return {"adapt_steps": int(S[1]), "swaps": int(S[2]), "dropped_moves": int(S[3]), "upper_hits": int(S[4])}


def _run_adaptive_v2(ent: Entries, plan, profile, res, capv, occ, admit_on_miss: bool, p: dict):
    """The Strata 0.2.x adaptive kernel (lag, paced copies, upper tier) over whole entries: (hits, loads, info
    counters); ``capv`` is updated in place."""
    v2 = _AdaptiveV2(ent.n_layers, ent.n_expert, plan, profile, res, capv, admit_on_miss, p)
    hits = v2.feed(ent.layer, ent.expert, ent.rnd)
    extra = v2.finish()
    return hits, v2.loads, extra


def _run_python(ent, policy, profile, slots, budget_bytes, blob_bytes, admission, cap, admit_on_miss, p):
    L, E = ent.n_layers, ent.n_expert
    kw: dict[str, Any] = {}
    if policy == "belady":
        if cap is None:
            cap = per_layer_split(L, slots=slots, budget_bytes=budget_bytes, blob_bytes=blob_bytes, n_expert=E)
        kw["future"] = (ent.layer, ent.expert)
    tier = make_tier(policy, n_layers=L, n_expert=E, profile=profile, slots=slots, budget_bytes=budget_bytes,
                     blob_bytes=blob_bytes, admission=admission, cap=cap, admit_on_miss=admit_on_miss,
                     **kw, **(p if policy in ("adaptive", "lfu", "lfru") else {}))
    hits = np.zeros(len(ent), dtype=bool)
    bounds = np.nonzero(np.diff(ent.record))[0] + 1
    starts = np.concatenate([[0], bounds]).astype(np.int64)
    ends = np.concatenate([bounds, [len(ent)]]).astype(np.int64)
    lay, ex, rnd = ent.layer, ent.expert, ent.rnd
    for s, e in zip(starts.tolist(), ends.tolist()):
        if s > 0 and rnd[s] != rnd[s - 1]:
            tier.end_round()
        hits[s:e] = tier.access(int(lay[s]), ex[s:e])
    tier.end_round()
    info: dict[str, Any] = {"cap": tier.cap.tolist(), "params": p}
    if hasattr(tier, "plan"):
        info.update({"n_slots": tier.plan.n_slots, "fill_bytes": tier.plan.fill_bytes, "admission": tier.plan.admission})
    else:
        info.update({"n_slots": int(tier.cap.sum()), "fill_bytes": 0, "admission": "per-layer"})
    if policy == "adaptive":
        info.update({"adapt_steps": tier.steps, "swaps": tier.swaps})
        if int(p["lag"]) > 1 or int(p["pace_bytes"]) > 0 or int(p["upper_slots"]) > 0:
            info.update({"dropped_moves": tier.dropped, "upper_hits": tier.upper_hits})
    return hits, tier.layer_loads.copy(), info


def _sim_result(acc: MetricAcc, loads, info, src, policy: str, label: str, bw: BandwidthModel,
                blob_bytes) -> SimResult:
    bb, _ = _blob_arrays(src.n_layers, blob_bytes)
    m = acc.result(loads, bb, bw, src.n_tokens, src.n_rounds)
    fill = int(info["fill_bytes"])
    if blob_bytes is None:  # sizes unknown: no byte-weighted rate, no bytes, no time (loads still count copies)
        m.update(h_bytes=None, moved_bytes=None, time_per_token_s=None)
        fill = None
    params = dict(info.get("params", {}))
    for k in ("adapt_steps", "swaps", "dropped_moves", "upper_hits"):
        if k in info:
            params[k] = info[k]
    return SimResult(policy=policy, admission=info["admission"], label=label, n_slots=int(info["n_slots"]),
                     cap=[int(c) for c in info["cap"]], fill_bytes=fill,
                     bandwidth=bw.to_dict(), params=params, rounds_by=src.rounds_by, warmup=src.n_warmup, **m)


def check_runs(n_layers: int, n_expert: int, runs: Sequence[dict[str, Any]]) -> None:
    """Raise the StrataError a run would raise (unknown policy, bad parameters or budget) before any pass."""
    never = np.full((int(n_layers), int(n_expert)), np.iinfo(np.int64).max, dtype=np.int64)
    dummy = _NextUses(np.zeros(0, np.int64), never, None)
    for r in runs:
        Replay(n_layers, n_expert, r["policy"], next_uses=dummy,
               **{k: v for k, v in r.items() if k not in ("policy", "label", "cost")})


REPLAY_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads a :class:`RunGroup` replays its runs in (one per run, at most this many)."""


class RunGroup:
    """Policy runs fed the same chunks (one pass of a stream serves them all); metrics accumulate per chunk.

    ``runs``: dicts with ``policy``, optional ``label``, optional ``cost`` (a :class:`.costmodel.ThreeTierModel`:
    the result's ``tiers``, with blob sizes) and :func:`run_policy`'s keyword arguments. ``src``: the
    :class:`Entries` or :class:`EntryStream` the chunks come from (geometry, tokens and rounds for the metrics;
    Belady runs take its next-use times)."""

    def __init__(self, src, runs: Sequence[dict[str, Any]], bandwidth: BandwidthModel | None = None):
        self.src, self.runs = src, list(runs)
        self.bw = bandwidth or BandwidthModel()
        nu = None
        if any(r["policy"] == "belady" for r in self.runs):
            nu = src.next_uses() if isinstance(src, EntryStream) else _NextUses.of_entries(src)
        L, E = src.n_layers, src.n_expert
        self.reps, self.accs, self.tier = [], [], []
        for r in self.runs:
            kw = {k: v for k, v in r.items() if k not in ("policy", "label", "cost")}
            self.reps.append(Replay(L, E, r["policy"], next_uses=nu, **kw))
            self.accs.append(MetricAcc(L))
            self.tier.append(_TierAcc(L, E, r) if r.get("cost") is not None and r.get("blob_bytes") is not None
                             else None)

    def _feed_one(self, i: int, c: Entries) -> None:
        h = self.reps[i].feed(c)
        _acc_add(self.accs[i], self.tier[i], c.layer, c.expert, c.record, h, c.count)

    def feed(self, c: Entries) -> None:
        """Replay one chunk through every run; with several runs and cores, the runs in threads (each run's
        state is its own and the compiled kernels release the GIL, so the results do not depend on it)."""
        n = len(self.reps)
        workers = min(n, REPLAY_THREADS)
        if workers < 2:
            for i in range(n):
                self._feed_one(i, c)
            return
        if getattr(self, "_pool", None) is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stratatools-replay")
        for f in [self._pool.submit(self._feed_one, i, c) for i in range(n)]:
            f.result()

    def close(self) -> None:
        """Stop the replay threads (:meth:`results` does)."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def results(self) -> list[SimResult]:
        self.close()
        out = []
        for r, rp, acc, ta in zip(self.runs, self.reps, self.accs, self.tier):
            loads, info = rp.finish()
            res = _sim_result(acc, loads, info, self.src, r["policy"], r.get("label", ""), self.bw,
                              r.get("blob_bytes"))
            if ta is not None and acc.n:
                res.tiers = ta.result(loads, self.src.n_tokens, r["cost"])
            out.append(res)
        return out


class _TierAcc:
    """Per-layer counts of VRAM hits, RAM hits and SSD reads, for :func:`.costmodel.tier_costs_from_counts`."""

    def __init__(self, L: int, E: int, run: dict):
        from stratatools.cachesim.costmodel import ram_set

        self.bb, rb = _blob_arrays(L, run["blob_bytes"])
        self.in_ram = ram_set(run.get("profile"), L, E, rb, run["cost"].ram_bytes)
        self.counts = np.zeros((3, L), np.int64)
        self.n = 0

    def add(self, layer: np.ndarray, expert: np.ndarray, hits: np.ndarray) -> None:
        L = self.counts.shape[1]
        hits = np.asarray(hits, dtype=bool)
        ram = ~hits & self.in_ram[layer, expert]
        ssd = ~hits & ~ram
        for i, m in enumerate((hits, ram, ssd)):
            self.counts[i] += np.bincount(layer[m], minlength=L)
        self.n += len(hits)

    def result(self, loads, n_tokens: int, cost) -> dict[str, float]:
        from stratatools.cachesim.costmodel import tier_costs_from_counts

        return tier_costs_from_counts(self.counts, self.n, loads, n_tokens, self.bb, cost)


def simulate_many(src: Entries | EntryStream, runs: Sequence[dict[str, Any]], *,
                  bandwidth: BandwidthModel | None = None, chunk: int | None = None, progress=None,
                  weight: float = 1.0) -> list[SimResult]:
    """Several policy runs over one pass of ``src`` (each chunk is fed to every run), metrics per chunk.

    Args:
        src: :class:`Entries` (sliced into ``chunk`` entries, default :data:`CHUNK_ENTRIES`) or an
            :class:`EntryStream` (its own chunks; Belady runs first build its next-use file).
        runs: dicts with ``policy``, optional ``label`` and :func:`run_policy`'s keyword arguments
            (``blob_bytes``, ``profile``, ``slots``, ``cap``, policy parameters, ...).
        progress: object with ``update(advance=x)``; advanced by ``weight`` x (share of the pass done).
    Returns:
        one :class:`SimResult` per run, in order. Raises StrataError as :func:`run_policy`.
    """
    if not runs:
        return []
    g = RunGroup(src, runs, bandwidth)
    stream = isinstance(src, EntryStream)
    total = (src.summary.entries if src.complete else src.raw_entries) if stream else len(src)
    for c in (prefetch(src.chunks()) if stream else src.chunks(chunk)):
        g.feed(c)
        if progress is not None and total:
            progress.update(advance=weight * len(c) / total)
    return g.results()


PREFETCH = 2
"""Chunks a stream's reader thread may prepare ahead of the replay (:func:`prefetch`)."""


def prefetch(it, depth: int = PREFETCH):
    """The items of ``it`` produced by a background thread up to ``depth`` ahead of the consumer: reading and
    preparing a stream's next chunk overlaps the replay of the current one (the compiled kernels of both release
    the GIL). Memory: ``depth`` more chunks. An exception of the producer is raised in the consumer at the item
    it stopped at; a consumer that stops early stops the producer."""
    import queue
    import threading

    if depth < 1:
        yield from it
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for x in it:
                while not stop.is_set():
                    try:
                        q.put((x, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((done, e))
            return
        finally:
            close = getattr(it, "close", None)
            if stop.is_set() and close is not None:
                close()
        q.put((done, None))

    t = threading.Thread(target=produce, name="stratatools-prefetch", daemon=True)
    t.start()
    try:
        while True:
            x, err = q.get()
            if x is done:
                if err is not None:
                    raise err
                return
            yield x
    finally:
        stop.set()
        while t.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                pass
            t.join(timeout=0.05)


def simulate_policy(ent: Entries | EntryStream, policy: str, *, label: str = "",
                    bandwidth: BandwidthModel | None = None, blob_bytes=None, cost=None, chunk: int | None = None,
                    **kw: Any) -> SimResult:
    """:func:`run_policy` plus :func:`metrics`, as a :class:`SimResult`, replayed chunk by chunk
    (:func:`simulate_many` with one run; ``ent`` may be an :class:`EntryStream`).

    ``cost``: a :class:`.costmodel.ThreeTierModel`; with blob sizes, ``tiers`` holds its per-tier hit rates and
    predicted tok/s (the RAM tier ranked by ``kw["profile"]``, flat order without one).

    Without ``blob_bytes`` (a slot budget and no pack/model) byte sizes are unknown: ``h_bytes``,
    ``moved_bytes``, ``fill_bytes`` and ``time_per_token_s`` are None; ``loads`` still counts the copies.
    """
    if kw.get("engine", "compiled") == "python":
        kw.pop("engine")
        bw = bandwidth or BandwidthModel()
        hits, loads, info = run_policy(ent, policy, blob_bytes=blob_bytes, engine="python", **kw)
        acc = MetricAcc(ent.n_layers)
        ta = None
        if cost is not None and blob_bytes is not None and len(ent):
            ta = _TierAcc(ent.n_layers, ent.n_expert, dict(blob_bytes=blob_bytes, cost=cost, **kw))
        _acc_add(acc, ta, ent.layer, ent.expert, ent.record, np.asarray(hits, dtype=bool), ent.count)
        res = _sim_result(acc, loads, info, ent, policy, label, bw, blob_bytes)
        if ta is not None:  # the counted entries (the warm-up's copies are in loads, as in moved_bytes)
            res.tiers = ta.result(loads, ent.n_tokens, cost)
        return res
    kw.pop("engine", None)
    return simulate_many(ent, [dict(policy=policy, label=label, blob_bytes=blob_bytes, cost=cost, **kw)],
                         bandwidth=bandwidth, chunk=chunk)[0]
