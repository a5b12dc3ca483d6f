"""The demo tells the whole story: every step exits as expected, outputs are linked, the numbers make sense."""

from __future__ import annotations

import json

import junitparser
import pytest

from stratatools.cli import run_text
from stratatools.demo.walkthrough import run_demo
from stratatools.core.errors import StrataError


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    return run_demo(out, run_text)


def test_every_step_as_expected(demo):
    assert demo.ok, [(s.title, s.code, s.expect) for s in demo.steps]
    assert len(demo.steps) == 16
    index = (demo.out / "index.md").read_text()
    assert "(missing)" not in index
    assert "all steps as expected" in index
    for st in demo.steps:
        assert st.log.exists() and st.log.read_text().startswith("$ stratatools ")
    # the demo's own top-level names (any other entry is another program's, carried over by demo --force)
    from stratatools.demo.walkthrough import OWN_NAMES

    assert set(p.name for p in demo.out.iterdir()) == set(OWN_NAMES)


def test_story_numbers(demo):
    rep = json.loads((demo.out / "reports/simulation/report.json").read_text())
    text = json.dumps(rep)
    assert "shipped-revA" in text and "remapped-revB" in text and "rebuilt-revB" in text
    table = (demo.out / "reports/simulation/report.md").read_text()
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 5 and cells[1] == "static" and cells[0] in ("shipped-revA", "remapped-revB", "rebuilt-revB"):
            rows[cells[0]] = float(cells[4].rstrip("%"))
    # realistic synthetic routing (Zipf-skewed per layer, topic locality): the stale profile is clearly worse than
    # the remapped one (one run: 37.4% vs 47.2%), the rebuilt one at least as good (53.4%)
    assert rows["remapped-revB"] > rows["shipped-revA"] + 5
    assert rows["rebuilt-revB"] >= rows["remapped-revB"] - 2
    for png in ("hit_rate_vs_budget.png", "layer_heatmap.png", "coverage.png"):
        assert (demo.out / "reports/simulation" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validate_release_red_then_green(demo):
    red = junitparser.JUnitXml.fromfile(str(demo.out / "reports/validate-stale.xml"))
    cases = {c.name: c for s in red for c in s}
    assert not cases["profile-stale"].is_passed
    assert cases["pack"].is_passed and cases["survivor-map"].is_passed
    green = junitparser.JUnitXml.fromfile(str(demo.out / "reports/validate-fixed.xml"))
    gcases = {c.name: c for s in green for c in s}
    assert all(c.is_passed for c in gcases.values())
    assert set(gcases) >= {"profile-stale", "survivor-map", "pack", "hit-rate"}


@pytest.mark.parametrize("code", [130, 143])
def test_an_interrupted_step_ends_the_demo(tmp_path, code):
    """Ctrl-C or SIGTERM during a step (the in-process runner returns the step's 130 / 143): the demo stops with
    that exit, runs no further step and publishes nothing; the previous demo folder stays as it was."""
    calls = []

    def runner(argv):
        calls.append(argv[0])
        if len(calls) == 2:
            return code, "interrupted"
        return run_text(argv)

    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as ei:
        run_demo(out, runner)
    assert ei.value.code == code and len(calls) == 2
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_refuses_non_demo_folder(tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(StrataError, match="already exists"):
        run_demo(tmp_path, run_text)
    with pytest.raises(StrataError, match="not a demo folder"):
        run_demo(tmp_path, run_text, force=True)
    assert (tmp_path / "keep.txt").read_text() == "user data"


def test_index_links_resolve(demo):
    import re

    index = (demo.out / "index.md").read_text()
    assert index.count("\n# ") == 0  # one title; embedded report headings are demoted
    links = re.findall(r"\]\(([^)]+)\)", index)
    assert any(link.endswith(".png") for link in links)
    for link in links:
        assert (demo.out / link).exists(), link


def test_demo_prompts_are_the_packaged_files(demo):
    from stratatools.core.errors import StrataError
    from stratatools.core.resources import packaged
    from stratatools.demo.walkthrough import demo_prompts

    train, ev = demo_prompts("train").splitlines(), demo_prompts("eval").splitlines()
    assert (len(train), len(ev)) == (6, 4)
    assert train[0].startswith(r"def fibonacci(n):\n    if n < 2:")  # \n escapes stay escapes (run --prompts text)
    assert not set(train) & set(ev)  # held-out prompts are not training prompts
    assert packaged("data", "demo", "eval.txt").read_text(encoding="utf-8") == demo_prompts("eval")
    for name in ("train", "eval"):  # what the demo ran on is the packaged text
        assert (demo.out / "prompts" / f"{name}.txt").read_text(encoding="utf-8") == demo_prompts(name)
    with pytest.raises(StrataError, match="unknown demo prompt set"):
        demo_prompts("test")
