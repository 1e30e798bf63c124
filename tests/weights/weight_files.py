"""GGUF files for the weights tests: a tiny dense model, a tiny MoE model, and one whose tensors span chunks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.models.tiny_gguf import (
    TinyMoE,
    TinySpec,
    tiny_moe_weights,
    tiny_weights,
    write_gguf,
    write_moe_gguf,
)

SPEC = TinySpec(n_blocks=4)
MOE = TinyMoE(n_experts=6, top_k=2)


def dense_gguf(path: Path, seed: int = 0) -> Path:
    return write_gguf(path, SPEC, tiny_weights(SPEC, seed))


def moe_gguf(path: Path, seed: int = 0) -> Path:
    return write_moe_gguf(path, SPEC, MOE, tiny_moe_weights(SPEC, MOE, seed))


def big_gguf(path: Path) -> Path:
    """A model whose embedding (3 MiB of float32) spans four 1 MiB chunks."""
    spec = TinySpec(n_blocks=2, vocab=6144, dim=128, hidden=256, n_heads=4, n_kv_heads=2)
    weights = tiny_weights(spec, 0)
    weights["token_embd.weight"] = np.random.default_rng(1).standard_normal((spec.vocab, spec.dim)).astype(np.float32)
    return write_gguf(path, spec, weights)
