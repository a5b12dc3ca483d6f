// Part of stratatools (stratatools/runtime/gpu). Compiled with quant_kernels.cu (after it) by kernels.py; the fast
// step instantiates these kernels from the multiply-add-fused module. tests/test_gpu_fused_host.py compiles them as
// host C++ (host_kernel_shim.cuh: one thread per block) and checks them against expert_ffn_reference.
// Routed-expert FFN with staged rows: as moe_gate_up_kernel / moe_down_kernel (same job table, same results up to
// float rounding), but a warp first copies the bytes of the rows it needs into its own shared buffer with 16-byte
// loads of the 16-byte-aligned span that covers them (every load of the warp in flight at once; bytes past a
// matrix's end are read one by one, never beyond it), then decodes groups from shared memory. Written for any
// block size (lanes = min(32, blockDim.x), warps = max(1, blockDim.x / 32)), so the host build runs the same code.
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
