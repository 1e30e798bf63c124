"""The code paths written for GPUs, checked on the CPU: decode attention over whole cache tiles, the
CUDA graph launch-dimension fix, and architectures built from their public shapes."""

import ctypes

import numpy as np
import pytest

from models.config import config_from_arch
from models.errors import ModelError
from models.stage import StageInput, StageModel
from models.tinygrad_ext.cuda_graph import add_kernel_node_with_nonzero_dims
from planner.arch import BUILTIN_ARCHS, ArchSpec
from swarmd.daemon.descriptor import smi_id

TINY = ArchSpec("tiny", n_blocks=2, hidden=128, ffn=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=500)


def decode_logits(tile: int) -> np.ndarray:
    """Two requests of different lengths decoded together for 12 steps, across several tile borders."""
    model = StageModel.random(config_from_arch(TINY, 48), seed=5, max_context=48, max_requests=2,
                              dtype="float32", attention_tile=tile, prefill_chunk=8)
    lengths, tokens = {"a": 11, "b": 5}, {}
    for rid, n in lengths.items():
        model.add_request(rid)
        tokens[rid] = int(model.forward([StageInput(rid, 0, np.arange(1, n + 1))])[0].argmax())
    steps = []
    for _ in range(12):
        out = model.forward([StageInput(r, lengths[r], np.array([tokens[r]])) for r in lengths])
        for r, logits in zip(lengths, out, strict=True):
            tokens[r], lengths[r] = int(logits.argmax()), lengths[r] + 1
        steps.append(np.stack(out))
    return np.stack(steps)


@pytest.mark.slow
def test_decode_attention_over_cache_tiles_equals_attention_over_the_exact_length():
    exact, tiled = decode_logits(tile=0), decode_logits(tile=8)
    assert np.abs(exact - tiled).max() < 1e-4 * np.abs(exact).max()


class Params(ctypes.Structure):
    _fields_ = [(d, ctypes.c_uint32) for d in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY",
                                                "blockDimZ")]


def test_a_graph_node_refused_for_a_zero_grid_is_added_with_the_grid_raised_to_one():
    seen = []

    def driver(node, graph, deps, ndeps, ref):  # refuses zero dimensions, as the CUDA driver does
        dims = [getattr(ref._obj, f) for f, _ in Params._fields_]
        seen.append(dims)
        return 1 if 0 in dims else 0

    params = Params(0, 1, 1, 8, 1, 1)
    assert add_kernel_node_with_nonzero_dims(driver, None, None, None, 0, ctypes.byref(params)) == 0
    assert seen == [[0, 1, 1, 8, 1, 1], [1, 1, 1, 8, 1, 1]]


def test_a_graph_node_refused_for_another_reason_is_not_retried():
    calls = []
    params = Params(4, 1, 1, 8, 1, 1)
    status = add_kernel_node_with_nonzero_dims(lambda *a: calls.append(a) or 1, None, None, None, 0,
                                               ctypes.byref(params))
    assert status == 1 and len(calls) == 1


def test_builtin_dense_architectures_give_their_configurations():
    config = config_from_arch(BUILTIN_ARCHS["llama-3.1-8b"], max_context=1024)
    assert (config.num_blocks, config.dim, config.hidden_dim, config.n_heads, config.n_kv_heads,
            config.head_dim, config.vocab_size, config.max_context) == (32, 4096, 14336, 32, 8, 128, 128256, 1024)
    with pytest.raises(ModelError, match="only dense"):
        config_from_arch(BUILTIN_ARCHS["mixtral-8x7b"])


def test_nvidia_smi_is_asked_about_the_gpu_that_cuda_visible_devices_maps_to(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert smi_id("CUDA") == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert smi_id("CUDA:1") == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert smi_id("CUDA:1") == "1"
