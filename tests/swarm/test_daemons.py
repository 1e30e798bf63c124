"""Acceptance: real `swarmd join` processes on loopback, checked with `swarmd status` as a user would."""

from __future__ import annotations

import json

import pytest

from tests.swarm.daemons import view, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serial]
BOUND = 30.0  # generous: the target figures are benchmarks, not test bounds


def agreed(ds, n_alive: int, after_epoch: int = 0):
    """The common view of `ds` once they agree on n_alive members and a plan newer than after_epoch."""
    views = {view(d.status()) for d in ds}
    if len(views) == 1:
        leader, epoch, alive = next(iter(views))
        if leader and epoch and epoch > after_epoch and len(alive) == n_alive and leader in alive:
            return leader, epoch, alive
    return None


def test_four_daemons_form_one_swarm_and_survive_kills_and_restarts(daemons):
    d1 = daemons("d1").start().wait_ready()
    assert d1.stdout_lines[0] == f"Peer ID: {d1.peer_id}"
    assert all(a.endswith(f"/p2p/{d1.peer_id}") and not a.endswith("/tcp/0/p2p/" + d1.peer_id)
               for a in d1.addresses)
    assert d1.stdout_lines[-1] == "Daemon is ready"
    assert any(line.startswith("API server listening on http://") for line in d1.stdout_lines)
    # a chain of bootstraps: d2 joins through d1, d3 through d2, d4 through d3
    d2 = daemons("d2").start(bootstrap=(d1.addresses[0],)).wait_ready()
    d3 = daemons("d3").start(bootstrap=(d2.addresses[0],)).wait_ready()
    d4 = daemons("d4").start(bootstrap=(d3.addresses[0],)).wait_ready()
    everyone = [d1, d2, d3, d4]
    leader, epoch, alive = wait_until(lambda: agreed(everyone, 4), BOUND, "4 daemons to agree")
    assert leader == d1.peer_id  # the founder stays leader while alive
    for d in everyone:
        done = d.status_cli("--json")
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["self"]["peer_id"] == d.peer_id and doc["leader"] == leader and doc["plan"]["epoch"] == epoch
        assert {m["peer_id"]: m["state"] for m in doc["members"]} == dict.fromkeys(alive, "alive")
        assert {s["peer_id"] for s in doc["plan"]["stages"]} == alive and doc["plan"]["experts"] == {}
    human = d4.status_cli()
    assert human.returncode == 0 and "members" in human.stdout and d1.peer_id[-6:] in human.stdout

    # kill -9 of a bootstrap node (d2: d3 joined through it): the rest stay one swarm
    d2.kill9()
    survivors = [d1, d3, d4]
    leader, epoch2, alive = wait_until(lambda: agreed(survivors, 3, epoch), BOUND, "the swarm to drop d2")
    assert leader == d1.peer_id and d2.peer_id not in alive and epoch2 > epoch
    assert all(next(m for m in d.status()["members"] if m["peer_id"] == d2.peer_id)["state"] == "dead"
               for d in survivors)

    # kill -9 of the leader: a new leader on a higher term, and a new plan
    term = d3.status()["term"]
    d1.kill9()
    survivors = [d3, d4]
    leader, epoch3, alive = wait_until(lambda: agreed(survivors, 2, epoch2), BOUND, "a new leader")
    assert leader == min(d3.peer_id, d4.peer_id) and epoch3 > epoch2 and d3.status()["term"] > term
    assert {s["peer_id"] for s in d3.status()["plan"]["stages"]} == alive

    # a restarted node rejoins with the same peer id (through a live member)
    old_id = d2.peer_id
    d2.addresses, d2.peer_id = [], ""
    d2.start(bootstrap=(d4.addresses[0],)).wait_ready()
    assert d2.peer_id == old_id
    survivors = [d2, d3, d4]
    wait_until(lambda: agreed(survivors, 3, epoch3), BOUND, "the restarted node to rejoin")
    me = next(m for m in d3.status()["members"] if m["peer_id"] == old_id)
    assert me["incarnation"] == 2

    metrics = __import__("httpx").get(f"{d3.api}/metrics", timeout=5).text
    assert 'swarmd_members{state="alive"} 3.0' in metrics and "swarmd_plan_epoch" in metrics
    assert 'swarmd_gc_collections_total{generation="0"}' in metrics
    assert d3.terminate() == 0
    assert not (d3.home / "api").exists()
