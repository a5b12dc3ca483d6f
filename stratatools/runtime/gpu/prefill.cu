// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by prefill.py and compiled with NVRTC
// (cupy.RawModule, multiply-add fusion allowed: the batched prefill agrees with the decode step by tolerance);
// tests/test_gpu_prefill_host.py compiles it as host C++ (host_kernel_shim.cuh: one thread per block, blocks run one
// after another) and checks every kernel against numpy.
// Kernels of the batched prompt prefill (prefill.py ChunkPrefill): the router of T tokens at once, the gated-DeltaNet
// recurrence over a chunk of tokens with the state resident in shared memory, and the dequantization of several
// expert blobs (addressed through a pointer table: VRAM slots or mapped pinned host memory) into float32 matrices.
//
// Every kernel is written for any block size (threads stride over their items; reductions through shared memory
// trees that a block of one thread skips), so the host build, which runs blocks of one thread, executes the same code.
// Needs prelude.cuh, the tables and decoders.cuh before it (dequant_blobs decodes with deq8).

#include "pdl.cuh"  // PDL_ENTRY: every kernel begins with it (launch.py BATCH_PDL_KERNELS)

#ifdef STRATA_HOST
#define PF_DYN_SHARED(T, name) T* name = reinterpret_cast<T*>(host_dyn_smem)
#else
#define PF_DYN_SHARED(T, name) extern __shared__ __align__(16) unsigned char pf_smem_[]; T* name = reinterpret_cast<T*>(pf_smem_)
#endif
#define PF_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float pf_sigm(float a) { return 1.0f / (1.0f + expf(-a)); }

// Block-wide reduction through a shared array of blockDim floats (blockDim a power of two); every thread gets
// the result. is_max: max, else sum.
__device__ float pf_reduce(float v, bool is_max, float* sh) {
    const int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (t < s) sh[t] = is_max ? fmaxf(sh[t], sh[t + s]) : sh[t] + sh[t + s];
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// ---- router of T tokens: one block per token t = blockIdx.x (grid-stride over tokens) -----------------------------
// logits row t at logits + t * ld (ld >= E; the shared expert's gate logit may follow the E router logits).
// Probabilities: sigmoid (sigmoid_gating) or softmax over the E logits; then k rounds of arg-max (ties to the lower
// expert index, what the CPU path's stable descending sort selects); weights: the chosen probabilities, divided by
// their sum when norm, times scale. Writes ids[t * k + r], w[t * k + r]. blockDim a power of two.
// Shared: E + 2 blockDim floats.
extern "C" __global__ void pf_route(const float* __restrict__ logits, int T, int ld, int E, int k, int sigmoid_gating,
                                    int norm, float scale, int* __restrict__ ids, float* __restrict__ w) {
    PDL_ENTRY();
    PF_DYN_SHARED(float, sh);
    float* p = sh;
    float* rv = sh + E;
    int* ri = reinterpret_cast<int*>(rv + blockDim.x);
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const float* lg = logits + (long long)t * ld;
        if (sigmoid_gating) {
            for (int i = tid; i < E; i += nt) p[i] = pf_sigm(lg[i]);
        } else {
            float m = PF_NEG_INF;
            for (int i = tid; i < E; i += nt) m = fmaxf(m, lg[i]);
            m = pf_reduce(m, true, rv);
            float s = 0.0f;
            for (int i = tid; i < E; i += nt) { float e = expf(lg[i] - m); p[i] = e; s += e; }
            s = pf_reduce(s, false, rv);
            for (int i = tid; i < E; i += nt) p[i] = p[i] / s;
        }
        __syncthreads();
        float tot = 0.0f;
        for (int r = 0; r < k; ++r) {
            float bv = PF_NEG_INF; int bi = 0x7fffffff;
            for (int i = tid; i < E; i += nt) {
                float v = p[i];
                if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
            }
            rv[tid] = bv; ri[tid] = bi;
            __syncthreads();
            for (int s = nt >> 1; s > 0; s >>= 1) {
                if (tid < s) {
                    float ov = rv[tid + s]; int oi = ri[tid + s];
                    if (ov > rv[tid] || (ov == rv[tid] && oi < ri[tid])) { rv[tid] = ov; ri[tid] = oi; }
                }
                __syncthreads();
            }
            int ii = ri[0];
            if (ii < 0 || ii >= E) ii = 0;  // only if every value is NaN
            const float val = p[ii];
            tot += val;
            __syncthreads();
            if (tid == 0) {
                ids[(long long)t * k + r] = ii;
                w[(long long)t * k + r] = val;
                p[ii] = PF_NEG_INF;
            }
            __syncthreads();
        }
        if (tid == 0) {
            for (int r = 0; r < k; ++r) {
                long long o = (long long)t * k + r;
                w[o] = (norm ? w[o] / tot : w[o]) * scale;
            }
        }
        __syncthreads();
    }
}

