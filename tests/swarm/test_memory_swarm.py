"""A whole swarm in one process on the in-memory network, in virtual time (trio's MockClock)."""

from __future__ import annotations

import pytest
import trio

from swarmd.config import LAN
from swarmd.net.identity import Signer, peer_id_of
from swarmd.swarm.election import term_round
from swarmd.swarm.service import SwarmService
from swarmd.testing.memory_network import MemoryHub
from swarmd.wire.gossip import AssignmentState, AssignmentStatus
from tests.swarm.memory_swarm import Swarm
from tests.swarm.swarm_helpers import key


async def settle(swarm: Swarm, seconds: float = 10.0) -> None:
    await trio.sleep(seconds)


@pytest.fixture
async def swarm(nursery):
    hub = await nursery.start(MemoryHub().run)
    return Swarm(nursery, hub)


async def test_five_nodes_agree_on_members_leader_and_plan(swarm, autojump_clock):
    founder = await swarm.start(1)
    for n in range(2, 6):
        await swarm.start(n, bootstrap=founder.peer_id)
    await settle(swarm)
    [(leader, term, epoch, live)] = swarm.views()
    assert leader == founder.peer_id and term_round(term) == 1 and len(live) == 5 and epoch >= 1
    plans = {s.plan.to_json().__repr__() for s in swarm.services.values()}
    assert len(plans) == 1
    assert {st.peer_id for st in founder.plan.stages} == live


async def test_a_killed_leader_is_replaced_by_the_lowest_survivor_with_a_newer_plan(swarm, autojump_clock):
    founder = await swarm.start(1)
    for n in range(2, 5):
        await swarm.start(n, bootstrap=founder.peer_id)
    await settle(swarm)
    [(_, term, epoch, _)] = swarm.views()
    swarm.kill(founder.peer_id)
    await settle(swarm)
    [(leader, new_term, new_epoch, live)] = swarm.views()
    assert leader == min(swarm.services) and new_term > term and new_epoch > epoch
    assert founder.peer_id not in live
    assert founder.peer_id not in {st.peer_id for st in swarm.services[leader].plan.stages}


async def test_the_chain_view_a_head_polls_is_the_status_snapshot_without_the_descriptors(swarm, autojump_clock):
    founder = await swarm.start(1)
    for n in range(2, 5):
        await swarm.start(n, bootstrap=founder.peer_id)
    await settle(swarm)
    swarm.kill(max(swarm.services))
    await settle(swarm, 5)
    for svc in swarm.services.values():
        plan, rows = svc.chain_view()
        snap = svc.snapshot()
        assert plan == snap["plan"]
        brief = [{k: m[k] for k in ("peer_id", "state", "assignment")} for m in snap["members"]]
        assert sorted(rows, key=lambda r: r["peer_id"]) == sorted(brief, key=lambda r: r["peer_id"])
        assert "dead" in {r["state"] for r in rows}


async def test_a_joiner_whose_bootstrap_peer_is_gone_never_founds_its_own_swarm(swarm, autojump_clock):
    founder = await swarm.start(1)
    swarm.kill(founder.peer_id)
    joiner = await swarm.start(2, bootstrap=founder.peer_id)
    await settle(swarm, 20)
    assert not joiner.admitted and joiner.leader is None and joiner.plan is None


async def test_members_of_another_model_are_refused_on_both_sides(swarm, autojump_clock):
    founder = await swarm.start(1)
    other = await swarm.start(2, bootstrap=founder.peer_id, model="llama-3.2-1b")
    await settle(swarm)
    assert "serves model 'llama-3.2-1b'" in founder.membership.refused[other.peer_id]
    assert "serves model 'smollm2-135m'" in other.membership.refused[founder.peer_id]
    assert not other.admitted and founder.membership.live() == {founder.peer_id}


async def test_partitioned_halves_converge_on_one_leader_once_healed(swarm, autojump_clock):
    founder = await swarm.start(1)
    for n in range(2, 5):
        await swarm.start(n, bootstrap=founder.peer_id)
    await settle(swarm)
    ids = sorted(swarm.services)
    swarm.hub.partition(ids[:2], ids[2:])
    await settle(swarm, 15)
    assert len({s.leader for s in swarm.services.values()}) == 2
    swarm.hub.heal()
    await settle(swarm, 30)
    [(leader, _, _, live)] = swarm.views()
    assert len(live) == 4 and leader in live


async def test_a_restarted_node_rejoins_with_a_new_incarnation(swarm, autojump_clock):
    founder = await swarm.start(1)
    await swarm.start(2, bootstrap=founder.peer_id)
    third = await swarm.start(3, bootstrap=founder.peer_id)
    await settle(swarm)
    swarm.kill(third.peer_id)
    await settle(swarm)
    assert founder.membership.state_of(third.peer_id) == "dead"
    again = await swarm.start(3, bootstrap=founder.peer_id, incarnation=2)
    await settle(swarm)
    assert again.admitted and founder.membership.state_of(third.peer_id) == "alive"
    assert len({v[2] for v in swarm.views()}) == 1 and len(next(iter(swarm.views()))[3]) == 3


async def test_leaving_leader_hands_over_a_plan_without_itself(swarm, autojump_clock):
    founder = await swarm.start(1)
    for n in range(2, 4):
        await swarm.start(n, bootstrap=founder.peer_id)
    await settle(swarm)
    await founder.leave()
    swarm.kill(founder.peer_id)
    await trio.sleep(10)  # a dropped connection makes a member dead once it stays silent for a suspicion timeout
    for s in swarm.services.values():
        assert founder.peer_id not in {st.peer_id for st in s.plan.stages}
        assert s.membership.state_of(founder.peer_id) == "dead"


