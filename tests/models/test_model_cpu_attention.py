"""The hand-written CPU decode attention in ggml numerics (`models.kernels.cpu_attention`): every row of a step
gets the bits of `ggml_numerics.attention` over its own slot and positions, whatever the heads' grouping, and a
stage's decode steps (a lone row, a batch, a verify step) give the logits they give without it."""

import numpy as np
import pytest
from tinygrad import Tensor

from models.kernels import ggml_numerics
from models.kernels.cpu_attention import cpu_decode_attention
from models.kernels.matvec import tune_cpu_renderer
from models.stage import StageInput, StageModel


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_each_row_gets_the_bits_of_ggml_attention_over_its_own_cache(heads, kv_heads):
    tune_cpu_renderer("CPU")
    rng = np.random.default_rng(heads)
    hd, n_slots, rows = 64, 4, 80
    cache = Tensor(rng.standard_normal((2, n_slots, kv_heads, rows, hd)).astype(np.float16)).realize()
    at = [(1, 0), (0, 5), (3, 79), (2, 17), (0, 8)]  # (slot, position): the first and last rows, 8 at once, a tail
    q = Tensor((rng.standard_normal((len(at), heads, 1, hd)) * 3).astype(np.float32)).realize()
    want = np.stack([ggml_numerics.attention(q[b:b + 1].contiguous(), cache[0, s:s + 1, :, 0:p + 1, :],
                                             cache[1, s:s + 1, :, 0:p + 1, :], None).numpy()[0]
                     for b, (s, p) in enumerate(at)])
    got = cpu_decode_attention(q, cache, Tensor(np.array([s for s, _ in at], np.int32)),
                               Tensor(np.array([p for _, p in at], np.int32))).numpy()
    assert np.array_equal(got, want)


@pytest.mark.slow  # compiles the tiny model's decode graphs twice
def test_a_stages_decode_steps_give_the_logits_they_give_without_it(tiny_quantized_gguf, monkeypatch):
    prompt = np.asarray([3, 9, 27, 81, 50, 7], np.int32)

    def steps(kernel: bool) -> list[np.ndarray]:
        model = StageModel.from_gguf(tiny_quantized_gguf, max_context=64, max_requests=2, numerics="ggml",
                                     dtype="quantized")
        assert model._cpu_attention is kernel  # the comparison is between the two paths, not one path twice
        out = []
        for rid in ("a", "b"):
            model.add_request(rid)
            model.forward([StageInput(rid, 0, prompt)])
        out += model.forward([StageInput("a", 6, np.asarray([11], np.int32))])  # a lone row
        out += model.forward([StageInput("a", 7, np.asarray([12], np.int32)),  # a batch
                              StageInput("b", 6, np.asarray([40], np.int32))])
        out += model.forward([StageInput("b", 7, np.asarray([2, 5, 6], np.int32), verify=True)])  # a verify step
        return out

    monkeypatch.setenv("SWARMD_CPU_ATTENTION", "0")
    without = steps(kernel=False)
    monkeypatch.setenv("SWARMD_CPU_ATTENTION", "1")
    with_kernel = steps(kernel=True)
    assert all(np.array_equal(a, b) for a, b in zip(with_kernel, without, strict=True))
