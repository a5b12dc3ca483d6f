"""Device staging of decode steps (StaticDecoder.device_stage_ready / set_device_token / _stage_from_device) on the
CPU side: which models it takes and the reason it gives otherwise, the VRAM plan of its tables under
STRATATOOLS_DECODE_QUEUE (auto, 1, 0), and a numpy decoder refusing it. The GPU equality with _stage is in
tests/test_gpu_decode_stage.py, the kernel's host build in tests/test_gpu_stage_step_host.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from stratatools.core.errors import StrataError
from stratatools.model.ggml_types import TYPES
from stratatools.runtime.gpu.decode import device_stage_check, stage_table_bytes

BF16 = "gguf/model-bf16.gguf"
BY_NAME = {t.name: t for t in TYPES.values()}


class _Model:
    def __init__(self, tensors):
        self.tensors = {n: SimpleNamespace(name=n, type=BY_NAME[ty], ne=ne,
                                           nbytes=ne[0] * ne[1] * BY_NAME[ty].type_size // BY_NAME[ty].block_size)
                        for n, (ty, ne) in tensors.items()}

    def has(self, name):
        return name in self.tensors

    def tensor(self, name):
        return self.tensors[name]


def _cfg(**kw):
    base = dict(n_embd=64, ple_layers=[0, 2], ple_ngram=3, ple_heads_per_ngram=2, eos_id=5,
                ple_head_vocab=np.array([7, 11, 13, 17]), ple_head_offsets=np.array([0, 7, 18, 31]))
    base.update(kw)
    return SimpleNamespace(**base)


def _model(tok="BF16", ple="Q8_0", ple_rows=48, tok_ne0=64, ple_ne0=32):
    return _Model({"token_embd.weight": (tok, (tok_ne0, 100)), "per_layer_token_embd.weight": (ple, (ple_ne0, ple_rows))})


def test_device_stage_check_takes_the_supported_tables_and_names_what_it_refuses():
    cfg = _cfg()
    for tok, ple in (("BF16", "Q8_0"), ("F32", "F16"), ("Q8_0", "BF16")):
        assert device_stage_check(_model(tok, ple), cfg) == (True, "")
    assert stage_table_bytes(_model("BF16", "Q8_0"), cfg) == 100 * 64 * 2 + 48 * 34
    ok, why = device_stage_check(_model("Q4_K", "BF16", tok_ne0=256), _cfg(n_embd=256))
    assert not ok and why == "tensor token_embd.weight is Q4_K; device staging reads F32, F16, BF16, Q8_0"
    ok, why = device_stage_check(_model("BF16", "Q8_0", ple_ne0=48), cfg)
    assert not ok and "rows of 48 values are not whole Q8_0 blocks" in why
    ok, why = device_stage_check(_model("BF16", "BF16", ple_rows=47), cfg)  # head 3's rows end at 48
    assert not ok and why == "PLE head vocabularies/offsets reach outside the table's 47 rows"
    ok, why = device_stage_check(_model(), _cfg(ple_head_vocab=np.array([7, 0, 13, 17])))
    assert not ok and "outside" in why
    ok, why = device_stage_check(_model(), _cfg(ple_ngram=9, ple_heads_per_ngram=1,
                                                ple_head_vocab=np.ones(8, int), ple_head_offsets=np.zeros(8, int)))
    assert not ok and why == "PLE n-gram size 9 is over 8"
    ok, why = device_stage_check(_model(), _cfg(ple_layers=list(range(129))))
    assert not ok and why == "129 PLE layers x 4 heads is over 512 rows a step"
    ok, why = device_stage_check(_model(tok_ne0=32), cfg)
    assert not ok and why == "token_embd.weight rows hold 32 values, not n_embd 64"
    no_ple = _Model({"token_embd.weight": ("F16", (64, 100))})
    ok, why = device_stage_check(no_ple, cfg)
    assert not ok and why == "tensor per_layer_token_embd.weight is missing"
    # without PLE layers only the token table is read (and planned)
    assert device_stage_check(no_ple, _cfg(ple_layers=[])) == (True, "")
    assert stage_table_bytes(no_ple, _cfg(ple_layers=[])) == 100 * 64 * 2


def test_queue_status_auto_queues_gpu_decoders_with_small_tables(monkeypatch):
    """STRATATOOLS_DECODE_QUEUE: auto (the default) queues a GPU decoder whose tables fit QUEUE_AUTO_TABLE_BYTES,
    1 queues wherever staging works, 0 never; async swaps and unstageable tables turn it off; a bad value is refused."""
    from stratatools.runtime.gpu import decode

    cfg, small = _cfg(), _model()
    big_rows = decode.QUEUE_AUTO_TABLE_BYTES // (64 * 2) + 1  # BF16 rows of 64 values: one row over the limit
    big = _model(tok="BF16", tok_ne0=64)
    big.tensors["token_embd.weight"].nbytes = big_rows * 64 * 2
    monkeypatch.delenv("STRATATOOLS_ASYNC_SWAPS", raising=False)
    monkeypatch.delenv("STRATATOOLS_DECODE_LAG", raising=False)
    for auto in (None, "", "auto", "Auto"):
        if auto is None:
            monkeypatch.delenv("STRATATOOLS_DECODE_QUEUE", raising=False)
        else:
            monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", auto)
        assert decode.decode_queue_setting() == "auto"
        assert decode.queue_status(small, cfg) == (True, "")
        ok, why = decode.queue_status(big, cfg)
        assert not ok and why == ("the token and PLE tables take 256.0 MiB of device memory (auto stages at most "
                                  "256 MiB; STRATATOOLS_DECODE_QUEUE=1 queues anyway)")
        ok, why = decode.queue_status(small, cfg, gpu=False)
        assert not ok and why.startswith("STRATATOOLS_DECODE_QUEUE=auto queues on a GPU decoder only")
        assert decode.queue_status(small, cfg, async_swaps=True) == (False, "not with STRATATOOLS_ASYNC_SWAPS=1")
        # the bookkeeping before each launch (DECODE_LAG=0) and queued steps exclude each other
        want = (False, "not with STRATATOOLS_DECODE_LAG=0 (the bookkeeping before each launch)")
        assert decode.queue_status(small, cfg, lag=False) == want
        monkeypatch.setenv("STRATATOOLS_DECODE_LAG", "0")
        assert decode.queue_status(small, cfg) == want and decode.queue_status(small, cfg, lag=True) == (True, "")
        monkeypatch.delenv("STRATATOOLS_DECODE_LAG")
        assert decode.queue_status(_model("Q4_K", tok_ne0=256), _cfg(n_embd=256))[0] is False
    monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", "1")
    assert decode.queue_status(big, cfg) == (True, "") and decode.queue_status(small, cfg, gpu=False) == (True, "")
    monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", "0")
    assert decode.queue_status(small, cfg) == (False, "STRATATOOLS_DECODE_QUEUE=0")
    # an explicit argument wins over the environment
    assert decode.queue_status(small, cfg, asked=True) == (True, "")
    monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", "auto")
    assert decode.queue_status(small, cfg, asked=False) == (False, "off (asked for)")
    monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", "YES ")  # the message shows the value as given
    with pytest.raises(StrataError, match=r"STRATATOOLS_DECODE_QUEUE='YES ': use auto, 1 or 0"):
        decode.queue_status(small, cfg)


@pytest.mark.kit
def test_plan_vram_plans_the_stage_tables_under_decode_queue(kit, monkeypatch):
    from stratatools.model.gguf import open_model
    from stratatools.runtime.config import read_config
    from stratatools.runtime.device import GIB, plan_vram

    monkeypatch.setenv("STRATATOOLS_MISS_FETCH", "zero-copy")
    with open_model(kit / BF16) as m:
        cfg = read_config(m)
        blob = [1000] * cfg.n_layer
        total_e = cfg.n_layer * max(cfg.n_expert)
        tables = int(m.tensor("token_embd.weight").nbytes) + int(m.tensor("per_layer_token_embd.weight").nbytes)
        assert tables == 256 * 1024 * 2 + 64 * 4096 * 2  # the kit's BF16 tables
        monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", "0")
        base = plan_vram(m, cfg, blob, 64, None, None, total_e)
        assert base.stage_tables == 0 and base.to_dict()["stage_tables_bytes"] == 0
        # on: asked for, or auto (unset, empty, "auto": the kit's 1 MiB of tables are under the auto limit)
        for on in ("1", None, "", "auto", " AUTO "):
            if on is None:
                monkeypatch.delenv("STRATATOOLS_DECODE_QUEUE", raising=False)
            else:
                monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", on)
            plan = plan_vram(m, cfg, blob, 64, None, None, total_e)
            assert plan.stage_tables == tables and plan.to_dict()["stage_tables_bytes"] == tables
        monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", "1")
        assert plan.fixed == base.fixed + tables and plan.to_dict()["planned_bytes"] == base.total + tables
        # under a budget the tables take slots' room: 2000 slots of 1024 bytes fit without them
        budget = (base.fixed + 2000 * 1024 + 10) / GIB
        assert plan_vram(m, cfg, blob, 64, budget, None, 10 ** 6).slots == 2000 - tables // 1024
        with pytest.raises(StrataError, match=r"token and PLE tables \(0\.00 GiB\) and reserve"):
            plan_vram(m, cfg, blob, 64, (base.fixed + 10) / GIB, None, 10 ** 6)
        # queued steps do not run with --batch or with async swaps: nothing planned for them then
        assert plan_vram(m, cfg, blob, 64, None, None, total_e, batch=2).stage_tables == 0
        monkeypatch.setenv("STRATATOOLS_ASYNC_SWAPS", "1")
        assert plan_vram(m, cfg, blob, 64, None, None, total_e).stage_tables == 0
        monkeypatch.delenv("STRATATOOLS_ASYNC_SWAPS")
        monkeypatch.setenv("STRATATOOLS_DECODE_QUEUE", "0")
        assert plan_vram(m, cfg, blob, 64, budget, None, 10 ** 6).slots == 2000


@pytest.mark.kit
def test_numpy_decoder_reports_device_staging_unavailable(kit):
    from stratatools.runtime.gpu.decode import StaticDecoder
    from stratatools.runtime.model import Qwen4ExpRuntime
    from stratatools.runtime.weights import load

    w = load(kit / BF16)
    dec = StaticDecoder(Qwen4ExpRuntime(w), max_ctx=8)
    ok, why = dec.device_stage_ready()
    assert not ok and why == "device staging needs a CuPy decoder (this one runs on numpy)"
    assert device_stage_check(w.model, w.cfg) == (True, "")  # the kit's tables themselves are fine
    from stratatools.model.gguf import open_model
    from stratatools.runtime.config import read_config

    for name, want in (("quant/model-ISTA-mix.gguf", (True, "")),
                       ("quant/model-Q4_K_M.gguf",
                        (False, "tensor token_embd.weight is Q4_K; device staging reads F32, F16, BF16, Q8_0"))):
        if (kit / name).exists():
            with open_model(kit / name) as m:
                assert device_stage_check(m, read_config(m)) == want
    with pytest.raises(StrataError, match="device staging is unavailable: device staging needs a CuPy decoder"):
        dec.set_device_token(3)
    with pytest.raises(StrataError, match=r"token id 1024 is outside the vocabulary \[0, 1024\)"):
        dec.set_device_token(1024)
    with pytest.raises(StrataError, match="device staging is unavailable"):
        dec._stage_from_device()


def test_stage_limits_are_the_kernel_sources():
    import re

    from stratatools.runtime.gpu import decode as D
    from stratatools.runtime.gpu.kernels import cuda_source, kernel_signatures

    src = cuda_source("stage_step.cu")
    assert int(re.search(r"#define SS_MAX_NGRAM (\d+)", src).group(1)) == D.STAGE_MAX_NGRAM
    assert int(re.search(r"#define SS_MAX_ROWS (\d+)", src).group(1)) == D.STAGE_MAX_ROWS
    assert len(kernel_signatures("stage_step.cu")["stage_step"]) == 20
    for name, tid in D.STAGE_TYPES.items():
        assert TYPES[tid].name == name and f"case {tid}:" in src
