"""The messages daemons gossip on their swarm's topic, and their signed CBOR envelope.

    {"v": WIRE_VERSION, "t": "hb" | "plan" | "leave", "from": peer id, "swarm": name,
     "body": {...}, "sig": Ed25519 signature over CBOR([v, t, from, swarm, body])}

The envelope keeps its shape across wire versions, so a daemon of another version is still
identified (and refused with a reason) rather than dropped as noise. Decoding is strict: unknown
types, unknown fields and bad schemas raise RemoteProtocolError with one line that says why.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import cbor2

from planner.errors import PlanSchemaError
from planner.node import NodeDescriptor
from planner.plan import Plan
from swarmd import WIRE_VERSION
from swarmd.errors import RemoteProtocolError
from swarmd.net.identity import Signer, short_id, verify_signature
from swarmd.wire.codec import WireError, decode_cbor

MAX_MESSAGE_BYTES = 1 << 20  # gossipsub's own inbound limit
MAX_DEPTH = 16  # a plan nests 7 deep (envelope, body, plan, stages, stage, experts, list)


class AssignmentState(enum.StrEnum):
    """How far a daemon got with what the plan gives it (the transitions: `swarmd.daemon.assignment_machine`)."""

    IDLE = "idle"  # nothing to hold
    LOADING = "loading"
    READY = "ready"  # its stage and experts are loaded
    STANDBY = "standby"  # a spare's warm copy of `layers`
    FAILED = "failed"  # loading failed (`error` says why)


ASSIGNMENT_STATES = tuple(s.value for s in AssignmentState)


class ForgedMessage(RemoteProtocolError):
    """A message that its claimed sender did not publish: a signature that does not verify ("forged"), or a
    correctly signed message published again by another peer ("replayed")."""

    def __init__(self, message: str, tag: Any, kind: str) -> None:
        super().__init__(message)
        self.tag = tag
        self.kind = kind


class IncompatibleVersion(RemoteProtocolError):
    """A correctly signed message from a daemon that speaks another wire version."""

    def __init__(self, peer_id: str, version: Any) -> None:
        self.shown = repr(version)[:24]  # whatever a peer put there, a status line stays short
        super().__init__(f"{short_id(peer_id)} speaks wire version {self.shown}, this daemon speaks {WIRE_VERSION}")
        self.peer_id = peer_id
        self.version = version


@dataclass(frozen=True)
class AssignmentStatus:
    """What a daemon does with the plan it accepted: which layers, and how far loading got."""

    epoch: int = 0
    layers: tuple[int, int] | None = None
    experts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    state: AssignmentState = AssignmentState.IDLE
    progress: float = 0.0  # 0..1 while loading
    error: str = ""
    fetch: tuple[int, int, float] = (0, 0, 0.0)  # weights being fetched: bytes so far, bytes in all, bytes/s
    # the loaded stage's KV slots: (slots, requests holding or waiting for one, version: changes with the second)
    kv: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", AssignmentState(self.state))

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "epoch": self.epoch,
            "layers": list(self.layers) if self.layers else None,
            "experts": {str(b): list(es) for b, es in self.experts.items()},
            "state": self.state.value,
            "progress": round(self.progress, 4),
            "error": self.error,
            "fetch": {"bytes": self.fetch[0], "total": self.fetch[1], "rate": round(self.fetch[2], 1)},
        }
        if self.kv is not None:
            doc["kv"] = {"slots": self.kv[0], "used": self.kv[1], "version": self.kv[2]}
        return doc

    @staticmethod
    def from_json(doc: Any) -> AssignmentStatus:
        keys = {"epoch", "layers", "experts", "state", "progress", "error", "fetch"}
        _expect_keys(doc, keys | ({"kv"} if isinstance(doc, dict) and "kv" in doc else set()), "assignment")
        kv = None
        if "kv" in doc:
            _expect_keys(doc["kv"], {"slots", "used", "version"}, "assignment.kv")
            kv = (_int(doc["kv"]["slots"], "assignment.kv.slots"), _int(doc["kv"]["used"], "assignment.kv.used"),
                  _int(doc["kv"]["version"], "assignment.kv.version"))
        layers, experts, progress = doc["layers"], doc["experts"], doc["progress"]
        _expect_keys(doc["fetch"], {"bytes", "total", "rate"}, "assignment.fetch")
        rate = doc["fetch"]["rate"]
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0.0 <= rate < 1e15:
            raise RemoteProtocolError("assignment.fetch.rate must be a non-negative number")
        if layers is not None and not (isinstance(layers, list) and len(layers) == 2):
            raise RemoteProtocolError("assignment.layers must be [start, end] or null")
        if doc["state"] not in ASSIGNMENT_STATES:
            raise RemoteProtocolError(f"unknown assignment state {str(doc['state'])[:40]!r}")
        if not isinstance(experts, dict) or not all(
                isinstance(b, str) and b.isdigit() and isinstance(es, list) for b, es in experts.items()):
            raise RemoteProtocolError("assignment.experts must map block numbers to lists of experts")
        if not isinstance(progress, int | float) or isinstance(progress, bool) or not 0.0 <= progress <= 1.0:
            raise RemoteProtocolError("assignment.progress must be a number from 0 to 1")
        if not isinstance(doc["error"], str):
            raise RemoteProtocolError("assignment.error must be a string")
        return AssignmentStatus(
            epoch=_int(doc["epoch"], "assignment.epoch"),
            layers=(_int(layers[0], "assignment.layers"), _int(layers[1], "assignment.layers"))
            if layers is not None else None,
            experts={int(b): tuple(_int(e, "assignment.experts") for e in es) for b, es in experts.items()},
            state=AssignmentState(doc["state"]),
            progress=float(progress),
            error=doc["error"][:300],
            fetch=(_int(doc["fetch"]["bytes"], "assignment.fetch.bytes"), _int(doc["fetch"]["total"],
                                                                              "assignment.fetch.total"), float(rate)),
            kv=kv,
        )


@dataclass(frozen=True)
class Heartbeat:
    """Published every heartbeat interval: the descriptor plus what the sender believes."""

    descriptor: NodeDescriptor
    seq: int  # increases with every heartbeat of one incarnation
    term: int = 0
    leader: str | None = None
    plan_epoch: int = 0  # epoch of the plan the sender runs (0: none)
    view: tuple[str, ...] = ()  # members the sender counts as not dead
    admitted: bool = False
    assignment: AssignmentStatus = field(default_factory=AssignmentStatus)
    slots: dict[str, str] = field(default_factory=dict)  # a leader adopting a plan file's slots: slot -> peer id

    @property
    def peer_id(self) -> str:
        return self.descriptor.peer_id

    @property
    def incarnation(self) -> int:
        return self.descriptor.incarnation


@dataclass(frozen=True)
class PlanAnnouncement:
    """The leader's plan for its term."""

    leader: str
    term: int
    plan: Plan


