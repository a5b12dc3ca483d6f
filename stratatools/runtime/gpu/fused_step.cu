// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by decode.py (kernels.cuda_unit: with
// step_common.cuh in place of its #include) and compiled with NVRTC
// (cupy.RawModule, multiply-add fusion allowed: the fast step agrees with the reference step by tolerance);
// tests/test_gpu_fused_host.py compiles it as host C++ (host_kernel_shim.cuh: one thread per block, blocks run
// one after another) and checks every kernel against the numpy formulas of stratatools.runtime.model.
// Fused kernels of the batch-1 decode step (decode.py StaticDecoder(fused=True)): the gated-DeltaNet step, the
// PLE block, hyper-connection inject + RMS norm, the hyper-connection mix.
//
// Every kernel is written for any block size (threads stride over their items; reductions through step_block_sum),
// so that the host build, which runs blocks of one thread, executes the same code.
#include "pdl.cuh"  // pdl_wait, pdl_trigger, PDL_ENTRY (programmatic dependent launch)

#include "step_common.cuh"  // step_sigm, step_softplus, step_block_sum, STEP_DYN_SHARED

// ---- gated DeltaNet, part 1: causal depthwise conv + SiLU, conv-state shift, per-head beta and decay ----------
// qkv[C]: this step's conv input; state[(K-1), C]: the previous K-1 inputs (oldest first), shifted in place;
// wc[C, K]; out[i] = silu(sum_k xin[k] wc[i, k]) with xin = [state; qkv]. For the nv value heads:
// beta[j] = sigmoid(b[j]), decay[j] = exp(ssm_a[j] * softplus(a[j] + dt_bias[j])). Any grid (grid-stride).
extern "C" __global__ void gdn_conv(const float* __restrict__ qkv, float* __restrict__ state, const float* __restrict__ wc,
                                    int C, int K, const float* __restrict__ b, const float* __restrict__ a,
                                    const float* __restrict__ ssm_a, const float* __restrict__ dt_bias, int nv,
                                    float* __restrict__ out, float* __restrict__ beta, float* __restrict__ decay) {
    PDL_ENTRY();
    const int stride = gridDim.x * blockDim.x;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < C; i += stride) {
        const float xn = qkv[i];
        const float* w = wc + (long long)i * K;
        float acc = 0.0f;
        for (int k = 0; k < K - 1; ++k) acc += state[(long long)k * C + i] * w[k];
        acc += xn * w[K - 1];
        for (int k = 0; k + 1 < K - 1; ++k) state[(long long)k * C + i] = state[(long long)(k + 1) * C + i];
        if (K > 1) state[(long long)(K - 2) * C + i] = xn;
        out[i] = acc * step_sigm(acc);
    }
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < nv; j += stride) {
        beta[j] = step_sigm(b[j]);
        decay[j] = expf(ssm_a[j] * step_softplus(a[j] + dt_bias[j]));
    }
}

