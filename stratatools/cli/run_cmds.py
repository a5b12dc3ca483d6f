"""CLI command ``run``: run prompts through a packed qwen4exp model with the runtime (:mod:`stratatools.runtime.run`).

Parses options, calls :func:`stratatools.runtime.run.run_prompts`, renders a rich table (or JSON with ``--json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from stratatools.cli import common, sim_cmds


def run_cmd(
    pack: Path = typer.Argument(..., help="Pack folder (native_experts.txt [+ experts.bin]) or a GGUF."),
    prompts: Path = typer.Option(..., "--prompts", "-p", help="Prompts: text lines (\\n escapes), JSON "
                                 "({\"prompts\": [{\"text\"|\"token_ids\", \"prompt_id\"}]}) or JSON Lines "
                                 "(.jsonl: one item per line); prompt ids must be distinct."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="The pack's GGUF, when the pack does not name it."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="STRP profile that fills the expert tier."),
    budget_gib: Optional[float] = typer.Option(None, "--budget-gib",
                                                callback=common.float_range(0.0, common.MAX_GIB), help="Tier size in GiB."),
    slots: Optional[int] = typer.Option(None, "--slots", callback=common.int_range(0, common.MAX_SLOTS),
                                         help="Tier size in slots."),
    policy: str = typer.Option("static", "--policy", help="Tier policy: static, adaptive, lru, lfu, lfru."),
    admission: str = typer.Option("global", "--admission", help="Tier admission: global or per-layer."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", "-n",
                                    callback=common.int_range(0, common.MAX_NEW_TOKENS), help="Length cap per request."),
    trace_out: Optional[Path] = typer.Option(None, "--trace-out", "-t", help="Write the routing trace here.",
                                               parser=common.out_file("--trace-out", "run-trace.bin")),
    trace_format: Optional[str] = typer.Option(None, "--trace-format", help="strata-tagged (default), strata, "
                                               "parquet or csv (default by extension)."),
    selection: str = typer.Option("transformers", "--qsa", help="QSA token selection: transformers or llamacpp."),
    output_gate: str = typer.Option("sigmoid", "--output-gate", help="GDN output gate: sigmoid (llama.cpp) or silu."),
    adapt_every: Optional[int] = sim_cmds._ADAPT_EVERY,
    adapt_swaps: Optional[int] = sim_cmds._ADAPT_SWAPS,
    adapt_decay: Optional[float] = sim_cmds._ADAPT_DECAY,
    adapt_lag: Optional[int] = sim_cmds._ADAPT_LAG,
    adapt_pace_bytes: Optional[int] = sim_cmds._ADAPT_PACE,
    upper_slots: Optional[int] = sim_cmds._UPPER_SLOTS,
    disjoint_adapt: bool = sim_cmds._DISJOINT,
    strata_version: str = sim_cmds._VERSION,
    device: str = typer.Option("auto", "--device", help="auto (the GPU when CuPy sees one), cpu or gpu."),
    vram_gib: Optional[float] = typer.Option(None, "--vram-gib", callback=common.float_range(0.0, common.MAX_GIB, lo_open=True),
                                             help="GPU: the whole device footprint in GiB; "
                                             "the expert slots follow from what is left."),
    batch: int = typer.Option(1, "--batch", callback=common.int_range(1, common.MAX_EXPERTS), help="Sequences decoded together (continuous batching: a finished "
                              "sequence's place goes to the next prompt); 1: one request at a time."),
    force: bool = typer.Option(False, "--force", help="Replace an existing trace file."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout."),
) -> None:
    """Greedy-decode every prompt, write the routing trace, report h_expert and tokens/s."""
    from stratatools.runtime.run import read_prompts, run_prompts, trace_format_note

    tier_params = sim_cmds.adaptive_params(adapt_every, adapt_swaps, adapt_decay, adapt_lag, adapt_pace_bytes,
                                           upper_slots, disjoint_adapt, strata_version)
    n = len(read_prompts(prompts))
    with common.progress_bar("run", n, bytes_=False) as bar:
        res = run_prompts(pack, prompts, model=model, profile=profile, budget_gib=budget_gib, slots=slots,
                          policy=policy, admission=admission, max_new_tokens=max_new_tokens, trace_out=trace_out,
                          trace_format=trace_format, force=force, selection=selection, output_gate=output_gate,
                          progress=lambda k: bar.update(advance=k), tier_params=tier_params,
                          device=device, vram_gib=vram_gib, batch=batch)
    fmt_note = trace_format_note(trace_out, trace_format) if trace_out is not None else None
    if fmt_note and not common.STATE.quiet:  # one line (no wrap), on stderr: stdout may be --json
        common.err_console.print(fmt_note, markup=False, highlight=False, soft_wrap=True)
    if res.trace_dropped_prefill:  # data left out: always said, one line on stderr
        from stratatools.traces.formats.strata import plain_prefill_note

        common.err_console.print("warning: " + plain_prefill_note(res.trace_path, res.trace_dropped_prefill,
                                                                  res.trace_dropped_prefill_records),
                                 markup=False, highlight=False, soft_wrap=True)
    if as_json:
        common.emit_json(res.to_dict())
        return
    c = common.console
    c.print(f"{res.pack or res.model}: experts from {res.expert_source}, QSA selection {res.selection}",
            markup=False, soft_wrap=True)
    d = res.device
    c.print(f"device: {d['device']}" + (f" ({d.get('gpu_name')}, {d.get('engine')}, misses: {d.get('miss_mode')}; "
                                       f"device memory used {d.get('device_used_bytes', 0) / 2**30:.2f} GiB)"
                                       if d["device"] == "gpu" else ""), markup=False, soft_wrap=True)
    t = Table(title="requests")
    for col in ("request", "id", "prompt tokens", "new tokens", "stop", "text"):
        t.add_column(col, justify="left" if col in ("id", "stop", "text") else "right")
    for r in res.requests:
        txt = (r.text or " ".join(map(str, r.new_ids)))
        t.add_row(str(r.request), r.prompt_id, str(r.prompt_tokens), str(len(r.new_ids)), r.stop,
                  repr(txt[:40]) if txt else "")
    c.print(t)
    # a request's first new token comes from its prefill's logits: the decode figure counts only the steps' tokens
    from_prefill = res.new_tokens - res.decode_tokens
    if res.decode_tokens:
        decode = (f"decode: {res.decode_tokens} tokens, {res.tokens_per_s:.1f} tokens/s"
                  + (f" aggregate over --batch {res.batch['batch']} ({res.batch.get('mean_active', 0):.1f} sequences "
                     f"per step on average)" if res.batch.get("batch", 1) > 1 else ""))
    else:  # -n 0 or 1: the prefill's logits gave every new token
        decode = "decode: no decode step ran"
    c.print(f"prefill: {res.prompt_tokens} tokens, {res.prefill_tokens_per_s:.1f} tokens/s; new tokens: "
            f"{res.new_tokens} ({from_prefill} from the prefill logits); {decode}", markup=False, soft_wrap=True)
    if res.tier is not None:
        tier = res.tier
        c.print(f"tier: {tier['policy']}, {tier['resident']} experts resident"
                + (f", {tier['slots']} slots" if tier["slots"] is not None else "")
                + (f", budget {tier['budget_bytes']} bytes" if tier["budget_bytes"] is not None else ""), markup=False)
        # the decode's counts; without a decode step the prefill's, titled so (--json has both)
        shown = "decode" if tier["decode"]["entries"] else "prefill"
        lt = Table(title=f"expert tier per layer ({shown})")
        for col in ("layer", "entries", "hits", "misses", "h_expert"):
            lt.add_column(col, justify="right")
        d = tier[shown]
        for il, (e, h) in enumerate(zip(d["layer_entries"], d["layer_hits"])):
            lt.add_row(str(il), str(e), str(h), str(e - h), f"{h / e:.4f}" if e else "-")
        c.print(lt)
        def rate(ph: str) -> str:
            d = tier[ph]
            return "-" if d["h_expert"] is None else f"{d['h_expert']:.4f} ({d['hits']}/{d['entries']})"

        c.print(f"h_expert (decode): {rate('decode')}; prefill: {rate('prefill')}; all: {rate('all')}; "
                f"{tier['rounds']} rounds", markup=False, soft_wrap=True)
    if res.trace_path:
        c.print(f"trace: {res.trace_records} records ({res.trace_format}) -> {res.trace_path}", markup=False)


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""
    app.command("run")(run_cmd)
