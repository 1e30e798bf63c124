"""Mixture-of-experts models: the MoE block against an independent numpy reference, experts held
elsewhere against experts in the stage's graph, seeded synthetic models, and MoE GGUF files."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from models.catalog.moe_writer import SYNTHETIC_MOE, write_synthetic_moe
from models.config import config_from_header
from models.expert_shard import ExpertShard
from models.gguf.header import read_header
from models.gguf.loader import stage_tensor_names
from models.layout import layout_from_gguf
from models.moe import ExpertCall
from models.stage import StageInput, StageModel
from models.text.tokenizer import Tokenizer
from tests.models.tiny_gguf import TinyMoE, TinySpec, tiny_moe_weights, write_moe_gguf
from tests.reference.np_llama import NpLlama, load_gguf

# compiles and runs tinygrad kernels (seconds each on a cold kernel cache)
pytestmark = pytest.mark.slow

F32_TOL = 1e-4
PROMPT = np.array([5, 17, 42, 8, 91, 23, 60])
SPEC = TinySpec(n_blocks=4)
# softmax without a bias and without normalised gates (Mixtral-like scoring over all experts), and
# sigmoid with a selection bias, normalised top-k and a routed scaling (DeepSeek-V3 / Kimi-K2)
ROUTERS = {"softmax": TinyMoE(gating=1, bias=False, norm=False, scale=1.0, shared_ffn=0),
           "sigmoid+bias": TinyMoE(gating=2, bias=True, norm=True, scale=1.5, shared_ffn=32)}


def write(tmp_path_factory, router: str):
    moe = ROUTERS[router]
    weights = tiny_moe_weights(SPEC, moe, seed=3)
    quant = {n: "Q8_0" for n in weights if n.endswith("_exps.weight")}  # experts kept in GGML blocks
    return write_moe_gguf(tmp_path_factory.mktemp("moe") / "moe.gguf", SPEC, moe, weights, quant=quant)


@pytest.fixture(scope="module", params=sorted(ROUTERS))
def any_router_gguf(request, tmp_path_factory):
    return write(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    return write(tmp_path_factory, "sigmoid+bias")


def teacher_forced(model: StageModel, rid: str, tokens: np.ndarray, experts=None) -> np.ndarray:
    """Logits of a prefill of all but the last two tokens, then two decode steps."""
    model.add_request(rid)
    out = [model.forward([StageInput(rid, 0, tokens[:-2], all_logits=True)], experts=experts)[0]]
    for pos in (len(tokens) - 2, len(tokens) - 1):
        out.append(model.forward([StageInput(rid, pos, tokens[pos:pos + 1])], experts=experts)[0][None])
    model.free_request(rid)
    return np.concatenate(out)


def test_the_config_and_layout_come_from_llamacpps_expert_keys(any_router_gguf):
    config = config_from_header(read_header(any_router_gguf))
    moe = ROUTERS["softmax" if config.expert_gating == "softmax" else "sigmoid+bias"]
    assert (config.num_experts, config.num_experts_per_tok, config.hidden_dim) == (6, 2, 32)
    assert (config.leading_dense_blocks, config.dense_hidden_dim) == (1, SPEC.hidden)
    assert config.expert_bias == moe.bias and config.shared_expert_dim == moe.shared_ffn
    layout = layout_from_gguf(any_router_gguf)
    assert layout.blocks[0].moe is None
    assert [b.moe.n_experts for b in layout.blocks[1:]] == [6, 6, 6]
    assert layout.blocks[1].moe.bytes_per_expert == 3 * 32 * SPEC.dim * 2  # float16 in a StageModel


def test_a_moe_gguf_computes_what_the_numpy_reference_computes(any_router_gguf):
    config, weights = load_gguf(any_router_gguf)
    want = NpLlama(config, weights, max_context=32).forward(PROMPT, 0)
    model = StageModel.from_gguf(any_router_gguf, max_context=32, max_requests=1, dtype="float32")
    np.testing.assert_allclose(teacher_forced(model, "r", PROMPT), want, atol=F32_TOL, rtol=0)


def test_experts_held_elsewhere_give_the_local_moes_logits(moe_gguf):
    """The stage cut at each router, with the experts spread over three shards, equals the stage
    that runs its experts in its own graph, for two requests decoding in one batch."""
    whole = StageModel.from_gguf(moe_gguf, max_context=32, max_requests=2, dtype="float32")
    stage = StageModel.from_gguf(moe_gguf, max_context=32, max_requests=2, dtype="float32", local_experts=False)
    assert stage.weight_bytes() < whole.weight_bytes()  # the routed experts are not loaded there
    shards = [ExpertShard.from_gguf(moe_gguf, {i: es for i in (1, 2, 3)}, dtype="float32")
              for es in ([0, 3], [1, 4, 2], [5])]  # one shard of a single expert
    calls: list[ExpertCall] = []

    def spread(call: ExpertCall) -> np.ndarray:
        calls.append(call)
        out = np.zeros_like(call.rows)
        for shard in shards:
            part = call.only(set(shard.holds(call.layer)))
            if part is not None:
                out[np.isin(call.sel, shard.holds(call.layer)).any(axis=1)] += shard(part)
        return out

    for rid in ("a", "b"):
        whole.add_request(rid)
        stage.add_request(rid)
    second = PROMPT[::-1].copy()
    for model, fn in ((whole, None), (stage, spread)):
        model.forward([StageInput("a", 0, PROMPT), StageInput("b", 0, second)], experts=fn)
    assert [c.layer for c in calls] == [1, 2, 3] * 2 and calls[0].rows.shape == (len(PROMPT), SPEC.dim)
    for step in range(4):  # past tinygrad's first jit replay (the third call)
        items = [StageInput("a", len(PROMPT) + step, np.array([step + 1])),
                 StageInput("b", len(PROMPT) + step, np.array([step + 7]))]
        want = whole.forward(items)
        got = stage.forward(items, experts=spread)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(g, w, atol=F32_TOL, rtol=0)
    assert calls[-1].rows.shape == (2, SPEC.dim) and calls[-1].sel.shape == (2, 2)  # one call per layer and step


def test_a_stage_without_its_experts_reads_no_expert_bytes(moe_gguf):
    header = read_header(moe_gguf)
    names = stage_tensor_names(header, 1, 3, SPEC.n_blocks, routed=False)
    assert "blk.1.ffn_gate_inp.weight" in names and not any("_exps" in n for n in names)
    with pytest.raises(Exception, match="experts live elsewhere"):
        stage = StageModel.from_gguf(moe_gguf, 1, 3, max_context=8, max_requests=1, local_experts=False)
        stage.add_request("r")
        stage.forward([StageInput("r", 0, np.zeros((1, SPEC.dim), np.float32))])


def test_a_stage_without_its_experts_grows_by_taking_its_moe_blocks_over(moe_gguf):
    """What a survivor serving a MoE does when its range grows: the router, shared experts and attention of
    the blocks it held are taken over; the routed experts stay with the expert actors."""
    shard = ExpertShard.from_gguf(moe_gguf, {i: range(6) for i in (1, 2, 3)})
    old = StageModel.from_gguf(moe_gguf, 1, 3, max_context=16, max_requests=1, local_experts=False)
    grown = StageModel.from_gguf(moe_gguf, 1, 4, max_context=16, max_requests=1, local_experts=False, reuse=old)
    scratch = StageModel.from_gguf(moe_gguf, 1, 4, max_context=16, max_requests=1, local_experts=False)
    assert sorted(grown.reused.blocks) == [1, 2] and grown.blk[2] is old.blk[2]
    assert grown.blk[2].ffn_gate_inp.weight is old.blk[2].ffn_gate_inp.weight
    first = StageModel.from_gguf(moe_gguf, 0, 2, max_context=16, max_requests=1, local_experts=False)
    local = StageModel.from_gguf(moe_gguf, 0, 3, max_context=16, max_requests=1, reuse=first)
    assert sorted(local.reused.blocks) == [0]  # the dense block; the MoE block lacks the routed experts it needs
    rows = np.random.default_rng(2).standard_normal((len(PROMPT), SPEC.dim)).astype(np.float32)
    out = []
    for stage in (grown, scratch):
        stage.add_request("r")
        out.append(stage.forward([StageInput("r", 0, rows)], experts=shard)[0])
    np.testing.assert_array_equal(out[0], out[1])


def test_a_shard_answers_each_call_from_its_own_rows(moe_gguf):
    """Every call after tinygrad's jit has captured the graph still computes on the new rows."""
    shard = ExpertShard.from_gguf(moe_gguf, {2: [0, 3, 5]}, dtype="float32")
    rng = np.random.default_rng(1)
    for _ in range(4):
        call = ExpertCall(2, rng.standard_normal((1, SPEC.dim)).astype(np.float32), np.array([[3, 5]], np.int32),
                          np.array([[0.25, 0.75]], np.float32))
        fresh = ExpertShard.from_gguf(moe_gguf, {2: [3, 5]}, dtype="float32")
        np.testing.assert_allclose(shard(call), fresh(call), atol=1e-6, rtol=0)


