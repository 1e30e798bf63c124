"""`swarmd join --plan FILE`: the founder adopts a written plan once the peers it names have joined."""

from __future__ import annotations

import pytest

from planner.plan import ModelRef, Plan, Stage
from swarmd.net.identity import load_or_create_identity, peer_id_of
from tests.swarm.daemons import wait_until

pytestmark = pytest.mark.slow


def test_the_founder_waits_for_the_named_peers_then_runs_the_plan_as_written(daemons, tmp_path, tiny_model):
    a, b = daemons("a"), daemons("b")
    ida, idb = (peer_id_of(load_or_create_identity(d.home)) for d in (a, b))  # identities made ahead
    # a model served from a path goes by that path
    written = Plan(epoch=41, model=ModelRef(str(tiny_model)), stages=(Stage(idb, (0, 6)), Stage(ida, (6, 8))))
    path = tmp_path / "plan.json"
    path.write_text(written.dumps())

    a.start(extra=("--plan", str(path))).wait_ready()
    note = wait_until(lambda: a.status()["plan_error"], 30, "the founder to say what it waits for")
    assert f"waiting for 1 of 2 peers named in plan.json to join: {idb[-6:]}" in note
    assert a.status()["plan"] is None

    b.start(bootstrap=(a.addresses[0],)).wait_ready()
    plan = wait_until(lambda: a.status()["plan"], 30, "the plan to be adopted")
    assert [(s["peer_id"], s["layers"]) for s in plan["stages"]] == [(idb, [0, 6]), (ida, [6, 8])]
    assert wait_until(lambda: b.status()["assignment"]["layers"] == [0, 6] and
                      b.status()["assignment"]["state"] == "ready", 30, "b to load blocks 0-5")


def test_a_plan_file_for_another_model_is_one_line_at_start(daemons, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(Plan(epoch=1, model=ModelRef("kimi-k2"), stages=(Stage("x", (0, 61)),)).dumps())
    d = daemons("d").start(extra=("--plan", str(path)))
    assert d.proc.wait(timeout=60) != 0
    assert "error: --plan" in d.log() and "the plan is for model kimi-k2" in d.log() and "Traceback" not in d.log()
