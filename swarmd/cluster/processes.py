"""The processes a cluster runs, and the state file that finds them again (`$SWARMD_HOME/cluster/state.json`).

Each process starts in a session of its own, so a Ctrl-C in the terminal reaches `swarmd cluster up` alone, which
then stops them in order; with `--keep` they outlive it, and `swarmd cluster down` stops them through the state
file. A process is named in the state with its pid and start time, so a pid the system has since given to another
program is never signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"


@dataclass(frozen=True)
class Started:
    name: str  # "emulator" or a slot
    pid: int
    started: float  # the process's start time (psutil's create_time): tells a reused pid apart
    log: str


def start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


class Processes:
    """Processes started for one cluster, stopped together."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started: list[Started] = []

    def start(self, name: str, cmd: Sequence[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        self.procs[name] = proc
        self.started.append(Started(name, proc.pid, start_time(proc.pid) or 0.0, str(log)))
        return proc

    def exited(self) -> list[tuple[str, int]]:
        """(name, exit code) of every process that has stopped."""
        return [(name, code) for name, p in self.procs.items() if (code := p.poll()) is not None]

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to every process (daemons leave the swarm), then SIGKILL to any still there after `timeout`."""
        stop_processes(self.started, timeout)
        for p in self.procs.values():
            if p.poll() is None:
                p.wait(timeout=5)


def stop_processes(started: Sequence[Started], timeout: float = 30.0) -> list[str]:
    """Stop the processes in `started` that still run (those whose pid now names another program are left alone);
    the names of those that were running."""
    running = [s for s in started if s.started and start_time(s.pid) == s.started]
    for s in running:
        _signal(s.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(s) for s in running):
        time.sleep(0.2)
    for s in running:
        if _alive(s):
            _signal(s.pid, signal.SIGKILL)
    return [s.name for s in running]


def _alive(s: Started) -> bool:
    import psutil

    try:
        p = psutil.Process(s.pid)
        return p.create_time() == s.started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return


def write_state(directory: Path, doc: dict[str, Any], started: Sequence[Started]) -> None:
    path = directory / STATE_FILE
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**doc, "processes": [asdict(s) for s in started]}, indent=1) + "\n")
    os.replace(tmp, path)


def read_state(directory: Path) -> tuple[dict[str, Any], list[Started]] | None:
    try:
        doc = json.loads((directory / STATE_FILE).read_text())
        return doc, [Started(**p) for p in doc.pop("processes")]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def running(started: Sequence[Started]) -> list[Started]:
    return [s for s in started if _alive(s)]


def clear_state(directory: Path) -> None:
    (directory / STATE_FILE).unlink(missing_ok=True)
