// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by decode.py (kernels.cuda_unit: with
// step_common.cuh in place of its #include) and compiled with NVRTC
// (cupy.RawModule, multiply-add fusion allowed: the fast step agrees with the reference step by tolerance);
// tests/test_gpu_attn_host.py compiles it as host C++ (host_kernel_shim.cuh: one thread per block, blocks run one
// after another) and checks both kernels against the numpy formulas of stratatools.runtime.model.
//
// The gated attention layer of the fused decode step around its scores (decode.py StaticDecoder._attention):
// before them, the per-head RMS norms of the query and key, NEOX rotary embedding on the first n_rot dims and the
// key/value rows written into the caches (one launch instead of the ~25 small array operations of the unfused
// step); after them, the output times sigmoid of the gate half of the query projection (one launch instead of 5).
// Written for any block size, as fused_step.cu.
#include "pdl.cuh"  // pdl_wait, pdl_trigger, PDL_ENTRY (programmatic dependent launch)

#include "step_common.cuh"  // step_sigm, step_rms_rope_row, STEP_DYN_SHARED

// Blocks 0 .. nh-1: query head h = qraw[h, 0:hd] of the [nh, 2 hd] projection (its gate half is attn_gate_mul's);
// blocks nh .. nh+nkv-1: key head h = kraw[h, :] of [nkv, hd]. Each: x = v * (1 / sqrt(mean(v^2) + eps)) * w[(h hd
// + i) % wlen] (stratatools.runtime.model._rmsnorm over rows of hd, w of wql / wkl values), then Rope.apply at this
// step's position: for i < n_rot, x[i] cos[i] + r[i] sin[i] with r = [-x[half:n_rot], x[0:half]] (half = n_rot / 2,
// cos/sin the NEOX tables of n_rot values); dims past n_rot unchanged. Query heads go to qout [nh, hd]; key head h
// goes to Kc[pos, h, :] and the value row vraw[h, :] to Vc[pos, h, :] (caches [max_ctx, nkv, hd], pos = *posp).
// Dynamic shared memory: hd floats.
extern "C" __global__ void attn_prep(const float* __restrict__ qraw, const float* __restrict__ kraw,
                                     const float* __restrict__ vraw, const float* __restrict__ wq, int wql,
                                     const float* __restrict__ wk, int wkl, const float* __restrict__ cosv,
                                     const float* __restrict__ sinv, int n_rot, int nh, int nkv, int hd, float eps,
                                     const int* __restrict__ posp, float* __restrict__ qout, float* __restrict__ Kc,
                                     float* __restrict__ Vc) {
    PDL_ENTRY();
    STEP_DYN_SHARED(float, t);
    __shared__ float red[32];
    const int b = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const bool isq = b < nh;
    const int h = isq ? b : b - nh;
    const float* src = isq ? qraw + (long long)h * 2 * hd : kraw + (long long)h * hd;
    const long long pos = posp[0];
    float* dst = isq ? qout + (long long)h * hd : Kc + (pos * nkv + h) * hd;
    step_rms_rope_row(src, isq ? wq : wk, isq ? wql : wkl, h, hd, eps, cosv, sinv, n_rot, t, red, dst);
    if (!isq) {
        float* vd = Vc + (pos * nkv + h) * hd;
        for (int i = tid; i < hd; i += nt) vd[i] = vraw[(long long)h * hd + i];
    }
}

// out[h hd + i] = o[h hd + i] * sigmoid(qraw[h 2 hd + hd + i]) for h < nh, i < hd (the gated attention's output
// gate: the second half of each head's query projection row). Any grid (grid-stride).
extern "C" __global__ void attn_gate_mul(const float* __restrict__ o, const float* __restrict__ qraw, int nh, int hd,
                                         float* __restrict__ out) {
    PDL_ENTRY();
    const long long n = (long long)nh * hd;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const long long h = e / hd, i = e - h * hd;
        out[e] = o[e] * step_sigm(qraw[h * 2 * hd + hd + i]);
    }
}
