"""Stop strings in streamed text: pure, so that the single-process loop (`models.generate`) and a swarm's head
(`swarmd.inference.head.session`) cut an output at the same place."""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """Finds stop strings in streamed text; holds back a tail that might still become one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text that is final now, whether a stop string ended the output). The stop string itself
        and anything after it are dropped."""
        buf = self.held + text
        # the stop that completes first ends the output (the longest of those completing at one place):
        # what a streamed output can know, so the cut does not depend on how the text arrives
        hits = [(i + len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)[1]], True
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
