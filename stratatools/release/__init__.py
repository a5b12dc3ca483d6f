"""Release checks: the named checks of ``validate-release``, their runner and its console/JSON/JUnit/markdown
outputs.

May import: every library package (core, model, pack, alloc, profiles, traces, cachesim); not cli, demo, runtime.
"""
