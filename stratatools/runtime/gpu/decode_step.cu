// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by kernels.py / decode.py and compiled with
// NVRTC (cupy.RawModule); tests/test_gpu_kernels_host.py compiles the decoders as host C++.
// Kernels of the batch-1 decode step (decode.py StaticDecoder): router top-k, fused norms, hyper-connection
// mixing, cache rows (the step's attention is qsa_step.cu's split kernels).
#include "pdl.cuh"  // pdl_wait, pdl_trigger, PDL_ENTRY (programmatic dependent launch)
typedef unsigned long long u64;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_add(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// Block-wide reduction (max if is_max else sum); every thread gets the result. red: 32 floats of shared memory.
__device__ float block_reduce(float v, bool is_max, float* red) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = is_max ? warp_max(v) : warp_add(v);
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float r = lane < nw ? red[lane] : (is_max ? NEG_INF : 0.0f);
        r = is_max ? warp_max(r) : warp_add(r);
        if (lane == 0) red[0] = r;
    }
    __syncthreads();
    return red[0];
}

// k rounds of block-wide arg-max over the probabilities p[E] in shared memory (ties to the lower index;
// chosen entries are set to -inf): ids[r], their probabilities vals[r] and the blob addresses of the VRAM slots.
__device__ void select_topk(float* p, int E, int k, const u64* __restrict__ slot, u64 gate_bytes, int* ids,
                            float* vals, u64* gate_ptr, u64* up_ptr, u64* down_ptr) {
    __shared__ float rv[32];
    __shared__ int ri[32];
    int t = threadIdx.x, lane = t & 31, wid = t >> 5, nw = (blockDim.x + 31) >> 5;
    for (int r = 0; r < k; ++r) {
        float bv = NEG_INF; int bi = 0x7fffffff;
        for (int i = t; i < E; i += blockDim.x) {
            float v = p[i];
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
        for (int o = 16; o; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o); int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { rv[wid] = bv; ri[wid] = bi; }
        __syncthreads();
        if (t == 0) {
            float b = rv[0]; int ii = ri[0];
            for (int q = 1; q < nw; ++q) if (rv[q] > b || (rv[q] == b && ri[q] < ii)) { b = rv[q]; ii = ri[q]; }
            if (ii < 0 || ii >= E) ii = 0;  // only if every value is NaN
            u64 ptr = slot[ii];
            ids[r] = ii; vals[r] = p[ii];
            gate_ptr[r] = ptr; up_ptr[r] = ptr + gate_bytes; down_ptr[r] = ptr + 2 * gate_bytes;
            p[ii] = NEG_INF;
        }
        __syncthreads();
    }
}

// select_topk by one warp (call from the threads of warp 0 only; no block barrier): each round, every lane scans
// its stride of p, then a butterfly arg-max (ties to the lower index) leaves the same winner in every lane.
// Same selection as select_topk, without its two block barriers per round.
__device__ void select_topk_warp(float* p, int E, int k, const u64* __restrict__ slot, u64 gate_bytes, int* ids,
                                 float* vals, u64* gate_ptr, u64* up_ptr, u64* down_ptr) {
    __shared__ int sel[64];
    int lane = threadIdx.x & 31;
    for (int r = 0; r < k; ++r) {
        float bv = NEG_INF; int bi = 0x7fffffff;
        for (int i = lane; i < E; i += 32) {
            float v = p[i];
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
        for (int o = 16; o; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o); int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (bi < 0 || bi >= E) bi = 0;  // only if every value is NaN
        __syncwarp();
        if (lane == 0) {
            ids[r] = bi; vals[r] = p[bi]; sel[r] = bi;
            p[bi] = NEG_INF;
        }
        __syncwarp();
    }
    // the blob addresses after the rounds, one lane per expert: the k table reads in flight together instead of one
    // global-memory round trip per round
    const int nl = blockDim.x < 32 ? (int)blockDim.x : 32;
    for (int r = lane; r < k; r += nl) {
        const u64 ptr = slot[sel[r]];
        gate_ptr[r] = ptr; up_ptr[r] = ptr + gate_bytes; down_ptr[r] = ptr + 2 * gate_bytes;
    }
}

// Top-k of probs[0..E) (select_topk): ids[k], w[k] (the probabilities) and the blob addresses slot[id]
// (+ gate_bytes for up, + 2 gate_bytes for down). One block; shared: E floats.
extern "C" __global__ void route_topk(const float* __restrict__ probs, int E, int k, const u64* __restrict__ slot,
                                      u64 gate_bytes, int* ids, float* w, u64* gate_ptr, u64* up_ptr, u64* down_ptr) {
    PDL_ENTRY();
    extern __shared__ float p[];
    for (int i = threadIdx.x; i < E; i += blockDim.x) p[i] = probs[i];
    __syncthreads();
    select_topk(p, E, k, slot, gate_bytes, ids, w, gate_ptr, up_ptr, down_ptr);
}

// ---- fused element-wise kernels of the fast step (StaticDecoder(fast=True)); same formulas as stratatools.runtime.model ----
__device__ __forceinline__ float sigm(float a) { return 1.0f / (1.0f + expf(-a)); }

// Rows of `group` values: out = x * (1 / sqrt(mean(x*x) + eps)), times w[flat index % wlen] when w is given
// (stratatools.runtime.model._rmsnorm). One block per row.
extern "C" __global__ void rmsnorm_rows(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                                        int group, int wlen, float eps) {
    PDL_ENTRY();
    __shared__ float red[32];
    long long base = (long long)blockIdx.x * group;
    float s = 0.0f;
    for (int i = threadIdx.x; i < group; i += blockDim.x) { float v = x[base + i]; s += v * v; }
    s = block_reduce(s, false, red);
    float r = 1.0f / sqrtf(s / (float)group + eps);
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        float v = x[base + i] * r;
        if (w) v = v * w[(base + i) % wlen];
        out[base + i] = v;
    }
}

// out[i] = silu(v[i] / div)
extern "C" __global__ void silu_div(const float* __restrict__ v, float* __restrict__ out, int n, float div) {
    PDL_ENTRY();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float a = v[i] / div; out[i] = a * sigm(a); }
}

