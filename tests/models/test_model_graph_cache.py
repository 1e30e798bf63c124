"""Captured graphs kept on disk: a new stage (or expert shard, or process) replays the graphs an earlier one
captured, bound to its own weights, and computes exactly what they did; entries that are corrupt or do not
fit are deleted and captured again, never used; the cache keeps to its size bound, least recently used out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tinygrad.llm.model import TransformerConfig

from models.cached_graphs import held_tensors, warm_from_cache
from models.expert_shard import ExpertShard
from models.moe import ExpertCall, MoEConfig
from models.stage import StageInput, StageModel
from models.tinygrad_ext.graph_cache import GraphCache, named_buffers, switched_off

# compiles and runs tinygrad kernels (seconds each on a cold kernel cache)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = TransformerConfig(num_blocks=3, dim=64, hidden_dim=128, n_heads=4, n_kv_heads=2, norm_eps=1e-5,
                           vocab_size=96, head_dim=16, rope_theta=10000.0, rope_dim=16, v_head_dim=16)
PROMPT = [5, 17, 42, 8, 91, 23]
GRAPHS = ["prefill (blocks 0-2)", "decode, batch 1 (blocks 0-2)", "decode, batch 2 (blocks 0-2)"]


@pytest.fixture
def graphs_dir(tmp_path, monkeypatch) -> Path:
    """An empty graph cache of this test's own (stages read the setting when they are made)."""
    monkeypatch.setenv("SWARMD_GRAPH_CACHE", str(tmp_path / "graphs"))
    return tmp_path / "graphs"


def stage(seed: int = 3, **kw) -> StageModel:
    return StageModel.random(CONFIG, seed, **{"max_context": 32, "max_requests": 2, "dtype": "float32", **kw})


def serve(model: StageModel) -> list[np.ndarray]:
    """A prefill, two decode steps of one request, then a decode step of two requests at once."""
    out = []
    for rid in "ab":
        model.add_request(rid)
        out.append(model.forward([StageInput(rid, 0, np.array(PROMPT))])[0])
    for pos in (6, 7):
        out.append(model.forward([StageInput("a", pos, np.array([pos]))])[0])
    out += model.forward([StageInput("a", 8, np.array([1])), StageInput("b", 6, np.array([2]))])
    for rid in "ab":
        model.free_request(rid)
    return out


def graph_buffers(model: StageModel) -> set:
    from tinygrad.uop.ops import Ops

    jits = [*model._prefill_jits.values(), *model._decode_jits.values()]
    return {u for j in jits for u in j.captured.linear.toposort() if u.op is Ops.BUFFER}


