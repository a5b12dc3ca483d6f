"""CLI commands: ``simulate`` (report folder with markdown, JSON, plots) and ``compare`` (profiles side by side).

Both parse options, call :func:`stratatools.cachesim.study.run_study`, and render. See
:mod:`stratatools.cachesim` for the model and :mod:`stratatools.cachesim.report` for the outputs.
"""

from __future__ import annotations


from typing import Any, Optional

import typer
from rich.table import Table

from stratatools.core.errors import StrataError, num_text
from stratatools.cli import common

POLICY_HELP = ("Policy, repeatable or comma-separated (each once): static, adaptive, lru, lfu, lfru, "
               "belady.")


def _policy_list(values: list[str] | None, known) -> list[str]:
    """The ``--policy`` values (repeatable, comma-separated) in the order given, each once (a repeat is dropped);
    [] when the option is not given (the command's default).

    Raises:
        StrataError: an empty value (``--policy ""``, ``static,,lru``) or an unknown policy."""
    out: list[str] = []
    for v in values or []:
        for x in v.split(","):
            x = x.strip()
            if not x:
                raise StrataError(f"--policy {v!r}: an empty policy name (use one or more of {', '.join(known)}, "
                                  f"comma-separated; leave --policy out for the default)")
            if x not in known:
                raise StrataError(f"--policy {x!r}: unknown (use {', '.join(known)})")
            if x not in out:
                out.append(x)
    return out


def _parse_sets(sets: list[str] | None) -> dict[str, dict[str, Any]]:
    """``--set adaptive.adapt_every=2`` -> {"adaptive": {"adapt_every": 2}} (ints, then floats).

    Raises StrataError for a malformed item, a non-finite value, or a policy/parameter that does not exist
    (the parameter tables of :mod:`stratatools.cachesim.tiers`).
    """
    from stratatools.cachesim.tiers import ADAPTIVE_DEFAULTS, LFRU_DEFAULTS, LFU_DEFAULTS, POLICIES

    params = {"adaptive": ADAPTIVE_DEFAULTS, "lfu": LFU_DEFAULTS, "lfru": LFRU_DEFAULTS}
    known = {p: list(params.get(p, {})) for p in POLICIES}
    out: dict[str, dict[str, Any]] = {}
    for s in sets or []:
        if "=" not in s or "." not in s.split("=", 1)[0]:
            raise StrataError(f"--set {s!r}: expected POLICY.KEY=VALUE, e.g. adaptive.adapt_every=2")
        k, v = s.split("=", 1)
        pol, key = k.split(".", 1)
        try:
            val: Any = int(v)
        except ValueError:
            try:
                val = float(v)
            except ValueError:
                raise StrataError(f"--set {s!r}: value {v!r} is not a number") from None
        if val != val or val in (float("inf"), float("-inf")):
            raise StrataError(f"--set {s!r}: value {v!r} is not a finite number")
        if pol not in known:
            raise StrataError(f"--set {s!r}: unknown policy {pol!r} (use {', '.join(known)})")
        if key not in known[pol]:
            have = ", ".join(known[pol]) if known[pol] else "none"
            raise StrataError(f"--set {s!r}: {pol} has no parameter {key!r} (its parameters: {have})")
        out.setdefault(pol, {})[key] = val
    return out


