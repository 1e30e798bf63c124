"""Fuzzing the gossip handler (`SwarmService.ingest`: decode, signature, schema, then membership, election and
planning): 10,000 random and mutated messages, many of them mutated below a valid signature, so the schema
checks and the state machines see them. None may raise, hang or corrupt the state; an honest member is
still heard afterwards."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from typing import Any

import cbor2
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import make_plan
from swarmd.config import LAN
from swarmd.net.gate import GuardLimits
from swarmd.net.identity import Signer, peer_id_of
from swarmd.net.seam import GossipMessage
from swarmd.swarm.service import SwarmService, SwarmSettings
from swarmd.testing.memory_network import MemoryHub
from swarmd.wire.gossip import Leave, PlanAnnouncement, _signed_part, encode
from tests.security.helpers import LAYOUT, planner
from tests.swarm.swarm_helpers import descriptor, heartbeat, key
from tests.wire.wire_examples import mutate

pytestmark = pytest.mark.slow  # about 10 s
SWARM = "fuzz"
PEERS = [peer_id_of(key(n)) for n in range(1, 5)]
SIGNERS = {peer_id_of(key(n)): Signer(key(n)) for n in range(1, 5)}
VICTIM = PEERS[0]
MESSAGES_PER_EXAMPLE = 100
ODD_VALUES: list[Any] = [None, True, -1, 0, 2**64, -(2**70), 1.5, math.nan, math.inf, "", "x" * 300, b"\x00",
                         [], [1, "a"], {}, {"k": None}, [[[[[]]]]]]


def valid_messages() -> list[bytes]:
    plan = make_plan(LAYOUT, tuple(descriptor(p) for p in sorted(PEERS)), epoch=3)
    out = []
    for i, p in enumerate(PEERS[1:]):
        out.append(encode(heartbeat(p, seq=i + 1, view=tuple(PEERS), leader=PEERS[1], term=2), SIGNERS[p], SWARM))
        out.append(encode(Leave(p, 1), SIGNERS[p], SWARM))
    out.append(encode(PlanAnnouncement(PEERS[1], 2, plan), SIGNERS[PEERS[1]], SWARM))
    return out


VALID = valid_messages()


def mutate_below_signature(data: bytes, rng: random.Random) -> bytes:
    """Change one thing inside the envelope and sign it again with the sender's key (if it has one)."""
    env = cbor2.loads(data)
    target: Any = env
    path: list[Any] = []
    for _ in range(rng.choice([0, 1, 2, 3, 3, 4, 4, 5, 6])):  # mostly deep: inside descriptors and plans
        if isinstance(target, dict) and target:
            deeper = [k for k, v in target.items() if isinstance(v, dict | list) and v]
            k = rng.choice(deeper) if deeper and rng.random() < 0.8 else rng.choice(list(target))
        elif isinstance(target, list) and target:
            k = rng.randrange(len(target))
        else:
            break
        path.append(k)
        target = target[k]
    parent = env
    for k in path[:-1]:
        parent = parent[k]
    op = rng.random()
    if not path:
        env[rng.choice(["v", "t", "from", "swarm", "extra"])] = rng.choice(ODD_VALUES + PEERS + ["hb", "plan"])
    elif op < 0.6:
        parent[path[-1]] = rng.choice(ODD_VALUES)
    elif op < 0.8 and isinstance(parent, dict):
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[rng.choice(["extra", "seq", "term", "peer_id"])] = rng.choice(ODD_VALUES)
    else:
        parent.append(rng.choice(ODD_VALUES))
    sender = env.get("from") if isinstance(env, dict) else None
    signer = SIGNERS.get(sender) if isinstance(sender, str) else None
    if signer is not None and {"v", "t", "from", "swarm", "body"} <= set(env):
        try:
            env["sig"] = signer.sign(_signed_part(env["v"], env["t"], env["from"], env["swarm"], env["body"]))
        except Exception:
            pass  # an odd value that canonical CBOR refuses: the message goes out with its old signature
    return cbor2.dumps(env)


def fuzzed(rng: random.Random) -> tuple[str, bytes]:
    kind = rng.random()
    base = rng.choice(VALID)
    if kind < 0.1:
        data = rng.randbytes(rng.randrange(200))
    elif kind < 0.2:
        data = mutate(base, rng)
    elif kind < 0.25:
        data = base
    else:
        data = mutate_below_signature(base, rng)
    origin = cbor2.loads(base)["from"] if rng.random() < 0.9 else rng.choice(PEERS)
    return origin, data


def run_example(batch: list[tuple[str, bytes]]) -> None:
    async def main() -> None:
        hub = MemoryHub()
        net = hub.endpoint(VICTIM, limits=GuardLimits(bad_frames=10**9))
        me = replace(descriptor(VICTIM), addresses=tuple(net.addresses()))
        svc = SwarmService(net, Signer(key(1)), SwarmSettings(SWARM, LAN, ((PEERS[1], f"/memory/{PEERS[1]}"),)),
                           describe_self=lambda: me, make_plan=planner)
        for origin, data in batch:
            svc.ingest(GossipMessage(origin, data), trio.current_time())
            await trio.sleep(0.01)
        json.dumps(svc.snapshot())  # the state is still whole and serialisable
        assert all(m.descriptor.peer_id == p for p, m in svc.membership.members.items())
        honest = encode(heartbeat(PEERS[3], seq=10**6, view=tuple(PEERS), leader=PEERS[1], term=2),
                        SIGNERS[PEERS[3]], SWARM)
        before = svc.stats["messages_received"]
        svc.ingest(GossipMessage(PEERS[3], honest), trio.current_time())
        assert svc.stats["messages_received"] == before + 1 and PEERS[3] in svc.membership.members

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_random_and_mutated_gossip_never_breaks_the_daemon(rng: random.Random):  # 10,000 messages
    run_example([fuzzed(rng) for _ in range(MESSAGES_PER_EXAMPLE)])


def resigned(data: bytes, change) -> bytes:
    env = cbor2.loads(data)
    change(env["body"])
    env["sig"] = SIGNERS[env["from"]].sign(_signed_part(env["v"], env["t"], env["from"], env["swarm"], env["body"]))
    return cbor2.dumps(env)


PLAN, HEARTBEAT = VALID[-1], VALID[0]


@pytest.mark.parametrize(("base", "change"), [
    (PLAN, lambda body: body["plan"].__setitem__("experts", [1, 2])),  # once ended the daemon: AttributeError
    (HEARTBEAT, lambda body: body["assignment"].__setitem__("epoch", math.inf)),  # once: OverflowError
    (HEARTBEAT, lambda body: body["descriptor"].__setitem__("incarnation", "7")),  # compared with ints later
    (HEARTBEAT, lambda body: body["descriptor"].__setitem__("memory_free", -1)),
    (HEARTBEAT, lambda body: body["descriptor"].__setitem__("rtt_ms", {"x": math.nan})),
])
def test_signed_messages_that_once_ended_the_daemon_are_now_rejected(base, change):
    async def main() -> None:
        net = MemoryHub().endpoint(VICTIM)
        svc = SwarmService(net, Signer(key(1)), SwarmSettings(SWARM, LAN), describe_self=lambda: descriptor(VICTIM),
                           make_plan=planner)
        svc.ingest(GossipMessage(cbor2.loads(base)["from"], resigned(base, change)), trio.current_time())
        assert svc.stats["rejected_messages"] == 1 and svc.membership.members == {}

    trio.run(main)
