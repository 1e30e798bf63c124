"""A model's configuration from its GGUF metadata, as tinygrad.llm's `TransformerConfig`.

Llama-style models are served (`llama` architecture: SmolLM2, Llama 2/3, Mistral, and with llama.cpp's
expert keys Mixtral-style mixtures of experts), and DeepSeek-V3 / Kimi-K2 style models (`deepseek2`:
multi-head latent attention, `models.deepseek2`); anything else is refused with one line that says so.
"""

from __future__ import annotations

from typing import Any

from models.errors import ModelError
from models.gguf.header import GGUFHeader
from models.moe import MoEConfig

GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE

SUPPORTED_ARCHS = ("llama", "deepseek2")


def _require(header: GGUFHeader, key: str) -> Any:
    full = f"{header.arch}.{key}"
    if full not in header.kv:
        raise ModelError(f"{header.path.name}: GGUF metadata lacks '{full}'; the file is incomplete or not a model")
    return header.kv[full]


def vocab_size(header: GGUFHeader) -> int:
    if (tokens := header.kv.get("tokenizer.ggml.tokens")) is not None:
        return len(tokens)
    if (n := header.arch_key("vocab_size")) is not None:
        return int(n)
    if "token_embd.weight" in header.tensors:
        return header.tensors["token_embd.weight"].shape[0]
    raise ModelError(f"{header.path.name}: cannot tell the vocabulary size (no tokens, vocab_size or token_embd)")


def config_from_header(header: GGUFHeader, max_context: int | None = None) -> MoEConfig:
    """The config (a tinygrad.llm `TransformerConfig`) of a GGUF model; `max_context` is clipped to the
    model's context length. Mixture-of-experts models (llama.cpp's MoE keys) get their MoE fields."""

    arch = header.arch
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(
            f"{header.path.name}: architecture {arch or '(none)'!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)}); use a Llama-family or DeepSeek-V3-family GGUF"
        )
    if arch == "deepseek2":
        from models.deepseek2 import config_from_header as deepseek2_config

        return deepseek2_config(header, vocab_size(header), max_context)
    n_heads = int(_require(header, "attention.head_count"))
    dim = int(_require(header, "embedding_length"))
    head_dim = int(header.arch_key("attention.key_length", dim // n_heads))
    context = int(_require(header, "context_length"))
    n_experts = int(header.arch_key("expert_count", 0))
    ffn = int(_require(header, "feed_forward_length"))
    return MoEConfig(
        num_blocks=int(_require(header, "block_count")),
        dim=dim,
        hidden_dim=int(header.arch_key("expert_feed_forward_length", ffn)) if n_experts else ffn,
        n_heads=n_heads,
        n_kv_heads=int(header.arch_key("attention.head_count_kv", n_heads)),
        norm_eps=float(_require(header, "attention.layer_norm_rms_epsilon")),
        vocab_size=vocab_size(header),
        head_dim=head_dim,
        rope_theta=float(header.arch_key("rope.freq_base", 10000.0)),
        rope_dim=int(header.arch_key("rope.dimension_count", head_dim)),
        v_head_dim=int(header.arch_key("attention.value_length", head_dim)),
        max_context=min(max_context, context) if max_context else context,
        **moe_fields(header, ffn),
    )


def config_from_arch(arch, max_context: int = 2048, rope_theta: float = 500000.0, norm_eps: float = 1e-5):
    """The `TransformerConfig` of a dense built-in architecture (`planner.arch.ArchSpec`), for models with
    seeded random weights: the shapes of the release, Llama 3's RoPE base and RMSNorm epsilon."""
    from tinygrad.llm.model import TransformerConfig

    if arch.is_moe or arch.kv_lora_rank:
        raise ModelError(f"{arch.name}: only dense architectures with plain attention can be built as a stage")
    return TransformerConfig(num_blocks=arch.n_blocks, dim=arch.hidden, hidden_dim=arch.ffn, n_heads=arch.n_heads,
                             n_kv_heads=arch.n_kv_heads, norm_eps=norm_eps, vocab_size=arch.vocab,
                             head_dim=arch.head_dim, rope_theta=rope_theta, rope_dim=arch.head_dim,
                             v_head_dim=arch.head_dim, max_context=max_context)


def moe_fields(header: GGUFHeader, ffn: int) -> dict[str, Any]:
    """The MoE part of the config from llama.cpp's keys (`expert_count`, `expert_used_count`,
    `expert_feed_forward_length`, `expert_shared_count`, `expert_shared_feed_forward_length`,
    `leading_dense_block_count`, `expert_weights_scale`, `expert_weights_norm`,
    `expert_gating_func` (1 softmax, 2 sigmoid)) and which optional tensors the file has."""
    n_experts = int(header.arch_key("expert_count", 0))
    if not n_experts:
        return {}
    top_k = int(header.arch_key("expert_used_count", 0))
    if not 1 <= top_k <= n_experts:
        raise ModelError(f"{header.path.name}: expert_used_count {top_k} is not in [1, {n_experts}]")
    expert_ffn = int(header.arch_key("expert_feed_forward_length", ffn))
    leading = int(header.arch_key("leading_dense_block_count", 0))
    gating = GATING_FUNCS.get(int(header.arch_key("expert_gating_func", 1)))
    if gating is None:
        raise ModelError(f"{header.path.name}: expert_gating_func {header.arch_key('expert_gating_func')} is "
                         "not supported (1 softmax, 2 sigmoid)")
    shared = int(header.arch_key("expert_shared_feed_forward_length",
                                 int(header.arch_key("expert_shared_count", 0)) * expert_ffn))
    return dict(num_experts=n_experts, num_experts_per_tok=top_k, leading_dense_blocks=leading,
                dense_hidden_dim=ffn if leading else 0, shared_expert_dim=shared,
                shared_expert_gate=f"blk.{leading}.ffn_gate_inp_shexp.weight" in header.tensors,
                routed_scaling_factor=float(header.arch_key("expert_weights_scale", 1.0)),
                norm_topk_prob=bool(header.arch_key("expert_weights_norm", False)),
                expert_bias=f"blk.{leading}.exp_probs_b.bias" in header.tensors, expert_gating=gating)
