// Part of stratatools (stratatools/runtime/gpu). Compiled with quant_kernels.cu (after it) by kernels.py; the fast
// step instantiates these kernels from the multiply-add-fused module. tests/test_gpu_fused_host.py compiles them as
// host C++ (host_kernel_shim.cuh: one thread per block) and checks them against expert_ffn_reference.
// Routed-expert FFN with staged rows: as moe_gate_up_kernel / moe_down_kernel (same job table, same results up to
// float rounding), but a warp first copies the bytes of the rows it needs into its own shared buffer with 16-byte
// loads of the 16-byte-aligned span that covers them (every load of the warp in flight at once; bytes past a
// matrix's end are read one by one, never beyond it), then decodes groups from shared memory. Written for any
// block size (lanes = min(32, blockDim.x), warps = max(1, blockDim.x / 32)), so the host build runs the same code.
#include "pdl.cuh"  // pdl_wait, pdl_trigger, PDL_ENTRY (programmatic dependent launch)
#ifndef STRATA_HOST
#define MOE_DYN_SHARED(name) extern __shared__ __align__(16) u8 name[]
#define MOE_LDG16(p) __ldg(reinterpret_cast<const uint4*>(p))
#else
#define MOE_DYN_SHARED(name) u8* name = reinterpret_cast<u8*>(host_dyn_smem)
#define MOE_LDG16(p) (*reinterpret_cast<const uint4*>(p))
#endif
// sum_t v[t] x[t] over values 8g .. 8g+7 of the block at b (in shared memory) and 8 floats x (16-byte aligned).
// Q2_0 and Q8_0 without integer-to-float conversions (a quarter-rate instruction that bounded these kernels): a
// code c becomes the float 2^23 + c by an OR into the mantissa of 2^23 (Q8_0: a byte permute of b + 128), exact, and
// the block scale multiplies the group's sum once. Other types: deq8's values. Float rounding differs from deq8's
// (v = q d, then v x) by the order of operations only; these kernels are the fast (multiply-add) path.
template <int T> __device__ __forceinline__ float dot8s(const u8* b, int g, const float* x) {
    const float4 xa = reinterpret_cast<const float4*>(x)[0], xb = reinterpret_cast<const float4*>(x)[1];
    const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    float s = 0.0f;
    if constexpr (T == 42) {  // Q2_0: (code - 1) d
        const float d = h2f(rd16(b));
        const u32 q2 = (u32)b[2 + 2 * g] | ((u32)b[3 + 2 * g] << 8);
        #pragma unroll
        for (int t = 0; t < 8; ++t) s += (__uint_as_float(0x4B000000u | ((q2 >> (2 * t)) & 3u)) - 8388609.0f) * xv[t];
        return d * s;
    } else if constexpr (T == 8) {  // Q8_0: int8 q d
        const float d = h2f(rd16(b));
        const u8* q = b + 2 + 8 * g;
        const u32 w0 = ((u32)q[0] | ((u32)q[1] << 8) | ((u32)q[2] << 16) | ((u32)q[3] << 24)) ^ 0x80808080u;
        const u32 w1 = ((u32)q[4] | ((u32)q[5] << 8) | ((u32)q[6] << 16) | ((u32)q[7] << 24)) ^ 0x80808080u;
        #pragma unroll
        for (int t = 0; t < 4; ++t) {
            s += (__uint_as_float(__byte_perm(w0, 0x4B000000u, 0x7440 + t)) - 8388736.0f) * xv[t];
            s += (__uint_as_float(__byte_perm(w1, 0x4B000000u, 0x7440 + t)) - 8388736.0f) * xv[4 + t];
        }
        return d * s;
    } else {
        float o[8];
        deq8<T>(b, g, o);
        #pragma unroll
        for (int t = 0; t < 8; ++t) s += o[t] * xv[t];
        return s;
    }
}

//: bytes of one staged row buffer (a row of at most MOE_ROW_MAX bytes fits with its alignment slack)
#define MOE_ROW_BUF 3104
#define MOE_ROW_MAX (MOE_ROW_BUF - 32)

// Copy the 16-byte chunks [c0, c1) of the aligned span of row bytes [s, s + n) into buf (chunk c at buf + 16 c),
// lanes striding by nl; `end` is the end of the matrix (nothing at or past it is read).
__device__ __forceinline__ void moe_stage(const u8* s, int n, const u8* end, u8* buf, int lane, int nl) {
    const u8* a0 = reinterpret_cast<const u8*>(reinterpret_cast<u64>(s) & ~15ull);
    const int n16 = (int)((s + n - a0 + 15) >> 4);
    for (int c = lane; c < n16; c += nl) {
        const u8* src = a0 + 16 * c;
        uint4 v;
        if (src + 16 <= end) {
            v = MOE_LDG16(src);
        } else {
            u32 wv[4] = {0u, 0u, 0u, 0u};
            for (int k = 0; k < 16; ++k)
                if (src + k < end) wv[k >> 2] |= (u32)src[k] << (8 * (k & 3));
            v = make_uint4(wv[0], wv[1], wv[2], wv[3]);
        }
        reinterpret_cast<uint4*>(buf)[c] = v;
    }
}

