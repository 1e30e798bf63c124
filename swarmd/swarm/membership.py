"""Who is in the swarm: a sans-IO state machine (heartbeats and probe results in, actions out).

Every change of a member's state is one row of `TRANSITIONS`, fired by `_fire`; anything else raises
`LocalProtocolError`. In words:

    (unknown) --compatible heartbeat (JOINED)--> alive
    alive   --neither a heartbeat nor a probe answer for the suspicion timeout (SILENT), a lost connection,
              a failed probe--> suspect
    suspect --heartbeat or probe answer--> alive
    suspect --direct probe failed, or no answer for another timeout (SUSPICION_EXPIRED)--> dead
    suspect (its connection dropped) --redials refused for a heartbeat interval (REDIALS_REFUSED)--> dead
    dead    --a newer heartbeat confirmed by a probe (CONFIRMED_BACK)--> alive
    any     --higher incarnation (REJOINED, a restart)--> alive;  any --LEFT--> dead
    any     --incompatible heartbeat (REFUSED)--> (unknown);  dead --dead_retention (FORGOTTEN)--> (unknown)

Liveness is heartbeats and direct probes alike: a member that answers its routine probes is alive however
rarely it publishes (large swarms publish and probe less often: `Timings.spread`). One that answers its probes
but whose heartbeats stop for `Timings.gossip_timeout` is reconnected (a `Reconnect` action, no state change):
its connection stands but the gossip stream over it is broken (py-libp2p can keep a dead pubsub stream on a
live connection after a reset), so no heartbeat or plan would come that way again until the connection is
made anew.

A member whose connection dropped is not dead at its first failed probe (a reset link fails the first
redials while it comes back), but it need not be silent for a whole suspicion timeout either: when
`REFUSALS_TO_DIE` redials in a row are refused (nothing listens at its address: a killed process) and no
heartbeat came for a heartbeat interval, it is dead. A hung process keeps its connection and accepts
dials, so only silence for the full timeout marks it.

A member of another wire version or model is never admitted: it is listed as refused with the
reason. A daemon that joins (has bootstrap peers) counts as admitted once an admitted, compatible
member's heartbeat names it; a founder is admitted from the start. Time is whatever `now` the
caller passes, so tests drive it with a fake clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from planner.node import NodeDescriptor
from swarmd.config import Timings
from swarmd.errors import LocalProtocolError
from swarmd.net.identity import short_id
from swarmd.wire.gossip import Heartbeat

# Redials in a row refused after a dropped connection that make a member dead (with a heartbeat interval of
# silence): one refusal can be a reset of the new connection, several in a row are a dead process. (Each
# redial is itself several connection attempts: py-libp2p retries a refused dial three times.)
REFUSALS_TO_DIE = 2


class State(enum.StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


class Cause(enum.Enum):
    """Why a member's state changes: the events of `TRANSITIONS`."""

    JOINED = "joined"  # first compatible heartbeat
    REJOINED = "rejoined"  # a heartbeat of a higher incarnation (the process restarted)
    HEARTBEAT = "heartbeat"  # a heartbeat after silence
    PROBE_ANSWERED = "probe answered"
    CONFIRMED_BACK = "confirmed back"  # dead, then a newer heartbeat and a probe answer
    SILENT = "silent"  # no heartbeat nor probe answer for the suspicion timeout
    CONNECTION_LOST = "connection lost"
    PROBE_FAILED = "probe failed"
    REDIALS_REFUSED = "redials refused"  # its connection dropped and nothing listens at its address
    SUSPICION_EXPIRED = "suspicion expired"
    LEFT = "left"
    REFUSED = "refused"  # an incompatible heartbeat (another wire version, model or weights)
    FORGOTTEN = "forgotten"  # dead for `dead_retention`


_ANY = (State.ALIVE, State.SUSPECT, State.DEAD)

# (state, cause) -> new state; None: no longer a member (unknown). Every state change goes through this table.
TRANSITIONS: dict[tuple[State | None, Cause], State | None] = {
    (None, Cause.JOINED): State.ALIVE,
    **{(s, Cause.REJOINED): State.ALIVE for s in _ANY},
    (State.SUSPECT, Cause.HEARTBEAT): State.ALIVE,
    (State.SUSPECT, Cause.PROBE_ANSWERED): State.ALIVE,
    (State.DEAD, Cause.CONFIRMED_BACK): State.ALIVE,
    (State.ALIVE, Cause.SILENT): State.SUSPECT,
    (State.ALIVE, Cause.CONNECTION_LOST): State.SUSPECT,
    (State.ALIVE, Cause.PROBE_FAILED): State.SUSPECT,
    (State.SUSPECT, Cause.PROBE_FAILED): State.DEAD,
    (State.SUSPECT, Cause.REDIALS_REFUSED): State.DEAD,
    (State.SUSPECT, Cause.SUSPICION_EXPIRED): State.DEAD,
    **{(s, Cause.LEFT): State.DEAD for s in _ANY},
    **{(s, Cause.REFUSED): None for s in _ANY},
    (State.DEAD, Cause.FORGOTTEN): None,
}
# Announced even when the state stays (a restart, a leave): the rest of the daemon acts on them.
ANNOUNCED_WHEN_UNCHANGED = frozenset({Cause.REJOINED, Cause.LEFT})


