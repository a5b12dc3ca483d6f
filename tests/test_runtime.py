"""Runtime tests on the kit's real llama.cpp-made files: loader, caches, tokenizer, tier, run command, bad input."""

from __future__ import annotations

import csv
import json
import shutil
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stratatools.core.errors import StrataError
from stratatools.runtime.model import Qwen4ExpRuntime, generate
from stratatools.runtime.topk import llamacpp_cells, partial_sort_topk
from stratatools.runtime.weights import load

pytestmark = pytest.mark.kit


@pytest.fixture(scope="module")
def bf16(kit):
    w = load(kit / "gguf" / "model-bf16.gguf")
    yield w
    w.close()


def test_config_reads_converter_conventions(bf16):
    c = bf16.cfg
    assert c.n_layer == 8 and c.n_embd == 256 and c.n_vocab == 1024
    assert c.recurrent == [True, True, True, False, True, True, True, False]
    assert c.compress_ratios == [0, 0, 0, 4, 0, 0, 0, 4]
    assert c.ple_layers == [1]  # 0-based in the GGUF (HF ple_layer_ids [2])
    assert c.ple_multipliers.tolist() == [4295158889766209, 8433018892997163, 1270917961435699]
    assert c.ple_head_offsets.tolist() == [0, 1009, 2022, 3041]
    assert c.n_rot == 16 and c.idx_budget == 8 and c.n_expert == [32] * 8 and c.n_expert_used == 4
    assert c.ssm_n_group == 2 and c.ssm_dt_rank == 4 and c.ssm_head_v_dim == 64
    assert c.eos_id == 1021 and c.output_gate == "sigmoid"


def test_prefill_then_decode_equals_one_prefill(bf16, kit_prompts):
    rt = Qwen4ExpRuntime(bf16)
    pid, ids = kit_prompts[2]  # p2: has the EOS in the middle (PLE reset), 45 tokens > QSA budget
    st_full = rt.new_state()
    full_logits, full_rec = rt.forward(ids, st_full, logits="all")
    st = rt.new_state()
    split = 20
    lg, rec = rt.forward(ids[:split], st, logits="all")
    logits = [lg]
    recs = [rec]
    for t in ids[split:]:
        lg, rec = rt.forward([t], st, logits="all")
        logits.append(lg)
        recs.append(rec)
    inc = np.concatenate(logits, axis=0)
    assert inc.shape == full_logits.shape
    np.testing.assert_allclose(inc, full_logits, rtol=0, atol=2e-5)
    for il in range(8):
        got = np.concatenate([r.ids[il] for r in recs], axis=0)
        np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(full_rec.ids[il], axis=1))
    assert st.pos == st_full.pos == len(ids)


def test_generate_stops_and_caps(bf16, kit_prompts):
    rt = Qwen4ExpRuntime(bf16)
    ids = kit_prompts[0][1]
    g = generate(rt, ids, max_new_tokens=5)
    assert len(g.new_ids) == 5 and g.stop == "length"
    # the first new token is the argmax of the prompt's last logits (p0: 326, the kit's transformers argmax)
    assert g.new_ids[0] == 326
    stop_at = g.new_ids[2]
    g2 = generate(rt, ids, max_new_tokens=5, stop_id=stop_at)
    assert g2.stop == "stop" and g2.new_ids == g.new_ids[:g.new_ids.index(stop_at) + 1]
    assert generate(rt, ids, max_new_tokens=0).new_ids == []
    with pytest.raises(StrataError):
        generate(rt, [], max_new_tokens=1)
    with pytest.raises(StrataError, match="outside the vocabulary"):
        rt.forward([5000], rt.new_state())


