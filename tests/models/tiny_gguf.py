"""Tiny Llama GGUF files written with gguf-py's writer, for loader and stage tests."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TinySpec:
    n_blocks: int = 5
    dim: int = 64
    hidden: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab: int = 96
    context: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def tiny_weights(spec: TinySpec, seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """float32 weights in GGUF layout and numpy order (out, in); Q/K rows in GGUF's interleaved order."""
    rng = np.random.default_rng(seed)
    hd = spec.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(spec.dim)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((spec.vocab, spec.dim)).astype(np.float32)}
    for i in range(spec.n_blocks):
        w |= {
            f"blk.{i}.attn_norm.weight": norm(),
            f"blk.{i}.attn_q.weight": mat(spec.n_heads * hd, spec.dim),
            f"blk.{i}.attn_k.weight": mat(spec.n_kv_heads * hd, spec.dim),
            f"blk.{i}.attn_v.weight": mat(spec.n_kv_heads * hd, spec.dim),
            f"blk.{i}.attn_output.weight": mat(spec.dim, spec.n_heads * hd),
            f"blk.{i}.ffn_norm.weight": norm(),
            f"blk.{i}.ffn_gate.weight": mat(spec.hidden, spec.dim),
            f"blk.{i}.ffn_up.weight": mat(spec.hidden, spec.dim),
            f"blk.{i}.ffn_down.weight": mat(spec.dim, spec.hidden),
        }
    w["output_norm.weight"] = norm()
    if not tied:
        w["output.weight"] = mat(spec.vocab, spec.dim)
    return w


def write_gguf(path: Path, spec: TinySpec, weights: dict[str, np.ndarray], *, arch: str = "llama",
               quant: dict[str, str] | None = None, omit: tuple[str, ...] = ()) -> Path:
    """Write a llama GGUF; `quant` maps tensor names to a GGML type name (e.g. "Q8_0"); `omit` drops
    metadata keys (without the architecture prefix)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    keys = {
        "block_count": lambda: writer.add_block_count(spec.n_blocks),
        "context_length": lambda: writer.add_context_length(spec.context),
        "embedding_length": lambda: writer.add_embedding_length(spec.dim),
        "feed_forward_length": lambda: writer.add_feed_forward_length(spec.hidden),
        "attention.head_count": lambda: writer.add_head_count(spec.n_heads),
        "attention.head_count_kv": lambda: writer.add_head_count_kv(spec.n_kv_heads),
        "attention.layer_norm_rms_epsilon": lambda: writer.add_layer_norm_rms_eps(spec.eps),
        "rope.freq_base": lambda: writer.add_rope_freq_base(spec.rope_theta),
    }
    for key, add in keys.items():
        if key not in omit:
            add()
    return finish(writer, path, weights, quant)


@dataclass(frozen=True)
class TinyMoE:
    """The MoE part of a tiny model: block 0 stays dense, blocks 1.. are MoE blocks."""

    n_experts: int = 6
    top_k: int = 2
    expert_ffn: int = 32
    shared_ffn: int = 32
    gating: int = 2  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
    bias: bool = True
    norm: bool = True
    scale: float = 1.5


def tiny_moe_weights(spec: TinySpec, moe: TinyMoE, seed: int = 0) -> dict[str, np.ndarray]:
    """`tiny_weights` with the FFN of blocks 1.. replaced by a router, routed experts (llama.cpp's
    stacked `ffn_{gate,up,down}_exps`), a selection bias and a gated shared expert."""
    rng = np.random.default_rng(seed + 1000)
    w = tiny_weights(spec, seed)

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)

    for i in range(1, spec.n_blocks):
        for t in ("ffn_gate", "ffn_up", "ffn_down"):
            del w[f"blk.{i}.{t}.weight"]
        e, f, d = moe.n_experts, moe.expert_ffn, spec.dim
        w |= {f"blk.{i}.ffn_gate_inp.weight": mat(e, d), f"blk.{i}.ffn_gate_exps.weight": mat(e, f, d),
              f"blk.{i}.ffn_up_exps.weight": mat(e, f, d), f"blk.{i}.ffn_down_exps.weight": mat(e, d, f)}
        if moe.bias:
            w[f"blk.{i}.exp_probs_b.bias"] = (0.05 * rng.standard_normal(e)).astype(np.float32)
        if moe.shared_ffn:
            s = moe.shared_ffn
            w |= {f"blk.{i}.ffn_gate_shexp.weight": mat(s, d), f"blk.{i}.ffn_up_shexp.weight": mat(s, d),
                  f"blk.{i}.ffn_down_shexp.weight": mat(d, s),
                  f"blk.{i}.ffn_gate_inp_shexp.weight": (rng.standard_normal(d) / math.sqrt(d)).astype(np.float32)}
    return w


def write_moe_gguf(path: Path, spec: TinySpec, moe: TinyMoE, weights: dict[str, np.ndarray], *,
                   quant: dict[str, str] | None = None) -> Path:
    """A tiny MoE GGUF with llama.cpp's expert keys and tensor names."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(spec.n_blocks)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.dim)
    writer.add_feed_forward_length(spec.hidden)
    writer.add_head_count(spec.n_heads)
    writer.add_head_count_kv(spec.n_kv_heads)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_expert_count(moe.n_experts)
    writer.add_expert_used_count(moe.top_k)
    writer.add_expert_feed_forward_length(moe.expert_ffn)
    writer.add_expert_shared_feed_forward_length(moe.shared_ffn)
    writer.add_leading_dense_block_count(1)
    writer.add_expert_weights_scale(moe.scale)
    writer.add_expert_weights_norm(moe.norm)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType(moe.gating))
    return finish(writer, path, weights, quant)


def finish(writer, path: Path, weights: dict[str, np.ndarray], quant: dict[str, str] | None) -> Path:
    """Add `weights` (those named in `quant` quantised to that GGML type) to `writer` and write the file."""
    import gguf

    for name, data in weights.items():
        qtype = (quant or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, data)
        else:
            q = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, gguf.quants.quantize(data, q), raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
