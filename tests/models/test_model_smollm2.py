"""SmolLM2-135M-Instruct (Q4_1 GGUF) on StageModel, against the numpy reference and llama.cpp's answers.

Float arithmetic is checked against the float32 numpy reference: float16 weights move SmolLM2's logits
by at most 0.065 against it (rms 0.005-0.007), so logits must agree within 0.1.

Against llama.cpp the bar is the issue's: what `swarmd run` computes with (ggml numerics, see
models/kernels/ggml_numerics.py) gives llama.cpp's greedy tokens up to its first near-tie (a step where
llama.cpp's top-1/top-2 gap is under 0.2), for every recorded prompt: the five of
tests/data/llamacpp-reference-smollm2.json and the ten of llamacpp-reference-smollm2-extra.json
(scripts/make_llamacpp_reference.py). Float arithmetic leaves llama.cpp at a 0.33 gap on "The
capital of France is" (docs/BENCHMARKS.md, "Fidelity against llama.cpp").
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.stage import SERVING_NUMERICS, StageInput, StageModel
from tests.reference.np_llama import NpLlama, load_gguf

pytestmark = pytest.mark.slow

DATA = Path(__file__).parents[1] / "data"
REFERENCE = json.loads((DATA / "llamacpp-reference-smollm2.json").read_text())
EXTRA = json.loads((DATA / "llamacpp-reference-smollm2-extra.json").read_text())
CASES = REFERENCE["cases"]
ALL_CASES = CASES + EXTRA["cases"]
F16_TOL = 0.1
NEAR_TIE = 0.2


def case_id(case: dict) -> str:
    return (case.get("user") or case["prompt"])[:28]


@pytest.fixture(scope="module")
def model(smollm2_gguf):
    return StageModel.from_gguf(smollm2_gguf, max_context=128, max_requests=2)


@pytest.fixture(scope="module")
def serving(smollm2_gguf):
    return StageModel.from_gguf(smollm2_gguf, max_context=128, max_requests=1, numerics=SERVING_NUMERICS)


@pytest.fixture(scope="module")
def numpy_weights(smollm2_gguf):
    return load_gguf(smollm2_gguf)


@pytest.mark.parametrize("reference", [REFERENCE, EXTRA], ids=["reference", "extra"])
def test_the_reference_files_are_for_this_gguf(reference):
    from models.catalog.store import SMOLLM2_135M

    assert reference["model_sha256"] == SMOLLM2_135M.sha256


@pytest.mark.parametrize("case", ALL_CASES, ids=[case_id(c) for c in ALL_CASES])
def test_reference_firm_prefixes_end_at_the_first_near_tie(case):
    gaps, firm = case["top2_gaps"], case["firm_ids"]
    assert firm == case["greedy_ids"][:len(firm)]
    assert all(g >= NEAR_TIE for g in gaps[:len(firm)])
    assert len(firm) == len(gaps) or gaps[len(firm)] < NEAR_TIE


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_teacher_forced_float16_logits_match_the_float32_reference(model, numpy_weights, case):
    ids = case["prompt_ids"] + case["greedy_ids"]
    model.add_request("t")
    got = model.forward([StageInput("t", 0, np.array(ids), all_logits=True)])[0]
    model.free_request("t")
    want = NpLlama(*numpy_weights, max_context=128).forward(ids, 0)
    np.testing.assert_allclose(got, want, atol=F16_TOL, rtol=0)


@pytest.mark.parametrize("case", ALL_CASES, ids=[case_id(c) for c in ALL_CASES])
def test_greedy_decoding_gives_llamacpps_tokens_up_to_its_first_near_tie(serving, case):
    prompt, firm = case["prompt_ids"], case["firm_ids"]
    serving.add_request("g")
    tokens = [int(serving.forward([StageInput("g", 0, np.array(prompt))])[0].argmax())]
    while len(tokens) < len(firm):
        step = StageInput("g", len(prompt) + len(tokens) - 1, np.array(tokens[-1:]))
        tokens.append(int(serving.forward([step])[0].argmax()))
    serving.free_request("g")
    assert tokens[:len(firm)] == firm


def test_block_weights_dequantised_in_the_kernel_match_the_float32_reference(smollm2_gguf, numpy_weights):
    quantized = StageModel.from_gguf(smollm2_gguf, max_context=64, max_requests=1, dtype="quantized")
    case = CASES[3]
    ids = case["prompt_ids"] + case["greedy_ids"][:8]
    quantized.add_request("q")
    got = quantized.forward([StageInput("q", 0, np.array(ids), all_logits=True)])[0]
    want = NpLlama(*numpy_weights, max_context=64).forward(ids, 0)
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)  # measured 2.4e-4: exact weights, float32 sums
    assert quantized.weight_bytes() < 0.4 * 269_030_016


def test_a_stage_holds_only_the_weights_of_its_blocks(model, smollm2_gguf):
    inner = StageModel.from_gguf(smollm2_gguf, 8, 16, max_context=16, max_requests=1)
    block_bytes = inner.weight_bytes() // 8
    embedding_bytes = model.vocab_size * model.hidden_size * 2  # float16, shared with the tied head
    assert model.weight_bytes() == pytest.approx(30 * block_bytes + embedding_bytes, rel=1e-3)
    assert inner.weight_bytes() < 0.22 * model.weight_bytes()
