"""Native pack: every field of every native_experts.txt line checked independently of the packer, on every kit
GGUF (split set included) and on synthetic releases; experts.bin slices; reuse, atomicity, determinism."""

from __future__ import annotations

import hashlib
import json
import random
import re
import struct
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from stratatools.core.errors import StrataError
from stratatools.model.gguf import open_model
from stratatools.pack.native import (EXPERTS_BIN, EXPERTS_SRC, NATIVE_TXT, pack_model, parse_native_experts, read_pack,
                              verify_pack)
from stratatools.synth.model import SynthConfig, synth_release


# ---------------------------------------------------------------- an independent GGUF header walker (test-only)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# (values per block, bytes per block): the gguf package's table plus Q2_0 = 64/18 (formats.md section 1)
_BLOCKS = {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
_BLOCKS[42] = (64, 18)


def walk(path: Path) -> tuple[int, dict[str, tuple[int, tuple[int, ...], int]], dict[str, object]]:
    """(data_start, {name: (type id, ne, absolute offset)}, scalar/str kv) read with plain struct calls."""
    b = path.read_bytes()[: 16 << 20]
    assert b[:4] == b"GGUF"
    _, nt, nkv = struct.unpack_from("<IQQ", b, 4)
    pos = 24
    kv: dict[str, object] = {}

    def rstr(pos: int) -> tuple[str, int]:
        n = struct.unpack_from("<Q", b, pos)[0]
        return b[pos + 8: pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

    def rval(t: int, pos: int) -> tuple[object, int]:
        if t == 8:
            return rstr(pos)
        if t == 9:
            et, n = struct.unpack_from("<IQ", b, pos)
            pos += 12
            items = []
            for _ in range(n):
                v, pos = rval(et, pos)
                items.append(v)
            return items, pos
        fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[t]
        return struct.unpack_from("<" + fmt, b, pos)[0], pos + _SIZES[t]

    for _ in range(nkv):
        k, pos = rstr(pos)
        t = struct.unpack_from("<I", b, pos)[0]
        v, pos = rval(t, pos + 4)
        kv[k] = v
    infos = []
    for _ in range(nt):
        name, pos = rstr(pos)
        nd = struct.unpack_from("<I", b, pos)[0]
        ne = struct.unpack_from(f"<{nd}Q", b, pos + 4)
        tid, off = struct.unpack_from("<IQ", b, pos + 4 + 8 * nd)
        pos += 4 + 8 * nd + 12
        infos.append((name, tid, ne, off))
    align = int(kv.get("general.alignment", 32))
    start = (pos + align - 1) // align * align
    return start, {n: (t, ne, start + o) for n, t, ne, o in infos}, kv


def nbytes(tid: int, ne: tuple[int, ...]) -> int:
    blk, size = _BLOCKS[tid]
    n = 1
    for d in ne[1:]:
        n *= d
    return ne[0] // blk * size * n


def check_pack_independently(model_path: Path, packdir: Path, samples: int = 3) -> None:
    """Every field of every line from the files themselves; experts.bin vs raw file bytes for sampled experts."""
    m = re.match(r"^(.+)-(\d{5})-of-(\d{5})\.gguf$", model_path.name)
    files = ([model_path.with_name(f"{m.group(1)}-{i:05d}-of-{m.group(3)}.gguf") for i in range(1, int(m.group(3)) + 1)]
             if m else [model_path])
    where: dict[str, tuple[Path, int, tuple[int, ...], int]] = {}
    kv0: dict[str, object] = {}
    for i, f in enumerate(files):
        _, infos, kv = walk(f)
        if i == 0:
            kv0 = kv
        for n, (t, ne, off) in infos.items():
            where[n] = (f, t, ne, off)
    arch = kv0["general.architecture"]
    n_trunk = int(kv0[f"{arch}.block_count"]) - int(kv0.get(f"{arch}.nextn_predict_layers", 0))
    E = where["blk.0.ffn_gate_inp.weight"][2][1]
    lines = (packdir / NATIVE_TXT).read_text().splitlines()
    head, rows = lines[0], lines[1:]
    split = any(len({where[f"blk.{L}.ffn_{r}_exps.weight"][0] for r in ("gate", "up", "down")}) > 1
                for L in range(n_trunk))
    assert head.startswith(f"# strata native experts v{4 if split else 3}: layer gu_type d_type offset blob_bytes ")
    assert f"(n_expert {E}, total " in head
    assert len(rows) == n_trunk
    running = 0
    binp = packdir / EXPERTS_BIN
    rng = random.Random(1)
    for L, row in enumerate(rows):
        toks = row.split(" ")
        g, u, d = (where[f"blk.{L}.ffn_{r}_exps.weight"] for r in ("gate", "up", "down"))
        assert int(toks[0]) == L
        assert int(toks[1]) == g[1] == u[1]
        assert int(toks[2]) == d[1]
        assert int(toks[3]) == running
        blob = nbytes(g[1], g[2]) // E + nbytes(u[1], u[2]) // E + nbytes(d[1], d[2]) // E
        # formats.md: 2*ff*row(gu, n_embd) + n_embd*row(d, ff)
        n_embd, ff = g[2][0], g[2][1]
        assert blob == 2 * ff * (n_embd // _BLOCKS[g[1]][0] * _BLOCKS[g[1]][1]) + n_embd * (ff // _BLOCKS[d[1]][0] * _BLOCKS[d[1]][1])
        assert int(toks[4]) == blob
        assert [int(x) for x in toks[5:8]] == [g[3], u[3], d[3]]
        names = ["" if x[0] == files[0] else x[0].name for x in (g, u, d)]
        if names == ["", "", ""]:
            assert len(toks) == 8
        elif len(set(names)) == 1:
            assert toks[8:] == [names[0]]
        else:
            assert toks[8:] == [",".join(names)]
        if binp.exists():
            with open(binp, "rb") as fb:
                for e in {0, E - 1, rng.randrange(E), rng.randrange(E)}:
                    fb.seek(running + e * blob)
                    got = fb.read(blob)
                    want = b""
                    for f, t, ne, off in (g, u, d):
                        s = nbytes(t, ne) // E
                        with open(f, "rb") as fh:
                            fh.seek(off + e * s)
                            want += fh.read(s)
                    assert got == want, (L, e)
        running += blob * E
    assert f"total {running};" in head
    if binp.exists():
        assert binp.stat().st_size == running


def kit_models(kit: Path) -> list[Path]:
    return [p for p in sorted(kit.glob("**/*.gguf")) if "imatrix" not in p.name]


def test_every_kit_gguf_packs_and_every_field_checks(kit, tmp_path):
    ms = kit_models(kit)
    assert len(ms) >= 10
    for p in ms:
        out = tmp_path / p.stem
        r = pack_model(p, out, experts_bin=True)
        assert r.experts_bin == "written"
        check_pack_independently(p, out)
        with open_model(p) as m:
            rep = verify_pack(read_pack(out), m)
            assert rep.ok, rep.problems


def test_pruned_kit_packs_with_16_experts(kit, tmp_path):
    for rev in ("revA", "revB"):
        r = pack_model(kit / f"pruned/coder-{rev}.gguf", tmp_path / rev)
        assert r.n_expert == 16 and r.version == 3 and r.experts_bin == "none"
        text = (tmp_path / rev / NATIVE_TXT).read_text()
        assert "(n_expert 16, total 2170880;" in text.splitlines()[0]


def test_kit_split_set_is_v4_with_per_role_column(kit, tmp_path):
    split = kit / "gguf/split/model-Q2_0-split-00001-of-00004.gguf"
    r = pack_model(split, tmp_path / "s", experts_bin=True)
    assert r.version == 4
    rows = (tmp_path / "s" / NATIVE_TXT).read_text().splitlines()[1:]
    s2, s3, s4 = (f"model-Q2_0-split-0000{i}-of-00004.gguf" for i in (2, 3, 4))
    # kit README section 5: blk.2 gate+up in shard 2, down in shard 1; blk.7 gate+down in shard 3, up in shard 4
    assert rows[2].split(" ")[8] == f"{s2},{s2},"
    assert rows[7].split(" ")[8] == f"{s3},{s4},{s3}"
    assert rows[0].count(" ") == 7  # all in shard 1: no column
    r2 = pack_model(kit / "quant/model-Q2_0.gguf", tmp_path / "w", experts_bin=True)
    assert r2.version == 3
    assert (tmp_path / "s" / EXPERTS_BIN).read_bytes() == (tmp_path / "w" / EXPERTS_BIN).read_bytes()
    # the same pack whichever shard is named
    pack_model(kit / "gguf/split/model-Q2_0-split-00003-of-00004.gguf", tmp_path / "s3")
    assert (tmp_path / "s3" / NATIVE_TXT).read_bytes() == (tmp_path / "s" / NATIVE_TXT).read_bytes()


# ------------------------------------------------------------------------------------------- synthetic
@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return synth_release(tmp_path_factory.mktemp("rel"), SynthConfig(n_layers=4, mtp=True, shards=3,
                                                                    ple_layers=(1,)))


def test_synth_shards_pack_and_check(release, tmp_path):
    for f in [release.canonical, release.revA.path, release.revB.path]:
        out = tmp_path / f.name
        r = pack_model(f, out, experts_bin=True)
        check_pack_independently(f, out)
        assert any("MTP block 4" in n for n in r.notes)
    r = pack_model(release.revA.path, tmp_path / "a2")
    assert r.n_expert == 16 and any("keeps 32 experts (trunk 16)" in n for n in r.notes)


def test_pack_is_deterministic_and_reuses_experts_bin(release, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    pack_model(release.canonical, a, experts_bin=True)
    pack_model(release.canonical, b, experts_bin=True)
    for n in (NATIVE_TXT, EXPERTS_BIN, EXPERTS_SRC, NATIVE_TXT + ".json"):
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    prov = json.loads((a / (NATIVE_TXT + ".json")).read_text())
    assert prov["kind"] == "pack" and len(prov["inputs"]) == 3
    assert prov["inputs"][0]["sha256"] == hashlib.sha256(release.canonical.read_bytes()).hexdigest()
    src = json.loads((a / EXPERTS_SRC).read_text())
    assert src["native_experts_sha256"] == hashlib.sha256((a / NATIVE_TXT).read_bytes()).hexdigest()
    assert [s["name"] for s in src["shards"]] == [p.name for p in release.canonical_files]
    r = pack_model(release.canonical, a, experts_bin=True, force=True)
    assert r.experts_bin == "reused" and r.bytes_copied == 0
    r = pack_model(release.canonical, a, force=True)
    assert r.experts_bin == "kept"


def test_stale_experts_bin_is_refused_or_rewritten(release, tmp_path):
    out = tmp_path / "p"
    pack_model(release.revA.path, out, experts_bin=True)
    with pytest.raises(StrataError, match="not cut from this model"):
        pack_model(release.revB.path, out, force=True)
    r = pack_model(release.revB.path, out, force=True, experts_bin=True)
    assert r.experts_bin == "written"
    check_pack_independently(release.revB.path, out)


def test_killed_run_leaves_previous_pack_untouched(release, tmp_path):
    out = tmp_path / "p"
    pack_model(release.revA.path, out, experts_bin=True)
    before = {n: (out / n).read_bytes() for n in (NATIVE_TXT, EXPERTS_BIN, EXPERTS_SRC)}
    seen = []

    def boom(n):
        seen.append(n)
        if len(seen) > 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack_model(release.revB.path, out, experts_bin=True, force=True, progress=boom)
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not (out / (EXPERTS_BIN + ".tmp")).exists()


def test_verify_pack_finds_tampering(release, tmp_path):
    out = tmp_path / "p"
    pack_model(release.revA.path, out, experts_bin=True)
    pk = read_pack(out)
    with open_model(release.revB.path) as m:
        assert not verify_pack(pk, m).ok  # other revision: same shape, other offsets/bytes
    data = bytearray((out / EXPERTS_BIN).read_bytes())
    data[pk.blob_offset(1, 0) + 3] ^= 0xFF
    (out / EXPERTS_BIN).write_bytes(bytes(data))
    with open_model(release.revA.path) as m:
        rep = verify_pack(read_pack(out), m)
    assert not rep.ok and "layer 1 expert 0" in rep.problems[0]


def test_read_pack_round_trip_and_blob_access(release, tmp_path):
    out = tmp_path / "p"
    r = pack_model(release.canonical, out, experts_bin=True)
    pk = read_pack(out)
    assert (pk.version, pk.n_expert, pk.total_bytes, pk.n_layers) == (r.version, 32, r.total_bytes, 4)
    assert pk.text() == (out / NATIVE_TXT).read_text()
    assert pk.source_name == release.canonical.name
    with open_model(release.canonical) as m:
        g = m.tensor("blk.2.ffn_gate_exps.weight")
        s = g.nbytes // 32
        assert pk.read_blob(2, 5)[:s] == bytes(m.raw(g, 5 * s, s))


# ------------------------------------------------------------------------------------------ the parser
GOOD = ("# strata native experts v3: layer gu_type d_type offset blob_bytes gate_off up_off down_off [shard] "
        "(n_expert 4, total 600; absolute offsets in m.gguf, or in the named shard beside it)\n"
        "0 42 42 0 100 10 20 30\n1 8 2 400 50 40 50 60 m-00002-of-00002.gguf\n")


def test_parser_accepts_and_rejects():
    p = parse_native_experts(GOOD)
    assert p.n_expert == 4 and p.total_bytes == 600 and p.layers[1].shards == ("m-00002-of-00002.gguf",) * 3
    bad = {
        GOOD.replace("v3", "v5"): "v5",
        GOOD.replace("1 8 2 400", "2 8 2 400"): "contiguous",
        GOOD.replace("1 8 2 400", "1 8 2 401"): "running sum",
        GOOD.replace("total 600", "total 601"): "add up",
        GOOD.replace("m-00002-of-00002.gguf", "a,b,c"): "needs v4",
        GOOD.replace("m-00002-of-00002.gguf", "a x"): "columns",
        GOOD.replace(" 42 42 ", " 42 999 "): "type id",
        GOOD.replace("(n_expert 4", "(n_expert x"): "n_expert",
        "0 42 42 0 100\n": "header",
    }
    for text, msg in bad.items():
        with pytest.raises(StrataError, match=msg):
            parse_native_experts(text, "t/native_experts.txt")
    v4 = GOOD.replace("v3", "v4").replace("m-00002-of-00002.gguf", "a,,b")
    assert parse_native_experts(v4).layers[1].shards == ("a", "", "b")


def _parses_or_fails_in_one_line(text: str) -> None:
    """parse_native_experts either raises a one-line StrataError or gives a table whose total is its sum."""
    try:
        p = parse_native_experts(text)
    except StrataError as e:
        assert "\n" not in str(e), str(e)
        return
    assert p.total_bytes == sum(ln.blob_bytes for ln in p.layers) * p.n_expert


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_parser_never_crashes_on_mutations(data):
    text = GOOD
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text)))
        kind = data.draw(st.sampled_from(["del", "ins", "sub"]))
        ch = data.draw(st.sampled_from(list("0123456789 ,\n#v()x-\u00e9\r")))
        if kind == "del":
            text = text[:i] + text[i + 1:]
        elif kind == "ins":
            text = text[:i] + ch + text[i:]
        else:
            text = text[:i] + ch + text[i + 1:]
    _parses_or_fails_in_one_line(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parser_never_crashes_on_random_text(text):
    _parses_or_fails_in_one_line(text)


def test_pread_fallback_gives_the_same_bytes(release, tmp_path, monkeypatch):
    from stratatools.pack import native as P
    pack_model(release.canonical, tmp_path / "k", experts_bin=True)
    monkeypatch.setattr(P._Copier, "__init__", lambda self: setattr(self, "kernel", False))
    pack_model(release.canonical, tmp_path / "f", experts_bin=True)
    assert (tmp_path / "k" / EXPERTS_BIN).read_bytes() == (tmp_path / "f" / EXPERTS_BIN).read_bytes()
