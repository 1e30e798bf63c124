"""Builders shared by the security tests: members of a swarm on real py-libp2p hosts on loopback."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import trio

from planner import BUILTIN_ARCHS, layout_from_arch, make_plan
from swarmd.config import LAN
from swarmd.net.gate import GuardLimits
from swarmd.net.identity import Signer, load_or_create_identity
from swarmd.net.libp2p_network import Libp2pNetwork
from swarmd.net.swarm_key import SwarmKey
from swarmd.net.tls_plane import DataPlaneConfig
from swarmd.swarm.planning import MakePlan
from swarmd.swarm.service import SwarmService, SwarmSettings
from swarmd.wire import Forward, WireTensor
from tests.swarm.swarm_helpers import descriptor

LAYOUT = layout_from_arch(BUILTIN_ARCHS["smollm2-135m"], "f16")
# LAN heartbeats (several hosts share one Python thread here); dials give up sooner than on a LAN, since a
# dial to a peer with another swarm key only ends at its timeout.
TIMINGS = replace(LAN, replan_debounce=0.3, dial_timeout=2.0)
SWARM = "sec"


def planner(action: MakePlan):
    return make_plan(LAYOUT, action.nodes, epoch=action.epoch, previous=action.previous)


@dataclass
class Member:
    net: Libp2pNetwork
    swarm: SwarmService
    signer: Signer

    @property
    def peer_id(self) -> str:
        return self.net.peer_id

    @property
    def address(self) -> str:
        return self.net.bound_addresses()[0]


async def start_member(nursery: trio.Nursery, home: Path, *, key: SwarmKey | None = None,
                       bootstrap: tuple[Member, ...] = (), allow: frozenset[str] | None = None,
                       limits: GuardLimits | None = None, timings=TIMINGS, tls: bool = False) -> Member:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    kp = load_or_create_identity(home)
    net = Libp2pNetwork(kp, ["/ip4/127.0.0.1/tcp/0"], timings=timings, swarm_key=key, allow=allow, limits=limits,
                        data_plane=DataPlaneConfig() if tls else None)
    await nursery.start(net.run)
    desc = descriptor(net.peer_id)

    def describe():
        return replace(desc, addresses=tuple(net.addresses()))

    settings = SwarmSettings(SWARM, timings, tuple((b.peer_id, b.address) for b in bootstrap))
    signer = Signer(kp)
    svc = SwarmService(net, signer, settings, describe_self=describe, make_plan=planner)
    await nursery.start(svc.run)
    return Member(net, svc, signer)


def identity(home: Path) -> Any:
    return load_or_create_identity(home)


async def eventually(check: Callable[[], Any], seconds: float, what: str, interval: float = 0.1) -> Any:
    """Poll `check` until it is truthy; fail naming `what`."""
    with trio.move_on_after(seconds):
        while True:
            value = check()
            if value:
                return value
            await trio.sleep(interval)
    raise AssertionError(f"not within {seconds:g} s: {what}")


def forward(step: int, width: int = 576) -> Forward:
    hidden = np.full((1, width), float(step), dtype=np.float32)
    return Forward("req", step, 1, step, "head", hidden=WireTensor.from_array(hidden))
