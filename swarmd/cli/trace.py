"""`swarmd trace summarize FILE`: the per-token breakdown of a trace written by `swarmd submit-prompt --trace`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from swarmd.errors import UserError

ORDER = 35

DESCRIPTION = """\
Read a Chrome trace-event JSON written by `swarmd submit-prompt --trace FILE` (or fetched from a daemon's
GET /api/v0/trace/REQUEST_ID) and print where a token's time goes: for every stage, the head and every hop,
each phase's time at the prefill (step 0) and its median and 95th percentile over the decode steps.

examples:
  swarmd submit-prompt --trace out.json -n 64 "The capital of France is"
  swarmd trace summarize out.json
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="read request traces (per-token breakdown)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="trace_command", required=True, metavar="COMMAND")
    s = actions.add_parser("summarize", help="print the per-token breakdown of a trace file",
                           description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("file", type=Path, help="a trace written by submit-prompt --trace")
    s.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    s.set_defaults(func=summarize)


def load_events(path: Path) -> list[dict]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the trace {path}: {e}") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise UserError(f"{path} is not a Chrome trace (no traceEvents list)")
    return events


def summarize(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from rich.console import Console

    from swarmd.observe.trace_summary import breakdown, render

    b = breakdown(load_events(args.file))
    if not b.rows:
        raise UserError(f"{args.file} has no spans with steps: was it written with --trace by a daemon of this "
                        "version?")
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in b.rows], "token_interval_ms": b.token_interval_ms,
                          "tokens": b.tokens, "nodes": b.nodes, "parts_ms": b.parts_ms}, indent=2))
        return 0
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # a pipe or a file: no wrapping of the names
    console.print(render(b, title=f"per-token breakdown of {args.file.name}"))
    return 0
