"""A jit's inputs go to the device by a copy into buffers kept per slot, shape and dtype, and its outputs come
back by a copy out of their buffer: the same values `Tensor(array)` and `Tensor.numpy()` give, without
running tinygrad's scheduler on every step."""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor

from models.tinygrad_ext.jit import HeldInputs, read_back


def test_held_inputs_are_refilled_in_place_and_each_slot_has_its_own_buffer():
    inputs = HeldInputs("CPU")
    first = inputs(np.arange(6, dtype=np.float32).reshape(2, 3))
    again = inputs(np.full((2, 3), 7, np.float32))
    other_slot = inputs(np.ones((2, 3), np.float32), slot=1)
    assert again is first
    assert other_slot is not first
    np.testing.assert_array_equal(first.numpy(), np.full((2, 3), 7, np.float32))
    np.testing.assert_array_equal(other_slot.numpy(), np.ones((2, 3), np.float32))
    assert inputs(np.zeros((1, 3), np.float32)) is not first  # another shape, another buffer
    assert inputs(np.zeros((2, 3), np.int32)) is not first  # another dtype too


def test_read_back_equals_numpy_for_a_buffer_seen_through_reshapes_and_permutes():
    x = Tensor(np.arange(24, dtype=np.float32)).realize().reshape(2, 3, 4)
    for view in (x, x.permute(2, 0, 1), x.reshape(6, 4).permute(1, 0), x.permute(1, 0, 2).reshape(3, 8)):
        got = read_back(view)
        assert got.flags.c_contiguous
        np.testing.assert_array_equal(got, view.numpy())


def test_read_back_falls_back_to_numpy_for_views_it_does_not_undo_and_unrealized_tensors():
    x = Tensor(np.arange(24, dtype=np.float32)).realize().reshape(4, 6)
    for t in (x[1:3], x.pad(((0, 1), None)), x + 1, x.flip(0)):
        np.testing.assert_array_equal(read_back(t), t.numpy())
