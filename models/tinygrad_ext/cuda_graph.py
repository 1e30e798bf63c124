"""A fix for tinygrad 0.13.0's CUDA graphs of kernels whose launch size depends on a symbolic variable.

tinygrad builds a CUDA graph's kernel nodes with every variable set to 0 and sets the real launch
dimensions before each replay. A kernel whose grid is a multiple of a variable (the decode
attention's `tiles`) then gets a grid of 0 at build time, which the driver refuses
(`cuGraphAddKernelNode`: CUDA Error 1, invalid argument), and the whole decode step falls out of the
graph. Raising such a dimension to 1 at build time is harmless: the replay sets the real one.
"""

from __future__ import annotations

from typing import Any

LAUNCH_DIMS = ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY", "blockDimZ")


def add_kernel_node_with_nonzero_dims(add_kernel_node: Any, node: Any, graph: Any, deps: Any, ndeps: int,
                                      params_ref: Any) -> int:
    """Call `cuGraphAddKernelNode`; if refused, raise any zero launch dimension to 1 and try once more."""
    status = add_kernel_node(node, graph, deps, ndeps, params_ref)
    params = params_ref._obj  # the struct that ctypes.byref() points at
    if status != 0 and any(getattr(params, d) == 0 for d in LAUNCH_DIMS):
        for d in LAUNCH_DIMS:
            setattr(params, d, max(1, getattr(params, d)))
        status = add_kernel_node(node, graph, deps, ndeps, params_ref)
    return status


def fix_symbolic_launch_dims() -> None:
    """Route tinygrad's CUDA graph builder through `add_kernel_node_with_nonzero_dims` (once per process)."""
    import tinygrad.runtime.graph.cuda as graph_module

    if isinstance(graph_module.cuda, _Driver):
        return
    graph_module.cuda = _Driver(graph_module.cuda)


class _Driver:
    """tinygrad's CUDA driver bindings, with cuGraphAddKernelNode wrapped."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def cuGraphAddKernelNode(self, node: Any, graph: Any, deps: Any, ndeps: int, params_ref: Any) -> int:
        return add_kernel_node_with_nonzero_dims(self._real.cuGraphAddKernelNode, node, graph, deps, ndeps,
                                                 params_ref)
