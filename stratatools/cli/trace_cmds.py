"""CLI commands: ``trace convert``, ``trace stats`` and ``make-profile`` (routing traces and profile building)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from stratatools.core.errors import StrataError
from stratatools.cli import common

trace_app = typer.Typer(help="Routing traces: convert between formats, summarise.", no_args_is_help=True)
_WHERE = typer.Option(None, "--where", help="KEY=VALUE: keep partitions (key=value folders) or Parquet rows "
                                            "with this value; repeatable.")
_CLUSTER = typer.Option(None, "--cluster", help=common.CLUSTER_HELP)


def _convert(
    src: str = typer.Argument(..., help="Input trace (Strata --dump-routing plain/tagged, llama-moe-trace CSV, "
                                        "kit CSV or Parquet; the format is sniffed); with --dataset also a folder, "
                                        "a glob or a Parquet dataset."),
    out: Path = typer.Option(..., "-o", "--output", help="Output file (with --dataset: a folder).",
                             parser=common.out_file("--output", "trace.parquet", folder_ok=True)),
    to: str = typer.Option(..., "--to", help="Output format: strata, strata-tagged, parquet or csv."),
    from_: Optional[str] = typer.Option(None, "--from", help="Input format (strata, llama-csv, csv, parquet); "
                                                             "default: sniffed."),
    n_layer: Optional[int] = typer.Option(None, "--n-layer", callback=common.int_range(1, common.MAX_LAYERS), help="Trunk layers, to range-check expert ids."),
    n_expert: Optional[int] = typer.Option(None, "--n-expert", callback=common.int_range(1, common.MAX_EXPERTS), help="Experts per layer, to range-check ids."),
    dataset: bool = typer.Option(False, "--dataset", help="--to parquet: write OUT as a (hive-partitioned) "
                                                          "dataset folder, read and written chunk by chunk."),
    partition: Optional[List[str]] = typer.Option(None, "--partition", help="With --dataset: KEY=VALUE folder "
                                                  "level, repeatable in order, each key once (e.g. server=a, "
                                                  "date=2026-12-01)."),
    where: Optional[List[str]] = _WHERE,
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    json_: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Convert a routing trace to another format (written to a temp file beside OUT, then renamed over it);
    ``--to parquet --dataset`` writes a partitioned Parquet dataset in bounded memory."""
    from stratatools.core.fsutil import refuse_stdout
    from stratatools.traces.sources import convert_trace_stream

    refuse_stdout(out, "--output", "a converted trace (written to a temp file and renamed)",
                  "trace.parquet" if to == "parquet" else f"trace.{'csv' if to == 'csv' else 'bin'}")
    if dataset or partition or where:
        if to != "parquet" or not dataset:
            raise StrataError("--partition and --where need --to parquet --dataset (a dataset folder)")
        from stratatools.traces.formats.parquet import write_parquet_dataset
        from stratatools.traces.sources import open_traces, parse_partition

        part = parse_partition(partition)
        srcs = open_traces([src], from_, n_layer, n_expert, where)
        with common.progress_bar("writing dataset", None, bytes_=False) as bar:
            d = write_parquet_dataset(srcs, out, part, force=force, progress=lambda m: bar.update(advance=m))
        if json_:
            common.emit_json(d)
            return
        common.console.print(f"{src} -> {d['output']}: {d['entries']:,} routed entries in {d['records']:,} records, "
                             f"{len(d['files'])} file(s), {d['bytes']:,} bytes", markup=False, soft_wrap=True)
        return
    from stratatools.traces.formats import check_trace_name

    check_trace_name(out, to.strip().lower(), "--to")
    with common.progress_bar("converting", None, bytes_=False) as bar:
        res = convert_trace_stream(Path(src), out, to, from_, force, n_layer, n_expert,
                                   progress=lambda m: bar.update(advance=m))
    if res.dropped_prefill:  # data left out: always said, one line on stderr (stdout may be --json)
        from stratatools.traces.formats.strata import plain_prefill_note

        common.err_console.print("warning: " + plain_prefill_note(res.output, res.dropped_prefill,
                                                                  res.dropped_prefill_records),
                                 markup=False, highlight=False, soft_wrap=True)
    if json_:
        common.emit_json(res.to_dict())
        return
    common.console.print(f"{res.input} ({res.from_format}) -> {res.output} ({res.to_format}): "
                         f"{res.entries:,} routed entries in {res.records:,} records, {res.output_bytes:,} bytes",
                         markup=False, soft_wrap=True)


LOCALITY_MAX_ENTRIES = 1 << 24  # trace stats reads a single trace up to this size whole (locality statistics)


