"""make-profile ranking against an independent, literal reference of formats.md section 4.

The reference below follows the section's five steps as a slow loop over records (dicts, sets and struct), the
way the text reads; it shares no code with stratatools.profiles.ranking. Traces go through real files (Strata binary
written here with struct) and the real reader.
"""

from __future__ import annotations

import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratatools.profiles.strp import read_profile
from stratatools.profiles.ranking import build_profile, count_pairs, make_profile, make_profile_files
from stratatools.traces.formats import read_trace


# -- the literal reference ---------------------------------------------------------------------------------------

def ref_profile_bytes(records, L, E, base_pairs=None, mode="default", fill="expert-major"):
    """formats.md section 4, literally. records: [(layer, [ids])]; base_pairs: [(layer, expert)] or None."""
    # 1. count (layer, expert) occurrences, weights ignored (pairs outside the model are not counted)
    freq = {}
    for layer, ids in records:
        for e in ids:
            if 0 <= layer < L and 0 <= e < E:
                freq[(layer, e)] = freq.get((layer, e), 0) + 1
    # 2. sort by count descending; ties: smaller layer, then smaller expert
    trace_pairs = sorted(freq.keys(), key=lambda p: (-freq[p], p[0], p[1]))
    # 3. concatenate without repeats, by mode
    ranked, seen = [], set()

    def take(pairs):
        for p in pairs:
            if p not in seen:
                seen.add(p)
                ranked.append(p)

    base_pairs = list(base_pairs or [])
    if mode == "default":
        take(base_pairs)
        take(trace_pairs)
    elif mode == "reorder":
        take(trace_pairs)
        take(base_pairs)
    elif mode == "no-base":
        take(trace_pairs)
    # 4. fill every pair not yet ranked
    if fill == "expert-major":
        take([(layer, e) for e in range(E) for layer in range(L)])
    else:
        take([(layer, e) for layer in range(L) for e in range(E)])
    # 5. STRP with n_ranked = slots = L*E, then the int32 rank table
    out = b"STRP" + struct.pack("<5I", 1, L, E, len(ranked), len(ranked))
    for layer, e in ranked:
        out += struct.pack("<HH", layer, e)
    slot = {p: i for i, p in enumerate(ranked)}
    for layer in range(L):
        for e in range(E):
            out += struct.pack("<i", slot.get((layer, e), -1))
    return out


def strata_bytes(records, weights=None):
    """Strata --dump-routing bytes: i32 layer, i32 k, k i32 ids, k f32 weights per record."""
    out = b""
    for i, (layer, ids) in enumerate(records):
        k = len(ids)
        w = weights[i] if weights is not None else [1.0 / k] * k
        out += struct.pack("<ii", layer, k) + struct.pack(f"<{k}i", *ids) + struct.pack(f"<{k}f", *w)
    return out


def ref_base_bytes(L, E, pairs):
    out = b"STRP" + struct.pack("<5I", 1, L, E, len(pairs), len(pairs))
    for p in pairs:
        out += struct.pack("<HH", *p)
    slot = {p: i for i, p in enumerate(pairs)}
    for layer in range(L):
        for e in range(E):
            out += struct.pack("<i", slot.get((layer, e), -1))
    return out


