"""``stratatools demo``: the walkthrough on an embedded synthetic release (synth, pack, stale vs remapped vs
rebuilt profiles, simulation, validate-release). Each step is a command line run by a step runner that the
caller passes in (the CLI passes its in-process runner), so the demo never imports :mod:`stratatools.cli`.

May import: :mod:`stratatools.core`, :mod:`stratatools.model`, :mod:`stratatools.pack`, :mod:`stratatools.alloc`, :mod:`stratatools.traces`, :mod:`stratatools.profiles`,
:mod:`stratatools.cachesim`, :mod:`stratatools.release`, :mod:`stratatools.synth`, :mod:`stratatools.runtime`.
"""
