"""stratatools: pack, profile, remap, trace, simulate and validate expert-offloaded MoE releases for Strata.

The package map, the direction data flows in and where to add things are in docs/architecture.md.
"""

from stratatools.core.version import __version__
from stratatools.core.errors import StrataError

__all__ = ["StrataError", "__version__"]
