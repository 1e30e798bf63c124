"""`swarmd plan`: print the Plan the planner would make for given nodes (the leader uses the same function)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmd.errors import UserError

if TYPE_CHECKING:
    from planner import ModelLayout, NodeDescriptor, PlanOptions

ORDER = 40

EPILOG = """\
examples:
  swarmd plan --model kimi-k2 --fleet 40x4090,8x3090,4x3060
  swarmd plan --model synthetic-moe-small --fleet 2x4090,2x3090,2x3060 --regions 2 --rtt-ms 1,60 --out moe.json
  swarmd plan --model kimi-k2 --fleet 300x4090,300x3090 --regions 3 --rtt-ms 5,60 --uplink-mbit 100 --json
  swarmd plan --model llama-3-70b --nodes nodes.json --policy min-latency

GPUs for --fleet: 3060 (RTX 3060 12GB), 3090, 4060ti (16GB), 4090, 5090, a4000, m2ultra (192GB).

--out writes a plan file: the Plan JSON with the fleet's node names (slots) where peer ids go, and the
fleet (each slot's device, memory and region; the regions' RTT and uplink). `swarmd cluster up --plan FILE`
brings that fleet up on this machine; `swarmd join --plan FILE --slot NAME` claims one slot on a real machine.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="print the Plan the planner would make for given nodes",
        description="Plan which node runs which blocks and experts of a model, and predict its speed.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="NAME",
                   help="any model `swarmd run` accepts (a known name, written into the model cache first if "
                        "needed, a .gguf file or an Ollama name: its layout is read from the GGUF), or a built-in "
                        "layout (llama-3.2-1b, llama-3.1-8b, llama-3-70b, mixtral-8x7b, deepseek-v3, kimi-k2)")
    nodes = p.add_mutually_exclusive_group(required=True)
    nodes.add_argument("--nodes", metavar="FILE", help="JSON list of NodeDescriptors ('-' reads stdin)")
    nodes.add_argument("--fleet", metavar="SPEC", help="simulated GPUs, e.g. 40x4090,8x3090,4x3060")
    p.add_argument("--policy", default="balanced", choices=["balanced", "min-latency"])
    p.add_argument("--dtype", choices=["int4", "int8", "bf16"],
                   help="weights for a built-in layout (default: int4 over 100 B parameters, else bf16)")
    p.add_argument("--regions", type=int, default=1, metavar="K", help="--fleet: spread nodes over K regions")
    p.add_argument("--rtt-ms", default="1,50", metavar="INTRA,INTER", help="--fleet: RTT inside / between regions")
    p.add_argument("--uplink-mbit", type=float, default=1000.0, metavar="N", help="--fleet: every node's uplink")
    p.add_argument("--context", type=int, metavar="TOKENS", help="KV budget per request (default 2048)")
    p.add_argument("--concurrency", type=int, metavar="N", help="requests whose KV must fit at once (default 4)")
    p.add_argument("--expert-load", metavar="FILE",
                   help='JSON {"<block>": [load per expert, ...]}: hot experts get replicas')
    p.add_argument("--previous", metavar="FILE", help="a Plan to re-plan from (keeps assignments where it can)")
    p.add_argument("--json", action="store_true", help="print the Plan as JSON on stdout")
    p.add_argument("--out", type=Path, metavar="FILE",
                   help="--fleet: write a plan file (the Plan naming the fleet's slots, and the fleet) for "
                        "`swarmd cluster up --plan` and `swarmd join --plan FILE --slot NAME`")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner import Plan, make_plan

    if args.out is not None and not args.fleet:
        raise UserError("--out writes a plan for a fleet's slots: give --fleet (e.g. --fleet 2x4090,2x3090)")
    layout = resolve_layout(args.model, args.dtype)
    nodes = load_nodes(args)
    options = plan_options(args)
    previous = Plan.loads(_read(args.previous)) if args.previous else None
    plan = make_plan(layout, nodes, policy=args.policy, options=options, previous=previous)
    if args.out is not None:
        write_plan_file(args.out, plan, args)
    if args.json:
        sys.stdout.write(plan.dumps() + "\n")
    else:
        print_table(plan, layout, nodes, options)
    return 0


def resolve_layout(name: str, dtype: str | None) -> ModelLayout:
    """A model `swarmd run` accepts, laid out as its daemons serve it (name, digest and sizes from its GGUF, the
    file written into the model cache first if needed); else a built-in layout. A name that is both (e.g.
    smollm2-135m) is planned as served, unless --dtype asks for the built-in layout."""
    from models.errors import ModelError
    from planner import BUILTIN_ARCHS, layout_from_arch
    from planner.arch import default_dtype
    from swarmd.daemon.served_model import served_model

    arch = BUILTIN_ARCHS.get(name.lower())
    if arch is not None and (dtype or not servable(name)):
        return layout_from_arch(arch, dtype or default_dtype(arch))
    try:
        layout = served_model(name).layout
    except ModelError as e:
        raise UserError(f"unknown model {name!r}; built-in layouts: {', '.join(BUILTIN_ARCHS)}; or a name "
                        f"`swarmd run` accepts ({str(e).removeprefix(f'unknown model {name!r}: ')})") from None
    if dtype and layout.dtype != dtype:
        raise UserError(f"{name} is served as {layout.dtype} weights; --dtype only applies to built-in layouts")
    return layout