// Hyper-connection mix: out[i] = (sum over h < hc of sigmoid(u[h*n+i]) * hn[h*n+i]) / hc.
extern "C" __global__ void hc_mix(const float* __restrict__ u, const float* __restrict__ hn, float* __restrict__ out,
                                  int hc, int n) {
    PDL_ENTRY();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 0.0f;
    for (int h = 0; h < hc; ++h) s += sigm(u[(long long)h * n + i]) * hn[(long long)h * n + i];
    out[i] = s / (float)hc;
}

// Residual with the inject weights: H[h*n+i] += y[i] * (2 sigmoid(v[h] / hc)).
extern "C" __global__ void hc_inject(float* __restrict__ H, const float* __restrict__ y, const float* __restrict__ v,
                                     int hc, int n) {
    PDL_ENTRY();
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= hc * n) return;
    int h = idx / n, i = idx - h * n;
    float iw = 2.0f * sigm(v[h] / (float)hc);
    H[idx] = H[idx] + y[i] * iw;
}

// out[0] = sigmoid(sum_i x[i] * w[i]) (the shared expert's gate). One block.
extern "C" __global__ void dot_sigmoid(const float* __restrict__ x, const float* __restrict__ w, int n, float* __restrict__ out) {
    PDL_ENTRY();
    __shared__ float red[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[i] * w[i];
    s = block_reduce(s, false, red);
    if (threadIdx.x == 0) out[0] = sigm(s);
}

// Router from logits: probabilities (sigmoid if gating else softmax), then route_topk's selection (k rounds of
// arg-max, ties to the lower index), then the weights: probabilities of the chosen, divided by their sum when
// norm, times scale. Writes ids[k], w[k] and the blob addresses. One block; p: E floats of shared memory.
// WARP: the selection by warp 0 alone (select_topk_warp) instead of the whole block (select_topk).
template <bool WARP>
__device__ void route_body(float* p, const float* __restrict__ logits, int E, int k, int sigmoid_gating, int norm,
                           float scale, const u64* __restrict__ slot, u64 gate_bytes, int* ids, float* w,
                           u64* gate_ptr, u64* up_ptr, u64* down_ptr) {
    __shared__ float red[32];
    __shared__ float chosen[64];
    int t = threadIdx.x;
    if (sigmoid_gating) {
        for (int i = t; i < E; i += blockDim.x) p[i] = sigm(logits[i]);
    } else {
        float m = NEG_INF;
        for (int i = t; i < E; i += blockDim.x) m = fmaxf(m, logits[i]);
        m = block_reduce(m, true, red);
        float s = 0.0f;
        for (int i = t; i < E; i += blockDim.x) { float e = expf(logits[i] - m); p[i] = e; s += e; }
        s = block_reduce(s, false, red);
        for (int i = t; i < E; i += blockDim.x) p[i] = p[i] / s;
    }
    __syncthreads();
    if (!WARP) {
        select_topk(p, E, k, slot, gate_bytes, ids, chosen, gate_ptr, up_ptr, down_ptr);
    } else {
        if (t >= 32) return;
        select_topk_warp(p, E, k, slot, gate_bytes, ids, chosen, gate_ptr, up_ptr, down_ptr);
    }
    if (t == 0) {
        float s = 0.0f;
        for (int r = 0; r < k; ++r) s += chosen[r];
        for (int r = 0; r < k; ++r) w[r] = (norm ? chosen[r] / s : chosen[r]) * scale;
    }
}

// route_body as a kernel. One block; shared: E floats.
extern "C" __global__ void route_fused(const float* __restrict__ logits, int E, int k, int sigmoid_gating, int norm,
                                       float scale, const u64* __restrict__ slot, u64 gate_bytes, int* ids, float* w,
                                       u64* gate_ptr, u64* up_ptr, u64* down_ptr) {
    PDL_ENTRY();
    extern __shared__ float p[];
    route_body<false>(p, logits, E, k, sigmoid_gating, norm, scale, slot, gate_bytes, ids, w, gate_ptr, up_ptr, down_ptr);
}

// route_fused (selection by one warp), plus the shared expert's gate from its logit: sg[0] = sigmoid(logits[E]) (the router matvec with the
// shared gate's row stacked after the E expert rows). One block; shared: E floats.
extern "C" __global__ void route_fused_sg(const float* __restrict__ logits, int E, int k, int sigmoid_gating, int norm,
                                          float scale, const u64* __restrict__ slot, u64 gate_bytes, int* ids, float* w,
                                          u64* gate_ptr, u64* up_ptr, u64* down_ptr, float* __restrict__ sg) {
    PDL_ENTRY();
    extern __shared__ float p[];
    if (threadIdx.x == 0) sg[0] = sigm(logits[E]);
    route_body<true>(p, logits, E, k, sigmoid_gating, norm, scale, slot, gate_bytes, ids, w, gate_ptr, up_ptr, down_ptr);
}

// route_fused_sg by one warp with the probabilities in registers (E <= 32 * NV; launch 32 threads, no dynamic shared
// memory; same arguments): lane l holds entries l, l + 32, ... The results are route_fused_sg's bit for bit
// (tests/test_gpu_decode.py): the softmax max and sum are reduced in the order of route_body's block of
// roundup32(E) threads (a butterfly per 32 entries, then one over those sums with zeros past them); each round of the
// selection takes the largest key, then the lowest index holding it, by two warp reductions (sm_80 redux), the keys
// ordering as select_topk_warp compares: 0 for NaN (never chosen while anything else is left), 1 for a taken entry
// (its value -inf), 2 + the order-preserving bits of the value otherwise; the weights' sum is taken in round order.
// No block barrier, no shared-memory round trip.
template <int NV>
__device__ __forceinline__ void route_warp_body(const float* __restrict__ logits, int E, int k, int sigmoid_gating,
                                                int norm, float scale, const u64* __restrict__ slot, u64 gate_bytes,
                                                int* ids, float* w, u64* gate_ptr, u64* up_ptr, u64* down_ptr,
                                                float* __restrict__ sg) {
    const int lane = threadIdx.x & 31;
    if (threadIdx.x >= 32) return;
    const int nv = (E + 31) >> 5;  // entries a lane holds (the block path's warps)
    float v[NV];
    if (sigmoid_gating) {
        #pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int i = lane + 32 * j;
            v[j] = i < E ? sigm(logits[i]) : 0.0f;
        }
    } else {
        float m = NEG_INF;
        #pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int i = lane + 32 * j;
            v[j] = i < E ? logits[i] : NEG_INF;
            m = fmaxf(m, v[j]);
        }
        m = warp_max(m);
        float tot = 0.0f;  // the block path's sum: per 32 entries, then across those sums in lane order
        #pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int i = lane + 32 * j;
            v[j] = i < E ? expf(v[j] - m) : 0.0f;
            const float sj = warp_add(v[j]);
            if (j == lane) tot = sj;
        }
        tot = warp_add(lane < nv ? tot : 0.0f);
        #pragma unroll
        for (int j = 0; j < NV; ++j) v[j] = v[j] / tot;
    }
    unsigned key[NV];
    #pragma unroll
    for (int j = 0; j < NV; ++j) {
        const unsigned b = __float_as_uint(v[j]);
        const unsigned o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // -inf -> 0x007fffff, +inf -> 0xff800000
        key[j] = (lane + 32 * j >= E || v[j] != v[j]) ? 0u : o + 2u;
    }
    if (lane == 0) sg[0] = sigm(logits[E]);
    int id0 = 0, id1 = 0;
    float c0 = 0.0f, c1 = 0.0f, s = 0.0f;
    for (int r = 0; r < k; ++r) {
        unsigned mk = 0u;
        #pragma unroll
        for (int j = 0; j < NV; ++j) mk = max(mk, key[j]);
        mk = __reduce_max_sync(0xffffffffu, mk);
        int cand = 0x7fffffff;
        #pragma unroll
        for (int j = NV - 1; j >= 0; --j)
            if (key[j] == mk) cand = lane + 32 * j;
        int bi = __reduce_min_sync(0xffffffffu, cand);
        if (bi < 0 || bi >= E) bi = 0;  // (not reached: index 0 holds the largest key when every key is 0)
        // the chosen probability as select_topk_warp reads it (p[bi]), then taken (-inf, key 1) by its lane
        float pv = 0.0f;
        #pragma unroll
        for (int j = 0; j < NV; ++j)
            if (lane + 32 * j == bi) { pv = v[j]; v[j] = NEG_INF; key[j] = 1u; }
        pv = __shfl_sync(0xffffffffu, pv, bi & 31);
        s += pv;
        if (lane == (r & 31)) {
            if (r < 32) { id0 = bi; c0 = pv; } else { id1 = bi; c1 = pv; }
        }
    }
    // lane r writes round r's expert (and r + 32's): id, weight, blob addresses, the k table reads in flight together
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = lane + 32 * h;
        if (r < k) {
            const int id = h ? id1 : id0;
            const float c = h ? c1 : c0;
            const u64 ptr = slot[id];
            ids[r] = id;
            w[r] = (norm ? c / s : c) * scale;
            gate_ptr[r] = ptr; up_ptr[r] = ptr + gate_bytes; down_ptr[r] = ptr + 2 * gate_bytes;
        }
    }
}

