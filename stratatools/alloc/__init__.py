"""ISTA's ``rco-allocation.txt`` (parse, validate, export), survivor maps between canonical and pruned expert ids,
router-based verification, and the release registry (``allocations/releases.toml``, packaged).

May import: :mod:`stratatools.core`, :mod:`stratatools.model`.
"""
