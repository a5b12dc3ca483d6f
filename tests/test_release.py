"""validate-release: the kit's stale-profile acceptance case, the fixed case, JUnit XML, exit codes."""

from __future__ import annotations

import json
import shutil

import junitparser
import pytest

from stratatools.release.checks import FAIL, PASS, SKIP
from stratatools.release.validate import ReleaseInputs, discover, validate_release


def _by_name(suite):
    return {c.name: c for c in suite.checks}


def test_stale_profile_on_revB_exits_1_and_names_the_check(kit, cli, tmp_path):
    p = kit / "pruned"
    junit = tmp_path / "r.xml"
    code, out, err = cli("validate-release", "--model", p / "coder-revB.gguf", "--alloc", p / "coder-revB.rco-allocation.txt",
                         "--profile", p / "profile-revA.bin", "--junit", junit, "--json-out", tmp_path / "r.json")
    assert code == 1, err
    assert "profile-stale" in out and "kit-coder@revA" in out
    xml = junitparser.JUnitXml.fromfile(str(junit))
    cases = {c.name: c for s in xml for c in s}
    assert set(cases) >= {"shards", "geometry", "allocation", "allocation-model", "profile-geometry", "profile-stale"}
    stale = cases["profile-stale"]
    assert not stale.is_passed and any(isinstance(r, junitparser.Failure) for r in stale.result)
    assert cases["geometry"].is_passed
    assert any(isinstance(r, junitparser.Skipped) for r in cases["pack"].result)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ok"] is False and data["counts"]["fail"] == 1


def test_reindexing_detected_without_provenance(kit, tmp_path):
    """A profile the registry does not know: --previous shows the re-indexing and fails the check."""
    p = kit / "pruned"
    prof = tmp_path / "unknown.bin"
    data = bytearray((p / "profile-revA.bin").read_bytes())
    # same pairs, different trailer bytes -> a digest the registry does not know; trailer is warned about only
    data[-1] ^= 0x01
    prof.write_bytes(bytes(data))
    s = validate_release(ReleaseInputs(model=p / "coder-revB.gguf", alloc=p / "coder-revB.rco-allocation.txt",
                                       profile=prof, previous=p / "coder-revA.gguf",
                                       previous_alloc=p / "coder-revA.rco-allocation.txt"))
    c = _by_name(s)
    assert c["survivor-map"].status == PASS
    assert c["survivor-map"].details["dense_indices_reindexed"] == 86  # kit expected.json: 14+9+6+14+11+12+6+14
    assert c["profile-stale"].status == FAIL
    # 128 pairs, 42 still name the same original expert (expected.json) -> at most 86 can move; dense-index
    # changes count pairs whose dense index now holds another expert
    assert 0 < c["profile-stale"].details["pairs_reindexed"] <= 128
    assert s.exit_code == 1


def test_remapped_profile_passes_with_full_model(kit):
    p = kit / "pruned"
    s = validate_release(ReleaseInputs(model=p / "coder-revB.gguf", alloc=p / "coder-revB.rco-allocation.txt",
                                       profile=p / "expected-profile-revA-remapped-to-revB.bin",
                                       full=kit / "quant/model-ISTA-mix.gguf"))
    c = _by_name(s)
    assert c["survivor-map"].status == PASS and c["profile-stale"].status == PASS
    assert s.exit_code == 0


def test_wrong_allocation_fails(kit):
    p = kit / "pruned"
    s = validate_release(ReleaseInputs(model=p / "coder-revB.gguf", alloc=p / "coder-revA.rco-allocation.txt",
                                       full=kit / "quant/model-ISTA-mix.gguf"))
    c = _by_name(s)
    assert c["survivor-map"].status == FAIL
    assert s.exit_code == 1


def test_pack_round_trip_and_hit_rate_gate(kit, tmp_path, cli):
    p = kit / "pruned"
    code, _, err = cli("pack", p / "coder-revB.gguf", "-o", tmp_path / "pack", "--experts-bin")
    assert code == 0, err
    base = dict(model=p / "coder-revB.gguf", pack=tmp_path / "pack",
                profile=p / "expected-profile-revA-remapped-to-revB.bin", traces=[p / "coder-revB.routing.csv"])
    ok = validate_release(ReleaseInputs(**base), min_hit_rate=0.05, slots=64)
    c = _by_name(ok)
    assert c["pack"].status == PASS and c["hit-rate"].status == PASS
    h = c["hit-rate"].details["h_expert"]
    assert 0.05 <= h <= 1.0
    strict = validate_release(ReleaseInputs(**base), min_hit_rate=min(1.0, h + 0.01), slots=64)
    assert _by_name(strict)["hit-rate"].status == FAIL
    # the gate's progress: one bar over its two passes (scan, replay), the same result
    import contextlib

    bars = []

    class _Bar:
        def __init__(self):
            self.done = 0.0

        def update(self, advance=0, **_):
            self.done += advance

    @contextlib.contextmanager
    def progress(what, total):
        bars.append((what, total, _Bar()))
        yield bars[-1][2]

    again = validate_release(ReleaseInputs(**base), min_hit_rate=0.05, slots=64, progress=progress)
    assert _by_name(again)["hit-rate"].details == c["hit-rate"].details
    assert [(w, t) for w, t, _ in bars] == [("hit-rate gate", 2)] and bars[0][2].done == pytest.approx(2.0)
    # corrupt one experts.bin byte: the round trip catches it
    binp = tmp_path / "pack" / "experts.bin"
    b = bytearray(binp.read_bytes())
    b[0] ^= 0xFF
    binp.write_bytes(bytes(b))
    bad = validate_release(ReleaseInputs(**base))
    assert _by_name(bad)["pack"].status == FAIL


