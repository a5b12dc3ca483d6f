"""``stratatools run``: run prompts through a packed model, record the routing, count the expert tier.

Prompts file (decision):

* ``*.json``: ``{"prompts": [...]}`` or a bare list; each item is a string (the text) or an object with
  ``text`` and/or ``token_ids`` (ids win when both are given: the kit's ``routing/prompts.json`` runs as is)
  and an optional ``prompt_id``: a string or an integer (its decimal text); absent or JSON ``null``, the
  default ``p<index>`` (null means "not given", as it does for ``text`` and ``token_ids``); any other type or an
  empty string is refused;
* ``*.jsonl`` (JSON Lines): one item per non-empty line, each following exactly the rules of a ``.json`` list's
  items (the index of ``p<index>`` counts items, not lines; lines end at ``\\n`` only, a ``\\r`` before it is
  ignored); errors name the line (1-based);
* anything else: UTF-8 text, one prompt per non-empty line; the escapes ``\\n``, ``\\t`` and ``\\\\`` inside
  a line become newline, tab and backslash (so code prompts fit on one line).

The suffixes are matched in any case. A file with NUL bytes or invalid UTF-8 is not text and is refused. Prompt
ids must be distinct (an explicit id equal to another prompt's default ``p<index>`` included; ``7`` and ``"7"``
are the same id): traces and reports name requests by them, so two prompts with one id are refused, naming
both. Requests are numbered 0.. in file order; those numbers are the trace's request ids.

The routing trace has one record per (request, position, layer): prefill positions with phase ``prefill``,
generated positions with phase ``decode`` (format by extension: ``.parquet``, ``.csv``, otherwise Strata's
tagged ``--dump-routing`` layout, which keeps request ids, phases and windows; ``--trace-format strata`` writes
the plain engine layout, which keeps none of them and holds decode positions only: the prefill records are left
out, as the engine's own dump writes none, and counted in ``trace_dropped_prefill``). Records are in the order the tier saw them, and every forward
batch of more than one position (the prefill) is a window, written layer-major: a replay of the trace makes the
same rounds as the run's tier (:data:`stratatools.traces.table.ROUNDS`) and feeds the entries in the same order.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.core.fsutil import guard_output, probe_writable, refuse_stdout
from stratatools.pack.native import EXPERTS_BIN, NATIVE_TXT
from stratatools.profiles.strp import read_profile
from stratatools.traces.table import DECODE, PREFILL, TraceTable
from stratatools.traces.formats import write_trace

from stratatools.runtime.model import Qwen4ExpRuntime, RoutingRecord, generate
from stratatools.runtime.tier import ExpertTier
from stratatools.runtime.tokenizer import BPETokenizer
from stratatools.runtime.weights import load

TRACE_FORMATS = ("strata-tagged", "strata", "parquet", "csv")
RUN_POLICIES = ("static", "adaptive", "lru", "lfu", "lfru")  # the online tiers (belady is offline)


@dataclass
class Prompt:
    """One request: its id label, text (may be None when only ids were given) and token ids (None: tokenize)."""

    prompt_id: str
    text: str | None
    token_ids: list[int] | None


def _unescape(line: str) -> str:
    out = []
    i = 0
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line) and line[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[line[i + 1]])
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


_JSON_TYPES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "a list"}


def _prompt_item(p: Path, it: Any, i: int, place: str) -> Prompt:
    """One item of a JSON prompts file (a ``.json`` list or a ``.jsonl`` line): the rules of the module docstring.

    ``i`` is the item's index (0-based, the default id ``p<i>``); ``place`` names it in errors (``prompt #i``, or
    ``line L: prompt #i`` in a ``.jsonl``). Raises StrataError (one line: file, place, fix) for an item that is not a
    string or an object, ``text`` that is not a string, ``token_ids`` that are not a list of integers, neither given,
    an empty prompt, or a ``prompt_id`` that is not a non-empty string or an integer.
    """
    if isinstance(it, str):
        if not it:
            raise StrataError(f"{p}: {place} is empty; give the prompt's text", p)
        return Prompt(f"p{i}", it, None)
    if not isinstance(it, dict):
        what = _JSON_TYPES.get(type(it), type(it).__name__)
        raise StrataError(f"{p}: {place} is {what}; expected a string or an object with text/token_ids", p)
    ids = it.get("token_ids")
    txt = it.get("text")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise StrataError(f"{p}: {place}: token_ids must be a list of integers", p)
    if txt is not None and not isinstance(txt, str):
        raise StrataError(f"{p}: {place}: text must be a string", p)
    if ids is None and txt is None:
        raise StrataError(f"{p}: {place} has neither text nor token_ids; give one of them", p)
    if ids is not None and not ids:
        raise StrataError(f"{p}: {place} has no tokens; give at least one token id (or leave token_ids out)", p)
    if ids is None and not txt:
        raise StrataError(f"{p}: {place} is empty; give the prompt's text", p)
    pid = it.get("prompt_id")
    if pid is None:
        pid = f"p{i}"
    elif isinstance(pid, bool) or not isinstance(pid, (str, int)) or pid == "":
        raise StrataError(f"{p}: {place}: prompt_id {json.dumps(pid)} is not a prompt id; give a non-empty "
                          f"string (or leave it out for the default p{i})", p)
    return Prompt(str(pid), txt, list(ids) if ids is not None else None)


def read_prompts(path: str | os.PathLike) -> list[Prompt]:
    """Parse a prompts file (see the module docstring): ``.json``, ``.jsonl`` (any case) or text lines.

    Returns the prompts in file order (request i is item i); their ``prompt_id`` values are distinct.

    Raises:
        StrataError: missing file, binary/non-UTF-8 content (byte offset named), malformed JSON (the line named)
            or items (a ``prompt_id`` that is not a non-empty string or an integer, for one; in a ``.jsonl`` the
            line is named too), two prompts with the same ``prompt_id`` (both named), no prompt at all.
    """
    from stratatools.core.fsutil import check_input

    p = check_input(path, "prompts file")
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise StrataError(f"{p}: no such file", p) from None
    except IsADirectoryError:
        raise StrataError(f"{p}: is a directory, expected a prompts file (text lines, JSON or JSON Lines)", p) from None
    nul = data.find(b"\x00")
    if nul >= 0:
        raise StrataError(f"{p}: byte {nul}: NUL byte; the prompts file is not text (one prompt per line, JSON "
                          f"or JSON Lines)", p)
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is not part of the first prompt
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StrataError(f"{p}: byte {e.start}: not UTF-8 text; the prompts file must be text lines, JSON or "
                          f"JSON Lines", p) from None
    prompts: list[Prompt] = []
    lines: list[int] = []  # .jsonl: the 1-based line of each prompt (for the duplicate id error)
    suffix = p.suffix.lower()
    if suffix == ".json":
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise StrataError(f"{p}: line {getattr(e, 'lineno', '?')}: not valid JSON ({e.msg if hasattr(e, 'msg') else e})", p) from None
        items = obj.get("prompts") if isinstance(obj, dict) else obj
        if not isinstance(items, list):
            raise StrataError(f"{p}: JSON must be a list of prompts or {{\"prompts\": [...]}}", p)
        for i, it in enumerate(items):
            prompts.append(_prompt_item(p, it, i, f"prompt #{i}"))
    elif suffix == ".jsonl":
        # JSON Lines: lines end at "\n" only (str.splitlines would also split at U+2028 or U+0085, which JSON
        # allows raw inside a string); a "\r" before it is whitespace to json.loads.
        for ln, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                it = json.loads(line)
            except ValueError as e:
                raise StrataError(f"{p}: line {ln}: not valid JSON ({e.msg if hasattr(e, 'msg') else e}, column "
                                  f"{getattr(e, 'colno', '?')}); a .jsonl file holds one JSON value per line: a "
                                  f"string or an object with text/token_ids", p) from None
            i = len(prompts)
            prompts.append(_prompt_item(p, it, i, f"line {ln}: prompt #{i}"))
            lines.append(ln)
    else:
        n = 0
        for line in text.splitlines():
            if not line.strip():
                continue
            prompts.append(Prompt(f"p{n}", _unescape(line), None))
            n += 1
    if not prompts:
        raise StrataError(f"{p}: no prompts in the file", p)
    seen: dict[str, int] = {}
    for i, pr in enumerate(prompts):
        j = seen.setdefault(pr.prompt_id, i)
        if j != i:
            a, b = (f"prompt #{j} (line {lines[j]})", f"prompt #{i} (line {lines[i]})") if lines else \
                (f"prompt #{j}", f"prompt #{i}")
            raise StrataError(f"{p}: {a} and {b} have the same prompt_id {json.dumps(pr.prompt_id)} "
                              f"(request ids in traces and reports are keyed by it); give each prompt its own "
                              f"prompt_id (a prompt without one is named p<index>)", p)
    return prompts


def trace_format_for(path: str | os.PathLike, fmt: str | None) -> str:
    """The trace format: ``fmt`` when given (any case, as the extensions are), else by extension (.parquet/.pq,
    .csv, .bin; otherwise strata-tagged, see :func:`trace_format_note`).

    Raises StrataError naming ``--trace-format`` for an unknown format, naming the file when its extension is one of
    :data:`stratatools.traces.formats.TRACE_EXTENSIONS` and disagrees with ``fmt``, or is .json/.jsonl (no trace
    format is JSON)."""
    from stratatools.traces.formats import check_trace_name, format_by_extension

    if fmt:
        f = fmt.strip().lower()
        if f not in TRACE_FORMATS:
            raise StrataError(f"--trace-format {fmt!r} is not one of {', '.join(TRACE_FORMATS)}")
        check_trace_name(path, f, "--trace-format")
        return f
    check_trace_name(path, None, "--trace-format")
    return format_by_extension(path) or "strata-tagged"


def trace_format_note(path: str | os.PathLike, fmt: str | None) -> str | None:
    """A line for the console when the trace's format was chosen for an extension that names none (``fmt`` not
    given, the extension names no trace format), else None."""
    from stratatools.traces.formats import format_by_extension

    if fmt or format_by_extension(path):
        return None
    ext = Path(path).suffix or "no extension"
    return (f"{path}: {ext} names no trace format: writing Strata tagged binary (the default; .csv or .parquet, "
            f"or --trace-format, choose another)")


@dataclass
class RequestResult:
    """One request's outcome."""

    request: int
    prompt_id: str
    prompt_tokens: int
    new_ids: list[int]
    text: str | None
    stop: str
    prefill_s: float
    decode_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"request": self.request, "prompt_id": self.prompt_id, "prompt_tokens": self.prompt_tokens,
                "new_tokens": len(self.new_ids), "new_ids": self.new_ids, "text": self.text, "stop": self.stop,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s}


