"""Three real daemons serving SmolLM2 in three stages across namespaces: a public founder and two homes behind
NAT (`two_homes`), or all three on loopback in one namespace (the baseline), driven through the CLI."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from swarmd.net.identity import load_or_create_identity, peer_id_of
from tests.netns.ns_daemons import NsDaemon
from tests.netns.topology import Netns
from tests.pipeline.daemon_swarm import even_plan
from tests.swarm.daemons import stop_all, wait_until

CONTEXT = 256
EXTRA = ("--timings", "local-test", "--max-context", str(CONTEXT))


class NatSwarm:
    def __init__(self, base: Path, bench_file: Path | None, nat: str, *, extra: tuple[str, ...] = ()) -> None:
        """`nat`: "drop" or "rst" (homes behind NATs of that kind), or "loopback" (one namespace, 127.0.0.1)."""
        self.nat = nat
        self.net = Netns.create()
        if nat == "loopback":
            self.net.add_ns("pub")
            self.net.hosts["pub"] = self.net.hosts.get("pub") or _host(self.net, "pub", "127.0.0.1")
            hosts = ["pub", "pub", "pub"]
        else:
            self.net.two_homes(nat)
            hosts = ["pub", "home1", "home2"]
        self.daemons: list[NsDaemon] = []
        for i, host in enumerate(hosts):
            home = base / f"d{i}-{host}"
            home.mkdir(parents=True, exist_ok=True)
            load_or_create_identity(home)
            self.daemons.append(NsDaemon(self.net, host, home, bench_file=bench_file, swarm=f"nat-{nat}",
                                         extra=(*EXTRA, *extra)))
        self.peers = [peer_id_of(load_or_create_identity(d.home)) for d in self.daemons]
        self.plan_file = base / "plan.json"
        self.plan_file.write_text(even_plan(self.peers).dumps())
        self.joined_s: dict[str, float] = {}  # home -> seconds from `swarmd join` to the chain being ready

    @property
    def founder(self) -> NsDaemon:
        return self.daemons[0]

    def listen(self, i: int) -> str:
        return f"/ip4/127.0.0.1/tcp/{4001 + i}" if self.nat == "loopback" else "/ip4/0.0.0.0/tcp/4001"

    def start(self, timeout: float = 300.0) -> NatSwarm:
        f = self.founder.start(listen=self.listen(0), extra=("--plan", str(self.plan_file))).wait_ready(90)
        host = "127.0.0.1" if self.nat == "loopback" else "198.18.0.1"
        boot = f"/ip4/{host}/tcp/4001/p2p/{f.peer_id}"
        for i, d in enumerate(self.daemons[1:], start=1):
            d.start(bootstrap=(boot,), listen=self.listen(i))
        for d in self.daemons[1:]:
            d.wait_ready(120)
        self.wait_covered(timeout)
        for d in self.daemons[1:]:
            self.joined_s[d.host] = round(time.monotonic() - d.started_at, 1)
        return self

    def wait_covered(self, timeout: float) -> dict[str, Any]:
        def covered() -> dict[str, Any] | None:
            st = self.founder.status()
            alive = sum(1 for m in st["members"] if m["state"] == "alive")
            return st if alive == 3 and st["coverage"].endswith("covered") and "not" not in st["coverage"] else None

        return wait_until(covered, timeout, "every stage of the 3-stage plan ready", interval=1.0)

    def submit(self, via: int, prompt: str, n: int, timeout: float = 300.0) -> tuple[int, dict[str, Any], str]:
        done = self.daemons[via].cli("submit-prompt", "--json", "--max-tokens", str(n), prompt, timeout=timeout)
        try:
            result = json.loads(done.stdout) if done.returncode == 0 else {}
        except ValueError:
            result = {}
        return done.returncode, result, done.stderr

    def link(self, a: int, b: int) -> dict[str, Any]:
        return self.daemons[a].links().get(self.peers[b], {"path": "?", "reason": "no entry"})

    def logs(self) -> str:
        return "\n".join(f"--- {d.home.name}\n{d.log()[-3000:]}" for d in self.daemons)

    def stop(self) -> None:
        try:
            stop_all(self.daemons)
        finally:
            self.net.close()


def _host(net: Netns, name: str, ip: str):
    from tests.netns.topology import Host

    return Host(net.name(name), ip, name)
