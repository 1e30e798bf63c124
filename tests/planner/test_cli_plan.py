"""`swarmd plan` as a user types it."""

from __future__ import annotations

import json
import subprocess
import sys

from planner import Plan
from swarmd.cli.main import main


def test_json_plan_for_a_fleet_round_trips_and_covers_the_model(capsys):
    assert main(["plan", "--model", "llama-3.2-1b", "--fleet", "2x3060,4090", "--json"]) == 0
    plan = Plan.loads(capsys.readouterr().out)
    assert plan.model.name == "llama-3.2-1b" and plan.model.dtype == "bf16"
    assert plan.n_blocks == 16 and len(plan.stages) == 3


def test_nodes_file_and_previous_plan_give_a_table(tmp_path, capsys):
    nodes = [{"peer_id": p, "memory_total": 2**32, "memory_free": 2**32, "flops": 1e12, "mem_bandwidth": 1e11}
             for p in ("alpha", "beta")]
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(nodes))
    assert main(["plan", "--model", "smollm2-135m", "--nodes", str(path), "--json"]) == 0
    previous = tmp_path / "plan.json"
    previous.write_text(capsys.readouterr().out)
    assert main(["plan", "--model", "smollm2-135m", "--nodes", str(path), "--previous", str(previous)]) == 0
    out = capsys.readouterr().out
    assert "stage-0" in out and "alpha" in out and "predicted:" in out and "bottleneck:" in out


def test_kimi_k2_defaults_to_int4_and_regions_shape_the_network(capsys):
    args = ["plan", "--model", "kimi-k2", "--fleet", "60x3090", "--regions", "2", "--rtt-ms", "2,80",
            "--uplink-mbit", "200", "--policy", "min-latency", "--json"]
    assert main(args) == 0
    plan = Plan.loads(capsys.readouterr().out)
    assert plan.model.dtype == "int4"
    assert len({s.peer_id.split("-")[0] for s in plan.stages}) == 1  # the chain stays in one region


def test_infeasible_and_unknown_inputs_fail_in_one_line_without_a_traceback():
    cases = [
        (["--model", "kimi-k2", "--fleet", "4x3060"], "swarmd plan: error: needs "),
        (["--model", "gpt-9", "--fleet", "4x3060"], "swarmd plan: error: unknown model 'gpt-9'"),
        (["--model", "kimi-k2", "--fleet", "4xH100"], "swarmd plan: error: --fleet: unknown GPU 'H100'"),
    ]
    for args, start in cases:
        done = subprocess.run([sys.executable, "-m", "swarmd", "plan", *args], capture_output=True, text=True)
        assert done.returncode == 2
        assert done.stderr.startswith(start), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
