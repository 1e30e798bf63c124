"""The hand-written CPU product of rows with a matrix in GGML blocks (`models.kernels.cpu_gemv`): which
products take it, and that each row gets from it the bits tinygrad's one-row kernel gives that row alone, in float
and in ggml numerics, for each block format."""

import numpy as np
import pytest
from tinygrad import Tensor
from tinygrad.uop.ops import Ops

from models.kernels import ggml_numerics
from models.kernels.cpu_gemv import cpu_gemv
from models.kernels.matvec import matvec, tune_cpu_renderer
from models.kernels.quant import KERNEL_QUANT_TYPES, from_ggml_blocks

FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def random_blocks(rng: np.random.Generator, ggml_type: int, rows: int, width: int):
    """A (rows, width) matrix of raw GGML blocks with random codes and small scales (and offsets), on the CPU."""
    _, size = KERNEL_QUANT_TYPES[ggml_type]
    raw = rng.integers(0, 256, (rows, width // 32, size), dtype=np.uint8)
    for at in ((0, 2), (2, 4)) if ggml_type == 3 else ((0, 2),):
        values = rng.uniform(-0.02, 0.02, raw.shape[:2]).astype(np.float16)
        raw[..., at[0]:at[1]] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return from_ggml_blocks(raw.reshape(-1), ggml_type, (rows, width), "CPU").realize()


def programs(t: Tensor) -> list[str]:
    return [u.arg.name for u in t.uop.toposort() if u.op is Ops.PROGRAM]


def test_two_rows_or_more_on_the_cpu_take_the_hand_written_kernel(monkeypatch):
    blocks = random_blocks(np.random.default_rng(0), 3, 64, 256)

    def kernels(rows: int) -> list[str]:
        y = ggml_numerics.matvec(Tensor.empty(rows, 256, device="CPU"), blocks.dequantized(), blocks)
        return [n for n in programs(y) if n.startswith("cpu_gemv")]

    assert kernels(1) == []  # a lone row keeps tinygrad's kernel
    assert kernels(2) == ["cpu_gemv_q4_1_2_64_256"]
    assert kernels(8) == ["cpu_gemv_q4_1_8_64_256"]
    assert kernels(64) == ["cpu_gemv_q4_1_64_64_256"]  # a prompt's chunk: tiles of 8 rows in one kernel
    one_block = random_blocks(np.random.default_rng(1), 3, 64, 32)
    y = ggml_numerics.matvec(Tensor.empty(2, 32, device="CPU"), one_block.dequantized(), one_block)
    assert not any(n.startswith("cpu_gemv") for n in programs(y))  # tinygrad takes its one scale out of the sum
    monkeypatch.setenv("SWARMD_CPU_GEMV", "0")
    assert kernels(2) == []


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(192, 576), (64, 1536), (32, 64)], ids=["18-blocks", "48-blocks", "2-blocks"])
@pytest.mark.parametrize("rows", [2, 5, 8, 20])
def test_each_row_gets_the_bits_of_tinygrads_kernel_for_that_row_alone(fmt, shape, rows):
    tune_cpu_renderer("CPU")  # as a stage does: the one-row kernels' form on the CPU
    rng = np.random.default_rng(rows)
    blocks = random_blocks(rng, FORMATS[fmt], *shape)
    w = blocks.dequantized()
    x = Tensor(rng.standard_normal((rows, shape[1])).astype(np.float32)).realize()
    alone = np.stack([matvec(x[r:r + 1].contiguous(), w).numpy()[0] for r in range(rows)])
    together = cpu_gemv(x, blocks).numpy()
    assert np.array_equal(together, alone)
    # ggml numerics: 8-bit activations, and for Q4_1 the correction of Q8_1's block sums added after the product
    alone = np.stack([ggml_numerics.matvec(x[r:r + 1].contiguous(), w, blocks).numpy()[0] for r in range(rows)])
    together = ggml_numerics.matvec(x, w, blocks)
    assert any(n.startswith("cpu_gemv") for n in programs(together))
    assert np.array_equal(together.numpy(), alone)