def test_ple_ngram_ids_reset_at_eos(bf16):
    rt = Qwen4ExpRuntime(bf16)
    c = bf16.cfg
    eos = c.eos_id
    ids = np.array([5, 6, eos, 7, 8, 9], dtype=np.int64)
    got = rt.ple_ngram_ids(ids, np.full(2, eos, np.int64))
    # brute force from the definition: token s back, or EOS when an EOS lies strictly between
    h = [eos, eos] + ids.tolist()
    for t in range(len(ids)):
        i = t + 2
        sh = []
        for s in range(3):
            j = i - s
            sh.append(h[j] if all(h[m] != eos for m in range(j, i)) else eos)
        cols = []
        for n in (2, 3):
            mixed = 0
            for s in range(n):
                mixed ^= sh[s] * int(c.ple_multipliers[s])
            for j in range((n - 2) * 2, (n - 1) * 2):
                cols.append(mixed % int(c.ple_head_vocab[j]) + int(c.ple_head_offsets[j]))
        assert got[t].tolist() == cols
    # incremental context gives the same ids as the full history
    tail = rt.ple_ngram_ids(ids[4:], ids[2:4].copy())
    np.testing.assert_array_equal(tail, got[4:])


def test_llamacpp_selection_matches_kit_indexer_cells(kit):
    """The cell scoring + partial_sort emulation reproduces llama.cpp's indexer_top_k rows given block order."""
    rows = defaultdict(list)
    for r in csv.DictReader(open(kit / "routing" / "llamacpp-bf16.indexer_topk.csv")):
        rows[(r["prompt_id"], int(r["layer"]), int(r["token_pos"]))].append((int(r["slot"]), int(r["cell"])))
    # query 0..3 of every prompt: only tail cells are visible, so the row depends on the tie-breaking alone
    n = 0
    for (pid, il, q), v in rows.items():
        if q < 4:
            cells = [c for _, c in sorted(v)]
            want = partial_sort_topk(np.r_[np.full(q + 1, np.inf), np.full(48 - q - 1, -np.inf)].astype(np.float32), 11)
            assert cells == want, (pid, il, q)
            n += 1
    assert n == 3 * 2 * 4
    # p0 blk 3 query 12 (3 blocks + a 1-cell tail): two best blocks whole, two cells of the third
    got = sorted(llamacpp_cells(np.array([3.0, 1.0, 2.0], np.float32), 4, 12, 11, 48).tolist())
    assert got == [0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12]


def test_pack_equals_gguf_and_mismatch_is_refused(kit, kit_prompts, tmp_path, cli):
    from stratatools.pack.native import pack_model

    pk = tmp_path / "pack"
    pack_model(kit / "gguf" / "split" / "model-Q2_0-split-00001-of-00004.gguf", pk)
    ids = kit_prompts[1][1][:12]
    wa = load(pk)
    wb = load(kit / "quant" / "model-Q2_0.gguf")
    try:
        assert wa.experts.source == "gguf" and wa.model.path.name.endswith("00001-of-00004.gguf")
        la, ra = Qwen4ExpRuntime(wa).forward(ids, Qwen4ExpRuntime(wa).new_state())
        lb, rb = Qwen4ExpRuntime(wb).forward(ids, Qwen4ExpRuntime(wb).new_state())
        np.testing.assert_array_equal(la, lb)
        # the expert slices are byte-identical through the v4 shard columns
        ga, ua, da = wa.experts.raw(7, 5)
        gb, ub, db = wb.experts.raw(7, 5)
        assert bytes(ua) == bytes(ub) and bytes(da) == bytes(db)
    finally:
        wa.close()
        wb.close()
    txt = (pk / "native_experts.txt").read_text().splitlines()
    cases = {
        "offset": lambda p: p[:5] + [str(int(p[5]) + 64)] + p[6:],
        "type": lambda p: [p[0], "8", "8"] + p[3:],
        "size": None,
    }
    for what, edit in cases.items():
        bad = tmp_path / f"bad_{what}"
        shutil.copytree(pk, bad)
        lines = list(txt)
        if what == "size":
            # blob_bytes doubled (and offsets rescaled so the table itself stays consistent)
            rows = [ln.split() for ln in lines[1:]]
            off = 0
            for r in rows:
                r[4] = str(int(r[4]) * 2)
                r[3] = str(off)
                off += int(r[4]) * 32
            lines = [lines[0].replace("total 3538944", f"total {off}")] + [" ".join(r) for r in rows]
        else:
            parts = lines[1].split()
            lines[1] = " ".join(edit(parts))
        (bad / "native_experts.txt").write_text("\n".join(lines) + "\n")
        code, out, err = cli("run", bad, "--prompts", kit / "routing" / "prompts.json", "-n", "0")
        assert code == 2, (what, err)
        msg = err.strip()
        assert msg.count("\n") == 0 and "error:" in msg and "Traceback" not in msg, msg
        assert {"offset": "off", "type": "gu_type", "size": "blob_bytes"}[what] in msg, msg


