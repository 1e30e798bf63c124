"""DeepSeek-V3 / Kimi-K2 style GGUF files (architecture `deepseek2`) with seeded weights, as llama.cpp's own
converter and quantizer would write the release: the converter's metadata keys (the MQA view of the latent
in `key_length`/`value_length`, per-head sizes in `key_length_mla`/`value_length_mla`, YaRN keys, 0.1 times
`mscale_all_dim` as the log multiplier), the split `attn_k_b`/`attn_v_b`, routed experts stacked per block,
and llama-quantize's Q4_0 types: every matrix in Q4_0 but the router (float32, which llama.cpp's quantizer
never quantises), norms and the selection bias in float32.

`kimi-k2-mini` is written from `models.deepseek2.KIMI_K2_MINI` with SmolLM2's tokenizer carried into the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from models.deepseek2 import KIMI_K2_MINI, DeepSeek2Arch, block_shapes

__all__ = ["KIMI_K2_MINI", "quantized_type", "write_deepseek2"]


def quantized_type(name: str, shape: tuple[int, ...]) -> str | None:
    """llama-quantize's choice for a Q4_0 file: "Q4_0" for matrices whose rows split into blocks of 32, None
    (kept float32) for norms, biases and the router."""
    if len(shape) < 2 or shape[-1] % 32 or "ffn_gate_inp" in name:
        return None
    return "Q4_0"


def write_deepseek2(out: str | Path, arch: DeepSeek2Arch, seed: int, *, tokenizer_from: str | Path,
                    progress: Callable[[str], None] | None = None) -> Path:
    """Write `arch` with weights drawn from `seed` (`models.catalog.synthetic.random_array`, per tensor) and
    the tokenizer (and vocabulary size) of the GGUF `tokenizer_from`."""
    import gguf

    from models.catalog.moe_writer import _finish
    from models.catalog.synthetic import random_array

    out = Path(out)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "deepseek2")
    reader = gguf.GGUFReader(str(tokenizer_from))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), vtype, sub)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    a = arch
    writer.add_name(a.name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(a.n_blocks)
    writer.add_context_length(a.context)
    writer.add_embedding_length(a.dim)
    writer.add_feed_forward_length(a.dense_ffn)
    writer.add_head_count(a.n_heads)
    writer.add_head_count_kv(1)  # the converter: MLA is MQA over the latent
    writer.add_rope_freq_base(a.theta)
    writer.add_layer_norm_rms_eps(a.eps)
    writer.add_expert_count(a.n_experts)
    writer.add_expert_used_count(a.top_k)
    writer.add_expert_group_count(a.groups)
    writer.add_expert_group_used_count(a.groups_used)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_leading_dense_block_count(a.leading_dense)
    writer.add_vocab_size(vocab)
    writer.add_q_lora_rank(a.q_lora)
    writer.add_kv_lora_rank(a.kv_lora)
    writer.add_key_length(a.kv_lora + a.rope)
    writer.add_value_length(a.kv_lora)
    writer.add_key_length_mla(a.nope + a.rope)
    writer.add_value_length_mla(a.v_dim)
    writer.add_expert_feed_forward_length(a.expert_ffn)
    writer.add_expert_shared_count(a.n_shared)
    writer.add_expert_weights_scale(a.routed_scale)
    writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(a.rope)
    if a.yarn_factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(a.yarn_factor)
        writer.add_rope_scaling_orig_ctx_len(a.yarn_original_context)
        writer.add_rope_scaling_yarn_beta_fast(a.yarn_beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(a.yarn_beta_slow)
        writer.add_rope_scaling_yarn_log_mul(0.1 * a.mscale_all_dim)

    def add(name: str, shape: tuple[int, ...]) -> None:
        values = random_array(seed, name, shape)
        qtype = quantized_type(name, shape)
        if qtype is None:
            writer.add_tensor(name, values)
        else:
            q = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, gguf.quants.quantize(values, q), raw_dtype=q)

    config = a.config(vocab)
    add("token_embd.weight", (vocab, a.dim))
    for i in range(a.n_blocks):
        if progress:
            progress(f"writing block {i + 1}/{a.n_blocks}")
        for n, shape in block_shapes(config, i).items():
            add(f"blk.{i}.{n}", shape)
    add("output_norm.weight", (a.dim,))
    add("output.weight", (vocab, a.dim))
    return _finish(writer, tmp, out)

