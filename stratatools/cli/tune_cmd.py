"""CLI command ``tune``: search the tier settings for a workload, held out by request (:mod:`stratatools.cachesim.tune`)."""

from __future__ import annotations

import re
from typing import Optional

import typer
from rich.table import Table

from stratatools.core.errors import StrataError, num_text
from stratatools.cli import common

GIB = 1 << 30
_NEEDS_SLOT = ("tune needs at least 1 slot (with no slot nothing is resident, so every setting scores the same and "
               "there is nothing to search)")


# --card's units: GB/MB/TB are SI (10^9 bytes ...), GiB/MiB/TiB and the bare letters G/M/T binary (2^30 ...), as
# GNU coreutils read them; a bare number is GiB
_CARD_UNITS = {"": (GIB, "GiB"), "g": (GIB, "GiB"), "gi": (GIB, "GiB"), "gib": (GIB, "GiB"), "gb": (10**9, "GB"),
               "m": (1 << 20, "MiB"), "mi": (1 << 20, "MiB"), "mib": (1 << 20, "MiB"), "mb": (10**6, "MB"),
               "t": (1 << 40, "TiB"), "ti": (1 << 40, "TiB"), "tib": (1 << 40, "TiB"), "tb": (10**12, "TB")}
_CARD_HELP = ("Card memory: budget = card - --reserve-gib. GB = 10^9 bytes, GiB (or G, or a bare number) = 2^30 "
              "bytes; MB/MiB, TB/TiB alike. A card sold as 12 GB usually has 12 GiB: write 12GiB.")


def parse_card(text: str) -> tuple[int, str]:
    """``--card``: ``12GiB``, ``16G``, ``12`` (GiB), ``0.5GB`` (SI: 0.5 x 10^9 bytes), ``512MiB``, ``1TB`` ->
    (bytes, the size as given with its unit spelled out, e.g. ``"0.5 GB"``). The bytes are exact (decimal
    arithmetic on the digits given), rounded down to a whole byte.

    Raises StrataError for anything else (no number, a number <= 0, an unknown unit, over
    :data:`stratatools.cli.common.MAX_GIB`)."""
    from decimal import Decimal

    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = _CARD_UNITS.get(m.group(2).lower()) if m else None
    nbytes = int(Decimal(m.group(1)) * unit[0]) if unit else 0
    if unit is None or nbytes <= 0 or nbytes > common.MAX_GIB * GIB:
        raise StrataError(f"--card {text!r}: expected a memory size such as 12GiB, 16G or 12GB (GB = 10^9 bytes, "
                          f"GiB = 2^30 bytes), more than 0 and at most {common.MAX_GIB:.0f} GiB")
    return nbytes, f"{m.group(1)} {unit[1]}"


def _budget(slots: Optional[int], budget_gib: Optional[float], card: Optional[str],
            reserve_gib: float) -> tuple[Optional[int], Optional[int], str]:
    """The budget tune searches under: (slots, budget bytes, text for the table and JSON). The card's bytes less
    the reserve's (rounded up to a whole byte); values echoed as given (:func:`num_text`)."""
    import math

    given = [x is not None for x in (slots, budget_gib, card)]
    if sum(given) != 1:
        raise StrataError("give exactly one budget: --slots N, --budget-gib X or --card SIZE (e.g. --card 12GiB)")
    if slots is not None:
        if slots < 1:
            # 0 is accepted by run/simulate (the all-miss tier, a measurement); a search over it finds nothing
            raise StrataError(f"--slots {slots}: {_NEEDS_SLOT}; give the card's slot count, --budget-gib X or "
                              f"--card SIZE")
        return slots, None, f"{slots} slots"
    if card is not None:
        size, size_text = parse_card(card)
        if not (0 <= reserve_gib < float("inf")):
            raise StrataError(f"--reserve-gib {reserve_gib}: must be a finite number >= 0")
        reserve = math.ceil(reserve_gib * GIB)
        if size <= reserve:
            raise StrataError(f"--card {card}: {size_text} is {size:,} bytes, "
                              f"{'less than' if size < reserve else 'no more than'} the --reserve-gib "
                              f"{num_text(reserve_gib)} ({reserve:,} bytes): no room for experts; give a larger "
                              f"--card (a card sold as 12 GB usually has 12 GiB: write 12GiB) or a smaller "
                              f"--reserve-gib")
        return None, size - reserve, (f"card {size_text} - reserve {num_text(reserve_gib)} GiB = "
                                      f"{size - reserve:,} bytes for experts")
    assert budget_gib is not None
    if not (0 < budget_gib < float("inf")):
        raise StrataError(f"--budget-gib {budget_gib}: must be a finite number > 0")
    return None, int(budget_gib * GIB), f"{num_text(budget_gib)} GiB"


