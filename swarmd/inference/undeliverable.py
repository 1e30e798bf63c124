"""A stage that cannot deliver a request's activations tells the request's head, at once and with the reason.

The actor transport retries a frame until its deadline and then reports it undeliverable. Without this, the
head would hear nothing and wait out its whole first-token (or next-token) timeout; told, it moves the
request to the current chain (an `unreachable` error is a chain error) and, once moving cannot help, fails it
with the reason, which `swarmd submit-prompt` prints before exiting non-zero.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from swarmd.net.identity import short_id
from swarmd.tasks import spawn
from swarmd.wire.messages import Error, Forward, Message, Token, request_id_of

log = logging.getLogger("swarmd.pipeline")


class ReportUndeliverable:
    """The transport's `on_undeliverable`; `install` gives it the transport, the stage actor and a nursery."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.stage: Any = None
        self.peer_id = ""
        self._nursery: trio.Nursery | None = None
        self.reported = 0

    def install(self, transport: Any, stage: Any, peer_id: str, nursery: trio.Nursery) -> None:
        self.transport, self.stage, self.peer_id, self._nursery = transport, stage, peer_id, nursery

    def __call__(self, peer: str, msg: Message, reason: str) -> None:
        rid = request_id_of(msg)
        log.warning("%s for %s to %s not delivered: %s", msg.TAG, rid or "-", peer[:16], reason)
        if not rid or not isinstance(msg, Forward | Token) or (isinstance(msg, Token) and msg.hop != 0):
            return  # only activations on their way along the chain; a token for the head has no one else to tell
        head = self.stage.head_of(rid) if self.stage is not None else None
        if head is None or head == peer or self._nursery is None or self.transport is None:
            return
        step = int(getattr(msg, "step", 0))
        error = Error("unreachable", f"{short_id(self.peer_id)} could not deliver {msg.TAG} to {short_id(peer)}: "
                                     f"{reason}", request_id=rid, step=step, hop=int(getattr(msg, "hop", 0)))
        if spawn(self._nursery, self._tell, head, error):
            self.reported += 1

    async def _tell(self, head: str, error: Error) -> None:
        try:
            await self.transport.post(head, error)
        except Exception as e:  # the head is gone too: its own timeout ends the request
            log.info("could not tell the head %s that %s is stuck: %s", short_id(head), error.request_id, e)
