"""The decode batch's latent rows in one kernel (`models.kernels.latent_rows`): its CUDA source builds for a Hopper GPU
without spilling registers, and, on an NVIDIA GPU, it gives the q latents the bits of `rms_norm`'s, and writes each
row's normed kv latent and rotated key into its own slot at its own position, leaving the cache's other rows."""


import numpy as np
import pytest
from tinygrad import Device, Tensor

from models.kernels import cuda
from models.kernels.latent_rows import LatentNorms, latent_rows, latent_rows_fits, source
from models.kernels.rms_norm import rms_norm
from tests.models.sm90 import built_without_spills, needs_nvcc

ON_NVIDIA = cuda.arch(Device.DEFAULT) >= 70
Q, L, R, SLOTS, POSITIONS = 1536, 512, 64, 3, 40


@needs_nvcc
def test_the_kernel_builds_for_hopper_without_spilling_registers(tmp_path):
    built_without_spills(source("latent_rows", Q, L, R, 4160, 1e-6, 1e-6), tmp_path)


def test_it_takes_a_float32_cache_and_a_q_latent_only(monkeypatch):
    monkeypatch.setattr(cuda, "arch", lambda device: 90)
    qkv, cache = Tensor.empty(2, Q + L + R), Tensor.empty(SLOTS, POSITIONS, L + R)
    assert latent_rows_fits(qkv, cache, Q, L, R)
    assert not latent_rows_fits(qkv, cache.half(), Q, L, R)
    assert not latent_rows_fits(Tensor.empty(2, L + R), cache, 0, L, R)  # no q latent: the separate kernels
    monkeypatch.setenv("SWARMD_LATENT_ROWS_KERNEL", "0")
    assert not latent_rows_fits(qkv, cache, Q, L, R)


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
def test_rows_go_normed_and_rotated_into_their_own_slots():
    rng = np.random.default_rng(0)
    qkv = (rng.standard_normal((3, Q + L + R)) * rng.uniform(0.1, 10, (3, 1))).astype(np.float32)
    q_w, kv_w = rng.uniform(0.5, 1.5, Q).astype(np.float32), rng.uniform(0.5, 1.5, L).astype(np.float32)
    angles = rng.uniform(-1, 1, (3, R)).astype(np.float32)
    before = rng.standard_normal((SLOTS, POSITIONS, L + R)).astype(np.float32)
    slots, starts = [2, 0, 1], [0, 39, 17]
    norms = LatentNorms(Tensor(q_w), Tensor(kv_w), 1e-6, 1e-5)
    q_normed, cached = latent_rows(Tensor(qkv), norms, Tensor(angles), Tensor(before.copy()),
                                   Tensor(np.array(slots, np.int32)), Tensor(np.array(starts, np.int32)), q_width=Q)
    after = cached.numpy()
    assert np.array_equal(q_normed.numpy(), rms_norm(Tensor(qkv), Tensor(q_w), 1e-6, columns=(0, Q)).numpy())
    kv = rms_norm(Tensor(qkv), Tensor(kv_w), 1e-5, columns=(Q, L)).numpy()
    half, pe = R // 2, qkv[:, Q + L:]
    cos, sin, x1, x2 = angles[:, :half], angles[:, half:], pe[:, :half], pe[:, half:]
    rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1)  # float32, each step rounded
    want = before.copy()
    for b, (s, p) in enumerate(zip(slots, starts, strict=True)):
        want[s, p] = np.concatenate([kv[b], rotated[b]])
    assert np.array_equal(after, want)


def test_the_kernel_runs_once_for_both_of_its_outputs(monkeypatch):
    """The cache is realised where the kernel is called; the q latents read later must not run the kernel again."""
    from tinygrad import dtypes
    from tinygrad.helpers import GlobalCounters

    monkeypatch.setattr(cuda, "arch", lambda device: 90)

    def empty(*shape, dtype=dtypes.float32):
        return Tensor.empty(*shape, dtype=dtype, device="NULL").realize()

    norms = LatentNorms(empty(Q), empty(L), 1e-6, 1e-6)
    GlobalCounters.reset()
    q_normed, _ = latent_rows(empty(1, Q + L + R), norms, empty(1, R), empty(SLOTS, POSITIONS, L + R),
                              empty(1, dtype=dtypes.int32), empty(1, dtype=dtypes.int32), q_width=Q)
    (q_normed * 2).realize()
    assert GlobalCounters.kernel_count == 2  # the latent rows, then the product
