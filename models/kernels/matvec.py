"""The matrix-vector product of decode steps (and prefill chunks), written so the CPU backend vectorises it.

tinygrad's clang backend turns a plain `x @ w.T` with few rows into one serial chain of scalar FMAs
per output, and folds loads into float4/half4 vectors whose lane extracts stop clang's SLP vectoriser.
The kernel here splits the reduction into 16 independent partial sums, pins its optimisations, and
asks for scalar loads, which clang turns into 8-wide conversions and FMAs.

On GPUs tinygrad's matvec heuristic does not fire for float32 activations times float16 weights (the
product holds a cast), and its fallback gives each thread whole rows: a few thousand threads for a
4096-wide layer, a tenth of an H200's bandwidth. There the reduction is split over a thread group
instead, with options measured per shape by scripts/bench_gpu.py (`GPU_MATVEC_OPTS`). Products of 8 rows or more
with a dense float16 matrix (decode batches, prefill chunks) go to the tensor cores instead (`tensor_core_matmul`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.kernels import cuda

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tinygrad import Tensor


def tune_cpu_renderer(device: str) -> None:
    """On CPU, let tinygrad emit scalar loads instead of folding them into float4/half4 vector loads.

    The clang backend devectorises arithmetic and relies on the compiler's SLP vectoriser, which gives
    up on the lane extracts of folded vector loads: a float16 matvec then runs one scalar conversion
    and FMA per weight. With scalar loads clang emits 8-wide conversions and FMAs (the decode step's
    gain: docs/BENCHMARKS.md, "The levers, each measured"). This setting is per device, for the whole
    process."""
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
    if tensor_core_rows(x.device, x.shape[0], w):
        return tensor_core_matmul(x, w)
    if (gpu := gpu_matvec_opts(x.device, x.shape[0], out_features, in_features)) is not None:
        # the options split one merged reduction axis; a dequantised block's axes stay apart
        dense = w.uop.base.op is Ops.BUFFER
        return _split_matvec(x, w, view=(in_features,), opts=gpu if gpu and dense else None)
    # a dense matrix's reduction axes merge in the kernel; a dequantised block's (32, 2, 16) stay apart
    if in_features % 32 == 0 and w.uop.base.op is not Ops.BUFFER:
        view: tuple[int, ...] = (in_features // 32, 2, 16) if in_features > 32 else (2, 16)  # no axis of one
    else:
        view = next(((in_features // s, s) for s in (16, 8, 4) if in_features % s == 0), (in_features, 1))
    return _split_matvec(x, w, view=view, opts=cpu_matvec_opts(x.device, out_features, len(view)))


# From this many rows a GPU multiplies by a dense float16 matrix on its tensor cores: decode batches of 8 and more,
# prefill chunks, verify batches. CUDA's tile (m16n8k16) takes the rows on its 8-wide side below 64 rows.
TENSOR_CORE_MIN_ROWS = 8
TENSOR_CORE_ROW_STEP = 8  # below 64 rows, the row count must be a multiple of the tile's 8-wide side
TENSOR_CORE_MANY_ROWS = 64  # from here the rows go on the tile's 16-wide side, as for prefill


def tensor_cores_on() -> bool:
    """`SWARMD_TENSOR_CORES=0` turns `tensor_core_matmul` off (for side-by-side measurements)."""
    import os

    return os.environ.get("SWARMD_TENSOR_CORES", "1") != "0"


def tensor_core_min_rows() -> int:
    """The fewest rows that use `tensor_core_matmul`: `SWARMD_TENSOR_CORE_MIN_ROWS` (64 gives back the rule
    where only prefill chunks used them, for side-by-side measurements), else `TENSOR_CORE_MIN_ROWS`."""
    import os

    return int(os.environ.get("SWARMD_TENSOR_CORE_MIN_ROWS") or TENSOR_CORE_MIN_ROWS)


def tensor_core_rows(device: str, rows: object, w: Tensor) -> bool:
    """Whether x (rows, in) @ w.T runs as `tensor_core_matmul`: on a GPU, with enough rows (a known count; below
    `TENSOR_CORE_MANY_ROWS` a multiple of `TENSOR_CORE_ROW_STEP`), a dense float16 matrix, unless
    `tensor_cores_on()` says no."""
    from tinygrad import dtypes
    from tinygrad.uop.ops import Ops

    return (device.split(":")[0] in GPU_DEVICES and isinstance(rows, int) and rows >= tensor_core_min_rows()
            and (rows >= TENSOR_CORE_MANY_ROWS or rows % TENSOR_CORE_ROW_STEP == 0)
            and w.dtype == dtypes.float16 and w.uop.base.op is Ops.BUFFER and tensor_cores_on())


def tensor_core_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x (rows, in) @ w.T with float16 inputs and float32 accumulation: the shape of product tinygrad gives to
    the tensor cores (a matrix-matrix kernel, where the matvec's split reduction leaves them idle). The
    activations are rounded to float16 first, as the weights already are.

    Fewer than `TENSOR_CORE_MANY_ROWS` rows (a decode batch) go as w @ x.T, which puts them on the tile's 8-wide
    side, and the reduction is split in `split_k` parts, each its own set of warps (tinygrad does not split a
    tensor-core reduction over a thread group): one warp per tile of 16 outputs would leave most of the GPU idle
    on a weight-bound product. The parts are summed in float32 by a second kernel. A product of a shape in
    `TENSOR_CORE_OPTS` takes the options searched for it. On NVIDIA GPUs the product runs as
    `models.kernels.gemm`'s hand-written kernel instead, where it fits."""
    from tinygrad import dtypes

    from models.kernels.gemm import gemm, gemm_fits

    rows, width = x.shape
    if gemm_fits(x.device, rows, w.shape[0], width):
        return gemm(x.cast(dtypes.float16), w)
    opts = tensor_core_opts(x.device, rows, w.shape[0], width)
    if rows >= TENSOR_CORE_MANY_ROWS:  # the activations in float16 first: fused, every tile of outputs recomputes them
        if opts:
            return gpu_reduce(lambda xh, wh: xh.matmul(wh.transpose(), dtype=dtypes.float32), opts,
                              x.cast(dtypes.float16), w)
        return x.cast(dtypes.float16).contiguous().matmul(w.transpose(), dtype=dtypes.float32)
    parts = split_k(w.shape[0], width)
    if parts == 1:
        return w.matmul(x.cast(dtypes.float16).transpose(), dtype=dtypes.float32).transpose()

    def split_product(w: Tensor, x: Tensor) -> Tensor:  # (parts, out, rows)
        ws = w.reshape(w.shape[0], parts, width // parts).permute(1, 0, 2)  # (parts, out, width / parts)
        xs = x.cast(dtypes.float16).reshape(rows, parts, width // parts).permute(1, 2, 0)  # (parts, width / parts, rows)
        return ws.matmul(xs, dtype=dtypes.float32)

    partial = gpu_reduce(split_product, opts, w, x) if opts else split_product(w, x).contiguous()
    return partial.sum(0).transpose()


# Tensor-core products' kernel options on GPUs, found by tinygrad's BEAM search on an H200
# (scripts/bench_prefill_products.py; docs/BENCHMARKS.md), keyed by the product's (rows, out, in): of a prompt chunk
# (a stage's chunks are all `prefill_chunk` rows, padding included) the product's one kernel, of a decode batch the
# split reduction's product kernel (its sum keeps tinygrad's choice: it fuses with what reads it). Llama-3.1-8B's
# products at chunks of 512 rows (gate/up and down from a wider search, BEAM=8) and batches of 8 (but the down
# projection, where the search found no better); a shape not here keeps tinygrad's heuristics.
TENSOR_CORE_OPTS: dict[tuple[int, int, int], tuple] = {
    (512, 6144, 4096): (("TC", 0, (-1, 2, 1)), ("UPCAST", 1, 4), ("UPCAST", 0, 4), ("UPCAST", 1, 3)),
    (512, 4096, 4096): (("TC", 0, (-1, 2, 1)), ("UPCAST", 0, 4), ("UPCAST", 1, 4), ("UNROLL", 0, 4), ("UPCAST", 1, 2),
                        ("LOCAL", 1, 2), ("SWAP", 0, 1)),
    (512, 28672, 4096): (("TC", 0, (-1, 2, 1)), ("UPCAST", 0, 4), ("UPCAST", 1, 7), ("LOCAL", 0, 4)),
    (512, 4096, 14336): (("TC", 0, (-1, 0, 1)), ("UPCAST", 0, 4), ("UPCAST", 1, 4), ("UNROLL", 0, 4), ("UPCAST", 1, 2)),
    (8, 6144, 4096): (("TC", 0, (-1, 0, 1)), ("UPCAST", 1, 3), ("UNROLL", 0, 4)),
    (8, 4096, 4096): (("TC", 0, (-1, 0, 1)), ("UNROLL", 0, 4), ("UPCAST", 1, 4)),
    (8, 28672, 4096): (("TC", 0, (-1, 0, 1)), ("UPCAST", 1, 2), ("SWAP", 0, 1), ("UNROLL", 0, 4)),
}


def tensor_core_opts(device: str, rows: int, out_features: int, in_features: int) -> tuple | None:
    """The (op, axis, arg) options of a tensor-core product's kernel on GPUs (None: tinygrad's heuristics).
    `SWARMD_TENSOR_CORE_OPTS` (a JSON file: {"rows,out,in": [[op, axis, arg], ...]}; `{}` for none) overrides the table,
    for searches and comparisons."""
    import json
    import os
    from pathlib import Path

    if device.split(":")[0] not in GPU_DEVICES:
        return None
    table = TENSOR_CORE_OPTS
    if path := os.environ.get("SWARMD_TENSOR_CORE_OPTS"):
        table = {tuple(int(n) for n in k.split(",")): v for k, v in json.loads(Path(path).read_text()).items()}
    return table.get((rows, out_features, in_features)) or None


def tensor_core_split() -> int:
    """`SWARMD_TENSOR_CORE_SPLIT`: the parts of every decode batch's tensor-core reduction (for searches); 0: `split_k`
    picks them."""
    import os

    return int(os.environ.get("SWARMD_TENSOR_CORE_SPLIT") or 0)


def split_k(out: int, width: int) -> int:
    """Parts of the reduction of a decode batch's tensor-core product with an (out, width) matrix:
    `SWARMD_TENSOR_CORE_SPLIT` (for searches), else enough that tiles of 64 outputs times parts come to about
    `TENSOR_CORE_BLOCKS`, at most 32; lowered until each part is whole tiles of 16."""
    parts = tensor_core_split()
    if not parts:
        parts = 1
        while parts < 32 and out // 64 * parts * 2 <= TENSOR_CORE_BLOCKS:
            parts *= 2
    while parts > 1 and width % (16 * parts):
        parts //= 2
    return parts


# Tiles of 64 outputs times reduction parts that fill an H200 with a decode batch's tensor-core product
# (scripts/bench_tensor_core_rows.py, Llama-3.1-8B shapes at 8, 16 and 32 rows: qkv gets 16 parts, attention
# output and down 32, gate_up 4, the head 1; a layer's four products within 8 % of each one's best split).
TENSOR_CORE_BLOCKS = 2048


def cpu_threads(out_features: int) -> int:
    """The threads a CPU product of `out_features` outputs runs on: tinygrad's CPU count, or fewer where they would
    not split the outputs evenly."""
    from tinygrad.helpers import CPU_COUNT

    return max(t for t in range(1, CPU_COUNT.value + 1) if out_features % t == 0)


def cpu_matvec_opts(device: str, out_features: int, n_reduce: int) -> tuple | None:
    from tinygrad.codegen.opt import Opt, OptOps

    if not device.split(":")[0] == "CPU":
        return None
    threads = cpu_threads(out_features)
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

    return kernel(cuda.in_place(x).contiguous(), w).transpose(0, 1)


# Options of the GPU matvec kernel (axis 0: output features, axis 1: rows; reduce axis 0: the inner
# dimension), picked by scripts/bench_gpu.py's search on an H200 for Llama-shaped layers. Keys: the
# row count bucket (decode batch) -> options; a matrix whose inner dimension the options do not divide
# is left to tinygrad's heuristics.
GPU_MATVEC_OPTS: dict[int, tuple[tuple[str, int, int], ...]] = {
    1: (('UNROLL', 0, 4), ('GROUP', 0, 32)),
    2: (('UNROLL', 0, 4), ('GROUP', 0, 32), ('UPCAST', 1, 2)),
    4: (('UNROLL', 0, 4), ('GROUP', 0, 32)),
    8: (('UNROLL', 0, 8), ('GROUP', 0, 64), ('UPCAST', 0, 4), ('UPCAST', 1, 8)),
    16: (('UNROLL', 0, 4), ('GROUP', 0, 32), ('UPCAST', 1, 8)),
    32: (('UNROLL', 0, 4), ('GROUP', 0, 64), ('UPCAST', 0, 4), ('UPCAST', 1, 8)),
}


def as_opts(entries: Sequence[tuple[str, int, int]]) -> tuple:
    """A table's (op, axis, arg) entries as tinygrad's kernel options (a list arg, as JSON gives a tensor core's,
    becomes a tuple)."""
    from tinygrad.codegen.opt import Opt, OptOps

    return tuple(Opt(OptOps[op], axis, tuple(arg) if isinstance(arg, list) else arg) for op, axis, arg in entries)


def gpu_matvec_opts(device: str, rows: int, out_features: int, in_features: int) -> tuple | None:
    """Kernel options for the GPU matvec of `rows` rows: None off GPUs, () for tinygrad's heuristics.

    `SWARMD_MATVEC_OPTS` (a JSON file of the same table) overrides the built-in one, for searches;
    an empty table, `{}`, leaves every matvec to tinygrad's heuristics."""
    if device.split(":")[0] not in GPU_DEVICES:
        return None
    override = _override_table()
    table = GPU_MATVEC_OPTS if override is None else override
    bucket = next((b for b in sorted(table) if rows <= b), None)
    if bucket is None:
        return ()
    opts = as_opts(table[bucket])
    return opts if opts_fit(opts, (out_features, rows), (in_features,)) else ()


def opts_fit(opts: tuple, outputs: Sequence[int], reduces: Sequence[int]) -> bool:
    """Whether each axis's splits divide it: LOCAL and UPCAST on output axis k (of sizes `outputs`), GROUP,
    GROUPTOP and UNROLL on reduce axis k (of sizes `reduces`), taken in turn; tinygrad would refuse or pad the kernel
    otherwise. Options on axes not given are not checked."""
    import math

    from tinygrad.codegen.opt import OptOps

    def split(ops: tuple, axis: int) -> int:
        return math.prod(o.arg or 1 for o in opts if o.op in ops and o.axis == axis)  # 0: the whole axis

    reduce_ops = (OptOps.GROUP, OptOps.GROUPTOP, OptOps.UNROLL)
    return (all(n % split((OptOps.LOCAL, OptOps.UPCAST), k) == 0 for k, n in enumerate(outputs))
            and all(n % split(reduce_ops, k) == 0 for k, n in enumerate(reduces)))


GPU_DEVICES = ("CUDA", "NV", "AMD", "HIP", "METAL", "CL", "NULL")


def _override_table() -> dict[int, tuple] | None:
    import json
    import os

    path = os.environ.get("SWARMD_MATVEC_OPTS")
    if not path:
        return None
    from pathlib import Path

    return {int(k): tuple(tuple(o) for o in v) for k, v in json.loads(Path(path).read_text()).items()}


def gpu_reduce(reduce_fn, opts: tuple[tuple[str, int, int], ...], *xs: Tensor) -> Tensor:
    """`reduce_fn(*xs)` as its own kernel with the given options on GPUs (tinygrad's heuristics leave a
    reduction with few outputs, or a symbolic length, to a few dozen threads); as is elsewhere. Each input is
    made contiguous first, so a view is copied: pass the buffer it views and take the view in `reduce_fn`."""
    from tinygrad import function

    if xs[0].device.split(":")[0] not in GPU_DEVICES:
        return reduce_fn(*xs)
    pinned = as_opts(opts)

    @function
    def kernel(*xs: Tensor) -> Tensor:
        return reduce_fn(*xs).contiguous(arg=pinned)

    return kernel(*(x.contiguous() for x in xs))
