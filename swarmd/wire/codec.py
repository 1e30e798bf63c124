"""CBOR bodies and tensors on the wire.

A frame (`swarmd.net.framing`) holds one CBOR value. Decoding is strict:
no CBOR tags (cbor2 would otherwise build datetimes, regexes, shared references), no indefinite lengths,
no duplicate map keys, bounded nesting, no trailing bytes. Anything else is a `WireError` with a short code
that is sent back to the peer.

Tensors are `{dtype, shape, data}` with raw little-endian bytes. Activations travel in their compute dtype
unless a wire dtype is configured (float16 or bfloat16, lossy: see docs/BENCHMARKS.md for the error).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import cbor2
import numpy as np

from swarmd.errors import LocalProtocolError, RemoteProtocolError

MAX_DEPTH = 8  # our messages nest at most 4 deep (envelope, body, tensor, shape)
MAX_NDIM = 4

# Wire dtype name -> numpy dtype of the raw bytes (little-endian). bfloat16 travels as its 16 raw bits.
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})
LOSSY_WIRE_DTYPES = frozenset({"float16", "bfloat16"})
FLOAT16_MAX = 65504.0


class WireError(RemoteProtocolError):
    """A peer sent bytes we refuse. `code` is a short stable identifier, `message` says what was wrong."""

    def __init__(self, code: str, message: str, *, request_id: str = "", seq: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.seq = seq  # the frame's sequence number, once the envelope was readable


# --- CBOR ---------------------------------------------------------------------------------------------------


class _RejectEveryTag(Mapping[int, Any]):
    """A `semantic_decoders` mapping that claims every tag and refuses it."""

    def __getitem__(self, tag: int) -> Any:
        def refuse(*_args: Any) -> Any:
            raise cbor2.CBORDecodeError(f"CBOR tag {tag} is not allowed")

        return refuse

    def __contains__(self, tag: object) -> bool:
        return True

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 0


def _refuse_tag(tag: cbor2.CBORTag, _immutable: bool) -> Any:  # unreachable while _REJECT_TAGS claims all
    raise cbor2.CBORDecodeError(f"CBOR tag {tag.tag} is not allowed")


_REJECT_TAGS = _RejectEveryTag()


def decode_cbor(body: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """One strict CBOR value from `body` (all of it), or WireError('not_cbor')."""
    fp = io.BytesIO(body)
    try:
        decoder = cbor2.CBORDecoder(
            fp,
            tag_hook=_refuse_tag,
            semantic_decoders=_REJECT_TAGS,
            max_depth=max_depth,
            allow_indefinite=False,
            allow_duplicate_keys=False,
            strict_hashable_types=True,
        )
        value = decoder.decode()
    except (cbor2.CBORError, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise WireError("not_cbor", f"frame is not valid CBOR ({e})") from None
    if fp.tell() != len(body):
        raise WireError("not_cbor", f"{len(body) - fp.tell()} bytes after the CBOR value")
    return value


def encode_cbor(value: Any) -> bytes:
    try:
        return cbor2.dumps(value)
    except cbor2.CBOREncodeError as e:
        raise LocalProtocolError(f"cannot encode {type(value).__name__} as CBOR: {e}") from e


# --- tensors --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WireTensor:
    """A tensor as it travels: dtype name, shape, raw little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        # A locally built tensor that does not add up is our bug; from_cbor checks peers' tensors first.
        if self.dtype not in DTYPES or _expected_nbytes(self.dtype, self.shape) != len(self.data):
            raise LocalProtocolError(f"inconsistent tensor {self.dtype}{list(self.shape)} with {len(self.data)} B")

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @classmethod
    def from_array(cls, array: np.ndarray, wire_dtype: str | None = None) -> WireTensor:
        """Encode `array`. `wire_dtype=None` keeps its dtype (lossless); float16/bfloat16 round floats."""
        name = wire_dtype or _dtype_name(array.dtype)
        if name not in DTYPES:
            raise LocalProtocolError(f"dtype {name!r} cannot travel; use one of {sorted(DTYPES)}")
        if name in FLOAT_DTYPES and array.dtype.kind != "f":
            raise LocalProtocolError(f"cannot send {array.dtype} data as {name}")
        if name == "bfloat16":
            raw = _float32_to_bfloat16_bits(np.asarray(array, dtype=np.float32))
        elif name == "float16" and array.dtype != np.float16 and array.size:
            # Residual streams carry outliers in the tens of thousands (SmolLM2: 2.3e4); past 65504 float16
            # would turn them into inf without a word.
            peak = float(np.nanmax(np.abs(np.where(np.isinf(array), 0, array)), initial=0.0))
            if peak > FLOAT16_MAX:
                raise LocalProtocolError(f"values up to {peak:.4g} do not fit float16 (max {FLOAT16_MAX}); "
                                         "send this tensor as float32 or bfloat16")
            raw = np.asarray(array, dtype=DTYPES[name])
        else:
            raw = np.asarray(array, dtype=DTYPES[name])
        return cls(name, tuple(int(d) for d in array.shape), np.ascontiguousarray(raw).tobytes())

    def to_array(self, dtype: str | np.dtype | None = None) -> np.ndarray:
        """Decode to numpy; `dtype` converts (e.g. a float16 wire tensor back to the compute float32)."""
        raw = np.frombuffer(self.data, dtype=DTYPES[self.dtype]).reshape(self.shape)
        array = _bfloat16_bits_to_float32(raw) if self.dtype == "bfloat16" else raw
        if dtype is not None and array.dtype != np.dtype(dtype):
            array = array.astype(dtype)
        return array

    def to_cbor(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    @classmethod
    def from_cbor(cls, value: Any, what: str = "tensor") -> WireTensor:
        """Validate a peer's `{dtype, shape, data}` map; WireError('bad_tensor') if it does not add up."""
        if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
            raise WireError("bad_tensor", f"{what} must be a map with exactly dtype, shape and data")
        dtype, shape, data = value["dtype"], value["shape"], value["data"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise WireError("bad_tensor", f"{what} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise WireError("bad_tensor", f"{what} shape must be a list of at most {MAX_NDIM} sizes")
        if not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
            raise WireError("bad_tensor", f"{what} shape {shape!r} is not a list of sizes")
        if not isinstance(data, bytes):
            raise WireError("bad_tensor", f"{what} data must be a byte string")
        expected = _expected_nbytes(dtype, tuple(shape))
        if expected != len(data):
            raise WireError("bad_tensor", f"{what} {dtype}{shape} needs {expected} bytes, got {len(data)}")
        return cls(dtype, tuple(shape), data)


def _expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize


def _dtype_name(dtype: np.dtype) -> str:
    for name, wire in DTYPES.items():
        if name != "bfloat16" and wire.kind == dtype.kind and wire.itemsize == dtype.itemsize:
            return name
    raise LocalProtocolError(f"dtype {dtype} cannot travel; use one of {sorted(DTYPES)}")


def _float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, keeping NaN a NaN (plain rounding could carry a NaN's payload into inf)."""
    bits = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype("<u2")


def _bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype("<u4") << 16).view("<f4")
