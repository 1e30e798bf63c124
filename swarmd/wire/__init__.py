"""The wire format: length-prefixed CBOR frames, tensors, and the messages actors exchange."""

from swarmd.net.framing import DEFAULT_MAX_FRAME, FrameDecoder
from swarmd.wire.codec import WireError, WireTensor
from swarmd.wire.messages import (
    Ack,
    Cancel,
    Envelope,
    Error,
    ExpertBatch,
    ExpertResult,
    Forward,
    Hello,
    Logprobs,
    Message,
    Ping,
    Pong,
    Sampling,
    Token,
    TraceQuery,
    TraceSpans,
    decode,
    encode,
)

__all__ = [
    "DEFAULT_MAX_FRAME",
    "Ack",

    "Cancel",
    "Envelope",
    "Error",
    "ExpertBatch",
    "ExpertResult",
    "Forward",
    "FrameDecoder",
    "Hello",
    "Logprobs",
    "Message",
    "Ping",
    "Pong",
    "Sampling",
    "Token",
    "TraceQuery",
    "TraceSpans",
    "WireError",
    "WireTensor",
    "decode",
    "encode",
]
