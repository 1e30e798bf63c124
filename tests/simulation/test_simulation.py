"""Deterministic fault simulation: whole daemons in one process on a virtual clock, a seed per run.

Each seed draws a swarm (2-8 daemons, a dense or a mixture-of-experts model, some behind NAT), the requests
sent to it, and the faults done to it meanwhile (crashes and restarts of stages, expert holders, the leader
and heads; link resets, partitions, delays, black holes, hung daemons). `runner.py` lists what every run
checks. `pytest tests/simulation --seed N` replays one seed; `--seeds 10000` runs a longer sweep.
"""

from __future__ import annotations

import pytest

from tests.simulation.regressions import REGRESSIONS
from tests.simulation.runner import simulate
from tests.simulation.scenario import Fault, Request, Scenario, draw


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "seed" in metafunc.fixturenames:
        chosen = metafunc.config.getoption("--seed")
        first = metafunc.config.getoption("--first-seed")
        seeds = chosen if chosen else range(first, first + metafunc.config.getoption("--seeds"))
        metafunc.parametrize("seed", seeds)


def keeps_every_promise(scenario: Scenario, models, pool, references, root) -> None:
    result = simulate(scenario, root, models[scenario.model], pool, references)
    assert not result.violations, "\n".join([scenario.describe(), *result.violations, "events:", *result.events])


def test_a_seeded_run_keeps_every_promise(seed, sim_models, sim_pool, sim_references, sim_root):
    keeps_every_promise(draw(seed), sim_models, sim_pool, sim_references, sim_root)


@pytest.mark.parametrize("found", sorted(REGRESSIONS))
def test_a_scenario_that_once_failed_keeps_every_promise(found, sim_models, sim_pool, sim_references, sim_root):
    keeps_every_promise(REGRESSIONS[found], sim_models, sim_pool, sim_references, sim_root / "regressions")


# Twelve daemons: more than `BASE_RATE_MEMBERS`, so heartbeats and probes are spread out (the seeds draw 2-8).
TWELVE = Scenario(
    seed=12, model="dense", daemons=12, behind_nat=(3,), stages=4,
    requests=(Request(at=0.5, head=1, prompt=(1, 2, 3, 4), max_tokens=6, seed=12, temperature=0.0),
              Request(at=1.2, head=5, prompt=(40, 41, 42), max_tokens=8, seed=7, temperature=0.8),
              Request(at=3.1, head=9, prompt=(250, 3), max_tokens=6, seed=3, temperature=0.0)),
    faults=(Fault(at=0.8, kind="freeze", pick=4101, lasts=6.0),
            Fault(at=1.5, kind="crash_stage", pick=877, lasts=3.0),
            Fault(at=2.4, kind="partition", pick=3093, lasts=2.5),
            Fault(at=3.0, kind="reset", pick=5150, lasts=0.0)))


def test_a_swarm_of_twelve_whose_heartbeats_and_probes_are_spread_keeps_every_promise(sim_models, sim_pool,
                                                                                       sim_references, sim_root):
    keeps_every_promise(TWELVE, sim_models, sim_pool, sim_references, sim_root / "twelve")


def test_a_seed_replays_exactly(sim_models, sim_pool, sim_references, sim_root):
    scenario = draw(11)
    first = simulate(scenario, sim_root / "first", sim_models[scenario.model], sim_pool, sim_references)
    again = simulate(scenario, sim_root / "again", sim_models[scenario.model], sim_pool, sim_references)
    assert first.outcomes == again.outcomes
    assert first.events == again.events
