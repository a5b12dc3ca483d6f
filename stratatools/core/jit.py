"""Optional numba: :func:`njit` compiles with numba when it imports (with an on-disk cache where one can be
written) and otherwise returns the plain Python function; :data:`HAVE_NUMBA` says which."""

from __future__ import annotations

try:  # pragma: no cover - exercised by whichever branch the machine has
    from numba import njit as _numba_njit

    HAVE_NUMBA = True

    def njit(**kwargs):
        """numba's njit with an on-disk cache where one can be written. numba refuses ``cache=True`` at
        decoration (RuntimeError "no locator available") when neither the package folder nor the user's cache
        folder is writable (a read-only install, no writable home); then the kernel is compiled each run."""

        def deco(f):
            try:
                return _numba_njit(**kwargs)(f)
            except RuntimeError:
                return _numba_njit(**{**kwargs, "cache": False})(f)

        return deco
except ImportError:  # pragma: no cover
    HAVE_NUMBA = False

    def njit(*args, **kwargs):
        if args and callable(args[0]):
            return args[0]
        return lambda f: f