def test_a_new_stage_replays_the_stored_graphs_and_computes_exactly_what_the_captured_ones_did(graphs_dir):
    first = stage()
    captured = serve(first)
    assert sorted(first.graphs.stored) == sorted(GRAPHS) and first.graphs.loaded == []
    second = stage()
    loaded = serve(second)
    assert sorted(second.graphs.loaded) == sorted(GRAPHS) and second.graphs.stored == []  # nothing captured
    for a, b in zip(captured, loaded, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_loaded_graph_computes_on_the_loading_stages_own_weights_and_copies_none(graphs_dir):
    first = stage()
    serve(first)
    second = stage()
    serve(second)
    own = set(second.graphs.bindings().values())
    theirs = set(first.graphs.bindings().values())
    used = graph_buffers(second)
    assert not used & theirs  # nothing of the stage that captured them
    assert used & own  # its weights, KV cache and tables
    made = used - own  # what loading the graphs allocated: their planned intermediates and outputs
    made_when_captured = graph_buffers(first) - theirs
    assert sorted(u.arg * u.dtype.itemsize for u in made) == sorted(u.arg * u.dtype.itemsize for u in made_when_captured)
    assert sum(u.arg * u.dtype.itemsize for u in made) < second.weight_bytes() / 3  # far less than a copy of them


def test_the_held_buffers_are_named_by_where_the_stage_holds_them(graphs_dir):
    names = held_tensors(stage())
    assert {"blk.0.attn_q.weight", "token_embd.weight", "output.weight", "kv.layers.2", "_rope", "_qkv.1"} <= set(names)
    assert not any(n.startswith(("_decode_jits", "_prefill_jits", "_inputs", "graphs")) for n in names)


def test_stages_of_another_shape_do_not_share_graphs(graphs_dir):
    base = stage()
    name = ("decode", 1, (0, 3, False))
    others = {"blocks": stage(start=0, end=2), "KV slots": stage(max_requests=4), "context": stage(max_context=48),
              "weights": stage(dtype="float16"), "seed": stage(seed=4), "numerics": stage(numerics="ggml")}
    keys = {what: json.dumps(m.graphs.key_of(name), sort_keys=True) for what, m in others.items()}
    mine = json.dumps(base.graphs.key_of(name), sort_keys=True)
    assert mine == json.dumps(stage().graphs.key_of(name), sort_keys=True)  # the same stage again: the same key
    assert all(k != mine for k in keys.values()) and len(set(keys.values())) == len(keys)
    key = base.graphs.key_of(name)
    assert {"tinygrad", "device", "renderer", "code", "buffers", "graph", "cpu", "threads"} <= set(key)


def test_a_corrupt_entry_is_deleted_and_the_graph_captured_again(graphs_dir):
    captured = serve(stage())
    victim = stage()
    path = victim.graphs.cache.path_of(victim.graphs.key_of(("decode", 1, (0, 3, False))))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    second = stage()
    loaded = serve(second)
    assert second.graphs.stored == ["decode, batch 1 (blocks 0-2)"]  # the corrupt one, captured again
    assert sorted(second.graphs.loaded) == sorted(set(GRAPHS) - {"decode, batch 1 (blocks 0-2)"})
    for a, b in zip(captured, loaded, strict=True):
        np.testing.assert_array_equal(a, b)
    fresh = stage()
    key = fresh.graphs.key_of(("decode", 1, (0, 3, False)))
    assert fresh.graphs.cache.load(key, fresh.graphs.bindings()) is not None  # whole again


def test_a_truncated_or_foreign_file_is_not_used(graphs_dir):
    serve(stage())
    owner = stage()
    graphs = owner.graphs
    cache, name = graphs.cache, ("prefill", False, (0, 3, False))
    path = cache.path_of(graphs.key_of(name))
    whole = path.read_bytes()
    for cut in (1000, 20):  # inside the payload, inside the header
        path.write_bytes(whole[:cut])
        assert cache.load(graphs.key_of(name), graphs.bindings()) is None and not path.exists()
    path.write_bytes(b"not a graph at all")
    assert cache.load(graphs.key_of(name), graphs.bindings()) is None and not path.exists()


def tiny_jit(w):
    """A captured graph that adds the held buffer `w` to its input."""
    from tinygrad import Tensor

    from models.tinygrad_ext.jit import capturing_jit

    jit = capturing_jit(lambda x: (x + w).realize())
    jit(Tensor(np.arange(64, dtype=np.float32)).realize())
    return jit.captured


def test_an_entry_whose_buffers_do_not_fit_the_loader_is_stale_and_deleted(tmp_path):
    from tinygrad import Tensor

    w = Tensor.ones(64).contiguous().realize()
    cache, key = GraphCache(tmp_path), {"graph": "add"}
    assert cache.store(key, tiny_jit(w), named_buffers([("w", w)]))
    other = Tensor.ones(65).contiguous().realize()  # another size under the same name
    assert cache.load(key, named_buffers([("w", other)])) is None and not cache.has(key)
    assert cache.store(key, tiny_jit(w), named_buffers([("w", w)]))
    assert cache.load(key, named_buffers([("v", w)])) is None and not cache.has(key)  # the name is missing
    assert cache.store(key, tiny_jit(w), named_buffers([("w", w)]))
    os.replace(cache.path_of(key), cache.path_of({"graph": "other"}))  # right file, wrong key
    assert cache.load({"graph": "other"}, named_buffers([("w", w)])) is None and not cache.has({"graph": "other"})


def test_a_graph_reading_a_buffer_it_is_not_given_is_not_stored(tmp_path):
    from tinygrad import Tensor

    w = Tensor.ones(64).contiguous().realize()
    cache = GraphCache(tmp_path)
    assert not cache.store({"graph": "add"}, tiny_jit(w), {})  # storing it would copy w
    assert cache.entries() == []


def test_the_cache_keeps_within_its_bound_and_the_least_recently_used_go_first(tmp_path):
    from tinygrad import Tensor

    w = Tensor.ones(64).contiguous().realize()
    bindings, captured = named_buffers([("w", w)]), tiny_jit(w)
    cache = GraphCache(tmp_path)
    assert cache.store({"n": 0}, captured, bindings)
    size = cache.total_bytes()
    cache = GraphCache(tmp_path, max_bytes=int(3.5 * size))
    for n in (1, 2):
        assert cache.store({"n": n}, captured, bindings)
    for n in range(3):
        os.utime(cache.path_of({"n": n}), (1000 + n, 1000 + n))
    assert cache.load({"n": 0}, bindings) is not None  # used now: the most recent
    assert cache.store({"n": 3}, captured, bindings)  # one too many: the least recently used (1) goes
    assert [cache.has({"n": n}) for n in range(4)] == [True, False, True, True]
    assert cache.total_bytes() <= cache.max_bytes
    assert cache.clear() == (3, 3 * size) and cache.entries() == []


def test_warming_from_the_cache_happens_only_when_it_holds_every_graph_needed(graphs_dir):
    cold = stage()
    assert not warm_from_cache(cold)
    assert not cold._prefill_jits and not cold._decode_jits and not cold.graphs.stored  # nothing captured
    cold.warmup(most_requests=1, prompt_scores=False)  # captures and stores prefill and one request's decode
    warm = stage()
    assert warm_from_cache(warm)
    assert sorted(warm.graphs.loaded) == ["decode, batch 1 (blocks 0-2)", "prefill (blocks 0-2)"]
    assert warm.graphs.stored == [] and len(warm.slots) == 0


def test_a_stage_made_with_the_cache_switched_off_neither_replays_nor_keeps_graphs(graphs_dir):
    serve(stage())  # the cache now holds this stage's graphs
    files = sorted(graphs_dir.iterdir())
    with switched_off():
        off = stage()
    assert not warm_from_cache(off)
    serve(off)  # captured, as without a cache
    assert off.graphs.loaded == [] and off.graphs.stored == [] and sorted(graphs_dir.iterdir()) == files
    assert stage().graphs.enabled  # outside, the cache is on again


def test_an_expert_shard_replays_its_stored_graphs(graphs_dir):
    config = MoEConfig(num_blocks=2, dim=64, hidden_dim=32, n_heads=4, n_kv_heads=2, norm_eps=1e-5, vocab_size=96,
                       head_dim=16, rope_theta=10000.0, rope_dim=16, v_head_dim=16, num_experts=4,
                       num_experts_per_tok=2)
    rng = np.random.default_rng(1)
    call = ExpertCall(1, rng.standard_normal((3, 64)).astype(np.float32), np.array([[0, 2], [2, 3], [3, 0]], np.int32),
                      rng.random((3, 2)).astype(np.float32))
    first = ExpertShard.random(config, 5, {1: [0, 2, 3]}, dtype="float32")
    expected = first(call)
    second = ExpertShard.random(config, 5, {1: [0, 2, 3]}, dtype="float32")
    np.testing.assert_array_equal(second(call), expected)
    assert first.graphs.stored == second.graphs.loaded == ["experts, 4 slots of 2 rows"]


SCRIPT = """
import json, sys
import numpy as np
from models.stage import SERVING_NUMERICS, StageInput, StageModel
model = StageModel.from_gguf(sys.argv[1], max_context=32, max_requests=1, numerics=SERVING_NUMERICS)
model.add_request("r")
out = [model.forward([StageInput("r", 0, np.array([5, 17, 42, 8]))])[0]]
out += [model.forward([StageInput("r", p, np.array([p]))])[0] for p in (4, 5)]
print(json.dumps({"loaded": model.graphs.loaded, "stored": model.graphs.stored,
                  "out": [o.tolist() for o in out]}))
"""


def test_a_second_process_replays_what_the_first_captured_from_the_same_gguf(graphs_dir, tiny_quantized_gguf):
    def run() -> dict:
        env = {**os.environ, "SWARMD_GRAPH_CACHE": str(graphs_dir)}
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_quantized_gguf)], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    first, second = run(), run()
    assert first["loaded"] == [] and len(first["stored"]) == 2
    assert second["stored"] == [] and second["loaded"] == first["stored"]
    assert second["out"] == first["out"]


