"""The demo: the whole story on the embedded synthetic release, as the commands a user would type.

A synthetic Coder-like release (a 32-expert canonical model, a 16-of-32 pruned revision A, and revision B
that re-indexes the survivors) is generated; a profile is built for revision A the way Strata's shipped
Coder profile was (the canonical model's routing, mapped onto the survivors); then revision B ships and the
story unfolds: pack, the stale profile caught, the remap, a profile rebuilt from traces the runtime
recorded, stale vs remapped vs rebuilt simulated on held-out prompts, and validate-release red on the stale
release and green on the fixed one. Every step runs the real CLI in-process; its command line, exit code
and output land in the output folder, with an ``index.md`` that links everything.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from stratatools.core.errors import StrataError
from stratatools.core.fsutil import publish_dir, tidy_output, write_text_atomic
from stratatools.core.resources import packaged

MARKER = ".stratatools-demo"  # a folder carrying this file is a demo output (demo --force may replace it)
OWN_NAMES = frozenset({MARKER, "index.md", "logs", "prompts", "traces", "profiles", "reports", "release",
                       "pack-revB"})
"""The entries a demo writes at the top of its folder; any other entry there is another program's (kept)."""


def _others_keep(name: str) -> bool:
    """True for a name in a demo folder that is not the demo's own (another program's file: carried over)."""
    return name not in OWN_NAMES

DEMO_PROMPT_SETS = ("train", "eval")
"""The demo's two prompt sets, packaged as ``data/demo/<name>.txt``: the workload the profiles are built from
and the held-out prompts they are judged on."""


def demo_prompts(name: str) -> str:
    """Text of the packaged prompt set ``name`` (``"train"`` or ``"eval"``): one prompt per line, ``\\n``
    escapes inside a prompt (the ``stratatools run --prompts`` text format).

    Raises:
        StrataError: unknown set, or the packaged file is missing (a broken install).
    """
    if name not in DEMO_PROMPT_SETS:
        raise StrataError(f"unknown demo prompt set {name!r} (one of {', '.join(DEMO_PROMPT_SETS)})")
    path = packaged("data", "demo", f"{name}.txt")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StrataError(f"{path}: the packaged demo prompts are missing; reinstall stratatools", path) from None
    if not text.strip():
        raise StrataError(f"{path}: the packaged demo prompts are empty; reinstall stratatools", path)
    return text


@dataclass
class Step:
    """One demo step: the command, its exit code, where its output went, and how long it took."""

    title: str
    argv: list[str]
    expect: int
    code: int = -1
    log: Path | None = None
    seconds: float = 0.0
    story: str = ""


