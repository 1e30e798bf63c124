"""Fixtures for the MoE tests: the pipeline's tinygrad in this process, on any thread."""

from tests.pipeline.conftest import kernel_cache_per_thread

__all__ = ["kernel_cache_per_thread"]
