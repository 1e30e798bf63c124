"""`swarmd join --dial-map FROM=TO`: every outbound connection of the process to FROM goes to TO."""

from __future__ import annotations

import pytest
import trio

from swarmd.errors import UserError
from swarmd.net.dial_map import DialMap, install_dial_map


async def listener(nursery: trio.Nursery, name: bytes) -> int:
    async def answer(stream: trio.SocketStream) -> None:
        await stream.send_all(name)
        await stream.aclose()

    listeners = await nursery.start(trio.serve_tcp, answer, 0)
    return listeners[0].socket.getsockname()[1]


async def who_answers(port: int) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        return await stream.receive_some(16)


async def test_a_mapped_address_is_dialled_at_its_target_and_others_directly():
    async with trio.open_nursery() as nursery:
        emulator, peer, other = [await listener(nursery, n) for n in (b"emulator", b"peer", b"other")]
        install_dial_map(DialMap.parse([f"127.0.0.1:{peer}=127.0.0.1:{emulator}"]))
        assert await who_answers(peer) == b"emulator"
        assert await who_answers(other) == b"other"
        nursery.cancel_scope.cancel()


def test_bad_entries_are_one_line_errors():
    assert DialMap.parse(["127.0.0.1:4001=127.0.0.1:7001", "[::1]:4001=[::1]:7001"]).routes == {
        ("127.0.0.1", 4001): ("127.0.0.1", 7001), ("::1", 4001): ("::1", 7001)}
    for entry, message in (("127.0.0.1:4001", "expected FROM=TO"),
                           ("localhost:4001=127.0.0.1:7001", "not IP:PORT"),
                           ("127.0.0.1:0=127.0.0.1:7001", "has no valid port")):
        with pytest.raises(UserError, match=message):
            DialMap.parse([entry])
    with pytest.raises(UserError, match="mapped twice"):
        DialMap.parse(["127.0.0.1:1=127.0.0.1:2", "127.0.0.1:1=127.0.0.1:3"])