# --- inputs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeartbeatReceived:
    heartbeat: Heartbeat


@dataclass(frozen=True)
class LeaveReceived:
    peer_id: str
    incarnation: int


@dataclass(frozen=True)
class ProbeResult:
    peer_id: str
    ok: bool
    rtt_ms: float | None = None
    error: str = ""
    refused: bool = False  # the probe had to dial, and the dial was turned away at once (not a timeout)


@dataclass(frozen=True)
class ConnectionLost:
    peer_id: str


@dataclass(frozen=True)
class RefusedMessage:
    """A message whose envelope already shows the sender cannot join (e.g. another wire version)."""

    peer_id: str
    reason: str


MembershipInput = HeartbeatReceived | LeaveReceived | ProbeResult | ConnectionLost | RefusedMessage


# --- actions ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Probe:
    peer_id: str


@dataclass(frozen=True)
class Dial:
    peer_id: str
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class StateChanged:
    peer_id: str
    old: State | None
    new: State
    reason: str


@dataclass(frozen=True)
class Reconnect:
    """Close the connection to `peer_id` (the dialer makes a new one, and gossip a new stream over it)."""

    peer_id: str
    reason: str


@dataclass(frozen=True)
class Refused:
    peer_id: str
    reason: str


@dataclass(frozen=True)
class Admitted:
    via: str


@dataclass(frozen=True)
class Forgotten:
    peer_id: str


MembershipAction = Probe | Dial | StateChanged | Reconnect | Refused | Admitted | Forgotten


@dataclass
class Member:
    peer_id: str
    state: State
    heartbeat: Heartbeat
    last_heard: float  # its last heartbeat or probe answer
    since: float  # when `state` was entered
    seq: int
    cause: Cause = Cause.JOINED  # of the last transition
    probe_sent: float | None = None  # when the outstanding probe went out
    last_probe: float = 0.0
    rtt_ms: float | None = None
    newer_while_dead: bool = False  # a fresh heartbeat arrived while dead: a probe decides
    refused_redials: int = 0  # probes in a row, since the connection dropped, whose dial was refused
    last_gossip: float = 0.0  # its last heartbeat (or when a reconnect was asked for, or it joined)
    reason: str = ""

    @property
    def incarnation(self) -> int:
        return self.heartbeat.incarnation

    @property
    def left(self) -> bool:
        """Dead because it said it leaves (not because it went silent)."""
        return self.cause is Cause.LEFT

    @property
    def connection_lost(self) -> bool:
        """Suspect because its connection dropped, not because it went silent."""
        return self.cause is Cause.CONNECTION_LOST

    @property
    def descriptor(self) -> NodeDescriptor:
        return self.heartbeat.descriptor


def incompatibility(local: NodeDescriptor, remote: NodeDescriptor) -> str | None:
    """Why `remote` cannot be in `local`'s swarm, or None if it can."""
    if remote.wire_version != local.wire_version:
        return f"speaks wire version {remote.wire_version}, this daemon speaks {local.wire_version}"
    if remote.model_name != local.model_name:
        return f"serves model {remote.model_name!r}, this swarm serves {local.model_name!r}"
    if remote.model_digest and local.model_digest and remote.model_digest != local.model_digest:
        return (f"serves different weights of {remote.model_name!r} "
                f"(digest {remote.model_digest[:12]}, here {local.model_digest[:12]})")
    return None


