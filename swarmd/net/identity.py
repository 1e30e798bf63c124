"""The daemon's Ed25519 identity, kept in `$SWARMD_HOME/identity.key` so its peer id survives restarts.

The file holds the libp2p protobuf encoding of the private key (what go and js libp2p also write),
mode 0600. Signing and verifying gossip uses the same key: an Ed25519 peer id embeds its public key.
"""

from __future__ import annotations

import os
from pathlib import Path

from swarmd.errors import RemoteProtocolError, UserError

IDENTITY_FILE = "identity.key"


def load_or_create_identity(home: Path):  # -> libp2p.crypto.keys.KeyPair
    """The key pair stored in `home`, created (and written with mode 0600) on first use."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.keys import KeyPair
    from libp2p.crypto.serialization import deserialize_private_key

    path = Path(home) / IDENTITY_FILE
    if path.exists():
        try:
            private = deserialize_private_key(path.read_bytes())
        except Exception as e:
            raise UserError(f"{path} is not a libp2p private key ({e}); move it away to get a new identity") from None
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
        return KeyPair(private, private.get_public_key())
    path.parent.mkdir(parents=True, exist_ok=True)
    pair = create_new_key_pair()
    fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pair.private_key.serialize())
    os.replace(path.with_suffix(".tmp"), path)
    return pair


def peer_id_of(key_pair) -> str:
    from libp2p.peer.id import ID

    return ID.from_pubkey(key_pair.public_key).to_base58()


class Signer:
    """Signs bytes as this daemon; verifies bytes signed by any Ed25519 peer id."""

    def __init__(self, key_pair) -> None:
        self._private = key_pair.private_key
        self.peer_id = peer_id_of(key_pair)

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


def verify_signature(peer_id: str, data: bytes, signature: bytes) -> None:
    """Raise RemoteProtocolError unless `signature` over `data` was made by `peer_id`'s key."""
    from libp2p.peer.id import ID

    try:
        public = ID.from_base58(peer_id).extract_public_key()
    except Exception:
        public = None
    if public is None:
        raise RemoteProtocolError(f"peer id {peer_id[:16]}... does not embed a public key")
    try:
        ok = public.verify(data, signature)
    except Exception:
        ok = False
    if not ok:
        raise RemoteProtocolError(f"bad signature on a message from {short_id(peer_id)}")


def short_id(peer_id: str) -> str:
    """The last 6 characters: what status tables and logs show (the prefix is the same for all)."""
    return peer_id[-6:] if len(peer_id) > 6 else peer_id
