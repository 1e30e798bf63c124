"""A plan file's fleet on this machine: one `swarmd join` per slot, the WAN between regions emulated.

    cluster = Cluster(Path("kimi.json"), default_home() / "cluster", say)
    cluster.start()                      # emulator, then the daemons (stage 0's slot founds the swarm)
    cluster.wait_ready(600)              # every stage and expert loaded, progress through `say`
    result = cluster.generate({"chat": "Hi", "max_tokens": 32}, sys.stdout)
    cluster.stop()

Each slot's daemon runs with the slot's memory limit, device label and the fleet's uplink, claims its slot
(`--plan FILE --slot NAME`), listens on loopback ports chosen here, and dials the slots of other regions
through the link emulator (`swarmd.cluster.wan`, `swarmd.cluster.emulator`). The device is measured once
here and every daemon gets that measurement, so they all describe this machine alike. Homes, logs and the
state `swarmd cluster down` reads live under the cluster directory (`$SWARMD_HOME/cluster`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx

from planner.errors import PlanSchemaError
from planner.plan_file import PlanFile
from swarmd.cluster.processes import Processes, clear_state, read_state, running, stop_processes, write_state
from swarmd.cluster.wan import HOST, SlotPorts, Wan, emulated_wan
from swarmd.errors import UserError

SWARM = "cluster"
# Daemons share this machine's cores: one that is busy loading can be silent for seconds without being gone.
TIMINGS = '[timings]\npreset = "lan"\nsuspect_after = 6.0\nprobe_timeout = 2.0\n'
POLL_S = 0.5

Say = Callable[[str], None]


class ClusterError(UserError):
    """Bringing the cluster up failed; the message names what (e.g. the slot that never became ready)."""


class FreePorts:
    """Free loopback ports, each held open until `release`, so that no two requests get the same one."""

    def __init__(self) -> None:
        self.held: list[socket.socket] = []

    def __call__(self) -> int:
        s = socket.socket()
        s.bind((HOST, 0))
        self.held.append(s)
        return int(s.getsockname()[1])

    def release(self) -> None:
        for s in self.held:
            s.close()
        self.held = []


def read_plan_file(path: Path) -> PlanFile:
    try:
        return PlanFile.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--plan {path}: no such file") from None
    except OSError as e:
        raise UserError(f"--plan {path}: {e.strerror}") from None
    except PlanSchemaError as e:
        raise UserError(f"--plan {path}: {e}") from None


class Cluster:
    def __init__(self, plan_path: Path, directory: Path, say: Say, *, claim_timeout: float = 120.0,
                 extra: tuple[str, ...] = ()) -> None:
        self.plan_path = Path(plan_path).resolve()
        self.file = read_plan_file(self.plan_path)
        self.dir = Path(directory)
        self.say = say
        self.claim_timeout = claim_timeout
        self.extra = extra  # more `swarmd join` options for every daemon
        self.processes = Processes()
        self.founder = self.file.plan.stages[0].peer_id  # stage 0's slot founds the swarm and heads the requests
        self.slots = [self.founder, *(n for n in self.file.fleet.names if n != self.founder)]
        self.peers: dict[str, str] = {}  # slot -> peer id
        self.apis: dict[str, str] = {}  # slot -> API URL
        self.control_port = 0
        self.wan: Wan | None = None
        self.started_at = 0.0
        self.http = httpx.Client()  # one for the polling: each new client loads the CA bundle again

    # --- start ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.started_at = time.monotonic()
        self._refuse_if_up()
        self.dir.mkdir(parents=True, exist_ok=True)
        model = self._model()
        bench = self._measure_device()
        free = FreePorts()
        ports = {s: SlotPorts(free(), free()) for s in self.slots}
        self.wan = emulated_wan(self.file.fleet, ports, free)
        free.release()
        if self.wan.links:
            self._start_emulator(self.wan)
        config = self.dir / "cluster.toml"
        config.write_text(f"uplink_mbps = {self.file.fleet.uplink_mbit:g}\n{TIMINGS}")
        for slot in self.slots:
            self._start_daemon(slot, model, ports, bench, config)
        write_state(self.dir, self.state(), self.processes.started)

    def _refuse_if_up(self) -> None:
        found = read_state(self.dir)
        if found is None:
            return
        doc, started = found
        if running(started):
            raise ClusterError(f"a cluster is already up here ({len(running(started))} processes of "
                               f"{Path(doc.get('plan', '?')).name}): `swarmd cluster down` stops it")
        clear_state(self.dir)

    def _model(self) -> str:
        from swarmd.daemon.served_model import served_model

        ref = self.file.plan.model
        self.say(f"model {ref.name}: making sure it is in the model cache")
        model = served_model(ref.name)
        if ref.digest and model.digest and ref.digest != model.digest:
            raise ClusterError(f"{self.plan_path.name} is for other weights of {ref.name} (digest {ref.digest[:12]}, "
                               f"the model cache has {model.digest[:12]}): write the plan again with `swarmd plan`")
        return ref.name

    def _measure_device(self) -> Path:
        """This machine's device, measured once (and kept): every slot's daemon gets a copy."""
        from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

        device = resolve_device("auto")
        if not (self.dir / BENCH_FILE).is_file():
            self.say(f"measuring this machine's {device} once (every slot's daemon describes it alike)")
        load_or_measure(self.dir, device, device_name(device))
        return self.dir / BENCH_FILE

    def _start_emulator(self, wan: Wan) -> None:
        spec = self.dir / "emulator.json"
        spec.write_text(json.dumps({"links": [vars(link) for link in wan.links]}, indent=1) + "\n")
        log = self.dir / "emulator.log"
        log.write_text("")
        proc = self.processes.start("emulator", [sys.executable, "-m", "swarmd.cluster.emulator", str(spec)], log,
                                    env=self._env())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if m := re.search(r"control on [\d.]+:(\d+)", log.read_text()):
                self.control_port = int(m.group(1))
                regions = self.file.fleet.regions
                self.say(f"link emulator up: {len(wan.links)} links between {regions} regions (pid {proc.pid})")
                return
            if proc.poll() is not None:
                raise ClusterError(f"the link emulator exited with code {proc.returncode}: {_last_line(log)}")
            time.sleep(0.1)
        raise ClusterError(f"the link emulator did not start within 60 s (its log: {log})")

    def _start_daemon(self, slot: str, model: str, ports: dict[str, SlotPorts], bench: Path, config: Path) -> None:
        from swarmd.net.identity import load_or_create_identity, peer_id_of

        assert self.wan is not None
        home = self.dir / "slots" / slot
        home.mkdir(parents=True, exist_ok=True)
        shutil.copy(bench, home / bench.name)
        (home / "api").unlink(missing_ok=True)
        self.peers[slot] = peer_id_of(load_or_create_identity(home))  # a slot keeps its peer id from run to run
        spec = self.file.fleet.slot(slot)
        cmd = [sys.executable, "-m", "swarmd", "join", "--home", str(home), "--swarm", SWARM, "--model", model,
               "--plan", str(self.plan_path), "--slot", slot, "--claim-timeout", f"{self.claim_timeout:g}",
               "--listen", f"/ip4/{HOST}/tcp/{ports[slot].swarm}", "--data-plane-port", str(ports[slot].data),
               "--api", f"{HOST}:0", "--memory-limit", str(spec.memory), "--device-label", spec.device,
               "--config", str(config), *self.extra]
        for entry in self.wan.dial_maps[slot]:
            cmd += ["--dial-map", entry]
        if slot != self.founder:
            cmd += ["--bootstrap", f"/ip4/{HOST}/tcp/{ports[self.founder].swarm}/p2p/{self.peers[self.founder]}"]
        proc = self.processes.start(slot, cmd, home / "daemon.log", env=self._env())
        self.say(f"slot {slot} ({spec.device}, region {spec.region}): pid {proc.pid}, peer {self.peers[slot][-6:]}")

    @staticmethod
    def _env() -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SWARMD_BOOTSTRAP", None)
        env.pop("SWARMD_HOME", None)
        return env

    def state(self) -> dict[str, Any]:
        return {"plan": str(self.plan_path), "api": self.apis.get(self.founder), "control_port": self.control_port,
                "peers": self.peers, "up_pid": os.getpid()}

    # --- ready ---------------------------------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Until the plan is adopted and every stage and expert is loaded; the founder's status. Progress through
        `say` whenever it changes; ClusterError naming the slots that are not ready after `timeout`."""
        deadline = time.monotonic() + timeout
        said, status = "", None
        while time.monotonic() < deadline:
            self._check_processes()
            self._find_apis()
            status = self._status(self.founder)
            line, ready = self._progress(status)
            if line != said:
                self.say(f"[{time.monotonic() - self.started_at:5.1f} s] {line}")
                said = line
            if ready and status is not None:
                write_state(self.dir, self.state(), self.processes.started)
                return status
            time.sleep(POLL_S)
        raise ClusterError(f"not ready within {timeout:.0f} s: {self._not_ready(status)}")

    def _check_processes(self) -> None:
        for name, code in self.processes.exited():
            log = self.dir / "emulator.log" if name == "emulator" else self.dir / "slots" / name / "daemon.log"
            what = "the link emulator" if name == "emulator" else f"slot {name}'s daemon"
            raise ClusterError(f"{what} exited with code {code}: {_last_line(log)}")

    def _find_apis(self) -> None:
        for slot in self.slots:
            if slot in self.apis:
                continue
            try:
                doc = json.loads((self.dir / "slots" / slot / "api").read_text())
            except (OSError, ValueError):
                continue
            if doc.get("pid") == self.processes.procs[slot].pid:
                self.apis[slot] = str(doc["url"]).rstrip("/")

    def _status(self, slot: str) -> dict[str, Any] | None:
        url = self.apis.get(slot)
        if url is None:
            return None
        try:
            status = self.http.get(f"{url}/api/v0/status", timeout=10).json()
            status["pipeline"] = self.http.get(f"{url}/api/v0/pipeline", timeout=10).json()
            return status
        except (httpx.HTTPError, ValueError):
            return None

    def _progress(self, status: dict[str, Any] | None) -> tuple[str, bool]:
        n = len(self.slots)
        started = len(self.apis)
        if status is None or started < n:
            return f"{started}/{n} daemons started (loading the model, joining)", False
        bound = status.get("slots", {}).get("bound", {})
        claimed = sum(1 for p in bound.values() if p)
        coverage = status.get("coverage", "")
        chain = status["pipeline"].get("chain", {})
        line = f"{claimed}/{len(bound)} slots claimed; {coverage}"
        if status.get("plan_error"):
            line += f" ({status['plan_error']})"
        covered = bool(re.match(r"layers 0-\d+ covered", coverage))
        experts = re.search(r"experts (\d+)/(\d+) placed", coverage)
        ready = (status.get("plan") is not None and covered and chain.get("ready", False)
                 and (experts is None or experts.group(1) == experts.group(2)))
        return line, ready

    def _not_ready(self, status: dict[str, Any] | None) -> str:
        """Which slots are not ready, and how far each got."""
        if status is None:
            missing = [s for s in self.slots if s not in self.apis]
            return (f"slot(s) {', '.join(missing)} never started their daemon's API" if missing
                    else f"slot {self.founder} (the founder) does not answer")
        members = {m["peer_id"]: m for m in status["members"]}
        bound = status.get("slots", {}).get("bound", {})
        problems = []
        for slot in self.slots:
            peer = bound.get(slot)
            m = members.get(peer or self.peers[slot])
            if peer is None:
                problems.append(f"slot {slot} never claimed" + (f" ({m['state']})" if m else " (not a member)"))
            elif m is None or m["state"] != "alive":
                problems.append(f"slot {slot} is {m['state'] if m else 'not a member'}")
            elif m["assignment"]["state"] != "ready":
                a = m["assignment"]
                detail = f" {a['progress']:.0%}" if a["state"] == "loading" else (f": {a['error']}" if a["error"] else "")
                problems.append(f"slot {slot} never became ready ({a['state']}{detail})")
        return "; ".join(problems) or status.get("plan_error") or status.get("coverage", "the plan is not adopted")

    # --- use -----------------------------------------------------------------------------------------------
    @property
    def api(self) -> str:
        return self.apis[self.founder]

    def generate(self, body: dict[str, Any], out: IO[str] | None = None) -> dict[str, Any]:
        """One request through the founder (the head), its text streamed to `out` as `swarmd run` prints it; the
        done event (usage, timings, the trace when asked) with the whole text."""
        text: list[str] = []
        try:
            with self.http.stream("POST", f"{self.api}/api/v0/generate", json=body,
                              timeout=httpx.Timeout(10.0, read=None)) as response:
                if response.status_code != 200:
                    response.read()
                    raise ClusterError(f"the head refused the request: {response.text.strip()[:200]}")
                for line in response.iter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("event") in ("token", "done") and event.get("text"):
                        text.append(event["text"])
                        if out is not None:
                            out.write(event["text"])
                            out.flush()
                    if event.get("event") == "done":
                        return {**event, "text": "".join(text)}
                    if event.get("event") == "error":
                        raise ClusterError(f"the cluster could not finish the request: {event['message']} "
                                           f"({event['code']})")
        except httpx.HTTPError as e:
            raise ClusterError(f"no answer from the head at {self.api}: {type(e).__name__}: {e}") from None
        raise ClusterError("the head ended the stream before the request finished")

    def set_wan(self, on: bool) -> None:
        """The emulated links at the plan's delays (on) or at none (off; bandwidth kept)."""
        if not self.control_port:
            return
        with socket.create_connection((HOST, self.control_port), timeout=10) as s:
            s.sendall(json.dumps({"wan": on}).encode() + b"\n")
            reply = json.loads(s.makefile().readline())
        if "error" in reply:
            raise ClusterError(f"the link emulator refused: {reply['error']}")

    # --- stop ----------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """SIGTERM to every daemon at once (then the emulator), SIGKILL past 30 s; the state file goes."""
        daemons = [s for s in self.processes.started if s.name != "emulator"]
        stop_processes(daemons, timeout=30.0)
        stop_processes([s for s in self.processes.started if s.name == "emulator"], timeout=5.0)
        for p in self.processes.procs.values():
            if p.poll() is None:
                p.wait(timeout=5)
        if self.processes.started:
            clear_state(self.dir)
        self.http.close()


def down(directory: Path, say: Say) -> int:
    """Stop a cluster kept up (`cluster up --keep`), found through its state file."""
    found = read_state(directory)
    if found is None:
        raise UserError(f"no cluster is up (no state in {directory})")
    doc, started = found
    daemons = [s for s in started if s.name != "emulator"]
    stopped = stop_processes(daemons, timeout=30.0) + stop_processes([s for s in started if s.name == "emulator"], 5.0)
    clear_state(directory)
    say(f"stopped {len(stopped)} process(es) of the cluster of {Path(doc.get('plan', '?')).name}"
        + ("" if stopped else " (none was still running)"))
    return 0


def _last_line(log: Path) -> str:
    """The line of `log` that says why its process ended: its last error line, else its last line."""
    try:
        lines = [ln.strip(" |") for ln in log.read_text(errors="replace").splitlines() if ln.strip(" |+-")]
    except OSError:
        return f"(no log at {log})"
    errors = [ln for ln in lines if re.search(r"(error|Error|Exception)\b.*:", ln)]
    return (errors or lines or [f"(empty log {log})"])[-1][-300:]
