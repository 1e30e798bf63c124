"""The pipeline tests' fixtures (tinygrad from any thread, a device benchmark measured once) for the speculation
tests, which run stages in this process and real daemons alike."""

from tests.pipeline.conftest import bench_file, kernel_cache_per_thread

__all__ = ["bench_file", "kernel_cache_per_thread"]
