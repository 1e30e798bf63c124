"""The pipeline tests' fixtures: a device benchmark measured once, tinygrad usable from any thread."""

from tests.pipeline.conftest import bench_file, kernel_cache_per_thread  # noqa: F401
