"""``stratatools run --device`` / ``--vram-gib`` and the context-length check: bad input is a one-line error with
exit code 2 (CPU side, runs in CI), and the device-memory plan's arithmetic."""

from __future__ import annotations

import json

import pytest

from stratatools.core.errors import StrataError
from stratatools.runtime import gpu

pytestmark = pytest.mark.kit

BF16 = "gguf/model-bf16.gguf"


def _one_line_error(code, err):
    assert code == 2, err
    assert err.strip() and err.strip().count("\n") == 0, err


def test_device_gpu_without_cupy_is_refused(kit, tmp_path, cli):
    if gpu.available():
        pytest.skip("a GPU is visible here: --device gpu is valid")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    code, _, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "1", "--device", "gpu")
    _one_line_error(code, err)
    assert "--device gpu" in err and "--device cpu" in err


def test_device_auto_and_cpu_report_the_choice(kit, tmp_path, cli):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    code, out, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "2", "--device", "cpu", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["device"]["device"] == "cpu" and res["device"]["device_requested"] == "cpu"
    code, out, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "0", "--device", "auto", "--json")
    assert code == 0, err
    assert json.loads(out)["device"]["device"] == ("gpu" if gpu.available() else "cpu")


@pytest.mark.parametrize("args,needle", [
    (("--device", "tpu"), "--device 'tpu'"),
    (("--device", "cpu", "--vram-gib", "4"), "--vram-gib"),
])
def test_bad_device_options(kit, tmp_path, cli, args, needle):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    code, _, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "1", *args)
    _one_line_error(code, err)
    assert needle in err


