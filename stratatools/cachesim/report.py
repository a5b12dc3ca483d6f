"""Rendering of cache-simulation studies: markdown, JSON and PNG plots (matplotlib, Agg backend).

Rendering never computes: everything comes from a :class:`stratatools.cachesim.study.Study`. Outputs are
deterministic: JSON is key-sorted, PNGs are written without a timestamp (``metadata={"Software": None}``,
fixed size and DPI), file names are fixed. A report folder holds ``report.md``, ``report.json``,
``hit_rate_vs_budget.png``, ``layer_heatmap.png`` and ``coverage.png``.
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Any

from stratatools.core.errors import StrataError
from stratatools.core.fsutil import _json_default, write_bytes_atomic, write_text_atomic

PLOTS = ("hit_rate_vs_budget.png", "layer_heatmap.png", "coverage.png")
FILES = ("report.md", "report.json") + PLOTS


def _pct(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{100 * x:.2f}%"


def _bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def result_rows(study) -> list[dict[str, Any]]:
    """Main-budget table rows: label, policy, admission, slots, h_expert, h_layer, h_bytes, moved_bytes, loads
    (copies), ms_per_token. Byte figures are None when the study has no blob sizes (slot budget only)."""
    rows = []
    for r in study.results:
        ms = None if r.time_per_token_s is None else 1e3 * r.time_per_token_s
        rows.append({"label": r.label, "policy": r.policy, "admission": r.admission, "slots": r.n_slots,
                     "h_expert": r.h_expert, "h_layer": r.h_layer, "h_bytes": r.h_bytes,
                     "moved_bytes": r.moved_bytes, "loads": r.loads, "ms_per_token": ms})
    return rows


def rounds_text(study) -> str:
    """What a replay round was (the unit of the adaptive tier's ``adapt_every`` and the LFU/LFRU decay), from the
    study's results (one replay, so every result agrees); '' without results."""
    if not study.results:
        return ""
    r = study.results[0]
    by, n = getattr(r, "rounds_by", "positions"), r.rounds
    if by == "windows":
        return f"verify windows from the traces' commit records ({n} rounds); a prefill batch is a window too"
    if by == "windows+positions":
        return (f"verify windows from the traces' commit records (a prefill batch is a window too), and one per "
                f"position for records outside every window ({n} rounds)")
    if by.endswith("batches"):
        return (f"layer-major batches (one captured ubatch of a request is one round, as a verify window is; "
                f"{n} rounds)")
    return f"positions ({n} rounds; no windows among the replayed entries)"


def _skipped_text(skipped: dict[str, int] | None) -> str:
    """' (left out: 6,336 prefill, ...)' for the non-zero counts, '' when nothing was left out."""
    parts = [f"{v:,} {k}" if k == "prefill" else f"{v:,} outside the model's {k}s"
             for k, v in (skipped or {}).items() if v]
    return f" (left out: {', '.join(parts)})" if parts else ""


def _phase_text(study) -> str:
    """'; counted: decode (... prefill entries replayed first to warm the cache)' and the like."""
    phase, cold, warm = getattr(study, "phase", "decode"), getattr(study, "cold", False), getattr(study, "warmup", 0)
    if phase == "all":
        return "; counted: every phase"
    if cold:
        return "; counted: decode, the prefill dropped (`--cold`: the decode starts on the start-up fill)"
    if warm:
        return (f"; counted: decode ({warm:,} prefill entries replayed first, uncounted: they warm the cache as "
                f"in the engine; copies include theirs)")
    return "; counted: decode"


def moved_text(row: dict[str, Any]) -> str:
    """The moved column: bytes when blob sizes are known, else the number of copies."""
    return _bytes(row["moved_bytes"]) if row["moved_bytes"] is not None else f"{row['loads']} copies"


def ms_text(row: dict[str, Any]) -> str:
    """The modelled ms-per-token column of a result row (3 decimals), or ``n/a`` when it has no modelled time."""
    return "n/a" if row["ms_per_token"] is None else f"{row['ms_per_token']:.3f}"


def study_json(study) -> str:
    """The study as deterministic JSON text."""
    return json.dumps(study.to_dict(), indent=2, sort_keys=True, default=_json_default, allow_nan=True) + "\n"


def study_markdown(study) -> str:
    """The report as markdown (tables of the main budget, k-fold, per-layer summary, plot links)."""
    b = study.budget
    budget = (f"{b['budget_bytes'] / 2**30:.3f} GiB" if b.get("budget_bytes") is not None else "") + \
             (" / " if b.get("budget_bytes") is not None and b.get("slots") is not None else "") + \
             (f"{b['slots']} slots" if b.get("slots") is not None else "")
    bw = study.bandwidth
    out = ["# Cache simulation report", "",
           f"- Model geometry: {study.n_layers} layers x {study.n_expert} experts",
           f"- Traces: {', '.join(t['name'] for t in study.traces)}: {study.entries} routed entries, "
           f"{study.tokens} tokens, {study.requests} requests" + _skipped_text(study.skipped) + _phase_text(study),
           f"- Budget: {budget}; admission of the static/adaptive tiers: {study.admission}",
           f"- Rounds (the adaptive tier's `adapt_every`, the LFU/LFRU decay): {rounds_text(study)}",
           "- Baselines (lru, lfu, lfru, belady) use the per-layer split of the same budget; `belady` labelled "
           "`<profile> split` runs under that profile's per-layer split and bounds its static/adaptive tiers.",
           "- Hit rates: `h_expert` = hits / routed (token, layer, expert) entries, hit = resident at the time of "
           "use (the headline); `h_layer` = share of (token, layer) records with all k experts resident; "
           "`h_bytes` = hits weighted by blob bytes.",
           f"- Bandwidth model: misses read from host memory at {bw['host_gbps']} GB/s, hits from VRAM at "
           f"{bw['vram_gbps']} GB/s, copies over PCIe at {bw['pcie_gbps']} GB/s, no overlap; routed experts only. "
           "It ranks traffic; it does not predict tokens/s." + (
               "" if study.blob_bytes is not None else
               " Blob sizes are unknown here (a slot budget without --pack/--model): h_bytes, bytes and ms/token "
               "are n/a and `moved` counts host->VRAM copies."), "",
           "## At the budget", "",
           "| profile / split | policy | admission | slots | h_expert | h_layer | h_bytes | moved | ms/token |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result_rows(study):
        out.append(f"| {r['label']} | {r['policy']} | {r['admission']} | {r['slots']} | {_pct(r['h_expert'])} | "
                   f"{_pct(r['h_layer'])} | {_pct(r['h_bytes'])} | {moved_text(r)} | {ms_text(r)} |")
    cm = getattr(study, "cost_model", None)
    if cm is not None:
        ram = "all experts" if cm["ram_bytes"] is None else _bytes(cm["ram_bytes"])
        out += ["", "## Three-tier cost model (a model, not a measurement)", "",
                f"VRAM {cm['vram_gbps']} GB/s, PCIe {cm['pcie_gbps']} GB/s, host RAM {cm['ram_gbps']} GB/s "
                f"(RAM tier: {ram}), SSD {cm['ssd_gbps']} GB/s. Assumptions: " + "; ".join(cm["assumptions"]) + ".",
                "", "| policy | profile / split | VRAM | RAM | SSD | moved / token | predicted tok/s |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for r in study.results:
            t = r.tiers
            if t is None:
                continue
            out.append(f"| {r.policy} | {r.label} | {_pct(t['h_vram'])} | {_pct(t['h_ram'])} | {_pct(t['h_ssd'])} | "
                       f"{_bytes(t['moved_bytes_per_token'])} | {t['tok_s']:.1f} |")
    kf = study.kfold
    if kf is not None:
        out += ["", f"## Held-out ({kf.k}-fold by request, {kf.requests} requests; profiles by make-profile "
                    f"`{kf.options['mode']}`)", "",
                "| policy | held-out h_expert (mean) | 95% interval | in-sample |", "|---|---:|---|---:|"]
        for p in kf.policies:
            out.append(f"| {p} | {_pct(kf.mean[p])} | [{_pct(kf.low[p])}, {_pct(kf.high[p])}] | "
                       f"{_pct(kf.in_sample[p])} |")
        out += ["", "| fold | requests | entries | " + " | ".join(kf.policies) + " |",
                "|---:|---:|---:|" + "---:|" * len(kf.policies)]
        for row in kf.folds:
            out.append(f"| {row['fold']} | {row['requests']} | {row['entries']} | " +
                       " | ".join(_pct(row["h_expert"][p]) for p in kf.policies) + " |")
    if study.coverage:
        out += ["", "## Coverage (first n ranked pairs)", "", "| profile | claimed from | n | claimed | measured |",
                "|---|---|---:|---:|---:|"]
        for name, c in study.coverage.items():
            for q in (0.25, 0.5, 1.0):
                i = min(len(c["n"]) - 1, int(round(q * (len(c["n"]) - 1))))
                out.append(f"| {name} | {c['claimed_kind']} | {c['n'][i]} | {_pct(c['claimed'][i])} | "
                           f"{_pct(c['measured'][i])} |")
    out += ["", "## Plots", "", "![hit rate against budget](hit_rate_vs_budget.png)", "",
            "![per-layer hit rate](layer_heatmap.png)", "", "![coverage](coverage.png)", ""]
    return "\n".join(out)


def _fig_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


_POLICY_COLOURS = {"static": "tab:blue", "adaptive": "tab:orange", "lru": "tab:green", "lfu": "tab:red",
                   "lfru": "tab:purple", "belady": "tab:brown"}
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def sweep_styles(keys) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(colour, line style, marker) per (label, policy) series: colour = policy, style and marker = profile
    (a Belady run under ``<profile> split`` shares its profile's style), so no two series look alike."""
    bases: list[str] = []
    for label, _ in keys:
        b = label[:-len(" split")] if label.endswith(" split") else label
        if b not in bases:
            bases.append(b)
    out = {}
    extra = sorted({p for _, p in keys} - set(_POLICY_COLOURS))
    for label, pol in keys:
        b = label[:-len(" split")] if label.endswith(" split") else label
        i = bases.index(b)
        colour = _POLICY_COLOURS.get(pol) or f"C{extra.index(pol) % 10}"
        out[(label, pol)] = (colour, _LINESTYLES[i % len(_LINESTYLES)], _MARKERS[(i // len(_LINESTYLES)) % len(_MARKERS)])
    return out


def plot_sweep(study) -> bytes:
    """PNG: h_expert against budget, one line per (profile/split, policy): colour = policy, line style and
    marker = profile; the legend sits outside the axes; a dotted line marks the main budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    unit = "slots"
    for row in study.sweep:
        if row["x"] is not None and row["x"] > 0:  # a zero budget has no place on a log axis
            series.setdefault((row["label"], row["policy"]), []).append((row["x"], row["h_expert"]))
        unit = row["unit"]
    scale = 1.0
    if unit == "GiB" and series and max(x for pts in series.values() for x, _ in pts) < 1:
        scale, unit = 1024.0, "MiB"
    styles = sweep_styles(sorted(series))
    xs: set[float] = set()
    for key, pts in sorted(series.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        pts.sort()
        colour, ls, mk = styles[key]
        ax.plot([p[0] * scale for p in pts], [100 * p[1] for p in pts], color=colour, linestyle=ls, marker=mk,
                markersize=5, label=f"{key[1]} ({key[0]})")
        xs.update(p[0] * scale for p in pts)
    b = study.budget
    main = (b["budget_bytes"] / 2**30 * scale) if unit in ("GiB", "MiB") and b.get("budget_bytes") else b.get("slots")
    if main:
        ax.axvline(main, color="0.4", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    if xs:
        ticks = sorted(xs)
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{int(t):,}" if unit == "slots" else f"{t:.3g}" for t in ticks])
        ax.minorticks_off()
    ax.set_ylim(0, 100)
    ax.set_xlabel(f"budget ({unit}; dotted line: the report's budget)")
    ax.set_ylabel("h_expert (%)")
    ax.set_title("Hit rate against budget")
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return _fig_bytes(fig)


def plot_heatmap(study) -> bytes:
    """PNG: per-layer h_expert at the budget, one row per result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = study.results
    data = np.array([[np.nan if x is None else x for x in r.layer_h_expert] for r in rows], dtype=float) * 100
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * study.n_layers + 3), max(3, 0.35 * len(rows) + 1.5)))
    im = ax.imshow(data, aspect="auto", vmin=0, vmax=100, cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r.policy} ({r.label})" for r in rows], fontsize=7)
    ax.set_xlabel("layer")
    ax.set_title("Per-layer h_expert (%) at the budget")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return _fig_bytes(fig)


def plot_coverage(study) -> bytes:
    """PNG: measured coverage of each profile's first n pairs, against its claimed curve (the profile's own
    frequency table) where it has one; the best ranking for these traces (oracle, the same for every profile)
    is drawn once as the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    oracle = None
    for name, c in sorted(study.coverage.items()):
        line, = ax.plot(c["n"], [100 * x for x in c["measured"]], label=f"{name} measured")
        if c["claimed_kind"] == "oracle":
            oracle = c
        else:
            ax.plot(c["n"], [100 * x for x in c["claimed"]], linestyle="--", color=line.get_color(),
                    label=f"{name} claimed ({c['claimed_kind']})")
    if oracle is not None:
        ax.plot(oracle["n"], [100 * x for x in oracle["claimed"]], linestyle="--", color="black", linewidth=1,
                label="best ranking for these traces (oracle)")
    ax.set_xlabel("first n ranked pairs (slots)")
    ax.set_ylabel("coverage of routed entries (%)")
    ax.set_title("Profile coverage: claimed vs measured")
    ax.grid(True, alpha=0.3)
    if study.coverage:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _fig_bytes(fig)


def write_report(study, folder: str | os.PathLike, force: bool = False,
                 inputs: "list[str | os.PathLike] | tuple" = ()) -> list[Path]:
    """Write report.md, report.json and the PNG plots into ``folder`` through
    :func:`stratatools.core.fsutil.publish_dir`: built in a temp folder beside it; a new folder, or one holding
    only a previous report, is swapped in whole (a previous report survives any failure); a folder holding other
    entries (files, subfolders) keeps them untouched and gets the report's files renamed in one by one, each
    complete: the previous report.json is removed first and the new one renamed in last, so its presence means
    the report is complete (a kill midway leaves some files new, some old, and no report.json). The folder
    keeps its permissions either way.

    Without ``force`` the "already exists" check runs again under the folder's lock, before the build and just
    before the swap (``publish_dir``'s ``refuse``): a report another run published after this one's first check
    is refused, not replaced.

    Raises StrataError when a report file exists there and ``force`` is False (also one published meanwhile),
    when the folder is an input or not a folder. Returns the paths written.
    """
    from stratatools.core.fsutil import publish_dir

    d = Path(folder)

    def refuse(_t: Path) -> None:  # also run under the output lock (publish_dir)
        for f in FILES:
            if (d / f).exists():
                raise StrataError(f"{d / f}: already exists (pass --force to replace the report)", d / f)

    if d.exists() and not d.is_dir():
        raise StrataError(f"{d}: exists and is not a folder; choose another --report folder", d)
    if not force:
        refuse(d)
    blobs = {"report.json": study_json(study).encode(), "report.md": study_markdown(study).encode(),
             "hit_rate_vs_budget.png": plot_sweep(study), "layer_heatmap.png": plot_heatmap(study),
             "coverage.png": plot_coverage(study)}
    with publish_dir(d, inputs=inputs, keep=lambda n: n not in FILES, refuse=None if force else refuse,
                     last=("report.json",)) as stage:
        for name in FILES:
            write_bytes_atomic(stage / name, blobs[name])
    return [d / name for name in FILES]


__all__ = ["write_report", "study_markdown", "study_json", "result_rows", "plot_sweep", "plot_heatmap",
           "plot_coverage", "sweep_styles", "moved_text", "ms_text", "FILES", "PLOTS", "write_text_atomic"]
