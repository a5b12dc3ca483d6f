"""The stratatools runtime: runs packed qwen4exp models (numpy; CuPy when a GPU is present): config, weights,
tokenizer, the forward pass, the expert tier (the simulator's policy objects) and the run command's loop.
:mod:`.gpu` holds the CuPy side and its CUDA sources.

May import: :mod:`stratatools.core`, :mod:`stratatools.model`, :mod:`stratatools.pack`, :mod:`stratatools.profiles`, :mod:`stratatools.traces`, :mod:`stratatools.cachesim`.
"""
