// Part of stratatools (stratatools/runtime/gpu). Helpers shared by the fused decode step's kernel files
// (fused_step.cu, attn_step.cu, attn_batch.cu, gdn_prep.cu), which include it with #include "step_common.cuh": kernels.py's cuda_unit() puts
// this text in place of that line for NVRTC and for the host C++ builds (fused_host_source), so the helpers exist
// once. Written for any block size: under STRATA_HOST (host_kernel_shim.cuh: one thread per block) the block sum
// is the thread's own value and dynamic shared memory is the shim's host_dyn_smem.
#ifndef STRATA_STEP_COMMON_CUH
#define STRATA_STEP_COMMON_CUH

__device__ __forceinline__ float step_sigm(float a) { return 1.0f / (1.0f + expf(-a)); }
// torch.nn.functional.softplus (beta 1, threshold 20), as stratatools.runtime.model._softplus
__device__ __forceinline__ float step_softplus(float x) { return x > 20.0f ? x : log1pf(expf(fminf(x, 20.0f))); }

#ifdef STRATA_HOST
static inline float step_warp_sum(float v) { return v; }
static inline float step_block_sum(float v, float*) { return v; }
static inline float step_block_max(float v, float*) { return v; }
#define STEP_DYN_SHARED(T, name) T* name = reinterpret_cast<T*>(host_dyn_smem)
#else
__device__ __forceinline__ float step_warp_sum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// Block-wide sum; every thread gets the result. red: 32 floats of shared memory. Call from every thread.
__device__ float step_block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = step_warp_sum(v);
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float r = lane < nw ? red[lane] : 0.0f;
        r = step_warp_sum(r);
        if (lane == 0) red[0] = r;
    }
    __syncthreads();
    return red[0];
}
// Block-wide max; every thread gets the result. red: 32 floats of shared memory. Call from every thread.
__device__ float step_block_max(float v, float* red) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float r = lane < nw ? red[lane] : __int_as_float(0xff800000);
        for (int o = 16; o; o >>= 1) r = fmaxf(r, __shfl_xor_sync(0xffffffffu, r, o));
        if (lane == 0) red[0] = r;
    }
    __syncthreads();
    return red[0];
}
// Dynamic shared memory of the launch as a T array `name` (one extern array per module; a kernel uses it once).
#define STEP_DYN_SHARED(T, name) extern __shared__ __align__(16) unsigned char step_smem_[]; T* name = reinterpret_cast<T*>(step_smem_)
#endif

// One attention head's row x = src[0:hd] (head h): dst[i] = x[i] * (1 / sqrt(mean(x^2) + eps)) * w[(h hd + i) % wl]
// (stratatools.runtime.model._rmsnorm over rows of hd), then NEOX rope for i < n_rot: dst[i] cos[i] + r[i] sin[i]
// with r = [-x[half:n_rot], x[0:half]] (Rope.apply; half = n_rot / 2); dims past n_rot unchanged. t: hd floats of
// shared memory, red: 32. Call from every thread of the block (decode attn_prep, batched attn_prep_b).
__device__ __forceinline__ void step_rms_rope_row(const float* __restrict__ src, const float* __restrict__ w, int wl,
                                                  int h, int hd, float eps, const float* __restrict__ cosv,
                                                  const float* __restrict__ sinv, int n_rot, float* t, float* red,
                                                  float* __restrict__ dst) {
    const int tid = threadIdx.x, nt = blockDim.x;
    float ss = 0.0f;
    for (int i = tid; i < hd; i += nt) {
        const float v = src[i];
        t[i] = v;
        ss += v * v;
    }
    ss = step_block_sum(ss, red);  // (its barriers also make t visible to the block)
    const float r = 1.0f / sqrtf(ss / (float)hd + eps);
    const int half = n_rot / 2;
    for (int i = tid; i < hd; i += nt) {
        float a = (t[i] * r) * w[((long long)h * hd + i) % wl];
        if (i < n_rot) {
            const int j = i < half ? i + half : i - half;
            const float bj = (t[j] * r) * w[((long long)h * hd + j) % wl];
            a = a * cosv[i] + (i < half ? -bj : bj) * sinv[i];
        }
        dst[i] = a;
    }
}

#endif  // STRATA_STEP_COMMON_CUH
