"""Loading a qwen4exp model for the runtime: a GGUF (one file or a shard set), optionally with a native pack.

Everything except the routed experts comes from the GGUF; routed experts come from the pack's
``experts.bin`` arena, from the GGUF offsets the pack's ``native_experts.txt`` names, or (no pack) from the
GGUF's ``ffn_{gate,up,down}_exps`` tensors. Conventions of llama.cpp's qwen4exp converter that the runtime
relies on (checked tensor by tensor against the kit's HF checkpoint; kit README sections 3 and 8):

* names and layouts of the table in kit README section 3; a GGUF ``[ne0, ne1]`` matrix is numpy
  ``(ne1, ne0)`` = torch ``nn.Linear.weight`` (out, in), so ``y = x @ W.T``;
* every zero-centred RMSNorm gamma is stored folded (``1 + w``: ``hc_*_norm``, ``attn_{q,k}_norm``,
  ``indexer.{q,k}_norm``, ``ple_norm_*``, ``output_hc_norm``); ``ssm_norm`` (the GDN gated norm) is stored
  as is; the HC/PLE norms are 1-D ``[hc * n_embd]``, one gamma per stream;
* ``ssm_a`` holds ``-exp(A_log)``;
* GDN value heads are stored **tiled** (value head j is served by key head ``j % n_k_heads``), not grouped
  as in transformers; every value-head tensor (``attn_qkv`` V rows, ``attn_gate``, ``ssm_alpha``,
  ``ssm_beta``, ``ssm_a``, ``ssm_dt.bias``, ``ssm_conv1d`` V channels, ``ssm_out`` columns) uses the same
  order, so the runtime computes in the file's order;
* the indexer's ``index_qk_proj`` is split into ``indexer.q_proj`` and ``indexer.k_proj``;
* the PLE table is the global ``per_layer_token_embd.weight`` and the hash constants are UINT64 metadata.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.model.ggml_types import GGMLType, type_by_id
from stratatools.model.gguf import Model, open_model

from stratatools.pack.native import EXPERTS_BIN, NATIVE_TXT, Pack, read_pack

from stratatools.runtime.config import Qwen4ExpConfig, read_config

try:  # the colleague-written dequantizer (numpy + CuPy); gguf.quants plus a local Q2_0 decoder otherwise
    from stratatools.runtime.dequant import dequantize as _dequantize
except ImportError:  # pragma: no cover - only while runtime/dequant.py is absent
    _dequantize = None

ROLES = ("gate", "up", "down")


def dequantize(raw: np.ndarray, gtype: GGMLType, n_values: int, xp: Any = np) -> Any:
    """Dequantize ``raw`` bytes of ``gtype`` to ``n_values`` float32 values on array module ``xp``.

    Uses :func:`stratatools.runtime.dequant.dequantize` when present; otherwise ``gguf.quants.dequantize`` (CPU) and a
    local Q2_0 decoder (formats.md section 1: fp16 d, 16 bytes of 2-bit codes, value ``(code - 1) * d``).
    """
    if _dequantize is not None:
        return _dequantize(raw, gtype, n_values, xp=xp)
    raw = np.asarray(raw, dtype=np.uint8)  # pragma: no cover
    if gtype.name == "Q2_0":  # pragma: no cover
        b = raw.reshape(-1, 18)
        d = b[:, :2].copy().view("<f2").astype(np.float32)
        codes = (b[:, 2:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
        out = ((codes.reshape(-1, 64).astype(np.float32) - 1) * d).reshape(-1)
    else:  # pragma: no cover
        import gguf.quants

        out = np.asarray(gguf.quants.dequantize(raw, gtype.id), dtype=np.float32).reshape(-1)
    return xp.asarray(out[:n_values])


@dataclass(frozen=True)
class ExpertSlice:
    """Where one role of one layer's routed experts lives: file, absolute offset of expert 0, bytes per expert."""

    path: Path
    offset: int
    slice_bytes: int
    type: GGMLType
    shape: tuple[int, int]  # numpy shape of one expert's matrix (out, in)


