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

#endif  // STRATA_STEP_COMMON_CUH