@st.composite
def trace_case(draw):
    L = draw(st.integers(1, 6))
    E = draw(st.integers(1, 12))
    n_rec = draw(st.integers(1, 40))
    records = []
    for _ in range(n_rec):
        kind = draw(st.sampled_from(["route"] * 8 + ["mtp", "tag"]))
        k = draw(st.integers(1, min(E, 5)))
        if kind == "route":
            layer = draw(st.integers(0, L - 1))
            ids = draw(st.lists(st.integers(0, E - 1), min_size=k, max_size=k, unique=True))  # a top-k
        elif kind == "mtp":  # an MTP block after the trunk may keep more experts
            layer = L
            ids = draw(st.lists(st.integers(0, 2 * E), min_size=k, max_size=k, unique=True))
        else:
            layer = draw(st.sampled_from([-1, -3, -4, -6, -9]))
            ids = draw(st.lists(st.integers(0, 1000), min_size=k, max_size=k))
        records.append((layer, ids))
    if records[0][0] == -2:
        records[0] = (0, [0])
    mode = draw(st.sampled_from(["default", "reorder", "no-base"]))
    fill = draw(st.sampled_from(["expert-major", "layer-major"]))
    base = None
    if draw(st.booleans()):
        allp = [(layer, e) for layer in range(L) for e in range(E)]
        perm = draw(st.permutations(allp))
        base = list(perm[:draw(st.integers(0, len(allp)))])
    return L, E, records, base, mode, fill


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace_case())
def test_make_profile_matches_literal_reference(case):
    L, E, records, base, mode, fill = case
    expected = ref_profile_bytes(records, L, E, base, mode, fill)
    with tempfile.TemporaryDirectory() as d:
        tp = os.path.join(d, "t.bin")
        with open(tp, "wb") as fh:
            fh.write(strata_bytes(records))
        base_path = None
        if base is not None:
            base_path = os.path.join(d, "base.bin")
            with open(base_path, "wb") as fh:
                fh.write(ref_base_bytes(L, E, base))
        out = os.path.join(d, "p.bin")
        res = make_profile_files([tp], out, L, E, base=base_path, mode=mode, fill=fill, max_layers=None)
        with open(out, "rb") as fh:
            got = fh.read()
    assert got == expected
    n_mtp = sum(len(ids) for layer, ids in records if layer >= L)
    assert res.skipped_layer == n_mtp
    assert res.used_entries == sum(len(ids) for layer, ids in records if 0 <= layer < L)


@settings(max_examples=60, deadline=None)
@given(trace_case(), st.integers(2, 4))
def test_merging_traces_equals_concatenating_them(case, parts):
    """Several traces of weight 1 rank like their concatenation (Strata sums counts over all traces)."""
    L, E, records, _, mode, fill = case
    expected = ref_profile_bytes(records, L, E, None, "no-base", fill)
    cut = np.linspace(0, len(records), parts + 1).astype(int)
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i in range(parts):
            chunk = records[cut[i]:cut[i + 1]]
            if not chunk:
                continue
            p = os.path.join(d, f"t{i}.bin")
            with open(p, "wb") as fh:
                fh.write(strata_bytes(chunk))
            paths.append(p)
        out = os.path.join(d, "p.bin")
        make_profile_files(paths, out, L, E, mode="no-base", fill=fill, max_layers=None)
        with open(out, "rb") as fh:
            assert fh.read() == expected


def test_trace_weights_scale_counts(tmp_path):
    """Weight 3 on one trace beats two copies of a competing pair in another."""
    a = tmp_path / "a.bin"
    b = tmp_path / "b.bin"
    a.write_bytes(strata_bytes([(0, [1])]))                 # (0,1) once
    b.write_bytes(strata_bytes([(0, [2]), (0, [2])]))       # (0,2) twice
    out = tmp_path / "p.bin"
    make_profile_files([str(a), str(b)], str(out), 1, 4, weights=[3.0, 1.0], mode="no-base")
    p = read_profile(out)
    assert p.pairs[:2].tolist() == [[0, 1], [0, 2]]
    out2 = tmp_path / "p2.bin"
    make_profile_files([str(a), str(b)], str(out2), 1, 4, weights=[1.0, 1.0], mode="no-base")
    assert read_profile(out2).pairs[:2].tolist() == [[0, 2], [0, 1]]


def test_weighting_by_router_weight_and_zero_weights(tmp_path):
    t = tmp_path / "t.bin"
    # expert 3 appears twice with weight 0.1, expert 5 once with 0.9 -> weight ranking puts 5 first
    t.write_bytes(strata_bytes([(0, [3, 5]), (0, [3, 4])], weights=[[0.1, 0.9], [0.1, 0.05]]))
    tbl = read_trace(t)
    r = count_pairs([tbl], 1, 8, weighting="weight")
    assert r.counts[0, 5] == pytest.approx(0.9, rel=1e-6)
    assert r.counts[0, 3] == pytest.approx(0.2, rel=1e-6)
    assert build_profile(r.counts, mode="no-base").pairs[0].tolist() == [0, 5]
    assert build_profile(count_pairs([tbl], 1, 8).counts, mode="no-base").pairs[0].tolist() == [0, 3]
    # a record of zero weights (a verify window) counts as unit weights
    z = tmp_path / "z.bin"
    z.write_bytes(strata_bytes([(0, [2, 6])], weights=[[0.0, 0.0]]))
    rz = count_pairs([read_trace(z)], 1, 8, weighting="weight")
    assert rz.counts[0, 2] == 1.0 and rz.counts[0, 6] == 1.0


