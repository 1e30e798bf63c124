"""The k largest of each row, as a hand-written CUDA kernel in tinygrad's graph: a router's choice of experts.

A block of threads takes a row, a value a thread. The k-th largest of its warps' maxima bounds the choice from below
(k values are at least that large), so only the values above that bound are candidates: each candidate's rank is
the count of candidates above it (of equal values the one of lower index ranks higher), and the candidates of rank
below k are the choice. The indices come out as `models.moe.top_k` gives them, the largest last.
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

MAX_THREADS = 1024  # a block's: rows of up to this many values


def top_k_kernel_on() -> bool:
    """`SWARMD_TOP_K_KERNEL=0` leaves the top-k to tinygrad's kernels (for side-by-side runs)."""
    return os.environ.get("SWARMD_TOP_K_KERNEL", "1") != "0"


def top_k_kernel_fits(x: Tensor, k: int) -> bool:
    """Whether `top_k_kernel` runs for x (..., n)."""
    return (top_k_kernel_on() and cuda.arch(x.device) >= 70
            and all(isinstance(n, int) for n in x.shape) and 1 <= k <= x.shape[-1] <= MAX_THREADS)


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
    return cuda.program(device, name, source(name, n, k, routing), grid=(rows, 1, 1),
                        threads=_padded(n), buffers=2 + routed + r.has_bias, ops=rows * n * n,
                        traffic=4 * rows * (n + k * (1 + routed)) + 4 * n * r.has_bias, outputs=1 + routed)


def _padded(n: int) -> int:
    """A row's values rounded up to whole warps: a block's threads."""
    return -(-n // 32) * 32


def source(name: str, n: int, k: int, routing: Routing | None = None) -> str:
    """The kernel's CUDA source: the choice alone, or (`routing`) the whole router after its product."""
    import numpy as np

    routed, r = routing is not None, routing or CHOICE_ONLY
    params = ["int* sel", *["float* gates"] * routed, "const float* __restrict__ x",
              *["const float* __restrict__ bias"] * r.has_bias]
    return _SOURCE.format(NAME=name, N=n, K=k, NP=_padded(n), ROUTED=int(routed),
                          PARAMS=", ".join(params), HAS_BIAS=int(r.has_bias), NORMALISE=int(r.normalise),
                          SCALE=repr(float(np.float32(r.scale))))


_SOURCE = r"""
#define N {N}
#define K {K}
#define NP {NP}
#define WARPS (NP / 32)
#define ROUTED {ROUTED}
#define HAS_BIAS {HAS_BIAS}
#define NORMALISE {NORMALISE}
#define NEG_INF __int_as_float(0xff800000)

extern "C" __global__ void __launch_bounds__(NP) {NAME}({PARAMS}) {{
  __shared__ float v[NP], top[WARPS], bound;
  __shared__ int candidate[NP], candidates;
#if ROUTED
  __shared__ float chosen[K];  // the chosen scores, by rank
#endif
  const int row = blockIdx.x, i = threadIdx.x, lane = i & 31, warp = i >> 5;
  const bool in = i < N;
  float mine = NEG_INF, score = 0.f;
  if (in) {{
    mine = x[(size_t)row * N + i];
#if ROUTED
    score = 1.f / (1.f + exp2f(mine * -1.4426950408889634f));
    mine = score;
#if HAS_BIAS
    mine += bias[i];
#endif
#endif
  }}
  v[i] = mine;
  float m = mine;  // the warp's maximum (every warp holds a value of the row)
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) top[warp] = m;
  if (i == 0) {{ candidates = 0; bound = NEG_INF; }}
  __syncthreads();
  if (WARPS >= K && i < WARPS) {{  // the K-th largest maximum
    const float t = top[i];
    int above = 0;
    for (int w = 0; w < WARPS; w++) above += top[w] > t || (top[w] == t && w < i);
    if (above == K - 1) bound = t;
  }}
  __syncthreads();
  const bool candidate_here = in && mine >= bound;
  if (candidate_here) candidate[atomicAdd(&candidates, 1)] = i;
  __syncthreads();
  if (candidate_here) {{
    int rank = 0;  // candidates above this one: larger ones, and equal ones of lower index
    for (int c = 0; c < candidates; c++) {{
      const int j = candidate[c];
      const float w = v[j];
      rank += w > mine || (w == mine && j < i);
    }}
    if (rank < K) {{
      sel[(size_t)row * K + K - 1 - rank] = i;
#if ROUTED
      chosen[rank] = score;
#endif
    }}
  }}
#if ROUTED
  __syncthreads();
  if (i == 0) {{
    float sum = 0.f;
    #pragma unroll
    for (int r = 0; r < K; r++) sum += chosen[r];
    #pragma unroll
    for (int j = 0; j < K; j++) {{
      const float g = chosen[K - 1 - j];
      gates[(size_t)row * K + j] = (NORMALISE ? g / sum : g) * {SCALE}f;
    }}
  }}
#endif
}}
"""