def servable(name: str) -> bool:
    """Whether `name` names weights `swarmd run` can load (a registered name or a file), not only an architecture."""
    from models.catalog.names import KNOWN_MODELS

    return name in KNOWN_MODELS or Path(name).expanduser().is_file()


def write_plan_file(path: Path, plan: Any, args: argparse.Namespace) -> None:
    """The plan naming the fleet's slots, with the fleet, as `swarmd cluster up` and `join --slot` read it."""
    from planner.fleet import simulated_fleet
    from planner.plan_file import PlanFile, fleet_of

    fleet = simulated_fleet(args.fleet, regions=args.regions, rtt_ms=_pair(args.rtt_ms, "--rtt-ms"),
                            uplink_mbit=args.uplink_mbit)
    nodes = fleet.nodes
    doc = PlanFile(plan, fleet_of([n.peer_id for n in nodes], [n.label for n in nodes],
                                  [n.memory_total for n in nodes], fleet.regions, fleet.rtt_ms.tolist(),
                                  fleet.uplink_mbit))
    try:
        path.write_text(doc.dumps() + "\n")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    idle = [n for n in doc.fleet.names if n not in plan.peers()]
    print(f"wrote {path}: {len(plan.stages)} stages over {len(nodes)} slots in {args.regions} region(s)"
          + (f"; {len(idle)} slot(s) without an assignment: {', '.join(idle)}" if idle else ""), file=sys.stderr)


def load_nodes(args: argparse.Namespace) -> list[NodeDescriptor]:
    from planner import NodeDescriptor, PlanSchemaError
    from planner.fleet import make_fleet

    if args.fleet:
        rtt = _pair(args.rtt_ms, "--rtt-ms")
        try:
            return make_fleet(args.fleet, regions=args.regions, rtt_ms=rtt, uplink_mbit=args.uplink_mbit)
        except PlanSchemaError as e:
            raise UserError(f"--fleet: {e}") from e
    doc = _json(_read(args.nodes), args.nodes)
    if isinstance(doc, dict) and "nodes" in doc:
        doc = doc["nodes"]
    if not isinstance(doc, list):
        raise UserError(f"{args.nodes}: expected a JSON list of NodeDescriptors")
    return [NodeDescriptor.from_json(d) for d in doc]


def plan_options(args: argparse.Namespace) -> PlanOptions:
    from planner import PlanOptions

    kw: dict[str, Any] = {}
    if args.context is not None:
        kw["context_length"] = args.context
    if args.concurrency is not None:
        kw["concurrency"] = args.concurrency
    if args.expert_load:
        doc = _json(_read(args.expert_load), args.expert_load)
        if not isinstance(doc, dict):
            raise UserError(f"{args.expert_load}: expected a JSON object of block -> loads")
        kw["expert_load"] = {int(b): tuple(float(x) for x in v) for b, v in doc.items()}
    return PlanOptions(**kw)


def print_table(plan: Any, layout: ModelLayout, nodes: list[NodeDescriptor], options: PlanOptions) -> None:
    from rich.console import Console
    from rich.table import Table

    from planner.report import node_rows

    gib = 1024**3
    rows = node_rows(plan, layout, nodes, options)
    table = Table(title=f"{layout.name} ({layout.dtype}) over {len(nodes)} nodes, policy {plan.policy}")
    for col, justify in (("stage", "left"), ("node", "left"), ("GPU", "left"), ("blocks", "left"),
                         ("experts", "left"), ("GiB used/free", "right"), ("ms/token", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    shown = [r for r in rows if r.role != "idle"]
    limit = 40
    for r in shown[:limit]:
        table.add_row(
            r.role, r.peer_id, r.label, _span(r.blocks[0], r.blocks[1] - 1) if r.blocks else "",
            f"{r.experts} of {_span(r.expert_blocks[0], r.expert_blocks[-1])}" if r.experts else "",
            f"{r.memory_used / gib:.1f} / {r.memory_free / gib:.1f}",
            f"{r.ms_per_token:.2f}" if r.ms_per_token is not None else "-",
        )
    if len(shown) > limit:
        table.add_row("...", f"{len(shown) - limit} more nodes", "", "", "", "", "")
    idle = len(rows) - len(shown)
    console = Console(width=None if sys.stdout.isatty() else 132)
    console.print(table)
    p = plan.predicted
    console.print(f"predicted: {p.token_latency_ms:.1f} ms/token, {p.stream_tokens_per_s:.2f} tokens/s per stream, "
                  f"{p.aggregate_tokens_per_s:.1f} tokens/s at {options.concurrency} streams, "
                  f"{p.saturated_tokens_per_s:.1f} tokens/s saturated")
    console.print(f"bottleneck: {p.bottleneck}")
    if idle:
        console.print(f"{idle} node(s) without an assignment")
    for line in plan.reasons[:1]:
        console.print(line)


def _span(a: int, b: int) -> str:
    return f"{a}-{b}" if b > a else str(a)


def _pair(text: str, flag: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError as e:
        raise UserError(f"{flag} takes two numbers, INTRA,INTER (got {text!r})") from e
    return a, b


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from e


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not JSON: {e}") from e