@dataclass
class DemoResult:
    """Outcome of a demo run: its output folder, the steps in order, and the wall time in seconds."""
    out: Path
    steps: list[Step] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every step exited with the code it expected."""
        return all(s.code == s.expect for s in self.steps)


Runner = Callable[[list[str]], "tuple[int, str]"]
"""Runs one command line (without the program name); returns (exit code, combined stdout+stderr text)."""


def run_demo(out: str | Path, runner: Runner, *, force: bool = False,
             progress: Callable[[Step], None] | None = None) -> DemoResult:
    """Run the demo into ``out`` (created; replaced with ``force``).

    ``runner`` runs each step's command line; the CLI passes its in-process runner, so the walkthrough
    shows exactly what a user typing the commands would see without this package importing the CLI.

    Returns:
        a :class:`DemoResult`; ``ok`` is False when any step exited other than expected.
    Raises:
        StrataError: ``out`` exists and is not empty, without ``force``.
    """
    final = Path(out)

    def refuse(_t: Path) -> None:  # also run under the output lock just before the swap (publish_dir)
        if final.exists() and final.is_dir() and any(final.iterdir()):
            if not force:
                raise StrataError(f"{final}: already exists and is not empty (pass --force to replace it)", final)
            if not (final / MARKER).is_file() or (final / MARKER).is_symlink():
                raise StrataError(f"{final}: is not a demo folder (it has no {MARKER} file); refusing to replace "
                                  f"it (choose an empty or new folder)", final)
            for e in sorted(os.scandir(final), key=lambda e: e.name):
                if _others_keep(e.name) and not (e.is_symlink() or e.is_file(follow_symlinks=False)):
                    kind = "a folder" if e.is_dir(follow_symlinks=False) else "a special file"
                    raise StrataError(f"{final / e.name}: is {kind} that is not the demo's; the demo replaces its "
                                      f"folder whole and carries only files over: move it away or choose another "
                                      f"folder", final / e.name)

    # what a killed run left beside it (its temp folder, the lock file, aside folders: the publish's keep)
    tidy_output(final, keep=_others_keep)
    refuse(final)
    # built in a temp folder beside the output and swapped in whole: the previous demo survives a crash, a kill or
    # a refusal (a demo whose steps ran and failed is published, so that its logs show why); other
    # programs' files in the previous folder (there before, or written meanwhile) are carried into the new one
    with publish_dir(final, keep=_others_keep, refuse=refuse, whole=True) as out:
        res = _run_steps(out, final, runner, progress)
    return _rebased(res, out, final)


def _rebased(res: DemoResult, stage: Path, final: Path) -> DemoResult:
    """``res`` with the temp folder's paths (argv, logs) replaced by the published folder's."""
    def mv(a: str) -> str:
        return a.replace(str(stage), str(final))

    for st in res.steps:
        st.argv = [mv(a) for a in st.argv]
        if st.log is not None:
            st.log = Path(mv(str(st.log)))
    res.out = final
    return res


def _run_steps(out: Path, final: Path, runner: Runner, progress: Callable[[Step], None] | None) -> DemoResult:
    write_text_atomic(out / MARKER, "stratatools demo output folder: `stratatools demo --force` may replace it\n")
    for sub in ("logs", "prompts", "traces", "profiles", "reports"):
        (out / sub).mkdir()
    for name in DEMO_PROMPT_SETS:
        write_text_atomic(out / "prompts" / f"{name}.txt", demo_prompts(name))

    R = out / "release"
    canon, revA, revB = R / "synth-canonical.gguf", R / "synth-revA.gguf", R / "synth-revB.gguf"
    allocA, allocB = R / "synth-revA.rco-allocation.txt", R / "synth-revB.rco-allocation.txt"
    P, T, REP = out / "profiles", out / "traces", out / "reports"
    pack = out / "pack-revB"
    n_new = "12"
    res = DemoResult(out)
    final_name = str(final)

    def s(title: str, argv: list, expect: int = 0, story: str = "") -> None:
        st = Step(title, [str(a) for a in argv], expect, story=story)
        t0 = time.perf_counter()
        st.code, text = runner(st.argv)
        st.seconds = time.perf_counter() - t0
        st.log = out / "logs" / f"{len(res.steps) + 1:02d}-{st.argv[0]}.txt"
        write_text_atomic(st.log, f"$ stratatools {shlex.join(st.argv)}\n{text}\n[exit {st.code}]\n"
                          .replace(str(out), final_name))
        res.steps.append(st)
        if progress:
            progress(st)
        if st.code in (130, 143) and st.expect not in (130, 143):
            # the step was interrupted (Ctrl-C) or terminated (SIGTERM): the in-process runner caught its exit,
            # so the demo ends here the same way instead of counting a failed step and going on (its build is
            # dropped, the previous demo folder stays)
            raise SystemExit(st.code)

    t_start = time.perf_counter()
    s("Synthesize the release", ["synth", R, "--seed", "7"],
      story="A canonical 32-expert model and two pruned revisions (16 of 32 experts per layer): revision B "
            "re-indexes the survivors, as the Coder's 2026-10-19 re-release did.")
    s("Inspect revision B", ["inspect", revB],
      story="Experts per layer come from the routers (ne1 of ffn_gate_inp), not from a constant.")
    s("Pack revision B", ["pack", revB, "-o", pack, "--experts-bin"],
      story="Strata's native_experts.txt and experts.bin, written atomically.")
    s("Route the workload through the canonical model", ["run", canon, "--prompts", out / "prompts/train.txt",
      "-n", n_new, "--trace-out", T / "canonical-train.bin"],
      story="The runtime records the routing it really does (Strata tagged trace: requests and phases).")
    s("Build the canonical profile", ["make-profile", T / "canonical-train.bin", "--model", canon, "--mode",
      "no-base", "-o", P / "canonical.bin"])
    s("Ship a profile for revision A", ["remap-profile", P / "canonical.bin", "--alloc", allocA, "-o",
      P / "shipped-revA.bin"],
      story="As Strata's shipped Coder profile was built: the full ranking mapped onto the survivors, "
            "unranked survivors appended layer-major.")
    s("Revision B ships: is the profile stale?", ["profile-diff", P / "shipped-revA.bin", "--old-alloc", allocA,
      "--new-alloc", allocB, "--markdown", REP / "profile-diff.md"], expect=1,
      story="The engine would load this profile without a word (same shape). stratatools says it is stale "
            "and exits 1.")
    s("Fix it: remap through original indices", ["remap-profile", P / "shipped-revA.bin", "--from-alloc", allocA,
      "--to-alloc", allocB, "-o", P / "remapped-revB.bin"])
    s("Verify the survivor map from the router weights", ["alloc", "verify", "--pruned", revB, "--full", canon,
      "--alloc", allocB],
      story="Each pruned router row equals exactly one row of the full router: no trust in the text needed.")
    s("Record revision B's own routing (workload)", ["run", pack, "--prompts", out / "prompts/train.txt",
      "-n", n_new, "--trace-out", T / "revB-train.bin"])
    s("Record revision B's routing on held-out prompts", ["run", pack, "--prompts", out / "prompts/eval.txt",
      "-n", n_new, "--trace-out", T / "revB-eval.bin"])
    s("Rebuild the profile from revision B's traces", ["make-profile", T / "revB-train.bin", "--pack", pack,
      "-o", P / "rebuilt-revB.bin"])
    s("Trace statistics", ["trace", "stats", T / "revB-eval.bin"])
    s("Stale vs remapped vs rebuilt, on held-out prompts", ["simulate", "-t", T / "revB-eval.bin",
      "-p", P / "shipped-revA.bin", "-p", P / "remapped-revB.bin", "-p", P / "rebuilt-revB.bin",
      "--pack", pack, "--slots", "32", "--policy", "static,adaptive,lru,belady", "--report", REP / "simulation"],
      story="Same traces, same budget (32 slots = 4 per layer), every profile and policy side by side.")
    s("validate-release: the stale profile", ["validate-release", "--model", revB, "--alloc", allocB,
      "--profile", P / "shipped-revA.bin", "--pack", pack, "--previous", revA, "--previous-alloc", allocA,
      "--junit", REP / "validate-stale.xml", "--markdown", REP / "validate-stale.md"], expect=1,
      story="Red: the profile-stale check fails.")
    s("validate-release: the fixed release", ["validate-release", "--model", revB, "--alloc", allocB,
      "--profile", P / "remapped-revB.bin", "--pack", pack, "--full", canon, "-t", T / "revB-eval.bin",
      "--min-hit-rate", "0.05", "--slots", "32", "--junit", REP / "validate-fixed.xml",
      "--markdown", REP / "validate-fixed.md"], expect=0,
      story="Green: every check passes, including the survivor map from the routers and the hit-rate gate.")
    res.seconds = time.perf_counter() - t_start
    _write_index(res)
    return res


def _rel(p: Path, base: Path) -> str:
    try:
        return str(p.relative_to(base))
    except ValueError:
        return str(p)


def _write_index(res: DemoResult) -> None:
    out = res.out
    lines = ["# stratatools demo", "",
             "Everything below was produced by `make demo` on the embedded synthetic release (clearly labelled "
             "synthetic in its metadata). Each step is the exact command a user would type; its full output "
             "is linked.", "",
             f"Result: **{'all steps as expected' if res.ok else 'SOME STEPS UNEXPECTED'}**, "
             f"{len(res.steps)} steps in {res.seconds:.1f} s.", "",
             "| # | step | command | exit | expected | log |", "|---|---|---|---|---|---|"]
    for i, st in enumerate(res.steps, 1):
        cmd = "stratatools " + " ".join(_rel(Path(a), out) if "/" in a else a for a in st.argv[:3]) + (" …" if len(st.argv) > 3 else "")
        mark = "ok" if st.code == st.expect else "**unexpected**"
        lines.append(f"| {i} | {st.title} | `{cmd}` | {st.code} | {st.expect} ({mark}) | "
                     f"[{st.log.name}](logs/{st.log.name}) |")
    lines += ["", "## The story", ""]
    for i, st in enumerate(res.steps, 1):
        stop = "" if st.title.endswith(("?", "!", ".")) else "."
        lines.append(f"{i}. **{st.title}{stop}** {st.story}".rstrip())
    lines += ["", "## Outputs", ""]
    links = [
        ("release/", "the synthetic release: canonical, revA, revB GGUFs, allocation maps, release.json"),
        ("pack-revB/native_experts.txt", "Strata's native pack table of revision B"),
        ("profiles/", "canonical, shipped (stale) revA, remapped and rebuilt revB profiles, each with a .json provenance sidecar"),
        ("traces/", "routing traces the runtime recorded"),
        ("reports/profile-diff.md", "the stale-profile report"),
        ("reports/simulation/report.md", "stale vs remapped vs rebuilt: table"),
        ("reports/simulation/hit_rate_vs_budget.png", "hit rate against budget"),
        ("reports/simulation/layer_heatmap.png", "per-layer hit rates"),
        ("reports/simulation/coverage.png", "claimed vs measured coverage"),
        ("reports/validate-stale.md", "validate-release on the stale release (red)"),
        ("reports/validate-fixed.md", "validate-release on the fixed release (green)"),
        ("reports/validate-stale.xml", "JUnit XML of the red run"),
    ]
    for rel, what in links:
        mark = "" if (out / rel).exists() else " (missing)"
        lines.append(f"- [{rel}]({rel}): {what}{mark}")
    sim = out / "reports" / "simulation" / "report.md"
    if sim.exists():
        import re

        body = [("#" + ln if ln.startswith("#") else ln) for ln in sim.read_text(encoding="utf-8").splitlines()]
        # the report links its plots relative to its own folder
        body = [re.sub(r"\]\((?!https?:|/)([^)]+)\)", r"](reports/simulation/\1)", ln) for ln in body]
        if body and body[0].startswith("## "):
            body = body[1:]  # the report's own title; this section has one
        lines += ["", "## Simulation (from reports/simulation/report.md)", ""] + body
    write_text_atomic(out / "index.md", "\n".join(lines) + "\n")
