"""Byte streams of other libraries as the seam's `Stream`: b'' at the end, StreamClosed when broken."""

from __future__ import annotations

from typing import Any

import trio

from swarmd.net.seam import StreamClosed


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
