// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by decode.py and compiled with NVRTC
// (cupy.RawModule, multiply-add fusion allowed: the fast step agrees with the reference step by tolerance);
// tests/test_gpu_dense_q8_host.py compiles it as host C++ (host_kernel_shim.cuh: one thread per block, blocks run
// one after another) and checks it against numpy.
//
// Batch-1 matvec over Q8_0 matrices re-laid out once at load time (decode.py StaticDecoder, issue 12 item 1): the
// 34-byte ggml blocks (fp16 scale d, 32 int8 codes; llama.cpp ggml-common.h block_q8_0) of a [rows, cols] matrix are
// split into one int8 code array [rows, cols] (row stride cols bytes, so every 16 codes are one 16-byte aligned
// vector load) and one fp16 scale array [rows, cols / 32]. Same bytes as the GGUF blocks; no float copy.
//
// y[r] = sum over blocks b of d[r, b] * sum_j q[r, 32 b + j] x[32 b + j]
// (the reference computes sum_j (q d) x; the two differ by float rounding only).
//
// Work split: a warp computes DQ_RW rows together (each 16-byte vector of x staged in shared memory serves DQ_RW
// rows), its lanes striding over the 16-value chunks of the row, DQ_U chunks per row in flight per lane (the first
// ones issued before x is staged, so that both latencies overlap). Matrices with
// few long rows (the hyper-connection down projection: 324 rows of 10,240 values) are split along the row into
// gridDim.y parts: each part writes its partial sums, and the last block of a row group to finish (a counter per
// row group, reset by that block) adds the parts in order, so the result does not depend on timing.
// Written for any block size (host build: blocks of one thread).
#include "pdl.cuh"  // pdl_wait, pdl_trigger, PDL_ENTRY (programmatic dependent launch)

#ifndef DQ_RW
#define DQ_RW 2
#endif
#ifndef DQ_U
#define DQ_U 6
#endif

// IEEE half -> float, exact (subnormals, infinities and NaNs included); decoders.cuh's h2f.
__device__ __forceinline__ float dq_h2f(unsigned short h) {
    unsigned sign = (unsigned)(h >> 15) << 31;
    unsigned ex = (h >> 10) & 0x1f;
    unsigned man = h & 0x3ff;
    if (ex == 0) {
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    unsigned bits = sign | ((ex == 31 ? 255u : ex + 112u) << 23) | (man << 13);
    return __uint_as_float(bits);
}

// Sum of the 4 signed bytes of w times xx: a byte b becomes the float 2^23 + (b + 128) by a byte permute into the
// mantissa of 2^23 (exact), minus 2^23 + 128 (exact): b as float without an integer-to-float conversion.
__device__ __forceinline__ float dq_dot4(unsigned w, float4 xx, float s) {
    const unsigned v = w ^ 0x80808080u;
    s += (__uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440)) - 8388736.0f) * xx.x;
    s += (__uint_as_float(__byte_perm(v, 0x4B000000u, 0x7441)) - 8388736.0f) * xx.y;
    s += (__uint_as_float(__byte_perm(v, 0x4B000000u, 0x7442)) - 8388736.0f) * xx.z;
    s += (__uint_as_float(__byte_perm(v, 0x4B000000u, 0x7443)) - 8388736.0f) * xx.w;
    return s;
}

__device__ __forceinline__ float dq_dot16(uint4 q, const float* xs) {
    const float4* x4 = reinterpret_cast<const float4*>(xs);
    float s = dq_dot4(q.x, x4[0], 0.0f);
    s = dq_dot4(q.y, x4[1], s);
    s = dq_dot4(q.z, x4[2], s);
    return dq_dot4(q.w, x4[3], s);
}

#ifdef STRATA_HOST
static inline float dq_warp_sum(float v) { return v; }
#define DQ_DYN_SHARED(T, name) T* name = reinterpret_cast<T*>(host_dyn_smem)
#else
__device__ __forceinline__ float dq_warp_sum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
#define DQ_DYN_SHARED(T, name) extern __shared__ __align__(16) unsigned char dq_smem_[]; T* name = reinterpret_cast<T*>(dq_smem_)
#endif

