"""What a daemon advertises and what it dials: no wildcard, no LAN address to the outside, relays when NATed."""

from __future__ import annotations

import ipaddress

from swarmd.net.addresses import (
    Scope,
    advertised,
    circuit_address,
    dialable,
    expand,
    relay_of,
    scope_of,
    strip_peer,
    with_peer,
)
from swarmd.net.connectivity import data_plane_config

HOME_IPS = ["127.0.0.1", "192.168.1.20", "fe80::1"]
PUBLIC_IPS = ["127.0.0.1", "198.18.0.1"]
R = "12D3KooWRelay"
ME = "12D3KooWMe"


def test_scopes_tell_loopback_lan_and_internet_apart_and_the_benchmark_range_counts_as_internet():
    assert scope_of("0.0.0.0") is Scope.UNUSABLE and scope_of("fe80::1") is Scope.UNUSABLE
    assert scope_of("127.0.0.1") is Scope.LOOPBACK and scope_of("::1") is Scope.LOOPBACK
    for ip in ("10.1.2.3", "172.16.0.9", "192.168.1.20", "100.64.0.1", "fd00::5"):
        assert scope_of(ip) is Scope.PRIVATE, ip
    for ip in ("198.18.0.1", "198.19.255.1", "8.8.8.8", "2001:db8::1"):
        assert scope_of(ip) is Scope.PUBLIC, ip


def test_a_wildcard_listen_address_becomes_the_interfaces_addresses_never_0000():
    assert expand("/ip4/0.0.0.0/tcp/4001", HOME_IPS) == ["/ip4/127.0.0.1/tcp/4001", "/ip4/192.168.1.20/tcp/4001"]
    assert expand("/ip4/10.0.0.1/tcp/4001", HOME_IPS) == ["/ip4/10.0.0.1/tcp/4001"]
    adv = advertised(["/ip4/0.0.0.0/tcp/4001"], HOME_IPS)
    assert adv.addresses == ("/ip4/192.168.1.20/tcp/4001",)  # the widest scope it has: its LAN
    assert "0.0.0.0" not in " ".join(adv.addresses)


def test_a_public_interface_is_advertised_alone_and_loopback_only_when_nothing_else_exists():
    assert advertised(["/ip4/0.0.0.0/tcp/4001"], PUBLIC_IPS).addresses == ("/ip4/198.18.0.1/tcp/4001",)
    only_lo = advertised(["/ip4/127.0.0.1/tcp/4001"], PUBLIC_IPS)
    assert only_lo.addresses == ("/ip4/127.0.0.1/tcp/4001",) and "loopback" in only_lo.reason


def test_behind_nat_lan_addresses_are_withheld_once_seen_from_outside_and_relay_addresses_take_their_place():
    circuit = circuit_address("/ip4/198.18.0.1/tcp/4001", R, ME)
    adv = advertised(["/ip4/0.0.0.0/tcp/4001"], HOME_IPS, circuits=[circuit], seen_from_public=True,
                     reachable=False)
    assert adv.addresses == (circuit,)
    assert "withheld" in adv.reason and "relay" in adv.reason


def test_a_forwarded_port_verified_by_dial_back_is_advertised_and_relays_are_dropped_once_reachable():
    adv = advertised(["/ip4/0.0.0.0/tcp/4001"], HOME_IPS, verified=["/ip4/198.18.0.2/tcp/4001"],
                     circuits=[circuit_address("/ip4/198.18.0.1/tcp/4001", R, ME)], seen_from_public=True,
                     reachable=True)
    assert adv.addresses == ("/ip4/198.18.0.2/tcp/4001",)


def test_announce_wins_over_everything():
    adv = advertised(["/ip4/0.0.0.0/tcp/4001"], HOME_IPS, announce=["/dns4/gpu.example/tcp/4001"],
                     verified=["/ip4/198.18.0.2/tcp/4001"])
    assert adv.addresses == ("/dns4/gpu.example/tcp/4001",)


