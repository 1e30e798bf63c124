"""The GGUF tokenizer gives llama.cpp's ids, decodes back exactly, and streams whole characters."""

from __future__ import annotations

import json
import re
import unicodedata
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.errors import ModelError
from models.gguf.header import read_header
from models.text.tokenizer import GPT2_SPLIT, LLAMA3_SPLIT, QWEN2_SPLIT, Tokenizer
from tests.tiny_vocab import CORPUS, write_vocab_gguf

REFERENCE = Path(__file__).parent / "data" / "llamacpp-reference-smollm2.json"
TRICKY = [
    "Hello, world!",
    "  leading and trailing spaces   ",
    "tabs\tand\r\nCRLF\n\n\nnewlines",
    "digits 1234567890 and 3.14159",
    "contractions: it's, we're, they'll, I'd, you've, I'M",
    "accents: café, naïve, Ærøskøbing, déjà vu",
    "CJK 東京タワー 한국어 and emoji 🦙🙂👩‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a" * 300 + " " * 40 + "z",
]
# Characters the split-regex properties draw from: every class the regexes tell apart.
ALPHABET = "aZéß東한 0179٣\t\n\r\u00a0\u2003'sStTrReEvVmMlLdD.,!?-_=+()[]{}:;\"#@$%^&*/\\|~`🙂—…"


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


def reference_cases() -> list[dict]:
    return json.loads(REFERENCE.read_text())["cases"]


@pytest.mark.parametrize("case", reference_cases(), ids=lambda c: c["prompt"][:24])
def test_prompt_ids_equal_llamacpp(smollm2, case):
    assert smollm2.encode(case["prompt"]) == case["prompt_ids"]


@pytest.mark.parametrize("case", reference_cases(), ids=lambda c: c["prompt"][:24])
def test_each_token_decodes_to_llamacpp_piece(smollm2, case):
    pieces = [smollm2.decode([i], skip_special=False) for i in case["greedy_ids"]]
    assert pieces == case["greedy_pieces"]


def test_smollm2_adds_no_bos_and_stops_on_im_end_and_endoftext(smollm2):
    assert not smollm2.add_bos
    assert smollm2.encode("Hi") == smollm2.encode("Hi", add_bos=False)
    assert smollm2.bos_id == 1 and smollm2.encode("Hi", add_bos=True)[0] == 1
    assert smollm2.tokens[2] == "<|im_end|>" and smollm2.eos_id == 2
    assert smollm2.stop_ids == {0, 2}
    assert smollm2.is_stop(2) and not smollm2.is_stop(198)


def test_control_tokens_are_atomic_and_hidden_when_decoding(smollm2):
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm2.decode(ids) == "user\nhi"
    assert smollm2.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("text", TRICKY)
def test_decode_inverts_encode(smollm2, text):
    assert smollm2.decode(smollm2.encode(text), skip_special=False) == text


def test_a_character_split_over_tokens_is_streamed_whole(smollm2):
    text = "llama 🦙 and 東京"
    ids = smollm2.encode(text)
    lone = [smollm2.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in lone), "test needs a character spread over several tokens"
    stream = smollm2.stream_decoder()
    pieces = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=40))
def test_streamed_text_equals_whole_decode_for_any_ids(smollm2, ids):
    stream = smollm2.stream_decoder()
    assert "".join(stream.feed(i) for i in ids) + stream.flush() == smollm2.decode(ids)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHABET + "<|im_start|>", max_size=60))
def test_smollm2_round_trips_any_text(smollm2, text):
    assert smollm2.decode(smollm2.encode(text), skip_special=False) == text


# --- the split regexes, checked against a reference built from Python's own Unicode tables ---

@cache
def _category_class(prefix: str) -> str:
    return "".join(re.escape(chr(c)) for c in range(0x323B0) if unicodedata.category(chr(c)).startswith(prefix))


