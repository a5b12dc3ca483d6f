"""CUDA source of the GPU dequantizers and quantized matrix-vector products, compiled once with CuPy.

Importing this module needs no CuPy: it only builds the source text. :func:`module` compiles it (NVRTC through
``cupy.RawModule``) on first use and caches the compiled kernels.

Block layouts are ggml's (llama.cpp ``ggml-common.h``; Q2_0 from formats.md section 1). Every decoder works
on *groups of 8 consecutive values* of a block (value ``8g .. 8g+7``), so one thread decodes 8 values that
share their scale. The arithmetic follows ``gguf.quants`` (gguf 0.19.0) operation by operation, in float32,
compiled with ``--fmad=false`` so that no multiply-add is fused: results are bit-identical to the numpy path
of :mod:`stratatools.runtime.dequant`.

The i-quant grids, sign table and non-linear 4-bit values are not retyped: they are read from
``gguf.quants`` at import time (``IQ2_XS.grid`` etc. after ``init_grid()``) and written into the source as
``__device__`` arrays.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

# ggml type ids (gguf.GGMLQuantizationType; Q2_0 = 42 per formats.md section 1).
TYPE_IDS: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
    "Q6_K": 14, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23,
    "IQ1_M": 29, "BF16": 30, "Q2_0": 42,
}

#: Kernel "unit" per type: (values, bytes). For quantized types this is the ggml block; the float types
#: use a pseudo-block of 8 values so that every type decodes in groups of 8.
UNIT: dict[int, tuple[int, int]] = {
    0: (8, 32), 1: (8, 16), 30: (8, 16),
    2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 20: (32, 18), 42: (64, 18),
    12: (256, 144), 13: (256, 176), 14: (256, 210), 17: (256, 74), 18: (256, 98), 21: (256, 110),
    22: (256, 82), 23: (256, 136), 29: (256, 56),
}


def _c_array(ctype: str, name: str, values: np.ndarray) -> str:
    vals = ",".join(str(int(v)) for v in np.asarray(values).reshape(-1))
    return f"__device__ const {ctype} {name}[{np.asarray(values).size}] = {{{vals}}};\n"


@functools.lru_cache(maxsize=1)
def tables_source() -> str:
    """The lookup tables as CUDA ``__device__`` arrays, taken from gguf.quants (never retyped)."""
    from gguf import quants

    out = []
    out.append(_c_array("u8", "KSIGNS", np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)))
    out.append(_c_array("i8", "KVALUES_IQ4NL", np.array(quants.IQ4_NL.kvalues, dtype=np.int8)))
    for cls, name, ctype in ((quants.IQ2_XS, "GRID_IQ2XS", "u8"), (quants.IQ2_S, "GRID_IQ2S", "u8"),
                             (quants.IQ3_XXS, "GRID_IQ3XXS", "u8"), (quants.IQ3_S, "GRID_IQ3S", "u8"),
                             (quants.IQ1_M, "GRID_IQ1", "i8")):
        cls.init_grid()
        grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
        as_int = grid.astype(np.int32)
        assert np.array_equal(as_int.astype(np.float32), grid), name  # integer-valued grids only
        out.append(_c_array(ctype, name, as_int))
    return "".join(out)


_PRELUDE = r"""
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
"""

_DECODERS = r"""
__device__ __forceinline__ u16 rd16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }
__device__ __forceinline__ u32 rd32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
// IEEE half -> float, exact (subnormals, infinities and NaNs included).
__device__ __forceinline__ float h2f(u16 h) {
    u32 sign = (u32)(h >> 15) << 31;
    u32 ex = (h >> 10) & 0x1f;
    u32 man = h & 0x3ff;
    if (ex == 0) {
        float v = (float)man * 5.9604644775390625e-08f;  // man * 2^-24, exact
        return sign ? -v : v;
    }
    u32 bits = sign | ((ex == 31 ? 255u : ex + 112u) << 23) | (man << 13);
    return __int_as_float((int)bits);
}
__device__ __forceinline__ float sgn(u32 bits, int t) { return ((bits >> t) & 1u) ? -1.0f : 1.0f; }

