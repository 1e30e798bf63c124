"""Swarm keys: `swarmd keygen` writes one only its owner can read; daemons refuse keys others can read."""

from __future__ import annotations

import base64
import os
import stat

import pytest

from swarmd.cli.main import main
from swarmd.errors import UserError
from swarmd.net.swarm_key import SwarmKey, load_swarm_key, write_swarm_key


def test_keygen_writes_a_key_readable_by_its_owner_only_and_never_overwrites_one(tmp_path, capsys):
    path = tmp_path / "swarm.key"
    assert main(["keygen", "--out", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = load_swarm_key(path)
    assert key.fingerprint in capsys.readouterr().out
    assert path.read_text().splitlines()[:2] == ["/key/swarm/psk/1.0.0/", "/base16/"]

    assert main(["keygen", "--out", str(path)]) == 2
    assert "--force" in capsys.readouterr().err and load_swarm_key(path) == key
    os.chmod(path, 0o644)
    assert main(["keygen", "--out", str(path), "--force"]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and load_swarm_key(path) != key


def test_a_key_others_can_read_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "swarm.key"
    write_swarm_key(path, SwarmKey.generate())
    os.chmod(path, 0o640)
    with pytest.raises(UserError, match="chmod 600"):
        load_swarm_key(path)


@pytest.mark.parametrize("body", [
    "/key/swarm/psk/1.0.0/\n/base16/\n{hex}\n",
    "/key/swarm/psk/1.0.0/\r\n/base64/\r\n{b64}\r\n",
])
def test_keys_written_by_other_libp2p_tools_are_read(tmp_path, body):
    secret = bytes(range(32))
    path = tmp_path / "swarm.key"
    path.write_text(body.format(hex=secret.hex(), b64=base64.b64encode(secret).decode()))
    path.chmod(0o600)
    assert load_swarm_key(path).secret == secret


@pytest.mark.parametrize(("text", "why"), [
    ("", "not a swarm key"),
    ("/key/swarm/psk/1.0.0/\n/base16/\nzz\n", "not valid base16"),
    ("/key/swarm/psk/1.0.0/\n/base16/\nabcd\n", "2 bytes"),
    ("/key/swarm/psk/1.0.0/\n/base58/\nabcd\n", "unknown encoding"),
])
def test_a_file_that_is_not_a_swarm_key_is_one_clear_line(tmp_path, text, why):
    path = tmp_path / "swarm.key"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(UserError, match=why):
        load_swarm_key(path)
    with pytest.raises(UserError, match="does not exist"):
        load_swarm_key(tmp_path / "missing.key")


def test_the_fingerprint_tells_keys_apart_and_the_repr_hides_the_secret():
    a, b = SwarmKey.generate(), SwarmKey.generate()
    assert a.fingerprint != b.fingerprint and len(a.fingerprint) == 16
    assert a.hex not in repr(a) and a.fingerprint in repr(a)
