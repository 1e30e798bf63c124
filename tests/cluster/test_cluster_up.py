"""`swarmd plan --out` then `swarmd cluster up --plan`, as a user types them: a heterogeneous fleet in two regions
on this machine, the WAN between them emulated, the answer equal to `swarmd run`'s, and a per-token trace."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from planner.plan_file import PlanFile
from tests.swarm.daemons import http

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.waits]

MODEL = "kimi-k2-mini"
FLEET = ["--fleet", "2x4090,2x3090,2x3060", "--regions", "2", "--rtt-ms", "1,60", "--uplink-mbit", "100"]
PROMPT = "The capital of France is"
TOKENS = 16


def swarmd(*args: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarmd", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def environment(home: Path) -> dict[str, str]:
    env = {**os.environ, "SWARMD_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("SWARMD_BOOTSTRAP", None)
    return env


def write_plan(path: Path, env: dict[str, str], *fleet: str) -> PlanFile:
    done = swarmd("plan", "--model", MODEL, *fleet, "--out", str(path), env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return PlanFile.loads(path.read_text())


class Kept:
    """The cluster `cluster up --keep` left running: its plan file, output, and state."""

    def __init__(self, base: Path, env: dict[str, str], plan: PlanFile, up: subprocess.CompletedProcess[str]) -> None:
        self.base, self.env, self.plan, self.up = base, env, plan, up
        self.dir = Path(env["SWARMD_HOME"]) / "cluster"
        self.state = json.loads((self.dir / "state.json").read_text())

    def api(self, slot: str) -> str:
        return json.loads((self.dir / "slots" / slot / "api").read_text())["url"]

    def emulator(self, cmd: dict[str, Any]) -> dict[str, Any]:
        with socket.create_connection(("127.0.0.1", self.state["control_port"]), timeout=10) as s:
            s.sendall(json.dumps(cmd).encode() + b"\n")
            return json.loads(s.makefile().readline())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """What `swarmd run` prints for the prompt."""
    env = environment(tmp_path_factory.mktemp("run-home"))
    done = swarmd("run", "--model", MODEL, "--max-tokens", str(TOKENS), PROMPT, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def kept(tmp_path_factory, reference):
    base = tmp_path_factory.mktemp("cluster")
    env = environment(base / "home")
    plan = write_plan(base / "moe.json", env, *FLEET)
    up = swarmd("cluster", "up", "--plan", str(base / "moe.json"), "--prompt", PROMPT, "--max-tokens", str(TOKENS),
                "--trace", str(base / "trace.json"), "--keep", env=env)
    assert up.returncode == 0, up.stderr[-4000:]
    try:
        yield Kept(base, env, plan, up)
    finally:
        swarmd("cluster", "down", env=env, timeout=120)


def test_the_acceptance_fleet_is_heterogeneous_spread_over_two_regions_and_uses_every_slot(kept):
    fleet, plan = kept.plan.fleet, kept.plan.plan
    assert len(fleet.slots) >= 6 and len({s.device for s in fleet.slots}) >= 3 and fleet.regions == 2
    assert set(plan.peers()) == set(fleet.names)
    assert len({h for by in plan.experts.values() for hs in by.values() for h in hs}) >= 4


def test_the_greedy_answer_is_what_swarmd_run_prints(kept, reference):
    assert kept.up.stdout == reference and len(reference) > 10
    assert re.search(r"ready [\d.]+ s after `cluster up`", kept.up.stderr)


def test_every_slot_runs_with_its_devices_label_and_memory_and_the_leader_bound_them_all(kept):
    status = http.get(f"{kept.state['api']}/api/v0/status", timeout=10).json()
    bound = status["slots"]["bound"]
    assert set(bound) == set(kept.plan.fleet.names) and all(bound.values())
    members = {m["peer_id"]: m for m in status["members"]}
    for s in kept.plan.fleet.slots:
        m = members[bound[s.name]]
        assert (m["label"], m["memory_total"], m["state"]) == (s.device, s.memory, "alive")
    assert [st["peer_id"] for st in status["plan"]["stages"]] == [bound[st.peer_id] for st in kept.plan.plan.stages]


def test_traffic_between_regions_crosses_the_emulator_on_libp2p_and_the_data_plane_and_inside_a_region_not(kept):
    stats = kept.emulator({"stats": True})
    crossed = {name: s["bytes_forwarded"] for name, s in stats.items()}
    assert sum(b for n, b in crossed.items() if n.endswith(":swarm")) > 0
    assert sum(b for n, b in crossed.items() if n.endswith(":data")) > 0  # activations between the regions
    assert all(s["delay_ms"] == 30.0 for s in stats.values())  # half of the 60 ms round trip, each way
    regions = {s.name: s.region for s in kept.plan.fleet.slots}
    assert all(regions[n.split("->")[1].split(":")[0]] != int(n[1]) for n in stats)  # links only across regions


def test_the_trace_has_a_process_per_daemon_moe_fan_outs_and_hops_with_bytes(kept):
    events = json.loads((kept.base / "trace.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    peers = set(kept.state["peers"].values())
    assert {name.split()[-1] for name in processes.values()} >= peers  # every daemon, by peer id
    spans = [e for e in events if e.get("ph") == "X"]
    assert any(e["name"] == "moe.fan_out" for e in spans)
    assert any(e["name"] == "hop.send" and e["args"].get("bytes", 0) > 0 for e in spans)
    assert f"per-token trace (Perfetto JSON): {kept.base / 'trace.json'}" in kept.up.stderr
    assert "per-token breakdown of trace.json" in kept.up.stderr and "moe.fan_out" in kept.up.stderr


def test_cluster_down_stops_every_process_it_kept(kept):
    pids = [p["pid"] for p in json.loads((kept.dir / "state.json").read_text())["processes"]]
    done = swarmd("cluster", "down", env=kept.env, timeout=120)
    assert done.returncode == 0 and f"stopped {len(pids)} process(es)" in done.stderr
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert not (kept.dir / "state.json").exists()
    again = swarmd("cluster", "down", env=kept.env, timeout=60)
    assert again.returncode == 2 and "no cluster is up" in again.stderr


def test_sigterm_while_the_cluster_comes_up_stops_every_process_it_started(tmp_path):
    env = environment(tmp_path / "home")
    write_plan(tmp_path / "two.json", env, "--fleet", "2x3060", "--regions", "2")
    proc = subprocess.Popen([sys.executable, "-m", "swarmd", "cluster", "up", "--plan", str(tmp_path / "two.json")],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)  # type: ignore[union-attr]
    reader.start()
    pids, seen = [], []
    while len(pids) < 3:  # the emulator and both slots' daemons
        seen.append(lines.get(timeout=300))
        if m := re.search(r"\(pid (\d+)\)|: pid (\d+),", seen[-1]):
            pids.append(int(m.group(1) or m.group(2)))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 2
    reader.join(timeout=10)
    while not lines.empty():
        seen.append(lines.get())
    assert seen[-1].strip() == "swarmd cluster: error: interrupted by SIGTERM: stopped every process it started"
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_a_plan_file_for_other_weights_is_one_line_before_anything_starts(tmp_path):
    env = environment(tmp_path / "home")
    write_plan(tmp_path / "p.json", env, "--fleet", "2x3060")
    doc = json.loads((tmp_path / "p.json").read_text())
    doc["model"]["digest"] = "ab" * 32
    (tmp_path / "p.json").write_text(json.dumps(doc))
    done = swarmd("cluster", "up", "--plan", str(tmp_path / "p.json"), env=env, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"swarmd cluster: error: p.json is for other weights of {MODEL}")
    assert not (tmp_path / "home" / "cluster" / "slots").exists()


def test_a_cluster_not_ready_in_time_names_the_slots_and_stops_every_process_it_started(tmp_path):
    env = environment(tmp_path / "home")
    plan = write_plan(tmp_path / "two.json", env, "--fleet", "2x3060", "--regions", "2")
    done = swarmd("cluster", "up", "--plan", str(tmp_path / "two.json"), "--ready-timeout", "2", env=env, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("swarmd cluster: error: not ready within 2 s: slot") and "Traceback" not in done.stderr
    assert any(name in last for name in plan.fleet.names)  # names what it waited for
    pids = [int(a or b) for a, b in re.findall(r"\(pid (\d+)\)|: pid (\d+),", done.stderr)]
    assert len(pids) == 3  # the emulator and both slots' daemons, all stopped
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