@dataclass
class Membership:
    local: NodeDescriptor  # what compatibility is judged against
    timings: Timings
    founder: bool  # started without bootstrap peers: admitted from the start
    members: dict[str, Member] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    admitted: bool = False

    def __post_init__(self) -> None:
        self.admitted = self.founder

    @property
    def self_id(self) -> str:
        return self.local.peer_id

    # --- queries --------------------------------------------------------------------------
    def live(self) -> set[str]:
        """Members not dead, self included: who elections and plans count."""
        return {p for p, m in self.members.items() if m.state != State.DEAD} | {self.self_id}

    def state_of(self, peer_id: str) -> State | None:
        if peer_id == self.self_id:
            return State.ALIVE
        m = self.members.get(peer_id)
        return m.state if m else None

    def suspicion_timeout(self) -> float:
        return self.timings.suspicion_timeout(len(self.live()))

    # --- inputs ---------------------------------------------------------------------------
    def handle(self, msg: MembershipInput, now: float) -> list[MembershipAction]:
        if isinstance(msg, HeartbeatReceived):
            return self._on_heartbeat(msg.heartbeat, now)
        if isinstance(msg, LeaveReceived):
            return self._on_leave(msg, now)
        if isinstance(msg, ProbeResult):
            return self._on_probe_result(msg, now)
        if isinstance(msg, ConnectionLost):
            m = self.members.get(msg.peer_id)
            if m and m.state == State.ALIVE:
                return [*self._fire(m, Cause.CONNECTION_LOST, now, "connection lost"), *self._probe(m, now)]
            return []
        if isinstance(msg, RefusedMessage):
            return self._refuse(msg.peer_id, msg.reason)
        raise TypeError(f"not a membership input: {msg!r}")

    def tick(self, now: float) -> list[MembershipAction]:
        out: list[MembershipAction] = []
        members = len(self.live())
        timeout, probe_period = self.timings.suspicion_timeout(members), self.timings.probe_period(members)
        gossip_timeout = self.timings.gossip_timeout(members)
        for m in list(self.members.values()):
            if m.probe_sent is not None and now - m.probe_sent > 3 * self.timings.probe_timeout:
                m.probe_sent = None  # its result was lost: allow another
            if m.state == State.ALIVE:
                if now - m.last_heard > timeout:
                    out += self._fire(m, Cause.SILENT, now, f"no heartbeat or probe answer for "
                                                            f"{now - m.last_heard:.1f} s")
                    out += self._probe(m, now)
                elif now - m.last_probe >= probe_period:
                    out += self._probe(m, now)
                if m.state == State.ALIVE and now - m.last_gossip > gossip_timeout:
                    m.last_gossip = now  # one reconnect per timeout
                    out.append(Reconnect(m.peer_id, f"it answers probes but sent no heartbeat for "
                                                    f"{gossip_timeout:.1f} s"))
            elif m.state == State.SUSPECT:
                if now - m.since > timeout:
                    out += self._fire(m, Cause.SUSPICION_EXPIRED, now, "suspect for a whole timeout without an answer")
                elif m.probe_sent is None:
                    out += self._probe(m, now)
            elif m.state == State.DEAD and now - m.since > self.timings.dead_retention:
                out += self._fire(m, Cause.FORGOTTEN, now, "dead for the retention time")
        return out

    # --- transitions ----------------------------------------------------------------------
    def _on_heartbeat(self, hb: Heartbeat, now: float) -> list[MembershipAction]:
        peer = hb.peer_id
        if peer == self.self_id:
            return []
        reason = incompatibility(self.local, hb.descriptor)
        if reason:
            refusal = self._refuse(peer, reason)
            gone = self.members.get(peer)
            if gone is not None:
                refusal += self._fire(gone, Cause.REFUSED, now, f"refused: {reason}")
            return refusal
        self.refused.pop(peer, None)
        out: list[MembershipAction] = []
        m = self.members.get(peer)
        if m is None:
            m = Member(peer, State.ALIVE, hb, last_heard=now, since=now, seq=hb.seq, last_probe=now, last_gossip=now)
            out += self._fire(m, Cause.JOINED, now, "joined", entering=True)
            out.append(Dial(peer, hb.descriptor.addresses))
        elif hb.incarnation > m.incarnation:
            addresses_changed = hb.descriptor.addresses != m.descriptor.addresses
            old = m.state
            m.heartbeat, m.seq, m.last_heard, m.last_gossip, m.newer_while_dead = hb, hb.seq, now, now, False
            out += self._fire(m, Cause.REJOINED, now, f"rejoined (incarnation {hb.incarnation})")
            if addresses_changed or old == State.DEAD:
                out.append(Dial(peer, hb.descriptor.addresses))
        elif hb.incarnation < m.incarnation or hb.seq <= m.seq:
            return []  # stale or duplicate
        elif m.state == State.DEAD:
            m.seq, m.last_gossip = hb.seq, now
            if not m.left:
                m.newer_while_dead = True
                out += self._probe(m, now)
            return out
        else:
            m.heartbeat, m.seq, m.last_heard, m.last_gossip = hb, hb.seq, now, now
            if m.state == State.SUSPECT:
                out += self._fire(m, Cause.HEARTBEAT, now, "heartbeat resumed")
        if not self.admitted and hb.admitted and self.self_id in hb.view and m.state == State.ALIVE:
            self.admitted = True
            out.append(Admitted(peer))
        return out

    def _on_leave(self, msg: LeaveReceived, now: float) -> list[MembershipAction]:
        m = self.members.get(msg.peer_id)
        if m is None or msg.incarnation < m.incarnation or m.left:
            return []
        return self._fire(m, Cause.LEFT, now, "left the swarm")

    def _on_probe_result(self, r: ProbeResult, now: float) -> list[MembershipAction]:
        m = self.members.get(r.peer_id)
        if m is None:
            return []
        m.probe_sent = None
        if r.ok:
            if r.rtt_ms is not None:
                m.rtt_ms = r.rtt_ms
            if m.state != State.DEAD:
                m.last_heard = now
            if m.state == State.SUSPECT:
                return self._fire(m, Cause.PROBE_ANSWERED, now, "answered a direct probe")
            if m.state == State.DEAD and m.newer_while_dead and not m.left:
                m.newer_while_dead = False
                m.last_heard = now
                return self._fire(m, Cause.CONFIRMED_BACK, now, "back: heartbeats again and answers probes")
            return []
        detail = f": {r.error}" if r.error else ""
        if m.state == State.SUSPECT:
            if m.connection_lost and now - m.since <= self.suspicion_timeout():
                # A reset link fails the first probes while it is dialled again: one failure proves nothing
                # (tick probes again meanwhile). Refused redials in a row over a heartbeat interval of
                # silence are a process that is gone; anything else waits for the whole suspicion timeout.
                m.refused_redials = m.refused_redials + 1 if r.refused else 0
                if m.refused_redials >= REFUSALS_TO_DIE and now - m.since >= self.timings.heartbeat_interval:
                    return self._fire(m, Cause.REDIALS_REFUSED, now, f"connection lost and {m.refused_redials} "
                                                                     f"redials refused{detail}")
                return []
            return self._fire(m, Cause.PROBE_FAILED, now, f"direct probe failed{detail}")
        if m.state == State.ALIVE:
            # A routine probe that fails while heartbeats or other probe answers still arrive says the path
            # is slow (a busy CPU), not that the member is gone: only silence makes it suspect.
            if now - m.last_heard <= self.suspicion_timeout():
                return []
            return [*self._fire(m, Cause.PROBE_FAILED, now, f"no heartbeat and probe failed{detail}"),
                    *self._probe(m, now)]
        m.newer_while_dead = False
        return []

    def _fire(self, m: Member, cause: Cause, now: float, reason: str, *,
              entering: bool = False) -> list[MembershipAction]:
        """Apply `TRANSITIONS[(m's state, cause)]` (`entering`: m is not a member yet); a pair that is not in
        the table is a bug here, not the peer's doing."""
        old = None if entering else m.state
        try:
            new = TRANSITIONS[(old, cause)]
        except KeyError:
            raise LocalProtocolError(f"member {short_id(m.peer_id)}: {cause.value} in state {old}") from None
        if new is None:  # no longer a member
            del self.members[m.peer_id]
            if cause is Cause.FORGOTTEN:
                return [Forgotten(m.peer_id)]
            return [StateChanged(m.peer_id, old, State.DEAD, reason)]  # the daemon counts it out
        if new == old and cause not in ANNOUNCED_WHEN_UNCHANGED:
            return []
        m.state, m.since, m.reason, m.cause = new, now, reason, cause
        m.refused_redials = 0
        if entering:
            self.members[m.peer_id] = m
        return [StateChanged(m.peer_id, old, new, reason)]

    def _probe(self, m: Member, now: float) -> list[MembershipAction]:
        if m.probe_sent is not None:
            return []
        m.probe_sent, m.last_probe = now, now
        return [Probe(m.peer_id)]

    def _refuse(self, peer: str, reason: str) -> list[MembershipAction]:
        if self.refused.get(peer) == reason:
            return []
        self.refused[peer] = reason
        return [Refused(peer, reason)]


def describe(action: MembershipAction) -> str:
    """One log line per action worth logging."""
    if isinstance(action, StateChanged):
        was = f"{action.old} -> " if action.old else ""
        return f"member {short_id(action.peer_id)}: {was}{action.new} ({action.reason})"
    if isinstance(action, Refused):
        return f"refused {short_id(action.peer_id)}: {action.reason}"
    if isinstance(action, Admitted):
        return f"admitted to the swarm (seen by {short_id(action.via)})"
    if isinstance(action, Forgotten):
        return f"forgot dead member {short_id(action.peer_id)}"
    return repr(action)
