"""tinygrad's TinyJit, capturing on its first call."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinygrad import TinyJit


def capturing_jit(fn: Callable[..., Any]) -> TinyJit:
    """A TinyJit that captures its graph on the first call instead of the second. TinyJit runs a function
    once untraced first, for state that is made lazily on first use; our stages and expert shards realize
    their weights, KV cache and tables when they load, so that run would only schedule every kernel of
    the graph a second time (seconds of Python per graph and stage on a CPU, before a first token)."""
    from tinygrad import TinyJit

    jit = TinyJit(fn)
    jit.cnt = 1  # TinyJit's own counter: 0 runs untraced, 1 captures, 2+ replays
    return jit
