"""The actor transport on the network seam: links are bulk streams of `/swarmd/act/1.0.0`.

`start_actor_transport(network, nursery, config)` makes an `ActorTransport` whose opener opens a bulk stream
to the peer (on the TLS data plane where the network has one) and exchanges `Hello` (each side's frame
limit), and serves the protocol with the same exchange before handing the stream to the transport. A peer the
transport cuts off (bad frames) is penalised in the network's peer gate, which drops its connections.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import trio

from swarmd.net.seam import Network, Stream
from swarmd.net.streams import close_quietly, read_frame
from swarmd.transport.transport import ActorTransport, LinkError, TransportConfig
from swarmd.wire.messages import Hello, Message, decode, encode

log = logging.getLogger(__name__)

PROTOCOL = "/swarmd/act/1.0.0"
HELLO_LIMIT = 4096
HELLO_TIMEOUT = 10.0


async def read_hello(stream: Stream) -> Hello:
    msg = decode(await read_frame(stream, HELLO_LIMIT)).msg
    if not isinstance(msg, Hello):
        raise LinkError(f"expected hello, got {msg.TAG}")
    return msg


def link_opener(network: Network, config: TransportConfig):
    """The transport's opener: a bulk stream to `peer` with the hello exchange done."""

    async def open_link(peer: str) -> Stream:
        stream = await network.open_stream(peer, PROTOCOL, bulk=True)
        try:
            with trio.fail_after(HELLO_TIMEOUT):
                await stream.write(encode(Hello(config.max_frame)))
                await read_hello(stream)
            return stream
        except BaseException:
            await close_quietly(stream)
            raise

    return open_link


def serve_links(network: Network, transport: ActorTransport) -> None:
    """Serve `/swarmd/act/1.0.0` on `network` with `transport`."""

    async def handle(peer: str, stream: Stream) -> None:
        if network.gate.is_penalised(peer, trio.current_time()):
            return
        with trio.fail_after(HELLO_TIMEOUT):
            await read_hello(stream)
            await stream.write(encode(Hello(transport.config.max_frame)))
        await transport.serve(peer, stream)

    network.serve(PROTOCOL, handle, bulk=True)


async def start_actor_transport(network: Network, nursery: trio.Nursery, config: TransportConfig | None = None, *,
                                rng: random.Random | None = None,
                                on_undeliverable: Callable[[str, Message, str], None] | None = None) -> ActorTransport:
    """An ActorTransport over `network`, serving and dialing `/swarmd/act/1.0.0`, its tasks in `nursery`; a frame
    given up on goes to `on_undeliverable` (peer, message, reason)."""
    config = config or TransportConfig()
    transport = ActorTransport(link_opener(network, config), config, local_peer=network.peer_id, gate=network.gate,
                               rng=rng, on_undeliverable=on_undeliverable)
    await nursery.start(transport.run)
    serve_links(network, transport)
    return transport
