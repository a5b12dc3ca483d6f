"""The device staging of a decode step's token-dependent inputs (stratatools/runtime/gpu/stage_step.cu ``stage_step``)
checked on the CPU: the CUDA source compiled as host C++ (host_kernel_shim.cuh), run step after step on random token
sequences with EOS tokens in them, against what StaticDecoder._stage writes (Qwen4ExpRuntime.ple_ngram_ids with the
context advanced once per PLE layer, rows dequantized by stratatools.runtime.dequant): every written float bit for bit,
nothing else in the input buffer touched, the context left behind, for random tables of F32, F16, BF16 and Q8_0,
n-grams of 2..4, 1..3 heads per n-gram and 1..3 PLE layers; and StaticDecoder's device staging code driven through a
numpy stand-in for CuPy whose launch runs that host build (kit model). Skips without a C++ compiler."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from hostlib import CXX, build_host_lib
from stratatools.model.ggml_types import TYPES
from stratatools.runtime.dequant import dequantize
from stratatools.runtime.model import Qwen4ExpRuntime

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler to build the host copy of the kernels")

TYPE_IDS = {"F32": 0, "F16": 1, "BF16": 30, "Q8_0": 8}
SENTINEL = np.uint32(0x7FBADBAD)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_host_lib(tmp_path_factory.mktemp("stagestep"), "stage_step.cu")


def _table(rng, type_name: str, rows: int, ne0: int) -> np.ndarray:
    """Random table bytes [rows, row_bytes]: any bit pattern for the float types (NaNs, infinities, subnormals
    included), finite fp16 scales (some subnormal, some zero) and any int8 codes for Q8_0."""
    t = TYPES[TYPE_IDS[type_name]]
    rb = t.row_bytes(ne0)
    raw = rng.integers(0, 256, size=(rows, rb), dtype=np.uint8)
    if type_name == "Q8_0":
        blocks = raw.reshape(rows, ne0 // 32, 34)
        d = (rng.standard_normal((rows, ne0 // 32)) * 0.01).astype(np.float16)
        d.reshape(-1)[::7] = np.float16(3e-7)  # subnormal fp16
        d.reshape(-1)[::11] = 0
        blocks[:, :, :2] = d.view(np.uint8).reshape(rows, ne0 // 32, 2)
    return raw


def _deq(raw: np.ndarray, type_name: str, ne0: int, ids) -> np.ndarray:
    return np.concatenate([dequantize(raw[int(u)], TYPE_IDS[type_name], ne0) for u in ids]).astype(np.float32)


def _setup(rng, ngram, hpn, n_pl, tok_type, ple_type, eos, n_tok=40, n_embd=64, ple_ne0=32):
    nh = (ngram - 1) * hpn
    vocab = rng.integers(3, 60, size=nh).astype(np.int64)
    hoff = np.concatenate([[0], np.cumsum(vocab)[:-1]]).astype(np.int64) + rng.integers(0, 5)
    ple_rows = int(hoff[-1] + vocab[-1]) + 2
    mult = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=ngram, dtype=np.int64)
    mult[0] = 4295158889766209  # one of the kit's (positive) multipliers
    cfg = SimpleNamespace(eos_id=eos, ple_ngram=ngram, ple_heads_per_ngram=hpn, ple_multipliers=mult,
                          ple_head_vocab=vocab, ple_head_offsets=hoff)
    tok_tab = _table(rng, tok_type, n_tok, n_embd)
    ple_tab = _table(rng, ple_type, ple_rows, ple_ne0)
    # the decoder's input layout: [pos | x0 | PLE rows per layer | cos/sin tail]
    x_off = 1
    poff = [x_off + n_embd + li * nh * ple_ne0 for li in range(n_pl)]
    n_in = x_off + n_embd + n_pl * nh * ple_ne0 + 8
    return SimpleNamespace(cfg=cfg, rt=SimpleNamespace(cfg=cfg), tok_tab=tok_tab, ple_tab=ple_tab, x_off=x_off,
                           poff=poff, n_in=n_in, nh=nh, n_tok=n_tok, n_embd=n_embd, ple_ne0=ple_ne0, ple_rows=ple_rows,
                           tok_type=tok_type, ple_type=ple_type, n_pl=n_pl,
                           prm=np.concatenate([mult, vocab, hoff, np.array(poff, dtype=np.int64)]).astype(np.int64))


def _launch(lib, S, tok: np.ndarray, ctx: np.ndarray, inp: np.ndarray, err: np.ndarray) -> None:
    p = lambda a: a.ctypes.data  # noqa: E731
    lib.host_stage_step(1, 1, p(tok), p(ctx), p(inp), p(S.tok_tab), TYPE_IDS[S.tok_type], S.n_tok,
                        S.tok_tab.shape[1], S.x_off, S.n_embd, p(S.ple_tab), TYPE_IDS[S.ple_type], S.ple_rows,
                        S.ple_tab.shape[1], S.ple_ne0, p(S.prm), S.n_pl, S.cfg.ple_ngram,
                        S.cfg.ple_heads_per_ngram, S.cfg.eos_id, p(err))


def _reference(S, token: int, ctx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What StaticDecoder._stage writes into x0 and the PLE slices for ``token`` (and the context it leaves)."""
    ids = np.array([token], dtype=np.int64)
    want = np.full(S.n_in, np.float32(0)).view(np.uint32)
    want[:] = SENTINEL
    want = want.view(np.float32)
    want[S.x_off:S.x_off + S.n_embd] = _deq(S.tok_tab, S.tok_type, S.n_embd, [token])
    keep = S.cfg.ple_ngram - 1
    for li in range(S.n_pl):
        rows = Qwen4ExpRuntime.ple_ngram_ids(S.rt, ids, ctx)
        if keep > 0:
            ctx = np.concatenate([ctx, ids])[-keep:]
        want[S.poff[li]:S.poff[li] + S.nh * S.ple_ne0] = _deq(S.ple_tab, S.ple_type, S.ple_ne0, rows.reshape(-1))
    return want, ctx


