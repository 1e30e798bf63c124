"""Loading a stage's tensors from a GGUF file: config, errors, which tensors, dequantisation, layout."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import config_from_header
from models.errors import ModelError
from models.gguf.header import read_header
from models.gguf.loader import interleaved_to_half_split, load_stage_weights, read_tensor, stage_tensor_names
from models.layout import layout_from_gguf
from tests.models.conftest import TINY_QUANT
from tests.models.tiny_gguf import tiny_weights, write_gguf


def test_config_comes_from_the_gguf_metadata(tiny_gguf, tiny_spec):
    c = config_from_header(read_header(tiny_gguf), max_context=64)
    assert (c.num_blocks, c.dim, c.hidden_dim, c.n_heads, c.n_kv_heads) == (5, 64, 128, 4, 2)
    assert (c.head_dim, c.rope_dim, c.vocab_size, c.max_context) == (16, 16, tiny_spec.vocab, 64)
    assert c.rope_theta == tiny_spec.rope_theta


def test_max_context_is_clipped_to_the_models_context(tiny_gguf, tiny_spec):
    assert config_from_header(read_header(tiny_gguf), max_context=10_000).max_context == tiny_spec.context


def test_an_unsupported_architecture_is_refused_in_one_line(tmp_path, tiny_spec):
    path = write_gguf(tmp_path / "m.gguf", tiny_spec, tiny_weights(tiny_spec), arch="gpt2")
    with pytest.raises(ModelError, match="architecture 'gpt2' is not supported") as e:
        config_from_header(read_header(path))
    assert "\n" not in str(e.value)


def test_a_missing_metadata_key_is_named(tmp_path, tiny_spec):
    path = write_gguf(tmp_path / "m.gguf", tiny_spec, tiny_weights(tiny_spec), omit=("feed_forward_length",))
    with pytest.raises(ModelError, match=r"lacks 'llama\.feed_forward_length'"):
        config_from_header(read_header(path))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelError, match="not a GGUF file"):
        read_header(tmp_path / "x.gguf")


def test_each_stage_names_only_its_blocks_plus_embedding_or_head(tiny_gguf):
    header = read_header(tiny_gguf)
    first, middle, last = (stage_tensor_names(header, a, b, 5) for a, b in ((0, 2), (2, 4), (4, 5)))
    assert first[0] == "token_embd.weight" and {n.split(".")[1] for n in first[1:]} == {"0", "1"}
    assert {n.split(".")[1] for n in middle} == {"2", "3"} and len(middle) == 18
    # the head is tied: the last stage reads the embedding matrix as its output projection
    assert last[-2:] == ["output_norm.weight", "token_embd.weight"]
    assert {n.split(".")[1] for n in last[:-2]} == {"4"}


def test_a_stage_reads_only_its_own_tensors(tmp_path, tiny_spec):
    """Every tensor outside blocks [2, 4) is NaN in the file: the stage's weights stay finite."""
    weights = tiny_weights(tiny_spec)
    poisoned = {n: (w if n.startswith(("blk.2.", "blk.3.")) else np.full_like(w, np.nan)) for n, w in weights.items()}
    path = write_gguf(tmp_path / "m.gguf", tiny_spec, poisoned)
    header = read_header(path)
    loaded = load_stage_weights(header, config_from_header(header), 2, 4, dtype="float32")
    assert set(loaded) == {f"blk.{i}.{t}" for i in (2, 3) for t in
                           ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                            "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")}
    assert all(np.isfinite(t.numpy()).all() for t in loaded.values())
    np.testing.assert_array_equal(loaded["blk.3.ffn_down.weight"].numpy(), weights["blk.3.ffn_down.weight"])


def test_the_last_stage_of_a_tied_model_gets_the_embedding_as_its_head(tiny_gguf):
    header = read_header(tiny_gguf)
    loaded = load_stage_weights(header, config_from_header(header), 4, 5, dtype="float32")
    assert "token_embd.weight" not in loaded
    np.testing.assert_array_equal(loaded["output.weight"].numpy(), read_tensor(header, "token_embd.weight").numpy())


