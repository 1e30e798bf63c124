"""tinygrad's TinyJit, capturing on its first call; the calls of one piece of a capture, recorded again on other buffers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from tinygrad import Tensor, TinyJit
    from tinygrad.uop.ops import UOp


class Bind(NamedTuple):
    """A variable's value for one call of a graph, bound into a UOp only where the jit captures or checks its
    inputs: a replay needs only the value, and binding costs about 15 us (tens of variables a decode step)."""

    name: str
    lo: int
    hi: int
    value: int

    def uop(self) -> UOp:
        from tinygrad import UOp

        return UOp.variable(self.name, self.lo, self.hi).bind(self.value)


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


def capturing() -> bool:
    """Whether a TinyJit is capturing its graph on this thread now."""
    from tinygrad.engine.realize import capturing as jits

    return bool(jits)


class RecordedCalls:
    """The calls a capturing TinyJit recorded while one piece of its function ran (`record`), to be recorded
    again on other buffers (`again`): a stage's blocks alike then cost one block's graph building and
    scheduling, most of a capture's time, and a substitution each for the others. The graph comes out as if
    each block had been built: the same kernels on each block's own buffers, in the same order."""

    def __init__(self, calls: list[UOp], made: set[UOp]) -> None:
        self.calls = calls  # the LINEARs scheduled while recording
        self.made = made  # the buffers those calls made (intermediates, outputs): fresh ones on each repeat

    @classmethod
    def record(cls, build: Callable[[], Tensor]) -> tuple[Tensor, RecordedCalls]:
        """`build()` realized inside the capture, and the calls it added. Only while `capturing()`."""
        from tinygrad.engine.realize import capturing as jits

        jit = jits[0]
        before = len(jit._linears)
        out = build().realize()
        calls = jit._linears[before:]
        earlier = {u for lin in jit._linears[:before] for u in _buffers_of(lin)}
        return out, cls(calls, {u for lin in calls for u in _buffers_of(lin) if u not in earlier and not _held(u)})

    def buffers(self) -> set[UOp]:
        """Every buffer the recorded calls read or write."""
        return {u for lin in self.calls for u in _buffers_of(lin)}

    def again(self, swap: Mapping[UOp, UOp], out: Tensor) -> Tensor:
        """Add the recorded calls to the capture again, on `swap`'s buffers for its keys and on fresh buffers for
        those the calls made; returns `out` (a tensor the recorded calls computed) as the new calls compute it."""
        from tinygrad.engine.realize import capturing as jits
        from tinygrad.tensor import Tensor
        from tinygrad.uop.ops import UOp

        mapping = {**{u: UOp.new_buffer(u.device, u.arg, u.dtype) for u in self.made}, **swap}
        jit = jits[0]
        for lin in self.calls:
            jit._linears.append(lin.substitute(mapping, walk=True))
        return Tensor(out.uop.substitute(mapping, walk=True))


def _buffers_of(linear: UOp) -> list[UOp]:
    from tinygrad.uop.ops import Ops

    return [u for call in linear.src for s in call.src[1:] for u in s.toposort() if u.op is Ops.BUFFER]


def _held(u: UOp) -> bool:
    """A buffer that exists outside the graph (weights, caches, the jit's inputs): it has a device buffer."""
    from tinygrad.uop.ops import buffers

    return u in buffers
