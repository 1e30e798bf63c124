"""What `swarmd join` accepts as access settings (key, allowlist, token), and how `swarmd status` shows them."""

from __future__ import annotations

import pytest

from swarmd.cli.main import main
from swarmd.cli.status import render
from swarmd.config import DaemonConfig
from swarmd.errors import UserError
from swarmd.net.access import load_access
from swarmd.net.swarm_key import SwarmKey, write_swarm_key
from tests.swarm.swarm_helpers import peer


def test_the_allowlist_comes_from_options_and_a_file_with_comments(tmp_path):
    listed = tmp_path / "peers.txt"
    listed.write_text(f"# the lab\n{peer(1)}\n\n{peer(2)}  # the GPU box\n")
    access = load_access(DaemonConfig(allow_peers=(peer(3),), allow_peers_file=listed))
    assert access.allow == {peer(1), peer(2), peer(3)} and not access.private
    assert load_access(DaemonConfig()).allow is None  # no allowlist: every peer (that holds the key)


def test_bad_access_settings_stop_the_daemon_before_it_starts_with_one_line(tmp_path, capsys):
    for args, why in (
        (["--swarm-key", str(tmp_path / "missing.key")], "does not exist"),
        (["--allow-peer", "not-a-peer-id"], "is not a peer id"),
        (["--allow-peers-file", str(tmp_path / "nope.txt")], "cannot read the allowlist"),
        (["--api", "0.0.0.0:0"], "needs --api-token"),
        (["--api-token", "short"], "at least 16"),
    ):
        assert main(["join", "--home", str(tmp_path / "home"), *args]) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err and err.count("\n") == 1, err


def test_status_shows_a_private_swarm_its_allowlist_and_the_penalty_box(tmp_path):
    from rich.console import Console

    key = SwarmKey.generate()
    write_swarm_key(tmp_path / "k", key)
    me = peer(1)
    doc = {"self": {"peer_id": me, "device": "CPU", "api": "http://127.0.0.1:1", "model": {"name": "m"}},
           "swarm": {"name": "lab", "private": True, "key_fingerprint": key.fingerprint, "allowlist": [peer(2)],
                     "api_token_required": True,
                     "penalised": [{"peer_id": peer(3), "seconds_left": 42.0, "reason": "flood: too much"}]},
           "admitted": True, "leader": me, "term": 1, "plan": None, "coverage": "no plan yet", "members": [],
           "refused": [], "plan_error": None}
    console = Console(width=160, record=True)
    console.print(render(doc))
    text = console.export_text()
    for expected in (f"private (swarm key {key.fingerprint})", "allowlist of 1 peer", "API needs a token",
                     "penalised peers", peer(3)[-6:], "42 s", "flood: too much"):
        assert expected in text, expected
    assert "OPEN" not in text


@pytest.mark.parametrize("listen", ["/ip4/127.0.0.1/udp/0/quic-v1", "/ip4/127.0.0.1/tcp/0/ws"])
def test_a_private_swarm_listens_on_tcp_only(listen):
    from swarmd.net.libp2p_network import Libp2pNetwork
    from tests.swarm.swarm_helpers import key

    with pytest.raises(UserError, match="TCP only"):
        Libp2pNetwork(key(1), [listen], swarm_key=SwarmKey.generate())
