// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by qmm.py (after prelude.cuh and mma.cuh) and
// compiled with NVRTC (cupy.RawModule, multiply-add fusion allowed); tests/test_gpu_qmm_host.py compiles it as host
// C++ (host_kernel_shim.cuh: one thread per block, which plays the 32 lanes of the block's one warp in turn) and
// checks it against numpy.
//
// Tensor-core GEMMs straight from quantized weights, for the batched prefill and the batched decode (issue 12 items 2
// and 3): Y[t, r] = sum_k X[t, k] W[r, k], W quantized by blocks of BV values with one fp16 scale d per block.
//
// Precision: a weight enters mma.m16n8k16 as its exact integer code in fp16 (Q8_0: int8 q; Q2_0: code - 1), the
// block's scale multiplies the block's float32 partial sum once (Q8_0: 2 k-steps of 16, Q2_0: 4), and an activation
// row is split (qmm_split) into two halves hi + lo of x 2^-e_t (e_t a power of two per row that puts max |x_t| in
// [2^14, 2^15)), two products per k-step, the result scaled back by 2^e_t: about 22 significant bits of x, products
// exact, float32 sums, so the result agrees with a float64 reference to about 1e-6 relative (float32 SGEMM's order).
//
// Layouts (F): 0 = "Q8R", dense_q8.cu's re-laid-out Q8_0 (int8 codes [R, K] row-major, fp16 scales [R, K / 32]);
// 8 = GGUF Q8_0 blocks (34 bytes: fp16 d, 32 int8 codes; llama.cpp ggml-common.h block_q8_0); 42 = GGUF Q2_0 blocks
// (18 bytes: fp16 d, 16 bytes of 2-bit codes, value j = (qs[j / 4] >> 2 (j % 4)) & 3, (code - 1) d; formats.md 1).
//
// k order: the sum over k does not depend on the order, so inside a block the k-steps' columns are assigned to lanes
// so that each lane reads its weights as one run of VPL = BV / 4 consecutive values: lane c (= lane & 3) takes the
// block's values [VPL c, VPL c + VPL), step s its values VPL c + 4 s + {0, 1, 2, 3} as the fragment columns
// {2c, 2c+1, 2c+8, 2c+9} (B's rows likewise), so Q8R is one 8-byte load per row and block, Q2_0 one 4-byte word.
// Q2_0 pairs its values differently: step s takes VPL c + {2s, 2s+8, 2s+1, 2s+9}, so that one mask of the word shifted
// by 4 s puts two codes in the two halves of a register (3 instructions a pair of weights instead of 6; the pairing
// of byte-adjacent codes bounded the batched step's expert jobs), and B's pairs are put together from the lane's two
// 16-byte loads by byte permutes (2 a step and n-tile, shared by the block's rows and matrices).
//
// Work split: a warp computes 16 weight rows (rows r0 + g and r0 + g + 8 of its lanes) for the block's 8 NT tokens
// (NT mma column tiles of 8); a block has nw = blockDim / 32 warps (the host build: one) and stages the tokens' hi/lo
// halves of QMM_KC values at a time in shared memory (all warps use them; two buffers, the next chunk copied with
// cp.async while the current one is computed); each lane loads its own weights straight into registers (also one
// chunk ahead).

#ifndef QMM_KC
#define QMM_KC 128           // values of k staged at a time (a multiple of 64)
#endif
// Halves of a staged token row (the chunk plus padding): a quarter warp (token rows g, g + 1; lanes c = 0..3) reads
// 16-byte pieces at g XS + VPL c (+ 8 q): Q8_0 (VPL 8) wants XS / 2 = 16 (mod 32) words, Q2_0 (VPL 16) 4 (mod 8),
// so that the 8 pieces fall on distinct banks.
template <int F> struct QmmXS { static constexpr int v = QMM_KC + (F == 42 ? 40 : 32); };
#ifndef QMM_THREADS
#define QMM_THREADS 128
#endif
// The kernels' launch bounds name a minimum of resident blocks (dense 2, expert jobs 3): without one, ptxas (CUDA
// 13.0, sm_90) spilled 8 bytes of Q2_0 instances at 72 registers; with 3 the Q8_0 gate/up job kernel keeps about 165
// registers (3 blocks an SM) instead of about 198 (nvcc -Xptxas -v: no instance spills).
// Expert job kernels are instantiated for jobs of JT = 8, 16 and 32 tokens (qmm.py JOB_SIZES; 2 blocks an SM at 32).

// Asynchronous 16-byte copies global -> shared (cp_async.cuh; the host build copies at once), and the dynamic shared
// memory that holds the staged activations (two chunks: the next one lands while the current one is computed).
#include "cp_async.cuh"  // cp_async16, cp_async_commit, cp_async_wait
#include "pdl.cuh"       // PDL_ENTRY: every kernel begins with it (launch.py BATCH_PDL_KERNELS)
#ifndef STRATA_HOST
extern __shared__ __align__(16) unsigned char qmm_smem[];
#define QMM_SMEM_BASE qmm_smem
#else
#define QMM_SMEM_BASE host_dyn_smem
#endif
#define QMM_DYN_SHARED(name) u16* name = reinterpret_cast<u16*>(QMM_SMEM_BASE)

template <int F> struct QFmt;
template <> struct QFmt<0> { static constexpr int bv = 32, ts = 0, vpl = 8, wpb = 2, steps = 2; };
template <> struct QFmt<8> { static constexpr int bv = 32, ts = 34, vpl = 8, wpb = 2, steps = 2; };
template <> struct QFmt<42> { static constexpr int bv = 64, ts = 18, vpl = 16, wpb = 1, steps = 4; };

// Raw weights of one lane for one row and one block: the lane's code words and the block's fp16 scale bits.
// rowp: the row's first byte (Q8R codes, or the row's first GGUF block); drow: the row's Q8R scales.
template <int F> __device__ __forceinline__ void qmm_load_raw(const u8* rowp, const u16* drow, int blk, int c,
                                                             u32* w, u16& d) {
    if constexpr (F == 0) {
#ifdef STRATA_HOST
        const u32* p = reinterpret_cast<const u32*>(rowp + 32 * (long long)blk + 8 * c);
        w[0] = p[0];
        w[1] = p[1];
#else
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(rowp + 32 * (long long)blk + 8 * c));
        w[0] = v.x;
        w[1] = v.y;
#endif
        d = __ldg(drow + blk);
    } else {
        const u8* b = rowp + (long long)QFmt<F>::ts * blk;  // GGUF blocks are 2-byte aligned: 16-bit loads
        const u16* p = reinterpret_cast<const u16*>(b);
        d = __ldg(p);
        const u16* q = reinterpret_cast<const u16*>(b + 2 + 2 * QFmt<F>::wpb * 2 * c);
        #pragma unroll
        for (int i = 0; i < QFmt<F>::wpb; ++i) w[i] = (u32)__ldg(q + 2 * i) | ((u32)__ldg(q + 2 * i + 1) << 16);
    }
}

// The codes of k-step s as two f16x2 registers (exact integers): values VPL c + 4 s + {0, 1} and + {2, 3}; Q2_0
// VPL c + {2s, 2s+8} and {2s+1, 2s+9}.
template <int F> __device__ __forceinline__ void qmm_codes(const u32* w, int s, u32& p01, u32& p23) {
    if constexpr (F == 42) {  // 2^10 + code in the mantissa of 1024 (0x6400), minus 1025: code - 1
        const u32 x = w[0] >> (4 * s);  // code 2s at bits 0-1, code 2s+8 at bits 16-17
        p01 = mma_hsub2((x & 0x00030003u) | 0x64006400u, 0x64016401u);
        p23 = mma_hsub2(((x >> 2) & 0x00030003u) | 0x64006400u, 0x64016401u);
    } else {  // int8 q: byte q + 128 in the mantissa of 1024, minus 1152
        const u32 v = w[s] ^ 0x80808080u;
        p01 = mma_hsub2(__byte_perm(v, 0x64646464u, 0x4140), 0x64806480u);
        p23 = mma_hsub2(__byte_perm(v, 0x64646464u, 0x4342), 0x64806480u);
    }
}

// Issue the loads of this lane's raw weights of chunk `chunk` (QMM_KC values) of its two rows r0 + g, r0 + g + 8
// (clamped to R - 1) of each of the NM matrices: wr[lane][m][block][row][word], dr[lane][m][block][row].
template <int F, int NM>
__device__ __forceinline__ void qmm_fetch(const u8* const* w, const u16* const* wd, long long rb, int R, int K, int r0,
                                          int chunk, u32 (*wr)[NM][QMM_KC / QFmt<F>::bv][2][QFmt<F>::wpb],
                                          u16 (*dr)[NM][QMM_KC / QFmt<F>::bv][2]) {
    constexpr int BV = QFmt<F>::bv, BPC = QMM_KC / BV;
    const int nb = K / BV, b0 = chunk * BPC;
    for (int l = 0; l < MMA_LANES; ++l) {
        const int lane = mma_lane(l), g = lane >> 2, c = lane & 3;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const long long row = min(r0 + g + 8 * h, R - 1);
            #pragma unroll
            for (int m = 0; m < NM; ++m) {
                const u8* rp = w[m] + row * rb;
                const u16* dp = F == 0 ? wd[m] + row * (long long)(K / 32) : nullptr;
                #pragma unroll
                for (int b = 0; b < BPC; ++b)
                    if (b0 + b < nb) qmm_load_raw<F>(rp, dp, b0 + b, c, wr[l][m][b][h], dr[l][m][b][h]);
            }
        }
    }
}

// The chunk in flight's raw weights (qmm_fetch's wr / dr) taken into the registers the chunk is computed from (wc /
// dc), so that the next chunk's loads may go out into wr / dr meanwhile.
template <int F, int NM>
__device__ __forceinline__ void qmm_take(u32 (*wr)[NM][QMM_KC / QFmt<F>::bv][2][QFmt<F>::wpb],
                                         u16 (*dr)[NM][QMM_KC / QFmt<F>::bv][2],
                                         u32 (*wc)[NM][QMM_KC / QFmt<F>::bv][2][QFmt<F>::wpb],
                                         u16 (*dc)[NM][QMM_KC / QFmt<F>::bv][2]) {
    for (int l = 0; l < MMA_LANES; ++l)
        #pragma unroll
        for (int m = 0; m < NM; ++m)
            #pragma unroll
            for (int b = 0; b < QMM_KC / QFmt<F>::bv; ++b)
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    dc[l][m][b][h] = dr[l][m][b][h];
                    #pragma unroll
                    for (int q = 0; q < QFmt<F>::wpb; ++q) wc[l][m][b][h][q] = wr[l][m][b][h][q];
                }
}

