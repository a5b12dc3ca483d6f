"""Runtime throughput on the kit's models: prefill and decode tokens/s of the numpy runtime, as ratios to
transformers' eager float32 forward (with its KV/recurrent cache) measured in the same run, plus peak RSS.
Both get the same untimed warm-up (a 4-token prefill and one decode step); the runtime's timed prefills still
include dequantizing each routed expert the first time it is used (its LRU keeps them afterwards).

Usage: python bench/bench_runtime.py [KIT_DIR] [N_NEW]
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stratatools.runtime.model import Qwen4ExpRuntime  # noqa: E402
from stratatools.runtime.weights import load  # noqa: E402

KIT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT.parent / "shared" / "kit"
N_NEW = int(sys.argv[2]) if len(sys.argv) > 2 else 32
MODELS = ["gguf/model-bf16.gguf", "gguf/split/model-Q2_0-split-00001-of-00004.gguf", "quant/model-Q4_K_M.gguf",
          "quant/model-IQ4_NL.gguf", "quant/model-ISTA-mix.gguf"]


def prompts():
    out = []
    for line in (KIT / "routing" / "tokens.tsv").read_text().splitlines():
        if line.strip():
            out.append([int(x) for x in line.split("\t")[1].split()])
    return out


def bench_runtime(path: Path) -> tuple[float, float]:
    w = load(path)
    rt = Qwen4ExpRuntime(w)
    st = rt.new_state()  # warm-up: one short prefill and one decode step, untimed (same as transformers')
    lg, _ = rt.forward(prompts()[0][:4], st)
    rt.forward([int(np.argmax(lg))], st)
    n_pre = n_dec = 0
    t_pre = t_dec = 0.0
    for ids in prompts():
        st = rt.new_state()
        t0 = time.perf_counter()
        lg, _ = rt.forward(ids, st)
        t1 = time.perf_counter()
        for _ in range(N_NEW):
            lg, _ = rt.forward([int(np.argmax(lg))], st)
        t2 = time.perf_counter()
        n_pre += len(ids)
        n_dec += N_NEW
        t_pre += t1 - t0
        t_dec += t2 - t1
    w.close()
    return n_pre / t_pre, n_dec / t_dec


def bench_transformers() -> tuple[float, float] | None:
    try:
        import torch
        from transformers import Qwen4ExpForCausalLM
    except ImportError:
        return None
    torch.set_num_threads(2)
    m = Qwen4ExpForCausalLM.from_pretrained(str(KIT / "hf" / "qwen4exp-tiny"), dtype=torch.float32,
                                            attn_implementation="eager").eval()
    n_pre = n_dec = 0
    t_pre = t_dec = 0.0
    with torch.no_grad():
        # the same warm-up as the runtime gets (its first forward pays torch's one-time set-up costs)
        out = m(input_ids=torch.tensor([prompts()[0][:4]]), use_cache=True)
        m(input_ids=out.logits[0, -1].argmax().view(1, 1), past_key_values=out.past_key_values, use_cache=True)
        for ids in prompts():
            t0 = time.perf_counter()
            out = m(input_ids=torch.tensor([ids]), use_cache=True)
            t1 = time.perf_counter()
            past = out.past_key_values
            nxt = out.logits[0, -1].argmax()
            for _ in range(N_NEW):
                out = m(input_ids=nxt.view(1, 1), past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[0, -1].argmax()
            t2 = time.perf_counter()
            n_pre += len(ids)
            n_dec += N_NEW
            t_pre += t1 - t0
            t_dec += t2 - t1
    return n_pre / t_pre, n_dec / t_dec


def main() -> None:
    base = bench_transformers()
    if base:
        print(f"baseline transformers f32 eager (HF checkpoint): prefill {base[0]:.1f} tok/s, decode {base[1]:.1f} tok/s")
    for rel in MODELS:
        pre, dec = bench_runtime(KIT / rel)
        ratio = f"  ratio vs transformers: prefill {pre / base[0]:.2f}x, decode {dec / base[1]:.2f}x" if base else ""
        print(f"{Path(rel).name:45s} prefill {pre:7.1f} tok/s  decode {dec:6.1f} tok/s{ratio}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {rss:.0f} MiB")


if __name__ == "__main__":
    main()
