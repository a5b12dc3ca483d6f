"""Top-k selections as llama.cpp and torch make them, ties included; llama.cpp's QSA cell selection.

ggml's CPU ``top_k`` (ggml-cpu ``ops.cpp``) fills an index array 0..n-1, runs ``std::partial_sort`` on it
with the comparator ``data[a] > data[b]`` and then swaps the first two results. libstdc++'s
``partial_sort`` is a heap selection (build a heap over the first k indices, then replace the heap top by
every later index that compares strictly better) followed by a heap sort. Cells of one QSA block share one
score, so *which* cells of a partly taken block are chosen depends on that heap; this module reproduces
the algorithm step by step (written from its specification: binary heap, hole-percolation ``adjust_heap``
then ``push_heap``), so the set and the order match llama.cpp's ``indexer_top_k`` tensor.

transformers' indexer picks blocks with ``torch.topk`` on the CPU, which (ATen ``TopKImpl.h``) fills a
queue of (value, index) pairs and runs ``std::partial_sort`` when ``k * 64 <= n``, else
``std::nth_element`` at ``k - 1``, with the strict comparator ``a.value > b.value``. Blocks whose ReLU
score is exactly 0 tie; :func:`torch_topk_indices` reproduces libstdc++'s introselect so the runtime keeps
the same blocks transformers keeps.

Cell scores (kit README section 6, checked against ``routing/llamacpp-bf16.indexer_topk.csv``): a cell of
a complete visible block gets its block's score, a visible cell of the incomplete tail +inf, an invisible
(future) cell -inf.
"""

from __future__ import annotations

import numpy as np

from stratatools.core.jit import njit