// Issue the copies of chunk `chunk` (KCV values) of the block's tokens' hi / lo halves into stage buffer xs (hi: TOK
// rows of XS halves, then lo), 16-byte pieces, all threads striding; a slot without a token (tokrow -1) gets zeros.
// WHOLE: every chunk is whole (K a multiple of KCV; the index arithmetic by constants).
template <int F, int NT, int KCV = QMM_KC, int XS = QmmXS<F>::v, bool WHOLE = false>
__device__ __forceinline__ void qmm_stage(const u16* __restrict__ xhi, const u16* __restrict__ xlo, long long ldx,
                                          const int* tokrow, int K, int chunk, u16* xs) {
    constexpr int BV = QFmt<F>::bv, BPC = KCV / BV, TOK = 8 * NT;
    const int nb = K / BV, b0 = chunk * BPC;
    const int pieces = WHOLE ? KCV / 8 : min(BPC, nb - b0) * BV / 8;
    for (int i = threadIdx.x; i < 2 * TOK * pieces; i += blockDim.x) {
        const int lohi = i / (TOK * pieces), rem = i - lohi * TOK * pieces;
        const int slot = rem / pieces, p = rem - slot * pieces;
        const int row = tokrow[slot];
        u16* dst = xs + (lohi * TOK + slot) * XS + 8 * p;
        if (row >= 0) cp_async16(dst, (lohi ? xlo : xhi) + row * ldx + (long long)b0 * BV + 8 * p);
        else *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// One quantization block (block b of the staged chunk xs_hi / xs_lo, rows of XS halves) of the tile: acc[m][n] += d
// (A[m] . the block's 8 NT tokens' hi + lo halves), the block's weights given as fragments A[m][k-step] (exact codes)
// and the rows' scales d0 (row g) / d1 (row g + 8). qmm_tile's and qmm_dense_ring's products.
template <int F, int NT, int NM, int XS>
__device__ __forceinline__ void qmm_block(const mma_a (*A)[QFmt<F>::steps], const float (*d0)[NM],
                                          const float (*d1)[NM], const u16* xs_hi, const u16* xs_lo, int b,
                                          mma_c (*acc)[NT]) {
    constexpr int BV = QFmt<F>::bv, VPL = QFmt<F>::vpl, S = QFmt<F>::steps;
    #pragma unroll
    for (int n = 0; n < NT; ++n) {
        // the column tile's hi / lo fragments of every k-step: a lane's VPL staged values are 16-byte loads
        // (two k-steps each; with the row padding, a quarter warp's loads fall on distinct banks)
        mma_b Bh[S], Bl[S];
        for (int l = 0; l < MMA_LANES; ++l) {
            const int lane = mma_lane(l), g = lane >> 2, c = lane & 3;
            const int o = (8 * n + g) * XS + b * BV + VPL * c;
            const uint4* ph = reinterpret_cast<const uint4*>(xs_hi + o);
            const uint4* pl = reinterpret_cast<const uint4*>(xs_lo + o);
            if constexpr (F == 42) {  // values 2s, 2s+8 and 2s+1, 2s+9 from halves 0-7 (u) and 8-15 (v)
                const uint4 uh = ph[0], vh = ph[1], ul = pl[0], vl = pl[1];
                const u32 UH[4] = {uh.x, uh.y, uh.z, uh.w}, VH[4] = {vh.x, vh.y, vh.z, vh.w};
                const u32 UL[4] = {ul.x, ul.y, ul.z, ul.w}, VL[4] = {vl.x, vl.y, vl.z, vl.w};
                #pragma unroll
                for (int t = 0; t < S; ++t) {
                    Bh[t].x[l][0] = __byte_perm(UH[t], VH[t], 0x5410);
                    Bh[t].x[l][1] = __byte_perm(UH[t], VH[t], 0x7632);
                    Bl[t].x[l][0] = __byte_perm(UL[t], VL[t], 0x5410);
                    Bl[t].x[l][1] = __byte_perm(UL[t], VL[t], 0x7632);
                }
            } else {
                #pragma unroll
                for (int q = 0; q < S / 2; ++q) {
                    const uint4 vh = ph[q], vl = pl[q];
                    Bh[2 * q].x[l][0] = vh.x; Bh[2 * q].x[l][1] = vh.y;
                    Bh[2 * q + 1].x[l][0] = vh.z; Bh[2 * q + 1].x[l][1] = vh.w;
                    Bl[2 * q].x[l][0] = vl.x; Bl[2 * q].x[l][1] = vl.y;
                    Bl[2 * q + 1].x[l][0] = vl.z; Bl[2 * q + 1].x[l][1] = vl.w;
                }
            }
        }
        #pragma unroll
        for (int m = 0; m < NM; ++m) {
            mma_c P;  // the block's partial sums (unscaled), then scaled once into acc
            mma_zero(P);
            #pragma unroll
            for (int s = 0; s < S; ++s) {
                mma_sync(P, A[m][s], Bh[s]);
                mma_sync(P, A[m][s], Bl[s]);
            }
            for (int l = 0; l < MMA_LANES; ++l) {
                acc[m][n].x[l][0] += d0[l][m] * P.x[l][0];
                acc[m][n].x[l][1] += d0[l][m] * P.x[l][1];
                acc[m][n].x[l][2] += d1[l][m] * P.x[l][2];
                acc[m][n].x[l][3] += d1[l][m] * P.x[l][3];
            }
        }
    }
}

// Dynamic shared memory of a kernel with NT column tiles (qmm.py smem_bytes): two stage buffers of hi and lo halves.
template <int F, int NT> struct QmmSmem { static constexpr int bytes = 2 * 2 * 8 * NT * QmmXS<F>::v * 2; };

// The product of the 16-row tile of NM matrices (rows r0 .. r0 + 15 of each; rows past R repeat row R - 1 and are
// not to be written) with the block's 8 NT tokens (tokrow[slot]: the row of xhi / xlo, or -1 for zeros; ldx halves
// a row): acc[m][n] (+)= the tile's sums, float32 and unscaled by the tokens' 2^e. All threads of the block call it
// (every warp stages; a warp whose tile lies past R computes on its clamped rows and writes nothing).
// w[m]: matrix m's first byte; wd[m]: its Q8R scales (F = 0); rb: bytes of a row (F = 0: K); xs: the dynamic shared
// memory (QmmSmem bytes). Chunk c + 1's activations are copied asynchronously and its weights loaded into registers
// while chunk c is computed. Only chunks [c0, c1) of QMM_KC values of k are summed (qmm_chunks: all of them; a split
// of k over blocks gives each block its own range; an empty range leaves acc zero).
template <int F> __device__ __forceinline__ int qmm_chunks(int K) {
    return (K / QFmt<F>::bv + QMM_KC / QFmt<F>::bv - 1) / (QMM_KC / QFmt<F>::bv);
}

template <int F, int NT, int NM>
__device__ __forceinline__ void qmm_tile(const u8* const* w, const u16* const* wd, long long rb, int R, int K, int r0,
                                         const u16* __restrict__ xhi, const u16* __restrict__ xlo, long long ldx,
                                         const int* tokrow, u16* xs, mma_c (*acc)[NT], int c0, int c1) {
    constexpr int BV = QFmt<F>::bv, VPL = QFmt<F>::vpl, WPB = QFmt<F>::wpb, S = QFmt<F>::steps;
    constexpr int BPC = QMM_KC / BV;  // blocks per staged chunk
    constexpr int XS = QmmXS<F>::v;
    constexpr int TOK = 8 * NT;
    const int nb = K / BV;
    #pragma unroll
    for (int m = 0; m < NM; ++m)
        #pragma unroll
        for (int n = 0; n < NT; ++n) mma_zero(acc[m][n]);
    if (c0 >= c1) return;  // (uniform over the block: no barrier is skipped by some threads only)
    // raw weights of the chunk in flight: [lane][matrix][block][row g / g + 8][word]
    u32 wr[MMA_LANES][NM][BPC][2][WPB];
    u16 dr[MMA_LANES][NM][BPC][2];
    qmm_stage<F, NT>(xhi, xlo, ldx, tokrow, K, c0, xs);
    cp_async_commit();
    qmm_fetch<F, NM>(w, wd, rb, R, K, r0, c0, wr, dr);
    for (int chunk = c0; chunk < c1; ++chunk) {
        const int b0 = chunk * BPC;
        const int nbc = min(BPC, nb - b0);
        const int buf = (chunk - c0) & 1;  // the range's first chunk is staged into buffer 0
        if (chunk + 1 < c1) {  // the next chunk's copies go out into the other buffer (free since the last barrier)
            qmm_stage<F, NT>(xhi, xlo, ldx, tokrow, K, chunk + 1, xs + (buf ^ 1) * 2 * TOK * XS);
            cp_async_commit();
            cp_async_wait<1>();  // this chunk's copies have landed (the next chunk's may be in flight)
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* xs_hi = xs + buf * 2 * TOK * XS;
        const u16* xs_lo = xs_hi + TOK * XS;
        u32 wc[MMA_LANES][NM][BPC][2][WPB];
        u16 dc[MMA_LANES][NM][BPC][2];
        qmm_take<F, NM>(wr, dr, wc, dc);
        if (chunk + 1 < c1) qmm_fetch<F, NM>(w, wd, rb, R, K, r0, chunk + 1, wr, dr);  // in flight while this chunk is computed
        #pragma unroll
        for (int b = 0; b < BPC; ++b) {
            if (b >= nbc) break;
            // the block's weights as fragments, every k-step (A reused by all NT column tiles)
            mma_a A[NM][S];
            float d0[MMA_LANES][NM], d1[MMA_LANES][NM];
            for (int l = 0; l < MMA_LANES; ++l) {
                #pragma unroll
                for (int m = 0; m < NM; ++m) {
                    #pragma unroll
                    for (int s = 0; s < S; ++s) {
                        qmm_codes<F>(wc[l][m][b][0], s, A[m][s].x[l][0], A[m][s].x[l][2]);  // row g: a0 a1, a4 a5
                        qmm_codes<F>(wc[l][m][b][1], s, A[m][s].x[l][1], A[m][s].x[l][3]);  // row g + 8: a2 a3, a6 a7
                    }
                    d0[l][m] = mma_h2f(dc[l][m][b][0]);
                    d1[l][m] = mma_h2f(dc[l][m][b][1]);
                }
            }
            qmm_block<F, NT, NM, XS>(A, d0, d1, xs_hi, xs_lo, b, acc);
        }
        __syncthreads();  // every warp is done with this buffer: the copies of chunk + 2 may go there
    }
}

// The output of a tile: calls f(l, n, i, row, slot) for each value acc[.][n].x[l][i] a lane holds (lanes l of the
// thread: one on the device, 32 in the host build): its weight row (of the 16 from r0) and its token slot in the
// column tiles (8 n + 2 c + ...). The kernels' epilogues write through it.
template <int NT, class Fn> __device__ __forceinline__ void qmm_each_out(int r0, Fn f) {
    for (int l = 0; l < MMA_LANES; ++l) {
        const int lane = mma_lane(l), g = lane >> 2, c = lane & 3;
        #pragma unroll
        for (int n = 0; n < NT; ++n)
            #pragma unroll
            for (int i = 0; i < 4; ++i) f(l, n, i, r0 + g + (i >= 2 ? 8 : 0), 8 * n + 2 * c + (i & 1));
    }
}

// ---- activations: hi / lo halves ---------------------------------------------------------------------------------
// For rows t < T of X (ldx floats a row, K values): e_t = clamp(E - 15, -126, 127) with max |X[t]| in [2^(E-1), 2^E)
// (0 for an all-zero or non-finite row), hi[t, k] = half(X[t, k] 2^-e_t), lo[t, k] = half(X[t, k] 2^-e_t - hi),
// sc[t] = 2^e_t. hi, lo: [T, K] (K halves a row). One block per row (grid stride); blockDim a multiple of 32 up to
// 1,024 (the host build: 1).
// A thread keeps its first QMM_SPLIT_REG values of a row in registers between the max and the split (one round of
// independent loads instead of two dependent passes; values past QMM_SPLIT_REG * blockDim are read twice), and the
// block's max takes warp shuffles and one barrier: 6.0 us a launch at 32 x 2,560 before (a tree of 8 barriers).
#ifndef QMM_SPLIT_REG
#define QMM_SPLIT_REG 16
#endif
extern "C" __global__ void qmm_split(const float* __restrict__ X, long long ldx, int T, int K, u16* __restrict__ hi,
                                     u16* __restrict__ lo, float* __restrict__ sc) {
    PDL_ENTRY();
    __shared__ float red[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    const int nw = (nt + 31) >> 5;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const float* x = X + (long long)t * ldx;
        float v[QMM_SPLIT_REG];
        float m = 0.0f;
        #pragma unroll
        for (int i = 0; i < QMM_SPLIT_REG; ++i) {
            const int k = tid + i * nt;
            v[i] = k < K ? x[k] : 0.0f;
            m = fmaxf(m, fabsf(v[i]));
        }
        for (int k = tid + QMM_SPLIT_REG * nt; k < K; k += nt) m = fmaxf(m, fabsf(x[k]));
        for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));  // (host: one thread, m is it)
        if ((tid & 31) == 0) red[tid >> 5] = m;
        __syncthreads();
        m = red[0];
        for (int w = 1; w < nw; ++w) m = fmaxf(m, red[w]);
        int e = 0;
        if (m > 0.0f && m <= 3.4028234663852886e38f) {
            int E;
            frexpf(m, &E);
            e = min(127, max(-126, E - 15));
        }
        u16* ho = hi + (long long)t * K;
        u16* lw = lo + (long long)t * K;
        #pragma unroll
        for (int i = 0; i < QMM_SPLIT_REG; ++i) {
            const int k = tid + i * nt;
            if (k < K) {
                const float y = ldexpf(v[i], -e);
                const u16 h = mma_f2h(y);
                ho[k] = h;
                lw[k] = mma_f2h(y - mma_h2f(h));
            }
        }
        for (int k = tid + QMM_SPLIT_REG * nt; k < K; k += nt) {
            const float y = ldexpf(x[k], -e);
            const u16 h = mma_f2h(y);
            ho[k] = h;
            lw[k] = mma_f2h(y - mma_h2f(h));
        }
        if (tid == 0) sc[t] = ldexpf(1.0f, e);
        __syncthreads();  // red is rewritten by the block's next row
    }
}

// Y[t, r] = P[0, t, r] + P[1, t, r] + ... + P[nz - 1, t, r] (float32, in that order) for the tile's rows
// [r0, r0 + nr) and tokens [t0, t0 + nt); P [nz, T, R] (read through L2: other blocks wrote it), Y [T, ldy]. Each
// thread sums up to 4 runs of 4 values (float4 loads where R is a multiple of 4), the slice loop unrolled so that
// the loads of several slices are in flight together (one value at a time, the last block of a tile with 6 slices
// took about 10 us).
__device__ __forceinline__ void qmm_add_slices(const float* __restrict__ P, float* __restrict__ Y, long long ldy,
                                               int T, int R, int nz, int r0, int nr, int t0, int nt) {
    const long long zs = (long long)T * R;
    if ((R & 3) == 0 && (nr & 3) == 0) {
        const int n4 = nr >> 2, ng = n4 * nt;
        for (int g0 = threadIdx.x; g0 < ng; g0 += 4 * blockDim.x) {
            float4 a[4];
            long long o[4];
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int g = min(g0 + j * (int)blockDim.x, ng - 1), tt = g / n4;
                o[j] = (long long)(t0 + tt) * R + r0 + 4 * (g - tt * n4);
                a[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
            #pragma unroll 4
            for (int zz = 0; zz < nz; ++zz) {
                float4 v[4];
                #pragma unroll
                for (int j = 0; j < 4; ++j) v[j] = __ldcg(reinterpret_cast<const float4*>(P + zz * zs + o[j]));
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    a[j].x += v[j].x; a[j].y += v[j].y; a[j].z += v[j].z; a[j].w += v[j].w;
                }
            }
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int g = g0 + j * (int)blockDim.x;
                if (g >= ng) break;
                const int tt = g / n4, rr = 4 * (g - tt * n4);
                float* y = Y + (long long)(t0 + tt) * ldy + r0 + rr;
                y[0] = a[j].x; y[1] = a[j].y; y[2] = a[j].z; y[3] = a[j].w;
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < nr * nt; i += blockDim.x) {
        const int tt = i / nr, rr = i - tt * nr;
        const long long o = (long long)(t0 + tt) * R + r0 + rr;
        float v = 0.0f;
        for (int zz = 0; zz < nz; ++zz) v += __ldcg(P + zz * zs + o);
        Y[(long long)(t0 + tt) * ldy + r0 + rr] = v;
    }
}

// ---- the split of k's slices added by a launch of their own (up to 32 tokens; STRATATOOLS_QMM_SUM) ---------------
// Y[i] = sum over z of P[z, i] for i < n (P [nz, n] float32, Y [n] contiguous), a run of 4 values (a float4; n a
// multiple of 4, else one value) shared by QSUM_G threads: thread g adds the slices z = g, g + G, ... in order, then
// the G partial sums meet by shuffles (xor 4, 2, 1: the same order for every value and launch). The CuPy reduction
// this replaces took 1.9-5.9 us a launch, 554 launches a 32-sequence step (H200, bench/gpu-notes.md). Grid: ceil(runs
// QSUM_G / blockDim) blocks, blockDim a multiple of 32 (the host build: a block of one thread a run). qmm_sum_act
// applies the hyper-connection's activation to each sum before it is stored (the launches of its own it replaces: the
// step's silu after the down projection, and the quotient, sigmoid, doubling and copy of the inject weights).
#ifdef STRATA_HOST
#define QSUM_G 1
#else
#define QSUM_G 8
#endif
// The activations a sum kernel may apply (qmm.py ACT_*): 0 none, 1 silu(s / div) (a = s / div, a sigmoid(a)), 2 the
// weights 2 sigmoid(s / div); the operations and roundings of prefill.py's element-wise kernels they replace.
__device__ __forceinline__ float qmm_act(float s, int act, float div) {
    if (act == 0) return s;
    const float a = s / div;
    const float sg = 1.0f / (1.0f + expf(-a));
    return act == 1 ? a * sg : 2.0f * sg;
}

// The sum of qmm_sum_slices with the activation ACT (a template argument: the plain sum keeps its code, which an
// activation read at run time made 30-80% slower, H200 bench/gpu-notes.md nineteenth pass).
template <int ACT>
__device__ __forceinline__ void qmm_sum_body(const float* __restrict__ P, float* __restrict__ Y, long long n, int nz,
                                             float div) {
    const bool v4 = (n & 3) == 0;
    const long long runs = v4 ? n >> 2 : n;
    const long long u = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / QSUM_G;
    const int g = (int)(threadIdx.x % QSUM_G);
    const long long uc = u < runs ? u : runs - 1;  // (every lane stays for the shuffles)
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (v4) {
        const float4* p = reinterpret_cast<const float4*>(P) + uc;
        #pragma unroll 4
        for (int z = g; z < nz; z += QSUM_G) {
            const float4 v = __ldcg(p + (long long)z * runs);
            a[0] += v.x; a[1] += v.y; a[2] += v.z; a[3] += v.w;
        }
    } else {
        for (int z = g; z < nz; z += QSUM_G) a[0] += __ldcg(P + (long long)z * n + uc);
    }
    #pragma unroll
    for (int o = QSUM_G / 2; o; o >>= 1)
        #pragma unroll
        for (int i = 0; i < 4; ++i) a[i] += __shfl_xor_sync(0xffffffffu, a[i], o);
    if (u >= runs || g != 0) return;
    if (v4)
        reinterpret_cast<float4*>(Y)[u] = make_float4(qmm_act(a[0], ACT, div), qmm_act(a[1], ACT, div),
                                                      qmm_act(a[2], ACT, div), qmm_act(a[3], ACT, div));
    else Y[u] = qmm_act(a[0], ACT, div);
}

extern "C" __global__ void qmm_sum_slices(const float* __restrict__ P, float* __restrict__ Y, long long n, int nz) {
    PDL_ENTRY();
    qmm_sum_body<0>(P, Y, n, nz, 1.0f);
}

// qmm_sum_slices, each sum through qmm_act<ACT>(s / div) before it is stored (ACT 1 or 2).
template <int ACT>
__global__ void qmm_sum_act(const float* __restrict__ P, float* __restrict__ Y, long long n, int nz, float div) {
    PDL_ENTRY();
    qmm_sum_body<ACT>(P, Y, n, nz, div);
}

// Y[i] = qmm_act(Y[i], act, div) for i < n: the activation where the product's sums were not made by qmm_sum_slices.
extern "C" __global__ void qmm_act_rows(float* __restrict__ Y, long long n, int act, float div) {
    PDL_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) Y[i] = qmm_act(Y[i], act, div);
}

// ---- float32: P[z, T, R] = X W^T over k slice z (the batched step's router) ---------------------------------------
// X [T, K] and W [R, K] float32 row-major, 16-byte aligned, K a multiple of 4, T <= QF_TOK. Block (b, z) computes rows
// [QF_ROWS b, QF_ROWS (b + 1)) of every token over k in [QF_KS z, QF_KS (z + 1)) into P + z T R ([nz, T, R]; nz =
// gridDim.y = ceil(K / QF_KS); qmm_sum_slices adds the slices). The slice of W and of X go to shared memory (rows of
// QF_KS + 4 floats: a quarter warp's 16-byte reads of 8 tokens' rows fall in distinct banks); warp g, lane j: rows
// 4 g .. 4 g + 3 of the tile for token j, each an fmaf chain over k in order (the result depends on nothing but the
// inputs); the tile's sums go out through shared memory, a warp storing a token's rows (a thread's four stores a
// token apart were 1,024 scattered writes a block). cuBLAS's SGEMM of the 32 x 2,560 x 257 router took 10.9 us a
// launch and its split-k reduction 2.8 more (H200, bench/gpu-notes.md twenty-third pass). W is constant: its slice
// is loaded before griddepcontrol.wait. Grid (ceil(R / QF_ROWS), nz), blockDim a multiple of 32 up to 256 (the host
// build: 1).
#define QF_ROWS 32
#define QF_TOK 32
#define QF_KS 128
#define QF_LD (QF_KS + 4)
extern "C" __global__ void __launch_bounds__(256) qmm_f32_nt(const float* __restrict__ X, const float* __restrict__ W,
                                                             float* __restrict__ P, int T, int R, int K) {
    __shared__ __align__(16) float ws[QF_ROWS * QF_LD];
    __shared__ __align__(16) float xs[QF_TOK * QF_LD];
    __shared__ float os[QF_TOK * (QF_ROWS + 1)];  // the tile's sums [token][row] (a row of padding: no conflicts)
    const int r0 = (int)blockIdx.x * QF_ROWS, z = (int)blockIdx.y, k0 = z * QF_KS, kn = min(QF_KS, K - k0);
    const int nt = (int)blockDim.x, tid = (int)threadIdx.x;
    constexpr int Q4 = QF_KS / 4;  // float4s a row of the slice
    constexpr int LPT = QF_ROWS * Q4 / 256;  // float4s a thread of 256 (QF_TOK = QF_ROWS: the same for X)
    auto stage = [&](const float* __restrict__ src, int rows, float* dst, bool weights) {
        // rows [0, rows) of src (rows of K floats from k0) into dst's rows of QF_LD floats; past rows or the slice:
        // zeros. With 256 threads all of a thread's loads are issued before its stores (a load and its store a round
        // waited on each load: qmm_f32_nt took 9.4 us a launch, H200 twenty-fourth pass)
        auto get = [&](int i) {
            const int r = i / Q4, q = i - r * Q4;
            const float4* p = reinterpret_cast<const float4*>(src + (long long)r * K + k0) + q;
            return r < rows && 4 * q < kn ? (weights ? __ldg(p) : *p) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        };
        auto put = [&](int i, float4 v) {
            const int r = i / Q4, q = i - r * Q4;
            *reinterpret_cast<float4*>(dst + r * QF_LD + 4 * q) = v;
        };
        if (nt == 256) {
            float4 v[LPT];
            #pragma unroll
            for (int j = 0; j < LPT; ++j) v[j] = get(tid + 256 * j);
            #pragma unroll
            for (int j = 0; j < LPT; ++j) put(tid + 256 * j, v[j]);
        } else {
            for (int i = tid; i < QF_ROWS * Q4; i += nt) put(i, get(i));
        }
    };
    stage(W + (long long)r0 * K, R - r0, ws, true);  // W's slice (rows past R, k past the slice: zeros)
    PDL_ENTRY();
    stage(X, T, xs, false);  // X's slice (tokens past T: zeros)
    __syncthreads();
    for (int o = tid; o < QF_ROWS / 4 * QF_TOK; o += nt) {  // (the host build's one thread plays every lane)
        const int g = o / QF_TOK, j = o - g * QF_TOK;
        const float* xr = xs + j * QF_LD;
        const float* w0 = ws + 4 * g * QF_LD;
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        #pragma unroll 4
        for (int k = 0; k < QF_KS; k += 4) {
            const float4 x = *reinterpret_cast<const float4*>(xr + k);
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float4 w = *reinterpret_cast<const float4*>(w0 + i * QF_LD + k);
                a[i] = fmaf(w.x, x.x, a[i]);
                a[i] = fmaf(w.y, x.y, a[i]);
                a[i] = fmaf(w.z, x.z, a[i]);
                a[i] = fmaf(w.w, x.w, a[i]);
            }
        }
        #pragma unroll
        for (int i = 0; i < 4; ++i) os[j * (QF_ROWS + 1) + 4 * g + i] = a[i];
    }
    __syncthreads();
    for (int i = tid; i < T * QF_ROWS; i += nt) {  // a warp a token's rows: one run of 128 bytes
        const int t = i / QF_ROWS, r = i - t * QF_ROWS;
        if (r0 + r < R) P[((long long)z * T + t) * R + r0 + r] = os[t * (QF_ROWS + 1) + r];
    }
}

