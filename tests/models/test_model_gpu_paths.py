"""The code paths written for GPUs, checked on the CPU: decode attention over whole cache tiles, the
CUDA graph launch-dimension fix, which products go to the tensor cores and the split-reduction form of a decode
batch's one, the gathered experts' kernel options and the one kernel of their GGML-block product, and architectures
built from their public shapes."""

import ctypes

import numpy as np
import pytest
from tiny_deepseek2 import TinyDeepSeek2, tiny_deepseek2_weights, write_deepseek2_gguf
from tinygrad import Device

from models.config import config_from_arch
from models.errors import ModelError
from models.kernels.attention import (
    SLOT_ORDERED_OPTS,
    batch_rows_at,
    half_product_attention,
    slot_ordered_decode_attention,
    slot_span,
)
from models.kernels.gathered import GATHERED_GPU_OPTS, block_matvec, gathered_opts
from models.kernels.matvec import (
    TENSOR_CORE_OPTS,
    as_opts,
    split_k,
    tensor_core_matmul,
    tensor_core_rows,
)
from models.stage import StageInput, StageModel
from models.tinygrad_ext.cuda_graph import add_kernel_node_with_nonzero_dims
from planner.arch import BUILTIN_ARCHS, ArchSpec
from swarmd.daemon.descriptor import smi_id

TINY = ArchSpec("tiny", n_blocks=2, hidden=128, ffn=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=500)


def decode_logits(tile: int) -> np.ndarray:
    """Three requests of different lengths decoded together for 12 steps, across several tile borders: slots 0, 2
    and 3 (the request in slot 1 left), a batch of 3 rows padded to 4."""
    model = StageModel.random(config_from_arch(TINY, 48), seed=5, max_context=48, max_requests=4,
                              dtype="float32", attention_tile=tile, prefill_chunk=8)
    lengths, tokens = {"a": 11, "gone": 3, "b": 5, "c": 8}, {}
    for rid, n in lengths.items():
        model.add_request(rid)
        tokens[rid] = int(model.forward([StageInput(rid, 0, np.arange(1, n + 1))])[0].argmax())
    model.free_request("gone")
    del lengths["gone"]
    steps = []
    for _ in range(12):
        out = model.forward([StageInput(r, lengths[r], np.array([tokens[r]])) for r in lengths])
        for r, logits in zip(lengths, out, strict=True):
            tokens[r], lengths[r] = int(logits.argmax()), lengths[r] + 1
        steps.append(np.stack(out))
    return np.stack(steps)


@pytest.mark.slow
@pytest.mark.parametrize("slot_ordered", ["1", "0"])
def test_decode_attention_over_cache_tiles_equals_attention_over_the_exact_length(slot_ordered, monkeypatch):
    exact = decode_logits(tile=0)
    monkeypatch.setenv("SWARMD_SLOT_ORDERED_ATTENTION", slot_ordered)  # one set of kernels, or a set per row
    tiled = decode_logits(tile=8)
    assert np.abs(exact - tiled).max() < 1e-4 * np.abs(exact).max()


