"""The swarm key: a 32-byte pre-shared secret that makes a swarm private.

The file has libp2p's private-network format (what go-ipfs and js-libp2p write as `swarm.key`):

    /key/swarm/psk/1.0.0/
    /base16/
    <64 hex digits>

`/base64/` and `/bin/` bodies are read too. The file must be readable by its owner only (mode 0600, as ssh
insists for private keys): a key others can read is a swarm others can join. The fingerprint names a key in
status and logs without revealing it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from swarmd.errors import UserError

CODEC = "/key/swarm/psk/1.0.0/"
KEY_BYTES = 32
_FINGERPRINT_DOMAIN = b"swarmd swarm key fingerprint v1\x00"


@dataclass(frozen=True)
class SwarmKey:
    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise ValueError(f"a swarm key is {KEY_BYTES} bytes, not {len(self.secret)}")

    def __repr__(self) -> str:  # never print the secret by accident
        return f"SwarmKey(fingerprint={self.fingerprint})"

    @staticmethod
    def generate() -> SwarmKey:
        return SwarmKey(secrets.token_bytes(KEY_BYTES))

    @property
    def hex(self) -> str:
        """What py-libp2p's `new_host(psk=...)` takes."""
        return self.secret.hex()

    @property
    def fingerprint(self) -> str:
        """16 hex digits that tell keys apart; they reveal nothing usable about the key."""
        return hashlib.sha256(_FINGERPRINT_DOMAIN + self.secret).hexdigest()[:16]

    def to_text(self) -> str:
        return f"{CODEC}\n/base16/\n{self.hex}\n"

    @staticmethod
    def from_text(text: str, source: str = "swarm key") -> SwarmKey:
        lines = [line.strip() for line in text.strip().splitlines()]
        if len(lines) < 3 or lines[0] != CODEC:
            raise UserError(f"{source} is not a swarm key: it must start with {CODEC} "
                            "(make one with `swarmd keygen --out FILE`)")
        encoding, body = lines[1], "".join(lines[2:])
        try:
            if encoding == "/base16/":
                secret = bytes.fromhex(body)
            elif encoding == "/base64/":
                secret = base64.b64decode(body, validate=True)
            elif encoding == "/bin/":
                secret = body.encode("latin-1")
            else:
                raise UserError(f"{source}: unknown encoding {encoding!r} (expected /base16/, /base64/ or /bin/)")
        except (ValueError, binascii.Error):
            raise UserError(f"{source}: the key is not valid {encoding.strip('/')}") from None
        if len(secret) != KEY_BYTES:
            raise UserError(f"{source}: the key is {len(secret)} bytes, a swarm key is {KEY_BYTES}")
        return SwarmKey(secret)


def load_swarm_key(path: Path) -> SwarmKey:
    """Read a swarm key file, refusing one that others can read (UserError, one line)."""
    path = Path(path).expanduser()
    try:
        st = path.stat()
        text = path.read_text(encoding="latin-1")
    except FileNotFoundError:
        raise UserError(f"swarm key {path} does not exist (make one with `swarmd keygen --out {path}`)") from None
    except OSError as e:
        raise UserError(f"cannot read swarm key {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(f"swarm key {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                        f"run `chmod 600 {path}`")
    return SwarmKey.from_text(text, source=f"swarm key {path}")


def write_swarm_key(path: Path, key: SwarmKey, *, overwrite: bool = False) -> None:
    """Write `key` to `path` with mode 0600 (created that way, never world-readable for a moment)."""
    path = Path(path).expanduser()
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise UserError(f"{path} exists; pass --force to replace it (every member then needs the new key)") from None
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # O_TRUNC keeps an existing file's mode
        f.write(key.to_text())
