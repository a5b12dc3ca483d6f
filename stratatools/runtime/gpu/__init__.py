"""GPU side of the runtime: CuPy kernels (dequantization, quantized matrix-vector and routed-expert FFN
products) and the GPU expert tier (VRAM slots + pinned host arena).

Everything here imports without CuPy; only calling a GPU function needs it. :func:`available` says whether
CuPy can see a GPU (tests skip on False, as in CI).
"""

from __future__ import annotations

import functools
from typing import Any

from stratatools.core.errors import StrataError


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when CuPy imports and at least one CUDA device answers."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


def require_cupy() -> Any:
    """Return the ``cupy`` module, or raise StrataError saying how to get a GPU path."""
    if not available():
        raise StrataError("the GPU path needs CuPy and a CUDA GPU (pip install cupy-cuda12x or cupy-cuda13x); "
                          "use the numpy path (xp=numpy) instead")
    import cupy

    return cupy