def _stats(
    traces: List[str] = typer.Argument(..., help="Trace files, folders, globs or Parquet datasets (any supported "
                                                 "format); several are one fleet."),
    from_: Optional[str] = typer.Option(None, "--from", help="Input format; default: sniffed."),
    n_expert: Optional[int] = typer.Option(None, "--n-expert", callback=common.int_range(1, common.MAX_EXPERTS), help="Experts per layer (concentration "
                                                                    "denominator); default: largest id + 1."),
    window: int = typer.Option(64, "--window", callback=common.int_range(1, common.MAX_COUNT), help="Steps per locality window (distinct experts per "
                                                           "window; the collapse verdict)."),
    where: Optional[List[str]] = _WHERE,
    cluster: Optional[str] = _CLUSTER,
    json_: bool = typer.Option(False, "--json", help="Print the statistics as JSON."),
) -> None:
    """Tokens, layers, k; per layer: distinct experts, concentration (top-10% share), entropy, distinct experts per
    window of decode steps, reuse distances; and a one-line verdict when routing has collapsed.

    Several files, folders, datasets, traces above LOCALITY_MAX_ENTRIES entries and --cluster are read chunk by
    chunk (memory independent of their length) and get the counts without the locality columns and verdict."""
    from stratatools.core.cluster import open_cluster
    from stratatools.traces.sources import open_traces, trace_stats_sources
    from stratatools.traces.table import trace_stats

    srcs = open_traces(traces, from_, None, None, where)
    st = None
    if len(srcs) == 1 and cluster is None and not where:
        s0 = srcs[0]
        n0 = len(s0) if hasattr(s0, "__len__") else int(s0.meta.get("source_bytes", 0)) // 8  # entries (bound)
        if n0 <= LOCALITY_MAX_ENTRIES:
            from stratatools.traces.formats import read_trace

            st = trace_stats(read_trace(s0.spec[0], from_, None, None), n_expert, window=window)
    if st is None:
        with open_cluster(cluster) as client:
            unit = "files" if client is not None else "entries"
            with common.progress_bar(f"counting ({unit})", len(srcs) if client is not None else None,
                                     bytes_=False) as bar:
                st = trace_stats_sources(srcs, n_expert, progress=lambda m: bar.update(advance=m), client=client)
        st.window = window
        st.verdict = (f"locality not computed (read chunk by chunk: several files, a dataset, --where, --cluster or "
                      f"more than {LOCALITY_MAX_ENTRIES:,} entries); run trace stats on one smaller trace file for "
                      f"the collapse verdict")
    trace = traces[0] if len(srcs) == 1 and len(traces) == 1 else f"{len(srcs)} trace file(s)"
    if json_:
        common.emit_json(st.to_dict())
        return
    c = common.console
    k = f"{st.k_min}" if st.k_min == st.k_max else f"{st.k_min}..{st.k_max}"
    c.print(f"{trace} ({st.meta.get('source_format')}): {st.entries:,} routed entries, {st.records:,} records, "
            f"{st.tokens:,} tokens, {st.requests} request(s), {st.layers} layers, k {k}, {st.n_expert} experts",
            markup=False, soft_wrap=True)
    c.print("phases: " + ", ".join(f"{p} {n:,}" for p, n in st.phases.items()), markup=False, soft_wrap=True)
    c.print(rounds_line(st.rounds, st.windows, st.outside_windows, st.prefill_windows), markup=False,
            soft_wrap=True)
    c.print(f"concentration (top 10% of pairs): {st.concentration:.1%}; mean entropy {st.mean_entropy_bits:.3f} "
            f"bits (uniform: {math.log2(st.n_expert) if st.n_expert else 0:.3f})", markup=False, soft_wrap=True)
    if st.reuse_quantiles:
        q = st.reuse_quantiles
        c.print(f"reuse distance ({st.locality_phase} steps since the request last routed the expert at that layer): "
                f"p50 {q['p50']:g}, p90 {q['p90']:g}, p99 {q['p99']:g}", markup=False, soft_wrap=True)
    tbl = Table("layer", "entries", "distinct", "top-10%", "entropy", f"min/{st.window}", f"mean/{st.window}",
                "reuse p50/p90", "cold")

    def _f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for ls in st.per_layer:
        tbl.add_row(str(ls.layer), f"{ls.entries:,}", str(ls.distinct_experts), f"{ls.concentration:.1%}",
                    f"{ls.entropy_bits:.3f}", _f(ls.window_distinct_min, 'd'), _f(ls.window_distinct_mean, '.1f'),
                    f"{_f(ls.reuse_p50, 'g')} / {_f(ls.reuse_p90, 'g')}", _f(ls.cold_share, '.1%'))
    c.print(tbl)
    c.print(f"verdict: {st.verdict}", markup=False, soft_wrap=True)


