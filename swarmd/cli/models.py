"""`swarmd models`: the models this machine can use without fetching anything."""

from __future__ import annotations

import argparse

ORDER = 70


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "models", help="list the models in the local cache and the local Ollama store",
        description="List the models usable without fetching: known names already pulled into the local "
                    "cache, models found in the local Ollama store, and models fetched from a swarm (whole or "
                    "partial). MANIFEST is the model's identity, the hash of its manifest (what members are "
                    "matched on; `swarmd join --model manifest:HASH` names a model by it).")
    p.set_defaults(func=list_models)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def list_models(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from models.catalog.chunk_store import partial_models
    from models.catalog.names import cached_models, known_names
    from models.catalog.store import cache_dir

    console = Console()
    if not console.is_terminal:  # piped: whole paths on one line each, for scripts
        console = Console(width=4096)
    found = cached_models()
    partial = partial_models()
    if not found and not partial:
        console.print(f"no models cached in {cache_dir()}; fetch one with `swarmd pull "
                      f"{known_names()[0] if known_names() else 'NAME'}`", highlight=False)
        return 0
    table = Table(box=None, pad_edge=False)
    table.add_column("NAME", no_wrap=True)
    table.add_column("SIZE", no_wrap=True, justify="right")
    table.add_column("SOURCE", no_wrap=True)
    table.add_column("MANIFEST", no_wrap=True)
    table.add_column("PATH", overflow="fold")
    for m in found:
        table.add_row(m.name, _size(m.size), m.kind, _digest(m.path, m.size), str(m.path))
    for p in partial:
        held, total = p.held_bytes(), p.manifest.tensor_bytes
        size = _size(held) if held == total else f"{_size(held)} of {_size(total)}"
        table.add_row(", ".join(p.names) or "-", size, "swarm" if held == total else "swarm (partial)",
                      p.digest[:16], str(p.path))
    console.print(table, highlight=False)
    return 0


HASH_ON_LISTING = 512 << 20  # larger files show their identity once `swarmd pull` (or a daemon) has hashed them


def _digest(path, size: int) -> str:
    from models.catalog.chunk_store import remembered_digest, whole_file
    from models.errors import ModelError

    known = remembered_digest(path)
    if known is None and size <= HASH_ON_LISTING:
        try:
            known = whole_file(path).digest
        except (ModelError, OSError):
            return "(not a GGUF)"
    return known[:16] if known else "(run swarmd pull)"
