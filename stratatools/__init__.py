"""stratatools: pack, profile, remap, trace, simulate and validate expert-offloaded MoE releases for Strata.

The package map, the direction data flows in and where to add things are in docs/architecture.md.
"""

import sys as _sys

_orig = list(getattr(_sys, "orig_argv", ()))
if _sys.argv[:1] == ["-m"] and any(a == "-mstratatools" or (a, b) == ("-m", "stratatools")
                                   for a, b in zip(_orig, _orig[1:] + [""])):
    # Python is locating ``python -m stratatools`` (argv[0] is "-m" until the module runs): from here on a Ctrl-C
    # while the CLI loads is a quiet exit 130, not a traceback (stratatools.__main__ has the same handler for the
    # ``stratatools`` command, and the CLI's entry point replaces it once it runs)
    import os as _os
    import signal as _signal

    def _interrupted_while_loading(signum, frame):
        try:
            _os.write(2, b"interrupted\n")
        except OSError:
            pass
        _os._exit(128 + signum)

    _interrupted_while_loading.stratatools_loading = True
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _interrupted_while_loading)
del _orig

from stratatools.core.version import __version__  # noqa: E402
from stratatools.core.errors import StrataError  # noqa: E402

__all__ = ["StrataError", "__version__"]
