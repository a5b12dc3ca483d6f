"""A GGUF whose metadata does not fit its tensors (or that lacks what its tokenizer needs) is refused with one
line, exit 2, by run, validate-release and pack, before anything is reshaped. Fixtures: copies of the kit's
pruned Coder with one metadata value or one tensor shape patched in place (same byte count, so the file stays
a well-formed GGUF)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tests.test_pack_bad import one_line_error

SRC = "pruned/coder-revA.gguf"


def _patched(kit: Path, out: Path, key: str | None = None, u32: int | None = None,
             tensor: str | None = None, ne: list[int] | None = None, rename: tuple[str, str] | None = None) -> Path:
    d = bytearray((kit / SRC).read_bytes())
    if key is not None:  # a UINT32 metadata value: <len><key><type u32><value>
        k = key.encode()
        i = d.find(struct.pack("<Q", len(k)) + k)
        assert i > 0 and struct.unpack_from("<I", d, i + 8 + len(k))[0] == 4
        struct.pack_into("<I", d, i + 8 + len(k) + 4, u32)
    if tensor is not None:  # a tensor's ne: <len><name><n_dims u32><ne u64 x n_dims>
        k = tensor.encode()
        i = d.find(struct.pack("<Q", len(k)) + k)
        j = i + 8 + len(k)
        assert i > 0 and struct.unpack_from("<I", d, j)[0] == len(ne)
        struct.pack_into(f"<{len(ne)}Q", d, j + 4, *ne)
    if rename is not None:  # a key renamed to one of the same length: the original key is absent
        a, b = (s.encode() for s in rename)
        assert len(a) == len(b) and d.count(a) == 1
        d = d.replace(a, b)
    out.write_bytes(bytes(d))
    return out


CASES = [
    # (id, patch, words the one line must hold)
    ("heads16", dict(key="qwen4exp.attention.head_count", u32=16), ["qwen4exp.attention.head_count 16", "blk.3.attn_q.weight", "[256, 512]"]),
    ("state32", dict(key="qwen4exp.ssm.state_size", u32=32), ["qwen4exp.ssm.state_size 32", "blk.0.attn_qkv.weight", "[256, 512]"]),
    ("rope128", dict(key="qwen4exp.rope.dimension_count", u32=128), ["qwen4exp.rope.dimension_count 128", "key_length 64"]),
    ("keylen32", dict(key="qwen4exp.attention.key_length", u32=32), ["qwen4exp.attention.key_length 32", "blk.3.attn_q.weight"]),
    ("kv4", dict(key="qwen4exp.attention.head_count_kv", u32=4), ["qwen4exp.attention.head_count_kv 4", "blk.3.attn_k.weight", "[256, 128]"]),
    ("conv_ne", dict(tensor="blk.0.ssm_conv1d.weight", ne=[8, 256]), ["blk.0.ssm_conv1d.weight", "[8, 256]", "ssm.conv_kernel 4"]),
    ("k17", dict(key="qwen4exp.expert_used_count", u32=17), ["expert_used_count 17 is not in 1..16"]),
    ("k0", dict(key="qwen4exp.expert_used_count", u32=0), ["expert_used_count 0 is not in 1..16"]),
    ("bc4", dict(key="qwen4exp.block_count", u32=4), ["blk.4.", "block_count is 4", "unused tensors"]),
]
FIX = "the file's metadata and tensors disagree; re-convert it"


@pytest.fixture()
def prompts(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("def foo(x):\n    return x\n")
    return p


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_run_refuses_metadata_that_does_not_fit(cli, kit, tmp_path, prompts, case):
    name, patch, needles = case
    m = _patched(kit, tmp_path / f"{name}.gguf", **patch)
    one_line_error(*cli("run", m, "--prompts", prompts, "-n", "2", "--device", "cpu", "--slots", "4"),
                   f"{name}.gguf", FIX, *needles)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_validate_release_fails_it(cli, kit, tmp_path, case):
    name, patch, needles = case
    m = _patched(kit, tmp_path / f"{name}.gguf", **patch)
    code, out, err = cli("validate-release", "--model", m)
    assert code != 0, out
    assert "PASS" not in out.strip().splitlines()[-1], out
    assert needles[0] in out, out


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("heads16", "k17", "bc4")], ids=["heads16", "k17", "bc4"])
def test_pack_refuses_it(cli, kit, tmp_path, case):
    name, patch, needles = case
    m = _patched(kit, tmp_path / f"{name}.gguf", **patch)
    one_line_error(*cli("pack", m, "-o", tmp_path / "o"), f"{name}.gguf", *needles)
    assert not (tmp_path / "o").exists()


def test_unpatched_copy_still_runs(cli, kit, tmp_path, prompts):
    """The fixture builder changes nothing else: the copy with a no-op patch runs (exit 0)."""
    m = _patched(kit, tmp_path / "same.gguf", key="qwen4exp.attention.head_count", u32=4)
    code, out, err = cli("run", m, "--prompts", prompts, "-n", "2", "--device", "cpu", "--slots", "4")
    assert code == 0, (out, err)


def test_gpt2_tokenizer_without_merges_is_refused(cli, kit, tmp_path, prompts):
    m = _patched(kit, tmp_path / "nomerges.gguf", rename=("tokenizer.ggml.merges", "tokenizer.ggml.mergex"))
    one_line_error(*cli("run", m, "--prompts", prompts, "-n", "2", "--device", "cpu", "--slots", "4"),
                   "nomerges.gguf", "tokenizer.ggml.merges is missing", "re-convert it")
    from stratatools.core.errors import StrataError
    from stratatools.model.gguf import open_model
    from stratatools.runtime.tokenizer import BPETokenizer

    with open_model(m) as model, pytest.raises(StrataError, match="merges is missing"):
        BPETokenizer.from_gguf(model)
    with open_model(kit / SRC) as model:  # the original's merges make 'def foo' fewer tokens than its bytes
        assert len(BPETokenizer.from_gguf(model).encode("def foo(x):")) < len("def foo(x):")