def test_a_shard_refuses_experts_it_does_not_hold(moe_gguf):
    shard = ExpertShard.from_gguf(moe_gguf, {2: [4, 1]}, dtype="float32")
    rows = np.ones((1, SPEC.dim), np.float32)
    with pytest.raises(Exception, match=r"experts \[0\] are not held"):
        shard(ExpertCall(2, rows, np.array([[0, 1]], np.int32), np.ones((1, 2), np.float32)))
    with pytest.raises(Exception, match="no experts of block 1"):
        shard(ExpertCall(1, rows, np.array([[4, -1]], np.int32), np.ones((1, 2), np.float32)))


def test_a_synthetic_moe_gguf_holds_the_seeded_weights_of_any_split(tmp_path):
    arch = SYNTHETIC_MOE["tiny"]
    path = write_synthetic_moe(tmp_path / "syn.gguf", arch, seed=5, vocab=96)
    config = arch.config(96, 32)
    from_file = StageModel.from_gguf(path, max_context=32, max_requests=1)  # the file holds float16 matrices
    bounds = [0, 2, 4]
    stages = [StageModel.random(config, 5, a, b, max_context=32, max_requests=1, dtype="float16")
              for a, b in itertools.pairwise(bounds)]
    data = teacher_forced(from_file, "f", PROMPT)
    for stage in stages:
        stage.add_request("s")
    x = PROMPT[:-2]
    for stage in stages:
        x = stage.forward([StageInput("s", 0, x, all_logits=stage.is_last)])[0]
    np.testing.assert_allclose(x, data[:len(PROMPT) - 2], atol=F32_TOL, rtol=0)


