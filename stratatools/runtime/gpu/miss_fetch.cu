// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by decode.py (cupy.RawModule);
// tests/test_gpu_miss_fetch_host.py compiles it as host C++ (host_kernel_shim.cuh: one thread per block, blocks run one
// after another) and checks it against numpy.
//
// Missed experts of the offloaded decode step copied into device memory by the SMs before the expert kernels run
// (StaticDecoder miss fetch modes, issue 17): the expert kernels then read every blob from device memory (slots or
// staging), and the bus carries each missed blob once, in one wide burst per layer, instead of the expert kernels'
// own reads of mapped host memory interleaved with their arithmetic. A blob is an expert's gate, up and down matrices
// back to back (tier.py HostArena): its address is the gate's, up = + gate_bytes, down = + 2 gate_bytes.
//
// fetch_blobs: job j (blockIdx.y, j < k) has blob address src[j] and expert id ids[j]. When src[j] lies in the mapped
// host arena [host_lo, host_hi) (a miss), the blob is found among the n_pf prefetched experts (pf_ids[i] == ids[j]
// with pf_addr[i] outside the host arena: already copied, by a fetch_blobs call on the side stream during the previous
// layer), or else copied to staging + j * slot_bytes, the blocks of the job (gridDim.x of them) each copying one part;
// the job's three matrix addresses go to out0/out1/out2[j] (unchanged for a resident expert). counters (may be null):
// c[0] += bytes copied, c[1] += jobs copied, c[2] += jobs served by a prefetched copy. Any block size and grid.

#ifdef STRATA_HOST
static inline void mf_add(unsigned long long* p, unsigned long long v) { *p += v; }
#else
__device__ __forceinline__ void mf_add(unsigned long long* p, unsigned long long v) { atomicAdd(p, v); }
#endif

//: 16-byte loads each thread keeps in flight while copying
#define MF_UNROLL 4

extern "C" __global__ void fetch_blobs(const unsigned long long* __restrict__ src, const int* __restrict__ ids, int k,
                                       unsigned long long host_lo, unsigned long long host_hi,
                                       const int* __restrict__ pf_ids, const unsigned long long* __restrict__ pf_addr,
                                       int n_pf, unsigned char* __restrict__ staging, long long slot_bytes,
                                       long long blob_bytes, long long gate_bytes, unsigned long long* __restrict__ out0,
                                       unsigned long long* __restrict__ out1, unsigned long long* __restrict__ out2,
                                       unsigned long long* __restrict__ counters) {
    const int j = blockIdx.y;
    if (j >= k) return;
    const unsigned long long a = src[j];
    const bool miss = a >= host_lo && a < host_hi;
    unsigned long long dst = a;
    bool copy = false, reused = false;
    if (miss) {
        const int e = ids[j];
        for (int i = 0; i < n_pf; ++i) {
            const unsigned long long p = pf_addr[i];
            if (pf_ids[i] == e && p != 0ull && !(p >= host_lo && p < host_hi)) {
                dst = p;
                reused = true;
                break;
            }
        }
        if (!reused) {
            dst = reinterpret_cast<unsigned long long>(staging) + (unsigned long long)j * (unsigned long long)slot_bytes;
            copy = true;
        }
    }
    if (copy) {
        const unsigned char* s = reinterpret_cast<const unsigned char*>(a);
        unsigned char* d = reinterpret_cast<unsigned char*>(dst);
        const int tid = threadIdx.x, nt = blockDim.x;
        if (((a | dst | (unsigned long long)blob_bytes) & 15ull) == 0ull) {
            const long long n16 = blob_bytes >> 4;
            const long long per = (n16 + gridDim.x - 1) / gridDim.x;
            const long long c0 = (long long)blockIdx.x * per;
            const long long c1 = c0 + per < n16 ? c0 + per : n16;
            const uint4* s4 = reinterpret_cast<const uint4*>(s);
            uint4* d4 = reinterpret_cast<uint4*>(d);
            for (long long c = c0 + tid; c < c1; c += (long long)nt * MF_UNROLL) {
                uint4 v[MF_UNROLL];
                #pragma unroll
                for (int u = 0; u < MF_UNROLL; ++u) {
                    const long long cu = c + (long long)u * nt;
                    if (cu < c1) v[u] = s4[cu];
                }
                #pragma unroll
                for (int u = 0; u < MF_UNROLL; ++u) {
                    const long long cu = c + (long long)u * nt;
                    if (cu < c1) d4[cu] = v[u];
                }
            }
        } else {  // unaligned blob (not met with the tier's layouts): byte by byte
            const long long per = (blob_bytes + gridDim.x - 1) / gridDim.x;
            const long long c0 = (long long)blockIdx.x * per;
            const long long c1 = c0 + per < blob_bytes ? c0 + per : blob_bytes;
            for (long long c = c0 + tid; c < c1; c += nt) d[c] = s[c];
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        out0[j] = dst;
        out1[j] = dst + (unsigned long long)gate_bytes;
        out2[j] = dst + 2ull * (unsigned long long)gate_bytes;
        if (counters != nullptr) {
            if (copy) {
                mf_add(counters, (unsigned long long)blob_bytes);
                mf_add(counters + 1, 1ull);
            }
            if (reused) mf_add(counters + 2, 1ull);
        }
    }
}
