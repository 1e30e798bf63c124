"""OpenAI request parsing and response shapes (pure; the routes are tested against real daemons)."""

from __future__ import annotations

import pytest

from models.text.tokenizer import Tokenizer
from swarmd.api.openai_format import (
    ApiError,
    LegacyLogprobs,
    chat_logprob_entry,
    parse_chat,
    parse_completion,
)
from swarmd.inference.head.session import PromptScores, TokenOut

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def tok(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


def refused(parse, body, status=400) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body, MODEL)
    assert e.value.status == status
    return e.value


def test_a_completion_takes_text_or_token_ids_and_openai_defaults():
    call = parse_completion({"model": MODEL, "prompt": "Hello"}, MODEL)
    assert call.prompt_text == "Hello" and call.max_tokens == 16 and call.sampling["temperature"] == 1.0
    ids = parse_completion({"prompt": [1, 2, 3], "max_tokens": 0, "echo": True, "logprobs": 2}, MODEL)
    assert ids.prompt_ids == (1, 2, 3) and ids.prompt_text is None
    req = ids.head_request(ids.prompt_ids)
    assert req.prompt_scores and req.logprobs == 2 and req.max_tokens == 0
    batch_of_one = parse_completion({"prompt": [[4, 5]]}, MODEL)
    assert batch_of_one.prompt_ids == (4, 5)
    assert parse_completion({"prompt": "x", "logprobs": 0}, MODEL).head_request([1]).logprobs == 1


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": 3}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
])
def test_bad_completion_fields_are_named_in_the_error(body, param):
    assert refused(parse_completion, body).param == param


def test_an_unknown_model_is_a_404_in_openai_shape():
    err = refused(parse_completion, {"model": "gpt-4", "prompt": "x"}, status=404)
    body = err.body()["error"]
    assert body["code"] == "model_not_found" and "gpt-4" in body["message"] and MODEL in body["message"]
    assert body["type"] == "invalid_request_error" and body["param"] == "model"
    assert refused(parse_completion, ["not", "an", "object"]).body()["error"]["message"].startswith("the request body")


def test_a_chat_takes_text_parts_and_its_token_limits():
    call = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                                  {"type": "text", "text": "!"}]}],
                       "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3}, MODEL)
    assert call.messages[0]["content"] == "Hi!" and call.max_tokens == 5
    req = call.head_request([1, 2], max_context=100)
    assert req.max_tokens == 5 and req.logprobs == 3
    unlimited = parse_chat({"messages": [{"role": "user", "content": "Hi"}]}, MODEL)
    assert unlimited.head_request([1, 2, 3], max_context=100).max_tokens == 97  # up to a full context
    assert refused(parse_chat, {"messages": []}).param == "messages"
    assert refused(parse_chat, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).param == \
        "top_logprobs"


def test_legacy_logprobs_have_one_entry_per_token_and_the_first_is_null(tok):
    ids = tok.encode("The capital")
    lp = LegacyLogprobs(tok, 2)
    lp.add_prompt(ids, PromptScores((-1.5,), (((tok.encode(" capital")[0], -1.5), (11, -2.0), (12, -3.0)),)))
    lp.add_token(TokenOut(0, tok.encode(" of")[0], " of", -0.25, ((tok.encode(" of")[0], -0.25),)))
    doc = lp.to_json()
    assert doc["tokens"] == ["The", " capital", " of"]
    assert doc["token_logprobs"] == [None, -1.5, -0.25]
    assert doc["top_logprobs"][0] is None and doc["top_logprobs"][1][" capital"] == -1.5
    assert len(doc["top_logprobs"][1]) == 2  # k = 2 of the 3 given
    assert doc["text_offset"] == [0, 3, 11]


def test_chat_logprobs_carry_bytes(tok):
    token = tok.encode(" é")[-1]
    entry = chat_logprob_entry(tok, TokenOut(0, token, "", -0.5, ((token, -0.5), (5, -1.0))), 1)
    assert entry["logprob"] == -0.5 and entry["bytes"] == list(tok.token_bytes(token))
    assert len(entry["top_logprobs"]) == 1
