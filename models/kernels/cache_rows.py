"""A stage's requests writing their new rows into their KV (or latent) cache slots.

Each request of a step writes its tokens' keys and values (or latents) at its own slot and positions. As a store
per request (`write_rows` without index tensors: a prompt chunk, a lone decode row) that is a kernel per request
and layer; a decode batch's rows go in one kernel (`store_rows`) that takes the slots and positions from two small
index tensors (`models.kernels.attention.batch_rows_at`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp


def store_rows(cache: Tensor, new: Tensor, slots: Tensor, starts: Tensor, *, slot_axis: int, row_axis: int) -> Tensor:
    """Write row b of `new` at slot `slots[b]`, position `starts[b]` of `cache`; returns the cache after the write.

    `new` is (B, *the cache's shape without its slot and position axes); `slots` and `starts` are (B,) int32.
    Rows must not share a (slot, position) unless they write the same values (padding rows into a scratch slot)."""
    from tinygrad import UOp, dtypes
    from tinygrad.uop.ops import KernelInfo

    assert slot_axis < row_axis and new.ndim == cache.ndim - 1, (cache.shape, new.shape)
    new = new.cast(cache.dtype)

    def kernel(cache: UOp, new: UOp, slots: UOp, starts: UOp) -> UOp:
        ranges = [UOp.range(n, axis) for axis, n in enumerate(new.shape)]
        b, rest = ranges[0], ranges[1:]
        at = list(rest)
        at.insert(slot_axis, slots[b].cast(dtypes.weakint))
        at.insert(row_axis, starts[b].cast(dtypes.weakint))
        return cache[tuple(at)].store(new[tuple(ranges)]).end(*ranges).sink(arg=KernelInfo(name="store_rows"))

    # realized here: the cache after a kernel call, read by more than one kernel, would be copied whole first
    return cache.custom_kernel(new, slots, starts, fxn=kernel)[0].realize()


def write_rows(cache: Tensor, new: Tensor, slots: Sequence[UOp], starts: Sequence[UOp], *, slot_axis: int,
               row_axis: int, at: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Request b's T new rows, `new[b]` (the cache's shape without its slot axis, T rows on its row axis), into slot
    `slots[b]` from position `starts[b]`; returns the cache after the writes, for the step's reads. `at`: the same
    slots and positions as (B,) tensors, for a decode batch (T = 1): every row in one kernel."""
    from tinygrad import Tensor

    if at is not None:
        return store_rows(cache, new.squeeze(row_axis), *at, slot_axis=slot_axis, row_axis=row_axis)
    T = new.shape[row_axis]

    def view(s: UOp, p: UOp) -> Tensor:
        return cache.shrink(tuple((s, s + 1) if a == slot_axis else (p, p + T) if a == row_axis else None
                                  for a in range(cache.ndim)))

    stores = [view(s, p).uop.store(new[b].unsqueeze(slot_axis).cast(cache.dtype).uop)
              for b, (s, p) in enumerate(zip(slots, starts, strict=True))]
    return Tensor(cache.uop.after(*stores))
