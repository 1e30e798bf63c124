"""The one framing of every stream between daemons: a 4-byte big-endian length, then that many bytes.

`FrameDecoder` splits bytes into frame bodies as they arrive (sans-IO); `swarmd.net.streams.read_frame` /
`write_frame` do the same on a `Stream` for handshakes and request/answer protocols. What a body holds is the
caller's business (CBOR messages for the actor transport and gossip, fixed structs for probes).
"""

from __future__ import annotations

import struct

from swarmd.net.errors import BadFrame

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 64 << 20


class FrameTooLarge(BadFrame):
    """A frame's length is over the receiver's limit: the stream cannot be followed past it."""

    code = "frame_too_large"


def frame(body: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """`body` with its length in front; refuses a body the receiver would refuse."""
    if len(body) > max_frame:
        raise ValueError(f"frame of {len(body)} bytes is over the {max_frame}-byte limit")
    return HEADER.pack(len(body)) + body


class FrameDecoder:
    """Feed it bytes as they arrive, take out whole frame bodies.

    A length over `max_frame` raises FrameTooLarge as soon as the 4-byte header is in, so a hostile length
    never makes us buffer its body.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._need: int | None = None  # body length of the frame being read, once its header is in

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def frame_length(self) -> int:
        """Body length of the frame being read (0 until its header is in)."""
        return self._need or 0

    @property
    def mid_frame(self) -> bool:
        """True while part of a frame has arrived (a slow rest is then a timeout, not idleness)."""
        return bool(self._buf)

    def next_frame(self) -> bytes | None:
        if self._need is None:
            if len(self._buf) < HEADER.size:
                return None
            (n,) = HEADER.unpack_from(self._buf)
            if n > self.max_frame:
                raise FrameTooLarge(f"frame of {n} bytes is over the {self.max_frame}-byte limit")
            self._need = n
        end = HEADER.size + self._need
        if len(self._buf) < end:
            return None
        with memoryview(self._buf) as view:
            body = bytes(view[HEADER.size : end])
        del self._buf[:end]
        self._need = None
        return body