def test_release_folder_discovery_and_unusable_input(kit, tmp_path, cli):
    rel = tmp_path / "rel"
    rel.mkdir()
    shutil.copy(kit / "pruned/coder-revA.gguf", rel)
    shutil.copy(kit / "pruned/coder-revA.rco-allocation.txt", rel)
    shutil.copy(kit / "pruned/profile-revA.bin", rel)
    inp = discover(rel)
    assert inp.model.name == "coder-revA.gguf" and inp.profile.name == "profile-revA.bin"
    code, out, _ = cli("validate-release", rel)
    assert code == 0, out
    code, _, err = cli("validate-release", tmp_path / "nope")
    assert code == 2 and "not a folder" in err and "Traceback" not in err
    code, _, err = cli("validate-release", "--model", kit / "pruned/coder-revA.gguf", "--profile", tmp_path / "missing.bin")
    assert code == 2 and "no such profile" in err


def test_broken_shard_set_is_a_failed_check(kit, tmp_path):
    d = tmp_path / "split"
    d.mkdir()
    for f in (kit / "gguf/split").glob("*.gguf"):
        if "00003" not in f.name:
            shutil.copy(f, d)
    s = validate_release(ReleaseInputs(model=d / "model-Q2_0-split-00001-of-00004.gguf"))
    c = _by_name(s)
    assert c["shards"].status == FAIL and "missing" in c["shards"].reason
    assert c["geometry"].status == SKIP
    assert s.exit_code == 1


# ---------------------------------------------------------------------------------------- review (issue 8)
def test_broken_shard_set_still_lists_every_check(kit, tmp_path):
    """One testcase per check in JUnit, whatever failed first: later checks are skipped, not dropped."""
    d = tmp_path / "split"
    d.mkdir()
    for f in (kit / "gguf/split").glob("*.gguf"):
        if not f.name.startswith("model-Q2_0-split-00004"):
            shutil.copy(f, d)
    s = validate_release(ReleaseInputs(model=d / "model-Q2_0-split-00001-of-00004.gguf",
                                       profile=kit / "pruned/profile-revA.bin"))
    names = [c.name for c in s.checks]
    assert names == ["shards", "geometry", "packable", "allocation", "allocation-model", "survivor-map",
                     "profile-geometry", "profile-stale", "pack", "hit-rate"]
    assert [c.status for c in s.checks].count(SKIP) == 9


def test_report_outputs_never_overwrite_inputs_and_need_force(kit, tmp_path, cli):
    p = kit / "pruned"
    alloc = tmp_path / "a.rco-allocation.txt"
    shutil.copy(p / "coder-revB.rco-allocation.txt", alloc)
    before = alloc.read_bytes()
    base = ("validate-release", "--model", p / "coder-revB.gguf", "--alloc", alloc)
    for opt in ("--json-out", "--junit", "--markdown"):
        code, _, err = cli(*base, opt, alloc, "--force")
        assert code == 2 and "overwrite the input" in err and "Traceback" not in err, (opt, err)
        assert alloc.read_bytes() == before
    out = tmp_path / "r.xml"
    out.write_text("old")
    code, _, err = cli(*base, "--junit", out)
    assert code == 2 and "--force" in err and out.read_text() == "old"
    code, _, err = cli(*base, "--junit", out, "--force")
    assert code == 0 and out.read_text().startswith("<?xml")
    code, _, err = cli(*base, "--junit", tmp_path / "same", "--markdown", tmp_path / "same")
    assert code == 2 and "same file" in err


@pytest.mark.parametrize("opts, words", [
    (("--slots", "-3"), "--slots"), (("--slots", "0"), "--slots"), (("--budget-gib", "-1"), "--budget-gib"),
    (("--budget-gib", "nan"), "--budget-gib"), (("--budget-gib", "inf"), "--budget-gib"),
    (("--slots", "8", "--budget-gib", "1"), "not both"),
])
def test_gate_budget_options_are_checked(kit, cli, opts, words):
    p = kit / "pruned"
    code, _, err = cli("validate-release", "--model", p / "coder-revB.gguf", "--profile", p / "profile-revA.bin",
                       "-t", p / "coder-revB.routing.csv", "--min-hit-rate", "0.1", *opts)
    assert code == 2 and words in err and "Traceback" not in err, err


