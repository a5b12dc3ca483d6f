// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by prefill.py and batch.py (kernels.cuda_unit:
// with step_common.cuh in place of its #include; cupy.RawModule,
// multiply-add fusion allowed: the batched paths agree with the decode step by tolerance); tests/test_gpu_gdn_prep_host.py
// compiles it as host C++ (host_kernel_shim.cuh: one thread per block, blocks run one after another) and checks it
// against the numpy formulas of stratatools.runtime.model (the CPU path's gated DeltaNet).
//
// The element-wise parts of the gated DeltaNet (GDN) around the recurrence (prefill.cu pf_gdn_chunk) for R rows at
// once, in two launches instead of about twenty array operations:
//   pf_gdn_prep: causal depthwise conv over [conv state; the sequence's rows] + SiLU, L2 norms of the q and k heads
//                (q also scaled by qscale = dk^-1/2), beta = sigmoid(b), decay = exp(ssm_a softplus(a + dt_bias)),
//                and each sequence's next conv state;
//   pf_gdn_out:  per value head RMS norm of the recurrence output times the norm weight, times the output gate's
//                activation of z (sigmoid or SiLU).
// The R rows are nseq sequences of len rows each (row r = s len + u): the prefill is one sequence of T rows, the
// batched decode step T sequences (places) of one row, each with its own conv state.
//
// Written for any block size: a block's threads stride over its row's values, its warps over heads (lanes =
// min(32, blockDim.x)), so the host build (blocks of one thread) runs the same code.

#include "step_common.cuh"  // step_sigm, step_softplus, step_warp_sum, STEP_DYN_SHARED
#include "pdl.cuh"          // PDL_ENTRY: every kernel begins with it (launch.py BATCH_PDL_KERNELS)

// qkv [R, C] (rows ldq floats apart): the conv input of every row (C = 2 nk dk + nv dv: q heads, k heads, v heads);
// state [nseq, K-1, C]: each sequence's previous K-1 inputs, oldest first; state_out [nseq, K-1, C]: the K-1 inputs
// after the sequence's rows (written by the block of its last row; state itself may be given where every sequence
// has one row: a channel's thread reads its inputs before it writes them, no other reads them); wc [C, K]; b, a
// [R, nv] (rows ldb floats apart: both can be columns of one product's output, as the batched step's joined
// in-projection gives them); ssm_a, dt_bias [nv].
// Outputs: qn, kn [R, nk, dk] (L2-normalised with eps 1e-6; qn times qscale), v [R, nv dv] (conv + SiLU of the v
// part), beta, decay [R, nv]. Grid: (any number of blocks (rows by grid stride), P parts): the C channels of a row are
// U = 2 nk + ceil(nv dv / dk) units of dk (the q and k heads, then pieces of the v channels), part p takes units
// [p ceil(U / P), ...) (its heads normed by its own block) and part 0 beta and decay, so that a batched step's few rows
// fill the device (32 rows: 32 blocks of 36.8 us before). Shared: 2 nk dk floats.
#define PF_CONV_KMAX 8  // conv taps a thread keeps in registers (longer convs read the rest again)
extern "C" __global__ void pf_gdn_prep(const float* __restrict__ qkv, const float* state, float* state_out,
                                       const float* __restrict__ wc, int C, int K, int nseq, int len,
                                       const float* __restrict__ b, const float* __restrict__ a,
                                       const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, int nk,
                                       int dk, int nv, float qscale, float* __restrict__ qn, float* __restrict__ kn,
                                       float* __restrict__ v, float* __restrict__ beta, float* __restrict__ decay,
                                       int ldq, int ldb) {
    PDL_ENTRY();
    STEP_DYN_SHARED(float, qk);
    const int tid = threadIdx.x, nt = blockDim.x;
    const int lanes = nt < 32 ? nt : 32, warps = nt / lanes > 0 ? nt / lanes : 1;
    const int warp = tid / lanes, lane = tid % lanes;
    const int nqk = 2 * nk * dk, km1 = K - 1, R = nseq * len;
    const int U = 2 * nk + (C - nqk + dk - 1) / dk, UP = (U + (int)gridDim.y - 1) / (int)gridDim.y;
    const int u0 = min(U, (int)blockIdx.y * UP), u1 = min(U, u0 + UP);
    const int ch0 = u0 * dk, ch1 = min(C, u1 * dk);  // the part's channels
    for (int r = blockIdx.x; r < R; r += gridDim.x) {
        const int s = r / len, u = r - s * len;
        const float* st = state + (long long)s * km1 * C;
        const float* rows = qkv + (long long)s * len * ldq;  // the sequence's first row
        for (int c = ch0 + tid; c < ch1; c += nt) {
            auto input = [&](int xi) {  // position xi of [state; rows]
                return xi < km1 ? st[(long long)xi * C + c] : rows[(long long)(xi - km1) * ldq + c];
            };
            float acc = 0.0f, xin[PF_CONV_KMAX];  // (the first PF_CONV_KMAX inputs kept: one row a sequence writes
            #pragma unroll                       // its next state from them, no load after a store of state_out)
            for (int i = 0; i < PF_CONV_KMAX; ++i) {
                if (i < K) {
                    xin[i] = input(u + i);
                    acc += xin[i] * wc[(long long)c * K + i];
                }
            }
            for (int i = PF_CONV_KMAX; i < K; ++i) acc += input(u + i) * wc[(long long)c * K + i];
            const float y = acc * step_sigm(acc);
            if (c < nqk) qk[c - ch0] = y;
            else v[(long long)r * (C - nqk) + (c - nqk)] = y;
            if (u == len - 1) {  // the sequence's next conv state: [state; rows] positions len .. len + K - 2
                #pragma unroll
                for (int i = 0; i < PF_CONV_KMAX - 1; ++i)
                    if (i < km1) state_out[((long long)s * km1 + i) * C + c] = len == 1 ? xin[i + 1] : input(len + i);
                for (int i = PF_CONV_KMAX - 1; i < km1; ++i)
                    state_out[((long long)s * km1 + i) * C + c] = input(len + i);
            }
        }
        __syncthreads();
        for (int h = u0 + warp; h < min(u1, 2 * nk); h += warps) {  // heads 0 .. nk-1: q, nk .. 2 nk-1: k
            const float* x = qk + (h - u0) * dk;
            float ss = 0.0f;
            for (int i = lane; i < dk; i += lanes) ss += x[i] * x[i];
            ss = step_warp_sum(ss);
            const float inv = 1.0f / sqrtf(ss + 1e-6f);
            float* o = h < nk ? qn + ((long long)r * nk + h) * dk : kn + ((long long)r * nk + (h - nk)) * dk;
            if (h < nk) {
                for (int i = lane; i < dk; i += lanes) o[i] = (x[i] * inv) * qscale;
            } else {
                for (int i = lane; i < dk; i += lanes) o[i] = x[i] * inv;
            }
        }
        for (int j = blockIdx.y == 0 ? tid : nv; j < nv; j += nt) {
            const long long i = (long long)r * nv + j, ib = (long long)r * ldb + j;
            beta[i] = step_sigm(b[ib]);
            decay[i] = expf(ssm_a[j] * step_softplus(a[ib] + dt_bias[j]));
        }
        __syncthreads();  // qk is rewritten by the block's next row
    }
}