CASES = [(2, 1, 1, "BF16", "BF16"), (3, 2, 1, "F16", "Q8_0"), (4, 3, 3, "Q8_0", "F32"), (3, 1, 2, "F32", "F16"),
         (4, 2, 2, "BF16", "Q8_0"), (2, 3, 3, "F16", "BF16")]


@pytest.mark.parametrize("ngram,hpn,n_pl,tok_type,ple_type", CASES)
def test_stage_step_writes_what_stage_writes_step_after_step(lib, ngram, hpn, n_pl, tok_type, ple_type):
    rng = np.random.default_rng(ngram * 100 + hpn * 10 + n_pl)
    eos = 3
    S = _setup(rng, ngram, hpn, n_pl, tok_type, ple_type, eos)
    keep = ngram - 1
    seq = rng.integers(0, S.n_tok, size=40)
    seq[rng.random(40) < 0.25] = eos  # segment resets, some back to back
    seq[:2] = eos
    ctx_ref = np.full(keep, eos, dtype=np.int64)
    ctx_dev = ctx_ref.copy()
    inp = np.full(S.n_in, SENTINEL, dtype=np.uint32).view(np.float32)
    tok = np.zeros(1, dtype=np.int64)
    err = np.zeros(1, dtype=np.int32)
    for token in seq.tolist():
        tok[0] = token
        _launch(lib, S, tok, ctx_dev, inp, err)
        want, ctx_ref = _reference(S, token, ctx_ref)
        assert np.array_equal(inp.view(np.uint32), want.view(np.uint32)), f"token {token}"
        assert np.array_equal(ctx_dev, ctx_ref)
        assert tok[0] == token and err[0] == 0
    # a context shorter than keep at the start of a sequence is never there: the decoder keeps keep ids
    assert ctx_dev.size == keep


