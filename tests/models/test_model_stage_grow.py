"""A stage built for a larger block range from a loaded one takes the blocks both hold over as they are (the same
tensors, not read again) and computes what a stage loaded from scratch computes: a survivor whose range grows
after a stage was lost reads only the blocks it lacked."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from tinygrad.llm.model import TransformerConfig

from models.gguf import loader as gguf_loader
from models.gguf.loader import StageParts
from models.stage import StageInput, StageModel

# compiles and runs tinygrad kernels (seconds on a cold kernel cache)
pytestmark = pytest.mark.slow

PROMPT = np.array([5, 17, 42, 8, 91, 23, 60])


def logits(stage: StageModel) -> np.ndarray:
    """Every prompt position's logits (a stage holding the whole model)."""
    stage.add_request("r")
    out = stage.forward([StageInput("r", 0, PROMPT, all_logits=True)])[0]
    stage.free_request("r")
    return out


def rows(stage: StageModel, data: np.ndarray) -> np.ndarray:
    """A middle or last stage's answer to the prompt's hidden rows."""
    stage.add_request("r")
    out = stage.forward([StageInput("r", 0, data)])[0]
    stage.free_request("r")
    return out


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The GGUF tensors read from the file, by name, in order."""
    names: list[str] = []
    read = gguf_loader.read_raw

    def recording(header, name):
        names.append(name)
        return read(header, name)

    monkeypatch.setattr(gguf_loader, "read_raw", recording)
    return names


def test_a_first_stage_grown_to_the_whole_model_reads_only_the_blocks_it_lacked(tiny_quantized_gguf, reads):
    # the served arithmetic: GGML blocks, ggml numerics
    old = StageModel.from_gguf(tiny_quantized_gguf, 0, 3, max_context=32, max_requests=1, numerics="ggml")
    rows(old, PROMPT)  # it has served: its graphs are captured
    reads.clear()
    grown = StageModel.from_gguf(tiny_quantized_gguf, 0, 5, max_context=32, max_requests=1, numerics="ggml",
                                 reuse=old)
    assert {n.split(".")[1] for n in reads if n.startswith("blk.")} == {"3", "4"}
    assert "token_embd.weight" not in reads  # the head is tied to the embedding it took over
    assert grown.reused == StageParts(frozenset({0, 1, 2}), embedding=True, head=False)
    assert all(grown.blk[i] is old.blk[i] and grown._qkv[i] is old._qkv[i] for i in range(3))
    assert grown.token_embd is old.token_embd and grown._blocks["blk.1.qkv"] is old._blocks["blk.1.qkv"]
    assert grown._blocks["output.weight"] is old._blocks["token_embd.weight"]
    assert grown.kv is not old.kv and grown.weight_dtype == old.weight_dtype
    del old
    gc.collect()  # the old stage's graphs are finalised: the tensors it shared stay
    scratch = StageModel.from_gguf(tiny_quantized_gguf, 0, 5, max_context=32, max_requests=1, numerics="ggml")
    np.testing.assert_array_equal(logits(grown), logits(scratch))


def test_a_last_stage_grown_downwards_keeps_its_blocks_and_head(tiny_gguf, reads):
    hidden = np.random.default_rng(3).standard_normal((len(PROMPT), 64)).astype(np.float32)
    old = StageModel.from_gguf(tiny_gguf, 3, 5, max_context=32, max_requests=1)
    reads.clear()
    grown = StageModel.from_gguf(tiny_gguf, 2, 5, max_context=32, max_requests=1, reuse=old)
    assert {n for n in reads if n.startswith("blk.")} == {n for n in reads if n.startswith("blk.2.")} != set()
    assert "output_norm.weight" not in reads and grown.reused.head
    assert grown.output is old.output and grown.blk[4] is old.blk[4] and grown._gate_up[3] is old._gate_up[3]
    scratch = StageModel.from_gguf(tiny_gguf, 2, 5, max_context=32, max_requests=1)
    np.testing.assert_array_equal(rows(grown, hidden), rows(scratch, hidden))
    shrunk = StageModel.from_gguf(tiny_gguf, 3, 5, max_context=32, max_requests=1, reuse=grown)
    assert shrunk.reused == StageParts(frozenset({3, 4}), embedding=False, head=True)


def test_only_a_stage_of_the_same_weights_hands_its_blocks_over(tiny_gguf, tiny_quantized_gguf):
    old = StageModel.from_gguf(tiny_gguf, 0, 3, max_context=32, max_requests=1)
    other_file = StageModel.from_gguf(tiny_quantized_gguf, 0, 4, max_context=32, max_requests=1, reuse=old)
    other_dtype = StageModel.from_gguf(tiny_gguf, 0, 4, max_context=32, max_requests=1, dtype="float32", reuse=old)
    assert other_file.reused == other_dtype.reused == StageParts()
    assert other_file.blk[0] is not old.blk[0]


CONFIG = TransformerConfig(num_blocks=4, dim=64, hidden_dim=128, n_heads=4, n_kv_heads=2, norm_eps=1e-5,
                           vocab_size=96, head_dim=16, rope_theta=10000.0, rope_dim=16, v_head_dim=16)


def test_a_seeded_stage_grows_the_same_way():
    old = StageModel.random(CONFIG, seed=5, start=1, end=3, max_context=32, max_requests=1)
    grown = StageModel.random(CONFIG, seed=5, start=1, end=4, max_context=32, max_requests=1, reuse=old)
    assert grown.reused == StageParts(frozenset({1, 2}), embedding=False, head=False)
    assert grown.blk[2] is old.blk[2]
    other_seed = StageModel.random(CONFIG, seed=6, start=1, end=4, max_context=32, max_requests=1, reuse=old)
    assert other_seed.reused == StageParts()
    hidden = np.random.default_rng(4).standard_normal((len(PROMPT), 64)).astype(np.float32)
    scratch = StageModel.random(CONFIG, seed=5, start=1, end=4, max_context=32, max_requests=1)
    np.testing.assert_array_equal(rows(grown, hidden), rows(scratch, hidden))