@dataclass
class RunResult:
    """What ``stratatools run`` reports.

    Attributes:
        model: the GGUF run; pack: the pack folder (None: straight from a GGUF); expert_source:
            ``experts.bin`` or ``gguf``.
        selection: QSA selection rule.
        requests: per request :class:`RequestResult`.
        prompt_tokens, new_tokens: totals. decode_tokens: the new tokens that decode steps made (a request's first
            new token comes from its prefill's logits, so with ``-n 1`` there are none).
        prefill_s, decode_s: wall time of the prefills and of the decode steps (seconds).
        tokens_per_s: generated tokens per decode second (decode throughput; the first new token comes from
            the prefill, so it is counted in ``prefill_tokens_per_s`` instead); with ``--batch N`` the aggregate
            over the sequences decoded together (decode positions run / wall seconds of the batched steps).
        batch: ``{"batch": N}``, and for N > 1 the batched decode's figures: ``steps``, ``mean_active`` (sequences
            per step), ``decode_tokens_per_s`` (aggregate, as ``tokens_per_s``), ``graph_steps`` (steps replayed from
            the CUDA graph), ``queued_steps`` (steps launched from the device's tokens before the host read the step
            before), ``engine``.
        prefill_tokens_per_s: prompt tokens per prefill second.
        tier: the tier's stats (None without a tier); h_expert: the tier's decode-phase hit rate
            (cache-policy.md ``h_expert``; prefill and all-phase rates are in ``tier``).
        trace_path, trace_format, trace_records: the written trace (records written).
        trace_dropped_prefill, trace_dropped_prefill_records: prefill entries and records the trace left out
            (``--trace-format strata`` holds decode positions only); 0 otherwise.
    """

    model: str
    pack: str | None
    expert_source: str
    selection: str
    requests: list[RequestResult]
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    prefill_tokens_per_s: float
    tier: dict[str, Any] | None
    h_expert: float | None
    trace_path: str | None
    trace_format: str | None
    trace_records: int
    options: dict[str, Any] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=lambda: {"device": "cpu"})
    batch: dict[str, Any] = field(default_factory=lambda: {"batch": 1})
    decode_tokens: int = 0
    trace_dropped_prefill: int = 0
    trace_dropped_prefill_records: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "pack": self.pack, "expert_source": self.expert_source,
                "selection": self.selection, "requests": [r.to_dict() for r in self.requests],
                "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "decode_tokens": self.decode_tokens, "prefill_s": self.prefill_s,
                "decode_s": self.decode_s, "tokens_per_s": self.tokens_per_s,
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "h_expert": self.h_expert, "tier": self.tier,
                "trace_path": self.trace_path, "trace_format": self.trace_format, "trace_records": self.trace_records,
                "trace_dropped_prefill": self.trace_dropped_prefill,
                "trace_dropped_prefill_records": self.trace_dropped_prefill_records,
                "options": self.options, "device": self.device, "batch": self.batch}


