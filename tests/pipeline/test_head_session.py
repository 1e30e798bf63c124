"""The head's view of a request: tokens back in order, text as it becomes final, and how it ends (sans-IO)."""

from __future__ import annotations

import numpy as np
import pytest

from models.text.tokenizer import Tokenizer
from swarmd.inference.head.session import Failed, Finished, HeadSession, PromptScores, TokenOut
from swarmd.wire import Error, Logprobs, Token, WireTensor

IM_END = 2  # SmolLM2's end of turn


@pytest.fixture(scope="module")
def tok(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


def session(tok, max_tokens=8, stops=(), scores=False) -> HeadSession:
    return HeadSession("r", 3, max_tokens, tok.stream_decoder(), stops, want_prompt_scores=scores)


def tokens(tok, text: str) -> list[int]:
    return tok.encode(text)


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenOut | Finished))


def test_tokens_that_arrive_out_of_order_or_twice_come_out_once_in_order(tok):
    s = session(tok)
    ids = tokens(tok, " Paris is nice")
    assert s.on_token(Token("r", 1, ids[1])) == []  # step 0 not in yet
    first = s.on_token(Token("r", 0, ids[0]))
    assert [e.step for e in first] == [0, 1]
    assert s.on_token(Token("r", 0, ids[0])) == [] and s.on_token(Token("r", 1, ids[1])) == []
    rest = s.on_token(Token("r", 2, ids[2], finish="length"))
    assert text_of(first + rest) == " Paris is nice" and isinstance(rest[-1], Finished)
    assert s.done and s.finish_reason == "length" and s.completion_tokens == 3 and s.tokens == ids[:3]


def test_an_end_of_turn_token_ends_the_text_without_being_part_of_it(tok):
    s = session(tok)
    events = s.on_token(Token("r", 0, tokens(tok, " Hi")[0])) + s.on_token(Token("r", 1, IM_END, finish="stop"))
    assert text_of(events) == " Hi" and events[-1] == Finished("stop")
    assert s.completion_tokens == 2  # the end token counts, as in swarmd run


def test_a_stop_string_split_over_tokens_cuts_the_text_before_it(tok):
    s = session(tok, stops=("END",))
    events = []
    for step, t in enumerate(tokens(tok, " one two EN")):
        events += s.on_token(Token("r", step, t))
    assert not s.done and "EN" not in text_of(events)  # held back: it may become END
    events += s.on_token(Token("r", 3, tokens(tok, "D")[0]))
    assert text_of(events) == " one two " and isinstance(events[-1], Finished) and s.finish_reason == "stop"
    assert s.on_token(Token("r", 4, 5)) == []  # nothing after the end


def test_tokens_wait_for_the_prompt_scores_when_those_were_asked_for(tok):
    s = session(tok, scores=True)
    early = s.on_token(Token("r", 0, tokens(tok, " Hi")[0], finish="length"))
    assert early == [] and not s.done
    scores = Logprobs("r", 0, WireTensor.from_array(np.array([-1.0, -2.0], np.float32)),
                      WireTensor.from_array(np.array([[5, 6], [7, 8]], np.int32)),
                      WireTensor.from_array(np.array([[-0.25, -0.5], [-0.75, -1.5]], np.float32)))
    events = s.on_logprobs(scores)
    assert isinstance(events[0], PromptScores) and events[0].top[1] == ((7, -0.75), (8, -1.5))
    assert isinstance(events[1], TokenOut) and isinstance(events[-1], Finished) and s.done


def test_scoring_only_ends_with_the_scores_and_ignores_the_sampled_token(tok):
    s = session(tok, max_tokens=0, scores=True)
    assert s.on_token(Token("r", 0, 7, finish="length")) == []
    events = s.on_logprobs(Logprobs("r", 0, WireTensor.from_array(np.zeros(2, np.float32)),
                                    WireTensor.from_array(np.zeros((2, 0), np.int32)),
                                    WireTensor.from_array(np.zeros((2, 0), np.float32))))
    assert isinstance(events[0], PromptScores) and events[-1] == Finished("length") and s.done
    assert s.completion_tokens == 0


def test_an_error_from_a_stage_fails_the_request_once(tok):
    s = session(tok)
    events = s.on_error(Error("kv_cache_full", "all 4 KV cache slots are in use", request_id="r"))
    assert events == [Failed("kv_cache_full", "all 4 KV cache slots are in use")] and s.done
    assert s.on_error(Error("other", "x", request_id="r")) == [] and s.on_token(Token("r", 0, 5)) == []


def test_a_token_beyond_max_tokens_is_a_protocol_failure(tok):
    s = session(tok, max_tokens=2)
    (failed,) = s.on_token(Token("r", 2, 5))
    assert isinstance(failed, Failed) and failed.code == "bad_token"
