"""Plan files: a plan naming a fleet's slots, with the fleet, as `swarmd plan --out` writes it."""

from __future__ import annotations

import json

import pytest

from planner import PlanSchemaError
from planner.plan import ModelRef, Plan, Stage
from planner.plan_file import PlanFile, Slot, fleet_of
from swarmd.cli.main import main

FLEET = fleet_of(["a", "b", "c"], ["RTX 4090", "RTX 3090", "RTX 3060 12GB"], [24 << 30, 24 << 30, 12 << 30],
                 [0, 1, 0], [[1.0, 60.0], [60.0, 1.0]], 100.0)
PLAN = Plan(epoch=0, model=ModelRef("m"), stages=(Stage("a", (0, 2)), Stage("b", (2, 4))),
            experts={1: {0: ("a", "c"), 1: ("c",)}, 3: {0: ("b",), 1: ("c",)}})


def test_a_plan_file_round_trips_and_knows_where_each_slot_is():
    pf = PlanFile(PLAN, FLEET)
    again = PlanFile.loads(pf.dumps())
    assert again == pf
    assert again.fleet.slot("c") == Slot("c", "RTX 3060 12GB", 12 << 30, 0)
    assert again.fleet.rtt_between("a", "c") == 1.0 and again.fleet.rtt_between("a", "b") == 60.0
    assert Plan.loads(pf.dumps()) == PLAN  # to anything reading Plans, it is the plan naming slots


def test_binding_puts_each_daemons_peer_id_where_its_slot_was():
    bound = PlanFile(PLAN, FLEET).bind({"a": "PA", "b": "PB", "c": "PC"})
    assert [s.peer_id for s in bound.stages] == ["PA", "PB"] and bound.head == "PB"
    assert bound.experts == {1: {0: ("PA", "PC"), 1: ("PC",)}, 3: {0: ("PB",), 1: ("PC",)}}
    with pytest.raises(PlanSchemaError, match="slots without a peer: c"):
        PlanFile(PLAN, FLEET).bind({"a": "PA", "b": "PB"})


def test_a_plan_naming_a_slot_the_fleet_lacks_or_a_file_without_fleet_is_refused():
    doc = PlanFile(PLAN, FLEET).to_json()
    doc["stages"][0]["peer_id"] = "z"
    with pytest.raises(PlanSchemaError, match="names z, which the fleet has no slot for"):
        PlanFile.from_json(doc)
    with pytest.raises(PlanSchemaError, match="needs a 'fleet'"):
        PlanFile.loads(PLAN.dumps())
    bad = PlanFile(PLAN, FLEET).to_json()
    bad["fleet"]["slots"]["a"]["region"] = 5
    with pytest.raises(PlanSchemaError, match="region from 0 to 1"):
        PlanFile.from_json(bad)


def test_swarmd_plan_out_writes_a_plan_file_for_a_model_swarmd_run_accepts(tmp_path, capsys):
    from swarmd.daemon.served_model import served_model

    out = tmp_path / "moe.json"
    args = ["plan", "--model", "synthetic-moe-small", "--fleet", "2x4090,2x3090,2x3060", "--regions", "2",
            "--rtt-ms", "1,60", "--uplink-mbit", "100", "--out", str(out)]
    assert main(args) == 0
    pf = PlanFile.loads(out.read_text())
    assert f"wrote {out}: {len(pf.plan.stages)} stages over 6 slots in 2 region(s)" in capsys.readouterr().err
    served = served_model("synthetic-moe-small")
    assert (pf.plan.model.name, pf.plan.model.digest) == (served.name, served.digest)  # as its daemons serve it
    assert set(pf.plan.peers()) == set(pf.fleet.names)  # every slot holds a stage or experts
    assert {s.device for s in pf.fleet.slots} == {"RTX 4090", "RTX 3090", "RTX 3060 12GB"}
    assert [s.region for s in pf.fleet.slots] == [0, 1, 0, 1, 0, 1]  # round robin in the spec's order
    assert pf.fleet.rtt_ms == ((1.0, 60.0), (60.0, 1.0)) and pf.fleet.uplink_mbit == 100.0
    assert json.loads(out.read_text())["fleet"]["slots"]["r0-3060-4"]["memory"] == 12348030976


def test_out_needs_a_fleet(tmp_path, capsys):
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps([{"peer_id": "x", "memory_total": 2**33, "memory_free": 2**33}]))
    assert main(["plan", "--model", "llama-3.2-1b", "--nodes", str(nodes), "--out", str(tmp_path / "p.json")]) == 2
    assert "--out writes a plan for a fleet's slots: give --fleet" in capsys.readouterr().err