def _gpu_runtime(w: Any, tier: ExpertTier | None, selection: str, max_ctx: int, info: dict[str, Any]) -> Any:
    """The GPU decode path: a :class:`stratatools.runtime.gpu.runtime.GPURuntime` whose device tier runs the
    tier's policy object (every expert resident without a tier), behind :class:`DecoderRuntime`."""
    import cupy as cp

    from stratatools.runtime.gpu.engine import DecoderRuntime
    from stratatools.runtime.gpu.runtime import GPURuntime
    from stratatools.runtime.gpu.tier import HostArena

    free0, total = cp.cuda.runtime.memGetInfo()
    info["gpu_name"] = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(errors="replace")
    info["device_free_at_start"] = int(free0)
    arena = HostArena.from_expert_source(w.experts)
    mode = "host" if arena.device_ptr is not None else "copy"
    grt = GPURuntime(w, policy=tier.tier if tier is not None else None, miss_mode=mode, arena=arena,
                     selection=selection, route_hook=tier.hook if tier is not None else None)
    if tier is not None:
        tier.attach_device(grt.tier)
    info["miss_mode"] = "host (zero-copy reads of pinned memory)" if mode == "host" else "copy"
    rt = DecoderRuntime(grt, max_ctx=max_ctx)
    info["engine"] = "static decoder + CUDA graph" + (" (QSA selection on the device)" if rt.dec.long else "")
    return rt


