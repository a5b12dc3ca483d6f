// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by batch.py (kernels.cuda_unit: with
// step_common.cuh in place of its #include) and compiled with NVRTC (multiply-add fusion allowed: the batched step
// agrees with the decode step by tolerance); tests/test_gpu_attn_batch_host.py compiles it as host C++
// (host_kernel_shim.cuh: one thread per block) and checks it against the numpy formulas of the batched step.
//
// The gated attention layer of the batched decode step (batch.py BatchDecoder._attention) for T tokens, token r of
// place place[r] at position pos[r] (caches [N places, max_ctx, nkv, hd]): attn_prep_b does what the decode step's
// attn_prep does for each token (q/k RMS norms, NEOX rope at the token's position, key/value rows into its place's
// caches); attn_decode_b attends each token's query heads over its place's positions 0 .. pos[r] and applies the
// output gate. Two launches instead of about fifteen array operations and a masked batched product.
// Written for any block size (lanes = min(32, blockDim.x), warps = max(1, blockDim.x / lanes)).

#include "step_common.cuh"  // step_sigm, step_warp_sum, step_block_sum, step_block_max, step_rms_rope_row
#include "pdl.cuh"          // PDL_ENTRY: every kernel begins with it (launch.py BATCH_PDL_KERNELS)


// Block (b, r): token r = blockIdx.y; b < nh: query head b of qraw [T, nh, 2 hd] (first hd values; the second half is
// the gate), b >= nh: key head b - nh of kraw [T, nkv, hd]. x * (1 / sqrt(mean(x^2) + eps)) * w[(h hd + i) % wlen],
// then rope with the token's cos / sin rows ([T, n_rot]); queries to qout [T, nh, hd], keys to
// Kc[place[r], pos[r], h, :] and the value row vraw[r, h, :] to Vc[place[r], pos[r], h, :]. Shared: hd floats.
extern "C" __global__ void attn_prep_b(const float* __restrict__ qraw, const float* __restrict__ kraw,
                                       const float* __restrict__ vraw, const float* __restrict__ wq, int wql,
                                       const float* __restrict__ wk, int wkl, const float* __restrict__ cosv,
                                       const float* __restrict__ sinv, int n_rot, int nh, int nkv, int hd, float eps,
                                       const int* __restrict__ place, const int* __restrict__ pos, int max_ctx,
                                       float* __restrict__ qout, float* __restrict__ Kc, float* __restrict__ Vc) {
    PDL_ENTRY();
    STEP_DYN_SHARED(float, t);
    __shared__ float red[32];
    const int b = blockIdx.x, r = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const bool isq = b < nh;
    const int h = isq ? b : b - nh;
    const float* src = isq ? qraw + ((long long)r * nh + h) * 2 * hd : kraw + ((long long)r * nkv + h) * hd;
    const long long row = ((long long)place[r] * max_ctx + pos[r]) * nkv + h;
    float* dst = isq ? qout + ((long long)r * nh + h) * hd : Kc + row * hd;
    step_rms_rope_row(src, isq ? wq : wk, isq ? wql : wkl, h, hd, eps, cosv + (long long)r * n_rot,
                      sinv + (long long)r * n_rot, n_rot, t, red, dst);
    if (!isq) {
        const float* vs = vraw + ((long long)r * nkv + h) * hd;
        for (int i = tid; i < hd; i += nt) Vc[row * hd + i] = vs[i];
    }
}

// Block (h, r): query head h of token r (q [T, nh, hd]) over positions 0 .. pos[r] of place place[r]'s caches (kv
// head h / (nh / nkv)): softmax(q . k * scale) v, times sigmoid of the gate half of qraw [T, nh, 2 hd], into out
// [T, nh hd]. Shared: (max pos + 1) floats.
extern "C" __global__ void attn_decode_b(const float* __restrict__ q, const float* __restrict__ Kc,
                                         const float* __restrict__ Vc, const int* __restrict__ place,
                                         const int* __restrict__ pos, int max_ctx, const float* __restrict__ qraw,
                                         float* __restrict__ out, int nh, int nkv, int hd, float scale) {
    PDL_ENTRY();
    STEP_DYN_SHARED(float, sc);
    __shared__ float red[32];
    const int h = blockIdx.x, r = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int lanes = nt < 32 ? nt : 32, warps = nt / lanes > 0 ? nt / lanes : 1;
    const int warp = tid / lanes, lane = tid % lanes;
    const int kvh = h / (nh / nkv), P = pos[r] + 1;
    const long long base = (long long)place[r] * max_ctx * nkv * hd + (long long)kvh * hd;
    const float* qh = q + ((long long)r * nh + h) * hd;
    for (int p = warp; p < P; p += warps) {
        const float* kp = Kc + base + (long long)p * nkv * hd;
        float s = 0.0f;
        for (int d = lane; d < hd; d += lanes) s += qh[d] * kp[d];
        s = step_warp_sum(s);
        if (lane == 0) sc[p] = s * scale;
    }
    __syncthreads();
    float m = __int_as_float(0xff800000);
    for (int p = tid; p < P; p += nt) m = fmaxf(m, sc[p]);
    m = step_block_max(m, red);
    float s = 0.0f;
    for (int p = tid; p < P; p += nt) {
        const float e = expf(sc[p] - m);
        sc[p] = e;
        s += e;
    }
    s = step_block_sum(s, red);
    const float inv = 1.0f / s;
    const float* gate = qraw + ((long long)r * nh + h) * 2 * hd + hd;
    for (int d = tid; d < hd; d += nt) {
        float acc = 0.0f;
        const float* vp = Vc + base + d;
        for (int p = 0; p < P; ++p) acc += sc[p] * vp[(long long)p * nkv * hd];
        out[((long long)r * nh + h) * hd + d] = (acc * inv) * step_sigm(gate[d]);
    }
}
