"""GPU benchmark (issue 7.4), run on the H200: every number is a ratio to a baseline measured in the same run.

1. Ceiling: device-to-device copy bandwidth (bytes read + written per second).
2. Dequantization GB/s per type (bytes read + float32 bytes written), as a fraction of the copy bandwidth.
3. MoE decode at batch 1 on the full-width config (hidden 2560, expert width 640, 512 experts, 10 active,
   8 layers, router + routed + shared experts per layer), weights random but valid blocks generated on the
   device, in Q2_0 and in i-quants (IQ3_XXS gate/up + IQ4_NL down; IQ2_XS + Q2_0): tokens/s eager (one
   launch per kernel from Python) and as a replayed CUDA graph; roofline fraction = (weight bytes touched
   per token / copy bandwidth) / measured time per token.
4. The same MoE stack in transformers eager (Qwen4ExpTextSparseMoeBlock x 8, bf16, experts_implementation
   "eager"): our tokens/s over theirs.
5. The GPU expert tier (static profile holding half the experts, misses copied or read from pinned host
   memory): tokens/s, h_expert, bytes moved per token.

Usage: python bench/bench_gpu.py [--layers 8] [--out results.json] [--steps 200]
Prints a table last; writes JSON with every number.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, F, E, K = 2560, 640, 512, 10

ROUTE_SRC = r"""
typedef unsigned long long u64;
// One block of E threads (E <= 1024): softmax over logits[0..E), top-k by repeated argmax (ties to the lower
// index), renormalised weights; writes blob pointers of the k experts and the shared-expert weight
// sigmoid(logits[E]).
extern "C" __global__ void route_topk(const float* __restrict__ logits, int E, int k, u64 base, u64 blob_bytes,
                                      u64 gate_bytes, u64* gate_ptr, u64* up_ptr, u64* down_ptr, float* w,
                                      float* shared_w) {
    __shared__ float p[1024];
    __shared__ float red_v[32];
    __shared__ int red_i[32];
    int t = threadIdx.x, lane = t & 31, wid = t >> 5, nw = (blockDim.x + 31) >> 5;
    float v = t < E ? logits[t] : __int_as_float(0xff800000);
    // max
    float m = v;
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red_v[wid] = m;
    __syncthreads();
    if (t < 32) { float mm = t < nw ? red_v[t] : __int_as_float(0xff800000); for (int o = 16; o; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, o)); if (t == 0) red_v[0] = mm; }
    __syncthreads();
    float mx = red_v[0];
    float e = t < E ? expf(v - mx) : 0.0f;
    if (t < E) p[t] = e;
    __syncthreads();
    float topsum = 0.0f;
    for (int r = 0; r < k; ++r) {
        float bv = t < E ? p[t] : -1.0f; int bi = t;
        for (int o = 16; o; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o); int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { red_v[wid] = bv; red_i[wid] = bi; }
        __syncthreads();
        if (t == 0) {
            float b = red_v[0]; int ii = red_i[0];
            for (int q = 1; q < nw; ++q) if (red_v[q] > b || (red_v[q] == b && red_i[q] < ii)) { b = red_v[q]; ii = red_i[q]; }
            u64 ptr = base + (u64)ii * blob_bytes;
            gate_ptr[r] = ptr; up_ptr[r] = ptr + gate_bytes; down_ptr[r] = ptr + 2 * gate_bytes;
            w[r] = b; p[ii] = -1.0f;
        }
        __syncthreads();
    }
    if (t == 0) {
        for (int r = 0; r < k; ++r) topsum += w[r];
        for (int r = 0; r < k; ++r) w[r] = w[r] / topsum;
        shared_w[0] = 1.0f / (1.0f + expf(-logits[E]));
    }
}
// x = rmsnorm(x + y) over n values, one block.
extern "C" __global__ void residual_norm(float* x, const float* y, int n) {
    __shared__ float red[32];
    int t = threadIdx.x;
    float s = 0.0f;
    for (int i = t; i < n; i += blockDim.x) { float v = x[i] + y[i]; x[i] = v; s += v * v; }
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((t & 31) == 0) red[t >> 5] = s;
    __syncthreads();
    if (t == 0) { float a = 0; for (int q = 0; q < (blockDim.x >> 5); ++q) a += red[q]; red[0] = rsqrtf(a / n + 1e-6f); }
    __syncthreads();
    float r = red[0];
    for (int i = t; i < n; i += blockDim.x) x[i] = x[i] * r;
}
"""


def timed(cp, fn, reps=20, warm=3):
    """Median seconds of fn() over reps, CUDA events around each call."""
    for _ in range(warm):
        fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return float(np.median(ts)), float(np.min(ts)), float(np.max(ts))


def rand_blocks_dev(cp, tname, n_values, seed):
    """Random bytes of whole blocks on the device with finite fp16 scales at the type's scale offset."""
    from stratatools.model.ggml_types import type_by_name

    t = type_by_name(tname)
    nb = n_values // t.block_size
    rs = cp.random.RandomState(seed)
    raw = rs.randint(0, 256, size=(nb, t.type_size), dtype=cp.uint8)
    scale_off = {"Q6_K": t.type_size - 2}.get(tname, 0)
    d = (rs.standard_normal(nb, dtype=cp.float32) * 0.002).astype(cp.float16).view(cp.uint8).reshape(nb, 2)
    raw[:, scale_off:scale_off + 2] = d
    return raw.reshape(-1)


