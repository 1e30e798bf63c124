"""A member gone bad, as a process of its own: it holds the swarm key, joins the gossip topic, then floods a
daemon for a bounded time — gossip messages as fast as it can publish them, probes as fast as it can send
them, and reconnects as fast as it can dial once it is cut off. Prints what it managed as one JSON line.

    python -m tests.security.flooder KEY_FILE TARGET_MULTIADDR SWARM SECONDS   (from the repository's root)
"""

from __future__ import annotations

import json
import logging
import struct
import sys
import time
from dataclasses import replace
from pathlib import Path

import trio
import trio.lowlevel

from swarmd.net.identity import Signer
from swarmd.net.swarm_key import load_swarm_key
from swarmd.swarm.service import PROBE_PROTOCOL, gossip_topic
from swarmd.wire.gossip import Heartbeat, encode
from tests.swarm.swarm_helpers import descriptor

LEN = struct.Struct(">I")


async def main(key_file: str, target: str, swarm: str, seconds: float) -> dict:
    import multiaddr
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.network.config import ConnectionConfig
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
    from libp2p.pubsub.pubsub import Pubsub
    from libp2p.tools.anyio_service import background_trio_service

    key = load_swarm_key(Path(key_file))
    kp = create_new_key_pair(b"\x99" * 32)
    me = ID.from_pubkey(kp.public_key).to_base58()
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    host = new_host(key_pair=kp, listen_addrs=listen, psk=key.hex,
                    connection_config=ConnectionConfig(max_connections_per_peer=1, dial_timeout=2.0))
    gossip = GossipSub(protocols=[PROTOCOL_ID_V11, PROTOCOL_ID], degree=6, degree_low=4, degree_high=12,
                       heartbeat_interval=1, adaptive_gossip_enabled=False, spam_protection_enabled=False)
    pubsub = Pubsub(host, gossip)
    info = info_from_p2p_addr(multiaddr.Multiaddr(target))
    signer, desc = Signer(kp), descriptor(me)
    sent = {"gossip": 0, "probes": 0, "dials": 0, "dials_refused": 0}
    async with host.run(listen_addrs=listen), background_trio_service(pubsub), background_trio_service(gossip):
        await pubsub.wait_until_ready()
        await pubsub.subscribe(gossip_topic(swarm))
        await host.connect(info)
        await trio.sleep(0.5)  # the mesh forms
        deadline = trio.current_time() + seconds

        async def gossip_flood() -> None:
            seq = 0
            while trio.current_time() < deadline:
                seq += 1
                hb = Heartbeat(replace(desc, load=float(seq)), seq=seq)
                try:
                    await pubsub.publish(gossip_topic(swarm), encode(hb, signer, swarm))
                    sent["gossip"] += 1
                except Exception:
                    await trio.sleep(0.01)
                await trio.sleep(0.001)  # as fast as the flooder's own host can carry them (its loop must run)

        async def probe_flood() -> None:
            while trio.current_time() < deadline:
                try:
                    stream = await host.new_stream(info.peer_id, [PROBE_PROTOCOL])
                    while trio.current_time() < deadline:
                        await stream.write(LEN.pack(8) + b"floodme!")
                        sent["probes"] += 1
                        await stream.read(12)
                except Exception:
                    await trio.sleep(0.01)

        async def redial() -> None:
            while trio.current_time() < deadline:
                if host.get_network().connections.get(info.peer_id):
                    await trio.sleep(0.05)
                    continue
                sent["dials"] += 1
                host.get_network().unblock_peer(info.peer_id)
                try:
                    with trio.fail_after(2):
                        await host.connect(info)
                except BaseException as e:
                    if not isinstance(e, Exception | trio.TooSlowError):
                        raise
                    sent["dials_refused"] += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(gossip_flood)
            nursery.start_soon(probe_flood)
            nursery.start_soon(redial)
    return {"peer_id": me, **sent}


if __name__ == "__main__":
    logging.basicConfig(level=logging.CRITICAL)
    t0 = time.monotonic()
    result = trio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
    print(json.dumps({**result, "seconds": round(time.monotonic() - t0, 1)}), flush=True)
