"""Streams in practice: other libraries' byte streams as the seam's `Stream` (b'' at the end, StreamClosed when
broken), and reading, writing and closing frames on any `Stream`."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from swarmd.net.framing import HEADER, FrameTooLarge
from swarmd.net.seam import Stream, StreamClosed

log = logging.getLogger(__name__)


class TrioStream:
    """A `trio.abc.Stream` (TCP, TLS, in-memory) as a `Stream`."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def read(self, n: int) -> bytes:
        try:
            return await self.stream.receive_some(n)  # bytes or bytearray: both feed a FrameDecoder
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise StreamClosed(f"stream broke: {type(e).__name__}: {e}") from None

    async def write(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise StreamClosed(f"write failed: {type(e).__name__}: {e}") from None

    async def close(self) -> None:
        await self.stream.aclose()

    async def reset(self) -> None:
        await trio.aclose_forcefully(self.stream)


class Libp2pStream:
    """A py-libp2p stream as a `Stream`: its EOF (an EOFError) becomes b'', its other errors StreamClosed."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    @property
    def remote_peer(self) -> str:
        return str(self.stream.muxed_conn.peer_id)

    def remote_address(self) -> str:
        """The host part of the address the connection under this stream reaches the peer at ('' if unknown)."""
        try:
            address = self.stream.get_remote_address()
        except Exception:
            return ""
        return str(address[0]) if address else ""

    async def read(self, n: int) -> bytes:
        try:
            return await self.stream.read(n)
        except EOFError:  # libp2p's StreamEOF is an EOFError
            return b""
        except trio.Cancelled:
            raise
        except Exception as e:
            raise StreamClosed(f"stream broke: {type(e).__name__}: {e}") from None

    async def write(self, data: bytes) -> None:
        try:
            await self.stream.write(data)
        except trio.Cancelled:
            raise
        except Exception as e:
            raise StreamClosed(f"write failed: {type(e).__name__}: {e}") from None

    async def close(self) -> None:
        await self.stream.close()

    async def reset(self) -> None:
        await self.stream.reset()


async def read_exact(stream: Stream, n: int) -> bytes:
    """Exactly `n` bytes (a read returns at most what was asked, so nothing past them is consumed)."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = await stream.read(n - len(buf))
        except (trio.Cancelled, StreamClosed):
            raise
        except Exception as e:
            raise StreamClosed(f"stream broke after {len(buf)} of {n} bytes: {type(e).__name__}") from None
        if not chunk:
            raise StreamClosed(f"stream ended after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


async def read_frame(stream: Stream, max_bytes: int) -> bytes:
    """One whole frame's body; FrameTooLarge for a length over `max_bytes` (callers bound it in time)."""
    (n,) = HEADER.unpack(await read_exact(stream, HEADER.size))
    if n > max_bytes:
        raise FrameTooLarge(f"frame of {n} bytes is over the {max_bytes} byte limit")
    return await read_exact(stream, n)


async def write_frame(stream: Stream, payload: bytes) -> None:
    try:
        await stream.write(HEADER.pack(len(payload)) + payload)  # one write per frame
    except (trio.Cancelled, StreamClosed):
        raise
    except Exception as e:
        raise StreamClosed(f"write failed: {type(e).__name__}: {e}") from None


class Closable(Protocol):
    async def close(self) -> None: ...


async def close_quietly(stream: Closable) -> None:
    """Close `stream`, shielded and within a second; a failure to close is only logged."""
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.close()
        except Exception as e:
            log.debug("closing a stream: %s: %s", type(e).__name__, e)
