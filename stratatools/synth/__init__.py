"""Synthetic qwen4exp releases: GGUF models of any depth, width, expert count and types, pruned revisions with
their allocations, for the demo, the tests and the benchmarks.

May import: :mod:`stratatools.core`, :mod:`stratatools.model`, :mod:`stratatools.runtime` (its tokenizer's byte
table only).
"""