def bench_copy(cp, nbytes=4 << 30):
    a = cp.empty(nbytes, dtype=cp.uint8)
    b = cp.empty(nbytes, dtype=cp.uint8)
    a.fill(1)
    t, _, _ = timed(cp, lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, cp.cuda.get_current_stream().ptr), reps=10)
    del a, b
    return 2 * nbytes / t


def bench_dequant(cp, copy_bw, types, n_values=1 << 28):
    from stratatools.runtime.dequant import dequantize
    from stratatools.model.ggml_types import type_by_name

    rows = []
    for tname in types:
        t = type_by_name(tname)
        n = n_values // t.block_size * t.block_size
        raw = rand_blocks_dev(cp, tname, n, 1) if t.block_size > 1 else cp.random.randint(0, 255, n * t.type_size, dtype=cp.uint8)
        out_holder = []
        sec, _, _ = timed(cp, lambda: out_holder.append(dequantize(raw, t, xp=cp)) or out_holder.clear(), reps=10)
        moved = raw.size + 4 * n
        rows.append({"type": tname, "values": n, "seconds": sec, "gb_s": moved / sec / 1e9, "frac_of_copy": moved / sec / copy_bw})
        del raw
    return rows


class MoEStack:
    """L layers of full-width MoE weights on the device plus a capturable decode step."""

    def __init__(self, cp, gu, dt, L, seed=0, shared_type="Q8_0"):
        from stratatools.runtime.gpu import kernels as Kmod
        from stratatools.runtime.gpu.tier import LayerExperts
        from stratatools.model.ggml_types import type_by_name

        self.cp, self.L = cp, L
        self.gu, self.dt, self.st = type_by_name(gu), type_by_name(dt), type_by_name(shared_type)
        self.ly = LayerExperts(E, self.gu, self.dt, H, F)
        self.sh = LayerExperts(1, self.st, self.st, H, F)
        gb = self.ly.gate_bytes
        self.blobs, self.router, self.shared = [], [], []
        for l in range(L):
            parts = [rand_blocks_dev(cp, gu, E * F * H, seed + 10 * l).reshape(E, -1),
                     rand_blocks_dev(cp, gu, E * F * H, seed + 10 * l + 1).reshape(E, -1),
                     rand_blocks_dev(cp, dt, E * H * F, seed + 10 * l + 2).reshape(E, -1)]
            self.blobs.append(cp.ascontiguousarray(cp.concatenate(parts, axis=1)).reshape(-1))
            del parts
            r = cp.random.RandomState(seed + l).standard_normal((E + 1, H), dtype=cp.float32) * 0.05
            self.router.append(cp.ascontiguousarray(r).view(cp.uint8).reshape(-1))
            sh = cp.concatenate([rand_blocks_dev(cp, shared_type, F * H, seed + 100 + l),
                                 rand_blocks_dev(cp, shared_type, F * H, seed + 200 + l),
                                 rand_blocks_dev(cp, shared_type, H * F, seed + 300 + l)])
            self.shared.append(sh)
        assert self.blobs[0].size == E * self.ly.blob_bytes
        mod = cp.RawModule(code=ROUTE_SRC, options=("--std=c++17",))
        self.k_route = mod.get_function("route_topk")
        self.k_resnorm = mod.get_function("residual_norm")
        self.k_mv = Kmod.kernel("matvec_kernel", 0)
        self.k_gu = Kmod.kernel("moe_gate_up_kernel", self.gu.id)
        self.k_dn = Kmod.kernel("moe_down_kernel", self.dt.id)
        self.k_sgu = Kmod.kernel("moe_gate_up_kernel", self.st.id)
        self.k_sdn = Kmod.kernel("moe_down_kernel", self.st.id)
        self.x = cp.random.RandomState(7).standard_normal((1, H), dtype=cp.float32)
        self.logits = cp.empty(E + 1, dtype=cp.float32)
        self.ptrs = cp.empty((3, K), dtype=cp.uint64)
        self.w = cp.empty(K, dtype=cp.float32)
        self.sw = cp.empty(1, dtype=cp.float32)
        self.tok = cp.zeros(K, dtype=cp.int32)
        self.tstart = cp.asarray(np.array([0, K], dtype=np.int32))
        self.hbuf = cp.empty(K * F, dtype=cp.float32)
        self.y = cp.empty((1, H), dtype=cp.float32)
        self.sptrs = [cp.asarray(np.array([[int(s.data.ptr)], [int(s.data.ptr) + self.sh.gate_bytes],
                                           [int(s.data.ptr) + 2 * self.sh.gate_bytes]], dtype=np.uint64)) for s in self.shared]
        self.stok = cp.zeros(1, dtype=cp.int32)
        self.ststart = cp.asarray(np.array([0, 1], dtype=np.int32))

    def bytes_per_token(self):
        return self.L * ((E + 1) * H * 4 + K * self.ly.blob_bytes + self.sh.blob_bytes)

    def step(self, stream=None):
        """One decode position through L MoE layers (7 launches per layer, no host synchronisation)."""
        i32 = np.int32
        wpb = 8
        for l in range(self.L):
            self.k_mv(((E + 1 + wpb - 1) // wpb,), (256,), (self.router[l], self.x, self.logits, i32(E + 1), i32(H)), shared_mem=H * 4, stream=stream)
            base = int(self.blobs[l].data.ptr)
            self.k_route((1,), (E,), (self.logits, i32(E), i32(K), np.uint64(base), np.uint64(self.ly.blob_bytes),
                                      np.uint64(self.ly.gate_bytes), self.ptrs[0], self.ptrs[1], self.ptrs[2], self.w, self.sw), stream=stream)
            self.k_gu(((F + wpb - 1) // wpb, K), (256,), (self.ptrs[0], self.ptrs[1], self.tok, self.x, self.hbuf, i32(H), i32(F)), shared_mem=H * 4, stream=stream)
            self.k_dn(((H + wpb - 1) // wpb, 1), (256,), (self.ptrs[2], self.w, self.tstart, self.hbuf, self.y, i32(H), i32(F), i32(0)), stream=stream)
            sp = self.sptrs[l]
            self.k_sgu(((F + wpb - 1) // wpb, 1), (256,), (sp[0], sp[1], self.stok, self.x, self.hbuf, i32(H), i32(F)), shared_mem=H * 4, stream=stream)
            self.k_sdn(((H + wpb - 1) // wpb, 1), (256,), (sp[2], self.sw, self.ststart, self.hbuf, self.y, i32(H), i32(F), i32(1)), stream=stream)
            self.k_resnorm((1,), (1024,), (self.x, self.y, i32(H)), stream=stream)

    def check_one_layer(self):
        """The fused step's layer-0 output against the float64 numpy reference (relative error)."""
        from stratatools.runtime.gpu.experts import expert_ffn_reference

        cp = self.cp
        x0 = self.x.copy()
        i32 = np.int32
        self.k_mv(((E + 8) // 8,), (256,), (self.router[0], self.x, self.logits, i32(E + 1), i32(H)), shared_mem=H * 4)
        base = int(self.blobs[0].data.ptr)
        self.k_route((1,), (E,), (self.logits, i32(E), i32(K), np.uint64(base), np.uint64(self.ly.blob_bytes),
                                  np.uint64(self.ly.gate_bytes), self.ptrs[0], self.ptrs[1], self.ptrs[2], self.w, self.sw))
        self.k_gu(((F + 7) // 8, K), (256,), (self.ptrs[0], self.ptrs[1], self.tok, self.x, self.hbuf, i32(H), i32(F)), shared_mem=H * 4)
        self.k_dn(((H + 7) // 8, 1), (256,), (self.ptrs[2], self.w, self.tstart, self.hbuf, self.y, i32(H), i32(F), i32(0)))
        ids = ((cp.asnumpy(self.ptrs[0]) - np.uint64(base)) // np.uint64(self.ly.blob_bytes)).astype(np.int64)
        logits = cp.asnumpy(self.logits)[:E].astype(np.float64)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        ref_ids = np.argsort(-p, kind="stable")[:K]
        wts = p[ref_ids] / p[ref_ids].sum()
        host_blobs = [cp.asnumpy(self.blobs[0][e * self.ly.blob_bytes:(e + 1) * self.ly.blob_bytes]) for e in ref_ids]
        ref = expert_ffn_reference(cp.asnumpy(x0)[0], host_blobs, wts, self.gu, self.dt, H, F)
        got = cp.asnumpy(self.y)[0]
        return {"ids_match": bool(set(ids.tolist()) == set(ref_ids.tolist())),
                "rel_err": float(np.abs(got - ref).max() / np.abs(ref).max())}


def profile_kernels(cp, stack, reps=200):
    """Median microseconds of each of layer 0's seven launches, timed one at a time."""
    i32 = np.int32
    base = int(stack.blobs[0].data.ptr)
    sp = stack.sptrs[0]
    xc = stack.x.copy()
    steps = {
        "router_matvec_f32": lambda: stack.k_mv(((E + 8) // 8,), (256,), (stack.router[0], stack.x, stack.logits, i32(E + 1), i32(H)), shared_mem=H * 4),
        "route_topk": lambda: stack.k_route((1,), (E,), (stack.logits, i32(E), i32(K), np.uint64(base), np.uint64(stack.ly.blob_bytes),
                                                         np.uint64(stack.ly.gate_bytes), stack.ptrs[0], stack.ptrs[1], stack.ptrs[2], stack.w, stack.sw)),
        "gate_up": lambda: stack.k_gu(((F + 7) // 8, K), (256,), (stack.ptrs[0], stack.ptrs[1], stack.tok, stack.x, stack.hbuf, i32(H), i32(F)), shared_mem=H * 4),
        "down": lambda: stack.k_dn(((H + 7) // 8, 1), (256,), (stack.ptrs[2], stack.w, stack.tstart, stack.hbuf, stack.y, i32(H), i32(F), i32(0))),
        "shared_gate_up": lambda: stack.k_sgu(((F + 7) // 8, 1), (256,), (sp[0], sp[1], stack.stok, stack.x, stack.hbuf, i32(H), i32(F)), shared_mem=H * 4),
        "shared_down": lambda: stack.k_sdn(((H + 7) // 8, 1), (256,), (sp[2], stack.sw, stack.ststart, stack.hbuf, stack.y, i32(H), i32(F), i32(1))),
        "residual_norm": lambda: stack.k_resnorm((1,), (1024,), (xc, stack.y, i32(H))),
    }
    out = {}
    for name, fn in steps.items():
        out[name] = timed(cp, fn, reps=reps)[0] * 1e6
    return out


def bench_moe(cp, stack, steps):
    out = {"gu": stack.gu.name, "down": stack.dt.name, "layers": stack.L, "bytes_per_token": stack.bytes_per_token()}
    out["check"] = stack.check_one_layer()
    out["kernel_us"] = profile_kernels(cp, stack)
    t_eager, _, _ = timed(cp, stack.step, reps=steps)
    out["eager_s"] = t_eager
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        stack.step(stream=s)  # warm (compiles)
        s.synchronize()
        s.begin_capture()
        stack.step(stream=s)
        graph = s.end_capture()
    def run_graph():
        graph.launch(stream=s)
    for _ in range(3):
        run_graph()
    s.synchronize()
    ts = []
    for _ in range(steps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        run_graph()
        b.record(s)
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    out["graph_s"] = float(np.median(ts))
    return out


def bench_hf_moe(L, steps, dtype_name="bfloat16", impl="eager"):
    import torch
    import transformers
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mq
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    dtype = getattr(torch, dtype_name)
    cfg = Qwen4ExpTextConfig(hidden_size=H, moe_intermediate_size=F, shared_expert_intermediate_size=F,
                             num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, hidden_act="silu")
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    with torch.device("cuda"):
        blocks = []
        for _ in range(L):
            b = mq.Qwen4ExpTextSparseMoeBlock(cfg).to(dtype)
            with torch.no_grad():
                for p in b.parameters():
                    p.normal_(0, 0.02)
            blocks.append(b)
        norm = torch.nn.RMSNorm(H, eps=1e-6).to(dtype)
    x = torch.randn(1, 1, H, device="cuda", dtype=dtype)

    @torch.no_grad()
    def step():
        nonlocal x
        for b in blocks:
            x = norm(x + b(x))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(steps):
        a, c = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        c.record()
        c.synchronize()
        ts.append(a.elapsed_time(c) / 1e3)
    wbytes = L * ((E * H) + K * 3 * F * H + 3 * F * H + H) * 2
    del blocks
    torch.cuda.empty_cache()
    return {"transformers": transformers.__version__, "impl": impl, "dtype": dtype_name, "seconds": float(np.median(ts)),
            "bytes_per_token": wbytes}


def bench_tier(cp, stack, miss_mode, steps, frac=0.5):
    """Decode through the GPU tier: routing on the device, ids to the host, tier fetch, fused FFN."""
    from stratatools.runtime.gpu.experts import ExpertJobs, expert_ffn
    from stratatools.runtime.gpu.tier import GPUExpertTier, HostArena
    from stratatools.cachesim import make_tier
    from stratatools.profiles.strp import Profile

    L = stack.L
    t0 = time.perf_counter()
    arena = HostArena([stack.ly] * L)
    for l in range(L):
        o = int(arena.layer_offset[l])
        stack.blobs[l][:].get(out=arena.host[o:o + stack.blobs[l].size])
    fill_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    pairs = np.array([(l, e) for e in rng.permutation(E) for l in range(L)])
    prof = Profile(n_layers=L, n_expert=E, pairs=pairs)
    pol = make_tier("static", profile=prof, slots=int(L * E * frac), blob_bytes=[stack.ly.blob_bytes] * L)
    tier = GPUExpertTier(arena, pol, miss_mode=miss_mode)
    i32 = np.int32
    x = stack.x

    def step():
        for l in range(L):
            stack.k_mv(((E + 8) // 8,), (256,), (stack.router[l], x, stack.logits, i32(E + 1), i32(H)), shared_mem=H * 4)
            lg = cp.asnumpy(stack.logits)
            p = np.exp(lg[:E] - lg[:E].max())
            ids = np.argpartition(-p, K)[:K]
            w = (p[ids] / p[ids].sum()).astype(np.float32)
            y = tier.ffn(l, x, ids[None], w[None])
            stack.k_resnorm((1,), (1024,), (x, y, i32(H)))
        tier.end_round()

    sec, _, _ = timed(cp, step, reps=steps)
    st = tier.stats()
    n_tok = steps + 3
    return {"miss_mode": miss_mode, "resident_frac": frac, "seconds": sec, "h_expert": st["h_expert"],
            "bytes_moved_per_token": st["bytes_moved"] / n_tok, "arena_fill_s": fill_s, "arena_bytes": arena.nbytes}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="bench_gpu.json")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-tier", action="store_true")
    a = ap.parse_args(argv)
    import cupy as cp

    res = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "layers": a.layers}
    t = time.perf_counter()
    from stratatools.runtime.gpu import kernels as Kmod
    Kmod.module()
    res["compile_s"] = time.perf_counter() - t
    res["copy_bw"] = bench_copy(cp)
    print(f"D2D copy: {res['copy_bw'] / 1e12:.2f} TB/s", flush=True)
    from stratatools.runtime.dequant import SUPPORTED_TYPES
    res["dequant"] = bench_dequant(cp, res["copy_bw"], SUPPORTED_TYPES)
    res["moe"] = []
    res["tier"] = []
    for gu, dt in (("Q2_0", "Q2_0"), ("IQ3_XXS", "IQ4_NL"), ("IQ2_XS", "Q2_0")):
        stack = MoEStack(cp, gu, dt, a.layers)
        m = bench_moe(cp, stack, a.steps)
        m["roofline_s"] = m["bytes_per_token"] / res["copy_bw"]
        res["moe"].append(m)
        print(json.dumps(m), flush=True)
        if gu == "Q2_0" and not a.skip_tier:
            for mode in ("copy", "host"):
                try:
                    res["tier"].append(bench_tier(cp, stack, mode, max(10, a.steps // 5)))
                    print(json.dumps(res["tier"][-1]), flush=True)
                except Exception as e:  # report, keep going
                    res["tier"].append({"miss_mode": mode, "error": repr(e)})
        del stack
        cp.get_default_memory_pool().free_all_blocks()
    if not a.skip_hf:
        res["hf"] = []
        for impl in ("eager", "grouped_mm"):
            try:
                res["hf"].append(bench_hf_moe(a.layers, a.steps, impl=impl))
            except Exception as e:
                res["hf"].append({"impl": impl, "error": repr(e)})
            print(json.dumps(res["hf"][-1]), flush=True)
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(a.out).write_text(json.dumps(res, indent=2))
    # table
    bw = res["copy_bw"]
    print(f"\ndevice {res['device']}; D2D copy {bw / 1e12:.2f} TB/s; kernel compile {res['compile_s']:.1f} s; peak RSS {res['peak_rss_mib']:.0f} MiB")
    print("dequant: " + ", ".join(f"{r['type']} {r['gb_s']:.0f} GB/s ({r['frac_of_copy']:.2f})" for r in res["dequant"]))
    hf = next((h for h in res.get("hf", []) if h.get("impl") == "eager" and "seconds" in h), None)
    for m in res["moe"]:
        line = (f"MoE {m['gu']}/{m['down']} x{m['layers']}: eager {1 / m['eager_s']:.0f} tok/s, graph {1 / m['graph_s']:.0f} tok/s, "
                f"roofline {1 / m['roofline_s']:.0f} tok/s -> fraction {m['roofline_s'] / m['graph_s']:.2f}; check {m['check']}")
        if hf:
            line += f"; vs transformers eager bf16 ({1 / hf['seconds']:.0f} tok/s): x{hf['seconds'] / m['graph_s']:.1f} (graph), x{hf['seconds'] / m['eager_s']:.1f} (eager)"
        print(line)
        print("   per-kernel us (layer 0):", {k: round(v, 1) for k, v in m["kernel_us"].items()})
    for h in res.get("hf", []):
        print("transformers:", h)
    for tr in res["tier"]:
        print("tier:", tr)


if __name__ == "__main__":
    main()
