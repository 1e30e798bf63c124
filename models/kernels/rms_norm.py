"""RMSNorm of a few rows as one hand-written CUDA kernel in tinygrad's graph, in place of tinygrad's two or more (the
sum of squares, then the scaling, and a copy of the window of a row it norms).

A block of threads takes a row, optionally a window of its columns (the normed part of a fused projection's
output, read in place), or the sum of two rows (`added_rms_norm`: the residual stream plus a block's attention,
written out beside its norm, in place of an add kernel before the norm's). Each thread holds every `threads`-th
value; it sums their squares, the warp adds its lanes' sums in a fixed tree and every thread the warps' sums in
order, so a row's bits do not depend on the rows around it.
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


def added_norm_on() -> bool:
    """`SWARMD_ADDED_NORM_KERNEL=0` adds the residual in a kernel of its own before the norm's (side-by-side runs)."""
    return os.environ.get("SWARMD_ADDED_NORM_KERNEL", "1") != "0"


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


def added_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x + delta (..., n) float32, and its `rms_norm`, from one kernel (the sum with the bits of tinygrad's add)."""
    from tinygrad import Tensor, dtypes

    *lead, n = x.shape
    rows = math.prod(lead)
    outs = tuple(Tensor.empty(rows, n, dtype=dtypes.float32, device=x.device) for _ in range(2))
    inputs = (x.reshape(rows, n).cast(dtypes.float32), weight.cast(dtypes.float32),
              delta.reshape(rows, n).cast(dtypes.float32))
    total, normed = cuda.run_outputs(outs, inputs, _program(x.device, rows, n, 0, n, float(eps), added=True))
    return total.reshape(*lead, n), normed.reshape(*lead, n)


@functools.cache
def _program(device: str, rows: int, stride: int, start: int, width: int, eps: float, added: bool = False) -> UOp:
    name = f"rms_norm_{rows}_{stride}_{start}_{width}" + "_added" * added
    threads = threads_for(width)
    return cuda.program(device, name, source(name, stride, start, width, eps, added), grid=(rows, 1, 1),
                        threads=threads, buffers=3 + 2 * added, ops=4 * rows * width,
                        traffic=4 * ((2 + 2 * added) * rows + 1) * width, outputs=1 + added)


def source(name: str, stride: int, start: int, width: int, eps: float, added: bool = False) -> str:
    """The kernel's CUDA source for rows of `stride` values, normed over columns [start, start + width); `added`:
    of x + delta, written out too."""
    import numpy as np

    threads = threads_for(width)
    return (_ADDED if added else _SOURCE).format(NAME=name, STRIDE=stride, START=start, N=width, T=threads,
                                                 EPS=repr(float(np.float32(eps))), NORM=NORM)


# A block's first T threads norm one window of N values (the others idle but meet its barrier), writing `out`: each
# thread holds every T-th value, the warp adds its lanes' squares in a fixed tree and every thread the warps' sums in
# order. With `d`, the window is xr + d, written to `sum`. Shared by this kernel and `models.kernels.latent_rows`,
# so their norms have the same bits.
NORM = r"""
template <int N, int T> __device__ __forceinline__ void norm(float* out, const float* xr, const float* w, float eps,
                                                             float* warps, const float* d = nullptr,
                                                             float* sum = nullptr) {
  constexpr int PER = (N + T - 1) / T;
  const int t = threadIdx.x;
  float v[PER], s = 0.f;
  if (t < T) {
    #pragma unroll
    for (int j = 0; j < PER; j++) {
      const int c = t + T * j;
      v[j] = (N % T == 0 || c < N) ? xr[c] : 0.f;
      if (d != nullptr && (N % T == 0 || c < N)) {
        v[j] = __fadd_rn(v[j], d[c]);
        sum[c] = v[j];
      }
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

_ADDED = r"""
{NORM}
extern "C" __global__ void __launch_bounds__({T}) {NAME}(float* sum, float* out, const float* __restrict__ x,
                                                        const float* __restrict__ w, const float* __restrict__ d) {{
  __shared__ float warps[{T} / 32];
  const size_t row = (size_t)blockIdx.x * {N};
  norm<{N}, {T}>(out + row, x + row, w, {EPS}f, warps, d + row, sum + row);
}}
"""
