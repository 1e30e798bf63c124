"""The swarm layer's I/O: heartbeats, probes and dials around the sans-IO state machines.

`SwarmService` owns a Membership, an Election and a PlanCoordinator. Its trio tasks only move
bytes and time: gossip in -> `handle`, the clock -> `tick`, and the actions that come back become
publishes, probes, dials and log lines. All state changes happen synchronously between awaits, so
the machines never see a half-applied update.
"""

from __future__ import annotations

import logging
import random
import secrets
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import trio

from planner.node import NodeDescriptor
from planner.plan import Plan
from swarmd import WIRE_VERSION
from swarmd.config import Timings
from swarmd.errors import RemoteProtocolError
from swarmd.net.framing import HEADER
from swarmd.net.identity import Signer, short_id
from swarmd.net.seam import BadFrame, GossipMessage, Network, PeerUnreachable, Stream, StreamClosed
from swarmd.net.streams import close_quietly, read_exact, read_frame, write_frame
from swarmd.observe.clock import ClockOffsets
from swarmd.swarm.election import Claim, Election, LeaderChanged, MembersChanged
from swarmd.swarm.membership import (
    Admitted,
    ConnectionLost,
    Dial,
    HeartbeatReceived,
    LeaveReceived,
    Membership,
    MembershipAction,
    MembershipInput,
    Probe,
    ProbeResult,
    Reconnect,
    Refused,
    RefusedMessage,
    State,
    StateChanged,
    describe,
)
from swarmd.swarm.planning import (
    Announced,
    Candidates,
    EpochSeen,
    Leadership,
    MakePlan,
    PlanAccepted,
    PlanCoordinator,
    PlanError,
    PlanFailed,
    PlanMade,
    PlanningAction,
    PlanRejected,
    PublishPlan,
)
from swarmd.tasks import spawn
from swarmd.transport.delivery import RetryPolicy
from swarmd.wire.gossip import (
    AssignmentState,
    AssignmentStatus,
    ForgedMessage,
    Heartbeat,
    IncompatibleVersion,
    Leave,
    PlanAnnouncement,
    decode,
    encode,
)

log = logging.getLogger(__name__)

PROBE_PROTOCOL = "/swarmd/probe/1.0.0"
NONCE = struct.Struct(">Q")
# A clock probe: the nonce and the sender's clock; answered with those and the receiver's clock when the probe
# came in and when the answer left (swarmd.observe.clock turns the four readings into an offset). A bare nonce is echoed.
CLOCK_PROBE = struct.Struct(">Qd")
CLOCK_ANSWER = struct.Struct(">Qddd")

PlanFunction = Callable[[MakePlan], Plan]  # may raise planner.InfeasiblePlan; runs in a worker thread


def gossip_topic(swarm: str) -> str:
    return f"{swarm}/members"


@dataclass(frozen=True)
class SwarmSettings:
    swarm: str
    timings: Timings
    bootstrap: tuple[tuple[str, str], ...] = ()  # (peer id, multiaddr) pairs

    @property
    def founder(self) -> bool:
        return not self.bootstrap


