"""Entry point: builds the parser from every subcommand module in this package and dispatches."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import swarmd
from swarmd.errors import UserError

DESCRIPTION = """\
swarmd serves language models from a swarm of GPUs. Every machine runs `swarmd join`; the
daemons find each other over libp2p, elect a leader that plans which daemon holds which layers
(and which MoE experts), and pass activations directly between themselves.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmd", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"swarmd {swarmd.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    package = importlib.import_module("swarmd.cli")
    modules = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_") or info.name == "main":
            continue
        module = importlib.import_module(f"swarmd.cli.{info.name}")
        if hasattr(module, "register"):
            modules.append(module)
    for module in sorted(modules, key=lambda m: (getattr(m, "ORDER", 100), m.__name__)):
        module.register(sub)
    return parser


def user_error_line(exc: BaseException) -> str | None:
    """The one line to print for an error the user can act on, or None for a bug."""
    from planner.errors import InfeasiblePlan, PlanSchemaError

    user_errors: tuple[type[BaseException], ...] = (UserError, InfeasiblePlan, PlanSchemaError)
    try:
        from models.errors import ModelError

        user_errors += (ModelError,)
    except ImportError:  # models not importable: no model errors to translate
        pass
    if isinstance(exc, user_errors):
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:
        line = user_error_line(exc)
        if line is None:
            raise
        print(f"swarmd {args.command}: error: {line}", file=sys.stderr, flush=True)
        return getattr(exc, "exit_code", 2)


if __name__ == "__main__":
    sys.exit(main())
