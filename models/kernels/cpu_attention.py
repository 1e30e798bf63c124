"""A decode step's attention on the CPU in ggml numerics as one hand-written C kernel for all its rows.

tinygrad runs each row's attention as five kernels (scores, their maximum, the sum of their exponentials, the
weights, the weighted values), whose index arithmetic divides by the row's length for every score. Here one kernel
does each (row, head) in turn with tinygrad's arithmetic, in tinygrad's order: the scores as one chain of
multiply-adds over the head's values, scaled; the running maximum; tinygrad's exp2 (its polynomial and its scaling
by powers of two, as its C renderer writes them); the sum from zero; the weights times the sum's reciprocal, rounded
to float16; each value a chain of multiply-adds over the positions. So a row gets the bits of
`models.kernels.ggml_numerics.attention` (tested).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp


def cpu_attention_on() -> bool:
    """`SWARMD_CPU_ATTENTION=0` leaves decode attention to tinygrad's kernels (for side-by-side measurements)."""
    return os.environ.get("SWARMD_CPU_ATTENTION", "1") != "0"


def cpu_attention_fits(device: str, numerics: str) -> bool:
    """Whether a stage on `device` computing in `numerics` runs its decode steps' attention with this kernel."""
    return cpu_attention_on() and device.split(":")[0] == "CPU" and numerics == "ggml"


def cpu_decode_attention(q: Tensor, cache: Tensor, slots: Tensor, starts: Tensor) -> Tensor:
    """q (B, heads, 1, head_dim) float32, row b over positions [0, starts[b]] of slot slots[b] of `cache` (2, slots,
    kv_heads, rows, head_dim) float16 -> (B, heads, 1, head_dim) float32. A row's scores live on its thread's stack
    (4 bytes a cache row)."""
    from tinygrad import Tensor, dtypes

    from models.kernels import cuda
    from models.kernels.matvec import cpu_threads

    batch, heads, _, hd = q.shape
    _, n_slots, kvh, rows, _ = cache.shape
    out = Tensor.empty(batch, heads, 1, hd, dtype=dtypes.float32, device=q.device)
    prog = _program(q.device, batch, heads, kvh, n_slots, rows, hd, cpu_threads(batch * heads))
    return cuda.run(out, (q.cast(dtypes.float32), cache, slots.cast(dtypes.int32), starts.cast(dtypes.int32)), prog)


@functools.cache
def _program(device: str, batch: int, heads: int, kvh: int, n_slots: int, rows: int, hd: int, n_threads: int) -> UOp:
    from models.kernels import cpu

    name = f"cpu_attention_{batch}_{heads}_{kvh}_{hd}_{rows}"
    src = _SOURCE.format(NAME=name, B=batch, H=heads, KVH=kvh, S=n_slots, L=rows, HD=hd, THREADS=n_threads,
                         SCALE=repr(float(1.0 / hd ** 0.5)) + "f")
    return cpu.program(device, name, src, threads=n_threads, buffers=5, ops=4 * batch * heads * rows * hd,
                       traffic=4 * batch * kvh * rows * hd)


_SOURCE = r"""
#define B {B}
#define H {H}
#define KVH {KVH}
#define S {S}
#define L {L}
#define HD {HD}
#define GROUP (H / KVH)

static inline __attribute__((always_inline)) float tg_exp2(float a1) {{
  _Bool isnan_ = (a1 != a1);
  float a3 = ((a1 != ((float)(-__builtin_inff()))) ? a1 : 0.0f);
  float a4 = (isnan_ ? 0.0f : a3);
  float a5 = ((a1 != ((float)(__builtin_inff()))) ? a4 : 0.0f);
  float a6 = ((a5 < 0.0f) ? -0.5f : 0.5f);
  int c0 = ((int)((a5 + a6)));
  _Bool neg = (c0 < 0);
  int a8 = (neg ? 1 : 0);
  int a9 = (((c0 + a8) >> 1) - ((int)((((c0 % 2) != 0) & (neg != 0)))));
  float a10 = (a5 - ((float)(c0)));
  float a11 = (((a1 < 128.0f) != 1) ? ((float)(__builtin_inff())) : (((((((((((((0.0001535920892f*a10)+0.001339262701f)*a10)+0.009618384764f)*a10)+0.05550347269f)*a10)+0.2402264476f)*a10)+0.6931471825f)*a10)+1.0f)*__builtin_bit_cast(float, (int)(((a9+127)<<23)))*__builtin_bit_cast(float, (int)((((c0-a9)+127)<<23)))));
  float a12 = ((a1 < -150.0f) ? 0.0f : a11);
  return (isnan_ ? ((float)(__builtin_nanf(""))) : a12);
}}

void {NAME}(float* restrict out, const float* restrict q, const __fp16* restrict cache, const int* restrict slots,
            const int* restrict starts, const int core_id) {{
  float sc[L];
  for (int item = core_id; item < B * H; item += {THREADS}) {{
    const int b = item / H, h = item % H, g = h / GROUP;
    const int n = starts[b] + 1;
    const __fp16* K = cache + (((long)slots[b] * KVH + g) * L) * HD;
    const __fp16* V = cache + ((((long)S + slots[b]) * KVH + g) * L) * HD;
    float qr[HD];
    for (int i = 0; i < HD; i++) qr[i] = (float)((__fp16)q[item * HD + i]);
    float m = (float)(-__builtin_inff());
    int p = 0;
    for (; p + 8 <= n; p += 8) {{  // 8 positions' chains side by side, each in its own order
      float acc[8] = {{0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}};
      for (int i = 0; i < HD; i++)
        for (int j = 0; j < 8; j++) acc[j] = acc[j] + qr[i] * (float)K[(p + j) * HD + i];
      for (int j = 0; j < 8; j++) sc[p + j] = acc[j] * {SCALE};
    }}
    for (; p < n; p++) {{
      float acc = 0.0f;
      for (int i = 0; i < HD; i++) acc = acc + qr[i] * (float)K[p * HD + i];
      sc[p] = acc * {SCALE};
    }}
    for (p = 0; p < n; p++) m = (m < sc[p]) ? sc[p] : m;
    float sum = 0.0f;
    for (p = 0; p < n; p++) {{
      const float e = tg_exp2((sc[p] - m) * 1.4426950408889634f);
      sc[p] = e;
      sum = sum + e;
    }}
    const float inv = 1.0f / sum;
    float o[HD];
    for (int i = 0; i < HD; i++) o[i] = 0.0f;
    for (p = 0; p < n; p++) {{
      const float w = (float)((__fp16)(sc[p] * inv));
      for (int i = 0; i < HD; i++) o[i] = o[i] + w * (float)V[p * HD + i];
    }}
    for (int i = 0; i < HD; i++) out[item * HD + i] = o[i];
  }}
}}
"""