async def test_bad_messages_are_rejected_with_one_line_and_the_swarm_carries_on(swarm, autojump_clock, caplog):
    import cbor2

    from swarmd.swarm.service import gossip_topic
    from swarmd.wire.gossip import encode

    founder = await swarm.start(1)
    member = await swarm.start(2, bootstrap=founder.peer_id)
    await settle(swarm)
    rogue = swarm.hub.endpoint(peer_id_of(key(9)))
    await rogue.connect(founder.peer_id, ())
    topic = gossip_topic("test")
    await rogue.publish(topic, b"\xff\xfe not cbor")
    await rogue.publish(topic, cbor2.dumps({"v": 1, "t": "hb"}))
    forged = cbor2.loads(encode(heartbeat_of(member), Signer(key(2)), "test"))
    forged["body"]["seq"] += 1000  # changed after signing, sent on the member's own connection
    await member.network.publish(topic, cbor2.dumps(forged))
    await settle(swarm, 3)
    assert founder.stats["rejected_messages"] >= 3
    lines = [r.getMessage() for r in caplog.records if r.name == "swarmd.swarm.service" and "rejected" in r.getMessage()]
    for reason in ("not CBOR", "envelope: missing body, from, sig, swarm", "bad signature"):
        assert any(reason in line for line in lines), reason
    assert all("\n" not in line for line in lines)
    [(leader, _, _, live)] = swarm.views()
    assert leader == founder.peer_id and live == {founder.peer_id, member.peer_id}


def heartbeat_of(svc: SwarmService):
    return svc._heartbeat()


async def test_a_hung_member_is_found_dead_by_probes_and_comes_back_when_it_resumes(swarm, autojump_clock):
    founder = await swarm.start(1)
    for n in range(2, 5):
        await swarm.start(n, bootstrap=founder.peer_id)
    await settle(swarm)
    hung = next(p for p in swarm.services if p != founder.peer_id)
    others = [s for p, s in swarm.services.items() if p != hung]
    seen_dead: set[str] = set()
    all_dead = trio.Event()

    def watch(observer: str):
        def listener(change):
            if change.peer_id == hung and change.new == "dead":
                seen_dead.add(observer)
                if len(seen_dead) == len(others):
                    all_dead.set()
        return listener

    for s in others:
        s.state_listeners.append(watch(s.peer_id))
    swarm.hub.freeze(hung)  # like SIGSTOP: its connections stay open, so no disconnect is seen
    t0 = trio.current_time()
    await all_dead.wait()
    took = trio.current_time() - t0
    assert LAN.probe_timeout < took <= LAN.suspect_after + 2 * LAN.probe_timeout + LAN.probe_interval, took
    swarm.hub.thaw(hung)
    await settle(swarm)
    assert all(s.membership.state_of(hung) == "alive" for s in others)


async def test_a_settled_member_refreshes_once_a_refresh_interval_and_tells_its_news_at_the_next_tick(
        swarm, autojump_clock):
    founder = await swarm.start(1)
    member = await swarm.start(2, bootstrap=founder.peer_id)
    await settle(swarm)
    await trio.sleep(2 * LAN.refresh_interval)  # the heartbeats after the last news, one interval, two, four...
    sent = member.stats["heartbeats_sent"]
    await trio.sleep(20 * LAN.refresh_interval)
    assert member.stats["heartbeats_sent"] - sent in (20, 21)  # nothing new: no more than the refreshes

    sent = member.stats["heartbeats_sent"]
    for _ in range(round(200 * LAN.refresh_interval)):  # until just after a heartbeat: the next is a refresh away
        await trio.sleep(0.01)
        if member.stats["heartbeats_sent"] > sent:
            break
    sent = member.stats["heartbeats_sent"]
    member.assignment_status = lambda: AssignmentStatus(epoch=founder.coordinator.epoch, layers=(0, 30),
                                                        state=AssignmentState.LOADING)
    await trio.sleep(LAN.heartbeat_interval / 2)
    seen = founder.membership.members[member.peer_id].heartbeat.assignment
    assert (seen.state, seen.layers) == (AssignmentState.LOADING, (0, 30))
    assert member.stats["heartbeats_sent"] == sent + 1  # told at once, in one heartbeat of its own


async def test_a_swarm_of_sixteen_heartbeats_half_as_often_and_its_probes_keep_everyone_alive(swarm, autojump_clock):
    founder = await swarm.start(1)
    for n in range(2, 17):
        await swarm.start(n, bootstrap=founder.peer_id)
    await settle(swarm, 30)
    period = LAN.heartbeat_period(16)
    assert period == 2 * LAN.refresh_interval
    await trio.sleep(2 * period)  # the heartbeats after the last news, one interval, two, four...
    sent = {p: s.stats["heartbeats_sent"] for p, s in swarm.services.items()}
    suspected = {p: s.stats["transitions_to_suspect"] for p, s in swarm.services.items()}
    await trio.sleep(20 * period)
    assert {s.stats["heartbeats_sent"] - sent[p] for p, s in swarm.services.items()} <= {20, 21}
    assert {s.stats["transitions_to_suspect"] - suspected[p] for p, s in swarm.services.items()} == {0}
    [(leader, _, _, live)] = swarm.views()
    assert len(live) == 16 and leader == founder.peer_id
