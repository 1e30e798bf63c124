"""Who may talk to this daemon: the peer-id allowlist, per-peer rates, strikes and the penalty box.

A sans-IO ledger, one per daemon, consulted wherever a peer first shows up: when libp2p has authenticated a
connection (before any stream), when a stream of a swarm protocol opens, when a gossip message arrives.
It only decides; `swarmd.net.libp2p_network` (libp2p) and `swarmd.testing.memory_network` do what it says (close connections, drop
gossip, refuse reconnects until the penalty is over) through `on_penalised`.

A peer is penalised when it keeps misbehaving: more than `bad_frames` strikes (a frame or message that
failed its checks, a stream over the limits) within `bad_frames_window`, or a flood (more than
`flood_drops` messages or streams over its rate within `flood_window`). A penalty lasts `penalty` seconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from swarmd.net.rates import StrikeCounter, TokenBucket


@dataclass(frozen=True)
class GuardLimits:
    """Every limit the swarm's own protocols enforce per peer (the actor transport has its own config)."""

    bad_frames: int = 5  # more strikes than this within the window cut a peer off
    bad_frames_window: float = 60.0
    penalty: float = 60.0  # seconds a cut-off peer is refused
    streams_per_peer: int = 4  # open streams of one protocol from one peer (probes use one)
    stream_opens_per_second: float = 10.0  # new streams of one protocol from one peer
    stream_open_burst: int = 20
    read_timeout: float = 60.0  # every read on a served stream; probes come every few seconds
    probes_per_second: float = 10.0  # probe frames from one peer (one every probe interval, a few more for suspects)
    probe_burst: int = 20
    handshakes_per_second: float = 20.0  # new connections from one IP address, before any handshake work
    handshake_burst: int = 40
    gossip_per_second: float = 20.0  # messages per origin (a member sends a heartbeat a second and a few plans)
    gossip_burst: int = 100
    flood_drops: int = 200  # messages dropped over the rate within the flood window: a flood
    flood_window: float = 10.0


@dataclass
class _PeerRecord:
    strikes: StrikeCounter
    floods: StrikeCounter
    buckets: dict[str, TokenBucket]
    penalised_until: float = float("-inf")
    reason: str = ""


class PeerGate:
    def __init__(self, allow: frozenset[str] | None = None, limits: GuardLimits | None = None,
                 self_id: str = "", on_penalised: Callable[[str, str], None] | None = None) -> None:
        self.allow = allow  # None: every peer that holds the swarm key (or any peer, in an open swarm)
        self.limits = limits or GuardLimits()
        self.self_id = self_id
        self.on_penalised = on_penalised  # (peer, reason): the I/O side drops the peer's connections
        self.stats: Counter[str] = Counter()
        self._peers: dict[str, _PeerRecord] = {}

    # --- questions --------------------------------------------------------------------------------------
    def refusal(self, peer: str, now: float) -> str | None:
        """Why `peer` is refused now, or None if it may talk to us."""
        if peer == self.self_id:
            return None
        if self.allow is not None and peer not in self.allow:
            return "not on the allowlist"
        rec = self._peers.get(peer)
        if rec is not None and rec.penalised_until > now:
            return f"penalised for {rec.penalised_until - now:.0f} s more: {rec.reason}"
        return None

    def admits(self, peer: str, now: float) -> bool:
        return self.refusal(peer, now) is None

    def is_penalised(self, peer: str, now: float) -> bool:
        rec = self._peers.get(peer)
        return rec is not None and rec.penalised_until > now

    def penalised(self, now: float) -> list[dict[str, object]]:
        """Peers in the penalty box now: what `swarmd status` shows."""
        return [{"peer_id": p, "seconds_left": round(r.penalised_until - now, 1), "reason": r.reason}
                for p, r in sorted(self._peers.items()) if r.penalised_until > now]

    # --- events ------------------------------------------------------------------------------------------
    def strike(self, peer: str, now: float, reason: str) -> bool:
        """`peer` sent something that failed its checks. True when this strike gets it penalised."""
        if peer == self.self_id:
            return False
        self.stats["strikes"] += 1
        rec = self._record(peer)
        if rec.penalised_until > now:
            return False
        if rec.strikes.strike(now):
            lim = self.limits
            self.penalise(peer, now, f"more than {lim.bad_frames} bad frames in {lim.bad_frames_window:.0f} s "
                                     f"(last: {reason[:200]})")
            return True
        return False

    def within_rate(self, peer: str, kind: str, now: float, rate: float, burst: float) -> bool:
        """Take one of `peer`'s `kind` tokens (`rate` per second, `burst` saved up). False: drop or refuse
        what it sent; a peer that keeps going over its rate is penalised as a flood."""
        if peer == self.self_id:
            return True
        rec = self._record(peer)
        bucket = rec.buckets.get(kind)
        if bucket is None:
            bucket = rec.buckets[kind] = TokenBucket(rate, burst)
        if bucket.try_take(now):
            return True
        self.stats["over_rate"] += 1
        if rec.penalised_until <= now and rec.floods.strike(now):
            self.penalise(peer, now, f"flood: over {self.limits.flood_drops} {kind} messages over its rate "
                                     f"in {self.limits.flood_window:.0f} s")
        return False

    def penalise(self, peer: str, now: float, reason: str) -> None:
        rec = self._record(peer)
        rec.penalised_until, rec.reason = now + self.limits.penalty, reason
        rec.strikes, rec.floods = self._strikes(), self._floods()
        self.stats["penalised"] += 1
        if self.on_penalised is not None:
            self.on_penalised(peer, reason)

    def expire(self, now: float) -> list[str]:
        """Peers whose penalty is over, let back in; and the records of peers quiet lately, dropped (memory
        stays bounded however many peers come and go)."""
        horizon = now - max(self.limits.bad_frames_window, self.limits.flood_window)
        released = [p for p, r in self._peers.items() if r.reason and r.penalised_until <= now]
        quiet = [p for p, r in self._peers.items() if not r.reason and not _active_since(r, horizon)]
        for p in released + quiet:
            del self._peers[p]
        return released

    # --- helpers -----------------------------------------------------------------------------------------
    def _record(self, peer: str) -> _PeerRecord:
        rec = self._peers.get(peer)
        if rec is None:
            rec = self._peers[peer] = _PeerRecord(self._strikes(), self._floods(), {})
        return rec

    def _strikes(self) -> StrikeCounter:
        return StrikeCounter(self.limits.bad_frames, self.limits.bad_frames_window)

    def _floods(self) -> StrikeCounter:
        return StrikeCounter(self.limits.flood_drops, self.limits.flood_window)


def _active_since(rec: _PeerRecord, since: float) -> bool:
    """Did the peer strike, flood, or use a rate after `since`?"""
    return (any(t > since for t in rec.strikes._times) or any(t > since for t in rec.floods._times)
            or any(b._at > since for b in rec.buckets.values()))
