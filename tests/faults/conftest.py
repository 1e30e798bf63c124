"""Fixtures for the fault tests: the pipeline's (tinygrad on any thread, one device benchmark)."""

from tests.pipeline.conftest import bench_file, kernel_cache_per_thread

__all__ = ["bench_file", "kernel_cache_per_thread"]
