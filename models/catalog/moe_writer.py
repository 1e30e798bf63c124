"""MoE GGUF files written with `gguf`'s writer: SmolLM2-MoE (derived from the dense SmolLM2) and
synthetic MoE models from a seed.

SmolLM2-MoE splits each block's MLP by intermediate neurons into E experts of equal width: expert e
owns neurons [e*F/E, (e+1)*F/E) of `ffn_gate`/`ffn_up` (rows) and the same columns of `ffn_down`.
The split moves GGML blocks without re-quantising, so the experts hold exactly the dense weights.

* top-k = E (`smollm2-moe-8x8`): zero router, softmax gates of 1/E each, routed scaling E: every
  gate is exactly 1 and the block computes the dense MLP (up to float summation order).
* top-k < E (`smollm2-moe-8x2`): a fixed router built from the expert weights: row e is the sum of
  expert e's gate-projection rows divided by sqrt(F/E), so a token's logit for e is the scaled sum of
  the pre-activations of e's SiLU gates (the experts whose gates open widest win); softmax scores of
  the top k, normalised to sum to 1, times E/k (the dense MLP sums E experts, the sparse one k).

All other tensors and the metadata (tokenizer included) are copied from the dense file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import ModelError

FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def _copy_metadata(reader, writer, skip: set[str]) -> None:
    import gguf

    for name, field in reader.fields.items():
        if name in skip or name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), vtype, sub)


def _raw(tensor) -> tuple[np.ndarray, Any]:
    """A reader tensor's data and type, ready for `add_tensor` (quantised: bytes per row)."""
    import gguf

    qtype = gguf.GGMLQuantizationType(int(tensor.tensor_type))
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(tensor.data), None
    return np.asarray(tensor.data), qtype


