"""The model a swarm serves: its name, its identity, its weights and layout.

A model's identity is the hash of its manifest (`models.gguf.manifest`): members are matched on it, and plans
and descriptors carry it. Weights come from `models.catalog.names.resolve_model` (a known name, a .gguf path, an
Ollama model) as a whole file, or from a partial model in the cache that fetches from the swarm what the plan
assigns (`swarmd.weights`); either way `store` gives its chunks and `path` the GGUF a stage loads from. The
layout the planner needs comes from the GGUF's header (`models.layout.layout_from_gguf`), named as the model is
served so that plans, descriptors and `swarmd plan` agree on the name. A seeded model (`random/llama-3.1-8b`,
`models.catalog.seeded`) has no file: its identity is its architecture and seed, and each stage draws its own
weights. A built-in architecture with no weights on this machine (e.g. `kimi-k2`) still plans: members are told
their layers, and loading them fails with a clear reason.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from models.catalog.seeded import SeededModel, parse_seeded_name
from models.errors import ModelError
from planner import BUILTIN_ARCHS, ModelLayout, layout_from_arch

if TYPE_CHECKING:
    from models.catalog.chunk_store import ChunkStore

log = logging.getLogger(__name__)

LAYOUT_DTYPE = "f16"  # models.gguf.loader dequantises weights to float16


@dataclass(frozen=True)
class ServedModel:
    name: str
    digest: str
    path: Path | None  # None: seeded, or known by architecture only (no weights here)
    layout: ModelLayout
    seeded: SeededModel | None = None  # weights drawn from a seed, not read from `path`
    store: ChunkStore | None = None  # the model's chunks held here (a whole file, or a partial model)


def served_model(spec: str) -> ServedModel:
    """Resolve `spec` (fetching a known model into the cache on first use); ModelError if unknown."""
    from models.catalog.names import resolve_model

    seeded = parse_seeded_name(spec)
    if seeded is not None:
        return seeded_model(seeded)
    try:
        source = resolve_model(spec)
    except ModelError:
        if spec not in BUILTIN_ARCHS:
            raise
        log.warning("no weights for %s here: it can be planned, not served", spec)
        return ServedModel(spec, "", None, layout_from_arch(BUILTIN_ARCHS[spec], LAYOUT_DTYPE))
    return from_store(source.name, whole_file_store(source.path))


def seeded_model(seeded: SeededModel) -> ServedModel:
    layout = layout_from_arch(seeded.arch, seeded.layout_dtype, digest=seeded.digest, name=seeded.name)
    return ServedModel(seeded.name, seeded.digest, None, layout, seeded)


def whole_file_store(path: Path) -> ChunkStore:
    """A whole GGUF's chunks; its manifest is computed on first use (the whole file is read once)."""
    from models.catalog.chunk_store import remembered_digest, whole_file

    if remembered_digest(path) is None:
        print(f"hashing {path.name} into its manifest (once)", file=sys.stderr, flush=True)
    return whole_file(path)


def from_store(name: str, store: ChunkStore) -> ServedModel:
    """The model whose chunks `store` holds (all or some), served as `name`."""
    return ServedModel(name, store.digest, store.path, layout_of(name, store), store=store)


def layout_of(name: str, store: ChunkStore) -> ModelLayout:
    """The layout the manifest's GGUF header gives (sizes as a StageModel holds them), under the served name."""
    from models.layout import layout_from_gguf

    header = store.manifest.gguf_header(store.path)
    layout = layout_from_gguf(header, digest=store.digest)
    return replace(layout, name=name, stored_bytes=store.manifest.tensor_bytes)
