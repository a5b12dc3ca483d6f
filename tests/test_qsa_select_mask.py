"""qsa_select_mask (the chunk-wide QSA cell selection) against the per-query rule it replaces."""

from __future__ import annotations

import numpy as np
import pytest

from stratatools.runtime.topk import qsa_select_mask, qsa_select_per_query


per_query = qsa_select_per_query  # the per-query rule the runtime ran before (the reference)


def random_scores(rng, T, B, kind):
    if kind == "distinct":
        return rng.standard_normal((T, B)).astype(np.float32)
    if kind == "relu":  # many exact zeros, as ReLU scores have
        return np.maximum(rng.standard_normal((T, B)), 0).astype(np.float32)
    if kind == "few":  # a handful of values: ties everywhere
        return rng.integers(0, 3, (T, B)).astype(np.float32)
    if kind == "equal":
        return np.full((T, B), 0.5, dtype=np.float32)
    sc = rng.standard_normal((T, B)).astype(np.float32)  # "mixed": some rows all equal, some with -0.0 and 0.0
    sc[::3] = 1.0
    sc[1::5, ::2] = -0.0
    sc[1::5, 1::2] = 0.0
    return sc


@pytest.mark.parametrize("selection", ["transformers", "llamacpp"])
def test_vectorized_mask_equals_per_query(selection):
    rng = np.random.default_rng(17)
    cases = fast = slow = 0
    for ratio in (1, 2, 3, 4, 7) * 3:
        for budget in (0, 1, ratio - 1, ratio, 2 * ratio + 1, 8, 13, 40):
            for kind in ("distinct", "relu", "few", "equal", "mixed"):
                n_cells = int(rng.integers(1, 90))
                T = int(rng.integers(1, 12))
                pos = rng.integers(0, n_cells, T)
                # positions at block boundaries (last cell of a block, first cell of the next) and the chunk end
                pos[: min(T, 3)] = [min(n_cells - 1, max(0, b)) for b in (ratio - 1, ratio, n_cells - 1)][: min(T, 3)]
                B = n_cells // ratio + int(rng.integers(0, 3))
                sc = random_scores(rng, T, B, kind)
                stats = {}
                got = qsa_select_mask(selection, sc, pos, ratio, budget, n_cells, stats)
                slow += stats["fallback"]
                fast += T - stats["fallback"]
                want = per_query(selection, sc, pos, ratio, budget, n_cells)
                assert got.shape == (T, n_cells)
                assert np.array_equal(got, want), (selection, ratio, budget, kind, pos.tolist())
                cases += 1
    assert cases == 3 * 5 * 8 * 5
    assert fast > 300 and slow > 100  # both paths ran


@pytest.mark.parametrize("selection", ["transformers", "llamacpp"])
def test_non_finite_scores_fall_back(selection):
    rng = np.random.default_rng(3)
    sc = rng.standard_normal((6, 20)).astype(np.float32)
    sc[0, 2] = np.nan
    sc[1, 4] = np.inf
    sc[2, :] = -np.inf
    pos = np.array([79, 60, 45, 79, 33, 12])
    stats = {}
    got = qsa_select_mask(selection, sc, pos, 4, 9, 80, stats)
    assert np.array_equal(got, per_query(selection, sc, pos, 4, 9, 80))
    assert stats["fallback"] >= 3


def test_distinct_scores_take_the_vectorized_path():
    """Full-width settings (ratio 4, budget 2048), a chunk at 6,000..: no ties, no per-query replay (transformers);
    llama.cpp takes a block in part unless the tail length is (budget - 1) mod ratio."""
    rng = np.random.default_rng(0)
    pos = np.arange(6000, 6064)
    sc = rng.random((64, 6064 // 4)).argsort(axis=1).astype(np.float32)  # distinct scores per row
    stats = {}
    got = qsa_select_mask("transformers", sc, pos, 4, 2048, 6064, stats)
    assert stats["fallback"] == 0
    assert np.array_equal(got, per_query("transformers", sc, pos, 4, 2048, 6064))
    assert np.array_equal(got.sum(axis=1), 512 * 4 + (pos + 1) % 4)
    got = qsa_select_mask("llamacpp", sc[:8], pos[:8], 4, 2048, 6064, stats)
    assert stats["fallback"] == 6  # (p+1)%4 == 3 for p = 6002, 6006
    assert np.array_equal(got, per_query("llamacpp", sc[:8], pos[:8], 4, 2048, 6064))
    assert np.array_equal(got.sum(axis=1), np.full(8, 2048 + 3))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="complete blocks"):
        qsa_select_mask("transformers", np.zeros((1, 2), np.float32), [20], 4, 8, 21)
    with pytest.raises(ValueError, match="rule"):
        qsa_select_mask("other", np.zeros((1, 9), np.float32), [20], 4, 8, 21)


def test_compiled_heap_selection_keeps_partial_sorts_set():
    """_heap_select_set (used for llama.cpp rows that take a block in part) = partial_sort_topk's set, ties too."""
    from stratatools.runtime.topk import _heap_select_set, partial_sort_topk

    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        v = rng.integers(0, 4, n).astype(np.float32)
        v[rng.random(n) < 0.1] = np.inf
        v[rng.random(n) < 0.1] = -np.inf
        k = int(rng.integers(1, n + 1))
        assert sorted(_heap_select_set(v, k).tolist()) == sorted(partial_sort_topk(v, k))
