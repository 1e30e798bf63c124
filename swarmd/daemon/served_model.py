"""The model a swarm serves: its name, the digest every member must share, its weights and layout.

Weights come from `models.catalog.names.resolve_model` (a known name, a .gguf path, an Ollama model); the
layout the planner needs from the GGUF's header (`models.layout.layout_from_gguf`), named as the
model is served so that plans, descriptors and `swarmd plan` agree on the name. A seeded model
(`random/llama-3.1-8b`, `models.catalog.seeded`) has no file: its layout comes from its architecture and
each stage draws its own weights. A built-in architecture with no weights on this machine (e.g.
`kimi-k2`) still plans: members are told their layers, and loading them fails with a clear reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from models.catalog.seeded import SeededModel, parse_seeded_name
from models.errors import ModelError
from planner import BUILTIN_ARCHS, ModelLayout, layout_from_arch

log = logging.getLogger(__name__)

LAYOUT_DTYPE = "f16"  # models.gguf.loader dequantises weights to float16


@dataclass(frozen=True)
class ServedModel:
    name: str
    digest: str
    path: Path | None  # None: seeded, or known by architecture only (no weights here)
    layout: ModelLayout
    seeded: SeededModel | None = None  # weights drawn from a seed, not read from `path`


def served_model(spec: str) -> ServedModel:
    """Resolve `spec` (fetching a known model into the cache on first use); ModelError if unknown."""
    from models.catalog.names import resolve_model

    seeded = parse_seeded_name(spec)
    if seeded is not None:
        layout = layout_from_arch(seeded.arch, seeded.layout_dtype, digest=seeded.digest, name=seeded.name)
        return ServedModel(seeded.name, seeded.digest, None, layout, seeded)
    try:
        source = resolve_model(spec)
    except ModelError:
        if spec not in BUILTIN_ARCHS:
            raise
        log.warning("no weights for %s here: it can be planned, not served", spec)
        return ServedModel(spec, "", None, layout_from_arch(BUILTIN_ARCHS[spec], LAYOUT_DTYPE))
    return ServedModel(source.name, source.digest, source.path, layout_of(source.name, source.path, source.digest))


def layout_of(name: str, path: Path, digest: str) -> ModelLayout:
    """The layout the GGUF's header gives (sizes as a StageModel holds them), under the served name."""
    from models.layout import layout_from_gguf

    return replace(layout_from_gguf(path, digest=digest), name=name)