def test_phase_decode_drops_prefill_only():
    from stratatools.traces.table import DECODE, PREFILL, UNKNOWN, TraceTable

    t = TraceTable(request=np.zeros(3), position=np.arange(3), phase=np.array([PREFILL, DECODE, UNKNOWN]),
                   layer=np.zeros(3), rank=np.zeros(3), expert=np.array([1, 2, 3]), weight=np.ones(3))
    r = count_pairs([t], 1, 4, phase="decode")
    assert r.counts[0].tolist() == [0, 0, 1, 1] and r.skipped_phase == 1
    assert count_pairs([t], 1, 4, phase="all").counts[0].tolist() == [0, 1, 1, 1]


def test_complete_base_hides_traces_in_default_mode(tmp_path):
    rng = np.random.default_rng(3)
    L, E = 3, 5
    perm = [tuple(p) for p in np.argwhere(np.ones((L, E)))[rng.permutation(L * E)].tolist()]
    (tmp_path / "base.bin").write_bytes(ref_base_bytes(L, E, perm))
    # expert 4 of layer 2 routed by three tokens (three records: one record's ids are distinct), expert 0 of layer 1
    (tmp_path / "t.bin").write_bytes(strata_bytes([(2, [4]), (2, [4]), (2, [4]), (1, [0])]))
    res = make_profile_files([str(tmp_path / "t.bin")], str(tmp_path / "p.bin"), L, E,
                             base=str(tmp_path / "base.bin"))
    assert (tmp_path / "p.bin").read_bytes() == (tmp_path / "base.bin").read_bytes()
    assert any("changed nothing" in w for w in res.warnings)
    assert (res.from_base, res.from_traces, res.from_fill) == (L * E, 0, 0)
    res2 = make_profile_files([str(tmp_path / "t.bin")], str(tmp_path / "p2.bin"), L, E,
                              base=str(tmp_path / "base.bin"), mode="reorder")
    assert read_profile(tmp_path / "p2.bin").pairs[0].tolist() == [2, 4]
    assert not any("changed nothing" in w for w in res2.warnings)
    assert (res2.from_base, res2.from_traces, res2.from_fill) == (L * E - 2, 2, 0)


# -- real input: the kit's canonical profile ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["routing/llamacpp-ISTA-mix.routing.csv",
                                  "routing/llamacpp-ISTA-mix.dump-routing.bin"])
def test_kit_canonical_profile_reproduced(kit, name):
    expected = (kit / "pruned" / "profile-canonical.bin").read_bytes()
    t = read_trace(kit / name, n_layers=8, n_expert=32)
    for mode in ("no-base", "default"):
        prof, res = make_profile([t], 8, 32, mode=mode)
        assert prof.to_bytes() == expected
        assert res.used_entries == (48 + 42 + 45) * 8 * 4  # 135 tokens x 8 layers x k=4


def test_kit_csv_and_dump_count_the_same(kit):
    a = read_trace(kit / "routing" / "llamacpp-ISTA-mix.routing.csv")
    b = read_trace(kit / "routing" / "llamacpp-ISTA-mix.dump-routing.bin")
    assert np.array_equal(count_pairs([a], 8, 32).counts, count_pairs([b], 8, 32).counts)


def test_kit_pruned_traces_against_16_experts(kit):
    """A pruned revision's traces carry dense ids 0..15 and work against the 16-expert model."""
    for rev in ("A", "B"):
        t = read_trace(kit / "pruned" / f"coder-rev{rev}.dump-routing.bin", n_layers=8, n_expert=16)
        c = read_trace(kit / "pruned" / f"coder-rev{rev}.routing.csv", n_layers=8, n_expert=16)
        assert int(t.expert.max()) <= 15
        ra, rb = count_pairs([t], 8, 16), count_pairs([c], 8, 16)
        assert np.array_equal(ra.counts, rb.counts) and ra.used_entries == len(t)
        p = build_profile(ra.counts, mode="no-base")
        assert p.complete and p.n_expert == 16
