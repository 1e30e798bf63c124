"""How a `deepseek2` GGUF lays out multi-head latent attention (`models.deepseek2`): the tensors a block has, the
rows llama.cpp's converter interleaves, and the legacy `attn_kv_b` split as the converter splits it. `config` is
a `models.deepseek2.DeepSeek2Config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from models.gguf.header import GGUFHeader

if TYPE_CHECKING:
    from tinygrad import Tensor


def attention_tensor_names(header: GGUFHeader, i: int) -> list[str]:
    """Block i's attention tensors as the file has them: the query's low-rank pair (or a plain `attn_q`),
    and `attn_k_b`/`attn_v_b` (or the legacy `attn_kv_b` they are split from)."""
    p = f"blk.{i}."
    q = ["attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"] if p + "attn_q_a.weight" in header.tensors \
        else ["attn_q.weight"]
    kv_b = ["attn_k_b.weight", "attn_v_b.weight"] if p + "attn_k_b.weight" in header.tensors else ["attn_kv_b.weight"]
    return [p + n for n in ["attn_norm.weight", *q, "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", *kv_b,
                            "attn_output.weight", "ffn_norm.weight"]]


def rope_rows(name: str, config: Any) -> tuple[int, int, int] | None:
    """(groups, rows per group, first rotated row) of a projection whose rotated rows GGUF keeps in
    interleaved pairs: each query head's last rope_dim rows, the key's rope rows after the latent."""
    kind = name.split(".", 2)[-1]
    if kind in ("attn_q_b.weight", "attn_q.weight"):
        return config.n_heads, config.head_dim, config.qk_nope_dim
    if kind == "attn_kv_a_mqa.weight":
        return 1, config.kv_lora_rank + config.rope_dim, config.kv_lora_rank
    return None


def interleaved_to_half_split(w: Tensor, groups: int, per_group: int, first: int) -> Tensor:
    """Rows [first, per_group) of each group from GGUF's (pairs, 2) order to (2, pairs), as
    tinygrad.llm's `Transformer.from_gguf` permutes `attn_q_b` and `attn_kv_a_mqa`."""
    g = w.reshape(groups, per_group, -1)
    rot = g[:, first:].rearrange("n (h two) d -> n (two h) d", two=2)
    return (g[:, :first].cat(rot, dim=1) if first else rot).reshape(-1, w.shape[-1])


def mla_permutation(name: str, config: Any):
    """The row permutation the loader applies to tensor `name` (identity for all but the rotated rows)."""
    rows = rope_rows(name, config)
    if rows is None:
        return lambda t: t
    return lambda t: interleaved_to_half_split(t, *rows)


def split_kv_b(kv_b: np.ndarray, config: Any) -> tuple[np.ndarray, np.ndarray]:
    """The legacy `attn_kv_b` (heads * (qk_nope + v), kv_lora) split as llama.cpp's converter splits it:
    `attn_k_b` (heads, kv_lora, qk_nope) (transposed) and `attn_v_b` (heads, v, kv_lora)."""
    h, nope, v = config.n_heads, config.qk_nope_dim, config.v_head_dim
    per_head = kv_b.reshape(h, nope + v, config.kv_lora_rank)
    return np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(per_head[:, nope:])