def _adjust_heap(idx: list[int], hole: int, length: int, value: int, less) -> None:
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if less(idx[child], idx[child - 1]):
            child -= 1
        idx[hole] = idx[child]
        hole = child
    if (length & 1) == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        idx[hole] = idx[child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and less(idx[parent], value):
        idx[hole] = idx[parent]
        hole = parent
        parent = (hole - 1) // 2
    idx[hole] = value


def _make_heap(idx: list[int], length: int, less) -> None:
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(idx, parent, length, idx[parent], less)
        if parent == 0:
            return
        parent -= 1


def partial_sort_topk(values: np.ndarray, k: int) -> list[int]:
    """Indices of the top ``k`` of ``values`` exactly as ggml's CPU ``top_k`` returns them.

    Emulates ``std::partial_sort(idx, idx + k, idx + n, [](a, b) { return v[a] > v[b]; })`` of libstdc++
    (heap select, then sort_heap) and the final swap of the first two entries.
    """
    v = [float(x) for x in np.asarray(values, dtype=np.float32).tolist()]
    n = len(v)
    k = min(k, n)
    if k <= 0:
        return []
    idx = list(range(n))

    def less(a: int, b: int) -> bool:  # the comparator: "a before b" = v[a] > v[b]
        return v[a] > v[b]

    _heap_select(idx, 0, k, n, less)
    last = k
    while last > 1:  # sort_heap
        last -= 1
        val = idx[last]
        idx[last] = idx[0]
        _adjust_heap(idx, 0, last, val, less)
    out = idx[:k]
    if k > 1:
        out[0], out[1] = out[1], out[0]
    return out


def llamacpp_cell_scores(block_scores: np.ndarray, ratio: int, pos: int, n_cells: int) -> np.ndarray:
    """Per-cell scores [n_cells] for a query at ``pos``: block score, +inf for the tail, -inf if invisible."""
    s = np.full(n_cells, -np.inf, dtype=np.float32)
    nb = len(block_scores)
    if nb:
        s[:nb * ratio] = np.repeat(np.asarray(block_scores, dtype=np.float32), ratio)
    s[nb * ratio:pos + 1] = np.inf
    return s


def llamacpp_cells(block_scores: np.ndarray, ratio: int, pos: int, k: int, n_cells: int) -> np.ndarray:
    """The visible cells llama.cpp attends for a query at ``pos`` (its top ``k`` cells, future ones dropped)."""
    sel = partial_sort_topk(llamacpp_cell_scores(block_scores, ratio, pos, n_cells), k)
    return np.array([c for c in sel if c <= pos], dtype=np.int64)


# --- libstdc++ introselect (std::nth_element), used by torch.topk on the CPU ------------------------------
def _move_median_to_first(a: list, result: int, x: int, y: int, z: int, less) -> None:
    if less(a[x], a[y]):
        if less(a[y], a[z]):
            a[result], a[y] = a[y], a[result]
        elif less(a[x], a[z]):
            a[result], a[z] = a[z], a[result]
        else:
            a[result], a[x] = a[x], a[result]
    elif less(a[x], a[z]):
        a[result], a[x] = a[x], a[result]
    elif less(a[y], a[z]):
        a[result], a[z] = a[z], a[result]
    else:
        a[result], a[y] = a[y], a[result]


def _unguarded_partition(a: list, first: int, last: int, pivot: int, less) -> int:
    while True:
        while less(a[first], a[pivot]):
            first += 1
        last -= 1
        while less(a[pivot], a[last]):
            last -= 1
        if not first < last:
            return first
        a[first], a[last] = a[last], a[first]
        first += 1


def _insertion_sort(a: list, first: int, last: int, less) -> None:
    for i in range(first + 1, last):
        val = a[i]
        if less(val, a[first]):
            a[first + 1:i + 1] = a[first:i]
            a[first] = val
        else:
            j = i
            while less(val, a[j - 1]):
                a[j] = a[j - 1]
                j -= 1
            a[j] = val


def _heap_select(a: list, first: int, middle: int, last: int, less) -> None:
    """libstdc++ ``__heap_select`` on ``a[first:last]`` (elements compared with ``less``)."""
    heap = a[first:middle]
    _make_heap(heap, len(heap), less)
    for i in range(middle, last):
        if less(a[i], heap[0]):
            val = a[i]
            a[i] = heap[0]
            _adjust_heap(heap, 0, len(heap), val, less)
    a[first:middle] = heap


def nth_element(a: list, nth: int, less) -> None:
    """In-place ``std::nth_element(a.begin(), a.begin() + nth, a.end(), less)`` as libstdc++ does it."""
    first, last = 0, len(a)
    if first == last or nth == last:
        return
    depth = 2 * ((last - first).bit_length() - 1)
    while last - first > 3:
        if depth == 0:
            _heap_select(a, first, nth + 1, last, less)
            a[first], a[nth] = a[nth], a[first]
            return
        depth -= 1
        mid = first + (last - first) // 2
        _move_median_to_first(a, first, first + 1, mid, last - 1, less)
        cut = _unguarded_partition(a, first + 1, last, first, less)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(a, first, last, less)


def torch_topk_indices(values: np.ndarray, k: int) -> list[int]:
    """The index *set* ``torch.topk(values, k)`` returns on the CPU (largest, non-deterministic mode).

    Emulates ATen ``topk_impl_loop``: ``partial_sort`` when ``k * 64 <= n``, else ``nth_element`` at
    ``k - 1``; comparator ``x.value > y.value`` (ties compare false). Returned in queue order.
    """
    v = np.asarray(values, dtype=np.float32).tolist()
    n = len(v)
    k = min(k, n)
    if k <= 0:
        return []
    if k * 64 <= n:
        out = partial_sort_topk(np.asarray(v, dtype=np.float32), k)
        if k > 1:  # partial_sort_topk applies ggml's swap; torch does not
            out[0], out[1] = out[1], out[0]
        return out
    q = [(float(x), i) for i, x in enumerate(v)]
    nth_element(q, k - 1, lambda x, y: x[0] > y[0])
    return [i for _, i in q[:k]]


def qsa_selects_all(selection: str, ratio: int, budget: int, p: int) -> bool:
    """True when QSA attends every visible cell at position ``p`` (0-based) of a layer with compress ratio ``ratio``
    and indexer budget ``budget`` tokens: no ratio (plain attention); ``transformers`` rule: the complete blocks
    ``(p+1)//ratio`` fit the ``budget//ratio`` blocks taken; ``llamacpp`` rule: the ``p+1`` visible cells fit the
    ``budget + ratio - 1`` cells taken."""
    if ratio <= 0:
        return True
    if selection == "transformers":
        return (p + 1) // ratio <= budget // ratio
    return p + 1 <= budget + ratio - 1


@njit(cache=True, nogil=True)
def _heap_select_set(v: np.ndarray, k: int) -> np.ndarray:  # pragma: no cover - compiled (or plain Python)
    """The indices libstdc++'s ``__heap_select`` keeps as the top ``k`` of ``v`` (float32 [n]), comparator
    ``v[a] > v[b]``: the set :func:`partial_sort_topk` returns (its sort_heap and swap only reorder it). The
    same steps as ``_make_heap`` / ``_adjust_heap`` / ``_heap_select`` above, compiled with numba."""
    n = v.shape[0]
    idx = np.arange(k)
    for parent in range((k - 2) // 2, -1, -1):
        _sift(v, idx, parent, k, idx[parent])
    for i in range(k, n):
        if v[i] > v[idx[0]]:
            _sift(v, idx, 0, k, i)
    return idx


@njit(cache=True, nogil=True)
def _sift(v: np.ndarray, idx: np.ndarray, hole: int, length: int, value: int) -> None:  # pragma: no cover
    """``_adjust_heap`` on index array ``idx`` with ``less(a, b) = v[a] > v[b]``."""
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if v[idx[child]] > v[idx[child - 1]]:
            child -= 1
        idx[hole] = idx[child]
        hole = child
    if (length & 1) == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        idx[hole] = idx[child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and v[idx[parent]] > v[value]:
        idx[hole] = idx[parent]
        hole = parent
        parent = (hole - 1) // 2
    idx[hole] = value


def qsa_select_per_query(selection: str, scores: np.ndarray, pos: np.ndarray, ratio: int, budget: int,
                         n_cells: int) -> np.ndarray:
    """The per-query QSA rule, one query at a time (:func:`torch_topk_indices` / :func:`llamacpp_cells` per row):
    the reference :func:`qsa_select_mask` equals, kept for its tests and benchmark. Same arguments and result
    (boolean mask [T, n_cells]); no checks."""
    mask = np.zeros((len(pos), n_cells), dtype=bool)
    for t, pp in enumerate(pos):
        pp = int(pp)
        nb = (pp + 1) // ratio
        if selection == "transformers":
            if nb > 0:
                for blk in torch_topk_indices(scores[t, :nb], min(budget // ratio, nb)):
                    mask[t, blk * ratio:(blk + 1) * ratio] = True
            mask[t, nb * ratio:pp + 1] = True
        else:
            mask[t, llamacpp_cells(scores[t, :nb], ratio, pp, budget + ratio - 1, n_cells)] = True
    return mask


def qsa_select_mask(selection: str, scores: np.ndarray, pos: np.ndarray, ratio: int, budget: int, n_cells: int,
                    stats: dict | None = None) -> np.ndarray:
    """The cells each of ``T`` queries attends, for a whole chunk at once: boolean mask [T, n_cells].

    Row ``t`` equals what the per-query rule of :meth:`stratatools.runtime.model.Qwen4ExpRuntime._select` gives for
    the query at ``pos[t]`` (0-based) with ``nb = (pos[t]+1)//ratio`` complete blocks scored by ``scores[t, :nb]``:
    ``transformers``: the blocks :func:`torch_topk_indices` keeps (``min(budget//ratio, nb)`` of them) plus the
    incomplete tail ``nb*ratio..pos[t]``; ``llamacpp``: :func:`llamacpp_cells` (top ``budget+ratio-1`` cells).

    Vectorized with numpy: each row's ``kb``-th largest block score (``kb`` blocks needed) is the threshold; when
    the blocks scoring at least the threshold are exactly the ones needed (no tie straddles it, and for
    ``llamacpp`` no block is taken in part) the chosen set is unique, so any top-k algorithm gives it and the row
    is ``scores >= threshold``. Other rows (ties across the threshold, a partly taken block, non-finite scores)
    replay the exact per-query function, whose tie rule decides (the device kernel ``qsa_select`` in
    ``gpu/qsa_step.cu`` splits the same way). Scores are rounded to float32 first, as the per-query functions do.

    Args:
        selection: ``transformers`` or ``llamacpp``.
        scores: block scores [T, B] with ``B >= (max(pos)+1)//ratio`` (later columns are ignored per row).
        pos: query positions [T] (int).
        ratio: compress ratio (> 0); budget: indexer budget in tokens (``idx_budget``).
        n_cells: mask width (the cache length, ``> max(pos)``).
        stats: if given, ``stats["fallback"]`` gets the number of rows that ran the per-query function.

    Memory: the mask plus a few [T, B] arrays (B = n_cells // ratio).

    Raises:
        ValueError: shapes that do not fit (a caller's bug, not bad input), an unknown rule or ``ratio <= 0``.
    """
    if selection not in ("transformers", "llamacpp"):
        raise ValueError(f"unknown QSA selection rule {selection!r}")
    if ratio <= 0:
        raise ValueError(f"compress ratio {ratio} is not positive")
    pos = np.asarray(pos, dtype=np.int64).reshape(-1)
    T = int(pos.size)
    sc = np.asarray(scores, dtype=np.float32)
    if sc.ndim != 2 or sc.shape[0] != T:
        raise ValueError(f"scores of shape {sc.shape} do not match {T} positions")
    mask = np.zeros((T, n_cells), dtype=bool)
    if T == 0:
        return mask
    if int(pos.min()) < 0 or int(pos.max()) >= n_cells:
        raise ValueError(f"positions {int(pos.min())}..{int(pos.max())} outside the {n_cells} cells")
    nb = (pos + 1) // ratio  # complete blocks per row
    B = int(nb.max())
    if B > sc.shape[1]:
        raise ValueError(f"{sc.shape[1]} block scores but position {int(pos.max())} has {B} complete blocks")
    s = sc[:, :B]
    valid = np.arange(B)[None, :] < nb[:, None]  # [T, B]
    tail = pos + 1 - nb * ratio
    if selection == "transformers":
        kb = np.clip(np.minimum(budget // ratio, nb), 0, None)  # blocks taken (torch_topk_indices: k <= 0 -> none)
        need = kb * ratio
        special = np.zeros(T, dtype=bool)
    else:
        k = budget + ratio - 1
        allvis = k >= pos + 1  # every visible cell is among the top k (future cells score -inf)
        need = np.where(allvis, nb * ratio, k - tail)  # cells taken from complete blocks (the tail is all taken)
        kb = np.where(allvis, nb, np.clip(-(-need // ratio), 0, None))
        special = ~allvis & (need < 0)  # a budget so small that not even the tail fits: per query
    bad = special | np.any(valid & ~np.isfinite(s), axis=1)
    sm = np.where(valid, s, np.float32(-np.inf))
    th = np.full(T, np.inf, dtype=np.float32)
    some = (kb > 0) & ~bad
    if some.any():
        srt = -np.sort(-sm, axis=1)  # descending per row
        th[some] = srt[some, kb[some] - 1]
    ge = valid & (sm >= th[:, None])  # rows without blocks: th = +inf, nothing (scores are finite)
    fits = ge.sum(axis=1) * ratio == need
    blocks = ge & (fits & ~bad)[:, None]
    if B:
        mask[:, :B * ratio] = np.repeat(blocks, ratio, axis=1)
    for j in range(ratio - 1):  # the incomplete tail: fewer than ratio cells per row
        rows = np.nonzero(j < tail)[0]
        mask[rows, nb[rows] * ratio + j] = True
    slow = np.nonzero(bad | ~fits)[0]
    for t in slow:
        mask[t] = False
        pp, n = int(pos[t]), int(nb[t])
        if selection == "transformers":
            if n > 0:
                for blk in torch_topk_indices(sc[t, :n], min(budget // ratio, n)):
                    mask[t, blk * ratio:(blk + 1) * ratio] = True
            mask[t, n * ratio:pp + 1] = True
        else:  # llamacpp_cells: the set partial_sort_topk keeps (compiled), future cells dropped
            cs = llamacpp_cell_scores(sc[t, :n], ratio, pp, n_cells)
            kk = min(budget + ratio - 1, n_cells)
            if kk > 0:
                sel = _heap_select_set(cs, kk)
                mask[t, sel[sel <= pp]] = True
    if stats is not None:
        stats["fallback"] = int(slow.size)
    return mask