def test_corrupt_sidecar_is_a_failed_check(kit, tmp_path):
    prof = tmp_path / "p.bin"
    shutil.copy(kit / "pruned/profile-revA.bin", prof)
    (tmp_path / "p.bin.json").write_text("garbage")
    s = validate_release(ReleaseInputs(model=kit / "pruned/coder-revB.gguf", profile=prof))
    c = _by_name(s)["profile-stale"]
    assert c.status == FAIL and "p.bin.json" in c.reason


def test_allocation_of_another_release_fails_by_registry(kit):
    """revB's GGUF with revA's allocation: types and kept counts agree (same pruning shape), but the
    registry knows both digests belong to different revisions."""
    p = kit / "pruned"
    s = validate_release(ReleaseInputs(model=p / "coder-revB.gguf", alloc=p / "coder-revA.rco-allocation.txt"))
    c = _by_name(s)["allocation-model"]
    assert c.status == FAIL and "kit-coder@revA" in c.reason and "kit-coder@revB" in c.reason


def test_discover_reads_only_the_magic_of_bin_files(tmp_path, kit, monkeypatch):
    rel = tmp_path / "rel"
    rel.mkdir()
    shutil.copy(kit / "pruned/coder-revA.gguf", rel)
    shutil.copy(kit / "pruned/profile-revA.bin", rel)
    (rel / "experts.bin").write_bytes(b"\0" * 4096)
    import pathlib

    def boom(self):
        raise AssertionError(f"read whole {self}")
    monkeypatch.setattr(pathlib.Path, "read_bytes", boom)
    assert discover(rel).profile.name == "profile-revA.bin"


def test_missing_registry_is_an_empty_registry(kit, tmp_path, monkeypatch, cli):
    """A broken install whose packaged registry is missing: the stale check still runs with --registry."""
    from stratatools.alloc import registry

    packaged = registry.DEFAULT_PATH
    monkeypatch.setattr(registry, "DEFAULT_PATH", tmp_path / "nope.toml")
    monkeypatch.delenv("STRATATOOLS_REGISTRY", raising=False)
    assert registry.load_registry().releases == []
    p = kit / "pruned"
    code, out, err = cli("validate-release", "--model", p / "coder-revB.gguf", "--profile", p / "profile-revA.bin",
                         "--registry", packaged)
    assert code == 1 and "kit-coder@revA" in out, err
    code, _, err = cli("validate-release", "--model", p / "coder-revB.gguf", "--registry", tmp_path / "none.toml")
    assert code == 2 and "none.toml" in err


def test_reports_on_stdout_and_gate_hint(kit, cli, tmp_path):
    p = kit / "pruned"
    base = ("validate-release", "--model", p / "coder-revB.gguf", "--profile", p / "profile-revA.bin")
    code, out, err = cli(*base, "--junit", "-")
    assert code == 1
    xml = junitparser.JUnitXml.fromstring(out.encode("utf-8"))  # bytes: lxml refuses str with a declaration
    assert {c.name for s in ([xml] if isinstance(xml, junitparser.TestSuite) else xml) for c in s} >= {"profile-stale"}
    assert not (tmp_path / "-").exists()
    code, out, err = cli(*base, "--markdown", "-")
    assert code == 1 and out.startswith("# validate-release") and "`profile-stale` | **FAIL**" in out
    code, _, err = cli(*base, "--junit", "-", "--json")
    assert code == 2 and "stdout" in err
    code, _, err = cli(*base, "-t", p / "coder-revB.routing.csv")
    assert code == 1 and "--min-hit-rate" in err


def test_sidecar_of_a_replaced_profile_is_not_trusted(kit, cli, tmp_path):
    """remap-profile records the output digest; a profile swapped under its sidecar fails profile-stale."""
    p = kit / "pruned"
    out = tmp_path / "revB.bin"
    code, _, err = cli("remap-profile", p / "profile-revA.bin", "--from-alloc", p / "coder-revA.rco-allocation.txt",
                       "--to-alloc", p / "coder-revB.rco-allocation.txt", "-o", out)
    assert code == 0, err
    side = json.loads((tmp_path / "revB.bin.json").read_text())
    from stratatools.core.fsutil import sha256_file

    assert side["output"]["sha256"] == sha256_file(out)
    base = dict(model=p / "coder-revB.gguf", alloc=p / "coder-revB.rco-allocation.txt", profile=out)
    assert _by_name(validate_release(ReleaseInputs(**base)))["profile-stale"].status == PASS
    shutil.copy(p / "profile-revA.bin", out)  # the stale profile under the fresh sidecar
    c = _by_name(validate_release(ReleaseInputs(**base)))["profile-stale"]
    assert c.status == FAIL and "describes another file" in c.reason
