// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by decode.py (StaticDecoder) and compiled with
// NVRTC (cupy.RawModule); tests/test_gpu_qsa_host.py compiles it as host C++ (host_kernel_shim.cuh: one thread per
// block, blocks run one after another) and checks every kernel against stratatools.runtime.model / topk.
// QSA on the device for one decode position (the position is read from *posp, so one launch sequence serves every
// position and the step stays capturable as a CUDA graph):
//   qsa_pool    when pos+1 completes a block: mean of the block's raw indexer keys, k_norm, RoPE at the block start;
//   qsa_scores  block scores sum_heads relu(q_h . bk[b]) / sqrt(d);
//   qsa_select  the selected cells (transformers' torch.topk of blocks + the tail, or llama.cpp's top cells);
//   attn_sel_partial / attn_sel_combine  attention over the selected cells, or (use_cells 0) over every position
//                                        (the CuPy step's attention at any context), split over blocks, any length.
// Block code uses shared-memory loops, no warp shuffles, so it is also correct with one thread per block.
#include "pdl.cuh"  // pdl_wait, pdl_trigger, PDL_ENTRY (programmatic dependent launch)

#ifndef QSA_NEG_INF
#define QSA_NEG_INF __int_as_float(0xff800000)
#define QSA_POS_INF __int_as_float(0x7f800000)
#endif
#define QSA_MAX_THREADS 1024
// A "warp" of the dot products: 32 lanes on the device, one lane in the host build (where a block has one thread).
#ifdef STRATA_HOST
#define QSA_WARP 1
__device__ __forceinline__ float qsa_warp_sum(float v) { return v; }
#else
#define QSA_WARP 32
__device__ __forceinline__ float qsa_warp_sum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
#endif

struct QsaPair { float v; int i; };

// ---- libstdc++'s algorithms on (value, index) pairs, comparator "a before b" = a.v > b.v (ties compare false) ----
// Written from the algorithms' specification as stratatools.runtime.topk emulates them (same step order).
__device__ __forceinline__ bool qsa_less(QsaPair a, QsaPair b) { return a.v > b.v; }