def rounds_line(rounds: str, windows: int, outside: int, prefill: int = 0) -> str:
    """One line saying what a replay round is for a trace (``trace stats``; see trace.TraceStats): verify
    windows and prefill batches (windows holding prefill records, as ``stratatools run`` writes them) are named
    apart."""
    if rounds == "positions":
        return "rounds: decode positions (the trace delimits no verify windows or prefill batches)"
    verify = windows - prefill
    if prefill and not verify:
        line = f"rounds: prefill batches ({prefill:,} batches, from the commit records"
    elif prefill:
        line = (f"rounds: windows ({verify:,} verify windows and {prefill:,} prefill batches, from the commit "
                f"records")
    else:
        line = f"rounds: verify windows ({windows:,} windows, from the commit records"
    if outside:
        line += f"; {outside:,} records outside every window count one round per position"
    return line + ")"


# -- make-profile ---------------------------------------------------------------------------------------------------

_WEIGHT_SUFFIX = re.compile(r"^(?P<path>.+):(?P<w>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")


def parse_trace_args(args: List[str], weights: Optional[List[float]]) -> tuple[list[str], list[float]]:
    """``TRACE`` or ``TRACE:WEIGHT`` arguments plus optional ``--weight`` values -> (paths, weights).

    A ``:WEIGHT`` suffix is taken only when the full argument is not an existing file. ``--weight`` gives one
    weight per trace, in order, and cannot be combined with suffixes.

    Raises:
        StrataError: a count mismatch, both forms at once, a negative weight.
    """
    paths: list[str] = []
    suffix_w: list[float | None] = []
    for a in args:
        m = _WEIGHT_SUFFIX.match(a)
        if m and not Path(a).exists():
            paths.append(m.group("path"))
            suffix_w.append(float(m.group("w")))
        else:
            paths.append(a)
            suffix_w.append(None)
    if weights:
        if any(w is not None for w in suffix_w):
            raise StrataError("give trace weights either as TRACE:W or with --weight, not both")
        if len(weights) != len(paths):
            raise StrataError(f"{len(weights)} --weight values for {len(paths)} traces (give one per trace)")
        ws = [float(w) for w in weights]
    else:
        ws = [1.0 if w is None else w for w in suffix_w]
    for p, w in zip(paths, ws):
        if not math.isfinite(w) or w < 0:
            raise StrataError(f"{p}: trace weight {w} must be a finite number >= 0")
    return paths, ws


def pack_geometry(pack_dir: Path) -> tuple[int, int]:
    """(trunk layers, n_expert) of a native pack directory.

    Uses ``stratatools.pack.native.read_pack`` when that module exists; otherwise parses ``native_experts.txt``
    minimally: E from ``(n_expert <E>`` in a comment line (as Strata's ``expert_layout_load``), layers = the
    number of table lines (docs/formats.md, 'The native pack').

    Raises:
        StrataError: no table, no ``n_expert``, no layer lines.
    """
    try:  # the pack module is a colleague's; use it when present
        from stratatools.pack.native import read_pack  # type: ignore[attr-defined]

        pk = read_pack(pack_dir)
        e = getattr(pk, "n_expert", None)
        nl = getattr(pk, "n_layers", None)
        if nl is None and getattr(pk, "layers", None) is not None:
            nl = len(pk.layers)
        if e is not None and nl is not None:
            return int(nl), int(e)
    except ImportError:
        pass
    from stratatools.core.fsutil import check_input

    table = check_input(pack_dir / "native_experts.txt" if pack_dir.is_dir() else pack_dir, "pack table")
    try:
        text = table.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StrataError(f"{table}: no such file (is {pack_dir} a native pack directory?)", table) from None
    except UnicodeDecodeError:
        raise StrataError(f"{table}: not UTF-8 text", table) from None
    e = None
    layers = 0
    for ln, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            m = re.search(r"\(n_expert\s+(\d+)", s)
            if m:
                e = int(m.group(1))
            continue
        first = s.split()[0]
        if not first.isdigit() or int(first) != layers:
            raise StrataError(f"{table}: line {ln}: expected layer {layers} first, found {first!r}", table)
        layers += 1
    if e is None:
        raise StrataError(f"{table}: no '(n_expert <E>' in its header comment; pass --n-layer and --n-expert", table)
    if layers == 0:
        raise StrataError(f"{table}: no layer lines", table)
    return layers, e


