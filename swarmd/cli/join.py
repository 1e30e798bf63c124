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
    add_setting_options(p)
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML file with the same keys as these options")
    p.add_argument("-v", "--verbose", action="store_true", help="log level debug")
    p.add_argument("-q", "--quiet", action="store_true", help="log level warning")
    p.set_defaults(func=run)


def add_setting_options(p: argparse.ArgumentParser) -> None:
    """One option per `DaemonConfig` field (`swarmd.config.settings`), with its help; unset options stay None."""
    from swarmd.config import settings

    for s in settings():
        kw: dict[str, Any] = {"dest": s.name, "default": None, "help": s.how.help}
        if s.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction if s.optional else "store_true"
        else:
            kw["metavar"] = s.how.metavar
            kw["choices"] = s.how.choices
            if s.kind is tuple:
                kw["action"] = "append"
            elif s.how.parse is None and s.kind in (int, float, Path):
                kw["type"] = s.kind
        p.add_argument(s.option, **kw)


def build_config(args: argparse.Namespace):
    """Defaults, then the config file, then the environment, then the command line."""
    from swarmd.config import DaemonConfig, env_changes, load_config_file, settings

    config = DaemonConfig()
    if args.config:
        config = config.with_overrides(**load_config_file(args.config))
    config = config.with_overrides(**env_changes())
    given = {s.name: s.convert(getattr(args, s.name), s.option) for s in settings()
             if getattr(args, s.name) is not None}
    config = config.with_overrides(**given)
    level = "debug" if args.verbose else "warning" if args.quiet else None
    return config.with_overrides(log_level=level)


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
    from swarmd.inference.compute import collect_garbage_on_the_compute_thread

    collect_garbage_on_the_compute_thread()  # a finaliser run on tinygrad's own thread would hang the daemon
    from swarmd.net.libp2p_network import parse_multiaddr, split_peer_addr

    for addr in config.listen:
        parse_multiaddr(addr, "--listen")
    for addr in config.bootstrap:
        split_peer_addr(addr, "--bootstrap")
    if config.slot and config.plan is None:
        raise UserError("--slot NAME claims a slot of a plan file: give --plan FILE too")
    if config.plan is not None and config.bootstrap and not config.slot:
        raise UserError("--plan with --bootstrap needs --slot NAME (a plan file's slot); a Plan naming peer ids is "
                        "for the daemon that founds the swarm")
    for addr in config.relays:
        split_peer_addr(addr, "--relay")
    from swarmd.net.dial_map import DialMap

    DialMap.parse(config.dial_map)  # a bad entry is a one-line error now, not at the first dial
    from swarmd.daemon.serving import run_pipeline
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
            say(f"Swarm page at {node.api_url}/ (open it in a browser)")
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