def _device_memory(rt: Any, info: dict[str, Any], plan: Any) -> None:
    """Device-memory figures of a finished GPU run into ``info`` (bytes): the plan, CuPy's pools, and what
    the device lost since the start (includes the CUDA context's own allocations)."""
    import cupy as cp

    pool = cp.get_default_memory_pool()
    dec = getattr(rt, "dec", None)
    grt = rt.rt if dec is not None else rt
    graph_pool = int(dec._pool.total_bytes()) if dec is not None and dec._pool is not None else 0
    info["pool_bytes"] = int(pool.total_bytes()) + graph_pool
    # the CUDA graph's private pool (the step's temporaries) and the decoder's state buffers (the plan's caches)
    info["graph_pool_bytes"] = graph_pool
    if dec is not None:
        info["decoder_state_bytes"] = int(dec.state_buffer_bytes())
    free1, _ = cp.cuda.runtime.memGetInfo()
    info["device_used_bytes"] = int(info.get("device_free_at_start", free1)) - int(free1)
    info["tier_vram_bytes"] = int(grt.tier.vram.size)
    info["tier"] = grt.tier.counters.to_dict()
    info["plan"] = plan.to_dict() if plan is not None else None
    if dec is not None:
        info["decoder"] = dict(dec.stats)
        info["miss_fetch"] = dec.fetch_stats()
        # queued decode steps (STRATATOOLS_DECODE_QUEUE): on or why not, and the steps run after a stop token
        info["decode_queue"] = {"on": bool(getattr(rt, "queue", False)), "reason": getattr(rt, "queue_reason", ""),
                                "discarded_steps": int(getattr(rt, "discarded_steps", 0))}


class _TraceBuilder:
    """The run's routing as a trace, one forward batch at a time, in the order the tier saw the records."""

    def __init__(self) -> None:
        self.cols: dict[str, list[np.ndarray]] = {k: [] for k in ("request", "position", "phase", "layer", "rank", "expert", "weight", "window")}
        self.records = 0
        self.windows = 0

    def add(self, request: int, phase: int, rec: RoutingRecord) -> None:
        """Append one forward batch: layer-major (every position of layer 0, then layer 1, ...: the order the
        batched forward routes and the tier counts), one record per (position, layer), ranks in order; a batch
        of more than one position is a window (one round, :data:`stratatools.traces.table.ROUNDS`)."""
        T = rec.positions.size
        L = len(rec.ids)
        if T == 0 or L == 0:
            return
        k = rec.ids[0].shape[1]
        ids = np.stack(rec.ids, axis=0)  # [L, T, k]
        w = np.stack(rec.weights, axis=0)
        n = T * L * k
        win = -1
        if T > 1:
            win, self.windows = self.windows, self.windows + 1
        self.cols["request"].append(np.full(n, request, np.int32))
        self.cols["position"].append(np.tile(np.repeat(rec.positions.astype(np.int32), k), L))
        self.cols["phase"].append(np.full(n, phase, np.int8))
        self.cols["layer"].append(np.repeat(np.arange(L, dtype=np.int16), T * k))
        self.cols["rank"].append(np.tile(np.arange(k, dtype=np.int16), T * L))
        self.cols["expert"].append(ids.reshape(-1).astype(np.int32))
        self.cols["weight"].append(w.reshape(-1).astype(np.float32))
        self.cols["window"].append(np.full(n, win, np.int32))
        self.records += T * L

    def table(self, **meta: Any) -> TraceTable:
        if not self.cols["expert"]:
            return TraceTable.empty(**meta)
        cols = {k: np.concatenate(v) for k, v in self.cols.items()}
        window = cols.pop("window")
        return TraceTable(**cols, meta=dict(meta), window=window if self.windows else None)


