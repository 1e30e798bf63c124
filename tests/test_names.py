"""Model names: known names from the cache, .gguf paths, and models in a local Ollama store."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from models.catalog import names
from models.catalog.names import ModelSource, cached_models, register_model, resolve_model
from models.catalog.store import SMOLLM2_135M
from models.errors import ModelError
from tests.tiny_vocab import write_vocab_gguf

MODEL_LAYER = "application/vnd.ollama.image.model"


def add_ollama_model(root: Path, registry: str, namespace: str, model: str, tag: str, gguf_file: Path) -> str:
    """Put `gguf_file` into a store laid out like Ollama's: a manifest naming a content-addressed blob."""
    data = gguf_file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    template = b'{{ .Prompt }}'
    template_digest = hashlib.sha256(template).hexdigest()
    (root / "blobs" / f"sha256-{template_digest}").write_bytes(template)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": f"sha256:{template_digest}", "size": len(template)},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{template_digest}",
             "size": len(template)},
            {"mediaType": MODEL_LAYER, "digest": f"sha256:{digest}", "size": len(data)},
        ],
    }
    path = root / "manifests" / registry / namespace / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return digest


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    return write_vocab_gguf(tmp_path / "tiny.gguf", pre="llama-bpe")


@pytest.fixture
def ollama_store(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "ollama-models"
    (root / "manifests").mkdir(parents=True)
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return root


def test_known_name_resolves_to_the_cached_wheel_model(smollm2_gguf):
    source = resolve_model("smollm2-135m")
    assert source == ModelSource("smollm2-135m", smollm2_gguf, SMOLLM2_135M.sha256, "wheel")


def test_known_name_not_yet_fetched_says_how_to_pull(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMD_MODELS", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelError, match=r"not in the cache yet: run `swarmd pull smollm2-135m`"):
        resolve_model("smollm2-135m", fetch=False)


def test_gguf_path_resolves_with_its_digest_remembered_beside_it(tiny_gguf):
    source = resolve_model(str(tiny_gguf))
    assert (source.path, source.kind) == (tiny_gguf, "file")
    assert source.digest == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    memo = tiny_gguf.with_name("tiny.gguf.sha256")
    saved = json.loads(memo.read_text())
    memo.write_text(json.dumps({**saved, "sha256": "0" * 64}))
    assert resolve_model(str(tiny_gguf)).digest == "0" * 64  # read back, not recomputed
    os.utime(tiny_gguf, ns=(saved["mtime_ns"] + 10**9, saved["mtime_ns"] + 10**9))
    assert resolve_model(str(tiny_gguf)).digest == source.digest  # file changed: recomputed


def test_missing_file_and_directory_are_clear_errors(tmp_path):
    with pytest.raises(ModelError, match=r"^no such model file: .*nothere\.gguf$"):
        resolve_model(str(tmp_path / "nothere.gguf"))
    with pytest.raises(ModelError, match="is a directory"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("registry", ["registry.example", "models.example.org"])
def test_ollama_names_resolve_to_the_store_blob_whatever_the_registry_directory(
        ollama_store, tiny_gguf, registry):
    digest = add_ollama_model(ollama_store, registry, "library", "llama3.2", "1b", tiny_gguf)
    add_ollama_model(ollama_store, registry, "library", "tinyvocab", "latest", tiny_gguf)
    add_ollama_model(ollama_store, registry, "someone", "thing", "q4", tiny_gguf)
    blob = ollama_store / "blobs" / f"sha256-{digest}"
    assert resolve_model("llama3.2:1b") == ModelSource("llama3.2:1b", blob, digest, "ollama")
    assert resolve_model("tinyvocab").name == "tinyvocab:latest"
    assert resolve_model("someone/thing:q4").path == blob
    assert resolve_model(f"{registry}/library/llama3.2:1b").path == blob
    with pytest.raises(ModelError, match="unknown model"):
        resolve_model("other.registry/library/llama3.2:1b")


def test_manifest_without_a_model_layer_or_blob_is_not_a_model(ollama_store, tiny_gguf):
    digest = add_ollama_model(ollama_store, "reg", "library", "broken", "latest", tiny_gguf)
    (ollama_store / "blobs" / f"sha256-{digest}").unlink()
    (ollama_store / "manifests" / "reg" / "library" / "odd").mkdir(parents=True)
    (ollama_store / "manifests" / "reg" / "library" / "odd" / "latest").write_text("not json")
    for spec in ("broken", "odd"):
        with pytest.raises(ModelError, match=f"unknown model '{spec}'"):
            resolve_model(spec)


def test_unknown_name_lists_known_names_in_one_line(ollama_store):
    with pytest.raises(ModelError) as err:
        resolve_model("llama3.2:1b")
    message = str(err.value)
    assert message.startswith("unknown model 'llama3.2:1b': known names are kimi-k2-mini, smollm2-135m, smollm2-moe-8x2, "
                              "smollm2-moe-8x8, synthetic-moe-1b, synthetic-moe-small, synthetic-moe-tiny; "
                              "or give a path to a .gguf file")
    assert str(ollama_store) in message and "\n" not in message


def test_registered_names_resolve_through_their_resolver(tiny_gguf, monkeypatch):
    monkeypatch.setattr(names, "KNOWN_MODELS", dict(names.KNOWN_MODELS))
    calls = []

    def synthetic(name: str, fetch: bool) -> ModelSource:
        calls.append((name, fetch))
        return ModelSource(name, tiny_gguf, "f" * 64, "synthetic")

    register_model("tiny-synthetic", synthetic)
    assert resolve_model("tiny-synthetic", fetch=False).kind == "synthetic"
    assert calls == [("tiny-synthetic", False)]
    assert "tiny-synthetic" in names.known_names()
    with pytest.raises(ValueError, match="already registered"):
        register_model("tiny-synthetic", synthetic)


def test_cached_models_lists_the_cache_and_the_ollama_store(ollama_store, tiny_gguf, smollm2_gguf):
    add_ollama_model(ollama_store, "reg", "library", "llama3.2", "1b", tiny_gguf)
    listed = {(m.name, m.kind): m for m in cached_models()}
    assert listed[("smollm2-135m", "wheel")].size == SMOLLM2_135M.size
    assert listed[("llama3.2:1b", "ollama")].size == tiny_gguf.stat().st_size