def test_stage_step_hash_is_int64_wrapping_and_remainder_non_negative(lib):
    """Multipliers of both signs and large ids make the mixed value negative and overflow: the rows still agree."""
    rng = np.random.default_rng(7)
    S = _setup(rng, 4, 2, 1, "BF16", "BF16", eos=-1, n_tok=40)
    S.cfg.ple_multipliers[:] = [-(2 ** 62) - 12345, 2 ** 63 - 1, -1, 3 ** 39]
    S.prm[:4] = S.cfg.ple_multipliers
    ctx_ref = np.array([39, 2 ** 40 + 5, -7], dtype=np.int64)  # any int64 ids may sit in a context
    ctx_dev = ctx_ref.copy()
    inp = np.full(S.n_in, SENTINEL, dtype=np.uint32).view(np.float32)
    err = np.zeros(1, dtype=np.int32)
    negative = 0
    for token in [5, 39, 0, 17, 17, 17, 2]:
        h = np.concatenate([ctx_ref, [token]]).astype(np.int64)
        with np.errstate(over="ignore"):
            negative += int(h[-1] * S.cfg.ple_multipliers[0] ^ h[-2] * S.cfg.ple_multipliers[1] < 0)
        _launch(lib, S, np.array([token], dtype=np.int64), ctx_dev, inp, err)
        want, ctx_ref = _reference(S, token, ctx_ref)
        assert np.array_equal(inp.view(np.uint32), want.view(np.uint32))
        assert np.array_equal(ctx_dev, ctx_ref)
    assert negative > 0 and err[0] == 0


def test_stage_step_bad_token_flags_and_writes_nan(lib):
    rng = np.random.default_rng(3)
    S = _setup(rng, 3, 2, 2, "Q8_0", "BF16", eos=3)
    ctx = np.array([3, 9], dtype=np.int64)
    inp = np.zeros(S.n_in, dtype=np.float32)
    err = np.zeros(1, dtype=np.int32)
    _launch(lib, S, np.array([S.n_tok], dtype=np.int64), ctx, inp, err)
    assert err[0] == 1
    assert np.isnan(inp[S.x_off:S.x_off + S.n_embd]).all()
    assert ctx.tolist() == [S.n_tok, S.n_tok]  # the context still advances (two PLE layers)
    _launch(lib, S, np.array([5], dtype=np.int64), ctx, inp, err)
    assert err[0] == 1 and not np.isnan(inp[S.x_off:S.x_off + S.n_embd]).any()  # sticky, later steps fine


def test_stage_step_without_ple_layers_writes_the_embedding_only(lib):
    rng = np.random.default_rng(5)
    S = _setup(rng, 3, 2, 0, "F16", "BF16", eos=3)
    ctx = np.array([7, 8], dtype=np.int64)
    inp = np.full(S.n_in, SENTINEL, dtype=np.uint32).view(np.float32)
    err = np.zeros(1, dtype=np.int32)
    _launch(lib, S, np.array([11], dtype=np.int64), ctx, inp, err)
    want, ctx_ref = _reference(S, 11, np.array([7, 8], dtype=np.int64))
    assert np.array_equal(inp.view(np.uint32), want.view(np.uint32))
    assert ctx.tolist() == [7, 8] == ctx_ref.tolist()


class _Dev(np.ndarray):
    """A numpy array posing as a CuPy one for the decoder's staging code (``.data.ptr``, ``.set``, ``.get``)."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)

    def set(self, arr, stream=None):
        self[...] = arr

    def get(self):
        return np.array(self)


class _Stream:
    ptr = 0

    def __init__(self, log):
        self.log = log

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def record(self):
        ev = SimpleNamespace(synchronize=lambda: self.log.append("wait"))
        self.log.append("record")
        return ev

    def wait_event(self, ev):
        pass

    def synchronize(self):
        pass


def _fake_cupy(lib, log):
    """The few CuPy calls StaticDecoder's device staging makes, on host memory, with the kernel from the host build."""
    dev = lambda a: np.ascontiguousarray(a).view(_Dev)  # noqa: E731

    def launch(grid, block, args):
        conv = [a.ctypes.data if isinstance(a, np.ndarray) else a.item() for a in args]
        log.append("kernel")
        lib.host_stage_step(grid[0], 1, *conv)

    module = SimpleNamespace(get_function=lambda name: launch if name == "stage_step" else None)
    runtime = SimpleNamespace(memcpyHostToDevice=1,
                              memcpyAsync=lambda dst, src, n, kind, st: (log.append(("copy", n)),
                                                                         ctypes.memmove(dst, src, n)))
    stream = _Stream(log)
    cp = SimpleNamespace(RawModule=lambda code, options: module, asarray=lambda a: dev(np.array(a)),
                         full=lambda n, v, dtype: dev(np.full(n, v, dtype=dtype)),
                         zeros=lambda n, dtype: dev(np.zeros(n, dtype=dtype)), int64=np.int64, int32=np.int32,
                         cuda=SimpleNamespace(runtime=runtime, get_current_stream=lambda: stream))
    return cp, stream


