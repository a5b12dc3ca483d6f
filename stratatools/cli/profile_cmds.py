"""CLI commands for expert profiles: ``profile show``, ``remap-profile``, ``profile-diff``.

Each command parses options, calls one library function (stratatools.profiles.strp, .remap, .profile_diff) and
renders its result as a rich table, markdown, or JSON with ``--json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from stratatools.cli import common

profile_app = typer.Typer(help="Inspect STRP expert profiles.", no_args_is_help=True)


def _expect_from(model: Optional[Path], n_layer: Optional[int], n_expert: Optional[int]) -> tuple[int, int] | None:
    from stratatools.core.errors import StrataError

    if model is not None:
        from stratatools.model.geometry import read_geometry
        from stratatools.model.gguf import open_model

        with open_model(model) as m:
            g = read_geometry(m)
            return g.n_trunk, g.n_expert
    if (n_layer is None) != (n_expert is None):
        raise StrataError("--n-layer and --n-expert go together")
    return (n_layer, n_expert) if n_layer is not None else None


@profile_app.command("show")
def show_cmd(
    profile: Path = typer.Argument(..., help="STRP v1 profile (.bin)."),
    top: int = typer.Option(8, "--top", "-k", callback=common.int_range(0, common.MAX_EXPERTS), help="Experts listed per layer, in rank order."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="GGUF the profile is for: dims must match."),
    n_layer: Optional[int] = typer.Option(None, "--n-layer", callback=common.int_range(1, common.MAX_LAYERS), help="Expected layers (without --model)."),
    n_expert: Optional[int] = typer.Option(None, "--n-expert", callback=common.int_range(1, common.MAX_EXPERTS), help="Expected experts per layer (without --model)."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout."),
) -> None:
    """Summary, per-layer counts and top-K per layer of a profile; stricter than the engine's reader."""
    from stratatools.core import provenance
    from stratatools.profiles.strp import read_profile, summarize

    prof = read_profile(profile, expect=_expect_from(model, n_layer, n_expert))
    info = summarize(prof, top=top)
    info["path"] = str(profile)
    info["provenance"] = provenance.read_sidecar(profile)
    if as_json:
        common.emit_json(info)
        return
    for w in prof.warnings:
        common.warn(f"{profile}: {w}")
    c = common.console
    c.print(f"{profile}: STRP v{info['version']}, {info['n_layers']} layers x {info['n_expert']} experts, "
            f"{info['n_ranked']} ranked of {info['n_layers'] * info['n_expert']} pairs "
            f"({'complete' if info['complete'] else 'partial'}), slots {info['slots']}, trailer: {info['trailer']}",
            markup=False, soft_wrap=True)
    prov = info["provenance"]
    if prov:
        alloc = prov.get("allocation") or {}
        c.print(f"provenance: {prov.get('kind')} by {prov.get('tool')} {prov.get('tool_version')}; allocation "
                f"{alloc.get('release') or alloc.get('name') or '-'}", markup=False, soft_wrap=True)
    t = Table(title=f"per layer (top {top} in rank order)")
    for col in ("layer", "ranked", "first rank", f"in first {info['n_layers'] * top}", "top experts"):
        t.add_column(col, justify="right" if col != "top experts" else "left")
    for row in info["layers"]:
        t.add_row(str(row["layer"]), str(row["ranked"]), "-" if row["first_rank"] is None else str(row["first_rank"]),
                  str(row["share_top"]), " ".join(str(x) for x in row["top"]))
    c.print(t)


