"""Real `swarmd join` processes for acceptance tests: started, read, asked and killed as a user would."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# One client for every request a test makes to a daemon (threads may share it): each new httpx client loads the CA
# bundle, tens of milliseconds of CPU, which polling a swarm's status turns into a busy core.
http = httpx.Client()


class Daemon:
    def __init__(self, home: Path, model: Path | None, *, bench_file: Path | None = None, swarm: str = "test",
                 extra: tuple[str, ...] = (), env: dict[str, str | None] | None = None) -> None:
        self.home, self.model, self.swarm, self.extra = home, model, swarm, extra
        self.env = env or {}  # set in (or, with None, removed from) the daemon's environment
        self.home.mkdir(parents=True, exist_ok=True)
        if bench_file is not None:
            shutil.copy(bench_file, home / bench_file.name)
        self.proc: subprocess.Popen[str] | None = None
        self.peer_id = ""
        self.addresses: list[str] = []
        self.api = ""
        self.stdout_lines: list[str] = []

    def command(self) -> list[str]:
        return [sys.executable, "-m", "swarmd", "join"]

    @property
    def log_path(self) -> Path:
        return self.home / "daemon.log"

    def start(self, *, bootstrap: tuple[str, ...] = (), listen: str = LOOPBACK, api: str = "127.0.0.1:0",
              extra: tuple[str, ...] = ()) -> Daemon:
        cmd = [*self.command(), "--home", str(self.home), "--listen", listen, "--api", api, "--swarm", self.swarm,
               *(["--model", str(self.model)] if self.model is not None else []), *self.extra, *extra]
        for b in bootstrap:
            cmd += ["--bootstrap", b]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SWARMD_BOOTSTRAP", None)
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        self.stdout_lines = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(self.log_path, "a"), text=True,
                                     env=env)
        return self

    def wait_ready(self, timeout: float = 30.0) -> Daemon:
        """Read stdout up to 'Daemon is ready'; fail with the log if it exits or takes too long."""
        assert self.proc is not None and self.proc.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()

        def pump(stream) -> None:  # a thread: text pipes buffer, so select() cannot see their lines
            for line in stream:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, args=(self.proc.stdout,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            self.stdout_lines.append(line)
            if line.startswith("Peer ID: "):
                self.peer_id = line.removeprefix("Peer ID: ")
            elif line.startswith("Swarm listening on "):
                self.addresses.append(line.removeprefix("Swarm listening on "))
            elif line.startswith("API server listening on "):
                self.api = line.removeprefix("API server listening on ")
            elif line == "Daemon is ready":
                return self
        raise AssertionError(f"daemon in {self.home} not ready (exit {self.proc.poll()}):\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def status(self) -> dict[str, Any]:
        return http.get(f"{self.api}/api/v0/status", timeout=5).json()

    def status_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`swarmd status` exactly as a user runs it, finding the daemon through its home."""
        env = {**os.environ, "SWARMD_HOME": str(self.home)}
        return subprocess.run([sys.executable, "-m", "swarmd", "status", *args], capture_output=True, text=True,
                              env=env, timeout=30)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM, and the exit code; kill -9 (and its code) if it has not stopped within `timeout`."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float) -> int:
        """The exit code once it has exited; kill -9 (and its code) if it has not within `timeout`."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return self.proc.returncode

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate(timeout=5)


def stop_all(daemons: list[Daemon], timeout: float = 5.0) -> list[int]:
    """SIGTERM every running daemon at once, then wait for each (kill -9 past `timeout`); their exit codes. One
    at a time, each survivor would re-plan and load what the one that left held, only to be stopped next."""
    running = [d for d in daemons if d.proc is not None and d.proc.poll() is None]
    for d in running:
        d.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    return [d.wait_exit(max(0.1, deadline - time.monotonic())) for d in running]


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.3) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


def view(status: dict[str, Any]) -> tuple[Any, ...]:
    """What all members of a converged swarm agree on: leader, plan epoch, and who is alive.

    The epoch counts only once the plan covers exactly the alive members (else it is None)."""
    alive = frozenset(m["peer_id"] for m in status["members"] if m["state"] == "alive")
    plan = status["plan"] or {"stages": []}
    planned = frozenset(s["peer_id"] for s in plan["stages"])
    return status["leader"], plan.get("epoch") if planned == alive else None, alive
