"""profile-diff: the kit's expected staleness numbers, top-K per layer, verdicts and exit codes, provenance."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stratatools.alloc.allocation import SurvivorMap
from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile, read_profile
from stratatools.profiles.diff import (default_slots_per_layer, diff_files, profile_vs_allocations, profile_vs_profile,
                                      stale_check_and_fix)


@pytest.fixture()
def revs(kit):
    p = kit / "pruned"
    return p / "profile-revA.bin", p / "coder-revA.rco-allocation.txt", p / "coder-revB.rco-allocation.txt"


def test_kit_expected_numbers(kit, revs):
    exp = json.loads((kit / "pruned/expected.json").read_text())
    prof, ra, rb = revs
    r = diff_files(prof, old_alloc=ra, new_alloc=rb)
    assert r.n_ranked == exp["profile_revA_pairs"] == 128
    assert r.still_same == exp["profile_revA_pairs_still_same_expert_in_revB"] == 42
    assert {str(i): v for i, v in enumerate(r.per_layer_changed)} == exp["survivor_index_changed_per_layer"]
    assert r.verdict == "stale" and r.exit_code == 1
    assert r.per_layer_lines_changed == [24] * 8 and r.groups_changed == 8
    # the registry knows the kit profile was built for revA
    assert r.built_for == "old" and r.built_for_release == "kit-coder@revA"


def test_kit_topk_independent(kit, revs):
    prof_p, ra, rb = revs
    prof = read_profile(prof_p)
    ka = json.loads((kit / "pruned/expected.json").read_text())["revA_kept"]
    kb = json.loads((kit / "pruned/expected.json").read_text())["revB_kept"]
    for k in (1, 4, 16):
        r = diff_files(prof_p, old_alloc=ra, new_alloc=rb, slots_per_layer=k)
        for layer in range(8):
            dense = [e for l, e in prof.pairs.tolist() if l == layer][:k]
            meant = {ka[str(layer)][d] for d in dense}
            now = {kb[str(layer)][d] for d in dense}
            t = r.top_k[layer]
            assert (t.overlap, t.fall_out, t.come_in) == (len(meant & now), sorted(meant - now), sorted(now - meant))
    assert r.top_k_overlap == sum(len(set(ka[str(l)]) & set(kb[str(l)])) for l in range(8))  # K = all 16


def test_cli_markdown_json_and_exit_codes(cli, revs, tmp_path):
    prof, ra, rb = revs
    code, out, err = cli("profile-diff", prof, "--old-alloc", ra, "--new-alloc", rb)
    assert code == 1, err
    assert "# profile-diff: STALE" in out and "**42 of 128**" in out and "| 0 | 14 | 24 |" in out
    code, out, err = cli("profile-diff", prof, "--old-alloc", ra, "--new-alloc", rb, "--json", "--max-stale", "0.7")
    assert code == 0
    d = json.loads(out)
    assert d["verdict"] == "tolerable" and d["still_same"] == 42 and abs(d["stale_fraction"] - 86 / 128) < 1e-6
    assert d["per_layer_changed"]["0"] == 14 and d["slots_per_layer"] == default_slots_per_layer(16) == 2
    rep = tmp_path / "r.md"
    code, out, _ = cli("profile-diff", prof, "--old-alloc", ra, "--new-alloc", rb, "--markdown", rep, "-k", "3")
    assert code == 1 and rep.read_text() == out and "Top-3 per layer" in out
    code, _, err = cli("profile-diff", prof, "--old-alloc", ra)
    assert code == 2 and "--new-alloc" in err
    code, _, err = cli("profile-diff", prof, "--old-alloc", rb, "--new-alloc", ra, "--max-stale", "2")
    assert code == 2


def test_fix_then_fresh_and_sidecar_says_new(kit, revs, tmp_path, cli):
    prof, ra, rb = revs
    before, fixed, after = stale_check_and_fix(prof, ra, rb, tmp_path / "fixed.bin")
    assert before.verdict == "stale" and before.still_same == 42
    assert fixed.profile.to_bytes() == (kit / "pruned/expected-profile-revA-remapped-to-revB.bin").read_bytes()
    assert after.verdict == "fresh" and after.still_same == 128
    # the remapped profile's sidecar names revB: diffing it "from revA" is answered from provenance
    code, out, err = cli("profile-diff", tmp_path / "fixed.bin", "--old-alloc", ra, "--new-alloc", rb, "--json")
    d = json.loads(out)
    assert code == 0 and d["verdict"] == "fresh" and d["built_for"] == "new"
    assert any("built for the new allocation" in n for n in d["notes"])


def test_two_profile_form(kit, revs, cli):
    prof, _, _ = revs
    code, out, err = cli("profile-diff", prof, prof, "--json")
    d = json.loads(out)
    assert code == 0 and d["verdict"] == "fresh" and d["still_same"] == 128 and d["spearman"] == 1.0
    other = kit / "pruned/expected-profile-revA-remapped-to-revB.bin"
    a, b = read_profile(prof), read_profile(other)
    same = sum(x == y for x, y in zip(a.pairs.tolist(), b.pairs.tolist()))
    code, out, err = cli("profile-diff", prof, other, "--json")
    d = json.loads(out)
    assert code == 1 and d["still_same"] == same
    code, out, err = cli("profile-diff", prof, kit / "pruned/profile-canonical.bin")
    assert code == 2 and "not of one model" in err
    code, out, err = cli("profile-diff", prof, other, "--old-alloc", revs[1])
    assert code == 2 and "not both" in err


def test_spearman_reversed():
    pairs = [(0, e) for e in range(5)]
    a = Profile(1, 5, pairs)
    b = Profile(1, 5, pairs[::-1])
    r = profile_vs_profile(a, b, slots_per_layer=2)
    assert r.spearman == pytest.approx(-1.0) and r.still_same == 1  # the middle pair
    assert r.top_k[0].fall_out == [0, 1] and r.top_k[0].come_in == [3, 4]


def test_coder_scale_user_report_shape():
    """A Coder-shaped re-release that re-indexes everything: few pairs survive, every layer changes."""
    rng = np.random.default_rng(4)
    old = SurvivorMap(512, [np.sort(rng.choice(512, 256, replace=False)) for _ in range(48)], "old")
    new = SurvivorMap(512, [np.sort(rng.choice(512, 256, replace=False)) for _ in range(48)], "new")
    flat = rng.permutation(48 * 256)
    prof = Profile(48, 256, np.stack([flat // 256, flat % 256], axis=1))
    r = profile_vs_allocations(prof, old, new, slots_per_layer=39)
    ot, nt = old.orig_table(), new.orig_table()
    assert r.still_same == int((ot[prof.pairs[:, 0], prof.pairs[:, 1]] == nt[prof.pairs[:, 0], prof.pairs[:, 1]]).sum())
    assert r.per_layer_changed == [int((x != y).sum()) for x, y in zip(ot, nt)]
    assert r.top_k_total == 48 * 39 and r.verdict == "stale"
    with pytest.raises(StrataError, match="pass the allocation the profile was built for"):
        profile_vs_allocations(Profile(48, 512, [(0, 0)]), old, new)


def test_dims_errors_name_the_files(kit, revs, cli):
    """The dims errors of both forms used to name no file."""
    prof, ra, rb = revs
    canon = kit / "pruned/profile-canonical.bin"
    code, out, err = cli("profile-diff", prof, canon)
    assert code == 2 and err.count("\n") == 1
    assert f"{canon}: byte 8: 8 layers x 32 experts but {prof} is 8 x 16" in err
    code, out, err = cli("profile-diff", canon, "--old-alloc", ra, "--new-alloc", rb)
    assert code == 2 and err.count("\n") == 1
    assert f"{canon}: byte 8: the profile is 8 layers x 32 experts but {ra.name} keeps 8 x 16" in err


def test_swapped_allocations_are_pointed_out(revs, cli):
    """The registry knows profile-revA.bin is revA's: with revA given as --new-alloc the verdict is fresh, and the
    note says the counts assume the other direction."""
    prof, ra, rb = revs
    code, out, err = cli("profile-diff", prof, "--old-alloc", rb, "--new-alloc", ra, "--json")
    d = json.loads(out)
    assert code == 0 and d["verdict"] == "fresh" and d["built_for"] == "new"
    assert any("built for the new allocation" in n and "swapped" in n for n in d["notes"])
