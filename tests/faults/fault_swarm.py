"""Real daemon swarms for fault tests: each daemon behind its own emulated link, killed or reset at will.

Every daemon listens on a fixed loopback port and announces the port of a link of `scripts/link_emulator.py`
(one emulator process, one link per daemon, a control port), so every connection another daemon opens to it
crosses that link: resetting the link breaks them all, in both directions. Activations travel on the libp2p
streams (`--data-plane libp2p`) so that they cross the links too.

The daemons run with the default timings made more patient (`TOLERANT`): on a small shared machine a daemon
loading weights can be starved of CPU for seconds, and the default 3 s of silence would then declare a live
member dead. A killed daemon is still noticed: its connections drop at once and it answers no probe.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.pipeline.daemon_swarm import DaemonSwarm, even_plan
from tests.swarm.daemons import http, wait_until

ROOT = Path(__file__).resolve().parents[2]
TOLERANT = "[timings]\npreset = \"lan\"\nsuspect_after = 6.0\nprobe_timeout = 2.0\n"


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range: the daemon binds it later, and no outgoing
    connection of another test can take it meanwhile (as one may a port the kernel handed out)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.SystemRandom().randrange(10000, low)  # (not the seeded global RNG: every worker would draw alike)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in 10000-{low}")


class LinkEmulator:
    """`scripts/link_emulator.py` as a process: one link per daemon, changed through its control port."""

    def __init__(self, targets: dict[str, int], log: Path) -> None:
        self.ports = {name: free_port() for name in targets}
        self.control = free_port()
        cmd = [sys.executable, str(ROOT / "scripts" / "link_emulator.py"), "--control", str(self.control)]
        for name, target in targets.items():
            cmd += ["--link", f"{name}={self.ports[name]}:127.0.0.1:{target}"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "a"))
        wait_until(self._listening, 120, "the link emulator's control port")

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.control), timeout=1).close()
            return True
        except OSError:
            return False

    def command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        with socket.create_connection(("127.0.0.1", self.control), timeout=10) as s:
            s.sendall(json.dumps(cmd).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        return json.loads(buf)

    def reset(self, name: str) -> int:
        return self.command({"link": name, "reset": True})["reset"]

    def set(self, name: str, **changes: Any) -> dict[str, Any]:
        return self.command({"link": name, "set": changes})

    def stats(self) -> dict[str, Any]:
        return self.command({"stats": True})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


class FaultSwarm(DaemonSwarm):
    """A DaemonSwarm whose daemons are reached through emulated links (`links`, one named d{i} per daemon)."""

    def __init__(self, base: Path, bench_file: Path, n: int, *, extra: tuple[str, ...] = (),
                 model: str | None = None, n_blocks: int = 30, standby: int = 0) -> None:
        base.mkdir(parents=True, exist_ok=True)
        config = base / "timings.toml"
        config.write_text(TOLERANT)
        super().__init__(base, bench_file, n, extra=("--data-plane", "libp2p", "--config", str(config), *extra),
                         model=model, n_blocks=n_blocks)
        # The last `standby` daemons are spares (`--standby`): the plan file names only the others as stages.
        self.spares = set(range(n - standby, n))
        if standby:
            self.plan_file.write_text(even_plan(self.peers[:n - standby], model or "smollm2-135m", n_blocks).dumps())
        self.listen_ports = {f"d{i}": free_port() for i in range(n)}
        self.options: dict[int, tuple[str, ...]] = {}  # more `swarmd join` options of daemon i, each start
        self.links = LinkEmulator(self.listen_ports, base / "links.log")

    def announced(self, i: int) -> str:
        return f"/ip4/127.0.0.1/tcp/{self.links.ports[f'd{i}']}"

    def start_daemon(self, i: int, bootstrap: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> None:
        spare = ("--standby",) if i in self.spares else ()
        self.daemons[i].start(bootstrap=bootstrap, listen=f"/ip4/127.0.0.1/tcp/{self.listen_ports[f'd{i}']}",
                              extra=("--announce", self.announced(i), *spare, *self.options.get(i, ()), *extra))

    def start(self, timeout: float = 300.0) -> FaultSwarm:
        self.start_daemon(0, extra=("--plan", str(self.plan_file)))
        self.daemons[0].wait_ready(60)
        boot = (f"{self.announced(0)}/p2p/{self.peers[0]}",)
        for i in range(1, len(self.daemons)):
            self.start_daemon(i, boot)
        for d in self.daemons[1:]:
            d.wait_ready(60)
        self.wait_chain(len(self.daemons) - len(self.spares), timeout)
        return self

    def agreed_plan(self) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """Every running daemon's status and the plan (JSON) they all hold, or None while they differ."""
        statuses = [d.status() for d in self.running]
        plans = [st["plan"] for st in statuses]
        if not all(plans) or any(p != plans[0] for p in plans):
            return None
        return statuses, plans[0]

    def wait_chain(self, n: int, timeout: float = 300.0) -> dict[str, Any]:
        """Until every daemon agrees on a plan of `n` stages over the running daemons that are not standbys,
        all loaded, and every standby the plan names holds its warm copy."""
        def ready() -> dict[str, Any] | None:
            alive = {d.peer_id for d in self.running}
            if (agreed := self.agreed_plan()) is None:
                return None
            statuses, plan = agreed
            spares = {s["peer_id"] for s in plan.get("standbys", ())}
            if {s["peer_id"] for s in plan["stages"]} | spares != alive or len(plan["stages"]) != n:
                return None
            warm = all(st["assignment"]["state"] == "standby" for st in statuses if st["self"]["peer_id"] in spares)
            return plan if warm and self.pipeline()["chain"]["ready"] else None

        return wait_until(ready, timeout, f"a ready chain of {n} stages")

    def standby_of(self, plan: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """The plan's standbys: spare peer -> the blocks it holds a copy of."""
        return {s["peer_id"]: tuple(s["layers"]) for s in plan.get("standbys", ())}

    def stop(self) -> None:
        super().stop()
        self.links.stop()

    def index_of(self, peer_id: str) -> int:
        return self.peers.index(peer_id)

    def stream(self, via: int = 0, *, on_token=None, read_timeout: float = 120.0,
               **body: Any) -> tuple[list[tuple[int, int]], dict[str, Any]]:
        """POST /api/v0/generate on daemon `via` (an index into `daemons`): (step, token id) pairs as streamed,
        and the final event. `on_token(n)` is called after the n-th token."""
        pairs: list[tuple[int, int]] = []
        with http.stream("POST", f"{self.daemons[via].api}/api/v0/generate", json=body,
                          timeout=httpx.Timeout(30.0, read=read_timeout)) as r:
            if r.status_code != 200:
                r.read()
                return pairs, {"event": "http_error", "status": r.status_code, **r.json()}
            for line in r.iter_lines():
                event = json.loads(line)
                if event["event"] == "token":
                    pairs.append((event["step"], event["id"]))
                    if on_token is not None:
                        on_token(len(pairs))
                elif event["event"] in ("done", "error"):
                    return pairs, event
        return pairs, {"event": "cut"}

