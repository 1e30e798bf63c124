"""Weights never travel through a circuit relay.

A relay carries the activations of members it cannot otherwise connect, within limits on circuits, bytes
and time (a volunteer lends its uplink for that, not for a model's weights, which would exhaust the limits
in seconds). So a peer reached only through a relay is neither asked for weights nor served them: a daemon
fetches from the members it reaches directly, and one behind a relay waits until hole punching gives it a
direct connection. Both ends check, so neither side's mistake puts weights on a relay.
"""

from __future__ import annotations

from swarmd.net.seam import Network

REFUSAL = "weights never travel through a circuit relay"


def may_carry_weights(network: Network, peer: str) -> bool:
    """Whether weights may flow between this daemon and `peer` now: only over a direct connection."""
    return not network.is_relayed(peer)