def _fmt(d: dict, key: str) -> str:
    if key == "h_expert":
        return f"{100 * d['mean']:.2f}% [{100 * d['low']:.2f}, {100 * d['high']:.2f}]"
    return f"{d['mean']:.1f} [{d['low']:.1f}, {d['high']:.1f}]"


def _settings_text(s: dict) -> str:
    return (f"{s['profile']}, {s['admission']}, every {s['adapt_every']}, swaps {s['max_moves']}, "
            f"decay {s['decay']}, lag {s['lag']}, pace {s['pace_slots']}")


def _table(res, budget_text: str) -> Table:
    d = res.to_dict()
    key = res.key
    t = Table(title=f"tune: {res.k}-fold held-out by request ({res.requests} requests), {budget_text}, "
                    f"objective {res.objective}")
    for c in ("setting", "profile, admission, every, swaps, decay, lag, pace", "held-out [95%]", "vs defaults",
              "h_layer", "tok/s (model)"):
        t.add_column(c, justify="left" if c.startswith(("setting", "profile")) else "right")
    rows = [("best", d["best"])]
    for name, row in (("engine defaults", d["engine_defaults"]), ("community", d["community"])):
        rows.append((name, row))
    base = d["engine_defaults"]["mean"]
    for name, row in rows:
        delta = row["mean"] - base
        dtxt = f"{100 * delta:+.2f} pt" if key == "h_expert" else f"{delta:+.1f}"
        t.add_row(name, _settings_text(row["settings"]), _fmt(row, key), dtxt,
                  f"{100 * row['h_layer']:.2f}%" if row.get("h_layer") is not None else "-",
                  f"{row['tok_s']:.1f}" if row.get("tok_s") is not None else "-")
    return t


def _geometry_of(t) -> tuple[int, int]:
    """(layers, experts) a trace names: its metadata's, else its largest layer and expert id + 1 (one pass over a
    chunk source's chunks, nothing kept)."""
    meta = t.meta if isinstance(getattr(t, "meta", None), dict) else {}
    L, E = meta.get("n_layers"), meta.get("n_expert")
    if L and E:
        return int(L), int(E)
    if hasattr(t, "chunks") and not hasattr(t, "layer"):
        lmax = emax = -1
        for c in t.chunks(1 << 20):
            if len(c["layer"]):
                lmax = max(lmax, int(c["layer"].max()))
                emax = max(emax, int(c["expert"].max()))
    else:
        lmax, emax = int(t.layer.max()), int(t.expert.max())
    return int(L or lmax + 1), int(E or emax + 1)


_GBPS = common.float_range(0.0, common.MAX_GBPS, lo_open=True)
_GIB = common.float_range(0.0, common.MAX_GIB)
_GIB_POS = common.float_range(0.0, common.MAX_GIB, lo_open=True)


