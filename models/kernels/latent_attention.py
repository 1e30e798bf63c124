"""Multi-head latent attention of a decode batch as two hand-written CUDA kernels in tinygrad's graph.

Row b's queries, absorbed into the latent space, q (B, heads, latent), attend over rows [0, starts[b]] of slot
slots[b] of the cache (slots, rows, latent), whose rows are every head's keys and whose first `values` columns are
their values. The first kernel splits a row's cache into `SPLITS` spans of equal length (the last one shorter); a
warp takes one head over one span, four cache rows at a time, and keeps its running maximum, the sum of its
weights and its weighted values (a span's entry padded to whole float4s). The second adds a head's spans in order.
Where the spans fall follows from the row's position alone, so a row's bits do not depend on the batch around it
(a verify step's rows included). With `QueryRope` the first kernel rotates the queries' RoPE part itself, read
where the query projection left it, in place of a kernel that rotates and joins them first.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from models.kernels import cuda

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp

SPLITS = 32  # spans of a row's cache, each a warp's per head (at most a warp's lanes: the sum weighs one a lane)
HEADS_PER_BLOCK = 8  # warps of a block of threads, one head each: they read the same cache rows


def latent_attention_on() -> bool:
    """`SWARMD_LATENT_ATTENTION_KERNEL=0` leaves the attention to tinygrad's kernels (for side-by-side runs)."""
    return os.environ.get("SWARMD_LATENT_ATTENTION_KERNEL", "1") != "0"


def latent_attention_fits(q: Tensor, cache: Tensor, values: int) -> bool:
    """Whether `latent_attention` runs for queries q (B, heads, latent) over `cache` (slots, rows, latent)."""
    from tinygrad import dtypes

    heads, width = q.shape[1], q.shape[2]
    return (latent_attention_on() and cuda.arch(q.device) >= 70 and cache.dtype == dtypes.float32
            and all(isinstance(n, int) for n in (*q.shape, *cache.shape)) and heads % HEADS_PER_BLOCK == 0
            and cache.shape[2] == width and width % 64 == 0 and values % 64 == 0
            and 4 * SPLITS <= values <= min(width, 4 * 1024))  # the sum: a warp weighs the spans, 4 values a thread


def query_rope_on() -> bool:
    """`SWARMD_QUERY_ROPE_IN_KERNEL=0` rotates and joins the queries in tinygrad's kernel first (side-by-side runs)."""
    return os.environ.get("SWARMD_QUERY_ROPE_IN_KERNEL", "1") != "0"


@dataclass(frozen=True)
class QueryRope:
    """The queries' RoPE part, unrotated, where the query projection left it: `heads` (B, heads, head_dim), each
    head's values from column `start` on, and each row's angles (B, rope_dim): cos of its half, then sin (the
    half-split RoPE of `models.deepseek2._rotate`, each product and sum rounded on its own)."""

    heads: Tensor
    start: int
    angles: Tensor


def latent_attention(q: Tensor, cache: Tensor, slots: Tensor, starts: Tensor, *, values: int, scale: float,
                     rope: QueryRope | None = None) -> Tensor:
    """Each row's attention output (B, heads, values) float32; scores scaled by `scale`. `slots` and `starts` are
    (B,) int32 tensors (`models.kernels.attention.batch_rows_at`). With `rope`, q (B, heads, values) is only the
    queries' latent part, and the kernel rotates their RoPE part itself."""
    from tinygrad import Tensor, dtypes

    batch, heads, width = q.shape
    if rope is not None:
        width += rope.angles.shape[-1]
    part, combine = _programs(q.device, batch, heads, width, values, cache.shape[1], float(scale),
                              None if rope is None else (rope.heads.shape[-1], rope.start))
    starts = starts.cast(dtypes.int32)
    spans = Tensor.empty(batch, SPLITS, heads, values + 4, dtype=dtypes.float32, device=q.device)
    inputs = (q.cast(dtypes.float32), cache, slots.cast(dtypes.int32), starts)
    if rope is not None:
        inputs += (rope.heads.cast(dtypes.float32), rope.angles.cast(dtypes.float32))
    spans = cuda.run(spans, inputs, part)
    out = Tensor.empty(batch, heads, values, dtype=dtypes.float32, device=q.device)
    return cuda.run(out, (spans, starts), combine)


