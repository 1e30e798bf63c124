"""`swarmd doctor`'s judgement, pure: a daemon's status document in, one line per check out, with a fix where one
applies. No I/O: `swarmd.cli.doctor` fetches the documents and prints what this returns.

Each check is `ok`, `warn` (it works, and a fix would make it better: a relayed link, a NAT) or `fail` (something
does not work: a member it cannot reach, no way for peers to reach it). The doctor exits 1 when any check fails.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | info
    line: str
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Diagnosis:
    situation: str  # one line: what kind of place this daemon is in
    checks: tuple[Check, ...]

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {"ok": not self.failed, "situation": self.situation, "checks": [c.to_json() for c in self.checks]}


def short(peer: str) -> str:
    return peer[-6:] if peer else "-"


def diagnose(status: dict[str, Any], pipeline: dict[str, Any] | None = None) -> Diagnosis:
    conn = status.get("connectivity") or {}
    reach = conn.get("reachability") or {}
    links = status.get("links") or []
    members = [m for m in status.get("members", [])[1:] if m.get("state") != "dead"]
    port = _listen_port(conn)
    checks = [
        _addresses(conn, port),
        _reachability(reach, port, bool(members)),
        *_relays(conn, reach),
        *_links(links, conn),
        _data_plane(conn, reach),
        _clock(status, pipeline),
    ]
    return Diagnosis(_situation(reach, links, conn), tuple(c for c in checks if c is not None))


def _listen_port(conn: dict[str, Any]) -> str:
    for a in conn.get("listen", []):
        if "/tcp/" in a:
            return a.split("/tcp/")[1].split("/")[0]
    return "?"


def _situation(reach: dict[str, Any], links: list[dict[str, str]], conn: dict[str, Any]) -> str:
    status = reach.get("status", "unknown")
    relayed = [x for x in links if x["path"] == "relayed"]
    punched = [p for p, h in (conn.get("hole_punching") or {}).items() if h.get("successes")]
    if status == "reachable":
        where = reach.get("summary", "reachable").split(" (")[0]
        return f"{where}: members dial this daemon directly"
    if status == "behind-nat":
        nat = reach.get("nat") or {}
        kind = "its NAT answers unsolicited connections with RST" if nat.get("unsolicited") == "rst" else \
            "its NAT drops unsolicited connections"
        if relayed:
            return f"behind NAT ({kind}): {len(relayed)} link(s) relayed" + \
                (f", {len(punched)} hole-punched" if punched else "")
        if punched:
            return f"behind NAT ({kind}): hole-punched to {len(punched)} member(s), no link relayed"
        return f"behind NAT ({kind}): every link direct"
    if status == "firewalled":
        return "not reachable: a firewall blocks inbound connections"
    return "reachability not known yet"


def _addresses(conn: dict[str, Any], port: str) -> Check:
    listen = ", ".join(conn.get("listen", [])) or "nothing"
    adv = conn.get("advertised", [])
    seen = (conn.get("reachability") or {}).get("observed_ip", "")
    line = f"listening on {listen}; peers see it at {seen or 'an address not reported yet'}; advertises " + \
        (f"{len(adv)} address(es) ({conn.get('advertised_because', '')})" if adv else "no address")
    if not adv:
        return Check("addresses", FAIL, line, f"listen on an interface peers can reach (--listen /ip4/<ip>/tcp/{port}) "
                                              "or name the address they should dial (--announce)")
    if any("/0.0.0.0/" in a or "/::/" in a for a in adv):
        return Check("addresses", FAIL, line, "advertise a concrete address with --announce")
    return Check("addresses", OK, line)


def _reachability(reach: dict[str, Any], port: str, has_members: bool) -> Check:
    status, summary = reach.get("status", "unknown"), reach.get("summary", "unknown")
    if status == "reachable":
        return Check("reachability", OK, summary)
    forward = f"forward TCP port {port} (and the data-plane port, --data-plane-port) on the router to this machine, " \
              f"then --announce /ip4/<public ip>/tcp/{port}"
    if status == "behind-nat":
        nat = reach.get("nat") or {}
        extra = ("; links to other members behind NAT stay relayed" if nat.get("unsolicited") == "rst" or
                 nat.get("port_preserving") is False else "")
        return Check("reachability", WARN, summary + extra, forward + " (members then dial it directly)")
    if status == "firewalled":
        return Check("reachability", FAIL, summary, f"allow inbound TCP on port {port} (and the data-plane port) in the "
                                                    "firewall")
    if not has_members:
        return Check("reachability", INFO, f"{summary} (no member to ask yet)")
    return Check("reachability", WARN, summary, "wait a few seconds: members are asked to dial it back")


def _relays(conn: dict[str, Any], reach: dict[str, Any]) -> list[Check]:
    relay = conn.get("relay") or {}
    out = []
    held = relay.get("reservations", [])
    if reach.get("status") in ("behind-nat", "firewalled"):
        if held:
            names = ", ".join(f"{short(r['relay'])} ({r['expires_in_s']} s left)" for r in held)
            out.append(Check("relay reservations", OK, f"{len(held)} reservation(s): {names}"))
        else:
            refused = relay.get("refused") or {}
            why = "; ".join(f"{short(p)}: {w}" for p, w in refused.items()) or "no member that serves relaying yet"
            out.append(Check("relay reservations", FAIL, f"not reachable and no relay reservation ({why}): "
                                                         "members cannot dial this daemon",
                             "run a reachable member (it serves relaying unless --no-relay-service), or give "
                             "--relay /ip4/<ip>/tcp/<port>/p2p/<relay id>"))
    if relay.get("serving"):
        lim = relay.get("limits") or {}
        line = (f"serving as a relay: {relay.get('reservations_held_here', 0)} reservation(s) held here, "
                f"{relay.get('circuits_relayed', 0)} circuit(s) relayed; limits {lim.get('circuits_per_peer')} "
                f"circuits per peer, {int(lim.get('circuit_bytes', 0)) >> 20} MiB and {lim.get('circuit_seconds')} s "
                "per circuit")
        useful = reach.get("status") == "reachable"
        out.append(Check("relay service", OK if useful else INFO,
                         line + ("" if useful else " (only members that reach it directly can use it)")))
    else:
        out.append(Check("relay service", INFO, "relay service off (--no-relay-service)"))
    return out


def _links(links: list[dict[str, str]], conn: dict[str, Any]) -> list[Check]:
    out = []
    for link in links:
        peer, path, reason = link["peer_id"], link["path"], link["reason"]
        line = f"{short(peer)}: {path}: {reason}"
        if path in ("data-plane", "direct"):
            out.append(Check(f"link {short(peer)}", OK, line))
        elif path == "relayed":
            out.append(Check(f"link {short(peer)}", WARN, line,
                             "forward the listen port on either side's router: a relayed hop costs the relay's too"))
        else:
            out.append(Check(f"link {short(peer)}", FAIL, line,
                             "check that the member runs and that its address (or a relay) is reachable from here"))
    return out


def _data_plane(conn: dict[str, Any], reach: dict[str, Any]) -> Check | None:
    dp = conn.get("data_plane") or {}
    port = dp.get("port")
    if not port:
        return Check("data plane", INFO, "no TLS data plane (--data-plane libp2p, or the pipeline is not running)")
    reachable = reach.get("data_plane_reachable")
    if reach.get("status") == "reachable" and reachable is False:
        return Check("data plane", FAIL, f"the libp2p port is reachable but the data-plane port {port} is not: "
                                         "activations fall back to libp2p (several times slower per hop)",
                     f"allow or forward TCP port {port} too (fix it with --data-plane-port)")
    if reach.get("status") == "behind-nat":
        return Check("data plane", WARN, f"data-plane port {port} is behind NAT: members outside reach this daemon "
                                         "on libp2p streams instead", "forward --data-plane-port with the listen port")
    where = "reachable from outside" if reachable else "reachable"
    return Check("data plane", OK, f"TLS data plane on port {port}, {where}")


def _clock(status: dict[str, Any], pipeline: dict[str, Any] | None) -> Check | None:
    leader = status.get("leader")
    me = (status.get("self") or {}).get("peer_id")
    if not leader or pipeline is None:
        return None
    if leader == me:
        return Check("clock", INFO, "this daemon leads: its clock is the reference for traces")
    off = (pipeline.get("clock_offsets") or {}).get(leader)
    if not off:
        return Check("clock", INFO, f"no clock offset to the leader {short(leader)} measured yet")
    return Check("clock", INFO, f"clock offset to the leader {short(leader)}: {off['offset_ms']:+.1f} ms "
                                f"(± {off['error_ms']:.1f} ms; used to align traces)")