template <int T> struct Unit;
#define UNIT_DEF(T, BS, TS) template <> struct Unit<T> { static const int bs = BS; static const int ts = TS; };
UNIT_DEF(0, 8, 32) UNIT_DEF(1, 8, 16) UNIT_DEF(30, 8, 16)
UNIT_DEF(2, 32, 18) UNIT_DEF(3, 32, 20) UNIT_DEF(6, 32, 22) UNIT_DEF(7, 32, 24) UNIT_DEF(8, 32, 34)
UNIT_DEF(20, 32, 18) UNIT_DEF(42, 64, 18)
UNIT_DEF(12, 256, 144) UNIT_DEF(13, 256, 176) UNIT_DEF(14, 256, 210) UNIT_DEF(17, 256, 74)
UNIT_DEF(18, 256, 98) UNIT_DEF(21, 256, 110) UNIT_DEF(22, 256, 82) UNIT_DEF(23, 256, 136) UNIT_DEF(29, 256, 56)

// Q4_K / Q5_K 6-bit scale and min of sub-block s (0..7), packed in 12 bytes.
__device__ __forceinline__ void k_scale_min(const u8* sc, int s, int* scale, int* mn) {
    if (s < 4) { *scale = sc[s] & 0x3F; *mn = sc[4 + s] & 0x3F; }
    else {
        *scale = (sc[8 + s - 4] & 0x0F) | ((sc[s - 4] >> 2) & 0x30);
        *mn = (sc[8 + s - 4] >> 4) | ((sc[4 + s - 4] >> 2) & 0x30);
    }
}