// Hbuf[j, r] = silu(gate_j[r] . x) * (up_j[r] . x) for job j = blockIdx.y; a warp takes `per` consecutive rows at a
// time (as many as one MOE_ROW_BUF buffer holds with their alignment slack: 4 rows of Q2_0 at hidden 2560), stages
// the gate and the up rows (every 16-byte load of the 2 per rows in flight at once), then computes them
// (grid-stride over row groups); x = X[tok[j], :H]. Rows of gate/up are rb = H / bs * ts bytes, rb <= MOE_ROW_MAX.
// Shared memory: H floats + 2 MOE_ROW_BUF bytes per warp. The host launches ceil(F / (warps * per)) blocks a job.
template <int TG> __global__ void __launch_bounds__(256) moe_gate_up_staged(
        const u64* __restrict__ gate_ptr, const u64* __restrict__ up_ptr, const int* __restrict__ tok,
        const float* __restrict__ X, float* __restrict__ Hbuf, int H, int F) {
    PDL_ENTRY();
    MOE_DYN_SHARED(smem);
    float* xs = reinterpret_cast<float*>(smem);
    const int j = blockIdx.y;
    const float* x = X + (long long)tok[j] * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) xs[i] = x[i];
    __syncthreads();
    const int nl = blockDim.x < 32 ? blockDim.x : 32;
    const int warps = blockDim.x >> 5 ? blockDim.x >> 5 : 1;
    const int warp = threadIdx.x / nl, lane = threadIdx.x % nl;
    u8* bg = smem + (long long)H * 4 + (long long)warp * 2 * MOE_ROW_BUF;  // H is a multiple of 8: 16-byte aligned
    u8* bu = bg + MOE_ROW_BUF;
    const int bs = Unit<TG>::bs, ts = Unit<TG>::ts, gpb = bs / 8;
    const int rb = (H / bs) * ts, ng = H / 8;
    const int stride = ((rb + 30) / 16) * 16;  // bytes a staged row (with its alignment slack) takes in a buffer
    const int per = MOE_ROW_BUF / stride;
    const u8* G = reinterpret_cast<const u8*>(gate_ptr[j]);
    const u8* U = reinterpret_cast<const u8*>(up_ptr[j]);
    const u8* Gend = G + (long long)F * rb;
    const u8* Uend = U + (long long)F * rb;
    for (int r0 = (blockIdx.x * warps + warp) * per; r0 < F; r0 += gridDim.x * warps * per) {
        const int nr = F - r0 < per ? F - r0 : per;
        for (int q = 0; q < nr; ++q) {
            moe_stage(G + (long long)(r0 + q) * rb, rb, Gend, bg + q * stride, lane, nl);
            moe_stage(U + (long long)(r0 + q) * rb, rb, Uend, bu + q * stride, lane, nl);
        }
        __syncwarp();
        for (int q = 0; q < nr; ++q) {
            const long long off = (long long)(r0 + q) * rb;
            const u8* gp = bg + q * stride + (reinterpret_cast<u64>(G + off) & 15);
            const u8* up = bu + q * stride + (reinterpret_cast<u64>(U + off) & 15);
            float ga = 0.0f, ua = 0.0f;
            for (int gi = lane; gi < ng; gi += nl) {
                int blk = gi / gpb, g = gi - blk * gpb;
                const float* xx = xs + 8 * gi;
                ga += dot8s<TG>(gp + blk * ts, g, xx);
                ua += dot8s<TG>(up + blk * ts, g, xx);
            }
            ga = warp_sum(ga);
            ua = warp_sum(ua);
            if (lane == 0) Hbuf[(long long)j * F + r0 + q] = ga / (1.0f + expf(-ga)) * ua;
        }
        __syncwarp();
    }
}

