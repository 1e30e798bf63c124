"""Seeded models (`random/ARCH[@SEED]`): a real architecture with seeded random weights, served by name, so
a swarm can serve shapes no file is at hand for; every daemon draws the same weights for the blocks it holds. (Three daemons serving one token for token as
one process: tests/timing/test_trace_daemons.py.)"""

from __future__ import annotations

import pytest

from models.catalog.seeded import SeededModel, parse_seeded_name
from models.errors import ModelError
from planner.arch import ArchSpec


def test_a_seeded_name_gives_the_architecture_and_the_seed():
    model = parse_seeded_name("random/llama-3.1-8b@7")
    assert (model.arch.name, model.seed, model.name) == ("llama-3.1-8b", 7, "random/llama-3.1-8b@7")
    assert parse_seeded_name("random/llama-3.1-8b").seed == 0
    assert parse_seeded_name("smollm2-135m") is None
    assert model.digest != parse_seeded_name("random/llama-3.1-8b@8").digest
    assert model.config(4096).max_context == 4096 and model.config().dim == 4096


def test_bad_seeded_names_say_what_would_do():
    with pytest.raises(ModelError, match=r"random/ARCH\[@SEED\] with ARCH one of .*llama-3.1-8b"):
        parse_seeded_name("random/llama-9")
    with pytest.raises(ModelError, match="ARCH one of"):
        parse_seeded_name("random/mixtral-8x7b")  # a MoE architecture: not a dense seeded model
    with pytest.raises(ModelError, match="bad seed"):
        parse_seeded_name("random/llama-3.2-1b@x")


def test_the_byte_level_vocabulary_encodes_any_text_and_ends_with_end_of_text():
    from models.text.tokenizer import Tokenizer

    arch = ArchSpec("small", n_blocks=1, hidden=8, ffn=16, n_heads=2, n_kv_heads=1, head_dim=4, vocab=600)
    kv = SeededModel(arch, 0).tokenizer_kv()
    tokenizer = Tokenizer(kv)
    assert tokenizer.vocab_size == 600 and len(set(kv["tokenizer.ggml.tokens"])) == 600
    text = "héllo, wörld 🙂\n\tend"
    ids = tokenizer.encode(text)
    assert all(i < 256 for i in ids) and tokenizer.decode(ids) == text
    assert tokenizer.stop_ids == {599} and tokenizer.decode([599]) == ""
    assert tokenizer.decode([256, 257]) == "\x00\x00\x00\x01"  # filler ids decode to fixed bytes
