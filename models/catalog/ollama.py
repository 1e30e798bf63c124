"""Models in the user's local Ollama store, read in place (nothing is copied or fetched).

The store holds `manifests/<registry>/<namespace>/<model>/<tag>` (JSON; the layer whose mediaType is
`application/vnd.ollama.image.model` is the GGUF) and `blobs/sha256-<hex>`. The registry directory's
name depends on the Ollama version, so every directory under `manifests/` is searched.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass(frozen=True)
class OllamaName:
    registry: str | None  # None: any registry directory in the store
    namespace: str
    model: str
    tag: str

    def __str__(self) -> str:
        short = self.model if self.namespace == DEFAULT_NAMESPACE else f"{self.namespace}/{self.model}"
        return f"{short}:{self.tag}"


@dataclass(frozen=True)
class OllamaModel:
    name: str  # e.g. "llama3.2:1b"
    blob: Path  # the GGUF
    sha256: str  # from the blob's name, which Ollama checked when it pulled it
    size: int
    manifest: Path


def parse_name(spec: str) -> OllamaName | None:
    """`model`, `model:tag`, `namespace/model:tag` or `registry/namespace/model:tag`; None if `spec` is
    not shaped like an Ollama name."""
    path, _, tag = spec.partition(":")
    parts = path.split("/")
    if not 1 <= len(parts) <= 3 or not all(_PART.match(p) for p in parts):
        return None
    tag = tag or DEFAULT_TAG
    if not _PART.match(tag):
        return None
    registry = parts[0] if len(parts) == 3 else None
    namespace = parts[-2] if len(parts) >= 2 else DEFAULT_NAMESPACE
    return OllamaName(registry, namespace, parts[-1], tag)


def store_roots() -> list[Path]:
    """Where Ollama keeps models: `$OLLAMA_MODELS` if set, else its per-user and system-service homes."""
    if env := os.environ.get("OLLAMA_MODELS"):
        return [Path(env).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def _model_layer(manifest: Path, root: Path) -> tuple[Path, str, int] | None:
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
    except (OSError, ValueError, AttributeError):
        return None
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == MODEL_MEDIA_TYPE:
            match = _DIGEST.match(str(layer.get("digest", "")))
            if match:
                blob = root / "blobs" / f"sha256-{match.group(1)}"
                return blob, match.group(1), int(layer.get("size") or 0)
    return None


def _registries(root: Path) -> list[Path]:
    manifests = root / "manifests"
    try:
        return sorted(p for p in manifests.iterdir() if p.is_dir())
    except OSError:
        return []


def find_model(spec: str, roots: list[Path] | None = None) -> OllamaModel | None:
    """The local GGUF blob behind an Ollama model name, or None when no store has it."""
    name = parse_name(spec)
    if name is None:
        return None
    for root in roots if roots is not None else store_roots():
        for registry in _registries(root):
            if name.registry is not None and registry.name != name.registry:
                continue
            manifest = registry / name.namespace / name.model / name.tag
            layer = _model_layer(manifest, root) if manifest.is_file() else None
            if layer and layer[0].is_file():
                blob, sha, _ = layer
                return OllamaModel(str(name), blob, sha, blob.stat().st_size, manifest)
    return None


def list_models(roots: list[Path] | None = None) -> list[OllamaModel]:
    """Every model in the local stores whose GGUF blob is present, sorted by name."""
    found: dict[str, OllamaModel] = {}
    for root in roots if roots is not None else store_roots():
        for registry in _registries(root):
            for manifest in sorted(registry.glob("*/*/*")):
                layer = _model_layer(manifest, root) if manifest.is_file() else None
                if not layer or not layer[0].is_file():
                    continue
                namespace, model, tag = manifest.parts[-3:]
                name = str(OllamaName(registry.name, namespace, model, tag))
                found.setdefault(name, OllamaModel(name, layer[0], layer[1], layer[0].stat().st_size, manifest))
    return [found[k] for k in sorted(found)]
