"""Acceptance: two daemons on two addresses of one bridge (two machines on a LAN, no NAT) pass activations on
the TLS data plane, and status says so; a data-plane hop between the two namespaces costs what it costs on
loopback, within 20 % (bench_hop's latency benchmark, both ways in the same run, medians)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from swarmd.net.identity import load_or_create_identity, peer_id_of
from tests.netns.ns_daemons import NsDaemon
from tests.netns.topology import Netns
from tests.pipeline.daemon_swarm import even_plan
from tests.swarm.daemons import stop_all, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BENCH_HOP = Path(__file__).resolve().parents[2] / "scripts" / "bench_hop.py"
EXTRA = ("--timings", "local-test", "--max-context", "256")


@pytest.fixture(scope="module")
def lan(tmp_path_factory, bench_file):
    net = Netns.create()
    try:
        h1, h2 = net.bridge_lan(2)
        base = tmp_path_factory.mktemp("lan")
        daemons = []
        for host in ("h1", "h2"):
            (base / host).mkdir()
            load_or_create_identity(base / host)
            daemons.append(NsDaemon(net, host, base / host, bench_file=bench_file, swarm="lan", extra=EXTRA))
        peers = [peer_id_of(load_or_create_identity(d.home)) for d in daemons]
        plan = base / "plan.json"
        plan.write_text(even_plan(peers).dumps())
        try:
            first = daemons[0].start(listen=f"/ip4/{h1.ip}/tcp/4001", extra=("--plan", str(plan))).wait_ready(90)
            daemons[1].start(listen=f"/ip4/{h2.ip}/tcp/4001",
                             bootstrap=(f"/ip4/{h1.ip}/tcp/4001/p2p/{first.peer_id}",)).wait_ready(90)
            wait_until(lambda: daemons[0].status()["coverage"] == "layers 0-29 covered", 300, "both stages ready",
                       interval=1.0)
            yield net, daemons, peers
        finally:
            stop_all(daemons)
    finally:
        net.close()


def test_two_daemons_on_a_bridge_pass_activations_on_the_data_plane_and_status_says_so(lan):
    _, daemons, peers = lan
    for _ in range(2):  # a daemon busy compiling its first kernels may be planned around for a while
        wait_until(lambda: len(daemons[0].status()["plan"]["stages"]) == 2, 180, "the two-stage plan", interval=1.0)
        done = daemons[0].cli("submit-prompt", "--max-tokens", "4", "The capital of France is", timeout=300)
        assert done.returncode == 0, done.stderr
        if len(daemons[0].status()["plan"]["stages"]) == 2:
            break
    there, back = daemons[0].links()[peers[1]], daemons[1].links()[peers[0]]
    seen = daemons[0].status()
    assert there["path"] == "data-plane" and "10.71.0.3:" in there["reason"], (there, seen["plan"], daemons[0].log()[-4000:])
    assert back["path"] == "data-plane", back
    conn = daemons[0].status()["connectivity"]
    assert conn["advertised"] == [f"/ip4/10.71.0.2/tcp/4001/p2p/{peers[0]}"]  # its LAN address, not 0.0.0.0
    assert conn["reachability"]["status"] == "reachable"


def hop_ms(net: Netns, out: Path, host: str, bind: str, receiver_ns: str = "") -> dict:
    """bench_hop's latency run from h1 to a receiver at `host` (in `receiver_ns`, else in h1 too)."""
    cmd = [*net.exec_prefix("h1"), sys.executable, str(BENCH_HOP), "latency", "--sizes", "2304,65536",
           "--rounds", "3", "--batch", "30", "--budget", "60", "--host", host, "--bind", bind, "--markdown",
           "--out", str(out)]
    if receiver_ns:
        cmd += ["--receiver-ns", receiver_ns]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def test_a_data_plane_hop_across_the_bridge_costs_what_it_costs_on_loopback(lan, tmp_path):
    net, _, _ = lan
    h1, h2 = net.hosts["h1"], net.hosts["h2"]
    runs: dict[str, list[dict]] = {"loopback": [], "bridge": []}
    for i in range(2):  # interleaved: loopback, bridge, loopback, bridge
        runs["loopback"].append(hop_ms(net, tmp_path / f"loop{i}.json", "127.0.0.1", "127.0.0.1"))
        runs["bridge"].append(hop_ms(net, tmp_path / f"bridge{i}.json", h2.ip, h1.ip, receiver_ns=h2.ns))
    assert all(r["tls_fallbacks"] == 0 for r in runs["bridge"])
    for size in ("2304", "65536"):
        loop = statistics.median(r["sizes"][size]["tls"]["median_ms"] for r in runs["loopback"])
        bridge = statistics.median(r["sizes"][size]["tls"]["median_ms"] for r in runs["bridge"])
        print(f"data-plane hop, {size} B: loopback {loop:.3f} ms, bridge {bridge:.3f} ms ({bridge / loop:.2f}x)")
        assert bridge <= 1.2 * loop, (size, loop, bridge)
