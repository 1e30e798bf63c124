"""The router's top-k as hand-written kernels (`models.kernels.top_k`): their CUDA sources build for a Hopper GPU
without spilling registers, and, on an NVIDIA GPU, they pick what `models.moe.top_k`'s tinygrad kernels pick, and the
whole sigmoid router gives `models.moe.route`'s gates."""


import numpy as np
import pytest
from tinygrad import Device, Tensor

from models.kernels import cuda
from models.kernels.top_k import Routing, routed_top_k, source, top_k_kernel
from tests.models.sm90 import built_without_spills, needs_nvcc

ON_NVIDIA = cuda.arch(Device.DEFAULT) >= 70


@needs_nvcc
@pytest.mark.parametrize("routed", [False, True])
@pytest.mark.parametrize("n", [1024, 384, 40])
def test_the_kernels_build_for_hopper_without_spilling_registers(tmp_path, routed, n):
    built_without_spills(source("top_k", n, 8 if n > 40 else 2, Routing(True, True, 2.827) if routed else None), tmp_path)


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("n,k", [(384, 8), (256, 8), (40, 2)])
def test_it_picks_what_tinygrads_kernels_pick(n, k, monkeypatch):
    from models.moe import top_k

    rng = np.random.default_rng(n)
    x = rng.integers(0, 4, (9, n)).astype(np.float32)  # many ties
    x[3, :] = -np.inf  # a row of a group left out (DeepSeek-V3's group-limited routing)
    x[4, 5::7] = -np.inf
    got = top_k_kernel(Tensor(x), k).numpy()
    monkeypatch.setenv("SWARMD_TOP_K_KERNEL", "0")
    assert np.array_equal(got, top_k(Tensor(x), k).numpy())


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("bias,normalise", [(True, True), (False, True), (True, False)])
def test_the_routed_kernel_gives_the_routers_choice_and_gates(bias, normalise, monkeypatch):
    from types import SimpleNamespace

    from models.moe import route

    rng = np.random.default_rng(7)
    logits = rng.integers(-3, 4, (5, 384)).astype(np.float32)  # many ties
    blk = SimpleNamespace(ffn_gate_inp=None)
    if bias:
        blk.exp_probs_b = {"bias": Tensor(rng.integers(0, 3, 384).astype(np.float32))}
    config = SimpleNamespace(num_experts_per_tok=8, norm_topk_prob=normalise, routed_scaling_factor=2.827,
                             expert_gating="sigmoid", expert_bias=bias, expert_groups=1)
    gates, sel = routed_top_k(Tensor(logits), blk.exp_probs_b["bias"] if bias else None, 8, normalise=normalise,
                              scale=2.827)
    monkeypatch.setenv("SWARMD_TOP_K_KERNEL", "0")
    want_gates, want_sel = route(blk, None, config, logits=Tensor(logits))
    assert np.array_equal(sel.numpy(), want_sel.numpy())
    np.testing.assert_allclose(gates.numpy(), want_gates.numpy(), rtol=1e-5)  # g / sum against tinygrad's g * (1 / sum)
