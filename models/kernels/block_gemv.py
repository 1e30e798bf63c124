"""A few rows times 4-bit GGML-block matrices (Q4_0, Q4_1), chosen per slot from a stack or one matrix, as a
hand-written CUDA kernel in tinygrad's graph: the decode step's product with a Kimi-class model's quantised weights.

x (slots, rows, in) float32; slot s multiplies matrix idx[s] of a stack, or matrix s of a stack of `slots` matrices
(a head's own matrix), or the one matrix; the result is float32 (slots, rows, out). A warp computes `per_warp` outputs:
each lane reads `lane_bytes` of every block's 16 bytes of codes (2 values a byte) in its share of each output's row,
so that a warp's loads of codes are whole 128-byte lines, and the matching activations of each row once for all its
outputs. A lane sums (code - offset) * x over its values of a block, scales the sum by the block's scale (and adds
Q4_1's offset times the activations' sum), and the warp adds its lanes' sums in a fixed tree: each output's sum
runs in the same order whatever the slots, rows and matrices around it.
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

    from models.kernels.quant import BlockQuantized

KERNEL_ROWS = 8  # a slot's rows one kernel holds in registers; more go in kernels of this many rows each
MAX_ROWS = 64  # more (a long prompt's chunk) go to tinygrad's kernel


@dataclass(frozen=True)
class Layout:
    """Outputs per warp, warps per block of threads, and bytes of a block's codes each lane reads (4, 8 or 16)."""

    per_warp: int = 4
    warps: int = 4
    lane_bytes: int = 4

    @staticmethod
    def parse(spec: str) -> Layout:
        """A layout from "per_warp,warps[,lane_bytes]"."""
        return Layout(*(int(v) for v in spec.split(",")))

    @property
    def tag(self) -> str:
        """The layout in a kernel's name."""
        return f"{self.per_warp}x{self.warps}" + (f"b{self.lane_bytes}" if self.lane_bytes != 4 else "")


def layout() -> Layout:
    """`SWARMD_BLOCK_GEMV_LAYOUT` ("per_warp,warps[,lane_bytes]", for searches), else the default."""
    spec = os.environ.get("SWARMD_BLOCK_GEMV_LAYOUT")
    return Layout.parse(spec) if spec else Layout()


def block_gemv_on() -> bool:
    """`SWARMD_BLOCK_GEMV=0` leaves these products to tinygrad's kernels (for side-by-side measurements)."""
    return os.environ.get("SWARMD_BLOCK_GEMV", "1") != "0"


def block_gemv_fits(x: Tensor, blocks: BlockQuantized, *, gathered: bool) -> bool:
    """Whether `block_gemv` runs for activations x (slots, rows, in) and these blocks, `gathered` by index or not."""
    if not (block_gemv_on() and cuda.arch(x.device) >= 70 and blocks.packed and all(isinstance(n, int) for n in x.shape)):
        return False
    slots, rows, width = x.shape
    out, per = blocks.shape[1] if blocks.shape else blocks.rows, layout()
    one_each = not blocks.shape or gathered or blocks.shape[0] == slots
    return (one_each and rows <= MAX_ROWS and width == blocks.cols and width % 32 == 0
            and out % (per.per_warp * per.warps) == 0)


def block_gemv(x: Tensor, blocks: BlockQuantized, idx: Tensor | None = None) -> Tensor:
    """x (slots, rows, in) times `blocks` -> float32 (slots, rows, out): with `idx`, slot s times matrix idx[s] of
    the stack; without, slot s times matrix s of a stack, or every slot times the one matrix. More than
    `KERNEL_ROWS` rows go in kernels of that many: a row's arithmetic is the same in any of them, so a request's
    row gets the same bits in a decode batch of any size (a verify step's rows included)."""
    from tinygrad import Tensor, dtypes

    slots, rows, width = x.shape
    if rows > KERNEL_ROWS:
        parts = [block_gemv(x[:, r:r + KERNEL_ROWS], blocks, idx) for r in range(0, rows, KERNEL_ROWS)]
        return parts[0].cat(*parts[1:], dim=1)
    out_features = blocks.shape[1] if blocks.shape else blocks.rows
    inputs = (x.cast(dtypes.float32), blocks.q, blocks.d, *([blocks.m] if blocks.m is not None else []),
              *([idx.cast(dtypes.int32)] if idx is not None else []))
    out = Tensor.empty(slots, rows, out_features, dtype=dtypes.float32, device=x.device)
    pick = "index" if idx is not None else "slot" if blocks.shape else "one"
    prog = _program(x.device, slots, rows, out_features, width, blocks.code_offset, blocks.m is not None, pick,
                    layout())
    return cuda.run(out, inputs, prog)


