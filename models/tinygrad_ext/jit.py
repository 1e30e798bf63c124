"""tinygrad's TinyJit, capturing on its first call."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tinygrad import Tensor, TinyJit


def capturing_jit(fn: Callable[..., Any]) -> TinyJit:
    """A TinyJit that captures its graph on the first call instead of the second. TinyJit runs a function
    once untraced first, for state that is made lazily on first use; our stages and expert shards realize
    their weights, KV cache and tables when they load, so that run would only schedule every kernel of
    the graph a second time (seconds of Python per graph and stage on a CPU, before a first token)."""
    from tinygrad import TinyJit

    jit = TinyJit(fn)
    jit.cnt = 1  # TinyJit's own counter: 0 runs untraced, 1 captures, 2+ replays
    return jit


class HeldInputs:
    """A jit's inputs on the device, in buffers kept per argument slot, shape and dtype. `Tensor(array).realize()`
    runs tinygrad's scheduler (1-2 ms of Python per call on a small CPU, more than a small kernel's run);
    a copy into a buffer the graphs already know is a memcpy. The caller reads each step's output back
    (which waits for the device) before the next step, so no kernel still reads a buffer it overwrites."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._held: dict[tuple[int, tuple[int, ...], str], Tensor] = {}

    def __call__(self, data: np.ndarray, slot: int = 0) -> Tensor:
        from tinygrad import Tensor

        key = (slot, data.shape, data.dtype.char)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = Tensor(data, device=self.device).realize()
        else:
            held.uop.base.realized.copyin(memoryview(np.ascontiguousarray(data)))
        return held


def read_back(t: Tensor) -> np.ndarray:
    """`t.numpy()` for a jit's output. A realized buffer seen through reshapes and permutes (how a graph's
    output comes back) is copied out of the buffer and rearranged in numpy (the copy waits for the device);
    `Tensor.numpy()` would first schedule a contiguous copy on the device, a millisecond of Python or more."""
    from tinygrad.uop.ops import Ops

    views = []
    u = t.uop
    while u is not u.base:
        if u.op not in (Ops.RESHAPE, Ops.PERMUTE):
            return t.numpy()
        views.append(u)
        u = u.src[0]
    buf = u.realized
    if buf is None or buf.dtype != t.dtype:
        return t.numpy()
    out = buf.numpy()
    for v in reversed(views):
        out = out.reshape(v.shape) if v.op is Ops.RESHAPE else out.transpose(v.arg)
    return np.ascontiguousarray(out)
