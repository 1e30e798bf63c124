#!/usr/bin/env python3
"""Start a swarm of N daemons on this machine (loopback, temporary homes), use it, and stop it cleanly.

    .venv/bin/python scripts/local_swarm.py                      # 4 daemons, one chat prompt, status, stop
    .venv/bin/python scripts/local_swarm.py --daemons 2 --prompt "The capital of France is" --max-tokens 32
    .venv/bin/python scripts/local_swarm.py --keep               # stay up for other clients until Ctrl-C

What it does, with progress on stderr: starts `swarmd join` N times (the first founds the swarm, each other
one joins through it), waits until the leader's plan gives every daemon a stage and every stage is loaded,
sends the prompt with `swarmd submit-prompt` (the answer streams to stdout), shows `swarmd status`, then
sends SIGTERM to each daemon it started and waits for it to leave. `LocalSwarm` is also used by
`scripts/bench_pipeline.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from swarmd.daemon.descriptor import BENCH_FILE

DEFAULT_CHAT = "Give me three reasons to learn Python."
http = httpx.Client()  # one for every poll: each new client loads the CA bundle (tens of ms of CPU)


def say(line: str) -> None:
    print(f"[local-swarm] {line}", file=sys.stderr, flush=True)


class Daemon:
    def __init__(self, index: int, home: Path, proc: subprocess.Popen[str]) -> None:
        self.index, self.home, self.proc = index, home, proc
        self.peer_id, self.address, self.api = "", "", ""
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_started(self, timeout: float) -> None:
        """Read the daemon's stdout up to 'Daemon is ready'."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            if line.startswith("Peer ID: "):
                self.peer_id = line.removeprefix("Peer ID: ")
            elif line.startswith("Swarm listening on ") and not self.address:
                self.address = line.removeprefix("Swarm listening on ")
            elif line.startswith("API server listening on "):
                self.api = line.removeprefix("API server listening on ")
            elif line == "Daemon is ready":
                return
        raise RuntimeError(f"daemon {self.index} did not start (exit code {self.proc.poll()}); its log:\n"
                           + self.log_tail())

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return (self.home / "daemon.log").read_text()[-chars:]
        except OSError:
            return "(no log)"

    def status(self) -> dict[str, Any]:
        return http.get(f"{self.api}/api/v0/status", timeout=5).json()

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=5)


