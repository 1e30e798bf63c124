"""Rows (a verify step, a decode batch, a prompt's chunk) times a matrix in GGML blocks as one hand-written C kernel
on the CPU, each block's weights decoded once for up to `TILE_ROWS` rows.

tinygrad's kernel for such a product loops over the rows outside its reduction, so it decodes every weight again
for each row (and clang does not vectorise its code for rows kept side by side): a step of a few rows cost nearly
as many one-row steps. Here a block's 32 weights are decoded into registers and then multiplied by each row of a
tile. Each row's arithmetic is that of `models.kernels.matvec`'s one-row kernel: 16 partial sums (lane j takes the
values j and j + 16 of every block, in order), each product added by a multiply-add, the partial sums added left
to right; so a row of a verify step, a batch or a chunk gets the bits tinygrad's kernels give it (tested).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp

    from models.kernels.quant import BlockQuantized

TILE_ROWS = 8  # rows that take each decoded block in turn (their sums in registers)


def cpu_gemv_on() -> bool:
    """`SWARMD_CPU_GEMV=0` leaves these products to tinygrad's kernels (for side-by-side measurements)."""
    return os.environ.get("SWARMD_CPU_GEMV", "1") != "0"


def cpu_gemv_fits(x: Tensor, blocks: BlockQuantized) -> bool:
    """Whether `cpu_gemv` runs for activations x (rows, in) and these blocks: two rows or more (a lone row is no
    faster here than in tinygrad's kernel), on the CPU, a single matrix of two blocks a row or more (with one,
    tinygrad takes a scale that is the same for the whole sum out of it: other bits)."""
    rows, width = x.shape
    return (cpu_gemv_on() and x.device.split(":")[0] == "CPU" and isinstance(rows, int) and rows >= 2
            and blocks.shape is None and width == blocks.cols and width >= 64)


def cpu_gemv(x: Tensor, blocks: BlockQuantized) -> Tensor:
    """x (rows, in) times `blocks` (out, in) transposed -> float32 (rows, out)."""
    from tinygrad import Tensor, dtypes

    from models.kernels import cuda
    from models.kernels.matvec import cpu_threads

    rows, width = x.shape
    out = Tensor.empty(rows, blocks.rows, dtype=dtypes.float32, device=x.device)
    inputs = (blocks.q, blocks.d, *([blocks.m] if blocks.m is not None else []), x.cast(dtypes.float32))
    prog = _program(x.device, rows, blocks.rows, width, blocks.packed, blocks.m is not None, blocks.code_offset,
                    cpu_threads(blocks.rows))
    return cuda.run(out, inputs, prog)


@functools.cache
def _program(device: str, rows: int, out_features: int, width: int, packed: bool, has_m: bool, offset: int,
             n_threads: int) -> UOp:
    from models.kernels import cpu

    kind = "q4_1" if has_m else "q4_0" if packed else "q8_0"
    name = f"cpu_gemv_{kind}_{rows}_{out_features}_{width}"
    code_bytes = out_features * width // (2 if packed else 1)
    traffic = code_bytes + out_features * width // 32 * (4 if has_m else 2) + 4 * rows * (width + out_features)
    return cpu.program(device, name, source(name, rows, out_features, width, packed, has_m, offset, n_threads),
                       threads=n_threads, buffers=4 + has_m, ops=2 * rows * out_features * width, traffic=traffic)


def source(name: str, rows: int, out_features: int, width: int, packed: bool, has_m: bool, offset: int,
           n_threads: int) -> str:
    """The kernel's C source: thread `core_id` computes its share of the outputs, for every row (clang's vector
    extensions: 16 lanes, whatever the machine's vector width)."""
    if packed:
        codes = ("u8x16 qv; __builtin_memcpy(&qv, qb, 16);\n"
                 "        const f32x16 lo = __builtin_convertvector(qv & (unsigned char)15, f32x16);\n"
                 "        const f32x16 hi = __builtin_convertvector(qv >> (unsigned char)4, f32x16);")
    else:
        codes = ("i8x16 q0, q1; __builtin_memcpy(&q0, qb, 16); __builtin_memcpy(&q1, qb + 16, 16);\n"
                 "        const f32x16 lo = __builtin_convertvector(q0, f32x16);\n"
                 "        const f32x16 hi = __builtin_convertvector(q1, f32x16);")

    def weight(c: str) -> str:
        return f"{c} * dd + mm" if has_m else f"({c} - {float(offset)!r}f) * dd" if offset else f"{c} * dd"

    return _SOURCE.format(NAME=name, ROWS=rows, OUT=out_features, COLS=width, NB=width // 32,
                          QB=16 if packed else 32, PER=out_features // n_threads, TILE=min(rows, TILE_ROWS),
                          CODES=codes, W_LO=weight("lo"), W_HI=weight("hi"),
                          M_ARG="const __fp16* restrict m, " if has_m else "",
                          M_LOAD="const float mm = (float)m[o * NB + b];" if has_m else "")


_SOURCE = r"""
#define ROWS {ROWS}
#define OUT {OUT}
#define COLS {COLS}
#define NB {NB}
#define QB {QB}
#define PER {PER}
#define TILE {TILE}
typedef float f32x16 __attribute__((vector_size(64)));
typedef unsigned char u8x16 __attribute__((vector_size(16)));
typedef signed char i8x16 __attribute__((vector_size(16)));

void {NAME}(float* restrict out, const unsigned char* restrict q, const __fp16* restrict d, {M_ARG}const float* restrict x,
            const int core_id) {{
  for (int o = core_id * PER; o < (core_id + 1) * PER; o++) {{
    for (int r0 = 0; r0 < ROWS; r0 += TILE) {{
      f32x16 acc[TILE];
      for (int r = 0; r < TILE; r++) acc[r] = (f32x16){{0}};
      for (int b = 0; b < NB; b++) {{
        const unsigned char* qb = q + ((long)o * NB + b) * QB;
        const float dd = (float)d[o * NB + b];
        {M_LOAD}
        {CODES}
        const f32x16 w_lo = {W_LO}, w_hi = {W_HI};
        for (int r = 0; r < TILE && r0 + r < ROWS; r++) {{
          f32x16 x_lo, x_hi;
          __builtin_memcpy(&x_lo, x + (r0 + r) * COLS + b * 32, 64);
          __builtin_memcpy(&x_hi, x + (r0 + r) * COLS + b * 32 + 16, 64);
          acc[r] = acc[r] + w_lo * x_lo;
          acc[r] = acc[r] + w_hi * x_hi;
        }}
      }}
      for (int r = 0; r < TILE && r0 + r < ROWS; r++) {{
        float s = acc[r][0];
        for (int j = 1; j < 16; j++) s = s + acc[r][j];
        out[(r0 + r) * OUT + o] = s;
      }}
    }}
  }}
}}
"""
