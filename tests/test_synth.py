"""synth: the synthetic release mirrors the converter's qwen4exp layout, is deterministic, and its pruned
revisions are cut from the canonical model exactly like ISTA's (survivors in ascending original index)."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from stratatools.model.gguf import open_model
from stratatools.model.quantize import dequantize_q2_0, quantize, quantize_q2_0, random_blocks
from stratatools.synth.model import (SynthConfig, build_tokenizer, kept_sets, ple_head_vocab_sizes, ple_layer_multipliers,
                               synth_release)


@pytest.fixture(scope="module")
def rel(tmp_path_factory):
    return synth_release(tmp_path_factory.mktemp("rel"), SynthConfig(seed=7))


def test_mirrors_converter_layout(kit, tmp_path):
    cfg = SynthConfig(gu_types=("BF16",), down_types=("BF16",), dense_type="BF16", embd_type="BF16", revisions=False,
                    routing="legacy")  # legacy: the converter model's value scales (kit README section 2)
    r = synth_release(tmp_path / "bf16", cfg)
    with open_model(kit / "gguf/model-bf16.gguf") as k, open_model(r.canonical) as s:
        assert list(k.tensors) == list(s.tensors)  # names and file order
        V = len(s.kv["tokenizer.ggml.tokens"])
        for n, a in k.tensors.items():
            b = s.tensors[n]
            want = (a.ne[0], V) if n in ("token_embd.weight", "output.weight") else a.ne
            assert (b.ne, b.type.name) == (want, a.type.name), n
        assert set(k.kv) == set(s.kv) - {"stratatools.synthetic", "stratatools.synth.model.variant", "stratatools.synth.model.seed"}
        for key in k.kv:
            assert k.files[0].kv_types[key] == s.files[0].kv_types[key], key
        same = [key for key in k.kv if key.startswith("qwen4exp.") and key not in (
            "qwen4exp.ple.eos_token_id", "qwen4exp.ple.layer_multipliers")]
        for key in same:
            assert np.array_equal(np.asarray(k.kv[key]), np.asarray(s.kv[key])), key
        assert s.kv["stratatools.synthetic"] is True and s.kv["general.name"].endswith("(synthetic)")
        # value scales of the converter's model (kit README section 2)
        assert abs(s.array("blk.0.ffn_gate_inp.weight").std() - 0.1) < 0.01
        assert abs(s.array("blk.0.ffn_gate_exps.weight").std() - 0.02) < 0.002
        assert abs(s.array("blk.0.hc_attn_norm.weight").mean() - 1.0) < 0.02
        assert (s.array("blk.0.ssm_a") < 0).all()


def test_ple_hash_constants_match_kit(kit):
    with open_model(kit / "gguf/model-bf16.gguf") as k:
        assert ple_layer_multipliers(1024, 3, 0, 1234) == [int(x) for x in k.kv["qwen4exp.ple.layer_multipliers"]]
        assert ple_head_vocab_sizes(1000, 4) == [int(x) for x in k.kv["qwen4exp.ple.head_vocab_sizes"]]


def test_tokenizer_is_consistent():
    t = build_tokenizer(512)
    assert len(set(t.tokens)) == len(t.tokens) and t.tokens[t.eos_id] == "<|endoftext|>"
    assert t.tokens[:3] == ("!", '"', "#") and len(t.tokens) > 300
    vocab = set(t.tokens)
    for m in t.merges:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab


def _plain_bpe(vocab_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Reference BPE: recount every pair of the whole text before each merge (what build_tokenizer must equal)."""
    from collections import Counter

    from stratatools.synth.model import _CORPUS, _PRETOK, _SPECIALS, byte_to_unicode

    bmap = byte_to_unicode()
    vocab = [bmap[b] for b in bmap]
    words = Counter(tuple(bmap[b] for b in w.encode("utf-8")) for w in _PRETOK.findall(_CORPUS))
    merges = []
    while len(vocab) < vocab_size - len(_SPECIALS):
        pairs: Counter = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        (a, b), cnt = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if cnt < 2:
            break
        merges.append(f"{a} {b}")
        if a + b not in vocab:
            vocab.append(a + b)
        nw: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            nw[tuple(out)] += c
        words = nw
    return tuple(vocab) + _SPECIALS, tuple(merges)


@pytest.mark.parametrize("vocab", [260, 300, 512, 4096])
def test_tokenizer_equals_plain_bpe(vocab):
    # the incremental learner (pair counts kept up to date, heap) makes exactly the merges of a full recount
    t = build_tokenizer(vocab)
    tokens, merges = _plain_bpe(vocab)
    assert t.merges == merges and t.tokens == tokens
    assert len(t.merges) >= 1
    if vocab == 512:
        assert (len(t.tokens), len(t.merges)) == (391, 132)  # the built-in text runs out of repeated pairs