class ExpertSource:
    """Routed-expert bytes and their float32 matrices, read lazily from a memory map.

    ``raw(layer, expert)`` gives the three role slices (uint8 views, zero-copy); ``matrices(layer, expert)``
    dequantizes them on ``xp`` (gate (ff, n), up (ff, n), down (n, ff)), keeping an LRU of dequantized
    experts up to ``cache_bytes`` float32 bytes (host-memory serving of the tier's misses).
    """

    def __init__(self, layers: list[dict[str, ExpertSlice]], n_expert: list[int], xp: Any = np,
                 cache_bytes: int = 1 << 30, arena: tuple[Path, list[int], list[int]] | None = None):
        self.layers = layers
        self.n_expert = n_expert
        self.xp = xp
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple[int, int], tuple[Any, Any, Any]] = OrderedDict()
        self._cached = 0
        self._maps: dict[Path, np.ndarray] = {}
        self.arena = arena  # (path, layer offsets, blob bytes) when serving from experts.bin
        self.source = "experts.bin" if arena else "gguf"

    def _map(self, path: Path) -> np.ndarray:
        m = self._maps.get(path)
        if m is None:
            m = np.memmap(path, dtype=np.uint8, mode="r")
            self._maps[path] = m
        return m

    def blob_bytes(self, layer: int) -> int:
        """Bytes of one expert of ``layer`` ([gate][up][down])."""
        return sum(s.slice_bytes for s in self.layers[layer].values())

    def raw(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The gate, up and down byte slices of one expert (zero-copy uint8 views)."""
        if not 0 <= expert < self.n_expert[layer]:
            raise StrataError(f"layer {layer}: expert {expert} is out of range (the layer has {self.n_expert[layer]})")
        sl = self.layers[layer]
        if self.arena is not None:
            path, offs, blobs = self.arena
            m = self._map(path)
            base = offs[layer] + expert * blobs[layer]
            out = []
            for r in ROLES:
                n = sl[r].slice_bytes
                out.append(m[base:base + n])
                base += n
            return out[0], out[1], out[2]
        res = []
        for r in ROLES:
            s = sl[r]
            m = self._map(s.path)
            a = s.offset + expert * s.slice_bytes
            res.append(m[a:a + s.slice_bytes])
        return res[0], res[1], res[2]

    def matrices(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        """Float32 (gate (ff, n), up (ff, n), down (n, ff)) of one expert on ``xp``."""
        key = (layer, expert)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        raws = self.raw(layer, expert)
        mats = []
        for r, raw in zip(ROLES, raws):
            s = self.layers[layer][r]
            n = s.shape[0] * s.shape[1]
            mats.append(dequantize(raw, s.type, n, xp=self.xp).reshape(s.shape))
        val = (mats[0], mats[1], mats[2])
        size = sum(int(m.size) * 4 for m in mats)
        if self.cache_bytes > 0 and size <= self.cache_bytes:
            self._cache[key] = val
            self._cached += size
            while self._cached > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached -= sum(int(m.size) * 4 for m in old)
        return val


class Weights:
    """A loaded qwen4exp model: its config, dense tensors (dequantized on first use) and routed experts.

    Attributes:
        model: the open GGUF (:class:`stratatools.model.gguf.Model`).
        cfg: :class:`~stratatools.runtime.config.Qwen4ExpConfig`.
        experts: :class:`ExpertSource`.
        pack: the :class:`stratatools.pack.native.Pack` when loaded through a pack, else None.
        xp: the array module (numpy or cupy).
    """

    def __init__(self, model: Model, cfg: Qwen4ExpConfig, experts: ExpertSource, pack: Pack | None, xp: Any):
        self.model = model
        self.cfg = cfg
        self.experts = experts
        self.pack = pack
        self.xp = xp
        self._dense: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        """A dense tensor as float32 on ``xp`` in numpy order (reverse of ne), cached.

        Raises StrataError naming the model when the tensor is missing.
        """
        a = self._dense.get(name)
        if a is None:
            t = self.model.tensor(name)
            n = 1
            for d in t.ne:
                n *= int(d)
            a = dequantize(self.model.raw(t), t.type, n, xp=self.xp).reshape(tuple(reversed(t.ne)))
            a = self.xp.ascontiguousarray(a, dtype=self.xp.float32)
            self._dense[name] = a
        return a

    def has(self, name: str) -> bool:
        """True when the model has a tensor of that GGUF name."""
        return self.model.has(name)

    def rows(self, name: str, ids: Any) -> Any:
        """Rows ``ids`` of a 2-D table (token embedding, PLE table) without dequantizing the whole table.

        The PLE table of a real release is ~28.8 GB; only the addressed rows are decoded.
        """
        t = self.model.tensor(name)
        ne0 = int(t.ne[0])
        rb = t.type.row_bytes(ne0)
        ids_np = np.asarray(ids if isinstance(ids, np.ndarray) else _to_numpy(ids), dtype=np.int64).reshape(-1)
        if name in self._dense:
            return self._dense[name][self.xp.asarray(ids_np)]
        raw = self.model.raw(t)
        if ids_np.size and (ids_np.min() < 0 or ids_np.max() >= int(t.ne[1])):
            raise StrataError(f"{self.model.path}: tensor {name}: row id out of range [0, {int(t.ne[1])})")
        out = np.empty((ids_np.size, ne0), dtype=np.float32)
        uniq, inv = np.unique(ids_np, return_inverse=True)
        dec = {}
        for u in uniq.tolist():
            dec[u] = _to_numpy(dequantize(raw[u * rb:(u + 1) * rb], t.type, ne0))
        for i, u in enumerate(ids_np.tolist()):
            out[i] = dec[u]
        return self.xp.asarray(out)

    def close(self) -> None:
        """Release the model's memory maps."""
        self.model.close()


def _to_numpy(a: Any) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) else a)


