"""Per-request KV caches of a pipeline stage.

`SlotTable` is the bookkeeping (pure Python): which request holds which slot of the pool and how many
tokens its cache holds. `KVPool` holds the tensors: per layer one (2, slots + 1, kv_heads, rows, head_dim)
tensor allocated once; the extra last slot is scratch space for the padding rows of a decode batch.
`LatentPool` is its multi-head latent attention twin: per layer one (slots + 1, rows, latent) tensor, the
compressed latent and rotated key of each token (`models.deepseek2`), no per-head keys or values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from models.errors import ModelError

if TYPE_CHECKING:
    from tinygrad import Tensor


class KVCacheFull(ModelError):
    """Every KV slot of the stage is taken; free a request or retry later."""


@dataclass
class SlotTable:
    n_slots: int
    _slots: dict[str, int] = field(default_factory=dict)
    _lengths: dict[str, int] = field(default_factory=dict)

    def add(self, request_id: str) -> int:
        """Reserve a slot for `request_id` (an already known request keeps its slot and its cache)."""
        if request_id in self._slots:
            return self._slots[request_id]
        free = sorted(set(range(self.n_slots)) - set(self._slots.values()))
        if not free:
            raise KVCacheFull(f"all {self.n_slots} KV cache slots are in use; free a request first")
        self._slots[request_id] = free[0]
        self._lengths[request_id] = 0
        return free[0]

    def free(self, request_id: str) -> None:
        self._slots.pop(request_id, None)
        self._lengths.pop(request_id, None)

    def adopt(self, old_id: str, new_id: str, keep: int) -> None:
        """`new_id` takes over `old_id`'s slot and the first `keep` tokens of its cache (the rest is dropped:
        rows past a request's length are never read, and are overwritten as it grows again)."""
        if old_id not in self._slots:
            raise ModelError(f"unknown request {old_id!r}: nothing to adopt")
        if new_id in self._slots:
            raise ModelError(f"request {new_id!r} already holds a slot")
        if not 0 <= keep <= self._lengths[old_id]:
            raise ModelError(f"cannot keep {keep} tokens of {old_id!r}, which holds {self._lengths[old_id]}")
        self._slots[new_id] = self._slots.pop(old_id)
        del self._lengths[old_id]
        self._lengths[new_id] = keep

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slots

    def request_ids(self) -> list[str]:
        """The requests holding a slot now."""
        return list(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, request_id: str) -> int:
        if request_id not in self._slots:
            raise ModelError(f"unknown request {request_id!r}: add_request() it first")
        return self._slots[request_id]

    def length(self, request_id: str) -> int:
        self.slot(request_id)
        return self._lengths[request_id]

    def set_length(self, request_id: str, n: int) -> None:
        self.slot(request_id)
        self._lengths[request_id] = n


class KVPool:
    """One KV tensor per layer (float32, or float16 as llama.cpp keeps it); rows [0, max_context +
    pad_rows) per slot."""

    def __init__(self, layers: range, n_slots: int, n_kv_heads: int, max_context: int, head_dim: int,
                 device: str, pad_rows: int = 0, dtype: str = "float32"):
        self.scratch_slot = n_slots
        shape = (2, n_slots + 1, n_kv_heads, max_context + pad_rows, head_dim)
        self.layers = _zeroed(layers, shape, dtype, device)

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in self.layers.values())


class LatentPool:
    """One latent cache per layer (float32, or float16 as llama.cpp keeps it): (slots + 1, rows, latent)."""

    def __init__(self, layers: range, n_slots: int, latent: int, max_context: int, device: str,
                 pad_rows: int = 0, dtype: str = "float32"):
        self.scratch_slot = n_slots
        shape = (n_slots + 1, max_context + pad_rows, latent)
        self.layers = _zeroed(layers, shape, dtype, device)

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in self.layers.values())


def _zeroed(layers: range, shape: tuple[int, ...], dtype: str, device: str) -> dict[int, Tensor]:
    """A zeroed tensor of `shape` per layer, realised at once: each realise walks every live tensor of the process."""
    from tinygrad import Tensor

    out = {i: Tensor.zeros(*shape, dtype=dtype, device=device).contiguous() for i in layers}
    if out:
        Tensor.realize(*out.values())
    return out
