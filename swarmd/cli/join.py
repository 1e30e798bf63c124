"""`swarmd join`: run a daemon in the foreground, founding a swarm or joining one."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from swarmd.errors import UserError

ORDER = 10
LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("join", help="start a daemon and join (or found) a swarm",
                       description="Run a swarmd daemon in the foreground. Without --bootstrap it founds a swarm; "
                                   "with it, it joins the swarm of the peers named.")
    p.add_argument("--swarm", help="swarm name: a namespace and the gossip topic prefix (default: swarmd)")
    p.add_argument("--listen", action="append", metavar="MULTIADDR",
                   help="where to listen for peers, repeatable (default: /ip4/0.0.0.0/tcp/0)")
    p.add_argument("--announce", action="append", metavar="MULTIADDR",
                   help="what peers are told to dial instead of the listen addresses, repeatable")
    p.add_argument("--bootstrap", action="append", metavar="MULTIADDR",
                   help="a member to join through, ending in /p2p/<peer id>; repeatable (also SWARMD_BOOTSTRAP)")
    p.add_argument("--model", help="model to serve: a known name, a .gguf path or an Ollama name (default: smollm2-135m)")
    p.add_argument("--api", metavar="HOST:PORT", help="local HTTP API address (default: 127.0.0.1:8765)")
    p.add_argument("--home", type=Path, help="state directory (default: $SWARMD_HOME or ~/.swarmd)")
    p.add_argument("--device", help="tinygrad device: auto, CPU, CUDA, METAL, ... (default: auto)")
    p.add_argument("--memory-limit", metavar="SIZE", help="memory this daemon may use, e.g. 12GiB")
    p.add_argument("--device-label", metavar="TEXT", help="name shown for this device, e.g. 'RTX 3060 12GB'")
    p.add_argument("--mdns", action="store_true", default=None, help="also find peers on the LAN with mDNS")
    p.add_argument("--plan", type=Path, metavar="FILE",
                   help="founding daemon only: adopt this Plan (JSON, e.g. from `swarmd plan --json`) once the "
                        "peers it names have joined, instead of computing one")
    p.add_argument("--standby", action="store_true", default=None,
                   help="be a spare: hold a warm copy of one stage's blocks and take that stage over at once "
                        "if its daemon is lost (the planner gives this daemon no stage while the others suffice)")
    p.add_argument("--full-replay", action="store_true", default=None,
                   help="when a request this daemon heads moves to a new chain, every stage rebuilds its KV cache "
                        "from the token history (by default the stages that stay keep theirs; for comparisons)")
    p.add_argument("--full-reload", action="store_true", default=None,
                   help="when the plan changes this daemon's block range, read the whole new range from the model "
                        "(by default the blocks it already holds are kept and only the others read; for comparisons)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="capture every jitted graph of the stage (prefill, prompt scoring, decode at each batch "
                        "size up to --max-requests) before it reports ready: a slower start, and no request waits "
                        "for the compiler later (default: on for GPUs, where a batch size's first use costs "
                        "seconds per graph; off for CPUs, where each graph costs many seconds at start)")
    p.add_argument("--max-requests", type=int, metavar="N",
                   help="requests this daemon's stage holds at once (its KV cache slots; default 4)")
    p.add_argument("--max-context", type=int, metavar="TOKENS",
                   help="context per request, prompt plus completion (default 2048, capped at the model's)")
    p.add_argument("--wire-dtype", choices=["float32", "float16", "bfloat16"],
                   help="activations on the wire: float32 is lossless (the default); the others halve the bytes")
    p.add_argument("--inline-step-ms", type=float, metavar="MS",
                   help="a decode step seen to take at most this long runs on the event loop's own thread when the "
                        "compute thread is idle, which saves two thread hand-overs per step; the daemon answers "
                        "nothing else meanwhile (default 50; 0: every step on the compute thread)")
    p.add_argument("--expert-placement", choices=["auto", "spread", "local"],
                   help="MoE models: keep each block's experts with its stage (local), spread them over the "
                        "other daemons (spread), or let the planner choose (auto, the default: spread under the "
                        "balanced policy)")
    p.add_argument("--data-plane", choices=["tls", "libp2p"],
                   help="tensors over pinned TLS sockets (default) or over the libp2p streams themselves")
    p.add_argument("--data-plane-port", type=int, metavar="PORT",
                   help="TCP port of the TLS data plane (default: any free one); behind a NAT with forwarded "
                        "ports, forward this one too (it listens on the --listen address)")
    p.add_argument("--no-relay-service", dest="relay_service", action="store_false", default=None,
                   help="do not serve as a circuit relay for members that cannot be reached directly (by "
                        "default a daemon serves relaying, within limits; only a reachable one is useful)")
    p.add_argument("--relay", action="append", metavar="MULTIADDR",
                   help="a relay (ending in /p2p/<peer id>) to keep a reservation on when this daemon cannot be "
                        "reached directly, besides the members that serve relaying; repeatable")
    p.add_argument("--no-hole-punching", dest="hole_punching", action="store_false", default=None,
                   help="do not try hole punching (DCUtR) with members reached only through a relay")
    p.add_argument("--swarm-key", type=Path, metavar="FILE",
                   help="make the swarm private: only peers holding this key (from `swarmd keygen`) can connect")
    p.add_argument("--allow-peer", action="append", metavar="PEER_ID",
                   help="accept only these peer ids (repeatable; with or without --swarm-key)")
    p.add_argument("--allow-peers-file", type=Path, metavar="FILE",
                   help="more allowed peer ids, one per line (# starts a comment)")
    p.add_argument("--api-token", metavar="TOKEN",
                   help="bearer token the HTTP API requires (also SWARMD_API_TOKEN); needed to bind --api off loopback")
    p.add_argument("--timings", metavar="PRESET", help="timing preset: lan (default) or local-test")
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML file with the same keys as these options")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default: info")
    p.add_argument("-v", "--verbose", action="store_true", help="log level debug")
    p.add_argument("-q", "--quiet", action="store_true", help="log level warning")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    """Defaults, then the config file, then the environment, then the command line."""
    from swarmd.config import (
        DaemonConfig,
        api_token_from_env,
        bootstrap_from_env,
        load_config_file,
        parse_size,
        parse_timings,
    )

    config = DaemonConfig()
    if args.config:
        config = config.with_overrides(**load_config_file(args.config))
    if env_boot := bootstrap_from_env():
        config = config.with_overrides(bootstrap=env_boot)
    if env_token := api_token_from_env():
        config = config.with_overrides(api_token=env_token)
    level = "debug" if args.verbose else "warning" if args.quiet else args.log_level
    return config.with_overrides(
        swarm=args.swarm,
        listen=tuple(args.listen) if args.listen else None,
        announce=tuple(args.announce) if args.announce else None,
        bootstrap=tuple(args.bootstrap) if args.bootstrap else None,
        model=args.model,
        api=args.api,
        home=args.home.expanduser() if args.home else None,
        device=args.device,
        memory_limit=parse_size(args.memory_limit) if args.memory_limit else None,
        device_label=args.device_label,
        mdns=args.mdns,
        timings=parse_timings(args.timings) if args.timings else None,
        plan=args.plan.expanduser() if args.plan else None,
        standby=args.standby,
        full_replay=args.full_replay,
        full_reload=args.full_reload,
        warmup=args.warmup,
        max_requests=args.max_requests,
        max_context=args.max_context,
        wire_dtype=args.wire_dtype,
        inline_step_ms=args.inline_step_ms,
        expert_placement=args.expert_placement,
        data_plane=args.data_plane,
        data_plane_port=args.data_plane_port,
        relay_service=args.relay_service,
        relays=tuple(args.relay) if args.relay else None,
        hole_punching=args.hole_punching,
        swarm_key=args.swarm_key.expanduser() if args.swarm_key else None,
        allow_peers=tuple(args.allow_peer) if args.allow_peer else None,
        allow_peers_file=args.allow_peers_file.expanduser() if args.allow_peers_file else None,
        api_token=args.api_token,
        log_level=level,
    )


# py-libp2p logs these as errors on every failed dial; to a daemon they are routine (a member died or left,
# and membership says so in its own words)
ROUTINE_LIBP2P = ("Failed to open TCP stream", "MultiselectClient handshake: read failed",
                  "failed to upgrade security for peer", "fail to upgrade mux for peer",
                  # a dial-back that stops after the handshake, a hole-punch dial that lost, a circuit that ended
                  "Unexpected error opening TCP stream", "Error reading from hop stream", "Error relaying data",
                  "Unexpected error reading from stream", "Error sending status message",
                  "Unexpected error handling hop stream", "Error handling stop stream")


class Libp2pNoise(logging.Filter):
    """Lets py-libp2p's records through only from `level` up (its modules set their own, lower levels), and
    without its routine dial failures unless `routine` (at --log-level debug)."""

    def __init__(self, level: int, routine: bool) -> None:
        super().__init__()
        self.level, self.routine = level, routine

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("libp2p"):
            return True
        if record.levelno < self.level:
            return False
        return self.routine or not record.getMessage().startswith(ROUTINE_LIBP2P)


def setup_logging(level: str) -> None:
    import libp2p  # noqa: F401 - importing it configures its logger (no handler, no propagation): undo that after

    logging.basicConfig(level=getattr(logging, level.upper()), format=LOG_FORMAT, stream=sys.stderr, force=True)
    # py-libp2p warns a lot about routine things (resets, closed streams): keep its errors only, in our format
    # (without propagation Python's last-resort handler printed them bare, with no time or source).
    debug = level == "debug"
    logging.getLogger("libp2p").propagate = True
    for handler in logging.getLogger().handlers:
        handler.addFilter(Libp2pNoise(logging.WARNING if debug else logging.ERROR, routine=debug))


def say(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    import trio

    config = build_config(args)
    setup_logging(config.log_level)
    from swarmd.daemon.compute import collect_garbage_on_the_compute_thread

    collect_garbage_on_the_compute_thread()  # a finaliser run on tinygrad's own thread would hang the daemon
    from swarmd.net.libp2p_network import parse_multiaddr, split_peer_addr

    for addr in config.listen:
        parse_multiaddr(addr, "--listen")
    for addr in config.bootstrap:
        split_peer_addr(addr, "--bootstrap")
    for addr in config.relays:
        split_peer_addr(addr, "--relay")
    if config.plan is not None and config.bootstrap:
        raise UserError("--plan is for the daemon that founds the swarm (one started without --bootstrap)")
    from swarmd.inference.pipeline import run_pipeline
    from swarmd.net.access import check_access

    check_access(config)
    try:
        return trio.run(serve, config, (run_pipeline,))
    except BaseExceptionGroup as group:
        raise _user_facing(group) from None


async def serve(config, extensions: tuple = ()) -> int:
    """Run a daemon until a signal or `swarmd leave`; `extensions` go to `Node.add_extension`."""
    import trio

    from swarmd.daemon.node import Node

    node = Node(config)
    for ext in extensions:
        node.add_extension(ext)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_leave_on_signal, signals, node, nursery)
            await nursery.start(_run_node, node, nursery)
            say(f"Peer ID: {node.peer_id}")
            assert node.network is not None
            for addr in node.network.bound_addresses():
                say(f"Swarm listening on {addr}")
            say(f"API server listening on {node.api_url}")
            say("Daemon is ready")
    return 0


async def _run_node(node, nursery, task_status) -> None:
    """Run the node; once it stops (`swarmd leave`), stop waiting for signals too."""
    await node.run(task_status=task_status)
    nursery.cancel_scope.cancel()


async def _leave_on_signal(signals: Any, node, nursery) -> None:
    async for signum in signals:
        logging.getLogger("swarmd").info("%s: leaving the swarm", signal.Signals(signum).name)
        break
    if node.ready.is_set():
        await node.leave()
    nursery.cancel_scope.cancel()


def _user_facing(group: BaseExceptionGroup) -> BaseException:
    """The first error a user can act on inside a task group, else the group itself (a bug)."""
    from models.errors import ModelError
    from planner.errors import InfeasiblePlan, PlanSchemaError

    wanted = (UserError, ModelError, InfeasiblePlan, PlanSchemaError, KeyboardInterrupt)
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        elif isinstance(exc, wanted):
            return exc
    return group
