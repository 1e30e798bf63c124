"""What the swarm map needs beyond the members' rows: their low-latency groups, as the planner forms them.

The status document's `groups` section (`node.status_parts["groups"]`): the live members (this daemon and every
member not dead) in the planner's low-latency groups (`planner.topology`: pairs closer than the group threshold,
from the RTTs each member gossips), the groups in the planner's tour order, and the median RTT between groups.

    {"groups": [["12D3...a", "12D3...b"], ["12D3...c"]], "group_rtt_ms": [[0.0, 41.2], [41.2, 0.0]]}
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from planner.node import NodeDescriptor
from planner.topology import build_topology
from swarmd.swarm.membership import State


def rtt_groups(nodes: Iterable[NodeDescriptor], *, default_rtt_ms: float, group_rtt_ms: float) -> dict[str, Any]:
    """The planner's low-latency groups of `nodes` (peer ids), and the median RTT between groups."""
    ordered = sorted(nodes, key=lambda n: n.peer_id)
    topo = build_topology(ordered, default_rtt_ms=default_rtt_ms, group_rtt_ms=group_rtt_ms)
    return {"groups": [[ordered[i].peer_id for i in group] for group in topo.groups],
            "group_rtt_ms": [[round(float(x), 3) for x in row] for row in topo.group_rtt]}


def live_descriptors(swarm: Any) -> list[NodeDescriptor]:
    """This daemon's descriptor (with the RTTs it measured) and every member's that is not dead, from a
    `SwarmService`: what the leader plans over."""
    me = replace(swarm.describe_self(), rtt_ms=swarm.rtts())
    return [me, *(m.descriptor for m in swarm.membership.members.values() if m.state != State.DEAD)]
