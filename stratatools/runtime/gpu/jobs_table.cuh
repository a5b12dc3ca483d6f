// Part of stratatools (stratatools/runtime/gpu). The expert job table built on the device, as a block's device
// function (qmm_jobs_table): qmm.cu's qmm_jobs launches it alone, prefill.cu's pf_route_jobs after the routing in the
// same block. Both include it with #include "jobs_table.cuh" (kernels.cuda_unit puts this text in place for NVRTC and
// for the host builds); it needs prelude.cuh's u32 / u64.
#ifndef STRATA_JOBS_TABLE_CUH
#define STRATA_JOBS_TABLE_CUH
// ids [N]: the expert of pair i = t k + r (0 <= id < E); ptr_row [E]: the layer's blob addresses (the decoder's slot
// table row). Writes the jobs of prefill.py expert_jobs (experts in increasing id, each expert's pairs in increasing
// pair index, jt slots a job: 8, 16 or 32): job_ptr [jmax], job_tok / job_dst [jmax jt] (token t and pair i of each
// slot, -1 for an empty slot); the jobs past the last are empty (their first slot -1, job_ptr that of expert 0: the
// job kernels return at once on them). jmax >= ceil(N / jt) + min(E, N) holds every routing. One block (grid 1 x 1),
// any block size nt <= qmm.py JOBS_THREADS, a multiple of 32 (the host build: one thread). Dynamic shared memory
// (qmm.py jobs_shared): 3 E + 1 + 2 JOBS_THREADS ints (of the last, the scan uses 2 (nt / 32)) and M keys, M the power
// of two >= N; E N < 2^32.
// The pairs are ordered by a bitonic sort of the keys e N + i in shared memory (log2(M) (log2(M) + 1) / 2 passes of
// M / 2 compare-exchanges, a barrier each): a pair's rank within its expert is then its sorted position minus the
// expert's first position, and the table comes out the same for any block size (no atomics decide an order). Up to
// QMM_JOBS_RANK_MAX pairs the rank is counted directly instead (the 45 barriers of the sort of 320 pairs took most of
// the 16.8 us a launch of the 32-sequence step, H200, bench/gpu-notes.md).
#ifndef QMM_JOBS_RANK_MAX
#define QMM_JOBS_RANK_MAX 1024
#endif
// (ids not __restrict__: pf_route_jobs reads here what its block wrote earlier in the same launch)
__device__ __forceinline__ void qmm_jobs_table(const int* ids, int N, int k, int E,
                                               const u64* __restrict__ ptr_row, int jmax, int jt,
                                               u64* __restrict__ job_ptr, int* __restrict__ job_tok,
                                               int* __restrict__ job_dst, int* smem) {
    int* cnt = smem;
    int* js = cnt + E;       // first job of expert e
    int* first = js + E;     // first sorted position of expert e's pairs
    int* jused = first + E;  // jobs the routing fills
    const int tid = threadIdx.x, nt = blockDim.x;
    int* tj = jused + 1;     // [nt] the threads' job sums, then their inclusive scan
    int* tp = tj + nt;       // [nt] the same of pairs
    u32* key = reinterpret_cast<u32*>(tp + nt);
    int M = 1, lm = 0;
    while (M < N) { M <<= 1; ++lm; }
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
    if (tid == 0) {  // the warps' totals -> their exclusive prefixes; the jobs the routing fills
        int aj = 0, ap = 0;
        for (int w = 0; w < nwarps; ++w) {
            const int vj = tj[w], vp = tp[w];
            tj[w] = aj; tp[w] = ap;
            aj += vj; ap += vp;
        }
        *jused = aj;
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
        // same expert (at most N compares a thread, the warp's reads of key[q] one broadcast), no sort
        __syncthreads();
        for (int p = tid; p < N; p += nt) {
            const u32 e = key[p] / (u32)N, lo = e * (u32)N;  // (pair q is expert e's when key[q] - lo < N)
            int r = 0;
            for (int q = 0; q < p; ++q) r += key[q] - lo < (u32)N;
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
#endif  // STRATA_JOBS_TABLE_CUH