// xs[i] = x[i] (or silu(x[i] / xdiv) when xdiv != 0: the hyper-connection mix's input) for i < n, the block's threads
// striding; the caller synchronises before reading xs.
__device__ __forceinline__ void dq_stage_x(const float* __restrict__ x, float xdiv, float* xs, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float a = x[i];
        if (xdiv != 0.0f) {
            a = a / xdiv;
            a = a * (1.0f / (1.0f + expf(-a)));
        }
        xs[i] = a;
    }
}

// qs: int8 codes [rows, cols]; dsc: fp16 scales [rows, cols / 32]; x [cols]; y [rows]; cols a multiple of 32.
// xdiv != 0: the input is silu(x / xdiv) (applied while x is staged, as matvec_tiled_kernel does).
// Grid: (ceil(rows / rows_per_block), ksplit) with rows_per_block = DQ_RW * warps per block; dynamic shared
// memory: 64 * ceil(cols / 16 / ksplit) bytes. With ksplit > 1: part [ksplit, rows] scratch, counter [gridDim.x]
// zeroed (left zeroed).
extern "C" __global__ void mv_q8r(const signed char* __restrict__ qs, const unsigned short* __restrict__ dsc,
                                  const float* __restrict__ x, float* __restrict__ y, int rows, int cols, float xdiv,
                                  float* __restrict__ part, int* __restrict__ counter) {
    DQ_DYN_SHARED(float, xs);
    const int ksplit = gridDim.y;
    const int nch = cols >> 4;  // 16-value chunks of a row
    const int cps = (nch + ksplit - 1) / ksplit;
    const int ks = blockIdx.y;
    const int c0 = ks * cps;
    const int c1 = min(nch, c0 + cps);
    const int lanes = blockDim.x < 32 ? (int)blockDim.x : 32;
    const int nw = (blockDim.x + 31) >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rpb = nw * DQ_RW;
    const int r0 = blockIdx.x * rpb + warp * DQ_RW;
    const long long nb = cols >> 5;
    const bool active = r0 < rows;
    const signed char* rp[DQ_RW];
    const unsigned short* dp[DQ_RW];
    #pragma unroll
    for (int r = 0; r < DQ_RW; ++r) {
        const long long rr = min(r0 + r, rows - 1);  // rows past the end repeat the last one (not written)
        rp[r] = qs + rr * (long long)cols;
        dp[r] = dsc + rr * nb;
    }
    uint4 q[DQ_U][DQ_RW];
    float d[DQ_U][DQ_RW];
    // the loads of DQ_U chunks of each of the warp's rows from chunk c on, all in flight together (a macro, so that
    // q and d stay registers)
#define DQ_LOAD(c_)                                                                                            \
    _Pragma("unroll") for (int u = 0; u < DQ_U; ++u) {                                                         \
        const int cc = (c_) + u * lanes;                                                                       \
        if (cc < c1) {                                                                                         \
            _Pragma("unroll") for (int r = 0; r < DQ_RW; ++r) {                                                \
                q[u][r] = __ldg(reinterpret_cast<const uint4*>(rp[r] + 16 * (long long)cc));                   \
                d[u][r] = dq_h2f(__ldg(dp[r] + (cc >> 1)));                                                    \
            }                                                                                                  \
        }                                                                                                      \
    }
    int c = c0 + lane;
    if (active && c < c1) { DQ_LOAD(c) }  // issued before x is staged: the two latencies overlap
    PDL_ENTRY();  // after the weight loads: they overlap the previous kernel's end (pdl.cuh)
    const int nx = c1 > c0 ? 16 * (c1 - c0) : 0;
    dq_stage_x(x + 16 * c0, xdiv, xs, nx);
    __syncthreads();
    float acc[DQ_RW];
    #pragma unroll
    for (int r = 0; r < DQ_RW; ++r) acc[r] = 0.0f;
    if (active) {
        while (c < c1) {
            #pragma unroll
            for (int u = 0; u < DQ_U; ++u) {
                const int cc = c + u * lanes;
                if (cc < c1) {
                    const float* xx = xs + 16 * (cc - c0);
                    #pragma unroll
                    for (int r = 0; r < DQ_RW; ++r) acc[r] += d[u][r] * dq_dot16(q[u][r], xx);
                }
            }
            c += lanes * DQ_U;
            if (c < c1) { DQ_LOAD(c) }
        }
    }
    #pragma unroll
    for (int r = 0; r < DQ_RW; ++r) acc[r] = dq_warp_sum(acc[r]);
    if (ksplit == 1) {
        if (lane == 0) {
            #pragma unroll
            for (int r = 0; r < DQ_RW; ++r)
                if (r0 + r < rows) y[r0 + r] = acc[r];
        }
        return;
    }
    if (lane == 0) {
        #pragma unroll
        for (int r = 0; r < DQ_RW; ++r)
            if (r0 + r < rows) part[(long long)ks * rows + r0 + r] = acc[r];
    }
    __threadfence();
    __syncthreads();
    __shared__ int dq_last;
    if (threadIdx.x == 0) dq_last = atomicAdd(counter + blockIdx.x, 1) == ksplit - 1;
    __syncthreads();
    if (!dq_last) return;
    __threadfence();
    for (int i = threadIdx.x; i < rpb; i += blockDim.x) {
        const int row = blockIdx.x * rpb + i;
        if (row < rows) {
            float s = 0.0f;
            for (int k = 0; k < ksplit; ++k) s += __ldcg(part + (long long)k * rows + row);
            y[row] = s;
        }
    }
    if (threadIdx.x == 0) counter[blockIdx.x] = 0;
}

