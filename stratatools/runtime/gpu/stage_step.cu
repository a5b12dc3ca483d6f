// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by decode.py (cupy.RawModule, NVRTC);
// tests/test_gpu_stage_step_host.py compiles it as host C++ (host_kernel_shim.cuh: one thread per block) and checks it
// bit for bit against Qwen4ExpRuntime.ple_ngram_ids and stratatools.runtime.dequant.
//
// stage_step: a batch-1 decode step's token-dependent inputs written on the device (StaticDecoder._stage_from_device,
// issue 17: queued decode steps), so that step t+1 can be queued behind step t without the host reading the token.
// One block, any block size. For the token t = tok[0]:
//  * inp[x_off, x_off + n_embd): row t of the token table (tok_tab, rows of tok_row_bytes bytes of ggml type tok_type),
//    dequantized;
//  * for PLE layer li < n_pl: the hashed n-gram row ids of t after the context ctx_li (keep = ngram - 1 ids: the
//    decoder's context after li updates, i.e. the last keep ids of ctx ++ [t] * li, as StaticDecoder._stage advances
//    its context inside the loop over the PLE layers), head j of nh = keep * hpn heads: history h = ctx_li ++ [t];
//    for shift s the id keep - s back is used unless an EOS lies at or after it before t (then eos: segment reset);
//    n-gram n = j / hpn + 2 mixes XOR_{s<n} h_s * mult[s] (int64, wrapping); row = (mixed mod vocab[j], made
//    non-negative as numpy's remainder) + hoff[j]. The nh rows (each ple_ne0 values of ple_tab, dequantized) go to
//    inp[poff[li], poff[li] + nh * ple_ne0) head after head (Qwen4ExpRuntime.ple_ngram_ids for one token);
//  * ctx <- the last keep ids of ctx ++ [t] * n_pl (the context the next step starts from).
// prm holds the int64 constants [mult (ngram) | vocab (nh) | hoff (nh) | poff (n_pl)]. A token outside
// [0, tok_rows) or a PLE row outside [0, ple_rows) writes quiet NaNs in its place and sets bit 1 / bit 2 of *err
// (sticky; err may be null). The launcher (StaticDecoder.device_stage_ready) keeps ngram <= SS_MAX_NGRAM,
// n_pl * nh <= SS_MAX_ROWS, vocab > 0 and every offset + vocab within the table, so only a bad token can set err.
//
// Table types (ggml ids): 0 F32, 1 F16, 30 BF16, 8 Q8_0 (block: fp16 d, 32 int8 codes; value float32(d) * code,
// one float32 multiply, as gguf.quants). fp16 is widened by integer arithmetic (payloads of NaNs kept, as numpy's
// float16 -> float32 conversion), so every written float equals the numpy dequantization bit for bit (on the device
// a NaN *product* of Q8_0, from a NaN or infinite scale, is the canonical NaN instead of x86's).

#ifdef STRATA_HOST
static inline void ss_flag(int* p, int v) { *p |= v; }
#else
__device__ __forceinline__ void ss_flag(int* p, int v) { atomicOr(p, v); }
#endif

#define SS_MAX_NGRAM 8
#define SS_MAX_ROWS 512

__device__ __forceinline__ unsigned ss_u16(const unsigned char* p) {
    return (unsigned)p[0] | ((unsigned)p[1] << 8);
}

// fp16 bits -> float32, exact (subnormals, infinities, NaN payloads as numpy widens them)
__device__ __forceinline__ float ss_half(unsigned h) {
    const unsigned s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(s | 0x7f800000u | (m << 13));
    if (e != 0u) return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
    const float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24: exact (m < 2^10)
    return __uint_as_float(__float_as_uint(v) | s);
}

// value k of a row of ggml type `type` (0 F32, 1 F16, 30 BF16, 8 Q8_0); other types: 0 (the launcher refuses them)
__device__ __forceinline__ float ss_value(const unsigned char* row, int type, long long k) {
    switch (type) {
        case 0: {
            const unsigned char* p = row + 4 * k;
            return __uint_as_float((unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) |
                                   ((unsigned)p[3] << 24));
        }
        case 1: return ss_half(ss_u16(row + 2 * k));
        case 30: return __uint_as_float(ss_u16(row + 2 * k) << 16);
        case 8: {
            const unsigned char* b = row + (k >> 5) * 34;
            const float d = ss_half(ss_u16(b));
            return d * (float)(signed char)b[2 + (k & 31)];
        }
        default: return 0.f;
    }
}

