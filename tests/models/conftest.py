"""Fixtures for model tests: tiny GGUF models written in the test, and block buffers that leave the KV cache out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny_gguf import TinySpec, tiny_weights, write_gguf

# Tensors stored quantised in the tiny model, so the loader's dequantisation path is exercised too.
TINY_QUANT = {"blk.1.ffn_up.weight": "Q8_0", "blk.2.attn_q.weight": "Q4_1", "blk.3.attn_k.weight": "Q4_0"}
# Every matrix quantised, matrices that are fused together (Q/K/V, gate/up) of one kind.
BLOCK_KINDS = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0", "ffn_gate": "Q8_0",
               "ffn_up": "Q8_0", "ffn_down": "Q4_1"}


@pytest.fixture(scope="session", autouse=True)
def tinygrad_here(tinygrad_in_process) -> None:
    """Every model test runs tinygrad in this process."""


@pytest.fixture(scope="session")
def tiny_spec() -> TinySpec:
    return TinySpec()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_spec) -> Path:
    """A 5-block llama GGUF with a tied head and a few quantised tensors."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, tiny_spec, tiny_weights(tiny_spec, seed=1), quant=TINY_QUANT)


@pytest.fixture(scope="session")
def tiny_quantized_gguf(tmp_path_factory, tiny_spec) -> Path:
    """The tiny model with every matrix in GGML blocks (Q4_0, Q4_1, Q8_0) and a Q8_0 embedding."""
    weights = tiny_weights(tiny_spec, seed=1)
    quant = {n: BLOCK_KINDS[n.split(".")[2]] for n in weights if n.startswith("blk.") and n.split(".")[2] in BLOCK_KINDS}
    path = tmp_path_factory.mktemp("gguf") / "tiny-q.gguf"
    return write_gguf(path, tiny_spec, weights, quant=quant | {"token_embd.weight": "Q8_0"})


@pytest.fixture
def kv_cache_left_out_of_block_buffers(monkeypatch) -> None:
    """`cached_graphs.block_buffers` as if a block's KV cache were not among its buffers: a graph made from a
    block's buffers then reads one of the block's own all the same."""
    from models import cached_graphs

    buffers = cached_graphs.block_buffers

    def without_the_kv_cache(owner, **kw):
        out = {}
        for block, (names, bufs) in buffers(owner, **kw).items():
            kept = [(n, u) for n, u in zip(names, bufs, strict=True) if not n.startswith("kv.")]
            out[block] = ([n for n, _ in kept], [u for _, u in kept])
        return out

    monkeypatch.setattr(cached_graphs, "block_buffers", without_the_kv_cache)
