"""Acceptance: a public founder and two daemons behind two NATs (real nftables masquerade between network
namespaces), as users would run them, serving SmolLM2 in three stages.

- NATs that drop unsolicited connections (most home routers): one swarm with one leader; the pipeline answers
  with exactly `swarmd run`'s text; the two NATed daemons end up hole-punched (their link is direct).
- NATs whose routers answer unsolicited connections with a RST (hole punching cannot work): the swarm forms and
  answers over the relay all the same, and the link between the NATed pair says relayed.
- `swarmd doctor` names each daemon's situation.
Each scenario's daemons serve all of its tests (module-scoped); the namespaces and veths are removed after them,
whatever happened.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.netns.nat_swarm import CONTEXT, NatSwarm
from tests.swarm.daemons import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(900)]

PROMPT = "The capital of France is"
N_TOKENS = 8


@pytest.fixture(scope="module")
def reference() -> str:
    """`swarmd run`'s greedy completion: what every swarm must answer."""
    done = subprocess.run([sys.executable, "-m", "swarmd", "run", "--max-context", str(CONTEXT), "-n", str(N_TOKENS),
                           PROMPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def dropping(tmp_path_factory, bench_file, reference):
    swarm = NatSwarm(tmp_path_factory.mktemp("drop"), bench_file, "drop")
    try:
        yield swarm.start()
    finally:
        swarm.stop()


def test_behind_dropping_nats_one_swarm_one_leader_and_swarmd_runs_answer(dropping, reference):
    views = [d.status() for d in dropping.daemons]
    assert {v["leader"] for v in views} == {dropping.peers[0]}
    assert all(len(v["plan"]["stages"]) == 3 for v in views)
    for home in dropping.daemons[1:]:  # a dial-back that the NAT drops ends at its timeout: later on a busy machine
        wait_until(lambda home=home: home.status()["connectivity"]["reachability"]["status"] == "behind-nat", 60,
                   f"{home.host} to find itself behind NAT")
    code, result, err = dropping.submit(1, PROMPT, N_TOKENS)  # headed by a daemon behind NAT
    assert code == 0, err + dropping.logs()
    assert result["text"] == reference and len(result["token_ids"]) == N_TOKENS


def test_the_nated_pair_ends_up_hole_punched(dropping):
    # the punch is booked by the daemon's next look at its connections (every 0.5 s), a moment after the link is up
    wait_until(lambda: "hole-punched" in (lk := dropping.link(1, 2))["reason"] and lk["path"] == "direct", 90,
               "a hole-punched direct link between the two daemons behind NAT")
    back = dropping.link(2, 1)
    assert back["path"] in ("direct", "data-plane"), back
    assert dropping.link(0, 1)["path"] in ("direct", "data-plane")  # they dialled the public founder themselves


def test_doctor_names_the_public_founder_and_the_hole_punched_homes(dropping):
    code, founder = dropping.founder.doctor()
    assert code == 0 and founder["situation"].startswith("public"), founder
    code, home = dropping.daemons[1].doctor()
    assert code == 0, home
    assert home["situation"].startswith("behind NAT (its NAT drops unsolicited connections): hole-punched"), home
    reach = next(c for c in home["checks"] if c["name"] == "reachability")
    assert reach["status"] == "warn" and "forward TCP port 4001" in reach["fix"]


@pytest.fixture(scope="module")
def resetting(tmp_path_factory, bench_file, reference, dropping):  # after the dropping NATs are gone
    dropping.stop()
    swarm = NatSwarm(tmp_path_factory.mktemp("rst"), bench_file, "rst")
    try:
        yield swarm.start()
    finally:
        swarm.stop()


def test_behind_nats_that_answer_with_rst_the_swarm_answers_over_the_relay(resetting, reference):
    code, result, err = resetting.submit(2, PROMPT, N_TOKENS)
    assert code == 0, err + resetting.logs()
    assert result["text"] == reference
    link = wait_until(lambda: (lk := resetting.link(1, 2))["path"] == "relayed" and "failed" in lk["reason"] and lk,
                      120, "a relayed link whose hole punching failed")
    assert "through relay" in link["reason"]
    assert resetting.link(2, 1)["path"] == "relayed"


def test_doctor_names_the_rst_nat_and_the_relayed_link(resetting):
    code, home = resetting.daemons[1].doctor()
    assert code == 0, home
    assert "answers unsolicited connections with RST" in home["situation"] and "relayed" in home["situation"], home
    relay = next(c for c in home["checks"] if c["name"] == "relay reservations")
    assert relay["status"] == "ok", relay
    reach = next(c for c in home["checks"] if c["name"] == "reachability")
    assert "hole punching cannot work" in reach["line"]