def adaptive_params(every: Optional[int] = None, swaps: Optional[int] = None, decay: Optional[float] = None,
                    lag: Optional[int] = None, pace_bytes: Optional[int] = None, upper_slots: Optional[int] = None,
                    disjoint: bool = False, version: str = "0.2", sets: dict[str, Any] | None = None) -> dict[str, Any]:
    """The adaptive tier's parameters from the engine's own option names (``--adapt-every``, ``--adapt-swaps``,
    ``--adapt-decay``, ``STRATA_ADAPT_LAG`` as ``--adapt-lag``, the paced budget, the upper tier,
    ``STRATA_DISJOINT_ADAPT`` as ``--disjoint-adapt``), merged with ``--set adaptive.KEY=V`` items (``sets``).

    ``version`` ``0.1`` refuses the 0.2.x knobs (lag, paced mode, upper tier, disjoint): Strata 0.1.4x has none of
    them; the defaults of the knobs both versions share are the same (4, 96, 0.7). Raises StrataError for an
    unknown version, a knob given twice, or a 0.2 knob under 0.1.
    """
    from stratatools.cachesim.tiers import ADAPTIVE_DEFAULTS, STRATA_VERSIONS, V02_PARAMS

    if version not in STRATA_VERSIONS:
        raise StrataError(f"--strata-version {version!r}: use {' or '.join(STRATA_VERSIONS)}")
    given = {"adapt_every": every, "max_moves": swaps, "decay": decay, "lag": lag, "pace_bytes": pace_bytes,
             "upper_slots": upper_slots, "disjoint": 1 if disjoint else None}
    names = {"adapt_every": "--adapt-every", "max_moves": "--adapt-swaps", "decay": "--adapt-decay",
             "lag": "--adapt-lag", "pace_bytes": "--adapt-pace-bytes", "upper_slots": "--upper-slots",
             "disjoint": "--disjoint-adapt"}
    out = dict(sets or {})
    for k, v in given.items():
        if v is None:
            continue
        if k in out:
            raise StrataError(f"{names[k]} and --set adaptive.{k} both given; keep one")
        out[k] = v
    if version == "0.1":
        for k in V02_PARAMS:
            if k in out and out[k] != ADAPTIVE_DEFAULTS[k]:
                raise StrataError(f"{names[k]} (adaptive.{k}) is a Strata 0.2.x behaviour; drop it or use "
                                  f"--strata-version 0.2")
    return out


def _budget(slots: Optional[int], budget_gib: Optional[float]) -> tuple[Optional[int], Optional[int]]:
    if slots is None and budget_gib is None:
        raise StrataError("no budget: give --slots N or --budget-gib X")
    if slots is not None and budget_gib is not None:
        raise StrataError(f"--slots {slots} and --budget-gib {num_text(budget_gib)} both size the tier: give --slots N or "
                          f"--budget-gib X, not both")
    if slots is not None and slots < 0:
        raise StrataError(f"--slots {slots}: must be >= 0")
    if budget_gib is not None and not (0 < budget_gib < float("inf")):
        raise StrataError(f"--budget-gib {budget_gib}: must be a finite number > 0")
    return slots, (None if budget_gib is None else int(budget_gib * 2**30))


def _inputs(traces: list[str], profiles: Optional[list[str]]) -> list[str]:
    """The input files of a study: every file the trace arguments name (files, folders, globs) and the
    profiles; the paths as given when a trace argument does not expand (its reader reports that)."""
    from stratatools.traces.sources import expand_traces

    out: list[str] = [str(t) for t in traces]
    try:
        out += [str(f) for f, _ in expand_traces([str(t) for t in traces])]
    except StrataError:
        pass
    return out + [str(p) for p in (profiles or [])]


def _check_report(report: str, inputs: list[str], force: bool, traces: Optional[list[str]] = None) -> None:
    """Refuse, before any work, a --report folder that would take an input's place or hold one (even with
    --force), that already holds a report (without --force), or that is an existing folder of other files and
    no report (without --force: it is not a report folder; with --force the report is added beside them).

    The folder-output rule (README, "Files"): a report folder is built beside the target; a new folder or a
    previous report is swapped in whole, a folder of other entries gets the report's files one by one and keeps
    the rest untouched (:func:`stratatools.core.fsutil.publish_dir`); an input is never replaced, moved or
    deleted. A report file name taken by a folder is refused even with --force; leftovers of a killed run are
    cleaned first (:func:`stratatools.core.fsutil.tidy_output`)."""
    from pathlib import Path

    from stratatools.cachesim.report import FILES

    if not report.strip():  # (Path("") is the current folder)
        raise StrataError(f"--report {report!r}: the path is empty; give a folder, e.g. --report sim-report")
    if report == "-":  # (Path would make a folder named "-")
        raise StrataError("--report -: a report folder (report.md, report.json, ...) is not written to stdout; give "
                          "a folder, e.g. --report sim-report (add --json for the numbers on stdout)")
    d = common.folder_place("--report", report, "sim-report")  # the root, a mount point, '..', under a file
    rd = d.resolve()
    given = list(inputs) + (_inputs(traces, None) if traces else [])
    ins = {Path(p).resolve(): p for p in given}
    if rd in ins:
        raise StrataError(f"{report}: the report folder would overwrite the input {ins[rd]}")
    for f in FILES:
        if (d / f).resolve() in ins:
            raise StrataError(f"{d / f}: is an input; the report would overwrite it (choose another --report)")
    for r, p in ins.items():
        if rd in r.parents:  # an input inside the folder: a report is never written among its inputs, even with --force
            raise StrataError(f"{report}: holds the input {p}; a report is not written among its own inputs, so "
                              f"write it elsewhere (choose another --report folder)")
    if d.exists() and not d.is_dir():
        raise StrataError(f"{report}: exists and is not a folder; choose another --report folder")
    from stratatools.core.fsutil import check_own_entries, refuse_foreign_folder, tidy_output

    # what a killed run left beside it (its temp folder, the lock file, aside folders: write_report's keep)
    tidy_output(d, keep=lambda n: n not in FILES)
    check_own_entries(d, lambda n: n not in FILES)  # a report name taken by a folder: --force cannot help
    if not force:
        for f in FILES:
            if (d / f).exists():
                raise StrataError(f"{d / f}: already exists (pass --force to replace the report)")
        refuse_foreign_folder(d, lambda n: not n.startswith("."), "report", "--report")


