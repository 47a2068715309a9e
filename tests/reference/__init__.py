"""Independent numpy references and tiny GGUF fixtures used as test oracles.

- ``tiny_gguf.write_tiny_llama``: random-weight llama GGUF files (gguf PyPI package).
- ``llama_numpy.LlamaRef``: float64 numpy forward pass of a llama GGUF (gguf PyPI reader).

Nothing here imports pyfast, so these stay independent of the code they check.
"""
