"""``alloc verify --full M``: M must be the unpruned model. The pruned file itself (or a symlink to it), another
model with as many experts per layer (another pruned revision) or one with fewer (arguments swapped) is refused
with one line naming the reference and the counts, exit 2 (was: the pruned model was accepted as its own "full"
model and every row matched itself)."""

from __future__ import annotations

from tests.test_pack_bad import one_line_error


def test_the_pruned_model_itself_is_refused_as_full(kit, cli, tmp_path):
    p = kit / "pruned" / "coder-revA.gguf"
    one_line_error(*cli("alloc", "verify", "--pruned", p, "--full", p), f"{p}: is the pruned model itself",
                   "--full takes the unpruned model")
    link = tmp_path / "full.gguf"
    link.symlink_to(p)
    one_line_error(*cli("alloc", "verify", "--pruned", p, "--full", link, "--json"), "is the pruned model itself")


def test_a_model_with_as_many_experts_is_refused_as_full(kit, cli, tmp_path):
    p = kit / "pruned"
    one_line_error(*cli("alloc", "verify", "--pruned", p / "coder-revA.gguf", "--full", p / "coder-revB.gguf"),
                   "coder-revB.gguf: every trunk layer keeps as many experts as the pruned model",
                   "(16 in layer 0)", "use --other")


def test_swapped_models_are_refused(kit, cli):
    one_line_error(*cli("alloc", "verify", "--pruned", kit / "quant" / "model-ISTA-mix.gguf", "--full",
                        kit / "pruned" / "coder-revA.gguf"),
                   "coder-revA.gguf: layer 0 keeps 16 experts, fewer than the 32", "wrong way round")


def test_the_real_full_model_still_verifies(kit, cli):
    p = kit / "pruned"
    code, out, err = cli("alloc", "verify", "--pruned", p / "coder-revA.gguf", "--full",
                         kit / "quant" / "model-ISTA-mix.gguf", "--alloc", p / "coder-revA.rco-allocation.txt")
    assert code == 0, (out, err)