def test_tokenizer_matches_kit_ids(kit, kit_prompts, bf16):
    from stratatools.runtime.tokenizer import BPETokenizer

    tok = BPETokenizer.from_gguf(bf16.model)
    pj = json.loads((kit / "routing" / "prompts.json").read_text())
    tsv = dict(kit_prompts)
    for p in pj["prompts"]:
        ids = tok.encode(p["text"])
        assert ids == p["token_ids"] == tsv[p["prompt_id"]]
        assert tok.decode(ids) == p["text"]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_tokenizer_roundtrip_property(text):
    import unicodedata

    from stratatools.runtime.tokenizer import BPETokenizer
    from stratatools.model.gguf import open_model
    from conftest import kit_dir

    k = kit_dir()
    if k is None:
        pytest.skip("kit absent")
    global _TOK
    try:
        tok = _TOK
    except NameError:
        with open_model(k / "gguf" / "model-bf16.gguf") as m:
            tok = _TOK = BPETokenizer.from_gguf(m)
    ids = tok.encode(text)
    assert all(0 <= i < 1024 for i in ids)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_run_cli_with_tier_and_trace(kit, tmp_path, cli):
    from stratatools.traces.formats import read_trace

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n    return a + b\\n\n\nThe quick brown fox\n")
    trace = tmp_path / "run.parquet"
    code, out, err = cli("run", kit / "quant" / "model-ISTA-mix.gguf", "--prompts", prompts,
                         "--profile", kit / "pruned" / "profile-canonical.bin", "--slots", "64",
                         "-n", "6", "--trace-out", trace, "--json")
    assert code == 0, err
    res = json.loads(out)
    from stratatools.runtime.tokenizer import BPETokenizer
    from stratatools.model.gguf import open_model

    with open_model(kit / "quant" / "model-ISTA-mix.gguf") as m:
        tok = BPETokenizer.from_gguf(m)
    n_prompt = [len(tok.encode("def add(a, b):\n    return a + b\n")), len(tok.encode("The quick brown fox"))]
    assert [r["prompt_tokens"] for r in res["requests"]] == n_prompt
    assert all(len(r["new_ids"]) <= 6 for r in res["requests"])
    tier = res["tier"]
    # the static tier holds the profile's first 64 pairs; every routed entry was counted once
    assert tier["resident"] == 64
    n_dec = sum(len(r["new_ids"]) - 1 for r in res["requests"] if r["stop"] == "length")
    assert tier["decode"]["entries"] == n_dec * 8 * 4
    assert tier["prefill"]["entries"] == sum(n_prompt) * 8 * 4
    assert 0.0 <= res["h_expert"] <= 1.0
    assert res["h_expert"] == pytest.approx(tier["decode"]["hits"] / tier["decode"]["entries"])
    t = read_trace(trace)
    assert len(t) == (sum(n_prompt) + n_dec) * 8 * 4 == res["trace_records"] * 4
    assert set(np.unique(t.request).tolist()) == {0, 1}
    assert set(np.unique(t.phase).tolist()) == {0, 1}
    # hits recomputed from the trace with the profile's first 64 pairs (static tier, no admission on misses
    # because the tier is full from the start)
    from stratatools.profiles.strp import read_profile

    prof = read_profile(kit / "pruned" / "profile-canonical.bin")
    res_set = {(int(l), int(e)) for l, e in prof.pairs[:64]} if hasattr(prof, "pairs") else None
    if res_set is not None:
        dec = t.phase == 1
        hits = sum((int(l), int(e)) in res_set for l, e in zip(t.layer[dec], t.expert[dec]))
        assert hits == tier["decode"]["hits"]
    # an existing trace is refused without --force
    code, _, err = cli("run", kit / "quant" / "model-ISTA-mix.gguf", "--prompts", prompts, "--trace-out", trace)
    assert code == 2 and "--force" in err


