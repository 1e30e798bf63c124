"""Which path each peer's link takes — the TLS data plane, a direct libp2p connection, or a relay — and why.

`describe` is pure: it turns what is known about one peer (`LinkFacts`) into the entry `swarmd status --json`
shows under `links`:

    {"peer_id": "12D3Koo...", "path": "data-plane" | "direct" | "relayed" | "none", "reason": "..."}

`data-plane` when activations to or from the peer travel on the TLS data plane; `direct` when they would
travel on a direct libp2p connection (hole-punched or dialled); `relayed` when the only connection goes through
a relay; `none` when there is no connection at all. `kind_of` reads a py-libp2p connection.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from swarmd.net.identity import short_id
from swarmd.net.seam import LinkInfo

PATHS = ("data-plane", "direct", "relayed", "none")


def kind_of(conn: Any) -> str:
    """'relayed' for a circuit through a relay, else 'direct'."""
    with contextlib.suppress(Exception):
        if any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses()):
            return "relayed"
    with contextlib.suppress(Exception):
        if str(getattr(conn.get_connection_type(), "value", "")) == "relayed":
            return "relayed"
    return "direct"


def connection_kinds(conns: Iterable[Any] | Any) -> set[str]:
    if conns is None:
        return set()
    if not isinstance(conns, list | tuple | set):
        conns = [conns]
    return {kind_of(c) for c in conns if not bool(getattr(c, "is_closed", False))}


def relay_of_connection(conns: Iterable[Any]) -> str:
    """The relay's peer id of the first relayed connection ('' when none)."""
    for c in conns or ():
        with contextlib.suppress(Exception):
            for a in c.get_transport_addresses():
                text = str(a)
                if "/p2p-circuit" in text:
                    return text.split("/p2p-circuit")[0].rpartition("/p2p/")[2]
    return ""


@dataclass(frozen=True)
class LinkFacts:
    peer: str
    kinds: frozenset[str] = frozenset()  # of the live libp2p connections: "direct", "relayed"
    relay: str = ""  # the relay of a relayed connection
    plane_out: tuple[str, str] | None = None  # our activation link to the peer: ("data-plane" | "libp2p", why)
    plane_in: int = 0  # data-plane connections the peer attached to us
    offer: str = ""  # why we did not offer the peer our data plane ('' when we did, or it never asked)
    punch: dict[str, Any] | None = None  # the hole-punch schedule's entry for the peer
    dial_error: str = ""


def describe(f: LinkFacts) -> dict[str, str]:
    if f.plane_out is not None and f.plane_out[0] == "data-plane":
        return _entry(f, "data-plane", f"activations to it on the TLS data plane ({f.plane_out[1]})")
    if f.plane_in:
        return _entry(f, "data-plane", "its activations to this daemon arrive on the TLS data plane")
    if "direct" in f.kinds:
        how = "hole-punched direct connection" if f.punch and f.punch.get("successes") else "direct connection"
        if f.plane_out is not None:
            why = f"data plane not used: {f.plane_out[1]}"
        elif f.offer:
            why = f"data plane not offered to it: {f.offer}"
        else:
            why = "no activation link with it yet"
        return _entry(f, "direct", f"{how}; {why}")
    if "relayed" in f.kinds:
        via = f"through relay {short_id(f.relay)}" if f.relay else "through a relay"
        return _entry(f, "relayed", f"{via}; {_punch_words(f.punch)}")
    return _entry(f, "none", f"not connected{': ' + f.dial_error if f.dial_error else ''}")


def _punch_words(punch: dict[str, Any] | None) -> str:
    if not punch:
        return "hole punching not tried (off, or the peer is not a member)"
    if punch.get("state") == "punching":
        return f"hole punching in progress (attempt {punch.get('attempts', 0)})"
    failures = int(punch.get("failures") or 0)
    if failures:
        nxt = punch.get("next_attempt_in_s")
        return (f"hole punching failed {failures} time{'s' if failures != 1 else ''} "
                f"({punch.get('last_error') or 'no direct connection came up'})"
                + (f"; next try in {nxt:.0f} s" if nxt is not None else ""))
    return "waiting to try hole punching"


def _entry(f: LinkFacts, path: str, reason: str) -> dict[str, str]:
    return {"peer_id": f.peer, "path": path, "reason": reason}


def kinds_for_descriptor(links: Iterable[dict[str, str]]) -> dict[str, str]:
    """peer -> path, for the descriptor the planner reads (peers with no connection left out)."""
    return {link["peer_id"]: link["path"] for link in links if link["path"] != "none"}


def links_document(paths: Mapping[str, LinkInfo], members: Iterable[str], self_id: str) -> list[dict[str, str]]:
    """`links` from any network's `link_paths()`: one entry per connected peer and per member (`none` when there is
    no connection to it)."""
    out = {peer: {"peer_id": peer, "path": info.path.value, "reason": info.reason} for peer, info in paths.items()}
    for peer in members:
        out.setdefault(peer, {"peer_id": peer, "path": "none", "reason": "not connected"})
    out.pop(self_id, None)
    return [out[p] for p in sorted(out)]