// o [R, nv dv]: the recurrence's output; z [R, nv dv] (rows ldz floats apart): the output gate's input; norm_w: wlen
// floats (indexed by the value's place in the row modulo wlen: per head (dv) or whole row (nv dv)).
// y[r, j dv + c] = (o * rn_j) * norm_w * act(z) with rn_j = 1 / sqrt(mean over the head's dv values of o^2 + eps),
// act sigmoid (sigmoid_gate) or SiLU.
// Grid: (any number of blocks (rows by grid stride), P): the heads go to the warps of the P blocks of a row.
extern "C" __global__ void pf_gdn_out(const float* __restrict__ o, const float* __restrict__ z,
                                      const float* __restrict__ norm_w, int wlen, float eps, int sigmoid_gate, int R,
                                      int nv, int dv, float* __restrict__ y, int ldz) {
    PDL_ENTRY();
    const int tid = threadIdx.x, nt = blockDim.x;
    const int lanes = nt < 32 ? nt : 32, warps = nt / lanes > 0 ? nt / lanes : 1;
    const int warp = tid / lanes, lane = tid % lanes;
    for (int r = blockIdx.x; r < R; r += gridDim.x) {
        for (int j = (int)blockIdx.y * warps + warp; j < nv; j += warps * (int)gridDim.y) {
            const long long base = (long long)r * nv * dv + (long long)j * dv;
            float ss = 0.0f;
            for (int c = lane; c < dv; c += lanes) ss += o[base + c] * o[base + c];
            ss = step_warp_sum(ss);
            const float rn = 1.0f / sqrtf(ss / (float)dv + eps);
            for (int c = lane; c < dv; c += lanes) {
                const float zz = z[(long long)r * ldz + (long long)j * dv + c];
                const float act = sigmoid_gate ? step_sigm(zz) : zz * step_sigm(zz);
                y[base + c] = ((o[base + c] * rn) * norm_w[(j * dv + c) % wlen]) * act;
            }
        }
    }
}