def _make_profile(
    traces: List[str] = typer.Argument(..., help="Trace files, folders, globs or Parquet datasets, each optionally "
                                                 "TRACE:WEIGHT (the weight applies to every file it names)."),
    out: Path = typer.Option(..., "-o", "--output", help="Output STRP profile (a .json provenance sidecar is "
                                                          "written beside it).",
                             parser=common.out_file("--output", "profile.bin")),
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF model (any shard): geometry from its routers."),
    pack: Optional[Path] = typer.Option(None, "--pack", help="Native pack directory: geometry from its table."),
    n_layer: Optional[int] = typer.Option(None, "--n-layer", callback=common.int_range(1, common.MAX_LAYERS), help="Trunk layers (with --n-expert)."),
    n_expert: Optional[int] = typer.Option(None, "--n-expert", callback=common.int_range(1, common.MAX_EXPERTS), help="Experts per layer (with --n-layer)."),
    base: Optional[Path] = typer.Option(None, "--base", help="Base profile to merge (modes default, reorder)."),
    mode: str = typer.Option("default", "--mode", help="default (base, traces, fill), reorder (traces, base, "
                                                       "fill) or no-base (traces, fill)."),
    fill: str = typer.Option("expert-major", "--fill", help="expert-major (Strata) or layer-major."),
    phase: str = typer.Option("all", "--phase", help="all (Strata) or decode (drop prefill entries)."),
    weighting: str = typer.Option("count", "--weighting", help="count (Strata) or weight (router weights)."),
    weight: Optional[List[float]] = typer.Option(None, "--weight", callback=common.float_range(0.0, 1e12), help="Per-trace weight, once per trace in "
                                                                        "order (or use TRACE:W)."),
    from_: Optional[str] = typer.Option(None, "--from", help="Trace format; default: sniffed per file."),
    where: Optional[List[str]] = _WHERE,
    cluster: Optional[str] = _CLUSTER,
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    json_: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Build a STRP expert profile from routing traces, ranked exactly as Strata's make_profile (defaults)."""
    from stratatools.profiles.ranking import make_profile_files

    given = [x is not None for x in (model, pack)] + [n_layer is not None or n_expert is not None]
    if sum(given) != 1:
        raise StrataError("give the model geometry once: --model M, --pack DIR, or --n-layer L --n-expert E")
    model_info = None
    extra_inputs: list[str] = []
    if model is not None:
        from stratatools.model.geometry import read_geometry
        from stratatools.model.gguf import open_model

        with open_model(model) as m:
            g = read_geometry(m)
            L, E = g.n_trunk, g.n_expert
            from stratatools.core.provenance import describe_shards

            model_info = {"name": model.name, "path": str(model), "size_bytes": m.total_bytes,
                          "n_mtp": g.n_mtp, "expert_count_kv": g.expert_count_kv,
                          "shards": describe_shards([f.path for f in m.files])}
            extra_inputs = [str(f.path) for f in m.files] if all(hasattr(f, "path") for f in m.files) else [str(model)]
    elif pack is not None:
        L, E = pack_geometry(pack)
        model_info = {"pack": str(pack)}
        extra_inputs = [str(pack / "native_experts.txt")] if pack.is_dir() else [str(pack)]
    else:
        if n_layer is None or n_expert is None:
            raise StrataError("--n-layer and --n-expert go together")
        L, E = n_layer, n_expert
    paths, ws = parse_trace_args(traces, weight)
    from stratatools.core.cluster import open_cluster

    with open_cluster(cluster) as client, common.progress_bar("counting traces", None, bytes_=False) as bar:
        res = make_profile_files(paths, str(out), L, E, weights=ws, base=str(base) if base else None, mode=mode,
                                 fill=fill, phase=phase, weighting=weighting, fmt=from_, force=force,
                                 model_info=model_info, extra_inputs=extra_inputs,
                                 progress=lambda i, n: bar.update(completed=i, total=n), where=where,
                                 client=client)
    for w in res.warnings:
        common.warn(w)
    if json_:
        common.emit_json(res.to_dict())
        return
    c = common.console
    c.print(f"wrote {res.output}: {res.n_layers * res.n_expert:,} ranked pairs ({res.from_base:,} from the base, "
            f"{res.from_traces:,} from the traces, {res.from_fill:,} filled in {res.fill}); "
            f"{res.n_layers} layers x {res.n_expert} experts, mode {res.mode}", markup=False, soft_wrap=True)
    c.print(f"counted {res.used_entries:,} routed entries ({res.traced_pairs:,} distinct pairs); left out: "
            f"{res.skipped_layer:,} of layers >= {res.n_layers}, {res.skipped_phase:,} prefill", markup=False, soft_wrap=True)
    tbl = Table("trace", "format", "weight", "entries", "used", "sha256")
    for d in res.inputs:
        tbl.add_row(d["path"], str(d["format"]), f"{d['weight']:g}", f"{d['entries']:,}", f"{d['used']:,}",
                    str(d["sha256"])[:16])
    c.print(tbl)
    c.print(f"provenance: {res.sidecar}", markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``trace convert``, ``trace stats`` and ``make-profile`` to ``app``."""
    trace_app.command("convert")(_convert)
    trace_app.command("stats")(_stats)
    app.add_typer(trace_app, name="trace")
    app.command("make-profile")(_make_profile)
