"""A decode batch's new latent-cache rows and normed query latents as one hand-written CUDA kernel in tinygrad's graph,
in place of five: the two RMSNorms, a copy of the key's RoPE part, the rotation joined to the normed latent, and
the cache write.

From the fused q_a / kv_a product's output (rows, q_lora + kv_lora + rope), a block of threads per row and part:
the first part norms the q latent (columns [0, q_lora)) into its own output; the second norms the kv latent
(the next kv_lora columns) and rotates the key's RoPE part (the last rope columns) into the row's cache slot at its
position. Each norm is `models.kernels.rms_norm`'s routine with that kernel's threads for its width (the same
bits); the rotation is `models.kernels.latent_attention`'s (each product and sum rounded on its own).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from models.kernels import cuda
from models.kernels.latent_attention import ROTATED
from models.kernels.rms_norm import MAX_PER_THREAD, NORM, threads_for

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp


def latent_rows_on() -> bool:
    """`SWARMD_LATENT_ROWS_KERNEL=0` leaves these steps to their own kernels (for side-by-side runs)."""
    return os.environ.get("SWARMD_LATENT_ROWS_KERNEL", "1") != "0"


@dataclass(frozen=True)
class LatentNorms:
    """The q latent's norm weight, the kv latent's, and their epsilons."""

    q_weight: Tensor
    kv_weight: Tensor
    q_eps: float
    kv_eps: float


def latent_rows_fits(qkv: Tensor, cache: Tensor, q_width: int, kv_width: int, rope: int) -> bool:
    """Whether `latent_rows` runs for the product's output qkv (rows, q_width + kv_width + rope) and a float32
    cache (slots, positions, kv_width + rope)."""
    from tinygrad import dtypes

    return (latent_rows_on() and cuda.arch(qkv.device) >= 70 and cache.dtype == dtypes.float32 and q_width > 0
            and all(isinstance(n, int) for n in (*qkv.shape, *cache.shape)) and qkv.ndim == 2
            and qkv.shape[1] == q_width + kv_width + rope and cache.shape[2] == kv_width + rope and rope % 2 == 0
            and rope <= 1024 and max(q_width, kv_width) <= 1024 * MAX_PER_THREAD)


def latent_rows(qkv: Tensor, norms: LatentNorms, angles: Tensor, cache: Tensor, slots: Tensor, starts: Tensor, *,
                q_width: int) -> tuple[Tensor, Tensor]:
    """(the normed q latents (rows, q_width); the cache after row b's latent went into slot slots[b] at position
    starts[b]). `angles` (rows, rope): each row's cos of its half, then sin."""
    from tinygrad import Tensor, dtypes

    rows, width = qkv.shape
    rope = angles.shape[-1]
    kv_width = width - q_width - rope
    prog = _program(qkv.device, rows, q_width, kv_width, rope, cache.shape[1], norms.q_eps, norms.kv_eps)
    f32 = dtypes.float32
    inputs = (qkv.cast(f32), norms.kv_weight.cast(f32), angles.cast(f32), slots.cast(dtypes.int32),
              starts.cast(dtypes.int32), norms.q_weight.cast(f32))
    q_normed = Tensor.empty(rows, q_width, dtype=f32, device=qkv.device)
    # realised here, as `store_rows`'s: the cache after a kernel call, read by more than one kernel, would be copied
    # whole first
    cached, q_normed = cuda.run_outputs((cache, q_normed), inputs, prog, realize=True)
    return q_normed, cached


@functools.cache
def _program(device: str, rows: int, q_width: int, kv_width: int, rope: int, positions: int, q_eps: float,
             kv_eps: float) -> UOp:
    name = f"latent_rows_{rows}_{q_width}_{kv_width}_{rope}_{positions}"
    threads = max(threads_for(q_width), threads_for(kv_width))
    return cuda.program(device, name, source(name, q_width, kv_width, rope, positions, q_eps, kv_eps),
                        grid=(rows, 2, 1), threads=threads, buffers=8, outputs=2, ops=4 * rows * (q_width + kv_width + rope),
                        traffic=4 * 2 * rows * (q_width + kv_width + rope))


def source(name: str, q_width: int, kv_width: int, rope: int, positions: int, q_eps: float, kv_eps: float) -> str:
    """The kernel's CUDA source."""
    import numpy as np

    return _SOURCE.format(NAME=name, QW=q_width, KW=kv_width, R=rope, POS=positions, TQ=threads_for(q_width),
                          TK=threads_for(kv_width), QEPS=repr(float(np.float32(q_eps))),
                          KEPS=repr(float(np.float32(kv_eps))), NORM=NORM, ROTATED=ROTATED)


_SOURCE = r"""
#define QW {QW}
#define KW {KW}
#define R {R}
#define W (QW + KW + R)
#define POS {POS}

{NORM}
{ROTATED}
extern "C" __global__ void {NAME}(float* cache, float* __restrict__ q_out, const float* __restrict__ qkv,
    const float* __restrict__ kv_w, const float* __restrict__ angles, const int* __restrict__ slots,
    const int* __restrict__ starts, const float* __restrict__ q_w) {{
  __shared__ float warps[32];
  const int b = blockIdx.x;
  const float* row = qkv + (size_t)b * W;
  if (blockIdx.y == 0) {{
    norm<QW, {TQ}>(q_out + (size_t)b * QW, row, q_w, {QEPS}f, warps);
    return;
  }}
  float* dst = cache + ((size_t)slots[b] * POS + starts[b]) * (KW + R);
  norm<KW, {TK}>(dst, row + QW, kv_w, {KEPS}f, warps);
  for (int k = threadIdx.x; k < R; k += blockDim.x) dst[KW + k] = rotated<R / 2>(row + QW + KW, angles + (size_t)b * R, k);
}}
"""