@dataclass(frozen=True)
class Leave:
    """A daemon says it is going (Ctrl-C, SIGTERM)."""

    peer_id: str
    incarnation: int


GossipMessage = Heartbeat | PlanAnnouncement | Leave


def _sender(msg: GossipMessage) -> str:
    if isinstance(msg, PlanAnnouncement):
        return msg.leader
    return msg.peer_id


def _body(msg: GossipMessage) -> tuple[str, dict[str, Any]]:
    if isinstance(msg, Heartbeat):
        return "hb", {
            "descriptor": msg.descriptor.to_json(),
            "seq": msg.seq,
            "term": msg.term,
            "leader": msg.leader,
            "plan_epoch": msg.plan_epoch,
            "view": list(msg.view),
            "admitted": msg.admitted,
            "assignment": msg.assignment.to_json(),
            "slots": dict(msg.slots),
        }
    if isinstance(msg, PlanAnnouncement):
        return "plan", {"term": msg.term, "plan": msg.plan.to_json()}
    return "leave", {"incarnation": msg.incarnation}


def _signed_part(version: Any, tag: Any, sender: Any, swarm: Any, body: Any) -> bytes:
    return cbor2.dumps([version, tag, sender, swarm, body], canonical=True)


def encode(msg: GossipMessage, signer: Signer, swarm: str) -> bytes:
    sender = _sender(msg)
    if sender != signer.peer_id:
        raise ValueError(f"cannot sign a message from {sender} as {signer.peer_id}")
    tag, body = _body(msg)
    sig = signer.sign(_signed_part(WIRE_VERSION, tag, sender, swarm, body))
    return cbor2.dumps({"v": WIRE_VERSION, "t": tag, "from": sender, "swarm": swarm, "body": body, "sig": sig})


def decode(data: bytes, swarm: str, origin: str | None = None) -> GossipMessage:
    """Check size, envelope, signature, version and schema, in that order.

    `origin` is the peer id the gossip layer authenticated as the publisher, when it knows one. The last
    messages that passed are remembered by their bytes: where many members share a process (the in-memory
    twin), the same message is checked once for all of them."""
    key = (data, swarm)
    known = _PASSED.get(key)
    if known is None:
        known = _PASSED[key] = _decode(data, swarm, origin)
        while len(_PASSED) > PASSED_KEPT:
            del _PASSED[next(iter(_PASSED))]
    if origin is not None and origin != known.sender:
        raise ForgedMessage(f"a message signed by {short_id(known.sender)} was published by {short_id(origin)}",
                            known.tag, "replayed")
    return known.message


