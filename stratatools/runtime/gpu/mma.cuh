// Part of stratatools (stratatools/runtime/gpu). Included by qmm.cu (kernels.py / qmm.py assemble the source); also
// compiles as host C++17 after host_kernel_shim.cuh (tests/test_gpu_qmm_host.py).
//
// A thin warp-level wrapper of the tensor-core instruction mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32:
// D[16 x 8] = A[16 x 16] B[16 x 8] + C, A and B half precision, C and D float32; and (at the end) of the integer
// m16n8k32 products the Q2_0 expert jobs take.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"; g = lane >> 2, c = lane & 3):
//   A: 4 registers of two halves (low half = first element): a0..a7; element ai sits at
//      row g + 8 [i in {2, 3, 6, 7}], column 2 c + (i & 1) + 8 [i >= 4]; register m holds a(2m), a(2m+1).
//   B: 2 registers: b0..b3; bi at row (k) 2 c + (i & 1) + 8 [i >= 2], column (n) g.
//   C, D: 4 floats c0..c3; ci at row g + 8 [i >= 2], column 2 c + (i & 1).
// Every fragment has a lane dimension MMA_LANES: on the device a thread holds its own lane's registers
// (MMA_LANES = 1, the lane is threadIdx.x & 31); the host build runs a block as one thread, which holds all 32
// lanes' registers (MMA_LANES = 32) and plays the lanes in turn; mma_sync then computes the 16 x 8 product from all
// lanes' fragments through the layout above (products exact, sums in double, one rounding to float per element: the
// device's accumulation differs from that by float rounding only).
//
// Also: float <-> half conversion (round to nearest even, the device's cvt.rn.f16.f32 / __float2half_rn; subnormals,
// overflow to infinity), and the packing of two halves into a register.
#ifndef STRATA_MMA_CUH
#define STRATA_MMA_CUH

#ifdef STRATA_HOST
#define MMA_LANES 32
#else
#define MMA_LANES 1
#endif

struct mma_a { u32 x[MMA_LANES][4]; };
struct mma_b { u32 x[MMA_LANES][2]; };
struct mma_c { float x[MMA_LANES][4]; };

// The lane that fragment slot l (0 <= l < MMA_LANES) belongs to.
__device__ __forceinline__ int mma_lane(int l) {
#ifdef STRATA_HOST
    return l;
#else
    (void)l;
    return (int)(threadIdx.x & 31);
#endif
}

__device__ __forceinline__ void mma_zero(mma_c& c) {
    for (int l = 0; l < MMA_LANES; ++l) c.x[l][0] = c.x[l][1] = c.x[l][2] = c.x[l][3] = 0.0f;
}

// IEEE half bits -> float (exact).
__device__ __forceinline__ float mma_h2f(u16 h) {
#ifdef STRATA_HOST
    const u32 sign = (u32)(h >> 15) << 31, ex = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (ex == 0) {
        const float v = (float)man * 5.9604644775390625e-08f;  // man * 2^-24, exact
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((ex == 31 ? 255u : ex + 112u) << 23) | (man << 13));
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

// float -> IEEE half bits, round to nearest even (subnormal halves, overflow to infinity, NaN stays NaN).
__device__ __forceinline__ u16 mma_f2h(float f) {
#ifdef STRATA_HOST
    const u32 x = __float_as_uint(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (u16)(sign | 0x7e00u);         // NaN
    if (ax >= 0x477ff000u) return (u16)(sign | 0x7c00u);        // >= 65520: infinity
    if (ax >= 0x38800000u) {                                    // normal half: rebias, round on the 13 dropped bits
        const u32 t = ax - 0x38000000u;
        return (u16)(sign | ((t + 0xfffu + ((t >> 13) & 1u)) >> 13));
    }
    const int e = (int)(ax >> 23);                              // subnormal half (or zero): units of 2^-24
    if (e < 102) return (u16)sign;                              // below 2^-25: rounds to zero
    const u32 m = (ax & 0x7fffffu) | 0x800000u;
    const int s = 126 - e;                                      // 14 .. 24
    u32 q = m >> s;
    const u32 rem = m & ((1u << s) - 1u), half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return (u16)(sign | q);
#else
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// Two halves in one register (lo = the lower-indexed element).
__device__ __forceinline__ u32 mma_pack(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }

// a - b on two halves at once (f16x2, round to nearest; the callers use it where the result is exact).
__device__ __forceinline__ u32 mma_hsub2(u32 a, u32 b) {
#ifdef STRATA_HOST
    const u16 lo = mma_f2h(mma_h2f((u16)(a & 0xffffu)) - mma_h2f((u16)(b & 0xffffu)));
    const u16 hi = mma_f2h(mma_h2f((u16)(a >> 16)) - mma_h2f((u16)(b >> 16)));
    return mma_pack(lo, hi);
#else
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
#endif
}

// d += a b (d is both C and D).
__device__ __forceinline__ void mma_sync(mma_c& d, const mma_a& a, const mma_b& b) {
#ifdef STRATA_HOST
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, c = l & 3;
        for (int i = 0; i < 8; ++i) {
            const u32 reg = a.x[l][i >> 1];
            const u16 h = (u16)((i & 1) ? reg >> 16 : reg & 0xffffu);
            const int row = g + ((i == 2 || i == 3 || i == 6 || i == 7) ? 8 : 0);
            const int col = 2 * c + (i & 1) + (i >= 4 ? 8 : 0);
            A[row][col] = mma_h2f(h);
        }
        for (int i = 0; i < 4; ++i) {
            const u32 reg = b.x[l][i >> 1];
            const u16 h = (u16)((i & 1) ? reg >> 16 : reg & 0xffffu);
            B[2 * c + (i & 1) + (i >= 2 ? 8 : 0)][g] = mma_h2f(h);
        }
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, c = l & 3;
        for (int i = 0; i < 4; ++i) {
            const int row = g + (i >= 2 ? 8 : 0), col = 2 * c + (i & 1);
            double s = d.x[l][i];
            for (int k = 0; k < 16; ++k) s += (double)A[row][k] * (double)B[k][col];
            d.x[l][i] = (float)s;
        }
    }
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d.x[0][0]), "+f"(d.x[0][1]), "+f"(d.x[0][2]), "+f"(d.x[0][3])
        : "r"(a.x[0][0]), "r"(a.x[0][1]), "r"(a.x[0][2]), "r"(a.x[0][3]), "r"(b.x[0][0]), "r"(b.x[0][1]));
#endif
}

