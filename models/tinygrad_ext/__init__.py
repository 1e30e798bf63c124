"""Additions to tinygrad 0.13 (jit capture, CUDA graph fix, the compiled-program cache, captured graphs kept on
disk), pinned by a test."""