// Y[t, r] (+)= sum over token t's jobs j of w[j] (down_j[r] . Hbuf[j]) for t = blockIdx.y, one row r per warp
// (grid-stride). Down rows are rb = F / bs * ts bytes, rb <= MOE_ROW_MAX; a warp stages as many jobs' rows at once
// as its buffer of 2 MOE_ROW_BUF bytes holds. Shared memory: 2 MOE_ROW_BUF bytes per warp.
template <int TD> __global__ void __launch_bounds__(256) moe_down_staged(
        const u64* __restrict__ down_ptr, const float* __restrict__ w, const int* __restrict__ tstart,
        const float* __restrict__ Hbuf, float* __restrict__ Y, int H, int F, int accumulate) {
    PDL_ENTRY();
    MOE_DYN_SHARED(smem);
    const int t = blockIdx.y;
    const int nl = blockDim.x < 32 ? blockDim.x : 32;
    const int warps = blockDim.x >> 5 ? blockDim.x >> 5 : 1;
    const int warp = threadIdx.x / nl, lane = threadIdx.x % nl;
    u8* buf = smem + (long long)warp * 2 * MOE_ROW_BUF;
    const int bs = Unit<TD>::bs, ts = Unit<TD>::ts, gpb = bs / 8;
    const int rb = (F / bs) * ts, ng = F / 8;
    const int stride = ((rb + 30) / 16) * 16;  // bytes a staged row (with its alignment slack) takes in buf
    const int per = (2 * MOE_ROW_BUF) / stride;
    const int j0 = tstart[t], nj = tstart[t + 1] - j0;
    for (int row = blockIdx.x * warps + warp; row < H; row += gridDim.x * warps) {
        float acc = 0.0f;
        for (int b0 = 0; b0 < nj; b0 += per) {
            const int nb = nj - b0 < per ? nj - b0 : per;
            for (int q = 0; q < nb; ++q) {
                const u8* D = reinterpret_cast<const u8*>(down_ptr[j0 + b0 + q]);
                moe_stage(D + (long long)row * rb, rb, D + (long long)H * rb, buf + q * stride, lane, nl);
            }
            __syncwarp();
            // lanes walk the (job, group) pairs; the pair advances by nl groups without a division
            int q = lane / ng, gi = lane - q * ng;
            while (q < nb) {
                const int j = j0 + b0 + q;
                const u8* rp = reinterpret_cast<const u8*>(down_ptr[j]) + (long long)row * rb;
                const u8* sp = buf + q * stride + (reinterpret_cast<u64>(rp) & 15);
                const int blk = gi / gpb, g = gi - blk * gpb;
                acc += w[j] * dot8s<TD>(sp + blk * ts, g, Hbuf + (long long)j * F + 8 * gi);
                gi += nl;
                while (gi >= ng) { gi -= ng; ++q; }
            }
            __syncwarp();
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            long long o = (long long)t * H + row;
            Y[o] = accumulate ? Y[o] + acc : acc;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Pipelined variants (moe_gate_up_pipe / moe_down_pipe: the decode step runs them when every routed expert is read from
// device memory, and for the shared expert; STRATATOOLS_MOE_KERNEL=staged|pipe overrides: experts.decoder_expert_kernels).
// Same job table and results (up to float rounding) as the staged kernels above; what differs:
// * Rows reach shared memory by cp.async (16-byte global -> shared copies that need no register and no wait per
//   copy). moe_stage's loop (16-byte load, then its store to shared) waits for each load before the next one is
//   issued, so a lane's ~12 loads of one pass were a chain of memory round trips; here every copy of an item is in
//   flight at once, a warp's first nstage items are issued before the block stages its input (the two overlap), and
//   with nstage > 1 its next nstage - 1 items are copied while it computes the current one (a ring of nstage slots
//   per warp; the host picks nstage, threads a block and rows a warp).
// * gate/up: a block works for one token over all of that token's (job, row) pairs, so x is staged once per block
//   and the jobs spread over the whole grid whatever their number; down: one token a block, its h rows staged once.
// * A lane decodes units of 16 values (a quarter of a Q2_0 block, half a Q8_0 block): one scale read per unit, the
//   codes read as 32-bit words (two aligned shared loads and a funnel shift: rows sit at any byte offset), and the
//   16 input values as 4 float4 from an interleaved layout (chunk k = values 4k .. 4k+3 of unit u at float4 index
//   k * units + u) in which the 32 lanes' loads of one chunk hit 32 consecutive float4: no bank conflict.
// * Q2_0: the input is staged pre-scaled, x'[t] = x[t] * 4^-(t mod 8) for value t of a unit (a power of two, exact
//   unless the product is subnormal), so code c of value t (bits 2t .. 2t+1 of the word, of its high half after one
//   shift for t >= 8) becomes the float 2^23 + c 4^(t mod 8) by one AND-OR into the mantissa of 2^23, and
//   (that - 2^23 - 4^(t mod 8)) * x'[t] = (c - 1) x[t] with a single rounding, as the direct product: 3 instructions a
//   value (and-or, add, fused multiply-add). Q8_0: byte permute of (q + 128) into 2^23's mantissa, add, multiply-add
//   (and one XOR a word). The staged kernels' dot8s spends 4 to 5 a value plus byte loads of codes and scale.
// Supported types: Q2_0 (42) and Q8_0 (8); H and F multiples of 16 values (of whole blocks in any case).
#include "cp_async.cuh"  // cp_async16, cp_async_commit, cp_async_wait
#ifndef STRATA_HOST
__device__ __forceinline__ float moe_h2f(u32 h) {  // IEEE half (low 16 bits) -> float, exact (hardware conversion)
    float f;
    asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 %0, lo;}\n" : "=f"(f) : "r"(h));
    return f;
}
#define MOE_FUNNEL(lo, hi, sh) __funnelshift_r((lo), (hi), (sh))
#else
static inline float moe_h2f(u32 h) { return h2f((u16)(h & 0xffffu)); }
#define MOE_FUNNEL(lo, hi, sh) ((u32)((((u64)(hi) << 32) | (u64)(lo)) >> ((sh) & 31)))
#endif
// Wait for all but the newest nstage - 1 commit groups (the slot about to be computed has landed); the host keeps
// nstage in 1..4 (more would wait for every group: correct, no longer pipelined).
__device__ __forceinline__ void moe_cp_wait_ring(int nstage) {
    if (nstage == 2) cp_async_wait<1>();
    else if (nstage == 3) cp_async_wait<2>();
    else if (nstage == 4) cp_async_wait<3>();
    else cp_async_wait<0>();
}
// Lanes of a warp, a compile-time constant so that a lane's units (u = lane + 32 m) have loop-invariant places in
// their blocks and constant strides: 32 on the device (the host launches whole warps only), 1 in the host build
// (one thread per block).
#ifndef STRATA_HOST
#define MOE_PIPE_LANES 32
#else
#define MOE_PIPE_LANES 1
#endif
//: bytes of shared memory the pipelined kernels leave after their last slot (dot16w reads the aligned word after a
//: row's last code byte, which may lie past the row: the slot slack and this pad keep it in bounds)
#define MOE_PIPE_PAD 16
// Issue the copies of nr rows of n bytes each into slot + q * stride (q < nr; row q's bytes [s_q, s_q + n) at
// slot + q * stride + (s_q & 15), the 16-byte-aligned chunks that cover them), lanes striding over the (row, chunk)
// pairs; rowf(q, s, end) gives row q's start and the end of its matrix: a chunk that reaches past the end is copied
// byte by byte with ordinary loads (nothing at or past the end is read), bytes past the end left as they were.
// stride >= the chunk slots of a row: ((n + 30) / 16) * 16.
template <class RowF> __device__ __forceinline__ void moe_issue_rows(int nr, int n, int stride, u8* slot, int lane,
                                                                    int nl, RowF rowf) {
    const int cpr = stride >> 4;
    int q = 0, c = lane;
    while (c >= cpr) { c -= cpr; ++q; }
    while (q < nr) {
        const u8* s;
        const u8* end;
        rowf(q, s, end);
        const u8* src = reinterpret_cast<const u8*>(reinterpret_cast<u64>(s) & ~15ull) + 16 * c;
        if (src < s + n) {
            u8* dst = slot + (long long)q * stride + 16 * c;
            if (src + 16 <= end) cp_async16(dst, src);
            else
                for (int k = 0; k < 16; ++k)
                    if (src + k < end) dst[k] = src[k];
        }
        c += nl;
        while (c >= cpr) { c -= cpr; ++q; }
    }
}
// Stage v = x[i] (i < n, the values of consecutive units of 16) into the interleaved layout at xs4 (units = n / 16
// float4 per chunk index), pre-scaled by 4^-(i mod 8) for Q2_0; all threads of the block stride over i. With x
// 16-byte aligned (the decode step's X and h rows are) a thread takes float4 chunks (4 values of one unit and one
// chunk index: one float4 store), MOE_STAGE_U of them loaded before any is stored, so that the block's loads are in
// flight together rather than one round trip per value (this staging bounded the launches: about 22 dependent loads
// a thread for the 10 jobs' h rows of the down kernel).
#define MOE_STAGE_U 8
template <int T> __device__ __forceinline__ void moe_stage_x(const float* x, int n, float* xs) {
    const int units = n >> 4;
    if ((reinterpret_cast<u64>(x) & 15) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        float4* xs4 = reinterpret_cast<float4*>(xs);
        const int n4 = n >> 2;
        for (int base = threadIdx.x; base < n4; base += MOE_STAGE_U * blockDim.x) {
            float4 v[MOE_STAGE_U];
            #pragma unroll
            for (int k = 0; k < MOE_STAGE_U; ++k) {
                const int c = base + k * blockDim.x;
                if (c < n4) v[k] = x4[c];
            }
            #pragma unroll
            for (int k = 0; k < MOE_STAGE_U; ++k) {
                const int c = base + k * blockDim.x;
                if (c < n4) {
                    const int u = c >> 2, q = c & 3;  // unit, chunk index (values 4q .. 4q+3 of the unit)
                    float4 w = v[k];
                    if constexpr (T == 42) {  // 4^-(t mod 8) for t = 4q .. 4q+3: exact powers of two
                        const int t0 = (4 * q) & 7;
                        w.x *= __uint_as_float((u32)(127 - 2 * t0) << 23);
                        w.y *= __uint_as_float((u32)(125 - 2 * t0) << 23);
                        w.z *= __uint_as_float((u32)(123 - 2 * t0) << 23);
                        w.w *= __uint_as_float((u32)(121 - 2 * t0) << 23);
                    }
                    xs4[q * units + u] = w;
                }
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int u = i >> 4, t = i & 15;
        float v = x[i];
        if constexpr (T == 42) v *= __uint_as_float((u32)(127 - 2 * (t & 7)) << 23);  // 4^-(t mod 8), exact
        xs[4 * ((t >> 2) * units + u) + (t & 3)] = v;
    }
}
//: bytes of codes in a unit of 16 values (Q2_0: 4, Q8_0: 16)
template <int T> struct MoeUnit { static constexpr int cb = T == 42 ? 4 : 16; };
// sum_t v[t] x[t] over the 16 values of one unit, x the unit's 16 staged inputs (pre-scaled for Q2_0; see above);
// the block's fp16 scale is bits [ssh, ssh + 16) of the word pair at sw, the unit's code bytes start at bit csh of
// the words at cw (sw, cw 4-byte aligned pointers into shared memory, shifts 0, 8, 16 or 24). Returns d * sum (the
// block scale applied once).
template <int T> __device__ __forceinline__ float dot16w(const u32* sw, u32 ssh, const u32* cw, u32 csh,
                                                         const float* xv) {
    const float d = moe_h2f(MOE_FUNNEL(sw[0], sw[1], ssh));
    float s0 = 0.0f, s1 = 0.0f;
    if constexpr (T == 42) {  // Q2_0: 18-byte block, fp16 d then 16 bytes of codes, value j = (qs[j/4] >> 2(j%4)) & 3
        const u32 w = MOE_FUNNEL(cw[0], cw[1], csh), wh = w >> 16;
        #pragma unroll
        for (int t = 0; t < 8; ++t) {
            const float off = 8388608.0f + (float)(1u << (2 * t));  // 2^23 + 4^t (the code's -1 included)
            s0 = fmaf(__uint_as_float(0x4B000000u | (w & (3u << (2 * t)))) - off, xv[t], s0);
            s1 = fmaf(__uint_as_float(0x4B000000u | (wh & (3u << (2 * t)))) - off, xv[8 + t], s1);
        }
    } else {  // Q8_0: 34-byte block, fp16 d then 32 int8 codes
        #pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 w = MOE_FUNNEL(cw[k], cw[k + 1], csh) ^ 0x80808080u;  // byte = q + 128
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float v = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + e)) - 8388736.0f;
                if (e & 1) s1 = fmaf(v, xv[4 * k + e], s1);
                else s0 = fmaf(v, xv[4 * k + e], s0);
            }
        }
    }
    return d * (s0 + s1);
}
// The 4-byte-aligned word pointer at or below p (shared memory) and p's offset from it in bits. (Pointer arithmetic
// rather than an integer round trip, so that the compiler keeps knowing the address is in shared memory.)
__device__ __forceinline__ const u32* moe_words(const u8* p, u32& sh) {
    const u32 lo = (u32)reinterpret_cast<u64>(p) & 3u;
    sh = 8u * lo;
    return reinterpret_cast<const u32*>(p - lo);
}
// dot16w for unit s of the block at b (shared memory, any byte offset).
template <int T> __device__ __forceinline__ float dot16p(const u8* b, int s, const float* xv) {
    u32 ssh, csh;
    const u32* sw = moe_words(b, ssh);
    const u32* cw = moe_words(b + 2 + MoeUnit<T>::cb * s, csh);
    return dot16w<T>(sw, ssh, cw, csh, xv);
}
// The 16 staged inputs of unit u (interleaved layout of `units` units at xs).
__device__ __forceinline__ void moe_load_x16(const float* xs, int units, int u, float* xv) {
    const float4* x4 = reinterpret_cast<const float4*>(xs);
    #pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 v = x4[k * units + u];
        xv[4 * k] = v.x; xv[4 * k + 1] = v.y; xv[4 * k + 2] = v.z; xv[4 * k + 3] = v.w;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Integer variants of the pipelined kernels for Q2_0 (moe_gate_up_pipe_i8 / moe_down_pipe_i8: the bodies below with
// I8; experts.py runs them for Q2_0 as STRATATOOLS_MOE_INT8 says: gate/up by default). Same job tables, grids, rings
// and item order as moe_gate_up_pipe / moe_down_pipe; what differs is the input and the dot product, as mv_q8i
// (dense_q8.cu) does for Q8_0:
// * The input (x, or the token's h rows) is quantized per block of 32 values while it is staged: s_b = max |x| /
//   MI8_QMAX, v = rint(x / s_b) in [-MI8_QMAX, MI8_QMAX], split into two int8 planes hi = floor((v + 128) / 256) and
//   lo = v - 256 hi (16-bit fixed point, about 1.5e-5 of the block's largest value). A 16-value unit's bytes are
//   stored permuted: word k (bytes 4k .. 4k+3) holds values k, 4+k, 8+k, 12+k of the unit, the order in which
//   (w >> 2k) & 0x03030303 lays out the 2-bit codes of a Q2_0 code word w. The per-unit sum of v is kept too.
// * A unit's sum is then sum_t (c_t - 1) v_t = 256 (sum c hi) + (sum c lo) - sum v: 8 dp4a (4 int8 products and an
//   add each) and 4 masks for 16 values against about 3 float instructions a value in dot16w; the unit adds
//   d s_b (float)(that sum) to the row (|sum| < 2^22: exact in int32 and in float). The down kernel folds the job's
//   routing weight into s_b.
// Precision as mv_q8i's: W (v s) differs from W x by the rounding of x to v s (each value within s_b / 2), plus
// float rounding of the units' terms and their sum. A block whose max |x| is below MI8_TINY counts as zero; a block
// holding a NaN or an infinity gets a NaN scale (every output it feeds is NaN, as the float kernels' are not finite).
#define MI8_QMAX 32639
#define MI8_TINY 7.888609052210118e-31f  // 2^-100
__device__ __forceinline__ int mi8_align16(int v) { return (v + 15) & ~15; }
// Shared layout of the quantized input of n values (n a multiple of 32): hi plane [n] at 0, lo plane [n] at n,
// scales [n / 32] at mi8_sc(n), unit sums [n / 16] at mi8_sum(n); mi8_end(n) bytes, 16-byte aligned.
__device__ __forceinline__ int mi8_sc(int n) { return mi8_align16(2 * n); }
__device__ __forceinline__ int mi8_sum(int n) { return mi8_sc(n) + 4 * (n >> 5); }
__device__ __forceinline__ int mi8_end(int n) { return mi8_align16(mi8_sum(n) + 4 * (n >> 4)); }
// Quantize x[0 .. cnt) (cnt a multiple of 32, at most n) into the layout of n values at base: one thread a block of
// 32 (the block's threads striding over blocks), its values read twice (the maximum, then the planes; the second
// pass hits the cache) so that no 32-value array lives in registers. wj: when given, block b's scale is multiplied
// by wj[b / bpj].
__device__ __forceinline__ void mi8_stage(const float* __restrict__ x, int cnt, u8* base, int n,
                                          const float* __restrict__ wj, int bpj) {
    float* xsc = reinterpret_cast<float*>(base + mi8_sc(n));
    int* xsum = reinterpret_cast<int*>(base + mi8_sum(n));
    const int nb = cnt >> 5;
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        const float* p = x + 32LL * b;
        const bool vec = (reinterpret_cast<u64>(p) & 15) == 0;  // float4 loads (all 8 in flight) when aligned
        // m: the largest |x| (fmaxf drops NaN, so a sum tells whether a value is not finite: the block's scale is
        // then NaN and so is every output that reads it, as with the float kernels, instead of a clamped value)
        float m = 0.0f, all = 0.0f;
        if (vec) {
            float4 v[8];
            #pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = reinterpret_cast<const float4*>(p)[k];
            #pragma unroll
            for (int k = 0; k < 8; ++k) {
                m = fmaxf(fmaxf(m, fmaxf(fabsf(v[k].x), fabsf(v[k].y))), fmaxf(fabsf(v[k].z), fabsf(v[k].w)));
                all += (v[k].x * 0.0f + v[k].y * 0.0f) + (v[k].z * 0.0f + v[k].w * 0.0f);
            }
        } else {
            #pragma unroll
            for (int t = 0; t < 32; ++t) {
                m = fmaxf(m, fabsf(p[t]));
                all += p[t] * 0.0f;
            }
        }
        const bool live = m >= MI8_TINY;
        const float s = live ? m / (float)MI8_QMAX : 0.0f;
        const float inv = live ? 1.0f / s : 0.0f;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 hw[4] = {0u, 0u, 0u, 0u}, lw[4] = {0u, 0u, 0u, 0u};
            int sum = 0;
            float xv[16];  // (the second read of the block: from the cache)
            if (vec) {
                #pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const float4 f = reinterpret_cast<const float4*>(p + 16 * h)[k];
                    xv[4 * k] = f.x; xv[4 * k + 1] = f.y; xv[4 * k + 2] = f.z; xv[4 * k + 3] = f.w;
                }
            } else {
                #pragma unroll
                for (int t = 0; t < 16; ++t) xv[t] = p[16 * h + t];
            }
            #pragma unroll
            for (int t = 0; t < 16; ++t) {
                const float r = fminf(fmaxf(rintf(xv[t] * inv), -(float)MI8_QMAX), (float)MI8_QMAX);
                const int v = (int)r;
                const int hi = (v + 128) >> 8;  // floor: lo = v - 256 hi in [-128, 127]
                const int lo = v - 256 * hi;
                sum += v;
                hw[t & 3] |= ((u32)hi & 0xffu) << (8 * (t >> 2));
                lw[t & 3] |= ((u32)lo & 0xffu) << (8 * (t >> 2));
            }
            const int u = 2 * b + h;
            reinterpret_cast<uint4*>(base)[u] = make_uint4(hw[0], hw[1], hw[2], hw[3]);
            reinterpret_cast<uint4*>(base + n)[u] = make_uint4(lw[0], lw[1], lw[2], lw[3]);
            xsum[u] = sum;
        }
        xsc[b] = (wj != nullptr ? s * wj[b / bpj] : s) + all;  // (all: 0, or NaN for a value not finite)
    }
}
// 256 (sum c hi) + (sum c lo) over the 16 2-bit codes of word w (value 4i + k at bits 8i + 2k) and a unit's planes.
__device__ __forceinline__ int mi8_dot(u32 w, uint4 h, uint4 l) {
    const int c0 = (int)(w & 0x03030303u), c1 = (int)((w >> 2) & 0x03030303u);
    const int c2 = (int)((w >> 4) & 0x03030303u), c3 = (int)((w >> 6) & 0x03030303u);
    int ih = __dp4a(c0, (int)h.x, 0);
    ih = __dp4a(c1, (int)h.y, ih);
    ih = __dp4a(c2, (int)h.z, ih);
    ih = __dp4a(c3, (int)h.w, ih);
    int il = __dp4a(c0, (int)l.x, 0);
    il = __dp4a(c1, (int)l.y, il);
    il = __dp4a(c2, (int)l.z, il);
    il = __dp4a(c3, (int)l.w, il);
    return 256 * ih + il;
}