// ---- integer products: mma.sync.aligned.m16n8k32.row.col.s32.{u8,s8}.{s8,u8}.s32 ----------------------------------
// D[16 x 8] = A[16 x 32] B[32 x 8] + C, A and B bytes, signed or not (mma_sync_i8<SA, SB>; the Q2_0 jobs' codes are
// unsigned A: mma_sync_i8s / mma_sync_i8u; the Q8R dense codes signed A), C and D int32 (exact; sums wrap modulo 2^32
// as the device's do). Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k32" with .u8 / .s8 types; g = lane >> 2,
// c = lane & 3):
//   A: 4 registers of 4 bytes (byte 0 = first element): register m holds row g + 8 [m odd], columns
//      4 c + {0, 1, 2, 3} + 16 [m >= 2].
//   B: 2 registers of 4 bytes: register m holds rows (k) 4 c + {0, 1, 2, 3} + 16 [m = 1], column (n) g.
//   C, D: 4 ints c0..c3 at row g + 8 [i >= 2], column 2 c + (i & 1) (as the float fragments).
struct mma_ci { int x[MMA_LANES][4]; };

#ifdef STRATA_HOST
template <bool SA, bool SB> inline void mma_host_i8(mma_ci& d, const mma_a& a, const mma_b& b) {
    int A[16][32], B[32][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, c = l & 3;
        for (int m = 0; m < 4; ++m)
            for (int i = 0; i < 4; ++i) {
                const u32 v = (a.x[l][m] >> (8 * i)) & 0xffu;
                A[g + 8 * (m & 1)][4 * c + i + 16 * (m >> 1)] = SA ? (int)(signed char)v : (int)v;
            }
        for (int m = 0; m < 2; ++m)
            for (int i = 0; i < 4; ++i) {
                const u32 v = (b.x[l][m] >> (8 * i)) & 0xffu;
                B[4 * c + i + 16 * m][g] = SB ? (int)(signed char)v : (int)v;
            }
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, c = l & 3;
        for (int i = 0; i < 4; ++i) {
            const int row = g + (i >= 2 ? 8 : 0), col = 2 * c + (i & 1);
            u32 s = (u32)d.x[l][i];
            for (int k = 0; k < 32; ++k) s += (u32)(A[row][k] * B[k][col]);
            d.x[l][i] = (int)s;
        }
    }
}
#else
// (one asm template for the four type pairs: the instruction differs only in its two type names)
#define MMA_I8_ASM(TA, TB, d, a, b)                                                                                \
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32." TA "." TB ".s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "    \
                 "{%8, %9}, {%0, %1, %2, %3};\n"                                                                   \
                 : "+r"(d.x[0][0]), "+r"(d.x[0][1]), "+r"(d.x[0][2]), "+r"(d.x[0][3])                              \
                 : "r"(a.x[0][0]), "r"(a.x[0][1]), "r"(a.x[0][2]), "r"(a.x[0][3]), "r"(b.x[0][0]), "r"(b.x[0][1]))
#endif

// d += a b, a signed bytes when SA, b when SB (else unsigned).
template <bool SA, bool SB> __device__ __forceinline__ void mma_sync_i8(mma_ci& d, const mma_a& a, const mma_b& b) {
#ifdef STRATA_HOST
    mma_host_i8<SA, SB>(d, a, b);
#else
    if constexpr (SA && SB) MMA_I8_ASM("s8", "s8", d, a, b);
    else if constexpr (SA) MMA_I8_ASM("s8", "u8", d, a, b);
    else if constexpr (SB) MMA_I8_ASM("u8", "s8", d, a, b);
    else MMA_I8_ASM("u8", "u8", d, a, b);
#endif
}

// d += a b, a unsigned and b signed bytes.
__device__ __forceinline__ void mma_sync_i8s(mma_ci& d, const mma_a& a, const mma_b& b) {
    mma_sync_i8<false, true>(d, a, b);
}

// d += a b, a and b unsigned bytes.
__device__ __forceinline__ void mma_sync_i8u(mma_ci& d, const mma_a& a, const mma_b& b) {
    mma_sync_i8<false, false>(d, a, b);
}

#endif  // STRATA_MMA_CUH