def test_a_dialler_skips_private_addresses_off_its_networks_wildcards_and_link_local():
    mine = [ipaddress.ip_network("10.99.2.0/24"), ipaddress.ip_network("127.0.0.0/8")]
    addrs = ["/ip4/10.99.1.2/tcp/4001/p2p/X", "/ip4/10.99.2.7/tcp/4001/p2p/X", "/ip4/0.0.0.0/tcp/4001/p2p/X",
             "/ip4/198.18.0.1/tcp/4001/p2p/X", "/ip6/fe80::1/tcp/4001/p2p/X",
             f"/ip4/198.18.0.1/tcp/4001/p2p/{R}/p2p-circuit/p2p/X"]
    direct, circuits = dialable(addrs, mine)
    assert direct == ["/ip4/10.99.2.7/tcp/4001/p2p/X", "/ip4/198.18.0.1/tcp/4001/p2p/X"]
    assert circuits == [f"/ip4/198.18.0.1/tcp/4001/p2p/{R}/p2p-circuit/p2p/X"]


def test_circuit_addresses_name_the_relay_and_the_peer():
    c = circuit_address("/ip4/198.18.0.1/tcp/4001", R, ME)
    assert c == f"/ip4/198.18.0.1/tcp/4001/p2p/{R}/p2p-circuit/p2p/{ME}"
    assert relay_of(c) == ("/ip4/198.18.0.1/tcp/4001", R)
    assert strip_peer(with_peer("/ip4/1.2.3.4/tcp/5", ME)) == "/ip4/1.2.3.4/tcp/5"


def test_the_data_plane_listens_where_libp2p_listens_and_names_the_announced_host():
    lan = data_plane_config(["/ip4/0.0.0.0/tcp/4001"], ())
    assert (lan.bind_host, lan.announce_host) == ("0.0.0.0", "")
    fixed = data_plane_config(["/ip4/10.0.0.2/tcp/4001"], ["/ip4/198.18.0.9/tcp/4001"], port=4002)
    assert (fixed.bind_host, fixed.bind_port, fixed.announce_host) == ("10.0.0.2", 4002, "198.18.0.9")
    assert data_plane_config(["/ip4/127.0.0.1/tcp/0"], ()).bind_host == "127.0.0.1"


def test_the_data_plane_listens_beside_a_listener_on_any_free_port():
    # swarmd join's default listen address: the data plane must not fall back to loopback for it
    assert data_plane_config(["/ip4/0.0.0.0/tcp/0"], ()).bind_host == "0.0.0.0"
    assert data_plane_config(["/ip4/10.71.0.3/tcp/0"], ()).bind_host == "10.71.0.3"


def test_the_data_plane_is_offered_only_where_a_peers_dial_can_arrive():
    from swarmd.net.connectivity import data_plane_refusal
    from swarmd.net.reachability import UNKNOWN, Verdict

    lan = [ipaddress.ip_network("10.99.1.0/24")]
    nat = Verdict("behind-nat", "behind NAT", data_plane=False)
    public = Verdict("reachable", "public", data_plane=True)
    unchecked = Verdict("reachable", "public", data_plane=None)
    assert data_plane_refusal(("127.0.0.1", 5), nat, lan) == ""  # this machine
    assert data_plane_refusal(("10.99.1.7", 5), nat, lan) == ""  # its LAN
    assert "behind NAT" in data_plane_refusal(("198.18.0.3", 5), nat, lan)  # a peer outside: the NAT eats its SYN
    assert data_plane_refusal(("198.18.0.3", 5), public, lan) == ""
    assert data_plane_refusal(("198.18.0.3", 5), unchecked, lan) == ""  # reachable; its port not checked yet
    assert data_plane_refusal(("198.18.0.3", 5), UNKNOWN, lan) != ""
    assert "relay" in data_plane_refusal(None, public, lan)
