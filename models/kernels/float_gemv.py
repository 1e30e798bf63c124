"""A few rows times a float16 or float32 matrix as one hand-written CUDA kernel in tinygrad's graph: a MoE router's
product at decode, whose output the router's top-k kernel then reads where it lies (tinygrad's product is a function
whose output is copied before a hand-written kernel reads it).

A block of `WARPS` warps computes one output for every row: each lane reads 16 bytes of the matrix row at a time (8
float16 or 4 float32 values), the warps take turns along the row, each lane sums its products, the warp adds its
lanes' sums in a fixed tree and one thread the warps' sums in order. So a row's bits do not depend on the rows around
it.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from models.kernels import cuda

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp

WARPS = 8  # warps sharing an output's row
MAX_ROWS = 7  # from 8 rows tinygrad's product (a float16 matrix's on the tensor cores)


def float_gemv_on() -> bool:
    """`SWARMD_FLOAT_GEMV=0` leaves these products to tinygrad's kernels (for side-by-side runs)."""
    return os.environ.get("SWARMD_FLOAT_GEMV", "1") != "0"


def float_gemv_fits(x: Tensor, w: Tensor) -> bool:
    """Whether `float_gemv` runs for x (rows, in) and w (out, in)."""
    from tinygrad import dtypes

    return (float_gemv_on() and cuda.arch(x.device) >= 70 and w.dtype in (dtypes.float16, dtypes.float32)
            and len(w.shape) == 2
            and all(isinstance(n, int) for n in (*x.shape, *w.shape)) and 1 <= x.shape[0] <= MAX_ROWS
            and x.shape[-1] == w.shape[1] and w.shape[1] % 8 == 0)


def float_gemv(x: Tensor, w: Tensor) -> Tensor:
    """x (rows, in) times w (out, in) float16 or float32, transposed -> float32 (rows, out)."""
    from tinygrad import Tensor, dtypes

    rows, width = x.shape
    out = Tensor.empty(rows, w.shape[0], dtype=dtypes.float32, device=x.device)
    return cuda.run(out, (x.cast(dtypes.float32), w), _program(x.device, rows, w.shape[0], width, w.dtype.itemsize))


@functools.cache
def _program(device: str, rows: int, out_features: int, width: int, itemsize: int) -> UOp:
    name = f"float_gemv_{rows}_{out_features}_{width}_f{8 * itemsize}"
    return cuda.program(device, name, source(name, rows, out_features, width, itemsize), grid=(out_features, 1, 1),
                        threads=32 * WARPS, buffers=3, ops=2 * rows * out_features * width,
                        traffic=itemsize * out_features * width + 4 * rows * (width + out_features))


def source(name: str, rows: int, out_features: int, width: int, itemsize: int = 2) -> str:
    """The kernel's CUDA source, for a matrix of float16 (`itemsize` 2) or float32 (4) values."""
    return _SOURCE.format(NAME=name, ROWS=rows, OUT=out_features, IN=width, WARPS=WARPS, HALF=int(itemsize == 2))


_SOURCE = r"""
#include <cuda_fp16.h>
#define ROWS {ROWS}
#define OUT {OUT}
#define IN {IN}
#define WARPS {WARPS}
#define HALF {HALF}
#if HALF
#define T half
#define PER 8
#else
#define T float
#define PER 4
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32) {NAME}(float* out, const float* __restrict__ x,
                                                                const T* __restrict__ w) {{
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, o = blockIdx.x;
  const T* wr = w + (size_t)o * IN;
  float acc[ROWS];
  #pragma unroll
  for (int i = 0; i < ROWS; i++) acc[i] = 0.f;
  #pragma unroll 4
  for (int c = (warp * 32 + lane) * PER; c < IN; c += WARPS * 32 * PER) {{
    const uint4 raw = __ldg((const uint4*)(wr + c));  // PER values
    float wv[PER];
#if HALF
    const half2* h = (const half2*)&raw;
    #pragma unroll
    for (int k = 0; k < 4; k++) {{ const float2 f = __half22float2(h[k]); wv[2 * k] = f.x; wv[2 * k + 1] = f.y; }}
#else
    wv[0] = __uint_as_float(raw.x); wv[1] = __uint_as_float(raw.y); wv[2] = __uint_as_float(raw.z);
    wv[3] = __uint_as_float(raw.w);
#endif
    #pragma unroll
    for (int i = 0; i < ROWS; i++) {{
      float t = acc[i];
      #pragma unroll
      for (int k = 0; k < PER; k += 4) {{
        const float4 v = __ldg((const float4*)(x + i * IN + c + k));
        t = fmaf(wv[k], v.x, t); t = fmaf(wv[k + 1], v.y, t); t = fmaf(wv[k + 2], v.z, t); t = fmaf(wv[k + 3], v.w, t);
      }}
      acc[i] = t;
    }}
  }}
  __shared__ float parts[WARPS][ROWS];
  #pragma unroll
  for (int i = 0; i < ROWS; i++) {{
    float v = acc[i];
    #pragma unroll
    for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
    if (lane == 0) parts[warp][i] = v;
  }}
  __syncthreads();
  if (threadIdx.x < ROWS) {{
    float v = parts[0][threadIdx.x];
    #pragma unroll
    for (int k = 1; k < WARPS; k++) v += parts[k][threadIdx.x];
    out[(size_t)threadIdx.x * OUT + o] = v;
  }}
}}
"""
