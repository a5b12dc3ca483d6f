"""Packaged release registry (installed as ``stratatools.allocations``): ``releases.toml`` and any allocation
maps. Read through :func:`stratatools.core.resources.packaged` (``packaged("allocations", "releases.toml")``).
"""