def run(traces: list[str], profiles: list[str], *, pack: Optional[str], model: Optional[str],
        slots: Optional[int], budget_gib: Optional[float], policies: list[str], admission: str,
        kfold: Optional[int], phase: str, host_gbps: float, pcie_gbps: float, vram_gbps: float,
        sets: list[str], sweep: bool, adaptive: dict[str, Any] | None = None, ssd_gbps: float = 6.0,
        ram_experts_gb: float | None = None, where: list[str] | None = None, cluster: str | None = None,
        cold: bool = False):
    """Library entry of both commands: read inputs, run the study. Returns (Study, StudyInputs).

    ``where``: partition / column filters of the traces (``--where``); ``cluster``: a Dask cluster spec
    (:mod:`stratatools.core.cluster`), None for the in-process path.

    ``adaptive``: the engine-named adaptive options (:func:`adaptive_params` keyword arguments); ``ssd_gbps`` and
    ``ram_experts_gb`` complete the three-tier cost model (:mod:`stratatools.cachesim.costmodel`), applied when
    blob sizes are known (--pack/--model). ``cold``: drop the prefill (``--cold``, with ``phase`` decode). Traces that route more layers
    than the model has (trunk plus MTP blocks) are refused (another model's)."""
    from stratatools.cachesim.replay import BandwidthModel
    from stratatools.cachesim.study import DEFAULT_POLICIES, load_inputs, run_study, study_steps

    s, b = _budget(slots, budget_gib)
    pols = _policy_list(policies, DEFAULT_POLICIES) or list(DEFAULT_POLICIES)
    if not all(0 < x < float("inf") for x in (host_gbps, pcie_gbps, vram_gbps)):
        raise StrataError("bandwidths (--host-gbps, --pcie-gbps, --vram-gbps) must be finite numbers > 0")
    if kfold is not None and kfold < 2:
        raise StrataError(f"--kfold {kfold}: need at least 2 folds (or leave --kfold out)")
    if admission not in ("global", "per-layer"):
        raise StrataError(f"--admission {admission!r}: unknown (use global or per-layer)")
    pp = _parse_sets(sets)
    ad = adaptive_params(sets=pp.get("adaptive"), **(adaptive or {}))
    if ad:
        pp["adaptive"] = ad
    from stratatools.cachesim.costmodel import ThreeTierModel

    if ram_experts_gb is not None and not (0 <= ram_experts_gb < float("inf")):
        raise StrataError(f"--ram-experts-gib {ram_experts_gb}: must be a finite number >= 0")
    cost = ThreeTierModel(vram_gbps, pcie_gbps, host_gbps, ssd_gbps,
                          None if ram_experts_gb is None else int(ram_experts_gb * 2**30))
    if phase not in ("decode", "all"):
        raise StrataError(f"--phase {phase!r}: unknown (use decode or all)")
    if cold and phase != "decode":
        raise StrataError("--cold drops the prefill before the decode is counted; it needs --phase decode")
    inp = load_inputs(traces, profiles, pack=pack, model=model, where=where)
    profs = inp.profiles or [None]
    names = inp.names or ["no profile"]
    total = study_steps(len(profs), pols, admission, sweep) + (2 if kfold else 0)
    from stratatools.core.cluster import open_cluster

    with open_cluster(cluster) as client, common.progress_bar("simulating", total, bytes_=False) as bar:
        st = run_study(inp.tables, profs, names, n_layers=inp.n_layers, n_expert=inp.n_expert,
                       trace_names=inp.trace_names, policies=pols, slots=s, budget_bytes=b,
                       blob_bytes=inp.blob_bytes, admission=admission, phase=phase, kfold=kfold,
                       bandwidth=BandwidthModel(host_gbps, pcie_gbps, vram_gbps), sweep=sweep,
                       policy_params=pp, progress=bar, cost=cost if inp.blob_bytes is not None else None,
                       client=client, cold=cold,
                       max_layers=_geometry_layers(inp, profs))
    return st, inp


