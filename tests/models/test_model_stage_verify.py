"""A verify step (speculative decoding): several positions of a request in one forward, each computed as its own
one-position decode step, so that its logits are bit for bit those of decoding the tokens one at a time; the rows
of rejected drafts are rolled back and written over."""

from __future__ import annotations

import numpy as np
import pytest

from models.errors import ModelError
from models.stage import NUMERICS, StageInput, StageModel

pytestmark = pytest.mark.slow  # compiles the tiny model's decode graph at a few batch sizes

PROMPT = np.asarray([3, 9, 27, 81, 50, 7], np.int32)


def one_at_a_time(model: StageModel, rid: str, tokens: list[int]) -> np.ndarray:
    """Logits of each of `tokens` fed as decode steps after the prompt."""
    model.add_request(rid)
    model.forward([StageInput(rid, 0, PROMPT)])
    rows = [model.forward([StageInput(rid, len(PROMPT) + i, np.asarray([t], np.int32))])[0]
            for i, t in enumerate(tokens)]
    model.free_request(rid)
    return np.stack(rows)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_a_verify_step_gives_bit_for_bit_the_logits_of_decoding_its_rows_one_at_a_time(tiny_quantized_gguf,
                                                                                         numerics):
    dtype = "quantized" if numerics == "ggml" else "float32"
    model = StageModel.from_gguf(tiny_quantized_gguf, max_context=64, max_requests=2, numerics=numerics, dtype=dtype)
    tokens = [11, 12, 40, 2, 5, 6, 90, 1]
    want = one_at_a_time(model, "seq", tokens)
    model.add_request("v")
    model.add_request("other")
    model.forward([StageInput("v", 0, PROMPT)])
    model.forward([StageInput("other", 0, PROMPT[:3])])
    for k in (1, 3, 7):  # 2, 4 and 8 rows; beside another request's decode step in the same batch
        got, _ = model.forward([StageInput("v", len(PROMPT), np.asarray(tokens[:k + 1], np.int32), verify=True),
                                StageInput("other", 3, np.asarray([4], np.int32))])
        assert got.shape == (k + 1, model.vocab_size)
        assert np.array_equal(got, want[:k + 1])
        assert model.position("v") == len(PROMPT) + k + 1
        model.rollback("v", len(PROMPT))
        model.rollback("other", 3)


def test_rolled_back_rows_are_written_over_by_the_accepted_continuation(tiny_quantized_gguf):
    model = StageModel.from_gguf(tiny_quantized_gguf, max_context=64, max_requests=1, numerics="ggml")
    want = one_at_a_time(model, "seq", [11, 12, 13, 14])
    model.add_request("v")
    model.forward([StageInput("v", 0, PROMPT)])
    model.forward([StageInput("v", len(PROMPT), np.asarray([11, 12, 77, 78], np.int32), verify=True)])
    model.rollback("v", len(PROMPT) + 2)  # 77 and 78 rejected: 13 and 14 follow 12
    got = model.forward([StageInput("v", len(PROMPT) + 2, np.asarray([13, 14], np.int32), verify=True)])[0]
    assert np.array_equal(got, want[2:])
    with pytest.raises(ModelError, match="cannot roll back"):
        model.rollback("v", len(PROMPT) + 10)
