// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by kernels.py / decode.py and compiled with
// NVRTC (cupy.RawModule); tests/test_gpu_kernels_host.py compiles the decoders as host C++.
// Dequantize, quantized matvec (reference and staged), routed-expert FFN kernels. Needs prelude.cuh,
// the tables and decoders.cuh before it.
// ---------------------------------------------------------------------------------------------------
// Dequantize n_groups groups of 8 values: dst[8*i .. 8*i+7].
template <int T> __global__ void dequant_kernel(const u8* __restrict__ src, float* __restrict__ dst, long long n_groups) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_groups) return;
    const int gpb = Unit<T>::bs / 8;
    long long blk = i / gpb;
    int g = (int)(i - blk * gpb);
    float o[8];
    deq8<T>(src + blk * Unit<T>::ts, g, o);
    float4* d4 = reinterpret_cast<float4*>(dst + 8 * i);
    d4[0] = make_float4(o[0], o[1], o[2], o[3]);
    d4[1] = make_float4(o[4], o[5], o[6], o[7]);
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Dot product of one quantized row (ncols values) with x, partial per lane. U groups per lane are decoded
// per iteration so that their loads are in flight together (batch-1 decode is latency-bound otherwise).
#define ILP 4
template <int T> __device__ __forceinline__ float row_dot_lane(const u8* __restrict__ row, const float* __restrict__ x, int ncols, int lane) {
    const int gpb = Unit<T>::bs / 8;
    const int ng = ncols / 8;
    float acc = 0.0f;
    for (int g0 = lane; g0 < ng; g0 += 32 * ILP) {
        float o[ILP][8];
        #pragma unroll
        for (int u = 0; u < ILP; ++u) {
            int gi = g0 + 32 * u;
            if (gi < ng) {
                int blk = gi / gpb, g = gi - blk * gpb;
                deq8<T>(row + (long long)blk * Unit<T>::ts, g, o[u]);
            }
        }
        #pragma unroll
        for (int u = 0; u < ILP; ++u) {
            int gi = g0 + 32 * u;
            if (gi < ng) {
                const float* xx = x + 8 * gi;
                #pragma unroll
                for (int t = 0; t < 8; ++t) acc += o[u][t] * xx[t];
            }
        }
    }
    return acc;
}

// Two rows of the same type against the same x (gate and up), loads of both in flight together.
template <int T> __device__ __forceinline__ void row_dot2_lane(const u8* __restrict__ ra, const u8* __restrict__ rb,
                                                               const float* __restrict__ x, int ncols, int lane,
                                                               float* acc_a, float* acc_b) {
    const int gpb = Unit<T>::bs / 8;
    const int ng = ncols / 8;
    float a = 0.0f, b = 0.0f;
    for (int g0 = lane; g0 < ng; g0 += 32 * (ILP / 2)) {
        float oa[ILP / 2][8], ob[ILP / 2][8];
        #pragma unroll
        for (int u = 0; u < ILP / 2; ++u) {
            int gi = g0 + 32 * u;
            if (gi < ng) {
                int blk = gi / gpb, g = gi - blk * gpb;
                deq8<T>(ra + (long long)blk * Unit<T>::ts, g, oa[u]);
                deq8<T>(rb + (long long)blk * Unit<T>::ts, g, ob[u]);
            }
        }
        #pragma unroll
        for (int u = 0; u < ILP / 2; ++u) {
            int gi = g0 + 32 * u;
            if (gi < ng) {
                const float* xx = x + 8 * gi;
                #pragma unroll
                for (int t = 0; t < 8; ++t) { a += oa[u][t] * xx[t]; b += ob[u][t] * xx[t]; }
            }
        }
    }
    *acc_a = a;
    *acc_b = b;
}

// y[r] = W[r, :] . x for a quantized matrix W of rows x cols (ggml row-major), one warp per row.
template <int T> __global__ void matvec_kernel(const u8* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,
                                               int rows, int cols) {
    extern __shared__ float xs[];
    for (int i = threadIdx.x; i < cols; i += blockDim.x) xs[i] = x[i];
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + warp;
    if (row >= rows) return;
    long long rb = (long long)(cols / Unit<T>::bs) * Unit<T>::ts;
    float acc = warp_sum(row_dot_lane<T>(W + row * rb, xs, cols, lane));
    if (lane == 0) y[row] = acc;
}

