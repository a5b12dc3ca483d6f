"""validate-release's hit-rate gate on traces that route layers at or past the model's trunk: the model's own MTP
block layers are left out of the gate, as make-profile leaves them out, and counted in the check's reason and
details; layers past the trunk and the MTP blocks make the trace another model's: refused in one line naming the
trace and the layer, exit 2, as simulate and tune refuse it (was: the gate failed, exit 1, as if the release
were bad)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

HEADER = "model,prompt_id,token_pos,layer,rank,expert_id,weight"


def _with_layer(src: Path, dst: Path, copy_from: int, to: int) -> int:
    """``src`` plus a copy of layer ``copy_from``'s rows as layer ``to``; returns the rows added."""
    lines = src.read_text().splitlines()
    extra = []
    for ln in lines[1:]:
        f = ln.split(",")
        if f[3] == str(copy_from):
            f[3] = str(to)
            extra.append(",".join(f))
    dst.write_text("\n".join(lines + extra) + "\n")
    return len(extra)


def _validate_revb(cli, p, t, rep):
    """validate-release of the kit's pruned revision B with its remapped profile on trace ``t`` (report ``rep``):
    (exit code, stdout, stderr)."""
    return cli("validate-release", "--model", p / "coder-revB.gguf", "--profile",
               p / "expected-profile-revA-remapped-to-revB.bin", "-t", t, "--min-hit-rate", "0.1", "--slots", 48,
               "--json-out", rep)


def test_layers_past_a_model_without_mtp_are_refused_exit_2(kit, cli, tmp_path):
    p = kit / "pruned"
    t = tmp_path / "past.csv"
    assert _with_layer(p / "coder-revB.routing.csv", t, 7, 8) == 540
    rep = tmp_path / "v.json"
    code, out, err = _validate_revb(cli, p, t, rep)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, out, err)
    assert f"{t}: the trace routes layers up to 8 but the model has 8 trunk layers (0..7)" in lines[0], lines[0]
    assert "another model's trace" in lines[0] and not rep.exists()


@pytest.fixture(scope="module")
def mtp_release(tmp_path_factory):
    """A synth model of 4 trunk layers + 1 MTP block (16 experts), and traces of 3 requests: trunk only, and the
    same plus entries of the MTP block's layer 4."""
    import io

    from stratatools.cli import run_captured

    d = tmp_path_factory.mktemp("mtp")
    out = io.StringIO()
    code = run_captured(["synth", str(d / "rel"), "--mtp", "--layers", "4", "--hidden", "64", "--experts", "16",
                         "--expert-ff", "64", "--no-revisions"], out)
    assert code == 0, out.getvalue()
    rnd = random.Random(1)
    trunk, mtp = [HEADER], []
    for p in range(3):
        for pos in range(40):
            for layer in range(5):
                for r, e in enumerate(rnd.sample(range(16) if pos % 2 else range(6), 4)):
                    (trunk if layer < 4 else mtp).append(f"synth,p{p},{pos},{layer},{r},{e},0.25")
    (d / "trunk.csv").write_text("\n".join(trunk) + "\n")
    (d / "mtp.csv").write_text("\n".join(trunk + mtp) + "\n")
    return d / "rel" / "synth-canonical.gguf", d / "trunk.csv", d / "mtp.csv", len(mtp)


def test_mtp_block_layers_are_left_out_of_the_gate_and_counted(mtp_release, cli, tmp_path):
    model, trunk, mtp, n_mtp = mtp_release
    prof = tmp_path / "p.strp"
    code, out, err = cli("make-profile", mtp, "-o", prof, "--model", model)
    assert code == 0 and f"{n_mtp} entries of layers >= 4" in " ".join(err.split()), err
    res = {}
    for name, t in (("trunk", trunk), ("mtp", mtp)):
        code, out, err = cli("validate-release", "--model", model, "--profile", prof, "-t", t, "--min-hit-rate",
                             "0.1", "--slots", 16, "--json")
        assert code == 0, (out, err)
        res[name] = next(c for c in json.loads(out)["checks"] if c["name"] == "hit-rate")
    a, b = res["trunk"], res["mtp"]
    assert a["status"] == b["status"] == "pass"
    assert b["details"]["h_expert"] == a["details"]["h_expert"] and b["details"]["entries"] == a["details"]["entries"]
    assert b["details"]["left_out_mtp"] == n_mtp == 480 and a["details"]["left_out_mtp"] == 0
    assert f"left out: {n_mtp} entries of the MTP block (layer 4)" in b["reason"], b["reason"]
    assert "left out" not in a["reason"], a["reason"]
