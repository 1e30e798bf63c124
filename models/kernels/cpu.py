"""Hand-written C kernels on the CPU in tinygrad's graphs: a kernel's source as the program tinygrad compiles with
its own C compiler and runs on its CPU threads (thread `core_id` of `threads`), so that captured steps and the graph
cache hold it like any other kernel. `models.kernels.cuda.run` runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinygrad.uop.ops import UOp


def program(device: str, name: str, source: str, *, threads: int, buffers: int, ops: int, traffic: int) -> UOp:
    """The C function `name` of `source`, the only function it defines (the entry point of the compiled object; helpers
    are `static inline` and always inlined), taking `buffers` pointers (the first its output) and `const int core_id`;
    `ops` and `traffic` (bytes) are tinygrad's estimates for its statistics."""
    from tinygrad.renderer import Estimates
    from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo, UOp

    sink = UOp.sink(arg=KernelInfo(name=name, estimates=Estimates(ops=ops, lds=traffic, mem=traffic)))
    info = ProgramInfo(name=name, global_size=(threads, 1, 1), vars=(UOp.variable("core_id", 0, threads - 1),),
                       globals=tuple(range(buffers)), outs=(0,), ins=tuple(range(1, buffers)))
    return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.DEVICE, arg=device), UOp(Ops.LINEAR, src=()),
                                 UOp(Ops.SOURCE, arg=source)), arg=info)