def register(app: typer.Typer) -> None:
    """Add ``tune`` to ``app``."""

    @app.command("tune")
    def tune_cmd(
        traces: list[str] = typer.Option(..., "--traces", "-t", help="Routing trace of the workload; repeatable."),
        profile: Optional[list[str]] = typer.Option(None, "--profile", "-p", help="STRP profile to consider; repeatable."),
        pack: Optional[str] = typer.Option(None, "--pack", help="Native pack folder (blob sizes per layer)."),
        model: Optional[str] = typer.Option(None, "--model", "-m", help="Model GGUF (blob sizes per layer)."),
        slots: Optional[int] = typer.Option(None, "--slots", callback=common.int_range(1, common.MAX_SLOTS, _NEEDS_SLOT),
                                            help="Slot count budget (at least 1)."),
        budget_gib: Optional[float] = typer.Option(None, "--budget-gib", callback=_GIB_POS,
                                                   help="Byte budget in GiB (needs --pack/--model)."),
        card: Optional[str] = typer.Option(None, "--card", help=_CARD_HELP),
        reserve_gib: float = typer.Option(1.5, "--reserve-gib", callback=_GIB,
                                         help="With --card: GiB kept for dense weights, KV cache, context."),
        objective: str = typer.Option("hit", "--objective", help="hit (held-out h_expert) or tok/s (cost model)."),
        kfold: Optional[int] = typer.Option(None, "--kfold", "-k", callback=common.int_range(2, common.MAX_COUNT),
                                            help="Folds by request (default 5, or the traces' request count when "
                                                 "they hold fewer, with a note; at most the request count)."),
        candidates: int = typer.Option(81, "--candidates", callback=common.int_range(0, common.MAX_COUNT),
                                        help="Settings drawn from the grid (besides the references)."),
        eta: int = typer.Option(3, "--eta", callback=common.int_range(2, common.MAX_COUNT), help="Successive halving: keep 1/eta per rung."),
        seed: int = typer.Option(0, "--seed", callback=common.int_range(0, common.MAX_SEED), help="Seed of the draw."),
        phase: str = typer.Option("decode", "--phase", help="decode (replay the prefill too, score the decode) or all."),
        strata_version: str = typer.Option("0.2", "--strata-version", help="0.2 (lag, paced mode) or 0.1."),
        vram_gbps: float = typer.Option(900.0, "--vram-gbps", callback=_GBPS, help="VRAM bandwidth, GB/s (cost model)."),
        pcie_gbps: float = typer.Option(25.0, "--pcie-gbps", callback=_GBPS, help="PCIe host->VRAM bandwidth, GB/s."),
        ram_gbps: float = typer.Option(60.0, "--ram-gbps", callback=_GBPS, help="Host RAM bandwidth, GB/s."),
        ssd_gbps: float = typer.Option(6.0, "--ssd-gbps", callback=_GBPS, help="SSD read bandwidth, GB/s."),
        ram_experts_gb: Optional[float] = typer.Option(None, "--ram-experts-gib", "--ram-experts-gb", callback=_GIB,
                                                       help="RAM tier size in GiB (the rest on SSD); default: all in "
                                                            "RAM. (--ram-experts-gb: the same, in GiB too.)"),
        dense_gib: float = typer.Option(0.0, "--dense-gib", callback=_GIB, help="Non-expert weights read per token, GiB (cost model)."),
        plot: Optional[str] = typer.Option(None, "--plot", help="Write a PNG of the held-out scores.",
                                            parser=common.out_file("--plot", "tune.png")),
        json_out: Optional[str] = typer.Option(None, "--json-out", help="Write the result as JSON to FILE.",
                                                parser=common.out_file("--json-out", "tune.json")),
        force: bool = typer.Option(False, "--force", help="Replace existing output files."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        cluster: Optional[str] = typer.Option(None, "--cluster", help=common.CLUSTER_HELP[:-len("default: in-process.")]
                                              + "each (settings, fold) score is a task; default: in-process."),
    ) -> None:
        """Search profile, admission and the adaptive knobs for a workload (k-fold by request, successive halving)."""
        from stratatools.cachesim.costmodel import ThreeTierModel
        from stratatools.cachesim.study import load_inputs
        from stratatools.cachesim.tune import plot_tune, tune
        from stratatools.cli.sim_cmds import _geometry_layers, warn_skipped
        from stratatools.core.fsutil import guard_output, write_bytes_atomic, write_json_atomic

        s, b, budget_text = _budget(slots, budget_gib, card, reserve_gib)
        if phase not in ("decode", "all"):
            raise StrataError(f"--phase {phase!r}: use decode or all")
        if seed < 0:
            raise StrataError(f"--seed {seed}: must be an integer >= 0")
        inputs = list(traces) + list(profile or [])
        for out in (plot, json_out):
            if out is not None:
                guard_output(out, inputs, force)
        if ram_experts_gb is not None and not (0 <= ram_experts_gb < float("inf")):
            raise StrataError(f"--ram-experts-gib {ram_experts_gb}: must be a finite number >= 0")
        if not (0 <= dense_gib < float("inf")):
            raise StrataError(f"--dense-gib {dense_gib}: must be a finite number >= 0")
        cost = ThreeTierModel(vram_gbps, pcie_gbps, ram_gbps, ssd_gbps,
                              None if ram_experts_gb is None else int(ram_experts_gb * GIB), int(dense_gib * GIB))
        # in this process the traces are read chunk by chunk (tune's streamed path); Dask tasks carry the folds'
        # entries, so --cluster reads them whole
        inp = load_inputs(traces, profile or [], pack=pack, model=model, whole=cluster is not None)
        if b is not None and inp.blob_bytes is not None:
            from stratatools.cachesim.layout import require_budget_slot

            # a budget below one slot is --slots 0 (refused in _budget); refused here, where the slot size is known
            option = f"--budget-gib {num_text(budget_gib)}" if card is None else \
                f"--card {card} (with --reserve-gib {num_text(reserve_gib)}: {b:,} bytes for experts)"
            fix = "--budget-gib {gib} or more, or --slots N" if card is None else \
                f"a --card at least {{gib}} GiB larger than the --reserve-gib {num_text(reserve_gib)}, a smaller " \
                f"--reserve-gib, or --slots N"
            require_budget_slot(b, inp.blob_bytes, option, _NEEDS_SLOT, fix)
        L, E = inp.n_layers, inp.n_expert
        if L is None:
            if inp.profiles:
                L, E = inp.profiles[0].n_layers, inp.profiles[0].n_expert
            else:
                L, E = _geometry_of(inp.tables[0])
                from stratatools.profiles.strp import MAX_EXPERTS, MAX_LAYERS, MAX_PAIRS
                if not (L <= MAX_LAYERS and E <= MAX_EXPERTS and L * E <= MAX_PAIRS):
                    raise StrataError(f"{traces[0]}: the trace names {L} layers x {E} experts, implausible "
                                      f"(at most {MAX_LAYERS} layers, {MAX_EXPERTS} experts); pass --model/--pack "
                                      f"or a --profile for the geometry", traces[0])
                common.note(f"geometry from the traces: {L} layers x {E} experts (pass --model/--pack or a "
                            f"--profile to set it)")
        total = None
        from stratatools.core.cluster import open_cluster, run_tasks

        with open_cluster(cluster) as client, common.progress_bar("tuning", total, bytes_=False) as bar:
            # each rung's (settings, fold) scores as Dask tasks; tune() passes one argument per task
            mapper = None if client is None else \
                (lambda fn, items: run_tasks(client, fn, [(it,) for it in items], name="tune-score"))
            res = tune(inp.tables, L, E, slots=s, budget_bytes=b, blob_bytes=inp.blob_bytes,
                       profiles=dict(zip(inp.names, inp.profiles)), k=kfold, candidates=candidates, eta=eta,
                       objective=objective, cost=cost if inp.blob_bytes is not None else None, seed=seed,
                       phase=phase, progress=bar, version=strata_version, trace_paths=list(traces),
                       profile_paths=dict(zip(inp.names, profile or [])), mapper=mapper,
                       max_layers=_geometry_layers(inp, inp.profiles or [None]))
        warn_skipped(res.skipped, L, E)  # on stderr, with --json too (as simulate)
        for n in res.notes:
            common.note(n)
        d = res.to_dict()
        d["budget"] = budget_text
        if plot is not None:
            write_bytes_atomic(plot, plot_tune(res))
        if json_out is not None:
            write_json_atomic(json_out, d)
        if as_json:
            common.emit_json(d)
            return
        from stratatools.cli.sim_cmds import _print_table

        _print_table(_table(res, budget_text))
        dd = d["diff_vs_defaults"]
        unit, f = ("pt", 100.0) if res.key == "h_expert" else ("tok/s", 1.0)
        verdict = "significant" if res.significant else "not significant"
        common.console.print(f"best vs engine defaults: {f * dd['mean']:+.2f} {unit} [{f * dd['low']:+.2f}, "
                             f"{f * dd['high']:+.2f}] paired over folds ({verdict}); {res.evaluated} replays, "
                             f"{res.candidates} settings drawn, rungs "
                             + ", ".join(f"{r['settings']}x{r['folds']}" for r in res.rungs),
                             markup=False, soft_wrap=True)
        common.console.print("engine flags:", markup=False)
        for line in res.engine_flags:
            common.console.print("  " + line, markup=False, soft_wrap=True)
        if res.cost_model is not None:
            common.note("tok/s is a model: " + "; ".join(res.cost_model["assumptions"]))
        common.note("the best is chosen on the folds it is scored on (its interval is slightly optimistic); "
                    "the reference rows are not selected")
        for p in (plot, json_out):
            if p is not None:
                common.note(f"wrote {p}")