__device__ void qsa_adjust_heap(QsaPair* a, int hole, int len, QsaPair value) {
    int top = hole, child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (qsa_less(a[child], a[child - 1])) child--;
        a[hole] = a[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        a[hole] = a[child - 1];
        hole = child - 1;
    }
    int parent = (hole - 1) / 2;
    while (hole > top && qsa_less(a[parent], value)) {
        a[hole] = a[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    a[hole] = value;
}

__device__ void qsa_make_heap(QsaPair* a, int len) {
    if (len < 2) return;
    for (int parent = (len - 2) / 2;; --parent) {
        qsa_adjust_heap(a, parent, len, a[parent]);
        if (parent == 0) return;
    }
}

// __heap_select(first, middle, last): afterwards a[first:middle] holds the selected elements.
__device__ void qsa_heap_select(QsaPair* a, int first, int middle, int last) {
    int len = middle - first;
    qsa_make_heap(a + first, len);
    for (int i = middle; i < last; ++i) {
        if (qsa_less(a[i], a[first])) {
            QsaPair val = a[i];
            a[i] = a[first];
            qsa_adjust_heap(a + first, 0, len, val);
        }
    }
}

__device__ __forceinline__ void qsa_swap(QsaPair* a, int x, int y) { QsaPair t = a[x]; a[x] = a[y]; a[y] = t; }

__device__ void qsa_move_median_to_first(QsaPair* a, int result, int x, int y, int z) {
    if (qsa_less(a[x], a[y])) {
        if (qsa_less(a[y], a[z])) qsa_swap(a, result, y);
        else if (qsa_less(a[x], a[z])) qsa_swap(a, result, z);
        else qsa_swap(a, result, x);
    } else if (qsa_less(a[x], a[z])) qsa_swap(a, result, x);
    else if (qsa_less(a[y], a[z])) qsa_swap(a, result, z);
    else qsa_swap(a, result, y);
}

__device__ int qsa_unguarded_partition(QsaPair* a, int first, int last, int pivot) {
    while (true) {
        while (qsa_less(a[first], a[pivot])) ++first;
        --last;
        while (qsa_less(a[pivot], a[last])) --last;
        if (!(first < last)) return first;
        qsa_swap(a, first, last);
        ++first;
    }
}

__device__ void qsa_insertion_sort(QsaPair* a, int first, int last) {
    for (int i = first + 1; i < last; ++i) {
        QsaPair val = a[i];
        if (qsa_less(val, a[first])) {
            for (int j = i; j > first; --j) a[j] = a[j - 1];
            a[first] = val;
        } else {
            int j = i;
            while (qsa_less(val, a[j - 1])) { a[j] = a[j - 1]; --j; }
            a[j] = val;
        }
    }
}

__device__ int qsa_bit_length(int v) { int b = 0; while (v) { ++b; v >>= 1; } return b; }

// std::nth_element(a, a + nth, a + n) (libstdc++ introselect).
__device__ void qsa_nth_element(QsaPair* a, int n, int nth) {
    int first = 0, last = n;
    if (first == last || nth == last) return;
    int depth = 2 * (qsa_bit_length(last - first) - 1);
    while (last - first > 3) {
        if (depth == 0) {
            qsa_heap_select(a, first, nth + 1, last);
            qsa_swap(a, first, nth);
            return;
        }
        --depth;
        int mid = first + (last - first) / 2;
        qsa_move_median_to_first(a, first, first + 1, mid, last - 1);
        int cut = qsa_unguarded_partition(a, first + 1, last, first);
        if (cut <= nth) first = cut; else last = cut;
    }
    qsa_insertion_sort(a, first, last);
}

// The index set torch.topk(values, k) returns on the CPU (topk.torch_topk_indices): a[0:n] holds (value, index)
// pairs in index order; afterwards a[0:k] holds the chosen ones.
__device__ void qsa_torch_topk(QsaPair* a, int n, int k) {
    if (k <= 0) return;
    if (k > n) k = n;
    if ((long long)k * 64 <= n) qsa_heap_select(a, 0, k, n);  // partial_sort: the heap selection decides the set
    else qsa_nth_element(a, n, k - 1);
}

// ---- block-wide helpers (any blockDim.x up to QSA_MAX_THREADS, including 1) ----
__device__ float qsa_block_reduce(float v, bool is_max, float* red) {
    int t = threadIdx.x, nt = blockDim.x;
    __syncthreads();
    red[t] = v;
    __syncthreads();
    for (int s = 1; s < nt; s <<= 1) {
        if ((t % (2 * s)) == 0 && t + s < nt) red[t] = is_max ? fmaxf(red[t], red[t + s]) : red[t] + red[t + s];
        __syncthreads();
    }
    float r = red[0];
    __syncthreads();
    return r;
}

// Exclusive prefix sum of one int per thread over the block (Hillis-Steele in scan[nt]); *total gets the sum.
__device__ int qsa_block_scan(int f, int* scan, int* total) {
    int t = threadIdx.x, nt = blockDim.x;
    scan[t] = f;
    __syncthreads();
    for (int off = 1; off < nt; off <<= 1) {
        int v = t >= off ? scan[t - off] : 0;
        __syncthreads();
        scan[t] += v;
        __syncthreads();
    }
    int r = scan[t] - f;
    *total = scan[nt - 1];
    __syncthreads();
    return r;
}

// ---- kernels ----------------------------------------------------------------------------------------------------
// When (pos+1) % ratio == 0: bk[b] = rope(k_norm(mean(ik[b*ratio .. b*ratio+ratio)))) with b = (pos+1)/ratio - 1
// (stratatools.runtime.model Qwen4ExpRuntime._select: mean in order, then x / sqrt(mean(x*x) + eps) * w, then NEOX
// RoPE on the first n_rot dims with cos/sin of the block start, given by the host in bcos/bsin). One block.
extern "C" __global__ void qsa_pool(const float* __restrict__ ik, float* __restrict__ bk, const float* __restrict__ knw,
                                    const float* __restrict__ bcos, const float* __restrict__ bsin,
                                    const int* __restrict__ posp, int ratio, int dih, int n_rot, float eps) {
    PDL_ENTRY();
    __shared__ float x[512];
    __shared__ float red[QSA_MAX_THREADS];
    int P = posp[0] + 1;
    if (P % ratio != 0) return;
    int b = P / ratio - 1;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < dih; d += blockDim.x) {
        float s = 0.0f;
        for (int j = 0; j < ratio; ++j) s += ik[((long long)b * ratio + j) * dih + d];
        s = s / (float)ratio;
        x[d] = s;
        ss += s * s;
    }
    ss = qsa_block_reduce(ss, false, red);
    float r = 1.0f / sqrtf(ss / (float)dih + eps);
    for (int d = threadIdx.x; d < dih; d += blockDim.x) x[d] = x[d] * r * knw[d];
    __syncthreads();
    int half = n_rot / 2;
    for (int d = threadIdx.x; d < dih; d += blockDim.x) {
        float v = x[d];
        if (d < n_rot) {
            float rot = d < half ? -x[d + half] : x[d - half];
            v = v * bcos[d] + rot * bsin[d];
        }
        bk[(long long)b * dih + d] = v;
    }
}

// scores[b] = (sum over h < nih of max(q[h] . bk[b], 0)) / sq for the complete blocks b < (pos+1)/ratio (+0.0 for
// an all-zero sum, so that the bit patterns order like the values). One warp per block b, grid-stride.
extern "C" __global__ void qsa_scores(const float* __restrict__ q, const float* __restrict__ bk,
                                      const int* __restrict__ posp, float* __restrict__ scores, int ratio, int nih,
                                      int dih, float sq) {
    PDL_ENTRY();
    int nb = (posp[0] + 1) / ratio;
    int lane = threadIdx.x % QSA_WARP, nwb = blockDim.x / QSA_WARP;
    for (int b = blockIdx.x * nwb + threadIdx.x / QSA_WARP; b < nb; b += gridDim.x * nwb) {
        const float* kb = bk + (long long)b * dih;
        float s = 0.0f;
        for (int h = 0; h < nih; ++h) {
            const float* qh = q + (long long)h * dih;
            float dot = 0.0f;
            for (int d = lane; d < dih; d += QSA_WARP) dot += qh[d] * kb[d];
            dot = qsa_warp_sum(dot);
            s += dot > 0.0f ? dot : 0.0f;
        }
        if (lane == 0) scores[b] = s / sq + 0.0f;
    }
}

// The value of the k-th largest of n non-negative floats (1 <= k <= n) by a 4-pass radix select on their bits, with
// *gt = how many are larger and *eq = how many equal it. Block-wide; shared: hist 256 ints, suf 514 ints, shr 3.
__device__ float qsa_kth_largest(const float* __restrict__ v, int n, int k, int* hist, int* suf, int* shr, int* gt,
                                 int* eq) {
    unsigned prefix = 0, mask = 0;
    int remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            unsigned u = __float_as_uint(v[i]);
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1);
        }
        __syncthreads();
        // suffix sums suf[d] = sum of hist[j >= d] (double-buffered doubling steps), then the one bin d with
        // suf[d] >= remaining > suf[d+1]
        int* A = suf;
        int* B = suf + 257;
        for (int i = threadIdx.x; i < 257; i += blockDim.x) A[i] = i < 256 ? hist[i] : 0;
        __syncthreads();
        for (int off = 1; off < 256; off <<= 1) {
            for (int i = threadIdx.x; i < 256; i += blockDim.x) B[i] = A[i] + (i + off < 256 ? A[i + off] : 0);
            if (threadIdx.x == 0) B[256] = 0;
            __syncthreads();
            int* tmp = A; A = B; B = tmp;
        }
        for (int i = threadIdx.x; i < 256; i += blockDim.x)
            if (A[i] >= remaining && A[i + 1] < remaining) { shr[0] = i; shr[1] = A[i + 1]; shr[2] = hist[i]; }
        __syncthreads();
        int d = shr[0];
        remaining -= shr[1];
        prefix |= (unsigned)d << shift;
        mask |= 255u << shift;
        if (shift == 0) { *eq = shr[2]; }
        __syncthreads();
    }
    *gt = k - remaining;
    return __uint_as_float(prefix);
}

