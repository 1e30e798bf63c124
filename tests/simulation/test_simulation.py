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
from tests.simulation.scenario import Scenario, draw


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


def test_a_seed_replays_exactly(sim_models, sim_pool, sim_references, sim_root):
    scenario = draw(11)
    first = simulate(scenario, sim_root / "first", sim_models[scenario.model], sim_pool, sim_references)
    again = simulate(scenario, sim_root / "again", sim_models[scenario.model], sim_pool, sim_references)
    assert first.outcomes == again.outcomes
    assert first.events == again.events
