"""The generation loop: stops where it should, streams whole characters, holds back partial stop strings.

The loop's logic is tested against a scripted model (logits that pick a chosen token each step) with
SmolLM2's real tokenizer; the real model runs it in test_run_cli.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.errors import ModelError
from models.generate import generate
from models.sampling import SamplingParams
from models.text.stop_text import StopText
from models.text.tokenizer import Tokenizer

IM_END = 2


class ScriptedModel:
    """Whole-model stand-in: each forward's logits make `script[i]` the likeliest token of step i."""

    def __init__(self, script: list[int], vocab_size: int, max_context: int = 512, noisy: bool = False):
        self.script, self.vocab_size, self.max_context = script, vocab_size, max_context
        self.calls: list[tuple[str, int, list[int]]] = []
        self.live: set[str] = set()
        self.noisy = noisy  # every step: the same spread-out logits instead of one clear winner

    def add_request(self, request_id: str) -> None:
        self.live.add(request_id)

    def free_request(self, request_id: str) -> None:
        self.live.discard(request_id)

    def forward(self, items):
        (item,) = items
        assert item.request_id in self.live
        self.calls.append((item.request_id, item.start_pos, [int(t) for t in item.data]))
        step = len(self.calls) - 1
        if self.noisy:
            return [np.random.default_rng(0).standard_normal(self.vocab_size).astype(np.float32) * 3]
        logits = np.zeros(self.vocab_size, dtype=np.float32)
        logits[self.script[step % len(self.script)]] = 20.0
        return [logits]


@pytest.fixture(scope="module")
def tok(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


def run_script(tok, text_ids, prompt="Say it:", **params):
    model = ScriptedModel(text_ids, tok.vocab_size, max_context=params.pop("max_context", 512))
    gen = generate(model, tok, tok.encode(prompt), SamplingParams(**params))
    pieces = list(gen)
    return model, gen, pieces


def test_stops_on_end_of_turn_without_emitting_it(tok):
    script = [*tok.encode("Hello there."), IM_END, *tok.encode(" never shown")]
    model, gen, pieces = run_script(tok, script, max_tokens=50)
    assert "".join(p.text for p in pieces) == "Hello there."
    assert gen.token_ids == script[:script.index(IM_END)]
    assert (gen.stats.finish_reason, gen.stats.completion_tokens) == ("stop", len(gen.token_ids) + 1)
    n_prompt = len(tok.encode("Say it:"))
    assert [c[1] for c in model.calls] == [0, *range(n_prompt, n_prompt + len(gen.token_ids))]
    assert model.calls[0][2] == tok.encode("Say it:") and [c[2][0] for c in model.calls[1:]] == gen.token_ids
    assert not model.live  # the request's cache is freed


def test_max_tokens_ends_with_length(tok):
    _, gen, pieces = run_script(tok, tok.encode(" one two three four five six"), max_tokens=3)
    assert len(gen.token_ids) == 3 and gen.stats.finish_reason == "length"
    assert "".join(p.text for p in pieces) == tok.decode(gen.token_ids)


def test_a_full_context_ends_with_length(tok):
    n_prompt = len(tok.encode("Say it:"))
    _, gen, _ = run_script(tok, tok.encode(" a b c d e f g h i j"), max_tokens=50, max_context=n_prompt + 3)
    assert len(gen.token_ids) == 4 and gen.stats.finish_reason == "length"


def test_stop_string_across_tokens_cuts_the_output_before_it(tok):
    script = [*tok.encode("The answer is 42. END of story"), IM_END]
    _, gen, pieces = run_script(tok, script, max_tokens=50, stop=("D of", "never"))
    assert "".join(p.text for p in pieces) == "The answer is 42. EN"
    assert gen.stats.finish_reason == "stop"
    assert tok.decode(gen.token_ids).startswith("The answer is 42. END of")


def test_text_that_only_starts_like_a_stop_string_comes_out_in_the_end(tok):
    script = [*tok.encode("fine, then EN"), IM_END]
    _, _, pieces = run_script(tok, script, max_tokens=50, stop=("END",))
    assert "".join(p.text for p in pieces) == "fine, then EN"
    assert pieces[-1].token_id is None and pieces[-1].text.endswith("EN")


def test_characters_split_over_tokens_stream_whole(tok):
    text = "llama 🦙 東京 ok"
    _, _, pieces = run_script(tok, [*tok.encode(text), IM_END], max_tokens=50)
    assert "".join(p.text for p in pieces) == text
    assert all("\ufffd" not in p.text for p in pieces)
    assert any(p.text == "" for p in pieces)  # a token that ended mid-character showed nothing yet


def test_sampling_is_reproducible_for_a_seed(tok):
    def tokens(seed):
        model = ScriptedModel([5], tok.vocab_size, noisy=True)
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
        gen = generate(model, tok, [1, 2, 3], params)
        list(gen)
        return gen.token_ids

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    assert len(set(tokens(1))) > 1


def test_closing_a_generation_early_frees_its_request(tok):
    model = ScriptedModel(tok.encode(" a b c"), tok.vocab_size)
    stream = iter(generate(model, tok, [1, 2], SamplingParams(max_tokens=10)))
    next(stream)
    stream.close()
    assert not model.live


@pytest.mark.parametrize("n_prompt, context, message", [(0, 8, "the prompt is empty"),
                                                        (8, 8, "the prompt is 8 tokens but the context holds 8")])
def test_prompts_that_do_not_fit_are_refused(tok, n_prompt, context, message):
    model = ScriptedModel([5], tok.vocab_size, max_context=context)
    with pytest.raises(ModelError, match=message):
        generate(model, tok, [5] * n_prompt, SamplingParams())


def test_stop_text_holds_back_only_what_could_still_become_a_stop():
    stops = StopText(["abc", "xy"])
    assert stops.push("123a") == ("123", False)
    assert stops.push("b") == ("", False)
    assert stops.push("d x") == ("abd ", False)
    assert stops.push("yz") == ("", True)
    assert StopText([]).push("anything") == ("anything", False)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab c", max_size=30), stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4),
                                                                  max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_text_output_is_the_text_cut_where_the_first_stop_to_complete_begins_however_it_is_split(text, stops, cuts):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    matcher, out, stopped = StopText(stops), "", False
    for lo, hi in itertools.pairwise(bounds):
        piece, stopped = matcher.push(text[lo:hi])
        out += piece
        if stopped:
            break
    if not stopped:
        out += matcher.flush()
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]  # (end, start): first to complete
    assert (out, stopped) == ((text[:min(hits)[1]], True) if hits else (text, False))