@cache
def reference_split(pattern: str) -> re.Pattern[str]:
    """`pattern` with \\p{L}, \\p{N} and \\s spelled out as explicit classes (as tinygrad's tokenizer does)."""
    letters, numbers = _category_class("L"), _category_class("N")
    space = r"\t\n\x0b\x0c\r\x85" + _category_class("Z")
    out = pattern.replace(r"[^\s\p{L}\p{N}]", f"[^{space}{letters}{numbers}]")
    out = out.replace(r"[^\r\n\p{L}\p{N}]", f"[^\\r\\n{letters}{numbers}]")
    out = out.replace(r"(?!\S)", f"(?![^{space}])")
    out = out.replace(r"\p{L}", f"[{letters}]").replace(r"\p{N}", f"[{numbers}]").replace(r"\s", f"[{space}]")
    return re.compile(out)


def hf_split(pattern: str, text: str) -> list[str]:
    from tokenizers import Regex, pre_tokenizers

    return [p for p, _ in pre_tokenizers.Split(Regex(pattern), "isolated").pre_tokenize_str(text)]


@pytest.mark.parametrize("pattern", [GPT2_SPLIT, LLAMA3_SPLIT, QWEN2_SPLIT], ids=["gpt2", "llama3", "qwen2"])
@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40))
def test_split_regex_matches_unicode_reference(pattern, text):
    assert hf_split(pattern, text) == reference_split(pattern).findall(text)


@cache
def tinygrad_llama3_split() -> re.Pattern[str]:
    from tinygrad.llm.cli import SimpleTokenizer

    return SimpleTokenizer({}, {}, "llama-bpe")._split_to_word


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40))
def test_llama3_split_matches_tinygrads_tokenizer(text):
    assert hf_split(LLAMA3_SPLIT, text) == tinygrad_llama3_split().findall(text)


# --- other presets, on tiny vocabularies written into GGUF files ---

def test_llama_bpe_preset_encodes_like_tinygrad_and_adds_bos(tmp_path):
    from tinygrad.llm.cli import SimpleTokenizer

    kv = read_header(write_vocab_gguf(tmp_path / "llama3.gguf", pre="llama-bpe")).kv
    tok, tiny = Tokenizer(kv), SimpleTokenizer.from_gguf_kv(kv)
    assert tok.add_bos  # llama.cpp's default for llama3 vocabularies when the GGUF does not say
    for line in [*CORPUS.splitlines(), CORPUS, "these 9999999 <|end|>hello"]:
        ids = tok.encode(line)
        assert ids == [tok.bos_id, *tiny.encode(line)]
        assert tok.decode(ids) == line.replace("<|end|>", "")


def test_add_bos_token_false_is_honoured_and_bos_never_doubles(tmp_path):
    tok = Tokenizer(read_header(write_vocab_gguf(tmp_path / "v.gguf", pre="llama-bpe", add_bos=False)).kv)
    assert tok.encode("the") == tok.encode("the", add_bos=False)
    bos_first = Tokenizer(read_header(write_vocab_gguf(tmp_path / "w.gguf", pre="llama-bpe")).kv)
    assert bos_first.encode("<|begin|>the").count(bos_first.bos_id) == 1


def test_gpt2_preset_keeps_digit_runs_that_smollm_splits(tmp_path):
    gpt2 = Tokenizer(read_header(write_vocab_gguf(tmp_path / "g.gguf", pre="gpt-2")).kv)
    smollm = Tokenizer(read_header(write_vocab_gguf(tmp_path / "s.gguf", pre="smollm")).kv)
    assert [gpt2.decode([i]) for i in gpt2.encode("x 12345")] == ["x", " 12345"]
    assert [smollm.decode([i]) for i in smollm.encode("x 12345")] == ["x", " ", "1", "2", "3", "4", "5"]


def test_unsupported_tokenizers_are_model_errors(tmp_path):
    kv = dict(read_header(write_vocab_gguf(tmp_path / "v.gguf", pre="llama-bpe")).kv)
    with pytest.raises(ModelError, match="pre-tokenizer 'mystery'"):
        Tokenizer({**kv, "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(ModelError, match="tokenizer 'llama' is not supported"):
        Tokenizer({**kv, "tokenizer.ggml.model": "llama"})
