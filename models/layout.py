"""The planner's ModelLayout of a GGUF model, computed from its metadata (no tensor is read).

Sizes are those of a StageModel: float16 weights, a float32 KV cache, float32 activations on the wire.
"""

from __future__ import annotations

from pathlib import Path

from models.config import config_from_header
from models.gguf_meta import GGUFHeader, read_header
from planner.arch import ArchSpec, layout_from_arch
from planner.layout import ModelLayout

WEIGHT_DTYPE = "f16"
KV_BYTES_PER_VALUE = 4
ACTIVATION_BYTES_PER_VALUE = 4


def arch_from_header(header: GGUFHeader) -> ArchSpec:
    c = config_from_header(header)
    name = str(header.kv.get("general.name") or header.path.stem)
    return ArchSpec(name=name, n_blocks=c.num_blocks, hidden=c.dim, ffn=c.hidden_dim, n_heads=c.n_heads,
                    n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, vocab=c.vocab_size,
                    tied_head="output.weight" not in header.tensors)


def layout_from_gguf(path_or_header: str | Path | GGUFHeader, digest: str = "") -> ModelLayout:
    header = path_or_header if isinstance(path_or_header, GGUFHeader) else read_header(path_or_header)
    return layout_from_arch(arch_from_header(header), WEIGHT_DTYPE, kv_bytes_per_value=KV_BYTES_PER_VALUE,
                            activation_bytes_per_value=ACTIVATION_BYTES_PER_VALUE, digest=digest)