// ---- gated DeltaNet, part 2: the recurrent step, value head j = blockIdx.x, columns split over gridDim.y blocks ----
// conv[C] (gdn_conv's out): q = conv[0, nk dk), k = conv[nk dk, 2 nk dk), v = conv[2 nk dk, ...); value head j
// uses key group j % nk (the CPU path tiles q and k). q, k are L2-normalised (eps 1e-6), q scaled by dk^-1/2.
// S[j] ([dk, dv], row-major) <- decay_j S[j] + k (x) delta with delta = (v_j - k^T (decay_j S[j])) beta_j;
// o = q^T S[j]; out[j dv + c] = rmsnorm(o)[c] * norm_w[(j dv + c) % wlen] * act(z[j dv + c]) with act sigmoid
// (sigmoid_gate) or SiLU. Block (j, b) owns columns [b cw, (b+1) cw) of head j (cw = ceil(dv / gridDim.y)): it
// writes o there into obuf and its share of sum(o^2) into sspart[j gridDim.y + b]; the head's last block to finish
// (counter[j], reset to 0 by that block) applies the norm and the gate to all dv columns.
// Shared: (2 dk + (rs + 1) cw) floats, rs = max(1, blockDim / cw).
extern "C" __global__ void gdn_recur(const float* __restrict__ conv, const float* __restrict__ beta,
                                     const float* __restrict__ decay, float* __restrict__ S, const float* __restrict__ z,
                                     const float* __restrict__ norm_w, int wlen, int nk, int dk, int dv, float eps,
                                     int sigmoid_gate, float* __restrict__ obuf, float* __restrict__ sspart,
                                     int* __restrict__ counter, float* __restrict__ out) {
    PDL_ENTRY();
    STEP_DYN_SHARED(float, sh);
    __shared__ float red[32];
    __shared__ int last;
    const int j = blockIdx.x, g = j % nk, tid = threadIdx.x, nt = blockDim.x;
    const int ncb = gridDim.y, cw = (dv + ncb - 1) / ncb, c0 = blockIdx.y * cw;
    const int nc = dv - c0 < cw ? dv - c0 : cw;  // columns of this block (>= 1 when ncb <= dv)
    const int rs = nc > 0 && nt / nc > 1 ? nt / nc : 1;
    float* q = sh;
    float* k = sh + dk;
    float* vec = sh + 2 * dk;
    float* part = vec + cw;
    const int nkd = nk * dk;
    float sq = 0.0f, sk = 0.0f;
    for (int r = tid; r < dk; r += nt) {
        float a = conv[g * dk + r], c = conv[nkd + g * dk + r];
        q[r] = a; k[r] = c;
        sq += a * a; sk += c * c;
    }
    sq = step_block_sum(sq, red);
    sk = step_block_sum(sk, red);
    const float qs = (1.0f / sqrtf(sq + 1e-6f)) * (1.0f / sqrtf((float)dk));
    const float ks = 1.0f / sqrtf(sk + 1e-6f);
    for (int r = tid; r < dk; r += nt) { q[r] = q[r] * qs; k[r] = k[r] * ks; }
    __syncthreads();
    const float dec = decay[j], bj = beta[j];
    float* Sj = S + (long long)j * dk * dv;
    // pass 1: kv[c] = sum_r k[r] * decay S[r, c], rows split in rs slices
    for (int idx = tid; idx < rs * nc; idx += nt) {
        int cl = idx % nc, s = idx / nc, c = c0 + cl;
        float acc = 0.0f;
        for (int r = s; r < dk; r += rs) acc += k[r] * (Sj[(long long)r * dv + c] * dec);
        part[s * cw + cl] = acc;
    }
    __syncthreads();
    const float* v = conv + 2 * nkd + (long long)j * dv;
    for (int cl = tid; cl < nc; cl += nt) {
        float kv = 0.0f;
        for (int s = 0; s < rs; ++s) kv += part[s * cw + cl];
        vec[cl] = (v[c0 + cl] - kv) * bj;
    }
    __syncthreads();
    // pass 2: S <- decay S + k delta^T, o[c] = sum_r q[r] S[r, c]
    for (int idx = tid; idx < rs * nc; idx += nt) {
        int cl = idx % nc, s = idx / nc, c = c0 + cl;
        float d = vec[cl], acc = 0.0f;
        for (int r = s; r < dk; r += rs) {
            long long o = (long long)r * dv + c;
            float sn = Sj[o] * dec + k[r] * d;
            Sj[o] = sn;
            acc += q[r] * sn;
        }
        part[s * cw + cl] = acc;
    }
    __syncthreads();
    float ss = 0.0f;
    for (int cl = tid; cl < nc; cl += nt) {
        float o = 0.0f;
        for (int s = 0; s < rs; ++s) o += part[s * cw + cl];
        obuf[(long long)j * dv + c0 + cl] = o;
        ss += o * o;
    }
    __threadfence();  // every thread's obuf writes are visible device-wide before thread 0 counts this block
    ss = step_block_sum(ss, red);
    if (tid == 0) {
        sspart[j * ncb + blockIdx.y] = ss;
        __threadfence();
        last = atomicAdd(&counter[j], 1) == ncb - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    float tot = 0.0f;
    for (int b = 0; b < ncb; ++b) tot += __ldcg(&sspart[j * ncb + b]);
    const float rn = 1.0f / sqrtf(tot / (float)dv + eps);
    for (int c = tid; c < dv; c += nt) {
        long long i = (long long)j * dv + c;
        float zz = z[i];
        float act = sigmoid_gate ? step_sigm(zz) : zz * step_sigm(zz);
        out[i] = (__ldcg(&obuf[i]) * rn) * norm_w[i % wlen] * act;
    }
    if (tid == 0) counter[j] = 0;
}

// ---- PLE block (stratatools.runtime.model Qwen4ExpRuntime._ple for one token), added to H in place -------------
// Block h handles hyper-connection stream h (values [h n, (h+1) n) of H, kraw, the conv state and weights):
// key = rmsnorm(kraw_h) wk, q = rmsnorm(H_h) wq, gate = dot(key, q) / sqrt(n), gate = sqrt(max(|gate|, 1e-6)) sign(gate),
// gv = sigmoid(gate) value, gvn = rmsnorm(gv) wcn; dilated causal conv over [buf; gvn] (kernel K, dilation d,
// buf: the span = (K-1) d previous gvn rows [span, hc n], shifted in place); H_h += gv + silu(conv).
// Weights are indexed by the flat position modulo their length (wkl, wql, wcl). Grid: hc blocks.
extern "C" __global__ void ple_fused(float* __restrict__ H, const float* __restrict__ kraw, const float* __restrict__ value,
                                     const float* __restrict__ wk, int wkl, const float* __restrict__ wq, int wql,
                                     const float* __restrict__ wcn, int wcl, float* __restrict__ buf,
                                     const float* __restrict__ wconv, int K, int d, int n, int hc, float eps) {
    PDL_ENTRY();
    __shared__ float red[32];
    const int h = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const long long base = (long long)h * n, C = (long long)hc * n;
    float sk = 0.0f, sq = 0.0f;
    for (int i = tid; i < n; i += nt) {
        float a = kraw[base + i], b = H[base + i];
        sk += a * a; sq += b * b;
    }
    sk = step_block_sum(sk, red);
    sq = step_block_sum(sq, red);
    const float rk = 1.0f / sqrtf(sk / (float)n + eps), rq = 1.0f / sqrtf(sq / (float)n + eps);
    float dt = 0.0f, sg2 = 0.0f;
    for (int i = tid; i < n; i += nt) {
        long long f = base + i;
        dt += ((kraw[f] * rk) * wk[f % wkl]) * ((H[f] * rq) * wq[f % wql]);
        sg2 += value[i] * value[i];
    }
    dt = step_block_sum(dt, red);
    sg2 = step_block_sum(sg2, red);
    float gate = dt / sqrtf((float)n);
    gate = sqrtf(fmaxf(fabsf(gate), 1e-6f)) * (float)((gate > 0.0f) - (gate < 0.0f));
    const float sg = step_sigm(gate);
    // sum of gv^2 = sg^2 * sum value^2 (gv = sg * value)
    const float rg = 1.0f / sqrtf((sg * sg * sg2) / (float)n + eps);
    const int span = (K - 1) * d;
    for (int i = tid; i < n; i += nt) {
        long long col = base + i;
        float gv = sg * value[i];
        float gvn = (gv * rg) * wcn[col % wcl];
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) {
            int r = k * d;
            float xv = r < span ? buf[(long long)r * C + col] : gvn;
            acc += xv * wconv[col * K + k];
        }
        for (int r = 0; r + 1 < span; ++r) buf[(long long)r * C + col] = buf[(long long)(r + 1) * C + col];
        if (span > 0) buf[(long long)(span - 1) * C + col] = gvn;
        H[col] = H[col] + (gv + acc * step_sigm(acc));
    }
}

