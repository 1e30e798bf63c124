"""RMSNorm of a few rows as one hand-written CUDA kernel in tinygrad's graph, in place of tinygrad's two or more (the
sum of squares, then the scaling, and a copy of the window of a row it norms).

A block of threads takes a row, optionally a window of its columns (the normed part of a fused projection's
output, read in place). Each thread holds every `threads`-th value; it sums their squares, the warp adds its
lanes' sums in a fixed tree and every thread the warps' sums in order, so a row's bits do not depend on the rows
around it.
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

MAX_PER_THREAD = 64  # values a thread holds in registers: rows of up to 65,536 values


def rms_norm_kernel_on() -> bool:
    """`SWARMD_RMS_NORM_KERNEL=0` leaves the norms to tinygrad's kernels (for side-by-side runs)."""
    return os.environ.get("SWARMD_RMS_NORM_KERNEL", "1") != "0"


def rms_norm_fits(x: Tensor, width: int) -> bool:
    """Whether `rms_norm` runs for x (..., n) and a window of `width` of its columns."""
    return (rms_norm_kernel_on() and cuda.arch(x.device) >= 70 and all(isinstance(n, int) for n in x.shape)
            and 1 <= width <= min(x.shape[-1], 1024 * MAX_PER_THREAD))


def threads_for(width: int) -> int:
    """A block's threads for rows of `width` values: about 16 values each, 32 to 1,024 threads."""
    threads = 32
    while threads < 1024 and 16 * threads < width:
        threads *= 2
    return threads


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, columns: tuple[int, int] | None = None) -> Tensor:
    """x (..., n) float32 -> (..., width): each row's columns [start, start + width) (all by default) times the
    reciprocal root of their mean square plus `eps`, times `weight` (width,)."""
    from tinygrad import Tensor, dtypes

    *lead, n = x.shape
    start, width = columns if columns is not None else (0, n)
    rows = math.prod(lead)
    out = Tensor.empty(rows, width, dtype=dtypes.float32, device=x.device)
    prog = _program(x.device, rows, n, start, width, float(eps))
    inputs = (x.reshape(rows, n).cast(dtypes.float32), weight.cast(dtypes.float32))
    return cuda.run(out, inputs, prog).reshape(*lead, width)


@functools.cache
def _program(device: str, rows: int, stride: int, start: int, width: int, eps: float) -> UOp:
    name = f"rms_norm_{rows}_{stride}_{start}_{width}"
    threads = threads_for(width)
    return cuda.program(device, name, source(name, stride, start, width, eps), grid=(rows, 1, 1), threads=threads,
                        buffers=3, ops=4 * rows * width, traffic=4 * (2 * rows + 1) * width)


def source(name: str, stride: int, start: int, width: int, eps: float) -> str:
    """The kernel's CUDA source for rows of `stride` values, normed over columns [start, start + width)."""
    import numpy as np

    threads = threads_for(width)
    return _SOURCE.format(NAME=name, STRIDE=stride, START=start, N=width, T=threads, EPS=repr(float(np.float32(eps))),
                          NORM=NORM)


# A block's first T threads norm one window of N values (the others idle but meet its barrier), writing `out`: each
# thread holds every T-th value, the warp adds its lanes' squares in a fixed tree and every thread the warps' sums in
# order. Shared by this kernel and `models.kernels.latent_rows`, so their norms have the same bits.
NORM = r"""
template <int N, int T> __device__ __forceinline__ void norm(float* out, const float* xr, const float* w, float eps,
                                                             float* warps) {
  constexpr int PER = (N + T - 1) / T;
  const int t = threadIdx.x;
  float v[PER], s = 0.f;
  if (t < T) {
    #pragma unroll
    for (int j = 0; j < PER; j++) {
      const int c = t + T * j;
      v[j] = (N % T == 0 || c < N) ? xr[c] : 0.f;
      s = fmaf(v[j], v[j], s);
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((t & 31) == 0) warps[t >> 5] = s;
  }
  __syncthreads();
  if (t < T) {
    float total = 0.f;
    #pragma unroll
    for (int k = 0; k < T / 32; k++) total += warps[k];
    const float r = rsqrtf(total / (float)N + eps);
    #pragma unroll
    for (int j = 0; j < PER; j++) {
      const int c = t + T * j;
      if (N % T == 0 || c < N) out[c] = v[j] * r * w[c];
    }
  }
}
"""

_SOURCE = r"""
{NORM}
extern "C" __global__ void __launch_bounds__({T}) {NAME}(float* out, const float* __restrict__ x,
                                                        const float* __restrict__ w) {{
  __shared__ float warps[{T} / 32];
  norm<{N}, {T}>(out + (size_t)blockIdx.x * {N}, x + (size_t)blockIdx.x * {STRIDE} + {START}, w, {EPS}f, warps);
}}
"""