def test_a_stored_graph_that_refuses_its_first_inputs_is_captured_again_and_stored(tmp_path):
    from tinygrad import Tensor

    from models.cached_graphs import StoringJit

    w = Tensor.ones(64).contiguous().realize()
    cache, bindings = GraphCache(tmp_path), named_buffers([("w", w)])
    assert cache.store({"graph": "add"}, tiny_jit(w), bindings)  # made for float32 inputs
    stored = []
    jit = StoringJit(lambda x: (x + w).realize(), stored.append, cache.load({"graph": "add"}, bindings))
    out = jit(Tensor(np.arange(64, dtype=np.int32)).realize())  # int32 inputs: tinygrad refuses the stored graph
    np.testing.assert_array_equal(out.numpy(), np.arange(64) + 1)
    assert stored == [jit]  # captured for these inputs, and handed over to be stored


def test_graphs_built_with_other_kernel_choices_have_another_key(graphs_dir, monkeypatch, tmp_path):
    def key() -> dict:  # of a stage made now (a stage reads the settings as its graphs are keyed)
        made = stage()  # held while keyed: its graphs refer to it weakly
        return made.graphs.key_of(("decode", 1, (0, 3, False)))

    monkeypatch.delenv("SWARMD_TENSOR_CORES", raising=False)
    monkeypatch.delenv("SWARMD_MATVEC_OPTS", raising=False)
    monkeypatch.delenv("SWARMD_TENSOR_CORE_MIN_ROWS", raising=False)
    kernels = ("SWARMD_GEMM", "SWARMD_GEMM_MIN_ROWS", "SWARMD_GEMM_TILING", "SWARMD_BLOCK_GEMV",
               "SWARMD_BLOCK_GEMV_LAYOUT", "SWARMD_LATENT_ATTENTION_KERNEL", "SWARMD_TOP_K_KERNEL",
               "SWARMD_RMS_NORM_KERNEL", "SWARMD_GATED_SUM_KERNEL", "SWARMD_CPU_GEMV",
               "SWARMD_CPU_ATTENTION")
    for variable in kernels:
        monkeypatch.delenv(variable, raising=False)
    plain = key()
    for variable, value in (("SWARMD_TENSOR_CORE_MIN_ROWS", "64"), ("SWARMD_GEMM", "0"),
                            ("SWARMD_GEMM_MIN_ROWS", "64"), ("SWARMD_GEMM_TILING", "64,64,64,2,2,3"),
                            ("SWARMD_BLOCK_GEMV", "0"), ("SWARMD_BLOCK_GEMV_LAYOUT", "4,4,4,1"),
                            ("SWARMD_LATENT_ATTENTION_KERNEL", "0"), ("SWARMD_TOP_K_KERNEL", "0"),
                            ("SWARMD_RMS_NORM_KERNEL", "0"), ("SWARMD_GATED_SUM_KERNEL", "0"),
                            ("SWARMD_CPU_GEMV", "0"), ("SWARMD_CPU_ATTENTION", "0")):
        monkeypatch.setenv(variable, value)
        assert key() != plain, variable
        monkeypatch.delenv(variable)
    monkeypatch.setenv("SWARMD_TENSOR_CORES", "0")
    assert key() != plain
    table = tmp_path / "opts.json"
    table.write_text("{}")
    monkeypatch.setenv("SWARMD_MATVEC_OPTS", str(table))
    keyed = key()
    table.write_text('{"1": [["UNROLL", 0, 4]]}')
    assert key() != keyed  # the table's content, not its path
