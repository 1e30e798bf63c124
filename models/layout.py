"""The planner's ModelLayout of a GGUF model, computed from its metadata (no tensor is read).

Sizes are those of a StageModel: float16 weights, a float32 KV cache, float32 activations on the wire.
A mixture-of-experts GGUF gives MoE blocks (`MoESpec`: experts, top-k, bytes per expert), so the
planner places its experts.
"""

from __future__ import annotations

from pathlib import Path

from models.config import config_from_header
from models.gguf.header import GGUFHeader, read_header
from planner.arch import ArchSpec, layout_from_arch
from planner.layout import ModelLayout

WEIGHT_DTYPE = "f16"
KV_BYTES_PER_VALUE = 4
ACTIVATION_BYTES_PER_VALUE = 4


def arch_from_header(header: GGUFHeader) -> ArchSpec:
    c = config_from_header(header)
    name = str(header.kv.get("general.name") or header.path.stem)
    moe = {}
    if c.num_experts:  # routed experts of c.hidden_dim; leading dense blocks and shared experts as sized
        moe = dict(n_experts=c.num_experts, top_k=c.num_experts_per_tok, expert_ffn=c.hidden_dim,
                   n_shared_experts=-(-c.shared_expert_dim // c.hidden_dim), leading_dense=c.leading_dense_blocks)
    return ArchSpec(name=name, n_blocks=c.num_blocks, hidden=c.dim, ffn=c.dense_hidden_dim or c.hidden_dim,
                    n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, vocab=c.vocab_size,
                    tied_head="output.weight" not in header.tensors, **moe)


def layout_from_gguf(path_or_header: str | Path | GGUFHeader, digest: str = "") -> ModelLayout:
    header = path_or_header if isinstance(path_or_header, GGUFHeader) else read_header(path_or_header)
    return layout_from_arch(arch_from_header(header), WEIGHT_DTYPE, kv_bytes_per_value=KV_BYTES_PER_VALUE,
                            activation_bytes_per_value=ACTIVATION_BYTES_PER_VALUE, digest=digest)