@functools.cache
def _programs(device: str, batch: int, heads: int, width: int, values: int, rows: int, scale: float,
              rope: tuple[int, int] | None = None) -> tuple[UOp, UOp]:
    import numpy as np

    tag = f"{batch}_{heads}_{width}_{values}_{rows}"
    head_dim, start = rope or (0, 0)
    consts = dict(H=heads, W=width, V=values, ROWS=rows, NS=SPLITS, HPB=HEADS_PER_BLOCK,
                  SCALE=repr(float(np.float32(scale))))
    name = f"latent_attention_{tag}" + (f"_r{head_dim}_{start}" if rope else "")
    part = cuda.program(device, name,
                        _PART.format(NAME=name, ROPE=int(rope is not None), HD=head_dim, START=start,
                                     PARAMS=_ROPE_PARAMS if rope else "", ROTATED=ROTATED, **consts),
                        grid=(heads // HEADS_PER_BLOCK, SPLITS, batch), threads=32 * HEADS_PER_BLOCK,
                        buffers=5 + 2 * (rope is not None), ops=4 * batch * heads * rows * width,
                        traffic=4 * batch * rows * width)
    combine = cuda.program(device, f"latent_attention_sum_{tag}",
                           _COMBINE.format(NAME=f"latent_attention_sum_{tag}", **consts), grid=(heads, batch, 1),
                           threads=values // 4, buffers=3, ops=4 * batch * heads * SPLITS * values,
                           traffic=4 * batch * heads * SPLITS * (values + 4))
    return part, combine


_PART = r"""
#define H {H}
#define W {W}
#define V {V}
#define ROWS {ROWS}
#define NS {NS}
#define HPB {HPB}
#define QW (W / 64)
#define VW (V / 64)
#define RPI 4
#define NEG_INF __int_as_float(0xff800000)
#define ROPE {ROPE}
#define HD {HD}
#define START {START}
{ROTATED}

extern "C" __global__ void __launch_bounds__(HPB * 32) {NAME}(float* part, const float* __restrict__ q,
    const float* __restrict__ cache, const int* __restrict__ slots, const int* __restrict__ starts{PARAMS}) {{
  const int lane = threadIdx.x & 31, h = blockIdx.x * HPB + (threadIdx.x >> 5), s = blockIdx.y, b = blockIdx.z;
  const int n = starts[b] + 1, per = (n + NS - 1) / NS, r0 = s * per, r1 = min(n, r0 + per);
  if (r0 >= r1) return;
  float2 qv[QW];
#if ROPE
  const float2* qh = (const float2*)(q + ((size_t)b * H + h) * V);
  const float* pe = heads + ((size_t)b * H + h) * HD + START;
  #pragma unroll
  for (int j = 0; j < QW; j++) {{
    const int e = 2 * (lane + 32 * j);
    qv[j] = e < V ? qh[lane + 32 * j] : make_float2(rotated<(W - V) / 2>(pe, angles + b * (W - V), e - V),
                                                    rotated<(W - V) / 2>(pe, angles + b * (W - V), e - V + 1));
  }}
#else
  const float2* qh = (const float2*)(q + ((size_t)b * H + h) * W);
  #pragma unroll
  for (int j = 0; j < QW; j++) qv[j] = qh[lane + 32 * j];
#endif
  const float* base = cache + (size_t)slots[b] * ROWS * W;
  float m = NEG_INF, l = 0.f;
  float2 acc[VW];
  #pragma unroll
  for (int j = 0; j < VW; j++) acc[j] = make_float2(0.f, 0.f);
  for (int r = r0; r < r1; r += RPI) {{
    float2 kv[RPI][QW];
    float sc[RPI];
    #pragma unroll
    for (int i = 0; i < RPI; i++) {{
      const float2* row = (const float2*)(base + (size_t)min(r + i, r1 - 1) * W);
      #pragma unroll
      for (int j = 0; j < QW; j++) kv[i][j] = __ldg(row + lane + 32 * j);
    }}
    #pragma unroll
    for (int i = 0; i < RPI; i++) {{
      float d = 0.f;
      #pragma unroll
      for (int j = 0; j < QW; j++) d = fmaf(qv[j].y, kv[i][j].y, fmaf(qv[j].x, kv[i][j].x, d));
      sc[i] = d;
    }}
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      #pragma unroll
      for (int i = 0; i < RPI; i++) sc[i] += __shfl_xor_sync(0xffffffffu, sc[i], o);
    float mx = m;
    #pragma unroll
    for (int i = 0; i < RPI; i++) {{
      sc[i] = r + i < r1 ? sc[i] * {SCALE}f : NEG_INF;
      mx = fmaxf(mx, sc[i]);
    }}
    const float keep = expf(m - mx);
    l *= keep;
    #pragma unroll
    for (int j = 0; j < VW; j++) {{ acc[j].x *= keep; acc[j].y *= keep; }}
    #pragma unroll
    for (int i = 0; i < RPI; i++) {{
      const float p = expf(sc[i] - mx);
      l += p;
      #pragma unroll
      for (int j = 0; j < VW; j++) {{
        acc[j].x = fmaf(p, kv[i][j].x, acc[j].x);
        acc[j].y = fmaf(p, kv[i][j].y, acc[j].y);
      }}
    }}
    m = mx;
  }}
  float* out = part + (((size_t)b * NS + s) * H + h) * (V + 4);
  #pragma unroll
  for (int j = 0; j < VW; j++) {{ out[2 * (lane + 32 * j)] = acc[j].x; out[2 * (lane + 32 * j) + 1] = acc[j].y; }}
  if (lane == 0) {{ out[V] = m; out[V + 1] = l; }}
}}
"""

# Value k of a half-split RoPE part x of 2 * HALF values, rotated by `angles` (cos of each angle, then its sin):
# x1 * cos - x2 * sin, then x2 * cos + x1 * sin, each product and sum rounded on its own. Shared with
# `models.kernels.latent_rows`, which rotates the cached keys so.
ROTATED = r"""
template <int HALF> __device__ __forceinline__ float rotated(const float* x, const float* angles, int k) {
  const int i = k % HALF;
  const float c = angles[i], sn = angles[HALF + i], x1 = x[i], x2 = x[HALF + i];
  return k < HALF ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sn)) : __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sn));
}
"""

_ROPE_PARAMS = ", const float* __restrict__ heads, const float* __restrict__ angles"

_COMBINE = r"""
#define H {H}
#define V {V}
#define NS {NS}
#define NEG_INF __int_as_float(0xff800000)

extern "C" __global__ void __launch_bounds__(V / 4) {NAME}(float* out, const float* __restrict__ part,
    const int* __restrict__ starts) {{
  __shared__ float weight[NS];
  __shared__ float total;
  const int h = blockIdx.x, b = blockIdx.y, t = threadIdx.x;
  const int n = starts[b] + 1, per = (n + NS - 1) / NS, spans = (n + per - 1) / per;
  const float* p = part + ((size_t)b * NS * H + h) * (V + 4);
  if (t < 32) {{  // the first warp weighs the spans: each lane one span, added in a fixed tree
    const float m = t < spans ? p[(size_t)t * H * (V + 4) + V] : NEG_INF;
    float mx = m;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float w = t < spans ? expf(m - mx) : 0.f;
    float l = t < spans ? w * p[(size_t)t * H * (V + 4) + V + 1] : 0.f;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (t < NS) weight[t] = w;
    if (t == 0) total = l;
  }}
  __syncthreads();
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  #pragma unroll 8
  for (int s = 0; s < spans; s++) {{
    const float4 v = *(const float4*)(p + (size_t)s * H * (V + 4) + 4 * t);
    const float w = weight[s];
    acc.x = fmaf(w, v.x, acc.x); acc.y = fmaf(w, v.y, acc.y); acc.z = fmaf(w, v.z, acc.z); acc.w = fmaf(w, v.w, acc.w);
  }}
  float* o = out + ((size_t)b * H + h) * V + 4 * t;
  o[0] = acc.x / total; o[1] = acc.y / total; o[2] = acc.z / total; o[3] = acc.w / total;
}}
"""