def _geometry_layers(inp, profs) -> "LayerLimit | None":
    """The layers a trace of the study's model may route: the trunk (of the model, pack or profiles) plus the
    --model's MTP blocks (a :class:`~stratatools.cachesim.replay.LayerLimit` that knows whether --model was read).
    A trace routing more is another model's (refused by the study)."""
    from stratatools.cachesim.replay import LayerLimit

    L = inp.n_layers if inp.n_layers is not None else next((p.n_layers for p in profs if p is not None), None)
    if L is None:
        return None
    model_read = str(getattr(inp, "blob_source", None) or "").startswith("model ")
    return LayerLimit(int(L) + int(getattr(inp, "n_mtp", 0) or 0), model_read)


def _table(st) -> Table:
    from stratatools.cachesim.report import _pct, moved_text, ms_text, result_rows

    t = Table(title=f"{st.entries} entries, {st.tokens} tokens; admission {st.admission}")
    tiers = getattr(st, "cost_model", None) is not None
    cols = ("profile / split", "policy", "slots", "h_expert", "h_layer", "h_bytes", "moved", "ms/token")
    for c in cols + (("RAM / SSD", "tok/s (model)") if tiers else ()):
        t.add_column(c, justify="left" if c in ("profile / split", "policy") else "right", no_wrap=True)
    for r, res in zip(result_rows(st), st.results):
        row = [r["label"], r["policy"], str(r["slots"]), _pct(r["h_expert"]), _pct(r["h_layer"]),
               _pct(r["h_bytes"]), moved_text(r), ms_text(r)]
        if tiers:
            tc = res.tiers
            row += ([f"{_pct(tc['h_ram'])} / {_pct(tc['h_ssd'])}", f"{tc['tok_s']:.1f}"] if tc else ["-", "-"])
        t.add_row(*row)
    return t


def _print_table(t: Table) -> None:
    """Print a table whole. In a pipe or file rich assumes 80 columns and would cut profile names and numbers
    ("profil…"); there the table gets its natural width instead. On a terminal rich fits the window."""
    from rich.measure import Measurement

    con = common.console
    if con.is_terminal:
        con.print(t)
        return
    from rich.console import Console

    need = Measurement.get(con, con.options.update_width(10_000), t).maximum
    Console(file=con.file, width=max(con.width, need), highlight=False, markup=False, emoji=False,
            color_system=None).print(t)


def _print_skipped(st) -> None:
    """Say on the console what the replay left out (MTP-block entries, --cold's prefill, out-of-range experts);
    nothing when every entry was replayed."""
    warn_skipped(getattr(st, "skipped", None), st.n_layers, st.n_expert)


def warn_skipped(skipped: dict[str, int] | None, n_layers: int, n_expert: int) -> None:
    """Warn (stderr) ``left out of the replay: ...`` for the nonzero counts of ``skipped`` (``layer``: entries of
    layers >= ``n_layers``, the model's MTP blocks; ``expert``; ``prefill``: --cold); simulate, compare and tune."""
    sk = {k: int(v) for k, v in (skipped or {}).items() if v}
    if not sk:
        return
    parts = []
    if sk.get("layer"):
        parts.append(f"{sk['layer']:,} entries of layers >= {n_layers} (the model's MTP blocks)")
    if sk.get("expert"):
        parts.append(f"{sk['expert']:,} entries of experts >= {n_expert}")
    if sk.get("prefill"):
        parts.append(f"{sk['prefill']:,} prefill entries (--cold)")
    common.warn("left out of the replay: " + "; ".join(parts))


