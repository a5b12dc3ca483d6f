"""stratatools.runtime.dequant: element-for-element against gguf.quants on real kit tensors and random blocks; Q2_0
against a slow literal reference; bad sizes give StrataError."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import quants
from hypothesis import given, settings, strategies as st

from stratatools.runtime.dequant import SUPPORTED_TYPES, dequantize, dequantize_rows, q2_0_dequantize
from stratatools.core.errors import StrataError
from stratatools.model.ggml_types import type_by_name
from stratatools.model.gguf import open_model

KIT_FILES = ["gguf/model-bf16.gguf", "quant/model-Q2_0.gguf", "quant/model-Q4_K_M.gguf",
             "quant/model-IQ4_NL.gguf", "quant/model-ISTA-mix.gguf"]


def random_blocks(tname: str, n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes of ``n_blocks`` blocks whose fp16 scale fields hold finite, moderate values."""
    t = type_by_name(tname)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, t.type_size), dtype=np.uint8)
    scale = rng.normal(0, 0.05, size=n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if tname in ("F32",):
        raw = rng.normal(0, 1, size=n_blocks).astype("<f4").view(np.uint8).reshape(n_blocks, 4)
    elif tname in ("F16", "BF16"):
        pass  # any 16-bit pattern, NaNs and infinities included
    elif tname in ("Q4_K", "Q5_K"):
        raw[:, 0:2] = scale
        raw[:, 2:4] = rng.normal(0, 0.05, size=n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    elif tname == "Q4_1" or tname == "Q5_1":
        raw[:, 0:2] = scale
        raw[:, 2:4] = rng.normal(0, 0.05, size=n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    elif tname == "Q6_K":
        raw[:, -2:] = scale
    elif tname == "IQ1_M":  # the fp16 scale is spread over the top nibbles of the 4 u16 scale words
        dbits = scale.view("<u2").reshape(n_blocks).astype(np.uint16)
        sc = raw[:, 48:56].copy().view("<u2")
        for i in range(4):
            sc[:, i] = (sc[:, i] & np.uint16(0x0FFF)) | (((dbits >> np.uint16(4 * i)) & np.uint16(0xF)) << np.uint16(12))
        raw[:, 48:56] = sc.view(np.uint8)
    else:
        raw[:, 0:2] = scale
    return raw.reshape(-1)


def q2_0_literal(raw: bytes) -> list[float]:
    """Literal, one-value-at-a-time Q2_0 decoder written from formats.md section 1."""
    out = []
    for b in range(len(raw) // 18):
        blk = raw[18 * b:18 * b + 18]
        d = struct.unpack("<e", blk[:2])[0]
        for j in range(64):
            code = (blk[2 + j // 4] >> (2 * (j % 4))) & 3
            out.append(float(np.float32(code - 1) * np.float32(d)))
    return out


def gguf_reference(raw: np.ndarray, tname: str) -> np.ndarray:
    t = type_by_name(tname)
    return np.asarray(quants.dequantize(raw.reshape(-1, t.type_size), gguf.GGMLQuantizationType(t.id))).reshape(-1)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Float arrays equal element for element, NaN == NaN."""
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("tname", [t for t in SUPPORTED_TYPES if t != "Q2_0"])
def test_random_blocks_match_gguf(tname):
    raw = random_blocks(tname, 64, seed=hash(tname) % 1000)
    ours = dequantize(raw, tname)
    ref = gguf_reference(raw, tname)
    t = type_by_name(tname)
    assert ours.dtype == np.float32 and ours.shape == (64 * t.block_size,)
    assert same_bits(ours, ref)
    assert np.isfinite(ref).mean() > 0.5 or tname in ("F16", "BF16")
    assert np.count_nonzero(ref) > 0


def test_q2_0_against_literal_reference():
    raw = random_blocks("Q2_0", 37, seed=7)
    ours = q2_0_dequantize(raw)
    ref = q2_0_literal(raw.tobytes())
    assert same_bits(ours, np.array(ref, dtype=np.float32))
    # all four levels occur and are -d, 0, d, 2d
    d0 = np.float32(struct.unpack("<e", raw[:2].tobytes())[0])
    assert set(np.unique(ours[:64]).tolist()) <= {float(-d0), 0.0, float(d0), float(2 * d0)}
    assert same_bits(dequantize(raw, 42, 37 * 64), ours)


def test_q2_0_known_block():
    # d = 0.5; codes 0,1,2,3 repeated -> -0.5, 0, 0.5, 1.0
    blk = np.frombuffer(np.float16(0.5).tobytes() + bytes([0b11100100] * 16), dtype=np.uint8)
    assert dequantize(blk, "Q2_0").tolist() == [-0.5, 0.0, 0.5, 1.0] * 16


def _kit_tensors(kit, rel):
    m = open_model(kit / rel)
    return m


@pytest.mark.kit
@pytest.mark.parametrize("rel", KIT_FILES)
def test_kit_tensors_match_gguf(kit, rel):
    """Every type in each kit file: ours equals gguf.quants element for element (up to 3 tensors a type)."""
    with open_model(kit / rel) as m:
        by_type: dict[str, list] = {}
        for t in m.iter_tensors():
            by_type.setdefault(t.type.name, []).append(t)
        assert by_type
        for tname, infos in by_type.items():
            for info in infos[:3]:
                raw = m.raw(info)
                ours = dequantize_rows(raw, info.type, info.ne)
                assert ours.shape == tuple(reversed(info.ne))
                if tname == "Q2_0":
                    ref = q2_0_dequantize(np.array(raw))
                else:
                    ref = gguf_reference(np.array(raw), tname)
                assert same_bits(ours.reshape(-1), ref), (rel, info.name)
                assert np.isfinite(ours).all(), (rel, info.name)


@pytest.mark.kit
def test_kit_q2_0_approximates_bf16(kit):
    """Q2_0 experts of the kit decode close to the BF16 originals (the decode is the one llama.cpp wrote)."""
    with open_model(kit / "gguf/model-bf16.gguf") as mb, open_model(kit / "quant/model-Q2_0.gguf") as mq:
        name = "blk.2.ffn_gate_exps.weight"
        tq = mq.tensor(name)
        assert tq.type.name == "Q2_0"
        q = dequantize_rows(mq.raw(tq), tq.type, tq.ne).reshape(-1)
        b = mb.array(name).reshape(-1)
        corr = float(np.corrcoef(q, b)[0, 1])
        # alternative decodings (code - 2, code - 1.5) must be worse: the levels are right, not just the scale
        alt = np.array([q2_0_alt(np.array(mq.raw(tq)), off) for off in (1.5, 2.0)])
        err = float(np.mean((q - b) ** 2))
        assert corr > 0.75
        for a in alt:
            assert np.mean((a - b) ** 2) > err


def q2_0_alt(raw, offset):
    blocks = raw.reshape(-1, 18)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    codes = (blocks[:, 2:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3
    return ((codes.reshape(-1, 64).astype(np.float32) - offset) * d).reshape(-1)


@pytest.mark.kit
def test_kit_type_coverage(kit):
    """Every type that appears in the kit files is supported."""
    seen = set()
    for rel in KIT_FILES:
        with open_model(kit / rel) as m:
            seen |= {t.type.name for t in m.iter_tensors()}
    assert seen <= set(SUPPORTED_TYPES)
    assert {"Q2_0", "IQ2_XS", "IQ3_XXS", "IQ4_NL", "Q4_K", "Q6_K"} <= seen


def test_rows_shape_and_bad_sizes():
    raw = random_blocks("Q8_0", 8, seed=1)  # 8 blocks = 256 values
    out = dequantize_rows(raw, "Q8_0", (64, 4))
    assert out.shape == (4, 64)
    assert same_bits(out.reshape(-1), dequantize(raw, 8))
    with pytest.raises(StrataError, match="whole number"):
        dequantize(raw[:-1], "Q8_0")
    with pytest.raises(StrataError, match="expected"):
        dequantize(raw, "Q8_0", 255)
    with pytest.raises(StrataError, match="whole number"):
        dequantize_rows(raw, "Q8_0", (16, 16))
    with pytest.raises(StrataError):
        dequantize(raw, 9999)


@settings(max_examples=60, deadline=None)
@given(tname=st.sampled_from(SUPPORTED_TYPES), data=st.binary(min_size=0, max_size=600))
def test_random_bytes_never_crash(tname, data):
    """Any bytes: either whole blocks (float32 out, right length) or a StrataError."""
    raw = np.frombuffer(data, dtype=np.uint8)
    t = type_by_name(tname)
    try:
        out = dequantize(raw, tname)
    except StrataError:
        assert len(data) % t.type_size != 0
        return
    assert out.dtype == np.float32 and out.size == len(data) // t.type_size * t.block_size
