"""`swarmd join --plan FILE`: the founder adopts a written plan once the peers it names have joined."""

from __future__ import annotations

import pytest

from planner.plan import ModelRef, Plan, Stage
from planner.plan_file import PlanFile
from swarmd.net.identity import load_or_create_identity, peer_id_of
from tests.swarm.daemons import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serial]


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


def plan_file(path, model) -> PlanFile:
    from swarmd.cli.main import main

    assert main(["plan", "--model", str(model), "--fleet", "2x3060", "--out", str(path)]) == 0
    return PlanFile.loads(path.read_text())


def test_each_slot_is_claimed_once_and_the_leader_names_the_ones_nobody_claimed(daemons, tmp_path, tiny_model):
    pf = plan_file(tmp_path / "p.json", tiny_model)
    first, second = pf.fleet.names
    plan = ("--plan", str(tmp_path / "p.json"))
    a = daemons("a").start(extra=(*plan, "--slot", first, "--claim-timeout", "2")).wait_ready()
    note = wait_until(lambda: "not claimed within" in (a.status()["plan_error"] or "") and a.status()["plan_error"],
                      30, "the leader to name the unclaimed slot")
    assert note.startswith(f"slot(s) {second} of p.json not claimed within 2 s")

    b = daemons("b").start(bootstrap=(a.addresses[0],), extra=(*plan, "--slot", first))  # a second claim of it
    assert b.proc.wait(timeout=60) == 2
    assert f"swarmd join: error: slot {first} of p.json is held by {a.peer_id}" in b.log()
    assert f"(unclaimed: {second})" in b.log() and "Traceback" not in b.log()

    c = daemons("c").start(bootstrap=(a.addresses[0],), extra=(*plan, "--slot", second)).wait_ready()
    adopted = wait_until(lambda: a.status()["plan"], 60, "the plan with both slots bound")
    peers = {first: a.peer_id, second: c.peer_id}
    assert [s["peer_id"] for s in adopted["stages"]] == [peers[s.peer_id] for s in pf.plan.stages]
    assert wait_until(lambda: c.status()["plan"] == adopted, 30, "c to run the bound plan")
    shown = a.status_cli()
    assert shown.returncode == 0 and "p.json, this daemon:" in shown.stdout and "2/2 claimed" in shown.stdout


def test_an_unknown_slot_or_a_plan_file_for_another_model_is_one_line_at_start(daemons, tmp_path, tiny_model):
    plan_file(tmp_path / "p.json", tiny_model)
    d = daemons("d").start(extra=("--plan", str(tmp_path / "p.json"), "--slot", "gpu-7"))
    assert d.proc.wait(timeout=60) == 2
    assert "swarmd join: error: --slot gpu-7: p.json has no such slot; its slots are r0-3060-0, r0-3060-1" in d.log()
    plan_file(tmp_path / "other.json", "synthetic-moe-small")
    e = daemons("e").start(extra=("--plan", str(tmp_path / "other.json"), "--slot", "r0-3060-0"))
    assert e.proc.wait(timeout=60) == 2
    assert f"error: --plan {tmp_path / 'other.json'}: the plan is for model synthetic-moe-small" in e.log()
    assert "Traceback" not in d.log() + e.log()