#define DQ_MAX_HC 8
// The hyper-connection up projection and mix in one launch: u = W x' (W [hc n, cols] in the layout above, x' =
// silu(x / xdiv)), then mixed[i] = (sum over h < hc of sigmoid(u[h n + i]) hn[h n + i]) / hc (decode_step.cu hc_mix),
// without writing u. A warp computes the hc rows h n + i of one i together (grid-stride over i); hc <= DQ_MAX_HC.
// Dynamic shared memory: 4 cols bytes.
extern "C" __global__ void mv_q8r_mix(const signed char* __restrict__ qs, const unsigned short* __restrict__ dsc,
                                      const float* __restrict__ x, float xdiv, const float* __restrict__ hn,
                                      float* __restrict__ mixed, int hc, int n, int cols) {
    PDL_ENTRY();
    DQ_DYN_SHARED(float, xs);
    dq_stage_x(x, xdiv, xs, cols);
    __syncthreads();
    const int nch = cols >> 4;
    const long long nb = cols >> 5;
    const int lanes = blockDim.x < 32 ? (int)blockDim.x : 32;
    const int nw = (blockDim.x + 31) >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = blockIdx.x * nw + warp; i < n; i += gridDim.x * nw) {
        float acc[DQ_MAX_HC];
        #pragma unroll
        for (int h = 0; h < DQ_MAX_HC; ++h) acc[h] = 0.0f;
        for (int c = lane; c < nch; c += lanes) {
            uint4 q[DQ_MAX_HC];
            float d[DQ_MAX_HC];
            #pragma unroll
            for (int h = 0; h < DQ_MAX_HC; ++h) {
                if (h < hc) {
                    const long long row = (long long)h * n + i;
                    q[h] = __ldg(reinterpret_cast<const uint4*>(qs + row * cols + 16 * (long long)c));
                    d[h] = dq_h2f(__ldg(dsc + row * nb + (c >> 1)));
                }
            }
            const float* xx = xs + 16 * c;
            #pragma unroll
            for (int h = 0; h < DQ_MAX_HC; ++h)
                if (h < hc) acc[h] += d[h] * dq_dot16(q[h], xx);
        }
        float s = 0.0f;
        #pragma unroll
        for (int h = 0; h < DQ_MAX_HC; ++h) {
            if (h < hc) {
                const float u = dq_warp_sum(acc[h]);
                s += (1.0f / (1.0f + expf(-u))) * hn[(long long)h * n + i];
            }
        }
        if (lane == 0) mixed[i] = s / (float)hc;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Streaming matvec (mv_q8s): the same layout and sums as mv_q8r, organised for bandwidth on tall matrices.
// mv_q8r gives each warp two rows once (grid = one pass), so all warps of a wave load, then all compute, with
// few blocks per SM (92 registers); on the H200 it reached 1.5 TB/s on the 34 MB projections (4.3 TB/s copy).
// Here a grid of a few blocks per SM walks the rows (rows spread over blocks first, so that every SM gets the
// same share), each warp holds at most DQS_U chunks per lane in registers (80 registers: 3 blocks of 256 threads
// per SM, 24 warps whose loads overlap the others' arithmetic; a version that loaded a warp's next window while
// computing the current one measured slower on the H200: 23.1 against 19.3 us on the 34 MB projection), and x is
// read from shared memory in a
// rotated order that keeps a quarter warp's 16-byte reads on distinct banks.
//
// Work split: `lpr` lanes per matrix row (a power of two; clamped to the warp's lanes), each taking chunks
// sl, sl + lpr, ... of the row in windows of `u` chunks (u <= DQS_U). Mix mode (hc > 0):
// output i of n combines the hc rows h n + i as mv_q8r_mix does; the rows of one output are
// spread over lane groups of one warp (then over a lane's loop) and summed by shuffles.
#ifndef DQS_U
#define DQS_U 8
#endif
#ifndef DQS_MINB
#define DQS_MINB 3  // blocks of 256 threads per SM the register budget allows (80 registers at DQS_U 8, no spills)
#endif

// sum_j q_j x_j over one 16-value chunk, the 4 words of q taken in the order r, r+1, .. (mod 4) with x's matching
// 16-byte pieces. With r = (chunk >> 1) & 3, eight lanes reading consecutive chunks (64 bytes of x apart) hit 8
// different 16-byte bank groups of shared memory instead of 2 (no 4-way conflict on the quarter warp's reads).
__device__ __forceinline__ float dq_dot16_rot(uint4 q, const float* xs, int r) {
    unsigned a0 = q.x, a1 = q.y, a2 = q.z, a3 = q.w;
    if (r & 1) { const unsigned t = a0; a0 = a1; a1 = a2; a2 = a3; a3 = t; }
    if (r & 2) { unsigned t = a0; a0 = a2; a2 = t; t = a1; a1 = a3; a3 = t; }
    const float4* x4 = reinterpret_cast<const float4*>(xs);
    float s = dq_dot4(a0, x4[r & 3], 0.0f);
    s = dq_dot4(a1, x4[(r + 1) & 3], s);
    s = dq_dot4(a2, x4[(r + 2) & 3], s);
    return dq_dot4(a3, x4[(r + 3) & 3], s);
}

// The lane roles of mv_q8s's work split (mv_q8i keeps it): L lanes per matrix row (lpr clamped to the warp's lanes),
// nhs lane groups sharing one output's hc streams in mix mode (the largest power of two dividing hc with nhs L <=
// lanes), G = L nhs lanes per output, gpw outputs per warp; this lane's output in the warp (sub), stream group (hs)
// and lane in its row (sl).
struct DqSplit {
    int L, nhs, G, gpw, sub, hs, sl;
};

__device__ __forceinline__ DqSplit dq_split(int lpr, int hc, int lanes, int lane) {
    DqSplit p;
    p.L = lpr < lanes ? lpr : lanes;
    p.nhs = 1;
    if (hc > 0)
        while (p.nhs * 2 <= hc && p.L * p.nhs * 2 <= lanes && hc % (p.nhs * 2) == 0) p.nhs *= 2;
    p.G = p.L * p.nhs;
    p.gpw = lanes / p.G;
    p.sub = lane / p.G;
    p.hs = (lane % p.G) / p.L;
    p.sl = lane % p.L;
    return p;
}

// y = W x' (x' = x, or silu(x / xdiv) when xdiv != 0) for W [rows, cols] (codes qs, fp16 scales dsc as mv_q8r),
// or in mix mode (hc > 0): y[i] = (sum over h < hc of sigmoid((W x')[h n + i]) hn[h n + i]) / hc for i < n (W has
// hc n rows). Grid: any number of blocks (the host launches a few per SM), any block size; dynamic shared memory:
// 4 cols bytes. cols a multiple of 32; lpr a power of two; 1 <= u <= DQS_U; hc >= 0 (the streams of an output go
// to nhs lane groups, nhs the largest power of two dividing hc with nhs lpr <= the warp's lanes; each group's lanes
// loop over hc / nhs streams, so every lane runs the same shuffles).
extern "C" __global__ void __launch_bounds__(256, DQS_MINB) mv_q8s(
        const signed char* __restrict__ qs, const unsigned short* __restrict__ dsc, const float* __restrict__ x,
        float* __restrict__ y, int rows, int cols, float xdiv, int lpr, int u, const float* __restrict__ hn, int hc,
        int n) {
    PDL_ENTRY();
    DQ_DYN_SHARED(float, xs);
    dq_stage_x(x, xdiv, xs, cols);
    __syncthreads();
    const int lanes = blockDim.x < 32 ? (int)blockDim.x : 32;
    const int nw = (blockDim.x + 31) >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const DqSplit sp = dq_split(lpr, hc, lanes, lane);
    const int L = sp.L, nhs = sp.nhs, G = sp.G, gpw = sp.gpw, sub = sp.sub, hs = sp.hs, sl = sp.sl;
    const int nch = cols >> 4;
    const long long nb = cols >> 5;
    const int win = u * L;
    const int nout = hc > 0 ? n : rows;
    const int nsub = hc > 0 ? hc : 1;
    const long long stride = (long long)gridDim.x * nw * gpw;
    // outputs spread over blocks first: block b's warps take outputs b, b + gridDim.x, ... (times gpw)
    for (long long base = ((long long)warp * gridDim.x + blockIdx.x) * gpw; base < nout; base += stride) {
        const long long o = base + sub;
        const bool act = o < nout;
        float s = 0.0f;
        for (int h = hs; h < nsub; h += nhs) {
            const long long row = hc > 0 ? (long long)h * n + o : o;
            const signed char* rp = qs + row * (long long)cols;
            const unsigned short* dp = dsc + row * nb;
            float acc = 0.0f;
            for (int c0 = sl; c0 < nch; c0 += win) {
                // this lane's chunks c0, c0 + L, ... of the window: kn of them (none for a row past the end)
                const int kn = act ? min(u, (nch - c0 + L - 1) / L) : 0;
                const uint4* qp = reinterpret_cast<const uint4*>(rp) + c0;
                uint4 q[DQS_U];
                unsigned short d[DQS_U];
                #pragma unroll
                for (int k = 0; k < DQS_U; ++k) {
                    if (k < kn) {
                        q[k] = __ldg(qp + k * L);
                        d[k] = __ldg(dp + ((c0 + k * L) >> 1));
                    }
                }
                #pragma unroll
                for (int k = 0; k < DQS_U; ++k)
                    if (k < kn) {
                        const int cc = c0 + k * L;
                        acc += dq_h2f(d[k]) * dq_dot16_rot(q[k], xs + 16 * cc, (cc >> 1) & 3);
                    }
            }
            for (int off = L >> 1; off; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
            if (hc > 0) {
                s += act ? (1.0f / (1.0f + expf(-acc))) * hn[row] : 0.0f;
            } else {
                s = acc;
            }
        }
        for (int off = G >> 1; off >= L; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (act && lane % G == 0) y[o] = hc > 0 ? s / (float)hc : s;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Integer matvec (mv_q8i): mv_q8s's contract, work split and launch shapes, with the products in int8 dot products
// (__dp4a: 4 int8 x int8 products and an int32 add per instruction) instead of one float per code (byte permute,
// subtract, FMA: about 60 instructions per 16 bytes of codes in mv_q8s; here 8 dp4a and 5 more).
//
// x' (x, or silu(x / xdiv)) is quantized per 32-value block b while it is staged: s_b = max |x'| over the block /
// DQI_QMAX, v = rint(x' * (1 / s_b)) in [-DQI_QMAX, DQI_QMAX], split into two int8 planes hi = floor((v + 128) / 256)
// and lo = v - 256 hi (in [-128, 127]). DQI_QMAX = 127 * 256 + 127 = 32639 is the largest bound for which both planes
// fit in int8 (v = 32767 would need hi = 128, or lo = 255). Shared memory: hi [cols] int8, lo [cols] int8, s
// [cols / 32] float: 2 cols + cols / 8 bytes (DQI_SHARED_BYTES; mv_q8s's 4 cols also suffices). For a 16-value chunk
// c of a row (block c >> 1): ih = sum of 4 dp4a of the 16 codes with the 16 hi bytes, il likewise with lo, and the
// chunk adds d[row, c >> 1] s_b (float)(256 ih + il) to the row's float sum (|ih| <= 16 * 128 * 127, |il| <=
// 16 * 128 * 128: |256 ih + il| < 2^27, an exact int32).
//
// Precision: W (v s) differs from W x' only by the rounding of x' to v s: |error| <= sum_j |w_j| s_b(j) / 2 over the
// row (each x' within s_b / 2 = max |x'| of its block / 65278, about 1.5e-5 of that max; the float32 rounding of
// 1 / s_b and of x' (1 / s_b) can add up to 0.004 s_b), plus float32 rounding of the chunk terms (d s_b, the int to
// float conversion) and of their sum.
// Range: x' finite; a block whose max |x'| is below DQI_TINY (2^-100, about 7.9e-31) counts as zero (s_b = 0: it
// adds nothing, so the error there is at most that max times the |w| of the block), which keeps s_b a normal float
// and 1 / s_b finite; no upper limit besides float's (no x' * 32639 is formed). Device: blocks of a multiple of 32
// threads (DQI_G = 8 lanes quantize a block of 32 values together, by shuffles); the host build (one thread a block)
// quantizes a block in one thread (DQI_G = 1).
#ifndef DQI_U
#define DQI_U 5
#endif
#ifndef DQI_MINB
#define DQI_MINB 4  // blocks of 256 threads per SM the register budget allows (64 registers at DQI_U 5, no spills)
#endif
#ifndef DQI_PRE
#define DQI_PRE 1  // the first window's loads issued before x is staged (see mv_q8i)
#endif
#define DQI_QMAX 32639
#define DQI_TINY 7.888609052210118e-31f  // 2^-100
#ifdef STRATA_HOST
#define DQI_G 1
#else
#define DQI_G 8
#endif

// IEEE half -> float: one cvt instruction on the device (dq_h2f's exact bit assembly on the host: same value).
__device__ __forceinline__ float dqi_h2f(unsigned short h) {
#ifdef STRATA_HOST
    return dq_h2f(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

// Stage x' = x (or silu(x / xdiv) when xdiv != 0) quantized as described above: xh / xl the hi / lo planes [cols],
// xsc the block scales [cols / 32]. A warp's lanes take lanes / DQI_G consecutive blocks at a time, DQI_G lanes a
// block, each lane 32 / DQI_G consecutive values (loop bounds uniform over the warp: every lane runs the shuffles).
// The caller synchronises before reading the planes.
__device__ __forceinline__ void dqi_stage_x(const float* __restrict__ x, float xdiv, signed char* xh, signed char* xl,
                                            float* xsc, int cols) {
    const int lanes = blockDim.x < 32 ? (int)blockDim.x : 32;
    const int nw = (blockDim.x + 31) >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gpw = lanes >= DQI_G ? lanes / DQI_G : 1;  // blocks a warp quantizes at once
    const int gl = lane % DQI_G;
    const int nblk = cols >> 5;
    for (int base = warp * gpw; base < nblk; base += nw * gpw) {
        const int b = base + lane / DQI_G;
        const bool ok = b < nblk;
        float a[32 / DQI_G];
        float m = 0.0f;
        #pragma unroll
        for (int p = 0; p < 32 / DQI_G / 4; ++p) {
            #pragma unroll
            for (int t = 0; t < 4; ++t) {
                float v = ok ? x[32 * b + 4 * (gl + p * DQI_G) + t] : 0.0f;
                if (xdiv != 0.0f) {
                    v = v / xdiv;
                    v = v * (1.0f / (1.0f + expf(-v)));
                }
                a[4 * p + t] = v;
                m = fmaxf(m, fabsf(v));
            }
        }
        for (int o = DQI_G >> 1; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const bool live = m >= DQI_TINY;
        const float s = live ? m / (float)DQI_QMAX : 0.0f;
        const float inv = live ? 1.0f / s : 0.0f;
        if (ok) {
            #pragma unroll
            for (int p = 0; p < 32 / DQI_G / 4; ++p) {
                unsigned hw = 0, lw = 0;
                #pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const float r = fminf(fmaxf(rintf(a[4 * p + t] * inv), -(float)DQI_QMAX), (float)DQI_QMAX);
                    const int v = (int)r;
                    const int hi = (v + 128) >> 8;  // floor: lo = v - 256 hi in [-128, 127]
                    const int lo = v - 256 * hi;
                    hw |= ((unsigned)hi & 0xffu) << (8 * t);
                    lw |= ((unsigned)lo & 0xffu) << (8 * t);
                }
                const int j = 32 * b + 4 * (gl + p * DQI_G);
                *reinterpret_cast<unsigned*>(xh + j) = hw;
                *reinterpret_cast<unsigned*>(xl + j) = lw;
            }
            if (gl == 0) xsc[b] = s;
        }
    }
}

// Dynamic shared bytes of mv_q8i for rows of cols values (the planes, then the scales).
#define DQI_SHARED_BYTES(cols) (2 * (cols) + 4 * ((cols) >> 5))

// 256 ih + il over one 16-value chunk: q the 16 codes, h / l the 16 hi / lo bytes of x'.
__device__ __forceinline__ int dqi_dot16(uint4 q, uint4 h, uint4 l) {
    int ih = __dp4a((int)q.x, (int)h.x, 0);
    ih = __dp4a((int)q.y, (int)h.y, ih);
    ih = __dp4a((int)q.z, (int)h.z, ih);
    ih = __dp4a((int)q.w, (int)h.w, ih);
    int il = __dp4a((int)q.x, (int)l.x, 0);
    il = __dp4a((int)q.y, (int)l.y, il);
    il = __dp4a((int)q.z, (int)l.z, il);
    il = __dp4a((int)q.w, (int)l.w, il);
    return ih * 256 + il;
}

// mv_q8s with integer dot products (same arguments, same plain and mix modes, same silu(x / xdiv) input, any grid):
// y = W x' for W [rows, cols], or in mix mode (hc > 0) y[i] = (sum over h < hc of sigmoid((W x')[h n + i])
// hn[h n + i]) / hc for i < n. Launch shapes: kernels.dqi_launch_shape (dqs_launch_shape with u <= DQI_U and
// DQI_MINB blocks per SM, DQI_SHARED_BYTES(cols) shared bytes); dqs_launch_shape's own shapes work too (4 cols
// shared bytes; any u: a window above DQI_U chunks is taken as DQI_U). Block size: a multiple of 32 on the device.
// Registers (nvcc -arch=sm_90 -cubin -O3 --std=c++17, ptxas): 64 at DQI_U 5 / DQI_MINB 4 / DQI_PRE 1, no spills
// (mv_q8s: 80 at DQS_U 8). The first window held in registers while x is staged costs some: at DQI_U 6 and 4
// blocks per SM it spills 16 bytes with DQI_PRE 1, none with DQI_PRE 0 (64 registers); DQI_U 7 fits 3 blocks
// (80), DQI_U 12 fits 2 (125); without DQI_PRE, DQI_U 4 fits 5 blocks (48). Unbounded, the kernel takes 85 registers
// at DQI_U 6 (the shared-memory reads of a window's x planes are issued early, 8 registers a chunk).
// bench_dense_q8.py times such builds beside the default.
extern "C" __global__ void __launch_bounds__(256, DQI_MINB) mv_q8i(
        const signed char* __restrict__ qs, const unsigned short* __restrict__ dsc, const float* __restrict__ x,
        float* __restrict__ y, int rows, int cols, float xdiv, int lpr, int u, const float* __restrict__ hn, int hc,
        int n) {
    DQ_DYN_SHARED(signed char, xh);
    signed char* xl = xh + cols;
    float* xsc = reinterpret_cast<float*>(xh + 2 * cols);
    const int lanes = blockDim.x < 32 ? (int)blockDim.x : 32;
    const int nw = (blockDim.x + 31) >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const DqSplit sp = dq_split(lpr, hc, lanes, lane);
    const int L = sp.L, nhs = sp.nhs, G = sp.G, gpw = sp.gpw, sub = sp.sub, hs = sp.hs, sl = sp.sl;
    const int uw = u < 1 ? 1 : (u > DQI_U ? DQI_U : u);
    const int nch = cols >> 4;
    const long long nb = cols >> 5;
    const int win = uw * L;
    const int nout = hc > 0 ? n : rows;
    const int nsub = hc > 0 ? hc : 1;
    const long long stride = (long long)gridDim.x * nw * gpw;
    const uint4* xh4 = reinterpret_cast<const uint4*>(xh);
    const uint4* xl4 = reinterpret_cast<const uint4*>(xl);
    const long long base0 = ((long long)warp * gridDim.x + blockIdx.x) * gpw;
    uint4 q[DQI_U];
    unsigned short d[DQI_U];
    // DQI_PRE: the loads of the lane's first window (output base0 + sub, stream hs, chunks sl, sl + L, ...) are
    // issued before x is staged, so that both latencies overlap; the loop below starts with that window (pre)
    bool pre = DQI_PRE != 0;
    if (pre) {
        const long long o = base0 + sub;
        const int kn = o < nout && sl < nch ? min(uw, (nch - sl + L - 1) / L) : 0;
        const long long row = hc > 0 ? (long long)hs * n + o : o;
        const uint4* qp = reinterpret_cast<const uint4*>(qs + row * (long long)cols) + sl;
        const unsigned short* dp = dsc + row * nb;
        #pragma unroll
        for (int k = 0; k < DQI_U; ++k) {
            if (k < kn) {
                q[k] = __ldg(qp + k * L);
                d[k] = __ldg(dp + ((sl + k * L) >> 1));
            }
        }
    }
    PDL_ENTRY();  // after the first window's weight loads (pdl.cuh)
    dqi_stage_x(x, xdiv, xh, xl, xsc, cols);
    __syncthreads();
    // outputs spread over blocks first: block b's warps take outputs b, b + gridDim.x, ... (times gpw)
    for (long long base = base0; base < nout; base += stride) {
        const long long o = base + sub;
        const bool act = o < nout;
        float s = 0.0f;
        for (int h = hs; h < nsub; h += nhs) {
            const long long row = hc > 0 ? (long long)h * n + o : o;
            const signed char* rp = qs + row * (long long)cols;
            const unsigned short* dp = dsc + row * nb;
            float acc = 0.0f;
            for (int c0 = sl; c0 < nch; c0 += win) {
                // this lane's chunks c0, c0 + L, ... of the window: kn of them (none for a row past the end)
                const int kn = act ? min(uw, (nch - c0 + L - 1) / L) : 0;
                if (!pre) {
                    const uint4* qp = reinterpret_cast<const uint4*>(rp) + c0;
                    #pragma unroll
                    for (int k = 0; k < DQI_U; ++k) {
                        if (k < kn) {
                            q[k] = __ldg(qp + k * L);
                            d[k] = __ldg(dp + ((c0 + k * L) >> 1));
                        }
                    }
                }
                pre = false;
                #pragma unroll
                for (int k = 0; k < DQI_U; ++k)
                    if (k < kn) {
                        const int cc = c0 + k * L;
                        const int iv = dqi_dot16(q[k], xh4[cc], xl4[cc]);
                        acc += (dqi_h2f(d[k]) * xsc[cc >> 1]) * (float)iv;
                    }
            }
            for (int off = L >> 1; off; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
            if (hc > 0) {
                s += act ? (1.0f / (1.0f + expf(-acc))) * hn[row] : 0.0f;
            } else {
                s = acc;
            }
        }
        for (int off = G >> 1; off >= L; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (act && lane % G == 0) y[o] = hc > 0 ? s / (float)hc : s;
    }
}
