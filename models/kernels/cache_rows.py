"""A decode batch's new cache rows written in one kernel.

Each row of a batch writes its token's keys and values (or latent) at its own slot and position. Written as a
store per row, that is a kernel per row and layer; here one kernel takes the slots and positions from two small
index tensors (`models.kernels.attention.batch_rows_at`) and writes every row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinygrad import Tensor


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