def _run_batched(rt: Any, dev: str, w: Any, tier: ExpertTier | None, prompts: list[Prompt], enc: list[list[int]],
                 max_new_tokens: int, need_ctx: int, batch: int, builder: _TraceBuilder,
                 results: list[RequestResult], tok: Any, progress: Callable[[int], None] | None,
                 info: dict[str, Any]) -> tuple[float, float, int]:
    """``run --batch N`` (N > 1): continuous batching through :func:`stratatools.runtime.gpu.batch.run_batched`
    (on the CPU a numpy :class:`StaticDecoder` over ``rt`` does the prefills). Fills ``results`` in request order and
    the trace builder in the tier's order; returns (prefill seconds, decode seconds, decode positions run)."""
    from stratatools.runtime.gpu.batch import BatchDecoder, run_batched
    from stratatools.runtime.gpu.decode import StaticDecoder

    if getattr(rt, "async_swaps", False):
        raise StrataError("--batch does not run with asynchronous expert swaps (STRATATOOLS_ASYNC_SWAPS=1): unset it")
    # on the GPU the decoder's step was captured first (run_prompts: DecoderRuntime.prepare), so its dense matrices
    # are on the device once for the prefills and the batched step
    dec = rt.dec if dev == "gpu" else StaticDecoder(rt, max_ctx=need_ctx)
    bd = BatchDecoder(dec, min(batch, len(enc)))

    def done(r: Any) -> None:
        if progress:
            progress(1)

    res, tot = run_batched(dec, bd, enc, max_new_tokens, w.cfg.eos_id, tier=tier,
                           on_record=lambda ri, ph, rec: builder.add(ri, ph, rec), on_done=done)
    for r, pr in zip(res, prompts):
        text = tok.decode(r.new_ids) if tok is not None else None
        results.append(RequestResult(r.request, pr.prompt_id, r.prompt_tokens, r.new_ids, text, r.stop, r.prefill_s,
                                     r.decode_s))
    dec_s = float(tot["decode_s"])
    graph, queued = int(bd.stats.get("graph_steps", 0)), int(bd.stats.get("queued_steps", 0))
    how = (f"{graph} of {int(tot['steps'])} steps replayed from a CUDA graph, {queued} queued from the device's "
           f"tokens" if graph else "eager launches")
    info.update({"places": bd.n, "steps": int(tot["steps"]), "mean_active": float(tot["mean_active"]),
                 "decode_forwards": int(tot["decode_forwards"]),
                 "decode_tokens_per_s": (tot["decode_forwards"] / dec_s) if dec_s > 0 else 0.0,
                 "state_bytes": bd.state_bytes(), "graph_steps": graph, "queued_steps": queued,
                 "engine": f"batched decode (continuous batching): {how}"})
    return float(tot["prefill_s"]), dec_s, int(tot["decode_forwards"])