// Hbuf[j, r] = silu(gate_j[r] . x) * (up_j[r] . x) for every job j of token t = blockIdx.y (jobs tstart[t] ..
// tstart[t+1]-1), x = X[t, :H]. The block's items are the token's (job, row) pairs f = q * F + r (q: the job's place
// among the token's), so that x is staged once per block and any number of jobs spreads over the whole grid; a warp's
// items are f = blockIdx.x * warps + warp + i * gridDim.x * warps, each staged (gate row and up row) into a slot of its
// ring of nstage slots. Shared memory (experts.pipe_gu_shared): H floats (x, interleaved) + warps * nstage * 2 * stride
// bytes + MOE_PIPE_PAD, stride = ((rb + 30) / 16) * 16, rb = H / bs * ts. With I8 (moe_gate_up_pipe_i8, Q2_0) x is
// staged quantized (mi8_stage: mi8_end(H) bytes in place of the H floats) and a unit's sums are integer (mi8_dot).
template <int TG, bool I8> __device__ __forceinline__ void moe_gate_up_pipe_body(
        const u64* __restrict__ gate_ptr, const u64* __restrict__ up_ptr, const int* __restrict__ tstart,
        const float* __restrict__ X, float* __restrict__ Hbuf, int H, int F, int nstage) {
    MOE_DYN_SHARED(smem);
    float* xs = reinterpret_cast<float*>(smem);
    const int t = blockIdx.y;
    const int j0 = tstart[t], nf = (tstart[t + 1] - j0) * F;
    constexpr int nl = MOE_PIPE_LANES;
    const int warps = blockDim.x / nl;
    const int warp = threadIdx.x / nl, lane = threadIdx.x % nl;
    constexpr int bs = Unit<TG>::bs, ts = Unit<TG>::ts, upb = bs / 16;
    constexpr int wstep = (32 / upb) * ts / 4;  // words a lane's unit pointers advance by (see the compute loop)
    static_assert(32 % upb == 0 && ((32 / upb) * ts) % 4 == 0, "a lane's units keep their byte alignment");
    const int rb = (H / bs) * ts, units = H / 16;
    const int stride = ((rb + 30) / 16) * 16;
    const long long mbytes = (long long)F * rb;
    u8* ring = smem + (long long)(I8 ? mi8_end(H) : H * 4) + (long long)warp * nstage * 2 * stride;
    const int f0 = blockIdx.x * warps + warp, fstep = gridDim.x * warps;
    const int nit = f0 < nf ? (nf - f0 + fstep - 1) / fstep : 0;
    auto issue = [=](int i) {
        const int f = f0 + i * fstep, q = f / F;
        const u8* G = reinterpret_cast<const u8*>(gate_ptr[j0 + q]);
        const u8* U = reinterpret_cast<const u8*>(up_ptr[j0 + q]);
        const long long off = (long long)(f - q * F) * rb;
        moe_issue_rows(2, rb, stride, ring + (i % nstage) * 2 * stride, lane, nl,
                       [=](int k, const u8*& s, const u8*& end) { s = (k ? U : G) + off; end = (k ? U : G) + mbytes; });
    };
    // the first nstage items' copies go out before x is staged (they do not need it): the two overlap
    for (int i = 0; i < nstage; ++i) {
        if (i < nit) issue(i);
        cp_async_commit();
    }
    if constexpr (I8) mi8_stage(X + (long long)t * H, H, smem, H, nullptr, 1);
    else moe_stage_x<TG>(X + (long long)t * H, H, xs);
    __syncthreads();
    for (int i = 0; i < nit; ++i) {
        moe_cp_wait_ring(nstage);  // item i landed (items i+1 .. i+nstage-1 may be in flight)
        __syncwarp();
        const int f = f0 + i * fstep, q = f / F, r = f - q * F;
        const long long off = (long long)r * rb;
        const u8* slot = ring + (i % nstage) * 2 * stride;
        const u8* gp = slot + ((gate_ptr[j0 + q] + (u64)off) & 15);
        const u8* up = slot + stride + ((up_ptr[j0 + q] + (u64)off) & 15);
        // Units are dealt to 32 lanes (in the host build one thread plays the 32 in turn): lane v takes u = v + 32 m,
        // so its place in a block (v mod upb) and the alignment of its scale and codes are the same for every m (a
        // step is 32 / upb blocks: 144 bytes for Q2_0, 544 for Q8_0, multiples of 4); word pointers and funnel shifts
        // are set once per row and advance by a constant.
        float ga = 0.0f, ua = 0.0f;
        for (int v = lane; v < 32; v += nl) {
            const int s = v % upb, b0 = v / upb;
            u32 gss, gcs, uss, ucs;
            const u32* gsw = moe_words(gp + b0 * ts, gss);
            const u32* gcw = moe_words(gp + b0 * ts + 2 + MoeUnit<TG>::cb * s, gcs);
            const u32* usw = moe_words(up + b0 * ts, uss);
            const u32* ucw = moe_words(up + b0 * ts + 2 + MoeUnit<TG>::cb * s, ucs);
            for (int u = v; u < units; u += 32) {
                if constexpr (I8) {
                    const uint4 hh = reinterpret_cast<const uint4*>(smem)[u];
                    const uint4 ll = reinterpret_cast<const uint4*>(smem + H)[u];
                    const float sb = reinterpret_cast<const float*>(smem + mi8_sc(H))[u >> 1];
                    const int su = reinterpret_cast<const int*>(smem + mi8_sum(H))[u];
                    const float dg = moe_h2f(MOE_FUNNEL(gsw[0], gsw[1], gss));
                    const float du = moe_h2f(MOE_FUNNEL(usw[0], usw[1], uss));
                    const int ig = mi8_dot(MOE_FUNNEL(gcw[0], gcw[1], gcs), hh, ll) - su;
                    const int iu = mi8_dot(MOE_FUNNEL(ucw[0], ucw[1], ucs), hh, ll) - su;
                    ga = fmaf(dg * sb, (float)ig, ga);
                    ua = fmaf(du * sb, (float)iu, ua);
                } else {
                    float xv[16];
                    moe_load_x16(xs, units, u, xv);
                    ga += dot16w<TG>(gsw, gss, gcw, gcs, xv);
                    ua += dot16w<TG>(usw, uss, ucw, ucs, xv);
                }
                gsw += wstep; gcw += wstep; usw += wstep; ucw += wstep;
            }
        }
        ga = warp_sum(ga);
        ua = warp_sum(ua);
        if (lane == 0) Hbuf[(long long)(j0 + q) * F + r] = ga / (1.0f + expf(-ga)) * ua;
        __syncwarp();  // slot i % nstage is free again: item i + nstage goes there
        if (i + nstage < nit) issue(i + nstage);
        cp_async_commit();
    }
}
template <int TG> __global__ void __launch_bounds__(256) moe_gate_up_pipe(
        const u64* __restrict__ gate_ptr, const u64* __restrict__ up_ptr, const int* __restrict__ tstart,
        const float* __restrict__ X, float* __restrict__ Hbuf, int H, int F, int nstage) {
    PDL_ENTRY();
    moe_gate_up_pipe_body<TG, false>(gate_ptr, up_ptr, tstart, X, Hbuf, H, F, nstage);
}
template <int TG> __global__ void __launch_bounds__(256) moe_gate_up_pipe_i8(
        const u64* __restrict__ gate_ptr, const u64* __restrict__ up_ptr, const int* __restrict__ tstart,
        const float* __restrict__ X, float* __restrict__ Hbuf, int H, int F, int nstage) {
    PDL_ENTRY();
    static_assert(TG == 42, "the integer expert kernels decode Q2_0");
    moe_gate_up_pipe_body<TG, true>(gate_ptr, up_ptr, tstart, X, Hbuf, H, F, nstage);
}