// One sequence's staging (stage_step's contract, above), by every thread of the block (it holds a barrier): token t,
// its context ctx (keep ids), x0 at inp[x_off ..), PLE layer li's rows at inp[pbase + poff[li] ..).
__device__ __forceinline__ void ss_stage_one(long long t, long long* __restrict__ ctx, float* __restrict__ inp,
                                             long long x_off, const unsigned char* __restrict__ tok_tab, int tok_type,
                                             long long tok_rows, long long tok_row_bytes, int n_embd,
                                             long long pbase, const unsigned char* __restrict__ ple_tab, int ple_type,
                                             long long ple_rows, long long ple_row_bytes, int ple_ne0,
                                             const long long* __restrict__ prm, int n_pl, int ngram, int hpn,
                                             long long eos, int* __restrict__ err, long long* s_rows) {
    const int tid = threadIdx.x, nt = blockDim.x;
    const float qnan = __uint_as_float(0x7fc00000u);
    const int keep = ngram > 1 ? ngram - 1 : 0;
    const int nh = keep * hpn;
    const long long* mult = prm;
    const long long* vocab = prm + ngram;
    const long long* hoff = vocab + nh;
    const long long* poff = hoff + nh;
    long long h0[SS_MAX_NGRAM];  // the incoming context, read by every thread before thread 0 rewrites it
    for (int i = 0; i < keep; ++i) h0[i] = ctx[i];
    // the token's embedding row
    const bool tok_ok = t >= 0 && t < tok_rows;
    if (!tok_ok && tid == 0 && err != nullptr) ss_flag(err, 1);
    const unsigned char* trow = tok_tab + (tok_ok ? t : 0) * tok_row_bytes;
    // (unrolled: a thread's loads of several values in flight at once; one at a time, the batched kernel took
    // 16.6 us at 32 places of 2,560 + 4 x 640 values, H200)
    #pragma unroll 4
    for (int c = tid; c < n_embd; c += nt) inp[x_off + c] = tok_ok ? ss_value(trow, tok_type, c) : qnan;
    // the PLE rows' ids, layer li and head j at q = li * nh + j
    for (int q = tid; q < n_pl * nh; q += nt) {
        const int li = q / nh, j = q % nh;
        long long h[SS_MAX_NGRAM];  // the context after li updates, then t
        for (int i = 0; i < keep; ++i) h[i] = i + li < keep ? h0[i + li] : t;
        h[keep] = t;
        int prev = -1;  // the last EOS before t
        for (int i = 0; i < keep; ++i)
            if (h[i] == eos) prev = i;
        const int n = j / hpn + 2;
        unsigned long long mixed = 0ull;
        for (int s = 0; s < n; ++s) {
            const int src = keep - s;
            const long long v = src > prev ? h[src] : eos;
            mixed ^= (unsigned long long)v * (unsigned long long)mult[s];  // int64 multiply, wrapping
        }
        long long r = (long long)mixed % vocab[j];
        if (r < 0) r += vocab[j];
        s_rows[q] = r + hoff[j];
    }
    __syncthreads();
    // the PLE rows: value c of row q = li nh + j (32-bit index arithmetic: the launcher keeps n_pl nh <= 512 rows
    // of ple_ne0 values, fewer than 2^31 in all)
    const int nrow = n_pl * nh;
    const int tot = nrow * ple_ne0;
    #pragma unroll 4
    for (int q = tid; q < tot; q += nt) {
        const int rq = q / ple_ne0, c = q - rq * ple_ne0;
        const int li = rq / nh, j = rq - li * nh;
        const long long row = s_rows[rq];
        const bool ok = row >= 0 && row < ple_rows;
        if (!ok && err != nullptr) ss_flag(err, 2);
        inp[pbase + poff[li] + (long long)j * ple_ne0 + c] =
            ok ? ss_value(ple_tab + row * ple_row_bytes, ple_type, c) : qnan;
    }
    // the next step's context (every thread read h0 before the barrier above)
    if (tid == 0)
        for (int i = 0; i < keep; ++i) ctx[i] = i + n_pl < keep ? h0[i + n_pl] : t;
}