def run_prompts(pack: str | os.PathLike, prompts_path: str | os.PathLike, *, model: str | os.PathLike | None = None,
                profile: str | os.PathLike | None = None, budget_gib: float | None = None, slots: int | None = None,
                policy: str = "static", admission: str = "global", max_new_tokens: int = 16,
                trace_out: str | os.PathLike | None = None, trace_format: str | None = None, force: bool = False,
                selection: str = "transformers", output_gate: str = "sigmoid", xp: Any = np,
                progress: Callable[[int], None] | None = None, tier_params: dict[str, Any] | None = None,
                device: str = "cpu", vram_gib: float | None = None, batch: int = 1) -> RunResult:
    """Run every prompt of ``prompts_path`` through a pack (or GGUF) with greedy decoding.

    Args:
        pack: pack folder or GGUF. model: the pack's GGUF when the pack does not name it.
        profile: STRP profile filling the tier; budget_gib / slots: the tier's size (a tier is built when any
            of profile, budget_gib, slots is given). policy / admission: tier policy (the simulator's).
        tier_params: the adaptive tier's parameters (``adapt_every``, ``max_moves``, ``decay``, ``lag``,
            ``pace_bytes``, ``upper_slots``, ``disjoint``; :class:`stratatools.cachesim.tiers.AdaptiveTier`).
        max_new_tokens: length cap per request (stop token: the model's EOS).
        trace_out / trace_format: where and how to write the routing trace. force: replace an existing trace.
        selection: QSA selection (``transformers`` or ``llamacpp``). output_gate: GDN output gate.
        progress: called with 1 after each request.
        device: ``cpu``, ``gpu`` or ``auto`` (:func:`stratatools.runtime.device.resolve_device`); on the GPU the
            static decoder runs every token (:mod:`stratatools.runtime.gpu.engine`) with the expert tier in VRAM
            slots and misses read from pinned host memory.
        vram_gib: the GPU path's device-memory budget: the expert slots follow from what the dense weights and
            caches leave (:func:`stratatools.runtime.device.plan_vram`).
        batch: sequences decoded together (1: one request at a time, the path above). Above 1, continuous
            batching (:func:`stratatools.runtime.gpu.batch.run_batched`): each prompt's batched prefill, then one
            batched decode step over the running sequences per position, a finished sequence's place taken by the
            next prompt; on the CPU the same code runs with numpy. Rounds: docs/cache-model.md "Batched decode".

    Raises:
        StrataError: every load/parse error (pack vs GGUF mismatch, bad prompts, profile of another geometry),
            an existing trace without ``force``, an output that is an input, ``trace_out`` ``-`` (stdout),
            ``trace_format`` without ``trace_out``, a ``policy`` outside :data:`RUN_POLICIES` (``belady`` is
            offline: simulate only).
    """
    refuse_stdout(trace_out, "--trace-out", "a routing trace (Strata binary, Parquet or CSV, written to a temp "
                  "file and renamed)", "run-trace.bin")
    if trace_format is not None and trace_out is None:
        raise StrataError(f"--trace-format {trace_format} without --trace-out: the format is the written trace's; add "
                          f"--trace-out FILE or drop --trace-format")
    prompts = read_prompts(prompts_path)
    fmt = None
    inputs: list[Any] = []
    if trace_out is not None:
        inputs = [pack, prompts_path] + ([profile] if profile else []) + ([model] if model else [])
        guard_output(trace_out, inputs, force)
        if Path(trace_out).is_dir():
            raise StrataError(f"{trace_out}: is a directory; --trace-out takes a file path", trace_out)
        fmt = trace_format_for(trace_out, trace_format)
    if max_new_tokens < 0:
        raise StrataError(f"--max-new-tokens {max_new_tokens} is negative")
    if batch < 1:
        raise StrataError(f"--batch {batch}: the batch size must be at least 1")
    if batch > 1 and fmt == "strata":
        raise StrataError(f"{trace_out}: --batch {batch} with --trace-format strata: the plain layout keeps no request ids "
                          f"or phases, so a replay cannot rebuild the batched rounds; use strata-tagged (the default), "
                          f"parquet or csv", trace_out)
    if fmt == "strata" and max_new_tokens <= 1:
        raise StrataError(f"{trace_out}: --trace-format strata with --max-new-tokens {max_new_tokens}: no decode step "
                          f"runs, and a plain Strata trace holds decode positions only (as the engine's "
                          f"--dump-routing), so it would be empty; use strata-tagged (the default), parquet or csv, "
                          f"or --max-new-tokens 2 or more", trace_out)
    if trace_out is not None:  # a folder that cannot take the trace fails now, not after the whole workload
        probe_writable(trace_out)
    from stratatools.runtime.device import resolve_device

    dev = resolve_device(device)
    if vram_gib is not None and dev != "gpu":
        raise StrataError("--vram-gib sizes the GPU path; it needs --device gpu (or auto with a GPU)")
    if slots is not None and budget_gib is not None:
        raise StrataError(f"--slots {slots} and --budget-gib {budget_gib:g} both size the tier: give --slots N or "
                          f"--budget-gib X, not both")
    if vram_gib is not None and budget_gib is not None:
        raise StrataError("--vram-gib and --budget-gib both size the tier; give one (--vram-gib: the whole device "
                          "footprint, --budget-gib: the expert slots alone)")
    if dev == "gpu":
        from stratatools.runtime.gpu import require_cupy
        from stratatools.runtime.gpu.switches import check_switches

        xp = require_cupy()
        check_switches()  # (a bad STRATATOOLS_* value fails here, before the model's load)
    if policy not in RUN_POLICIES:
        why = " is offline (it needs the whole future: use it in simulate)" if policy == "belady" else " is unknown"
        raise StrataError(f"--policy {policy}{why}; run's expert tier takes {', '.join(RUN_POLICIES)}")
    if admission not in ("global", "per-layer"):
        raise StrataError(f"--admission {admission!r}: unknown; use global or per-layer")
    want_tier = profile is not None or budget_gib is not None or slots is not None or vram_gib is not None
    if tier_params and policy != "adaptive":
        raise StrataError(f"the --adapt-*/--upper-slots options configure the adaptive tier, not --policy {policy}: "
                          f"add --policy adaptive")
    if not want_tier and (policy != "static" or admission != "global"):
        raise StrataError(f"--policy {policy} / --admission {admission} configure the expert tier, and there is none: "
                          f"pass --slots N, --budget-gib X or --profile P")
    w = load(pack, model, xp=xp, output_gate=output_gate)
    try:
        if trace_out is not None:  # the files behind the pack folder and every shard are inputs too
            files = [f.path for f in w.model.files]
            if w.pack is not None:
                files += [w.pack.path / n for n in (NATIVE_TXT, NATIVE_TXT + ".json", EXPERTS_BIN, EXPERTS_BIN + ".src.json")]
            guard_output(trace_out, inputs + files, force)
        prof = None
        if profile is not None:
            prof = read_profile(profile)
        tok = None
        enc: list[list[int]] = []
        n_ctx_model = w.model.kv.get(f"{w.model.arch}.context_length")
        if any(pr.token_ids is None for pr in prompts):
            tok = BPETokenizer.from_gguf(w.model)
        ctx_left = None if n_ctx_model is None else int(n_ctx_model) - max_new_tokens
        for i, pr in enumerate(prompts):
            if pr.token_ids is not None:
                ids = pr.token_ids
            else:
                # a text that cannot fit the context whatever its tokens is refused before it is tokenized (its token
                # list would take ~35 bytes a token of memory); only one of more bytes than positions left can be
                nbytes = len((pr.text or "").encode("utf-8", "replace"))
                least = -(-nbytes // tok.max_token_bytes) if ctx_left is not None and nbytes > ctx_left else 0
                if least and least > ctx_left:
                    raise StrataError(f"{prompts_path}: prompt #{i}: {nbytes} bytes of text are at least {least} "
                                      f"tokens (a token covers at most {tok.max_token_bytes} bytes) + --max-new-tokens "
                                      f"{max_new_tokens}, over the model's context length {int(n_ctx_model)}; shorten "
                                      f"the prompt or lower --max-new-tokens", prompts_path)
                ids = tok.encode(pr.text or "")
            bad = [x for x in ids if not 0 <= x < w.cfg.n_vocab]
            if bad:
                raise StrataError(f"{prompts_path}: prompt #{i}: token id {bad[0]} is outside the vocabulary [0, {w.cfg.n_vocab})", prompts_path)
            enc.append(list(ids))
        if tok is None:  # token-id prompts: the output is still decoded when the model has a tokenizer
            try:
                tok = BPETokenizer.from_gguf(w.model)
            except StrataError:
                tok = None
        need_ctx = max(len(ids) for ids in enc) + max_new_tokens
        if n_ctx_model is not None and need_ctx > int(n_ctx_model):
            i = max(range(len(enc)), key=lambda j: len(enc[j]))
            raise StrataError(f"{prompts_path}: prompt #{i}: {len(enc[i])} tokens + --max-new-tokens {max_new_tokens} = "
                              f"{need_ctx} positions, over the model's context length {int(n_ctx_model)}; shorten the "
                              f"prompt or lower --max-new-tokens", prompts_path)
        vram_plan = None
        if dev == "gpu":
            from stratatools.runtime.device import plan_vram

            blob = [w.experts.blob_bytes(il) for il in range(w.cfg.n_layer)]
            vram_plan = plan_vram(w.model, w.cfg, blob, need_ctx, vram_gib, slots, int(sum(w.cfg.n_expert)),
                                  selection=selection, batch=batch)
            if vram_gib is not None:
                slots = vram_plan.slots
        tier = None
        if want_tier:
            tier = ExpertTier(w, policy=policy, profile=prof, slots=slots, budget_gib=budget_gib,
                              admission=admission, profile_path=str(profile) if profile else None,
                              store=dev != "gpu", **(tier_params or {}))
        dev_info: dict[str, Any] = {"device": dev, "device_requested": device}
        if dev == "gpu":
            rt = _gpu_runtime(w, tier, selection, need_ctx, dev_info)
        else:
            rt = Qwen4ExpRuntime(w, selection=selection, expert_fn=tier.matrices if tier else None,
                                 route_hook=tier.hook if tier else None)
        builder = _TraceBuilder()
        results: list[RequestResult] = []
        pre_s = dec_s = 0.0
        n_new_decoded = 0
        batch_info: dict[str, Any] = {"batch": int(batch)}
        if dev == "gpu":
            if batch > 1 and getattr(rt, "queue", False):  # the batched step has no queued decode (nor its tables)
                rt.queue, rt.queue_reason = False, "--batch runs the batched step"
            # graph capture and kernel compilation are one-time set-up, timed apart from the first prompt's prefill
            ts = time.perf_counter()
            rt.prepare()
            dev_info["setup_s"] = time.perf_counter() - ts
        if batch > 1:
            pre_s, dec_s, n_new_decoded = _run_batched(rt, dev, w, tier, prompts, enc, max_new_tokens, need_ctx,
                                                       int(batch), builder, results, tok, progress, batch_info)
        for ri, (pr, ids) in enumerate(zip(prompts, enc) if batch == 1 else ()):
            if tier is not None:
                tier.phase = "prefill"
            marks: dict[str, float] = {}

            def on_forward(phase: str) -> None:
                if tier is not None:  # the prefill is one round, each decode step one round
                    tier.end_round()
                    tier.phase = "decode"
                if phase == "prefill":
                    marks["prefill_end"] = time.perf_counter()

            t0 = time.perf_counter()
            g = generate(rt, ids, max_new_tokens, stop_id=w.cfg.eos_id, state=rt.new_state(), on_forward=on_forward)
            t2 = time.perf_counter()
            t1 = marks["prefill_end"]
            builder.add(ri, PREFILL, g.prefill)
            for rec in g.decode:
                builder.add(ri, DECODE, rec)
            n_new_decoded += len(g.decode)
            new, stop = g.new_ids, g.stop
            pre_s += t1 - t0
            dec_s += t2 - t1
            text = tok.decode(new) if tok is not None else None
            results.append(RequestResult(ri, pr.prompt_id, len(ids), new, text, stop, t1 - t0, t2 - t1))
            if progress:
                progress(1)
        if dev == "gpu":
            _device_memory(rt, dev_info, vram_plan)
        n_prompt = sum(len(x) for x in enc)
        n_new = sum(len(r.new_ids) for r in results)
        tstats = tier.stats() if tier is not None else None
        h = None
        if tstats is not None:
            h = tstats["decode"]["h_expert"] if tstats["decode"]["entries"] else tstats["all"]["h_expert"]
        n_records = builder.records
        n_drop = r_drop = 0
        if trace_out is not None:
            names = [pr.prompt_id for pr in prompts]
            extra = {"request_names": names} if len(set(names)) == len(names) else {}  # CSV prompt_id column
            table = builder.table(source_format="stratatools-runtime", n_layers=w.cfg.n_layer,
                                  n_expert=max(w.cfg.n_expert), model=w.model.path.name,
                                  model_name=w.model.path.name, selection=selection, **extra)
            if fmt == "strata":  # decode positions only, as the engine's dump; said by the caller
                from stratatools.traces.formats.strata import all_prefill_error, drop_prefill

                n_all = len(table)
                table, n_drop, r_drop = drop_prefill(table)
                if n_all and not len(table):  # every request stopped at its first token
                    raise all_prefill_error(trace_out, n_all)
                n_records -= r_drop
            write_trace(table, trace_out, fmt)
        return RunResult(
            model=str(w.model.path), pack=str(w.pack.path) if w.pack is not None else None,
            expert_source=w.experts.source, selection=selection, requests=results, prompt_tokens=n_prompt,
            new_tokens=n_new, prefill_s=pre_s, decode_s=dec_s,
            tokens_per_s=(n_new_decoded / dec_s) if dec_s > 0 and n_new_decoded else 0.0,
            prefill_tokens_per_s=(n_prompt / pre_s) if pre_s > 0 else 0.0, tier=tstats, h_expert=h,
            trace_path=str(trace_out) if trace_out is not None else None, trace_format=fmt, trace_records=n_records,
            options={"policy": policy if tier else None, "admission": admission if tier else None, "slots": slots,
                     "budget_gib": budget_gib, "profile": str(profile) if profile else None,
                     "max_new_tokens": max_new_tokens, "output_gate": output_gate, "vram_gib": vram_gib,
                     "batch": int(batch)},
            device=dev_info, batch=batch_info, decode_tokens=int(n_new_decoded),
            trace_dropped_prefill=n_drop, trace_dropped_prefill_records=r_drop)
    finally:
        w.close()