// The cells a decode query at pos attends: cells[0..*ncell) (ascending), from the block scores of the complete
// blocks b < nb = (pos+1)/ratio. rule 0 (transformers): the blocks torch.topk(scores, min(budget/ratio, nb)) keeps,
// plus the incomplete tail; rule 1 (llamacpp): the top budget+ratio-1 cells of the cell scores (block score, +inf
// for the tail) as libstdc++'s partial_sort selects them. Ties: when the tied values at the threshold are all taken
// the set follows from the threshold alone; else thread 0 replays the CPU algorithm (qsa_torch_topk /
// qsa_heap_select) over pairs[]. flags: scratch of max(nb, pos+1) ints; pairs: scratch of pos+1 pairs. One block.
extern "C" __global__ void qsa_select(const float* __restrict__ scores, const int* __restrict__ posp, int ratio,
                                      int budget, int rule, int* __restrict__ flags, QsaPair* __restrict__ pairs,
                                      int* __restrict__ cells, int* __restrict__ ncell) {
    PDL_ENTRY();
    __shared__ int hist[256];
    __shared__ int suf[514];
    __shared__ int shr[4];
    __shared__ int scan[QSA_MAX_THREADS];
    int t = threadIdx.x, nt = blockDim.x;
    int P = posp[0] + 1, nb = P / ratio, tail0 = nb * ratio;
    // flags: per block (rule 0) or per cell (rule 1): 1 = attended
    int all = 0;
    if (rule == 0) {
        int take = budget / ratio < nb ? budget / ratio : nb;
        if (take >= nb) all = 1;
        else if (take <= 0) { for (int b = t; b < nb; b += nt) flags[b] = 0; }
        else {
            int gt, eq;
            float th = qsa_kth_largest(scores, nb, take, hist, suf, shr, &gt, &eq);
            bool exact = (gt + eq == take);
            for (int b = t; b < nb; b += nt) flags[b] = exact ? (scores[b] >= th) : 0;
            if (!exact) {
                for (int b = t; b < nb; b += nt) { pairs[b].v = scores[b]; pairs[b].i = b; }
                __syncthreads();
                if (t == 0) {
                    qsa_torch_topk(pairs, nb, take);
                    for (int j = 0; j < take; ++j) flags[pairs[j].i] = 1;
                }
            }
        }
    } else {
        int k = budget + ratio - 1;
        if (k >= P) all = 1;
        else {
            int need = k - (P - tail0);  // cells from complete blocks (the whole tail is taken: it is < ratio <= k)
            int kb = (need + ratio - 1) / ratio;
            int gt = 0, eq = 0;
            float th = 0.0f;
            if (kb > 0) th = qsa_kth_largest(scores, nb, kb, hist, suf, shr, &gt, &eq);
            bool exact = kb == 0 || (gt + eq) * ratio == need;
            for (int c = t; c < P; c += nt)
                flags[c] = c >= tail0 ? 1 : (exact && kb > 0 ? (scores[c / ratio] >= th) : 0);
            if (!exact) {
                for (int c = t; c < P; c += nt) { pairs[c].v = c >= tail0 ? QSA_POS_INF : scores[c / ratio]; pairs[c].i = c; }
                __syncthreads();
                if (t == 0) {
                    qsa_heap_select(pairs, 0, k, P);
                    for (int c = 0; c < tail0; ++c) flags[c] = 0;
                    for (int j = 0; j < k; ++j) flags[pairs[j].i] = 1;
                }
            }
        }
    }
    __syncthreads();
    // compaction, ascending: rule 0 (or all) lists the attended blocks' cells then the tail, rule 1 the flagged cells
    int base = 0, total = 0;
    int unit = rule == 0 || all ? ratio : 1;
    int n_items = rule == 0 || all ? nb : P;
    for (int i0 = 0; i0 < n_items; i0 += nt) {
        int i = i0 + t;
        int f = i < n_items ? (all ? 1 : flags[i]) : 0;
        int at = qsa_block_scan(f, scan, &total);
        if (f) for (int j = 0; j < unit; ++j) cells[base + at * unit + j] = i * unit + j;
        base += total * unit;
    }
    if (unit == ratio)
        for (int c = tail0 + t; c < P; c += nt) cells[base + c - tail0] = c;
    if (unit == ratio) base += P - tail0;
    if (t == 0) ncell[0] = base;
}