// Values 8g .. 8g+7 of the block (or pseudo-block) at b.
template <int T> __device__ __forceinline__ void deq8(const u8* __restrict__ b, int g, float* o) {
    if constexpr (T == 0) {  // F32 (word loads when aligned, as GGUF data always is)
        if ((reinterpret_cast<u64>(b) & 3) == 0) {
            const float* f = reinterpret_cast<const float*>(b);
            #pragma unroll
            for (int t = 0; t < 8; ++t) o[t] = f[t];
        } else {
            #pragma unroll
            for (int t = 0; t < 8; ++t) o[t] = __int_as_float((int)rd32(b + 4 * t));
        }
    } else if constexpr (T == 1 || T == 30) {  // F16, BF16
        u16 h[8];
        if ((reinterpret_cast<u64>(b) & 1) == 0) {
            const u16* p = reinterpret_cast<const u16*>(b);
            #pragma unroll
            for (int t = 0; t < 8; ++t) h[t] = p[t];
        } else {
            #pragma unroll
            for (int t = 0; t < 8; ++t) h[t] = rd16(b + 2 * t);
        }
        #pragma unroll
        for (int t = 0; t < 8; ++t) o[t] = (T == 1) ? h2f(h[t]) : __int_as_float((int)((u32)h[t] << 16));
    } else if constexpr (T == 2 || T == 20) {  // Q4_0, IQ4_NL: d, 16 bytes of nibbles (low nibbles = values 0..15)
        float d = h2f(rd16(b));
        const u8* qs = b + 2;
        #pragma unroll
        for (int t = 0; t < 8; ++t) {
            int j = 8 * g + t;
            int q = j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4);
            if constexpr (T == 2) o[t] = d * (float)(q - 8);
            else o[t] = d * (float)KVALUES_IQ4NL[q];
        }
    } else if constexpr (T == 3) {  // Q4_1
        float d = h2f(rd16(b)), m = h2f(rd16(b + 2));
        const u8* qs = b + 4;
        #pragma unroll
        for (int t = 0; t < 8; ++t) {
            int j = 8 * g + t;
            int q = j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4);
            o[t] = d * (float)q + m;
        }
    } else if constexpr (T == 6 || T == 7) {  // Q5_0, Q5_1
        const int off = (T == 6) ? 2 : 4;
        float d = h2f(rd16(b));
        float m = (T == 7) ? h2f(rd16(b + 2)) : 0.0f;
        u32 qh = rd32(b + off);
        const u8* qs = b + off + 4;
        #pragma unroll
        for (int t = 0; t < 8; ++t) {
            int j = 8 * g + t;
            int q = (j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4)) | (int)(((qh >> j) & 1u) << 4);
            if constexpr (T == 6) o[t] = d * (float)(q - 16);
            else o[t] = d * (float)q + m;
        }
    } else if constexpr (T == 8) {  // Q8_0
        float d = h2f(rd16(b));
        #pragma unroll
        for (int t = 0; t < 8; ++t) o[t] = (float)(i8)b[2 + 8 * g + t] * d;
    } else if constexpr (T == 42) {  // Q2_0: (code - 1) * d
        float d = h2f(rd16(b));
        u32 q2 = (u32)b[2 + 2 * g] | ((u32)b[3 + 2 * g] << 8);
        #pragma unroll
        for (int t = 0; t < 8; ++t) o[t] = (float)((int)((q2 >> (2 * t)) & 3u) - 1) * d;
    } else if constexpr (T == 12 || T == 13) {  // Q4_K, Q5_K
        float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
        int s = g >> 2;  // 32-value sub-block
        int scv, mv;
        k_scale_min(b + 4, s, &scv, &mv);
        float dd = d * (float)scv;
        float dm = dmin * (float)mv;
        const u8* qs = b + (T == 12 ? 16 : 48);
        int c = s >> 1, h = s & 1;
        #pragma unroll
        for (int t = 0; t < 8; ++t) {
            int l = 8 * (g & 3) + t;
            int q = (qs[c * 32 + l] >> (4 * h)) & 0xF;
            if constexpr (T == 13) q |= ((b[16 + l] >> s) & 1) << 4;
            o[t] = dd * (float)q - dm;
        }
    } else if constexpr (T == 14) {  // Q6_K
        const u8* ql = b;
        const u8* qh = b + 128;
        const i8* sc = (const i8*)(b + 192);
        float d = h2f(rd16(b + 208));
        int j0 = 8 * g;
        float dd = d * (float)sc[j0 >> 4];
        int c = j0 >> 7, r0 = j0 & 127;
        int h = r0 >> 6, k = r0 >> 5;
        #pragma unroll
        for (int t = 0; t < 8; ++t) {
            int r = r0 + t;
            int lo = (ql[c * 64 + (r & 63)] >> (4 * h)) & 0xF;
            int hi = (qh[c * 32 + (r & 31)] >> (2 * k)) & 3;
            o[t] = dd * (float)((lo | (hi << 4)) - 32);
        }
    } else if constexpr (T == 23) {  // IQ4_XS
        float d = h2f(rd16(b));
        u32 sh = rd16(b + 2);
        const u8* sl = b + 4;
        const u8* qs = b + 8;
        int ib = g >> 2;
        int ls = (int)(((sl[ib >> 1] >> (4 * (ib & 1))) & 0xF) | (((sh >> (2 * ib)) & 3u) << 4)) - 32;
        float dl = d * (float)ls;
        int r0 = 8 * (g & 3);
        int h = r0 >> 4;
        #pragma unroll
        for (int t = 0; t < 8; ++t) {
            int l = (r0 + t) & 15;
            int q = (qs[ib * 16 + l] >> (4 * h)) & 0xF;
            o[t] = dl * (float)KVALUES_IQ4NL[q];
        }
    } else if constexpr (T == 18) {  // IQ3_XXS
        float d = h2f(rd16(b));
        const u8* qs = b + 2;
        int ib = g >> 2, k = g & 3;
        u32 s = rd32(b + 66 + 4 * ib);
        float db = d * (0.5f + (float)(s >> 28)) * 0.5f;
        u32 signs = KSIGNS[(s >> (7 * k)) & 127u];
        const u8* g0 = GRID_IQ3XXS + 4 * qs[2 * g];
        const u8* g1 = GRID_IQ3XXS + 4 * qs[2 * g + 1];
        #pragma unroll
        for (int t = 0; t < 4; ++t) o[t] = db * (float)g0[t] * sgn(signs, t);
        #pragma unroll
        for (int t = 0; t < 4; ++t) o[4 + t] = db * (float)g1[t] * sgn(signs, 4 + t);
    } else if constexpr (T == 21) {  // IQ3_S
        float d = h2f(rd16(b));
        const u8* qs = b + 2;
        const u8* qh = b + 66;
        u32 signs = b[74 + g];
        int ib = g >> 2;
        int sv = (b[106 + (ib >> 1)] >> (4 * (ib & 1))) & 0xF;
        float db = d * (float)(1 + 2 * sv);
        int i0 = 2 * g, i1 = 2 * g + 1;
        int idx0 = qs[i0] | (((qh[i0 >> 3] >> (i0 & 7)) & 1) << 8);
        int idx1 = qs[i1] | (((qh[i1 >> 3] >> (i1 & 7)) & 1) << 8);
        #pragma unroll
        for (int t = 0; t < 4; ++t) o[t] = db * (float)GRID_IQ3S[4 * idx0 + t] * sgn(signs, t);
        #pragma unroll
        for (int t = 0; t < 4; ++t) o[4 + t] = db * (float)GRID_IQ3S[4 * idx1 + t] * sgn(signs, 4 + t);
    } else if constexpr (T == 17) {  // IQ2_XS
        float d = h2f(rd16(b));
        u32 q = rd16(b + 2 + 2 * g);
        int ib16 = g >> 1;
        int s = (b[66 + (ib16 >> 1)] >> (4 * (ib16 & 1))) & 0xF;
        float db = d * (0.5f + (float)s) * 0.25f;
        u32 signs = KSIGNS[q >> 9];
        const u8* gr = GRID_IQ2XS + 8 * (q & 511u);
        #pragma unroll
        for (int t = 0; t < 8; ++t) o[t] = db * (float)gr[t] * sgn(signs, t);
    } else if constexpr (T == 22) {  // IQ2_S
        float d = h2f(rd16(b));
        int idx = b[2 + g] | (((b[66 + (g >> 2)] >> (2 * (g & 3))) & 3) << 8);
        u32 signs = b[34 + g];
        int ib16 = g >> 1;
        int s = (b[74 + (ib16 >> 1)] >> (4 * (ib16 & 1))) & 0xF;
        float db = d * (0.5f + (float)s) * 0.25f;
        const u8* gr = GRID_IQ2S + 8 * idx;
        #pragma unroll
        for (int t = 0; t < 8; ++t) o[t] = db * (float)gr[t] * sgn(signs, t);
    } else if constexpr (T == 29) {  // IQ1_M
        const u8* qs = b;
        const u8* qh = b + 32;
        u32 s0 = rd16(b + 48), s1 = rd16(b + 50), s2 = rd16(b + 52), s3 = rd16(b + 54);
        u16 dbits = (u16)((s0 >> 12) | ((s1 >> 12) << 4) | ((s2 >> 12) << 8) | (s3 & 0xF000u));
        float d = h2f(dbits);
        int si = g >> 1;  // 16-value scale index
        u32 su = rd16(b + 48 + 2 * (si >> 2));
        int s = (su >> (3 * (si & 3))) & 7;
        float dl = d * (float)(2 * s + 1);
        int qhv = (qh[g >> 1] >> (4 * (g & 1))) & 0xF;
        int idx = qs[g] | ((qhv & 7) << 8);
        float delta = (qhv & 8) ? -0.125f : 0.125f;
        const i8* gr = GRID_IQ1 + 8 * idx;
        #pragma unroll
        for (int t = 0; t < 8; ++t) o[t] = dl * ((float)gr[t] + delta);
    }
}