def test_deterministic_for_a_seed(rel, tmp_path):
    again = synth_release(tmp_path / "again", SynthConfig(seed=7))
    for a, b in [(rel.canonical, again.canonical), (rel.revA.path, again.revA.path),
                 (rel.revB.allocation, again.revB.allocation), (rel.manifest, again.manifest)]:
        assert a.read_bytes() == b.read_bytes(), a.name
    other = synth_release(tmp_path / "other", replace(SynthConfig(seed=8), revisions=False))
    assert other.canonical.read_bytes() != rel.canonical.read_bytes()


def test_pruned_revisions_are_cut_from_canonical(rel):
    cfg = rel.config
    with open_model(rel.canonical) as c:
        for rev in (rel.revA, rel.revB):
            with open_model(rev.path) as p:
                assert p.key("expert_count") == cfg.keep
                for L in range(cfg.n_layers):
                    ks = rev.kept[L]
                    assert ks == sorted(ks) and len(set(ks)) == cfg.keep
                    rc, rp = c.array(f"blk.{L}.ffn_gate_inp.weight"), p.array(f"blk.{L}.ffn_gate_inp.weight")
                    assert np.array_equal(rp, rc[ks])
                    for role in ("gate", "up", "down"):
                        tc, tp = c.tensor(f"blk.{L}.ffn_{role}_exps.weight"), p.tensor(f"blk.{L}.ffn_{role}_exps.weight")
                        s = tc.nbytes // cfg.n_expert
                        for new, orig in enumerate(ks):
                            assert bytes(p.raw(tp, new * s, s)) == bytes(c.raw(tc, orig * s, s))
                assert bytes(p.raw("blk.0.attn_qkv.weight")) == bytes(c.raw("blk.0.attn_qkv.weight"))
    for L in range(cfg.n_layers):
        a, b = set(rel.revA.kept[L]), set(rel.revB.kept[L])
        assert len(a - b) == cfg.swap == len(b - a)


