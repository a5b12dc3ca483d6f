"""The CLI: make-profile, trace convert, trace stats (in-process through the `cli` fixture)."""

from __future__ import annotations

import json
import struct

from stratatools.profiles.strp import read_profile


def rec(layer, ids):
    k = len(ids)
    return struct.pack("<ii", layer, k) + struct.pack(f"<{k}i", *ids) + struct.pack(f"<{k}f", *([1.0 / k] * k))


def test_make_profile_kit_canonical_from_csv_and_dump(cli, kit, tmp_path):
    expected = (kit / "pruned" / "profile-canonical.bin").read_bytes()
    for i, src in enumerate(["routing/llamacpp-ISTA-mix.routing.csv", "routing/llamacpp-ISTA-mix.dump-routing.bin"]):
        out = tmp_path / f"p{i}.bin"
        code, o, e = cli("make-profile", kit / src, "-o", out, "--n-layer", 8, "--n-expert", 32, "--mode", "no-base",
                         "--json")
        assert code == 0, e
        assert out.read_bytes() == expected
        res = json.loads(o)
        assert res["used_entries"] == 4320 and res["from_traces"] == 256 and res["from_fill"] == 0
        side = json.loads((tmp_path / f"p{i}.bin.json").read_text())
        assert side["inputs"][0]["sha256"] == res["inputs"][0]["sha256"] and side["inputs"][0]["weight"] == 1.0
        assert side["options"]["mode"] == "no-base" and side["kind"] == "profile"


def test_make_profile_geometry_from_model(cli, kit, tmp_path):
    out = tmp_path / "p.bin"
    code, o, e = cli("make-profile", kit / "routing" / "llamacpp-ISTA-mix.dump-routing.bin", "-o", out,
                     "--model", kit / "quant" / "model-ISTA-mix.gguf")
    assert code == 0, e
    assert out.read_bytes() == (kit / "pruned" / "profile-canonical.bin").read_bytes()
    # a pruned revision: 16 experts from its routers; its dense-id trace fits
    out2 = tmp_path / "a.bin"
    code, o, e = cli("make-profile", kit / "pruned" / "coder-revA.dump-routing.bin", "-o", out2,
                     "--model", kit / "pruned" / "coder-revA.gguf", "--json")
    assert code == 0, e
    p = read_profile(out2)
    assert (p.n_layers, p.n_expert) == (8, 16) and p.complete
    # the full model's trace names experts >= 16: refused, one line, exit 2
    code, o, e = cli("make-profile", kit / "routing" / "llamacpp-ISTA-mix.dump-routing.bin", "-o", tmp_path / "x.bin",
                     "--model", kit / "pruned" / "coder-revA.gguf")
    assert code == 2 and "out of range for 16 experts" in e and len(e.strip().splitlines()) == 1
    assert not (tmp_path / "x.bin").exists()


def test_make_profile_pack_geometry(cli, tmp_path):
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "native_experts.txt").write_text(
        "# strata native experts v2: layer gu_type d_type offset blob_bytes (n_expert 4, total 96; x)\n"
        "0 8 8 0 8\n1 8 8 32 8\n2 8 8 64 8\n")
    t = tmp_path / "t.bin"
    t.write_bytes(rec(0, [3]) + rec(2, [1, 3]))
    out = tmp_path / "p.bin"
    code, o, e = cli("make-profile", t, "-o", out, "--pack", pack, "--json", "--mode", "no-base")
    assert code == 0, e
    res = json.loads(o)
    assert (res["n_layers"], res["n_expert"]) == (3, 4)
    assert res["skipped_layer"] == 0
    assert read_profile(out).pairs[:3].tolist() == [[0, 3], [2, 1], [2, 3]]
    # layer 3: a pack names no MTP block, so (as simulate does) the trace is another model's
    t.write_bytes(rec(0, [3]) + rec(2, [1, 3]) + rec(3, [0]))
    code, o, e = cli("make-profile", t, "-o", tmp_path / "q.bin", "--pack", pack)
    assert code == 2 and "routes layers up to 3 but the model has 3 trunk layers" in " ".join(e.split()), e


