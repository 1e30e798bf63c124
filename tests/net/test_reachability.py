"""Reachability by dial-back on a new connection: the wire, the verdict, and two real hosts."""

from __future__ import annotations

import socket

import pytest
import trio

from swarmd.errors import RemoteProtocolError
from swarmd.net.reachability import (
    OK,
    PROTOCOL,
    REFUSED,
    TIMEOUT,
    Answer,
    Report,
    Request,
    ask,
    classify,
    verdict,
)

ME = ["127.0.0.1", "10.99.1.2"]


def report(peer: str, ip: str, outcome: str, *, port: int = 40000, local: int = 40000, dp: str = "") -> Report:
    return Report(peer, ip, port, local, {f"/ip4/{ip}/tcp/4001": outcome}, dp, 1.0)


def test_requests_and_answers_round_trip_and_bad_ones_are_refused():
    req = Request((4001,), ("/ip4/10.0.0.1/tcp/4001",), 4002)
    assert Request.decode(req.encode()) == req
    ans = Answer("198.18.0.2", 5555, {"/ip4/198.18.0.2/tcp/4001": TIMEOUT}, OK)
    assert Answer.decode(ans.encode()) == ans
    import cbor2

    for bad in (b"\xff", cbor2.dumps([1]), cbor2.dumps({"v": 2}), cbor2.dumps({"v": 1, "ports": ["x"]}),
                cbor2.dumps({"v": 1, "ports": list(range(1, 20))}), cbor2.dumps({"v": 1, "evil": 1})):
        with pytest.raises(RemoteProtocolError):
            Request.decode(bad)


def test_a_daemon_a_public_peer_dialled_back_is_public():
    v = verdict([report("a", "198.18.0.1", OK)], ["198.18.0.1"])
    assert v.status == "reachable" and v.reachable and v.summary.startswith("public")
    assert v.verified == ("/ip4/198.18.0.1/tcp/4001",) and v.seen_from_public


def test_behind_a_nat_that_drops_unsolicited_connections_hole_punching_can_work():
    v = verdict([report("a", "198.18.0.2", TIMEOUT), report("b", "198.18.0.2", TIMEOUT)], ME)
    assert v.status == "behind-nat" and v.reachable is False and v.hole_punching_viable
    assert v.nat == {"unsolicited": "drop", "port_preserving": True, "wan_ip": "198.18.0.2"}
    assert "drops unsolicited connections" in v.summary and "hole punching can work" in v.summary


def test_behind_a_nat_that_answers_with_rst_hole_punching_cannot_work():
    v = verdict([report("a", "198.18.0.2", REFUSED)], ME)
    assert v.status == "behind-nat" and v.hole_punching_viable is False
    assert "RST" in v.summary and "relayed links only" in v.summary


def test_a_nat_that_changes_source_ports_defeats_hole_punching():
    v = verdict([report("a", "198.18.0.2", TIMEOUT, port=61000, local=40000)], ME)
    assert v.nat["port_preserving"] is False and v.hole_punching_viable is False
    assert "port-randomising" in v.summary


def test_own_address_but_no_dial_back_is_a_firewall_not_a_nat():
    v = verdict([report("a", "10.99.1.2", REFUSED)], ME)
    assert v.status == "firewalled" and "firewall refuses" in v.summary


def test_public_observers_decide_over_lan_ones_and_no_answers_leave_it_unknown():
    lan_ok = report("lan", "10.99.1.2", OK)
    outside = report("pub", "198.18.0.2", TIMEOUT)
    assert verdict([lan_ok, outside], ME).status == "behind-nat"
    assert verdict([lan_ok], ME).summary.startswith("on a private network")
    assert verdict([], ME).status == "unknown"
    noroute = Report("a", "198.18.0.2", 1, 1, {"/ip4/198.18.0.2/tcp/4001": "error: OSError: no route"}, "", 1.0)
    assert verdict([noroute], ME).status == "unknown"


def test_failed_dials_are_classified_through_wrapping_exceptions():
    refused = ConnectionRefusedError(111, "Connection refused")
    try:
        try:
            raise ExceptionGroup("all attempts failed", [refused])
        except ExceptionGroup as g:
            raise OSError("all attempts to connect failed") from g
    except OSError as wrapped:
        assert classify(wrapped) == REFUSED
    assert classify(trio.TooSlowError()) == TIMEOUT
    assert classify(OSError(113, "No route to host")).startswith("error: ")


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


async def test_a_connected_peer_dials_back_on_a_new_connection_so_a_closed_port_is_refused(tmp_path):
    """py-libp2p's AutoNAT would answer OK for both: the asker is connected, so its 'dial' reuses the connection."""
    from swarmd.config import LOCAL_TEST
    from swarmd.net.identity import load_or_create_identity
    from swarmd.net.libp2p_network import Libp2pNetwork

    a = Libp2pNetwork(load_or_create_identity(tmp_path / "a"), ["/ip4/127.0.0.1/tcp/0"], timings=LOCAL_TEST)
    b = Libp2pNetwork(load_or_create_identity(tmp_path / "b"), ["/ip4/127.0.0.1/tcp/0"], timings=LOCAL_TEST)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        await nursery.start(b.run)
        await a.connect(b.peer_id, b.addresses())
        listening = int(a.bound_addresses()[0].split("/tcp/")[1].split("/")[0])
        shut = closed_port()
        stream = await a.open_stream(b.peer_id, PROTOCOL)
        with trio.fail_after(15):
            answer = await ask(stream, Request((listening, shut)))
        assert answer.ip == "127.0.0.1"
        assert answer.results == {f"/ip4/127.0.0.1/tcp/{listening}": OK, f"/ip4/127.0.0.1/tcp/{shut}": REFUSED}
        # listening on loopback only, a daemon asks no one: this machine alone can reach it, and does
        assert a.connectivity.verdict.status == "reachable" and "loopback only" in a.connectivity.verdict.summary
        assert a.connectivity.server.answered == 0 and b.connectivity.server.answered == 1
        nursery.cancel_scope.cancel()
