"""silu(gate) * up of a product's output laid out [gate | up], read by one kernel in place.

Written as a product over a (gate, up) axis rather than of two slices: tinygrad writes a tensor out whole before a
kernel reads two different slices of it, and keeps that copy when the tensor's sources reach more than three
buffers, as a hand-written kernel's output often does. A product of two values (times 1) rounds as their product,
so the bits are those of `gate.silu() * up`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinygrad import Tensor


def silu_glu(gate_up: Tensor) -> Tensor:
    """(..., 2F) [gate | up] -> (..., F) silu(gate) * up."""
    from tinygrad import Tensor

    *lead, width = gate_up.shape
    pair = gate_up.reshape(*lead, 2, width // 2)
    gate = Tensor.arange(2, device=gate_up.device).reshape(2, 1) == 0
    return gate.where(pair.silu(), pair).prod(axis=-2)
