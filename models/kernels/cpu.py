"""Hand-written C kernels on the CPU in tinygrad's graphs: a kernel's source as the program tinygrad compiles with
its own C compiler and runs on its CPU threads (thread `core_id` of `threads`), so that captured steps and the graph
cache hold it like any other kernel. `models.kernels.cuda` makes the program from it and runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinygrad.uop.ops import UOp


def program(device: str, name: str, source: str, *, threads: int, buffers: int, ops: int, traffic: int) -> UOp:
    """The C function `name` of `source`, the only function it defines (the entry point of the compiled object; helpers
    are `static inline` and always inlined), taking `buffers` pointers (the first its output) and `const int core_id`;
    `ops` and `traffic` (bytes) are tinygrad's estimates for its statistics."""
    from tinygrad.uop.ops import ProgramInfo, UOp

    from models.kernels import cuda

    info = ProgramInfo(name=name, global_size=(threads, 1, 1), vars=(UOp.variable("core_id", 0, threads - 1),),
                       globals=tuple(range(buffers)), outs=(0,), ins=tuple(range(1, buffers)))
    return cuda.compiled(device, source, info, ops=ops, traffic=traffic)
