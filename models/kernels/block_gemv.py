"""A few rows times 4-bit GGML-block matrices (Q4_0, Q4_1), chosen per slot from a stack or one matrix, as a
hand-written CUDA kernel in tinygrad's graph: the decode step's product with a Kimi-class model's quantised weights.

x (slots, rows, in) float32; slot s multiplies matrix idx[s] of a stack, or matrix s of a stack of `slots` matrices
(a head's own matrix), or the one matrix; the result is float32 (slots, rows, out). A warp computes `per_warp` outputs
over its part of their rows: the `split` warps of a group share each row's blocks of 32 (so that a lone small
matrix still fills the GPU), and a thread block holds `warps / split` groups. Each lane reads `lane_bytes` of a
block's 16 bytes of codes (2 values a byte), so that a warp's loads of codes are whole 128-byte lines, and the
matching activations of each row once for all its outputs. A lane sums (code - offset) * x over its values of a
block, scales the sum by the block's scale (and adds Q4_1's offset times the activations' sum); the warp adds its
lanes' sums in a fixed tree, and the group its warps' sums in order. The split follows from the matrix's width and
whether it is one of a stack, so each output's sum runs in the same order whatever the slots, rows and matrices
around it. Two things a neighbouring kernel would do come inside: activations read where they lie (`Strided`: a
head's part of a fused projection's output) instead of a copy, and, with `glu`, a feed-forward's silu(gate) * up of
a matrix laid out [gate | up] (a warp's outputs are half gate rows, half the matching up rows).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
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
    """Outputs per warp, warps per block of threads, bytes of a block's codes each lane reads (4, 8 or 16), and
    warps sharing an output's row (0: `splits` of the row's width)."""

    per_warp: int = 4
    warps: int = 4
    lane_bytes: int = 8
    split: int = 0

    @staticmethod
    def parse(spec: str) -> Layout:
        """A layout from "per_warp,warps[,lane_bytes[,split]]"."""
        return Layout(*(int(v) for v in spec.split(",")))

    def splits(self, width: int, stacked: bool = False) -> int:
        """Warps sharing a row of `width` values: one for a stack's matrices (their slots fill the GPU), else up to
        all of a block's, while each still reads its lanes' codes four or more times."""
        if self.split or stacked:
            return self.split or 1
        per_line = 64 * self.lane_bytes  # the values a warp's lanes cover at once (2 a byte)
        split = self.warps
        while split > 1 and width < 4 * per_line * split:
            split //= 2
        return split

    def for_rows(self, width: int, stacked: bool = False) -> Layout:
        """This layout with its split fixed for rows of `width` values (of a stack's matrices or not)."""
        return replace(self, split=self.splits(width, stacked))

    @property
    def outputs(self) -> int:
        """The outputs a block of threads computes (of a layout `for_rows`)."""
        return self.per_warp * self.warps // self.split

    @property
    def tag(self) -> str:
        """The layout in a kernel's name (of a layout `for_rows`)."""
        return (f"{self.per_warp}x{self.warps}" + (f"b{self.lane_bytes}" if self.lane_bytes != 4 else "")
                + (f"k{self.split}" if self.split > 1 else ""))


def layout() -> Layout:
    """`SWARMD_BLOCK_GEMV_LAYOUT` ("per_warp,warps[,lane_bytes[,split]]", for searches), else the default."""
    spec = os.environ.get("SWARMD_BLOCK_GEMV_LAYOUT")
    return Layout.parse(spec) if spec else Layout()


def block_gemv_on() -> bool:
    """`SWARMD_BLOCK_GEMV=0` leaves these products to tinygrad's kernels (for side-by-side measurements)."""
    return os.environ.get("SWARMD_BLOCK_GEMV", "1") != "0"


def heads_in_place_on() -> bool:
    """`SWARMD_HEADS_IN_PLACE=0` copies a per-head product's input out first (`Strided`'s, side-by-side runs)."""
    return os.environ.get("SWARMD_HEADS_IN_PLACE", "1") != "0"


def glu_in_kernel_on() -> bool:
    """`SWARMD_GLU_IN_KERNEL=0` leaves a feed-forward's silu(gate) * up to a kernel of its own (side-by-side runs)."""
    return os.environ.get("SWARMD_GLU_IN_KERNEL", "1") != "0" and layout().per_warp % 2 == 0


def shared_in_experts_on() -> bool:
    """`SWARMD_SHARED_IN_EXPERTS=0` leaves a MoE block's shared expert to products of its own, its gate and up split
    over warps as any lone matrix's (side-by-side runs); by default it is laid out as a routed expert, and at a decode
    step of one row it is one more slot of the routed experts' products (`block_gemv`'s `extra`)."""
    return os.environ.get("SWARMD_SHARED_IN_EXPERTS", "1") != "0"


def block_gemv_fits(x: Tensor, blocks: BlockQuantized, *, gathered: bool, stacked: bool = False) -> bool:
    """Whether `block_gemv` runs for activations x (slots, rows, in) and these blocks, `gathered` by index or not
    (`stacked`: a lone matrix laid out as a stack's)."""
    return block_gemv_fits_shape(x.device, x.shape, blocks, gathered=gathered, stacked=stacked)


def block_gemv_fits_shape(device: str, shape: tuple, blocks: BlockQuantized, *, gathered: bool,
                          stacked: bool = False) -> bool:
    """`block_gemv_fits` for activations of `shape` (slots, rows, in) on `device`."""
    if not (block_gemv_on() and cuda.arch(device) >= 70 and blocks.packed and all(isinstance(n, int) for n in shape)):
        return False
    slots, rows, width = shape
    out = blocks.shape[1] if blocks.shape else blocks.rows
    per = layout().for_rows(width, bool(blocks.shape) or stacked)
    one_each = not blocks.shape or gathered or blocks.shape[0] == slots
    return (one_each and rows <= MAX_ROWS and width == blocks.cols and width % 32 == 0
            and per.warps % per.split == 0 and out % per.outputs == 0)


def extra_fits(blocks: BlockQuantized, extra: BlockQuantized) -> bool:
    """Whether `extra` can be one more slot of a gathered product with the stack `blocks`: a lone matrix of the
    stack's kind (codes, offsets) and of its matrices' shape."""
    return (blocks.shape is not None and not extra.shape and extra.kind == blocks.kind
            and (extra.rows, extra.cols) == tuple(blocks.shape[1:]))


@dataclass(frozen=True)
class Strided:
    """Activations of `shape` (slots, rows, in) read where they lie: slot s's row r starts `slot` floats after slot
    s - 1's and `row` floats after row r - 1's, in a buffer `base` (a head's query values in a fused projection's
    output, each head's a part of a row). The kernel reads them where both strides are multiples of 4 (`aligned`:
    its loads are 16 bytes)."""

    base: Tensor
    slot: int
    row: int
    shape: tuple[int, int, int]

    @property
    def aligned(self) -> bool:
        return self.slot % 4 == 0 and self.row % 4 == 0


def block_gemv(x: Tensor | Strided, blocks: BlockQuantized, idx: Tensor | None = None, *, share: int = 1,
               glu: bool = False, stacked: bool = False, extra: BlockQuantized | None = None,
               extra_x: int = 0) -> Tensor:
    """x (slots, rows, in) times `blocks` -> float32 (slots, rows, out): with `idx`, slot s times matrix idx[s] of
    the stack; without, slot s times matrix s of a stack, or every slot times the one matrix. With `share`, x holds
    slots / share slots, each read by `share` consecutive slots of idx (a row's chosen experts); x `Strided`: its
    values where they lie. With `glu` the matrices are [gate | up] and the result is
    silu(gate) * up (slots, rows, out / 2). More than `KERNEL_ROWS` rows go in kernels of that many: a row's
    arithmetic is the same in any of them, so a request's row gets the same bits in a decode batch of any size (a
    verify step's rows included). `stacked`: the one matrix's outputs are summed as a stack's (`extra`'s bits).
    `extra` (with `idx`, one row a slot): a lone matrix laid out as the stack's, times x's slot `extra_x` in one
    more slot after idx's (a MoE block's shared expert beside its routed ones), with the bits of its own product
    `stacked`."""
    from tinygrad import Tensor, dtypes

    x_slots, rows, width = x.shape
    if rows > KERNEL_ROWS:
        assert extra is None, "a further matrix's slot takes one row"

        def rows_of(r: int) -> Tensor | Strided:
            if isinstance(x, Strided):
                return replace(x, base=x.base.reshape(-1)[r * x.row:], shape=(x_slots, min(KERNEL_ROWS, rows - r), width))
            return x[:, r:r + KERNEL_ROWS]

        parts = [block_gemv(rows_of(r), blocks, idx, share=share, glu=glu, stacked=stacked)
                 for r in range(0, rows, KERNEL_ROWS)]
        return parts[0].cat(*parts[1:], dim=1)
    assert share == 1 or idx is not None, "slots share their rows only when gathered by index"
    assert not isinstance(x, Strided) or x.aligned, "strided activations are read 16 bytes at a time"
    assert not glu or layout().per_warp % 2 == 0, "a gated product's warps take pairs of gate and up rows"
    assert extra is None or (idx is not None and rows == 1 and extra_fits(blocks, extra))
    slots = idx.shape[0] + 1 if extra is not None else x_slots * share
    out_features = blocks.shape[1] if blocks.shape else blocks.rows
    strides = (x.slot, x.row) if isinstance(x, Strided) else None
    inputs = ((x.base if isinstance(x, Strided) else x).cast(dtypes.float32), blocks.q, blocks.d,
              *([blocks.m] if blocks.m is not None else []), *([idx.cast(dtypes.int32)] if idx is not None else []),
              *(extra.buffers() if extra is not None else []))
    out = Tensor.empty(slots, rows, out_features // (1 + glu), dtype=dtypes.float32, device=blocks.q.device)
    pick = "index" if idx is not None else "slot" if blocks.shape else "one"
    prog = _program(blocks.q.device, slots, rows, out_features, width, blocks.code_offset, blocks.m is not None, pick,
                    layout().for_rows(width, pick != "one" or stacked), share, strides, glu,
                    None if extra is None else extra_x)
    return cuda.run(out, inputs, prog)


@functools.cache
def _program(device: str, slots: int, rows: int, out_features: int, width: int, offset: int, has_m: bool, pick: str,
             lay: Layout, share: int = 1, strides: tuple[int, int] | None = None, glu: bool = False,
             extra_x: int | None = None) -> UOp:
    name = (f"block_gemv_{slots}_{rows}_{out_features}_{width}" + ("_m" if has_m else f"_o{offset}")
            + {"index": "_g", "slot": "_s", "one": ""}[pick] + (f"_x{share}" if share > 1 else "")
            + ("_glu" if glu else "") + (f"_v{strides[0]}_{strides[1]}" if strides else "")
            + (f"_e{extra_x}" if extra_x is not None else "") + f"_{lay.tag}")
    matrices = 1 if pick == "one" else slots
    traffic = (matrices * out_features * width * (10 if has_m else 9) // 16
               + 4 * slots * rows * (width // share + out_features // (1 + glu)))
    return cuda.program(device, name, source(name, rows, out_features, width, offset, has_m, pick, lay, share,
                                             strides, glu, extra_x),
                        grid=(out_features // lay.outputs, slots, 1), threads=32 * lay.warps,
                        buffers=4 + has_m + (pick == "index") + (extra_x is not None) * (2 + has_m),
                        ops=2 * slots * rows * out_features * width,
                        traffic=traffic)


def source(name: str, rows: int, out_features: int, width: int, offset: int, has_m: bool, pick: str,
           lay: Layout, share: int = 1, strides: tuple[int, int] | None = None, glu: bool = False,
           extra_x: int | None = None) -> str:
    """The kernel's CUDA source (its loop over blocks unrolled less the more rows and bytes a lane holds, within its
    registers); `pick`: how a slot's matrix is chosen ("index": idx[slot], "slot": matrix slot,
    "one": the one matrix); `share`: slots that read each slot of x; `strides`: x's (slot, row) strides in floats
    (None: a contiguous x's); `glu`: silu(gate) * up out; `extra_x`: the last slot multiplies a further matrix
    (its buffers after idx) by x's slot `extra_x`."""
    lay = lay.for_rows(width, pick != "one")  # (a layout with its split fixed keeps it)
    params = ["float* out", "const float* __restrict__ x", "const unsigned* __restrict__ q",
              "const half* __restrict__ d"]
    params += ["const half* __restrict__ m"] * has_m + ["const int* __restrict__ idx"] * (pick == "index")
    if extra_x is not None:
        params += ["const unsigned* __restrict__ q2", "const half* __restrict__ d2"]
        params += ["const half* __restrict__ m2"] * has_m
    matrix = {"index": "idx[slot]", "slot": "slot", "one": "0"}[pick]
    slot_stride, row_stride = strides or (rows * width, width)
    return _SOURCE.format(NAME=name, PARAMS=", ".join(params), ROWS=rows, OUT=out_features, NB=width // 32,
                          OFF=float(offset), HAS_M=int(has_m), GLU=int(glu), MATRIX=matrix, NR=lay.per_warp,
                          WARPS=lay.warps, SPLIT=lay.split, SHARE=share, XS=slot_stride, XR=row_stride,
                          WORDS=lay.lane_bytes // 4, EXTRA=int(extra_x is not None), XE=extra_x or 0,
                          UNROLL=max(1, (4 if rows <= 2 else 2) * 4 // lay.lane_bytes),
                          # 8 rows of warps sharing them: three blocks of threads an SM (ptxas would take 128 registers
                          # a thread and spill)
                          BOUNDS="WARPS * 32" + (", 3" if rows >= KERNEL_ROWS and lay.split > 1 else ""))


_SOURCE = r"""
#include <cuda_fp16.h>
#define ROWS {ROWS}
#define OUT {OUT}
#define NB {NB}
#define OFF {OFF}f
#define HAS_M {HAS_M}
#define XS {XS}
#define XR {XR}
#define GLU {GLU}
#define NR {NR}
#if GLU
// a warp's outputs: NR / 2 gate rows, then the matching up rows (OUT / 2 rows further); silu(g) = g * sigmoid(g),
// the sigmoid through exp2 as tinygrad writes it
#define OUTS (NR / 2)
#define ROW_OF(r) ((r) < OUTS ? (r) : (r) - OUTS + OUT / 2)
#define GATED(g, u) ((g) * (1.f / (1.f + exp2f((g) * -1.4426950408889634f))) * (u))
#else
#define OUTS NR
#define ROW_OF(r) (r)
#endif
#define WARPS {WARPS}
#define WORDS {WORDS}
#define SPLIT {SPLIT}
#define SHARE {SHARE}
#define LPB (4 / WORDS)
#define BPI (32 / LPB)
#define EXTRA {EXTRA}
// byte k of w (a code, 0-15) minus the offset, exactly: the byte as the low bits of 2^23's float, less 2^23 + offset
// (no integer-to-float conversion, which runs at a quarter of the float rate)
#define CODE(w, k) (__int_as_float(__byte_perm((w), 0x4B000000u, 0x7540u + (k))) - (8388608.0f + OFF))

template <int W> __device__ __forceinline__ void codes(unsigned* c, const unsigned* p);
template <> __device__ __forceinline__ void codes<1>(unsigned* c, const unsigned* p) {{ c[0] = __ldg(p); }}
template <> __device__ __forceinline__ void codes<2>(unsigned* c, const unsigned* p) {{
  const uint2 t = __ldg((const uint2*)p); c[0] = t.x; c[1] = t.y;
}}
template <> __device__ __forceinline__ void codes<4>(unsigned* c, const unsigned* p) {{
  const uint4 t = __ldg((const uint4*)p); c[0] = t.x; c[1] = t.y; c[2] = t.z; c[3] = t.w;
}}

extern "C" __global__ void __launch_bounds__({BOUNDS}) {NAME}({PARAMS}) {{
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = lane % LPB;
  const int group = warp / SPLIT, share = warp % SPLIT;
  const int slot = blockIdx.y, o0 = (blockIdx.x * (WARPS / SPLIT) + group) * OUTS;
#if EXTRA
  // the last slot: the further matrix (q2, d2, m2) times x's slot XE
  const bool further = slot == gridDim.y - 1;
  const unsigned* qm = further ? q2 : q;
  const half* dm = further ? d2 : d;
#if HAS_M
  const half* mp = further ? m2 : m;
#endif
  const size_t row0 = (size_t)(further ? 0 : {MATRIX}) * OUT + o0;
  const float* xs = x + (size_t)(further ? {XE} : slot / SHARE) * XS + part * WORDS * 4;
#else
  const unsigned* qm = q;
  const half* dm = d;
#if HAS_M
  const half* mp = m;
#endif
  const size_t row0 = (size_t)({MATRIX}) * OUT + o0;
  const float* xs = x + (size_t)(slot / SHARE) * XS + part * WORDS * 4;
#endif
  float acc[NR][ROWS];
  #pragma unroll
  for (int r = 0; r < NR; r++)
    #pragma unroll
    for (int i = 0; i < ROWS; i++) acc[r][i] = 0.f;

  #pragma unroll {UNROLL}
  for (int b = share * BPI + lane / LPB; b < NB; b += BPI * SPLIT) {{
    unsigned c[NR][WORDS];
    float sc[NR];
#if HAS_M
    float mm[NR];
#endif
    #pragma unroll
    for (int r = 0; r < NR; r++) {{
      codes<WORDS>(c[r], qm + (row0 + ROW_OF(r)) * (NB * 4) + b * 4 + part * WORDS);
      sc[r] = __half2float(dm[(row0 + ROW_OF(r)) * NB + b]);
#if HAS_M
      mm[r] = __half2float(mp[(row0 + ROW_OF(r)) * NB + b]);
#endif
    }}
    #pragma unroll
    for (int i = 0; i < ROWS; i++) {{
      float s[NR], sx = 0.f;
      #pragma unroll
      for (int r = 0; r < NR; r++) s[r] = 0.f;
      #pragma unroll
      for (int k = 0; k < WORDS; k++) {{
        const float4 lo = __ldg((const float4*)(xs + i * XR + b * 32 + k * 4));
        const float4 hi = __ldg((const float4*)(xs + i * XR + b * 32 + k * 4 + 16));
#if HAS_M
        sx += ((lo.x + lo.y) + (lo.z + lo.w)) + ((hi.x + hi.y) + (hi.z + hi.w));
#endif
        #pragma unroll
        for (int r = 0; r < NR; r++) {{
          const unsigned lo4 = c[r][k] & 0x0F0F0F0Fu, hi4 = (c[r][k] >> 4) & 0x0F0F0F0Fu;
          float t = s[r];
          t = fmaf(CODE(lo4, 0), lo.x, t);
          t = fmaf(CODE(lo4, 1), lo.y, t);
          t = fmaf(CODE(lo4, 2), lo.z, t);
          t = fmaf(CODE(lo4, 3), lo.w, t);
          t = fmaf(CODE(hi4, 0), hi.x, t);
          t = fmaf(CODE(hi4, 1), hi.y, t);
          t = fmaf(CODE(hi4, 2), hi.z, t);
          s[r] = fmaf(CODE(hi4, 3), hi.w, t);
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

#if SPLIT > 1
  __shared__ float parts[WARPS][NR * ROWS];
#endif
  #pragma unroll
  for (int r = 0; r < NR; r++)
    #pragma unroll
    for (int i = 0; i < ROWS; i++) {{
      float v = acc[r][i];
      #pragma unroll
      for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
#if SPLIT > 1
      if (lane == (r * ROWS + i) % 32) parts[warp][r * ROWS + i] = v;
#elif GLU
      acc[r][i] = v;  // every lane holds the sum
#else
      if (lane == (r * ROWS + i) % 32) out[((size_t)slot * ROWS + i) * OUT + o0 + r] = v;
#endif
    }}
#if SPLIT == 1 && GLU
  #pragma unroll
  for (int r = 0; r < OUTS; r++)
    #pragma unroll
    for (int i = 0; i < ROWS; i++)
      if (lane == (r * ROWS + i) % 32) out[((size_t)slot * ROWS + i) * (OUT / 2) + o0 + r] = GATED(acc[r][i], acc[r + OUTS][i]);
#endif
#if SPLIT > 1
  __syncthreads();
  if (share == 0)
    for (int j = lane; j < OUTS * ROWS; j += 32) {{
      float v = parts[warp][j];
      #pragma unroll
      for (int w = 1; w < SPLIT; w++) v += parts[warp + w][j];
#if GLU
      float u = parts[warp][j + OUTS * ROWS];
      #pragma unroll
      for (int w = 1; w < SPLIT; w++) u += parts[warp + w][j + OUTS * ROWS];
      out[((size_t)slot * ROWS + j % ROWS) * (OUT / 2) + o0 + j / ROWS] = GATED(v, u);
#else
      out[((size_t)slot * ROWS + j % ROWS) * OUT + o0 + j / ROWS] = v;
#endif
    }}
#endif
}}
"""
