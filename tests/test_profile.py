"""STRP v1 profiles: byte layout, both trailers, strictness (errors with byte offsets), `profile show`."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile, parse_profile, read_profile, summarize


def strp(L, E, pairs, slots=None, trailer="rank", version=1, extra=b""):
    """Independent STRP writer (formats.md section 2) used to build fixtures."""
    pairs = list(pairs)
    n = len(pairs)
    head = b"STRP" + struct.pack("<5I", version, L, E, n if slots is None else slots, n)
    body = b"".join(struct.pack("<HH", l, e) for l, e in pairs)
    if trailer == "rank":
        table = [-1] * (L * E)
        for i, (l, e) in enumerate(pairs):
            table[l * E + e] = i
        tail = struct.pack(f"<{L * E}i", *table)
    elif trailer == "freq":
        tail = struct.pack(f"<{L * E}f", *[float((i * 7) % 5) for i in range(L * E)])
    else:
        tail = b""
    return head + body + tail + extra


def test_writer_bytes_match_independent_layout(tmp_path):
    rng = np.random.default_rng(0)
    flat = rng.permutation(6 * 5)[:17]
    pairs = [(int(f // 5), int(f % 5)) for f in flat]
    prof = Profile(6, 5, pairs)
    assert prof.to_bytes() == strp(6, 5, pairs)
    out = tmp_path / "p.bin"
    prof.write(out)
    assert out.read_bytes() == strp(6, 5, pairs)
    assert not (tmp_path / "p.bin.tmp").exists()
    back = read_profile(out)
    assert back.trailer == "rank" and back.warnings == []
    assert back.pairs.tolist() == [list(p) for p in pairs]
    assert back.slots == 17 and back.n_ranked == 17 and not back.complete


def test_kit_profiles(kit):
    c = read_profile(kit / "pruned/profile-canonical.bin", expect=(8, 32))
    assert (c.n_layers, c.n_expert, c.n_ranked, c.trailer) == (8, 32, 256, "rank")
    assert c.complete and c.warnings == []
    a = read_profile(kit / "pruned/profile-revA.bin")
    assert (a.n_layers, a.n_expert, a.n_ranked) == (8, 16, 128)
    assert len(set(map(tuple, a.pairs.tolist()))) == 128
    # bytes round-trip exactly
    assert a.to_bytes() == (kit / "pruned/profile-revA.bin").read_bytes()


def test_freq_trailer_is_read_and_named():
    data = strp(3, 4, [(0, 1), (2, 3)], trailer="freq")
    p = parse_profile(data)
    assert p.trailer == "freq"
    assert p.freq.shape == (3, 4) and p.freq[0, 1] == float((1 * 7) % 5)


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d[:10], "byte 10: truncated STRP header"),
    (lambda d: d[:2], "byte 2: truncated STRP header"),
    (lambda d: d[:24 + 4 * 3 + 2], "truncated pair list (3 of 5 pairs)"),
    (lambda d: b"STRQ" + d[4:], "byte 0: not an expert profile"),
    (lambda d: d[:16] + struct.pack("<I", 4) + d[20:], "byte 20: n_ranked 5 exceeds slots 4"),
])
def test_bad_profiles(mutate, needle):
    data = strp(4, 4, [(0, 0), (1, 2), (3, 3), (2, 1), (0, 3)])
    with pytest.raises(StrataError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_profile(mutate(data), "x.bin")


def test_dims_mismatch_and_pairs_errors():
    data = strp(4, 4, [(0, 0), (1, 2)])
    with pytest.raises(StrataError, match=r"x.bin: byte 8: profile is for 4 layers x 4 experts but the model has 4 x 8"):
        parse_profile(data, "x.bin", expect=(4, 8))
    dup = strp(4, 4, [(0, 0), (1, 2), (0, 0)], trailer="none")
    with pytest.raises(StrataError, match=r"byte 32: pair #2 \(layer 0, expert 0\) repeats an earlier pair"):
        parse_profile(dup, "x.bin")
    oor = strp(4, 4, [(0, 0), (1, 4)], trailer="none")
    with pytest.raises(StrataError, match=r"byte 28: pair #1 \(layer 1, expert 4\) is out of range"):
        parse_profile(oor, "x.bin")
    oor_layer = strp(4, 4, [(9, 0)], trailer="none")
    with pytest.raises(StrataError, match=r"byte 24: pair #0 \(layer 9"):
        parse_profile(oor_layer, "x.bin")


def test_warnings_trailing_bytes_and_inconsistent_trailer():
    p = parse_profile(strp(2, 2, [(0, 1), (1, 0)], extra=b"\x00\x01\x02"))
    assert p.trailer == "rank" and any("3 trailing bytes" in w for w in p.warnings)
    data = bytearray(strp(2, 2, [(0, 1), (1, 0)]))
    struct.pack_into("<i", data, len(data) - 4, 0)  # rank of (1,1) claims 0 though unranked
    p = parse_profile(bytes(data))
    assert any("disagrees with the pair list at 1 entries" in w for w in p.warnings)
    p = parse_profile(strp(2, 2, [(0, 1)], trailer="none"))
    assert p.trailer == "none" and any("no trailer" in w for w in p.warnings)


def test_summarize_independent():
    rng = np.random.default_rng(5)
    flat = rng.permutation(5 * 7)
    prof = Profile(5, 7, np.stack([flat // 7, flat % 7], axis=1))
    s = summarize(prof, top=3)
    pairs = prof.pairs.tolist()
    for layer in range(5):
        mine = [e for l, e in pairs if l == layer]
        row = s["layers"][layer]
        assert row["ranked"] == 7 and row["top"] == mine[:3]
        assert row["first_rank"] == next(i for i, (l, _) in enumerate(pairs) if l == layer)
        assert row["share_top"] == sum(1 for l, _ in pairs[:15] if l == layer)


def test_cli_profile_show(cli, kit):
    code, out, err = cli("profile", "show", kit / "pruned/profile-revA.bin", "--json", "-k", "3")
    assert code == 0, err
    d = json.loads(out)
    prof = read_profile(kit / "pruned/profile-revA.bin")
    assert d["n_ranked"] == 128 and d["trailer"] == "rank"
    assert sum(r["ranked"] for r in d["layers"]) == 128
    assert d["layers"][2]["top"] == [e for l, e in prof.pairs.tolist() if l == 2][:3]
    code, out, err = cli("profile", "show", kit / "pruned/profile-revA.bin")
    assert code == 0 and "8 layers x 16 experts" in out
    code, out, err = cli("profile", "show", kit / "pruned/profile-revA.bin", "--model", kit / "quant/model-ISTA-mix.gguf")
    assert code == 2 and err.count("\n") == 1 and "8 x 32" in err and "remap-profile" in err


def test_cli_bad_profile_exit_2(cli, tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(strp(3, 3, [(0, 0), (0, 0)]))
    code, out, err = cli("profile", "show", bad)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    code, out, err = cli("profile", "show", tmp_path / "missing.bin")
    assert code == 2 and "no such file" in err


_VALID = strp(3, 5, [(0, 1), (2, 4), (1, 0), (2, 2)])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(data):
    for d in (data, b"STRP" + data):
        try:
            p = parse_profile(d)
        except StrataError:
            continue
        assert p.n_ranked <= p.slots


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), max_size=6),
       st.integers(0, len(_VALID) + 8))
def test_mutated_profiles_never_crash(edits, cut):
    d = bytearray(_VALID)
    for pos, val in edits:
        d[pos] = val
    d = bytes(d[:cut]) if cut < len(d) else bytes(d) + b"\x00" * (cut - len(d))
    try:
        p = parse_profile(d, expect=(3, 5))
    except StrataError as e:
        assert "\n" not in str(e)
        return
    assert (p.n_layers, p.n_expert) == (3, 5)
    assert len(np.unique(p.flat())) == p.n_ranked


# -- review: implausible headers, bounded reads --------------------------------------------------------------

@pytest.mark.parametrize("L,E,needle", [
    (0xFFFFFFFF, 0xFFFFFFFF, "byte 8: 4294967295 layers x 4294967295 experts is implausible"),
    (65535, 65535, "byte 8: 65535 layers x 65535 experts is implausible"),
    (0, 16, "byte 8: 0 layers x 16 experts is implausible"),
    (8, 0, "byte 8: 8 layers x 0 experts is implausible"),
])
def test_implausible_dims_are_errors(cli, tmp_path, L, E, needle):
    """A header with absurd dims used to reach `profile show` (32 GiB allocation or an endless loop)."""
    data = b"STRP" + struct.pack("<5I", 1, L, E, 0, 0)
    with pytest.raises(StrataError, match=needle):
        parse_profile(data, "x.bin")
    p = tmp_path / "x.bin"
    p.write_bytes(data)
    code, out, err = cli("profile", "show", p)
    assert code == 2 and err.count("\n") == 1 and "implausible" in err
    with pytest.raises(StrataError, match="implausible"):
        Profile(L, E, np.zeros((0, 2), np.int64)).to_bytes()


def test_read_profile_reads_only_what_the_header_needs(tmp_path):
    """A multi-GB file passed by mistake must not be read whole: only header, pairs and one table."""
    import tracemalloc

    data = strp(3, 5, [(0, 1), (2, 4)])
    p = tmp_path / "big.bin"
    extra = 256 << 20
    with open(p, "wb") as fh:
        fh.write(data)
        fh.truncate(len(data) + extra)  # sparse: 256 MiB of trailing zeros
    tracemalloc.start()
    try:
        prof = read_profile(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (16 << 20), f"read_profile allocated {peak} bytes for a {len(data)}-byte profile"
    assert prof.trailer == "rank" and prof.pairs.tolist() == [[0, 1], [2, 4]]
    assert any(f"{extra} trailing bytes" in w for w in prof.warnings)
    # a GGUF (or anything else) passed as a profile: refused from its first bytes
    g = tmp_path / "model.gguf"
    with open(g, "wb") as fh:
        fh.write(b"GGUF" + b"\x03\x00\x00\x00")
        fh.truncate(extra)
    tracemalloc.start()
    try:
        with pytest.raises(StrataError, match="byte 0: not an expert profile"):
            read_profile(g)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (16 << 20)
    # a header claiming 2**32-1 ranked pairs in a small file: truncation, without allocating for the claim
    h = tmp_path / "n.bin"
    h.write_bytes(b"STRP" + struct.pack("<5I", 1, 8, 16, 0xFFFFFFFF, 0xFFFFFFFF) + b"\x00" * 40)
    tracemalloc.start()
    try:
        with pytest.raises(StrataError, match=r"byte 64: truncated pair list \(10 of 4294967295 pairs\)"):
            read_profile(h)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (16 << 20)


def test_summarize_many_layers_is_fast():
    """summarize is linear in pairs + layers (it used to scan every pair once per layer): 4M pairs over 4,096
    layers take about as long as 4M pairs over 64 layers (the per-layer scan: 64x as long, ~15 s). A ratio in
    the same run, not a wall-clock limit (a loaded machine made the 3 s limit fail)."""
    import time

    def timed(L, E):
        flat = np.random.default_rng(2).permutation(L * E)
        prof = Profile(L, E, np.stack([flat // E, flat % E], axis=1))
        t = time.process_time()
        s = summarize(prof, top=2)
        return time.process_time() - t, prof, s

    few, _, _ = timed(64, 65536)
    many, prof, s = timed(4096, 1024)
    L, E = 4096, 1024
    assert many < 8 * few + 0.5, (many, few)
    assert sum(r["ranked"] for r in s["layers"]) == L * E
    lay = prof.pairs[:, 0]
    assert s["layers"][77]["top"] == prof.pairs[lay == 77, 1][:2].tolist()
