"""Expert profiles: the STRP file, ranking from routing traces (make-profile), remapping onto a pruned or
re-indexed release, and the stale-profile diff.

May import: :mod:`stratatools.core`, :mod:`stratatools.model`, :mod:`stratatools.alloc`, :mod:`stratatools.traces`.
"""
