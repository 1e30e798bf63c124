"""A head in the test process that sends duplicated and reordered frames: the idempotency test's tool.

It is a libp2p network with the actor transport (it receives the requests' tokens). On a raw actor stream to stage
0 it writes each request's prompt twice, the copies out of order; and for every token the last stage sends it,
it writes that token's copy for stage 0 once more (a duplicate racing the original)."""

from __future__ import annotations

import multiaddr
import numpy as np
import trio

from swarmd.net.framing import read_frame
from swarmd.net.libp2p_network import Libp2pNetwork
from swarmd.net.streams import Libp2pStream
from swarmd.transport.links import PROTOCOL, start_actor_transport
from swarmd.wire import Forward, Hello, WireTensor, decode, encode
from swarmd.wire.messages import Cancel, Error, Sampling, Token
from tests.pipeline.daemon_swarm import DaemonSwarm


async def run_with_duplicates(swarm: DaemonSwarm, prompts: dict[str, list[int]],
                              stop_ids: tuple[int, ...], n_tokens: int) -> dict[str, list[int]]:
    """Run `prompts` (request id -> token ids) greedily with duplicates; each request's tokens in step order."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import info_from_p2p_addr

    plan = swarm.running[0].status()["plan"]
    stage0 = plan["stages"][0]["peer_id"]
    network = Libp2pNetwork(create_new_key_pair(bytes([91]) * 32), ["/ip4/127.0.0.1/tcp/0"])
    me = network.peer_id
    tokens: dict[str, dict[int, int]] = {rid: {} for rid in prompts}
    finished = {rid: trio.Event() for rid in prompts}
    errors: list[Error] = []
    seq = 100

    async with trio.open_nursery() as nursery:
        await nursery.start(network.run)
        host = network.host
        for d in swarm.running:
            await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(d.addresses[0])))
        transport = await start_actor_transport(network, nursery)
        raw = Libp2pStream(await host.new_stream(ID.from_base58(stage0), [PROTOCOL]))
        await raw.write(encode(Hello(1 << 20)))
        assert isinstance(decode(await read_frame(raw, 4096)).msg, Hello)

        async def drain_acks() -> None:
            while (await raw.read(1 << 16)) != b"":
                pass

        nursery.start_soon(drain_acks)

        async def write(msg) -> None:
            nonlocal seq
            seq += 1
            await raw.write(encode(msg, seq))

        async def on_token(peer: str, msg: Token) -> None:
            if msg.hop != 1 or msg.step in tokens[msg.request_id]:
                return
            tokens[msg.request_id][msg.step] = msg.token
            if msg.finish:
                finished[msg.request_id].set()
            else:  # the copy the last stage sent stage 0, once more
                await write(Token(msg.request_id, msg.step, msg.token, msg.logprob, msg.top_ids, msg.top_logprobs,
                                  hop=0))

        async def on_error(peer: str, msg: Error) -> None:
            errors.append(msg)
            for ev in finished.values():
                ev.set()

        transport.route(Token, on_token)
        transport.route(Error, on_error)
        firsts = [Forward(rid, 0, 0, 0, me, tokens=WireTensor.from_array(np.asarray(ids, np.int32)),
                          epoch=plan["epoch"], sampling=Sampling(max_tokens=n_tokens, seed=7, stop_ids=stop_ids))
                  for rid, ids in prompts.items()]
        for msg in (firsts[1], firsts[0], firsts[0], firsts[1]):  # each twice, out of order
            await write(msg)
        with trio.fail_after(240):
            for ev in finished.values():
                await ev.wait()
        for rid in prompts:
            for hop, s in enumerate(plan["stages"]):
                await transport.send(s["peer_id"], Cancel(rid, "done", hop=hop), within=10)
        nursery.cancel_scope.cancel()
    assert not errors, errors
    return {rid: [t for _, t in sorted(steps.items())] for rid, steps in tokens.items()}
