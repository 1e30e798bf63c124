"""`swarmd pull NAME`: fetch a model into the local cache now, rather than on first use."""

from __future__ import annotations

import argparse
import sys

ORDER = 60

DESCRIPTION = """\
Fetch a model into the local model cache (shared by every daemon on this machine), check its
sha256 and compute its manifest (the model's identity in a swarm), so that `swarmd run` and
`swarmd join` start without fetching. Prints the file's path on
stdout; progress goes to stderr. Paths and Ollama models are only located and checked.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pull", help="fetch a model by name into the local cache",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help="a known name (e.g. smollm2-135m), a path to a .gguf file, or an Ollama model name")
    p.set_defaults(func=pull)


def pull(args: argparse.Namespace) -> int:
    from models.catalog.names import resolve_model
    from swarmd.daemon.served_model import whole_file_store

    source = resolve_model(args.name, fetch=True)
    manifest = whole_file_store(source.path).digest
    print(f"{source.name}: {source.kind}, sha256 {source.digest}, manifest {manifest}", file=sys.stderr, flush=True)
    print(source.path, flush=True)
    return 0
