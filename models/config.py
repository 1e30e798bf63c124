"""A model's configuration from its GGUF metadata, as tinygrad.llm's `TransformerConfig`.

Only dense Llama-style models are served for now (`llama` architecture: SmolLM2, Llama 2/3, Mistral);
anything else is refused with one line that says so.
"""

from __future__ import annotations

from typing import Any

from models.errors import ModelError
from models.gguf_meta import GGUFHeader

SUPPORTED_ARCHS = ("llama",)


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


def config_from_header(header: GGUFHeader, max_context: int | None = None):  # -> TransformerConfig
    """The `TransformerConfig` of a GGUF model; `max_context` is clipped to the model's context length."""
    from tinygrad.llm.model import TransformerConfig

    arch = header.arch
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(
            f"{header.path.name}: architecture {arch or '(none)'!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)}); use a Llama-family GGUF"
        )
    if header.arch_key("expert_count", 0):
        raise ModelError(f"{header.path.name}: mixture-of-experts GGUFs are not supported yet; use a dense model")
    n_heads = int(_require(header, "attention.head_count"))
    dim = int(_require(header, "embedding_length"))
    head_dim = int(header.arch_key("attention.key_length", dim // n_heads))
    context = int(_require(header, "context_length"))
    return TransformerConfig(
        num_blocks=int(_require(header, "block_count")),
        dim=dim,
        hidden_dim=int(_require(header, "feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(header.arch_key("attention.head_count_kv", n_heads)),
        norm_eps=float(_require(header, "attention.layer_norm_rms_epsilon")),
        vocab_size=vocab_size(header),
        head_dim=head_dim,
        rope_theta=float(header.arch_key("rope.freq_base", 10000.0)),
        rope_dim=int(header.arch_key("rope.dimension_count", head_dim)),
        v_head_dim=int(header.arch_key("attention.value_length", head_dim)),
        max_context=min(max_context, context) if max_context else context,
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
