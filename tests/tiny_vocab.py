"""Tiny byte-level BPE vocabularies written into GGUF files, for tokenizer and model-name tests."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import gguf

from models.text.tokenizer import CONTROL, NORMAL, byte_decoder

CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's 2024 and we've 12345 reasons; they'll see.\n"
    "the theory of the thing: there, then, them, these, those. Hello world! hello World!!\n"
    "    indented   code = fn(x, y) + 42\r\n\tcafé naïve déjà vu — 東京 and 🙂 emoji\n"
)


def byte_level_merges(corpus: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE training on the byte-level form of `corpus`, split roughly the way GPT-2 splits.

    A tiny stand-in for a real merge list: merge ranks are in the order they were learned."""
    encode = {b: c for c, b in byte_decoder().items()}
    words = [[encode[b] for b in w.encode()] for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", corpus)]
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for pair in itertools.pairwise(w):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i:i + 2] = [joined]
                i += 1
    return merges


def write_vocab_gguf(path: Path, *, pre: str, specials: tuple[str, ...] = ("<|begin|>", "<|end|>"),
                     add_bos: bool | None = None, n_merges: int = 200, chat_template: str | None = None,
                     arch: str = "llama") -> Path:
    """A GGUF holding only tokenizer metadata: specials (ids 0..), the 256 byte symbols, then merges."""
    alphabet = sorted(byte_decoder(), key=lambda c: byte_decoder()[c])
    merges = byte_level_merges(CORPUS, n_merges)
    tokens = list(specials) + alphabet + [a + b for a, b in merges]
    seen: set[str] = set()
    tokens = [t for t in tokens if not (t in seen or seen.add(t))]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([CONTROL] * len(specials) + [NORMAL] * (len(tokens) - len(specials)))
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
