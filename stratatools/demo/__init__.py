"""``stratatools demo``: the walkthrough on an embedded synthetic release (synth, pack, stale vs remapped vs
rebuilt profiles, simulation, validate-release), calling the library, never the CLI.

May import: every library package; not :mod:`stratatools.cli`.
"""
