"""Real py-libp2p networks on loopback (the daemon's `Libp2pNetwork`, with or without its TLS data plane),
each with an ActorTransport; and bare hosts for writing raw frames like a misbehaving peer."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from swarmd.net.libp2p_network import Libp2pNetwork
from swarmd.net.tls_plane import DataPlaneConfig
from swarmd.transport.links import start_actor_transport
from swarmd.transport.transport import ActorTransport, TransportConfig


@dataclass
class P2PNode:
    network: Libp2pNetwork
    peer: str
    transport: ActorTransport

    @property
    def host(self) -> Any:
        return self.network.host


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
    """Start nodes with `await p2p(seed, tls=..., config=...)` (`tls`: bulk streams on the TLS data plane);
    all stop when the test ends."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    logging.getLogger("libp2p").setLevel(logging.ERROR)
    hosts: list[Any] = []

    async def run_node(seed: int, tls: bool, config: TransportConfig | None, *, task_status) -> None:
        # Each network lives in a task of its own: its host's run() context is entered and left by that task.
        network = Libp2pNetwork(create_new_key_pair(bytes([seed]) * 32), ["/ip4/127.0.0.1/tcp/0"],
                                data_plane=DataPlaneConfig() if tls else None)
        async with trio.open_nursery() as nursery:
            await nursery.start(network.run)
            transport = await start_actor_transport(network, nursery, config)
            introduce(network.host, hosts)
            hosts.append(network.host)
            task_status.started(P2PNode(network, network.peer_id, transport))

    async with trio.open_nursery() as nodes:

        async def start(seed: int, *, tls: bool = False, config: TransportConfig | None = None) -> P2PNode:
            return await nodes.start(run_node, seed, tls, config)

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
