"""Acceptance: two daemons on two addresses of one bridge (two machines on a LAN, no NAT) pass activations on
the TLS data plane, and status says so."""

from __future__ import annotations

import pytest

from swarmd.net.identity import load_or_create_identity, peer_id_of
from tests.netns.ns_daemons import NsDaemon
from tests.netns.topology import Netns
from tests.pipeline.daemon_swarm import even_plan
from tests.swarm.daemons import stop_all, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(600)]

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
