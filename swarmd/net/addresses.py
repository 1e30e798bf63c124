"""Which addresses a daemon advertises, and which of a peer's addresses it dials. Pure: no sockets, no clock.

A daemon listening on `/ip4/0.0.0.0/tcp/P` must never tell peers to dial `0.0.0.0` (py-libp2p does: peers then
dial themselves). What it advertises, in order of preference:

1. `--announce` addresses, exactly as given (the operator knows best: a port forward, a public DNS name);
2. its listen addresses, wildcards expanded to the interfaces' own addresses, keeping only the widest scope
   it has (public beats private beats loopback): a home machine with a public IPv6 and a LAN IPv4 advertises
   the public one; a LAN-only swarm advertises LAN addresses; a swarm of one machine, loopback;
3. an address a peer verified by dialling it back on a new connection (a NAT with a forwarded port, seen from
   outside at WAN_IP:listen_port);
4. `/p2p-circuit` addresses through the relays that hold a reservation for it.

Private addresses are left out once the daemon knows it is seen from the public internet (a peer observed it
at a public address): peers outside its network cannot dial them. A dialler, for its part, tries a peer's
private addresses only when they are on one of its own networks (two homes both using 192.168.1.0/24 must not
dial each other's LAN addresses). 198.18.0.0/15 (the benchmarking range, RFC 2544) counts as public: tests
use it as the internet between their NATs.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

CIRCUIT = "/p2p-circuit"


class Scope(enum.IntEnum):
    """How far an address reaches; larger is wider."""

    UNUSABLE = 0  # unspecified (0.0.0.0, ::) or link-local: never advertised, never dialled
    LOOPBACK = 1
    PRIVATE = 2  # RFC 1918, carrier-grade NAT (100.64/10), IPv6 unique-local
    PUBLIC = 3


_PRIVATE_NETS = [ipaddress.ip_network(n) for n in
                 ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")]


def scope_of(ip: str) -> Scope:
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return Scope.PUBLIC  # a DNS name: the operator announced it, so it resolves where it must
    if addr.is_unspecified or addr.is_link_local or addr.is_multicast:
        return Scope.UNUSABLE
    if addr.is_loopback:
        return Scope.LOOPBACK
    if any(addr in net for net in _PRIVATE_NETS):
        return Scope.PRIVATE
    return Scope.PUBLIC


def parts(addr: str) -> list[str]:
    return addr.strip("/").split("/")


def ip_of(addr: str) -> str | None:
    """The IP (or DNS name) of a direct multiaddr, None for a circuit address or one without a host."""
    if is_circuit(addr):
        return None
    p = parts(addr)
    if len(p) >= 2 and p[0] in ("ip4", "ip6", "dns", "dns4", "dns6"):
        return p[1]
    return None


def tcp_port_of(addr: str) -> int | None:
    p = parts(addr)
    for i in range(len(p) - 1):
        if p[i] == "tcp" and p[i + 1].isdigit():
            return int(p[i + 1])
    return None


def is_circuit(addr: str) -> bool:
    return CIRCUIT in addr


def strip_peer(addr: str) -> str:
    """`/ip4/1.2.3.4/tcp/5/p2p/ID` -> `/ip4/1.2.3.4/tcp/5` (the last /p2p/ part only)."""
    head, sep, tail = addr.rpartition("/p2p/")
    return head if sep and "/" not in tail else addr


def with_peer(addr: str, peer_id: str) -> str:
    return addr if addr.endswith(f"/p2p/{peer_id}") else f"{strip_peer(addr)}/p2p/{peer_id}"


def tcp_address(ip: str, port: int) -> str:
    family = "ip6" if ":" in ip else "ip4"
    return f"/{family}/{ip}/tcp/{port}"


def circuit_address(relay_addr: str, relay_id: str, peer_id: str) -> str:
    """How others reach `peer_id` through the relay `relay_id` listening at `relay_addr`."""
    return f"{with_peer(relay_addr, relay_id)}{CIRCUIT}/p2p/{peer_id}"


def relay_of(circuit: str) -> tuple[str, str]:
    """`/ip4/R/tcp/P/p2p/RID/p2p-circuit/p2p/ID` -> (`/ip4/R/tcp/P`, RID)."""
    relay_part = circuit.split(CIRCUIT)[0]
    head, _, relay_id = relay_part.rpartition("/p2p/")
    return head, relay_id


def expand(listen: str, interface_ips: Iterable[str]) -> list[str]:
    """A listen address with its wildcard host replaced by each interface address of the same family."""
    p = parts(listen)
    if len(p) < 2 or p[1] not in ("0.0.0.0", "::"):
        return [listen]
    v6 = p[1] == "::"
    return ["/" + "/".join([p[0], ip, *p[2:]]) for ip in interface_ips
            if (":" in ip) == v6 and scope_of(ip) is not Scope.UNUSABLE]


@dataclass(frozen=True)
class Advertised:
    """What a daemon tells peers to dial, and why (for `swarmd doctor`)."""

    addresses: tuple[str, ...]
    reason: str


def advertised(listen: Sequence[str], interface_ips: Sequence[str], *, announce: Sequence[str] = (),
               verified: Sequence[str] = (), circuits: Sequence[str] = (), seen_from_public: bool = False,
               reachable: bool | None = None) -> Advertised:
    """The addresses (without /p2p/) to advertise; see the module's docstring for the rules.

    `verified`: addresses a peer reached by dialling back; `seen_from_public`: a peer saw this daemon at a public
    address; `reachable`: the dial-back verdict (None: not known yet). Circuit addresses are advertised only
    while the daemon is not known to be reachable."""
    if announce:
        return Advertised(tuple(dict.fromkeys(announce)), "as --announce says")
    concrete = [a for raw in listen for a in expand(raw, interface_ips) if not is_circuit(a)]
    scored = [(scope_of(ip), a) for a in concrete if (ip := ip_of(a)) is not None]
    scored = [(s, a) for s, a in scored if s is not Scope.UNUSABLE]
    widest = max((s for s, _ in scored), default=Scope.UNUSABLE)
    out = [a for s, a in scored if s == widest]
    reason = {Scope.PUBLIC: "public listen addresses", Scope.PRIVATE: "private network addresses (LAN)",
              Scope.LOOPBACK: "loopback only: peers on this machine alone can dial it",
              Scope.UNUSABLE: "no usable listen address"}[widest]
    if seen_from_public and widest is Scope.PRIVATE:  # peers that see us from outside cannot dial these
        out, reason = [], "behind NAT: LAN addresses withheld from peers outside the LAN"
    extra = [v for v in verified if v not in out]
    if extra:
        out += extra
        reason += "; WAN address verified by a peer's dial-back"
    if circuits and reachable is not True:
        out += [c for c in circuits if c not in out]
        reason += "; relay addresses (not reachable directly)"
    return Advertised(tuple(out), reason)


def on_link(ip: str, networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return False
    return any(addr in net for net in networks)


def dialable(addresses: Sequence[str], networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]
             ) -> tuple[list[str], list[str]]:
    """A peer's addresses split into (direct addresses worth dialling, circuit addresses). Unspecified and
    link-local addresses are dropped; private ones are kept only when on one of our `networks`."""
    direct, circuits = [], []
    for a in addresses:
        if is_circuit(a):
            circuits.append(a)
            continue
        ip = ip_of(a)
        if ip is None:
            continue
        scope = scope_of(ip)
        if scope is Scope.UNUSABLE or (scope is Scope.PRIVATE and not on_link(ip, networks)):
            continue
        direct.append(a)
    return direct, circuits


def local_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """The networks of this machine's interfaces (address/netmask), loopback included."""
    import psutil

    out: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for entries in psutil.net_if_addrs().values():
        for e in entries:
            if not e.netmask:
                continue
            try:
                out.append(ipaddress.ip_network(f"{e.address.split('%')[0]}/{e.netmask}", strict=False))
            except ValueError:
                continue
    return out


def interface_ips() -> list[str]:
    """Every address of this machine's interfaces (IPv4 and IPv6)."""
    import psutil

    out = []
    for entries in psutil.net_if_addrs().values():
        for e in entries:
            try:
                ipaddress.ip_address(e.address.split("%")[0])
            except ValueError:
                continue
            out.append(e.address.split("%")[0])
    return out
