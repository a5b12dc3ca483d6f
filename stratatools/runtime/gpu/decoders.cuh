// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by kernels.py / decode.py and compiled with
// NVRTC (cupy.RawModule); tests/test_gpu_kernels_host.py compiles the decoders as host C++.
// ggml block decoders: deq8<T>(block, group, out) gives values 8g..8g+7 of a block (layouts: llama.cpp
// ggml-common.h; Q2_0: formats.md section 1). Needs prelude.cuh and the tables kernels.tables_source() writes.
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

