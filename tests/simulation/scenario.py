"""A seed draws a whole simulated run: the swarm, the requests sent to it, and the faults done to it.

Everything is a plain value, so a seed's scenario can be printed, compared and replayed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

PROMPTS = ((1, 2, 3, 4), (40, 41, 42), (7, 100, 7, 100, 9), (250, 3), (12, 13, 14, 15, 16, 17), (99,))
FAULTS = ("crash_stage", "crash_expert_holder", "crash_leader", "crash_head", "crash_any", "reset", "partition",
          "delay", "black_hole", "freeze")


@dataclass(frozen=True)
class Request:
    at: float  # virtual seconds after the swarm is ready
    head: int  # the daemon index it is sent to
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int
    temperature: float


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    pick: int  # which daemon (or pair, or split) it hits, resolved against the swarm at that moment
    lasts: float  # how long until it is undone (a restart, a heal, a mend); 0: never
    amount: float = 0.0  # a delay's seconds


@dataclass(frozen=True)
class Scenario:
    seed: int
    model: str  # "dense" or "moe"
    daemons: int
    behind_nat: tuple[int, ...]  # daemons nobody can dial (reached through relays)
    requests: tuple[Request, ...]
    faults: tuple[Fault, ...] = field(default=())
    stages: int = 0  # each daemon has the memory for about 1/stages of the model (0: for all of it)

    def describe(self) -> str:
        lines = [f"seed {self.seed}: {self.daemons} daemons, {self.model} model in {self.stages or 'any'} stages, "
                 f"behind NAT {list(self.behind_nat)}"]
        lines += [f"  request at {r.at:.2f}s via d{r.head}: prompt {list(r.prompt)} max {r.max_tokens} "
                  f"seed {r.seed} T={r.temperature}" for r in self.requests]
        lines += [f"  fault at {f.at:.2f}s: {f.kind} pick {f.pick} for {f.lasts:.2f}s"
                  + (f" ({f.amount * 1e3:.0f} ms)" if f.amount else "") for f in self.faults]
        return "\n".join(lines)


def draw(seed: int) -> Scenario:
    rng = random.Random(seed)
    model = "moe" if rng.random() < 0.3 else "dense"
    daemons = rng.choice((2, 2, 3, 3, 3, 4, 4, 5, 6, 8))
    behind_nat = tuple(sorted(rng.sample(range(1, daemons), k=min(daemons - 1, rng.choice((1, 2)))))) \
        if daemons > 2 and rng.random() < 0.2 else ()
    requests = tuple(
        Request(at=round(rng.uniform(0.0, 3.0), 2), head=rng.randrange(daemons), prompt=rng.choice(PROMPTS),
                max_tokens=rng.choice((4, 6, 8)), seed=rng.randrange(1000),
                temperature=0.0 if rng.random() < 0.7 else 0.8)
        for _ in range(rng.choice((1, 2, 3, 3, 4, 6))))
    n_faults = rng.choice((0, 1, 1, 2, 2, 3, 4))
    kinds = [k for k in FAULTS if model == "moe" or k != "crash_expert_holder"]
    faults = tuple(sorted((
        Fault(at=round(rng.uniform(0.0, 4.0), 2), kind=rng.choice(kinds), pick=rng.randrange(1 << 16),
              lasts=round(rng.choice((0.0, rng.uniform(1.0, 6.0))), 2), amount=round(rng.uniform(0.005, 0.2), 3))
        for _ in range(n_faults)), key=lambda f: f.at))
    stages = rng.randint(max(1, daemons - 2), daemons) if rng.random() < 0.85 else 0  # mostly split, a spare or two
    return Scenario(seed, model, daemons, behind_nat, requests, faults, stages)