// ---- dense: Y[T, R] = X W^T ----------------------------------------------------------------------------------------
// W: layout F (w: codes or blocks; wd: Q8R scales, F = 0 only; rb: bytes a row); X given as qmm_split's hi / lo [T, K]
// and sc [T]; Y [T, ldy] float32 (columns 0 .. R-1 written). K a multiple of the block (32, Q2_0 64).
// Split of k over nz slices (more blocks than the rows and token tiles give): slice z sums chunks [z p, (z + 1) p) of
// QMM_KC values, p = ceil(chunks / nz), into its own partial result P + z T R ([nz, T, R] float32); the last of a
// tile's nz slices to finish (counted in cnt[tile], tile = blockIdx.x + gridDim.x (blockIdx.y / nz), which it sets
// back to 0) adds the slices in the order z = 0 .. nz - 1 into Y, so the result does not depend on which slice
// finished last; with cnt null the caller adds them. nz = 1: Y directly (P and cnt unused).
// Grid: (ceil(R / (16 nw MT)), ceil(T / (8 NT)) nz), blockIdx.y = token tile nz + slice; nw = blockDim / 32 warps
// (host build: 1). Dynamic shared memory: QmmSmem<F, NT>::bytes.
// MT: 16-row tiles a warp (1, or 2 for the longer X: every activation fragment a warp reads from shared memory then
// serves 32 rows, and a block stages its tokens once for 128 rows). With MT 2 the rows are a multiple of 16 nw MT
// (no warp past R: its second tile's rows are not clamped).
template <int F, int NT, int MT = 1> __global__ void __launch_bounds__(QMM_THREADS, 2) qmm_dense(
        const u8* __restrict__ w, const u16* __restrict__ wd, long long rb, const u16* __restrict__ xhi,
        const u16* __restrict__ xlo, const float* __restrict__ xsc, float* __restrict__ Y, long long ldy, int T,
        int R, int K, int nz, float* __restrict__ P, int* __restrict__ cnt) {
    PDL_ENTRY();
    QMM_DYN_SHARED(xs);
    __shared__ int tokrow[8 * NT];
    __shared__ int last;
    const int nw = blockDim.x >= 32 ? (int)(blockDim.x >> 5) : 1;
    const int warp = (int)(threadIdx.x >> 5);
    const int z = (int)blockIdx.y % nz, tile = (int)blockIdx.y / nz;
    const int t0 = tile * 8 * NT;
    const int nch = qmm_chunks<F>(K), per = (nch + nz - 1) / nz;
    const int c0 = min(nch, z * per), c1 = min(nch, c0 + per);
    float* dst = nz == 1 ? Y : P + (long long)z * T * R;
    const long long ldd = nz == 1 ? ldy : (long long)R;
    for (int s = threadIdx.x; s < 8 * NT; s += blockDim.x) tokrow[s] = t0 + s < T ? t0 + s : -1;
    __syncthreads();
    const int r0 = (blockIdx.x * nw + warp) * 16 * MT;
    const u8* wm[MT];
    const u16* dm[MT];
    #pragma unroll
    for (int m = 0; m < MT; ++m) {  // tile m: the rows r0 + 16 m .. + 15 (MT 2: R a multiple of 16 nw MT, qmm.py)
        wm[m] = w + (long long)(16 * m) * rb;
        dm[m] = F == 0 ? wd + (long long)(16 * m) * (K / 32) : wd;
    }
    mma_c acc[MT][NT];
    qmm_tile<F, NT, MT>(wm, dm, rb, R, K, r0, xhi, xlo, (long long)K, tokrow, xs, acc, c0, c1);
    #pragma unroll
    for (int m = 0; m < MT; ++m)
        qmm_each_out<NT>(r0 + 16 * m, [&](int l, int n, int i, int row, int s) {
            const int t = tokrow[s];
            if (row < R && t >= 0) dst[(long long)t * ldd + row] = acc[m][n].x[l][i] * xsc[t];
        });
    if (nz == 1 || cnt == nullptr) return;  // (no counters: the caller adds the slices)
    __threadfence();  // this slice's partial sums are visible before it counts
    __syncthreads();
    if (threadIdx.x == 0) {
        const int c = (int)blockIdx.x + (int)gridDim.x * tile;
        last = atomicAdd(cnt + c, 1) == nz - 1;
        if (last) cnt[c] = 0;  // every slice has counted: ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int rows_b = nw * 16 * MT;
    qmm_add_slices(P, Y, ldy, T, R, nz, (int)blockIdx.x * rows_b, min(rows_b, R - (int)blockIdx.x * rows_b), t0,
                   min(8 * NT, T - t0));
}

// The slots of a down job j (all threads of the block call it; ends with a barrier): dst[s] = job_dst[j JT + s] (the
// pair's output row, -1 for an empty slot) and tokrow[s] = its hidden row j JT + s (-1 for an empty slot). Returns
// whether the job has work (an empty job's first slot is empty: qmm_jobs' spares).
template <int JT> __device__ __forceinline__ bool qmm_down_slots(const int* __restrict__ job_dst, int j, int* dst,
                                                                 int* tokrow) {
    for (int s = threadIdx.x; s < JT; s += blockDim.x) {
        dst[s] = job_dst[j * JT + s];
        tokrow[s] = dst[s] >= 0 ? j * JT + s : -1;
    }
    __syncthreads();
    return dst[0] >= 0;
}

// ---- routed experts: jobs of one expert and up to JT tokens (JT 8, 16 or 32; prefill.py expert_jobs) --------------
// gate/up: Hbuf[j JT + s, r] = silu(g) u, g = gate_j[r] . x, u = up_j[r] . x, x = X[job_tok[j JT + s]], for
// job j = blockIdx.y and rows r < Fd (16 nw a block, blockIdx.x); gate_j at job_ptr[j] (a VRAM slot or mapped pinned
// host memory), up_j = gate_j + Fd rb, rb = H / BV * ts. X as qmm_split's hi / lo [T, H] and sc [T]. Slots with
// job_tok < 0 are left as they are. Grid: (ceil(Fd / (16 nw)), jobs); dynamic shared memory: QmmSmem<F, JT / 8>::bytes.
template <int F, int JT> __global__ void __launch_bounds__(QMM_THREADS, JT > 16 ? 2 : 3) qmm_moe_gu(
        const u64* __restrict__ job_ptr, const int* __restrict__ job_tok, const u16* __restrict__ xhi,
        const u16* __restrict__ xlo, const float* __restrict__ xsc, float* __restrict__ Hbuf, int H, int Fd) {
    PDL_ENTRY();
    QMM_DYN_SHARED(xs);
    __shared__ int tokrow[JT];
    const int j = blockIdx.y;
    const int nw = blockDim.x >= 32 ? (int)(blockDim.x >> 5) : 1;
    const int warp = (int)(threadIdx.x >> 5);
    for (int s = threadIdx.x; s < JT; s += blockDim.x) tokrow[s] = job_tok[j * JT + s];
    __syncthreads();
    if (tokrow[0] < 0) return;  // an empty job (qmm_jobs' spare jobs; slots fill from 0): nothing to read
    const int r0 = (blockIdx.x * nw + warp) * 16;
    const long long rb = (long long)(H / QFmt<F>::bv) * QFmt<F>::ts;
    const u8* G = reinterpret_cast<const u8*>(job_ptr[j]);
    const u8* wm[2] = {G, G + (long long)Fd * rb};
    const u16* dm[2] = {nullptr, nullptr};
    mma_c acc[2][JT / 8];
    qmm_tile<F, JT / 8, 2>(wm, dm, rb, Fd, H, r0, xhi, xlo, (long long)H, tokrow, xs, acc, 0, qmm_chunks<F>(H));
    qmm_each_out<JT / 8>(r0, [&](int l, int n, int i, int row, int s) {
        const int t = tokrow[s];
        if (row < Fd && t >= 0) {
            const float gs = acc[0][n].x[l][i] * xsc[t], us = acc[1][n].x[l][i] * xsc[t];
            Hbuf[((long long)j * JT + s) * Fd + row] = gs / (1.0f + expf(-gs)) * us;
        }
    });
}

// down: out[job_dst[j JT + s], r] = down_j[r] . h for job j = blockIdx.y, rows r < H, h = row j JT + s of
// Hbuf given as qmm_split's hi / lo [J JT, Fd] and sc; down_j = job_ptr[j] + doff, rows of Fd values. Slots with
// job_dst < 0 are skipped (their Hbuf rows are not read). Grid: (ceil(H / (16 nw)), jobs); dynamic shared memory:
// QmmSmem<F, JT / 8>::bytes.
template <int F, int JT> __global__ void __launch_bounds__(QMM_THREADS, JT > 16 ? 2 : 3) qmm_moe_down(
        const u64* __restrict__ job_ptr, long long doff, const int* __restrict__ job_dst, const u16* __restrict__ hhi,
        const u16* __restrict__ hlo, const float* __restrict__ hsc, float* __restrict__ out, int H, int Fd) {
    PDL_ENTRY();
    QMM_DYN_SHARED(xs);
    __shared__ int tokrow[JT];
    __shared__ int dst[JT];
    const int j = blockIdx.y;
    const int nw = blockDim.x >= 32 ? (int)(blockDim.x >> 5) : 1;
    const int warp = (int)(threadIdx.x >> 5);
    if (!qmm_down_slots<JT>(job_dst, j, dst, tokrow)) return;  // an empty job
    const int r0 = (blockIdx.x * nw + warp) * 16;
    const long long rb = (long long)(Fd / QFmt<F>::bv) * QFmt<F>::ts;
    const u8* wm[1] = {reinterpret_cast<const u8*>(job_ptr[j]) + doff};
    const u16* dm[1] = {nullptr};
    mma_c acc[1][JT / 8];
    qmm_tile<F, JT / 8, 1>(wm, dm, rb, H, Fd, r0, hhi, hlo, (long long)Fd, tokrow, xs, acc, 0, qmm_chunks<F>(Fd));
    qmm_each_out<JT / 8>(r0, [&](int l, int n, int i, int row, int s) {
        const int t = tokrow[s];
        if (row < H && t >= 0) out[(long long)dst[s] * H + row] = acc[0][n].x[l][i] * hsc[t];
    });
}

// ---- weights as fp16 hi / lo for cuBLAS (the hgemm path, qmm.py hgemm) --------------------------------------------
// W (layout F: w, wd, rb as for qmm_dense; R rows of K values) as two fp16 matrices Wh, Wl [R, K] row-major (halves)
// with W = Wh + Wl exactly: v = d code in float32 (exact: 11 x 8 significant bits), Wh = half(v) round to nearest,
// Wl = half(v - Wh). Wl is exact: d is an fp16 value, so v and Wh are multiples of 2^-24 and |v - Wh| <= ulp(Wh) / 2
// holds at most v's 8 bits below Wh's (halves represent every multiple of 2^-24 of 11 significant bits). Q2_0
// ((code - 1) d, code - 1 in {-1, 0, 1, 2}) is exact in one half: Wl is not written (may be null). A value with
// |v| >= 65520 has no half (Wh infinite): *flag is set to 1 (the caller falls back to qmm_dense for the matrix; flag
// is never cleared here). One thread a lane unit of qmm_load_raw (VPL values of one row's block: 8, Q2_0 16), grid
// stride; K a multiple of the block (32, Q2_0 64) and of 8; wh, wl 16-byte aligned.
template <int F> __global__ void __launch_bounds__(256) qmm_wsplit(
        const u8* __restrict__ w, const u16* __restrict__ wd, long long rb, int R, int K, u16* __restrict__ wh,
        u16* __restrict__ wl, int* __restrict__ flag) {
    PDL_ENTRY();
    constexpr int BV = QFmt<F>::bv, VPL = QFmt<F>::vpl, WPB = QFmt<F>::wpb;
    const int nb = K / BV;
    const long long units = (long long)R * nb * 4;  // 4 lanes' units (c = 0..3) a block
    bool inf = false;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < units;
         u += (long long)gridDim.x * blockDim.x) {
        const long long r = u / (4LL * nb);
        const int rem = (int)(u - r * 4LL * nb), blk = rem >> 2, c = rem & 3;
        u32 q[WPB];
        u16 db;
        qmm_load_raw<F>(w + r * rb, F == 0 ? wd + r * (long long)(K / 32) : nullptr, blk, c, q, db);
        const float d = mma_h2f(db);
        u16 hi[VPL], lo[VPL];
        #pragma unroll
        for (int j = 0; j < VPL; ++j) {
            float v;
            if constexpr (F == 42) v = (float)((int)((q[0] >> (2 * j)) & 3u) - 1) * d;
            else v = (float)(int)(i8)((q[j >> 2] >> (8 * (j & 3))) & 0xffu) * d;
            hi[j] = mma_f2h(v);
            inf |= (hi[j] & 0x7fffu) >= 0x7c00u;
            if constexpr (F != 42) lo[j] = mma_f2h(v - mma_h2f(hi[j]));
        }
        const long long o = r * K + (long long)blk * BV + VPL * c;
        #pragma unroll
        for (int p = 0; p < VPL / 8; ++p) {
            uint4 vh;
            vh.x = mma_pack(hi[8 * p], hi[8 * p + 1]); vh.y = mma_pack(hi[8 * p + 2], hi[8 * p + 3]);
            vh.z = mma_pack(hi[8 * p + 4], hi[8 * p + 5]); vh.w = mma_pack(hi[8 * p + 6], hi[8 * p + 7]);
            reinterpret_cast<uint4*>(wh + o)[p] = vh;
            if constexpr (F != 42) {
                uint4 vl;
                vl.x = mma_pack(lo[8 * p], lo[8 * p + 1]); vl.y = mma_pack(lo[8 * p + 2], lo[8 * p + 3]);
                vl.z = mma_pack(lo[8 * p + 4], lo[8 * p + 5]); vl.w = mma_pack(lo[8 * p + 6], lo[8 * p + 7]);
                reinterpret_cast<uint4*>(wl + o)[p] = vl;
            }
        }
    }
    if (inf) *flag = 1;
}