"""

_KERNELS = r"""
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

template <int T> __global__ void __launch_bounds__(256) matvec_tiled_kernel(const u8* __restrict__ W, const float* __restrict__ x,
                                                                           float* __restrict__ y, int rows, int cols) {
    extern __shared__ __align__(16) u8 smem[];
    float* xs = reinterpret_cast<float*>(smem);
    if ((reinterpret_cast<u64>(x) & 15) == 0) {
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
"""


def source() -> str:
    """The whole CUDA translation unit (types, tables from gguf.quants, decoders, kernels)."""
    return _PRELUDE + tables_source() + _DECODERS + _KERNELS


HOST_SHIM = r"""
#include <cstring>
#define __device__
#define __forceinline__ inline
#define __restrict__
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
"""


def host_source() -> str:
    """The decoders alone, compilable as host C++17 (``g++``) with a small shim, plus an ``extern "C"``
    entry ``deq_host(type_id, src, dst, n_groups)``: lets the CPU check the GPU decoders' index arithmetic
    against :mod:`stratatools.runtime.dequant` where no GPU exists (tests/test_gpu_kernels_host.py)."""
    cases = "".join(
        f"        case {tid}: for (long long i = 0; i < n_groups; ++i) deq8<{tid}>(src + (i / {bs // 8}) * {ts}, "
        f"(int)(i % {bs // 8}), dst + 8 * i); return 0;\n" for tid, (bs, ts) in sorted(UNIT.items()))
    entry = ('extern "C" int deq_host(int type_id, const u8* src, float* dst, long long n_groups) {\n'
             "    switch (type_id) {\n" + cases + "        default: return -1;\n    }\n}\n")
    return HOST_SHIM + _PRELUDE + tables_source() + _DECODERS + entry


KERNEL_TEMPLATES = ("dequant_kernel", "matvec_kernel", "moe_gate_up_kernel", "moe_down_kernel")
OPTIONS = ("--std=c++17", "--fmad=false")
#: Kernels of the fast module (:func:`fast_module`): compiled with multiply-add fusion allowed (results differ
#: from the reference kernels by float rounding only; the dequantizers' bit-exactness is the reference module's).
FAST_TEMPLATES = ("matvec_tiled_kernel",)
FAST_OPTIONS = ("--std=c++17",)
#: Bytes of a row segment one warp stages in shared memory (the CUDA source's SEG_BYTES) and its buffer.
SEG_BYTES = 3072
SEG_BUF = SEG_BYTES + 32
TILED_THREADS = 256


@functools.lru_cache(maxsize=1)
def module() -> Any:
    """Compile (once) and return the ``cupy.RawModule`` with every kernel instantiated for every type."""
    import cupy

    names = [f"{k}<{tid}>" for k in KERNEL_TEMPLATES for tid in sorted(UNIT)]
    return cupy.RawModule(code=source(), options=OPTIONS, name_expressions=names)


def kernel(name: str, type_id: int) -> Any:
    """The compiled kernel ``name<type_id>`` (a ``cupy.RawKernel``)."""
    if name in FAST_TEMPLATES:
        return fast_module().get_function(f"{name}<{int(type_id)}>")
    return module().get_function(f"{name}<{int(type_id)}>")


@functools.lru_cache(maxsize=1)
def fast_module() -> Any:
    """Compile (once) the :data:`FAST_TEMPLATES` kernels for every type (``cupy.RawModule``)."""
    import cupy

    names = [f"{k}<{tid}>" for k in FAST_TEMPLATES for tid in sorted(UNIT)]
    return cupy.RawModule(code=source(), options=FAST_OPTIONS, name_expressions=names)


def tiled_shared_bytes(cols: int) -> int:
    """Dynamic shared memory of :func:`matvec_tiled` for rows of ``cols`` values (x + one segment buffer a warp)."""
    return cols * 4 + (TILED_THREADS // 32) * SEG_BUF


@functools.lru_cache(maxsize=None)
def _device_limits() -> tuple[int, int]:
    import cupy

    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return int(dev["multiProcessorCount"]), int(dev.get("sharedMemPerMultiprocessor", 228 * 1024))


def matvec_tiled_launch(W: Any, x: Any, y: Any, type_id: int, rows: int, cols: int) -> None:
    """Launch ``matvec_tiled_kernel<type_id>``: ``y[r] = W[r, :] . x`` (CuPy arrays; W uint8, 16-byte aligned;
    x, y float32 contiguous). Grid: at most the blocks that fit on the device at once (rows by grid stride)."""
    n_sm, smem_sm = _device_limits()
    shm = tiled_shared_bytes(cols)
    per_sm = max(1, min(2048 // TILED_THREADS, smem_sm // (shm + 1024)))
    blocks = max(1, min((rows + TILED_THREADS // 32 - 1) // (TILED_THREADS // 32), n_sm * per_sm))
    k = kernel("matvec_tiled_kernel", type_id)
    if shm > 48 * 1024 and getattr(k, "max_dynamic_shared_size_bytes", 0) < shm:
        k.max_dynamic_shared_size_bytes = shm
    k((blocks,), (TILED_THREADS,), (W, x, y, np.int32(rows), np.int32(cols)), shared_mem=shm)
