"""A matvec whose matrix is chosen per slot by index from a stack (the routed experts of a MoE block).

`models.kernels.matvec` holds the one-matrix matvec whose layout and options this one follows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.kernels import ggml_numerics
from models.kernels.matvec import GPU_DEVICES, cpu_matvec_opts

if TYPE_CHECKING:
    from tinygrad import Tensor


def gathered_matvec(x: Tensor, w, idx: Tensor, *, ggml: bool = False) -> Tensor:
    """x (slots, rows, in) times, per slot, matrix idx[slot] of a stack w (n, out, in) -> (slots, rows, out).

    `w` is a float tensor or a `models.kernels.quant.BlockQuantized` stack; either way the gather by index
    folds into the kernel's loads, so only the chosen matrices are read (dequantised in the kernel). The
    reduction is laid out and split as `matvec`'s, with pinned options (`GATHERED_OPTS` on GPUs): each
    output's sum runs in the same order whatever the slots and rows around it. With `ggml`, activations are
    quantised to 8 bits per block first (`models.kernels.ggml_numerics`), as llama.cpp does."""
    from tinygrad import dtypes, function

    from models.kernels.quant import BlockQuantized

    slots, rows, in_features = x.shape
    quantized = isinstance(w, BlockQuantized)
    err = None
    if ggml and quantized and in_features % 32 == 0:
        values, err = ggml_numerics.q8_activations(x.reshape(slots * rows, in_features))
        x = values.reshape(slots, rows, in_features)
    mats = w.gathered(idx) if quantized else w[idx].cast(dtypes.float32)
    out_features = mats.shape[1]
    # as in matvec: a dense matrix's reduction axes merge in the kernel, a dequantised block's stay apart
    view: tuple[int, ...] = (in_features // 32, 2, 16) if quantized and in_features % 32 == 0 else \
        next(((in_features // s, s) for s in (16, 8, 4) if in_features % s == 0), (in_features, 1))
    view = tuple(d for d in view[:-1] if d > 1) + view[-1:]  # an axis of one would vanish from the kernel
    opts = gathered_opts(x.device, out_features, len(view))

    @function
    def kernel(x: Tensor, mats: Tensor) -> Tensor:
        parts = mats.permute(1, 0, 2).reshape(out_features, slots, 1, *view) * x.reshape(1, slots, rows, *view)
        y = parts.sum(tuple(range(3, 2 + len(view)))).sum(-1)  # (out, slots, rows)
        return y.contiguous(arg=opts) if opts else y.contiguous()

    y = kernel(x.contiguous(), mats).permute(1, 2, 0)
    if err is not None and w.q8_1 and w.m is not None:  # Q4_1 offsets meet Q8_1's rounded block sums
        m = w.m.reshape(w.shape[0], out_features, -1)[idx].cast(dtypes.float32)  # (slots, out, in/32)
        y = y + (err.reshape(slots, rows, 1, -1) * m.reshape(slots, 1, out_features, -1)).sum(-1)
    return y


# Options of the gathered matvec on GPUs (axis 0: output features; reduce axis 0: the inner dimension); empty:
# tinygrad's heuristics. Options that split the reduction must not depend on the slots and rows.
GATHERED_GPU_OPTS: tuple[tuple[str, int, int], ...] = (('UNROLL', 0, 4), ('GROUP', 0, 32))


def gathered_opts(device: str, out_features: int, n_reduce: int) -> tuple | None:
    """Pinned options of `gathered_matvec`: matvec's on the CPU, `GATHERED_GPU_OPTS` on GPUs
    (`SWARMD_GATHERED_OPTS`, a JSON list of [op, axis, amount], overrides them, for searches)."""
    import json
    import os

    from tinygrad.codegen.opt import Opt, OptOps

    if device.split(":")[0] not in GPU_DEVICES:
        return cpu_matvec_opts(device, out_features, n_reduce)
    table = json.loads(os.environ["SWARMD_GATHERED_OPTS"]) if os.environ.get("SWARMD_GATHERED_OPTS") \
        else GATHERED_GPU_OPTS
    return tuple(Opt(OptOps[op], axis, arg) for op, axis, arg in table) or None
