"""Every ``STRATATOOLS_*`` switch of the GPU path read at once (:func:`check_switches`), so that ``run --device gpu``
refuses a bad value before it loads the model."""

from __future__ import annotations

from stratatools.runtime.gpu import decode, experts, kernels, launch, prefill, qmm


def check_switches() -> None:
    """Read every ``STRATATOOLS_*`` switch of the GPU path now. Each is otherwise read where it is used, some only
    for one layout, job size or launch, so a bad value could surface in the middle of a run (after the model's
    load, or inside a CUDA graph's capture). Raises the first bad one's StrataError (the variable, its value and
    the values it takes); needs no CuPy."""
    for read in (qmm.chunk_values, lambda: qmm.chunk_values(moe=True, layout=42), qmm.short_fill, qmm.ring,
                 qmm.ring_warps, qmm.dense_i8, qmm.jobs_ring, qmm.sum_kernel, qmm.dense2, qmm.prefill_gemm,
                 qmm.batch_gemm, qmm.copy_plan, qmm.q8r_shared, qmm.router_kernel, qmm.job_tokens,
                 lambda: qmm.job_tokens(batch=True),
                 qmm.big_matrix_values,
                 lambda: qmm.jobs_i8("Q2_0", "Q2_0"), kernels.shared_side,
                 kernels.dense_min_rows_per_sm,
                 kernels.dq_split_blocks_per_sm, kernels.dense_kernel, launch.pdl_enabled,
                 lambda: launch.pdl_enabled(env=launch.BATCH_PDL_ENV), prefill.route_warp,
                 prefill.hc_fused, prefill.joined_enabled, prefill.graph_enabled,
                 prefill.gdn_kernel, prefill.gdn_step_cols, prefill.gdn_step_early, decode.route_warp,
                 decode.prefetch_blocks,
                 lambda: decode.prefetch_width(8), decode.decode_queue_setting, decode.miss_fetch_mode,
                 decode.prefetch_order, experts.expert_kernel_choice, experts.pipe_shapes):
        read()
