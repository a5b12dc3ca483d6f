"""CLI commands for ISTA ``rco-allocation.txt`` maps: ``alloc show|check|export|verify``.

Each command calls one library function (stratatools.alloc.allocation, .survivors) and renders the result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from stratatools.cli import common

alloc_app = typer.Typer(help="Read, check, export and verify rco-allocation.txt maps.", no_args_is_help=True)


def _summary_table(s: dict, title: str) -> Table:
    t = Table(title=title)
    for col in ("layer", "kept", "pruned", "kept originals (first 12)"):
        t.add_column(col, justify="left" if col.startswith("kept orig") else "right")
    return t


@alloc_app.command("show")
def show_cmd(
    alloc: Path = typer.Argument(..., help="rco-allocation.txt"),
    layers: bool = typer.Option(True, "--layers/--no-layers", help="Per-layer table."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout (includes the survivor map)."),
) -> None:
    """Summary of an allocation map: sections, layers, kept counts, types, survivor order."""
    from stratatools.alloc.allocation import read_allocation

    a = read_allocation(alloc)
    s = a.summary()
    if as_json:
        if a.pruned:
            s["survivors"] = {str(i): k.tolist() for i, k in enumerate(a.survivor_map().kept)}
        common.emit_json(s)
        return
    _render_summary(a, s, layers)


def _render_summary(a, s: dict, layers: bool) -> None:
    c = common.console
    c.print(f"{a.path}: {s['title'] or '(no title)'}", markup=False, soft_wrap=True)
    c.print(f"entries {s['n_entries']}: Section 1 {s['n_section1']} tensors, Section 2 {s['n_section2']} per-expert lines",
            markup=False, soft_wrap=True)
    if not a.pruned:
        c.print("no Section 2: the allocation of an unpruned release", markup=False, soft_wrap=True)
    else:
        u = s["uniform_n_kept"]
        kept_txt = f"{u} of {s['n_original']} per layer (uniform)" if u is not None else \
            f"{min(s['n_kept_per_layer'])}..{max(s['n_kept_per_layer'])} of {s['n_original']} per layer (NOT uniform)"
        c.print(f"layers {s['n_layers']}, kept {kept_txt}; total kept {s['total_kept']}, pruned {s['total_pruned']}",
                markup=False, soft_wrap=True)
        c.print("kept types: " + ", ".join(f"{k} {v}" for k, v in s["kept_types"].items()), markup=False, soft_wrap=True)
        c.print(f"survivor numbering: {s['survivor_order']}", markup=False, soft_wrap=True)
        if layers:
            t = _summary_table(s, "per layer")
            for i, k in enumerate(a.survivor_map().kept):
                ks = k.tolist()
                t.add_row(str(i), str(len(ks)), str(a.n_original - len(ks)),
                          " ".join(str(x) for x in ks[:12]) + (" ..." if len(ks) > 12 else ""))
            c.print(t)
    for w in s["warnings"]:
        common.warn(f"{a.path}: {w}")


@alloc_app.command("check")
def check_cmd(
    alloc: Path = typer.Argument(..., help="rco-allocation.txt"),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="The GGUF it describes: Section 1 types must "
                                          "equal the tensor types, kept counts the routers' ne1."),
    strict: bool = typer.Option(False, "--strict", help="Fail (exit 1) on warnings too."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout."),
) -> None:
    """Validate an allocation (structure always; against a GGUF with --model). Exit 1 when a check fails."""
    from stratatools.alloc.allocation import check_against_model, read_allocation

    a = read_allocation(alloc)
    s = a.summary()
    mc = check_against_model(a, model) if model is not None else None
    ok = (mc is None or mc.ok) and not (strict and a.warnings)
    if as_json:
        s["model_check"] = mc.to_dict() if mc is not None else None
        s["ok"] = ok
        common.emit_json(s)
    else:
        _render_summary(a, s, layers=False)
        if mc is not None:
            c = common.console
            if mc.ok:
                c.print(f"model {model}: Section 1 types and router expert counts agree", markup=False, soft_wrap=True)
            else:
                t = Table(title=f"disagreements with {model}")
                t.add_column("tensor")
                t.add_column("allocation")
                t.add_column("gguf")
                for name, at, gt in mc.type_mismatches:
                    t.add_row(name, at, gt)
                for name in mc.missing_in_model:
                    t.add_row(name, "listed", "(absent)")
                for name in mc.missing_in_allocation:
                    t.add_row(name, "(absent)", "present")
                c.print(t)
        common.console.print("check: " + ("passed" if ok else "FAILED"), markup=False, soft_wrap=True)
    if not ok:
        raise typer.Exit(1)


@alloc_app.command("export")
def export_cmd(
    alloc: Path = typer.Argument(..., help="rco-allocation.txt"),
    out: Path = typer.Option(..., "--out", "-o", help="Output file (.csv, .parquet or .json).",
                             parser=common.out_file("--out", "alloc.csv")),
    fmt: Optional[str] = typer.Option(None, "--format", "-f", help="csv, parquet or json (default: from the suffix)."),
    what: str = typer.Option("map", "--table", help="map (layer, new_index, original_index, types) or entries "
                                                    "(every Section 2 line)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout (what was written)."),
) -> None:
    """Export the survivor map or the per-expert entries to CSV, Parquet or JSON."""
    from stratatools.alloc.allocation import export_allocation, export_frame, read_allocation
    from stratatools.core.fsutil import guard_output

    guard_output(out, [alloc], force)
    a = read_allocation(alloc)
    written = export_allocation(a, out, fmt, what)
    if as_json:
        common.emit_json({"source": str(alloc), "out": str(written), "table": what,
                          "format": (fmt or written.suffix.lstrip(".")).lower(), "rows": len(export_frame(a, what)),
                          "bytes": written.stat().st_size})
    else:
        common.note(f"wrote {out}")


@alloc_app.command("verify")
def verify_cmd(
    pruned: Path = typer.Option(..., "--pruned", "-p", help="Pruned GGUF (any shard)."),
    full: Optional[Path] = typer.Option(None, "--full", help="The unpruned model (reference)."),
    other: Optional[Path] = typer.Option(None, "--other", help="Another pruned revision (reference)."),
    alloc: Optional[Path] = typer.Option(None, "--alloc", "-a", help="The pruned model's allocation, to compare."),
    other_alloc: Optional[Path] = typer.Option(None, "--other-alloc", help="With --other: the other revision's allocation."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout."),
) -> None:
    """Recover the survivor map from the routers (exact row matches) and compare it with the text.

    Reads only the router tensors. Exit 1 when rows are unmatched/ambiguous or the map disagrees.
    """
    from stratatools.alloc.survivors import verify_survivors

    res = verify_survivors(pruned, full=full, other=other, alloc=alloc, other_alloc=other_alloc)
    if as_json:
        common.emit_json(res.to_dict())
    else:
        c = common.console
        ref = "full model" if res.kind == "full" else "other revision"
        c.print(f"{pruned} vs {ref} {res.reference}: routers {res.router_types[0]}/{res.router_types[1]}", markup=False, soft_wrap=True)
        t = Table(title="router rows matched")
        for col in ("layer", "rows", "matched", "unmatched", "ambiguous", "ascending", "vs allocation"):
            t.add_column(col, justify="right")
        for x in res.layers:
            n = len(x.match)
            dis = x.disagreements()
            vs = "-" if x.expected is None else ("agrees" if not dis else f"{len(dis)} differ (first idx {dis[0]})")
            t.add_row(str(x.layer), str(n), str(int((x.match >= 0).sum())), str(len(x.unmatched)),
                      str(len(x.ambiguous)), "yes" if x.ascending else "NO", vs)
        c.print(t)
        for n in res.notes:
            common.warn(n)
        if res.compared:
            verdict = "the allocation's map equals the routers' map" if res.ok else \
                f"the allocation's map DISAGREES with the routers at {res.n_disagree} indices"
        else:
            verdict = "every router row resolved" if res.ok else \
                f"{res.n_unmatched} unmatched, {res.n_ambiguous} ambiguous router rows"
        c.print(f"verify: {verdict}", markup=False, soft_wrap=True)
    if not res.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the ``alloc`` command group to ``app``."""
    app.add_typer(alloc_app, name="alloc")
