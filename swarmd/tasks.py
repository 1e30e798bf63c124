"""Starting a task from a callback, in a nursery that a stopping daemon closes.

A service keeps its nursery in an attribute that is None before it starts and after it stops. Between the
two, once the nursery's body is cancelled and its last task ends, trio closes it to new tasks before the
service sees its `async with` exit: `spawn` covers both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio


def spawn(nursery: trio.Nursery | None, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
    """Start `fn(*args)` in `nursery`; False (nothing started) when there is none or it takes no new tasks."""
    if nursery is None:
        return False
    try:
        nursery.start_soon(fn, *args)
    except RuntimeError:  # closed to new arrivals: the daemon is stopping
        return False
    return True
