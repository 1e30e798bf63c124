"""`swarmd doctor`'s judgement on status documents of daemons in each situation, and its exit when none answers."""

from __future__ import annotations

import os
import subprocess
import sys

from swarmd.net.diagnosis import FAIL, OK, WARN, diagnose

ME, PEER, RELAY = "12D3KooWselfAAAAAA", "12D3KooWpeerBBBBBB", "12D3KooWrelayCCCCC"


def doc(reach: dict, links: list, *, relay: dict | None = None, punch: dict | None = None, dp_port: int = 4002) -> dict:
    return {
        "self": {"peer_id": ME}, "leader": RELAY,
        "members": [{"peer_id": ME, "state": "alive"}, {"peer_id": PEER, "state": "alive"}],
        "links": links,
        "connectivity": {
            "listen": ["/ip4/0.0.0.0/tcp/4001"], "advertised": ["/ip4/198.18.0.1/tcp/4001"],
            "advertised_because": "public listen addresses", "reachability": reach,
            "relay": relay or {"serving": True, "limits": {"circuits_per_peer": 8, "circuit_bytes": 1 << 30,
                                                          "circuit_seconds": 3600}, "reservations": []},
            "hole_punching": punch or {}, "data_plane": {"port": dp_port}},
    }


def named(d, name):
    return next(c for c in d.checks if c.name == name)


def test_a_public_daemon_with_every_link_on_the_data_plane_needs_nothing():
    d = diagnose(doc({"status": "reachable", "summary": "public (198.18.0.1:4001 dialled back by 2 peers)",
                      "observed_ip": "198.18.0.1", "data_plane_reachable": True},
                     [{"peer_id": PEER, "path": "data-plane", "reason": "activations to it on the TLS data plane"}]))
    assert not d.failed and d.situation.startswith("public")
    assert named(d, "reachability").status == OK and named(d, "data plane").status == OK


def test_behind_a_dropping_nat_hole_punched_is_named_and_the_port_forward_suggested():
    reach = {"status": "behind-nat", "summary": "behind NAT (port-preserving, drops unsolicited connections, hole "
             "punching can work)", "observed_ip": "198.18.0.2", "nat": {"unsolicited": "drop"}}
    relay = {"serving": True, "limits": {}, "reservations": [{"relay": RELAY, "expires_in_s": 3500}]}
    d = diagnose(doc(reach, [{"peer_id": PEER, "path": "direct", "reason": "hole-punched direct connection"}],
                     relay=relay, punch={PEER: {"successes": 1}}))
    assert d.situation == "behind NAT (its NAT drops unsolicited connections): hole-punched to 1 member(s), no link relayed"
    r = named(d, "reachability")
    assert r.status == WARN and "forward TCP port 4001" in r.fix
    assert named(d, "relay reservations").status == OK and not d.failed


def test_behind_an_rst_nat_the_relayed_links_are_named_and_no_reservation_is_a_failure():
    reach = {"status": "behind-nat", "summary": "behind NAT (answers unsolicited connections with RST, ...)",
             "nat": {"unsolicited": "rst"}}
    d = diagnose(doc(reach, [{"peer_id": PEER, "path": "relayed", "reason": "through relay CCCCC; hole punching "
                                                                             "failed 3 times"}]))
    assert d.situation.startswith("behind NAT (its NAT answers unsolicited connections with RST): 1 link(s) relayed")
    assert named(d, f"link {PEER[-6:]}").status == WARN
    assert named(d, "relay reservations").status == FAIL and d.failed
    assert "links to other members behind NAT stay relayed" in named(d, "reachability").line


def test_a_reachable_libp2p_port_with_an_unreachable_data_plane_port_is_a_failure_with_its_fix():
    d = diagnose(doc({"status": "reachable", "summary": "public", "data_plane_reachable": False}, []))
    check = named(d, "data plane")
    assert check.status == FAIL and "--data-plane-port" in check.fix


def test_a_member_it_cannot_connect_to_fails():
    d = diagnose(doc({"status": "reachable", "summary": "public"},
                     [{"peer_id": PEER, "path": "none", "reason": "not connected: no answer within 3 s"}]))
    assert named(d, f"link {PEER[-6:]}").status == FAIL and d.failed


def test_doctor_exits_2_when_no_daemon_answers(tmp_path):
    env = {**os.environ, "SWARMD_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "swarmd", "doctor"], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "no daemon is running" in done.stderr
