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


def test_kimi_k2_blocks_are_named_by_count_and_a_count_too_large_for_the_device_says_how_many_fit():
    model = parse_seeded_name("random/kimi-k2:12@7")
    assert (model.name, model.seed, model.blocks, model.arch.n_blocks) == ("random/kimi-k2:12@7", 7, 12, 12)
    config = model.config(4096)
    assert (config.dim, config.n_heads, config.q_lora_rank, config.kv_lora_rank, config.num_experts) == (
        7168, 64, 1536, 512, 384)
    assert (config.max_context, config.yarn_factor, model.layout_dtype) == (4096, 32.0, "int4")
    assert model.digest != parse_seeded_name("random/kimi-k2:13@7").digest
    fits = model.blocks_that_fit(140e9, 1024, 8)
    assert 14 <= fits <= 15  # the dense first block, then 9.6 GB of int4 per block; the embedding and head 1.3 GB
    model.check_fits(1, 12, 140e9, 1024, 8)
    many = parse_seeded_name("random/kimi-k2:20")
    with pytest.raises(ModelError, match=rf"at most {fits} full-width blocks fit \(random/kimi-k2:{fits}\)") as e:
        many.check_fits(0, 20, 140e9, 1024, 8)
    assert "\n" not in str(e.value)
    for bad in ("random/kimi-k2", "random/kimi-k2:0", "random/kimi-k2:62", "random/kimi-k2:x"):
        with pytest.raises(ModelError, match=r"say how many of kimi-k2's 61 blocks"):
            parse_seeded_name(bad)
    with pytest.raises(ModelError, match="ARCH:BLOCKS"):
        parse_seeded_name("random/llama-3.1-8b:4")