def _split_rows(data: np.ndarray, n: int) -> np.ndarray:
    """(F, row) -> (n, F/n, row): expert e takes rows [e*F/n, (e+1)*F/n)."""
    return data.reshape(n, data.shape[0] // n, *data.shape[1:])


def _split_columns(data: np.ndarray, n: int, block_bytes: int, block_elems: int, width: int) -> np.ndarray:
    """(D, F) stored as bytes per row -> (n, D, F/n): expert e takes columns [e*F/n, (e+1)*F/n).
    Whole GGML blocks move when F/n is a multiple of the block size."""
    per = width // n
    if per % block_elems:
        raise ModelError(f"cannot split {width} columns into {n} experts in GGML blocks of {block_elems}")
    chunk = per // block_elems * block_bytes
    return np.ascontiguousarray(data.reshape(data.shape[0], n, chunk).transpose(1, 0, 2))


def smollm2_router(gate: np.ndarray, n_experts: int) -> np.ndarray:
    """(E, D) float32 router from a dense gate projection (F, D): row e = sum of expert e's rows / sqrt(F/E)."""
    per = gate.shape[0] // n_experts
    return (gate.reshape(n_experts, per, -1).sum(axis=1) / math.sqrt(per)).astype(np.float32)


def write_smollm2_moe(dense: str | Path, out: str | Path, n_experts: int, top_k: int) -> Path:
    """Write SmolLM2-MoE (E = n_experts, top-k) derived from the dense SmolLM2 GGUF `dense`."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(dense))
    arch = str(reader.fields["general.architecture"].contents())
    ffn = int(reader.fields[f"{arch}.feed_forward_length"].contents())
    if ffn % n_experts or not 1 <= top_k <= n_experts:
        raise ModelError(f"cannot make {n_experts} experts (top {top_k}) from an MLP of {ffn} neurons")
    out = Path(out)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    _copy_metadata(reader, writer, {"general.name"})
    writer.add_name(f"SmolLM2-MoE {n_experts}x{top_k}")
    writer.add_expert_count(n_experts)
    writer.add_expert_used_count(top_k)
    writer.add_expert_feed_forward_length(ffn // n_experts)
    full = top_k == n_experts  # softmax gates 1/E times E: exactly 1; else normalised top-k gates times E/k
    writer.add_expert_weights_scale(float(n_experts) if full else n_experts / top_k)
    writer.add_expert_weights_norm(not full)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    for t in reader.tensors:
        data, qtype = _raw(t)
        name = str(t.name)
        kind = name.split(".", 2)[-1] if name.startswith("blk.") else ""
        if kind not in FFN:
            writer.add_tensor(name, data, raw_dtype=qtype)
            continue
        prefix = name.rsplit(".", 2)[0]
        if kind == "ffn_down.weight":
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t.tensor_type))]
            split = _split_columns(data, n_experts, block_bytes, block_elems, ffn)
        else:
            split = _split_rows(data, n_experts)
        writer.add_tensor(f"{prefix}.{kind.replace('.weight', '_exps.weight')}", split, raw_dtype=qtype)
        if kind == "ffn_gate.weight":
            dense_gate = dequantize(data, t.tensor_type).reshape(ffn, -1).astype(np.float32)
            router = (np.zeros((n_experts, dense_gate.shape[1]), np.float32) if top_k == n_experts
                      else smollm2_router(dense_gate, n_experts))
            writer.add_tensor(f"{prefix}.ffn_gate_inp.weight", router)
    return _finish(writer, tmp, out)


def half_split_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `models.gguf.loader.interleaved_to_half_split`: Q/K rows as GGUF stores them."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)


@dataclass(frozen=True)
class SyntheticMoE:
    """A synthetic MoE architecture (weights come from a seed, `models.catalog.synthetic`)."""

    n_blocks: int
    dim: int
    n_heads: int
    n_kv_heads: int
    n_experts: int
    top_k: int
    expert_ffn: int
    dense_ffn: int
    leading_dense: int = 1
    shared_ffn: int = 0
    gating: str = "sigmoid"  # with a selection bias, as DeepSeek-V3 / Kimi-K2
    selection_bias: bool = True
    routed_scale: float = 2.5
    context: int = 2048

    def config(self, vocab: int, max_context: int | None = None):
        from models.moe import MoEConfig

        hd = self.dim // self.n_heads
        return MoEConfig(num_blocks=self.n_blocks, dim=self.dim, hidden_dim=self.expert_ffn, n_heads=self.n_heads,
                         n_kv_heads=self.n_kv_heads, norm_eps=1e-5, vocab_size=vocab, head_dim=hd,
                         rope_theta=10000.0, rope_dim=hd, v_head_dim=hd, max_context=max_context or self.context,
                         num_experts=self.n_experts, num_experts_per_tok=self.top_k, norm_topk_prob=True,
                         shared_expert_dim=self.shared_ffn, shared_expert_gate=False,
                         leading_dense_blocks=self.leading_dense, dense_hidden_dim=self.dense_ffn,
                         routed_scaling_factor=self.routed_scale, expert_bias=self.selection_bias,
                         expert_gating=self.gating)


SYNTHETIC_MOE = {
    "tiny": SyntheticMoE(n_blocks=4, dim=64, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2, expert_ffn=32,
                         dense_ffn=128, shared_ffn=32),
    "small": SyntheticMoE(n_blocks=8, dim=256, n_heads=8, n_kv_heads=4, n_experts=16, top_k=4, expert_ffn=128,
                          dense_ffn=768, shared_ffn=128),
    # about 1.0 B parameters with a 49152-token vocabulary
    "1b": SyntheticMoE(n_blocks=16, dim=1024, n_heads=16, n_kv_heads=4, n_experts=32, top_k=4, expert_ffn=640,
                       dense_ffn=4096, shared_ffn=640),
}


def write_synthetic_moe(out: str | Path, arch: SyntheticMoE, seed: int, *, tokenizer_from: str | Path | None = None,
                        vocab: int = 256, byte_tokenizer: bool = False, name: str = "synthetic-moe",
                        progress: Callable[[str], None] | None = None) -> Path:
    """A float16 MoE GGUF of `arch` with seeded weights (the values `StageModel.random(config, seed)`
    holds). With `tokenizer_from`, that GGUF's tokenizer (and vocabulary size) is copied in; with
    `byte_tokenizer`, a seeded model's byte-level tokenizer of `vocab` tokens is written (no file needed)."""
    import gguf

    from models.catalog.synthetic import block_shapes, expert_shapes, random_array

    out = Path(out)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    if tokenizer_from is not None:
        reader = gguf.GGUFReader(str(tokenizer_from))
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                vtype = field.types[0]
                sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
                writer.add_key_value(key, field.contents(), vtype, sub)
        vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    elif byte_tokenizer:
        from models.catalog.seeded import write_byte_level_tokenizer

        write_byte_level_tokenizer(writer, vocab)
    c = arch.config(vocab)
    writer.add_name(name)
    writer.add_block_count(c.num_blocks)
    writer.add_context_length(arch.context)
    writer.add_embedding_length(c.dim)
    writer.add_feed_forward_length(arch.dense_ffn)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_vocab_size(vocab)
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.hidden_dim)
    writer.add_leading_dense_block_count(c.leading_dense_blocks)
    writer.add_expert_weights_scale(c.routed_scaling_factor)
    writer.add_expert_weights_norm(c.norm_topk_prob)
    if c.shared_expert_dim:
        writer.add_expert_shared_feed_forward_length(c.shared_expert_dim)
    gating = {"softmax": gguf.ExpertGatingFuncType.SOFTMAX, "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}
    writer.add_expert_gating_func(gating[c.expert_gating])

    def add(name: str, values: np.ndarray) -> None:
        # norms and the selection bias stay float32 (as converters write them); matrices float16
        writer.add_tensor(name, values if values.ndim == 1 else values.astype(np.float16))

    add("token_embd.weight", random_array(seed, "token_embd.weight", (vocab, c.dim)))
    for i in range(c.num_blocks):
        if progress:
            progress(f"writing block {i + 1}/{c.num_blocks}")
        for n, shape in block_shapes(c, i, routed=False).items():
            values = random_array(seed, f"blk.{i}.{n}", shape)
            heads = {"attn_q.weight": c.n_heads, "attn_k.weight": c.n_kv_heads}.get(n)
            add(f"blk.{i}.{n}", half_split_to_interleaved(values, heads) if heads else values)
        if i >= c.leading_dense_blocks:
            for n, (_, *shape) in expert_shapes(c, 1).items():
                stack = np.stack([random_array(seed, f"blk.{i}.{n}.weight#{e}", tuple(shape))
                                  for e in range(c.num_experts)])
                add(f"blk.{i}.{n}.weight", stack)
    add("output_norm.weight", random_array(seed, "output_norm.weight", (c.dim,)))
    add("output.weight", random_array(seed, "output.weight", (vocab, c.dim)))
    return _finish(writer, tmp, out)


def _finish(writer, tmp: Path, out: Path) -> Path:
    """Write the GGUF out and move it into place (a reader never sees a half-written file)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out
