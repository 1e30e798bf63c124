"""Runs a scenario on whole daemons in one process, on a virtual clock, and checks what must hold.

After every run:
- each request ended with exactly the tokens of the undisturbed run, or with an error (and what it got before
  the error is a prefix of those tokens: no wrong token ever reached the client);
- no daemon ended by itself (an exception escaping a daemon is a crash of ours);
- once idle, nothing is left behind on the daemons still up: no request at a head, in a stage's book or KV
  slots, in a MoE router, and no request counted in flight;
- every term had one leader, whoever reported it.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import trio.testing

from swarmd.testing.memory_network import MemoryHub
from swarmd.testing.twin import SIM_TIMINGS, ModelPool, Outcome, SwarmTwin, TwinDaemon
from tests.simulation.scenario import Fault, Request, Scenario

SETTLE = 30.0  # virtual seconds the swarm gets to form and load before the first request
# virtual seconds after the last request and the last fault before looking for leftovers: a frame sent late is
# given up or delivered, a cancel sent after it too, and a request no one speaks of has expired
IDLE = SIM_TIMINGS.send_timeout + SIM_TIMINGS.request_idle_timeout + 3.0
log = logging.getLogger(__name__)


@dataclass
class RunResult:
    outcomes: list[Outcome]
    violations: list[str]
    events: list[str] = field(default_factory=list)  # what happened, in order: a replay must match it


References = dict[tuple[Any, ...], tuple[int, ...]]


def reference_key(model: str, r: Request) -> tuple[Any, ...]:
    return (model, r.prompt, r.max_tokens, r.seed, r.temperature)


def compute_references(model_path: str, model: str, requests: list[Request], root: Path, pool: ModelPool,
                       into: References) -> None:
    """The undisturbed tokens of each request: one daemon holding the whole model, one request at a time."""
    missing = [r for r in requests if reference_key(model, r) not in into]
    if not missing:
        return

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            hub = await nursery.start(MemoryHub().run)
            twin = SwarmTwin(hub, root, model_path, pool=pool, expert_placement="local")
            alone = await twin.start(nursery, 0)
            for r in missing:
                out = await twin.generate(alone, list(r.prompt), max_tokens=r.max_tokens, seed=r.seed,
                                          temperature=r.temperature)
                assert not out.error, f"the reference run failed: {out.error}"
                into[reference_key(model, r)] = out.tokens
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


class Run:
    """One scenario on one swarm twin."""

    def __init__(self, sc: Scenario, twin: SwarmTwin, nursery: trio.Nursery) -> None:
        self.sc, self.twin, self.nursery = sc, twin, nursery
        self.rng = random.Random(sc.seed ^ 0x5EED)
        self.events: list[str] = []
        self.violations: list[str] = []
        self.leaders: dict[int, set[str]] = {}
        self.undo: list[tuple[float, str, Any]] = []  # (when, what, how) for faults still in force

    def note(self, what: str) -> None:
        self.events.append(f"{trio.current_time():9.3f} {what}")

    # --- the swarm -----------------------------------------------------------------------------------------
    async def start_swarm(self) -> bool:
        from libp2p.crypto.ed25519 import create_new_key_pair

        from swarmd.net.identity import peer_id_of

        for i in self.sc.behind_nat:
            self.twin.hub.behind_nat(peer_id_of(create_new_key_pair(bytes([i + 1]) * 32)))
        founder = await self.twin.start(self.nursery, 0)
        for i in range(1, self.sc.daemons):
            await self.twin.start(self.nursery, i, via=founder)
        with trio.move_on_after(SETTLE):
            while not self._ready(founder):  # noqa: ASYNC110 - readiness is a status snapshot
                await trio.sleep(0.25)
        ready = self._ready(founder)
        self.note(f"swarm {'ready' if ready else 'NOT READY'}: {self._plan_summary(founder)}")
        return ready

    @staticmethod
    def _ready(d: TwinDaemon) -> bool:
        return d.alive and d.pipeline is not None and d.pipeline.chain().ready

    @staticmethod
    def _plan_summary(d: TwinDaemon) -> str:
        plan = d.node.plan if d.node is not None else None
        if plan is None:
            return "no plan"
        return f"epoch {plan.epoch} " + " ".join(f"{s.peer_id[-4:]}{list(s.layers)}" for s in plan.stages)

    def by_peer(self) -> dict[str, TwinDaemon]:
        return {d.peer_id: d for d in self.twin.alive()}

    def current_plan(self) -> Any:
        plans = [d.node.plan for d in self.twin.alive() if d.node is not None and d.node.plan is not None]
        return max(plans, key=lambda p: p.epoch, default=None)

    # --- requests ------------------------------------------------------------------------------------------
    async def request(self, i: int, r: Request, t0: float, out: list[Outcome | None]) -> None:
        await trio.sleep_until(t0 + r.at)
        head = self.twin.daemons.get(r.head)
        if head is None or not head.alive or head.pipeline is None:
            out[i] = Outcome((), "head_down: its daemon is not running")
        else:
            out[i] = await self.twin.generate(head, list(r.prompt), max_tokens=r.max_tokens, seed=r.seed,
                                              temperature=r.temperature)
        self.note(f"request {i} ended: {len(out[i].tokens)} tokens {out[i].error[:60]}")

    # --- faults --------------------------------------------------------------------------------------------
    async def fault(self, f: Fault, t0: float) -> None:
        await trio.sleep_until(t0 + f.at)
        alive = sorted(self.twin.alive(), key=lambda d: d.index)
        if not alive:
            return
        hub = self.twin.hub
        pick = random.Random(f.pick)
        if f.kind.startswith("crash"):
            victim = self._victim(f.kind, alive, pick)
            if victim is None:
                return
            self.note(f"crash d{victim.index} ({f.kind})")
            self.twin.crash(victim)
            if f.lasts:
                await trio.sleep(f.lasts)
                await self.twin.restart(self.nursery, victim)
                self.note(f"restart d{victim.index}")
            return
        if f.kind == "freeze":
            victim = pick.choice(alive)
            self.note(f"freeze d{victim.index}")
            hub.freeze(victim.peer_id)
            await self._lasting(f, f"thaw d{victim.index}", lambda: hub.thaw(victim.peer_id))
            return
        if len(alive) < 2:
            return
        a, b = pick.sample(alive, 2)
        if f.kind == "reset":
            self.note(f"reset d{a.index}-d{b.index}")
            hub.reset(a.peer_id, b.peer_id)
        elif f.kind == "delay":
            self.note(f"delay d{a.index}-d{b.index} {f.amount * 1e3:.0f} ms")
            hub.set_delay(a.peer_id, b.peer_id, f.amount)
            await self._lasting(f, f"undelay d{a.index}-d{b.index}", lambda: hub.set_delay(a.peer_id, b.peer_id, 0.0))
        elif f.kind == "black_hole":
            self.note(f"black hole d{a.index}-d{b.index}")
            hub.black_hole(a.peer_id, b.peer_id)
            await self._lasting(f, f"mend d{a.index}-d{b.index}", lambda: hub.mend(a.peer_id, b.peer_id))
        elif f.kind == "partition":
            cut = pick.randrange(1, len(alive))
            shuffled = pick.sample(alive, len(alive))
            side_a, side_b = shuffled[:cut], shuffled[cut:]
            self.note(f"partition {[d.index for d in side_a]} | {[d.index for d in side_b]}")
            hub.partition([d.peer_id for d in side_a], [d.peer_id for d in side_b])
            await self._lasting(f, "heal", hub.heal)

    def _victim(self, kind: str, alive: list[TwinDaemon], pick: random.Random) -> TwinDaemon | None:
        peers = self.by_peer()
        plan = self.current_plan()
        if kind == "crash_stage" and plan is not None:
            candidates = [peers[s.peer_id] for s in plan.stages if s.peer_id in peers]
        elif kind == "crash_expert_holder" and plan is not None:
            holders = {p for by_e in plan.experts.values() for ps in by_e.values() for p in ps}
            candidates = [d for p, d in peers.items() if p in holders]
        elif kind == "crash_leader":
            leaders = {d.node.swarm.leader for d in alive if d.node is not None and d.node.swarm is not None}
            candidates = [peers[p] for p in leaders if p in peers]
        elif kind == "crash_head":
            candidates = [d for d in alive if d.pipeline is not None and d.pipeline.head.requests]
        else:
            candidates = list(alive)
        candidates = sorted(candidates or alive, key=lambda d: d.index)
        return pick.choice(candidates) if candidates else None

    async def _lasting(self, f: Fault, what: str, undo: Any) -> None:
        if f.lasts:
            await trio.sleep(f.lasts)
            undo()
            self.note(what)
        else:
            self.undo.append((trio.current_time(), what, undo))

    def undo_all(self) -> None:
        for _, what, undo in self.undo:
            undo()
            self.note(f"{what} (end of run)")
        self.undo.clear()
        self.twin.hub.heal()

    # --- what must hold --------------------------------------------------------------------------------------
    async def watch_leaders(self) -> None:
        while True:
            for d in self.twin.alive():
                swarm = d.node.swarm if d.node is not None else None
                if swarm is not None and swarm.leader is not None and swarm.admitted:
                    self.leaders.setdefault(swarm.term, set()).add(swarm.leader)
            await trio.sleep(0.25)

    def check_outcomes(self, outcomes: list[Outcome], expected: list[tuple[int, ...]]) -> None:
        for i, (out, want) in enumerate(zip(outcomes, expected, strict=True)):
            if not out.error and out.tokens != want:
                self.violations.append(f"request {i} finished with {list(out.tokens)}, not the undisturbed "
                                       f"{list(want)}")
            if out.error and out.tokens != want[:len(out.tokens)]:
                self.violations.append(f"request {i} got {list(out.tokens)} before its error, not a prefix of "
                                       f"{list(want)}")
            if out.error and not out.error.strip():
                self.violations.append(f"request {i} failed without saying why")

    def check_daemons(self) -> None:
        for d in self.twin.daemons.values():
            for e in d.errors:
                self.violations.append(f"d{d.index} crashed: {type(e).__name__}: {e}")
        for term, leaders in sorted(self.leaders.items()):
            if len(leaders) > 1:
                self.violations.append(f"term {term} had {len(leaders)} leaders: {sorted(p[-6:] for p in leaders)}")

    async def settle_then_check_idle(self) -> None:
        """Leftovers are a fault only if they outlast the retry and idle windows: look every second, stop as
        soon as none is left, report what is left at the end."""
        deadline = trio.current_time() + IDLE
        while self.leftovers() and trio.current_time() < deadline:  # noqa: ASYNC110 - state of many daemons
            await trio.sleep(1.0)
        self.violations += self.leftovers()

    def leftovers(self) -> list[str]:
        found = []
        for d in sorted(self.twin.alive(), key=lambda d: d.index):
            p, node = d.pipeline, d.node
            if p is None or node is None:
                continue
            left = []
            if p.head.requests:
                left.append(f"head holds {sorted(p.head.requests)}")
            if p.stage.book is not None and p.stage.book.requests:
                now = trio.current_time()
                states = {rid: f"step {st.step}{' busy' if st.busy else ''}{' cancelled' if st.cancelled else ''} "
                               f"idle {now - st.last_active:.1f}/{p.stage.idle_timeout:.0f} s"
                          for rid, st in sorted(p.stage.book.requests.items())}
                left.append(f"stage book holds {states} ({p.stage.queue_state()})")
            stage = node.assignment.stage if node.assignment is not None else None
            if stage is not None and stage.slots.request_ids():
                left.append(f"KV slots held by {sorted(stage.slots.request_ids())}")
            if p.router._pending or p.router._hot:
                left.append(f"MoE router waits for {len(p.router._pending)} batches and {len(p.router._hot)} "
                            "batches of hot steps")
            if node.requests_in_flight:
                left.append(f"{node.requests_in_flight} requests counted in flight")
            if left:
                found.append(f"d{d.index} is idle but " + "; ".join(left))
        return found


async def run(sc: Scenario, root: Path, model_path: str, pool: ModelPool, references: References) -> RunResult:
    """`sc` on a fresh swarm twin (call inside `trio.run` with a MockClock)."""
    trio._core._run._r.seed(sc.seed)  # trio's own scheduling choices, so that a seed replays exactly
    random.seed(sc.seed)
    outcomes: list[Outcome | None] = [None] * len(sc.requests)
    async with trio.open_nursery() as nursery:
        hub = await nursery.start(MemoryHub(rng=random.Random(sc.seed)).run)
        placement = "spread" if sc.model == "moe" else "auto"
        twin = SwarmTwin(hub, root, model_path, pool=pool, expert_placement=placement)
        if sc.stages:
            twin.settings["memory_limit"] = twin.memory_for_stages(sc.stages)
        r = Run(sc, twin, nursery)
        nursery.start_soon(r.watch_leaders)
        if await r.start_swarm():
            t0 = trio.current_time()
            async with trio.open_nursery() as inner:
                for i, req in enumerate(sc.requests):
                    inner.start_soon(r.request, i, req, t0, outcomes)
                for f in sc.faults:
                    inner.start_soon(r.fault, f, t0)
            r.undo_all()
            r.check_outcomes([o for o in outcomes if o is not None],
                             [references[reference_key(sc.model, q)] for q in sc.requests])
            await r.settle_then_check_idle()
        else:
            r.violations.append("the swarm did not become ready before any fault: " + "; ".join(r.events))
        r.check_daemons()
        nursery.cancel_scope.cancel()
    return RunResult([o for o in outcomes if o is not None], r.violations, r.events)


def simulate(sc: Scenario, root: Path, model_path: str, pool: ModelPool, references: References) -> RunResult:
    compute_references(model_path, sc.model, list(sc.requests), root / "reference", pool, references)
    return trio.run(run, sc, root / f"seed-{sc.seed}", model_path, pool, references,
                    clock=trio.testing.MockClock(autojump_threshold=0))