// ---- the job table on the device (the batched decode step and the prefill: the routing is not read back) -----------
// ids [N]: the expert of pair i = t k + r (0 <= id < E); ptr_row [E]: the layer's blob addresses (the decoder's slot
// table row). Writes the jobs of prefill.py expert_jobs (experts in increasing id, each expert's pairs in increasing
// pair index, jt slots a job: 8, 16 or 32): job_ptr [jmax], job_tok / job_dst [jmax jt] (token t and pair i of each
// slot, -1 for an empty slot); the jobs past the last are empty (their first slot -1, job_ptr that of expert 0: the
// job kernels return at once on them). jmax >= ceil(N / jt) + min(E, N) holds every routing. One block (grid 1 x 1),
// any block size nt <= qmm.py JOBS_THREADS, a multiple of 32 (the host build: one thread). Dynamic shared memory
// (qmm.py jobs_shared): M keys, M the power of two >= N, then 3 E + 1 + 2 JOBS_THREADS ints (of the last, the scan
// uses 2 (nt / 32)); E N < 2^32.
// The pairs are ordered by a bitonic sort of the keys e N + i in shared memory (log2(M) (log2(M) + 1) / 2 passes of
// M / 2 compare-exchanges, a barrier each): a pair's rank within its expert is then its sorted position minus the
// expert's first position, and the table comes out the same for any block size (no atomics decide an order). Up to
// QMM_JOBS_RANK_MAX pairs the rank is counted directly instead (the 45 barriers of the sort of 320 pairs took most of
// the 16.8 us a launch of the 32-sequence step, H200, bench/gpu-notes.md).
#ifndef QMM_JOBS_RANK_MAX
#define QMM_JOBS_RANK_MAX 1024
#endif
extern "C" __global__ void qmm_jobs(const int* __restrict__ ids, int N, int k, int E, const u64* __restrict__ ptr_row,
                                    int jmax, int jt, u64* __restrict__ job_ptr, int* __restrict__ job_tok,
                                    int* __restrict__ job_dst) {
    PDL_ENTRY();
    int M = 1, lm = 0;
    while (M < N) { M <<= 1; ++lm; }
    u32* key = reinterpret_cast<u32*>(QMM_SMEM_BASE);  // [M] (first: 16-byte aligned for the rank's uint4 reads)
    int* cnt = reinterpret_cast<int*>(key + M);
    int* js = cnt + E;       // first job of expert e
    int* first = js + E;     // first sorted position of expert e's pairs
    int* jused = first + E;  // jobs the routing fills
    const int tid = threadIdx.x, nt = blockDim.x;
    int* tj = jused + 1;     // [nt] the threads' job sums, then their inclusive scan
    int* tp = tj + nt;       // [nt] the same of pairs
    for (int e = tid; e < E; e += nt) cnt[e] = 0;
    for (int i = tid; i < M; i += nt) key[i] = i < N ? (u32)ids[i] * (u32)N + (u32)i : 0xffffffffu;
    __syncthreads();
    for (int i = tid; i < N; i += nt) atomicAdd(&cnt[ids[i]], 1);
    __syncthreads();
    // exclusive prefix sums of the experts' jobs and pairs: thread t sums its run of experts [t seg, (t + 1) seg),
    // the runs' sums are scanned across the threads, then each thread writes its experts' prefixes
    const int seg = (E + nt - 1) / nt, e0 = min(E, tid * seg), e1 = min(E, e0 + seg);
    int sj = 0, sp = 0;
    for (int e = e0; e < e1; ++e) { sj += (cnt[e] + jt - 1) / jt; sp += cnt[e]; }
    // (inclusive scans within each warp by shuffles, the warps' totals scanned by one thread, two barriers; a
    // Hillis-Steele scan over the threads took 20 barriers at 1,024 threads)
    int ij = sj, ip = sp;
    const int lane = tid & 31, wid = tid >> 5, nwarps = (nt + 31) >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const int aj = __shfl_up_sync(0xffffffffu, ij, o), ap = __shfl_up_sync(0xffffffffu, ip, o);
        if (lane >= o) { ij += aj; ip += ap; }
    }
    if (lane == 31 || tid == nt - 1) { tj[wid] = ij; tp[wid] = ip; }
    __syncthreads();
    if (wid == 0) {  // the warps' totals -> their exclusive prefixes (warp 0's shuffle scan: one thread's loop of
        // loads and stores took about 1,300 cycles), and the jobs the routing fills
        const int vj = lane < nwarps ? tj[lane] : 0, vp = lane < nwarps ? tp[lane] : 0;
        int aj = vj, ap = vp;
        for (int o = 1; o < 32; o <<= 1) {
            const int uj = __shfl_up_sync(0xffffffffu, aj, o), up = __shfl_up_sync(0xffffffffu, ap, o);
            if (lane >= o) { aj += uj; ap += up; }
        }
        if (lane < nwarps) { tj[lane] = aj - vj; tp[lane] = ap - vp; }
        if (lane == nwarps - 1) *jused = aj;
    }
    __syncthreads();
    int bj = tj[wid] + ij - sj, bp = tp[wid] + ip - sp;
    for (int e = e0; e < e1; ++e) {
        js[e] = bj;
        first[e] = bp;
        bj += (cnt[e] + jt - 1) / jt;
        bp += cnt[e];
    }
    if (N <= QMM_JOBS_RANK_MAX) {
        // few pairs (the batched step: 320): a pair's rank within its expert is the count of the earlier pairs of the
        // same expert (at most N compares a thread, the warp's reads of key[q] one broadcast), no sort; eight keys a
        // round in two 16-byte reads (a read a key, each waiting on the one before, took about 5 us at 320 pairs)
        __syncthreads();
        for (int p = tid; p < N; p += nt) {
            const u32 e = key[p] / (u32)N, lo = e * (u32)N;  // (pair q is expert e's when key[q] - lo < N)
            int r = 0, q = 0;
            for (; q + 8 <= p; q += 8) {
                const uint4 a = *reinterpret_cast<const uint4*>(key + q);
                const uint4 b = *reinterpret_cast<const uint4*>(key + q + 4);
                r += (int)(a.x - lo < (u32)N) + (int)(a.y - lo < (u32)N) + (int)(a.z - lo < (u32)N) +
                     (int)(a.w - lo < (u32)N) + (int)(b.x - lo < (u32)N) + (int)(b.y - lo < (u32)N) +
                     (int)(b.z - lo < (u32)N) + (int)(b.w - lo < (u32)N);
            }
            for (; q < p; ++q) r += key[q] - lo < (u32)N;
            const int slot = js[e] * jt + r;
            job_tok[slot] = p / k;
            job_dst[slot] = p;
        }
    } else {
        // bitonic sort of the keys (M a power of two; stride too: shifts and masks, no division)
        for (int ls = 1; ls <= lm; ++ls)
            for (int lt = ls - 1; lt >= 0; --lt) {
                __syncthreads();
                const int stride = 1 << lt;
                for (int t = tid; t < M / 2; t += nt) {
                    const int lo = ((t >> lt) << (lt + 1)) | (t & (stride - 1)), hi = lo + stride;
                    const u32 a = key[lo], b = key[hi];
                    if ((a > b) == (((lo >> ls) & 1) == 0)) { key[lo] = b; key[hi] = a; }
                }
            }
        __syncthreads();
        for (int p = tid; p < N; p += nt) {
            const u32 kv = key[p];
            const int e = (int)(kv / (u32)N), i = (int)(kv - (u32)e * (u32)N);
            const int slot = js[e] * jt + (p - first[e]);
            job_tok[slot] = i / k;
            job_dst[slot] = i;
        }
    }
    for (int e = tid; e < E; e += nt) {
        const int n = cnt[e];
        if (n == 0) continue;
        const int j0 = js[e], nj = (n + jt - 1) / jt;
        for (int j = j0; j < j0 + nj; ++j) job_ptr[j] = ptr_row[e];
        for (int r = n; r < nj * jt; ++r) job_tok[j0 * jt + r] = job_dst[j0 * jt + r] = -1;
    }
    const int ju = *jused;
    for (int j = ju + tid; j < jmax; j += nt) job_ptr[j] = ptr_row[0];
    for (long long s = (long long)ju * jt + tid; s < (long long)jmax * jt; s += nt)
        job_tok[s] = job_dst[s] = -1;
}

// ---- integer expert jobs (Q2_0 gate/up and down; STRATATOOLS_QMM_JOBS_I8, qmm.py jobs_i8) ----------------------
// The step's jobs hold 1-2 tokens an expert on average: their time goes to the instructions a weight (the 2-bit
// decode into fp16, the hi and lo products, B's byte permutes), not to the products. The integer form feeds the codes
// 0..3 to mma.m16n8k32 as unsigned bytes: one shift and one mask give a register of 4 weights (fp16: 3 instructions a
// pair), and one k-step covers 32 values.
//
// Activations (qmm_split_i8): per row t and block b of 64 values (the Q2_0 block), q = rint(x 32767 / m) with m the
// block's max |x| (|q| <= 32767), as two byte planes q = 256 hi + lo (hi signed, lo unsigned), the block's scale
// s_tb = m / 32767 and Q_tb = sum of its q. A block's integer sum sum_k (code_k - 1) q_k = 256 (codes . hi) +
// (codes . lo) - Q is exact in int32, so y = sum_b d_b s_tb I_tb carries only the rounding of q (at most s_tb / 2 a
// value: about 1.5e-5 of the block's largest value) and float32 sums. A block holding a non-finite value gets
// q = 0 and s = NaN (the result is NaN, as the float path's).
//
// Plane layout: the 4-byte word w of a block (16 words) holds, in bytes i = 0..3, the values
// 16 (w >> 2) + 4 i + (w & 3): lane c's 16-byte piece at 16 c is, in words r = 0..3, B's registers of k-slots
// 4 c + i: word 0 (shift 0 of the codes), word 1 (shift 2) for k-step 0, words 2 and 3 (shifts 4 and 6) for k-step 1,
// against A's registers (w >> 2 r) & 0x03030303 of the lane's code word (values 16 c + 4 i + r in byte i).
#ifdef STRATA_HOST
#define QI8_GROUP 1    // threads a block of 64 values (the host build: one thread does its 16 words)
#else
#define QI8_GROUP 16
#endif
// Bytes a staged token row (rows 64 mod 128 bytes apart: a quarter warp's 16-byte loads fall on distinct banks).
#define QI8_XS (QMM_KC + 64)

// The value of a block of 64 that byte i of plane word wd holds: ORD 0 (the Q2_0 jobs' order above) 16 (wd >> 2) +
// 4 i + (wd & 3); ORD 1 (the Q8R dense ring, qmm_dense_ring<..., 1>) the values' own order, 4 wd + i.
template <int ORD> __device__ __forceinline__ int qi8_value(int wd, int i) {
    if constexpr (ORD == 0) return 16 * (wd >> 2) + 4 * i + (wd & 3);
    else return 4 * wd + i;
}

// One block b of 64 values of row t as qi8_split stores it (every lane of a group of QI8_GROUP calls it; lane gl
// takes words gl WPT .. (gl + 1) WPT - 1): the values come from val(j), j = the value's place in the block (0..63;
// called for the lane's words in order, only when live), the planes xh, xl [T, K] bytes (as words [T, K / 4]) in
// plane order ORD (qi8_value), the block's scale xs [T, K / 64] float and its sum of q xq [T, K / 64] int. Not live:
// nothing written (the lane stays for the shuffles).
template <int ORD, class Val>
__device__ __forceinline__ void qi8_unit(Val val, bool live, int gl, long long t, int b, int K, u32* __restrict__ xh,
                                         u32* __restrict__ xl, float* __restrict__ xs, int* __restrict__ xq) {
    constexpr int WPT = 16 / QI8_GROUP;  // words a thread
    const int nb = K >> 6;
    float v[WPT][4];
    float m = 0.0f;
    int bad = 0;
    #pragma unroll
    for (int p = 0; p < WPT; ++p) {
        const int wd = gl * WPT + p;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[p][i] = live ? val(qi8_value<ORD>(wd, i)) : 0.0f;
            const float a = fabsf(v[p][i]);
            bad |= !(a <= 3.4028234663852886e38f);
            m = fmaxf(m, a);
        }
    }
    for (int o = QI8_GROUP / 2; o; o >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    // (a block below 2^-64 is scaled up first: 32767 / m overflows for m under about 1e-34)
    const float up = m < 5.421010862427522e-20f ? 18446744073709551616.0f : 1.0f;
    const float inv = (m > 0.0f && !bad) ? 32767.0f / (m * up) : 0.0f;
    int qs = 0;
    #pragma unroll
    for (int p = 0; p < WPT; ++p) {
        const int wd = gl * WPT + p;
        u32 h = 0, l = 0;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            int q = bad ? 0 : (int)rintf(v[p][i] * up * inv);
            q = min(32767, max(-32767, q));
            qs += q;
            h |= (u32)((q >> 8) & 0xff) << (8 * i);
            l |= (u32)(q & 0xff) << (8 * i);
        }
        if (live) {
            const long long o = t * (K >> 2) + 16 * b + wd;
            xh[o] = h;
            xl[o] = l;
        }
    }
    for (int o = QI8_GROUP / 2; o; o >>= 1) qs += __shfl_xor_sync(0xffffffffu, qs, o);
    if (live && gl == 0) {
        xs[t * nb + b] = bad ? __int_as_float(0x7fc00000) : m / 32767.0f;
        xq[t * nb + b] = qs;
    }
}

// The unit of 64 values (row t, block b of K / 64) that a thread's group of QI8_GROUP takes in a grid over the T K / 64
// units, lane gl of it; live false past the units (the last unit stands in: the lanes stay for the shuffles).
struct QI8Pos {
    int t, b, gl;
    bool live;
};
__device__ __forceinline__ QI8Pos qi8_pos(int T, int K) {
    const int nb = K >> 6;
    const long long units = (long long)T * nb;
    const long long u = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / QI8_GROUP;
    const long long uc = u < units ? u : units - 1;
    const int t = (int)(uc / nb);
    return {t, (int)(uc - (long long)t * nb), (int)(threadIdx.x % QI8_GROUP), u < units};
}

// xh, xl [T, K] bytes (as words [T, K / 4]) in plane order ORD (qi8_value), xs [T, K / 64] float, xq [T, K / 64] int; K
// a multiple of 64. Rows t with rowok[t] < 0 are skipped (rowok null: none). Grid: ceil(T K / 64 QI8_GROUP / blockDim)
// blocks, blockDim a multiple of 32 (the host build: T K / 64 blocks of one thread).
template <int ORD>
__device__ __forceinline__ void qi8_split(const float* __restrict__ X, long long ldx, int T, int K,
                                          const int* __restrict__ rowok, u32* __restrict__ xh, u32* __restrict__ xl,
                                          float* __restrict__ xs, int* __restrict__ xq) {
    const QI8Pos at = qi8_pos(T, K);
    const bool live = at.live && (rowok == nullptr || rowok[at.t] >= 0);  // (every lane stays for the shuffles)
    const float* x = X + (long long)at.t * ldx + 64 * at.b;
    qi8_unit<ORD>([&](int j) { return x[j]; }, live, at.gl, at.t, at.b, K, xh, xl, xs, xq);
}

extern "C" __global__ void qmm_split_i8(const float* __restrict__ X, long long ldx, int T, int K,
                                        const int* __restrict__ rowok, u32* __restrict__ xh, u32* __restrict__ xl,
                                        float* __restrict__ xs, int* __restrict__ xq) {
    PDL_ENTRY();
    qi8_split<0>(X, ldx, T, K, rowok, xh, xl, xs, xq);
}

// The split in the values' order (ORD 1) for the integer dense ring (qmm_dense_ring<..., 1>).
extern "C" __global__ void qmm_split_i8d(const float* __restrict__ X, long long ldx, int T, int K,
                                         const int* __restrict__ rowok, u32* __restrict__ xh, u32* __restrict__ xl,
                                         float* __restrict__ xs, int* __restrict__ xq) {
    PDL_ENTRY();
    qi8_split<1>(X, ldx, T, K, rowok, xh, xl, xs, xq);
}

// ---- the hyper-connections' norm and mix with the split of their outputs (prefill.py _hc_in, _hc_gpu_mix) ----------
// The batched step ran them as an inject, rmsnorm_rows (7.6 us a launch), pf_hc_mix and a split each (qmm_split_i8d,
// 4.3 us): one launch now writes the rows and their planes.

// The sum of v over the block (every thread calls it; blockDim a multiple of 32, the host build's 1; red: 32 floats
// of shared memory, which a second call may reuse: its first barrier waits for this call's readers).
__device__ __forceinline__ float qmm_block_sum(float v, float* red) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = (int)(threadIdx.x & 31), wid = (int)(threadIdx.x >> 5), nw = (int)((blockDim.x + 31) >> 5);
    __syncthreads();  // (red is free: an earlier call's readers are past it)
    if (lane == 0) red[wid] = v;
    __syncthreads();
    if (wid == 0) {
        v = lane < nw ? red[lane] : 0.0f;
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    return red[0];
}