// Attention of one decode query over n = *ncell cells (use_cells 0: n = pos+1, cell i is position i), split
// into gridDim.y parts: part s of head h covers list entries [s*chunk, (s+1)*chunk) and writes its max m, its sum
// l of exp(score - m) and acc[d] = sum exp(score - m) V[cell, d] to part[(h * S + s) * (hd + 2) ...]. Scores are
// q_h . K[cell, kv(h)] * scale; sc: scratch [nh, max_ctx] floats. K, V: [max_ctx, nkv, hd].
extern "C" __global__ void attn_sel_partial(const float* __restrict__ q, const float* __restrict__ K,
                                            const float* __restrict__ V, const int* __restrict__ cells,
                                            const int* __restrict__ ncell, int use_cells, const int* __restrict__ posp,
                                            float* __restrict__ sc, float* __restrict__ part, int nh, int nkv, int hd,
                                            float scale, int max_ctx) {
    PDL_ENTRY();
    __shared__ float red[QSA_MAX_THREADS];
    int h = blockIdx.x, s = blockIdx.y, S = gridDim.y, kvh = h / (nh / nkv);
    int n = use_cells ? ncell[0] : posp[0] + 1;
    int chunk = (n + S - 1) / S;
    int i0 = s * chunk, i1 = i0 + chunk < n ? i0 + chunk : n;
    const float* qh = q + (long long)h * hd;
    float* sch = sc + (long long)h * max_ctx;
    float m = QSA_NEG_INF;
    int lane = threadIdx.x % QSA_WARP, nwb = blockDim.x / QSA_WARP;
    for (int i = i0 + threadIdx.x / QSA_WARP; i < i1; i += nwb) {  // one warp per cell, lanes over the head dims
        int c = use_cells ? cells[i] : i;
        const float* kp = K + ((long long)c * nkv + kvh) * hd;
        float dot = 0.0f;
        for (int d = lane; d < hd; d += QSA_WARP) dot += qh[d] * kp[d];
        dot = qsa_warp_sum(dot) * scale;
        if (lane == 0) sch[i] = dot;
        m = fmaxf(m, dot);
    }
    __syncthreads();  // sch written by lane 0s is read by every thread below (global memory, same block)
    m = qsa_block_reduce(m, true, red);
    float l = 0.0f;
    for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        float e = expf(sch[i] - m);
        sch[i] = e;
        l += e;
    }
    l = qsa_block_reduce(l, false, red);
    float* out = part + ((long long)h * S + s) * (hd + 2);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        const float* vp = V + (long long)kvh * hd + d;
        for (int i = i0; i < i1; ++i) {
            int c = use_cells ? cells[i] : i;
            acc += sch[i] * vp[(long long)c * nkv * hd];
        }
        out[2 + d] = acc;
    }
    if (threadIdx.x == 0) { out[0] = m; out[1] = l; }
}

// out[h, d] = sum_s exp(m_s - M) acc_s[d] / sum_s exp(m_s - M) l_s, M = max_s m_s (parts without cells: m = -inf).
extern "C" __global__ void attn_sel_combine(const float* __restrict__ part, float* __restrict__ out, int S, int hd) {
    PDL_ENTRY();
    int h = blockIdx.x;
    const float* ph = part + (long long)h * S * (hd + 2);
    float M = QSA_NEG_INF;
    for (int s = 0; s < S; ++s) M = fmaxf(M, ph[s * (hd + 2)]);
    float L = 0.0f;
    for (int s = 0; s < S; ++s) {
        float ms = ph[s * (hd + 2)];
        if (ms != QSA_NEG_INF) L += expf(ms - M) * ph[s * (hd + 2) + 1];
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < S; ++s) {
            float ms = ph[s * (hd + 2)];
            if (ms != QSA_NEG_INF) acc += expf(ms - M) * ph[s * (hd + 2) + 2 + d];
        }
        out[(long long)h * hd + d] = acc / L;
    }
}
