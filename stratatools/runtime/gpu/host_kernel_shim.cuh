// Makes fused_step.cu, quant_kernels.cu, moe_staged.cu and qsa_step.cu compile as host C++17 (tests/test_gpu_fused_host.py,
// tests/test_gpu_qsa_host.py; with host_shim.cuh and the decoders for quant_kernels.cu and moe_staged.cu): a kernel runs as one thread per block,
// the blocks one after another (host_run_grid), so barriers are no-ops and block reductions are the thread's own
// value. Kernels written for any block size (fused_step.cu's rule) then compute what the device computes, up to
// float summation order.
#include <cmath>
#include <cstring>
#include <algorithm>
#include <math.h>
#define STRATA_HOST 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__
#define __align__(n)
#define __launch_bounds__(...)
struct host_dim3 { unsigned x, y, z; };
static host_dim3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
static inline void __syncthreads() {}
static inline void __syncwarp() {}
// A warp of one lane: a butterfly reduction's partner contributes nothing (sums only; the fused kernels and the
// staged expert kernels reduce by sums).
template <class T> static inline T __shfl_xor_sync(unsigned, T, int) { return T(0); }
// ... and a scan's read of a lower lane is never taken (lane 0 has none).
template <class T> static inline T __shfl_up_sync(unsigned, T v, int) { return v; }
// ... and a broadcast from any lane reads the one lane there is.
template <class T> static inline T __shfl_sync(unsigned, T v, int) { return v; }
// ... and a warp reduction (sm_80 redux) is the lane's own value.
static inline unsigned __reduce_max_sync(unsigned, unsigned v) { return v; }
static inline int __reduce_min_sync(unsigned, int v) { return v; }
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline void __stcs(T* p, T v) { *p = v; }
static inline void __threadfence() {}
// Round-to-nearest products and sums that the device compiler may not fuse (the host build does not contract).
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline int atomicAdd(int* p, int v) { int o = *p; *p = o + v; return o; }
// CUDA's byte permute: byte i of the result is byte (s >> 4i) & 7 of the 8 bytes {x, y} (x the low four).
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long b = ((unsigned long long)y << 32) | x, r = 0;
    for (int i = 0; i < 4; ++i) r |= ((b >> (8 * ((s >> (4 * i)) & 7))) & 0xffull) << (8 * i);
    return (unsigned)r;
}
// CUDA's __dp4a: the 4 signed (unsigned) byte products of a and b plus c, wrapping in 32 bits as the device does.
static inline int __dp4a(int a, int b, int c) {
    unsigned r = (unsigned)c;
    for (int i = 0; i < 4; ++i)
        r += (unsigned)((int)(signed char)((unsigned)a >> (8 * i)) * (int)(signed char)((unsigned)b >> (8 * i)));
    return (int)r;
}
static inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int i = 0; i < 4; ++i) c += ((a >> (8 * i)) & 0xffu) * ((b >> (8 * i)) & 0xffu);
    return c;
}
#ifndef STRATA_HOST_BITCASTS  // (also in host_shim.cuh; whichever shim comes first defines them)
#define STRATA_HOST_BITCASTS
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
#endif
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float2 { float x, y; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
using std::min;
using std::max;
static float host_dyn_smem[1 << 16];
// The tests hold a kernel to the dynamic shared bytes its launcher asks for: host_smem_poison(n) fills the buffer
// past n bytes with 0xA5, host_smem_overrun(n) counts the bytes past n that a kernel changed since.
extern "C" void host_smem_poison(long long n) {
    std::memset(reinterpret_cast<unsigned char*>(host_dyn_smem) + n, 0xA5, sizeof(host_dyn_smem) - (size_t)n);
}
extern "C" long long host_smem_overrun(long long n) {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(host_dyn_smem);
    long long c = 0;
    for (size_t i = (size_t)n; i < sizeof(host_dyn_smem); ++i) c += b[i] != 0xA5;
    return c;
}
// Run kernel body `f` for every block of a gx x gy grid (one thread each).
template <class F> static void host_run_grid(unsigned gx, unsigned gy, F f) {
    gridDim = {gx, gy, 1};
    blockDim = {1, 1, 1};
    threadIdx = {0, 0, 0};
    for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) { blockIdx = {x, y, 0}; f(); }
}
