"""Real py-libp2p hosts on loopback, each with an ActorTransport, set up as py-libp2p 0.8.1 needs:
Ed25519 keys from fixed seeds, TCP + noise + yamux, `ConnectionConfig(max_connections_per_peer=1)`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from swarmd.transport.links import P2PLinks, Plane, start_actor_transport
from swarmd.transport.transport import ActorTransport, TransportConfig


@dataclass
class P2PNode:
    host: Any
    peer: str
    transport: ActorTransport
    links: P2PLinks


StartNode = Callable[..., Awaitable[P2PNode]]


def make_host(seed: int) -> tuple[Any, list]:
    import multiaddr
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.network.config import ConnectionConfig

    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    host = new_host(
        key_pair=create_new_key_pair(bytes([seed]) * 32),
        listen_addrs=listen,
        connection_config=ConnectionConfig(max_connections_per_peer=1),
    )
    return host, listen


def introduce(host: Any, others: list[Any]) -> None:
    """Tell `host` and `others` each other's addresses (what membership does in the daemon)."""
    for other in others:
        host.get_peerstore().add_addrs(other.get_id(), other.get_addrs(), 3600)
        other.get_peerstore().add_addrs(host.get_id(), host.get_addrs(), 3600)


@pytest.fixture
async def p2p() -> AsyncIterator[StartNode]:
    """Start nodes with `await p2p(seed, plane=..., config=...)`; all stop when the test ends."""
    logging.getLogger("libp2p").setLevel(logging.ERROR)
    hosts: list[Any] = []

    async def run_node(seed: int, plane: Plane, config: TransportConfig | None, *, task_status) -> None:
        # Each host lives in a task of its own: its run() context is entered and left by that task.
        host, listen = make_host(seed)
        async with host.run(listen_addrs=listen), trio.open_nursery() as nursery:
            transport, links = await start_actor_transport(host, nursery, config, plane=plane)
            introduce(host, hosts)
            hosts.append(host)
            task_status.started(P2PNode(host, str(host.get_id()), transport, links))

    async with trio.open_nursery() as nodes:

        async def start(seed: int, *, plane: Plane = Plane.LIBP2P, config: TransportConfig | None = None) -> P2PNode:
            return await nodes.start(run_node, seed, plane, config)

        yield start
        nodes.cancel_scope.cancel()


@pytest.fixture
async def bare_host() -> AsyncIterator[Callable[[int], Awaitable[Any]]]:
    """A libp2p host with no transport, for writing raw frames like a misbehaving peer."""

    async def run_host(seed: int, *, task_status) -> None:
        host, listen = make_host(seed)
        async with host.run(listen_addrs=listen):
            task_status.started(host)
            await trio.sleep_forever()

    async with trio.open_nursery() as hosts:

        async def start(seed: int) -> Any:
            return await hosts.start(run_host, seed)

        yield start
        hosts.cancel_scope.cancel()


async def eventually(predicate: Callable[[], bool], seconds: float = 5.0) -> None:
    """Poll state that offers no event to wait on (a libp2p host's connection table)."""
    for _ in range(int(seconds / 0.01)):
        if predicate():
            return
        await trio.sleep(0.01)
    raise AssertionError("condition not reached in time")
