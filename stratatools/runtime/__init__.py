"""The stratatools runtime: runs packed qwen4exp models (numpy; CuPy when a GPU is present)."""