extern "C" __global__ void stage_step(const long long* __restrict__ tok, long long* __restrict__ ctx,
                                      float* __restrict__ inp, const unsigned char* __restrict__ tok_tab, int tok_type,
                                      long long tok_rows, long long tok_row_bytes, int x_off, int n_embd,
                                      const unsigned char* __restrict__ ple_tab, int ple_type, long long ple_rows,
                                      long long ple_row_bytes, int ple_ne0, const long long* __restrict__ prm,
                                      int n_pl, int ngram, int hpn, long long eos, int* __restrict__ err) {
    __shared__ long long s_rows[SS_MAX_ROWS];
    if (blockIdx.x != 0) return;
    ss_stage_one(tok[0], ctx, inp, x_off, tok_tab, tok_type, tok_rows, tok_row_bytes, n_embd, 0, ple_tab, ple_type,
                 ple_rows, ple_row_bytes, ple_ne0, prm, n_pl, ngram, hpn, eos, err, s_rows);
}

// stage_steps: the batched decode step's inputs for N places (BatchDecoder, queued steps), a block a place b (grid N):
// stage_step's work for token tok[b] and context ctx[b * ctx_ld ..] (keep ids), x0 of place b at
// inp[x_off + b * x_ld ..), its PLE rows at inp[b * p_ld + poff[li] ..) (poff in prm as for stage_step), and its rope
// row: cos / sin [n_rot] at inp[cos_off + b * n_rot ..) / inp[sin_off + b * n_rot ..) copied from row pos[b] of the
// tables rope_cos / rope_sin [max_ctx, n_rot] (Rope.cos_sin_host of every position, so bit for bit the host's); a
// position outside [0, max_ctx) writes quiet NaNs there and sets bit 4 of *err.
extern "C" __global__ void stage_steps(const long long* __restrict__ tok, long long* __restrict__ ctx, int ctx_ld,
                                       const int* __restrict__ pos, const float* __restrict__ rope_cos,
                                       const float* __restrict__ rope_sin, int max_ctx, int n_rot, long long cos_off,
                                       long long sin_off, float* __restrict__ inp, long long x_off, long long x_ld,
                                       const unsigned char* __restrict__ tok_tab, int tok_type, long long tok_rows,
                                       long long tok_row_bytes, int n_embd, long long p_ld,
                                       const unsigned char* __restrict__ ple_tab, int ple_type, long long ple_rows,
                                       long long ple_row_bytes, int ple_ne0, const long long* __restrict__ prm,
                                       int n_pl, int ngram, int hpn, long long eos, int* __restrict__ err) {
    __shared__ long long s_rows[SS_MAX_ROWS];
    const int b = blockIdx.x;
    const int p = pos[b];
    const bool pos_ok = p >= 0 && p < max_ctx;
    if (!pos_ok && threadIdx.x == 0 && err != nullptr) ss_flag(err, 4);
    const float qnan = __uint_as_float(0x7fc00000u);
    for (int i = threadIdx.x; i < n_rot; i += blockDim.x) {
        inp[cos_off + (long long)b * n_rot + i] = pos_ok ? rope_cos[(long long)p * n_rot + i] : qnan;
        inp[sin_off + (long long)b * n_rot + i] = pos_ok ? rope_sin[(long long)p * n_rot + i] : qnan;
    }
    ss_stage_one(tok[b], ctx + (long long)b * ctx_ld, inp, x_off + (long long)b * x_ld, tok_tab, tok_type, tok_rows,
                 tok_row_bytes, n_embd, (long long)b * p_ld, ple_tab, ple_type, ple_rows, ple_row_bytes, ple_ne0, prm,
                 n_pl, ngram, hpn, eos, err, s_rows);
}