// ---------------------------------------------------------------------------------------------------
// Batch-1 matvec, staged ("tiled") variant. Each warp walks rows (grid stride, so x is staged into shared memory
// once per block); a row is read in segments of at most SEG_BYTES: the warp copies the segment's bytes from global
// memory into its own shared buffer with 16-byte loads (coalesced across the warp; the 16-byte-aligned span that
// covers the segment), then decodes the groups from shared memory. W must be 16-byte aligned (the host checks).
#define SEG_BYTES 3072
#define SEG_BUF (SEG_BYTES + 32)

// deq8 for a block in shared memory: Q8_0 reads its quants as 16-bit words (blocks of 34 bytes at even addresses);
// the arithmetic is deq8<8>'s. Other types use deq8.
template <int T> __device__ __forceinline__ void deq8s(const u8* b, int g, float* o) {
    if constexpr (T == 8) {
        const u16* p = reinterpret_cast<const u16*>(b);
        float d = h2f(p[0]);
        #pragma unroll
        for (int t = 0; t < 4; ++t) {
            u16 v = p[1 + 4 * g + t];
            o[2 * t] = (float)(i8)(v & 0xff) * d;
            o[2 * t + 1] = (float)(i8)(v >> 8) * d;
        }
    } else {
        deq8<T>(b, g, o);
    }
}

// xdiv != 0: the input is x' = silu(x / xdiv) (the hyper-connection mix's first activation, applied while staging).
template <int T> __global__ void __launch_bounds__(256) matvec_tiled_kernel(const u8* __restrict__ W, const float* __restrict__ x,
                                                                           float* __restrict__ y, int rows, int cols,
                                                                           float xdiv) {
    extern __shared__ __align__(16) u8 smem[];
    float* xs = reinterpret_cast<float*>(smem);
    if (xdiv != 0.0f) {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            float a = x[i] / xdiv;
            xs[i] = a * (1.0f / (1.0f + expf(-a)));
        }
    } else if ((reinterpret_cast<u64>(x) & 15) == 0) {
        for (int i = threadIdx.x; i < cols / 4; i += blockDim.x)
            reinterpret_cast<float4*>(xs)[i] = reinterpret_cast<const float4*>(x)[i];
    } else {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) xs[i] = x[i];
    }
    __syncthreads();
    const int warps = blockDim.x >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u8* buf = smem + (long long)cols * 4 + warp * SEG_BUF;  // cols is a multiple of 8: 16-byte aligned
    const int bs = Unit<T>::bs, ts = Unit<T>::ts, gpb = bs / 8;
    const int nb = cols / bs;
    const long long rb = (long long)nb * ts;
    const int segb = SEG_BYTES / ts;
    const u8* Wend = W + (long long)rows * rb;
    for (int row = blockIdx.x * warps + warp; row < rows; row += gridDim.x * warps) {
        const u8* rp = W + (long long)row * rb;
        float acc = 0.0f;
        for (int b0 = 0; b0 < nb; b0 += segb) {
            const int nbk = min(segb, nb - b0);
            const u8* s = rp + (long long)b0 * ts;
            const u8* e = s + (long long)nbk * ts;
            const u8* a0 = reinterpret_cast<const u8*>(reinterpret_cast<u64>(s) & ~15ull);
            const int n16 = (int)((e - a0 + 15) >> 4);
            #pragma unroll 4
            for (int c = lane; c < n16; c += 32) {
                const u8* src = a0 + 16 * c;
                uint4 v;
                if (src + 16 <= Wend) {
                    v = __ldg(reinterpret_cast<const uint4*>(src));
                } else {  // the last chunk of the matrix: bytes past its end are not read
                    u32 wv[4] = {0u, 0u, 0u, 0u};
                    #pragma unroll
                    for (int k = 0; k < 16; ++k)
                        if (src + k < Wend) wv[k >> 2] |= (u32)src[k] << (8 * (k & 3));
                    v = make_uint4(wv[0], wv[1], wv[2], wv[3]);
                }
                reinterpret_cast<uint4*>(buf)[c] = v;
            }
            __syncwarp();
            const u8* sp = buf + (s - a0);
            const float* xb = xs + (long long)b0 * bs;
            const int ng = nbk * gpb;
            for (int gi = lane; gi < ng; gi += 32) {
                int blk = gi / gpb, g = gi - blk * gpb;
                float o[8];
                deq8s<T>(sp + blk * ts, g, o);
                const float4* x4 = reinterpret_cast<const float4*>(xb + 8 * gi);
                float4 xa = x4[0], xc = x4[1];
                acc += o[0] * xa.x; acc += o[1] * xa.y; acc += o[2] * xa.z; acc += o[3] * xa.w;
                acc += o[4] * xc.x; acc += o[5] * xc.y; acc += o[6] * xc.z; acc += o[7] * xc.w;
            }
            __syncwarp();
        }
        acc = warp_sum(acc);
        if (lane == 0) y[row] = acc;
    }
}

