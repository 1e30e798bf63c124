"""The head's session under random arrivals (tokens out of order and repeated, the prompt's log-probs, errors):
tokens go out once each in step order, nothing follows the end, scores come first when asked for, and the phase
changes only along its table (an illegal change raises LocalProtocolError)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.errors import LocalProtocolError
from swarmd.inference.head.session import (
    SESSION_TRANSITIONS,
    Failed,
    Finished,
    HeadSession,
    PromptScores,
    SessionEvent,
    SessionPhase,
    TokenOut,
)
from swarmd.wire import Error, Logprobs, Token, WireTensor

PROMPT = 3


class Letters:
    """A decoder: token t is one letter."""

    def feed(self, token_id: int) -> str:
        return chr(ord("a") + token_id % 26)

    def flush(self) -> str:
        return ""


def scores() -> Logprobs:
    return Logprobs("r", 0, WireTensor.from_array(np.zeros(PROMPT - 1, np.float32)),
                    WireTensor.from_array(np.zeros((PROMPT - 1, 1), np.int32)),
                    WireTensor.from_array(np.zeros((PROMPT - 1, 1), np.float32)))


arrivals = st.one_of(
    st.tuples(st.just("token"), st.integers(0, 9), st.integers(0, 30), st.sampled_from(["", "", "", "stop", "length"])),
    st.tuples(st.just("scores")),
    st.tuples(st.just("error")),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 8), st.booleans(), st.sampled_from([(), ("cd",)]), st.lists(arrivals, max_size=30))
def test_tokens_go_out_once_in_order_and_nothing_follows_the_end(max_tokens, want_scores, stops, sequence):
    if max_tokens == 0:
        want_scores = True  # scoring only
    s = HeadSession("r", PROMPT, max_tokens, Letters(), stops, want_prompt_scores=want_scores)
    out: list = []
    for kind, *args in sequence:
        if kind == "token":
            step, token, finish = args
            out += s.on_token(Token("r", step, token, finish=finish))
        elif kind == "scores":
            out += s.on_logprobs(scores())
        else:
            out += s.on_error(Error("stage_error", "it broke", request_id="r"))
        assert s.ended == (s.phase is not SessionPhase.STREAMING)
        assert (s.error is not None) == (s.phase is SessionPhase.FAILED)
    steps = [e.step for e in out if isinstance(e, TokenOut)]
    assert steps == list(range(len(steps))) and len(steps) <= max(max_tokens, 1)
    ends = [i for i, e in enumerate(out) if isinstance(e, Finished | Failed)]
    assert ends in ([], [len(out) - 1])  # at most one end, and nothing after it
    assert bool(ends) == s.done
    if want_scores and any(isinstance(e, TokenOut | Finished) for e in out):
        assert isinstance(out[0], PromptScores)
    if s.done:
        before = len(out)
        out += s.on_error(Error("late", "after the end", request_id="r")) + s.on_logprobs(scores())
        assert len(out) == before  # a request wholly given out takes nothing more


def test_an_illegal_transition_raises_a_local_protocol_error():
    s = HeadSession("r", PROMPT, 4, Letters())
    s.on_token(Token("r", 0, 1, finish="length"))
    assert s.phase is SessionPhase.FINISHED and s.done
    with pytest.raises(LocalProtocolError, match="request r: finish while finished"):
        s._fire(SessionEvent.FINISH)
    assert {old for old, _ in SESSION_TRANSITIONS} == {SessionPhase.STREAMING, SessionPhase.FINISHED}