def _print_rounds(st) -> None:
    """Say what a replay round was (verify windows when the traces carry commit records)."""
    if not st.results:
        return
    r = st.results[0]
    by = getattr(r, "rounds_by", "positions")
    if by == "windows":
        line = f"rounds: {r.rounds} verify windows or prefill batches (from the traces' commit records)"
    elif by == "windows+positions":
        line = (f"rounds: {r.rounds} (verify windows or prefill batches, plus one per position outside every "
                f"window)")
    elif by.endswith("batches"):
        line = (f"rounds: {r.rounds} (each layer-major batch, e.g. one prompt's captured ubatch, is one round"
                + (", as are verify windows)" if by.startswith("windows") else ")"))
    else:
        line = f"rounds: {r.rounds} positions (no windows among the replayed entries)"
    if getattr(r, "warmup", 0):
        line += f"; {r.warmup} prefill entries replayed to warm the cache, not counted (--cold drops them)"
    common.console.print(line, markup=False, soft_wrap=True)


_TRACES = typer.Option(..., "--traces", "-t", help="Routing trace: a file (any supported format), a folder, a glob "
                                                    "or a Parquet dataset; repeatable.")
_WHERE = typer.Option(None, "--where", help="KEY=VALUE: keep partitions (key=value folders) or Parquet rows with "
                                            "this value; repeatable.")
_CLUSTER = typer.Option(None, "--cluster", help=common.CLUSTER_HELP)
_PROFILE = typer.Option(None, "--profile", "-p", help="STRP profile; repeatable.")
_PACK = typer.Option(None, "--pack", help="Native pack folder (blob sizes per layer).")
_MODEL = typer.Option(None, "--model", "-m", help="Model GGUF (blob sizes per layer).")
_GBPS = common.float_range(0.0, common.MAX_GBPS, lo_open=True)
_BUDGET_GIB = common.float_range(0.0, common.MAX_GIB, lo_open=True)
_SLOTS = typer.Option(None, "--slots", callback=common.int_range(0, common.MAX_SLOTS), help="Slot count budget.")
_HOST_GBPS = typer.Option(60.0, "--host-gbps", "--ram-gbps", callback=_GBPS, help="Host-memory (RAM) bandwidth, GB/s.")
_SSD_GBPS = typer.Option(6.0, "--ssd-gbps", callback=_GBPS, help="SSD read bandwidth, GB/s (three-tier cost model).")
_RAM_EXPERTS = typer.Option(None, "--ram-experts-gib", "--ram-experts-gb", callback=common.float_range(0.0, common.MAX_GIB),
                            help="RAM tier size in GiB, the rest on SSD (three-tier cost model; default: all in RAM). "
                                 "(--ram-experts-gb: the same, in GiB too.)")
_PCIE_GBPS = typer.Option(25.0, "--pcie-gbps", callback=_GBPS, help="PCIe host->VRAM bandwidth, GB/s.")
_VRAM_GBPS = typer.Option(900.0, "--vram-gbps", callback=_GBPS, help="VRAM bandwidth, GB/s.")
_SETS = typer.Option(None, "--set", help="Policy parameter POLICY.KEY=VALUE, repeatable.")
_FORCE = typer.Option(False, "--force", help="Replace an existing report.")
_ADAPT_EVERY = typer.Option(None, "--adapt-every", callback=common.int_range(1, common.MAX_COUNT), help="Adaptive tier: adapt every N rounds (engine default 4).")
_ADAPT_SWAPS = typer.Option(None, "--adapt-swaps", callback=common.int_range(0, common.MAX_COUNT), help="Adaptive tier: at most N moves per step (engine default 96).")
_ADAPT_DECAY = typer.Option(None, "--adapt-decay", callback=common.float_range(0.0, 1.0), help="Adaptive tier: usage decay per step (engine default 0.7).")
_ADAPT_LAG = typer.Option(None, "--adapt-lag", callback=common.int_range(1, common.MAX_COUNT), help="STRATA_ADAPT_LAG (0.2.x): 1 (default); 2 = swaps from windows >= 2 old.")
_ADAPT_PACE = typer.Option(None, "--adapt-pace-bytes", callback=common.int_range(0, common.MAX_BYTES), help="Paced mode (0.2.x): copy bytes per round; 0 = off.")
_UPPER_SLOTS = typer.Option(None, "--upper-slots", callback=common.int_range(0, common.MAX_SLOTS), help="Upper tier (0.2.x): slots on a second GPU; 0 = none.")
_DISJOINT = typer.Option(False, "--disjoint-adapt", help="STRATA_DISJOINT_ADAPT=1 (0.2.x): the two tiers hold disjoint sets.")
_VERSION = typer.Option("0.2", "--strata-version", help="Engine version modelled: 0.2 (default) or 0.1 (refuses 0.2.x knobs).")