@pytest.mark.kit
def test_decoder_device_staging_glue_matches_stage_on_the_host(lib, kit, monkeypatch):
    """StaticDecoder.set_device_token / _stage_from_device driven on the CPU (a stand-in for CuPy whose kernel launch
    runs the host build of stage_step): the launch's arguments, the position copies and the context hand-over give,
    step after step, the input buffer _stage writes, bit for bit, on the kit's model (BF16 tables)."""
    import sys

    from stratatools.runtime.gpu.decode import StaticDecoder
    from stratatools.runtime.weights import load

    w = load(kit / "gguf/model-bf16.gguf")
    rt = Qwen4ExpRuntime(w)
    cfg = w.cfg
    log: list = []
    monkeypatch.setitem(sys.modules, "cupyx", SimpleNamespace(empty_pinned=lambda n, dtype: np.zeros(n, dtype=dtype)))
    A = StaticDecoder(rt, max_ctx=12)
    B = StaticDecoder(rt, max_ctx=12)
    B.gpu = True
    B.cp, B._stream = _fake_cupy(lib, log)
    B.inp = np.zeros(B.n_in, dtype=np.float32).view(_Dev)
    B._tok_dev = np.zeros(1, dtype=np.int64).view(_Dev)
    assert B.device_stage_ready() == (True, "")
    eos = cfg.eos_id
    seq = [17, 5, eos, 900, 900, eos, eos, 3, 1000, 2]
    # a context handed over from the host (shorter than ngram - 1: filled with EOS in front on the device)
    A.ple_ctx = np.array([41], dtype=np.int64)
    B.ple_ctx = A.ple_ctx.copy()
    B.set_device_token(seq[0])
    for i, tok in enumerate(seq):
        if i == 6:  # the host sets a token itself: ple_ctx is read back from the device first
            assert B._ple_ctx_on_device and np.array_equal(B.ple_ctx, A.ple_ctx) and not B._ple_ctx_on_device
            B.set_device_token(tok)
        elif i:
            B._tok_dev[0] = tok  # what the previous step's arg-max leaves
        A._stage(tok)
        n0 = len(log)
        B._stage_from_device()
        # a pinned buffer is refilled only after the copy that last read it (two buffers in turn)
        assert log[n0:] == ["wait"] * (i >= 2) + [("copy", 4), ("copy", 4 * (B.n_in - B._cos_sl[0])), "record",
                                                  "kernel"]
        assert np.array_equal(np.asarray(A.inp).view(np.uint32), np.asarray(B.inp).view(np.uint32)), f"step {i}"
        assert np.array_equal(B.device_ple_ctx(), A.ple_ctx)
        A.pos += 1
        B.pos += 1
    assert B.device_stage_errors() == 0
    assert B.pos == len(seq) and A.ple_ctx.tolist() == [1000, 2] == B.device_ple_ctx().tolist()
    # host staging after device-staged steps continues from the device's context
    for tok in (eos, 7):
        A._stage(tok)
        B._stage(tok)
        assert np.array_equal(np.asarray(A.inp).view(np.uint32), np.asarray(B.inp).view(np.uint32))
        A.pos += 1
        B.pos += 1
    assert B.ple_ctx.tolist() == [eos, 7]


def _batch_fake(S, layers, ctxs):
    """A stand-in for BatchDecoder's PLE-context code (``_ple_rows_b``, ``_ctx_rows``, ``_advance_ctx``, ``_keep``):
    the config of ``_setup`` with PLE layers ``layers`` and each place's context ``ctxs``."""
    from stratatools.runtime.gpu.batch import BatchDecoder

    cfg = SimpleNamespace(**vars(S.cfg), ple_layers=list(layers))
    rt = SimpleNamespace(cfg=cfg)
    rt.ple_ngram_ids_rows = lambda ids, ctx, lens: Qwen4ExpRuntime.ple_ngram_ids_rows(rt, ids, ctx, lens)
    f = SimpleNamespace(cfg=cfg, rt=rt, ple_ctx=[np.array(c, dtype=np.int64) for c in ctxs])
    for name in ("_ple_rows_b", "_ctx_rows", "_advance_ctx", "_keep"):
        setattr(f, name, getattr(BatchDecoder, name).__get__(f))
    return f


