"""Foundation shared by every other package: the one error type (:mod:`.errors`), the one write path and file
helpers (:mod:`.fsutil`), provenance sidecars (:mod:`.provenance`), optional numba (:mod:`.jit`), packaged data
(:mod:`.resources`) and the version.

May import: the standard library, numpy, numba. Nothing else of stratatools.
"""