def test_context_longer_than_the_model_is_refused(kit, tmp_path, cli):
    """The kit model's context length is 4,096: a 4,000-token prompt with 200 new tokens does not fit."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"token_ids": [5] * 4000}]))
    code, _, err = cli("run", kit / BF16, "--prompts", prompts, "-n", "200", "--device", "cpu")
    _one_line_error(code, err)
    assert "4200 positions" in err and "context length 4096" in err and "prompt #0" in err


def test_vram_plan_fits_refuses_and_says_what_it_needs(kit, monkeypatch):
    monkeypatch.setenv("STRATATOOLS_MISS_FETCH", "zero-copy")  # no staging (planned in the test below)
    monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", "0")  # no token / PLE tables (tests/test_decode_stage.py plans them)
    from stratatools.model.gguf import open_model
    from stratatools.runtime.config import read_config
    from stratatools.runtime.device import GIB, RESERVE_BYTES, cache_bytes, dense_device_bytes, plan_vram, prefill_bytes
    from stratatools.runtime.gpu.decode import qsa_cache_bytes, split_attention_bytes

    with open_model(kit / BF16) as m:
        cfg = read_config(m)
        blob = [1000] * cfg.n_layer
        total_e = cfg.n_layer * max(cfg.n_expert)
        dense = dense_device_bytes(m, cfg, indexer=True)  # 64 positions: past the kit's full selection (11)
        assert 0 < dense_device_bytes(m, cfg) < dense < m.path.stat().st_size
        caches = cache_bytes(cfg, 64)
        assert caches > cache_bytes(cfg, 32) > cache_bytes(cfg, 11) > 0
        # past 11 positions the QSA caches and scratch are planned too
        kv_pos = sum(8 * cfg.n_head_kv * cfg.head_dim for il in range(cfg.n_layer) if not cfg.recurrent[il])
        # (11 positions: the split attention scratch alone; 64: inside the QSA bytes)
        assert cache_bytes(cfg, 64) - cache_bytes(cfg, 11) == 53 * kv_pos + qsa_cache_bytes(cfg, 64) - split_attention_bytes(cfg, 11)
        assert qsa_cache_bytes(cfg, 64) > 64 * 4 * cfg.idx_head_dim
        # the batched prefill's temporaries (a chunk of at most 64 tokens here) are planned too
        pf = prefill_bytes(m, cfg, 64)
        assert prefill_bytes(m, cfg, 1024) > pf > 64 * cfg.n_embd * cfg.hc_count * 4
        # the hgemm path plans as mma (the same expert jobs; its fp16 weight pair fits the dense share), sgemm less
        sizes = {}
        for g in ("mma", "hgemm", "sgemm"):
            monkeypatch.setenv("STRATATOOLS_PREFILL_GEMM", g)
            sizes[g] = prefill_bytes(m, cfg, 64)
        monkeypatch.delenv("STRATATOOLS_PREFILL_GEMM")
        assert sizes["hgemm"] == sizes["mma"] == pf > sizes["sgemm"]
        fixed = dense + caches + RESERVE_BYTES + pf
        # a budget with room for 100 slots of 1,024 bytes (blob 1,000 rounded up to 256)
        plan = plan_vram(m, cfg, blob, 64, (fixed + 100 * 1024 + 10) / GIB, None, total_e)
        assert plan.slot_bytes == 1024 and plan.slots == min(100, total_e)
        assert plan.total <= plan.budget and plan.to_dict()["prefill_bytes"] == pf
        # no budget: every expert
        assert plan_vram(m, cfg, blob, 64, None, None, total_e).slots == total_e
        # too small for the dense part
        with pytest.raises(StrataError, match=r"^--vram-gib [0-9.]+: the dense weights \(0\.\d\d GiB\), caches for 64 "
                           r"positions \(0\.\d\d GiB\), prefill scratch \(0\.\d\d GiB\) and reserve \(0\.75 GiB\) need "
                           r"0\.\d\d GiB before any expert slot; give at least that$"):
            plan_vram(m, cfg, blob, 64, (fixed - 1) / GIB, None, total_e)
        monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", "1")  # the tables named in the list when planned
        with pytest.raises(StrataError, match=r"prefill scratch \(0\.\d\d GiB\), token and PLE tables \(0\.00 GiB\) and "
                           r"reserve"):
            plan_vram(m, cfg, blob, 64, (fixed - 1) / GIB, None, total_e)
        monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", "0")
        # --slots over the budget: the message names the memory it needs
        with pytest.raises(StrataError, match=r"--slots 200 does not fit .* needs .* GiB.* at most 100 slots fit"):
            plan_vram(m, cfg, blob, 64, (fixed + 100 * 1024 + 10) / GIB, 200, total_e)
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(StrataError, match="not a finite size"):
                plan_vram(m, cfg, blob, 64, bad, None, total_e)


def test_miss_fetch_staging_is_planned_and_a_bad_mode_refused(kit, monkeypatch):
    """STRATATOOLS_MISS_FETCH: the staging of the fetch modes (k blob entries; 3 k with the prefetch's two parities)
    comes out of the budget before the slots; an unknown mode is a one-line StrataError naming the variable."""
    from stratatools.model.gguf import open_model
    from stratatools.runtime.config import read_config
    from stratatools.runtime.device import GIB, plan_vram
    from stratatools.runtime.gpu.decode import fetch_grid, fetch_staging_bytes, miss_fetch_mode, prefetch_width

    monkeypatch.delenv("STRATATOOLS_PREFETCH_EXTRA", raising=False)
    assert fetch_staging_bytes("zero-copy", 8, 1024) == 0
    assert fetch_staging_bytes("fetch", 8, 1024) == 8 * 1024
    # prefetch: k entries for the layer computed + two parities of the k predicted experts (default: no extra)
    assert prefetch_width(8) == 8 and fetch_staging_bytes("prefetch", 8, 1024) == 24 * 1024
    monkeypatch.setenv("STRATATOOLS_PREFETCH_EXTRA", "4")
    assert prefetch_width(8) == 12 and prefetch_width(8, 10) == 10 and prefetch_width(60) == 64
    assert fetch_staging_bytes("prefetch", 8, 1024) == (8 + 2 * 12) * 1024
    for bad in ("-1", "two", "\u0663", "+4", "1_0"):  # (non-ASCII digits, signs and underscores were taken by int())
        monkeypatch.setenv("STRATATOOLS_PREFETCH_EXTRA", bad)
        with pytest.raises(StrataError, match=r"STRATATOOLS_PREFETCH_EXTRA=.*whole number of experts \(0 or more\)"):
            prefetch_width(8)
    monkeypatch.delenv("STRATATOOLS_PREFETCH_EXTRA")
    from stratatools.runtime.gpu.decode import PREFETCH_BLOCKS, prefetch_blocks

    monkeypatch.delenv("STRATATOOLS_PREFETCH_BLOCKS", raising=False)
    assert prefetch_blocks() == PREFETCH_BLOCKS == 32
    monkeypatch.setenv("STRATATOOLS_PREFETCH_BLOCKS", "96")
    assert prefetch_blocks() == 96
    for bad in ("0", "many", "\u0669\u0666", "+96", "9_6"):
        monkeypatch.setenv("STRATATOOLS_PREFETCH_BLOCKS", bad)
        with pytest.raises(StrataError, match=r"STRATATOOLS_PREFETCH_BLOCKS=.*whole number of blocks \(1 or more\)"):
            prefetch_blocks()
    monkeypatch.delenv("STRATATOOLS_PREFETCH_BLOCKS")
    from stratatools.runtime.gpu.decode import prefetch_order

    monkeypatch.delenv("STRATATOOLS_PREFETCH_ORDER", raising=False)
    assert prefetch_order() == "first"
    monkeypatch.setenv("STRATATOOLS_PREFETCH_ORDER", "after")
    assert prefetch_order() == "after"
    monkeypatch.setenv("STRATATOOLS_PREFETCH_ORDER", "mixer")
    assert prefetch_order() == "mixer"
    monkeypatch.setenv("STRATATOOLS_PREFETCH_ORDER", "later")
    with pytest.raises(StrataError, match="STRATATOOLS_PREFETCH_ORDER='later': use first, after, mixer"):
        prefetch_order()
    monkeypatch.delenv("STRATATOOLS_PREFETCH_ORDER")
    # 1.38 MB blobs, k 8, 132 SMs: 66 blocks a job (4 per SM when all 8 miss); a small blob: one block per 16 KiB
    assert fetch_grid(8, 1382400, 132) == 66 and fetch_grid(8, 20000, 132) == 2 and fetch_grid(64, 100, 4) == 1
    with open_model(kit / BF16) as m:
        cfg = read_config(m)
        blob = [1000] * cfg.n_layer
        total_e = cfg.n_layer * max(cfg.n_expert)
        monkeypatch.delenv("STRATATOOLS_MISS_FETCH", raising=False)
        assert miss_fetch_mode() == "prefetch"  # the default
        monkeypatch.setenv("STRATATOOLS_MISS_FETCH", "zero-copy")
        base = plan_vram(m, cfg, blob, 64, None, None, total_e)
        assert base.staging == 0 and base.to_dict()["staging_bytes"] == 0
        budget = (base.fixed + 100 * 1024 + 10) / GIB
        assert plan_vram(m, cfg, blob, 64, budget, None, total_e).slots == min(100, total_e)
        monkeypatch.setenv("STRATATOOLS_MISS_FETCH", "prefetch")
        plan = plan_vram(m, cfg, blob, 64, budget, None, total_e)
        k = cfg.n_expert_used
        n_st = k + 2 * prefetch_width(k, min(cfg.n_expert))
        assert plan.staging == n_st * 1024 and plan.fixed == base.fixed + plan.staging
        assert plan.slots == min(100 - n_st, total_e)
        monkeypatch.delenv("STRATATOOLS_MISS_FETCH")
        assert plan_vram(m, cfg, blob, 64, budget, None, total_e).staging == plan.staging
        monkeypatch.setenv("STRATATOOLS_MISS_FETCH", "later")
        with pytest.raises(StrataError, match="STRATATOOLS_MISS_FETCH='later': use one of zero-copy, fetch, prefetch"):
            plan_vram(m, cfg, blob, 64, budget, None, total_e)


def test_resolve_device():
    from stratatools.runtime.device import resolve_device

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("gpu" if gpu.available() else "cpu")
    with pytest.raises(StrataError, match="not one of"):
        resolve_device("cuda")


@pytest.mark.parametrize("policy", ["static", "adaptive", "lru", "lfu", "lfru"])
def test_resident_row_is_the_masks_row(policy):
    """Tier.resident_row (what the GPU tier reads after each access) equals resident_mask()'s row, always."""
    import numpy as np

    from stratatools.cachesim import make_tier
    from stratatools.profiles.strp import Profile

    L, E = 3, 12
    rng = np.random.default_rng(5)
    if policy in ("static", "adaptive"):
        pairs = np.array([(l, e) for e in range(E) for l in range(L)], dtype=np.uint16)
        t = make_tier(policy, profile=Profile(n_layers=L, n_expert=E, pairs=pairs[rng.permutation(len(pairs))]),
                      slots=8, blob_bytes=[100] * L)
    else:
        t = make_tier(policy, n_layers=L, n_expert=E, slots=9, blob_bytes=[100] * L)
    for r in range(30):
        for l in range(L):
            t.access(l, rng.choice(E, 3, replace=False))
            m = t.resident_mask()
            for ll in range(L):
                assert np.array_equal(t.resident_row(ll), m[ll]), (policy, r, ll)
        t.end_round()
    assert t.resident_mask().any()
