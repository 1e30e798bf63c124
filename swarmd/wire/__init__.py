"""The wire format: length-prefixed CBOR frames, tensors, and the messages actors exchange."""

from swarmd.net.framing import DEFAULT_MAX_FRAME, FrameDecoder
from swarmd.wire.codec import WireError, WireTensor
from swarmd.wire.messages import (
    Ack,
    Cancel,
    Draft,
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
    Verified,
    decode,
    encode,
)

__all__ = [
    "DEFAULT_MAX_FRAME",
    "Ack",

    "Cancel",
    "Draft",
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
    "Verified",
    "WireError",
    "WireTensor",
    "decode",
    "encode",
]
