// Part of stratatools (stratatools/runtime/gpu). Asynchronous 16-byte (and 4 / 8-byte) copies global -> shared
// memory (cp.async, sm_80+), shared by moe_staged.cu and qmm.cu, which include it with #include "cp_async.cuh"
// (kernels.cuda_unit puts this text in place for NVRTC and for the host builds). Under STRATA_HOST
// (host_kernel_shim.cuh) a copy happens at once and commits / waits are no-ops.
#ifndef STRATA_CP_ASYNC_CUH
#define STRATA_CP_ASYNC_CUH
#ifndef STRATA_HOST
// ... to the shared-space address d (__cvta_generic_to_shared of a pointer made once: a copy's own conversion cost
// four instructions, cuobjdump of qmm.cu's jobs).
__device__ __forceinline__ void cp_async16_s(unsigned d, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    cp_async16_s((unsigned)__cvta_generic_to_shared(dst), src);
}
// ... and of N = 4 or 8 bytes (cp.async.ca: through L1; src and dst N-byte aligned).
template <int N> __device__ __forceinline__ void cp_async_small_s(unsigned d, const void* src) {
    static_assert(N == 4 || N == 8, "cp.async.ca copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void cp_async_small(void* dst, const void* src) {
    cp_async_small_s<N>((unsigned)__cvta_generic_to_shared(dst), src);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
#else
static inline void cp_async16(void* dst, const void* src) { std::memcpy(dst, src, 16); }
template <int N> static inline void cp_async_small(void* dst, const void* src) { std::memcpy(dst, src, N); }
static inline void cp_async_commit() {}
template <int N> static inline void cp_async_wait() {}
#endif
#endif  // STRATA_CP_ASYNC_CUH
