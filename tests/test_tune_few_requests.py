"""tune on the kit's 3-request trace: the default ``--kfold`` (5) fits the traces (3 folds, said in a note), so the
budget tune suggests for a too-small one runs as suggested; an explicit ``--kfold`` above the request count is
still refused, and a trace of one request cannot be held out at all."""

from __future__ import annotations

import json
import re

import pytest


def _kit(kit):
    p = kit / "pruned"
    return p / "coder-revB.routing.csv", p / "coder-revB.gguf"


def test_the_suggested_budget_runs_with_the_default_kfold(kit, cli):
    t, m = _kit(kit)
    base = ("tune", "-t", t, "--model", m, "--candidates", 3)
    code, out, err = cli(*base, "--budget-gib", "0.000001")
    assert code == 2, err
    sug = re.search(r"give --budget-gib (\S+) or more", err)
    assert sug, err
    code, out, err = cli(*base, "--budget-gib", sug.group(1), "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["k"] == 3 and d["requests"] == 3, (d["k"], d["requests"])
    note = " ".join(err.split())
    assert "3-fold: the traces hold 3 requests (the default --kfold 5 needs 5)" in note, note


def test_an_explicit_kfold_above_the_requests_is_refused(kit, cli):
    t, m = _kit(kit)
    code, out, err = cli("tune", "-t", t, "--model", m, "--candidates", 3, "--slots", 16, "--kfold", 5)
    assert code == 2 and "--kfold 5: the traces hold only 3 request(s)" in err and "at most 3 folds" in err, err
    code, out, err = cli("tune", "-t", t, "--model", m, "--candidates", 3, "--slots", 16, "--kfold", 3, "--json")
    assert code == 0 and json.loads(out)["k"] == 3 and "default --kfold" not in err, err


def test_one_request_cannot_be_held_out(kit, cli, tmp_path):
    t, m = _kit(kit)
    lines = t.read_text().splitlines()
    one = tmp_path / "one.csv"
    one.write_text("\n".join([lines[0]] + [ln for ln in lines[1:] if ln.split(",")[1] == "p0"]) + "\n")
    code, out, err = cli("tune", "-t", one, "--model", m, "--candidates", 3, "--slots", 16)
    assert code == 2 and "hold only 1 request" in err and "at least 2 requests" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("mapper", [False, True])
def test_library_tune_with_k_none_fits_the_requests(kit, mapper):
    from stratatools.cachesim.study import load_inputs
    from stratatools.cachesim.tune import tune

    t, m = _kit(kit)
    inp = load_inputs([t], [], model=m, whole=mapper)
    res = tune(inp.tables, inp.n_layers, inp.n_expert, slots=16, blob_bytes=inp.blob_bytes, k=None, candidates=2,
               mapper=(lambda fn, items: [fn(it) for it in items]) if mapper else None)
    assert res.k == 3 and res.requests == 3 and res.to_dict()["k"] == 3
