"""A swarm of real `swarmd join` processes serving SmolLM2, for the pipeline's acceptance tests.

It starts N daemons on loopback with a plan file giving each an even share of the blocks (so the swarm forms
once, without a re-plan per joiner), and shrinks by stopping daemons: the leader then re-plans over the rest,
which is how one set of processes is tested as a chain of 6, 4, 3 and 2 stages. Every daemon serves the
default model (smollm2-135m, from the model cache) unless the swarm is given another name.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from planner.plan import ModelRef, Plan, Stage, stage_actor
from tests.swarm.daemons import Daemon, http, stop_all, wait_until

N_BLOCKS = 30  # SmolLM2-135M


def even_plan(peers: list[str], model: str = "smollm2-135m", n_blocks: int = N_BLOCKS) -> Plan:
    n = len(peers)
    bounds = [round(i * n_blocks / n) for i in range(n + 1)]
    stages = tuple(Stage(p, (bounds[i], bounds[i + 1]), (stage_actor(i),)) for i, p in enumerate(peers))
    return Plan(epoch=1, model=ModelRef(model), stages=stages)


class DaemonSwarm:
    def __init__(self, base: Path, bench_file: Path, n: int, *, extra: tuple[str, ...] = (),
                 model: str | None = None, n_blocks: int = N_BLOCKS) -> None:
        from swarmd.net.identity import load_or_create_identity, peer_id_of

        self.base = base
        self.daemons: list[Daemon] = []
        for i in range(n):
            home = base / f"d{i}"
            home.mkdir(parents=True, exist_ok=True)
            load_or_create_identity(home)  # the peer id is known before the daemon starts: the plan names it
            named = ("--model", model) if model else ()
            self.daemons.append(Daemon(home, None, bench_file=bench_file, swarm="pipeline", extra=(*named, *extra)))
        self.peers = [peer_id_of(load_or_create_identity(d.home)) for d in self.daemons]
        self.plan_file = base / "plan.json"
        self.plan_file.write_text(even_plan(self.peers, model or "smollm2-135m", n_blocks).dumps())

    def start(self, timeout: float = 300.0) -> DaemonSwarm:
        first = self.daemons[0].start(extra=("--plan", str(self.plan_file))).wait_ready(60)
        for d in self.daemons[1:]:
            d.start(bootstrap=(first.addresses[0],))
        for d in self.daemons[1:]:
            d.wait_ready(60)
        plan = Plan.loads(self.plan_file.read_text())
        self.wait_chain(len(plan.stages), timeout, stages={s.peer_id for s in plan.stages})
        return self

    @property
    def running(self) -> list[Daemon]:
        return [d for d in self.daemons if d.proc is not None and d.proc.poll() is None]

    def pipeline(self, i: int = 0) -> dict[str, Any]:
        return http.get(f"{self.running[i].api}/api/v0/pipeline", timeout=10).json()

    def wait_chain(self, n: int, timeout: float = 300.0, *, stages: set[str] | None = None) -> dict[str, Any]:
        """Until every daemon agrees on a plan of `n` stages, all loaded: one per running daemon, or on the peers
        `stages` (a plan whose other daemons hold experts only)."""
        alive = stages if stages is not None else {d.peer_id for d in self.running}

        def ready() -> dict[str, Any] | None:
            for d in self.running:
                if not d.status()["plan"] or {s["peer_id"] for s in d.status()["plan"]["stages"]} != alive:
                    return None
            chain = self.pipeline()["chain"]
            plan = self.running[0].status()["plan"]
            return plan if chain["ready"] and len(plan["stages"]) == n else None

        return wait_until(ready, timeout, f"a ready chain of {n} stages")

    def shrink_to(self, n: int, timeout: float = 300.0) -> dict[str, Any]:
        """Stop the newest daemons (SIGTERM: they leave the swarm, all at once) until `n` run; the leader
        re-plans."""
        leaving = self.running[n:]
        codes = stop_all(leaving, timeout=15.0)
        assert codes == [0] * len(leaving), "\n".join(d.log() for d in leaving)
        return self.wait_chain(n, timeout)

    def stop(self) -> None:
        stop_all(self.daemons)

    def generate(self, via: int = 0, **body: Any) -> tuple[list[int], dict[str, Any]]:
        """POST /api/v0/generate on daemon `via`: the token ids and the final event."""
        tokens: list[int] = []
        with http.stream("POST", f"{self.running[via].api}/api/v0/generate", json=body,
                          timeout=httpx.Timeout(30.0, read=600.0)) as r:
            if r.status_code != 200:
                r.read()
                return tokens, {"event": "http_error", "status": r.status_code, **r.json()}
            for line in r.iter_lines():
                event = json.loads(line)
                if event["event"] == "token":
                    tokens.append(event["id"])
                elif event["event"] in ("done", "error"):
                    return tokens, event
        return tokens, {"event": "cut"}

    def logs(self) -> str:
        return "\n".join(f"--- {d.home.name}\n{d.log()[-4000:]}" for d in self.daemons)


def timed(fn, *args, **kw) -> tuple[Any, float]:
    start = time.monotonic()
    return fn(*args, **kw), time.monotonic() - start
