"""Network namespaces for the network tests: hosts on a bridge, homes behind NAT routers, bandwidth caps.

Everything one run creates carries its prefix (`Netns.prefix`, a few characters unique to the run), so two
runs never collide, and `Netns.close` removes it all, veths included, whatever state a test left it in. Only
198.18.0.0/15 (the "internet" between NATs) and 10.x (LANs) are used, inside the namespaces created here.

    with Netns.create() as net:
        lan = net.bridge_lan(2)                  # hosts "h1", "h2" at 10.71.0.2/24 and 10.71.0.3/24
        net.run("h1", "ip", "addr")

    with Netns.create() as net:
        homes = net.two_homes(nat="drop")        # "pub" 198.18.0.1, "home1" 10.99.1.2 behind "nat1", ...

Needs root (CAP_NET_ADMIN), `ip` (iproute2), `nft` (nftables) and `tc`; `missing_tools()` says what is not
there, for a clean skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

NAT_MODES = ("drop", "rst")  # unsolicited inbound TCP: silently dropped (most home routers) or answered by RST


def missing_tools() -> str:
    """Why namespace tests cannot run here ('' when they can)."""
    if os.geteuid() != 0:
        return "network namespace tests need root (CAP_NET_ADMIN); run the suite as root to include them"
    lacking = [t for t in ("ip", "nft", "tc") if shutil.which(t) is None]
    if lacking:
        return f"network namespace tests need {', '.join(lacking)} (scripts/bootstrap.sh installs them as root)"
    return ""


class CommandFailed(RuntimeError):
    pass


def sh(*cmd: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise CommandFailed(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()[:400]}")
    return done


@dataclass
class Host:
    """One namespace with its address on the network the test cares about."""

    ns: str  # the namespace's full name (prefixed)
    ip: str
    name: str


@dataclass
class Netns:
    prefix: str
    namespaces: list[str] = field(default_factory=list)
    veths: list[str] = field(default_factory=list)  # root-namespace names, removed if a move failed midway
    hosts: dict[str, Host] = field(default_factory=dict)

    @staticmethod
    def create(prefix: str | None = None) -> Netns:
        """A fresh run: the prefix is 5 characters from the pid and the clock (veth names stay <= 15)."""
        if prefix is None:
            prefix = f"s{(os.getpid() * 7919 + int(time.time() * 1000)) % 36**4:04x}"[:5]
        return Netns(prefix)

    def __enter__(self) -> Netns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- building blocks ---------------------------------------------------------------------------------
    def name(self, short: str) -> str:
        return f"{self.prefix}{short}"

    def add_ns(self, short: str) -> str:
        ns = self.name(short)
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def link(self, a_ns: str, a_if: str, b_ns: str, b_if: str) -> tuple[str, str]:
        """A veth pair with one end in each namespace; the interface names get the run's prefix."""
        a, b = self.name(a_if), self.name(b_if)
        assert len(a) <= 15 and len(b) <= 15, (a, b)
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        self.veths += [a, b]
        sh("ip", "link", "set", a, "netns", a_ns)
        sh("ip", "link", "set", b, "netns", b_ns)
        for ns, dev in ((a_ns, a), (b_ns, b)):
            sh("ip", "-n", ns, "link", "set", dev, "up")
        return a, b

    def addr(self, ns: str, dev: str, cidr: str) -> None:
        sh("ip", "-n", ns, "addr", "add", cidr, "dev", dev)

    def run(self, short_or_ns: str, *cmd: str, check: bool = True,
            timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
        ns = short_or_ns if short_or_ns in self.namespaces else self.name(short_or_ns)
        return sh("ip", "netns", "exec", ns, *cmd, check=check, timeout=timeout)

    def exec_prefix(self, host: str) -> list[str]:
        """The command prefix that runs a process inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].ns]

    def limit_bandwidth(self, ns: str, dev: str, mbit: float, burst_kbit: int = 256, latency_ms: int = 50) -> None:
        """Cap what leaves `dev` at `mbit` with a token bucket (tc tbf; this kernel has no netem for delay)."""
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
           "burst", f"{burst_kbit}kbit", "latency", f"{latency_ms}ms")

    # --- topologies ------------------------------------------------------------------------------------------
    def bridge_lan(self, n: int, subnet: str = "10.71.0") -> list[Host]:
        """`n` hosts h1..hn on one bridge (in namespace "lan"), at {subnet}.2, .3, ...: different machines on a
        LAN, no NAT between them."""
        lan = self.add_ns("lan")
        sh("ip", "-n", lan, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", lan, "link", "set", "br0", "up")
        hosts = []
        for i in range(1, n + 1):
            ns = self.add_ns(f"h{i}")
            dev, port = self.link(ns, f"h{i}e", lan, f"h{i}b")
            sh("ip", "-n", lan, "link", "set", port, "master", "br0")
            ip = f"{subnet}.{i + 1}"
            self.addr(ns, dev, f"{ip}/24")
            self.hosts[f"h{i}"] = host = Host(ns, ip, f"h{i}")
            hosts.append(host)
        return hosts

    def two_homes(self, nat: str = "drop") -> dict[str, Host]:
        """A public network 198.18.0.0/24 (bridge in namespace "pub", which is also a host at 198.18.0.1) and
        two homes, each a host behind its own NAT router:

            pub 198.18.0.1 ── nat1 198.18.0.2 | 10.99.1.1 ── home1 10.99.1.2
                           └─ nat2 198.18.0.3 | 10.99.2.1 ── home2 10.99.2.2

        The routers masquerade (source ports kept, as Linux does) and treat unsolicited inbound TCP as `nat`
        says: "drop" it silently or let their own stack answer it with a RST ("rst")."""
        if nat not in NAT_MODES:
            raise ValueError(f"nat must be one of {NAT_MODES}")
        pub = self.add_ns("pub")
        sh("ip", "-n", pub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", pub, "link", "set", "br0", "up")
        self.addr(pub, "br0", "198.18.0.1/24")
        self.hosts["pub"] = Host(pub, "198.18.0.1", "pub")
        for i in (1, 2):
            router, home = self.add_ns(f"nat{i}"), self.add_ns(f"home{i}")
            wan, port = self.link(router, f"r{i}w", pub, f"p{i}")
            sh("ip", "-n", pub, "link", "set", port, "master", "br0")
            lan_side, home_dev = self.link(router, f"r{i}l", home, f"h{i}e")
            self.addr(router, wan, f"198.18.0.{i + 1}/24")
            self.addr(router, lan_side, f"10.99.{i}.1/24")
            self.addr(home, home_dev, f"10.99.{i}.2/24")
            sh("ip", "-n", home, "route", "add", "default", "via", f"10.99.{i}.1")
            sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            rules = [
                "add table ip nat",
                "add chain ip nat post { type nat hook postrouting priority 100 ; }",
                f"add rule ip nat post oifname {wan} masquerade",
            ]
            if nat == "drop":
                rules += [
                    "add table inet filt",
                    "add chain inet filt in { type filter hook input priority 0 ; policy accept ; }",
                    f"add rule inet filt in iifname {wan} meta l4proto tcp drop",
                ]
            for rule in rules:
                sh("ip", "netns", "exec", router, "nft", *rule.split())
            self.hosts[f"nat{i}"] = Host(router, f"198.18.0.{i + 1}", f"nat{i}")
            self.hosts[f"home{i}"] = Host(home, f"10.99.{i}.2", f"home{i}")
        return {k: self.hosts[k] for k in ("pub", "home1", "home2")}

    # --- clean-up ----------------------------------------------------------------------------------------------
    def kill_processes(self) -> None:
        """End what still runs inside this run's namespaces (by pid, as `ip netns pids` lists them)."""
        for ns in self.namespaces:
            done = sh("ip", "netns", "pids", ns, check=False)
            for pid in done.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass

    def close(self) -> None:
        """Remove every namespace and veth of this run (idempotent; never raises)."""
        try:
            self.kill_processes()
        except Exception:
            pass
        for ns in reversed(self.namespaces):
            sh("ip", "netns", "del", ns, check=False)
        for dev in self.veths:  # gone with their namespaces unless a move failed; then still in ours
            if sh("ip", "link", "show", dev, check=False).returncode == 0:
                sh("ip", "link", "del", dev, check=False)
        self.namespaces.clear()
        self.veths.clear()


def leftovers(prefix: str) -> list[str]:
    """Namespaces and root-namespace links whose names start with `prefix` (what `close` must leave: none)."""
    names = [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in sh("ip", "-o", "link").stdout.splitlines()]
    return [n for n in names + links if n.startswith(prefix)]


def ns_python(net: Netns, host: str, args: Sequence[str]) -> list[str]:
    import sys

    return [*net.exec_prefix(host), sys.executable, *args]
