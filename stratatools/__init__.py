"""stratatools: pack, profile, remap, trace, simulate and validate expert-offloaded MoE releases for Strata."""

__version__ = "0.1.0"

from .errors import StrataError  # noqa: E402

__all__ = ["StrataError", "__version__"]
