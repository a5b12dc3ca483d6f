"""Metadata that does not fit the tensors, on GGUFs written by the project's own writer (tests/gguf_edit.py copies
a synth release's canonical model with one value or shape changed):

* ``inspect`` shows what it can read and then refuses the file as run/pack/validate-release do (one line, exit 2;
  was: exit 0 with the table only);
* an empty ``tokenizer.ggml.merges`` array is refused like a missing one;
* the PLE tensors and the MTP block's expert widths are checked by check_consistency.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from stratatools.core.errors import StrataError
from stratatools.model.geometry import check_consistency
from stratatools.model.gguf import open_model
from tests.gguf_edit import copy_gguf
from tests.test_pack_bad import SMALL, one_line_error

FIX = "the file's metadata and tensors disagree; re-convert it"


@pytest.fixture(scope="module")
def canon(tmp_path_factory):
    """A synth canonical model of 2 trunk layers + 1 MTP block (8 experts, width 64), PLE on layer 0."""
    from stratatools.synth.model import synth_release

    r = synth_release(tmp_path_factory.mktemp("canon") / "rel", replace(SMALL, mtp=True))
    with open_model(r.canonical) as m:
        check_consistency(m)  # the unedited model is consistent
    return r.canonical


def _refused(path, *needles):
    with open_model(path) as m, pytest.raises(StrataError) as ei:
        check_consistency(m)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: ") and FIX in msg and "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


# -- 3. inspect ------------------------------------------------------------------------------------------------------

def test_inspect_shows_an_inconsistent_gguf_then_exits_2(canon, cli, tmp_path):
    m = copy_gguf(canon, tmp_path / "k9.gguf", kv={"qwen4exp.expert_used_count": 9})
    code, out, err = cli("inspect", m)
    one_line_error(code, out, err, "k9.gguf", "expert_used_count 9 is not in 1..8", FIX)
    assert "routed experts per layer" in out and "INCONSISTENT" in out  # what it could read is shown
    code, out, err = cli("inspect", m, "--json")
    one_line_error(code, out, err, "expert_used_count 9 is not in 1..8")
    d = json.loads(out)
    assert "expert_used_count 9 is not in 1..8" in d["inconsistency"] and d["n_expert"] == 8
    # the same file is refused by pack with the same line
    code, out2, err2 = cli("pack", m, "-o", tmp_path / "pk")
    one_line_error(code, out2, err2, "expert_used_count 9 is not in 1..8")
    assert err2.strip().splitlines()[-1] == err.strip().splitlines()[-1]


def test_inspect_of_a_consistent_gguf_exits_0(canon, cli):
    code, out, err = cli("inspect", canon, "--json")
    assert code == 0 and json.loads(out)["inconsistency"] is None, err


# -- 4. empty merges --------------------------------------------------------------------------------------------------

def test_empty_merges_array_is_refused_like_a_missing_one(canon, cli, tmp_path):
    from stratatools.model.gguf_write import ARRAY, STRING
    from stratatools.runtime.tokenizer import BPETokenizer

    m = copy_gguf(canon, tmp_path / "nomerges.gguf", kv={"tokenizer.ggml.merges": ([], ARRAY, STRING)})
    with open_model(m) as model:
        assert list(model.kv["tokenizer.ggml.merges"]) == []
        with pytest.raises(StrataError, match="tokenizer.ggml.merges is empty"):
            BPETokenizer.from_gguf(model)
    p = tmp_path / "p.txt"
    p.write_text("def foo(x):\n    return x\n")
    one_line_error(*cli("run", m, "--prompts", p, "-n", "1", "--device", "cpu", "--slots", "4"),
                   "nomerges.gguf", "tokenizer.ggml.merges is empty", "re-convert it")


# -- 5. PLE shapes and the MTP block's expert width -------------------------------------------------------------------

PLE_CASES = [
    ("key", dict(ne={"blk.0.ple_key.weight": (64, 128)}), ["blk.0.ple_key.weight", "[64, 128]", "[64, 256]"]),
    ("value", dict(ne={"blk.0.ple_value.weight": (32, 64)}), ["blk.0.ple_value.weight", "[32, 64]", "[64, 64]"]),
    ("conv", dict(ne={"blk.0.ple_conv1d.weight": (3, 256)}), ["blk.0.ple_conv1d.weight", "ple.conv_kernel 4"]),
    ("normq", dict(ne={"blk.0.ple_norm_query.weight": (128,)}), ["blk.0.ple_norm_query.weight", "[128]", "[256]"]),
    ("rowdim", dict(kv={"qwen4exp.embedding_length_per_layer_input": 32}),
     ["per_layer_token_embd.weight", "embedding_length_per_layer_input says rows of 32"]),
    ("vocab", dict(kv={"qwen4exp.ple.head_offsets": [0, 1009, 2022, 9000]}),
     ["per_layer_token_embd.weight", "address rows up to 10020"]),
    ("heads", dict(kv={"qwen4exp.ple.heads_per_ngram": 3}), ["ple.head_offsets has 4 values", "needs 6"]),
    ("layer", dict(kv={"qwen4exp.ple.layers": [5]}), ["ple.layers names layer 5, not a trunk layer (0..1)"]),
]


@pytest.mark.parametrize("case", PLE_CASES, ids=[c[0] for c in PLE_CASES])
def test_ple_metadata_that_does_not_fit_is_refused(canon, tmp_path, case):
    name, edit, needles = case
    _refused(copy_gguf(canon, tmp_path / f"{name}.gguf", **edit), *needles)


@pytest.mark.parametrize("role,ne", [("gate", (64, 32, 8)), ("up", (64, 32, 8)), ("down", (128, 64, 8))])
def test_mtp_block_expert_width_is_checked(canon, tmp_path, role, ne):
    m = copy_gguf(canon, tmp_path / f"mtp-{role}.gguf", ne={f"blk.2.ffn_{role}_exps.weight": ne})
    _refused(m, f"blk.2.ffn_{role}_exps.weight", str(list(ne)), "expert_feed_forward_length 64 (MTP block)")


def test_mtp_block_shared_expert_width_is_checked_and_pack_refuses(canon, cli, tmp_path):
    m = copy_gguf(canon, tmp_path / "mtp-sh.gguf", ne={"blk.2.ffn_up_shexp.weight": (64, 32)})
    _refused(m, "blk.2.ffn_up_shexp.weight", "[64, 32]", "expert_shared_feed_forward_length 64 (MTP block)")
    one_line_error(*cli("pack", m, "-o", tmp_path / "pk"), "mtp-sh.gguf", "blk.2.ffn_up_shexp.weight")
