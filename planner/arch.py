"""Architectures by their public configuration numbers, and the ModelLayout they give.

`layout_from_arch` is the one place that turns an architecture into bytes and FLOPs, so the
built-in layouts and the layouts `models/` reads from GGUF metadata agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlanSchemaError
from planner.layout import BlockLayout, ModelLayout, MoESpec

# Bytes per parameter as stored. int4/int8 carry one float16 scale per block of 32 (GGUF Q4_0/Q8_0).
BYTES_PER_PARAM: dict[str, float] = {
    "int4": 4.5 / 8,
    "int8": 8.5 / 8,
    "bf16": 2.0,
    "f16": 2.0,
    "f32": 4.0,
}


@dataclass(frozen=True)
class ArchSpec:
    name: str
    n_blocks: int
    hidden: int
    ffn: int  # dense FFN width (leading dense blocks of a MoE use it too)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    tied_head: bool = False
    # mixture of experts
    n_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    n_shared_experts: int = 0
    leading_dense: int = 0
    n_groups: int = 0
    topk_groups: int = 0
    # multi-head latent attention (DeepSeek/Kimi); kv_lora_rank > 0 turns it on
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0
    qk_nope_dim: int = 0

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def attention_params(self) -> int:
        h = self.hidden
        if self.kv_lora_rank:
            q_head = self.qk_nope_dim + self.rope_dim
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.n_heads * q_head \
                if self.q_lora_rank else h * self.n_heads * q_head
            kv = h * (self.kv_lora_rank + self.rope_dim) + self.kv_lora_rank \
                + self.kv_lora_rank * self.n_heads * (self.qk_nope_dim + self.v_head_dim)
            return q + kv + self.n_heads * self.v_head_dim * h
        return h * self.n_heads * self.head_dim * 2 + h * self.n_kv_heads * self.head_dim * 2

    def kv_values_per_token(self) -> int:
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.rope_dim  # the compressed latent is what MLA caches
        return 2 * self.n_kv_heads * self.head_dim

    def attn_flops_per_context_token(self) -> int:
        if self.kv_lora_rank:
            return 2 * self.n_heads * (self.kv_lora_rank + self.rope_dim) * 2
        return 2 * self.n_heads * self.head_dim * 2

    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_ffn

    def total_params(self) -> int:
        dense_ffn = 3 * self.hidden * self.ffn
        per_block = []
        for i in range(self.n_blocks):
            p = self.attention_params() + 2 * self.hidden
            if self.is_moe and i >= self.leading_dense:
                p += self.hidden * self.n_experts + (self.n_experts + self.n_shared_experts) * self.expert_params()
            else:
                p += dense_ffn
            per_block.append(p)
        head = 0 if self.tied_head else self.vocab * self.hidden
        return sum(per_block) + self.vocab * self.hidden + head + self.hidden


def layout_from_arch(
    arch: ArchSpec,
    dtype: str,
    *,
    kv_bytes_per_value: int = 2,
    activation_bytes_per_value: int = 2,
    digest: str = "",
    name: str | None = None,
) -> ModelLayout:
    """The ModelLayout of `arch` with weights stored as `dtype`."""
    if dtype not in BYTES_PER_PARAM:
        raise PlanSchemaError(f"unknown dtype {dtype!r}; known: {', '.join(BYTES_PER_PARAM)}")
    bpp = BYTES_PER_PARAM[dtype]
    h = arch.hidden
    norms = 2 * h
    blocks = []
    for i in range(arch.n_blocks):
        attn = arch.attention_params()
        moe = None
        if arch.is_moe and i >= arch.leading_dense:
            shared = arch.n_shared_experts * arch.expert_params()
            router = h * arch.n_experts
            dense_params = attn + norms + router + shared
            flops = 2 * (attn + router + shared)
            moe = MoESpec(
                n_experts=arch.n_experts,
                top_k=arch.top_k,
                bytes_per_expert=int(arch.expert_params() * bpp),
                flops_per_expert_token=2 * arch.expert_params(),
                n_shared=arch.n_shared_experts,
                n_groups=arch.n_groups,
                topk_groups=arch.topk_groups,
            )
        else:
            ffn = 3 * h * arch.ffn
            dense_params = attn + norms + ffn
            flops = 2 * (attn + ffn)
        blocks.append(
            BlockLayout(
                param_bytes=int(dense_params * bpp),
                flops_per_token=flops,
                kv_bytes_per_token=arch.kv_values_per_token() * kv_bytes_per_value,
                activation_bytes=h * activation_bytes_per_value,
                attn_flops_per_context_token=arch.attn_flops_per_context_token(),
                moe=moe,
            )
        )
    # A tied head still needs its own copy of the embedding on the last stage's node.
    head_bytes = int((arch.vocab * h + h) * bpp)
    return ModelLayout(
        name=name or arch.name,
        dtype=dtype,
        blocks=tuple(blocks),
        embedding_bytes=int(arch.vocab * h * bpp),
        head_bytes=head_bytes,
        head_flops_per_token=2 * arch.vocab * h,
        hidden_size=h,
        vocab_size=arch.vocab,
        digest=digest,
        tied_head=arch.tied_head,
    )


# Public configurations (config.json of each release); numbers only, no weights.
BUILTIN_ARCHS: dict[str, ArchSpec] = {
    a.name: a
    for a in (
        ArchSpec("smollm2-135m", n_blocks=30, hidden=576, ffn=1536, n_heads=9, n_kv_heads=3, head_dim=64,
                 vocab=49152, tied_head=True),
        ArchSpec("llama-3.2-1b", n_blocks=16, hidden=2048, ffn=8192, n_heads=32, n_kv_heads=8, head_dim=64,
                 vocab=128256, tied_head=True),
        ArchSpec("llama-3.1-8b", n_blocks=32, hidden=4096, ffn=14336, n_heads=32, n_kv_heads=8, head_dim=128,
                 vocab=128256),
        ArchSpec("llama-3-70b", n_blocks=80, hidden=8192, ffn=28672, n_heads=64, n_kv_heads=8, head_dim=128,
                 vocab=128256),
        ArchSpec("mixtral-8x7b", n_blocks=32, hidden=4096, ffn=14336, n_heads=32, n_kv_heads=8, head_dim=128,
                 vocab=32000, n_experts=8, top_k=2, expert_ffn=14336),
        ArchSpec("deepseek-v3", n_blocks=61, hidden=7168, ffn=18432, n_heads=128, n_kv_heads=128, head_dim=192,
                 vocab=129280, n_experts=256, top_k=8, expert_ffn=2048, n_shared_experts=1, leading_dense=3,
                 n_groups=8, topk_groups=4, q_lora_rank=1536, kv_lora_rank=512, rope_dim=64, v_head_dim=128,
                 qk_nope_dim=128),
        ArchSpec("kimi-k2", n_blocks=61, hidden=7168, ffn=18432, n_heads=64, n_kv_heads=64, head_dim=192,
                 vocab=163840, n_experts=384, top_k=8, expert_ffn=2048, n_shared_experts=1, leading_dense=1,
                 q_lora_rank=1536, kv_lora_rank=512, rope_dim=64, v_head_dim=128, qk_nope_dim=128),
    )
}


def default_dtype(arch: ArchSpec) -> str:
    """int4 for models over 100 B parameters, bf16 otherwise (what `swarmd plan` assumes by name)."""
    return "int4" if arch.total_params() > 100e9 else "bf16"