def test_make_profile_weights_and_warnings(cli, tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(rec(0, [1]))
    b.write_bytes(rec(0, [2]) + rec(0, [2]))
    out = tmp_path / "p.bin"
    code, o, e = cli("make-profile", f"{a}:3", f"{b}:1", "-o", out, "--n-layer", 1, "--n-expert", 4, "--json")
    assert code == 0, e
    assert read_profile(out).pairs[:2].tolist() == [[0, 1], [0, 2]]
    side = json.loads((tmp_path / "p.bin.json").read_text())
    assert [i["weight"] for i in side["inputs"]] == [3.0, 1.0]
    out2 = tmp_path / "p2.bin"
    code, o, e = cli("make-profile", a, b, "--weight", 1, "--weight", 1, "-o", out2, "--n-layer", 1, "--n-expert", 4)
    assert code == 0, e
    assert read_profile(out2).pairs[:2].tolist() == [[0, 2], [0, 1]]
    # complete base in default mode: warned, output = base
    out3 = tmp_path / "p3.bin"
    code, o, e = cli("make-profile", a, "-o", out3, "--n-layer", 1, "--n-expert", 4, "--base", out2)
    assert code == 0 and "changed nothing" in e
    assert out3.read_bytes() == out2.read_bytes()


def test_make_profile_errors(cli, tmp_path):
    t = tmp_path / "t.bin"
    t.write_bytes(rec(0, [1]))
    out = tmp_path / "p.bin"
    ok = ("--n-layer", 2, "--n-expert", 4)
    assert cli("make-profile", t, "-o", out, *ok)[0] == 0
    code, o, e = cli("make-profile", t, "-o", out, *ok)
    assert code == 2 and "--force" in e
    assert cli("make-profile", t, "-o", out, *ok, "--force")[0] == 0
    code, o, e = cli("make-profile", t, "-o", t, *ok, "--force")
    assert code == 2 and "overwrite the input" in e
    assert t.read_bytes() == rec(0, [1])
    code, o, e = cli("make-profile", t, "-o", tmp_path / "q.bin")
    assert code == 2 and "geometry" in e
    code, o, e = cli("make-profile", t, "-o", tmp_path / "q.bin", *ok, "--mode", "bogus")
    assert code == 2 and "mode" in e
    code, o, e = cli("make-profile", t, "-o", tmp_path / "q.bin", *ok, "--base", out, "--n-expert", 8)
    assert code == 2
    code, o, e = cli("make-profile", tmp_path / "missing.bin", "-o", tmp_path / "q.bin", *ok)
    assert code == 2 and "no such file" in e
    bad = tmp_path / "bad.bin"
    bad.write_bytes(rec(0, [1])[:-2])
    code, o, e = cli("make-profile", bad, "-o", tmp_path / "q.bin", *ok)
    assert code == 2 and "byte 0" in e and len(e.strip().splitlines()) == 1
    assert not (tmp_path / "q.bin").exists() and not (tmp_path / "q.bin.tmp").exists()


def test_trace_convert_and_stats(cli, kit, tmp_path):
    src = kit / "routing" / "llamacpp-ISTA-mix.routing.csv"
    pq = tmp_path / "t.parquet"
    code, o, e = cli("trace", "convert", src, "-o", pq, "--to", "parquet", "--json")
    assert code == 0, e
    assert json.loads(o)["entries"] == 4320
    st_bin = tmp_path / "t.bin"
    assert cli("trace", "convert", pq, "-o", st_bin, "--to", "strata")[0] == 0
    assert cli("trace", "convert", pq, "-o", st_bin, "--to", "strata")[0] == 2
    assert cli("trace", "convert", pq, "-o", tmp_path / "z", "--to", "xml")[0] == 2
    # a profile from the converted binary equals the canonical one
    out = tmp_path / "p.bin"
    assert cli("make-profile", st_bin, "-o", out, "--n-layer", 8, "--n-expert", 32)[0] == 0
    assert out.read_bytes() == (kit / "pruned" / "profile-canonical.bin").read_bytes()
    code, o, e = cli("trace", "stats", pq, "--json")
    assert code == 0, e
    s = json.loads(o)
    assert (s["entries"], s["tokens"], s["layers"], s["k_min"], s["k_max"], s["requests"]) == (4320, 135, 8, 4, 4, 3)
    assert all(ls["distinct_experts"] <= 32 for ls in s["per_layer"])
    assert 0.1 <= s["concentration"] <= 1
    code, o, e = cli("trace", "stats", src)
    assert code == 0 and "135 tokens" in o and "entropy" in o
    empty = tmp_path / "e.bin"
    empty.write_bytes(b"")
    code, o, e = cli("trace", "stats", empty)
    assert code == 2 and "empty" in e
