"""Small builders shared by the swarm tests."""

from __future__ import annotations

from functools import cache

from planner.node import NodeDescriptor
from swarmd import WIRE_VERSION
from swarmd.wire.gossip import AssignmentStatus, Heartbeat


@cache
def peer(n: int) -> str:
    """A real Ed25519 peer id, deterministic in n; ordering follows the strings, not n."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    return ID.from_pubkey(create_new_key_pair(bytes([n]) * 32).public_key).to_base58()


@cache
def key(n: int):
    from libp2p.crypto.ed25519 import create_new_key_pair

    return create_new_key_pair(bytes([n]) * 32)


def descriptor(peer_id: str, *, model: str = "smollm2-135m", wire: int = WIRE_VERSION, incarnation: int = 1,
               memory: int = 8 << 30, flops: float = 1e12) -> NodeDescriptor:
    return NodeDescriptor(peer_id=peer_id, memory_total=memory, memory_free=memory, flops=flops,
                          addresses=(f"/ip4/127.0.0.1/tcp/4001/p2p/{peer_id}",), wire_version=wire,
                          model_name=model, incarnation=incarnation, swarmd_version="0.1.0")


def heartbeat(peer_id: str, seq: int, *, view: tuple[str, ...] = (), admitted: bool = True, term: int = 0,
              leader: str | None = None, incarnation: int = 1, model: str = "smollm2-135m",
              wire: int = WIRE_VERSION, state: str = "idle") -> Heartbeat:
    return Heartbeat(descriptor=descriptor(peer_id, model=model, wire=wire, incarnation=incarnation), seq=seq,
                     term=term, leader=leader, view=view, admitted=admitted,
                     assignment=AssignmentStatus(state=state))
