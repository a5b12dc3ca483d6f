"""CLI: ``validate-release`` (every check on a release, for CI)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from stratatools.release.checks import FAIL, PASS
from stratatools.core.fsutil import write_text_atomic
from stratatools.cli import common
from stratatools.cli.common import console, emit_json, progress_bar, styled, warn

_STYLE = {PASS: "green", FAIL: "bold red", "skip": "yellow"}


def validate_release_cmd(
    release_dir: Optional[Path] = typer.Argument(None, help="Release folder: one model (file or shard set), "
                                                           "optionally its allocation, profile and pack."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="The GGUF (any shard) instead of a folder."),
    alloc: Optional[Path] = typer.Option(None, "--alloc", "-a", help="rco-allocation.txt of this release."),
    profile: Optional[Path] = typer.Option(None, "--profile", "-p", help="STRP expert profile to validate."),
    pack: Optional[Path] = typer.Option(None, "--pack", help="Native pack folder to round-trip."),
    traces: List[Path] = typer.Option([], "--traces", "-t", help="Routing trace for the hit-rate gate: a file, folder, glob or Parquet dataset (repeat)."),
    full: Optional[Path] = typer.Option(None, "--full", help="The unpruned model: verify the survivor map."),
    previous: Optional[Path] = typer.Option(None, "--previous", help="The previous revision: detect re-indexing."),
    previous_alloc: Optional[Path] = typer.Option(None, "--previous-alloc", help="The previous revision's allocation."),
    min_hit_rate: Optional[float] = typer.Option(None, "--min-hit-rate", callback=common.float_range(0.0, 1.0),
                                                help="Gate: profile h_expert on the traces (0..1)."),
    slots: Optional[int] = typer.Option(None, "--slots", callback=common.int_range(0, common.MAX_SLOTS),
                                       help="Slots for the gate, at least 1 (default: 39/256 of the experts per "
                                            "layer)."),
    budget_gib: Optional[float] = typer.Option(None, "--budget-gib", callback=common.float_range(0.0, common.MAX_GIB, lo_open=True),
                                              help="Byte budget for the gate instead of slots."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout instead of the table."),
    json_out: Optional[Path] = typer.Option(None, "--json-out", help="Write the result as JSON to FILE.",
                                            parser=common.out_file("--json-out", "validate.json", stdout_ok=True)),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Write JUnit XML (one testcase per check; '-' = stdout).",
                                         parser=common.out_file("--junit", "validate.xml", stdout_ok=True)),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Write a markdown summary ('-' = stdout).",
                                            parser=common.out_file("--markdown", "validate.md", stdout_ok=True)),
    registry: Optional[Path] = typer.Option(None, "--registry", help="Release registry TOML (default: "
                                            "$STRATATOOLS_REGISTRY, else the packaged allocations/releases.toml)."),
    force: bool = typer.Option(False, "--force", help="Replace existing --json-out/--junit/--markdown files."),
    github: bool = typer.Option(False, "--github", help="Print GitHub Actions annotations on stdout "
                                "(::error file=...::reason per failed check, ::notice per skipped one)."),
) -> None:
    """Validate a release: shards, geometry, allocation, survivor map, profile (stale?), pack, hit-rate gate.

    Exit 0 when every check passes (skips allowed), 1 when a check failed, 2 for unusable input. A requested
    gate never becomes a skip: --min-hit-rate needs --traces and a profile, --slots/--budget-gib need
    --min-hit-rate, --previous-alloc needs --previous (else exit 2). The gate's default budget is
    L x round(E x 39/256) slots (at least 1 per layer).
    """
    from stratatools.release.validate import check_gate_inputs, check_gate_options, resolve_inputs, validate_release

    inp = resolve_inputs(release_dir, model=model, alloc=alloc, profile=profile, pack=pack, traces=traces,
                         full=full, previous=previous, previous_alloc=previous_alloc)
    check_gate_options(min_hit_rate, slots, budget_gib)
    check_gate_inputs(inp, min_hit_rate, slots, budget_gib)  # a requested gate never becomes a skip
    if json_out is not None and str(json_out) == "-":
        from stratatools.core.errors import StrataError

        raise StrataError("--json-out -: to print JSON on stdout use --json; --json-out takes a file path")
    stdout_reports = (["json"] if as_json else []) + [k for k, v in (("junit", junit), ("markdown", markdown))
                                                      if v is not None and str(v) == "-"] \
        + (["github"] if github else [])
    if len(stdout_reports) > 1:
        from stratatools.core.errors import StrataError

        named = [(f"--{k}" if k in ("json", "github") else f"--{k} -") for k in stdout_reports]
        raise StrataError(f"{' and '.join(named)} all print on stdout; send at most one report there")
    if min_hit_rate is None and inp.traces:
        warn("--traces only serves the hit-rate gate; add --min-hit-rate X to run it")
    _guard_reports(inp, registry, force, junit=junit, json_out=json_out, markdown=markdown)
    suite = validate_release(inp, min_hit_rate=min_hit_rate, slots=slots, budget_gib=budget_gib, registry=registry,
                             progress=lambda what, total: progress_bar(what, total, bytes_=False))
    if junit is not None and str(junit) != "-":
        write_text_atomic(junit, suite.to_junit())
    if markdown is not None and str(markdown) != "-":
        write_text_atomic(markdown, suite.to_markdown())
    if json_out is not None:
        import json

        write_text_atomic(json_out, json.dumps(suite.to_dict(), indent=2, sort_keys=True, default=str) + "\n")
    if stdout_reports == ["json"]:
        emit_json(suite.to_dict())
    elif stdout_reports:
        import sys

        if stdout_reports[0] == "github":
            sys.stdout.write(suite.to_github())
        else:
            sys.stdout.write(suite.to_junit() if stdout_reports[0] == "junit" else suite.to_markdown())
        sys.stdout.flush()
    else:
        t = Table(title=f"validate-release: {inp.model.name}", show_lines=False)
        t.add_column("check")
        t.add_column("status")
        t.add_column("reason", overflow="fold")
        for c in suite.checks:
            t.add_row(c.name, styled((c.status, _STYLE[c.status])), c.reason)
        console.print(t)
        n = suite.counts
        verdict = ("PASS", "green") if suite.ok else ("FAIL", "bold red")
        console.print(styled(verdict, f": {n[PASS]} passed, {n[FAIL]} failed, {n['skip']} skipped"))
    raise typer.Exit(suite.exit_code)


def _guard_reports(inp, registry: Optional[Path], force: bool, **outs: Optional[Path]) -> None:
    """Refuse report paths that are an input (any shard too), one another, or existing without --force;
    all before any check runs, so a refused run writes nothing."""
    from stratatools.core.errors import StrataError
    from stratatools.core.fsutil import guard_output
    from stratatools.model.gguf import shard_siblings

    inputs: list[Path] = [p for p in (inp.model, inp.alloc, inp.profile, inp.full, inp.previous,
                                      inp.previous_alloc, registry) if p is not None] + list(inp.traces)
    for m in (inp.model, inp.full, inp.previous):
        if m is not None and m.exists():
            inputs += shard_siblings(m) or []
    if inp.profile is not None:
        inputs.append(inp.profile.with_name(inp.profile.name + ".json"))
    if inp.pack is not None and inp.pack.is_dir():
        inputs += list(inp.pack.iterdir())
    given = {k: v for k, v in outs.items() if v is not None and str(v) != "-"}
    seen: dict[Path, str] = {}
    for k, v in given.items():
        r = v.resolve()
        if r in seen:
            raise StrataError(f"{v}: --{seen[r].replace('_', '-')} and --{k.replace('_', '-')} name the same file; "
                              "give each report its own path", v)
        seen[r] = k
        guard_output(v, inputs, force)


def register(app: typer.Typer) -> None:
    """Add ``validate-release`` to ``app``."""
    app.command("validate-release")(validate_release_cmd)