@functools.cache
def _program(device: str, slots: int, rows: int, out_features: int, width: int, offset: int, has_m: bool, pick: str,
             lay: Layout) -> UOp:
    name = (f"block_gemv_{slots}_{rows}_{out_features}_{width}" + ("_m" if has_m else f"_o{offset}")
            + {"index": "_g", "slot": "_s", "one": ""}[pick] + f"_{lay.tag}")
    matrices = 1 if pick == "one" else slots
    traffic = matrices * out_features * width * (10 if has_m else 9) // 16 + 4 * slots * rows * (width + out_features)
    return cuda.program(device, name, source(name, rows, out_features, width, offset, has_m, pick, lay),
                        grid=(out_features // (lay.per_warp * lay.warps), slots, 1), threads=32 * lay.warps,
                        buffers=4 + has_m + (pick == "index"), ops=2 * slots * rows * out_features * width, traffic=traffic)


def source(name: str, rows: int, out_features: int, width: int, offset: int, has_m: bool, pick: str,
           lay: Layout) -> str:
    """The kernel's CUDA source (its loop over blocks unrolled less the more rows and bytes a lane holds, within its
    registers); `pick`: how a slot's matrix is chosen ("index": idx[slot], "slot": matrix slot,
    "one": the one matrix)."""
    params = ["float* out", "const float* __restrict__ x", "const unsigned* __restrict__ q",
              "const half* __restrict__ d"]
    params += ["const half* __restrict__ m"] * has_m + ["const int* __restrict__ idx"] * (pick == "index")
    matrix = {"index": "idx[slot]", "slot": "slot", "one": "0"}[pick]
    return _SOURCE.format(NAME=name, PARAMS=", ".join(params), ROWS=rows, OUT=out_features, NB=width // 32,
                          OFF=float(offset), HAS_M=int(has_m), MATRIX=matrix, NR=lay.per_warp, WARPS=lay.warps,
                          WORDS=lay.lane_bytes // 4, UNROLL=max(1, (4 if rows <= 2 else 2) * 4 // lay.lane_bytes))


_SOURCE = r"""
#include <cuda_fp16.h>
#define ROWS {ROWS}
#define OUT {OUT}
#define NB {NB}
#define OFF {OFF}f
#define HAS_M {HAS_M}
#define NR {NR}
#define WARPS {WARPS}
#define WORDS {WORDS}
#define LPB (4 / WORDS)
#define BPI (32 / LPB)

template <int W> __device__ __forceinline__ void codes(unsigned* c, const unsigned* p);
template <> __device__ __forceinline__ void codes<1>(unsigned* c, const unsigned* p) {{ c[0] = __ldg(p); }}
template <> __device__ __forceinline__ void codes<2>(unsigned* c, const unsigned* p) {{
  const uint2 t = __ldg((const uint2*)p); c[0] = t.x; c[1] = t.y;
}}
template <> __device__ __forceinline__ void codes<4>(unsigned* c, const unsigned* p) {{
  const uint4 t = __ldg((const uint4*)p); c[0] = t.x; c[1] = t.y; c[2] = t.z; c[3] = t.w;
}}

extern "C" __global__ void __launch_bounds__(WARPS * 32) {NAME}({PARAMS}) {{
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = lane % LPB;
  const int slot = blockIdx.y, o0 = (blockIdx.x * WARPS + warp) * NR;
  const size_t row0 = (size_t)({MATRIX}) * OUT + o0;
  const float* xs = x + (size_t)slot * ROWS * NB * 32 + part * WORDS * 4;
  float acc[NR][ROWS];
  #pragma unroll
  for (int r = 0; r < NR; r++)
    #pragma unroll
    for (int i = 0; i < ROWS; i++) acc[r][i] = 0.f;

  #pragma unroll {UNROLL}
  for (int b = lane / LPB; b < NB; b += BPI) {{
    unsigned c[NR][WORDS];
    float sc[NR];
#if HAS_M
    float mm[NR];
#endif
    #pragma unroll
    for (int r = 0; r < NR; r++) {{
      codes<WORDS>(c[r], q + (row0 + r) * (NB * 4) + b * 4 + part * WORDS);
      sc[r] = __half2float(d[(row0 + r) * NB + b]);
#if HAS_M
      mm[r] = __half2float(m[(row0 + r) * NB + b]);
#endif
    }}
    #pragma unroll
    for (int i = 0; i < ROWS; i++) {{
      float s[NR], sx = 0.f;
      #pragma unroll
      for (int r = 0; r < NR; r++) s[r] = 0.f;
      #pragma unroll
      for (int k = 0; k < WORDS; k++) {{
        const float4 lo = __ldg((const float4*)(xs + i * NB * 32 + b * 32 + k * 4));
        const float4 hi = __ldg((const float4*)(xs + i * NB * 32 + b * 32 + k * 4 + 16));
#if HAS_M
        sx += ((lo.x + lo.y) + (lo.z + lo.w)) + ((hi.x + hi.y) + (hi.z + hi.w));
#endif
        #pragma unroll
        for (int r = 0; r < NR; r++) {{
          const unsigned v = c[r][k];
          float t = s[r];
          t = fmaf((float)(v & 15u) - OFF, lo.x, t);
          t = fmaf((float)((v >> 8) & 15u) - OFF, lo.y, t);
          t = fmaf((float)((v >> 16) & 15u) - OFF, lo.z, t);
          t = fmaf((float)((v >> 24) & 15u) - OFF, lo.w, t);
          t = fmaf((float)((v >> 4) & 15u) - OFF, hi.x, t);
          t = fmaf((float)((v >> 12) & 15u) - OFF, hi.y, t);
          t = fmaf((float)((v >> 20) & 15u) - OFF, hi.z, t);
          s[r] = fmaf((float)(v >> 28) - OFF, hi.w, t);
        }}
      }}
      #pragma unroll
      for (int r = 0; r < NR; r++) {{
        acc[r][i] = fmaf(s[r], sc[r], acc[r][i]);
#if HAS_M
        acc[r][i] = fmaf(mm[r], sx, acc[r][i]);
#endif
      }}
    }}
  }}

  #pragma unroll
  for (int r = 0; r < NR; r++)
    #pragma unroll
    for (int i = 0; i < ROWS; i++) {{
      float v = acc[r][i];
      #pragma unroll
      for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
      if (lane == (r * ROWS + i) % 32) out[((size_t)slot * ROWS + i) * OUT + o0 + r] = v;
    }}
}}
"""
