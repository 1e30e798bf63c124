"""A dial map: every outbound TCP connection to one address goes to another (`swarmd join --dial-map A=B`).

`swarmd cluster up` runs a fleet on one machine and sends the traffic between regions through a link emulator:
each daemon dials a peer of another region at the emulator's port that leads to that peer with the region pair's
delay, and a peer of its own region directly. The map sits where every outbound connection of the process is
made, trio's socket factory: libp2p's TCP transport and the TLS data plane both open their connections through
`trio.open_tcp_stream`, so one rule covers both, and any later dialer too, without either knowing. The factory
is per `trio.run`, so the map applies to the whole daemon process.

    dial_map = DialMap.parse(["127.0.0.1:4001=127.0.0.1:7001"])
    install_dial_map(dial_map)        # inside trio.run, before the network starts
"""

from __future__ import annotations

import ipaddress
import logging
import socket as stdlib_socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import trio

# trio's own socket class: subclassed so that only `connect` changes (trio exposes no public way to wrap it).
from trio._socket import _SocketType

from swarmd.errors import UserError

log = logging.getLogger(__name__)

Address = tuple[str, int]


def _address(text: str, entry: str) -> Address:
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise UserError(f"--dial-map {entry!r}: {text!r} is not IP:PORT (an IP address, not a host name)") from None
    if not sep or not 0 < number < 65536:
        raise UserError(f"--dial-map {entry!r}: {text!r} has no valid port")
    return str(ip), number


@dataclass(frozen=True)
class DialMap:
    routes: dict[Address, Address] = field(default_factory=dict)

    @staticmethod
    def parse(entries: Sequence[str]) -> DialMap:
        """'HOST:PORT=HOST:PORT' entries; a one-line UserError for a bad one or a second rule for one address."""
        routes: dict[Address, Address] = {}
        for entry in entries:
            src, sep, dst = entry.partition("=")
            if not sep:
                raise UserError(f"--dial-map {entry!r}: expected FROM=TO, e.g. 127.0.0.1:4001=127.0.0.1:7001")
            key = _address(src, entry)
            if key in routes:
                raise UserError(f"--dial-map: {src.strip()} is mapped twice")
            routes[key] = _address(dst, entry)
        return DialMap(routes)

    def route(self, address: Any) -> Any:
        """Where a connection to `address` (a socket address tuple) really goes."""
        if isinstance(address, tuple) and len(address) >= 2:
            to = self.routes.get((str(address[0]), int(address[1])))
            if to is not None:
                return to if len(address) == 2 else (*to, *address[2:])  # IPv6: flow info and scope kept
        return address

    def __bool__(self) -> bool:
        return bool(self.routes)


class _MappedSocket(_SocketType):
    def __init__(self, sock: stdlib_socket.socket, dial_map: DialMap) -> None:
        super().__init__(sock)
        self._dial_map = dial_map

    async def connect(self, address: Any) -> None:
        routed = self._dial_map.route(address)
        if routed is not address:
            log.debug("dial %s:%s goes to %s:%s (dial map)", address[0], address[1], routed[0], routed[1])
        await super().connect(routed)


class _Factory(trio.abc.SocketFactory):
    def __init__(self, dial_map: DialMap) -> None:
        self.dial_map = dial_map

    def socket(self, family: int = stdlib_socket.AF_INET, type: int = stdlib_socket.SOCK_STREAM,
               proto: int = 0) -> trio.socket.SocketType:
        sock = stdlib_socket.socket(family, type, proto)
        if family in (stdlib_socket.AF_INET, stdlib_socket.AF_INET6) and type == stdlib_socket.SOCK_STREAM:
            return cast("trio.socket.SocketType", _MappedSocket(sock, self.dial_map))
        return trio.socket.from_stdlib_socket(sock)


def install_dial_map(dial_map: DialMap) -> None:
    """From now on in this `trio.run`, every trio socket connects through `dial_map`."""
    if dial_map:
        trio.socket.set_custom_socket_factory(_Factory(dial_map))
        log.info("dial map: %s", ", ".join(f"{a[0]}:{a[1]} -> {b[0]}:{b[1]}" for a, b in dial_map.routes.items()))