def test_allocation_files_follow_ista_layout(rel):
    cfg = rel.config
    for rev in (rel.revA, rel.revB):
        lines = rev.allocation.read_text().splitlines()
        assert lines[0].startswith("# RCO allocation map") and lines[2] == f"# Experts: {cfg.keep} of {cfg.n_expert} retained per layer, {cfg.n_layers} layers"
        s2 = [ln for ln in lines if re.match(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.weight\[\d+\]:", ln)]
        assert len(s2) == cfg.n_layers * 3 * cfg.n_expert
        with open_model(rev.path) as m:
            s1 = [ln for ln in lines if ln and not ln.startswith("#") and ln not in s2]
            assert {ln.split(": ")[0]: ln.split(": ")[1] for ln in s1} == {n: t.type.name for n, t in m.tensors.items()}
            for ln in s2:
                mm = re.match(r"^blk\.(\d+)\.ffn_(\w+)_exps\.weight\[(\d+)\]: ?(\S*)$", ln)
                L, role, i, ty = int(mm.group(1)), mm.group(2), int(mm.group(3)), mm.group(4)
                if i in rev.kept[L]:
                    assert ty == m.tensor(f"blk.{L}.ffn_{role}_exps.weight").type.name
                else:
                    assert ty == ""


def test_kept_sets_differ_between_revisions():
    ks = kept_sets(SynthConfig())
    assert ks["revA"] != ks["revB"]
    assert ks == kept_sets(SynthConfig())


def test_q2_0_quantizer_round_trip_and_kit_layout(kit):
    rng = np.random.default_rng(0)
    x = 0.02 * rng.standard_normal((64, 256)).astype(np.float32)
    q = quantize_q2_0(x)
    assert q.shape == (64, 256 // 64 * 18)
    y = dequantize_q2_0(q)
    rel_err = np.linalg.norm(y - x) / np.linalg.norm(x)
    assert rel_err < 0.6  # 2-bit: 4 levels per block
    assert np.array_equal(quantize(x, "Q2_0"), q)
    # reading the kit's llama-quantize Q2_0 with our dequantizer tracks the BF16 original
    with open_model(kit / "quant/model-Q2_0.gguf") as mq, open_model(kit / "gguf/model-bf16.gguf") as mb:
        t = mq.tensor("blk.0.ffn_gate_exps.weight")
        deq = dequantize_q2_0(np.asarray(mq.raw(t)).reshape(-1, 256 // 64 * 18))
        ref = mb.array("blk.0.ffn_gate_exps.weight").reshape(-1, 256)
        c = np.corrcoef(deq.ravel(), ref.ravel())[0, 1]
        assert c > 0.7  # a wrong code layout gives ~0
        ours = dequantize_q2_0(quantize_q2_0(ref))
        assert np.linalg.norm(ours - ref) <= 1.05 * np.linalg.norm(deq - ref)


@pytest.mark.parametrize("tname", ["Q8_0", "Q4_0"])
def test_q8_0_q4_0_equal_gguf_quants(tname):
    # our quantizers (no gguf import at run time) give gguf.quants' bytes: normals, exact halves, zeros, ties
    import gguf
    from gguf.quants import quantize as gq

    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 256)).astype(np.float32) * 0.02
    x[0] = 0.0
    x[1, :32] = np.arange(32, dtype=np.float32) - 15.5          # halves after scaling
    x[2, :32] = np.float32(-1.0)                                  # one value of largest magnitude, negative
    x[3, :32] = np.tile(np.float32([1.0, -1.0]), 16)             # |max| tie between signs
    x[4] = rng.integers(-127, 128, 256).astype(np.float32) / 2   # ties in roundf
    want = np.ascontiguousarray(gq(x, gguf.GGMLQuantizationType[tname]), dtype=np.uint8)
    got = quantize(x, tname)
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.array_equal(got, want)
    assert np.array_equal(quantize(x[5:7, :64].reshape(2, 64), tname), want[5:7, :want.shape[1] // 4])


@pytest.mark.parametrize("tname", ["Q2_0", "IQ2_XS", "Q8_0"])
def test_random_tensor_pieces_keep_the_frame_stream(monkeypatch, tname):
    # random tensors are handed on in small pieces, but the bytes are those of whole frames drawn at once (a seed
    # gives the same model whatever the piece size); frames end mid-word for these block sizes
    import zlib

    import stratatools.synth.model as sm
    from stratatools.model.ggml_types import type_by_name
    from stratatools.synth.model import TSpec, _producer

    t = type_by_name(tname)
    monkeypatch.setattr(sm, "_RANDOM_FRAME_BYTES", 37 * t.type_size + 3)   # 37 blocks a frame
    monkeypatch.setattr(sm, "_CHUNK_BYTES", 5 * t.type_size)               # pieces of 4 or 8 blocks
    sp = TSpec("blk.0.ffn_up_exps.weight", (t.block_size * 10, 9, 1), t, random=True)  # 90 blocks: 37 + 37 + 16
    pieces = list(_producer(sp, 11)())
    assert len(pieces) > 3 and all(p.nbytes <= 8 * t.type_size for p in pieces)
    rng = np.random.default_rng([11, zlib.crc32(sp.name.encode("utf-8"))])
    want = np.concatenate([random_blocks(t, n, rng) for n in (37, 37, 16)])
    assert np.array_equal(np.concatenate(pieces), want)


def test_random_blocks_are_sane():
    rng = np.random.default_rng(1)
    for t in ("Q2_0", "IQ2_XS", "IQ4_NL", "IQ3_XXS"):
        b = random_blocks(t, 1000, rng)
        d = b[:, :2].copy().view("<f2").astype(np.float32)
        assert np.isfinite(d).all() and (d > 0).all() and d.max() < 0.05
    b = random_blocks("Q2_0", 4096, np.random.default_rng(2))
    v = dequantize_q2_0(b.reshape(1, -1))
    assert 0.005 < v.std() < 0.05


def test_full_width_config_geometry():
    cfg = SynthConfig.full_width()
    cfg.validate()
    assert (cfg.hidden, cfg.expert_ff, cfg.n_expert, cfg.k, cfg.n_layers) == (2560, 640, 512, 10, 8)
    assert cfg.context_length == 131072 and cfg.indexer_top_k == 2048  # 8k+ contexts fit, past full selection
    assert {cfg.gu_type(i).name for i in range(8)} == {"Q2_0", "IQ2_XS"}
    assert {cfg.down_type(i).name for i in range(8)} == {"Q2_0", "IQ4_NL"}


def test_full_width_small_write_is_valid(tmp_path, cli):
    # the full-width code path (random valid i-quant blocks) on 2 layers of a narrower model
    code, out, err = cli("synth", tmp_path / "fw", "--full-width", "--layers", "2", "--hidden", "256",
                         "--expert-ff", "128", "--experts", "16", "--json")
    assert code == 0, err
    code, out, err = cli("pack", tmp_path / "fw/synth-canonical.gguf", "-o", tmp_path / "p", "--experts-bin")
    assert code == 0, err
    with open_model(tmp_path / "fw/synth-canonical.gguf") as m:
        assert m.tensor("blk.1.ffn_gate_exps.weight").type.name == "IQ2_XS"
        assert m.tensor("blk.1.ffn_down_exps.weight").type.name == "IQ4_NL"
        assert m.key("expert_used_count") == 10 and m.key("expert_count") == 16


def test_cli_synth_shards_types(tmp_path, cli):
    code, out, err = cli("synth", tmp_path / "s", "--layers", "4", "--shards", "2", "--types",
                         "gu=Q2_0/Q8_0,down=Q8_0,dense=Q4_0", "--seed", "3")
    assert code == 0, err
    files = sorted(p.name for p in (tmp_path / "s").glob("*.gguf"))
    assert files == [f"synth-{n}-0000{i}-of-00002.gguf" for n in ("canonical", "revA", "revB") for i in (1, 2)]
    with open_model(tmp_path / "s/synth-revB-00002-of-00002.gguf") as m:
        assert m.tensor("blk.0.ffn_gate_exps.weight").type.name == "Q2_0"
        assert m.tensor("blk.1.ffn_up_exps.weight").type.name == "Q8_0"
        assert m.tensor("blk.0.attn_qkv.weight").type.name == "Q4_0"
        assert m.tensor("blk.0.hc_attn_up.weight").type.name == "Q4_0"
        assert m.files[1].kv["split.no"] == 1
