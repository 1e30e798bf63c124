"""Real `swarmd join` processes inside network namespaces, driven through the CLI as a user would.

A daemon's API listens on 127.0.0.1 inside its own namespace, out of this process's reach, so every question
goes through `swarmd status --json`, `swarmd doctor --json` and `swarmd submit-prompt`, run in the same
namespace and finding the daemon through its home (`$SWARMD_HOME/api`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.netns.topology import Netns
from tests.swarm.daemons import Daemon


class NsDaemon(Daemon):
    def __init__(self, net: Netns, host: str, home: Path, *, bench_file: Path | None = None, swarm: str = "nat",
                 extra: tuple[str, ...] = ()) -> None:
        super().__init__(home, None, bench_file=bench_file, swarm=swarm, extra=extra)
        self.net, self.host = net, host
        self.started_at = 0.0

    @property
    def ip(self) -> str:
        return self.net.hosts[self.host].ip

    def command(self) -> list[str]:
        return [*self.net.exec_prefix(self.host), sys.executable, "-m", "swarmd", "join"]

    def start(self, *, bootstrap: tuple[str, ...] = (), listen: str = "", api: str = "127.0.0.1:0",
              extra: tuple[str, ...] = ()) -> NsDaemon:
        self.started_at = time.monotonic()
        super().start(bootstrap=bootstrap, listen=listen or f"/ip4/0.0.0.0/tcp/{4001}", api=api, extra=extra)
        return self

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """`swarmd ARGS` in this daemon's namespace, finding it through its home."""
        env = {**os.environ, "SWARMD_HOME": str(self.home)}
        return subprocess.run([*self.net.exec_prefix(self.host), sys.executable, "-m", "swarmd", *args],
                              capture_output=True, text=True, env=env, timeout=timeout)

    def status(self) -> dict[str, Any]:
        done = self.cli("status", "--json", timeout=30)
        if done.returncode != 0:
            raise AssertionError(f"swarmd status failed ({done.returncode}): {done.stderr.strip()}")
        return json.loads(done.stdout)

    def doctor(self) -> tuple[int, dict[str, Any]]:
        done = self.cli("doctor", "--json", timeout=60)
        try:
            return done.returncode, json.loads(done.stdout)
        except ValueError:
            raise AssertionError(f"swarmd doctor printed no JSON ({done.returncode}): {done.stderr}") from None

    def links(self) -> dict[str, dict[str, Any]]:
        """`status --json`'s links, by peer id."""
        return {link["peer_id"]: link for link in self.status().get("links", [])}
