"""A misbehaving peer: a libp2p host in the test process that writes bad frames to a daemon's actor protocol."""

from __future__ import annotations

import cbor2
import multiaddr
import numpy as np
import trio

from swarmd.net.framing import HEADER
from swarmd.net.streams import Libp2pStream, read_frame
from swarmd.transport.links import PROTOCOL
from swarmd.wire import Forward, Hello, WireTensor, decode, encode

HIDDEN = 576  # SmolLM2


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def bad_frames() -> dict[str, bytes]:
    """Each kind of bad input, as the bytes a peer would write (the last one ends the link)."""
    int_hidden = {"dtype": "int32", "shape": [1, HIDDEN], "data": bytes(4 * HIDDEN)}
    wrong_dtype = {"t": "forward", "v": 1, "seq": 4,
                   "body": {"request_id": "bad-4", "step": 0, "hop": 1, "start_pos": 0, "head": "x",
                            "hidden": int_hidden}}
    narrow = Forward("bad-3", 0, 1, 0, "x", hidden=WireTensor.from_array(np.zeros((1, 100), np.float32)))
    return {
        "not_cbor": frame(b"\xff\x00 this is not CBOR"),
        "unknown_type": frame(cbor2.dumps({"t": "launch_missiles", "v": 1, "seq": 2, "body": {}})),
        "wrong_width": encode(narrow, 3),
        "wrong_dtype": frame(cbor2.dumps(wrong_dtype)),
        "oversized": HEADER.pack(100 << 20),  # claims 100 MiB: over the 64 MiB limit
    }


async def bad_frame_replies(address: str, peer_id: str) -> dict[str, str]:
    """Dial the daemon at `address`, write each bad frame, and collect the error code it answers with."""
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import info_from_p2p_addr

    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    host = new_host(key_pair=create_new_key_pair(bytes([77]) * 32), listen_addrs=listen)
    replies: dict[str, str] = {}
    async with host.run(listen_addrs=listen):
        with trio.fail_after(30):
            await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(address)))
            stream = Libp2pStream(await host.new_stream(ID.from_base58(peer_id), [PROTOCOL]))
            await stream.write(encode(Hello(1 << 20)))
            assert isinstance(decode(await read_frame(stream, 4096)).msg, Hello)
            for name, data in bad_frames().items():
                await stream.write(data)
                replies[name] = decode(await read_frame(stream, 1 << 20)).msg.code
            await stream.close()
    return replies
