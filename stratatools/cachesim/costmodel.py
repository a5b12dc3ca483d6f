"""Three-tier cost model: predicted decode tokens/s from the bytes each routed expert is read from.

This is a **model**, stated so it can be argued with; it ranks configurations by traffic, it does not measure
an engine. Strata 0.2.x keeps routed experts in three places (cache-policy.md "Strata 0.2.x"): VRAM (the
expert tier, plus an upper tier on a second GPU), host RAM (``--ram-experts-gb``) and SSD (``--ssd-experts``).

Assumptions (every report that shows a tok/s prints these):

1. Decode is memory-bound at batch 1: a token costs the time to read the bytes it touches; compute, kernel
   launches, attention/KV traffic and synchronisation are left out (``dense_bytes`` adds the non-expert weights
   read from VRAM per token when known, 0 by default).
2. Each routed (token, layer, expert) entry reads its expert's blob once: from VRAM on a hit (``vram_gbps``),
   else from host RAM when the expert is in the RAM tier (``ram_gbps``; the CPU computes on it there), else
   from SSD (``ssd_gbps``).
3. The RAM tier is static: the profile's ranked pairs in order, each charged its rounded blob (256 bytes),
   stopping at the first that does not fit ``ram_bytes`` (the start-up fill's rule); ``ram_bytes`` None = every
   expert is in RAM (no SSD tier). Experts read from SSD are not promoted to RAM.
4. Copies host->VRAM (arrival admission, adaptive moves) cross PCIe (``pcie_gbps``) and are not overlapped
   with compute; a copy of an SSD-resident expert is charged PCIe only.
5. Bandwidths are sustained rates in GB/s = 1e9 bytes/s; nothing else shares them.

``time_per_token = dense/vram + vram_bytes/vram + ram_bytes/ram + ssd_bytes/ssd + moved_bytes/pcie`` (bytes per
decode token); ``tok_s = 1 / time_per_token``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from stratatools.core.errors import StrataError
from stratatools.profiles.strp import Profile

ASSUMPTIONS = (
    "decode is memory-bound at batch 1: a token costs the time to read the bytes it touches (compute, attention "
    "and KV traffic left out; the dense weights too, unless given: tune --dense-gib)",
    "each routed entry reads its expert's blob once: VRAM on a hit, host RAM when the expert is in the RAM "
    "tier, else SSD",
    "the RAM tier is static: the profile's ranked prefix that fits --ram-experts-gb (rounded blobs, stop at the "
    "first that does not fit); without --ram-experts-gb every expert is in RAM",
    "host->VRAM copies cross PCIe and are not overlapped with compute",
    "bandwidths are sustained GB/s (1e9 bytes/s), not shared",
)


@dataclass(frozen=True)
class ThreeTierModel:
    """Bandwidths (GB/s) and the RAM tier's size (module docstring). Defaults: a 12 GB consumer card (~900),
    PCIe 4.0 x16 (~25), dual-channel DDR5 (~60), an NVMe SSD (~6)."""

    vram_gbps: float = 900.0
    pcie_gbps: float = 25.0
    ram_gbps: float = 60.0
    ssd_gbps: float = 6.0
    ram_bytes: int | None = None
    dense_bytes: int = 0

    def __post_init__(self):
        for k in ("vram_gbps", "pcie_gbps", "ram_gbps", "ssd_gbps"):
            v = getattr(self, k)
            if not (0 < v < float("inf")):
                raise StrataError(f"--{k.replace('_', '-')} {v}: must be a finite number > 0")
        if self.ram_bytes is not None and self.ram_bytes < 0:
            raise StrataError(f"--ram-experts-gb: {self.ram_bytes} bytes is negative")
        if self.dense_bytes < 0:
            raise StrataError("--dense-gib must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["assumptions"] = list(ASSUMPTIONS)
        return d


def ram_set(profile: Profile | None, n_layers: int, n_expert: int, slot_bytes: np.ndarray,
            ram_bytes: int | None) -> np.ndarray:
    """bool [L, E]: experts in the RAM tier (assumption 3). Pairs the profile does not rank follow in flat order
    (``layer * E + expert``). ``slot_bytes``: int [L] rounded blob bytes."""
    if ram_bytes is None:
        return np.ones((n_layers, n_expert), dtype=bool)
    flat = np.arange(n_layers * n_expert, dtype=np.int64)
    if profile is not None and len(profile.pairs):
        ranked = profile.pairs[:, 0].astype(np.int64) * n_expert + profile.pairs[:, 1].astype(np.int64)
        rest = np.setdiff1d(flat, ranked, assume_unique=False)
        order = np.concatenate([ranked, rest])
    else:
        order = flat
    cum = np.cumsum(np.asarray(slot_bytes, dtype=np.int64)[order // n_expert])
    n = int(np.searchsorted(cum, int(ram_bytes), side="right"))
    m = np.zeros(n_layers * n_expert, dtype=bool)
    m[order[:n]] = True
    return m.reshape(n_layers, n_expert)


def tier_costs(layer: np.ndarray, expert: np.ndarray, hits: np.ndarray, loads: np.ndarray, n_tokens: int,
               blob_bytes: np.ndarray, in_ram: np.ndarray, model: ThreeTierModel) -> dict[str, float]:
    """Per-tier hit rates, bytes per token and the predicted tok/s (module docstring).

    Args:
        layer, expert: int [N] routed entries; hits: bool [N] (VRAM-resident at use); loads: int [L] copies;
        n_tokens: decode tokens the entries cover; blob_bytes: int [L] actual blob bytes; in_ram: bool [L, E].
    Returns: ``h_vram``, ``h_ram``, ``h_ssd`` (fractions of entries), ``vram_bytes_per_token``,
        ``ram_bytes_per_token``, ``ssd_bytes_per_token``, ``moved_bytes_per_token``, ``time_per_token_s``,
        ``tok_s``.
    """
    hits = np.asarray(hits, dtype=bool)
    L = len(np.asarray(blob_bytes))
    layer = np.asarray(layer, dtype=np.int64)
    ram = ~hits & in_ram[layer, np.asarray(expert, dtype=np.int64)]
    ssd = ~hits & ~ram
    counts = np.stack([np.bincount(layer[m], minlength=L) for m in (hits, ram, ssd)])
    return tier_costs_from_counts(counts, len(hits), loads, n_tokens, blob_bytes, model)


def tier_costs_from_counts(counts: np.ndarray, n: int, loads: np.ndarray, n_tokens: int, blob_bytes: np.ndarray,
                           model: ThreeTierModel) -> dict[str, float]:
    """:func:`tier_costs` from per-layer entry counts: ``counts`` int [3, L] (VRAM hits, RAM hits, SSD reads)
    over ``n`` entries; what a streaming replay accumulates chunk by chunk (the same figures: the byte sums
    are integers, exact in float64 below 2**53)."""
    bb = np.asarray(blob_bytes, dtype=np.float64)
    if n == 0 or n_tokens <= 0:
        raise StrataError("the cost model needs decode entries (the traces hold none)")
    c = np.asarray(counts, dtype=np.float64)
    tok = float(n_tokens)
    vb = float((c[0] * bb).sum()) / tok
    rb = float((c[1] * bb).sum()) / tok
    sb = float((c[2] * bb).sum()) / tok
    mb = float((np.asarray(loads, dtype=np.float64) * bb).sum()) / tok
    t = (model.dense_bytes + vb) / (model.vram_gbps * 1e9) + rb / (model.ram_gbps * 1e9) + \
        sb / (model.ssd_gbps * 1e9) + mb / (model.pcie_gbps * 1e9)
    return {"h_vram": float(counts[0].sum()) / n, "h_ram": float(counts[1].sum()) / n,
            "h_ssd": float(counts[2].sum()) / n,
            "vram_bytes_per_token": vb, "ram_bytes_per_token": rb, "ssd_bytes_per_token": sb,
            "moved_bytes_per_token": mb, "time_per_token_s": t, "tok_s": 1.0 / t if t > 0 else float("inf")}
