"""An assignment in chunks, and chunks held in the planner's terms.

A stage [a, b) needs the tensors `models.gguf.loader.stage_tensor_names` lists (the embedding on the first
stage, the output norm and head on the last; a MoE stage leaves its routed experts to the expert holders);
an expert shard needs its experts' slices of the stacked expert tensors. `holdings` says what a daemon holds
as `planner.holdings` writes it, for its descriptor.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from models.gguf.header import GGUFHeader
from models.gguf.loader import ROUTED_TENSORS, block_tensor_names, head_tensor_name, stage_tensor_names
from models.gguf.manifest import Manifest
from planner.holdings import format_holdings


class ModelParts:
    """The chunks of a model's parts, computed once from its manifest."""

    def __init__(self, manifest: Manifest, header: GGUFHeader, n_blocks: int, is_moe: bool) -> None:
        self.manifest, self.header, self.n_blocks, self.is_moe = manifest, header, n_blocks, is_moe
        self._blocks = {i: manifest.chunks_of(block_tensor_names(header, i, routed=False)) for i in range(n_blocks)}
        self._embedding = manifest.chunks_of(["token_embd.weight"])
        self._head = manifest.chunks_of(["output_norm.weight", head_tensor_name(header)])
        self._experts = {i: self._stacked(i) for i in range(n_blocks) if self._stacked(i)}
        self._cache: tuple[int, tuple[str, ...]] | None = None

    def _stacked(self, block: int) -> int:
        """Experts in block `block`'s stacked tensors (0: a dense block)."""
        name = f"blk.{block}.{ROUTED_TENSORS[0]}"
        return self.manifest.tensor(name).units if name in self.header.tensors else 0

    def stage(self, layers: tuple[int, int]) -> list[int]:
        a, b = layers
        return self.manifest.chunks_of(stage_tensor_names(self.header, a, b, self.n_blocks, routed=not self.is_moe))

    def experts(self, experts: Mapping[int, Sequence[int]]) -> list[int]:
        return self.manifest.chunks_of((), experts) if experts else []

    def assignment(self, layers: tuple[int, int] | None, experts: Mapping[int, Sequence[int]]) -> list[int]:
        return sorted(set(self.stage(layers) if layers else []) | set(self.experts(experts)))

    def holdings(self, held: Collection[int]) -> tuple[str, ...]:
        """What `held` (chunk indices) covers, as a descriptor says it; remembered for the same count."""
        if self._cache is not None and self._cache[0] == len(held):
            return self._cache[1]
        have = set(held)
        if len(have) == len(self.manifest.chunks):
            out: tuple[str, ...] = ("*",)
        else:
            experts = {b: [e for e in range(n) if all(c in have for c in self.manifest.chunks_of((), {b: [e]}))]
                       for b, n in self._experts.items()}
            out = format_holdings(embedding=all(c in have for c in self._embedding),
                                  head=all(c in have for c in self._head),
                                  blocks=[i for i, cs in self._blocks.items() if all(c in have for c in cs)],
                                  experts=experts)
        self._cache = (len(held), out)
        return out
