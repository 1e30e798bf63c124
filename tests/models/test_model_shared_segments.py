"""A MoE stage cut after each router runs a segment per block; the segments of one block each share one graph per
step shape, the block's buffers its inputs, and compute bit for bit what a graph per block computes."""

from __future__ import annotations

import numpy as np
import pytest

from models.catalog.moe_writer import SYNTHETIC_MOE
from models.stage import StageInput, StageModel

CONFIG = SYNTHETIC_MOE["tiny"].config(96, 32)  # a dense block, then 3 MoE blocks: blocks 2 and 3 are one-block segments


def stage(*, shared: bool = True) -> StageModel:
    s = StageModel.random(CONFIG, 5, 0, 4, max_context=32, max_requests=2, dtype="float16")
    if not shared:
        s._shared = {}  # as if no segment were shareable: a graph per segment
    return s


def serve(s: StageModel) -> list[np.ndarray]:
    """Two prompts, then decode steps of both at once and of one alone."""
    s.add_request("a")
    s.add_request("b")
    out = [*s.forward([StageInput("a", 0, np.array([5, 17, 42, 8]))]), *s.forward([StageInput("b", 0, np.array([3, 9]))])]
    for step in range(3):
        out += s.forward([StageInput("a", 4 + step, np.array([11 + step])), StageInput("b", 2 + step, np.array([60]))])
    out += s.forward([StageInput("a", 7, np.array([1]))])
    return out


def graphs(s: StageModel) -> set:
    return {key[1] for key in (*s._decode_jits, *s._prefill_jits)}


def test_one_block_segments_share_a_graph_and_compute_the_bits_of_a_graph_per_block():
    alone, shared = stage(shared=False), stage()
    expected = serve(alone)
    got = serve(shared)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(graphs(alone)) == 4  # blocks 0-1 to the first router, block 2, block 3, the head
    assert len(graphs(shared)) == 3  # blocks 2 and 3 as one
    assert not shared._unshared


def test_a_shared_graph_that_reads_a_blocks_own_buffer_is_refused_and_every_block_gets_its_own(
        kv_cache_left_out_of_block_buffers):  # the KV cache not among the inputs: the graph holds block 2's own
    expected = serve(stage(shared=False))
    refused = stage()
    got = serve(refused)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    assert refused._unshared and len(graphs(refused)) == 4


@pytest.mark.parametrize("shared", [True, False])
def test_a_replayed_step_takes_its_variables_new_values(shared):
    s = stage(shared=shared)
    s.add_request("a")
    s.forward([StageInput("a", 0, np.array([5, 17]))])
    first = s.forward([StageInput("a", 2, np.array([9]))])[0]
    s.free_request("a")
    s.add_request("a")
    s.forward([StageInput("a", 0, np.array([5, 17, 9]))])
    again = s.forward([StageInput("a", 3, np.array([9]))])[0]  # the same graph, another position
    assert not np.array_equal(first, again)
