"""Signed gossip messages: what is accepted, and the one-line reason for what is not."""

from __future__ import annotations

import cbor2
import pytest

from planner.plan import ModelRef, Plan, Stage
from swarmd import WIRE_VERSION
from swarmd.errors import RemoteProtocolError
from swarmd.net.identity import Signer
from swarmd.wire.gossip import IncompatibleVersion, Leave, PlanAnnouncement, decode, encode
from tests.swarm.swarm_helpers import heartbeat, key, peer

A, B = peer(1), peer(2)
SIGNER = Signer(key(1))


def plan(epoch: int = 3) -> Plan:
    return Plan(epoch=epoch, model=ModelRef("smollm2-135m"), stages=(Stage(A, (0, 20)), Stage(B, (20, 30))))


def tamper(data: bytes, **changes) -> bytes:
    env = cbor2.loads(data)
    env.update(changes)
    return cbor2.dumps(env)


def test_every_message_type_round_trips():
    for msg in (heartbeat(A, 7, view=(A, B), term=2, leader=A, state="loading"),
                PlanAnnouncement(A, 2, plan()), Leave(A, 4)):
        assert decode(encode(msg, SIGNER, "s"), "s", origin=A) == msg


def test_a_changed_body_fails_the_signature():
    data = encode(heartbeat(A, 7), SIGNER, "s")
    env = cbor2.loads(data)
    env["body"]["seq"] = 8
    with pytest.raises(RemoteProtocolError, match="bad signature"):
        decode(cbor2.dumps(env), "s")


def test_a_message_signed_by_someone_else_is_rejected():
    data = encode(Leave(A, 1), SIGNER, "s")
    with pytest.raises(RemoteProtocolError, match="bad signature"):
        decode(tamper(data, **{"from": B}), "s")
    with pytest.raises(RemoteProtocolError, match="was published by"):
        decode(data, "s", origin=B)


def test_another_wire_version_is_named_after_the_signature_checks_out():
    other = Signer(key(1))
    env = {"v": WIRE_VERSION + 1, "t": "hb", "from": A, "swarm": "s", "body": {"new": "shape"}}
    signed = cbor2.dumps([env["v"], env["t"], A, "s", env["body"]], canonical=True)
    data = cbor2.dumps({**env, "sig": other.sign(signed)})
    with pytest.raises(IncompatibleVersion) as info:
        decode(data, "s")
    assert info.value.peer_id == A and info.value.version == WIRE_VERSION + 1


def test_unknown_types_fields_and_swarms_are_rejected_with_a_reason():
    def signed(tag, body, swarm="s"):
        part = cbor2.dumps([WIRE_VERSION, tag, A, swarm, body], canonical=True)
        return cbor2.dumps({"v": WIRE_VERSION, "t": tag, "from": A, "swarm": swarm, "body": body,
                            "sig": SIGNER.sign(part)})

    with pytest.raises(RemoteProtocolError, match="unknown gossip message type 'gossip'"):
        decode(signed("gossip", {}), "s")
    with pytest.raises(RemoteProtocolError, match="leave message: unknown extra"):
        decode(signed("leave", {"incarnation": 1, "extra": 2}), "s")
    with pytest.raises(RemoteProtocolError, match="belongs to swarm 'other'"):
        decode(signed("leave", {"incarnation": 1}, swarm="other"), "s")
    with pytest.raises(RemoteProtocolError, match="not CBOR"):
        decode(b"\xff\x00garbage", "s")


def test_a_plan_that_fails_its_schema_is_rejected():
    bad = plan().to_json()
    bad["stages"][1]["layers"] = [25, 30]  # a gap: blocks 20-24 in no stage
    body = {"term": 1, "plan": bad}
    part = cbor2.dumps([WIRE_VERSION, "plan", A, "s", body], canonical=True)
    data = cbor2.dumps({"v": WIRE_VERSION, "t": "plan", "from": A, "swarm": "s", "body": body,
                        "sig": SIGNER.sign(part)})
    with pytest.raises(RemoteProtocolError, match="fails its schema"):
        decode(data, "s")


def test_a_descriptor_that_fails_its_schema_is_rejected():
    data = encode(heartbeat(A, 1), SIGNER, "s")
    env = cbor2.loads(data)
    env["body"]["descriptor"]["gpu_count"] = 8
    part = cbor2.dumps([env["v"], env["t"], A, "s", env["body"]], canonical=True)
    env["sig"] = SIGNER.sign(part)
    with pytest.raises(RemoteProtocolError, match=r"descriptor from .* fails its schema"):
        decode(cbor2.dumps(env), "s")


def test_a_heartbeat_for_someone_else_is_rejected():
    hb = heartbeat(B, 1)
    body = {"descriptor": hb.descriptor.to_json(), "seq": 1, "term": 0, "leader": None, "plan_epoch": 0,
            "view": [], "admitted": True, "assignment": hb.assignment.to_json(), "slots": {}}
    part = cbor2.dumps([WIRE_VERSION, "hb", A, "s", body], canonical=True)
    data = cbor2.dumps({"v": WIRE_VERSION, "t": "hb", "from": A, "swarm": "s", "body": body,
                        "sig": SIGNER.sign(part)})
    with pytest.raises(RemoteProtocolError, match="sent a descriptor for"):
        decode(data, "s")


def test_a_leaders_heartbeat_carries_its_slot_bindings_and_bad_ones_are_rejected():
    from dataclasses import replace

    hb = replace(heartbeat(A, 3, leader=A), slots={"gpu-0": A, "gpu-1": B})
    assert decode(encode(hb, SIGNER, "s"), "s").slots == {"gpu-0": A, "gpu-1": B}
    env = cbor2.loads(encode(hb, SIGNER, "s"))
    env["body"]["slots"] = {"gpu-0": 7}
    env["sig"] = SIGNER.sign(cbor2.dumps([env["v"], env["t"], A, "s", env["body"]], canonical=True))
    with pytest.raises(RemoteProtocolError, match="'slots' must map slot names to peer ids"):
        decode(cbor2.dumps(env), "s")