// The streams H [T, hc n] (rows r = t hc + h of n values, n a multiple of 64), a block a row. With y [T, n] the row
// takes its pending inject first, H += y[t] iw[r] (iw [T, hc]; prefill.py _inject's formula, written back into H);
// then hn [T, hc n] = x / sqrt(mean(x x) + eps) times w[(r n + c) mod wlen] (w null: none; decode_step.cu
// rmsnorm_rows's formula, its sum in another order); with xh the split of hn as [T, hc n] into the planes of
// qmm_split_i8d (the same bits as that kernel over this hn). The row is read once, by float4s, into shared memory
// (2 n floats of dynamic shared memory: the row, then w's values for it) and normed and split from there (the first
// form read it from global memory twice, 8.7 us a launch of the 32-sequence step: more than rmsnorm_rows alone).
// Grid: T hc blocks (the host build: one thread each); blockDim a multiple of 32, n / 4 the fastest (a float4 a
// thread, one turn of the split).
extern "C" __global__ void qmm_hc_norm_split(float* __restrict__ H, const float* __restrict__ y,
                                             const float* __restrict__ iw, int hc, int n,
                                             const float* __restrict__ w, int wlen, float eps,
                                             float* __restrict__ hn, u32* __restrict__ xh, u32* __restrict__ xl,
                                             float* __restrict__ xs, int* __restrict__ xq) {
    PDL_ENTRY();
    __shared__ float red[32];
    float* sx = reinterpret_cast<float*>(QMM_SMEM_BASE);  // [n] the row after the inject
    float* sw = sx + n;                                    // [n] w's values for the row
    const int r = (int)blockIdx.x, t = r / hc, h = r - t * hc;
    const long long base = (long long)r * n;
    float4* x4 = reinterpret_cast<float4*>(H + base);
    const float4* y4 = y != nullptr ? reinterpret_cast<const float4*>(y + (long long)t * n) : nullptr;
    const float g = y != nullptr ? iw[r] : 0.0f;
    const bool whole = w != nullptr && wlen % n == 0;  // (w's values for this row: one run, no modulo a value)
    const float4* w4 = whole ? reinterpret_cast<const float4*>(w + base % wlen) : nullptr;
    float s = 0.0f;
    for (int f = (int)threadIdx.x; f < (n >> 2); f += (int)blockDim.x) {
        float4 v = x4[f];
        if (y4 != nullptr) {
            const float4 d = y4[f];
            v = make_float4(v.x + d.x * g, v.y + d.y * g, v.z + d.z * g, v.w + d.w * g);
            x4[f] = v;
        }
        reinterpret_cast<float4*>(sx)[f] = v;
        if (whole) {
            reinterpret_cast<float4*>(sw)[f] = w4[f];
        } else if (w != nullptr) {
            for (int i = 0; i < 4; ++i) sw[4 * f + i] = w[(base + 4 * f + i) % wlen];
        }
        s += v.x * v.x;
        s += v.y * v.y;
        s += v.z * v.z;
        s += v.w * v.w;
    }
    s = qmm_block_sum(s, red);  // (its barriers also make sx and sw whole for every thread)
    const float rs = 1.0f / sqrtf(s / (float)n + eps);
    float* o = hn + base;
    auto val = [&](int c) {
        float v = sx[c] * rs;
        if (w != nullptr) v = v * sw[c];
        return v;
    };
    if (xh == nullptr) {
        for (int i = (int)threadIdx.x; i < n; i += (int)blockDim.x) o[i] = val(i);
        return;
    }
    const int nu = n >> 6, per = (int)blockDim.x / QI8_GROUP, gl = (int)(threadIdx.x % QI8_GROUP);
    for (int u0 = 0; u0 < nu; u0 += per) {  // (every thread takes the same turns: the groups' shuffles)
        const int u = u0 + (int)threadIdx.x / QI8_GROUP;
        const int uc = u < nu ? u : nu - 1;
        qi8_unit<1>([&](int j) {
            const int c = 64 * uc + j;
            const float v = val(c);
            o[c] = v;
            return v;
        }, u < nu, gl, t, h * nu + uc, hc * n, xh, xl, xs, xq);
    }
}

// Units of 64 a block of qmm_hc_mix_split (its blockDim / QI8_GROUP, at most; the host build's blocks hold one).
#define QI8_MIX_UNITS 16

// The hyper-connections' mix out [T, n] = (sum over h < hc of sigmoid(u[t, h, c]) hn[t, h, c]) / hc (u, hn [T, hc n];
// prefill.py pf_hc_mix's formula) and, with xh, its split into the planes of order ORD (qmm_split_i8 / qmm_split_i8d
// of out, the same bits). n a multiple of 64; units of 64 outputs of QI8_GROUP threads each, a thread's outputs
// from float4s of u and hn (then through shared memory into the plane order): grid ceil(T n / 64 QI8_GROUP /
// blockDim) blocks, blockDim at most 16 QI8_GROUP (the host build: T n / 64 blocks of one thread).
template <int ORD>
__global__ void qmm_hc_mix_split(const float* __restrict__ u, const float* __restrict__ hn, int hc, int n, int T,
                                 float* __restrict__ out, u32* __restrict__ xh, u32* __restrict__ xl,
                                 float* __restrict__ xs, int* __restrict__ xq) {
    PDL_ENTRY();
    constexpr int WPT = 16 / QI8_GROUP;  // float4s (words) a thread
    __shared__ float sv[QI8_MIX_UNITS][64];
    const QI8Pos at = qi8_pos(T, n);
    const int t = at.t, b = at.b, gl = at.gl;
    const bool live = at.live;
    float* buf = sv[threadIdx.x / QI8_GROUP];
    if (live) {
        const long long r0 = (long long)t * hc * n + 64 * b;
        float4* o4 = reinterpret_cast<float4*>(out + (long long)t * n + 64 * b);
        #pragma unroll
        for (int p = 0; p < WPT; ++p) {
            const int f = gl * WPT + p;  // values 4 f .. 4 f + 3 of the unit
            float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int h = 0; h < hc; ++h) {
                const float4 uu = reinterpret_cast<const float4*>(u + r0 + (long long)h * n)[f];
                const float4 xx = reinterpret_cast<const float4*>(hn + r0 + (long long)h * n)[f];
                a[0] += (1.0f / (1.0f + expf(-uu.x))) * xx.x;
                a[1] += (1.0f / (1.0f + expf(-uu.y))) * xx.y;
                a[2] += (1.0f / (1.0f + expf(-uu.z))) * xx.z;
                a[3] += (1.0f / (1.0f + expf(-uu.w))) * xx.w;
            }
            #pragma unroll
            for (int i = 0; i < 4; ++i) buf[4 * f + i] = a[i] / (float)hc;
            o4[f] = make_float4(buf[4 * f], buf[4 * f + 1], buf[4 * f + 2], buf[4 * f + 3]);
        }
    }
    __syncwarp();  // (a unit's threads are one quarter or half of a warp)
    if (xh != nullptr) qi8_unit<ORD>([&](int j) { return buf[j]; }, live, gl, t, b, n, xh, xl, xs, xq);
}

// A unit of 64 sums of qmm_sum_act_split / qmm_sum_hc: the 16 float4 runs P4 + run0 + f over the nz slices `stride`
// float4s apart (QSUM_G threads a run, qmm_sum_body's order), through qmm_act<ACT>, into o4[f] and v64 (shared).
template <int ACT>
__device__ __forceinline__ void qmm_sum_unit(const float4* __restrict__ P4, long long run0, long long stride, int nz,
                                             float div, float4* __restrict__ o4, float* v64) {
    const int g = (int)(threadIdx.x % QSUM_G);
    for (int f = (int)threadIdx.x / QSUM_G; f < 16; f += (int)blockDim.x / QSUM_G) {
        const float4* p = P4 + run0 + f;
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        #pragma unroll 4
        for (int z = g; z < nz; z += QSUM_G) {
            const float4 v = __ldcg(p + (long long)z * stride);
            a[0] += v.x; a[1] += v.y; a[2] += v.z; a[3] += v.w;
        }
        #pragma unroll
        for (int o = QSUM_G / 2; o; o >>= 1)
            #pragma unroll
            for (int i = 0; i < 4; ++i) a[i] += __shfl_xor_sync(0xffffffffu, a[i], o);
        if (g == 0) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) v64[4 * f + i] = qmm_act(a[i], ACT, div);
            o4[f] = make_float4(v64[4 * f], v64[4 * f + 1], v64[4 * f + 2], v64[4 * f + 3]);
        }
    }
}

// After qmm_sum_unit (every thread calls it): the unit's 64 values in v64 split as block b of row t of [T, K]
// (qi8_unit, ORD 1) by the block's first half warp (lanes 16..31 stand by in their own group of the shuffles).
__device__ __forceinline__ void qmm_split_v64(const float* v64, int t, int b, int K, u32* __restrict__ xh,
                                              u32* __restrict__ xl, float* __restrict__ xs, int* __restrict__ xq) {
    __syncthreads();
    if (threadIdx.x < 32)
        qi8_unit<1>([&](int j) { return v64[j]; }, (int)threadIdx.x < QI8_GROUP, (int)(threadIdx.x % QI8_GROUP), t, b,
                    K, xh, xl, xs, xq);
}

