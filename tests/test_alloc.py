"""rco-allocation parsing, validation, survivor maps, export, model checks and router verification."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratatools.alloc.allocation import (check_against_model, diff_allocations, export_allocation, format_allocation,
                                    parse_allocation, read_allocation)
from stratatools.core.errors import StrataError
from stratatools.alloc.survivors import match_rows, verify_survivors

RNG = np.random.default_rng(11)


def small(L=3, E=8, keep=4, seed=0, **kw) -> tuple[str, list[list[int]]]:
    rng = np.random.default_rng(seed)
    kept = [sorted(rng.choice(E, keep, replace=False).tolist()) for _ in range(L)]
    s1 = {"token_embd.weight": "Q8_0", "blk.0.ffn_gate_inp.weight": "F32", "blk.4.ssm_a": "F32"}
    return format_allocation(kept, E, section1=s1, expert_types=("IQ2_XS", "IQ2_XS", "Q2_0"), **kw), kept


# -- kit ----------------------------------------------------------------------------------------------------

def test_kit_maps_match_expected(kit):
    exp = json.loads((kit / "pruned/expected.json").read_text())
    for rev in ("A", "B"):
        a = read_allocation(kit / f"pruned/coder-rev{rev}.rco-allocation.txt")
        sm = a.survivor_map()
        assert sm.n_layers == exp["n_layers"] and sm.n_original == exp["n_expert_full"]
        assert [k.tolist() for k in sm.kept] == [exp[f"rev{rev}_kept"][str(i)] for i in range(8)]
        assert (a.header_kept, a.header_original, a.header_layers) == (16, 32, 8)
        assert len(a.tensor_types) == 214 and a.n_entries == 214 + 8 * 3 * 32
        assert a.out_of_order_layers == [] and a.warnings == []
        # the dense table inverts the map
        dt = sm.dense_table()
        for layer, k in enumerate(sm.kept):
            assert dt[layer, k].tolist() == list(range(16))
            assert (dt[layer] >= 0).sum() == 16


def test_kit_diff_counts(kit):
    exp = json.loads((kit / "pruned/expected.json").read_text())
    a = read_allocation(kit / "pruned/coder-revA.rco-allocation.txt")
    b = read_allocation(kit / "pruned/coder-revB.rco-allocation.txt")
    d = diff_allocations(a, b)
    assert d.dense_changed_per_layer == [exp["survivor_index_changed_per_layer"][str(i)] for i in range(8)]
    # independent count of lines differing at the same position
    la = [l for l in (kit / "pruned/coder-revA.rco-allocation.txt").read_text().splitlines() if l and not l.startswith("#")]
    lb = [l for l in (kit / "pruned/coder-revB.rco-allocation.txt").read_text().splitlines() if l and not l.startswith("#")]
    assert d.entries_changed == sum(x.strip() != y.strip() for x, y in zip(la, lb))
    assert d.section1_changed == 0 and d.groups_changed == 8 and d.groups_total == 9
    assert d.dropped_per_layer == [4] * 8 and d.added_per_layer == [4] * 8


def test_kit_check_against_model(kit):
    a = read_allocation(kit / "pruned/coder-revA.rco-allocation.txt")
    mc = check_against_model(a, kit / "pruned/coder-revA.gguf")
    assert mc.ok and mc.router_counts == [16] * 8


def test_kit_type_mismatch_fails_check(cli, kit, tmp_path):
    text = (kit / "pruned/coder-revA.rco-allocation.txt").read_text()
    bad = tmp_path / "a.txt"
    bad.write_text(text.replace("blk.3.ffn_down_shexp.weight: Q8_0", "blk.3.ffn_down_shexp.weight: Q4_K"))
    mc = check_against_model(read_allocation(bad), kit / "pruned/coder-revA.gguf")
    assert mc.type_mismatches == [("blk.3.ffn_down_shexp.weight", "Q4_K", "Q8_0")]
    code, out, err = cli("alloc", "check", bad, "--model", kit / "pruned/coder-revA.gguf")
    assert code == 1 and "FAILED" in out and "Q4_K" in out


def test_kit_kept_count_disagrees_with_gguf(cli, kit, tmp_path):
    text = (kit / "pruned/coder-revA.rco-allocation.txt").read_text()
    for role, t in (("gate", "IQ3_XXS"), ("up", "IQ3_XXS"), ("down", "IQ4_NL")):
        text = text.replace(f"blk.0.ffn_{role}_exps.weight[1]: {t}", f"blk.0.ffn_{role}_exps.weight[1]: ")
    bad = tmp_path / "a.txt"
    bad.write_text(text)
    with pytest.raises(StrataError, match=r"line \d+: layer 0 keeps 15 experts but the router of coder-revA.gguf has 16"):
        check_against_model(read_allocation(bad), kit / "pruned/coder-revA.gguf")
    code, out, err = cli("alloc", "check", bad, "--model", kit / "pruned/coder-revA.gguf")
    assert code == 2 and err.count("\n") == 1 and "keeps 15 experts" in err


def test_kit_verify_routers(kit):
    full = kit / "quant/model-ISTA-mix.gguf"
    ra = kit / "pruned/coder-revA.rco-allocation.txt"
    rb = kit / "pruned/coder-revB.rco-allocation.txt"
    for rev, alloc in (("A", ra), ("B", rb)):
        res = verify_survivors(kit / f"pruned/coder-rev{rev}.gguf", full=full, alloc=alloc)
        assert res.ok and res.compared and res.n_unmatched == 0 and res.n_ambiguous == 0
        assert res.survivor_map().equals(read_allocation(alloc).survivor_map())
    # revA against revB: the expected dense->dense map from both texts
    res = verify_survivors(kit / "pruned/coder-revA.gguf", other=kit / "pruned/coder-revB.gguf", alloc=ra, other_alloc=rb)
    assert res.ok and res.n_unmatched == 4 * 8  # the 4 experts per layer revB dropped
    sa, sb = read_allocation(ra).survivor_map(), read_allocation(rb).survivor_map()
    for x in res.layers:
        want = [int(np.searchsorted(sb.kept[x.layer], o)) if o in sb.kept[x.layer] else -1 for o in sa.kept[x.layer]]
        assert x.match.tolist() == want
    # the wrong text is caught
    res = verify_survivors(kit / "pruned/coder-revA.gguf", full=full, alloc=rb)
    assert not res.ok and res.n_disagree == 86


def test_cli_verify(cli, kit):
    full = kit / "quant/model-ISTA-mix.gguf"
    code, out, err = cli("alloc", "verify", "--pruned", kit / "pruned/coder-revA.gguf", "--full", full,
                         "--alloc", kit / "pruned/coder-revA.rco-allocation.txt", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["ok"] and d["layers"][0]["match"] == json.loads((kit / "pruned/expected.json").read_text())["revA_kept"]["0"]
    code, out, err = cli("alloc", "verify", "--pruned", kit / "pruned/coder-revA.gguf", "--full", full,
                         "--alloc", kit / "pruned/coder-revB.rco-allocation.txt")
    assert code == 1 and "DISAGREES" in out
    code, out, err = cli("alloc", "verify", "--pruned", kit / "pruned/coder-revA.gguf")
    assert code == 2 and "exactly one reference" in err


def test_match_rows_unmatched_ambiguous_shared():
    ref = RNG.normal(size=(6, 4)).astype(np.float32)
    ref[5] = ref[2]  # identical rows in the reference
    pruned = np.stack([ref[0], ref[2], RNG.normal(size=4).astype(np.float32), ref[3], ref[3]])
    match, cands, shared = match_rows(pruned, ref)
    assert match.tolist() == [0, -2, -1, 3, 3]
    assert cands == {1: [2, 5]} and shared == [3]
    neg = ref.copy()
    neg[0, 0] = -0.0
    ref[0, 0] = 0.0
    m2, _, _ = match_rows(neg[:1], ref)
    assert m2.tolist() == [-1]  # bit-exact: -0.0 is not +0.0


# -- tolerance ---------------------------------------------------------------------------------------------

def test_tolerant_spellings_give_the_same_map():
    text, kept = small()
    base = parse_allocation(text.encode())
    assert [k.tolist() for k in base.survivor_map().kept] == kept
    variants = [
        "\ufeff" + text,
        text.replace("\n", "\r\n"),
        text.replace("]: \n", "]:\n"),
        text.replace(": ", " :   "),
        text.replace(": ", ":\t"),
    ]
    for v in variants:
        a = parse_allocation(v.encode("utf-8"))
        assert a.survivor_map().equals(base.survivor_map()), repr(v[:40])
        assert a.tensor_types == base.tensor_types
    alt = small(pruned_colon=":")[0]
    assert parse_allocation(alt.encode()).survivor_map().equals(base.survivor_map())


def test_out_of_order_listing_is_reported_not_trusted():
    text, kept = small(order="shuffled", seed=3)
    a = parse_allocation(text.encode(), "s.txt")
    assert [k.tolist() for k in a.survivor_map().kept] == kept
    assert a.out_of_order_layers == [0, 1, 2]
    assert any("not listed in ascending original index" in w for w in a.warnings)


def test_nonuniform_kept_counts_reported():
    kept = [[0, 1, 2], [1, 3], [0, 2, 3]]
    a = parse_allocation(format_allocation(kept, 4).encode())
    assert a.n_kept == [3, 2, 3]
    assert a.summary()["uniform_n_kept"] is None
    with pytest.raises(StrataError, match="layers keep different numbers of experts"):
        a.survivor_map().n_kept_required()


def test_section1_only_file():
    a = parse_allocation(b"# full release\noutput.weight: Q8_0\nblk.0.ssm_a: F32\n")
    assert not a.pruned and a.tensor_types == {"output.weight": "Q8_0", "blk.0.ssm_a": "F32"}
    with pytest.raises(StrataError, match="no Section 2"):
        a.survivor_map()


# -- bad input ---------------------------------------------------------------------------------------------

def _lines(text):
    return text.split("\n")


def test_missing_index():
    text, _ = small()
    ls = _lines(text)
    i = ls.index(next(l for l in ls if l.startswith("blk.1.ffn_up_exps.weight[5]")))
    del ls[i]
    with pytest.raises(StrataError, match=r"a.txt: line \d+: layer 1 up: original index 5 is missing"):
        parse_allocation("\n".join(ls).encode(), "a.txt")


def test_differing_gate_up_down_sets():
    text, kept = small()
    k = kept[2][0]
    ls = _lines(text)
    i = next(j for j, l in enumerate(ls) if l.startswith(f"blk.2.ffn_down_exps.weight[{k}]"))
    ls[i] = f"blk.2.ffn_down_exps.weight[{k}]: "
    with pytest.raises(StrataError, match=rf"line {i + 1}: layer 2: original expert {k} is kept for gate but pruned for down"):
        parse_allocation("\n".join(ls).encode(), "a.txt")


def test_garbage_line():
    text, _ = small()
    ls = _lines(text)
    ls.insert(7, "this is not an entry")
    with pytest.raises(StrataError, match=r"a.txt: line 8: not an allocation entry: 'this is not an entry'"):
        parse_allocation("\n".join(ls).encode(), "a.txt")
    ls = _lines(text)
    j = next(j for j, l in enumerate(ls) if l.startswith("blk.0.ffn_gate_exps.weight[2]"))
    ls[j] = "blk.0.ffn_gate_exps.weight[2: Q2_0"
    with pytest.raises(StrataError, match=rf"line {j + 1}: not an allocation entry"):
        parse_allocation("\n".join(ls).encode(), "a.txt")


def test_duplicate_entry_and_layer_gap_and_untyped_tensor():
    text, _ = small()
    ls = _lines(text)
    j = next(j for j, l in enumerate(ls) if l.startswith("blk.1.ffn_gate_exps.weight[3]"))
    ls.insert(j + 2, ls[j])
    with pytest.raises(StrataError, match=rf"line {j + 3}: blk.1.ffn_gate_exps.weight\[3\] is listed twice \(first at line {j + 1}\)"):
        parse_allocation("\n".join(ls).encode(), "a.txt")
    gap = "\n".join(l for l in _lines(text) if not l.startswith("blk.1.ffn_"))
    with pytest.raises(StrataError, match="layer 1 has no per-expert"):
        parse_allocation(gap.encode(), "a.txt")
    with pytest.raises(StrataError, match=r"line 2: tensor output.weight has no type"):
        parse_allocation(b"# x\noutput.weight: \n", "a.txt")
    with pytest.raises(StrataError, match=r"line 3: tensor output.weight is listed twice"):
        parse_allocation(b"output.weight: Q8_0\n\noutput.weight: Q8_0\n", "a.txt")
    with pytest.raises(StrataError, match=r"line 1 \(byte 2\): not UTF-8"):
        parse_allocation(b"ab\xff\n", "a.txt")


def test_cli_bad_allocation_exit_2(cli, tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("nonsense\n")
    for cmd in (("alloc", "show", p), ("alloc", "check", p), ("alloc", "export", p, "-o", tmp_path / "o.csv")):
        code, out, err = cli(*cmd)
        assert code == 2 and err.count("\n") == 1 and "line 1" in err and "Traceback" not in err
    assert not (tmp_path / "o.csv").exists()


# -- export ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["csv", "parquet", "json"])
def test_export_round_trip_and_deterministic(tmp_path, fmt, cli):
    text, kept = small(L=4, E=10, keep=5, seed=7)
    src = tmp_path / "a.rco-allocation.txt"
    src.write_text(text)
    out = tmp_path / f"m.{fmt}"
    code, _, err = cli("alloc", "export", src, "-o", out)
    assert code == 0, err
    if fmt == "csv":
        df = pd.read_csv(out, keep_default_na=False)
    elif fmt == "parquet":
        df = pd.read_parquet(out)
    else:
        doc = json.loads(out.read_text())
        df = pd.DataFrame(doc["rows"], columns=doc["columns"])
    assert list(df.columns) == ["layer", "new_index", "original_index", "gate_type", "up_type", "down_type"]
    want = [(l, i, o) for l, k in enumerate(kept) for i, o in enumerate(k)]
    assert list(zip(df.layer, df.new_index, df.original_index)) == want
    assert set(df.down_type) == {"Q2_0"} and set(df.gate_type) == {"IQ2_XS"}
    first = out.read_bytes()
    code, _, err = cli("alloc", "export", src, "-o", out)
    assert code == 2 and "--force" in err
    code, _, _ = cli("alloc", "export", src, "-o", out, "--force")
    assert code == 0 and out.read_bytes() == first


def test_export_entries_table(tmp_path):
    text, kept = small()
    a = parse_allocation(text.encode(), "a.txt")
    export_allocation(a, tmp_path / "e.csv", what="entries")
    df = pd.read_csv(tmp_path / "e.csv", keep_default_na=False)
    assert len(df) == 3 * 3 * 8
    assert df[df.kept & (df.role == "gate")].groupby("layer").original_index.apply(list).tolist() == kept
    with pytest.raises(StrataError, match="unknown export format"):
        export_allocation(a, tmp_path / "e.xlsx")


def test_cli_show_json(cli, kit):
    code, out, err = cli("alloc", "show", kit / "pruned/coder-revB.rco-allocation.txt", "--json")
    assert code == 0, err
    d = json.loads(out)
    exp = json.loads((kit / "pruned/expected.json").read_text())
    assert d["survivors"] == exp["revB_kept"] and d["n_kept_per_layer"] == [16] * 8 and d["total_pruned"] == 128
    code, out, err = cli("alloc", "show", kit / "pruned/coder-revB.rco-allocation.txt")
    assert code == 0 and "16 of 32 per layer (uniform)" in out


# -- full scale (correctness; timing lives in bench/bench_alloc.py) ----------------------------------------

def test_coder_scale_parse_and_diff():
    rng = np.random.default_rng(1)
    ka = [np.sort(rng.choice(512, 256, replace=False)) for _ in range(48)]
    kb = [np.sort(np.concatenate([k[:200], rng.choice(np.setdiff1d(np.arange(512), k), 56, replace=False)])) for k in ka]
    s1 = {f"blk.{l}.t{j}.weight": "Q8_0" for l in range(48) for j in range(25)}
    s1.update({f"g{i}.weight": "F32" for i in range(24)})
    a = parse_allocation(format_allocation(ka, 512, section1=s1).encode(), "a")
    b = parse_allocation(format_allocation(kb, 512, section1=s1).encode(), "b")
    assert a.n_entries == 74_952 and len(a.tensor_types) == 1224
    d = diff_allocations(a, b)
    assert d.dense_changed_per_layer == [int((x != y).sum()) for x, y in zip(ka, kb)]
    # lines changed at a position = originals whose kept state flipped, x3 roles
    assert d.lines_changed_per_layer == [3 * len(np.setxor1d(x, y)) for x, y in zip(ka, kb)]
    assert d.groups_changed == 48 and d.groups_total == 49


# -- property tests ----------------------------------------------------------------------------------------

_VALID = small(L=2, E=4, keep=2)[0].encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(data):
    try:
        parse_allocation(data, "r.txt")
    except StrataError as e:
        assert "\n" not in str(e)


_ALPHABET = st.sampled_from(list("blk.0123456789_:[] \t\r\n#ABQxffn_gateupdownexpsweight") + ["\ufeff", "\x00", "\xe9"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_VALID)), st.integers(0, 3), st.text(_ALPHABET, max_size=4)), max_size=5))
def test_mutated_allocations_never_crash(edits):
    d = _VALID.decode()
    for pos, kind, s in edits:
        pos = min(pos, len(d))
        if kind == 0:
            d = d[:pos] + s + d[pos:]
        elif kind == 1:
            d = d[:pos] + d[pos + len(s) + 1:]
        elif kind == 2:
            d = d[:pos] + s + d[pos + len(s):]
        else:
            d = d[:pos]
    try:
        a = parse_allocation(d.encode("utf-8"), "m.txt")
    except StrataError as e:
        assert "\n" not in str(e)
        return
    if a.pruned:
        sm = a.survivor_map()
        assert all((np.diff(k) > 0).all() for k in sm.kept)
        assert sum(sm.n_kept) == int(a.kept_mask.sum())


def test_kit_verify_against_shard_set(kit):
    """The full reference may be a gguf-split shard set (routers in any shard)."""
    res = verify_survivors(kit / "pruned/coder-revB.gguf", full=kit / "gguf/split/model-Q2_0-split-00003-of-00004.gguf",
                           alloc=kit / "pruned/coder-revB.rco-allocation.txt")
    assert res.ok and res.compared and res.n_disagree == 0
    with pytest.raises(StrataError, match="survivor map in original indices needs --full"):
        verify_survivors(kit / "pruned/coder-revB.gguf", other=kit / "pruned/coder-revA.gguf").survivor_map()


def test_type_warnings():
    t = format_allocation([[0, 1], [2, 3]], 4, section1={"blk.0.ffn_gate_exps.weight": "Q4_K"},
                          expert_types=("Q2_0", "Q4_0", "Q2_0"))
    a = parse_allocation(t.replace("blk.1.ffn_up_exps.weight[3]: Q4_0", "blk.1.ffn_up_exps.weight[3]: Q8_0").encode())
    assert any("1 (layer, role) groups keep experts of mixed types" in w for w in a.warnings)
    assert any("1 expert tensors have per-expert types that differ" in w and "blk.0.ffn_gate_exps.weight" in w
               for w in a.warnings)
    assert a.type_histogram() == {"Q2_0": 8, "Q4_0": 3, "Q8_0": 1}


# -- review: empty files, empty layers, header counts, truncated layers, binary files ------------------------

@pytest.mark.parametrize("data", [b"", b"\n\n", b"\xef\xbb\xbf# RCO allocation map\n# Experts: 16 of 32\n\n"])
def test_no_entries_is_an_error(cli, tmp_path, data):
    """An empty (or comment-only) file used to pass `alloc check`."""
    with pytest.raises(StrataError, match=r"e.txt: no allocation entries"):
        parse_allocation(data, "e.txt")
    p = tmp_path / "e.txt"
    p.write_bytes(data)
    code, out, err = cli("alloc", "check", p)
    assert code == 2 and err.count("\n") == 1 and "no allocation entries" in err


def test_layer_keeping_no_expert_is_an_error(cli, kit, tmp_path):
    """A layer with every expert pruned used to be accepted, and remap-profile wrote an L x 0 profile."""
    text = format_allocation([[0, 2], []], 4)
    last = max(i for i, l in enumerate(text.split("\n")) if l.startswith("blk.1.")) + 1
    with pytest.raises(StrataError, match=rf"a.txt: line {last}: layer 1 keeps no expert"):
        parse_allocation(text.encode(), "a.txt")
    a = tmp_path / "a.txt"
    a.write_text(text)
    from stratatools.profiles.strp import Profile
    Profile(2, 4, [(0, 1), (1, 2)]).write(tmp_path / "p.bin")
    code, out, err = cli("remap-profile", tmp_path / "p.bin", "--alloc", a, "-o", tmp_path / "o.bin")
    assert code == 2 and "keeps no expert" in err and not (tmp_path / "o.bin").exists()


def test_header_counts_named_in_errors():
    text, _ = small(L=2, E=8, keep=4)
    big = text.replace("4 of 8", "4 of 99999999")
    with pytest.raises(StrataError, match=r"line 2: the header states 99999999 original experts per layer"):
        parse_allocation(big.encode(), "a.txt")
    more = text.replace("4 of 8", "4 of 16")
    with pytest.raises(StrataError, match=r"original index 8 is missing .*the header states 16 original experts"):
        parse_allocation(more.encode(), "a.txt")


def test_allocation_missing_layers_of_the_model(cli, kit, tmp_path):
    """A file cut at a layer boundary (layers 4..7 gone) used to pass `alloc check --model`."""
    lines = (kit / "pruned/coder-revA.rco-allocation.txt").read_text().split("\n")
    last = max(i for i, l in enumerate(lines) if l.startswith("blk.3.ffn_down_exps"))
    cut = tmp_path / "cut.txt"
    cut.write_text("\n".join(lines[:last + 1]) + "\n")
    a = read_allocation(cut)
    assert a.n_layers == 4 and any("header says 8 layers" in w for w in a.warnings)
    with pytest.raises(StrataError, match=rf"cut.txt: line {last + 1}: Section 2 lists 4 layers but coder-revA.gguf "
                                          r"has 8 trunk layers with routers"):
        check_against_model(a, kit / "pruned/coder-revA.gguf")
    code, out, err = cli("alloc", "check", cut, "--model", kit / "pruned/coder-revA.gguf")
    assert code == 2 and err.count("\n") == 1 and "Section 2 lists 4 layers" in err


def test_binary_file_refused_without_reading_it_whole(tmp_path):
    import tracemalloc

    g = tmp_path / "model.gguf"
    with open(g, "wb") as fh:
        fh.write(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
        fh.truncate(256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(StrataError, match=r"model.gguf: line 1: NUL byte"):
            read_allocation(g)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (16 << 20)
