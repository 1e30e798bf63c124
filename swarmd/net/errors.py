"""What goes wrong between daemons, as the network seam reports it (no I/O here: sans-IO code raises them too)."""

from __future__ import annotations

from swarmd.errors import RemoteProtocolError


class PeerUnreachable(Exception):
    """Dialing a peer or opening a stream to it failed; the message says why, in one line."""


class StreamClosed(Exception):
    """The other side closed or reset the stream, or the connection under it broke."""


class BadFrame(StreamClosed, RemoteProtocolError):
    """The peer sent a frame that breaks the protocol (too large, wrong shape): the stream is given up and
    the peer gets a strike from the guard that serves it."""
