"""DeepSeek-V3 / Kimi-K2 style models (GGUF architecture `deepseek2`) against the independent float32 numpy
reference (tests/reference/np_deepseek2.py): multi-head latent attention with the compressed latent cached
per request, YaRN RoPE, sigmoid routing with a selection bias (and groups), a shared expert, a leading dense
block; files in both forms of the latent's up-projection, float and Q4_0, and llama.cpp's arithmetic."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from reference import np_deepseek2 as ref
from tiny_deepseek2 import TinyDeepSeek2, joined_kv_b, tiny_deepseek2_weights, write_deepseek2_gguf

from models.expert_shard import ExpertShard
from models.gguf.header import read_header
from models.gguf.loader import stage_tensor_names
from models.stage import StageInput, StageModel

pytestmark = pytest.mark.slow  # compiles kernels

SPEC = TinyDeepSeek2()
PROMPT = np.array([1, 5, 9, 33, 2, 70, 11, 4, 60, 3])
DECODED = [7, 8, 90]
F32_TOL = 1e-4


def q4_0(weights: dict[str, np.ndarray]) -> dict[str, str]:
    """Every matrix in Q4_0, experts included, but the router (as llama.cpp's quantizer leaves it)."""
    return {n: "Q4_0" for n, v in weights.items() if v.ndim >= 2 and v.shape[-1] % 32 == 0 and "gate_inp" not in n}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("deepseek2")
    w = tiny_deepseek2_weights(SPEC, seed=3)
    groups = replace(SPEC, groups=4, groups_used=2)  # DeepSeek-V3's group-limited routing
    return {"split": write_deepseek2_gguf(base / "split.gguf", SPEC, w),
            "kv_b": write_deepseek2_gguf(base / "kv_b.gguf", SPEC, joined_kv_b(w, SPEC)),
            "q4_0": write_deepseek2_gguf(base / "q4.gguf", SPEC, w, quant=q4_0(w)),
            "groups": write_deepseek2_gguf(base / "groups.gguf", groups, tiny_deepseek2_weights(groups, seed=4))}


def reference_logits(path: Path) -> np.ndarray:
    config, weights = ref.load(path)
    return ref.forward(config, weights, [*PROMPT.tolist(), *DECODED])


def run(model: StageModel, rid: str = "a", experts=None) -> np.ndarray:
    """Prefill's logits for every prompt position, then each decoded token's (`experts` answering the stage's
    expert calls, if its experts live elsewhere)."""
    model.add_request(rid)
    out = [model.forward([StageInput(rid, 0, PROMPT, all_logits=True)], experts=experts)[0]]
    for j, t in enumerate(DECODED):
        out.append(model.forward([StageInput(rid, len(PROMPT) + j, np.array([t]))], experts=experts)[0][None])
    model.free_request(rid)
    return np.concatenate(out)


@pytest.mark.parametrize("form", ["split", "kv_b", "groups"])
def test_a_deepseek2_gguf_computes_what_the_numpy_reference_computes(files, form):
    """Prefill and decode through the latent cache (absorbed queries) equal the reference's decompressed
    multi-head attention; the legacy `attn_kv_b` form loads as the split one."""
    model = StageModel.from_gguf(files[form], max_context=64, max_requests=2, dtype="float32")
    assert model.kv.layers[0].shape[-1] == SPEC.kv_lora + SPEC.rope  # only the latent is cached
    np.testing.assert_allclose(run(model), reference_logits(files[form]), atol=F32_TOL, rtol=0)


def test_decoded_tokens_attending_over_whole_cache_tiles_compute_the_numpy_reference(files):
    """As on GPUs: each decoded token's latent attention reads whole tiles of 4 cache rows (positions 10-12
    cross a tile's border), the rows past its own masked; its sums run in another order than over the exact
    length."""
    exact = run(StageModel.from_gguf(files["split"], max_context=64, max_requests=2, dtype="float32"))
    tiled = run(StageModel.from_gguf(files["split"], max_context=64, max_requests=2, dtype="float32",
                                     attention_tile=4))
    np.testing.assert_allclose(tiled, reference_logits(files["split"]), atol=F32_TOL, rtol=0)
    prompt = len(PROMPT)
    assert np.array_equal(tiled[:prompt], exact[:prompt])  # the prompt's chunk attends over its exact length
    assert not np.array_equal(tiled[prompt:], exact[prompt:])


def test_q4_0_experts_stay_quantized_and_compute_the_dequantized_reference(files):
    model = StageModel.from_gguf(files["q4_0"], max_context=64, max_requests=1, dtype="quantized")
    assert model.weight_dtype == "quantized"
    shard = model.expert_shard
    assert shard is not None and shard.weights[1][0].shape == (SPEC.n_experts, 2 * SPEC.expert_ffn, SPEC.dim)
    experts = 3 * SPEC.n_experts * SPEC.expert_ffn * SPEC.dim * (SPEC.n_blocks - 1)
    assert shard.weight_bytes() == pytest.approx(experts * 18 / 32)  # 4-bit codes and a float16 scale per 32
    np.testing.assert_allclose(run(model), reference_logits(files["q4_0"]), atol=1e-3, rtol=0)


@pytest.mark.parametrize("tile", [None, 4])
def test_requests_at_different_positions_decode_in_one_batch_as_alone(files, tile):
    model = StageModel.from_gguf(files["split"], max_context=64, max_requests=2, dtype="float32",
                                 attention_tile=tile)
    alone = run(model, "solo")
    model.add_request("a")
    model.add_request("b")
    model.forward([StageInput("a", 0, PROMPT)])
    model.forward([StageInput("b", 0, PROMPT[:4])])
    for j, t in enumerate(DECODED):
        a, b = model.forward([StageInput("a", len(PROMPT) + j, np.array([t])),
                              StageInput("b", 4 + j, np.array([PROMPT[4 + j]]))])
        np.testing.assert_allclose(a, alone[len(PROMPT) + j], atol=F32_TOL, rtol=0)
    np.testing.assert_allclose(b, alone[4 + len(DECODED) - 1], atol=F32_TOL, rtol=0)


def test_stages_and_spread_experts_give_the_single_process_bits(files):
    """One arithmetic: two stages without their experts, the experts spread over three shards and summed as
    the router sums them, give exactly the whole model's logits (llama.cpp's numerics, Q4_0)."""
    from swarmd.inference.moe.dispatch import ReplicaChooser, combine, split_by_node

    path = files["q4_0"]
    whole = run(StageModel.from_gguf(path, max_context=64, max_requests=1, numerics="ggml"))
    first = StageModel.from_gguf(path, 0, 2, max_context=64, max_requests=1, numerics="ggml", local_experts=False)
    last = StageModel.from_gguf(path, 2, 3, max_context=64, max_requests=1, numerics="ggml", local_experts=False)
    spread = [list(range(0, 16, 3)), list(range(1, 16, 3)), list(range(2, 16, 3))]
    shards = {name: ExpertShard.from_gguf(path, {1: es, 2: es}, numerics="ggml")
              for name, es in zip("abc", spread, strict=True)}
    holders = {e: (name,) for name, es in zip("abc", spread, strict=True) for e in es}

    def experts(call):
        parts = split_by_node(call, holders, ReplicaChooser(lambda: 0.0).choose)
        return combine(call, [(p, shards[p.peer].expert_outputs(p.call)) for p in parts])

    out = []
    for stage in (first, last):
        stage.add_request("r")
    hidden = first.forward([StageInput("r", 0, PROMPT)], experts=experts)[0]
    out.append(last.forward([StageInput("r", 0, hidden, all_logits=True)], experts=experts)[0])
    for j, t in enumerate(DECODED):
        hidden = first.forward([StageInput("r", len(PROMPT) + j, np.array([t]))], experts=experts)[0]
        out.append(last.forward([StageInput("r", len(PROMPT) + j, hidden)], experts=experts)[0][None])
    np.testing.assert_array_equal(np.concatenate(out), whole)


def test_a_stage_reads_only_its_own_tensors(files):
    header = read_header(files["split"])
    names = stage_tensor_names(header, 1, 2, SPEC.n_blocks, routed=False)
    assert all(n.startswith("blk.1.") for n in names) and "blk.1.attn_k_b.weight" in names
    assert not any("_exps" in n for n in names)
    legacy = stage_tensor_names(read_header(files["kv_b"]), 0, 1, SPEC.n_blocks)
    assert "blk.0.attn_kv_b.weight" in legacy and "token_embd.weight" in legacy and "output.weight" not in legacy


@pytest.mark.parametrize("numerics", ["float", "ggml"])
def test_experts_in_the_stages_own_graph_give_the_bits_of_its_shard(files, numerics):
    """The routed experts gathered inside the stage's graph (no host round trip) against the graph cut after each
    router, the shard answering on the host as a swarm's expert holders do: the same logits, bit for bit, on the
    CPU and on GPUs (where a decode step of one row runs the shared expert as one more slot of the routed ones')."""
    path = files["q4_0"]
    fast = StageModel.from_gguf(path, max_context=64, max_requests=1, dtype="quantized", numerics=numerics,
                                experts_in_graph=True)
    assert len(fast.segments) == 1
    exact = StageModel.from_gguf(path, max_context=64, max_requests=1, dtype="quantized", numerics=numerics)
    np.testing.assert_array_equal(run(fast), run(exact))


def test_a_stage_handed_a_shard_of_all_its_experts_runs_them_in_its_graph_with_the_same_bits(files):
    """As a daemon whose plan keeps the experts with their stage: the stage loaded without them, the node's shard
    holding every one of its MoE blocks' experts, runs them inside its graph (no cut) and gives the logits of the
    graph cut after each router, bit for bit; a shard short of one expert is refused, and without a shard the
    stage's graph is cut again."""
    path = files["q4_0"]
    n = SPEC.n_experts
    cut = StageModel.from_gguf(path, max_context=64, max_requests=1, dtype="quantized", local_experts=False)
    every = ExpertShard.from_gguf(path, {1: range(n), 2: range(n)}, dtype="quantized")
    assert not cut.use_experts(ExpertShard.from_gguf(path, {1: range(n), 2: range(n - 1)}, dtype="quantized"))
    fast = StageModel.from_gguf(path, max_context=64, max_requests=1, dtype="quantized", local_experts=False)
    assert fast.use_experts(every) and len(fast.segments) == 1 and len(cut.segments) > 1
    np.testing.assert_array_equal(run(fast), run(cut, experts=every.compute))
    assert not fast.use_experts(None) and fast.segments == cut.segments  # cut again, its experts asked for
    np.testing.assert_array_equal(run(fast, experts=every.compute), run(cut, experts=every.compute))


def test_experts_in_the_graph_give_the_same_bits_in_kernels_of_a_few_pairs(files, monkeypatch):
    """As on GPUs, where a kernel of many experts reads slowly: a decoded token's four (row, expert) pairs in
    two kernels of two, each pair's sums in the same order as in one kernel of four."""

    def decode(pairs: str) -> np.ndarray:
        monkeypatch.setenv("SWARMD_IN_GRAPH_PAIRS", pairs)
        model = StageModel.from_gguf(files["q4_0"], max_context=64, max_requests=1, dtype="quantized",
                                     experts_in_graph=True)
        model.add_request("a")
        out = [model.forward([StageInput("a", 0, PROMPT[:1])])[0]]
        out += [model.forward([StageInput("a", 1 + j, np.array([t]))])[0] for j, t in enumerate(DECODED)]
        return np.stack(out)

    np.testing.assert_array_equal(decode("2"), decode("0"))