def test_bad_inputs_exit_2(kit, tmp_path, cli):
    gguf = kit / "gguf" / "model-bf16.gguf"
    binp = tmp_path / "p.txt"
    binp.write_bytes(b"abc\x00def\n")
    lat = tmp_path / "q.txt"
    lat.write_bytes(b"caf\xe9\n")
    js = tmp_path / "r.json"
    js.write_text('{"prompts": [{"token_ids": [1, "x"]}]}')
    good = tmp_path / "ok.txt"
    good.write_text("hello\n")
    cases = [
        (("run", gguf, "--prompts", binp), "not text"),
        (("run", gguf, "--prompts", lat), "not UTF-8"),
        (("run", gguf, "--prompts", js), "token_ids"),
        (("run", gguf, "--prompts", good, "--profile", kit / "pruned" / "profile-revA.bin"), "another model"),
        (("run", kit / "pruned" / "coder-revA.gguf", "--prompts", good, "--profile", kit / "pruned" / "profile-canonical.bin"), "another model"),
        (("run", tmp_path, "--prompts", good), "native_experts.txt"),
    ]
    for args, needle in cases:
        code, out, err = cli(*args)
        assert code == 2, (args, err)
        assert needle in err and err.strip().count("\n") == 0, err


def test_synthetic_release_runs(tmp_path, cli):
    """The colleague's synthetic release (stratatools.synth.model) runs end to end, packed, with a tier."""
    synth = pytest.importorskip("stratatools.synth.model")
    from stratatools.pack.native import pack_model

    rel = tmp_path / "rel"
    synth.synth_release(rel)
    pk = tmp_path / "pack"
    pack_model(rel / "synth-revA.gguf", pk, experts_bin=True)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\\n    return x\n")
    trace = tmp_path / "t.bin"
    code, out, err = cli("run", pk, "--prompts", prompts, "-n", "3", "--slots", "16", "--policy", "adaptive",
                         "--trace-out", trace, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["expert_source"] == "experts.bin" and res["new_tokens"] >= 1
    assert trace.stat().st_size > 0 and res["tier"]["resident"] <= 16


def test_run_adaptive_tier_with_engine_knobs_and_an_upper_tier(tmp_path, cli):
    """The runtime's tier takes the 0.2.x knobs by the engine's option names; the upper tier's experts are served
    from the tier's store too (the same online objects as the simulator)."""
    synth = pytest.importorskip("stratatools.synth.model")
    from stratatools.pack.native import pack_model

    rel = tmp_path / "rel"
    synth.synth_release(rel)
    pk = tmp_path / "pack"
    pack_model(rel / "synth-revA.gguf", pk, experts_bin=True)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\\n    return x\n")
    base = ["run", pk, "--prompts", prompts, "-n", "3", "--slots", "8", "--json"]
    code, out, err = cli(*base, "--policy", "adaptive", "--adapt-every", "1", "--adapt-swaps", "4",
                         "--adapt-lag", "2", "--upper-slots", "8", "--disjoint-adapt")
    assert code == 0, err
    tier = json.loads(out)["tier"]
    # no profile: both tiers start empty; the upper tier's free slots are taken by its own moves (global pool)
    assert tier["resident"] <= 8 and 0 < tier["upper_resident"] <= 8
    code, _, err = cli(*base, "--adapt-every", "1")
    assert code == 2 and "add --policy adaptive" in err
    code, _, err = cli(*base, "--policy", "adaptive", "--strata-version", "0.1", "--upper-slots", "8")
    assert code == 2 and "0.2.x" in err
