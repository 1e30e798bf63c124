"""`swarmd models --cache` lists the graph cache (what each graph is for, its size, when last used) and
`--cache --clear` empties it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from models.tinygrad_ext.graph_cache import GraphCache

ROOT = Path(__file__).resolve().parents[1]


def swarmd(*args: str, cache: Path | str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmd", "models", *args], capture_output=True, text=True,
                          env={**os.environ, "SWARMD_GRAPH_CACHE": str(cache)}, cwd=ROOT, timeout=60)


def test_models_cache_lists_each_graph_and_clear_deletes_them(tmp_path):
    cache = GraphCache(tmp_path / "graphs")
    label = {"model": "tiny.gguf", "owner": "blocks 0-4", "device": "CPU"}
    assert cache.write({"n": 1}, b"x" * 3000, {**label, "graph": "prefill (blocks 0-4)"})
    assert cache.write({"n": 2}, b"y" * 5000, {**label, "graph": "decode, batch 2 (blocks 0-4)"})
    listed = swarmd("--cache", cache=cache.root)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert rows[0][:4] == ["MODEL", "PART", "GRAPH", "DEVICE"]
    assert " ".join(rows[1]).startswith("tiny.gguf blocks 0-4 prefill (blocks 0-4) CPU")
    assert " ".join(rows[2]).startswith("tiny.gguf blocks 0-4 decode, batch 2 (blocks 0-4) CPU")
    size = f"{cache.total_bytes() / 1024:.1f} KiB"  # the payloads and their headers
    assert listed.stdout.splitlines()[-1] == f"2 graphs, {size} of 2.0 GiB in {cache.root}"

    cleared = swarmd("--cache", "--clear", cache=cache.root)
    assert cleared.stdout.strip() == f"deleted 2 graphs ({size}) from {cache.root}"
    assert cache.entries() == []
    empty = swarmd("--cache", cache=cache.root)
    assert empty.stdout.startswith(f"no graphs cached in {cache.root}")


def test_clear_without_cache_is_refused_and_an_off_cache_says_so(tmp_path):
    refused = swarmd("--clear", cache=tmp_path)
    assert refused.returncode == 2 and "--clear deletes the graph cache: give it with --cache" in refused.stderr
    off = swarmd("--cache", cache="off")
    assert off.returncode == 0 and off.stdout.startswith("the graph cache is off")
