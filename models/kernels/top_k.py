"""The k largest of each row, as a hand-written CUDA kernel in tinygrad's graph: a router's choice of experts.

A warp takes a row: each lane holds every 32nd value, and k times over the warp finds the best value left (of equal
values the one of lower index) and takes it out. The indices come out as `models.moe.top_k` gives them, the largest
last, in place of tinygrad's kernels that count every element's rank against every other (docs/BENCHMARKS.md).
`routed_top_k` is the whole of a sigmoid router after its product, in one kernel: scores, the selection bias, the
choice, and the chosen scores as gates (normalised in order of rank, then scaled).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
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
    prog = _program(x.device, rows, n, k, None)
    return cuda.run(out, (x.reshape(rows, n).cast(dtypes.float32),), prog).reshape(*lead, k)


@dataclass(frozen=True)
class Routing:
    """What `routed_top_k`'s kernel does besides the choice: add a selection bias, normalise the gates, scale them."""

    has_bias: bool
    normalise: bool
    scale: float


CHOICE_ONLY = Routing(has_bias=False, normalise=False, scale=1.0)  # the plain top-k's constants in the shared source


def routed_top_k(logits: Tensor, bias: Tensor | None, k: int, *, normalise: bool, scale: float) -> tuple[Tensor, Tensor]:
    """A sigmoid router's gates (..., k) float32 and choice (..., k) int32 from its logits (..., n), as
    `models.moe.route` makes them: the k best of sigmoid(logits) + `bias`, the largest last; their scores, divided by
    their sum when `normalise`, times `scale`."""
    from tinygrad import Tensor, dtypes

    *lead, n = logits.shape
    rows = math.prod(lead)
    outs = (Tensor.empty(rows, k, dtype=dtypes.int32, device=logits.device),
            Tensor.empty(rows, k, dtype=dtypes.float32, device=logits.device))
    inputs = (logits.reshape(rows, n).cast(dtypes.float32), *([] if bias is None else [bias.cast(dtypes.float32)]))
    prog = _program(logits.device, rows, n, k, Routing(bias is not None, normalise, float(scale)))
    sel, gates = cuda.run_outputs(outs, inputs, prog)
    return gates.reshape(*lead, k), sel.reshape(*lead, k)


@functools.cache
def _program(device: str, rows: int, n: int, k: int, routing: Routing | None) -> UOp:
    routed, r = routing is not None, routing or CHOICE_ONLY
    name = f"top_k_{rows}_{n}_{k}" if not routed else f"routed_top_k_{rows}_{n}_{k}" + "_b" * r.has_bias + "_n" * r.normalise
    return cuda.program(device, name, source(name, rows, n, k, routing), grid=(-(-rows // ROWS_PER_BLOCK), 1, 1),
                        threads=32 * ROWS_PER_BLOCK, buffers=2 + routed + r.has_bias, ops=rows * n * k,
                        traffic=4 * rows * (n + k * (1 + routed)) + 4 * n * r.has_bias, outputs=1 + routed)


def source(name: str, rows: int, n: int, k: int, routing: Routing | None = None) -> str:
    """The kernel's CUDA source: the choice alone, or (`routing`) the whole router after its product."""
    import numpy as np

    routed, r = routing is not None, routing or CHOICE_ONLY
    params = ["int* sel", *["float* gates"] * routed, "const float* __restrict__ x",
              *["const float* __restrict__ bias"] * r.has_bias]
    return _SOURCE.format(NAME=name, ROWS=rows, N=n, K=k, PER=-(-n // 32), RPB=ROWS_PER_BLOCK, ROUTED=int(routed),
                          PARAMS=", ".join(params), HAS_BIAS=int(r.has_bias), NORMALISE=int(r.normalise),
                          SCALE=repr(float(np.float32(r.scale))))


_SOURCE = r"""
#define ROWS {ROWS}
#define N {N}
#define K {K}
#define PER {PER}
#define RPB {RPB}
#define ROUTED {ROUTED}
#define HAS_BIAS {HAS_BIAS}
#define NORMALISE {NORMALISE}

extern "C" __global__ void __launch_bounds__(RPB * 32) {NAME}({PARAMS}) {{
  const int lane = threadIdx.x & 31, row = blockIdx.x * RPB + (threadIdx.x >> 5);
  if (row >= ROWS) return;
  float v[PER];
  bool left[PER];
#if ROUTED
  float score[PER], g[K];  // sigmoid scores; the chosen ones' (lane 0), in order of rank
#endif
  #pragma unroll
  for (int t = 0; t < PER; t++) {{
    left[t] = lane + 32 * t < N;
    v[t] = left[t] ? x[(size_t)row * N + lane + 32 * t] : 0.f;
#if ROUTED
    score[t] = 1.f / (1.f + exp2f(v[t] * -1.4426950408889634f));
    v[t] = score[t];
#if HAS_BIAS
    if (left[t]) v[t] += bias[lane + 32 * t];
#endif
#endif
  }}
#if ROUTED
  #pragma unroll  // g in registers
#endif
  for (int j = K - 1; j >= 0; j--) {{
    float best = 0.f, bs = 0.f;
    int at = -1;  // this lane's best left: the largest value, of equal ones the lowest index
    #pragma unroll
    for (int t = 0; t < PER; t++)
      if (left[t] && (at < 0 || v[t] > best)) {{
        best = v[t]; at = lane + 32 * t;
#if ROUTED
        bs = score[t];
#endif
      }}
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {{
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oa = __shfl_xor_sync(0xffffffffu, at, o);
      const float os = __shfl_xor_sync(0xffffffffu, bs, o);
      if (oa >= 0 && (at < 0 || ob > best || (ob == best && oa < at))) {{ best = ob; at = oa; bs = os; }}
    }}
    if (lane == 0) sel[(size_t)row * K + j] = at;
#if ROUTED
    g[j] = bs;
#endif
    #pragma unroll
    for (int t = 0; t < PER; t++)
      if (lane + 32 * t == at) left[t] = false;
  }}
#if ROUTED
  if (lane == 0) {{
    float sum = 0.f;
    #pragma unroll
    for (int j = K - 1; j >= 0; j--) sum += g[j];
    #pragma unroll
    for (int j = 0; j < K; j++) gates[(size_t)row * K + j] = (NORMALISE ? g[j] / sum : g[j]) * {SCALE}f;
  }}
#endif
}}
"""