// pf_route's contract with one warp a token (E <= 32 PF_RW_VPL; STRATATOOLS_ROUTE_WARP): a lane holds the
// probabilities i = lane + 32 j in registers, each of the k rounds takes the lane's best (the same predicate as
// pf_route: larger, ties to the lower index; NaN never wins) and the warp's by five shuffles, with no barrier
// (pf_route's block takes a tree of 7 barriers a round: 13.5 us a launch for 32 tokens x 256 experts, H200,
// bench/gpu-notes.md). The softmax's sum is added in another order than pf_route's (the same values to float
// rounding: two probabilities an ulp apart may tie after one kernel's division and not after the other's, so a
// softmax router may order them differently; the sigmoid gating divides by nothing and picks as pf_route does).
// Grid: ceil(T / warps a block), the host build: T blocks of one thread (which holds every value).
#ifdef STRATA_HOST
#define PF_RW_LANES 1
#define PF_RW_VPL 512
#else
#define PF_RW_LANES 32
#define PF_RW_VPL 8
#endif
extern "C" __global__ void pf_route_warp(const float* __restrict__ logits, int T, int ld, int E, int k,
                                         int sigmoid_gating, int norm, float scale, int* __restrict__ ids,
                                         float* __restrict__ w) {
    PDL_ENTRY();
    const int lane = (int)threadIdx.x % PF_RW_LANES, wpb = (int)blockDim.x / PF_RW_LANES;
    const int t = (int)blockIdx.x * wpb + (int)threadIdx.x / PF_RW_LANES;
    if (t >= T || E > PF_RW_LANES * PF_RW_VPL) return;  // (a whole warp: t is the warp's)
    const float* lg = logits + (long long)t * ld;
    float v[PF_RW_VPL];
    if (sigmoid_gating) {
        #pragma unroll
        for (int j = 0; j < PF_RW_VPL; ++j) {
            const int i = lane + PF_RW_LANES * j;
            v[j] = i < E ? pf_sigm(lg[i]) : PF_NEG_INF;
        }
    } else {
        float m = PF_NEG_INF;
        #pragma unroll
        for (int j = 0; j < PF_RW_VPL; ++j) {
            const int i = lane + PF_RW_LANES * j;
            v[j] = i < E ? lg[i] : PF_NEG_INF;
            m = fmaxf(m, v[j]);
        }
        for (int o = PF_RW_LANES / 2; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float sm = 0.0f;
        #pragma unroll
        for (int j = 0; j < PF_RW_VPL; ++j) {
            const int i = lane + PF_RW_LANES * j;
            if (i < E) {
                v[j] = expf(v[j] - m);
                sm += v[j];
            }
        }
        for (int o = PF_RW_LANES / 2; o; o >>= 1) sm += __shfl_xor_sync(0xffffffffu, sm, o);
        #pragma unroll
        for (int j = 0; j < PF_RW_VPL; ++j)
            if (lane + PF_RW_LANES * j < E) v[j] = v[j] / sm;
    }
    // k <= the warp's lanes: lane r keeps round r's pick and writes it once the total is known (lane 0 writing each
    // round's and reading them back for the weights' division waited on each store: about 2 us of the 7.2 a launch,
    // H200 twenty-fourth pass); more rounds (and the host build's one lane): lane 0 writes them as they come
    const bool held = k <= PF_RW_LANES;
    float tot = 0.0f, mine = 0.0f;
    int mine_i = 0;
    for (int r = 0; r < k; ++r) {
        float bv = PF_NEG_INF;
        int bi = 0x7fffffff;
        #pragma unroll
        for (int j = 0; j < PF_RW_VPL; ++j) {
            const int i = lane + PF_RW_LANES * j;
            if (i < E && (v[j] > bv || (v[j] == bv && i < bi))) { bv = v[j]; bi = i; }
        }
        for (int o = PF_RW_LANES / 2; o; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        int ii = bi;
        float val = bv;
        if (ii < 0 || ii >= E) {  // only if every value is NaN: pf_route's p[0]
            ii = 0;
            val = __shfl_sync(0xffffffffu, v[0], 0);
        }
        tot += val;
        #pragma unroll
        for (int j = 0; j < PF_RW_VPL; ++j)
            if (lane + PF_RW_LANES * j == ii) v[j] = PF_NEG_INF;
        if (held) {
            if (lane == r) { mine = val; mine_i = ii; }
        } else if (lane == 0) {
            ids[(long long)t * k + r] = ii;
            w[(long long)t * k + r] = val;
        }
    }
    if (held) {
        if (lane < k) {
            ids[(long long)t * k + lane] = mine_i;
            w[(long long)t * k + lane] = (norm ? mine / tot : mine) * scale;
        }
    } else if (lane == 0) {
        for (int r = 0; r < k; ++r) {
            const long long o = (long long)t * k + r;
            w[o] = (norm ? w[o] / tot : w[o]) * scale;
        }
    }
}

// ---- the routed experts' outputs of a token, weighted -----------------------------------------------------------
// y[t, c] = w[t, 0] ya[t k, c] + w[t, 1] ya[t k + 1, c] + ... (k terms, summed in rank order from 0, every product
// rounded before its sum: no multiply-add fusion, as the array code's multiply then sum). ya: [T k, n] (each pair's
// unweighted output row), w: [T, k], y: [T, n]. Grid stride over the T n outputs (one pass over ya; the array code's
// product and sum over the rank axis took two, the sum strided).
// SHARED: plus sigmoid(g[t ldg + goff]) ys[t, c] (pf_moe_sum_shared).
template <bool SHARED>
__device__ __forceinline__ void pf_moe_sum_rows(const float* __restrict__ ya, const float* __restrict__ w, int T, int k,
                                                int n, const float* __restrict__ ys, const float* __restrict__ g,
                                                int ldg, int goff, float* __restrict__ y) {
    const long long total = (long long)T * n;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / n;
        const long long c = i - t * n;
        float acc = 0.0f;
        for (int r = 0; r < k; ++r) acc = __fadd_rn(acc, __fmul_rn(w[t * k + r], ya[(t * k + r) * n + c]));
        if (SHARED) {
            const float sg = 1.0f / (1.0f + expf(-g[t * ldg + goff]));
            acc = __fadd_rn(acc, __fmul_rn(sg, ys[i]));
        }
        y[i] = acc;
    }
}

extern "C" __global__ void pf_moe_sum(const float* __restrict__ ya, const float* __restrict__ w, int T, int k, int n,
                                      float* __restrict__ y) {
    PDL_ENTRY();
    pf_moe_sum_rows<false>(ya, w, T, k, n, nullptr, nullptr, 0, 0, y);
}

// pf_moe_sum with the shared expert's output added: y[t, c] = (the k weighted routed rows, as pf_moe_sum) +
// sigmoid(g[t ldg + goff]) ys[t, c] (the gate rounded, then its product, then the sum: the array code's y + sg ys).
// The one launch replaces pf_moe_sum and the gate's sigmoid, product and sum (prefill.py _moe_sum).
extern "C" __global__ void pf_moe_sum_shared(const float* __restrict__ ya, const float* __restrict__ w, int T, int k,
                                             int n, const float* __restrict__ ys, const float* __restrict__ g,
                                             int ldg, int goff, float* __restrict__ y) {
    PDL_ENTRY();
    pf_moe_sum_rows<true>(ya, w, T, k, n, ys, g, ldg, goff, y);
}

// ---- gated DeltaNet recurrence over a chunk of T tokens ----------------------------------------------------------
// q, kk: [T, nk, dk] (L2-normalised; q scaled by dk^-1/2); v: [T, ldv] with value head j at v + j dv; beta, decay:
// [T, nv]. Value head j = blockIdx.x uses key group j % nk. Block (j, b) owns columns [b cw, (b+1) cw) of head j
// (cw = ceil(dv / gridDim.y)); its part of the state S[j] ([dk, dv] row-major) is held in shared memory for the
// whole chunk and written back at the end. For each token t in order (the decode step's gdn_recur arithmetic):
// S <- decay S + k (x) delta, delta = (v - k^T (decay S)) beta; o[t, j dv + c] = sum_r q[r] S[r, c] (before the norm).
// Token t+1's inputs (q, k, the block's v columns, decay, beta) are loaded into registers while token t is computed
// and stored into the other half of double-buffered shared arrays after it (up to PF_GDN_PER values a thread; any
// further ones are read then), so the token loop does not wait on global memory.
// Shared (gdn_chunk_shared in prefill.py): (dk cw + 4 dk + (rs + 3) cw + 4) floats, rs = max(1, blockDim / cw).
#ifndef PF_GDN_PER
#define PF_GDN_PER 4
#endif
extern "C" __global__ void pf_gdn_chunk(const float* __restrict__ q, const float* __restrict__ kk,
                                        const float* __restrict__ v, int ldv, const float* __restrict__ beta,
                                        const float* __restrict__ decay, float* __restrict__ S,
                                        float* __restrict__ out, int T, int nk, int nv, int dk, int dv) {
    PDL_ENTRY();
    PF_DYN_SHARED(float, sh);
    const int j = blockIdx.x, g = j % nk, tid = threadIdx.x, nt = blockDim.x;
    const int ncb = gridDim.y, cw = (dv + ncb - 1) / ncb, c0 = blockIdx.y * cw;
    const int nc = dv - c0 < cw ? dv - c0 : cw;
    if (nc <= 0) return;
    const int rs = nt / nc > 1 ? nt / nc : 1;
    float* Ss = sh;                // [dk, cw]
    float* qs = Ss + dk * cw;      // [2, dk]
    float* ks = qs + 2 * dk;       // [2, dk]
    float* vs = ks + 2 * dk;       // [2, cw]
    float* dl = vs + 2 * cw;       // [cw]
    float* part = dl + cw;         // [rs, cw]
    float* sc = part + rs * cw;    // [2, 2]: decay, beta
    float* Sj = S + (long long)j * dk * dv;
    for (int idx = tid; idx < dk * nc; idx += nt) {
        int r = idx / nc, cl = idx - r * nc;
        Ss[r * cw + cl] = Sj[(long long)r * dv + c0 + cl];
    }
    // token 0's inputs into half 0
    for (int r = tid; r < dk; r += nt) { qs[r] = q[(long long)g * dk + r]; ks[r] = kk[(long long)g * dk + r]; }
    for (int cl = tid; cl < nc; cl += nt) vs[cl] = v[(long long)j * dv + c0 + cl];
    if (tid == 0) { sc[0] = decay[j]; sc[1] = beta[j]; }
    __syncthreads();
    for (int t = 0; t < T; ++t) {
        const int h = t & 1, hn = h ^ 1;
        const bool more = t + 1 < T;
        const float* qn = q + ((long long)(t + 1) * nk + g) * dk;
        const float* kn = kk + ((long long)(t + 1) * nk + g) * dk;
        const float* vn = v + (long long)(t + 1) * ldv + (long long)j * dv + c0;
        float pq[PF_GDN_PER], pk[PF_GDN_PER], pv[PF_GDN_PER], pd = 0.0f, pb = 0.0f;
        if (more) {  // issued now, used after this token
            #pragma unroll
            for (int i = 0; i < PF_GDN_PER; ++i) {
                const int r = tid + i * nt;
                pq[i] = r < dk ? qn[r] : 0.0f;
                pk[i] = r < dk ? kn[r] : 0.0f;
                pv[i] = r < nc ? vn[r] : 0.0f;
            }
            if (tid == 0) { pd = decay[(long long)(t + 1) * nv + j]; pb = beta[(long long)(t + 1) * nv + j]; }
        }
        const float* qb = qs + h * dk;
        const float* kb = ks + h * dk;
        const float* vb = vs + h * cw;
        const float dec = sc[2 * h], bj = sc[2 * h + 1];
        for (int idx = tid; idx < rs * nc; idx += nt) {
            int cl = idx % nc, s = idx / nc;
            float acc = 0.0f;
            for (int r = s; r < dk; r += rs) acc += kb[r] * (Ss[r * cw + cl] * dec);
            part[s * cw + cl] = acc;
        }
        __syncthreads();
        for (int cl = tid; cl < nc; cl += nt) {
            float kv = 0.0f;
            for (int s = 0; s < rs; ++s) kv += part[s * cw + cl];
            dl[cl] = (vb[cl] - kv) * bj;
        }
        __syncthreads();
        for (int idx = tid; idx < rs * nc; idx += nt) {
            int cl = idx % nc, s = idx / nc;
            float d = dl[cl], acc = 0.0f;
            for (int r = s; r < dk; r += rs) {
                float sn = Ss[r * cw + cl] * dec + kb[r] * d;
                Ss[r * cw + cl] = sn;
                acc += qb[r] * sn;
            }
            part[s * cw + cl] = acc;
        }
        __syncthreads();
        float* ot = out + (long long)t * nv * dv + (long long)j * dv + c0;
        for (int cl = tid; cl < nc; cl += nt) {
            float o = 0.0f;
            for (int s = 0; s < rs; ++s) o += part[s * cw + cl];
            ot[cl] = o;
        }
        if (more) {  // token t+1's inputs into the other half (read by nobody during token t)
            #pragma unroll
            for (int i = 0; i < PF_GDN_PER; ++i) {
                const int r = tid + i * nt;
                if (r < dk) { qs[hn * dk + r] = pq[i]; ks[hn * dk + r] = pk[i]; }
                if (r < nc) vs[hn * cw + r] = pv[i];
            }
            for (int r = tid + PF_GDN_PER * nt; r < dk; r += nt) { qs[hn * dk + r] = qn[r]; ks[hn * dk + r] = kn[r]; }
            for (int r = tid + PF_GDN_PER * nt; r < nc; r += nt) vs[hn * cw + r] = vn[r];
            if (tid == 0) { sc[2 * hn] = pd; sc[2 * hn + 1] = pb; }
        }
        __syncthreads();
    }
    for (int idx = tid; idx < dk * nc; idx += nt) {
        int r = idx / nc, cl = idx - r * nc;
        Sj[(long long)r * dv + c0 + cl] = Ss[r * cw + cl];
    }
}

// ---- gated DeltaNet recurrence, rows over warps (the batched decode step: one token a place) -----------------------
// The contract of pf_gdn_chunk; block (j, b) holds the columns c = b nl + lane (nl = 32 lanes; the host build: one
// column) of head j, and its warp w the state rows [PF_GDN_RW_ROWS w, + PF_GDN_RW_ROWS) of them in registers (16 a
// thread, 56 registers: 2,048 threads an SM keep the state's loads in flight). A warp reads and writes its rows' 32
// columns as 128 contiguous bytes. The warps' partial sums k^T S and q^T S meet in shared memory (added in warp order:
// the result does not depend on timing), two barriers a token. The batched step (T = 1, places x heads as the heads)
// took 49.3 us a layer at 32 places x 32 heads of 128 x 128; two threads a column holding 64 rows each (246 registers,
// 8 warps an SM) took 70.2 (H200, bench/gpu-notes.md, sixteenth pass). Grid: (nv, ceil(dv / 32)), blockDim
// 32 ceil(dk / PF_GDN_RW_ROWS) (the host build: grid y = dv, one thread).
#ifdef STRATA_HOST
#define PF_GDN_RW_ROWS 128
#else
#define PF_GDN_RW_ROWS 16
#endif
#define PF_GDN_RW_WARPS 8  // the most row parts (dk <= 128 on the device)
// The thread's rows of head j's state, column part b, into s (CS: loads that evict first, __ldcs: the state is read
// once a step). A launch whose shapes the body refuses loads nothing.
template <bool CS>
__device__ __forceinline__ void pf_gdn_step_rw_load(const float* __restrict__ S, int dk, int dv, int j, int b,
                                                    float* s) {
    const int nl = blockDim.x >= 32 ? 32 : 1, nw = (int)blockDim.x / nl;
    const int lane = (int)threadIdx.x % nl, w = (int)threadIdx.x / nl;
    const int c = b * nl + lane, r0 = w * PF_GDN_RW_ROWS;
    const bool shapes = nw <= PF_GDN_RW_WARPS && nw * PF_GDN_RW_ROWS >= dk;
    const int nr = shapes && c < dv ? max(0, min(PF_GDN_RW_ROWS, dk - r0)) : 0;  // rows of this thread
    const float* p = S + (long long)j * dk * dv + (long long)r0 * dv + c;  // (one running address: 16 precomputed
    #pragma unroll                                                          // 64-bit ones spilled at 80 registers)
    for (int i = 0; i < PF_GDN_RW_ROWS; ++i) {
        s[i] = i < nr ? (CS ? __ldcs(p) : *p) : 0.0f;
        p += dv;
    }
}

// (the body of pf_gdn_step_rw and pf_gdn_step_rwc: head j, column part b, its state's rows s as
// pf_gdn_step_rw_load left them; CS: stores that evict first, __stcs)
template <bool CS>
__device__ __forceinline__ void pf_gdn_step_rw_body(
        const float* __restrict__ q, const float* __restrict__ kk, const float* __restrict__ v, int ldv,
        const float* __restrict__ beta, const float* __restrict__ decay, float* __restrict__ S,
        float* __restrict__ out, int T, int nk, int nv, int dk, int dv, int hpp, int kpp, int j, int b, float* s) {
    __shared__ float red[2][PF_GDN_RW_WARPS][32];
    const int nl = blockDim.x >= 32 ? 32 : 1, nw = (int)blockDim.x / nl;
    const int lane = (int)threadIdx.x % nl, w = (int)threadIdx.x / nl;
    // hpp > 0: the heads are places' heads, hpp value heads and kpp key heads a place (value head h of a place reads
    // its key head h mod kpp: the batched step needs no repeated copy of q and k); else key head j mod nk
    const int g = hpp > 0 ? (j / hpp) * kpp + (j % hpp) % kpp : j % nk;
    const int c = b * nl + lane;
    if (nw > PF_GDN_RW_WARPS || nw * PF_GDN_RW_ROWS < dk) return;  // (uniform: the launcher's shapes never do this)
    const bool ok = c < dv;
    const int r0 = w * PF_GDN_RW_ROWS;
    const int nr = ok ? max(0, min(PF_GDN_RW_ROWS, dk - r0)) : 0;  // rows of this thread
    float* Sj = S + (long long)j * dk * dv + (long long)r0 * dv + c;
    for (int t = 0; t < T; ++t) {
        const float* qt = q + ((long long)t * nk + g) * dk + r0;
        const float* kt = kk + ((long long)t * nk + g) * dk + r0;
        const float dec = decay[(long long)t * nv + j], bj = beta[(long long)t * nv + j];
        float kv = 0.0f;
        #pragma unroll
        for (int i = 0; i < PF_GDN_RW_ROWS; ++i)
            if (r0 + i < dk) kv += kt[i] * (s[i] * dec);
        if (nw > 1) {
            red[0][w][lane] = kv;
            __syncthreads();
            kv = red[0][0][lane];
            for (int u = 1; u < nw; ++u) kv += red[0][u][lane];
        }
        const float d = ok ? (v[(long long)t * ldv + (long long)j * dv + c] - kv) * bj : 0.0f;
        float o = 0.0f;
        #pragma unroll
        for (int i = 0; i < PF_GDN_RW_ROWS; ++i)
            if (r0 + i < dk) {
                s[i] = s[i] * dec + kt[i] * d;
                o += qt[i] * s[i];
            }
        if (nw > 1) {
            red[1][w][lane] = o;
            __syncthreads();  // (also: every warp has read red[0] before the next token writes it)
            o = red[1][0][lane];
            for (int u = 1; u < nw; ++u) o += red[1][u][lane];
        }
        if (ok && w == 0) out[(long long)t * nv * dv + (long long)j * dv + c] = o;
    }
    float* p = Sj;
    #pragma unroll
    for (int i = 0; i < PF_GDN_RW_ROWS; ++i) {
        if (i < nr) {
            if (CS) __stcs(p, s[i]);
            else *p = s[i];
        }
        p += dv;
    }
}

extern "C" __global__ void __launch_bounds__(256, 4) pf_gdn_step_rw(
        const float* __restrict__ q, const float* __restrict__ kk, const float* __restrict__ v, int ldv,
        const float* __restrict__ beta, const float* __restrict__ decay, float* __restrict__ S,
        float* __restrict__ out, int T, int nk, int nv, int dk, int dv, int hpp, int kpp) {
    PDL_ENTRY();
    float s[PF_GDN_RW_ROWS];
    pf_gdn_step_rw_load<false>(S, dk, dv, (int)blockIdx.x, (int)blockIdx.y, s);
    pf_gdn_step_rw_body<false>(q, kk, v, ldv, beta, decay, S, out, T, nk, nv, dk, dv, hpp, kpp, (int)blockIdx.x,
                               (int)blockIdx.y, s);
}

// pf_gdn_step_rw with the grid's axes swapped: (ceil(dv / 32), nv), so that the blocks the device starts one after
// another are one head's column parts, which together read and write its whole state (dk dv floats in one run)
// instead of every head's same 128-byte piece of each 512-byte row.
extern "C" __global__ void __launch_bounds__(256, 4) pf_gdn_step_rwc(
        const float* __restrict__ q, const float* __restrict__ kk, const float* __restrict__ v, int ldv,
        const float* __restrict__ beta, const float* __restrict__ decay, float* __restrict__ S,
        float* __restrict__ out, int T, int nk, int nv, int dk, int dv, int hpp, int kpp) {
    PDL_ENTRY();
    float s[PF_GDN_RW_ROWS];
    pf_gdn_step_rw_load<false>(S, dk, dv, (int)blockIdx.y, (int)blockIdx.x, s);
    pf_gdn_step_rw_body<false>(q, kk, v, ldv, beta, decay, S, out, T, nk, nv, dk, dv, hpp, kpp, (int)blockIdx.y,
                               (int)blockIdx.x, s);
}

// pf_gdn_step_rwc with the state's loads before griddepcontrol.wait (the batched step where S is its places' state
// buffer itself, which no kernel of the step but this one writes: a step's graph replay starts once the one before
// has ended), so that under programmatic dependent launch they overlap the kernels before it (pf_gdn_prep's q, k, v,
// beta and decay are read after the wait). pf_gdn_step_rwcs: the same with the state's loads and stores evicting
// first (__ldcs / __stcs: 64 MB of state a layer at 32 places, read and written once a step).
extern "C" __global__ void __launch_bounds__(256, 4) pf_gdn_step_rwce(
        const float* __restrict__ q, const float* __restrict__ kk, const float* __restrict__ v, int ldv,
        const float* __restrict__ beta, const float* __restrict__ decay, float* __restrict__ S,
        float* __restrict__ out, int T, int nk, int nv, int dk, int dv, int hpp, int kpp) {
    float s[PF_GDN_RW_ROWS];
    pf_gdn_step_rw_load<false>(S, dk, dv, (int)blockIdx.y, (int)blockIdx.x, s);
    PDL_ENTRY();
    pf_gdn_step_rw_body<false>(q, kk, v, ldv, beta, decay, S, out, T, nk, nv, dk, dv, hpp, kpp, (int)blockIdx.y,
                               (int)blockIdx.x, s);
}

extern "C" __global__ void __launch_bounds__(256, 4) pf_gdn_step_rwcs(
        const float* __restrict__ q, const float* __restrict__ kk, const float* __restrict__ v, int ldv,
        const float* __restrict__ beta, const float* __restrict__ decay, float* __restrict__ S,
        float* __restrict__ out, int T, int nk, int nv, int dk, int dv, int hpp, int kpp) {
    float s[PF_GDN_RW_ROWS];
    pf_gdn_step_rw_load<true>(S, dk, dv, (int)blockIdx.y, (int)blockIdx.x, s);
    PDL_ENTRY();
    pf_gdn_step_rw_body<true>(q, kk, v, ldv, beta, decay, S, out, T, nk, nv, dk, dv, hpp, kpp, (int)blockIdx.y,
                              (int)blockIdx.x, s);
}

// ---- gated DeltaNet recurrence, one warp per PF_GDN_CPW value columns (the prefill's default) ----------------------
// The contract of pf_gdn_chunk (q, kk [T, nk, dk]; v [T, ldv], value head j at v + j dv; beta, decay [T, nv]; S
// [nv, dk, dv] updated in place; out [T, nv dv]), another work split: warp w of block (j, b) owns the columns
// c0 = PF_GDN_CPW (b wpb + w) .. + PF_GDN_CPW - 1 of head j (wpb = warps a block; the host build: one warp of one
// lane), lane l the state rows l, l + 32, ... of those columns, in registers for the whole chunk (dk <= 32
// PF_GDN_RPL). Per token: kv = k^T (decay S) per column, summed over the warp by shuffles; delta = (v - kv) beta;
// S <- decay S + k delta; o = q^T S, summed likewise; lane 0 writes o. No shared memory and no block barrier (the
// chunk kernel's three a token bounded it: 1.1 ms a layer for 512 tokens): the warps walk the tokens independently,
// token t+1's inputs loaded while token t is computed.
#define PF_GDN_CPW 4
#ifdef STRATA_HOST
#define PF_GDN_RPL 128  // the host's one lane holds every row
#else
#define PF_GDN_RPL 4
#endif
extern "C" __global__ void pf_gdn_warp(const float* __restrict__ q, const float* __restrict__ kk,
                                       const float* __restrict__ v, int ldv, const float* __restrict__ beta,
                                       const float* __restrict__ decay, float* __restrict__ S,
                                       float* __restrict__ out, int T, int nk, int nv, int dk, int dv) {
    PDL_ENTRY();
    const int nl = blockDim.x >= 32 ? 32 : 1, wpb = blockDim.x >= 32 ? (int)(blockDim.x >> 5) : 1;
    const int lane = (int)threadIdx.x & (nl - 1), warp = (int)threadIdx.x / nl;
    const int j = blockIdx.x, g = j % nk;
    const int c0 = PF_GDN_CPW * ((int)blockIdx.y * wpb + warp);
    if (c0 >= dv) return;  // (the whole warp)
    const int ncol = min(PF_GDN_CPW, dv - c0);
    const int nr = lane < dk ? (dk - lane + nl - 1) / nl : 0;  // this lane's rows: lane, lane + nl, ...
    float* Sj = S + (long long)j * dk * dv + c0;
    float st[PF_GDN_RPL][PF_GDN_CPW];
    #pragma unroll
    for (int i = 0; i < PF_GDN_RPL; ++i)
        #pragma unroll
        for (int c = 0; c < PF_GDN_CPW; ++c)
            st[i][c] = i < nr && c < ncol ? Sj[(long long)(lane + i * nl) * dv + c] : 0.0f;
    float kq[PF_GDN_RPL], qq[PF_GDN_RPL], vv[PF_GDN_CPW], bt = 0.0f, dc = 0.0f;
    float kn[PF_GDN_RPL], qn[PF_GDN_RPL], vn[PF_GDN_CPW], btn = 0.0f, dcn = 0.0f;
    #pragma unroll
    for (int i = 0; i < PF_GDN_RPL; ++i) {
        kq[i] = i < nr ? kk[(long long)g * dk + lane + i * nl] : 0.0f;
        qq[i] = i < nr ? q[(long long)g * dk + lane + i * nl] : 0.0f;
    }
    #pragma unroll
    for (int c = 0; c < PF_GDN_CPW; ++c) vv[c] = c < ncol ? v[(long long)j * dv + c0 + c] : 0.0f;
    if (T > 0) { bt = beta[j]; dc = decay[j]; }
    for (int t = 0; t < T; ++t) {
        if (t + 1 < T) {  // token t+1's inputs, used after this token
            const long long kb = ((long long)(t + 1) * nk + g) * dk + lane;
            #pragma unroll
            for (int i = 0; i < PF_GDN_RPL; ++i) {
                kn[i] = i < nr ? kk[kb + i * nl] : 0.0f;
                qn[i] = i < nr ? q[kb + i * nl] : 0.0f;
            }
            const float* vr = v + (long long)(t + 1) * ldv + (long long)j * dv + c0;
            #pragma unroll
            for (int c = 0; c < PF_GDN_CPW; ++c) vn[c] = c < ncol ? vr[c] : 0.0f;
            btn = beta[(long long)(t + 1) * nv + j];
            dcn = decay[(long long)(t + 1) * nv + j];
        }
        float kv[PF_GDN_CPW], o[PF_GDN_CPW];
        #pragma unroll
        for (int c = 0; c < PF_GDN_CPW; ++c) { kv[c] = 0.0f; o[c] = 0.0f; }
        #pragma unroll
        for (int i = 0; i < PF_GDN_RPL; ++i)
            #pragma unroll
            for (int c = 0; c < PF_GDN_CPW; ++c) kv[c] += kq[i] * (st[i][c] * dc);
        #pragma unroll
        for (int c = 0; c < PF_GDN_CPW; ++c)
            for (int m = nl >> 1; m > 0; m >>= 1) kv[c] += __shfl_xor_sync(0xffffffffu, kv[c], m);
        #pragma unroll
        for (int c = 0; c < PF_GDN_CPW; ++c) kv[c] = (vv[c] - kv[c]) * bt;  // delta
        #pragma unroll
        for (int i = 0; i < PF_GDN_RPL; ++i)
            #pragma unroll
            for (int c = 0; c < PF_GDN_CPW; ++c) {
                const float sn = st[i][c] * dc + kq[i] * kv[c];
                st[i][c] = sn;
                o[c] += qq[i] * sn;
            }
        #pragma unroll
        for (int c = 0; c < PF_GDN_CPW; ++c)
            for (int m = nl >> 1; m > 0; m >>= 1) o[c] += __shfl_xor_sync(0xffffffffu, o[c], m);
        if (lane == 0) {
            float* ot = out + (long long)t * nv * dv + (long long)j * dv + c0;
            #pragma unroll
            for (int c = 0; c < PF_GDN_CPW; ++c)
                if (c < ncol) ot[c] = o[c];
        }
        #pragma unroll
        for (int i = 0; i < PF_GDN_RPL; ++i) { kq[i] = kn[i]; qq[i] = qn[i]; }
        #pragma unroll
        for (int c = 0; c < PF_GDN_CPW; ++c) vv[c] = vn[c];
        bt = btn;
        dc = dcn;
    }
    #pragma unroll
    for (int i = 0; i < PF_GDN_RPL; ++i)
        #pragma unroll
        for (int c = 0; c < PF_GDN_CPW; ++c)
            if (i < nr && c < ncol) Sj[(long long)(lane + i * nl) * dv + c] = st[i][c];
}

// ---- dequantize blobs through a pointer table ----------------------------------------------------------------------
// For blob b = blockIdx.y: the n_groups * 8 values of type TQ starting off bytes after ptrs[b] (a VRAM slot or mapped
// pinned host memory) into dst + b * n_groups * 8 (float32). Groups by grid stride over blockIdx.x.
template <int TQ> __global__ void pf_dequant_blobs(const u64* __restrict__ ptrs, long long off, long long n_groups,
                                                   float* __restrict__ dst) {
    PDL_ENTRY();
    const int b = blockIdx.y;
    const u8* src = reinterpret_cast<const u8*>(ptrs[b]) + off;
    float* d = dst + (long long)b * n_groups * 8;
    const int gpb = Unit<TQ>::bs / 8;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_groups;
         i += (long long)gridDim.x * blockDim.x) {
        long long blk = i / gpb;
        int g = (int)(i - blk * gpb);
        float o[8];
        deq8<TQ>(src + blk * Unit<TQ>::ts, g, o);
        #pragma unroll
        for (int e = 0; e < 8; ++e) d[8 * i + e] = o[e];
    }
}

