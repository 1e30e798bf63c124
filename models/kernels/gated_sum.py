"""A MoE block's residual plus its rows' gated expert outputs as one hand-written CUDA kernel in tinygrad's graph,
rounded as `models.moe.gated_sum` rounds them on a swarm's host: per row, each selection's gate times its output
(rounded), added in the order of the row's selections, then added to the residual (the shared experts' output added
to it first, where the kernel takes that too). The kernel's operations are `__fmul_rn` and `__fadd_rn`, which the
compiler never fuses into multiply-adds, so a stage running its experts in its graph gets the bits of one whose
graph is cut after each router (tinygrad's kernels fuse and reorder them).
"""

from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING

from models.kernels import cuda

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp

THREADS = 128
# where the shared experts' output comes from: none, a buffer of its own, or after the rows' k outputs in theirs
NO_SHARED, SHARED_BUFFER, SHARED_AFTER = 0, 1, 2


def gated_sum_kernel_on() -> bool:
    """`SWARMD_GATED_SUM_KERNEL=0` leaves the sum to tinygrad's kernels (for side-by-side runs)."""
    return os.environ.get("SWARMD_GATED_SUM_KERNEL", "1") != "0"


def gated_sum_fits(outputs: Tensor) -> bool:
    """Whether `residual_plus_gated` runs for expert outputs (..., k, dim)."""
    return (gated_sum_kernel_on() and cuda.arch(outputs.device) >= 70
            and all(isinstance(n, int) for n in outputs.shape))


def residual_plus_gated(residual: Tensor, outputs: Tensor, gates: Tensor, shared: Tensor | None = None, *,
                        shared_after: bool = False) -> Tensor:
    """residual (..., dim) + per row the sum over j of gates[..., j] * outputs[..., j, :] (outputs (..., k, dim),
    gates (..., k)), each product and sum rounded in turn -> float32 (..., dim). With `shared` (..., dim), the
    shared experts' output, residual + shared is rounded first, as a graph cut after the router adds them. With
    `shared_after`, outputs (rows * (k + 1), dim) holds the rows' k outputs, then each row's shared output."""
    from tinygrad import Tensor, dtypes

    assert shared is None or not shared_after, "the shared output comes in its own buffer or after the routed ones"
    *lead, dim = residual.shape
    rows, k = math.prod(lead), gates.shape[-1]
    out = Tensor.empty(*lead, dim, dtype=dtypes.float32, device=outputs.device)
    inputs = (residual.reshape(rows, dim).cast(dtypes.float32),
              outputs.reshape(rows * (k + shared_after), dim).cast(dtypes.float32),
              gates.reshape(rows, k).cast(dtypes.float32))
    if shared is not None:
        inputs += (shared.reshape(rows, dim).cast(dtypes.float32),)
    form = SHARED_AFTER if shared_after else SHARED_BUFFER if shared is not None else NO_SHARED
    return cuda.run(out, inputs, _program(outputs.device, rows, k, dim, form))


@functools.cache
def _program(device: str, rows: int, k: int, dim: int, shared: int = NO_SHARED) -> UOp:
    name = f"gated_sum_{rows}_{k}_{dim}" + {NO_SHARED: "", SHARED_BUFFER: "_s", SHARED_AFTER: "_sa"}[shared]
    return cuda.program(device, name, source(name, rows, k, dim, shared), grid=(-(-rows * dim // THREADS), 1, 1),
                        threads=THREADS, buffers=4 + (shared == SHARED_BUFFER), ops=2 * rows * k * dim,
                        traffic=4 * rows * (k + 2 + (shared != NO_SHARED)) * dim)


def source(name: str, rows: int, k: int, dim: int, shared: int = NO_SHARED) -> str:
    """The kernel's CUDA source: a thread an output value. `shared`: where the shared output comes from
    (`NO_SHARED`, `SHARED_BUFFER`, `SHARED_AFTER`: every row's after all rows' k outputs)."""
    return _SOURCE.format(NAME=name, ROWS=rows, K=k, DIM=dim, T=THREADS, SHARED=int(shared),
                          PARAMS=", const float* __restrict__ s" if shared == SHARED_BUFFER else "")


_SOURCE = r"""
#define ROWS {ROWS}
#define K {K}
#define DIM {DIM}
#define SHARED {SHARED}

extern "C" __global__ void __launch_bounds__({T}) {NAME}(float* out, const float* __restrict__ h,
    const float* __restrict__ y, const float* __restrict__ g{PARAMS}) {{
  const int i = blockIdx.x * {T} + threadIdx.x;
  if (i >= ROWS * DIM) return;
  const int row = i / DIM, c = i % DIM;
  const float* yr = y + (size_t)row * K * DIM + c;
  float total = __fmul_rn(g[row * K], yr[0]);
  #pragma unroll
  for (int j = 1; j < K; j++) total = __fadd_rn(total, __fmul_rn(g[row * K + j], yr[(size_t)j * DIM]));
#if SHARED == 2
  out[i] = __fadd_rn(__fadd_rn(h[i], y[(size_t)ROWS * K * DIM + i]), total);
#elif SHARED
  out[i] = __fadd_rn(__fadd_rn(h[i], s[i]), total);
#else
  out[i] = __fadd_rn(h[i], total);
#endif
}}
"""
