"""Requested checks never become green skips; traces of another model are refused; --report folders.

Each case is an input a new-user break test found passing (or merging into the wrong folder)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stratatools.release.checks import FAIL
from stratatools.release.validate import ReleaseInputs, validate_release


def _extra_layer_trace(kit: Path, out: Path) -> Path:
    """The kit's revB routing CSV (8 layers) plus a copy of every layer-0 row as layer 9: a 10-layer trace."""
    lines = (kit / "pruned/coder-revB.routing.csv").read_text().splitlines()
    extra = []
    for ln in lines[1:]:
        f = ln.split(",")
        if f[3] == "0":
            f[3] = "9"
            extra.append(",".join(f))
    out.write_text("\n".join(lines + extra) + "\n")
    return out


@pytest.mark.parametrize("opts, words", [
    (("-t", "TRACE", "--min-hit-rate", "0.1", "--slots", "4"), "needs --profile"),      # the reported case
    (("--min-hit-rate", "0.1"), "needs --traces TRACE and --profile"),
    (("--profile", "PROF", "--min-hit-rate", "0.1"), "needs --traces TRACE;"),
    (("--slots", "4"), "--slots: only the hit-rate gate's budget"),
    (("--budget-gib", "1"), "--budget-gib: only the hit-rate gate's budget"),
    (("--previous-alloc", "ALLOC"), "add --previous"),
])
def test_requested_gate_without_its_inputs_is_refused(kit, cli, tmp_path, opts, words):
    p = kit / "pruned"
    sub = {"TRACE": p / "coder-revB.routing.csv", "PROF": p / "expected-profile-revA-remapped-to-revB.bin",
           "ALLOC": p / "coder-revA.rco-allocation.txt"}
    code, out, err = cli("validate-release", "--model", p / "coder-revB.gguf", *[sub.get(o, o) for o in opts],
                         "--junit", tmp_path / "r.xml")
    assert code == 2 and words in err and "Traceback" not in err and "PASS" not in out, (code, err)
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "r.xml").exists()


def test_requested_gate_fails_on_a_bad_trace_or_profile(kit, tmp_path):
    p = kit / "pruned"
    good = dict(model=p / "coder-revB.gguf", profile=p / "expected-profile-revA-remapped-to-revB.bin",
                traces=[p / "coder-revB.routing.csv"])
    garbage = tmp_path / "rand.bin"
    garbage.write_bytes(bytes(range(256)) * 12)
    wrong_prof = tmp_path / "wrong.bin"  # a profile of another geometry (32 experts): does not load
    shutil.copy(kit / "pruned/profile-canonical.bin", wrong_prof)
    for inp, what in ((dict(good, traces=[garbage]), "rand.bin"),
                      (dict(good, profile=wrong_prof), "not measured")):
        s = validate_release(ReleaseInputs(**inp), min_hit_rate=0.01, slots=64)
        c = {x.name: x for x in s.checks}["hit-rate"]
        assert c.status == FAIL and what in c.reason and s.exit_code == 1, c.reason
        # the reports say the same: a JUnit failure, not a skip
        assert '<failure message="' in s.to_junit().split('name="hit-rate"')[1].split("</testcase>")[0]
        assert s.to_dict()["checks"][-1]["status"] == "fail"
    # a trace of more layers than the model's trunk and MTP blocks is another model's: unusable input (exit 2), as
    # simulate and tune refuse it (tests/test_validate_extra_layers.py)
    from stratatools.core.errors import StrataError

    with pytest.raises(StrataError, match="routes layers up to 9"):
        validate_release(ReleaseInputs(**dict(good, traces=[_extra_layer_trace(kit, tmp_path / "l10.csv")])),
                         min_hit_rate=0.01, slots=64)
    # so is a trace with expert ids past the model's (the canonical model's 32-expert routing on the 16-expert
    # pruned model; tests/test_validate_other_model_ids.py)
    with pytest.raises(StrataError, match="is out of range for 16 experts"):
        validate_release(ReleaseInputs(**dict(good, traces=[kit / "routing/llamacpp-ISTA-mix.routing.csv"])),
                         min_hit_rate=0.01, slots=64)


def test_requested_gate_fails_when_the_model_does_not_open(kit, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    p = kit / "pruned"
    s = validate_release(ReleaseInputs(model=bad, profile=p / "profile-revA.bin",
                                       traces=[p / "coder-revB.routing.csv"]), min_hit_rate=0.1)
    c = {x.name: x for x in s.checks}
    assert c["hit-rate"].status == FAIL and "does not open" in c["hit-rate"].reason
    assert c["pack"].status == "skip"


def test_default_gate_budget_is_stated(kit, cli):
    p = kit / "pruned"
    code, out, err = cli("validate-release", "--model", p / "coder-revB.gguf", "--json",
                         "--profile", p / "expected-profile-revA-remapped-to-revB.bin",
                         "-t", p / "coder-revB.routing.csv", "--min-hit-rate", "0.01")
    hr = {c["name"]: c for c in json.loads(out)["checks"]}["hit-rate"]
    # 8 layers x round(16 x 39/256) = 8 x 2 slots
    assert hr["status"] == "pass" and hr["details"]["budget"].startswith("16 slots (default: 2 per layer")
