"""The k largest of each row, as a hand-written CUDA kernel in tinygrad's graph: a router's choice of experts.

A warp takes a row: each lane holds every 32nd value, and k times over the warp finds the best value left (of equal
values the one of lower index) and takes it out. The indices come out as `models.moe.top_k` gives them, the largest
last, in place of tinygrad's kernels that count every element's rank against every other (docs/BENCHMARKS.md).
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

ROWS_PER_BLOCK = 4  # warps of a block of threads, a row each
MAX_PER_LANE = 32  # values a lane holds in registers: rows of up to 1,024


def top_k_kernel_on() -> bool:
    """`SWARMD_TOP_K_KERNEL=0` leaves the top-k to tinygrad's kernels (for side-by-side runs)."""
    return os.environ.get("SWARMD_TOP_K_KERNEL", "1") != "0"


def top_k_kernel_fits(x: Tensor, k: int) -> bool:
    """Whether `top_k_kernel` runs for x (..., n)."""
    return (top_k_kernel_on() and cuda.arch(x.device) >= 70
            and all(isinstance(n, int) for n in x.shape) and 1 <= k <= x.shape[-1] <= 32 * MAX_PER_LANE)


def top_k_kernel(x: Tensor, k: int) -> Tensor:
    """The indices (int32) of the k largest of x along its last axis, the largest last; of equal values the one of
    lower index ranks higher."""
    from tinygrad import Tensor, dtypes

    *lead, n = x.shape
    rows = math.prod(lead)
    out = Tensor.empty(rows, k, dtype=dtypes.int32, device=x.device)
    prog = _program(x.device, rows, n, k)
    return cuda.run(out, (x.reshape(rows, n).cast(dtypes.float32),), prog).reshape(*lead, k)


@functools.cache
def _program(device: str, rows: int, n: int, k: int) -> UOp:
    name = f"top_k_{rows}_{n}_{k}"
    return cuda.program(device, name, _SOURCE.format(NAME=name, ROWS=rows, N=n, K=k, PER=-(-n // 32),
                                                     RPB=ROWS_PER_BLOCK),
                        grid=(-(-rows // ROWS_PER_BLOCK), 1, 1), threads=32 * ROWS_PER_BLOCK, buffers=2,
                        ops=rows * n * k, traffic=4 * rows * (n + k))


_SOURCE = r"""
#define ROWS {ROWS}
#define N {N}
#define K {K}
#define PER {PER}
#define RPB {RPB}

extern "C" __global__ void __launch_bounds__(RPB * 32) {NAME}(int* out, const float* __restrict__ x) {{
  const int lane = threadIdx.x & 31, row = blockIdx.x * RPB + (threadIdx.x >> 5);
  if (row >= ROWS) return;
  float v[PER];
  bool left[PER];
  #pragma unroll
  for (int t = 0; t < PER; t++) {{
    left[t] = lane + 32 * t < N;
    v[t] = left[t] ? x[(size_t)row * N + lane + 32 * t] : 0.f;
  }}
  for (int j = K - 1; j >= 0; j--) {{
    float best = 0.f;
    int at = -1;  // this lane's best left: the largest value, of equal ones the lowest index
    #pragma unroll
    for (int t = 0; t < PER; t++)
      if (left[t] && (at < 0 || v[t] > best)) {{ best = v[t]; at = lane + 32 * t; }}
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {{
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oa = __shfl_xor_sync(0xffffffffu, at, o);
      if (oa >= 0 && (at < 0 || ob > best || (ob == best && oa < at))) {{ best = ob; at = oa; }}
    }}
    if (lane == 0) out[(size_t)row * K + j] = at;
    #pragma unroll
    for (int t = 0; t < PER; t++)
      if (lane + 32 * t == at) left[t] = false;
  }}
}}
"""
