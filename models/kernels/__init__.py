"""Kernels written for tinygrad: decode matvecs, quantised weights, llama.cpp's numerics."""