def _gguf_expert_slices(model: Model, cfg: Qwen4ExpConfig) -> list[dict[str, ExpertSlice]]:
    out = []
    for il in range(cfg.n_layer):
        e = cfg.n_expert[il]
        d: dict[str, ExpertSlice] = {}
        for r in ROLES:
            t = model.tensor(f"blk.{il}.ffn_{r}_exps.weight")
            if len(t.ne) != 3 or int(t.ne[2]) != e:
                raise StrataError(f"{model.path}: tensor {t.name} has shape {list(t.ne)}; expected 3-D with ne2 = {e} "
                                  f"(the router's expert count)", model.path)
            d[r] = ExpertSlice(model.file_of(t).path, t.offset, t.nbytes // e, t.type, (int(t.ne[1]), int(t.ne[0])))
        if d["gate"].type.id != d["up"].type.id:
            raise StrataError(f"{model.path}: layer {il}: gate ({d['gate'].type.name}) and up ({d['up'].type.name}) "
                              f"experts have different types", model.path)
        out.append(d)
    return out


def _check_pack(pack: Pack, model: Model, cfg: Qwen4ExpConfig,
                slices: list[dict[str, ExpertSlice]]) -> None:
    """Refuse a pack whose table does not describe ``model`` (types, sizes, offsets, shard files)."""
    p = pack.path / NATIVE_TXT
    if len(pack.layers) != cfg.n_layer:
        raise StrataError(f"{p}: the table has {len(pack.layers)} layers but {model.path} has {cfg.n_layer} trunk layers "
                          f"(pack this model again)", p)
    for il, row in enumerate(pack.layers):
        e = cfg.n_expert[il]
        if pack.n_expert != e:
            raise StrataError(f"{p}: layer {il}: n_expert {pack.n_expert} but layer {il}'s router in {model.path} has "
                              f"{e} experts (pack this model again)", p)
        s = slices[il]
        for col, want, role in (("gu_type", row.gu_type, "gate"), ("gu_type", row.gu_type, "up"), ("d_type", row.d_type, "down")):
            if want != s[role].type.id:
                try:
                    wname = type_by_id(want).name
                except StrataError:
                    wname = f"id {want}"
                raise StrataError(f"{p}: layer {il}: {col} is {wname} but blk.{il}.ffn_{role}_exps.weight in "
                                  f"{model.path.name} is {s[role].type.name} (the pack was made from another model)", p)
        blob = sum(x.slice_bytes for x in s.values())
        if row.blob_bytes != blob:
            raise StrataError(f"{p}: layer {il}: blob_bytes {row.blob_bytes} but layer {il}'s experts in "
                              f"{model.path.name} are {blob} bytes each (the pack was made from another model)", p)
        shards = row.shards or ("", "", "")
        for role, off, shard in zip(ROLES, (row.gate_off, row.up_off, row.down_off), shards):
            if off is None:
                continue
            t = model.tensor(f"blk.{il}.ffn_{role}_exps.weight")
            fname = model.file_of(t).path.name
            want_file = shard or model.files[0].path.name
            if want_file != fname:
                raise StrataError(f"{p}: layer {il}: {role} tensor of layer {il} is named in shard {want_file} but "
                                  f"{model.path.name}'s shard set has it in {fname}", p)
            if off != t.offset:
                raise StrataError(f"{p}: layer {il}: {role}_off {off} but blk.{il}.ffn_{role}_exps.weight starts at byte "
                                  f"{t.offset} of {fname} (the pack was made from another model)", p)


def find_pack_model(pack: Pack) -> Path | None:
    """The GGUF a pack was made from, or None.

    Looked up in order: the pack's provenance sidecar (``native_experts.txt.json``, inputs with role
    ``shard``: their recorded paths), then the header's shard-1 name (and ``experts.bin.src.json``'s shard
    names) in the pack folder and in its parent.
    """
    names: list[str] = []
    side = pack.path / (NATIVE_TXT + ".json")
    for f in (side, pack.path / (EXPERTS_BIN + ".src.json")):
        try:
            info = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        items = (info.get("inputs") or info.get("shards") or []) if isinstance(info, dict) else []
        for it in items:
            if isinstance(it, dict):
                if it.get("path"):
                    q = Path(it["path"])
                    if q.is_file():
                        return q
                if it.get("name"):
                    names.append(str(it["name"]))
    if pack.source_name:
        names.insert(0, pack.source_name)
    for n in names:
        for d in (pack.path, pack.path.parent):
            q = d / Path(n).name
            if q.is_file():
                return q
    return None


def load(path: str | os.PathLike, model_path: str | os.PathLike | None = None, *, xp: Any = np,
         use_arena: bool | None = None, output_gate: str = "sigmoid", expert_cache_bytes: int = 1 << 30) -> Weights:
    """Load a model for the runtime.

    Args:
        path: a GGUF (file or any shard of a set) or a pack folder (``native_experts.txt`` [+ experts.bin]).
        model_path: the pack's GGUF when ``path`` is a pack and the pack does not name it.
        xp: numpy or cupy.
        use_arena: read experts from ``experts.bin`` (default: when present) instead of the GGUF offsets.
        output_gate: GDN output gate activation (``sigmoid``, llama.cpp's; or ``silu``).
        expert_cache_bytes: LRU of dequantized experts kept in memory (float32 bytes).

    Raises:
        StrataError: unreadable GGUF, not qwen4exp, missing tensors, a pack table that does not match the GGUF
            (layers, expert count, types, blob sizes, offsets, shard names), an experts.bin of the wrong size.
    """
    p = Path(path)
    pack = None
    if p.is_dir() or p.name == NATIVE_TXT:
        pack = read_pack(p)
        mp = Path(model_path) if model_path else find_pack_model(pack)
        if mp is None:
            raise StrataError(f"{pack.path}: cannot tell which GGUF this pack was made from; pass --model MODEL.gguf", pack.path)
        model = open_model(mp)
    else:
        if model_path:
            raise StrataError(f"{p}: --model is only for pack folders; {p.name} is already a model")
        model = open_model(p)
    try:
        cfg = read_config(model, output_gate=output_gate)
        slices = _gguf_expert_slices(model, cfg)
        arena = None
        if pack is not None:
            _check_pack(pack, model, cfg, slices)
            bin_path = pack.path / EXPERTS_BIN
            have_arena = bin_path.exists()
            if use_arena and not have_arena:
                raise StrataError(f"{bin_path}: no such file (pack with --experts-bin, or run without it)", bin_path)
            if have_arena and use_arena is not False:
                size = bin_path.stat().st_size
                if size != pack.total_bytes:
                    raise StrataError(f"{bin_path}: {size} bytes but {NATIVE_TXT} describes {pack.total_bytes} "
                                      f"(a stale or cut-short experts.bin; pack again)", bin_path)
                arena = (bin_path, [r.offset for r in pack.layers], [r.blob_bytes for r in pack.layers])
            elif any(r.gate_off is None for r in pack.layers):
                raise StrataError(f"{pack.path}: the table has no GGUF offsets and there is no experts.bin; pack again", pack.path)
        experts = ExpertSource(slices, cfg.n_expert, xp=xp, cache_bytes=expert_cache_bytes, arena=arena)
        return Weights(model, cfg, experts, pack, xp)
    except BaseException:
        model.close()
        raise
