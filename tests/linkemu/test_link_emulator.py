"""The link emulator forwards bytes faithfully and adds exactly the impairments it is told to."""

from __future__ import annotations

import time

import pytest
import trio

from swarmd.testing.linkemu import Link, LinkConfig


async def echo_server(nursery: trio.Nursery) -> int:
    async def echo(stream: trio.SocketStream) -> None:
        try:
            async for data in stream:
                await stream.send_all(data)
        except trio.BrokenResourceError:
            pass

    listeners = await nursery.start(trio.serve_tcp, echo, 0)
    return listeners[0].socket.getsockname()[1]


async def start_link(nursery: trio.Nursery, config: LinkConfig) -> tuple[Link, int]:
    target = await echo_server(nursery)
    link = Link(config, ("127.0.0.1", target))
    port = await nursery.start(link.serve)
    return link, port


async def roundtrip(stream: trio.SocketStream, payload: bytes) -> bytes:
    await stream.send_all(payload)
    got = b""
    while len(got) < len(payload):
        chunk = await stream.receive_some(1 << 16)
        if not chunk:
            break
        got += chunk
    return got


async def test_bytes_arrive_unchanged_and_in_order():
    async with trio.open_nursery() as nursery:
        _, port = await start_link(nursery, LinkConfig(jitter_ms=3))
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        payload = bytes(range(256)) * 4000
        assert await roundtrip(stream, payload) == payload
        nursery.cancel_scope.cancel()


async def test_delay_applies_in_each_direction():
    async with trio.open_nursery() as nursery:
        _, port = await start_link(nursery, LinkConfig(delay_ms=40))
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        t0 = time.monotonic()
        await roundtrip(stream, b"ping")
        assert time.monotonic() - t0 >= 0.079
        nursery.cancel_scope.cancel()


async def test_bandwidth_cap_paces_a_large_transfer():
    async with trio.open_nursery() as nursery:
        _, port = await start_link(nursery, LinkConfig(bandwidth_mbit=20))
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        payload = b"x" * 500_000  # 4 Mbit each way at 20 Mbit/s: >= 0.2 s one way, both directions pipelined
        t0 = time.monotonic()
        assert len(await roundtrip(stream, payload)) == len(payload)
        assert time.monotonic() - t0 >= 0.2
        nursery.cancel_scope.cancel()


async def test_reset_breaks_open_connections_and_new_ones_work():
    async with trio.open_nursery() as nursery:
        link, port = await start_link(nursery, LinkConfig())
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        assert await roundtrip(stream, b"a") == b"a"
        assert link.reset_connections() == 1
        with pytest.raises((trio.BrokenResourceError, OSError)):
            for _ in range(50):
                await stream.send_all(b"b")
                if not await stream.receive_some(10):
                    raise trio.BrokenResourceError("eof")
        fresh = await trio.open_tcp_stream("127.0.0.1", port)
        assert await roundtrip(fresh, b"c") == b"c"
        nursery.cancel_scope.cancel()


async def test_blackhole_holds_bytes_until_lifted():
    async with trio.open_nursery() as nursery:
        link, port = await start_link(nursery, LinkConfig(blackhole=True))
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"held")
        with trio.move_on_after(0.3) as waited:
            await stream.receive_some(10)
        assert waited.cancelled_caught
        link.update(blackhole=False)
        with trio.fail_after(5):
            got = b""
            while len(got) < 4:
                got += await stream.receive_some(10)
        assert got == b"held"
        nursery.cancel_scope.cancel()
