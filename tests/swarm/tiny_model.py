"""A tiny Llama GGUF with seeded random weights: a real model file that loads in a blink.

Daemon tests serve it instead of SmolLM2 so that loading stages does not dominate their time;
everything else (resolving, digest, layout from the header, StageModel loading) is the real path.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def write_tiny_llama(path: Path, *, n_blocks: int = 8, dim: int = 64, ffn: int = 128, n_heads: int = 4,
                     n_kv_heads: int = 2, vocab: int = 256, seed: int = 0, byte_tokenizer: bool = False,
                     scale: float = 0.05) -> Path:
    """With `byte_tokenizer`, a byte-level tokenizer of `vocab` (>= 257) tokens is written too, as seeded
    models have: then the file serves text prompts, not only token ids. `scale` is the weights' spread (wider
    weights give more varied greedy tokens)."""
    rng = np.random.default_rng(seed)
    head_dim = dim // n_heads

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    if byte_tokenizer:
        from models.catalog.seeded import write_byte_level_tokenizer

        write_byte_level_tokenizer(w, vocab)
    w.add_name("tiny-llama")
    w.add_block_count(n_blocks)
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tensor("token_embd.weight", weight(vocab, dim))
    for i in range(n_blocks):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(dim, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", weight(n_heads * head_dim, dim))
        w.add_tensor(f"blk.{i}.attn_k.weight", weight(n_kv_heads * head_dim, dim))
        w.add_tensor(f"blk.{i}.attn_v.weight", weight(n_kv_heads * head_dim, dim))
        w.add_tensor(f"blk.{i}.attn_output.weight", weight(dim, n_heads * head_dim))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(dim, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(ffn, dim))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weight(ffn, dim))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weight(dim, ffn))
    w.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