class SwarmService:
    def __init__(
        self,
        network: Network,
        signer: Signer,
        settings: SwarmSettings,
        *,
        describe_self: Callable[[], NodeDescriptor],
        assignment_status: Callable[[], AssignmentStatus] = AssignmentStatus,
        make_plan: PlanFunction,
        on_plan: Callable[[PlanAnnouncement], None] = lambda ann: None,
        clock: Callable[[], float] = time.perf_counter,
        slot_bindings: Callable[[], dict[str, str]] = dict,
        on_slots: Callable[[dict[str, str]], None] = lambda slots: None,
        blocking: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync,
        rng: random.Random | None = None,
    ) -> None:
        self.network = network
        self.blocking = blocking  # runs the planner off the event loop (a worker thread; inline in simulations)
        self._rng = rng or random.Random(random.getrandbits(64))  # the dials' backoff jitter (a simulation replays it)
        self.clock = clock  # the clock probes carry (the one trace spans are stamped with)
        self.clocks = ClockOffsets()
        self.signer = signer
        self.settings = settings
        self.timings = settings.timings
        self.topic = gossip_topic(settings.swarm)
        self.describe_self = describe_self
        self.assignment_status = assignment_status
        self.make_plan = make_plan
        self.on_plan = on_plan
        self.slot_bindings = slot_bindings  # a plan file's slots as this node binds them (gossiped while it leads)
        self.on_slots = on_slots  # told the bindings the leader gossips
        self.peer_id = network.peer_id
        first = describe_self()
        self.incarnation = first.incarnation
        self.membership = Membership(local=first, timings=self.timings, founder=settings.founder)
        self.election = Election(self.peer_id)
        self.coordinator = PlanCoordinator(self.peer_id, self.timings)
        self.seq = 0
        self.started_at = 0.0
        self.stats: Counter[str] = Counter()
        self._probe_streams: dict[str, Stream] = {}
        self._next_dial: dict[str, tuple[float, int]] = {}  # peer -> (not before, failed dials in a row)
        self._dial_retry = RetryPolicy(initial=self.timings.dial_backoff_initial, maximum=self.timings.dial_backoff_max)
        self._dialing: set[str] = set()
        self._warned: dict[tuple[str, str], float] = {}
        self._nursery: trio.Nursery | None = None
        self._leaving = False
        self._learned_at: dict[str, float] = {}  # when a member was (re)learned: see _dial_targets
        self._discovered: dict[str, tuple[str, ...]] = {}  # found by mDNS, dialed until they are members
        self.state_listeners: list[Callable[[StateChanged], None]] = []
        self._told: tuple = ()  # _news() as the last heartbeat said it
        self._news_event: trio.Event | None = None  # set when _news() changes before the next heartbeat is due

    # --- lifecycle ------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        messages = await self.network.subscribe(self.topic)
        self.network.serve(PROBE_PROTOCOL, self._serve_probe)
        self.started_at = trio.current_time()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.settings.founder:
                log.info("founding swarm %r", self.settings.swarm)
            else:
                log.info("joining swarm %r through %s", self.settings.swarm,
                         ", ".join(short_id(p) for p, _ in self.settings.bootstrap))
            self._sync(trio.current_time())
            nursery.start_soon(self._receive_loop, messages)
            nursery.start_soon(self._disconnect_loop)
            nursery.start_soon(self._heartbeat_loop)
            nursery.start_soon(self._tick_loop)
            nursery.start_soon(self._dial_loop)
            task_status.started(self)

    async def leave(self) -> None:
        """Tell the swarm we go; a leader first publishes a plan without itself."""
        self._leaving = True
        t = self.timings
        with trio.move_on_after(max(2.0, 4 * t.leave_grace)):
            others = [n for n in self._candidate_nodes() if n.peer_id != self.peer_id]
            if self.election.is_leader and others:
                c = self.coordinator
                basis = replace(c.basis, peers=frozenset(n.peer_id for n in others))
                action = MakePlan(tuple(others), max(c.max_epoch_seen, c.epoch) + 1, c.term,
                                  c.current.plan if c.current else None, basis)
                try:
                    plan = await self.blocking(self.make_plan, action)
                except Exception as e:
                    log.warning("could not re-plan before leaving: %s", e)
                else:
                    ann = PlanAnnouncement(self.peer_id, c.term, plan)
                    await self._publish(encode(ann, self.signer, self.settings.swarm))
                    log.info("published plan epoch %d without this node before leaving", plan.epoch)
            await self._publish(encode(Leave(self.peer_id, self.incarnation), self.signer, self.settings.swarm))
            log.info("left swarm %r", self.settings.swarm)
            await trio.sleep(t.leave_grace)

    def add_discovered(self, peer_id: str, addresses: tuple[str, ...]) -> None:
        """A peer found outside the gossip (mDNS): dial it, and gossip does the rest."""
        if peer_id != self.peer_id and peer_id not in self.membership.members:
            self._discovered[peer_id] = addresses

    # --- queries ----------------------------------------------------------------------------
    @property
    def admitted(self) -> bool:
        return self.membership.admitted

    @property
    def leader(self) -> str | None:
        return self.election.leader

    @property
    def term(self) -> int:
        return self.election.term

    @property
    def plan(self) -> Plan | None:
        ann = self.coordinator.current
        return ann.plan if ann else None

    def rtts(self) -> dict[str, float]:
        return {p: round(m.rtt_ms, 3) for p, m in self.membership.members.items()
                if m.rtt_ms is not None and m.state != State.DEAD}

    def chain_view(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The plan (its JSON) and each member's peer id, state and assignment: what a head looks at ten times a
        second while it serves. `snapshot`'s rows without the descriptors (this node's asks about every link)."""
        rows = [{"peer_id": self.peer_id, "state": str(State.ALIVE), "assignment": self.assignment_status().to_json()}]
        rows += [{"peer_id": p, "state": str(m.state), "assignment": m.heartbeat.assignment.to_json()}
                 for p, m in self.membership.members.items()]
        return (self.plan.to_json() if self.plan else None), rows

    def snapshot(self) -> dict[str, Any]:
        """What `swarmd status --json` shows about the swarm (the node adds its own parts)."""
        now = trio.current_time()
        me = self.describe_self()
        members = [self._member_row(me, State.ALIVE, 0.0, None, self.assignment_status(), "self")]
        for peer in sorted(self.membership.members):
            m = self.membership.members[peer]
            members.append(self._member_row(m.descriptor, m.state, now - m.last_heard, m.rtt_ms,
                                            m.heartbeat.assignment, m.reason))
        return {
            "swarm": self.settings.swarm,
            "admitted": self.admitted,
            "leader": self.leader,
            "term": self.term,
            "members": members,
            "refused": [{"peer_id": p, "reason": r} for p, r in sorted(self.membership.refused.items())],
            "plan": self.plan.to_json() if self.plan else None,
            "plan_error": self.coordinator.error or None,
        }

    @staticmethod
    def _member_row(d: NodeDescriptor, state: State, last_seen: float, rtt: float | None,
                    a: AssignmentStatus, reason: str) -> dict[str, Any]:
        return {
            "peer_id": d.peer_id,
            "state": str(state),
            "last_seen_s": round(last_seen, 3),
            "rtt_ms": None if rtt is None else round(rtt, 3),
            "label": d.label,
            "device": d.device,
            "device_name": d.device_name,
            "memory_total": d.memory_total,
            "memory_free": d.memory_free,
            "flops": d.flops,
            "mem_bandwidth": d.mem_bandwidth,
            "load": d.load,
            "incarnation": d.incarnation,
            "addresses": list(d.addresses),
            "assignment": a.to_json(),
            "reason": reason,
        }

    # --- the state machines -------------------------------------------------------------------
    def _feed(self, msg: MembershipInput, now: float) -> None:
        actions = self.membership.handle(msg, now)
        self._on_membership(actions)
        if any(not isinstance(a, Probe) for a in actions):  # else (a probe's answer) the next tick syncs
            self._sync(now)

    def _sync(self, now: float) -> None:
        m = self.membership
        dead = frozenset(p for p, x in m.members.items() if x.state == State.DEAD)
        changes = self.election.handle(MembersChanged(frozenset(m.live()), dead, m.admitted), now)
        self._on_election(changes, now)
        nodes = self._candidate_nodes()
        failed = frozenset((n.peer_id, n.incarnation) for n in nodes
                           if self._assignment_of(n.peer_id).state == AssignmentState.FAILED)
        self._on_planning(self.coordinator.handle(Candidates(nodes, failed), now))

    def _candidate_nodes(self) -> tuple[NodeDescriptor, ...]:
        """This node and every member not dead: who the leader plans over."""
        others = [m.descriptor for m in self.membership.members.values() if m.state != State.DEAD]
        return (self._self_descriptor(), *others)

    def _assignment_of(self, peer: str) -> AssignmentStatus:
        if peer == self.peer_id:
            return self.assignment_status()
        return self.membership.members[peer].heartbeat.assignment

    def _on_membership(self, actions: list[MembershipAction]) -> None:
        for a in actions:
            if isinstance(a, Probe):
                self._spawn(self._probe, a.peer_id)
            elif isinstance(a, Dial):
                self._next_dial.pop(a.peer_id, None)
                self._learned_at[a.peer_id] = trio.current_time()
            elif isinstance(a, StateChanged):
                self.stats[f"transitions_to_{a.new}"] += 1
                level = logging.WARNING if a.new != State.ALIVE else logging.INFO
                log.log(level, describe(a))
                if a.new == State.DEAD:
                    self._drop_probe_stream(a.peer_id)
                for listener in self.state_listeners:
                    listener(a)
            elif isinstance(a, Reconnect):
                self.stats["reconnects"] += 1
                log.warning("member %s: reconnecting: %s", short_id(a.peer_id), a.reason)
                self.network.hang_up(a.peer_id)
            elif isinstance(a, Refused):
                self.stats["refusals"] += 1
                log.warning(describe(a))
            elif isinstance(a, Admitted):
                log.info(describe(a))

    def _on_election(self, changes: list[LeaderChanged], now: float) -> None:
        for c in changes:
            self.stats["leader_changes"] += 1
            if c.leader is None:
                log.info("no leader (%s)", c.reason)
            else:
                me = " (this node)" if c.leader == self.peer_id else ""
                log.info("leader is %s%s on term %d: %s", short_id(c.leader), me, c.term, c.reason)
            self._on_planning(self.coordinator.handle(Leadership(c.term, c.leader), now))

    def _on_planning(self, actions: list[PlanningAction]) -> None:
        for a in actions:
            if isinstance(a, MakePlan):
                self._spawn(self._run_planner, a)
            elif isinstance(a, PublishPlan):
                self._spawn(self._publish, encode(a.announcement, self.signer, self.settings.swarm))
            elif isinstance(a, PlanAccepted):
                plan = a.announcement.plan
                mine = [s for s in plan.stages if s.peer_id == self.peer_id]
                role = f"blocks {mine[0].layers[0]}-{mine[0].layers[1] - 1}" if mine else "no blocks"
                log.info("plan epoch %d from %s (term %d): %d stages, this node runs %s", plan.epoch,
                         short_id(a.announcement.leader), a.announcement.term, len(plan.stages), role)
                self.stats["plans_accepted"] += 1
                self.on_plan(a.announcement)
            elif isinstance(a, PlanError):
                log.warning("cannot plan: %s", a.reason)
            elif isinstance(a, PlanRejected):
                ann = a.announcement
                self._plan_rejected(a.reason, ann.leader, f"epoch {ann.plan.epoch} of term {ann.term} from "
                                                          f"{short_id(ann.leader)}: {a.detail}")

    def _plan_rejected(self, reason: str, sender: str, detail: str) -> None:
        """Count a plan refused by `reason` (forged, replayed, stale, conflicting, not_leader) and log it."""
        self.stats[f"plans_rejected:{reason}"] += 1
        message = f"rejected a plan ({reason}): {detail}"
        if reason in ("stale", "not_leader"):  # also what a leader change leaves in flight
            log.info(message)
        else:
            self._warn_once(f"plan-{reason}-{sender}", message)

    # --- tasks --------------------------------------------------------------------------------
    def _spawn(self, fn, *args) -> None:
        spawn(self._nursery, fn, *args)

    async def _tick_loop(self) -> None:
        period = min(0.25, self.timings.heartbeat_interval / 4)
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            self._on_membership(self.membership.tick(now))
            self._sync(now)
            self._on_election(self.election.tick(now), now)
            self._on_planning(self.coordinator.tick(now))
            if self._news_event is not None and self._news() != self._told:
                self._news_event.set()

    def _news(self) -> tuple:
        """What the others act on as soon as it changes: who is alive, the leader and term, the plan's epoch, how
        far this node's part of the plan got, whether its stage has a KV slot free (heads admit requests by
        that; the count itself waits for the next heartbeat, so a busy swarm's gossip stays bounded), and the
        leader's bindings of a plan file's slots."""
        a = self.assignment_status()
        full = a.kv is not None and a.kv[1] >= a.kv[0]
        slots = tuple(sorted(self.slot_bindings().items())) if self.election.is_leader else ()
        return (frozenset(self.membership.live()), self.admitted, self.election.term, self.election.leader,
                self.coordinator.epoch, a.epoch, a.layers, a.state, tuple(sorted(a.experts.items())), full, slots)

    async def _heartbeat_loop(self) -> None:
        """A heartbeat at the next tick when `_news()` changes, then after one heartbeat interval, two, four...,
        up to `heartbeat_period` (the refresh interval, spread out in large swarms) while nothing changes: news
        (a join, a refusal, a plan) is told again soon, a settled swarm's refreshes are far apart."""
        next_at, gap = trio.current_time(), self.timings.heartbeat_interval
        while not self._leaving:
            news = self._news()
            if news != self._told:
                next_at, gap = trio.current_time(), self.timings.heartbeat_interval
            self.seq += 1
            self._told, self._news_event = news, trio.Event()
            await self._publish(encode(self._heartbeat(), self.signer, self.settings.swarm))
            self.stats["heartbeats_sent"] += 1
            if trio.current_time() >= next_at:
                next_at += min(gap, self.timings.heartbeat_period(len(self.membership.live())))
                gap *= 2
            with trio.move_on_at(next_at):
                await self._news_event.wait()

    def _self_descriptor(self) -> NodeDescriptor:
        return replace(self.describe_self(), rtt_ms=self.rtts())

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            descriptor=self._self_descriptor(),
            seq=self.seq,
            term=self.election.term,
            leader=self.election.leader,
            plan_epoch=self.coordinator.epoch,
            view=tuple(sorted(self.membership.live())),
            admitted=self.admitted,
            assignment=self.assignment_status(),
            slots=self.slot_bindings() if self.election.is_leader else {},
        )

    async def _publish(self, data: bytes) -> None:
        try:
            await self.network.publish(self.topic, data)
        except Exception as e:
            self._warn_once("publish", f"publishing on {self.topic} failed: {e}")

    async def _receive_loop(self, messages) -> None:
        async for msg in messages:
            self.ingest(msg, trio.current_time())

    def ingest(self, msg: GossipMessage, now: float) -> None:
        """One gossip message from the network: checked, then fed to the state machines. Never raises for
        anything a peer sends; a message that fails its checks is a strike against its publisher."""
        try:
            decoded = decode(msg.data, self.settings.swarm, origin=msg.origin)
        except IncompatibleVersion as e:
            self._feed(RefusedMessage(e.peer_id, f"speaks wire version {e.shown}, "
                                                  f"this daemon speaks {WIRE_VERSION}"), now)
            return
        except RemoteProtocolError as e:
            self.stats["rejected_messages"] += 1
            if isinstance(e, ForgedMessage) and e.tag == "plan":
                self._plan_rejected(e.kind, msg.origin, str(e))
            else:
                self._warn_once(msg.origin, f"rejected a message from {short_id(msg.origin)}: {e}")
            self.network.strike(msg.origin, f"gossip: {e}")
            return
        self.stats["messages_received"] += 1
        if isinstance(decoded, Heartbeat):
            self._on_membership(self.membership.handle(HeartbeatReceived(decoded), now))
            if decoded.peer_id in self.membership.members:
                claim = Claim(decoded.peer_id, decoded.term, decoded.leader)
                self._on_election(self.election.handle(claim, now), now)
                self.coordinator.handle(EpochSeen(decoded.plan_epoch), now)
            self._sync(now)
            if decoded.slots and decoded.peer_id == self.election.leader:
                self.on_slots(dict(decoded.slots))
        elif isinstance(decoded, PlanAnnouncement):
            if decoded.leader in self.membership.refused:
                return
            self._on_planning(self.coordinator.handle(Announced(decoded), now))
        elif isinstance(decoded, Leave):
            self._feed(LeaveReceived(decoded.peer_id, decoded.incarnation), now)

    async def _disconnect_loop(self) -> None:
        async for peer in self.network.disconnects():
            self._drop_probe_stream(peer)
            self._feed(ConnectionLost(peer), trio.current_time())

    async def _dial_loop(self) -> None:
        while True:
            now = trio.current_time()
            if not self.admitted and now - self.started_at > 5.0:
                self._say_not_admitted()
            for peer, addresses, is_bootstrap in self._dial_targets():
                if peer == self.peer_id or peer in self._dialing or self.network.is_connected(peer):
                    continue
                if now < self._next_dial.get(peer, (0.0, 0))[0]:
                    continue
                self._dialing.add(peer)
                self._spawn(self._dial, peer, addresses, is_bootstrap)
            await trio.sleep(min(0.5, self.timings.heartbeat_interval))

    def _say_not_admitted(self) -> None:
        connected = [short_id(p) for p, _ in self.settings.bootstrap if self.network.is_connected(p)]
        why = "; ".join(f"refused by {short_id(p)}: {r}" for p, r in self.membership.refused.items())
        detail = why or (f"connected to {', '.join(connected)}, waiting for a member to accept this node"
                         if connected else "no bootstrap peer reachable yet")
        self._warn_once("admission", f"not admitted to swarm {self.settings.swarm!r} yet: {detail}", every=10.0)

    def _dial_targets(self) -> list[tuple[str, tuple[str, ...], bool]]:
        targets: dict[str, tuple[tuple[str, ...], bool]] = {
            p: (a, False) for p, a in self._discovered.items() if p not in self.membership.members}
        if not self.admitted:
            for peer, addr in self.settings.bootstrap:
                targets[peer] = ((addr if "/p2p/" in addr else f"{addr}/p2p/{peer}",), True)
        # Two peers dialing each other at once end up with two connections and streams that break
        # while one closes; so the lower peer id dials, and the higher one only if no connection
        # came up after a grace time (the lower one may not be able to reach it).
        grace = 3 * self.timings.heartbeat_interval
        now = trio.current_time()
        for peer, m in self.membership.members.items():
            if m.left:  # dead ones are dialed too, with backoff: a healed partition must reconnect
                continue
            if peer < self.peer_id and now - self._learned_at.get(peer, 0.0) < grace and peer not in targets:
                continue
            targets[peer] = (m.descriptor.addresses, peer in targets)
        return [(p, a, b) for p, (a, b) in targets.items()]

    async def _dial(self, peer: str, addresses: tuple[str, ...], is_bootstrap: bool) -> None:
        try:
            await self.network.connect(peer, addresses)
        except PeerUnreachable as e:
            _, failures = self._next_dial.get(peer, (0.0, 0))
            delay = self._dial_retry.backoff(failures, self._rng)
            self._next_dial[peer] = (trio.current_time() + delay, failures + 1)
            if is_bootstrap and not self.admitted:
                log.warning("bootstrap peer %s unreachable (%s); retrying in %.1f s, not admitted yet",
                            short_id(peer), e, delay)
            else:
                log.debug("dial %s failed: %s", short_id(peer), e)
        else:
            self._next_dial.pop(peer, None)
            log.debug("connected to %s", short_id(peer))
        finally:
            self._dialing.discard(peer)

    async def _run_planner(self, action: MakePlan) -> None:
        now = trio.current_time()
        try:
            plan = await self.blocking(self.make_plan, action)
        except Exception as e:
            msg = PlanFailed(str(e).splitlines()[0] if str(e) else type(e).__name__, action.basis, action.term)
            self._on_planning(self.coordinator.handle(msg, now))
            return
        self.stats["plans_made"] += 1
        self._on_planning(self.coordinator.handle(PlanMade(plan, action.basis, action.term), trio.current_time()))

    # --- probes -------------------------------------------------------------------------------
    async def _probe(self, peer: str) -> None:
        t0 = trio.current_time()
        ok, rtt, err, refused = False, None, "", False
        nonce = secrets.randbits(64)
        must_dial = not self.network.is_connected(peer)
        try:
            with trio.fail_after(self.timings.probe_timeout):
                stream = self._probe_streams.get(peer)
                if stream is None:
                    stream = await self.network.open_stream(peer, PROBE_PROTOCOL)
                    self._probe_streams[peer] = stream
                sent = self.clock()
                await write_frame(stream, CLOCK_PROBE.pack(nonce, sent))
                answer = await read_frame(stream, CLOCK_ANSWER.size)
                back = self.clock()
                if len(answer) != CLOCK_ANSWER.size:
                    raise StreamClosed("wrong probe answer")
                echoed, echoed_sent, received, answered = CLOCK_ANSWER.unpack(answer)
                if (echoed, echoed_sent) != (nonce, sent):
                    raise StreamClosed("wrong probe answer")
            ok, rtt = True, (trio.current_time() - t0) * 1e3
            self.clocks.add(peer, sent, received, answered, back)
        except trio.TooSlowError:
            err = f"no answer within {self.timings.probe_timeout:g} s"
        except PeerUnreachable as e:
            err = str(e)
            # The dial was turned away inside the timeout (py-libp2p has already retried it a few times):
            # nothing listens there. A hung process accepts and then says nothing, a black-holed link
            # swallows the dial: both time out instead.
            refused = must_dial
        except StreamClosed as e:
            err = str(e)
        if not ok:
            self._drop_probe_stream(peer)
            self.stats["probes_failed"] += 1
        self._feed(ProbeResult(peer, ok, rtt, err, refused), trio.current_time())

    async def _serve_probe(self, peer: str, stream: Stream) -> None:
        """Echo 8-byte nonces, and answer 16-byte clock probes with this daemon's clock readings, at most
        `probes_per_second` of them from one peer; anything else is a bad frame (the guard around every served
        stream then resets it and counts a strike)."""
        gate = self.network.gate
        lim = gate.limits
        while True:
            (n,) = HEADER.unpack(await read_exact(stream, HEADER.size))
            if n != CLOCK_PROBE.size and n > NONCE.size:  # refused before reading it, as any oversized frame
                raise BadFrame(f"frame of {n} bytes is over the {NONCE.size} byte limit")
            probe = await read_exact(stream, n)
            received = self.clock()
            if len(probe) not in (NONCE.size, CLOCK_PROBE.size):
                raise BadFrame(f"a probe is {NONCE.size} or {CLOCK_PROBE.size} bytes, not {len(probe)}")
            if not gate.within_rate(peer, "probe", trio.current_time(), lim.probes_per_second, lim.probe_burst):
                raise BadFrame(f"probes faster than {lim.probes_per_second:g}/s")
            if len(probe) == CLOCK_PROBE.size:
                probe = CLOCK_ANSWER.pack(*CLOCK_PROBE.unpack(probe), received, self.clock())
            await write_frame(stream, probe)

    def _drop_probe_stream(self, peer: str) -> None:
        stream = self._probe_streams.pop(peer, None)
        if stream is not None:
            self._spawn(close_quietly, stream)

    def _warn_once(self, key: str, message: str, every: float = 30.0) -> None:
        """One line per distinct problem per `every` seconds, so a bad peer cannot flood the log."""
        now = trio.current_time()
        k = (key, message)
        if now - self._warned.get(k, -every) >= every:
            self._warned[k] = now
            log.warning(message)