// ---- routed experts straight from the quantized blobs, several tokens per weight row -------------------------------
// A job is (one expert, up to PF_TT of its tokens): job_ptr[j] is the expert's blob address (a VRAM slot or mapped
// pinned host memory), job_tok[j PF_TT + s] the row of X of its token s (-1: no token). Each weight row is decoded
// once per job and multiplied with the job's tokens, staged in shared memory (float32).
#define PF_TT 8

__device__ __forceinline__ float pf_warp_sum(float v) {
#ifndef STRATA_HOST
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
#endif
    return v;
}

// Hbuf[j PF_TT + s, r] = silu(gate_j[r] . x_s) * (up_j[r] . x_s) for job j = blockIdx.y and rows r (one per warp, grid
// stride over blockIdx.x); gate_j = job_ptr[j], up_j = gate_j + F rb (rb = H / bs * ts bytes a row). Rows of no token
// are left as they are. Shared: PF_TT H floats.
template <int TQ> __global__ void __launch_bounds__(256) pf_moe_gu(
        const u64* __restrict__ job_ptr, const int* __restrict__ job_tok, const float* __restrict__ X,
        float* __restrict__ Hbuf, int H, int F) {
    PDL_ENTRY();
    PF_DYN_SHARED(float, xs);
    const int j = blockIdx.y;
    for (int i = threadIdx.x; i < PF_TT * H; i += blockDim.x) {
        int s = i / H, c = i - s * H;
        int t = job_tok[j * PF_TT + s];
        xs[i] = t >= 0 ? X[(long long)t * H + c] : 0.0f;
    }
    __syncthreads();
    const int nl = blockDim.x < 32 ? blockDim.x : 32;
    const int warps = blockDim.x >> 5 ? blockDim.x >> 5 : 1;
    const int warp = threadIdx.x / nl, lane = threadIdx.x % nl;
    const int bs = Unit<TQ>::bs, ts = Unit<TQ>::ts, gpb = bs / 8;
    const long long rb = (long long)(H / bs) * ts;
    const int ng = H / 8;
    const u8* G = reinterpret_cast<const u8*>(job_ptr[j]);
    const u8* U = G + (long long)F * rb;
    for (int row = blockIdx.x * warps + warp; row < F; row += gridDim.x * warps) {
        const u8* gr = G + row * rb;
        const u8* ur = U + row * rb;
        float ag[PF_TT], au[PF_TT];
        #pragma unroll
        for (int s = 0; s < PF_TT; ++s) { ag[s] = 0.0f; au[s] = 0.0f; }
        for (int gi = lane; gi < ng; gi += nl) {
            int blk = gi / gpb, g = gi - blk * gpb;
            float og[8], ou[8];
            deq8<TQ>(gr + (long long)blk * ts, g, og);
            deq8<TQ>(ur + (long long)blk * ts, g, ou);
            #pragma unroll
            for (int s = 0; s < PF_TT; ++s) {
                const float4* x4 = reinterpret_cast<const float4*>(xs + s * H + 8 * gi);
                float4 a = x4[0], b = x4[1];
                ag[s] += og[0] * a.x + og[1] * a.y + og[2] * a.z + og[3] * a.w
                       + og[4] * b.x + og[5] * b.y + og[6] * b.z + og[7] * b.w;
                au[s] += ou[0] * a.x + ou[1] * a.y + ou[2] * a.z + ou[3] * a.w
                       + ou[4] * b.x + ou[5] * b.y + ou[6] * b.z + ou[7] * b.w;
            }
        }
        #pragma unroll
        for (int s = 0; s < PF_TT; ++s) {
            float gs = pf_warp_sum(ag[s]), us = pf_warp_sum(au[s]);
            if (lane == 0 && job_tok[j * PF_TT + s] >= 0)
                Hbuf[((long long)j * PF_TT + s) * F + row] = gs / (1.0f + expf(-gs)) * us;
        }
    }
}

