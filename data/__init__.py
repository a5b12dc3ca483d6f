"""Packaged data (installed as ``stratatools.data``): prompt suites for recording routing (``prompts/``), the
demo's inputs (``demo/``) and small reference profiles with their provenance sidecars (``profiles/``).
Read through :func:`stratatools.core.resources.packaged` (``packaged("data", "demo", "train.txt")``).
"""