// The sums of the hyper-connections' down and inject projections made as one product (prefill.py _hc_joined): P
// [nz, T, R] the split of k's slices of [T, R] (R a multiple of 4; columns [0, rd) the down projection's, rd a
// multiple of 64, then R - rd inject columns). m [T, rd] = silu(s / div) with its split into qmm_split_i8d's planes
// (the up projection's input), iw [T, R - rd] = 2 sigmoid(s / div) (the inject weights): qmm_sum_act_split's units,
// and each token's unit 0 also adds its inject columns (QSUM_G threads a column, qmm_sum_body's order). Grid T rd /
// 64 blocks of 128 threads (the host build: one thread each).
extern "C" __global__ void __launch_bounds__(128) qmm_sum_hc(const float* __restrict__ P, float* __restrict__ m,
                                                  float* __restrict__ iw, int R, int rd, int nz, float div,
                                                  u32* __restrict__ xh, u32* __restrict__ xl, float* __restrict__ xs,
                                                  int* __restrict__ xq) {
    PDL_ENTRY();
    __shared__ float v64[64];
    const int nb = rd >> 6, unit = (int)blockIdx.x, t = unit / nb, b = unit - t * nb, ni = R - rd;
    const long long n = (long long)(gridDim.x / nb) * R;  // values of a slice (T R)
    const int g = (int)(threadIdx.x % QSUM_G), per = (int)blockDim.x / QSUM_G;
    qmm_sum_unit<1>(reinterpret_cast<const float4*>(P), ((long long)t * R + 64 * b) / 4, n >> 2, nz, div,
                    reinterpret_cast<float4*>(m + (long long)t * rd + 64 * b), v64);  // (R: whole float4s a row)
    if (b == 0) {
        for (int i0 = 0; i0 < ni; i0 += per) {  // (every thread takes the same turns: the groups' shuffles)
            const int i = i0 + (int)threadIdx.x / QSUM_G;
            float a = 0.0f;
            if (i < ni)
                for (int z = g; z < nz; z += QSUM_G) a += __ldcg(P + (long long)z * n + (long long)t * R + rd + i);
            #pragma unroll
            for (int o = QSUM_G / 2; o; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (g == 0 && i < ni) iw[(long long)t * ni + i] = qmm_act(a, 2, div);
        }
    }
    qmm_split_v64(v64, t, b, rd, xh, xl, xs, xq);
}

// qmm_sum_act<ACT>'s sums of Y [T, R] (R a multiple of 64; ACT 0: none) and, from the same launch, their split
// into qmm_split_i8d's planes [T, R] (the same bits as that kernel over this Y): a block a unit of 64 outputs
// (grid T R / 64; 128 threads: QSUM_G a float4 of sums, as qmm_sum_body adds them, then a half warp's split; the
// host build's one thread does it all). The hyper-connections' down projection's output is the up projection's input.
template <int ACT>
__global__ void __launch_bounds__(128) qmm_sum_act_split(const float* __restrict__ P, float* __restrict__ Y, int R,
                                                         int nz, float div, u32* __restrict__ xh,
                                                         u32* __restrict__ xl, float* __restrict__ xs,
                                                         int* __restrict__ xq) {
    PDL_ENTRY();
    __shared__ float v64[64];
    const int nb = R >> 6, unit = (int)blockIdx.x, t = unit / nb, b = unit - t * nb;
    qmm_sum_unit<ACT>(reinterpret_cast<const float4*>(P), (long long)unit * 16, (long long)gridDim.x * 16, nz, div,
                      reinterpret_cast<float4*>(Y) + (long long)unit * 16, v64);
    qmm_split_v64(v64, t, b, R, xh, xl, xs, xq);
}

// Issue the copies of chunk `chunk` (RKC values) of the block's tokens' byte planes into stage buffer xs (hi: TOK rows
// of XS bytes, then lo); a slot without a token gets zeros.
template <int NT, int RKC = QMM_KC, int XS = QI8_XS>
__device__ __forceinline__ void qi8_stage(const u8* __restrict__ xh, const u8* __restrict__ xl, int K,
                                          const int* tokrow, int chunk, u8* xs) {
    constexpr int BPC = RKC / 64, TOK = 8 * NT;
    const int nb = K >> 6, b0 = chunk * BPC;
    const int n = min(BPC, nb - b0) * 4;  // 16-byte pieces of the chunk's row
    for (int i = threadIdx.x; i < 2 * TOK * n; i += blockDim.x) {
        const int lohi = i / (TOK * n), rem = i - lohi * TOK * n;
        const int slot = rem / n, p = rem - slot * n;
        const int row = tokrow[slot];
        u8* dst = xs + (lohi * TOK + slot) * XS + 16 * p;
        if (row >= 0) cp_async16(dst, (lohi ? xl : xh) + (long long)row * K + 64LL * b0 + 16 * p);
        else *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// Dynamic shared memory of the integer job kernels (qmm.py smem_bytes_i8): two stage buffers of both planes, then the
// job's tokens' block scales ssc [nb][TOK] (float) and sums sq [nb][TOK] (int).
template <int NT> struct QmmSmemI8 { static constexpr int stage = 2 * 2 * 8 * NT * QI8_XS; };

// The pointers into that memory of a kernel of JT-token jobs over rows of K values (its first nb = K / 64 blocks), the
// scales after `lead` bytes of stages.
template <int JT> __device__ __forceinline__ void qi8_smem(int K, int lead, u8*& stage, float*& ssc, int*& sq) {
    stage = reinterpret_cast<u8*>(QMM_SMEM_BASE);
    ssc = reinterpret_cast<float*>(stage + lead);
    sq = reinterpret_cast<int*>(ssc + (K >> 6) * JT);
}

// Load the job's tokens' block scales and sums into shared memory (zeros for an empty slot). The tile's first
// barrier orders these writes before their reads.
template <int NT>
__device__ __forceinline__ void qi8_scales(const float* __restrict__ gs, const int* __restrict__ gq, int nb,
                                           const int* tokrow, float* ssc, int* sq) {
    constexpr int TOK = 8 * NT;
    for (int i = threadIdx.x; i < nb * TOK; i += blockDim.x) {
        const int b = i / TOK, slot = i - b * TOK, row = tokrow[slot];
        ssc[i] = row >= 0 ? gs[(long long)row * nb + b] : 0.0f;
        sq[i] = row >= 0 ? gq[(long long)row * nb + b] : 0;
    }
}

// One block of 64 values of k (block bg of the row; b of the staged chunk, whose planes are xs_hi / xs_lo, rows of XS
// bytes): acc[m][n] += the 16 rows' codes (wc[l][m][h]: the lane's code word of row g + 8 h; dc: the rows' fp16 scale
// bits) times the block's 8 NT tokens, scaled by d_b s_tb.
template <int NT, int NM, int XS>
__device__ __forceinline__ void qi8_block(const u32 (*wc)[NM][2], const u16 (*dc)[NM][2], int bg, int b,
                                          const u8* xs_hi, const u8* xs_lo, const float* ssc, const int* sq,
                                          mma_c (*acc)[NT]) {
    constexpr int TOK = 8 * NT;
    mma_a A[NM][2];  // k-steps 0 and 1 of the block: registers h (row g / g + 8) and 2 + h
    float d0[MMA_LANES][NM], d1[MMA_LANES][NM];
    for (int l = 0; l < MMA_LANES; ++l) {
        #pragma unroll
        for (int m = 0; m < NM; ++m) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 x = wc[l][m][h];
                A[m][0].x[l][h] = x & 0x03030303u;
                A[m][0].x[l][2 + h] = (x >> 2) & 0x03030303u;
                A[m][1].x[l][h] = (x >> 4) & 0x03030303u;
                A[m][1].x[l][2 + h] = (x >> 6) & 0x03030303u;
            }
            d0[l][m] = mma_h2f(dc[l][m][0]);
            d1[l][m] = mma_h2f(dc[l][m][1]);
        }
    }
    #pragma unroll
    for (int n = 0; n < NT; ++n) {
        mma_b Bh[2], Bl[2];
        float s0[MMA_LANES], s1[MMA_LANES];
        int q0[MMA_LANES], q1[MMA_LANES];
        for (int l = 0; l < MMA_LANES; ++l) {
            const int lane = mma_lane(l), g = lane >> 2, c = lane & 3;
            const int o = (8 * n + g) * XS + b * 64 + 16 * c;
            const uint4 vh = *reinterpret_cast<const uint4*>(xs_hi + o);
            const uint4 vl = *reinterpret_cast<const uint4*>(xs_lo + o);
            Bh[0].x[l][0] = vh.x; Bh[0].x[l][1] = vh.y; Bh[1].x[l][0] = vh.z; Bh[1].x[l][1] = vh.w;
            Bl[0].x[l][0] = vl.x; Bl[0].x[l][1] = vl.y; Bl[1].x[l][0] = vl.z; Bl[1].x[l][1] = vl.w;
            const int so = bg * TOK + 8 * n + 2 * c;
            s0[l] = ssc[so];
            s1[l] = ssc[so + 1];
            q0[l] = sq[so];
            q1[l] = sq[so + 1];
        }
        #pragma unroll
        for (int m = 0; m < NM; ++m) {
            // the block's exact integer sums: codes . hi, then 256 times that - Q as the accumulator of codes . lo
            // (int32 arithmetic wraps, so this is 256 (codes . hi) + (codes . lo) - Q in any order: no registers
            // set to -Q before the lo products, which took moves a block, cuobjdump)
            mma_ci P;
            for (int l = 0; l < MMA_LANES; ++l) P.x[l][0] = P.x[l][1] = P.x[l][2] = P.x[l][3] = 0;
            mma_sync_i8s(P, A[m][0], Bh[0]);
            mma_sync_i8s(P, A[m][1], Bh[1]);
            for (int l = 0; l < MMA_LANES; ++l) {
                P.x[l][0] = (int)(((u32)P.x[l][0] << 8) - (u32)q0[l]);
                P.x[l][1] = (int)(((u32)P.x[l][1] << 8) - (u32)q1[l]);
                P.x[l][2] = (int)(((u32)P.x[l][2] << 8) - (u32)q0[l]);
                P.x[l][3] = (int)(((u32)P.x[l][3] << 8) - (u32)q1[l]);
            }
            mma_sync_i8u(P, A[m][0], Bl[0]);
            mma_sync_i8u(P, A[m][1], Bl[1]);
            for (int l = 0; l < MMA_LANES; ++l) {
                acc[m][n].x[l][0] += d0[l][m] * s0[l] * (float)P.x[l][0];
                acc[m][n].x[l][1] += d0[l][m] * s1[l] * (float)P.x[l][1];
                acc[m][n].x[l][2] += d1[l][m] * s0[l] * (float)P.x[l][2];
                acc[m][n].x[l][3] += d1[l][m] * s1[l] * (float)P.x[l][3];
            }
        }
    }
}

// The integer tile: acc[m][n] = the 16 rows r0.. of the NM Q2_0 matrices (w[m], rb bytes a row, R rows of K values)
// times the block's 8 NT tokens, float32, fully scaled (d_b s_tb), k staged QMM_KC values at a time, each lane's
// weights loaded into registers one chunk ahead. All threads of the block call it.
template <int NT, int NM>
__device__ __forceinline__ void qi8_tile(const u8* const* w, long long rb, int R, int K, int r0,
                                         const u8* __restrict__ xh, const u8* __restrict__ xl, const int* tokrow,
                                         const float* ssc, const int* sq, u8* xs, mma_c (*acc)[NT]) {
    constexpr int BPC = QMM_KC / 64, TOK = 8 * NT, XS = QI8_XS;
    const int nb = K >> 6, nch = (nb + BPC - 1) / BPC;
    #pragma unroll
    for (int m = 0; m < NM; ++m)
        #pragma unroll
        for (int n = 0; n < NT; ++n) mma_zero(acc[m][n]);
    u32 wr[MMA_LANES][NM][BPC][2][1];
    u16 dr[MMA_LANES][NM][BPC][2];
    qi8_stage<NT>(xh, xl, K, tokrow, 0, xs);
    cp_async_commit();
    qmm_fetch<42, NM>(w, nullptr, rb, R, K, r0, 0, wr, dr);
    for (int chunk = 0; chunk < nch; ++chunk) {
        const int b0 = chunk * BPC, nbc = min(BPC, nb - b0), buf = chunk & 1;
        if (chunk + 1 < nch) {
            qi8_stage<NT>(xh, xl, K, tokrow, chunk + 1, xs + (buf ^ 1) * 2 * TOK * XS);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u8* xs_hi = xs + buf * 2 * TOK * XS;
        const u8* xs_lo = xs_hi + TOK * XS;
        u32 wc[MMA_LANES][NM][BPC][2][1];
        u16 dc[MMA_LANES][NM][BPC][2];
        qmm_take<42, NM>(wr, dr, wc, dc);
        if (chunk + 1 < nch) qmm_fetch<42, NM>(w, nullptr, rb, R, K, r0, chunk + 1, wr, dr);
        #pragma unroll
        for (int b = 0; b < BPC; ++b) {
            if (b >= nbc) break;
            u32 wb[MMA_LANES][NM][2];
            u16 db[MMA_LANES][NM][2];
            for (int l = 0; l < MMA_LANES; ++l)
                #pragma unroll
                for (int m = 0; m < NM; ++m)
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        wb[l][m][h] = wc[l][m][b][h][0];
                        db[l][m][h] = dc[l][m][b][h];
                    }
            qi8_block<NT, NM, XS>(wb, db, b0 + b, b, xs_hi, xs_lo, ssc, sq, acc);
        }
        __syncthreads();
    }
}

// ---- the integer tile through a ring of stages (qmm.py JOBS_RING_ENV) ----------------------------------------------
// As qi8_tile, but the block copies its rows' weights (cp.async) with the tokens' planes into a ring of S stages of
// shared memory, S - 1 chunks of RKC values ahead of the chunk computed (qi8_tile keeps one chunk of a lane's weights
// in flight in registers: the batched step's job kernels waited on those loads, long-scoreboard stalls first, Nsight
// Compute). A GGUF Q2_0 row's chunk (18-byte blocks, 2-byte aligned) is copied as the 16-byte pieces that cover it,
// from the aligned address at or below its first byte (the extra bytes lie in the same 16-byte granules as the row's
// own, never on another page, and are not read). Stage (bytes): weights [NM][16 nw rows][WS], then the tokens' planes
// hi [TOK][XS], lo [TOK][XS].
template <int NT, int NM, int RKC, int PAD = 16> struct QI8Ring {
    static constexpr int BPC = RKC / 64, TOK = 8 * NT;
    static constexpr int WP = (14 + 18 * BPC + 15) / 16;  // pieces that cover a chunk's blocks from any even offset
    static constexpr int WS = 16 * WP + PAD;              // a staged row (PAD 16: rows' banks apart; 0: smaller)
    static constexpr int XS = RKC + 64;                   // a staged token row of one plane (as QI8_XS)
    static __device__ __forceinline__ int stage(int nw) { return NM * 16 * nw * WS + 2 * TOK * XS; }
};

// The rings' copies from each thread's plan (QI8RPlan, QmmRingPlan); 0: worked out each chunk (qmm.py COPY_PLAN_ENV).
#ifndef QMM_COPY_PLAN
#define QMM_COPY_PLAN 1
#endif

// The shared-space address of shared buffer p on the device (0 in the host build, whose copies use p itself).
__device__ __forceinline__ unsigned qmm_smem_addr(const void* p) {
#ifndef STRATA_HOST
    return (unsigned)__cvta_generic_to_shared(p);
#else
    (void)p;
    return 0u;
#endif
}

// N = 4, 8 or 16 bytes from src to byte off of the shared buffer at st (st_s: its shared-space address on the device).
template <int N> __device__ __forceinline__ void qmm_cp(u8* st, unsigned st_s, int off, const void* src) {
#ifndef STRATA_HOST
    (void)st;
    if constexpr (N == 16) cp_async16_s(st_s + (unsigned)off, src);
    else cp_async_small_s<N>(st_s + (unsigned)off, src);
#else
    (void)st_s;
    if constexpr (N == 16) cp_async16(st + off, src);
    else cp_async_small<N>(st + off, src);
#endif
}

// A thread's share of every stage's copies, fixed for the whole tile (QI8RPlan: made once, then each chunk issues its
// copies by adding the chunk's offset; the copy of a chunk worked out from the thread index took about a quarter of
// the gate/up kernel's instructions and a third of down's, cuobjdump of the H200 build): thread t of QMM_THREADS
// copies staged row u = t (matrix u / nrows, row u mod nrows) when t < NM nrows, and the tokens' 16-byte pieces
// i = t + j QMM_THREADS (plane i / (TOK PC), slot, piece p of the chunk's row). The device runs it with
// blockDim.x == QMM_THREADS (qi8r_tile); otherwise qi8r_copy plays the plan's threads.
template <int NT, int NM, int RKC, int PAD> struct QI8RPlan {
    using G = QI8Ring<NT, NM, RKC, PAD>;
    static constexpr int PC = 4 * G::BPC, TJ = 2 * G::TOK * PC / QMM_THREADS;
    static_assert(TJ * QMM_THREADS == 2 * G::TOK * PC, "whole rounds of the tokens' pieces");
    // (QMM_THREADS a multiple of PC: a thread's pieces share their place p in the row, and piece j + 1 lies
    // QMM_THREADS / PC staged rows after piece j)
    static_assert(QMM_THREADS % PC == 0, "a thread's pieces at one place of the row");
    static constexpr int TSTEP = QMM_THREADS / PC * G::XS;
    const u8* wsrc;      // the staged row's weights (row start), nullptr: the thread stages no row
    const u8* tsrc[TJ];  // token piece j's bytes at chunk 0 (nullptr: an empty slot, zeros)
    int tdst;            // piece 0's offset in a stage (piece j's: + j TSTEP)
    int tp;              // the pieces' place p in the chunk's row (copied while p < the chunk's pieces)
};

template <int NT, int NM, int RKC, int PAD>
__device__ __forceinline__ void qi8r_plan(QI8RPlan<NT, NM, RKC, PAD>& pl, int t, const u8* const* w, long long rb,
                                          int R, int K, int rbase, int nrows, const u8* __restrict__ xh,
                                          const u8* __restrict__ xl, const int* tokrow) {
    using G = QI8Ring<NT, NM, RKC, PAD>;
    using P = QI8RPlan<NT, NM, RKC, PAD>;
    static_assert(NM == 1 || NM == 2, "one or two matrices a job");
    pl.wsrc = nullptr;
    if (t < NM * nrows) {
        // (constant indices into w: a runtime index put the pointers in local memory)
        const int m = t >= nrows, r = t - m * nrows;
        pl.wsrc = (m ? w[NM - 1] : w[0]) + (long long)min(rbase + r, R - 1) * rb;
    }
    pl.tp = t % P::PC;
    pl.tdst = NM * nrows * G::WS + (t / P::PC) * G::XS + 16 * pl.tp;
    #pragma unroll
    for (int j = 0; j < P::TJ; ++j) {
        const int i = t + j * QMM_THREADS;
        const int lohi = i / (G::TOK * P::PC), slot = i / P::PC - lohi * G::TOK;
        const int row = tokrow[slot];
        pl.tsrc[j] = row >= 0 ? (lohi ? xl : xh) + (long long)row * K + 16 * pl.tp : nullptr;
    }
}

// Issue one thread's copies of chunk `chunk` into the stage at st (shared address st_s on the device); t: the
// thread's staged row (the plan's).
template <int NT, int NM, int RKC, int PAD>
__device__ __forceinline__ void qi8r_issue(const QI8RPlan<NT, NM, RKC, PAD>& pl, int t, int K, int chunk, u8* st,
                                           unsigned st_s) {
    using G = QI8Ring<NT, NM, RKC, PAD>;
    using P = QI8RPlan<NT, NM, RKC, PAD>;
    const int nb = K >> 6, b0 = chunk * G::BPC, nbc = min(G::BPC, nb - b0);
    if (pl.wsrc != nullptr) {
        // the 16-byte pieces that cover the row's chunk, from the aligned address at or below its first byte
        const unsigned long long a = reinterpret_cast<unsigned long long>(pl.wsrc + 18LL * b0);
        const unsigned long long a16 = a & ~15ull;
        const int np = ((int)(a - a16) + 18 * nbc + 15) >> 4;
        #pragma unroll
        for (int p = 0; p < G::WP; ++p)
            if (p < np) qmm_cp<16>(st, st_s, t * G::WS + 16 * p, reinterpret_cast<const void*>(a16 + 16ull * p));
    }
    if (pl.tp >= 4 * nbc) return;
    #pragma unroll
    for (int j = 0; j < P::TJ; ++j) {
        const int d = pl.tdst + j * P::TSTEP;
        if (pl.tsrc[j] != nullptr) qmm_cp<16>(st, st_s, d, pl.tsrc[j] + (long long)RKC * chunk);
        else *reinterpret_cast<uint4*>(st + d) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// A chunk's copies without a plan kept: the thread plays the plan's threads threadIdx.x, + blockDim.x, ... (the host
// build's one thread all QMM_THREADS in turn; a device block of other than QMM_THREADS threads, which the launchers
// do not make, stays correct).
template <int NT, int NM, int RKC, int PAD>
__device__ __forceinline__ void qi8r_copy(const u8* const* w, long long rb, int R, int K, int rbase, int nrows,
                                          const u8* __restrict__ xh, const u8* __restrict__ xl, const int* tokrow,
                                          int chunk, u8* st) {
    const unsigned st_s = qmm_smem_addr(st);
    for (int t = (int)threadIdx.x; t < QMM_THREADS; t += (int)blockDim.x) {
        QI8RPlan<NT, NM, RKC, PAD> pl;
        qi8r_plan(pl, t, w, rb, R, K, rbase, nrows, xh, xl, tokrow);
        qi8r_issue(pl, t, K, chunk, st, st_s);
    }
}

template <int NT, int NM, int S, int RKC, int PAD>
__device__ __forceinline__ void qi8r_tile(const u8* const* w, long long rb, int R, int K, int rbase,
                                          const u8* __restrict__ xh, const u8* __restrict__ xl, const int* tokrow,
                                          const float* ssc, const int* sq, u8* ring, mma_c (*acc)[NT]) {
    using G = QI8Ring<NT, NM, RKC, PAD>;
    const int nw = blockDim.x >= 32 ? (int)(blockDim.x >> 5) : 1;
    const int nrows = 16 * nw, wrow = 16 * (int)(threadIdx.x >> 5), stage = G::stage(nw);
    const int nb = K >> 6, nch = (nb + G::BPC - 1) / G::BPC;
    #pragma unroll
    for (int m = 0; m < NM; ++m)
        #pragma unroll
        for (int n = 0; n < NT; ++n) mma_zero(acc[m][n]);
#ifndef STRATA_HOST
    // (the plan made once; a block of other than QMM_THREADS threads works each chunk's copies out: qi8r_copy)
    const bool planned = QMM_COPY_PLAN && blockDim.x == QMM_THREADS;
    QI8RPlan<NT, NM, RKC, PAD> pl;
    if (planned) qi8r_plan(pl, (int)threadIdx.x, w, rb, R, K, rbase, nrows, xh, xl, tokrow);
    const unsigned ring_s = qmm_smem_addr(ring);
#endif
    auto copy = [&](int c) {  // chunk c's copies into its stage
        u8* st = ring + (c % S) * stage;
#ifndef STRATA_HOST
        if (planned) {
            qi8r_issue(pl, (int)threadIdx.x, K, c, st, ring_s + (unsigned)((c % S) * stage));
            return;
        }
#endif
        qi8r_copy<NT, NM, RKC, PAD>(w, rb, R, K, rbase, nrows, xh, xl, tokrow, c, st);
    };
    #pragma unroll 1
    for (int s = 0; s < S - 1; ++s) {
        if (s < nch) copy(s);
        cp_async_commit();
    }
    int su[MMA_LANES][NM][2], lo[MMA_LANES][NM][2];  // the lane's rows' staged offsets and addresses' low 4 bits
    for (int l = 0; l < MMA_LANES; ++l) {
        const int g = mma_lane(l) >> 2;
        #pragma unroll
        for (int m = 0; m < NM; ++m)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long row = min(rbase + wrow + g + 8 * h, R - 1);
                su[l][m][h] = (m * nrows + wrow + g + 8 * h) * G::WS;
                lo[l][m][h] = (int)(reinterpret_cast<unsigned long long>(w[m] + row * rb) & 15ull);
            }
    }
    for (int chunk = 0; chunk < nch; ++chunk) {
        cp_async_wait<S - 2>();
        __syncthreads();
        const int nx = chunk + S - 1;
        if (nx < nch) copy(nx);
        cp_async_commit();
        const u8* st = ring + (chunk % S) * stage;
        const u8* xs_hi = st + NM * nrows * G::WS;
        const u8* xs_lo = xs_hi + G::TOK * G::XS;
        const int b0 = chunk * G::BPC, nbc = min(G::BPC, nb - b0);
        int sh[MMA_LANES][NM][2];  // where the lane's rows' chunk starts in their staged pieces
        for (int l = 0; l < MMA_LANES; ++l)
            #pragma unroll
            for (int m = 0; m < NM; ++m)
                #pragma unroll
                for (int h = 0; h < 2; ++h) sh[l][m][h] = su[l][m][h] + ((lo[l][m][h] + 18 * b0) & 15);
        #pragma unroll
        for (int b = 0; b < G::BPC; ++b) {
            if (b >= nbc) break;
            u32 wb[MMA_LANES][NM][2];
            u16 db[MMA_LANES][NM][2];
            for (int l = 0; l < MMA_LANES; ++l) {
                const int c = mma_lane(l) & 3;
                #pragma unroll
                for (int m = 0; m < NM; ++m)
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u16* q = reinterpret_cast<const u16*>(st + sh[l][m][h] + 18 * b);
                        db[l][m][h] = q[0];
                        wb[l][m][h] = (u32)q[1 + 2 * c] | ((u32)q[2 + 2 * c] << 16);
                    }
            }
            qi8_block<NT, NM, G::XS>(wb, db, b0 + b, b, xs_hi, xs_lo, ssc, sq, acc);
        }
    }
}

// The bytes of stages before the scales in an integer job kernel's shared memory: QmmSmemI8's two buffers (S = 0:
// qi8_tile), or the ring's S stages (qi8r_tile, RKC values a stage, NM matrices, nw warps).
template <int JT, int NM, int S, int RKC, int PAD> __device__ __forceinline__ int qi8_lead(int nw) {
    if constexpr (S == 0) return QmmSmemI8<JT / 8>::stage;
    else return S * QI8Ring<JT / 8, NM, RKC, PAD>::stage(nw);
}

// gate/up as qmm_moe_gu<42, JT>, the activations as qmm_split_i8's planes xh / xl, scales xs and sums xq of X [T, H].
// S = 0: qi8_tile, dynamic shared memory QmmSmemI8<JT / 8>::stage + 8 (H / 64) JT bytes; else qi8r_tile (a ring of S
// stages of RKC values), S QI8Ring<JT / 8, 2, RKC>::stage(nw) + 8 (H / 64) JT bytes (qmm.py smem_bytes_i8).
// The gate/up job body: job j's JT slots (tokrow: token rows of X, -1 empty) through expert blob G; the block's
// dynamic shared memory as qmm_moe_gu_i8's (stage, ssc, sq: qi8_smem). All threads of the block call it.
template <int JT, int S, int RKC, int PAD>
__device__ __forceinline__ void qi8_gu_job(const u8* G, const int* tokrow, int j, const u8* __restrict__ xh,
                                           const u8* __restrict__ xl, const float* __restrict__ xs,
                                           const int* __restrict__ xq, float* __restrict__ Hbuf, int H, int Fd,
                                           u8* stage, float* ssc, int* sq) {
    const int nw = blockDim.x >= 32 ? (int)(blockDim.x >> 5) : 1;
    const int warp = (int)(threadIdx.x >> 5);
    qi8_scales<JT / 8>(xs, xq, H >> 6, tokrow, ssc, sq);
    const int r0 = (blockIdx.x * nw + warp) * 16;
    const long long rb = (long long)(H / 64) * 18;
    const u8* wm[2] = {G, G + (long long)Fd * rb};
    mma_c acc[2][JT / 8];
    if constexpr (S == 0) qi8_tile<JT / 8, 2>(wm, rb, Fd, H, r0, xh, xl, tokrow, ssc, sq, stage, acc);
    else qi8r_tile<JT / 8, 2, S, RKC, PAD>(wm, rb, Fd, H, r0 - 16 * warp, xh, xl, tokrow, ssc, sq, stage, acc);
    qmm_each_out<JT / 8>(r0, [&](int l, int n, int i, int row, int s) {
        if (row < Fd && tokrow[s] >= 0) {
            const float gs = acc[0][n].x[l][i], us = acc[1][n].x[l][i];
            Hbuf[((long long)j * JT + s) * Fd + row] = gs / (1.0f + expf(-gs)) * us;
        }
    });
}

// gate/up as qmm_moe_gu<42, JT>, the activations as qmm_split_i8's planes xh / xl, scales xs and sums xq of X [T, H].
// S = 0: qi8_tile, dynamic shared memory QmmSmemI8<JT / 8>::stage + 8 (H / 64) JT bytes; else qi8r_tile (a ring of S
// stages of RKC values), S QI8Ring<JT / 8, 2, RKC>::stage(nw) + 8 (H / 64) JT bytes (qmm.py smem_bytes_i8).
template <int JT, int S = 0, int RKC = 0, int PAD = 16>
__global__ void __launch_bounds__(QMM_THREADS, S > 0 && JT <= 8 ? 6 : (JT > 16 ? 2 : 3)) qmm_moe_gu_i8(
        const u64* __restrict__ job_ptr, const int* __restrict__ job_tok, const u8* __restrict__ xh,
        const u8* __restrict__ xl, const float* __restrict__ xs, const int* __restrict__ xq, float* __restrict__ Hbuf,
        int H, int Fd) {
    PDL_ENTRY();
    u8* stage;
    float* ssc;
    int* sq;
    const int nw = blockDim.x >= 32 ? (int)(blockDim.x >> 5) : 1;
    qi8_smem<JT>(H, qi8_lead<JT, 2, S, RKC, PAD>(nw), stage, ssc, sq);
    __shared__ int tokrow[JT];
    const int j = blockIdx.y;
    for (int s = threadIdx.x; s < JT; s += blockDim.x) tokrow[s] = job_tok[j * JT + s];
    __syncthreads();
    if (tokrow[0] < 0) return;
    qi8_gu_job<JT, S, RKC, PAD>(reinterpret_cast<const u8*>(job_ptr[j]), tokrow, j, xh, xl, xs, xq, Hbuf, H, Fd,
                                stage, ssc, sq);
}

// down as qmm_moe_down<42, JT>, h as qmm_split_i8's planes of Hbuf [J JT, Fd] (rows of empty slots need not be
// split). Dynamic shared memory as qmm_moe_gu_i8's over rows of Fd values, one matrix.
template <int JT, int S = 0, int RKC = 0, int PAD = 16>
__global__ void __launch_bounds__(QMM_THREADS, JT > 16 ? 2 : 3) qmm_moe_down_i8(
        const u64* __restrict__ job_ptr, long long doff, const int* __restrict__ job_dst, const u8* __restrict__ hh,
        const u8* __restrict__ hl, const float* __restrict__ hs, const int* __restrict__ hq, float* __restrict__ out,
        int H, int Fd) {
    PDL_ENTRY();
    u8* stage;
    float* ssc;
    int* sq;
    const int nw = blockDim.x >= 32 ? (int)(blockDim.x >> 5) : 1;
    qi8_smem<JT>(Fd, qi8_lead<JT, 1, S, RKC, PAD>(nw), stage, ssc, sq);
    __shared__ int tokrow[JT];
    __shared__ int dst[JT];
    const int j = blockIdx.y;
    const int warp = (int)(threadIdx.x >> 5);
    if (!qmm_down_slots<JT>(job_dst, j, dst, tokrow)) return;
    qi8_scales<JT / 8>(hs, hq, Fd >> 6, tokrow, ssc, sq);
    const int r0 = (blockIdx.x * nw + warp) * 16;
    const long long rb = (long long)(Fd / 64) * 18;
    const u8* wm[1] = {reinterpret_cast<const u8*>(job_ptr[j]) + doff};
    mma_c acc[1][JT / 8];
    if constexpr (S == 0) qi8_tile<JT / 8, 1>(wm, rb, H, Fd, r0, hh, hl, tokrow, ssc, sq, stage, acc);
    else qi8r_tile<JT / 8, 1, S, RKC, PAD>(wm, rb, H, Fd, r0 - 16 * warp, hh, hl, tokrow, ssc, sq, stage, acc);
    qmm_each_out<JT / 8>(r0, [&](int l, int n, int i, int row, int s) {
        if (row < H && tokrow[s] >= 0) out[(long long)dst[s] * H + row] = acc[0][n].x[l][i];
    });
}

// ---- dense Q8R through a ring of stages (up to 32 tokens: the batched step; qmm.py RING_ENV) -----------------------
// The products of qmm_dense<0, NT> in the same order (nz = 1: bit for bit its Y), the weights waiting elsewhere.
// qmm_dense loads a lane's weights into registers one chunk ahead, so a block has one chunk of weights in flight: at 32
// tokens the large matrices streamed at 0.5-0.7 TB/s (H200: the 12,288-row attention matrix 61 us in 192 blocks),
// bounded by the loads' latency. Here the block copies its 16 nw rows' codes and scales, with its tokens' hi / lo
// halves, into a ring of S stages of shared memory (cp.async), S - 1 chunks of RKC values ahead of the chunk computed;
// one barrier a chunk (the stage refilled after it is the one every warp finished computing before it).
// A stage (bytes): codes [16 nw][RKC + 32] (the padding puts lanes g = 0..7's 8-byte reads of their rows on distinct
// banks), scales [16 nw][RKC / 32] fp16, then hi [8 NT][RKC + 32] and lo halves (as QmmXS<0>). K is a multiple of RKC
// (qmm.py takes qmm_dense for other K). Grid, split of k (chunks of RKC), P and cnt as qmm_dense.
//
// I8 = 1 (qmm.py DENSE_I8_ENV): the products as the integer expert jobs make them. The activations come as
// qmm_split_i8d's byte planes (16-bit fixed point per token and block of 64 values, q = 256 hi + lo, scale s_tb; the
// planes in the values' order), the codes go to mma.m16n8k32 as signed bytes (no decode), and a k-step covers a Q8R
// block of 32 values: its integer sum 256 (codes . hi) + (codes . lo) is exact and is scaled once by d s_tb. The fp16
// form spends two products (hi, lo) a k-step of 16 values and a decode of the codes (240-280 instructions a block a
// warp: Nsight Compute, bench/gpu-notes.md); at the same ring the integer form measured only 0-5% faster, 3 x 128
// values 8-10% (the eighteenth pass: the instructions were not the bound alone). Error: the fixed point's rounding
// (at most s_tb / 2 a value) and float32 sums (tests: hostlib.i8_bound); Y needs no token scale (xsc: the block
// scales [T, K / 64]). Its stage: codes and scales as above, the tokens' block scales [RKC / 64][8 NT] float, then the
// planes hi [8 NT][RKC + 32] and lo (bytes; a half warp's 8-byte loads of rows g = 0..3 fall on distinct banks).
template <int NT, int RKC, int I8 = 0> struct QmmRing {
    static constexpr int BPC = RKC / 32, WS = RKC + 32, XS = RKC + 32, DB = RKC / 16, TOK = 8 * NT;
    static constexpr int XB = I8 ? 1 : 2;                   // bytes a staged activation value (of each plane / half)
    static constexpr int SB = I8 ? (RKC / 64) * TOK * 4 : 0;  // bytes of the tokens' block scales
    // bytes of one stage for nw warps (qmm.py ring_stage_bytes)
    static __device__ __forceinline__ int stage(int nw) { return 16 * nw * (WS + DB) + SB + 2 * TOK * XS * XB; }
};

// Issue the copies of chunk `chunk`'s Q8R codes and scales of rows rbase .. rbase + nrows - 1 (clamped to R - 1) into
// stage st: codes [nrows][RKC + 32], then scales [nrows][RKC / 32] fp16 (both rings' stages begin so).
template <int RKC>
__device__ __forceinline__ void qmm_ring_rows(const u8* __restrict__ w, const u16* __restrict__ wd, int R, int K,
                                              int rbase, int nrows, int chunk, u8* st) {
    constexpr int WP = RKC / 16, WS = QmmRing<1, RKC>::WS, DB = QmmRing<1, RKC>::DB;  // (WP: 16-byte pieces a row)
    u8* sd = st + nrows * WS;
    const long long k0 = (long long)chunk * RKC;
    for (int i = threadIdx.x; i < nrows * WP; i += blockDim.x) {
        const int r = i / WP, p = i - r * WP;
        const long long row = min(rbase + r, R - 1);
        cp_async16(st + r * WS + 16 * p, w + row * K + k0 + 16 * p);
    }
    for (int r = threadIdx.x; r < nrows; r += blockDim.x) {
        const long long row = min(rbase + r, R - 1);
        const u16* src = wd + row * (long long)(K / 32) + k0 / 32;
        if constexpr (DB == 16) cp_async16(sd + r * DB, src);
        else cp_async_small<DB>(sd + r * DB, src);
    }
}

// Issue the copies of chunk `chunk` into stage st of the fp16 ring (QmmRing<NT, RKC>): rows rbase .. rbase + nrows - 1
// (clamped to R - 1), the block's tokens' hi / lo halves (tokrow; a slot without a token gets zeros). The integer
// ring's copies: QmmRingPlan.
template <int NT, int RKC>
__device__ __forceinline__ void qmm_ring_copy(const u8* __restrict__ w, const u16* __restrict__ wd, int R, int K,
                                              int rbase, int nrows, const u16* __restrict__ xhi,
                                              const u16* __restrict__ xlo, const int* tokrow, int chunk, u8* st) {
    using G = QmmRing<NT, RKC>;
    qmm_ring_rows<RKC>(w, wd, R, K, rbase, nrows, chunk, st);
    u8* sx = st + nrows * (G::WS + G::DB);
    qmm_stage<0, NT, RKC, G::XS, true>(xhi, xlo, (long long)K, tokrow, K, chunk, reinterpret_cast<u16*>(sx));
}

// The integer ring's copies of one thread, fixed for the kernel (QmmRingPlan: made once, then each chunk issues them at
// the chunk's offset; working each chunk's copies out from the thread index took about two fifths of the ring's
// instructions, cuobjdump of the H200 build): thread t of NTH threads (a block of NR rows at most) copies the codes'
// 16-byte pieces i = t + j NTH (row i / WP, piece i mod WP), row t's scales, the tokens' block scales t + j NTH
// ([b][slot]) and the tokens' plane pieces t + j NTH (as qi8_stage). Sources are chunk
// 0's (nullptr: an empty slot's zeros); a destination < 0: no such copy. The device runs it with blockDim.x == NTH;
// otherwise (the host build's one thread) qmm_ring_copy_i8 plays the NTH threads in turn.
template <int NT, int RKC, int NTH, int NR> struct QmmRingPlan {
    using G = QmmRing<NT, RKC, 1>;
    static constexpr int WP = RKC / 16, PC = RKC / 16, B64 = RKC / 64;
    static constexpr int WJ = (NR * WP + NTH - 1) / NTH;
    static constexpr int TJ = (2 * G::TOK * PC + NTH - 1) / NTH, SJ = (B64 * G::TOK + NTH - 1) / NTH;
    const u8* ws[WJ];
    int wdst[WJ];
    const u8* ds;  // the row's scales
    int ddst;
    const u8* ss[SJ];
    int sdst[SJ];
    const u8* ts[TJ];
    int tdst[TJ];
};

template <int NT, int RKC, int NTH, int NR>
__device__ __forceinline__ void qmm_ring_plan(QmmRingPlan<NT, RKC, NTH, NR>& pl, int t, const u8* __restrict__ w,
                                              const u16* __restrict__ wd, const u16* __restrict__ xhi,
                                              const u16* __restrict__ xlo, const float* __restrict__ xsc, int R,
                                              int K, int rbase, int nrows, const int* tokrow) {
    using G = QmmRing<NT, RKC, 1>;
    using P = QmmRingPlan<NT, RKC, NTH, NR>;
    #pragma unroll
    for (int j = 0; j < P::WJ; ++j) {
        const int i = t + j * NTH, r = i / P::WP, p = i - r * P::WP;
        pl.ws[j] = w + (long long)min(rbase + r, R - 1) * K + 16 * p;
        pl.wdst[j] = i < nrows * P::WP ? r * G::WS + 16 * p : -1;
    }
    pl.ds = reinterpret_cast<const u8*>(wd + (long long)min(rbase + t, R - 1) * (K / 32));
    pl.ddst = t < nrows ? nrows * G::WS + t * G::DB : -1;
    const int sx = nrows * (G::WS + G::DB);  // the tokens' part of a stage
    #pragma unroll
    for (int j = 0; j < P::SJ; ++j) {
        const int i = t + j * NTH, b = i / G::TOK, slot = i - b * G::TOK;
        const int row = i < P::B64 * G::TOK ? tokrow[slot] : -1;
        pl.ss[j] = row >= 0 ? reinterpret_cast<const u8*>(xsc + (long long)row * (K >> 6) + b) : nullptr;
        pl.sdst[j] = i < P::B64 * G::TOK ? sx + 4 * i : -1;
    }
    #pragma unroll
    for (int j = 0; j < P::TJ; ++j) {
        const int i = t + j * NTH;
        const int lohi = i / (G::TOK * P::PC), rem = i - lohi * G::TOK * P::PC;
        const int slot = rem / P::PC, p = rem - slot * P::PC;
        const int row = i < 2 * G::TOK * P::PC ? tokrow[slot] : -1;
        const u8* plane = reinterpret_cast<const u8*>(lohi ? xlo : xhi);
        pl.ts[j] = row >= 0 ? plane + (long long)row * K + 16 * p : nullptr;
        pl.tdst[j] = i < 2 * G::TOK * P::PC ? sx + G::SB + (lohi * G::TOK + slot) * G::XS + 16 * p : -1;
    }
}

// Issue one thread's copies of chunk `chunk` into the stage at st (shared address st_s on the device): PART
// QMM_ISSUE_W the weights' (codes and scales: constant, so qmm_dense_ring issues its first stages' before
// griddepcontrol.wait), QMM_ISSUE_X the tokens', QMM_ISSUE_W | QMM_ISSUE_X both.
#define QMM_ISSUE_W 1
#define QMM_ISSUE_X 2
template <int PART = QMM_ISSUE_W | QMM_ISSUE_X, int NT, int RKC, int NTH, int NR>
__device__ __forceinline__ void qmm_ring_issue(const QmmRingPlan<NT, RKC, NTH, NR>& pl, int chunk, u8* st,
                                               unsigned st_s) {
    using G = QmmRing<NT, RKC, 1>;
    using P = QmmRingPlan<NT, RKC, NTH, NR>;
    const long long k0 = (long long)chunk * RKC;
    if constexpr ((PART & QMM_ISSUE_W) != 0) {
        #pragma unroll
        for (int j = 0; j < P::WJ; ++j)
            if (pl.wdst[j] >= 0) qmm_cp<16>(st, st_s, pl.wdst[j], pl.ws[j] + k0);
        if (pl.ddst >= 0) qmm_cp<G::DB>(st, st_s, pl.ddst, pl.ds + k0 / 16);
    }
    if constexpr ((PART & QMM_ISSUE_X) == 0) return;
    #pragma unroll
    for (int j = 0; j < P::SJ; ++j) {
        if (pl.sdst[j] < 0) continue;
        if (pl.ss[j] != nullptr) qmm_cp<4>(st, st_s, pl.sdst[j], pl.ss[j] + 4 * P::B64 * (long long)chunk);
        else *reinterpret_cast<float*>(st + pl.sdst[j]) = 0.0f;
    }
    #pragma unroll
    for (int j = 0; j < P::TJ; ++j) {
        if (pl.tdst[j] < 0) continue;
        if (pl.ts[j] != nullptr) qmm_cp<16>(st, st_s, pl.tdst[j], pl.ts[j] + k0);
        else *reinterpret_cast<uint4*>(st + pl.tdst[j]) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// A chunk's copies of the integer ring without a plan kept: the thread plays the plan's threads threadIdx.x,
// + blockDim.x, ... (the host build's one thread all NTH in turn).
template <int NT, int RKC, int NTH, int NR>
__device__ __forceinline__ void qmm_ring_copy_i8(const u8* __restrict__ w, const u16* __restrict__ wd, int R, int K,
                                                 int rbase, int nrows, const u16* __restrict__ xhi,
                                                 const u16* __restrict__ xlo, const float* __restrict__ xsc,
                                                 const int* tokrow, int chunk, u8* st) {
    const unsigned st_s = qmm_smem_addr(st);
    for (int t = (int)threadIdx.x; t < NTH; t += (int)blockDim.x) {
        QmmRingPlan<NT, RKC, NTH, NR> pl;
        qmm_ring_plan(pl, t, w, wd, xhi, xlo, xsc, R, K, rbase, nrows, tokrow);
        qmm_ring_issue(pl, chunk, st, st_s);
    }
}

// One Q8R block of 32 values (u of the staged chunk st; nrows rows staged) of a warp's 16 rows (from wrow) times the
// block's 8 NT tokens' hi / lo halves (QmmRing<NT, RKC>): qmm_block's products, the codes decoded from the stage.
template <int NT, int RKC>
__device__ __forceinline__ void qmm_ring_f16_block(const u8* st, int nrows, int wrow, int u, mma_c (&acc)[NT]) {
    using G = QmmRing<NT, RKC>;
    const u16* sd = reinterpret_cast<const u16*>(st + nrows * G::WS);
    const u16* xs_hi = reinterpret_cast<const u16*>(st + nrows * (G::WS + G::DB));
    const u16* xs_lo = xs_hi + G::TOK * G::XS;
    mma_a A[1][2];
    float d0[MMA_LANES][1], d1[MMA_LANES][1];
    for (int l = 0; l < MMA_LANES; ++l) {
        const int lane = mma_lane(l), g = lane >> 2, c = lane & 3;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32* p = reinterpret_cast<const u32*>(st + (wrow + g + 8 * h) * G::WS + 32 * u + 8 * c);
            const u32 wv[2] = {p[0], p[1]};
            qmm_codes<0>(wv, 0, A[0][0].x[l][h], A[0][0].x[l][2 + h]);  // row g (h 0): a0 a1, a4 a5
            qmm_codes<0>(wv, 1, A[0][1].x[l][h], A[0][1].x[l][2 + h]);
        }
        d0[l][0] = mma_h2f(sd[(wrow + g) * G::BPC + u]);
        d1[l][0] = mma_h2f(sd[(wrow + g + 8) * G::BPC + u]);
    }
    qmm_block<0, NT, 1, G::XS>(A, d0, d1, xs_hi, xs_lo, u, &acc);
}

// One Q8R block of 32 values (u of the staged chunk st; nrows rows staged) of a warp's 16 rows (from wrow) times the
// block's 8 NT tokens on the integer planes (QmmRing<NT, RKC, 1>): acc[n] += d_r s_tb (256 (codes . hi) + (codes .
// lo)). A's registers: row g + 8 h's codes 32 u + 8 c + 0..3 (k-slots 4 c + 0..3) and + 4..7 (k-slots 16 + 4 c +
// 0..3), one 8-byte load; B's: the token's plane bytes at the same values (planes in the values' order).
template <int NT, int RKC>
__device__ __forceinline__ void qmm_ring_i8_block(const u8* st, int nrows, int wrow, int u, mma_c (&acc)[NT]) {
    using G = QmmRing<NT, RKC, 1>;
    const u16* sd = reinterpret_cast<const u16*>(st + nrows * G::WS);
    const float* ssx = reinterpret_cast<const float*>(st + nrows * (G::WS + G::DB));
    const u8* xs_hi = st + nrows * (G::WS + G::DB) + G::SB;
    const u8* xs_lo = xs_hi + G::TOK * G::XS;
    mma_a A;
    float d0[MMA_LANES], d1[MMA_LANES];
    for (int l = 0; l < MMA_LANES; ++l) {
        const int lane = mma_lane(l), g = lane >> 2, c = lane & 3;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint2 v = *reinterpret_cast<const uint2*>(st + (wrow + g + 8 * h) * G::WS + 32 * u + 8 * c);
            A.x[l][h] = v.x;
            A.x[l][2 + h] = v.y;
        }
        d0[l] = mma_h2f(sd[(wrow + g) * G::BPC + u]);
        d1[l] = mma_h2f(sd[(wrow + g + 8) * G::BPC + u]);
    }
    #pragma unroll
    for (int n = 0; n < NT; ++n) {
        mma_b Bh, Bl;
        float s0[MMA_LANES], s1[MMA_LANES];
        for (int l = 0; l < MMA_LANES; ++l) {
            const int lane = mma_lane(l), g = lane >> 2, c = lane & 3;
            const int o = (8 * n + g) * G::XS + 32 * u + 8 * c;
            const uint2 vh = *reinterpret_cast<const uint2*>(xs_hi + o);
            const uint2 vl = *reinterpret_cast<const uint2*>(xs_lo + o);
            Bh.x[l][0] = vh.x; Bh.x[l][1] = vh.y;
            Bl.x[l][0] = vl.x; Bl.x[l][1] = vl.y;
            const float2 sv = *reinterpret_cast<const float2*>(ssx + (u >> 1) * G::TOK + 8 * n + 2 * c);
            s0[l] = sv.x;
            s1[l] = sv.y;
        }
        mma_ci Q;  // 256 (codes . hi), then + (codes . lo): the block's exact integer sums
        for (int l = 0; l < MMA_LANES; ++l) Q.x[l][0] = Q.x[l][1] = Q.x[l][2] = Q.x[l][3] = 0;
        mma_sync_i8<true, true>(Q, A, Bh);
        for (int l = 0; l < MMA_LANES; ++l)
            #pragma unroll
            for (int i = 0; i < 4; ++i) Q.x[l][i] = (int)((u32)Q.x[l][i] << 8);
        mma_sync_i8<true, false>(Q, A, Bl);
        for (int l = 0; l < MMA_LANES; ++l) {
            acc[n].x[l][0] += d0[l] * s0[l] * (float)Q.x[l][0];
            acc[n].x[l][1] += d0[l] * s1[l] * (float)Q.x[l][1];
            acc[n].x[l][2] += d1[l] * s0[l] * (float)Q.x[l][2];
            acc[n].x[l][3] += d1[l] * s1[l] * (float)Q.x[l][3];
        }
    }
}

// The end of qmm_dense_ring (every thread calls it): the KG groups' sums acc added in group order into group 0's
// (through the ring's memory, once every copy has landed; the host build's one thread holds every group's, NG = KG),
// group 0's written to dst [T, ldd] (times xsc[t] with SCALE), then the split of k's slices added into Y by the
// tile's last slice (cnt null: by the caller).
template <int NT, int KG, int NG, bool SCALE>
__device__ __forceinline__ void qmm_ring_finish(mma_c (*acc)[NT], u8* ring, int rw, int wr, int grp, const int* tokrow,
                                                int r0, int R, const float* __restrict__ xsc, float* dst, long long ldd,
                                                int nz, int* cnt, int tile, int* last, const float* P, float* Y,
                                                long long ldy, int T, int rbase, int nrows, int t0) {
    if constexpr (KG > 1) {  // the groups' sums added in group order into group 0's (host: its own accumulators)
#ifdef STRATA_HOST
        for (int q = 1; q < KG; ++q)
            for (int n = 0; n < NT; ++n)
                for (int l = 0; l < MMA_LANES; ++l)
                    for (int i = 0; i < 4; ++i) acc[0][n].x[l][i] += acc[q][n].x[l][i];
#else
        cp_async_wait<0>();
        __syncthreads();  // every warp is done with the ring: its memory holds the groups' sums now
        float* red = reinterpret_cast<float*>(ring);  // [KG - 1][rw][32 lanes][NT][4]
        const int lane = (int)(threadIdx.x & 31);
        if (grp > 0) {
            float* r = red + (((grp - 1) * rw + wr) * 32 + lane) * NT * 4;
            #pragma unroll
            for (int n = 0; n < NT; ++n)
                #pragma unroll
                for (int i = 0; i < 4; ++i) r[n * 4 + i] = acc[0][n].x[0][i];
        }
        __syncthreads();
        if (grp == 0) {
            #pragma unroll 1
            for (int q = 1; q < KG; ++q) {
                const float* r = red + (((q - 1) * rw + wr) * 32 + lane) * NT * 4;
                #pragma unroll
                for (int n = 0; n < NT; ++n)
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) acc[0][n].x[0][i] += r[n * 4 + i];
            }
        }
#endif
    }
    if (grp == 0)  // (the other groups stay for the barriers below)
        qmm_each_out<NT>(r0, [&](int l, int n, int i, int row, int s) {
            const int t = tokrow[s];
            if (row < R && t >= 0)
                dst[(long long)t * ldd + row] = SCALE ? acc[0][n].x[l][i] * xsc[t] : acc[0][n].x[l][i];
        });
    if (nz == 1 || cnt == nullptr) return;  // (no counters: the caller adds the slices)
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int c = (int)blockIdx.x + (int)gridDim.x * tile;
        *last = atomicAdd(cnt + c, 1) == nz - 1;
        if (*last) cnt[c] = 0;
    }
    __syncthreads();
    if (!*last) return;
    __threadfence();
    qmm_add_slices(P, Y, ldy, T, R, nz, rbase, min(nrows, R - rbase), t0, min(8 * NT, T - t0));
}

