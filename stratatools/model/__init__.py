"""Model access: the GGUF reader and writer (shard sets, mmap, zero-copy tensors), ggml types and their block
geometry, quantizers/dequantizers used by synth, and the MoE geometry read from the router (E = ne1).

May import: :mod:`stratatools.core`.
"""
