"""SmolLM2-MoE: SmolLM2-135M's MLP split into 8 experts; top-2 is a sparse model. (Top-8 of 8 equals dense
SmolLM2 token for token through four daemons: tests/moe/test_daemons_moe.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from models.catalog.names import resolve_model
from models.expert_shard import ExpertShard
from models.layout import layout_from_gguf
from models.moe import ExpertCall
from models.stage import StageInput, StageModel

# loads two blocks of SmolLM2 twice and compiles their kernels
pytestmark = pytest.mark.slow

PROMPT = np.array([504, 3458, 282, 4649, 314])  # "The capital of France is"


def test_top2_of_8_is_a_sparse_model_that_routes_two_experts_per_token(smollm2_gguf):
    source = resolve_model("smollm2-moe-8x2")
    layout = layout_from_gguf(source.path)
    assert (layout.blocks[5].moe.n_experts, layout.blocks[5].moe.top_k) == (8, 2)
    split = StageModel.from_gguf(source.path, 0, 2, max_context=32, max_requests=1, local_experts=False)
    shard = ExpertShard.from_gguf(source.path, {0: range(8), 1: range(8)})
    seen: list[ExpertCall] = []

    def record(call: ExpertCall) -> np.ndarray:
        seen.append(call)
        return shard(call)

    split.add_request("r")
    hidden = split.forward([StageInput("r", 0, PROMPT)], experts=record)[0]
    assert [c.layer for c in seen] == [0, 1]
    for call in seen:
        assert call.sel.shape == (len(PROMPT), 2) and len({tuple(r) for r in call.sel}) > 1
        np.testing.assert_allclose(call.gates.sum(axis=1), 4.0, rtol=1e-5)  # normalised, times E/k
    dense = StageModel.from_gguf(smollm2_gguf, 0, 2, max_context=32, max_requests=1)
    dense.add_request("r")
    assert not np.allclose(hidden, dense.forward([StageInput("r", 0, PROMPT)])[0], atol=1e-2)  # a quarter of each MLP
