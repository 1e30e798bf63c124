"""Additions to tinygrad 0.13 (jit capture, CUDA graph fix, the compiled-program cache), pinned by a test."""