// ---- hyper-connections ----------------------------------------------------------------------------------------
// RMS norm of each of the hc streams of H (n values each): hn = H_h / sqrt(mean(H_h^2) + eps) * w[flat % wl];
// when y is given, first the residual H_h += y * 2 sigmoid(v[h] / hc) (in place). Grid: hc blocks.
#define HCI_R 4  // values a thread of hc_inject_rms keeps in registers between its two passes
extern "C" __global__ void hc_inject_rms(float* __restrict__ H, const float* __restrict__ y, const float* __restrict__ v,
                                         int hc, int n, const float* __restrict__ w, int wl, float eps,
                                         float* __restrict__ hn) {
    PDL_ENTRY();
    __shared__ float red[32];
    const int h = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const long long base = (long long)h * n;
    const float iw = y ? 2.0f * step_sigm(v[h] / (float)hc) : 0.0f;
    // a thread's first HCI_R values and their norm weights stay in registers for the second pass (no second
    // round trip to memory after the block sum); values past HCI_R * blockDim.x are read again. The sums and
    // products are those of one loop over i = tid, tid + nt, ... (the same result).
    float xr[HCI_R], wr[HCI_R];
    float ss = 0.0f;
    #pragma unroll
    for (int k = 0; k < HCI_R; ++k) {
        const int i = tid + k * nt;
        xr[k] = 0.0f;
        wr[k] = 0.0f;
        if (i < n) {
            float x = H[base + i];
            if (y) { x = x + y[i] * iw; H[base + i] = x; }
            xr[k] = x;
            wr[k] = w[(base + i) % wl];
            ss += x * x;
        }
    }
    for (int i = tid + HCI_R * nt; i < n; i += nt) {
        float x = H[base + i];
        if (y) { x = x + y[i] * iw; H[base + i] = x; }
        ss += x * x;
    }
    ss = step_block_sum(ss, red);
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    #pragma unroll
    for (int k = 0; k < HCI_R; ++k) {
        const int i = tid + k * nt;
        if (i < n) hn[base + i] = (xr[k] * r) * wr[k];
    }
    for (int i = tid + HCI_R * nt; i < n; i += nt) hn[base + i] = (H[base + i] * r) * w[(base + i) % wl];
}

