"""GGUF reader core: every kit file opens (Q2_0 included), shards merge, geometry comes from routers."""

from __future__ import annotations

import pytest

from stratatools.core.errors import StrataError
from stratatools.model.geometry import read_geometry
from stratatools.model.gguf import open_model


def test_open_all_kit_models(kit):
    for p in sorted(kit.glob("**/*.gguf")):
        if "imatrix" in p.name:
            continue
        with open_model(p) as m:
            assert m.arch == "qwen4exp"
            assert len(m.tensors) == 214, p


def test_q2_0_file_types(kit):
    with open_model(kit / "quant/model-Q2_0.gguf") as m:
        t = m.tensor("blk.0.ffn_gate_exps.weight")
        assert t.type.name == "Q2_0" and t.type.id == 42
        assert t.ne == (256, 64, 32)
        assert t.nbytes == 256 // 64 * 18 * 64 * 32


def test_split_set_merges(kit):
    split = kit / "gguf/split/model-Q2_0-split-00003-of-00004.gguf"
    with open_model(split) as s, open_model(kit / "quant/model-Q2_0.gguf") as whole:
        assert len(s.files) == 4
        assert set(s.tensors) == set(whole.tensors)
        for name in ("blk.7.ffn_up_exps.weight", "blk.2.ffn_gate_exps.weight"):
            assert bytes(s.raw(name)) == bytes(whole.raw(name))
        assert s.tensor("blk.7.ffn_up_exps.weight").shard == 3


def test_geometry_pruned_from_router(kit):
    with open_model(kit / "pruned/coder-revA.gguf") as m:
        g = read_geometry(m)
        assert g.n_trunk == 8 and g.n_mtp == 0
        assert g.expert_counts == [16] * 8
        assert g.full_attention_layers == [3, 7]
        le = g.layers[2]
        assert (le.gu_type.name, le.d_type.name) == ("IQ2_XS", "Q2_0")
        # 2 * ff * row(IQ2_XS, 256) + n_embd * row(Q2_0, 64) = 2*64*74 + 256*18
        assert le.blob_bytes == 2 * 64 * 74 + 256 * 18


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(StrataError, match="not a GGUF"):
        open_model(p)


def test_type_table_matches_gguf_package():
    # the built-in table (no gguf import at start-up) must agree with the pinned gguf package, id by id
    import gguf

    from stratatools.model.ggml_types import TYPES, type_by_id

    for qt, (block, size) in gguf.GGML_QUANT_SIZES.items():
        t = type_by_id(int(qt))
        assert (t.name, t.block_size, t.type_size) == (qt.name, int(block), int(size))
    assert set(TYPES) - {int(q) for q in gguf.GGML_QUANT_SIZES} == {42}
    assert (TYPES[42].name, TYPES[42].block_size, TYPES[42].type_size) == ("Q2_0", 64, 18)