class LocalSwarm:
    """N `swarmd join` processes on loopback with homes under one directory."""

    def __init__(self, n: int, *, model: str = "smollm2-135m", base: Path | None = None,
                 extra: tuple[str, ...] = (), timings: str = "lan", swarm: str = "local",
                 first_extra: tuple[str, ...] = (), listen_of: Any = None, extra_of: Any = None,
                 bootstrap: str | None = None,
                 env_of: Callable[[int], dict[str, str]] | None = None) -> None:
        self.n, self.model, self.extra, self.timings, self.swarm = n, model, extra, timings, swarm
        self.env_of = env_of  # extra environment of daemon i (e.g. CUDA_VISIBLE_DEVICES)
        self.first_extra = first_extra  # options for the founding daemon only (e.g. --plan FILE)
        # Per daemon i (e.g. behind a link emulator): its listen address, its own options, and the address the
        # others bootstrap from (default: the first daemon's own).
        self.listen_of = listen_of or (lambda i: "/ip4/127.0.0.1/tcp/0")
        self.extra_of = extra_of or (lambda i: ())
        self.bootstrap = bootstrap
        self._own_base = base is None
        self.base = Path(tempfile.mkdtemp(prefix="swarmd-local-")) if base is None else base
        self.daemons: list[Daemon] = []

    def start(self, timeout: float = 120.0) -> LocalSwarm:
        while len(self.daemons) < self.n:
            self.add(timeout)
        return self

    def add(self, timeout: float = 120.0) -> Daemon:
        i = len(self.daemons)
        home = self.base / f"daemon-{i}"
        home.mkdir(parents=True, exist_ok=True)
        if self.daemons:  # they share this machine: the first daemon's device benchmark describes every one
            bench = self.daemons[0].home / BENCH_FILE
            if bench.exists() and not (home / BENCH_FILE).exists():
                shutil.copy(bench, home / BENCH_FILE)
        cmd = [sys.executable, "-m", "swarmd", "join", "--home", str(home), "--listen", self.listen_of(i),
               "--api", "127.0.0.1:0", "--swarm", self.swarm, "--model", self.model, "--timings", self.timings,
               *self.extra, *self.extra_of(i)]
        if self.daemons:
            cmd += ["--bootstrap", self.bootstrap or self.daemons[0].address]
        else:
            cmd += list(self.first_extra)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env_of(i) if self.env_of else {})}
        env.pop("SWARMD_BOOTSTRAP", None)
        with open(home / "daemon.log", "a") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        daemon = Daemon(i, home, proc)
        self.daemons.append(daemon)
        daemon.wait_started(timeout)
        say(f"daemon {i + 1}/{self.n} up: peer {daemon.peer_id[-6:]}, pid {proc.pid}, api {daemon.api}")
        return daemon

    @property
    def api(self) -> str:
        return self.daemons[0].api

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        """Until the plan gives every daemon a stage and every stage is loaded; the plan."""
        deadline = time.monotonic() + timeout
        said = ""
        while time.monotonic() < deadline:
            for d in self.daemons:
                if d.proc.poll() is not None:
                    raise RuntimeError(f"daemon {d.index} exited with {d.proc.returncode}; its log:\n" + d.log_tail())
            try:
                pipeline = http.get(f"{self.api}/api/v0/pipeline", timeout=5).json()
                plan = self.daemons[0].status()["plan"]
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                detail = f"asking daemon 1: {type(e).__name__}"
            else:
                stages = len(plan["stages"]) if plan else 0
                detail = pipeline["chain"]["detail"]
                if stages == self.n and pipeline["chain"]["ready"]:
                    say(f"swarm ready: {detail}")
                    return plan
                if plan and stages != self.n:
                    detail = f"plan epoch {plan['epoch']} has {stages} of {self.n} daemons; waiting for the others"
            if detail != said:
                say(f"waiting: {detail}")
                said = detail
            time.sleep(0.5)
        raise RuntimeError(f"the swarm was not ready within {timeout:.0f} s: {said}")

    def stop(self) -> None:
        for d in reversed(self.daemons):
            code = d.stop()
            say(f"daemon {d.index + 1} (pid {d.proc.pid}) stopped with exit code {code}")
        self.daemons = []
        if self._own_base:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def swarmd(*args: str, stdout: Any = None) -> int:
    """Run a swarmd command as a user would, its output going straight to ours."""
    return subprocess.run([sys.executable, "-m", "swarmd", *args], check=False, stdout=stdout).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", "-N", type=int, default=4, help="how many daemons (default: 4)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--chat", default=None, help=f"the chat message to send (default: {DEFAULT_CHAT!r})")
    what.add_argument("--prompt", help="a plain prompt to continue instead of a chat message")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens to generate (default: 96)")
    parser.add_argument("--model", default="smollm2-135m", help="model every daemon serves (default: smollm2-135m)")
    parser.add_argument("--keep", action="store_true", help="keep the swarm up after the prompt until Ctrl-C")
    parser.add_argument("--max-context", type=int, default=1024, help="context per request (default: 1024)")
    args = parser.parse_args()
    if args.daemons < 1:
        parser.error("--daemons must be at least 1")

    say(f"fetching {args.model} into the model cache if needed")
    if swarmd("pull", args.model, stdout=sys.stderr) != 0:
        return 1
    swarm = LocalSwarm(args.daemons, model=args.model, extra=("--max-context", str(args.max_context)))
    try:
        say(f"starting {args.daemons} daemons on 127.0.0.1 (homes under {swarm.base})")
        swarm.start()
        swarm.wait_ready()
        say(f"submitting {'the prompt' if args.prompt else 'a chat message'} through daemon 1 "
            f"(the first token compiles kernels on a fresh machine: give it a minute)")
        cmd = ["submit-prompt", "--api", swarm.api, "--max-tokens", str(args.max_tokens)]
        cmd += [args.prompt] if args.prompt else ["--chat", args.chat or DEFAULT_CHAT]
        code = swarmd(*cmd)
        print(flush=True)
        say("swarmd status:")
        swarmd("status", "--api", swarm.api)
        if args.keep:
            say(f"the swarm stays up; its web page at {swarm.api}/, OpenAI-compatible API at {swarm.api}/v1 "
                "(Ctrl-C stops it)")
            try:
                while all(d.proc.poll() is None for d in swarm.daemons):
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        return code
    except (RuntimeError, KeyboardInterrupt) as e:
        say(f"stopping: {e}" if str(e) else "stopping")
        return 1
    finally:
        say("stopping the swarm (SIGTERM to each daemon)")
        swarm.stop()


if __name__ == "__main__":
    sys.exit(main())
