"""Who may reach a daemon, as its configuration says: the swarm key, the peer allowlist, the API token.

`load_access(config)` reads and checks all of it before anything listens, so a bad key file, a malformed
peer id or an API bound off loopback without a token is one clear line and no daemon.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmd.config import DaemonConfig, parse_api_address
from swarmd.errors import UserError
from swarmd.net.swarm_key import SwarmKey, load_swarm_key

MIN_API_TOKEN = 16  # characters: a token is a password that never needs to be typed


@dataclass(frozen=True)
class Access:
    swarm_key: SwarmKey | None
    allow: frozenset[str] | None
    api_token: str

    @property
    def private(self) -> bool:
        return self.swarm_key is not None

    def status(self) -> dict[str, Any]:
        """The access part of `swarmd status --json`'s "swarm" object."""
        return {
            "private": self.private,
            "key_fingerprint": self.swarm_key.fingerprint if self.swarm_key else None,
            "allowlist": sorted(self.allow) if self.allow is not None else None,
            "api_token_required": bool(self.api_token),
        }

    def describe(self) -> str:
        """One line for the log at start."""
        if self.swarm_key is not None:
            who = f"private swarm (swarm key {self.swarm_key.fingerprint})"
        else:
            who = "OPEN swarm: anyone who can reach the listen address can join (use --swarm-key to close it)"
        if self.allow is not None:
            who += f"; only {len(self.allow)} allowed peer id(s) may connect"
        return who


def load_access(config: DaemonConfig) -> Access:
    key = load_swarm_key(config.swarm_key) if config.swarm_key is not None else None
    allow = _allowlist(config.allow_peers, config.allow_peers_file)
    check_api_binding(config.api, config.api_token)
    return Access(key, allow, config.api_token)


def check_access(config: DaemonConfig) -> Access:
    """`load_access`, for the CLI to call before the daemon starts (errors are UserError)."""
    return load_access(config)


def check_api_binding(bind: str, token: str) -> None:
    """The API may listen off loopback only with a bearer token, and a token must not be guessable."""
    if token and len(token) < MIN_API_TOKEN:
        raise UserError(f"the API token is {len(token)} characters; use at least {MIN_API_TOKEN} "
                        "(for example the output of `openssl rand -hex 32`)")
    host, _ = parse_api_address(bind)
    if not token and not is_loopback(host):
        raise UserError(f"--api {bind} listens beyond this machine: it needs --api-token TOKEN (or "
                        "SWARMD_API_TOKEN) so that only clients holding the token can use it")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _allowlist(peers: tuple[str, ...], path: Path | None) -> frozenset[str] | None:
    items = list(peers)
    if path is not None:
        try:
            text = Path(path).expanduser().read_text()
        except OSError as e:
            raise UserError(f"cannot read the allowlist {path}: {e.strerror}") from None
        for line in text.splitlines():
            entry = line.split("#", 1)[0].strip()
            if entry:
                items.append(entry)
    if not items and path is None:
        return None
    for peer in items:
        _check_peer_id(peer)
    return frozenset(items)


def _check_peer_id(peer: str) -> None:
    from libp2p.peer.id import ID

    try:
        ok = ID.from_base58(peer).extract_public_key() is not None
    except Exception:
        ok = False
    if not ok:
        raise UserError(f"allowed peer {peer!r} is not a peer id (the 'Peer ID: ...' line a daemon prints)")