// route_warp_body for E <= 256 (8 entries a lane) and for E <= 512 (16).
extern "C" __global__ void route_warp_sg8(const float* __restrict__ logits, int E, int k, int sigmoid_gating, int norm,
                                          float scale, const u64* __restrict__ slot, u64 gate_bytes, int* ids, float* w,
                                          u64* gate_ptr, u64* up_ptr, u64* down_ptr, float* __restrict__ sg) {
    PDL_ENTRY();
    route_warp_body<8>(logits, E, k, sigmoid_gating, norm, scale, slot, gate_bytes, ids, w, gate_ptr, up_ptr, down_ptr,
                       sg);
}
extern "C" __global__ void route_warp_sg16(const float* __restrict__ logits, int E, int k, int sigmoid_gating, int norm,
                                           float scale, const u64* __restrict__ slot, u64 gate_bytes, int* ids,
                                           float* w, u64* gate_ptr, u64* up_ptr, u64* down_ptr,
                                           float* __restrict__ sg) {
    PDL_ENTRY();
    route_warp_body<16>(logits, E, k, sigmoid_gating, norm, scale, slot, gate_bytes, ids, w, gate_ptr, up_ptr,
                        down_ptr, sg);
}

// dst[pos * n + i] = src[i] for the position held in *posp.
extern "C" __global__ void put_row(const float* __restrict__ src, float* __restrict__ dst, const int* __restrict__ posp, int n) {
    PDL_ENTRY();
    long long base = (long long)posp[0] * n;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[base + i] = src[i];
}