def remap_cmd(
    profile: Path = typer.Argument(..., help="Profile to remap (STRP v1)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output profile (written atomically, plus <out>.json provenance).",
                             parser=common.out_file("--out", "remapped.bin")),
    alloc: Optional[Path] = typer.Option(None, "--alloc", "-a", help="Allocation of the pruned target: the profile is "
                                          "of the full model (original indices)."),
    from_alloc: Optional[Path] = typer.Option(None, "--from-alloc", help="Allocation the profile was built for."),
    to_alloc: Optional[Path] = typer.Option(None, "--to-alloc", help="Allocation of the revision to remap onto."),
    fill: str = typer.Option("layer-major", "--fill", help="Order for survivors the ranking never named: "
                              "layer-major (as Strata's shipped Coder profile), expert-major (as make_profile), none."),
    slots: Optional[int] = typer.Option(None, "--slots", callback=common.int_range(0, common.MAX_SLOTS), help="Keep only the first N pairs."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Target GGUF: its router geometry must match."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    as_json: bool = typer.Option(False, "--json", help="JSON report on stdout."),
) -> None:
    """Map a profile through original expert indices onto a pruned model or another pruned revision."""
    from stratatools.profiles.remap import remap_profile_files

    res = remap_profile_files(profile, out, alloc=alloc, from_alloc=from_alloc, to_alloc=to_alloc, fill=fill,
                              slots=slots, model=model, force=force)
    if as_json:
        d = res.to_dict()
        d["out"] = str(out)
        common.emit_json(d)
        return
    for n in res.notes:
        common.warn(n)
    tot = res.totals()
    c = common.console
    c.print(f"{out}: {res.profile.n_layers} layers x {res.profile.n_expert} experts, {tot['output']} ranked pairs "
            f"({res.mode}, fill {res.fill}{'' if res.slots is None else f', slots {res.slots}'})", markup=False, soft_wrap=True)
    c.print(f"input {tot['input']}: kept {tot['kept']}, dropped {tot['dropped_pruned']} (pruned) + "
            f"{tot['dropped_repeat']} (repeats); filled {tot['filled']}; cut {tot['cut']}", markup=False, soft_wrap=True)
    if res.same_position is not None:
        c.print(f"{res.same_position} of {tot['input']} input pairs keep their dense index", markup=False, soft_wrap=True)
    t = Table(title="per layer")
    for col in ("layer", "kept", "dropped (pruned)", "dropped (repeat)", "filled", "cut"):
        t.add_column(col, justify="right")
    for i in range(res.profile.n_layers):
        t.add_row(str(i), str(res.kept[i]), str(res.dropped_pruned[i]), str(res.dropped_repeat[i]),
                  str(res.filled[i]), str(res.cut[i]))
    c.print(t)
    common.note(f"provenance: {out}.json")


def diff_cmd(
    profile: Path = typer.Argument(..., help="Profile (built for --old-alloc), or profile A of two."),
    other: Optional[Path] = typer.Argument(None, help="Profile B of the same model (second form)."),
    old_alloc: Optional[Path] = typer.Option(None, "--old-alloc", help="Allocation the profile was built for."),
    new_alloc: Optional[Path] = typer.Option(None, "--new-alloc", help="Allocation of the release it is loaded on."),
    slots_per_layer: Optional[int] = typer.Option(None, "--slots-per-layer", "-k",
                                                   callback=common.int_range(1, common.MAX_EXPERTS),
                                                   help="K for the top-K per layer comparison (default: the 12 GB "
                                                        "card's share of the Coder, 39 of 256)."),
    max_stale: float = typer.Option(0.0, "--max-stale", callback=common.float_range(0.0, 1.0),
                                    help="Largest stale fraction that still passes (exit 1 beyond it)."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout instead of markdown."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the markdown report to FILE.",
                                            parser=common.out_file("--markdown", "diff.md")),
    force: bool = typer.Option(False, "--force", help="Replace an existing --markdown file."),
) -> None:
    """Is a profile stale? Against a re-release (--old-alloc/--new-alloc) or against another profile."""
    from stratatools.core.fsutil import guard_output, write_text_atomic
    from stratatools.profiles.diff import diff_files

    inputs = [p for p in (profile, other, old_alloc, new_alloc) if p is not None]
    if markdown is not None:
        guard_output(markdown, inputs, force)
    res = diff_files(profile, other, old_alloc=old_alloc, new_alloc=new_alloc, slots_per_layer=slots_per_layer,
                     max_stale=max_stale)
    md = res.to_markdown()
    if markdown is not None:
        write_text_atomic(markdown, md)
    if as_json:
        common.emit_json(res.to_dict())
    else:
        common.console.print(md, markup=False, highlight=False, soft_wrap=True, end="")
    if res.exit_code:
        raise typer.Exit(res.exit_code)


def register(app: typer.Typer) -> None:
    """Add ``profile show``, ``remap-profile`` and ``profile-diff`` to ``app``."""
    app.add_typer(profile_app, name="profile")
    app.command("remap-profile")(remap_cmd)
    app.command("profile-diff")(diff_cmd)
