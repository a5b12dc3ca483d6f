"""stratatools.runtime.gpu.switches.check_switches (no CuPy needed): every STRATATOOLS_* switch of the GPU path read
at once, so that a bad value fails before a run loads its model, not inside the step that first reads it (the integer
dense ring's, for one, is read only for Q8R matrices of up to 32 tokens)."""

from __future__ import annotations

import pytest

from stratatools.core.errors import StrataError
from stratatools.runtime.gpu import decode, experts, kernels, launch, prefill, qmm
from stratatools.runtime.gpu.switches import check_switches

#: (variable, a value it refuses)
BAD = [(qmm.KC_ENV, "100"), (qmm.MOE_KC_ENV, "7"), (qmm.SHORT_FILL_ENV, "9"), (qmm.RING_ENV, "5:64"),
       (qmm.RING_WARPS_ENV, "6"),
       (qmm.DENSE_I8_ENV, "2:256:2"), (qmm.DENSE_I8_ENV, "4:64:3"), (qmm.JOBS_RING_ENV, "1:1"), (qmm.SUM_ENV, "2"),
       (qmm.DENSE2_ENV, "x"), (qmm.GEMM_ENV, "cublas"), (qmm.BATCH_GEMM_ENV, "fp8"), (qmm.JOB_ENV, "12"),
       (qmm.BATCH_JOB_ENV, "4"), (qmm.BIG_ENV, "-1"), (qmm.JOBS_I8_ENV, "yes"), (qmm.ROUTER_ENV, "cublas"),
       (prefill.GDN_STEP_COLS_ENV, "yes"), (prefill.GDN_STEP_EARLY_ENV, "2"),
       (kernels.SHARED_SIDE_ENV, "2"),
       (kernels.DENSE_MIN_ROWS_ENV, "x"), (kernels.DQ_SPLIT_ENV, "0"), (kernels.DENSE_KERNEL_ENV, "fast"),
       (launch.PDL_ENV, "on"), (launch.BATCH_PDL_ENV, "yes"), (prefill.ROUTE_WARP_ENV, "2"),
       (prefill.HC_FUSED_ENV, "2"), (prefill.JOINED_ENV, "on"),
       (prefill.GRAPH_ENV, "2"), (prefill.GDN_WARP_ENV, "2"),
       (decode.PREFETCH_BLOCKS_ENV, "0"), (decode.PREFETCH_EXTRA_ENV, "-3"), (decode.DECODE_QUEUE_ENV, "maybe"),
       (decode.MISS_FETCH_ENV, "later"), (decode.PREFETCH_ORDER_ENV, "last"), (experts.MOE_KERNEL_ENV, "magic"),
       (experts.MOE_PIPE_ENV, "gu=7x1x1")]


@pytest.fixture
def clean_env(monkeypatch):
    for name, _ in BAD:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_pass(clean_env):
    check_switches()  # (raises on a bad default reader)
    for name, good in ((qmm.DENSE_I8_ENV, "0"), (qmm.DENSE_I8_ENV, "3:128:4"), (qmm.RING_ENV, "4:64:2"),
                       (qmm.JOBS_RING_ENV, "0"), (qmm.BATCH_JOB_ENV, "16")):
        clean_env.setenv(name, good)
        check_switches()


@pytest.mark.parametrize("name,value", BAD)
def test_a_bad_switch_is_refused_naming_it(clean_env, name, value):
    clean_env.setenv(name, value)
    with pytest.raises(StrataError) as e:
        check_switches()
    assert name in str(e.value) and "\n" not in str(e.value)