@pytest.mark.parametrize("name", sorted(TINY_QUANT))
def test_quantised_tensors_dequantise_like_gguf_py(tiny_gguf, name):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    t = next(t for t in GGUFReader(str(tiny_gguf)).tensors if t.name == name)
    expected = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
    np.testing.assert_array_equal(read_tensor(read_header(tiny_gguf), name).numpy(), expected)


def test_block_weights_dequantise_in_the_kernel_to_ggmls_values(tiny_gguf):
    from models.kernels.quant import BlockQuantized

    header = read_header(tiny_gguf)
    loaded = load_stage_weights(header, config_from_header(header), 1, 4, dtype="quantized")
    heads = {"attn_q": 4, "attn_k": 2}
    for name in TINY_QUANT:
        assert isinstance(loaded[name], BlockQuantized)
        want = read_tensor(header, name)
        if (n := heads.get(name.split(".")[2])) is not None:
            want = interleaved_to_half_split(want, n)
        np.testing.assert_array_equal(loaded[name].dequantized().numpy(), want.numpy())
    assert loaded["blk.1.attn_norm.weight"].dtype.name == "float"  # norms stay float32
    assert loaded["blk.1.attn_q.weight"].dtype.name == "half"  # float32 matrices become float16


def test_qk_rows_go_from_interleaved_pairs_to_half_split_per_head():
    from tinygrad import Tensor

    heads, head_dim = 2, 6
    rows = np.arange(heads * head_dim, dtype=np.float32)[:, None].repeat(3, axis=1)
    out = interleaved_to_half_split(Tensor(rows), heads).numpy()[:, 0]
    # per head: even rows (first of each pair) first, then the odd rows
    assert out.tolist() == [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]


def test_layout_from_gguf_matches_the_planners_builtin_arithmetic(tiny_gguf, tiny_spec):
    layout = layout_from_gguf(tiny_gguf, digest="abc")
    s = tiny_spec
    block = s.dim * s.dim * 2 + s.dim * s.n_kv_heads * s.head_dim * 2 + 3 * s.dim * s.hidden + 2 * s.dim
    assert layout.n_blocks == 5 and layout.digest == "abc" and layout.dtype == "f16"
    assert layout.blocks[0].param_bytes == 2 * block
    assert layout.blocks[0].kv_bytes_per_token == 2 * s.n_kv_heads * s.head_dim * 4
    assert layout.blocks[0].activation_bytes == s.dim * 4
    assert layout.embedding_bytes == 2 * s.vocab * s.dim


@pytest.mark.parametrize("dtype", ["float16", "quantized"])
def test_weights_realised_a_few_at_a_time_are_the_weights_realised_at_once(tiny_quantized_gguf, monkeypatch, dtype):
    """A load realises its weights in batches of a bounded size: with a bound below any tensor's size each weight
    is a batch of its own, and every weight comes out realised and bit for bit the same."""
    import models.gguf.loader as loader
    from models.kernels.quant import BlockQuantized

    header = read_header(tiny_quantized_gguf)
    config = config_from_header(header)
    at_once = load_stage_weights(header, config, 0, 5, dtype=dtype)
    monkeypatch.setattr(loader, "REALIZE_BATCH_BYTES", 1)
    one_by_one = load_stage_weights(header, config, 0, 5, dtype=dtype)
    assert at_once.keys() == one_by_one.keys()
    assert any(isinstance(w, BlockQuantized) for w in at_once.values()) == (dtype == "quantized")
    for name, w in at_once.items():
        other = one_by_one[name]
        parts = zip(w.buffers(), other.buffers(), strict=True) if isinstance(w, BlockQuantized) else [(w, other)]
        for a, b in parts:
            assert a.uop.is_realized and b.uop.is_realized, name
            assert np.array_equal(a.numpy(), b.numpy()), name
