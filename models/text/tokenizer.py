"""The tokenizer stored in a GGUF file, rebuilt with HF `tokenizers` so its ids equal llama.cpp's.

Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) only: vocab and merges come from the GGUF, the
pre-tokenizer from `tokenizer.ggml.pre` (llama.cpp's names for its split regexes). CONTROL and
USER_DEFINED tokens are atomic. Decoding goes through each token's bytes, so a streamed decode
and a whole decode give the same text and a character split over tokens comes out whole.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import ModelError

# llama.cpp's token types (GGUF tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's split regexes (llama-vocab.cpp), in the syntax HF's Split understands.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# Tokens llama.cpp also treats as end of generation when the vocab has them.
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
    "<|end_of_text|>",
)


@dataclass(frozen=True)
class Preset:
    """How llama.cpp splits text before BPE for one `tokenizer.ggml.pre` value."""

    split: str  # GPT2_SPLIT, LLAMA3_SPLIT or QWEN2_SPLIT
    digits_first: bool = False  # split every digit apart before the regex (llama.cpp's `\p{N}` pass)
    ignore_merges: bool = False  # a pre-token found whole in the vocab is taken as is
    add_bos_default: bool = False  # when the GGUF has no tokenizer.ggml.add_bos_token


_GPT2 = Preset(GPT2_SPLIT)
_STARCODER = Preset(GPT2_SPLIT, digits_first=True)
_LLAMA3 = Preset(LLAMA3_SPLIT, ignore_merges=True, add_bos_default=True)
_QWEN2 = Preset(QWEN2_SPLIT)
PRESETS: dict[str, Preset] = {
    "gpt-2": _GPT2, "gpt2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "roberta-bpe": _GPT2,
    "smollm": _STARCODER, "starcoder": _STARCODER, "refact": _STARCODER, "command-r": _STARCODER,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {chr(b): b for b in keep} | {chr(256 + i): b for i, b in enumerate(moved)}


_BYTE_DECODER = byte_decoder()


def _token_bytes(text: str, token_type: int) -> bytes:
    if token_type in (NORMAL, BYTE) and all(c in _BYTE_DECODER for c in text):
        return bytes(_BYTE_DECODER[c] for c in text)
    return text.encode("utf-8")


def _build_hf_tokenizer(tokens: Sequence[str], types: Sequence[int], merges: Iterable[str], preset: Preset):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as hf_models

    vocab = {text: i for i, text in enumerate(tokens)}
    pairs = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
    tk = Tokenizer(hf_models.BPE(vocab, pairs, ignore_merges=preset.ignore_merges))
    steps: list[pre_tokenizers.PreTokenizer] = []
    if preset.digits_first:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if preset.split == GPT2_SPLIT:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(preset.split), behavior="isolated", invert=False),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tk.decoder = decoders.ByteLevel()
    atomic = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
              for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    tk.add_special_tokens(atomic)
    return tk


class Tokenizer:
    """Text <-> token ids for one GGUF model, the way llama.cpp does it."""

    def __init__(self, kv: Mapping[str, Any]):
        model = kv.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelError(f"tokenizer '{model}' is not supported (only byte-level BPE, "
                             "tokenizer.ggml.model = gpt2, as in SmolLM2, Llama 3 and Qwen 2)")
        pre = str(kv.get("tokenizer.ggml.pre", "gpt2"))
        if pre not in PRESETS:
            raise ModelError(f"pre-tokenizer '{pre}' is not supported; supported: {', '.join(sorted(PRESETS))}")
        tokens: list[str] = list(kv["tokenizer.ggml.tokens"])
        types: list[int] = list(kv.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        preset = PRESETS[pre]
        self.pre = pre
        self.tokens = tokens
        self.types = types
        self._hf = _build_hf_tokenizer(tokens, types, kv.get("tokenizer.ggml.merges", []), preset)
        self._bytes = [_token_bytes(t, k) for t, k in zip(tokens, types, strict=True)]
        self._shown = [k in (NORMAL, BYTE, USER_DEFINED) for k in types]

        def token_id(key: str) -> int | None:
            value = kv.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        self.bos_id = token_id("bos_token_id")
        self.eos_id = token_id("eos_token_id")
        self.eot_id = token_id("eot_token_id")
        self.add_bos = bool(kv.get("tokenizer.ggml.add_bos_token", preset.add_bos_default)) and self.bos_id is not None
        named = {i for i, t in enumerate(tokens) if t in END_OF_GENERATION_TEXTS and types[i] != NORMAL}
        listed = {i for i in (self.eos_id, self.eot_id, token_id("eom_token_id")) if i is not None}
        self.stop_ids: frozenset[int] = frozenset(listed | named)
        self.chat_template: str | None = kv.get("tokenizer.chat_template")

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from models.gguf.header import read_header

        return cls(read_header(path).kv)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def bos_token(self) -> str:
        return self.tokens[self.bos_id] if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self.tokens[self.eos_id] if self.eos_id is not None else ""

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in it are parsed as one token each.

        BOS is prepended when the GGUF asks for it (never for SmolLM2), unless the text already
        starts with it (a chat template that writes `bos_token` itself)."""
        ids: list[int] = self._hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids.insert(0, self.bos_id)
        return ids

    def token_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes:
        """The bytes one token stands for; control tokens are empty when `skip_special`."""
        if skip_special and not self._shown[token_id]:
            return b""
        return self._bytes[token_id]

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        data = b"".join(self.token_bytes(i, skip_special=skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def is_stop(self, token_id: int) -> bool:
        return token_id in self.stop_ids

    def stream_decoder(self, *, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(lambda i: self.token_bytes(i, skip_special=skip_special))


class StreamDecoder:
    """Turns token ids into text as they come; a character split over tokens is held back until whole."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        """What is still held back at the end (an incomplete character comes out as U+FFFD)."""
        return self._utf8.decode(b"", final=True)