// KG groups of warps share the block's rows and split each stage's blocks of k between them (group g takes blocks
// [g BPC / KG, (g + 1) BPC / KG)): KG times the warps a block (32 WG KG threads) for the same rows and stages, so
// more warps hide each other's latencies (at 32 tokens one group of 4 warps kept the SMs' issue slots 30% busy,
// dependency waits first: Nsight Compute, bench/gpu-notes.md). At the end the groups' sums meet in shared memory,
// added in group order 0 .. KG - 1 (the host build's one thread plays every group's part and adds in the same order).
// KG = 1: qmm_dense's order exactly. WG: warps of a group (4; 8: 128 rows a block, the tokens' activations staged
// once for twice the rows; 2: 32 rows a block, twice the blocks for the SMs to share evenly; qmm.py RING_WARPS_ENV);
// the kernel takes its rows from blockDim, WG bounds its launch.
template <int NT, int S, int RKC, int KG = 1, int I8 = 0, int WG = 4>
__global__ void __launch_bounds__(32 * WG * KG) qmm_dense_ring(
        const u8* __restrict__ w, const u16* __restrict__ wd, long long rb, const u16* __restrict__ xhi,
        const u16* __restrict__ xlo, const float* __restrict__ xsc, float* __restrict__ Y, long long ldy, int T,
        int R, int K, int nz, float* __restrict__ P, int* __restrict__ cnt) {
    using G = QmmRing<NT, RKC, I8>;
    static_assert(S >= 2, "a ring of at least two stages");
    static_assert(G::BPC % KG == 0, "a stage's blocks split evenly between the groups");
    constexpr int BPG = G::BPC / KG;  // blocks of a stage a group computes
#ifdef STRATA_HOST
    constexpr int NG = KG;  // (the host's one warp plays every group)
#else
    constexpr int NG = 1;
#endif
    (void)rb;  // (Q8R: K bytes a row)
    u8* ring = reinterpret_cast<u8*>(QMM_SMEM_BASE);
    __shared__ int tokrow[G::TOK];
    __shared__ int last;
    const int nw = blockDim.x >= 32 ? (int)(blockDim.x >> 5) : KG;  // (host: one warp standing for KG)
    const int rw = nw / KG;                                          // warps of one group: 16 rows each
    const int warp = blockDim.x >= 32 ? (int)(threadIdx.x >> 5) : 0;
    const int grp = warp / rw, wr = warp - grp * rw;
    const int nrows = 16 * rw, stage = G::stage(rw);
    const int z = (int)blockIdx.y % nz, tile = (int)blockIdx.y / nz;
    const int t0 = tile * G::TOK;
    const int nch = K / RKC, per = (nch + nz - 1) / nz;
    const int c0 = min(nch, z * per), c1 = min(nch, c0 + per);
    float* dst = nz == 1 ? Y : P + (long long)z * T * R;
    const long long ldd = nz == 1 ? ldy : (long long)R;
    for (int s = threadIdx.x; s < G::TOK; s += blockDim.x) tokrow[s] = t0 + s < T ? t0 + s : -1;
    __syncthreads();
    const int rbase = (int)blockIdx.x * nrows, wrow = 16 * wr;  // the warp's rows: rbase + wrow + 0 .. 15
    const int r0 = rbase + wrow;
    mma_c acc[NG][NT];
    #pragma unroll
    for (int q = 0; q < NG; ++q)
        #pragma unroll
        for (int n = 0; n < NT; ++n) mma_zero(acc[q][n]);
    constexpr int NTH = 32 * WG * KG;
#ifndef STRATA_HOST
    // (I8: the plan made once; a block of other than NTH threads works each chunk's copies out)
    const bool planned = QMM_COPY_PLAN && I8 && blockDim.x == NTH;
    QmmRingPlan<NT, RKC, NTH, 16 * WG> pl;
    if (planned) qmm_ring_plan(pl, (int)threadIdx.x, w, wd, xhi, xlo, xsc, R, K, rbase, nrows, tokrow);
    const unsigned ring_s = qmm_smem_addr(ring);
    // the first S - 1 chunks' weights before griddepcontrol.wait: constant, so under programmatic dependent launch
    // their copies overlap the end of the kernel before (nothing above reads memory an earlier kernel writes)
    if (planned) {
        #pragma unroll 1
        for (int s = 0; s < S - 1; ++s)
            if (c0 + s < c1) qmm_ring_issue<QMM_ISSUE_W>(pl, c0 + s, ring + s * stage, ring_s + (unsigned)(s * stage));
    }
#endif
    PDL_ENTRY();
    auto copy = [&](int c, bool w_issued) {  // chunk c's copies into its stage (w_issued: the tokens' alone)
        u8* st = ring + ((c - c0) % S) * stage;
#ifndef STRATA_HOST
        if (planned) {
            const unsigned st_s = ring_s + (unsigned)(((c - c0) % S) * stage);
            if (w_issued) qmm_ring_issue<QMM_ISSUE_X>(pl, c, st, st_s);
            else qmm_ring_issue(pl, c, st, st_s);
            return;
        }
#else
        (void)w_issued;
#endif
        if constexpr (I8)
            qmm_ring_copy_i8<NT, RKC, NTH, 16 * WG>(w, wd, R, K, rbase, nrows, xhi, xlo, xsc, tokrow, c, st);
        else qmm_ring_copy<NT, RKC>(w, wd, R, K, rbase, nrows, xhi, xlo, tokrow, c, st);
    };
    #pragma unroll 1
    for (int s = 0; s < S - 1; ++s) {  // the first S - 1 chunks (a group each, empty past the range; the first
        if (c0 + s < c1) copy(c0 + s, true);  // group also holds the weights issued before the wait)
        cp_async_commit();
    }
    for (int chunk = c0; chunk < c1; ++chunk) {
        cp_async_wait<S - 2>();  // this chunk's group has landed (groups committed: S - 1 + (chunk - c0))
        __syncthreads();         // ... for every thread's copies; and every warp is done with the previous stage
        const int nx = chunk + S - 1;
        if (nx < c1) copy(nx, false);
        cp_async_commit();
        const u8* st = ring + ((chunk - c0) % S) * stage;
        #pragma unroll
        for (int q = 0; q < NG; ++q) {
            #pragma unroll
            for (int bb = 0; bb < BPG; ++bb) {
                const int b = (NG == 1 ? grp : q) * BPG + bb;
                if constexpr (I8) qmm_ring_i8_block<NT, RKC>(st, nrows, wrow, b, acc[q]);
                else qmm_ring_f16_block<NT, RKC>(st, nrows, wrow, b, acc[q]);
            }
        }
    }
    qmm_ring_finish<NT, KG, NG, !I8>(acc, ring, rw, wr, grp, tokrow, r0, R, xsc, dst, ldd, nz, cnt, tile, &last, P, Y,
                                     ldy, T, rbase, nrows, t0);
}
