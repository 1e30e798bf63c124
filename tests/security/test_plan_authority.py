"""Only the leader of the current term changes the plan: forged, replayed, stale, conflicting and
usurping plans are rejected, logged and counted (in virtual time on the in-memory network)."""

from __future__ import annotations

import logging
from dataclasses import replace

import cbor2
import trio

from planner.plan import Plan
from swarmd.config import LAN
from swarmd.net.identity import Signer, peer_id_of
from swarmd.net.seam import GossipMessage
from swarmd.observe.metrics import NodeMetrics
from swarmd.swarm.service import SwarmService, SwarmSettings
from swarmd.testing.memory_network import MemoryHub
from swarmd.testing.twin import run_inline
from swarmd.wire.gossip import PlanAnnouncement, encode
from tests.security.helpers import planner
from tests.swarm.swarm_helpers import descriptor, key

SWARM = "authority"


async def start(nursery, hub, n: int, bootstrap: str | None = None) -> SwarmService:
    pid = peer_id_of(key(n))
    net = hub.endpoint(pid)
    desc = replace(descriptor(pid), addresses=tuple(net.addresses()))
    boot = ((bootstrap, f"/memory/{bootstrap}"),) if bootstrap else ()
    svc = SwarmService(net, Signer(key(n)), SwarmSettings(SWARM, LAN, boot), describe_self=lambda: desc,
                       make_plan=planner, blocking=run_inline)  # the planner inline: virtual time stays put
    await nursery.start(svc.run)
    return svc


def forge(data: bytes, signer: Signer) -> bytes:
    """The same envelope with a signature made by another key."""
    env = cbor2.loads(data)
    env["sig"] = signer.sign(b"anything")
    return cbor2.dumps(env)


def with_plan(plan: Plan, **changes) -> Plan:
    return replace(plan, **changes)


async def test_only_the_current_leaders_newer_plans_are_accepted(nursery, autojump_clock, caplog):
    caplog.set_level(logging.INFO, "swarmd.swarm.service")
    hub = await nursery.start(MemoryHub().run)
    leader = await start(nursery, hub, 1)
    member = await start(nursery, hub, 2, bootstrap=leader.peer_id)
    other = await start(nursery, hub, 3, bootstrap=leader.peer_id)
    await trio.sleep(10)
    assert member.leader == leader.peer_id and member.plan == leader.plan and member.plan.epoch >= 1
    in_force, term = member.plan, member.term
    lead, rogue = Signer(key(1)), Signer(key(3))

    def ingest(origin: str, data: bytes) -> None:
        member.ingest(GossipMessage(origin, data), trio.current_time())

    newer = with_plan(in_force, epoch=in_force.epoch + 5, stages=in_force.stages[:1])
    genuine = encode(PlanAnnouncement(leader.peer_id, term, newer), lead, SWARM)
    ingest(leader.peer_id, forge(genuine, rogue))  # a newer plan in the leader's name, signed by another key
    ingest(other.peer_id, genuine)  # the leader's signed plan, published again by someone else
    ingest(leader.peer_id, encode(PlanAnnouncement(leader.peer_id, term, with_plan(in_force, epoch=in_force.epoch - 1)),
                                  lead, SWARM))  # an older epoch, signed by the leader: a replay
    ingest(leader.peer_id, encode(PlanAnnouncement(leader.peer_id, term - 1, newer), lead, SWARM))  # a past term
    ingest(leader.peer_id, encode(PlanAnnouncement(leader.peer_id, term, with_plan(in_force, stages=in_force.stages[:1])),
                                  lead, SWARM))  # the epoch in force with other contents
    ingest(other.peer_id, encode(PlanAnnouncement(other.peer_id, term, newer), rogue, SWARM))  # not the leader
    ingest(leader.peer_id, encode(PlanAnnouncement(leader.peer_id, term, in_force), lead, SWARM))  # a republish

    assert member.plan == in_force
    rejected = {k.split(":", 1)[1]: v for k, v in member.stats.items() if k.startswith("plans_rejected:")}
    assert rejected == {"forged": 1, "replayed": 1, "stale": 2, "conflicting": 1, "not_leader": 1}
    logged = caplog.text
    for reason in rejected:
        assert f"rejected a plan ({reason})" in logged

    # The counters reach /metrics with the reason as a label.
    text = NodeMetrics(lambda: snapshot(member), lambda: dict(member.stats)).render().decode()
    assert 'swarmd_plans_rejected_total{reason="forged"} 1.0' in text
    assert 'swarmd_plans_rejected_total{reason="stale"} 2.0' in text

    # The leader's next real plan still gets through.
    await start(nursery, hub, 4, bootstrap=leader.peer_id)
    await trio.sleep(10)
    assert member.plan == leader.plan and member.plan.epoch > in_force.epoch and len(member.plan.stages) == 4


def snapshot(svc: SwarmService) -> dict:
    s = svc.snapshot()
    return {**s, "self": {"peer_id": svc.peer_id}, "assignment": {"state": "idle"}, "requests_in_flight": 0}


