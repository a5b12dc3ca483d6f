"""CLI commands on models: ``inspect``, ``pack``, ``synth``. Each parses options, calls one library function and
renders its result (rich tables, or JSON with ``--json``).

The library modules are imported inside the commands: every command's start-up pays only for what it runs
(``synth`` does not load the pack or inspect code, nor the GGUF reader unless it writes pruned revisions)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from stratatools.core.errors import StrataError
from stratatools.cli import common

if TYPE_CHECKING:
    from stratatools.pack.inspect import InspectReport
    from stratatools.pack.native import PackResult
    from stratatools.synth.model import ReleaseInfo

# the routing presets shown in --help (stratatools.synth.routing.PRESETS; kept equal by tests/test_synth_routing.py,
# copied so that building the command line does not import numpy)
DEFAULT_SKEW, DEFAULT_LOCALITY, BURSTY_SKEW, BURSTY_LOCALITY = 2.1, 0.3, 1.0, 0.6


def _gib(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


# ----------------------------------------------------------------------------------------- inspect
def render_inspect(r: InspectReport) -> None:
    """Print an :class:`InspectReport` as rich tables on the shared console (the --json form is ``r.to_dict()``)."""
    from rich.table import Table

    c = common.console
    t = Table(title=f"{Path(r.path).name}", show_header=False, title_justify="left")
    t.add_column("field", style="bold")
    t.add_column("value")
    t.add_row("name", r.name)
    t.add_row("synthetic", "yes (stratatools.synthetic)" if r.synthetic else "no")
    t.add_row("architecture", r.architecture)
    t.add_row("blocks", f"{r.block_count} ({r.n_trunk} trunk, {r.n_mtp} MTP)")
    t.add_row("n_embd", str(r.n_embd))
    t.add_row("experts used (k)", str(r.n_expert_used))
    t.add_row("experts per layer (routers)", str(r.n_expert) if r.n_expert is not None else
              "varies: " + " ".join(str(x.n_expert) for x in r.layers if not x.is_mtp))
    t.add_row("expert_count (metadata)", str(r.expert_count_kv))
    t.add_row("expert width / shared width", f"{r.n_ff} / {r.n_ff_shared}")
    t.add_row("full-attention layers", " ".join(map(str, r.full_attention_layers)) or "-")
    t.add_row("expert bytes (trunk)", f"{r.expert_bytes:,} ({_gib(r.expert_bytes)})")
    t.add_row("tensors / file bytes", f"{r.n_tensors} / {r.total_bytes:,} ({_gib(r.total_bytes)})")
    t.add_row("shards", "\n".join(f"{i + 1}: {s.name} ({_gib(s.size_bytes)}, {s.n_tensors} tensors)"
                                  for i, s in enumerate(r.shards)))
    t.add_row("metadata vs tensors", "consistent" if not r.inconsistency else
              "INCONSISTENT: run, pack and validate-release refuse this file (the error line says why)")
    t.add_row("native pack", "ok" if r.packable else "refused: " + "; ".join(r.problems))
    c.print(t)
    lt = Table(title="routed experts per layer", title_justify="left")
    for col in ("layer", "E", "ff", "router", "gate", "up", "down", "blob bytes", "shards g/u/d"):
        lt.add_column(col, justify="right" if col in ("layer", "E", "ff", "blob bytes") else "left")
    for x in r.layers:
        lt.add_row(f"{x.layer}{' (MTP)' if x.is_mtp else ''}", str(x.n_expert), str(x.n_ff), x.router_type,
                   str(x.gate_type), str(x.up_type), str(x.down_type),
                   f"{x.blob_bytes:,}" if x.blob_bytes is not None else "-",
                   "/".join(str(s) if s else "-" for s in x.shards))
    c.print(lt)


def inspect_cmd(
    model: Path = typer.Argument(..., help="GGUF file or any shard of a -0000N-of-0000M set."),
    json_: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Show a MoE GGUF's geometry: layers, trunk/MTP, experts per layer from the routers, types, blob bytes, shards."""
    from stratatools.pack.inspect import inspect_model

    r = inspect_model(model)
    if json_:
        common.emit_json(r.to_dict())
    else:
        render_inspect(r)
    if r.inconsistency:
        # shown above as far as it could be read; the file is refused as run, pack and validate-release refuse it
        raise StrataError(r.inconsistency)


# -------------------------------------------------------------------------------------------- pack
def render_pack(r: PackResult) -> None:
    """Print a :class:`PackResult`: one row per layer (types, offsets, blob bytes, shard) and the totals."""
    from rich.table import Table

    c = common.console
    t = Table(title=f"native pack {r.packdir}", title_justify="left")
    for col in ("layer", "gu", "down", "offset", "blob bytes", "gate_off", "up_off", "down_off", "shard"):
        t.add_column(col, justify="left" if col in ("gu", "down", "shard") else "right")
    from stratatools.pack.native import _tname
    for ln in r.layers:
        t.add_row(str(ln.layer), _tname(ln.gu_type), _tname(ln.d_type), f"{ln.offset:,}", f"{ln.blob_bytes:,}",
                  str(ln.gate_off), str(ln.up_off), str(ln.down_off), ln.shard_column() or "-")
    c.print(t)
    c.print(f"native_experts.txt v{r.version}: {r.n_layers} layers x {r.n_expert} experts, total {r.total_bytes:,} "
            f"bytes ({_gib(r.total_bytes)}); experts.bin: {r.experts_bin}"
            + (f", {_gib(r.bytes_copied)} in {r.seconds:.2f} s" if r.bytes_copied else ""))
    for n in r.notes:
        c.print(f"note: {n}")


