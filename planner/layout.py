"""ModelLayout: what the planner needs to know about a model, block by block.

One schema for the whole project: `models/` computes it from a GGUF's metadata, the built-in
layouts in `planner.arch` compute it from public configurations, and the planner and simulator
read it. All sizes are bytes for one copy of the weights in the layout's dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from planner.errors import PlanSchemaError


@dataclass(frozen=True)
class MoESpec:
    """The routed part of a mixture-of-experts block."""

    n_experts: int  # routed experts
    top_k: int
    bytes_per_expert: int
    flops_per_expert_token: int  # FLOPs one expert spends on one token
    n_shared: int = 0  # shared experts, always active; their bytes are in the block's dense part
    n_groups: int = 0  # DeepSeek-style group-limited routing (0: none)
    topk_groups: int = 0


@dataclass(frozen=True)
class BlockLayout:
    """One transformer block. `param_bytes`/`flops_per_token` cover everything except routed experts."""

    param_bytes: int
    flops_per_token: int
    kv_bytes_per_token: int
    activation_bytes: int  # one token's hidden state leaving the block, in the wire dtype
    attn_flops_per_context_token: int = 0  # extra FLOPs per token per token already in the context
    moe: MoESpec | None = None

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + (self.moe.n_experts * self.moe.bytes_per_expert if self.moe else 0)


@dataclass(frozen=True)
class ModelLayout:
    name: str
    dtype: str
    blocks: tuple[BlockLayout, ...]
    embedding_bytes: int
    head_bytes: int  # output norm + LM head (0 extra when tied and on the same node as the embedding)
    head_flops_per_token: int
    hidden_size: int
    vocab_size: int
    digest: str = ""
    tied_head: bool = False  # the head is the embedding matrix: one copy when both sit on one node
    stored_bytes: int = 0  # the weights as the model file stores them (what fetching them moves); 0: unknown

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def is_moe(self) -> bool:
        return any(b.moe is not None for b in self.blocks)

    @property
    def total_bytes(self) -> int:
        return self.embedding_bytes + self.head_bytes + sum(b.total_bytes for b in self.blocks)

    def moe_blocks(self) -> list[int]:
        return [i for i, b in enumerate(self.blocks) if b.moe is not None]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(doc: dict[str, Any]) -> ModelLayout:
        try:
            blocks = tuple(
                BlockLayout(**{**b, "moe": MoESpec(**b["moe"]) if b.get("moe") else None}) for b in doc["blocks"]
            )
            return ModelLayout(**{**doc, "blocks": blocks})
        except (KeyError, TypeError) as e:
            raise PlanSchemaError(f"bad ModelLayout document: {e}") from e