@pytest.mark.parametrize("attention", ["grouped-query", "latent"])
def test_a_prompts_first_chunk_compiled_from_position_zero_gives_the_general_graphs_logits(attention, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setenv("SWARMD_HALF_PREFILL_ATTENTION", "0")  # on GPUs: the same float32 products as the other chunks
    if attention == "latent":
        spec = TinyDeepSeek2()
        path = write_deepseek2_gguf(tmp_path / "mla.gguf", spec, tiny_deepseek2_weights(spec, seed=3))

    def run(first_chunk_graph: bool) -> tuple[np.ndarray, np.ndarray, int]:
        if attention == "latent":  # chunks of 32 rows
            model = StageModel.from_gguf(path, max_context=96, max_requests=1, dtype="float32")
        else:  # chunks of 8
            model = StageModel.random(config_from_arch(TINY, 48), seed=5, max_context=48, max_requests=1,
                                      dtype="float32", prefill_chunk=8)
        model.first_chunk_graph = first_chunk_graph
        model.add_request("r")
        n = 40 if attention == "latent" else 20  # two or three chunks
        prompt = model.forward([StageInput("r", 0, np.arange(1, n + 1), all_logits=True)])[0]
        step = model.forward([StageInput("r", n, np.array([int(prompt[-1].argmax())]))])[0]  # over what they wrote
        return prompt, step, sum(1 for key in model._prefill_jits if "first" in key)

    general, fixed = run(False), run(True)
    assert general[2] == 0 and fixed[2] > 0  # a graph per segment (a MoE model is cut after each router)
    for a, b in zip(general[:2], fixed[:2], strict=True):
        assert np.abs(a - b).max() < 1e-5 * np.abs(a).max()


def test_a_first_chunks_attention_with_float16_products_is_attention_to_float16_precision():
    from tinygrad import Tensor

    rng = np.random.default_rng(4)
    q, k, v = (Tensor(rng.standard_normal(shape).astype(np.float32)) for shape in ((1, 8, 12, 32), (1, 2, 12, 32),
                                                                                 (1, 2, 12, 32)))
    mask = Tensor.full((1, 1, 12, 12), float("-inf")).triu(1)
    want = q.scaled_dot_product_attention(k, v, attn_mask=mask, enable_gqa=True).numpy()
    got = half_product_attention(q, k, v, mask).numpy()
    assert got.dtype == np.float32 and np.abs(got - want).max() < 5e-3 * np.abs(want).max()
    assert np.abs(got - want).max() > 0  # the products did run in float16


@pytest.mark.parametrize("shape", sorted(SLOT_ORDERED_OPTS), ids=str)
def test_the_slot_ordered_attention_with_its_searched_options_is_attention(shape):
    """On a GPU the table's options are pinned on the kernels of that shape (on the CPU tinygrad chooses)."""
    from tinygrad import Tensor, UOp, dtypes

    span, kv_heads, group, head_dim, tile, dtype = shape
    heads, max_context = kv_heads * group, 3 * tile
    rng = np.random.default_rng(6)
    cache = rng.standard_normal((2, span + 1, kv_heads, max_context, head_dim)).astype(np.float32)
    q = rng.standard_normal((span, heads, 1, head_dim)).astype(np.float32)
    at = [2 * tile + 7 - 5 * b for b in range(span)]  # rows of different lengths, across tile borders
    svars = [UOp.variable(f"slot{b}", 0, span).bind(b) for b in range(span)]
    pvars = [UOp.variable(f"pos{b}", 0, max_context - 1).bind(p) for b, p in enumerate(at)]
    tiles = UOp.variable("tiles", 1, 3).bind(max(at) // tile + 1)
    got = slot_ordered_decode_attention(
        Tensor(q), Tensor(cache).cast(getattr(dtypes, dtype)).contiguous(), *batch_rows_at(svars, pvars, Device.DEFAULT),
        tiles, span=span, tile=tile, positions=Tensor.arange(max_context), n_kv_heads=kv_heads).numpy()
    for b, p in enumerate(at):
        keys, values = cache[0, b, :, :p + 1], cache[1, b, :, :p + 1]  # (kv_heads, rows, head_dim)
        for h in range(heads):
            scores = keys[h // group] @ q[b, h, 0] / np.sqrt(head_dim)
            weights = np.exp(scores - scores.max())
            want = weights @ values[h // group] / weights.sum()
            assert np.abs(got[b, h, 0] - want).max() < 1e-4 * np.abs(want).max()


def pinned_options(out) -> list[tuple]:
    """The options pinned on the kernels that compute `out`, in schedule order (nothing runs)."""
    from tinygrad.uop.ops import Ops

    linear, _ = out.linear_with_vars()
    return [u.arg.opts_to_apply for u in linear.toposort() if u.op is Ops.SINK and u.arg is not None
            and u.arg.opts_to_apply]


@pytest.mark.parametrize("shape", sorted(SLOT_ORDERED_OPTS), ids=str)
def test_the_slot_ordered_attentions_scores_and_sum_kernels_are_scheduled_with_the_tables_options(shape):
    """On the NULL device (a GPU's code path that runs nothing), both reductions' kernels carry their options."""
    from tinygrad import Tensor, UOp

    span, kv_heads, group, head_dim, tile, _ = shape
    max_context = 5 * tile
    svars = [UOp.variable(f"slot{b}", 0, span).bind(b) for b in range(span)]
    pvars = [UOp.variable(f"pos{b}", 0, max_context - 1).bind(4 * tile + b) for b in range(span)]
    out = slot_ordered_decode_attention(
        Tensor.empty(span, kv_heads * group, 1, head_dim, device="NULL"),
        Tensor.empty(2, span + 1, kv_heads, max_context, head_dim, device="NULL").contiguous(),
        *batch_rows_at(svars, pvars, "NULL"), UOp.variable("tiles", 1, 5).bind(5), span=span, tile=tile,
        positions=Tensor.arange(max_context, device="NULL"), n_kv_heads=kv_heads)
    assert pinned_options(out) == [as_opts(SLOT_ORDERED_OPTS[shape][kernel]) for kernel in ("scores", "sum")]


@pytest.mark.parametrize("shape", sorted(TENSOR_CORE_OPTS), ids=str)
def test_a_tensor_core_product_of_a_table_shape_is_scheduled_with_the_tables_options(shape):
    """A prompt chunk's one kernel, or a decode batch's split product (its sum has no options of its own)."""
    from tinygrad import Tensor, dtypes

    rows, out_features, in_features = shape
    product = tensor_core_matmul(Tensor.empty(rows, in_features, device="NULL"),
                                 Tensor.empty(out_features, in_features, dtype=dtypes.float16, device="NULL"))
    assert pinned_options(product) == [as_opts(TENSOR_CORE_OPTS[shape])]
    other = tensor_core_matmul(Tensor.empty(rows * 2, in_features, device="NULL"),  # a row count not searched
                               Tensor.empty(out_features, in_features, dtype=dtypes.float16, device="NULL"))
    assert pinned_options(other) == []


def test_a_decode_batch_attends_in_slot_order_only_where_its_rows_hold_distinct_slots():
    assert slot_span([0, 2, 3], 8) == 4 and slot_span([5], 8) == 8 and slot_span([0, 1], 32) == 2
    model = StageModel.random(config_from_arch(TINY, 32), seed=5, max_context=32, max_requests=4, dtype="float32",
                              attention_tile=8, prefill_chunk=8)
    for rid in "ab":
        model.add_request(rid)
        model.forward([StageInput(rid, 0, np.arange(1, 6))])
    model.forward([StageInput("a", 5, np.array([7])), StageInput("b", 5, np.array([8]))])
    model.forward([StageInput("a", 6, np.array([7, 9]), verify=True)])  # two rows of one slot
    assert sorted(span for _, _, span in model._decode_jits) == [0, 2]


def test_a_gpu_stages_warm_up_captures_the_graphs_of_first_and_later_chunks_and_of_both_decode_layouts():
    model = StageModel.random(config_from_arch(TINY, 48), seed=5, max_context=48, max_requests=4, dtype="float32",
                              attention_tile=8, prefill_chunk=8)
    model.first_chunk_graph = True  # as on a GPU
    model.warmup()
    warmed = set(model._prefill_jits) | set(model._decode_jits)
    for rid in "abc":
        model.add_request(rid)
        model.forward([StageInput(rid, 0, np.arange(1, 12))])  # a first chunk, then a later one
    model.forward([StageInput(r, 11, np.array([5])) for r in "abc"])  # distinct slots, padded to 4
    model.forward([StageInput("a", 12, np.array([5, 6, 7]), verify=True)])  # one slot's rows
    assert set(model._prefill_jits) | set(model._decode_jits) == warmed


def test_decode_batches_of_eight_rows_and_more_and_prefill_chunks_use_the_tensor_cores_on_gpus(monkeypatch):
    from tinygrad import Tensor, dtypes

    monkeypatch.delenv("SWARMD_TENSOR_CORE_MIN_ROWS", raising=False)
    monkeypatch.delenv("SWARMD_TENSOR_CORES", raising=False)
    w = Tensor.empty(64, 32, dtype=dtypes.float16).realize()
    on = [rows for rows in (1, 2, 4, 8, 12, 16, 32, 48, 64, 100, 512) if tensor_core_rows("CUDA", rows, w)]
    assert on == [8, 16, 32, 48, 64, 100, 512]  # below 64 rows, multiples of the tile's 8-wide side
    assert not tensor_core_rows("CPU", 32, w)
    assert not tensor_core_rows("CUDA", 32, Tensor.empty(64, 32, dtype=dtypes.float32).realize())
    monkeypatch.setenv("SWARMD_TENSOR_CORE_MIN_ROWS", "64")  # the earlier rule: prefill chunks only
    assert [rows for rows in (8, 32, 64) if tensor_core_rows("CUDA", rows, w)] == [64]


@pytest.mark.parametrize("rows", [8, 32, 64])
def test_a_tensor_core_product_with_its_reduction_in_parts_equals_the_plain_product(rows):
    from tinygrad import Tensor

    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((rows, 256)).astype(np.float32), rng.standard_normal((48, 256)).astype(np.float16)
    assert split_k(48, 256) > 1  # below 64 rows the reduction goes in parts
    out = tensor_core_matmul(Tensor(x), Tensor(w)).numpy()
    want = x.astype(np.float16).astype(np.float32) @ w.astype(np.float32).T
    assert out.shape == (rows, 48)
    assert np.abs(out - want).max() < 2e-3 * np.abs(want).max()  # float16 products, float32 sums


def test_a_decode_batch_product_is_split_into_more_parts_the_fewer_outputs_it_has():
    assert [split_k(out, 4096) for out in (4096, 6144, 28672, 128256)] == [32, 16, 4, 1]
    assert split_k(4096, 64) == 4 and split_k(4096, 24) == 1  # whole tiles of 16 per part


class Params(ctypes.Structure):
    _fields_ = [(d, ctypes.c_uint32) for d in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY",
                                                "blockDimZ")]


def test_a_graph_node_refused_for_a_zero_grid_is_added_with_the_grid_raised_to_one():
    seen = []

    def driver(node, graph, deps, ndeps, ref):  # refuses zero dimensions, as the CUDA driver does
        dims = [getattr(ref._obj, f) for f, _ in Params._fields_]
        seen.append(dims)
        return 1 if 0 in dims else 0

    params = Params(0, 1, 1, 8, 1, 1)
    assert add_kernel_node_with_nonzero_dims(driver, None, None, None, 0, ctypes.byref(params)) == 0
    assert seen == [[0, 1, 1, 8, 1, 1], [1, 1, 1, 8, 1, 1]]


def test_a_graph_node_refused_for_another_reason_is_not_retried():
    calls = []
    params = Params(4, 1, 1, 8, 1, 1)
    status = add_kernel_node_with_nonzero_dims(lambda *a: calls.append(a) or 1, None, None, None, 0,
                                               ctypes.byref(params))
    assert status == 1 and len(calls) == 1


def test_the_gathered_experts_pinned_options_apply_where_they_divide_the_reduction_and_heuristics_elsewhere():
    pinned = gathered_opts("CUDA", 14336, (256, 16))  # a 4096-wide float16 expert input, one axis in the kernel
    assert [(o.op.name, o.axis, o.arg) for o in pinned] == [tuple(o) for o in GATHERED_GPU_OPTS]
    assert gathered_opts("CUDA", 32, (4, 16)) is None  # 64 wide: an unroll of 4 leaves 16, no group of 32
    assert gathered_opts("CUDA", 1536, (36, 16)) is None  # SmolLM2's 576: 144 after the unroll
    assert gathered_opts("CPU", 32, (4, 16)) is not None  # the CPU's own options, whatever the width


def expert_stack(device: str, rng: np.random.Generator | None = None, *, offsets: bool = False):
    """A stack of 6 Q4_0 (or, with offsets, Q4_1) experts of 24 x 128; random codes when `rng` is given."""
    from tinygrad import Tensor, dtypes

    from models.kernels.quant import BlockQuantized

    n, out, width = 6, 24, 128
    if rng is None:
        q = Tensor.empty(n * out, width // 2, dtype=dtypes.uint8, device=device)
        d = Tensor.empty(n * out, width // 32, dtype=dtypes.float16, device=device)
    else:
        q = Tensor(rng.integers(0, 256, (n * out, width // 2), dtype=np.uint8), device=device)
        d = Tensor(rng.standard_normal((n * out, width // 32)).astype(np.float16), device=device)
    m = Tensor(np.ones((n * out, width // 32), np.float16) / 3, device=device) if offsets else None
    return BlockQuantized(q, d, m, width, shape=(n, out, width), code_offset=0 if offsets else 8)


def test_the_chosen_experts_scales_are_read_inside_their_product_not_written_out_before_it():
    """On the NULL device: the one kernel before the layout copy is the product, and it reads the float16 scales of
    the whole stack by index (picked first and broadcast after, they took a kernel of their own)."""
    from tinygrad import Tensor, dtypes
    from tinygrad.uop.ops import Ops

    for offsets in (False, True):
        experts = expert_stack("NULL", offsets=offsets)
        out = block_matvec(Tensor.empty(4, 1, 128, device="NULL"), experts,
                           Tensor.empty(4, dtype=dtypes.int32, device="NULL"))
        linear, _ = out.linear_with_vars()
        kernels = [u for u in linear.toposort() if u.op is Ops.SINK]
        product = [k for k in kernels if any(u.op is Ops.REDUCE for u in k.toposort())]
        assert len(product) == 1 and len(kernels) <= 2
        reads = {(u.dtype.base, u.dtype.size) for u in product[0].toposort() if u.op is Ops.PARAM}
        assert (dtypes.half, experts.d.numel()) in reads


@pytest.mark.parametrize("offsets", [False, True], ids=["q4_0", "q4_1"])
def test_a_gathered_block_product_is_each_chosen_experts_dequantised_product(offsets, monkeypatch):
    from tinygrad import Tensor

    monkeypatch.setenv("SWARMD_BLOCK_OPTS", "[]")  # the CPU runs the kernel without a GPU's thread groups
    rng = np.random.default_rng(3)
    experts = expert_stack("CPU", rng, offsets=offsets)
    x = rng.standard_normal((4, 3, 128)).astype(np.float32)
    idx = np.array([5, 0, 2, 5], dtype=np.int32)
    got = block_matvec(Tensor(x, device="CPU"), experts, Tensor(idx, device="CPU")).numpy()
    whole = experts.dequantized().numpy()  # (6, 24, 128)
    want = np.einsum("srk,sok->sro", x, whole[idx])
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_builtin_dense_architectures_give_their_configurations():
    config = config_from_arch(BUILTIN_ARCHS["llama-3.1-8b"], max_context=1024)
    assert (config.num_blocks, config.dim, config.hidden_dim, config.n_heads, config.n_kv_heads,
            config.head_dim, config.vocab_size, config.max_context) == (32, 4096, 14336, 32, 8, 128, 128256, 1024)
    with pytest.raises(ModelError, match="only dense"):
        config_from_arch(BUILTIN_ARCHS["mixtral-8x7b"])


def test_nvidia_smi_is_asked_about_the_gpu_that_cuda_visible_devices_maps_to(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert smi_id("CUDA") == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert smi_id("CUDA:1") == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert smi_id("CUDA:1") == "1"
