"""`swarmd models`: the models this machine can use without fetching anything; with `--cache`, the graphs
captured for them and kept on disk (`models.tinygrad_ext.graph_cache`), and `--cache --clear` to delete them."""

from __future__ import annotations

import argparse
import time

from swarmd.errors import UserError

ORDER = 70


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "models", help="list the models in the local cache and the local Ollama store (--cache: the graph cache)",
        description="List the models usable without fetching: known names already pulled into the local "
                    "cache, models found in the local Ollama store, and models fetched from a swarm (whole or "
                    "partial). MANIFEST is the model's identity, the hash of its manifest (what members are "
                    "matched on; `swarmd join --model manifest:HASH` names a model by it). With --cache, list "
                    "the graph cache instead: the computation graphs captured for the stages this machine ran, "
                    "kept on disk so that a new process (swarmd run, a daemon's stage) starts without capturing "
                    "them again ($SWARMD_GRAPH_CACHE, default ~/.cache/swarmd/graphs; bounded by "
                    "$SWARMD_GRAPH_CACHE_MB, default 2048; the least recently used go first).")
    p.add_argument("--cache", action="store_true", help="list the graph cache: what each graph is for, its "
                   "size and when it was last used")
    p.add_argument("--clear", action="store_true", help="with --cache: delete every graph in it (they are "
                   "captured again when next needed)")
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

    if args.clear and not args.cache:
        raise UserError("--clear deletes the graph cache: give it with --cache")
    if args.cache:
        return show_graph_cache(clear=args.clear)

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


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def show_graph_cache(*, clear: bool) -> int:
    """List the graph cache's entries, least recently used first, and its total against its bound (or clear it)."""
    from rich.console import Console
    from rich.table import Table

    from models.tinygrad_ext.graph_cache import ENV_DIR, default_cache

    console = Console()
    if not console.is_terminal:
        console = Console(width=4096)
    cache = default_cache()
    if cache is None:
        console.print(f"the graph cache is off (${ENV_DIR} or tinygrad's JIT=0)", highlight=False)
        return 0
    if clear:
        count, size = cache.clear()
        console.print(f"deleted {count} graphs ({_size(size)}) from {cache.root}", highlight=False)
        return 0
    entries = cache.entries()
    if not entries:
        console.print(f"no graphs cached in {cache.root}; a stage stores its graphs there when it first runs them",
                      highlight=False)
        return 0
    table = Table(box=None, pad_edge=False)
    for name, justify in (("MODEL", "left"), ("PART", "left"), ("GRAPH", "left"), ("DEVICE", "left"),
                          ("SIZE", "right"), ("LAST USED", "right")):
        table.add_column(name, no_wrap=True, justify=justify)  # type: ignore[arg-type]
    for e in entries:
        label = e.label
        table.add_row(str(label.get("model") or "?"), str(label.get("owner") or "?"), str(label.get("graph") or "?"),
                      str(label.get("device") or "?"), _size(e.size), _ago(e.last_used))
    console.print(table, highlight=False)
    total = sum(e.size for e in entries)
    console.print(f"{len(entries)} graphs, {_size(total)} of {_size(cache.max_bytes)} in {cache.root}", highlight=False)
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
