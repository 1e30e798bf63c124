"""Products of a few rows with matrices chosen per slot by index from a stack (the routed experts of a MoE
block): the gather folds into the kernel's loads, so only the chosen matrices are read, and GGML-block matrices
are dequantised in the kernel. `block_matvec` is the GPU kernel for GGML blocks (one matrix or a gathered
stack), its reduction split over a thread group."""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.kernels import cuda, ggml_numerics
from models.kernels.block_gemv import (
    block_gemv,
    block_gemv_fits,
    block_gemv_on,
    glu_in_kernel_on,
)
from models.kernels.glu import silu_glu
from models.kernels.matvec import GPU_DEVICES, as_opts, cpu_matvec_opts, opts_fit

if TYPE_CHECKING:
    from tinygrad import Tensor


def gathered_matvec(x: Tensor, w, idx: Tensor, *, ggml: bool = False, share: int = 1) -> Tensor:
    """x (slots, rows, in) times, per slot, matrix idx[slot] of a stack w (n, out, in) -> (slots, rows, out). With
    `share`, x holds slots / share slots, each for `share` consecutive slots of idx (a row's chosen experts): read
    in place by `models.kernels.block_gemv`, repeated for the other kernels.

    `w` is a float tensor or a `models.kernels.quant.BlockQuantized` stack; either way the gather by index
    folds into the kernel's loads, so only the chosen matrices are read (dequantised in the kernel). The
    reduction is laid out and split as `matvec`'s, with pinned options (`GATHERED_OPTS` on GPUs): each
    output's sum runs in the same order whatever the slots and rows around it. With `ggml`, activations are
    quantised to 8 bits per block first (`models.kernels.ggml_numerics`), as llama.cpp does."""
    from tinygrad import dtypes, function

    from models.kernels.quant import BlockQuantized

    quantized = isinstance(w, BlockQuantized)
    if _in_block_kernel(x, w, ggml):
        return block_matvec(x, w, idx, share=share)
    x = shared_rows(x, share)
    slots, rows, in_features = x.shape
    err = None
    if ggml and quantized and in_features % 32 == 0:
        values, err = ggml_numerics.q8_activations(x.reshape(slots * rows, in_features))
        x = values.reshape(slots, rows, in_features)
    if quantized and x.device.split(":")[0] in GPU_DEVICES and err is None:
        return block_matvec(x, w, idx)
    mats = w.gathered(idx) if quantized else w[idx].cast(dtypes.float32)
    out_features = mats.shape[1]
    # as in matvec: a dense matrix's reduction axes merge in the kernel, a dequantised block's stay apart
    view: tuple[int, ...] = (in_features // 32, 2, 16) if quantized and in_features % 32 == 0 else \
        next(((in_features // s, s) for s in (16, 8, 4) if in_features % s == 0), (in_features, 1))
    view = tuple(d for d in view[:-1] if d > 1) + view[-1:]  # an axis of one would vanish from the kernel
    opts = gathered_opts(x.device, out_features, view, merged=not quantized)

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


def gated_matvec(x: Tensor, w, idx: Tensor, *, ggml: bool = False, share: int = 1) -> Tensor:
    """silu(gate) * up of `gathered_matvec` with a stack of [gate | up] matrices -> (slots, rows, out / 2): on GPUs
    with GGML blocks in `block_matvec`'s kernel where it fits."""
    if _in_block_kernel(x, w, ggml):
        return block_matvec(x, w, idx, share=share, glu=True)
    return silu_glu(gathered_matvec(x, w, idx, ggml=ggml, share=share))


def _in_block_kernel(x: Tensor, w, ggml: bool) -> bool:
    """Whether a product of x with `w` goes to `block_matvec`: GGML blocks on a GPU, with float activations."""
    from models.kernels.quant import BlockQuantized

    return isinstance(w, BlockQuantized) and x.device.split(":")[0] in GPU_DEVICES and not ggml


def shared_rows(x: Tensor, share: int) -> Tensor:
    """x (n, rows, in) with each slot repeated `share` times in a row -> (n * share, rows, in)."""
    if share == 1:
        return x
    n, rows, width = x.shape
    return x.reshape(n, 1, rows, width).expand(n, share, rows, width).reshape(n * share, rows, width)


def block_matvec(x: Tensor, blocks, idx: Tensor | None = None, *, share: int = 1, glu: bool = False) -> Tensor:
    """x (slots, rows, in) times GGML-block matrices -> (slots, rows, out), as one GPU kernel whose reduction
    (over blocks of 32 and the 16 bytes of a block's codes, both nibbles at once) is split over a thread group:
    with `idx`, slot s multiplies matrix idx[s] of the stack `blocks` (gathered by index inside the kernel,
    reading only those matrices' codes); without, the one matrix (slots = 1). On NVIDIA GPUs, where it fits, the
    product is `models.kernels.block_gemv`'s hand-written kernel instead. With `glu` the matrices are [gate | up]
    and the result silu(gate) * up (slots, rows, out / 2), inside that kernel too. `share`: as `gathered_matvec`'s."""
    from tinygrad import dtypes, function

    if block_gemv_fits(x, blocks, gathered=idx is not None):
        if glu and glu_in_kernel_on():
            return block_gemv(x, blocks, idx, share=share, glu=True)
        y = block_gemv(x, blocks, idx, share=share)
        return silu_glu(y) if glu else y
    x = shared_rows(x, share)
    slots, rows, in_features = x.shape
    n, out_features = (blocks.shape[0], blocks.shape[1]) if blocks.shape else (1, blocks.rows)
    nb, per = in_features // 32, (16 if blocks.packed else 32)
    opts = block_opts(nb, (slots, out_features, rows))
    gathered, has_m, off = idx is not None, blocks.m is not None, blocks.code_offset

    @function
    def kernel(x: Tensor, q: Tensor, d: Tensor, *rest: Tensor) -> Tensor:
        pick_idx = rest[-1] if gathered else None

        def pick(t: Tensor) -> Tensor:
            t = t.reshape(n, out_features, t.shape[-1])
            return t[pick_idx] if pick_idx is not None else t

        def per_code(t: Tensor) -> Tensor:
            """A block's scale or offset beside each of its codes. Broadcast before the pick: picked first,
            tinygrad would write the chosen ones out in a kernel of their own before the product."""
            spread = t.reshape(-1, nb, 1).expand(-1, nb, per).reshape(t.shape[0], nb * per)
            return pick(spread).cast(dtypes.float32).reshape(slots, out_features, 1, nb, per)

        codes = pick(q).reshape(slots, out_features, 1, nb, per)
        scale = per_code(d)
        xs = x.reshape(slots, 1, rows, nb, 2, 16) if blocks.packed else x.reshape(slots, 1, rows, nb, 32)
        if blocks.packed:
            lo, hi = codes.bitwise_and(15).cast(dtypes.float32), codes.rshift(4).cast(dtypes.float32)
            if off:
                lo, hi = lo - off, hi - off
            terms = (lo * xs[..., 0, :] + hi * xs[..., 1, :]) * scale
            if has_m:  # Q4_1: w = q * d + m
                m = per_code(rest[0])
                terms = terms + m * (xs[..., 0, :] + xs[..., 1, :])
        else:
            terms = codes.cast(dtypes.float32) * xs * scale
        y = terms.sum((-2, -1))  # one reduction (slots, out, rows): a thread group splits its blocks
        return y.contiguous(arg=opts) if opts else y.contiguous()

    args = [x.contiguous(), blocks.q, blocks.d, *([blocks.m] if has_m else []), *([idx] if gathered else [])]
    y = kernel(*args).permute(0, 2, 1)
    return silu_glu(y) if glu else y


def pairs_per_kernel(device: str) -> int:
    """How many (row, expert) pairs one gathered kernel of `models.expert_shard.ExpertShard.in_graph` takes: 8
    on GPUs where tinygrad's kernel runs the products (it reads each byte slower when it reads many experts'
    matrices at once than in several kernels of a few experts each, docs/BENCHMARKS.md); 0, all of them, where
    `models.kernels.block_gemv` runs them and elsewhere. `SWARMD_IN_GRAPH_PAIRS` overrides, for comparisons."""
    import os

    if os.environ.get("SWARMD_IN_GRAPH_PAIRS"):
        return int(os.environ["SWARMD_IN_GRAPH_PAIRS"])
    if device.split(":")[0] not in GPU_DEVICES or (block_gemv_on() and cuda.arch(device) >= 70):
        return 0
    return 8


# Options of the gathered matvec on GPUs (axis 0: output features; reduce axis 0: the inner dimension); empty:
# tinygrad's heuristics. Options that split the reduction must not depend on the slots and rows.
GATHERED_GPU_OPTS: tuple[tuple[str, int, int], ...] = (('UNROLL', 0, 4), ('GROUP', 0, 32))


def gathered_opts(device: str, out_features: int, reduce: tuple[int, ...], *, merged: bool = True) -> tuple | None:
    """Pinned options of `gathered_matvec`, whose reduction runs over the axes `reduce` (one axis in the kernel
    when `merged`, as a dense matrix's): matvec's on the CPU, `GATHERED_GPU_OPTS` on GPUs (`SWARMD_GATHERED_OPTS`,
    a JSON list of [op, axis, amount], overrides them, for searches). Where their splits do not divide the axes
    they split in turn (narrow models), tinygrad's heuristics: tinygrad would refuse the kernel."""
    import json
    import math
    import os

    if device.split(":")[0] not in GPU_DEVICES:
        return cpu_matvec_opts(device, out_features, len(reduce))
    table = json.loads(os.environ["SWARMD_GATHERED_OPTS"]) if os.environ.get("SWARMD_GATHERED_OPTS") \
        else GATHERED_GPU_OPTS
    opts = as_opts(table)
    fits = opts_fit(opts, (out_features,), (math.prod(reduce),) if merged else reduce)
    return opts if fits and opts else None


def block_opts(n_blocks: int, shape: tuple[int, int, int]) -> tuple:
    """Options of `block_matvec`'s kernel of output `shape` (slots, out, rows); reduce axis 0: the blocks of 32
    of a row. By default (the best of a search on an H200, docs/BENCHMARKS.md "Kimi-class MoE") four threads
    split a row's blocks and eight rows of output share a work group; where those do not divide, a thread group
    of the largest of 32, 16, 8, 4, 2 that divides the blocks.
    `SWARMD_BLOCK_OPTS` (a JSON list of [op, axis, amount], output axes counted in (slots, out, rows)) replaces
    them, for searches: an output axis of one (which leaves the kernel) drops its options."""
    import json
    import math
    import os

    from tinygrad.codegen.opt import Opt, OptOps

    reduce_ops = (OptOps.GROUP, OptOps.GROUPTOP, OptOps.UNROLL)
    if table := os.environ.get("SWARMD_BLOCK_OPTS"):
        opts = []
        for op, axis, arg in json.loads(table):
            kind = OptOps[op]
            if kind in reduce_ops:
                opts.append(Opt(kind, axis, arg))
            elif shape[axis] > 1 and shape[axis] % arg == 0:
                opts.append(Opt(kind, sum(1 for d in shape[:axis] if d > 1), arg))
        if n_blocks % math.prod(o.arg for o in opts if o.op in reduce_ops) == 0:
            return tuple(opts)
    if n_blocks % 4 == 0 and shape[1] % 8 == 0:
        return (Opt(OptOps.GROUP, 0, 4), Opt(OptOps.LOCAL, int(shape[0] > 1), 8))
    group = next((g for g in (32, 16, 8, 4, 2) if n_blocks % g == 0), 1)
    return (Opt(OptOps.GROUP, 0, group),) if group > 1 else ()
