"""The model a swarm serves: its name, the digest every member must share, its weights and layout.

Weights come from `models.names.resolve_model` (a known name, a .gguf path, an Ollama model). The
layout the planner needs comes from `models.layout.layout_from_gguf` where that exists, else from
the GGUF header's shape (`models.config`), else from the built-in architectures by name. A built-in
architecture with no weights on this machine (e.g. `kimi-k2`) still plans: members are told their
layers, and loading them fails with a clear reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from models.errors import ModelError
from planner import BUILTIN_ARCHS, ArchSpec, ModelLayout, layout_from_arch

log = logging.getLogger("swarmd.model")

LAYOUT_DTYPE = "f16"  # models.gguf_loader dequantises weights to float16


@dataclass(frozen=True)
class ServedModel:
    name: str
    digest: str
    path: Path | None  # None: known by architecture only, no weights here
    layout: ModelLayout


def served_model(spec: str) -> ServedModel:
    """Resolve `spec` (fetching a known model into the cache on first use); ModelError if unknown."""
    from models.names import resolve_model

    try:
        source = resolve_model(spec)
    except ModelError:
        if spec not in BUILTIN_ARCHS:
            raise
        log.warning("no weights for %s here: it can be planned, not served", spec)
        return ServedModel(spec, "", None, layout_from_arch(BUILTIN_ARCHS[spec], LAYOUT_DTYPE))
    return ServedModel(source.name, source.digest, source.path, layout_of(source.name, source.path, source.digest))


def layout_of(name: str, path: Path, digest: str) -> ModelLayout:
    try:
        from models.layout import layout_from_gguf  # type: ignore[import-not-found]
    except ImportError:
        layout_from_gguf = None
    if layout_from_gguf is not None:
        return layout_from_gguf(path)
    if name in BUILTIN_ARCHS:
        return layout_from_arch(BUILTIN_ARCHS[name], LAYOUT_DTYPE, digest=digest)
    return layout_from_arch(arch_from_gguf(name, path), LAYOUT_DTYPE, digest=digest)


def arch_from_gguf(name: str, path: Path) -> ArchSpec:
    """The shape of a dense Llama-family GGUF, read from its header only."""
    from models.config import config_from_header
    from models.gguf_meta import read_header

    header = read_header(path)
    c = config_from_header(header)
    return ArchSpec(name, n_blocks=c.num_blocks, hidden=c.dim, ffn=c.hidden_dim, n_heads=c.n_heads,
                    n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, vocab=c.vocab_size,
                    tied_head="output.weight" not in header.tensors)