@pytest.mark.parametrize("ngram,hpn,n_pl,tok_type,ple_type", CASES)
def test_stage_steps_writes_what_the_batched_host_staging_writes(lib, ngram, hpn, n_pl, tok_type, ple_type):
    """``stage_steps`` (a block a place) over 5 places with contexts of every length (empty, short, full; EOS in
    them), step after step: x0 rows, each PLE layer's rows and the rope rows bit for bit what BatchDecoder's host
    staging makes (``_ple_rows_b`` on the host contexts, rows dequantized, ``cos_sin_host`` rows), nothing else in
    the buffer touched, and the device contexts equal to the host's after ``_advance_ctx`` (EOS-padded rows)."""
    rng = np.random.default_rng(1000 + ngram * 100 + hpn * 10 + n_pl)
    eos, N, nr, max_ctx = 3, 5, 6, 20
    S = _setup(rng, ngram, hpn, n_pl, tok_type, ple_type, eos)
    keep = ngram - 1
    layers = [2 * li + 1 for li in range(n_pl)]
    ctxs = [rng.integers(0, S.n_tok, size=m) for m in [0, 1, keep, keep, max(keep - 1, 0)]]
    ctxs[2][0] = eos
    host, devf = _batch_fake(S, layers, ctxs), _batch_fake(S, layers, ctxs)
    wl = S.nh * S.ple_ne0
    lay = {"x0": 0, "cos": N * S.n_embd + 3, "sin": N * S.n_embd + 3 + N * nr}
    lay.update({("ple", li): lay["sin"] + N * nr + 5 + li * (N * wl + 2) for li in range(n_pl)})
    size = (lay[("ple", n_pl - 1)] + N * wl if n_pl else lay["sin"] + N * nr) + 4
    prm = np.concatenate([S.cfg.ple_multipliers, S.cfg.ple_head_vocab, S.cfg.ple_head_offsets,
                          np.array([lay[("ple", li)] for li in range(n_pl)], dtype=np.int64)]).astype(np.int64)
    cos_t = rng.standard_normal((max_ctx, nr)).astype(np.float32)
    sin_t = rng.standard_normal((max_ctx, nr)).astype(np.float32)
    pos = np.array([0, 4, 7, 19, 11], dtype=np.int32)
    err = np.zeros(1, dtype=np.int32)
    p = lambda a: a.ctypes.data  # noqa: E731
    for step in range(12):
        toks = rng.integers(0, S.n_tok, size=N).astype(np.int64)
        toks[rng.random(N) < 0.3] = eos
        pl = np.arange(N, dtype=np.int64)
        ctx = np.ascontiguousarray(devf._ctx_rows(pl))
        buf = np.full(size, SENTINEL, dtype=np.uint32).view(np.float32)
        lib.host_stage_steps(N, 1, p(toks), p(ctx), ctx.shape[1], p(pos), p(cos_t), p(sin_t), max_ctx, nr,
                             lay["cos"], lay["sin"], p(buf), lay["x0"], S.n_embd, p(S.tok_tab), TYPE_IDS[tok_type],
                             S.n_tok, S.tok_tab.shape[1], S.n_embd, wl, p(S.ple_tab), TYPE_IDS[ple_type], S.ple_rows,
                             S.ple_tab.shape[1], S.ple_ne0, p(prm), n_pl, ngram, hpn, eos, p(err))
        want = np.full(size, SENTINEL, dtype=np.uint32).view(np.float32)
        want[:N * S.n_embd] = _deq(S.tok_tab, tok_type, S.n_embd, toks)
        for b in range(N):
            o = lay["cos"] + b * nr
            want[o:o + nr] = cos_t[pos[b]]
            o = lay["sin"] + b * nr
            want[o:o + nr] = sin_t[pos[b]]
        rows = host._ple_rows_b(toks, pl) if n_pl else {}
        for li, il in enumerate(layers):
            o = lay[("ple", li)]
            want[o:o + N * wl] = _deq(S.ple_tab, ple_type, S.ple_ne0, rows[il].reshape(-1))
        assert np.array_equal(buf.view(np.uint32), want.view(np.uint32)), step
        devf._advance_ctx(pl, toks)
        assert [c.tolist() for c in devf.ple_ctx] == [c.tolist() for c in host.ple_ctx], step
        assert np.array_equal(ctx, devf._ctx_rows(pl)), step
        assert err[0] == 0
        pos = (pos + 1) % max_ctx


