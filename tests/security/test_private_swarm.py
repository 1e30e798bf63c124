"""A private swarm on real py-libp2p hosts: peers without the swarm key (or off the allowlist) cannot connect,
see descriptors, receive a plan or deliver activations, on libp2p or on the TLS data plane."""

from __future__ import annotations

import pytest
import trio

from swarmd.net.seam import PeerUnreachable
from swarmd.net.swarm_key import SwarmKey
from swarmd.net.tls_plane import Offer
from swarmd.transport.links import start_actor_transport
from swarmd.transport.transport import DeliveryFailed
from swarmd.wire import Forward
from tests.security.helpers import TIMINGS, eventually, forward, start_member

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.waits]  # real hosts and dial timeouts: about 15 s


async def test_only_holders_of_the_swarm_key_join_see_descriptors_get_the_plan_or_deliver_activations(tmp_path):
    key = SwarmKey.generate()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            a = await start_member(nursery, tmp_path / "a", key=key, tls=True)
            b = await start_member(nursery, tmp_path / "b", key=key, bootstrap=(a,), tls=True)
            keyless = await start_member(nursery, tmp_path / "keyless", bootstrap=(a,), tls=True)
            other_key = await start_member(nursery, tmp_path / "other", key=SwarmKey.generate(), bootstrap=(a,),
                                           tls=True)
            delivered: list[Forward] = []

            async def stage(peer, msg):
                delivered.append(msg)

            transports = {}
            for m in (a, b, keyless, other_key):
                transports[m.peer_id] = await start_actor_transport(m.net, nursery)
                if m is a:
                    transports[a.peer_id].route(Forward, stage)
                m.net.host.get_peerstore().add_addrs(a.net.host.get_id(), a.net.host.get_addrs(), 3600)
            plane = a.net.data_plane
            assert plane is not None

            # The members form a swarm, plan, and pass an activation over the TLS data plane.
            await eventually(lambda: b.swarm.plan is not None and a.swarm.plan is not None
                             and {s.peer_id for s in a.swarm.plan.stages} == {a.peer_id, b.peer_id},
                             30, "a and b share a plan over both of them")
            await transports[b.peer_id].send(a.peer_id, forward(1), within=10)
            assert [m.step for m in delivered] == [1] and plane.connections(b.peer_id) == 1

            # The outsiders kept dialing the whole time: no connection, no member, no descriptor, no plan.
            for outsider in (keyless, other_key):
                assert not outsider.swarm.admitted and outsider.swarm.plan is None
                assert outsider.swarm.membership.members == {}
                assert outsider.peer_id not in a.swarm.membership.members
                assert not a.net.is_connected(outsider.peer_id) and not outsider.net.is_connected(a.peer_id)
                with pytest.raises(PeerUnreachable):
                    await outsider.net.connect(a.peer_id, [a.address])
                with pytest.raises(DeliveryFailed):
                    await transports[outsider.peer_id].send(a.peer_id, forward(2), within=TIMINGS.dial_timeout + 1)

            # Nor does the data plane take an activation from whoever finds its port: its tokens only travel
            # over the private libp2p stream, and a guessed one is refused.
            guess = Offer("127.0.0.1", plane.port, plane.cert_der, bytes(16))
            assert keyless.net.data_plane is not None
            with pytest.raises(Exception):  # noqa: B017 - the listener just hangs up
                await keyless.net.data_plane.dial(guess)
            assert [m.step for m in delivered] == [1]
            assert plane.connections(keyless.peer_id) == 0
            nursery.cancel_scope.cancel()


async def test_the_allowlist_refuses_other_holders_of_the_key(tmp_path):
    key = SwarmKey.generate()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            from swarmd.net.identity import load_or_create_identity, peer_id_of

            b_id = peer_id_of(load_or_create_identity(tmp_path / "b"))
            a = await start_member(nursery, tmp_path / "a", key=key, allow=frozenset({b_id}))
            b = await start_member(nursery, tmp_path / "b", key=key, bootstrap=(a,))
            c = await start_member(nursery, tmp_path / "c", key=key, bootstrap=(a,))
            await eventually(lambda: b.swarm.admitted and a.peer_id in b.swarm.membership.members, 20,
                             "b, on the allowlist, joins a")
            await trio.sleep(2 * TIMINGS.heartbeat_interval)
            assert not c.swarm.admitted and c.peer_id not in a.swarm.membership.members
            assert not a.net.is_connected(c.peer_id)
            assert a.net.connections_refused >= 1
            with pytest.raises(PeerUnreachable):
                await c.net.connect(a.peer_id, [a.address])
            nursery.cancel_scope.cancel()
