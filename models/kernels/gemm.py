"""A float16 matrix-matrix product on NVIDIA tensor cores, as a hand-written CUDA kernel in tinygrad's graph.

x (rows, in) @ w.T for a weight matrix w (out, in): both operands float16 and contiguous along `in`, the sums in
float32, the result float32 (rows, out). tinygrad's own tensor-core kernels load each operand tile from global
memory straight into registers; this one stages tiles of both operands in shared memory through `cp.async`, several
tiles ahead of the products, and feeds the `mma.sync` tiles from there with `ldmatrix`. It enters a graph as a
compiled program (`Tensor.custom_kernel`), so a captured step runs it like any other kernel.

It runs on tinygrad's CUDA and NV devices (compute capability 8.0 and up), for `in` a multiple of the tile's depth
(times the reduction's parts) and `out` of its width; `gemm_fits` says when. Rows need no padding: a tile's rows past
the last read zeros and are not written.
"""

from __future__ import annotations

import functools
import os
from dataclasses import astuple, dataclass, replace
from typing import TYPE_CHECKING

from models.kernels import cuda
from models.kernels.cuda import STATIC_SHARED_BYTES

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp


@dataclass(frozen=True)
class Tiling:
    """One block computes bm x bn outputs with warps_m x warps_n warps, over `in` in steps of bk, staging `stages`
    steps of both operands in shared memory. With `split` > 1 the reduction goes in that many parts, each a block
    of its own writing a float32 partial product, summed by a second kernel: a product of few rows then still
    spreads its weight reads over the whole GPU."""

    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    stages: int
    split: int = 1

    @staticmethod
    def parse(spec: str) -> Tiling:
        """A tiling from "bm,bn,bk,warps_m,warps_n,stages[,split]"."""
        return Tiling(*(int(v) for v in spec.split(",")))

    @property
    def spec(self) -> str:
        """The tiling as `parse` reads it."""
        return ",".join(str(v) for v in astuple(self))

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def shared_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * self.bk * 2

    def valid(self) -> bool:
        wm, wn = self.bm // self.warps_m, self.bn // self.warps_n
        return (self.bk in (32, 64) and wm % 16 == 0 and wn % 16 == 0 and wm * self.warps_m == self.bm
                and wn * self.warps_n == self.bn and self.stages >= 2
                and self.shared_bytes <= STATIC_SHARED_BYTES)


# The fastest of those timed on an H200 for Llama-3.1-8B's products (scripts/bench_gemm.py; docs/BENCHMARKS.md): for a
# prompt chunk (512 rows), and for a decode batch (32 rows), whose weight reads need the reduction split to fill the
# GPU where the outputs are few: in up to 8 parts, as many as keep tiles of outputs times parts within BATCH_BLOCKS.
CHUNK_TILING = Tiling(bm=64, bn=128, bk=64, warps_m=2, warps_n=2, stages=2)
BATCH_TILING = Tiling(bm=32, bn=64, bk=64, warps_m=1, warps_n=2, stages=3)
BATCH_BLOCKS = 512
CHUNK_ROWS = 64  # from here a product takes CHUNK_TILING


