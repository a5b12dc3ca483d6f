"""GGUF reader property tests: random and mutated bytes give a StrataError (or a valid model), never another
exception or a hang."""

from __future__ import annotations

import struct
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from stratatools.core.errors import StrataError
from stratatools.model.geometry import read_geometry
from stratatools.model.gguf import open_model
from stratatools.model.gguf_write import U32, GGUFWriterStream
from stratatools.model.ggml_types import type_by_name
from stratatools.pack.native import plan_pack


_SEED: list[bytes] = []


def seed_bytes() -> bytes:
    """A small valid MoE GGUF (built once)."""
    if _SEED:
        return _SEED[0]
    import tempfile
    p = Path(tempfile.mkdtemp()) / "m.gguf"
    w = GGUFWriterStream(p)
    w.add("general.architecture", "qwen4exp")
    w.add("qwen4exp.block_count", 1, U32)
    w.add("qwen4exp.embedding_length", 64, U32)
    w.add("general.alignment", 32, U32)
    w.add("tokenizer.ggml.tokens", ["a", "b", "c"])
    f32, q2 = type_by_name("F32"), type_by_name("Q2_0")
    w.add_tensor("blk.0.ffn_gate_inp.weight", (64, 2), f32, lambda: [bytes(64 * 2 * 4)])
    for r, ne in (("gate", (64, 64, 2)), ("up", (64, 64, 2)), ("down", (64, 64, 2))):
        w.add_tensor(f"blk.0.ffn_{r}_exps.weight", ne, q2, lambda ne=ne: [bytes(q2.nbytes(ne))])
    w.write()
    _SEED.append(p.read_bytes())
    p.unlink()
    return _SEED[0]


def _check_error(e: StrataError, p: Path) -> None:
    msg = str(e)
    assert "\n" not in msg, msg
    assert str(p) in msg or p.name in msg, msg


def _try(tmp_path, data: bytes) -> None:
    """Open, read the geometry and plan a pack; any failure must be a one-line StrataError naming the file."""
    p = tmp_path / "f.gguf"
    p.write_bytes(data)
    try:
        with open_model(p) as m:
            try:
                g = read_geometry(m)
                plan = plan_pack(m)
            except StrataError as e:
                _check_error(e, p)
                return
            assert g.block_count >= 0 and plan.total_bytes >= 0
    except StrataError as e:
        _check_error(e, p)


def test_seed_is_a_valid_model(tmp_path):
    """The fuzz seed itself parses: 1 layer, 2 experts of 3456 blob bytes (so mutations start from a valid file)."""
    p = tmp_path / "seed.gguf"
    p.write_bytes(seed_bytes())
    with open_model(p) as m:
        g = read_geometry(m)
        assert (g.block_count, g.n_embd, g.uniform_n_expert) == (1, 64, 2)
        assert [ly.blob_bytes for ly in g.layers] == [3456]
        assert plan_pack(m).n_expert == 2


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_mutated_headers(tmp_path, data):
    b = bytearray(seed_bytes())
    for _ in range(data.draw(st.integers(1, 6))):
        if not b:
            break
        i = data.draw(st.integers(0, min(400, len(b) - 1)))  # the header region
        kind = data.draw(st.sampled_from(["byte", "u64", "cut"]))
        if kind == "byte":
            b[i] = data.draw(st.integers(0, 255))
        elif kind == "u64" and i + 8 <= len(b):
            b[i:i + 8] = struct.pack("<Q", data.draw(st.sampled_from([0, 1, 2**31, 2**63, 2**64 - 1, 7, 9, 13])))
        else:
            del b[data.draw(st.integers(i, len(b))):]
    _try(tmp_path, bytes(b))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=600))
def test_random_bytes(tmp_path, blob):
    _try(tmp_path, b"GGUF" + struct.pack("<I", 3) + blob)
    _try(tmp_path, blob)