// Routed-expert FFN, first half. Job j (blockIdx.y) multiplies token tok[j]'s hidden vector X[tok[j], :H] by
// the gate and up matrices at gate_ptr[j] / up_ptr[j] (F rows of H values each) and writes
// Hbuf[j, r] = silu(gate_r . x) * (up_r . x). Pointers may be VRAM slots or mapped host memory.
template <int TG> __global__ void moe_gate_up_kernel(const u64* __restrict__ gate_ptr, const u64* __restrict__ up_ptr,
                                                     const int* __restrict__ tok, const float* __restrict__ X,
                                                     float* __restrict__ Hbuf, int H, int F) {
    extern __shared__ float xs[];
    int j = blockIdx.y;
    const float* x = X + (long long)tok[j] * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) xs[i] = x[i];
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + warp;
    if (row >= F) return;
    long long rb = (long long)(H / Unit<TG>::bs) * Unit<TG>::ts;
    const u8* g = reinterpret_cast<const u8*>(gate_ptr[j]) + row * rb;
    const u8* u = reinterpret_cast<const u8*>(up_ptr[j]) + row * rb;
    float ga, ua;
    row_dot2_lane<TG>(g, u, xs, H, lane, &ga, &ua);
    ga = warp_sum(ga);
    ua = warp_sum(ua);
    if (lane == 0) {
        float silu = ga / (1.0f + expf(-ga));
        Hbuf[(long long)j * F + row] = silu * ua;
    }
}

// Routed-expert FFN, second half. For token t (blockIdx.y) and output row r:
// Y[t, r] (+)= sum over its jobs j in [tstart[t], tstart[t+1]) of w[j] * (down_j[r, :] . Hbuf[j, :]).
template <int TD> __global__ void moe_down_kernel(const u64* __restrict__ down_ptr, const float* __restrict__ w,
                                                  const int* __restrict__ tstart, const float* __restrict__ Hbuf,
                                                  float* __restrict__ Y, int H, int F, int accumulate) {
    int t = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + warp;
    if (row >= H) return;
    long long rb = (long long)(F / Unit<TD>::bs) * Unit<TD>::ts;
    // lanes walk the (job, group) pairs of all this token's experts, ILP groups in flight per lane
    const int gpb = Unit<TD>::bs / 8;
    const int ng = F / 8;
    const int j0 = tstart[t];
    const int total = (tstart[t + 1] - j0) * ng;
    float acc = 0.0f;
    for (int i0 = lane; i0 < total; i0 += 32 * ILP) {
        float o[ILP][8];
        #pragma unroll
        for (int u = 0; u < ILP; ++u) {
            int i = i0 + 32 * u;
            if (i < total) {
                int j = i / ng, gi = i - j * ng;
                const u8* d = reinterpret_cast<const u8*>(down_ptr[j0 + j]) + row * rb;
                int blk = gi / gpb, g = gi - blk * gpb;
                deq8<TD>(d + (long long)blk * Unit<TD>::ts, g, o[u]);
            }
        }
        #pragma unroll
        for (int u = 0; u < ILP; ++u) {
            int i = i0 + 32 * u;
            if (i < total) {
                int j = i / ng, gi = i - j * ng;
                const float* hh = Hbuf + (long long)(j0 + j) * F + 8 * gi;
                float s = 0.0f;
                #pragma unroll
                for (int tt = 0; tt < 8; ++tt) s += o[u][tt] * hh[tt];
                acc += w[j0 + j] * s;
            }
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        long long o = (long long)t * H + row;
        Y[o] = accumulate ? Y[o] + acc : acc;
    }
}
