"""The guard around every stream a daemon serves through the network seam (`Network.serve`).

Before the handler runs: a refused peer (not on the allowlist, penalised) gets its stream reset; so does a
peer over its rate of new streams or its number of open streams for that protocol (a strike each). While it
runs: every read has a timeout (`GuardLimits.read_timeout`), so a peer that opens a stream and goes quiet
holds nothing for long. When the handler raises `RemoteProtocolError` (a bad frame) the peer gets a strike;
enough strikes and the gate penalises the peer (its `on_penalised` drops the peer's connections). Nothing a
peer sends ends the daemon or another peer's stream.
"""

from __future__ import annotations

import logging
from collections import Counter

import trio

from swarmd.errors import RemoteProtocolError
from swarmd.net.gate import PeerGate
from swarmd.net.identity import short_id
from swarmd.net.seam import Stream, StreamClosed, StreamHandler

log = logging.getLogger(__name__)

class ReadTimedOut(StreamClosed):
    """A served stream said nothing for `read_timeout` seconds."""


class TimedStream:
    """A served stream whose every read gives up after `timeout` seconds."""

    def __init__(self, stream: Stream, timeout: float) -> None:
        self._stream = stream
        self._timeout = timeout

    async def read(self, n: int) -> bytes:
        with trio.move_on_after(self._timeout):
            return await self._stream.read(n)
        raise ReadTimedOut(f"nothing read for {self._timeout:g} s")

    async def write(self, data: bytes) -> None:
        with trio.move_on_after(self._timeout):
            await self._stream.write(data)
            return
        raise ReadTimedOut(f"a write took over {self._timeout:g} s (the peer does not read)")

    async def close(self) -> None:
        await self._stream.close()

    async def reset(self) -> None:
        await self._stream.reset()


class StreamGuard:
    """Runs handlers of served protocols under the gate's rules; one per network endpoint."""

    def __init__(self, gate: PeerGate) -> None:
        self.gate = gate
        self.open: Counter[tuple[str, str]] = Counter()  # (peer, protocol) -> streams being served
        self.stats: Counter[str] = Counter()

    def wrap(self, protocol: str, handler: StreamHandler, *, long_lived: bool = False) -> StreamHandler:
        async def guarded(peer: str, stream: Stream) -> None:
            await self.run(protocol, handler, peer, stream, long_lived=long_lived)

        return guarded

    async def run(self, protocol: str, handler: StreamHandler, peer: str, stream: Stream, *,
                  long_lived: bool = False) -> None:
        """Serve one inbound stream of `protocol` from `peer`; never raises. A `long_lived` stream (a transport
        link, which checks liveness and limits its streams itself) has no read timeout and no cap here."""
        now = trio.current_time()
        gate, lim = self.gate, self.gate.limits
        refusal = gate.refusal(peer, now)
        if refusal is not None:
            self.stats["streams_refused"] += 1
            await _reset(stream)
            return
        key = (peer, protocol)
        if not gate.within_rate(peer, f"stream:{protocol}", now, lim.stream_opens_per_second, lim.stream_open_burst):
            self.stats["streams_over_rate"] += 1
            await _reset(stream)
            return
        if not long_lived and self.open[key] >= lim.streams_per_peer:
            gate.strike(peer, now, f"more than {lim.streams_per_peer} open {protocol} streams")
            await _reset(stream)
            return
        self.open[key] += 1
        try:
            await handler(peer, stream if long_lived else TimedStream(stream, lim.read_timeout))
        except ReadTimedOut as e:
            log.debug("%s stream from %s closed: %s", protocol, short_id(peer), e)
        except RemoteProtocolError as e:
            self.stats["bad_frames"] += 1
            log.info("bad %s frame from %s: %s", protocol, short_id(peer), e)
            gate.strike(peer, trio.current_time(), f"{protocol}: {e}")
            await _reset(stream)
        except (StreamClosed, EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as e:  # our bug, or a libp2p stream error type: never let it reach the host
            log.warning("handler for %s from %s failed: %s: %s", protocol, short_id(peer), type(e).__name__, e)
        finally:
            self.open[key] -= 1
            if not self.open[key]:
                del self.open[key]

async def _reset(stream: Stream) -> None:
    with trio.move_on_after(1.0):
        try:
            await stream.reset()
        except Exception:
            return
