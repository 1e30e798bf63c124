"""A stage's graph capture builds one block of each kind (and its last block) and records that block's calls again
on the other blocks' buffers; the graph computes bit for bit what building every block computes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from tiny_deepseek2 import TinyDeepSeek2, tiny_deepseek2_weights, write_deepseek2_gguf
from tinygrad.llm.model import TransformerConfig

from models import stage as stage_module
from models.catalog.moe_writer import SYNTHETIC_MOE
from models.stage import StageInput, StageModel

pytestmark = pytest.mark.slow  # compiles kernels

DENSE = TransformerConfig(num_blocks=5, dim=64, hidden_dim=128, n_heads=4, n_kv_heads=2, norm_eps=1e-5,
                          vocab_size=96, head_dim=16, rope_theta=10000.0, rope_dim=16, v_head_dim=16)
MOE = SYNTHETIC_MOE["tiny"].config(96, 32)  # a dense block, then 3 MoE blocks


def serve(s: StageModel) -> list[np.ndarray]:
    """Two prompts (one scoring every position on a last stage), then decode steps of both and of one alone."""
    def rows(n: int, seed: int) -> np.ndarray:
        r = np.random.default_rng(seed)
        return r.integers(0, 90, n) if s.is_first else r.standard_normal((n, s.hidden_size)).astype(np.float32)

    s.add_request("a")
    s.add_request("b")
    out = [*s.forward([StageInput("a", 0, rows(4, 1))]), *s.forward([StageInput("b", 0, rows(2, 2), all_logits=s.is_last)])]
    for step in range(3):
        out += s.forward([StageInput("a", 4 + step, rows(1, 10 + step)), StageInput("b", 2 + step, rows(1, 20 + step))])
    out += s.forward([StageInput("a", 7, rows(1, 30))])
    return out


def counting_builds(s: StageModel) -> Counter:
    """Counts the blocks `s` builds, by block."""
    built: Counter = Counter()
    build = s._block

    def counted(i, *args, **kwargs):
        built[i] += 1
        return build(i, *args, **kwargs)

    s._block = counted
    return built


def served_both_ways(make, monkeypatch) -> tuple[list[np.ndarray], list[np.ndarray], Counter, Counter]:
    """What a stage serves with blocks recorded and repeated, and with every block built; the builds of each
    (every graph captured here, none from the graph cache)."""
    monkeypatch.setenv("SWARMD_GRAPH_CACHE", "off")
    recorded = make()
    recorded_builds = counting_builds(recorded)
    got = serve(recorded)
    with monkeypatch.context() as m:
        m.setattr(stage_module, "capturing", lambda: False)
        built = make()
        every_build = counting_builds(built)
        expected = serve(built)
    return got, expected, recorded_builds, every_build


def assert_same_bits(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_blocks_attending_over_cache_tiles_repeat_on_their_own_kv_cache(monkeypatch):
    got, expected, recorded, _ = served_both_ways(  # decode attention over cache tiles, as on GPUs
        lambda: StageModel.random(DENSE, 7, 1, 4, max_context=32, max_requests=2, dtype="float32", attention_tile=8),
        monkeypatch)
    assert_same_bits(got, expected)
    assert recorded == {1: 3, 3: 3}


@pytest.mark.parametrize("bounds", [(0, 5), (1, 4), (2, 5)])
def test_dense_blocks_are_built_once_per_graph_and_compute_the_bits_of_every_block_built(bounds, monkeypatch):
    got, expected, recorded, every = served_both_ways(
        lambda: StageModel.random(DENSE, 7, *bounds, max_context=32, max_requests=2, dtype="float32"), monkeypatch)
    assert_same_bits(got, expected)
    graphs = 4  # prefill, prefill scoring every position (last stage) or decode batch 1, decode batches 1 and 2
    first, end = bounds
    assert set(every) == set(range(first, end)) and set(every.values()) == {graphs - (end < 5)}
    # the first block of each graph, and its last (whose output flows into the head, or out, unstored)
    assert recorded == {first: graphs - (end < 5), end - 1: graphs - (end < 5)}


def test_moe_blocks_running_their_experts_in_the_stages_graph_repeat_on_their_own_experts(monkeypatch):
    got, expected, recorded, every = served_both_ways(
        lambda: StageModel.random(MOE, 5, 0, 4, max_context=32, max_requests=2, dtype="float16",
                                  experts_in_graph=True), monkeypatch)
    assert_same_bits(got, expected)
    assert set(every) == {0, 1, 2, 3}
    assert set(recorded) == {0, 1, 3}  # the dense block, the first MoE block (block 2 repeats it) and the last


def test_a_moe_stage_cut_at_its_routers_builds_each_segments_blocks(monkeypatch):
    """Cut after each router, a segment holds one block of each kind (blocks 2 and 3 share one graph)."""
    got, expected, recorded, every = served_both_ways(
        lambda: StageModel.random(MOE, 5, 0, 4, max_context=32, max_requests=2, dtype="float16"), monkeypatch)
    assert_same_bits(got, expected)
    assert recorded == every and set(every) == {0, 1, 2}


def test_a_block_whose_kv_cache_is_not_among_its_buffers_is_built_every_time(kv_cache_left_out_of_block_buffers,
                                                                             monkeypatch):
    got, expected, recorded, every = served_both_ways(
        lambda: StageModel.random(DENSE, 7, 0, 5, max_context=32, max_requests=2, dtype="float32"), monkeypatch)
    assert_same_bits(got, expected)
    assert recorded == every


def test_latent_attention_blocks_repeat_too(tmp_path, monkeypatch):
    spec = TinyDeepSeek2(n_blocks=5, leading_dense=2)
    path = write_deepseek2_gguf(tmp_path / "tiny.gguf", spec, tiny_deepseek2_weights(spec, seed=3))
    got, expected, recorded, every = served_both_ways(
        lambda: StageModel.from_gguf(path, max_context=32, max_requests=2, experts_in_graph=True), monkeypatch)
    assert_same_bits(got, expected)
    assert set(every) == {0, 1, 2, 3, 4}
    assert set(recorded) == {0, 2, 4}  # dense blocks 0-1, MoE blocks 2-4 (the last is built)


def test_blocks_whose_matrices_differ_in_type_are_kinds_of_their_own(tiny_gguf, monkeypatch):
    """The tiny GGUF quantises one matrix of blocks 1, 2 and 3 each its own way; with llama.cpp's arithmetic a stage
    keeps those in GGML blocks: of blocks 0-3, none repeats another (block 4, the last, is built anyway)."""
    got, expected, recorded, every = served_both_ways(
        lambda: StageModel.from_gguf(tiny_gguf, max_context=32, max_requests=2, numerics="ggml"), monkeypatch)
    assert_same_bits(got, expected)
    assert set(every) == {0, 1, 2, 3, 4}, every
    assert set(recorded) == {0, 1, 2, 3, 4}, recorded
