"""Cache simulation: Strata's VRAM expert tier, baselines, replay of traces, held-out k-fold.

What it models is cache-policy.md (Strata expert_cache.cpp and its adaptive tier); see :mod:`.layout` for
the slot layout and :mod:`.tiers` for every policy's exact rules and the decisions taken where the doc is
silent.

Online API (the runtime uses these objects, not a copy of the rules)::

    from stratatools.cachesim import make_tier
    tier = make_tier("adaptive", profile=prof, budget_bytes=12 << 30, blob_bytes=blob_bytes,
                     admission="global", adapt_every=4)          # or slots=N; cap=[...] for per-layer baselines
    hit = tier.access(layer, experts)    # experts: int array [k]; returns bool [k], resident at time of use
    tier.end_round()                     # after every decode position (or verify window)
    tier.stats()                         # dict: entries, hits, h_expert, h_layer, h_bytes, moved_bytes, per layer
    tier.resident_mask()                 # bool [L, E]

Policies: ``static``, ``adaptive``, ``lru``, ``lfu``, ``lfru`` (online) and ``belady`` (offline: needs
``future=(layer[N], expert[N])``).

Batch API (the simulator; compiled kernels, tested equal to the online objects)::

    from stratatools.cachesim import prepare_entries, simulate_policy
    ent = prepare_entries(trace_table, n_layers, n_expert)          # rounds, records, filtered entries
    res = simulate_policy(ent, "static", profile=prof, slots=4105)  # -> SimResult (metrics + per layer)

Higher level: :func:`stratatools.cachesim.replay.simulate` (profiles x policies x budgets),
:func:`stratatools.cachesim.kfold.kfold_eval` (held-out by request).

May import: :mod:`stratatools.core`, :mod:`stratatools.model`, :mod:`stratatools.pack`, :mod:`stratatools.profiles`, :mod:`stratatools.traces`.
"""

from __future__ import annotations

from stratatools.cachesim.layout import TierPlan, per_layer_split, plan_tier, rounded_blob_bytes
from stratatools.cachesim.tiers import (ADAPTIVE_DEFAULTS, LFRU_DEFAULTS, LFU_DEFAULTS, POLICIES, AdaptiveTier, BeladyTier,
                    LFRUTier, LFUTier, LRUTier, StaticTier, Tier, make_tier, next_uses)

__all__ = ["TierPlan", "per_layer_split", "plan_tier", "rounded_blob_bytes", "ADAPTIVE_DEFAULTS",
           "LFRU_DEFAULTS", "LFU_DEFAULTS", "POLICIES", "AdaptiveTier", "BeladyTier", "LFRUTier", "LFUTier",
           "LRUTier", "StaticTier", "Tier", "make_tier", "next_uses"]
