"""Load the weights of one pipeline stage from a GGUF file: blocks [start, end), plus the embedding on
the first stage and the output norm and head on the last.

Only the bytes of those tensors are read from the file (tinygrad's `gguf_load` copies the whole file
into memory first), so a node's memory follows its assignment. Dequantisation is tinygrad.llm's
`ggml_data_to_tensor`; weights end up as float16, as in tinygrad.llm, and the Q/K rows are permuted
the way `Transformer.from_gguf` does, from GGUF's interleaved RoPE pairs to tinygrad's half-split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from models.errors import ModelError
from models.gguf.header import GGUFHeader, TensorInfo

if TYPE_CHECKING:
    from tinygrad import Tensor

    from models.kernels.quant import BlockQuantized

W = TypeVar("W", "Tensor", "BlockQuantized")

# The tensors of one Llama block, by GGUF name without the `blk.{i}.` prefix.
BLOCK_TENSORS = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)


@dataclass(frozen=True)
class StageParts:
    """Parts of a stage, by what they are: blocks (by index), the embedding, the output norm and head."""
    blocks: frozenset[int] = frozenset()
    embedding: bool = False
    head: bool = False


def tensor_nbytes(info: TensorInfo) -> int:
    """Bytes the tensor occupies in the file."""
    from tinygrad.llm.gguf import _GGML_NATIVE, _GGML_QUANT

    if (dtype := _GGML_NATIVE.get(info.ggml_type)) is not None:
        return info.n_elements * dtype.itemsize
    if (quant := _GGML_QUANT.get(info.ggml_type)) is not None:
        per_block, block_bytes = quant
        return info.n_elements // per_block * block_bytes
    raise ModelError(f"tensor {info.name}: GGML type {info.ggml_type} is not supported by tinygrad's GGUF reader")


def head_tensor_name(header: GGUFHeader) -> str:
    """`output.weight`, or `token_embd.weight` when the head is tied to the embedding."""
    return "output.weight" if "output.weight" in header.tensors else "token_embd.weight"


# The feed-forward tensors of a MoE block: router, optional selection bias and shared experts.
MOE_DENSE_TENSORS = ("ffn_gate_inp.weight",)
MOE_OPTIONAL_TENSORS = ("exp_probs_b.bias", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                        "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight")
ROUTED_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def block_tensor_names(header: GGUFHeader, i: int, *, routed: bool = True) -> list[str]:
    """Block i's tensors: a dense block's nine, or a MoE block's attention, router, the optional
    tensors the file has and (with `routed`) the stacked routed experts. A `deepseek2` block's attention
    is multi-head latent attention (`models.gguf.deepseek2_tensors.attention_tensor_names`)."""
    if header.arch == "deepseek2":
        from models.gguf.deepseek2_tensors import attention_tensor_names

        attention = attention_tensor_names(header, i)
    else:
        attention = [f"blk.{i}.{t}" for t in BLOCK_TENSORS[:6]]
    if f"blk.{i}.ffn_gate_inp.weight" not in header.tensors:
        return attention + [f"blk.{i}.{t}" for t in BLOCK_TENSORS[6:]]
    names = attention + [f"blk.{i}.{t}" for t in MOE_DENSE_TENSORS]
    names += [f"blk.{i}.{t}" for t in MOE_OPTIONAL_TENSORS if f"blk.{i}.{t}" in header.tensors]
    return names + ([f"blk.{i}.{t}" for t in ROUTED_TENSORS] if routed else [])


def stage_tensor_names(header: GGUFHeader, start: int, end: int, n_blocks: int, *, routed: bool = True,
                       held: StageParts | None = None) -> list[str]:
    """The GGUF tensors stage [start, end) of an `n_blocks` model needs, in file order of loading; but
    those of `held` (parts a stage already loaded and hands over)."""
    held = held or StageParts()
    names = ["token_embd.weight"] if start == 0 and not held.embedding else []
    names += [n for i in range(start, end) if i not in held.blocks for n in block_tensor_names(header, i, routed=routed)]
    if end == n_blocks and not held.head:
        head = head_tensor_name(header)
        # a head tied to an embedding the stage takes over is that embedding: nothing to read
        names += ["output_norm.weight"] + ([] if head == "token_embd.weight" and held.embedding else [head])
    if "rope_freqs.weight" in header.tensors:  # Llama 3's RoPE frequency factors, used by every block
        names.append("rope_freqs.weight")
    missing = [n for n in names if n not in header.tensors]
    if missing:
        raise ModelError(f"{header.path.name}: tensors missing from the file: {', '.join(missing[:4])}")
    return list(dict.fromkeys(names))


def read_raw(header: GGUFHeader, name: str) -> np.ndarray:
    """The bytes of one tensor, and only those."""
    info = header.tensors[name]
    nbytes = tensor_nbytes(info)
    raw = np.fromfile(header.path, dtype=np.uint8, count=nbytes, offset=info.offset)
    if raw.size != nbytes:
        raise ModelError(f"{header.path.name}: file ends inside tensor {name}; the download is incomplete")
    return raw


def read_tensor(header: GGUFHeader, name: str, device: str | None = None) -> Tensor:
    """One tensor, dequantised (float32 for quantised types) on `device`, reading only its bytes."""
    from tinygrad import Tensor
    from tinygrad.llm.gguf import ggml_data_to_tensor

    info = header.tensors[name]
    raw = Tensor(read_raw(header, name), device=device)
    return ggml_data_to_tensor(raw, info.n_elements, info.ggml_type).reshape(info.shape)


def interleaved_to_half_split(w: Tensor, n_heads: int) -> Tensor:
    """Permute a Q or K projection's rows per head from GGUF's (hd/2, 2) RoPE pairs to (2, hd/2),
    the same rearrangement `tinygrad.llm.model.Transformer.from_gguf` applies for `llama`."""
    heads = w.reshape(n_heads, w.shape[0] // n_heads, -1)
    return heads.rearrange("n (h two) d -> n (two h) d", two=2).reshape(-1, w.shape[-1])


REALIZE_BATCH_BYTES = 64 << 20


class RealizeBatch:
    """Weights realised together, about `REALIZE_BATCH_BYTES` at a time. Each realise makes tinygrad walk every
    live tensor of the process, so one realise per weight costs a process that holds many models (the
    simulation's twin) about half of a load; the bound keeps the sources a batch holds small beside a large stage."""

    def __init__(self) -> None:
        self.pending: list[Tensor] = []
        self.bytes = 0

    def add(self, w: W) -> W:
        """`w` (lazy), realised with the batch it completes or at `flush()`."""
        from models.kernels.quant import BlockQuantized

        parts = w.buffers() if isinstance(w, BlockQuantized) else [w]
        self.pending += parts
        self.bytes += sum(t.nbytes() for t in parts)
        if self.bytes >= REALIZE_BATCH_BYTES:
            self.flush()
        return w

    def flush(self) -> None:
        from tinygrad import Tensor

        if self.pending:
            Tensor.realize(*self.pending)
        self.pending, self.bytes = [], 0


def load_stage_weights(
    header: GGUFHeader, config, start: int, end: int, *, device: str | None = None, dtype: str = "float16",
    routed: bool = True, held: StageParts | None = None,
) -> dict[str, Tensor | BlockQuantized]:
    """Weights of stage [start, end), keyed by GGUF name; the tied head is `output.weight`. The parts in
    `held` are left out (not read): a stage already holds them.

    `dtype` "float16" or "float32": realised dense matrices. "quantized": Q4_0/Q4_1/Q8_0 matrices stay in
    their GGML blocks (`BlockQuantized`, dequantised inside the kernels), other matrices are float16 and
    norms float32."""
    from tinygrad import Tensor

    from models.kernels.quant import KERNEL_QUANT_TYPES, from_ggml_blocks

    if dtype not in ("float16", "float32", "quantized"):
        raise ModelError(f"unknown weight dtype {dtype!r}: use float16, float32 or quantized")
    mla = header.arch == "deepseek2"
    if config.rope_dim != config.head_dim and not mla:
        raise ModelError(f"{header.path.name}: partial RoPE ({config.rope_dim} of {config.head_dim}) is not supported")
    heads = {"attn_q.weight": config.n_heads, "attn_k.weight": config.n_kv_heads}
    weights: dict[str, Tensor | BlockQuantized] = {}
    batch = RealizeBatch()
    for name in stage_tensor_names(header, start, end, config.num_blocks, routed=routed, held=held):
        info = header.tensors[name]
        if mla:
            from models.gguf.deepseek2_tensors import mla_permutation

            permute = mla_permutation(name, config)
        else:
            n_heads = heads.get(name.split(".", 2)[-1])

            def permute(t: Tensor, n_heads: int | None = n_heads) -> Tensor:
                return interleaved_to_half_split(t, n_heads) if n_heads else t

        if mla and name.endswith("attn_kv_b.weight"):  # the legacy form: split as llama.cpp's converter does
            from models.gguf.deepseek2_tensors import split_kv_b

            cast = "float32" if dtype == "float32" else "float16"
            k_b, v_b = split_kv_b(read_tensor(header, name).numpy(), config)
            prefix = name[:-len("attn_kv_b.weight")]
            weights[prefix + "attn_k_b.weight"] = batch.add(Tensor(k_b, device=device).cast(cast).contiguous())
            weights[prefix + "attn_v_b.weight"] = batch.add(Tensor(v_b, device=device).cast(cast).contiguous())
            continue
        if dtype == "quantized" and info.ggml_type in KERNEL_QUANT_TYPES and len(info.shape) >= 2 \
                and info.shape[-1] % 32 == 0:
            blocks = from_ggml_blocks(read_raw(header, name), info.ggml_type, info.shape, device)
            weights[name] = batch.add((blocks.map_rows(permute) if len(info.shape) == 2 else blocks).contiguous())
            continue
        # RoPE frequency factors stay float32 (they scale angles); with quantised matrices, so do the norms
        keep32 = dtype == "float32" or name == "rope_freqs.weight" or (dtype == "quantized" and len(info.shape) == 1)
        cast = "float32" if keep32 else "float16"
        weights[name] = batch.add(permute(read_tensor(header, name, device)).cast(cast).contiguous())
    held = held or StageParts()
    if end == config.num_blocks and not held.head and not held.embedding and "output.weight" not in weights:
        weights["output.weight"] = weights["token_embd.weight"] if start == 0 else weights.pop("token_embd.weight")
    batch.flush()
    return weights


def load_expert_weights(header: GGUFHeader, experts: Mapping[int, Sequence[int]], *, device: str | None = None,
                        dtype: str = "float16") -> dict[str, Tensor | BlockQuantized]:
    """The routed experts `experts[layer]` of each layer, stacked in that order under their GGUF names
    (`blk.{i}.ffn_{gate,up,down}_exps.weight`), reading only those experts' bytes; "quantized" keeps
    Q4_0/Q4_1/Q8_0 experts in their GGML blocks."""
    from tinygrad import Tensor
    from tinygrad.llm.gguf import ggml_data_to_tensor

    from models.kernels.quant import KERNEL_QUANT_TYPES, from_ggml_blocks

    if dtype not in ("float16", "float32", "quantized"):
        raise ModelError(f"unknown weight dtype {dtype!r}: use float16, float32 or quantized")
    out: dict[str, Tensor | BlockQuantized] = {}
    batch = RealizeBatch()
    for layer, es in experts.items():
        for t in ROUTED_TENSORS:
            name = f"blk.{layer}.{t}"
            if name not in header.tensors:
                raise ModelError(f"{header.path.name}: block {layer} has no routed experts ({name})")
            info = header.tensors[name]
            n_experts, per_expert = info.shape[0], tensor_nbytes(info) // info.shape[0]
            if any(not 0 <= e < n_experts for e in es):
                raise ModelError(f"{header.path.name}: block {layer} has {n_experts} experts, asked for {list(es)}")
            raw = np.concatenate([np.fromfile(header.path, dtype=np.uint8, count=per_expert,
                                              offset=info.offset + e * per_expert) for e in es])
            if dtype == "quantized" and info.ggml_type in KERNEL_QUANT_TYPES and info.shape[-1] % 32 == 0:
                out[name] = batch.add(from_ggml_blocks(raw, info.ggml_type, (len(es), *info.shape[1:]), device)
                                      .contiguous())
                continue
            elements = len(es) * (info.n_elements // n_experts)
            w = ggml_data_to_tensor(Tensor(raw, device=device), elements, info.ggml_type)
            cast = "float32" if dtype == "float32" else "float16"
            out[name] = batch.add(w.reshape(len(es), *info.shape[1:]).cast(cast).contiguous())
    batch.flush()
    return out
