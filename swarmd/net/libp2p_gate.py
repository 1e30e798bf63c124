"""Where the peer gate meets py-libp2p 0.8.1: connections, every stream handler, and gossip.

- `GatedUpgrader` wraps the swarm's transport upgrader. Before the security handshake, an IP address that
  opens connections faster than `handshakes_per_second` is hung up on (a handshake costs milliseconds of
  CPU). Right after it (the first moment the remote peer id is authenticated, before any stream exists) a
  peer the gate refuses — not on the allowlist, or penalised — is hung up on. Inbound and outbound
  connections both pass through it.
- `guard_all_handlers` makes every stream handler the host ever registers (identify, ping, gossipsub, ours)
  unable to take the host down: an exception in a handler (gossipsub's `DecodeError` on bytes that are not a
  protobuf, docs/SECURITY.md) would end `host.run()` and every connection with it. It becomes a strike
  against the sender instead.
- `gossip_validator` is a gossipsub topic validator: a message whose origin the gate refuses, or that is over
  its origin's rate or the size limit, is dropped before it is delivered or forwarded to other peers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import trio

from swarmd.net.gate import PeerGate
from swarmd.net.identity import short_id

log = logging.getLogger(__name__)


class GatedUpgrader:
    """py-libp2p's TransportUpgrader, with the gate's verdict right after the security handshake."""

    def __init__(self, inner: Any, gate: PeerGate) -> None:
        self._inner = inner
        self._gate = gate
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def upgrade_security(self, raw_conn: Any, is_initiator: bool, peer_id: Any = None) -> Any:
        from libp2p.transport.exceptions import SecurityUpgradeFailure

        if not is_initiator:
            ip, now, lim = _remote_ip(raw_conn), trio.current_time(), self._gate.limits
            if ip and (self._gate.is_penalised(f"ip:{ip}", now) or not self._gate.within_rate(
                    f"ip:{ip}", "handshake", now, lim.handshakes_per_second, lim.handshake_burst)):
                self.refused += 1
                with contextlib.suppress(Exception):
                    await raw_conn.close()
                raise SecurityUpgradeFailure(f"{ip} opens connections faster than {lim.handshakes_per_second:g}/s")
        secured = await self._inner.upgrade_security(raw_conn, is_initiator, peer_id)
        remote = secured.get_remote_peer().to_base58()
        refusal = self._gate.refusal(remote, trio.current_time())
        if refusal is not None:
            self.refused += 1
            log.debug("connection %s %s refused: %s", "to" if is_initiator else "from", short_id(remote), refusal)
            with contextlib.suppress(Exception):
                await secured.close()
            raise SecurityUpgradeFailure(f"{short_id(remote)} refused: {refusal}")
        return secured

    async def upgrade_connection(self, conn: Any, peer_id: Any) -> Any:
        return await self._inner.upgrade_connection(conn, peer_id)


def _remote_ip(raw_conn: Any) -> str:
    try:
        address = raw_conn.get_remote_address()
    except Exception:
        return ""
    return str(address[0]) if address else ""


def gate_of(host: Any) -> PeerGate | None:
    """The gate installed on `host` (by `swarmd.net.libp2p_network.Libp2pNetwork`), or None for a bare host."""
    upgrader = getattr(host.get_network(), "upgrader", None)
    return upgrader._gate if isinstance(upgrader, GatedUpgrader) else None


def install_gate(host: Any, gate: PeerGate) -> GatedUpgrader:
    network = host.get_network()
    gated = GatedUpgrader(network.upgrader, gate)
    network.upgrader = gated
    return gated


class _GuardedHandlers(dict):
    """The host's protocol -> handler table; whatever is stored in it is stored guarded."""

    def __init__(self, handlers: dict, guard: Callable[[str, Any], Any]) -> None:
        self._guard = guard
        super().__init__()
        for protocol, handler in handlers.items():
            self[protocol] = handler

    def __setitem__(self, protocol: Any, handler: Any) -> None:
        if handler is not None and not getattr(handler, "_swarmd_guarded", False):
            handler = self._guard(str(protocol), handler)
        super().__setitem__(protocol, handler)


def guard_all_handlers(host: Any, gate: PeerGate) -> None:
    """Wrap every stream handler of `host`, now and later, in a catch-all that strikes the sender."""
    from libp2p.io.exceptions import IOException
    from libp2p.network.stream.exceptions import StreamError

    warned: dict[tuple[str, str], float] = {}

    def guard(protocol: str, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        async def guarded(stream: Any) -> None:
            try:
                await handler(stream)
            except (StreamError, IOException, EOFError):
                pass  # the connection or stream broke: not something the peer sent
            except Exception as e:
                peer = "?"
                with contextlib.suppress(Exception):
                    peer = stream.muxed_conn.peer_id.to_base58()
                now = trio.current_time()
                what = f"{type(e).__name__}: {str(e)[:160]}"
                if now - warned.get((peer, protocol), -60.0) >= 60.0:
                    warned[(peer, protocol)] = now
                    log.warning("%s handler failed on a stream from %s (%s)", protocol, short_id(peer), what)
                if peer != "?":
                    gate.strike(peer, now, f"{protocol}: {what}")
                with contextlib.suppress(Exception):
                    await stream.reset()

        guarded._swarmd_guarded = True  # type: ignore[attr-defined]
        return guarded

    mux = host.get_mux()
    mux.handlers = _GuardedHandlers(mux.handlers, guard)


def gossip_validator(gate: PeerGate, self_id: str, max_bytes: int) -> Callable[[Any, Any], bool]:
    """A synchronous gossipsub topic validator enforcing the gate per message origin."""
    from libp2p.peer.id import ID

    lim = gate.limits

    def validate(forwarder: Any, msg: Any) -> bool:
        try:
            origin = ID(msg.from_id).to_base58()
        except Exception:
            return False
        if origin == self_id:
            return True
        now = trio.current_time()
        if len(msg.data) > max_bytes:
            gate.strike(origin, now, f"gossip message of {len(msg.data)} bytes")
            return False
        if not gate.admits(origin, now):
            return False
        return gate.within_rate(origin, "gossip", now, lim.gossip_per_second, lim.gossip_burst)

    return validate