def pack_cmd(
    model: Path = typer.Argument(..., help="GGUF file or any shard of a set."),
    out: Path = typer.Option(..., "-o", "--out", help="Pack folder (native_experts.txt, experts.bin, sidecars).",
                             parser=common.out_folder("-o", "packs/mymodel")),
    experts_bin: bool = typer.Option(False, "--experts-bin", help="Also write experts.bin (reused when it matches)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing pack."),
    no_hash: bool = typer.Option(False, "--no-hash",
                                 help="Do not sha256 the model for the provenance sidecar (saves a full read)."),
    rehash: bool = typer.Option(False, "--rehash",
                                help="Hash the model again even when the digest cache has its sha256."),
    json_: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Write Strata's native pack for a MoE GGUF (docs/formats.md, 'The native pack')."""
    from stratatools.pack.native import pack_model

    with common.progress_bar("packing experts", None) as bar:
        def start(total: int) -> None:
            if total:
                bar.update(total=total)
        r = pack_model(model, out, experts_bin=experts_bin, force=force,
                       progress=lambda n: bar.update(advance=n), on_start=start, hash_inputs=not no_hash,
                       rehash=rehash)
    notes = common.write_notes()  # (stderr) what the publish did beside the pack folder
    if json_:
        common.emit_json({**r.to_dict(), "notes": r.notes + notes})
    else:
        render_pack(r)


# ------------------------------------------------------------------------------------------- synth
def _parse_types(spec: str) -> dict[str, object]:
    """``gu=Q8_0/Q4_0,down=Q2_0,dense=Q8_0,embd=BF16`` -> config fields (``/`` cycles over layers)."""
    keys = {"gu": "gu_types", "down": "down_types", "dense": "dense_type", "embd": "embd_type"}
    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" not in part:
            raise StrataError(f"--types: '{part}' is not role=TYPE (roles: gu, down, dense, embd)")
        k, v = (x.strip() for x in part.split("=", 1))
        if k not in keys or not v:
            raise StrataError(f"--types: unknown role '{k}' (roles: gu, down, dense, embd)")
        if keys[k] in out:
            raise StrataError(f"--types: role '{k}' is given twice ({spec}); give each role once (use "
                              f"{k}=A/B to cycle types over layers)" if k in ("gu", "down") else
                              f"--types: role '{k}' is given twice ({spec}); give each role once")
        vals = tuple(x.strip().upper() for x in v.split("/") if x.strip())
        from stratatools.synth.model import writable_types

        ok = writable_types()
        for x in vals:
            if x not in ok:
                raise StrataError(f"--types {k}={v}: unknown or unwritable type '{x}' (synth writes: {', '.join(ok)})")
        if k not in ("gu", "down") and len(vals) > 1:
            raise StrataError(f"--types {k}={v}: one type for {k} ('/' cycles over layers for gu and down only)")
        out[keys[k]] = vals if k in ("gu", "down") else vals[0]
    return out


def render_synth(r: ReleaseInfo) -> None:
    """Print a synthetic :class:`ReleaseInfo`: the files written per revision, sizes and write speed."""
    from rich.table import Table

    c = common.console
    t = Table(title=f"synthetic release in {r.outdir}", title_justify="left")
    t.add_column("model")
    t.add_column("experts", justify="right")
    t.add_column("files")
    t.add_column("allocation")
    cfg = r.config
    t.add_row("canonical", str(cfg.n_expert), "\n".join(p.name for p in r.canonical_files), "-")
    for name, rev in r.revisions.items():
        t.add_row(name, str(cfg.keep), "\n".join(p.name for p in rev.files), rev.allocation.name)
    c.print(t)
    rt = cfg.routing if cfg.routing == "legacy" else f"{cfg.routing} (skew {cfg.skew:g}, locality {cfg.locality:g})"
    c.print(f"routing: {rt}", markup=False)
    c.print(f"{cfg.n_layers} layers{' + MTP' if cfg.mtp else ''}, hidden {cfg.hidden}, k {cfg.k}, "
            f"{_gib(r.bytes_written)} written in {r.seconds:.2f} s (canonical {r.write_mib_s:.0f} MiB/s); "
            f"manifest {r.manifest.name}")


def synth_cmd(
    outdir: Path = typer.Argument(..., help="Folder for the release.", parser=common.out_folder("OUTDIR", "rel")),
    experts: Optional[int] = typer.Option(None, "--experts", callback=common.int_range(1, 65535), help="Experts per layer in the canonical model [32]."),
    keep: Optional[int] = typer.Option(None, "--keep", callback=common.int_range(1, 65535), help="Survivors per layer in the pruned revisions [16]."),
    swap: Optional[int] = typer.Option(None, "--swap", callback=common.int_range(0, 65535), help="revA survivors replaced in revB, per layer [4]."),
    layers: Optional[int] = typer.Option(None, "--layers", callback=common.int_range(1, common.MAX_LAYERS), help="Trunk layers [8]."),
    hidden: Optional[int] = typer.Option(None, "--hidden", callback=common.int_range(1, 2**24), help="n_embd [256]."),
    expert_ff: Optional[int] = typer.Option(None, "--expert-ff", callback=common.int_range(1, 2**24), help="Expert width [64]."),
    k: Optional[int] = typer.Option(None, "--k", callback=common.int_range(1, 65535), help="Experts used per token [4]."),
    types: Optional[str] = typer.Option(None, "--types",
                                        help="role=TYPE list, e.g. gu=Q8_0/Q4_0,down=Q2_0,dense=Q8_0,embd=BF16 "
                                             "('/' cycles over layers)."),
    shards: Optional[int] = typer.Option(None, "--shards", callback=common.int_range(1, 99999), help="Files per model (gguf-split layout) [1]."),
    mtp: bool = typer.Option(False, "--mtp", help="Add an MTP block that keeps the canonical expert count."),
    seed: Optional[int] = typer.Option(None, "--seed", callback=common.int_range(0, common.MAX_SEED), help="Random seed [0]."),
    full_width: bool = typer.Option(False, "--full-width",
                                    help="Real expert geometry (2560/640, 512 experts, k 10; Q2_0 + i-quants, random "
                                         "valid blocks); multi-GB. Other options override it."),
    no_revisions: bool = typer.Option(False, "--no-revisions", help="Only the canonical model."),
    routing: str = typer.Option("realistic", "--routing",
                                help="Routing model: realistic (per-layer Zipf popularity, topic locality, no "
                                     "collapse at depth; calibrated to real routing), bursty (realistic with mild "
                                     "popularity and strong locality: LRU beats a static profile), uniform (no "
                                     "skew, no locality) or legacy (old weights)."),
    skew: Optional[float] = typer.Option(None, "--skew", callback=common.float_range(0.0, 8.0), help=f"Zipf exponent of each layer's expert popularity "
                                                             f"[{DEFAULT_SKEW}; bursty {BURSTY_SKEW}]; 0 = none."),
    locality: Optional[float] = typer.Option(None, "--locality",
                                             callback=common.float_range(0.0, 1.0, hi_open=True),
                                             help=f"Share of the router input taken by the per-request topic "
                                                  f"context at depth, 0..<1 [{DEFAULT_LOCALITY}; bursty "
                                                  f"{BURSTY_LOCALITY}]; 0 = none."),
    force: bool = typer.Option(False, "--force", help="Replace existing files."),
    json_: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Write a tiny synthetic qwen4exp release: canonical model, pruned revA/revB and their allocation maps."""
    from stratatools.synth.model import SynthConfig, check_footprint, config_with, synth_release

    if routing != "realistic":
        for name, val in (("--skew", skew), ("--locality", locality)):
            if val is not None:
                raise StrataError(f"synth: {name} {val:g} has no effect with --routing {routing} (only "
                                  f"--routing realistic uses it); drop {name} or use --routing realistic")
    base = SynthConfig.full_width() if full_width else SynthConfig()
    kw = dict(n_expert=experts, keep=keep, swap=swap, n_layers=layers, hidden=hidden, expert_ff=expert_ff, k=k,
              shards=shards, seed=seed, routing=routing, skew=skew, locality=locality)
    if full_width and (keep is not None or swap is not None):
        kw["revisions"] = True  # pruned revisions at full width when asked for
    if mtp:
        kw["mtp"] = True
    if no_revisions:
        kw["revisions"] = False
    if types:
        kw.update(_parse_types(types))  # type: ignore[arg-type]
    cfg = config_with(base, **kw)
    if cfg.revisions:  # defaults follow --experts / --keep when only those are given
        if keep is None and cfg.keep > cfg.n_expert:
            cfg = config_with(cfg, keep=max(1, cfg.n_expert // 2))
        if swap is None:
            cfg = config_with(cfg, swap=max(0, min(cfg.swap, cfg.keep, cfg.n_expert - cfg.keep)))
        if k is None and cfg.k > cfg.keep:
            cfg = config_with(cfg, k=cfg.keep)
    elif k is None and cfg.k > cfg.n_expert:
        cfg = config_with(cfg, k=cfg.n_expert)
    total, _ = check_footprint(cfg, outdir)  # before anything is allocated: too big for memory or disk is refused
    with common.progress_bar("writing synthetic release", total) as bar:
        r = synth_release(outdir, cfg, force=force, progress=lambda n: bar.update(advance=n))
    notes = common.write_notes()  # (stderr) what the publish did beside the release folder
    if json_:
        common.emit_json({**r.to_dict(), "notes": notes})
    else:
        render_synth(r)


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""
    app.command("inspect")(inspect_cmd)
    app.command("pack")(pack_cmd)
    app.command("synth")(synth_cmd)
