"""Reader fuzzing worker (issue 14), run in a subprocess under an address-space limit.

``python tests/fuzz_worker.py SEEDS.json MAX_EXAMPLES [RLIMIT_MB]`` where SEEDS.json maps a reader name to a seed
file. For every reader it runs a hypothesis campaign of mutated seeds (truncations, big numbers planted over
header fields, byte flips, splices, line edits for text formats) and prints one JSON line per reader:
``{"reader", "tried", "ok", "strata_error", "tracebacks": [...], "hangs": n, "data_loss": n, "multi_line": [...]}``.
Each input is read with a 20 s alarm (a hang) under ``RLIMIT_AS`` (an unbounded allocation becomes a MemoryError,
which is counted as a traceback); data loss counts inputs whose bytes were changed or removed by reading them.
``python tests/fuzz_worker.py --make-seeds DIR`` writes the seed files and DIR/seeds.json first. Used by
tests/test_safety_readers.py; run by hand with a larger MAX_EXAMPLES for a campaign.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import traceback
from pathlib import Path

HANG_S = 20


class Hang(BaseException):
    pass


def _alarm(*_):
    raise Hang()


def readers():
    """name -> function(path) that reads the file the way the commands do (and computes what they compute)."""
    from stratatools.alloc.allocation import read_allocation
    from stratatools.alloc.registry import load_registry
    from stratatools.model.geometry import read_geometry
    from stratatools.model.gguf import open_model
    from stratatools.pack.native import read_pack
    from stratatools.profiles.strp import read_profile
    from stratatools.traces.formats import read_trace
    from stratatools.traces.table import trace_stats

    def gguf(p):
        with open_model(p) as m:
            try:
                read_geometry(m)
            finally:
                pass
            for t in list(m.iter_tensors())[:4]:
                m.raw(t, 0, min(t.nbytes, 64))

    def trace(fmt):
        def f(p):
            tt = read_trace(p, fmt)
            trace_stats(tt)
        return f

    def stream(p):  # the chunk sources the streaming commands use (tagged walker, Parquet batches), small chunks
        from stratatools.traces.sources import open_traces, trace_stats_sources

        trace_stats_sources(open_traces([p]), rows=7)

    def pack(p):
        d = Path(p).parent / "pk"
        d.mkdir(exist_ok=True)
        os.replace(p, d / "native_experts.txt")
        try:
            read_pack(d)
        finally:
            os.replace(d / "native_experts.txt", p)

    return {"gguf": gguf, "strp": read_profile, "alloc": read_allocation, "registry": load_registry,
            "native": pack, "strata": trace("strata"), "strata-tagged": trace("strata"), "csv": trace("csv"),
            "llama-csv": trace("llama-csv"), "parquet": trace("parquet"), "sniff": trace(None),
            "strata-stream": stream, "parquet-stream": stream}


BIG = [0, 1, 0x7F, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x100000000, 0x7FFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF,
       1 << 40, 65535, 65536, 512]
TEXT_SNIPPETS = [b"", b",", b" ", b"\x00", b"nan", b"-1", b"99999999999999999999", b"1e308", b"[", b"[[", b"]",
                 b"=", b"\"", b"\n", b"\r\n", b"\xff\xfe", b"[/]", b"pruned", b":", b"blk.999999999.ffn_up_exps.weight[",
                 b"# ", b"# strata native experts v9", b"{" * 50, b"a = [" * 300, b"inf", b"-0", b"\t"]


def mutate(seed: bytes, ops, text: bool) -> bytes:
    b = bytearray(seed)
    for op in ops:
        kind, a, c, v = op
        n = len(b)
        pos = a % (n + 1) if n else 0
        if kind == 0:  # truncate
            del b[pos:]
        elif kind == 1 and n:  # plant a big little-endian number
            val = BIG[v % len(BIG)]
            w = (1, 2, 4, 8)[c % 4]
            pos = pos - pos % w if c & 4 else pos
            b[pos:pos + w] = (val & ((1 << (8 * w)) - 1)).to_bytes(w, "little")
        elif kind == 2 and n:  # flip a byte
            b[pos % n] ^= (v % 255) + 1
        elif kind == 3:  # splice a snippet / random bytes
            snip = TEXT_SNIPPETS[v % len(TEXT_SNIPPETS)] if text or c % 2 else bytes([v % 256]) * (c % 16 + 1)
            b[pos:pos] = snip
        elif kind == 4 and n:  # duplicate a span (repeats records/lines)
            end = min(n, pos + (c % 256) + 1)
            b[pos:pos] = b[pos:end] * ((v % 4) + 1)
        elif kind == 5 and n:  # delete a span
            del b[pos:pos + (c % 64) + 1]
    return bytes(b)


def campaign(name: str, seed_path: str, max_examples: int, workdir: Path) -> dict:
    from hypothesis import HealthCheck, given, settings, strategies as st

    from stratatools.core.errors import StrataError

    fn = readers()[name]
    seed = Path(seed_path).read_bytes()
    text = name in ("alloc", "registry", "native", "csv", "llama-csv")
    stats = {"reader": name, "tried": 0, "ok": 0, "strata_error": 0, "tracebacks": [], "hangs": 0,
             "data_loss": 0, "multi_line": []}
    target = workdir / Path(seed_path).name
    op = st.tuples(st.integers(0, 5), st.integers(0, 1 << 32), st.integers(0, 255), st.integers(0, 1 << 16))

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(op, min_size=1, max_size=4), st.booleans())
    def run(ops, from_scratch):
        data = mutate(b"" if from_scratch and ops[0][0] == 3 else seed, ops, text)
        target.write_bytes(data)
        stats["tried"] += 1
        signal.alarm(HANG_S)
        try:
            fn(str(target))
            stats["ok"] += 1
        except StrataError as e:
            stats["strata_error"] += 1
            if "\n" in str(e) or not str(e):
                stats["multi_line"].append(str(e)[:300])
        except Hang:
            stats["hangs"] += 1
        except BaseException as e:  # noqa: BLE001 - every other exception is what we count
            if isinstance(e, KeyboardInterrupt):
                raise
            tb = traceback.format_exc().strip().splitlines()
            stats["tracebacks"].append(" | ".join(tb[-3:])[:400])
            if len(stats["tracebacks"]) <= 3:
                (workdir / f"crash-{name}-{len(stats['tracebacks'])}.bin").write_bytes(data)
        finally:
            signal.alarm(0)
            try:
                if target.read_bytes() != data:  # a reader must never change or remove its input
                    stats["data_loss"] += 1
            except OSError:
                stats["data_loss"] += 1

    run()
    return stats


def main() -> None:
    if sys.argv[1] == "--make-seeds":  # python tests/fuzz_worker.py --make-seeds DIR: DIR/seeds.json for a campaign
        d = Path(sys.argv[2])
        d.mkdir(parents=True, exist_ok=True)
        make_seeds(d)
        return
    seeds = json.loads(Path(sys.argv[1]).read_text())
    max_examples = int(sys.argv[2])
    limit_mb = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else None
    import numpy  # noqa: F401  - imported before the limit: their mappings are not what we measure
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import pyarrow.dataset  # noqa: F401  - the chunk sources' (its shared library is large)
    readers()
    if limit_mb:
        with open("/proc/self/statm") as fh:
            vm = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        lim = vm + limit_mb * (1 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    signal.signal(signal.SIGALRM, _alarm)
    with tempfile.TemporaryDirectory(prefix="fuzz-") as d:
        for name, path in seeds.items():
            if only and name not in only:
                continue
            wd = Path(d) / name
            wd.mkdir()
            res = campaign(name, path, max_examples, wd)
            crash_dir = os.environ.get("FUZZ_CRASH_DIR")
            if crash_dir:
                for c in wd.glob("crash-*"):
                    Path(crash_dir).mkdir(parents=True, exist_ok=True)
                    os.replace(c, Path(crash_dir) / c.name)
            print(json.dumps(res), flush=True)



def make_seeds(d: Path) -> dict[str, str]:
    """Valid seed files of every reader, made from a tiny synthetic release (a few KB each, except the GGUF)."""
    import numpy as np

    from stratatools.alloc.registry import DEFAULT_PATH
    from stratatools.pack.native import pack_model
    from stratatools.profiles.strp import Profile
    from stratatools.synth.model import SynthConfig, synth_release
    from stratatools.traces.formats import write_trace
    from stratatools.traces.table import TraceTable

    cfg = SynthConfig(n_layers=2, hidden=64, n_expert=8, keep=4, swap=1, k=2, expert_ff=64, shared_ff=64,
                      n_head=2, n_head_kv=1, head_dim=32, linear_k_heads=1, linear_v_heads=2, linear_k_dim=32,
                      linear_v_dim=32, hc_lowrank=32, indexer_dim=32, full_attention_interval=2, ple_layers=(0,),
                      vocab_size=300)
    rel = synth_release(d / "rel", cfg)
    pack_model(rel.revA.path, d / "pack", hash_inputs=False)
    out = {"gguf": str(rel.revA.path), "alloc": str(rel.revA.allocation),
           "native": str(d / "pack" / "native_experts.txt"), "registry": str(DEFAULT_PATH)}
    Profile(2, 8, np.array([[0, 3], [1, 2], [0, 1], [1, 7]])).write(d / "p.bin")
    out["strp"] = str(d / "p.bin")
    n = 24  # 2 requests x 3 tokens x 2 layers x k 2
    req = np.repeat([0, 1], 12)
    pos = np.tile(np.repeat([0, 1, 2], 4), 2)
    layer = np.tile([0, 0, 1, 1], 6)
    rank = np.tile([0, 1], 12)
    expert = (np.arange(n) * 3) % 8
    expert[1::2] = (expert[0::2] + 1) % 8
    tt = TraceTable(req, pos, np.where(pos == 0, 0, 1), layer, rank, expert, np.full(n, 0.5, np.float32))
    for fmt, name in (("strata", "t.bin"), ("strata-tagged", "tt.bin"), ("csv", "t.csv"), ("parquet", "t.parquet")):
        write_trace(tt, d / name, fmt)
        out[fmt] = str(d / name)
    (d / "l.csv").write_text("".join(f"{p},{l},{e},{(e + 1) % 8}\n" for p in range(3) for l in range(2)
                                     for e in (p + l,)))
    out["llama-csv"] = str(d / "l.csv")
    out["sniff"] = str(d / "tt.bin")
    out["strata-stream"] = str(d / "tt.bin")
    out["parquet-stream"] = str(d / "t.parquet")
    (d / "seeds.json").write_text(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
