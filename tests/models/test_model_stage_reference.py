"""A StageModel loaded from a tiny GGUF computes what the independent numpy reference computes.

Tolerances are measured, not guessed: with float32 weights the logits differ from numpy's by at most
1.9e-5 here (max |logit| ~50), so 1e-4 is used; float16 weights (tinygrad.llm's default and ours)
cost up to 0.034 on this model and 0.065 on SmolLM2-135M, so 0.1 is used, and greedy tokens must
agree wherever the reference's top-1/top-2 gap exceeds twice that. Weights kept in their GGML blocks
("quantized", dequantised in the kernels) are exact, so they get the float32 tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from models.stage import StageInput, StageModel
from tests.reference.np_llama import NpLlama, load_gguf

# compiles and runs tinygrad kernels (seconds each on a cold kernel cache)
pytestmark = pytest.mark.slow

F32_TOL, F16_TOL = 1e-4, 0.1


@pytest.fixture(scope="module", params=["float32", "float16", "quantized"])
def gguf_path(request, tiny_gguf, tiny_quantized_gguf):
    return request.param, tiny_quantized_gguf if request.param == "quantized" else tiny_gguf


@pytest.fixture(scope="module")
def reference(gguf_path):
    config, weights = load_gguf(gguf_path[1])
    return lambda: NpLlama(config, weights, max_context=64)


@pytest.fixture(scope="module")
def model(gguf_path):
    dtype, path = gguf_path
    return StageModel.from_gguf(path, max_context=64, max_requests=2, dtype=dtype)


def tolerance(model: StageModel) -> float:
    return F16_TOL if model.weight_dtype == "float16" else F32_TOL


def test_prefill_logits_match_the_reference(model, reference):
    ids = np.random.default_rng(0).integers(0, model.vocab_size, 40)
    model.add_request("p")
    got = model.forward([StageInput("p", 0, ids, all_logits=True)])[0]
    model.free_request("p")
    np.testing.assert_allclose(got, reference().forward(ids, 0), atol=tolerance(model), rtol=0)


def test_greedy_decoding_follows_the_reference(model, reference):
    prompt = [3, 14, 15, 92, 65, 35]
    ref = reference()
    expected = ref.forward(prompt, 0)[-1]
    model.add_request("g")
    got = model.forward([StageInput("g", 0, np.array(prompt))])[0]
    for step in range(8):
        np.testing.assert_allclose(got, expected, atol=tolerance(model), rtol=0)
        top2 = np.sort(expected)[-2:]
        if top2[1] - top2[0] > 2 * tolerance(model):
            assert got.argmax() == expected.argmax()
        token = int(expected.argmax())  # teacher-forced on the reference's choice
        pos = len(prompt) + step
        got = model.forward([StageInput("g", pos, np.array([token]))])[0]
        expected = ref.forward([token], pos)[-1]
    model.free_request("g")


def test_llama3_rope_frequency_factors_are_applied(tmp_path, tiny_spec):
    """Llama 3 GGUFs carry `rope_freqs.weight`: each RoPE frequency is divided by its factor."""
    from tests.models.tiny_gguf import tiny_weights, write_gguf

    weights = tiny_weights(tiny_spec, seed=2)
    weights["rope_freqs.weight"] = np.linspace(1.0, 8.0, tiny_spec.head_dim // 2).astype(np.float32)
    path = write_gguf(tmp_path / "llama3ish.gguf", tiny_spec, weights)
    model = StageModel.from_gguf(path, max_context=32, max_requests=1, dtype="float32")
    ids = np.arange(1, 20) % tiny_spec.vocab
    model.add_request("r")
    got = model.forward([StageInput("r", 0, ids, all_logits=True)])[0]
    want = NpLlama(*load_gguf(path), max_context=32).forward(ids, 0)
    np.testing.assert_allclose(got, want, atol=F32_TOL, rtol=0)
    without = dict(weights)
    del without["rope_freqs.weight"]
    plain = NpLlama(*load_gguf(write_gguf(tmp_path / "plain.gguf", tiny_spec, without)), max_context=32).forward(ids, 0)
    assert np.abs(plain - want).max() > 100 * F32_TOL  # the factors matter at these positions
