"""Hole punching (DCUtR) between members that reach each other only through a relay, retried with backoff.

`PunchBook` is the sans-IO schedule, one entry per peer, every transition in `TRANSITIONS`:

    state      event        -> state      (action)
    waiting    due          -> punching   (start an attempt: the driver calls DCUtR)
    punching   succeeded    -> direct     (the activation links move: the relayed connection is closed)
    punching   failed       -> waiting    (next attempt after a backoff that doubles up to `max_backoff`)
    waiting    direct_seen  -> direct     (the peer's own attempt worked, or it dialled us directly)
    punching   direct_seen  -> direct
    direct     relayed_only -> waiting    (the direct connection was lost: try again soon)

`HolePuncher` drives it with py-libp2p's `DCUtRProtocol`, adjusted where 0.8.1 goes wrong for us
(../shared notes, py-libp2p-nat.md): its own auto-drive loop (every 2 s, 3 attempts per peer, then never
again) is replaced by the schedule above; the hole-punch dials bind the real TCP listen socket's address,
not whatever the host advertises; and the addresses it sends the peer are this daemon's WAN address (as peers
saw it) at its listen port, which is what a port-preserving NAT maps the listen socket to.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from swarmd.net.identity import short_id

log = logging.getLogger("swarmd.holepunch")


class PunchState(enum.Enum):
    WAITING = "waiting"
    PUNCHING = "punching"
    DIRECT = "direct"


class PunchEvent(enum.Enum):
    DUE = "due"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DIRECT_SEEN = "direct_seen"
    RELAYED_ONLY = "relayed_only"


W, P, D = PunchState.WAITING, PunchState.PUNCHING, PunchState.DIRECT
TRANSITIONS: dict[tuple[PunchState, PunchEvent], PunchState] = {
    (W, PunchEvent.DUE): P,
    (P, PunchEvent.SUCCEEDED): D,
    (P, PunchEvent.FAILED): W,
    (W, PunchEvent.DIRECT_SEEN): D,
    (P, PunchEvent.DIRECT_SEEN): D,
    (D, PunchEvent.RELAYED_ONLY): W,
}


@dataclass
class Punch:
    state: PunchState = PunchState.WAITING
    attempts: int = 0  # attempts since the last success
    failures: int = 0  # over the peer's lifetime
    successes: int = 0
    next_at: float = 0.0
    backoff: float = 0.0
    last_error: str = ""
    since: float = 0.0  # when the current state began
    took_s: float | None = None  # from relayed-only (or the successful attempt's start) to direct
    first_relayed: float = 0.0  # when the peer was last seen with relayed connections only

    def to_json(self, now: float) -> dict[str, Any]:
        return {"state": self.state.value, "attempts": self.attempts, "failures": self.failures,
                "successes": self.successes, "last_error": self.last_error, "took_s": self.took_s,
                "next_attempt_in_s": round(max(0.0, self.next_at - now), 1) if self.state is W else None}


@dataclass
class PunchBook:
    """When to try hole punching with whom. `initial_delay` staggers the two sides (the one with the higher peer
    id waits longer, so usually one session runs, not two)."""

    self_id: str
    initial_delay: float = 1.0
    first_backoff: float = 5.0
    max_backoff: float = 300.0
    punches: dict[str, Punch] = field(default_factory=dict)

    def _apply(self, peer: str, event: PunchEvent, now: float) -> Punch:
        punch = self.punches[peer]
        nxt = TRANSITIONS.get((punch.state, event))
        if nxt is not None and nxt is not punch.state:
            punch.state, punch.since = nxt, now
        return punch

    def relayed_only(self, peer: str, now: float) -> None:
        """`peer` is connected through a relay and nothing else."""
        punch = self.punches.get(peer)
        if punch is None:
            delay = self.initial_delay * (1 if self.self_id < peer else 3)
            self.punches[peer] = Punch(next_at=now + delay, since=now, first_relayed=now)
            return
        if punch.state is D:
            self._apply(peer, PunchEvent.RELAYED_ONLY, now)
            punch.attempts, punch.backoff, punch.next_at = 0, 0.0, now + self.initial_delay
            punch.first_relayed = now

    def direct(self, peer: str, now: float) -> None:
        """`peer` has a direct connection (however it came: the peer's hole punch counts as one of ours)."""
        punch = self.punches.get(peer)
        if punch is not None and punch.state is not D:
            punch.successes += 1
            punch.took_s = round(now - punch.first_relayed, 3)
            punch.attempts, punch.backoff, punch.last_error = 0, 0.0, ""
            self._apply(peer, PunchEvent.DIRECT_SEEN, now)

    def forget(self, peer: str) -> None:
        self.punches.pop(peer, None)

    def due(self, now: float) -> list[str]:
        """Peers whose next attempt is due: they move to `punching` (the caller starts each attempt)."""
        out = []
        for peer, punch in sorted(self.punches.items()):
            if punch.state is W and now >= punch.next_at:
                self._apply(peer, PunchEvent.DUE, now)
                punch.attempts += 1
                out.append(peer)
        return out

    def result(self, peer: str, ok: bool, now: float, error: str = "") -> None:
        punch = self.punches.get(peer)
        if punch is None or punch.state is not P:
            return
        if ok:
            punch.took_s = round(now - punch.since, 3)
            punch.successes += 1
            punch.attempts, punch.backoff, punch.last_error = 0, 0.0, ""
            self._apply(peer, PunchEvent.SUCCEEDED, now)
        else:
            punch.failures += 1
            punch.last_error = error
            punch.backoff = min(self.max_backoff, max(self.first_backoff, 2 * punch.backoff))
            punch.next_at = now + punch.backoff
            self._apply(peer, PunchEvent.FAILED, now)


def _swarmd_dcutr_class() -> type:
    """py-libp2p's DCUtRProtocol with the three changes the module's docstring lists."""
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
    from multiaddr import Multiaddr

    class SwarmdDCUtR(DCUtRProtocol):  # type: ignore[misc, valid-type]
        predicted: Callable[[], list[str]] = staticmethod(lambda: [])

        async def _auto_drive_loop(self) -> None:
            return None  # HolePuncher schedules attempts

        async def _dial_peer(self, peer_id: Any, addr: Any, source: Any = None, as_responder: bool = False) -> None:
            await super()._dial_peer(peer_id, addr, listen_source(self.host), as_responder)

        async def _get_observed_addrs(self) -> list[bytes]:
            predicted = self.predicted()
            if not predicted:
                return await super()._get_observed_addrs()
            return [Multiaddr(a).to_bytes() for a in predicted]

    return SwarmdDCUtR


def listen_source(host: Any) -> tuple[str, int] | None:
    """The (ip, port) of the host's TCP listen socket: hole-punch dials must leave from it."""
    for a in host.get_transport_addrs():
        text = str(a)
        if "/tcp/" in text and "/p2p-circuit" not in text:
            p = text.strip("/").split("/")
            with contextlib.suppress(ValueError, IndexError):
                return p[1], int(p[p.index("tcp") + 1])
    return None


class HolePuncher:
    """Runs DCUtR on `host` (serving the peer's attempts too) and schedules our own attempts with `PunchBook`."""

    def __init__(self, host: Any, self_id: str, *, predicted: Callable[[], list[str]],
                 on_direct: Callable[[str], None], book: PunchBook | None = None, tick: float = 0.5,
                 attempt_timeout: float = 40.0) -> None:
        self.host = host
        self.book = book or PunchBook(self_id)
        self.predicted = predicted
        self.on_direct = on_direct  # told when a punch succeeded (the caller moves links off the relay)
        self.tick = tick
        self.attempt_timeout = attempt_timeout
        self.dcutr: Any = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        from libp2p.tools.anyio_service import background_trio_service

        self.dcutr = _swarmd_dcutr_class()(self.host, read_timeout=10, write_timeout=10, dial_timeout=5)
        self.dcutr.predicted = self.predicted
        async with background_trio_service(self.dcutr), trio.open_nursery() as nursery:
            await self.dcutr.event_started.wait()
            task_status.started()
            while True:
                self._observe(trio.current_time())
                for peer in self.book.due(trio.current_time()):
                    nursery.start_soon(self._attempt, peer)
                await trio.sleep(self.tick)

    def _observe(self, now: float) -> None:
        from swarmd.net.link_paths import connection_kinds

        connections = self.host.get_network().connections
        for pid, conns in list(connections.items()):
            peer = pid.to_base58()
            kinds = connection_kinds(conns)
            if "direct" in kinds:
                was = self.book.punches.get(peer)
                if was is not None and was.state is not D:
                    log.info("direct connection to %s (its own hole punch, or a direct dial)", short_id(peer))
                    self.book.direct(peer, now)
                    self.on_direct(peer)
            elif "relayed" in kinds:
                self.book.relayed_only(peer, now)
        for peer in [p for p in self.book.punches if not self._connected(p)]:
            self.book.forget(peer)

    def _connected(self, peer: str) -> bool:
        from libp2p.peer.id import ID

        return bool(self.host.get_network().connections.get(ID.from_base58(peer)))

    async def _attempt(self, peer: str) -> None:
        from libp2p.peer.id import ID

        pid = ID.from_base58(peer)
        self.dcutr._hole_punch_attempts.pop(pid, None)  # its own budget (3, then never) is ours to keep
        punch = self.book.punches.get(peer)
        log.info("hole punching to %s (attempt %d)", short_id(peer), punch.attempts if punch else 0)
        ok, error = False, ""
        try:
            with trio.fail_after(self.attempt_timeout):
                ok = bool(await self.dcutr.initiate_hole_punch(pid))
            if not ok:
                error = "no direct connection came up (the NATs did not let the simultaneous dials through)"
        except trio.TooSlowError:
            error = f"no result within {self.attempt_timeout:.0f} s"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[:200]
        now = trio.current_time()
        self.book.result(peer, ok, now, error)
        punch = self.book.punches.get(peer)
        if ok:
            log.info("hole punched to %s in %.1f s: links move to the direct connection", short_id(peer),
                     punch.took_s if punch and punch.took_s is not None else 0.0)
            self.on_direct(peer)
        elif punch is not None:
            log.info("hole punching to %s failed (%s); next try in %.0f s", short_id(peer), error, punch.backoff)

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        return {peer: punch.to_json(now) for peer, punch in sorted(self.book.punches.items())}