// y[r] = W[r, :] . x for a float32 matrix W (rows x cols, row-major; the router with the shared gate's row), one
// block per row (grid-stride): float4 loads when W and x are 16-byte aligned and cols a multiple of 4.
extern "C" __global__ void matvec_f32_rows(const float* __restrict__ W, const float* __restrict__ x,
                                           float* __restrict__ y, int rows, int cols) {
    PDL_ENTRY();
    __shared__ float red[32];
    const bool vec = (((unsigned long long)W | (unsigned long long)x) & 15ull) == 0 && (cols & 3) == 0;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* w = W + (long long)r * cols;
        float acc = 0.0f;
        if (vec) {
            const float4* w4 = reinterpret_cast<const float4*>(w);
            const float4* x4 = reinterpret_cast<const float4*>(x);
            for (int i = threadIdx.x; i < cols / 4; i += blockDim.x) {
                float4 a = w4[i], b = x4[i];
                acc += a.x * b.x; acc += a.y * b.y; acc += a.z * b.z; acc += a.w * b.w;
            }
        } else {
            for (int i = threadIdx.x; i < cols; i += blockDim.x) acc += w[i] * x[i];
        }
        acc = step_block_sum(acc, red);
        if (threadIdx.x == 0) y[r] = acc;
    }
}
