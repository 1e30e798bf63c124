"""Hand-written CUDA kernels in tinygrad's graphs: which devices take them, and a kernel's source as the compiled
program that `Tensor.custom_kernel` runs, so that captured steps and the graph cache hold it like any other kernel
(`run` runs any device's program: `models.kernels.cpu` makes C ones for the CPU).

tinygrad's CUDA graphs launch every kernel with no dynamic shared memory: a kernel declares what it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import ProgramInfo, UOp

# What a CUDA kernel may declare. More must be asked for at launch, which tinygrad's CUDA graphs do not do.
STATIC_SHARED_BYTES = 48 * 1024


def arch(device: str) -> int:
    """The compute capability (80 for sm_80) of a tinygrad CUDA or NV device; 0 for any other device."""
    if device.split(":")[0] not in ("CUDA", "NV"):
        return 0
    from tinygrad import Device
    from tinygrad.renderer.cstyle import CUDARenderer

    renderer = Device[device].renderer
    if not isinstance(renderer, CUDARenderer):
        return 0
    target = renderer.target.arch
    return int(target[3:]) if target.startswith("sm_") and target[3:].isdigit() else 0


def program(device: str, name: str, source: str, *, grid: tuple[int, int, int], threads: int, buffers: int,
            ops: int, traffic: int, outputs: int = 1) -> UOp:
    """The kernel `name` of CUDA `source` as a program of `buffers` pointer arguments (the first `outputs` its
    outputs, the others its inputs), launched on `grid` blocks of `threads` threads; `ops` and `traffic` (bytes) are
    tinygrad's estimates for its statistics."""
    from tinygrad.uop.ops import ProgramInfo

    info = ProgramInfo(name=name, global_size=grid, local_size=(threads, 1, 1), globals=tuple(range(buffers)),
                       outs=tuple(range(outputs)), ins=tuple(range(outputs, buffers)))
    return compiled(device, source, info, ops=ops, traffic=traffic)


def compiled(device: str, source: str, info: ProgramInfo, *, ops: int, traffic: int) -> UOp:
    """`source` as the program tinygrad compiles for `device` and launches as `info` says (its name, launch and
    buffers); `ops` and `traffic` (bytes) are tinygrad's estimates for its statistics."""
    from tinygrad.renderer import Estimates
    from tinygrad.uop.ops import KernelInfo, Ops, UOp

    sink = UOp.sink(arg=KernelInfo(name=info.name, estimates=Estimates(ops=ops, lds=traffic, mem=traffic)))
    return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.DEVICE, arg=device), UOp(Ops.LINEAR, src=()),
                                 UOp(Ops.SOURCE, arg=source)), arg=info)


def run(out: Tensor, inputs: tuple[Tensor, ...], prog: UOp) -> Tensor:
    """`out` (an empty tensor of the result's shape) written by `prog` from `inputs` (made contiguous)."""
    return run_outputs((out,), inputs, prog)[0]


def run_outputs(outs: tuple[Tensor, ...], inputs: tuple[Tensor, ...], prog: UOp, *,
                realize: bool = False) -> tuple[Tensor, ...]:
    """`outs` (empty tensors of the results' shapes) written by `prog` from `inputs` (made contiguous); with
    `realize`, run now. Outputs are realised together: one realised alone runs the kernel, and another read later
    runs it again."""
    done = tuple(outs[0].custom_kernel(*outs[1:], *(_unshaped(t).contiguous() for t in inputs),
                                       fxn=lambda *_params: prog)[:len(outs)])
    if realize:
        done[0].realize(*done[1:])
    return done


def in_place(t: Tensor) -> Tensor:
    """t, or, when it is a kernel's output reshaped back to that output's own shape, the output itself: a reshaped
    kernel output is copied whole before another kernel may read it (a matvec's input)."""
    from tinygrad.uop.ops import Ops

    base = _unshaped(t)
    return base if base.uop.op is Ops.AFTER and base.shape == t.shape else t


def _unshaped(t: Tensor) -> Tensor:
    """t without the reshapes on top of it, nor the permutes that move only axes of one: a kernel reads its buffer's
    values in order, which neither changes, and tinygrad copies such a view of a kernel's output whole before
    another kernel may read it."""
    from tinygrad import Tensor
    from tinygrad.uop.ops import Ops

    u = t.uop
    while u.op is Ops.RESHAPE or (u.op is Ops.PERMUTE and _moves_only_ones(u.marg, u.src[0].shape)):
        u = u.src[0]
    return t if u is t.uop else Tensor(u)


def _moves_only_ones(order: tuple[int, ...], shape: tuple) -> bool:
    kept = [a for a in order if shape[a] != 1]
    return kept == sorted(kept)
