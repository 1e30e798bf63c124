"""The matrix-vector product of decode steps (and prefill chunks), written so the CPU backend vectorises it.

tinygrad's clang backend turns a plain `x @ w.T` with few rows into one serial chain of scalar FMAs
per output, and folds loads into float4/half4 vectors whose lane extracts stop clang's SLP vectoriser.
The kernel here splits the reduction into 16 independent partial sums, pins its optimisations, and
asks for scalar loads, which clang turns into 8-wide conversions and FMAs. On other devices
tinygrad's own heuristics choose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinygrad import Tensor


def tune_cpu_renderer(device: str) -> None:
    """On CPU, let tinygrad emit scalar loads instead of folding them into float4/half4 vector loads.

    The clang backend devectorises arithmetic and relies on the compiler's SLP vectoriser, which gives
    up on the lane extracts of folded vector loads: a float16 matvec then runs one scalar conversion
    and FMA per weight. With scalar loads clang emits 8-wide conversions and FMAs (measured: the
    SmolLM2 decode step ~2x faster). This setting is per device, for the whole process."""
    from tinygrad import Device

    if device.split(":")[0] == "CPU":
        Device[device].renderer.supports_float4 = False


def matvec(x: Tensor, w: Tensor) -> Tensor:
    """x (rows, I) @ w.T for a few rows, as a kernel a CPU compiler vectorises.

    A plain dot product is one serial chain of scalar FMAs. Here the reduction is split into 16
    independent partial sums (the unrolled innermost axis), which clang turns into vector
    conversions and FMAs; rows of x are looped inside each weight row, so a weight (or its GGML
    block, dequantised in the kernel) is read from memory once for all rows. The reduction runs over
    (blocks of 32, 2 halves, 16): the layout of GGML's 4-bit blocks, whose two nibbles of a byte
    hold values j and j+16. On other devices tinygrad's heuristics choose."""
    from tinygrad.uop.ops import Ops

    out_features, in_features = w.shape
    # a dense matrix's reduction axes merge in the kernel; a dequantised block's (32, 2, 16) stay apart
    if in_features % 32 == 0 and w.uop.base.op is not Ops.BUFFER:
        view: tuple[int, ...] = (in_features // 32, 2, 16)
    else:
        view = next(((in_features // s, s) for s in (16, 8, 4) if in_features % s == 0), (in_features, 1))
    return _split_matvec(x, w, view=view, opts=cpu_matvec_opts(x.device, out_features, len(view)))


def cpu_matvec_opts(device: str, out_features: int, n_reduce: int) -> tuple | None:
    from tinygrad.codegen.opt import Opt, OptOps
    from tinygrad.helpers import CPU_COUNT

    if not device.split(":")[0] == "CPU":
        return None
    threads = max(t for t in range(1, CPU_COUNT.value + 1) if out_features % t == 0)
    opts = (Opt(OptOps.UNROLL, n_reduce - 1, 0),)  # the innermost 16 (or fewer) partial sums
    return opts + ((Opt(OptOps.THREAD, 0, threads),) if threads > 1 else ())


def _split_matvec(x: Tensor, w: Tensor, *, view: tuple[int, ...], opts: tuple | None) -> Tensor:
    from tinygrad import function

    @function
    def kernel(x: Tensor, w: Tensor) -> Tensor:
        out_features, rows = w.shape[0], x.shape[0]
        parts = w.reshape(out_features, 1, *view) * x.reshape(1, rows, *view)
        y = parts.sum(tuple(range(2, 1 + len(view)))).sum(-1)  # (out, rows)
        return y.contiguous(arg=opts) if opts else y.contiguous()

    return kernel(x.contiguous(), w).transpose(0, 1)
