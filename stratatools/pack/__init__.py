"""Strata's native expert pack (`native_experts.txt` v3/v4, `experts.bin` and its source sidecar) and the
`inspect` report of what a model would pack to.

May import: :mod:`stratatools.core`, :mod:`stratatools.model`.
"""
