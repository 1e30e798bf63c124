"""What `swarmd status --json` says about each peer's link, and why."""

from __future__ import annotations

from swarmd.net.link_paths import PATHS, LinkFacts, describe, kinds_for_descriptor


def test_activations_on_the_tls_data_plane_say_where_it_listens():
    e = describe(LinkFacts("P", frozenset({"direct"}), plane_out=("data-plane", "198.18.0.1:4567")))
    assert e == {"peer_id": "P", "path": "data-plane", "reason": "activations to it on the TLS data plane "
                                                                  "(198.18.0.1:4567)"}
    assert describe(LinkFacts("P", frozenset({"direct"}), plane_in=1))["path"] == "data-plane"


def test_a_hole_punched_connection_is_direct_and_says_why_the_data_plane_is_not_used():
    e = describe(LinkFacts("P", frozenset({"direct"}), plane_out=("libp2p", "it did not offer its data plane"),
                           punch={"state": "direct", "successes": 1}))
    assert e["path"] == "direct" and e["reason"].startswith("hole-punched direct connection; data plane not used")


def test_a_relayed_link_names_its_relay_and_the_hole_punching_record():
    e = describe(LinkFacts("P", frozenset({"relayed"}), relay="12D3KooWRelayRelayXYZ123",
                           punch={"state": "waiting", "failures": 3, "last_error": "no direct connection came up",
                                  "next_attempt_in_s": 40.0}))
    assert e["path"] == "relayed"
    assert "through relay" in e["reason"] and "failed 3 times" in e["reason"] and "next try in 40 s" in e["reason"]


def test_no_connection_is_none_with_the_dial_error_and_the_descriptor_leaves_it_out():
    e = describe(LinkFacts("P", dial_error="no answer within 3 s"))
    assert e == {"peer_id": "P", "path": "none", "reason": "not connected: no answer within 3 s"}
    assert set(PATHS) == {"data-plane", "direct", "relayed", "none"}
    assert kinds_for_descriptor([e, {"peer_id": "Q", "path": "relayed", "reason": ""}]) == {"Q": "relayed"}


def test_any_networks_link_paths_make_the_status_entries_and_a_member_without_a_connection_is_none():
    from swarmd.net.link_paths import links_document
    from swarmd.net.seam import LinkInfo, LinkPath

    paths = {"Q": LinkInfo(LinkPath.RELAYED, "through 123456"), "R": LinkInfo(LinkPath.MEMORY, "in-memory twin")}
    assert links_document(paths, ["ME", "Q", "S"], "ME") == [
        {"peer_id": "Q", "path": "relayed", "reason": "through 123456"},
        {"peer_id": "R", "path": "memory", "reason": "in-memory twin"},
        {"peer_id": "S", "path": "none", "reason": "not connected"},
    ]


def test_the_address_a_served_stream_came_from_is_found_under_the_seams_wrappers():
    from swarmd.net.reachability import remote_of
    from swarmd.net.stream_guard import TimedStream
    from swarmd.net.streams import Libp2pStream

    class Conn:
        def get_transport_addresses(self):
            return ["/ip4/198.18.0.2/tcp/4001"]

    class Raw:
        muxed_conn = Conn()

        def get_remote_address(self):
            return ("198.18.0.2", 4001)

    assert remote_of(TimedStream(Libp2pStream(Raw()), 5.0)) == ("198.18.0.2", 4001)
    Raw.muxed_conn.get_transport_addresses = lambda: ["/ip4/198.18.0.1/tcp/4001/p2p/R/p2p-circuit"]
    assert remote_of(Libp2pStream(Raw())) is None  # relayed: no address of the peer's own to dial