def tiling(rows: int, out_features: int, in_features: int) -> Tiling:
    """`SWARMD_GEMM_TILING` ("bm,bn,bk,warps_m,warps_n,stages[,split]", for searches), else the tiling for this
    many rows and a matrix of this shape."""
    if spec := os.environ.get("SWARMD_GEMM_TILING"):
        return Tiling.parse(spec)
    if rows >= CHUNK_ROWS:
        return CHUNK_TILING
    t, split = BATCH_TILING, 8
    while split > 1 and (out_features // t.bn * split > BATCH_BLOCKS or in_features % (t.bk * split)):
        split //= 2
    return replace(t, split=split)


def gemm_on() -> bool:
    """`SWARMD_GEMM=0` leaves every product to tinygrad's own kernels (for side-by-side measurements)."""
    return os.environ.get("SWARMD_GEMM", "1") != "0"


def gemm_min_rows() -> int:
    """`SWARMD_GEMM_MIN_ROWS`: fewer rows keep tinygrad's kernels (64 does so for decode batches, for side-by-side
    measurements). By default every product `tensor_core_matmul` is given may take `gemm`."""
    return int(os.environ.get("SWARMD_GEMM_MIN_ROWS") or 0)


def gemm_fits(device: str, rows: int, out_features: int, in_features: int, t: Tiling | None = None) -> bool:
    """Whether `gemm` runs on this device for this many rows and a matrix of this shape."""
    t = t or tiling(rows, out_features, in_features)
    return (gemm_on() and rows >= gemm_min_rows() and cuda.arch(device) >= 80 and t.valid() and out_features % t.bn == 0
            and in_features % (t.bk * t.split) == 0)


def gemm(x: Tensor, w: Tensor, t: Tiling | None = None) -> Tensor:
    """x (rows, in) @ w.T with x and w float16, w (out, in) a contiguous buffer: float32 (rows, out)."""
    from tinygrad import Tensor, dtypes

    rows, width = x.shape
    out_features = w.shape[0]
    t = t or tiling(rows, out_features, width)
    assert x.dtype == w.dtype == dtypes.float16 and w.shape[1] == width, (x.dtype, w.dtype, x.shape, w.shape)
    out = Tensor.empty(t.split, rows, out_features, dtype=dtypes.float32, device=x.device)
    parts = cuda.run(out, (x, w), _program(x.device, rows, out_features, width, t))
    return parts[0] if t.split == 1 else parts.sum(0)


@functools.cache
def _program(device: str, rows: int, out_features: int, width: int, t: Tiling) -> UOp:
    name = f"gemm_{rows}_{out_features}_{width}_{t.bm}x{t.bn}x{t.bk}w{t.warps_m}x{t.warps_n}s{t.stages}" + (
        f"p{t.split}" if t.split > 1 else "")
    traffic = 2 * (rows * width + out_features * width) + 4 * rows * out_features * t.split
    return cuda.program(device, name, source(name, rows, out_features, width, t),
                        grid=(-(-rows // t.bm), out_features // t.bn, t.split), threads=t.threads, buffers=3,
                        ops=2 * rows * out_features * width, traffic=traffic)


def source(name: str, rows: int, out_features: int, width: int, t: Tiling) -> str:
    """The kernel's CUDA source. Shared memory holds each operand tile as rows of bk halves in 16-byte chunks,
    chunk c of row r at c ^ (r & 7) (rows of 8 chunks) or c ^ ((r >> 1) & 3) (rows of 4): the eight rows an
    `ldmatrix` reads then sit in distinct banks."""
    chunks = t.bk // 8
    swizzle = "(r & 7)" if chunks == 8 else "((r >> 1) & 3)"
    return _SOURCE.format(NAME=name, M=rows, N=out_features, K=width, SPLIT=t.split, BM=t.bm, BN=t.bn, BK=t.bk, CH=chunks,
                          SWIZZLE=swizzle, WARPS_N=t.warps_n, THREADS=t.threads, STAGES=t.stages,
                          MI=t.bm // t.warps_m // 16, NI=t.bn // t.warps_n // 8)


_SOURCE = r"""
#include <cuda_fp16.h>
#define M_ {M}
#define N_ {N}
#define K_ {K}
#define SPLIT {SPLIT}
#define BM {BM}
#define BN {BN}
#define BK {BK}
#define CH {CH}
#define STAGES {STAGES}
#define THREADS {THREADS}
#define MI {MI}
#define NI {NI}
#define WM (MI * 16)
#define WN (NI * 8)

__device__ __forceinline__ int chunk_at(int r, int c) {{ return r * CH + (c ^ {SWIZZLE}); }}
__device__ __forceinline__ void copy16(uint4* dst, const half* src, bool pred) {{
  unsigned a = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(a), "l"(src), "r"(pred ? 16 : 0));
}}
__device__ __forceinline__ void ldmatrix4(unsigned* r, const uint4* p) {{
  unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0,%1,%2,%3}}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}}
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b) {{
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}}

extern "C" __global__ void __launch_bounds__(THREADS, 2) {NAME}(float* out, const half* x, const half* w) {{
  __shared__ __align__(128) uint4 smem[STAGES * (BM + BN) * CH];
  uint4* const xs = smem;                    // [STAGES][BM * CH]
  uint4* const ws = smem + STAGES * BM * CH;  // [STAGES][BN * CH]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / {WARPS_N}, wn = warp % {WARPS_N};
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;

  auto load = [&](int kt, int s) {{
    const int k0 = blockIdx.z * (K_ / SPLIT) + kt * BK;
    #pragma unroll
    for (int i = tid; i < BM * CH; i += THREADS) {{
      const int r = i / CH, c = i % CH, row = m0 + r;
      copy16(xs + s * BM * CH + chunk_at(r, c), x + (size_t)(row < M_ ? row : 0) * K_ + k0 + c * 8, row < M_);
    }}
    #pragma unroll
    for (int i = tid; i < BN * CH; i += THREADS) {{
      const int r = i / CH, c = i % CH;
      copy16(ws + s * BN * CH + chunk_at(r, c), w + (size_t)(n0 + r) * K_ + k0 + c * 8, true);
    }}
  }};

  float acc[MI][NI][4];
  #pragma unroll
  for (int i = 0; i < MI; i++)
    #pragma unroll
    for (int j = 0; j < NI; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

  constexpr int KT = K_ / SPLIT / BK;
  out += (size_t)blockIdx.z * M_ * N_;
  #pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {{
    if (s < KT) load(s, s);
    asm volatile("cp.async.commit_group;");
  }}
  for (int kt = 0; kt < KT; kt++) {{
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2));
    __syncthreads();
    if (kt + STAGES - 1 < KT) load(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
    asm volatile("cp.async.commit_group;");
    const int s = kt % STAGES;
    #pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {{
      unsigned a[MI][4], b[NI][2];
      #pragma unroll
      for (int i = 0; i < MI; i++)
        ldmatrix4(a[i], xs + s * BM * CH + chunk_at(wm * WM + i * 16 + (lane & 15), kk * 2 + (lane >> 4)));
      #pragma unroll
      for (int j = 0; j < NI; j += 2) {{
        unsigned r[4];
        ldmatrix4(r, ws + s * BN * CH + chunk_at(wn * WN + j * 8 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
        b[j][0] = r[0]; b[j][1] = r[1]; b[j + 1][0] = r[2]; b[j + 1][1] = r[3];
      }}
      #pragma unroll
      for (int i = 0; i < MI; i++)
        #pragma unroll
        for (int j = 0; j < NI; j++) mma16816(acc[i][j], a[i], b[j]);
    }}
  }}

  const int g = lane >> 2, q = lane & 3;
  #pragma unroll
  for (int i = 0; i < MI; i++) {{
    const int r0 = m0 + wm * WM + i * 16 + g;
    #pragma unroll
    for (int j = 0; j < NI; j++) {{
      const int c = n0 + wn * WN + j * 8 + q * 2;
      if (r0 < M_) *(float2*)(out + (size_t)r0 * N_ + c) = make_float2(acc[i][j][0], acc[i][j][1]);
      if (r0 + 8 < M_) *(float2*)(out + (size_t)(r0 + 8) * N_ + c) = make_float2(acc[i][j][2], acc[i][j][3]);
    }}
  }}
}}
"""
