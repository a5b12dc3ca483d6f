"""The synthetic routing model (stratatools.synth.routing): knobs, per-layer popularity, full-width revisions."""

import numpy as np
import pytest

from stratatools.core.errors import StrataError
from stratatools.model.gguf import open_model
from stratatools.synth.model import SynthConfig
from stratatools.synth.routing import full_values, hot_direction, popularity_rank, router_values


@pytest.mark.parametrize("kw, msg", [(dict(routing="bogus"), "--routing"), (dict(skew=-0.5), "--skew"),
                                     (dict(skew=float("nan")), "--skew"), (dict(locality=1.0), "--locality"),
                                     (dict(linear_v_dim=33), "even")])
def test_bad_knobs_are_refused(kw, msg):
    with pytest.raises(StrataError, match=msg):
        SynthConfig(**kw).validate()


def test_router_popularity_follows_a_per_layer_rank():
    cfg = SynthConfig(n_layers=8, n_expert=64, skew=1.0)
    c = hot_direction(cfg.seed, cfg.hidden)
    pops = []
    for layer in (0, 5):
        name = f"blk.{layer}.ffn_gate_inp.weight"
        r = router_values(cfg, layer, 64, cfg.seed, name)
        bias = r @ c
        rank = popularity_rank(cfg.seed, name, 64)
        assert np.all(np.diff(bias[np.argsort(rank)]) < 0)  # hotter rank, larger bias along c
        pops.append(np.argsort(rank)[:8])
    assert len(set(pops[0]) & set(pops[1])) < 6  # each layer has its own hot set
    flat = router_values(SynthConfig(n_layers=8, n_expert=64, routing="uniform"), 0, 64, 0, "blk.0.ffn_gate_inp.weight")
    assert np.ptp(flat @ c) < 1e-4  # uniform: no popularity


def test_legacy_keeps_the_old_values():
    cfg = SynthConfig(routing="legacy")
    assert full_values(cfg, "blk.0.ffn_gate_inp.weight", (256, 32), 0) is None
    assert not cfg.experts_random(cfg.gu_type(0))


def test_full_width_honours_keep_and_swap(cli, tmp_path):
    out = tmp_path / "fw"
    code, text, err = cli("synth", str(out), "--full-width", "--layers", "2", "--hidden", "256", "--expert-ff", "256",
                          "--experts", "16", "--keep", "8", "--swap", "2", "--k", "4", "--json")
    assert code == 0, err
    for rev in ("revA", "revB"):
        with open_model(out / f"synth-{rev}.gguf") as m:
            assert m.tensors["blk.0.ffn_gate_inp.weight"].ne == (256, 8)
        assert (out / f"synth-{rev}.rco-allocation.txt").exists()


def test_prefetched_producer_keeps_order_errors_and_stops():
    from stratatools.synth.model import _prefetched

    assert list(_prefetched(lambda: iter(range(50)))()) == list(range(50))

    def bad():
        yield b"ok"
        raise StrataError("boom")

    with pytest.raises(StrataError, match="boom"):
        list(_prefetched(bad)())
    made = []

    def endless():
        i = 0
        while True:
            made.append(i)
            yield i
            i += 1

    g = _prefetched(endless, depth=2)()
    assert next(g) == 0
    g.close()  # the helper thread stops instead of running on
    n = len(made)
    import time
    time.sleep(0.05)
    assert len(made) == n <= 5


def test_repeated_rows_are_written_like_quantized_rows():
    from stratatools.model.quantize import quantize
    from stratatools.synth.model import _producer, _tensor_list

    cfg = SynthConfig(n_layers=4)
    for name in ("blk.0.attn_gate.weight", "blk.0.ssm_alpha.weight", "blk.0.attn_qkv.weight"):
        sp = next(s for s in _tensor_list(cfg, 300) if s.name == name)
        got = b"".join(bytes(c) for c in _producer(sp, 0, cfg)())
        want = bytes(quantize(np.ascontiguousarray(full_values(cfg, name, sp.ne, 0)), sp.gtype))
        assert got == want and len(got) == sp.gtype.nbytes(sp.ne)


def test_pipelined_producers_keep_order_errors_and_stop():
    import threading
    import time

    from stratatools.synth.model import _pipelined

    gens = _pipelined([lambda: iter([1, 2]), lambda: iter([]), lambda: iter(range(3, 40))], depth=2)
    assert [list(g()) for g in gens] == [[1, 2], [], list(range(3, 40))]

    def bad():
        yield b"ok"
        raise StrataError("boom")

    gens = _pipelined([lambda: iter([b"a"]), bad])
    assert list(gens[0]()) == [b"a"]
    with pytest.raises(StrataError, match="boom"):
        list(gens[1]())
    made = []

    def endless():
        i = 0
        while True:
            made.append(i)
            yield i
            i += 1

    before = threading.active_count()
    g = _pipelined([endless, endless], depth=2)[0]()
    assert next(g) == 0
    g.close()  # the writer stopped (an error while writing): the helper thread stops instead of running on
    n = len(made)
    time.sleep(0.05)
    assert len(made) == n <= 5 and threading.active_count() == before


@pytest.mark.parametrize("routing, opt", [("uniform", "--skew"), ("legacy", "--locality")])
def test_skew_or_locality_with_a_routing_that_ignores_them_is_refused(cli, tmp_path, routing, opt):
    out = tmp_path / "rel"
    code, _, err = cli("synth", str(out), "--layers", "2", "--experts", "8", "--routing", routing, opt, "0.5")
    assert code == 2 and "Traceback" not in err
    assert f"{opt} 0.5" in err and routing in err and "realistic" in err
    assert not out.exists()


def test_cli_help_presets_match_routing():
    # the synth command shows the routing presets without importing numpy; they must be the library's
    from stratatools.cli import model_cmds
    from stratatools.synth.routing import PRESETS

    assert PRESETS["realistic"] == (model_cmds.DEFAULT_SKEW, model_cmds.DEFAULT_LOCALITY)
    assert PRESETS["bursty"] == (model_cmds.BURSTY_SKEW, model_cmds.BURSTY_LOCALITY)
