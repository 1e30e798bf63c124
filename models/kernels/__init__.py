"""Kernels written for tinygrad: decode matvecs, attention over cache tiles, quantised weights, llama.cpp's numerics."""