// out[job_dst[j PF_TT + s], r] = down_j[r] . Hbuf[j PF_TT + s] for job j = blockIdx.y and rows r < H (one per warp,
// grid stride over blockIdx.x); down_j = job_ptr[j] + doff; rows of F values of type TQ. Slots with job_dst < 0 are
// skipped. Shared: PF_TT F floats.
template <int TQ> __global__ void __launch_bounds__(256) pf_moe_down(
        const u64* __restrict__ job_ptr, long long doff, const int* __restrict__ job_dst,
        const float* __restrict__ Hbuf, float* __restrict__ out, int H, int F) {
    PDL_ENTRY();
    PF_DYN_SHARED(float, hs);
    const int j = blockIdx.y;
    for (int i = threadIdx.x; i < PF_TT * F; i += blockDim.x) hs[i] = Hbuf[(long long)j * PF_TT * F + i];
    __syncthreads();
    const int nl = blockDim.x < 32 ? blockDim.x : 32;
    const int warps = blockDim.x >> 5 ? blockDim.x >> 5 : 1;
    const int warp = threadIdx.x / nl, lane = threadIdx.x % nl;
    const int bs = Unit<TQ>::bs, ts = Unit<TQ>::ts, gpb = bs / 8;
    const long long rb = (long long)(F / bs) * ts;
    const int ng = F / 8;
    const u8* D = reinterpret_cast<const u8*>(job_ptr[j]) + doff;
    for (int row = blockIdx.x * warps + warp; row < H; row += gridDim.x * warps) {
        const u8* dr = D + row * rb;
        float acc[PF_TT];
        #pragma unroll
        for (int s = 0; s < PF_TT; ++s) acc[s] = 0.0f;
        for (int gi = lane; gi < ng; gi += nl) {
            int blk = gi / gpb, g = gi - blk * gpb;
            float o[8];
            deq8<TQ>(dr + (long long)blk * ts, g, o);
            #pragma unroll
            for (int s = 0; s < PF_TT; ++s) {
                const float4* h4 = reinterpret_cast<const float4*>(hs + s * F + 8 * gi);
                float4 a = h4[0], b = h4[1];
                acc[s] += o[0] * a.x + o[1] * a.y + o[2] * a.z + o[3] * a.w
                        + o[4] * b.x + o[5] * b.y + o[6] * b.z + o[7] * b.w;
            }
        }
        #pragma unroll
        for (int s = 0; s < PF_TT; ++s) {
            float v = pf_warp_sum(acc[s]);
            int d = job_dst[j * PF_TT + s];
            if (lane == 0 && d >= 0) out[(long long)d * H + row] = v;
        }
    }
}
