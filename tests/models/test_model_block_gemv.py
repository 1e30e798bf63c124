"""The hand-written product with 4-bit GGML blocks (`models.kernels.block_gemv`): which products take it, that its
CUDA source builds for a Hopper GPU without spilling registers, and, on an NVIDIA GPU, that it is the product of the
dequantised weights, gathered by index or not, whatever the slots and rows around an output."""


import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tinygrad import Device, Tensor
from tinygrad.uop.ops import Ops

from models.kernels import cuda
from models.kernels.block_gemv import Layout, Strided, block_gemv, source
from models.kernels.gathered import block_matvec
from models.kernels.quant import from_ggml_blocks
from tests.models.sm90 import built_without_spills, needs_nvcc

ON_NVIDIA = cuda.arch(Device.DEFAULT) >= 70


def random_blocks(rng: np.random.Generator, rows: int, width: int, q4_1: bool) -> np.ndarray:
    """Raw Q4_0 (or Q4_1) blocks (rows, width / 32, bytes): random codes, small scales (and offsets)."""
    raw = rng.integers(0, 256, (rows, width // 32, 20 if q4_1 else 18), dtype=np.uint8)
    for at in ((0, 2), (2, 4)) if q4_1 else ((0, 2),):
        values = rng.uniform(0.002, 0.02, raw.shape[:2]).astype(np.float16)
        raw[..., at[0]:at[1]] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw


def dequantized(raw: np.ndarray, q4_1: bool) -> np.ndarray:
    kind = GGMLQuantizationType.Q4_1 if q4_1 else GGMLQuantizationType.Q4_0
    return dequantize(raw.reshape(raw.shape[0], -1), kind).astype(np.float64)


def programs(t: Tensor) -> list[str]:
    return [u.arg.name for u in t.uop.toposort() if u.op is Ops.PROGRAM]


def test_decode_products_with_4_bit_blocks_take_the_hand_written_kernel_on_nvidia_gpus(monkeypatch):
    monkeypatch.setattr(cuda, "arch", lambda device: 90 if device == "NULL" else 0)
    raw = random_blocks(np.random.default_rng(0), 16 * 64, 256, q4_1=False)
    stack = from_ggml_blocks(raw, 2, (16, 64, 256), "NULL")
    idx = Tensor([3, 5], device="NULL")

    def kernels(rows: int, slots: int = 2) -> list[str]:
        return [n for n in programs(block_matvec(Tensor.empty(slots, rows, 256, device="NULL"), stack, idx))
                if n.startswith("block_gemv")]

    assert kernels(1) == ["block_gemv_2_1_64_256_o8_g_4x4b8"]
    assert kernels(8) == ["block_gemv_2_8_64_256_o8_g_4x4b8"]
    assert kernels(9) == ["block_gemv_2_8_64_256_o8_g_4x4b8", "block_gemv_2_1_64_256_o8_g_4x4b8"]  # 8 rows a kernel
    assert kernels(65) == []  # a long prompt's chunk: tinygrad's kernel
    shared = programs(block_matvec(Tensor.empty(1, 1, 256, device="NULL"), stack, idx, share=2))
    assert [n for n in shared if n.startswith("block_gemv")] == ["block_gemv_2_1_64_256_o8_g_x2_4x4b8"]
    monkeypatch.setenv("SWARMD_BLOCK_GEMV", "0")
    assert kernels(1) == []


@needs_nvcc
@pytest.mark.parametrize("rows,has_m,pick,layout", [(1, False, "index", Layout()), (8, False, "one", Layout()),
                                                     (8, True, "slot", Layout(2, 4)),
                                                     (8, False, "index", Layout(4, 4, 16)),
                                                     (8, False, "index", Layout(4, 4, 4, 4)),
                                                     (1, False, "glu", Layout()), (8, False, "glu", Layout(4, 4, 4, 4)),
                                                     (1, False, "glu+extra", Layout()), (1, True, "extra", Layout())])
def test_the_kernel_builds_for_hopper_without_spilling_registers(rows, has_m, pick, layout, tmp_path):
    glu, extra = pick.startswith("glu"), pick.endswith("extra")
    pick = "index" if glu or extra else pick
    built_without_spills(source("block_gemv_check", rows, 4096, 7168, 0 if has_m else 8, has_m, pick, layout,
                                8 if pick == "index" else 1, glu=glu, strides=(192, 12288) if pick == "slot" else None,
                                extra_x=0 if extra else None),
                         tmp_path)


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("q4_1", [False, True], ids=["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 8, 20])
@pytest.mark.parametrize("layout", ["4,4,4", "4,4,8", "4,4,16", "4,4,4,2", "4,4,4,4"],
                         ids=["4-bytes", "8-bytes", "16-bytes", "2-warps-a-row", "4-warps-a-row"])
def test_the_product_is_that_of_the_dequantised_weights_gathered_by_index(rows, q4_1, layout, monkeypatch):
    monkeypatch.setenv("SWARMD_BLOCK_GEMV_LAYOUT", layout)
    rng = np.random.default_rng(rows)
    raw = random_blocks(rng, 6 * 64, 512, q4_1)
    stack = from_ggml_blocks(raw, 3 if q4_1 else 2, (6, 64, 512), Device.DEFAULT).realize()
    pick = np.array([4, 0, 4, 2], np.int32)
    x = rng.standard_normal((4, rows, 512)).astype(np.float32)
    got = block_matvec(Tensor(x), stack, Tensor(pick)).numpy()
    want = np.einsum("sri,soi->sro", x.astype(np.float64), dequantized(raw, q4_1).reshape(6, 64, 512)[pick])
    assert got.shape == (4, rows, 64)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("rows", [1, 9])
def test_slots_that_share_their_rows_give_the_bits_of_the_rows_repeated(rows):
    rng = np.random.default_rng(12)
    raw = random_blocks(rng, 6 * 64, 512, False)
    stack = from_ggml_blocks(raw, 2, (6, 64, 512), Device.DEFAULT).realize()
    x = rng.standard_normal((2, rows, 512)).astype(np.float32)  # two rows' activations, four experts each
    pick = Tensor(np.array([4, 0, 5, 2, 1, 0, 3, 2], np.int32))
    shared = block_gemv(Tensor(x), stack, pick, share=4).numpy()
    repeated = block_gemv(Tensor(np.repeat(x, 4, axis=0)), stack, pick).numpy()
    assert shared.shape == (8, rows, 64) and np.array_equal(shared, repeated)


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("q4_1", [False, True], ids=["Q4_0", "Q4_1"])
@pytest.mark.parametrize("glu", [False, True])
def test_a_further_matrix_in_one_more_slot_has_the_bits_of_its_own_product_laid_out_as_a_stacks(q4_1, glu):
    """A MoE block's shared expert beside its routed ones: the last slot multiplies the further matrix by x's slot
    `extra_x`, with the bits of that matrix's lone product `stacked`; the other slots are the product without it."""
    rng = np.random.default_rng(13)
    raw = random_blocks(rng, 6 * 64, 4096, q4_1)
    stack = from_ggml_blocks(raw, 3 if q4_1 else 2, (6, 64, 4096), Device.DEFAULT).realize()
    lone = from_ggml_blocks(random_blocks(rng, 64, 4096, q4_1), 3 if q4_1 else 2, (64, 4096), Device.DEFAULT).realize()
    x = rng.standard_normal((1, 1, 4096)).astype(np.float32)  # one row, its four experts' and the further slot's
    pick = Tensor(np.array([4, 0, 5, 2], np.int32))
    both = block_gemv(Tensor(x), stack, pick, share=4, glu=glu, extra=lone).numpy()
    routed = block_gemv(Tensor(x), stack, pick, share=4, glu=glu).numpy()
    alone = block_gemv(Tensor(x), lone, glu=glu, stacked=True).numpy()
    assert both.shape == (5, 1, 32 if glu else 64)
    assert np.array_equal(both[:4], routed) and np.array_equal(both[4], alone[0])
    later = np.concatenate([rng.standard_normal((4, 1, 4096)), x]).astype(np.float32)  # its row after the others
    got = block_gemv(Tensor(later), stack, pick, glu=glu, extra=lone, extra_x=4).numpy()
    assert np.array_equal(got[4], both[4]) and np.array_equal(got[:4], block_gemv(Tensor(later[:4]), stack, pick, glu=glu).numpy())


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
def test_without_an_index_each_slot_multiplies_its_own_matrix_of_the_stack():
    rng = np.random.default_rng(11)
    raw = random_blocks(rng, 6 * 64, 128, False)  # heads of 128 values: fewer blocks than a warp's lanes take
    stack = from_ggml_blocks(raw, 2, (6, 64, 128), Device.DEFAULT).realize()
    x = rng.standard_normal((6, 2, 128)).astype(np.float32)
    got = block_gemv(Tensor(x), stack).numpy()
    want = np.einsum("sri,soi->sro", x.astype(np.float64), dequantized(raw, False).reshape(6, 64, 128))
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
def test_an_outputs_bits_do_not_depend_on_the_slots_and_rows_around_it():
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, 4 * 64, 4096, False)
    stack = from_ggml_blocks(raw, 2, (4, 64, 4096), Device.DEFAULT).realize()
    x = rng.standard_normal((8, 20, 4096)).astype(np.float32)
    pick = np.arange(8, dtype=np.int32) % 4
    whole = block_matvec(Tensor(x), stack, Tensor(pick)).numpy()  # 20 rows a slot: kernels of 8, 8 and 4
    for row in (2, 13, 17):
        alone = block_matvec(Tensor(x[5:6, row:row + 1].copy()), stack, Tensor(pick[5:6])).numpy()
        assert np.array_equal(whole[5, row], alone[0, 0])


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
def test_a_lone_matrix_shared_by_warps_gives_each_row_the_bits_it_has_alone():
    assert (Layout().splits(4096), Layout().splits(4096, stacked=True), Layout().splits(1024)) == (2, 1, 1)
    rng = np.random.default_rng(8)
    raw = random_blocks(rng, 64, 4096, True)
    matrix = from_ggml_blocks(raw, 3, (64, 4096), Device.DEFAULT).realize()
    x = rng.standard_normal((1, 20, 4096)).astype(np.float32)
    whole = block_matvec(Tensor(x), matrix).numpy()
    want = x[0].astype(np.float64) @ dequantized(raw, True).T
    assert np.abs(whole[0] - want).max() < 1e-5 * np.abs(want).max()
    for row in (0, 9, 19):
        alone = block_matvec(Tensor(x[:, row:row + 1].copy()), matrix).numpy()
        assert np.array_equal(whole[0, row], alone[0, 0])


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_heads_read_where_they_lie_give_the_bits_of_heads_copied_out(rows):
    """Each head's first 128 of its 192 values in rows of 6 heads (a query projection's output), read in place."""
    rng = np.random.default_rng(20 + rows)
    raw = random_blocks(rng, 6 * 64, 128, False)
    stack = from_ggml_blocks(raw, 2, (6, 64, 128), Device.DEFAULT).realize()
    q = rng.standard_normal((rows, 6 * 192)).astype(np.float32)
    copied = np.ascontiguousarray(q.reshape(rows, 6, 192)[..., :128].transpose(1, 0, 2))  # (heads, rows, 128)
    in_place = block_gemv(Strided(Tensor(q), 192, 6 * 192, (6, rows, 128)), stack).numpy()
    assert np.array_equal(in_place, block_gemv(Tensor(copied), stack).numpy())


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("width", [4096, 1024], ids=["split-rows", "whole-rows"])
@pytest.mark.parametrize("gathered", [False, True], ids=["one-matrix", "experts"])
def test_a_gated_product_gives_silu_of_its_gate_rows_times_its_up_rows(rows, width, gathered):
    rng = np.random.default_rng(30 + rows)
    raw = random_blocks(rng, 3 * 128, width, False)  # three [gate | up] matrices of 64 + 64 rows
    stack = from_ggml_blocks(raw, 2, (3, 128, width) if gathered else (3 * 128, width), Device.DEFAULT).realize()
    x = rng.standard_normal((2 if gathered else 1, rows, width)).astype(np.float32)
    pick = Tensor(np.array([2, 0], np.int32)) if gathered else None
    got = block_gemv(Tensor(x), stack, pick, glu=True).numpy()
    plain = block_gemv(Tensor(x), stack, pick).numpy().astype(np.float64)
    gate, up = (plain[..., :64], plain[..., 64:128]) if gathered else (plain[..., :192], plain[..., 192:])
    want = gate / (1 + np.exp(-gate)) * up
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-6 * np.abs(want).max()
