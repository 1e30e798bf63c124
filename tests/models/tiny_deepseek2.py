"""Tiny DeepSeek-V3 / Kimi-K2 style GGUF files (architecture `deepseek2`) written with gguf-py's writer, with
the metadata keys and tensor names llama.cpp's converter writes, in either form of the latent's up-projection:
split `attn_k_b`/`attn_v_b` (today's converter) or the legacy `attn_kv_b`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.models.tiny_gguf import finish


@dataclass(frozen=True)
class TinyDeepSeek2:
    n_blocks: int = 3
    dim: int = 64
    n_heads: int = 4
    q_lora: int = 32
    kv_lora: int = 32
    nope: int = 32
    rope: int = 16
    v_dim: int = 32
    dense_ffn: int = 96
    expert_ffn: int = 32
    n_experts: int = 16
    top_k: int = 4
    groups: int = 1
    groups_used: int = 1
    shared: int = 1
    leading_dense: int = 1
    scale: float = 2.5
    vocab: int = 96
    context: int = 4096
    theta: float = 50000.0
    eps: float = 1e-6
    yarn_factor: float = 32.0  # Kimi-K2's: YaRN from an original context of 128 (so short tests reach it)
    yarn_orig: int = 128
    yarn_log_mul: float = 1.0


def tiny_deepseek2_weights(spec: TinyDeepSeek2, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights in GGUF's numpy order, split form (`attn_k_b`, `attn_v_b`)."""
    rng = np.random.default_rng(seed)

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    s, h = spec, spec.n_heads
    w = {"token_embd.weight": rng.standard_normal((s.vocab, s.dim)).astype(np.float32)}
    for i in range(s.n_blocks):
        p = f"blk.{i}."
        w |= {p + "attn_norm.weight": norm(s.dim), p + "attn_q_a.weight": mat(s.q_lora, s.dim),
              p + "attn_q_a_norm.weight": norm(s.q_lora), p + "attn_q_b.weight": mat(h * (s.nope + s.rope), s.q_lora),
              p + "attn_kv_a_mqa.weight": mat(s.kv_lora + s.rope, s.dim), p + "attn_kv_a_norm.weight": norm(s.kv_lora),
              p + "attn_k_b.weight": mat(h, s.kv_lora, s.nope), p + "attn_v_b.weight": mat(h, s.v_dim, s.kv_lora),
              p + "attn_output.weight": mat(s.dim, h * s.v_dim), p + "ffn_norm.weight": norm(s.dim)}
        if i < s.leading_dense:
            w |= {p + "ffn_gate.weight": mat(s.dense_ffn, s.dim), p + "ffn_up.weight": mat(s.dense_ffn, s.dim),
                  p + "ffn_down.weight": mat(s.dim, s.dense_ffn)}
            continue
        e, f = s.n_experts, s.expert_ffn
        w |= {p + "ffn_gate_inp.weight": mat(e, s.dim), p + "exp_probs_b.bias": (0.1 * rng.standard_normal(e)).astype(np.float32),
              p + "ffn_gate_exps.weight": mat(e, f, s.dim), p + "ffn_up_exps.weight": mat(e, f, s.dim),
              p + "ffn_down_exps.weight": mat(e, s.dim, f)}
        if s.shared:
            sf = s.shared * f
            w |= {p + "ffn_gate_shexp.weight": mat(sf, s.dim), p + "ffn_up_shexp.weight": mat(sf, s.dim),
                  p + "ffn_down_shexp.weight": mat(s.dim, sf)}
    w["output_norm.weight"] = norm(s.dim)
    w["output.weight"] = mat(s.vocab, s.dim)
    return w


def joined_kv_b(weights: dict[str, np.ndarray], spec: TinyDeepSeek2) -> dict[str, np.ndarray]:
    """The legacy form: `attn_kv_b` (heads * (nope + v), kv_lora) in place of the split pair."""
    out = {}
    for name, value in weights.items():
        if name.endswith("attn_v_b.weight"):
            continue
        if name.endswith("attn_k_b.weight"):
            v_b = weights[name.replace("attn_k_b", "attn_v_b")]
            kv_b = np.concatenate([value.transpose(0, 2, 1), v_b], axis=1)  # (H, nope + v, L)
            out[name.replace("attn_k_b", "attn_kv_b")] = kv_b.reshape(-1, spec.kv_lora)
            continue
        out[name] = value
    return out


def write_deepseek2_gguf(path: Path, spec: TinyDeepSeek2, weights: dict[str, np.ndarray], *,
                         quant: dict[str, str] | None = None, gating: int = 2) -> Path:
    """Write the model with llama.cpp's `deepseek2` keys; `quant` maps tensor names to GGML type names."""
    import gguf

    split = any(n.endswith("attn_k_b.weight") for n in weights)
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    s = spec
    writer.add_block_count(s.n_blocks)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.dim)
    writer.add_feed_forward_length(s.dense_ffn)
    writer.add_head_count(s.n_heads)
    writer.add_head_count_kv(1 if split else s.n_heads)
    writer.add_rope_freq_base(s.theta)
    writer.add_layer_norm_rms_eps(s.eps)
    writer.add_expert_count(s.n_experts)
    writer.add_expert_used_count(s.top_k)
    writer.add_expert_group_count(s.groups)
    writer.add_expert_group_used_count(s.groups_used)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    writer.add_leading_dense_block_count(s.leading_dense)
    writer.add_vocab_size(s.vocab)
    writer.add_q_lora_rank(s.q_lora)
    writer.add_kv_lora_rank(s.kv_lora)
    if split:  # today's converter: the MQA view of the latent, and the per-head sizes under *_mla
        writer.add_key_length(s.kv_lora + s.rope)
        writer.add_value_length(s.kv_lora)
        writer.add_key_length_mla(s.nope + s.rope)
        writer.add_value_length_mla(s.v_dim)
    else:
        writer.add_key_length(s.nope + s.rope)
        writer.add_value_length(s.v_dim)
    writer.add_expert_feed_forward_length(s.expert_ffn)
    writer.add_expert_shared_count(s.shared)
    writer.add_expert_weights_scale(s.scale)
    writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(s.rope)
    if s.yarn_factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(s.yarn_factor)
        writer.add_rope_scaling_orig_ctx_len(s.yarn_orig)
        writer.add_rope_scaling_yarn_beta_fast(1.0)
        writer.add_rope_scaling_yarn_beta_slow(1.0)
        writer.add_rope_scaling_yarn_log_mul(0.1 * s.yarn_log_mul)
    tokens = [f"<t{i}>" for i in range(s.vocab)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    return finish(writer, path, weights, quant)
