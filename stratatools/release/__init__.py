"""Release checks: the named checks of ``validate-release``, their runner and its console/JSON/JUnit/markdown
outputs.

May import: :mod:`stratatools.core`, :mod:`stratatools.model`, :mod:`stratatools.pack`, :mod:`stratatools.alloc`, :mod:`stratatools.profiles`, :mod:`stratatools.traces`,
:mod:`stratatools.cachesim`.
"""