def _adaptive(every, swaps, decay, lag, pace, upper, disjoint, version) -> dict[str, Any]:
    return {"every": every, "swaps": swaps, "decay": decay, "lag": lag, "pace_bytes": pace, "upper_slots": upper,
            "disjoint": disjoint, "version": version}


def register(app: typer.Typer) -> None:
    """Add ``simulate`` and ``compare`` to ``app``."""

    @app.command("simulate")
    def simulate_cmd(
        traces: list[str] = _TRACES,
        profile: Optional[list[str]] = _PROFILE,
        pack: Optional[str] = _PACK,
        model: Optional[str] = _MODEL,
        slots: Optional[int] = _SLOTS,
        budget_gib: Optional[float] = typer.Option(None, "--budget-gib", callback=_BUDGET_GIB,
                                                   help="Byte budget in GiB (needs --pack/--model)."),
        policy: Optional[list[str]] = typer.Option(None, "--policy", help=POLICY_HELP),
        admission: str = typer.Option("global", "--admission", help="global (engine default) or per-layer."),
        kfold: Optional[int] = typer.Option(None, "--kfold", callback=common.int_range(2, common.MAX_COUNT), help="Held-out k-fold by request."),
        phase: str = typer.Option("decode", "--phase", help="decode (replay everything, count the decode) or "
                                  "all (count everything)."),
        cold: bool = typer.Option(False, "--cold", help="With --phase decode: drop the prefill, so the decode "
                                  "starts on the start-up fill alone."),
        host_gbps: float = _HOST_GBPS,
        pcie_gbps: float = _PCIE_GBPS,
        vram_gbps: float = _VRAM_GBPS,
        ssd_gbps: float = _SSD_GBPS,
        ram_experts_gb: Optional[float] = _RAM_EXPERTS,
        sets: Optional[list[str]] = _SETS,
        adapt_every: Optional[int] = _ADAPT_EVERY,
        adapt_swaps: Optional[int] = _ADAPT_SWAPS,
        adapt_decay: Optional[float] = _ADAPT_DECAY,
        adapt_lag: Optional[int] = _ADAPT_LAG,
        adapt_pace_bytes: Optional[int] = _ADAPT_PACE,
        upper_slots: Optional[int] = _UPPER_SLOTS,
        disjoint_adapt: bool = _DISJOINT,
        strata_version: str = _VERSION,
        no_sweep: bool = typer.Option(False, "--no-sweep", help="Skip the budget sweep (faster)."),
        where: Optional[list[str]] = _WHERE,
        cluster: Optional[str] = _CLUSTER,
        report: Optional[str] = typer.Option(None, "--report", help="Also write a report folder: report.md, "
                                             "report.json and PNG plots."),
        force: bool = _FORCE,
        as_json: bool = typer.Option(False, "--json", help="Print the study as JSON on stdout (report.json's "
                                     "content)."),
    ) -> None:
        """Replay traces through Strata's VRAM tier and baselines; print the table (or JSON), optionally write
        a report with plots."""
        from stratatools.cachesim.report import study_json, write_report

        if report is not None:
            _check_report(report, list(traces) + list(profile or []), force, traces=list(traces))
        st, _ = run(traces, profile or [], pack=pack, model=model, slots=slots, budget_gib=budget_gib,
                    policies=policy or [], admission=admission, kfold=kfold, phase=phase, host_gbps=host_gbps,
                    pcie_gbps=pcie_gbps, vram_gbps=vram_gbps, sets=sets or [], sweep=not no_sweep,
                    adaptive=_adaptive(adapt_every, adapt_swaps, adapt_decay, adapt_lag, adapt_pace_bytes,
                                       upper_slots, disjoint_adapt, strata_version),
                    ssd_gbps=ssd_gbps, ram_experts_gb=ram_experts_gb, where=where, cluster=cluster,
                    cold=cold)
        paths = write_report(st, report, force=force, inputs=_inputs(traces, profile)) if report is not None else []
        common.write_notes()  # (stderr) what the publish did beside the report folder; --json is report.json's
        _print_skipped(st)  # on stderr, with --json too
        if as_json:
            import sys
            sys.stdout.write(study_json(st))
            return
        _print_table(_table(st))
        _print_rounds(st)
        if st.kfold is not None:
            kf = st.kfold
            for p in kf.policies:
                common.console.print(f"{kf.k}-fold held-out {p}: h_expert {100 * kf.mean[p]:.2f}% "
                                     f"[{100 * kf.low[p]:.2f}%, {100 * kf.high[p]:.2f}%], in-sample "
                                     f"{100 * kf.in_sample[p]:.2f}%")
        if paths:
            common.note(f"wrote {', '.join(str(p) for p in paths)}")

    @app.command("compare")
    def compare_cmd(
        traces: list[str] = _TRACES,
        profile: Optional[list[str]] = _PROFILE,
        pack: Optional[str] = _PACK,
        model: Optional[str] = _MODEL,
        slots: Optional[int] = _SLOTS,
        budget_gib: Optional[float] = typer.Option(None, "--budget-gib", callback=_BUDGET_GIB, help="Byte budget in GiB."),
        policy: Optional[list[str]] = typer.Option(None, "--policy", help=POLICY_HELP + " Default: static,adaptive,belady."),
        admission: str = typer.Option("global", "--admission", help="global or per-layer."),
        phase: str = typer.Option("decode", "--phase", help="decode (replay everything, count the decode) or all."),
        cold: bool = typer.Option(False, "--cold", help="With --phase decode: drop the prefill from the replay."),
        host_gbps: float = _HOST_GBPS,
        pcie_gbps: float = _PCIE_GBPS,
        vram_gbps: float = _VRAM_GBPS,
        ssd_gbps: float = _SSD_GBPS,
        ram_experts_gb: Optional[float] = _RAM_EXPERTS,
        sets: Optional[list[str]] = _SETS,
        adapt_every: Optional[int] = _ADAPT_EVERY,
        adapt_swaps: Optional[int] = _ADAPT_SWAPS,
        adapt_decay: Optional[float] = _ADAPT_DECAY,
        adapt_lag: Optional[int] = _ADAPT_LAG,
        adapt_pace_bytes: Optional[int] = _ADAPT_PACE,
        upper_slots: Optional[int] = _UPPER_SLOTS,
        disjoint_adapt: bool = _DISJOINT,
        strata_version: str = _VERSION,
        where: Optional[list[str]] = _WHERE,
        cluster: Optional[str] = _CLUSTER,
        report: Optional[str] = typer.Option(None, "--report", help="Also write a report folder."),
        force: bool = _FORCE,
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Put several profiles side by side on the same traces and budget."""
        from stratatools.cachesim.report import result_rows, write_report

        if not profile:
            raise StrataError("compare needs at least one --profile")
        if report is not None:
            _check_report(report, list(traces) + list(profile), force, traces=list(traces))
        st, _ = run(traces, profile, pack=pack, model=model, slots=slots, budget_gib=budget_gib,
                    policies=policy or ["static", "adaptive", "belady"], admission=admission, kfold=None,
                    phase=phase, host_gbps=host_gbps, pcie_gbps=pcie_gbps, vram_gbps=vram_gbps, sets=sets or [],
                    sweep=report is not None,
                    adaptive=_adaptive(adapt_every, adapt_swaps, adapt_decay, adapt_lag, adapt_pace_bytes,
                                       upper_slots, disjoint_adapt, strata_version),
                    ssd_gbps=ssd_gbps, ram_experts_gb=ram_experts_gb, where=where, cluster=cluster,
                    cold=cold)
        paths = write_report(st, report, force=force, inputs=_inputs(traces, profile)) if report is not None else []
        notes = common.write_notes()  # (stderr) what the publish did beside the report folder
        _print_skipped(st)  # on stderr, with --json too
        if as_json:
            common.emit_json({"entries": st.entries, "tokens": st.tokens, "budget": st.budget,
                              "admission": st.admission, "profiles": st.profiles, "rows": result_rows(st),
                              "notes": notes})
            return
        _print_table(_table(st))
        _print_rounds(st)
        if paths:
            common.note(f"wrote {', '.join(str(p) for p in paths)}")