def test_stage_steps_bad_position_writes_nan_rope_rows_and_flags(lib):
    """A place at a position outside [0, max_ctx) gets quiet-NaN rope rows and bit 4 (sticky); the other place's
    rows and both places' embedding rows are still written."""
    rng = np.random.default_rng(11)
    S = _setup(rng, 3, 1, 1, "BF16", "F16", eos=3)
    N, nr, max_ctx, wl = 2, 4, 8, S.nh * S.ple_ne0
    cos_t = rng.standard_normal((max_ctx, nr)).astype(np.float32)
    sin_t = rng.standard_normal((max_ctx, nr)).astype(np.float32)
    x, c, s_, pb = 0, N * S.n_embd, N * S.n_embd + N * nr, N * S.n_embd + 2 * N * nr
    prm = np.concatenate([S.cfg.ple_multipliers, S.cfg.ple_head_vocab, S.cfg.ple_head_offsets, [pb]]).astype(np.int64)
    err = np.zeros(1, dtype=np.int32)
    p = lambda a: a.ctypes.data  # noqa: E731
    for bad in (max_ctx, -1):
        buf = np.zeros(pb + N * wl, dtype=np.float32)
        toks = np.array([5, 6], dtype=np.int64)
        ctx = np.full((N, 2), 3, dtype=np.int64)
        pos = np.array([2, bad], dtype=np.int32)
        lib.host_stage_steps(N, 1, p(toks), p(ctx), 2, p(pos), p(cos_t), p(sin_t), max_ctx, nr, c, s_, p(buf), x,
                             S.n_embd, p(S.tok_tab), TYPE_IDS["BF16"], S.n_tok, S.tok_tab.shape[1], S.n_embd, wl,
                             p(S.ple_tab), TYPE_IDS["F16"], S.ple_rows, S.ple_tab.shape[1], S.ple_ne0, p(prm), 1, 3, 1,
                             3, p(err))
        assert err[0] == 4
        assert np.array_equal(buf[c:c + nr], cos_t[2]) and np.array_equal(buf[s_:s_ + nr], sin_t[2])
        assert np.isnan(buf[c + nr:c + 2 * nr]).all() and np.isnan(buf[s_ + nr:s_ + 2 * nr]).all()
        want_x = _deq(S.tok_tab, "BF16", S.n_embd, toks)
        assert np.array_equal(buf[:N * S.n_embd].view(np.uint32), want_x.view(np.uint32))
        assert ctx.tolist() == [[3, 5], [3, 6]]
        err[0] = 0


def test_rope_rows_of_the_whole_table_equal_the_step_rows():
    """The batched device staging copies rows of ``Rope.cos_sin_host(arange(max_ctx))``; the host staging computes
    ``cos_sin_host(pos)`` for the step's positions: the same floats bit for bit (numpy's float32 cos / sin do not
    depend on where a value sits in the array)."""
    from stratatools.runtime.model import Rope

    for n_rot, theta in [(64, 1e7), (32, 10000.0), (128, 5e6)]:
        rope = Rope(np, n_rot, theta)
        c_all, s_all = rope.cos_sin_host(np.arange(4096))
        for pos in [np.array([0, 4095, 17, 1023, 2048, 5, 333, 4000, 9, 11, 77]), np.arange(3000, 3032),
                    np.array([123])]:
            c, s = rope.cos_sin_host(pos)
            assert np.array_equal(c_all[pos].view(np.uint32), c.view(np.uint32))
            assert np.array_equal(s_all[pos].view(np.uint32), s.view(np.uint32))