@dataclass(frozen=True)
class _Passed:
    sender: str
    tag: str
    message: GossipMessage


PASSED_KEPT = 512
_PASSED: dict[tuple[bytes, str], _Passed] = {}


def _decode(data: bytes, swarm: str, origin: str | None) -> _Passed:
    if len(data) > MAX_MESSAGE_BYTES:
        raise RemoteProtocolError(f"gossip message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES} limit")
    try:  # strict: no tags, no indefinite lengths, no duplicate keys, bounded nesting
        env = decode_cbor(data, max_depth=MAX_DEPTH)
    except WireError as e:
        raise RemoteProtocolError(f"gossip message is not CBOR: {e.message}") from None
    _expect_keys(env, {"v", "t", "from", "swarm", "body", "sig"}, "envelope")
    sender, sig = env["from"], env["sig"]
    if not isinstance(sender, str) or not isinstance(sig, bytes):
        raise RemoteProtocolError("envelope 'from' must be a peer id string and 'sig' bytes")
    if origin is not None and origin != sender:
        raise ForgedMessage(f"a message signed by {short_id(sender)} was published by {short_id(origin)}",
                            env["t"], "replayed")
    try:
        verify_signature(sender, _signed_part(env["v"], env["t"], sender, env["swarm"], env["body"]), sig)
    except RemoteProtocolError as e:
        raise ForgedMessage(str(e), env["t"], "forged") from None
    if env["v"] != WIRE_VERSION:
        raise IncompatibleVersion(sender, env["v"])
    if env["swarm"] != swarm:
        raise RemoteProtocolError(f"{short_id(sender)} belongs to swarm {env['swarm']!r}, not {swarm!r}")
    tag, body = env["t"], env["body"]
    if tag == "hb":
        return _Passed(sender, tag, _decode_heartbeat(sender, body))
    if tag == "plan":
        _expect_keys(body, {"term", "plan"}, "plan message")
        try:
            plan = Plan.from_json(body["plan"])
        except PlanSchemaError as e:
            raise RemoteProtocolError(f"plan from {short_id(sender)} fails its schema: {e}") from None
        return _Passed(sender, tag, PlanAnnouncement(leader=sender, term=_int(body["term"], "term"), plan=plan))
    if tag == "leave":
        _expect_keys(body, {"incarnation"}, "leave message")
        return _Passed(sender, tag, Leave(peer_id=sender, incarnation=_int(body["incarnation"], "incarnation")))
    raise RemoteProtocolError(f"unknown gossip message type {tag!r} from {short_id(sender)}")


def _decode_heartbeat(sender: str, body: Any) -> Heartbeat:
    _expect_keys(body, {"descriptor", "seq", "term", "leader", "plan_epoch", "view", "admitted", "assignment",
                        "slots"}, "heartbeat")
    try:
        descriptor = NodeDescriptor.from_json(body["descriptor"])
    except PlanSchemaError as e:
        raise RemoteProtocolError(f"descriptor from {short_id(sender)} fails its schema: {e}") from None
    if descriptor.peer_id != sender:
        raise RemoteProtocolError(f"{short_id(sender)} sent a descriptor for {short_id(descriptor.peer_id)}")
    leader, view = body["leader"], body["view"]
    if leader is not None and not isinstance(leader, str):
        raise RemoteProtocolError("heartbeat 'leader' must be a peer id or null")
    if not isinstance(view, list) or not all(isinstance(p, str) for p in view):
        raise RemoteProtocolError("heartbeat 'view' must be a list of peer ids")
    slots = body["slots"]
    if not isinstance(slots, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in slots.items()):
        raise RemoteProtocolError("heartbeat 'slots' must map slot names to peer ids")
    return Heartbeat(
        descriptor=descriptor,
        seq=_int(body["seq"], "seq"),
        term=_int(body["term"], "term"),
        leader=leader,
        plan_epoch=_int(body["plan_epoch"], "plan_epoch"),
        view=tuple(view),
        admitted=bool(body["admitted"]),
        assignment=AssignmentStatus.from_json(body["assignment"]),
        slots=slots,
    )


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RemoteProtocolError(f"'{name}' must be a non-negative integer")
    return value


def _expect_keys(doc: Any, keys: set[str], what: str) -> None:
    if not isinstance(doc, dict):
        raise RemoteProtocolError(f"{what} must be a map")
    if set(doc) != keys:
        missing, extra = keys - set(doc), set(doc) - keys
        detail = "; ".join(p for p in (
            f"missing {', '.join(sorted(missing))}" if missing else "",
            f"unknown {', '.join(sorted(map(str, extra)))}" if extra else "") if p)
        raise RemoteProtocolError(f"{what}: {detail}")
