"""remap-profile: the kit's expected bytes, a literal reference of the remap rules, fills, slots, guards."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stratatools.alloc.allocation import SurvivorMap, read_allocation
from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile, read_profile
from stratatools.profiles.remap import remap_full_to_pruned, remap_pruned_to_pruned


def reference_remap(pairs, to_new, n_layers, n_out, fill, slots=None):
    """Slow literal version of the rules (issue 3, formats.md 4): map, drop pruned and repeats, fill, cut."""
    out, seen = [], set()
    for l, e in pairs:
        n = to_new(l, e)
        if n is None or (l, n) in seen:
            continue
        seen.add((l, n))
        out.append((l, n))
    if fill == "layer-major":
        order = [(l, e) for l in range(n_layers) for e in range(n_out)]
    elif fill == "expert-major":
        order = [(l, e) for e in range(n_out) for l in range(n_layers)]
    else:
        order = []
    out += [p for p in order if p not in seen]
    return out if slots is None else out[:slots]


def test_kit_canonical_to_revA_bytes(kit):
    a = read_allocation(kit / "pruned/coder-revA.rco-allocation.txt")
    res = remap_full_to_pruned(read_profile(kit / "pruned/profile-canonical.bin"), a.survivor_map())
    assert res.profile.to_bytes() == (kit / "pruned/profile-revA.bin").read_bytes()
    assert res.totals() == {"input": 256, "kept": 128, "dropped_pruned": 128, "dropped_repeat": 0, "filled": 0,
                            "cut": 0, "output": 128}


def test_kit_revA_to_revB_bytes(kit, cli, tmp_path):
    out = tmp_path / "revB.bin"
    code, stdout, err = cli("remap-profile", kit / "pruned/profile-revA.bin", "-o", out,
                            "--from-alloc", kit / "pruned/coder-revA.rco-allocation.txt",
                            "--to-alloc", kit / "pruned/coder-revB.rco-allocation.txt", "--json")
    assert code == 0, err
    assert out.read_bytes() == (kit / "pruned/expected-profile-revA-remapped-to-revB.bin").read_bytes()
    d = json.loads(stdout)
    assert d["totals"]["kept"] + d["totals"]["dropped_pruned"] == 128
    assert d["totals"]["filled"] == d["totals"]["dropped_pruned"]  # complete in, complete out
    assert d["same_position"] == 42
    assert [r["kept"] + r["dropped_pruned"] for r in d["per_layer"]] == [16] * 8
    side = json.loads((tmp_path / "revB.bin.json").read_text())
    assert side["kind"] == "profile" and side["allocation"]["name"] == "coder-revB.rco-allocation.txt"
    assert side["options"]["fill"] == "layer-major"
    assert [i["role"] for i in side["inputs"]] == ["profile", "from-allocation", "to-allocation"]
    # the sidecar of the source is absent, so nothing is claimed about it
    assert side["source_profile_built_for"] is None


def test_kit_cli_full_with_model_check(kit, cli, tmp_path):
    out = tmp_path / "a.bin"
    code, stdout, err = cli("remap-profile", kit / "pruned/profile-canonical.bin", "-o", out,
                            "--alloc", kit / "pruned/coder-revA.rco-allocation.txt", "--model", kit / "pruned/coder-revA.gguf")
    assert code == 0, err
    assert out.read_bytes() == (kit / "pruned/profile-revA.bin").read_bytes()
    assert "kept 128, dropped 128 (pruned)" in stdout
    # wrong direction: a pruned profile given as if it were full
    code, _, err = cli("remap-profile", kit / "pruned/profile-revA.bin", "-o", tmp_path / "b.bin",
                       "--alloc", kit / "pruned/coder-revA.rco-allocation.txt")
    assert code == 2 and "8 layers x 16 experts" in err and "8 x 32" in err
    assert not (tmp_path / "b.bin").exists()


def test_guards(kit, cli, tmp_path):
    prof = tmp_path / "p.bin"
    prof.write_bytes((kit / "pruned/profile-revA.bin").read_bytes())
    ra, rb = kit / "pruned/coder-revA.rco-allocation.txt", kit / "pruned/coder-revB.rco-allocation.txt"
    code, _, err = cli("remap-profile", prof, "-o", prof, "--from-alloc", ra, "--to-alloc", rb)
    assert code == 2 and "overwrite the input" in err
    out = tmp_path / "o.bin"
    out.write_bytes(b"old")
    code, _, err = cli("remap-profile", prof, "-o", out, "--from-alloc", ra, "--to-alloc", rb)
    assert code == 2 and "--force" in err and out.read_bytes() == b"old"
    code, _, err = cli("remap-profile", prof, "-o", out, "--from-alloc", ra, "--to-alloc", rb, "--force")
    assert code == 0 and out.read_bytes() != b"old"
    code, _, err = cli("remap-profile", prof, "-o", tmp_path / "x.bin", "--from-alloc", ra)
    assert code == 2 and "go together" in err
    code, _, err = cli("remap-profile", prof, "-o", tmp_path / "x.bin", "--alloc", ra, "--from-alloc", ra, "--to-alloc", rb)
    assert code == 2 and "either --alloc" in err
    code, _, err = cli("remap-profile", prof, "-o", tmp_path / "x.bin", "--from-alloc", ra, "--to-alloc", rb, "--fill", "zigzag")
    assert code == 2 and "unknown fill" in err


def test_source_sidecar_is_compared(kit, cli, tmp_path):
    ra, rb = kit / "pruned/coder-revA.rco-allocation.txt", kit / "pruned/coder-revB.rco-allocation.txt"
    first = tmp_path / "b.bin"
    assert cli("remap-profile", kit / "pruned/profile-revA.bin", "-o", first, "--from-alloc", ra, "--to-alloc", rb)[0] == 0
    # remapping the revB profile again "from revA" contradicts its sidecar: warned, still done
    code, out, err = cli("remap-profile", first, "-o", tmp_path / "c.bin", "--from-alloc", ra, "--to-alloc", rb)
    assert code == 0 and "built for the --to-alloc allocation" in err
    side = json.loads((tmp_path / "c.bin.json").read_text())
    assert side["source_profile_built_for"]["name"] == "coder-revB.rco-allocation.txt"


def _random_map(rng, L, E_full, keep):
    return SurvivorMap(E_full, [np.sort(rng.choice(E_full, keep, replace=False)) for _ in range(L)], "m")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 5), st.integers(2, 12), st.sampled_from(["layer-major", "expert-major", "none"]),
       st.one_of(st.none(), st.integers(0, 40)), st.booleans())
def test_matches_literal_reference(seed, L, E_full, fill, slots, with_repeats):
    rng = np.random.default_rng(seed)
    keep = int(rng.integers(1, E_full + 1))
    old, new = _random_map(rng, L, E_full, keep), _random_map(rng, L, E_full, keep)
    # full -> pruned, from a partial profile (optionally with repeats, which Profile would refuse to write)
    n = int(rng.integers(0, L * E_full + 1))
    flat = rng.permutation(L * E_full)[:n]
    pairs = np.stack([flat // E_full, flat % E_full], axis=1)
    if with_repeats and n:
        pairs = np.concatenate([pairs, pairs[rng.integers(0, n, size=3)]])
    prof = Profile.__new__(Profile)
    prof.n_layers, prof.n_expert, prof.pairs, prof.slots = L, E_full, pairs.astype(np.int64), len(pairs)
    res = remap_full_to_pruned(prof, new, fill=fill, slots=slots)
    dense = {(l, int(o)): i for l, k in enumerate(new.kept) for i, o in enumerate(k)}
    want = reference_remap(pairs.tolist(), lambda l, e: dense.get((l, e)), L, keep, fill, slots)
    assert res.profile.pairs.tolist() == [list(p) for p in want]
    assert sum(res.kept) + sum(res.dropped_pruned) + sum(res.dropped_repeat) == len(pairs)
    # pruned -> pruned
    m = int(rng.integers(0, L * keep + 1))
    f2 = rng.permutation(L * keep)[:m]
    p2 = Profile(L, keep, np.stack([f2 // keep, f2 % keep], axis=1))
    res2 = remap_pruned_to_pruned(p2, old, new, fill=fill, slots=slots)
    want2 = reference_remap(p2.pairs.tolist(), lambda l, d: dense.get((l, int(old.kept[l][d]))), L, keep, fill, slots)
    assert res2.profile.pairs.tolist() == [list(p) for p in want2]
    if slots is None and fill != "none":
        assert res2.profile.complete


def test_revision_shape_errors():
    rng = np.random.default_rng(0)
    a = _random_map(rng, 2, 8, 4)
    b = _random_map(rng, 3, 8, 4)
    p = Profile(2, 4, [(0, 1)])
    with pytest.raises(StrataError, match="not revisions of one model"):
        remap_pruned_to_pruned(p, a, b)
    nonuni = SurvivorMap(8, [np.array([0, 1]), np.array([2, 3, 4])], "n")
    with pytest.raises(StrataError, match="different numbers of experts"):
        remap_full_to_pruned(Profile(2, 8, [(0, 0)]), nonuni)
    with pytest.raises(StrataError, match="must be 0 or more"):
        remap_full_to_pruned(Profile(2, 8, [(0, 0)]), a, slots=-1)


def test_existing_sidecar_needs_force(kit, cli, tmp_path):
    """remap-profile used to replace an existing <out>.json silently (make-profile refuses it)."""
    ra, rb = kit / "pruned/coder-revA.rco-allocation.txt", kit / "pruned/coder-revB.rco-allocation.txt"
    out = tmp_path / "o.bin"
    side = tmp_path / "o.bin.json"
    side.write_text('{"mine": 1}\n')
    code, _, err = cli("remap-profile", kit / "pruned/profile-revA.bin", "-o", out, "--from-alloc", ra, "--to-alloc", rb)
    assert code == 2 and "o.bin.json: already exists (pass --force" in err
    assert side.read_text() == '{"mine": 1}\n' and not out.exists()
    code, _, err = cli("remap-profile", kit / "pruned/profile-revA.bin", "-o", out, "--from-alloc", ra, "--to-alloc", rb,
                       "--force")
    assert code == 0 and json.loads(side.read_text())["allocation"]["name"] == "coder-revB.rco-allocation.txt"
    # the sidecar path may not be an input either
    prof = tmp_path / "q"
    prof.write_bytes((kit / "pruned/profile-revA.bin").read_bytes())
    alloc_named_like_sidecar = tmp_path / "r.json"
    alloc_named_like_sidecar.write_bytes(ra.read_bytes())
    code, _, err = cli("remap-profile", prof, "-o", tmp_path / "r", "--from-alloc", alloc_named_like_sidecar,
                       "--to-alloc", rb, "--force")
    assert code == 2 and "overwrite the input" in err and alloc_named_like_sidecar.read_bytes() == ra.read_bytes()