// Y[t, r] (+)= sum over token t's jobs j of w[j] (down_j[r] . Hbuf[j]) for t = blockIdx.y; a warp's items are the
// output rows r = blockIdx.x * warps + warp + i * gridDim.x * warps, each staged (the row r of every job's down
// matrix) into a slot of its ring of nstage slots. The block first stages the token's Hbuf rows (interleaved over the
// (job, unit) pairs p = q * F / 16 + u, pre-scaled for Q2_0), its weights and its down addresses. Shared memory
// (experts.pipe_down_shared): max_jobs F floats + 16 ceil(max_jobs / 4) bytes (w) + 16 ceil(max_jobs / 2) bytes
// (addresses) + warps * nstage * max_jobs * stride bytes + MOE_PIPE_PAD, stride = ((rb + 30) / 16) * 16,
// rb = F / bs * ts. A token with more than max_jobs jobs gets NaN rows. With I8 (moe_down_pipe_i8, Q2_0) the h rows
// are staged quantized (mi8_stage over the layout of max_jobs F values, each job's weight folded into its blocks'
// scales: mi8_end(max_jobs F) bytes in place of the floats and the weights) and a unit's sum is integer (mi8_dot).
template <int TD, bool I8> __device__ __forceinline__ void moe_down_pipe_body(
        const u64* __restrict__ down_ptr, const float* __restrict__ w, const int* __restrict__ tstart,
        const float* __restrict__ Hbuf, float* __restrict__ Y, int H, int F, int accumulate, int nstage,
        int max_jobs) {
    MOE_DYN_SHARED(smem);
    const int t = blockIdx.y;
    const int j0 = tstart[t], nj = tstart[t + 1] - j0;
    if (nj > max_jobs) {  // the launch's bound broken: NaN rows rather than writes past the shared buffers
        for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < H; r += gridDim.x * blockDim.x)
            Y[(long long)t * H + r] = __uint_as_float(0x7fc00000u);
        return;
    }
    const int np = nj * (F / 16);  // (job, unit) pairs
    const int n = max_jobs * F;  // (the layout's size; the token's nj * F values are staged)
    float* hs = reinterpret_cast<float*>(smem);
    float* ws = hs + (long long)n;
    u64* ps = I8 ? reinterpret_cast<u64*>(smem + mi8_end(n)) : reinterpret_cast<u64*>(ws + 4 * ((max_jobs + 3) / 4));
    u8* rings = reinterpret_cast<u8*>(ps + 2 * ((max_jobs + 1) / 2));
    constexpr int nl = MOE_PIPE_LANES;
    const int warps = blockDim.x / nl;
    const int warp = threadIdx.x / nl, lane = threadIdx.x % nl;
    const int bs = Unit<TD>::bs, ts = Unit<TD>::ts, upb = bs / 16, fu = F / 16;
    const int rb = (F / bs) * ts;
    const int stride = ((rb + 30) / 16) * 16;
    const long long sbytes = (long long)nj * stride;
    u8* ring = rings + (long long)warp * nstage * max_jobs * stride;
    const long long mbytes = (long long)H * rb;
    const int r0 = blockIdx.x * warps + warp, rstep = gridDim.x * warps;
    const int nit = r0 < H ? (H - r0 + rstep - 1) / rstep : 0;
    const u64* dp = down_ptr + j0;  // (read from global memory: ps is not staged yet)
    auto issue = [=](int i) {
        const long long off = (long long)(r0 + i * rstep) * rb;
        moe_issue_rows(nj, rb, stride, ring + (i % nstage) * sbytes, lane, nl, [=](int q, const u8*& s, const u8*& end) {
            const u8* D = reinterpret_cast<const u8*>(dp[q]);
            s = D + off;
            end = D + mbytes;
        });
    };
    // the first nstage items' copies go out before h is staged (they do not need it): the two overlap
    for (int i = 0; i < nstage; ++i) {
        if (i < nit) issue(i);
        cp_async_commit();
    }
    if constexpr (I8) mi8_stage(Hbuf + (long long)j0 * F, nj * F, smem, n, w + j0, F >> 5);
    else moe_stage_x<TD>(Hbuf + (long long)j0 * F, nj * F, hs);
    for (int q = threadIdx.x; q < nj; q += blockDim.x) {
        if constexpr (!I8) ws[q] = w[j0 + q];
        ps[q] = dp[q];
    }
    __syncthreads();
    for (int i = 0; i < nit; ++i) {
        moe_cp_wait_ring(nstage);  // item i landed (items i+1 .. i+nstage-1 may be in flight)
        __syncwarp();
        const int r = r0 + i * rstep;
        const long long off = (long long)r * rb;
        const u8* slot = ring + (i % nstage) * sbytes;
        float acc = 0.0f;
        int q = 0, u = lane;
        while (u >= fu) { u -= fu; ++q; }
        for (int p = lane; p < np; p += nl) {
            const int blk = u / upb, s = u - blk * upb;
            const u8* rp = slot + (long long)q * stride + ((ps[q] + (u64)off) & 15) + blk * ts;
            if constexpr (I8) {
                u32 ssh, csh;
                const u32* sw = moe_words(rp, ssh);
                const u32* cw = moe_words(rp + 2 + 4 * s, csh);
                const float dd = moe_h2f(MOE_FUNNEL(sw[0], sw[1], ssh));
                const int iv = mi8_dot(MOE_FUNNEL(cw[0], cw[1], csh), reinterpret_cast<const uint4*>(smem)[p],
                                       reinterpret_cast<const uint4*>(smem + n)[p])
                               - reinterpret_cast<const int*>(smem + mi8_sum(n))[p];
                acc = fmaf(dd * reinterpret_cast<const float*>(smem + mi8_sc(n))[p >> 1], (float)iv, acc);
            } else {
                float xv[16];
                moe_load_x16(hs, np, p, xv);
                acc = fmaf(ws[q], dot16p<TD>(rp, s, xv), acc);
            }
            u += nl;
            while (u >= fu) { u -= fu; ++q; }
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            const long long o = (long long)t * H + r;
            Y[o] = accumulate ? Y[o] + acc : acc;
        }
        __syncwarp();  // slot i % nstage is free again: item i + nstage goes there
        if (i + nstage < nit) issue(i + nstage);
        cp_async_commit();
    }
}
template <int TD> __global__ void __launch_bounds__(256, 4) moe_down_pipe(
        const u64* __restrict__ down_ptr, const float* __restrict__ w, const int* __restrict__ tstart,
        const float* __restrict__ Hbuf, float* __restrict__ Y, int H, int F, int accumulate, int nstage,
        int max_jobs) {
    PDL_ENTRY();
    moe_down_pipe_body<TD, false>(down_ptr, w, tstart, Hbuf, Y, H, F, accumulate, nstage, max_jobs);
}
template <int TD> __global__ void __launch_bounds__(256, 4) moe_down_pipe_i8(
        const u64* __restrict__ down_ptr, const float* __restrict__ w, const int* __restrict__ tstart,
        const float* __restrict__ Hbuf, float* __restrict__ Y, int H, int F, int accumulate, int nstage,
        int max_jobs) {
    PDL_ENTRY();
    static_assert(TD == 42, "the integer expert kernels decode Q2_0");
    moe_down_pipe_body<TD, true>(down_ptr, w, tstart, Hbuf, Y, H, F, accumulate, nstage, max_jobs);
}
