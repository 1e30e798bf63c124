"""`swarmd cluster up --plan FILE` and `swarmd cluster down`: a plan file's fleet on this machine."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from swarmd.errors import UserError

ORDER = 45
DEFAULT_CHAT = "Give me three reasons to learn Python."

DESCRIPTION = """\
Bring a plan file's fleet up on this machine and run a prompt through it: one `swarmd join` per slot, with
the slot's memory limit and device label, on free loopback ports. Connections between slots of different
regions (libp2p and the activation data plane alike) go through a link emulator with the plan's round trip
(half of it each way) and uplink; connections inside a region go straight. Once every stage and expert is
loaded (progress on stderr), the prompt is sent; stdout gets exactly what `swarmd run` prints for the same
arguments (the completion), stderr the per-token trace's table, and the trace itself is written as Perfetto
JSON. Then every daemon is stopped, unless --keep. On an error, Ctrl-C or SIGTERM every process it started is
stopped and it exits non-zero with the reason.

Everything lives under $SWARMD_HOME/cluster: each slot's home and daemon.log (a slot keeps its peer id from
run to run), the emulator's log, and the state `swarmd cluster down` reads.

examples:
  swarmd plan --model kimi-k2-mini --fleet 2x4090,2x3090,2x3060 --regions 2 --rtt-ms 1,60 --out kimi.json
  swarmd cluster up --plan kimi.json --prompt "The capital of France is" --max-tokens 24
  swarmd cluster up --plan kimi.json --keep && swarmd submit-prompt --api URL "Hello" && swarmd cluster down
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="bring a plan file's fleet up on this machine (emulated WAN links)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    up = actions.add_parser("up", help="start every slot of a plan file, run a prompt, stop (unless --keep)",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("--plan", type=Path, required=True, metavar="FILE",
                    help="a plan file (`swarmd plan --fleet ... --out FILE`)")
    what = up.add_mutually_exclusive_group()
    what.add_argument("--prompt", metavar="TEXT", help="text to continue as it is (no chat template)")
    what.add_argument("--chat", metavar="TEXT", help=f"a user message through the chat template (default: {DEFAULT_CHAT!r})")
    up.add_argument("--max-tokens", "-n", type=int, default=128, metavar="N", help="tokens to generate (default: 128)")
    up.add_argument("--temperature", "-t", type=float, default=0.0, metavar="T",
                    help="sampling temperature; 0 picks the most likely token every step (default: 0)")
    up.add_argument("--trace", type=Path, metavar="FILE",
                    help="where to write the request's per-token trace (default: $SWARMD_HOME/cluster/trace.json)")
    up.add_argument("--keep", action="store_true", help="leave the cluster up after the prompt (`swarmd cluster down`)")
    up.add_argument("--ready-timeout", type=float, default=600.0, metavar="SECONDS",
                    help="how long every stage and expert may take to load (default: 600)")
    up.add_argument("--claim-timeout", type=float, default=120.0, metavar="SECONDS",
                    help="each daemon's --claim-timeout (default: 120)")
    up.set_defaults(func=run_up)
    down = actions.add_parser("down", help="stop a cluster left up with --keep")
    down.set_defaults(func=run_down)


def _say(line: str) -> None:
    print(f"[cluster] {line}", file=sys.stderr, flush=True)


class Interrupted(Exception):
    """SIGINT or SIGTERM while the cluster runs."""


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def run_up(args: argparse.Namespace) -> int:
    from swarmd.cluster.bringup import Cluster
    from swarmd.config import default_home

    if args.max_tokens < 1 or args.temperature < 0:
        raise UserError("--max-tokens must be at least 1 and --temperature at least 0")
    directory = default_home() / "cluster"
    body: dict[str, Any] = {"prompt": args.prompt} if args.prompt is not None else {"chat": args.chat or DEFAULT_CHAT}
    body.update(max_tokens=args.max_tokens, temperature=args.temperature, trace=True)
    cluster = Cluster(args.plan, directory, _say, claim_timeout=args.claim_timeout)
    handlers = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    kept = False
    try:
        fleet = cluster.file.fleet
        _say(f"bringing up {len(fleet.slots)} slots of {args.plan.name} in {fleet.regions} region(s) "
             f"(homes and logs under {directory})")
        cluster.start()
        cluster.wait_ready(args.ready_timeout)
        _say(f"ready {time.monotonic() - cluster.started_at:.1f} s after `cluster up`; sending the prompt to "
             f"slot {cluster.founder} (stage 0, the head)")
        result = cluster.generate(body, sys.stdout)
        if sys.stdout.isatty():
            print(flush=True)
        trace = args.trace or directory / "trace.json"
        _write_trace(trace, result.get("trace", []))
        _say(summary(result))
        if args.keep:
            kept = True
            _say(f"the cluster stays up: API at {cluster.api} (`swarmd submit-prompt --api {cluster.api} ...`); "
                 "`swarmd cluster down` stops it")
        return 0
    except Interrupted as e:
        raise UserError(f"interrupted by {e}: stopped every process it started") from None
    finally:
        for s in handlers:
            signal.signal(s, signal.SIG_IGN)  # the stop below must finish
        try:
            if not kept:
                cluster.stop()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)


def run_down(args: argparse.Namespace) -> int:
    from swarmd.cluster.bringup import down
    from swarmd.config import default_home

    return down(default_home() / "cluster", _say)


def _write_trace(path: Path, events: list[dict[str, Any]]) -> None:
    from rich.console import Console

    from swarmd.observe.chrome_trace import write_trace
    from swarmd.observe.trace_summary import breakdown, render

    try:
        write_trace(path, events)
    except OSError as e:
        raise UserError(f"cannot write the trace to {path}: {e.strerror}") from None
    _say(f"per-token trace (Perfetto JSON): {path}")
    b = breakdown(events)
    Console(stderr=True, width=160).print(render(b, title=f"per-token breakdown of {path.name}"))


def summary(result: dict[str, Any]) -> str:
    usage, t = result["usage"], result["timings"]
    parts = [f"{usage['prompt_tokens']} prompt tokens", f"{usage['completion_tokens']} tokens"]
    if t.get("time_to_first_token_s") is not None:
        parts.append(f"time to first token {t['time_to_first_token_s']:.2f} s")
    if t.get("decode_tokens_per_s"):
        parts.append(f"decode {t['decode_tokens_per_s']:.2f} tok/s")
    return "; ".join(parts) + f"; finish: {result['finish_reason']}"
