"""The one framing of every stream: a 4-byte length, then the body."""

from __future__ import annotations

import cbor2
import pytest

from swarmd.net.framing import HEADER, FrameDecoder, FrameTooLarge, frame


def test_frame_decoder_reassembles_frames_split_anywhere():
    bodies = [b"a", b"", b"x" * 70_000, cbor2.dumps({"k": 1})]
    stream = b"".join(frame(b) for b in bodies)
    for chunk in (1, 3, 4, 5, 1000, len(stream)):
        dec, out = FrameDecoder(), []
        for i in range(0, len(stream), chunk):
            dec.feed(stream[i : i + chunk])
            while (body := dec.next_frame()) is not None:
                out.append(body)
        assert out == bodies
        assert not dec.mid_frame


def test_an_oversized_length_is_refused_from_the_header_alone():
    dec = FrameDecoder(max_frame=1024)
    dec.feed(HEADER.pack(1025))
    with pytest.raises(FrameTooLarge) as info:
        dec.next_frame()
    assert info.value.code == "frame_too_large"


def test_framing_an_oversized_body_is_refused():
    with pytest.raises(ValueError):
        frame(b"x" * 11, max_frame=10)
