"""Five real py-libp2p hosts in one process on loopback: the swarm layer end to end, without the CLI."""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio

from planner import BUILTIN_ARCHS, layout_from_arch, make_plan
from swarmd.config import LAN
from swarmd.net.identity import Signer, load_or_create_identity
from swarmd.net.libp2p_network import Libp2pNetwork
from swarmd.net.streams import read_frame, write_frame
from swarmd.swarm.planning import MakePlan
from swarmd.swarm.service import SwarmService, SwarmSettings
from tests.swarm.swarm_helpers import descriptor

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.waits]
LAYOUT = layout_from_arch(BUILTIN_ARCHS["smollm2-135m"], "f16")
# Five hosts share one Python thread here, so every gossip message costs five times: LAN heartbeats
# (the 0.25 s of the local-test preset keep this loop busy enough to delay probes past their timeout).
TIMINGS = replace(LAN, replan_debounce=0.3)


def planner(action: MakePlan):
    return make_plan(LAYOUT, action.nodes, epoch=action.epoch, previous=action.previous)


async def start_node(nursery, home, bootstrap=()):
    kp = load_or_create_identity(home)
    net = await nursery.start(Libp2pNetwork(kp, ["/ip4/127.0.0.1/tcp/0"], timings=TIMINGS).run)
    desc = descriptor(net.peer_id)

    def describe():
        return replace(desc, addresses=tuple(net.addresses()))

    svc = SwarmService(net, Signer(kp), SwarmSettings("inproc", TIMINGS, bootstrap), describe_self=describe,
                       make_plan=planner)
    await nursery.start(svc.run)
    return net, svc


async def test_five_real_hosts_see_each_other_elect_one_leader_and_share_one_plan(tmp_path):
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            net1, first = await start_node(nursery, tmp_path / "n1")
            boot = ((first.peer_id, net1.addresses()[0]),)
            nodes = [first] + [(await start_node(nursery, tmp_path / f"n{i}", boot))[1] for i in range(2, 6)]
            ids = {n.peer_id for n in nodes}
            while True:
                views = {(n.leader, n.coordinator.epoch, frozenset(n.membership.live()),
                          frozenset(s.peer_id for s in n.plan.stages) if n.plan else None) for n in nodes}
                if len(views) == 1 and next(iter(views))[2] == ids and next(iter(views))[3] == ids:
                    break
                await trio.sleep(0.2)
            [(leader, epoch, _, _)] = views
            assert leader == first.peer_id and epoch >= 1
            assert len({n.plan.to_json().__repr__() for n in nodes}) == 1
            # every member dials every other (soon after it learns of it): the mesh survives the loss of the
            # bootstrap node
            while True:
                if all(set(n.network.connected_peers()) == ids - {n.peer_id} for n in nodes):
                    break
                await trio.sleep(0.2)
            await trio.sleep(2 * TIMINGS.probe_interval)  # direct probes measure round trips
            assert all(set(n.rtts()) == ids - {n.peer_id} for n in nodes)
            nursery.cancel_scope.cancel()


async def test_a_stream_handler_that_fails_does_not_take_the_host_down(tmp_path):
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a = await nursery.start(Libp2pNetwork(load_or_create_identity(tmp_path / "a"), ["/ip4/127.0.0.1/tcp/0"],
                                                  timings=TIMINGS).run)
            b = await nursery.start(Libp2pNetwork(load_or_create_identity(tmp_path / "b"), ["/ip4/127.0.0.1/tcp/0"],
                                                  timings=TIMINGS).run)

            async def broken(peer, stream):
                await read_frame(stream, 100)
                raise RuntimeError("handler bug")

            async def echo(peer, stream):
                await write_frame(stream, await read_frame(stream, 100))

            b.serve("/test/broken/1", broken)
            b.serve("/test/echo/1", echo)
            await a.connect(b.peer_id, b.addresses())
            s = await a.open_stream(b.peer_id, "/test/broken/1")
            await write_frame(s, b"boom")
            await trio.sleep(0.3)
            s = await a.open_stream(b.peer_id, "/test/echo/1")
            await write_frame(s, b"still here")
            assert await read_frame(s, 100) == b"still here"
            nursery.cancel_scope.cancel()


async def test_peers_are_told_the_announced_address_and_the_log_shows_the_bound_one(tmp_path):
    kp = load_or_create_identity(tmp_path / "a")
    net = Libp2pNetwork(kp, ["/ip4/127.0.0.1/tcp/0"], ["/ip4/127.0.0.1/tcp/4999"], timings=TIMINGS)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(net.run)
            assert net.addresses() == [f"/ip4/127.0.0.1/tcp/4999/p2p/{net.peer_id}"]
            [bound] = net.bound_addresses()
            assert bound.startswith("/ip4/127.0.0.1/tcp/") and "/tcp/0/" not in bound and "/tcp/4999/" not in bound
            nursery.cancel_scope.cancel()


class _Muxer:
    def __init__(self, closed: bool) -> None:
        self.is_closed = closed


class _Conn:
    def __init__(self, closed: bool) -> None:
        self.muxed_conn = _Muxer(closed)


class _Stream:
    def __init__(self, conn: _Conn) -> None:
        self.muxed_conn = conn.muxed_conn


class _Network:
    def __init__(self, connections: dict[str, list[_Conn]]) -> None:
        self.connections = connections

    def get_connections(self, peer: str) -> list[_Conn]:
        return self.connections.get(peer, [])


def test_a_gossip_stream_left_on_a_closed_connection_is_found_only_while_another_connection_is_open():
    from swarmd.net.libp2p_network import gossip_streams_on_closed_connections

    old, new, gone = _Conn(closed=True), _Conn(closed=False), _Conn(closed=True)
    fine = _Conn(closed=False)
    streams = {"stale": _Stream(old), "healthy": _Stream(fine), "disconnected": _Stream(gone)}
    network = _Network({"stale": [old, new], "healthy": [fine], "disconnected": [gone]})
    # "disconnected" has no open connection: py-libp2p forgets it itself once it handles the close
    assert gossip_streams_on_closed_connections(streams, network) == ["stale"]
