"""A Kimi-class stage's jitted decode step as an NVIDIA GPU would run it, captured on tinygrad's NULL device (the GPU
paths taken, nothing run): what a step makes once, and what each block runs."""

from dataclasses import replace

import numpy as np
import pytest
from tinygrad.helpers import Context
from tinygrad.uop.ops import Ops

from models.deepseek2 import KIMI_K2
from models.stage import StageInput, StageModel
from tests.models.sm90 import take_gpu_paths

# Kimi-K2's structure at a width whose latent attention takes the hand-written kernels (8 heads, a latent of 128)
ARCH = replace(KIMI_K2, dim=1024, n_heads=8, q_lora=256, kv_lora=128, nope=64, rope=64, v_dim=64, dense_ffn=2048,
               expert_ffn=256, n_experts=64)


@pytest.fixture
def on_a_gpu(monkeypatch):
    """The GPU paths on the NULL device, as an sm_90 GPU (an H100 / H200) takes them."""
    take_gpu_paths("NULL", monkeypatch.setattr)
    monkeypatch.setenv("SWARMD_GRAPH_CACHE", "off")
    with Context(DEV="NULL", NULL_ALLOW_COPYOUT=1):
        yield


def decode_kernels(blocks: int) -> list:
    """The programs of a decode step's captured graph, in order, for a stage of `blocks` MoE blocks."""
    config = replace(ARCH, n_blocks=blocks + 2).config(4096, 640)
    stage = StageModel.random(config, 0, 1, 1 + blocks, max_context=640, max_requests=1, device="NULL",
                              numerics="float", experts_in_graph=True)
    stage.add_request("a")
    for n in range(3):  # captured on the second step
        stage.slots.set_length("a", 512 + n)
        stage.forward([StageInput("a", 512 + n, np.zeros((1, config.dim), np.float32))])
    (jit,) = stage._decode_jits.values()

    def programs(linear) -> list:
        out = []
        for call in linear.src:
            if call.op is Ops.CALL and call.src[0].op is Ops.CUSTOM_FUNCTION:  # a batch of calls
                out += programs(call.src[0].src[0])
            elif call.op is Ops.CALL and call.src[0].op is Ops.PROGRAM:
                out.append(call.src[0].arg)
        return out

    return programs(jit.captured.linear)


def test_a_step_writes_its_rope_angles_and_rows_once_not_again_in_each_block(on_a_gpu):
    """The kernels that read the step's bound variables (its rows' slots and positions): the angles' row of the RoPE
    table, the slot, the position. Before, each block copied them out again before its hand-written kernels."""
    reading_variables = {blocks: [p.name for p in decode_kernels(blocks) if p.vars] for blocks in (1, 3)}
    assert len(reading_variables[1]) == 3
    assert reading_variables[3] == reading_variables[1]


def test_each_block_runs_the_same_kernels_all_hand_written(on_a_gpu):
    names = [p.name for p in decode_kernels(2) if not p.vars]
    first, second = names[:len(names) // 2], names[len(names) // 2:]
    assert sorted(first) == sorted(second)
    tinygrads = [n for n in first if not n.startswith(("block_gemv", "latent_", "rms_norm", "float_gemv",
                                                       "routed_top_k", "gated_sum"))]
    assert tinygrads == []  # the shared expert's output too is added to the residual stream in the gated sum
    assert len(first) == 15
    # the shared expert is one more slot of the routed experts' two products (9 = 8 chosen + 1)
    assert sum(n.startswith("block_gemv_9_") for n in first) == 2


def test_the_shared_expert_can_keep_products_of_its_own(on_a_gpu, monkeypatch):
    monkeypatch.setenv("SWARMD_SHARED_IN_EXPERTS", "0")
    names = [p.name for p in decode_kernels(1) if not p.vars]
    assert len(names) == 17 and not any(n.startswith("block_gemv_9_") for n in names)