def test_a_synthetic_moe_gguf_can_carry_a_byte_level_tokenizer_and_needs_no_other_file(tmp_path):
    path = write_synthetic_moe(tmp_path / "syn.gguf", SYNTHETIC_MOE["tiny"], seed=5, vocab=300, byte_tokenizer=True)
    tokenizer = Tokenizer.from_gguf(path)
    ids = tokenizer.encode("Any text, ünïcode too")
    assert max(ids) < 256 and tokenizer.decode(ids) == "Any text, ünïcode too"
    assert tokenizer.eos_id == 299


def test_synthetic_presets_span_tiny_to_about_a_billion_parameters():
    from models.catalog.moe_writer import SyntheticMoE
    from planner.arch import ArchSpec

    def params(a: SyntheticMoE) -> int:
        return ArchSpec("x", a.n_blocks, a.dim, a.dense_ffn, a.n_heads, a.n_kv_heads, a.dim // a.n_heads, 49152,
                        n_experts=a.n_experts, top_k=a.top_k, expert_ffn=a.expert_ffn,
                        n_shared_experts=1, leading_dense=a.leading_dense).total_params()

    assert params(SYNTHETIC_MOE["tiny"]) < 10e6  # mostly its 49152-token embedding and head
    assert 0.9e9 < params(SYNTHETIC_MOE["1b"]) < 1.2e9


@pytest.mark.parametrize("n,k", [(384, 8), (8, 2), (64, 6)])
def test_the_routers_top_k_picks_the_k_largest_the_lower_index_first_among_equals(n, k):
    from tinygrad import Tensor
    from tinygrad.llm.model import pairwise_topk

    from models.moe import top_k

    rng = np.random.default_rng(n)
    for x in (rng.integers(0, 5, (2, 3, n)).astype(np.float32), rng.standard_normal((2, 3, n)).astype(np.float32)):
        got = top_k(Tensor(x), k).numpy()
        order = np.lexsort((-np.broadcast_to(np.arange(n), x.shape), x), axis=-1)  # ascending; of equals, lower index last
        assert np.array_equal(got, order[..., -k:])
        if n <= 64:  # tinygrad's own (whose kernel takes long to build for hundreds of experts) picks the same
            assert np.array_equal(got, pairwise_topk(Tensor(x), k)[1].numpy())
