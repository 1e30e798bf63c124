"""Which daemon holds which slot of a plan file: the rule the leader applies before every plan. Pure.

A daemon started with `swarmd join --plan FILE --slot NAME` claims the slot in its descriptor. The leader binds
each slot to one claimer and keeps it bound while that daemon is live and still claims it; a free slot goes to
its claimer with the lowest peer id (any leader picks the same one). Every other claimer of a bound slot is
refused. The leader gossips the bindings in its heartbeat, so a refused daemon learns it, and a leader that takes
over starts from the bindings its predecessor gossiped.

    b = bind_slots(("gpu-0", "gpu-1"), live_descriptors, held={"gpu-0": "12D3KooWabc"})
    b.peers     {"gpu-0": "12D3KooWabc", "gpu-1": ...}   slot -> peer id
    b.refused   {"12D3KooWxyz": "gpu-0"}                 peer id -> the slot it claimed in vain
    b.unclaimed ("gpu-1",)                               slots without a live claimer, in the file's order
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from planner.node import NodeDescriptor


@dataclass(frozen=True)
class Binding:
    peers: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    unclaimed: tuple[str, ...] = ()
    unknown: dict[str, str] = field(default_factory=dict)  # peer id -> a slot the file does not have


def bind_slots(slots: Sequence[str], nodes: Sequence[NodeDescriptor], held: Mapping[str, str]) -> Binding:
    """Bind `slots` to the live `nodes` that claim them, keeping the bindings in `held` whose peer still claims."""
    claims: dict[str, list[str]] = {}
    unknown: dict[str, str] = {}
    known = set(slots)
    for n in sorted(nodes, key=lambda n: n.peer_id):
        if not n.slot:
            continue
        if n.slot in known:
            claims.setdefault(n.slot, []).append(n.peer_id)
        else:
            unknown[n.peer_id] = n.slot
    peers: dict[str, str] = {}
    refused: dict[str, str] = {}
    for slot in slots:
        claimers = claims.get(slot, [])
        if not claimers:
            continue
        keep = held.get(slot)
        holder = keep if keep in claimers else claimers[0]
        peers[slot] = holder
        refused.update({p: slot for p in claimers if p != holder})
    unclaimed = tuple(s for s in slots if s not in peers)
    return Binding(peers, refused, unclaimed, unknown)
