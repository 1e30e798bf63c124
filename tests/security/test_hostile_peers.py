"""Hostile bytes on every protocol a daemon serves, over real py-libp2p hosts on loopback: identify, ping and
gossipsub as libp2p handles them, and swarmd's probe and actor protocols; plus garbage before the handshake.
No stream hangs, the daemon stays up, and an honest member's heartbeats, probes and activations still get
through."""

from __future__ import annotations

import random
import struct
from dataclasses import replace

import multiaddr
import pytest
import trio

from swarmd.net.gate import GuardLimits
from swarmd.net.streams import read_frame, write_frame
from swarmd.net.swarm_key import SwarmKey
from swarmd.swarm.service import PROBE_PROTOCOL
from swarmd.transport.links import start_actor_transport
from swarmd.wire import Forward, Hello, encode
from tests.security.helpers import eventually, forward, start_member
from tests.wire.wire_examples import VALID_BODIES, mutate

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.waits]  # about 20 s
PATIENT = GuardLimits(bad_frames=10**6, stream_opens_per_second=1e6, stream_open_burst=10**6)
PAYLOADS_PER_PROTOCOL = 12
LEN = struct.Struct(">I")


def payloads(protocol: str, rng: random.Random) -> list[bytes]:
    out = []
    for _ in range(PAYLOADS_PER_PROTOCOL):
        junk = rng.randbytes(rng.randint(1, 300))
        if protocol.startswith("/meshsub"):  # varint-length-prefixed protobufs, mostly not protobufs
            out.append(bytes([len(junk[:127])]) + junk[:127] if rng.random() < 0.7 else junk)
        elif protocol == "/swarmd/act/1.0.0":  # a hello, then a mutated actor frame
            body = mutate(rng.choice(VALID_BODIES), rng)
            out.append(encode(Hello(1 << 20)) + LEN.pack(len(body)) + body if rng.random() < 0.7 else junk)
        elif protocol == PROBE_PROTOCOL:
            out.append(LEN.pack(rng.choice([3, 8, 9, 2**31])) + junk[:12])
        else:
            out.append(junk)
    return out


async def throw(host, peer_id, protocol: str, payload: bytes) -> None:
    """Open a stream, send `payload`, read until the daemon closes it. Gossipsub's streams are long-lived by
    design (idle between messages), so a partial gossipsub frame may just wait: those we hang up ourselves."""
    patience = 1.0 if protocol.startswith("/meshsub") else 5.0
    with trio.move_on_after(patience) as timer:
        stream = await host.new_stream(peer_id, [protocol])
        try:
            await stream.write(payload)
            await stream.close()
            while await stream.read(4096):
                pass
        except Exception:
            pass  # a reset or an EOF error: the daemon hung up
    with trio.move_on_after(1):
        try:
            await stream.reset()
        except Exception:
            pass
    assert not timer.cancelled_caught or protocol.startswith("/meshsub"), \
        f"a {protocol} stream was still open after {patience:g} s: {payload[:40]!r}"


async def test_hostile_streams_on_every_protocol_leave_the_daemon_serving_others(tmp_path):
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.network.config import ConnectionConfig
    from libp2p.peer.peerinfo import info_from_p2p_addr

    key = SwarmKey.generate()
    rng = random.Random(9)
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            victim = await start_member(nursery, tmp_path / "victim", key=key, limits=PATIENT)
            honest = await start_member(nursery, tmp_path / "honest", key=key, bootstrap=(victim,))
            v_transport = await start_actor_transport(victim.net, nursery)
            h_transport = await start_actor_transport(honest.net, nursery)
            got: list[tuple[str, Forward]] = []

            async def stage(peer, msg):
                got.append((str(peer), msg))

            v_transport.route(Forward, stage)
            await eventually(lambda: victim.peer_id in honest.swarm.membership.live(), 20, "honest joins victim")

            # A member gone bad: it holds the swarm key, so it can connect and open streams.
            listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
            evil = new_host(key_pair=create_new_key_pair(b"\x66" * 32), listen_addrs=listen, psk=key.hex,
                            connection_config=ConnectionConfig(max_connections_per_peer=1))
            async with evil.run(listen_addrs=listen):
                info = info_from_p2p_addr(multiaddr.Multiaddr(victim.address))
                await evil.connect(info)
                protocols = sorted(str(p) for p in victim.net.host.get_mux().handlers)
                assert {"/ipfs/id/1.0.0", "/ipfs/ping/1.0.0", "/meshsub/1.1.0", PROBE_PROTOCOL,
                        "/swarmd/act/1.0.0"} <= set(protocols)
                for protocol in protocols:
                    for payload in payloads(protocol, rng):
                        await throw(evil, info.peer_id, protocol, payload)

                # Garbage before any handshake, and a connection that says nothing at all.
                host, port = victim.address.split("/")[2], int(victim.address.split("/")[4])
                for _ in range(5):
                    tcp = await trio.open_tcp_stream(host, port)
                    await tcp.send_all(rng.randbytes(rng.randint(1, 2000)))
                    await tcp.aclose()
                silent = await trio.open_tcp_stream(host, port)

                # The daemon carries on: the honest member is heard, probed, and its activations arrive.
                last = victim.swarm.membership.members[honest.peer_id].last_heard
                await eventually(lambda: victim.swarm.membership.members[honest.peer_id].last_heard > last, 5,
                                 "a new heartbeat from the honest member")
                assert str(victim.swarm.membership.members[honest.peer_id].state) == "alive"
                probe = await honest.net.open_stream(victim.peer_id, PROBE_PROTOCOL)
                await write_frame(probe, b"8 bytes!")
                assert await read_frame(probe, 8) == b"8 bytes!"
                await h_transport.send(victim.peer_id, forward(1), within=10)
                # (a mutated frame from `evil` may still decode to a well-formed activation: that one is served)
                assert [m.step for peer, m in got if peer == str(honest.peer_id)] == [1]
                assert victim.net.gate.stats["strikes"] > 0  # what was refused was counted against the sender
                await silent.aclose()

            # Bad actor frames past the limit: the transport strikes the peer in the gate (one penalty box),
            # which cuts it off, so it cannot come back on any protocol until its penalty is over. A member of
            # its own, so that whether the random frames above already cut `evil` off does not matter here; the
            # gate's usual limit from here on (the random frames above needed a patient one).
            victim.net.gate.limits = replace(PATIENT, bad_frames=GuardLimits().bad_frames)
            worse = new_host(key_pair=create_new_key_pair(b"\x67" * 32), listen_addrs=listen, psk=key.hex,
                             connection_config=ConnectionConfig(max_connections_per_peer=1))
            async with worse.run(listen_addrs=listen):
                await worse.connect(info)
                worse_id = str(worse.get_id())
                bad = b"\xff" * 8
                await throw(worse, info.peer_id, "/swarmd/act/1.0.0",
                            encode(Hello(1 << 20)) + (LEN.pack(len(bad)) + bad) * 10)
                await eventually(lambda: victim.net.gate.is_penalised(worse_id, trio.current_time()), 5,
                                 "the gate to penalise the peer the transport cut off")
                worse.get_network().unblock_peer(info.peer_id)
                await eventually(lambda: not worse.get_network().connections.get(info.peer_id), 5, "a hang-up")
                with pytest.raises(Exception):  # noqa: B017 - refused right after the security handshake
                    with trio.fail_after(5):
                        await worse.connect(info)
            nursery.cancel_scope.cancel()
