#!/usr/bin/env python3
"""Run emulated links between daemons: TCP proxies with delay, jitter, bandwidth caps, resets.

    scripts/link_emulator.py --link a=7001:127.0.0.1:4001 --link b=7002:127.0.0.1:4002 \
        --delay-ms 10 --bandwidth-mbit 100 --control 7000

Change a link while it runs by sending JSON lines to the control port:
    {"link": "a", "set": {"delay_ms": 50, "blackhole": true}}
    {"link": "a", "reset": true}        # abrupt reset of its open connections
    {"stats": true}
Each command gets one JSON line back.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, fields
from functools import partial
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from swarmd.testing.linkemu import Link, LinkConfig, json_lines_handler


def parse_link(spec: str) -> tuple[str, int, str, int]:
    try:
        name, rest = spec.split("=", 1)
        listen, host, port = rest.rsplit(":", 2)
        return name, int(listen), host, int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --link {spec!r}: expected NAME=LISTEN_PORT:HOST:PORT") from None


def apply(links: dict[str, Link], cmd: dict) -> dict:
    if cmd.get("stats"):
        return {name: {**asdict(link.stats), "config": asdict(link.config)} for name, link in links.items()}
    link = links.get(cmd.get("link", ""))
    if link is None:
        return {"error": f"unknown link {cmd.get('link')!r}; links: {sorted(links)}"}
    if cmd.get("reset"):
        return {"reset": link.reset_connections()}
    known = {f.name for f in fields(LinkConfig)}
    changes = cmd.get("set", {})
    if not isinstance(changes, dict) or set(changes) - known:
        return {"error": f"'set' takes an object with keys among {sorted(known)}"}
    return {"config": asdict(link.update(**changes))}


async def control(links: dict[str, Link], port: int) -> None:
    await trio.serve_tcp(json_lines_handler(partial(apply, links)), port, host="127.0.0.1")


async def main_async(args: argparse.Namespace) -> None:
    base = LinkConfig(args.delay_ms, args.jitter_ms, args.bandwidth_mbit, args.reset_probability)
    links: dict[str, Link] = {}
    async with trio.open_nursery() as nursery:
        for i, (name, listen, host, port) in enumerate(args.link):
            links[name] = link = Link(base, (host, port), seed=args.seed + i)
            bound = await nursery.start(partial(link.serve, port=listen))
            print(f"link {name}: 127.0.0.1:{bound} -> {host}:{port}", flush=True)
        if args.control:
            nursery.start_soon(control, links, args.control)
            print(f"control on 127.0.0.1:{args.control}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", type=parse_link, action="append", required=True, help="NAME=LISTEN_PORT:HOST:PORT")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per direction")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--bandwidth-mbit", type=float, default=0.0, help="per direction; 0 = unlimited")
    p.add_argument("--reset-probability", type=float, default=0.0, help="chance per 64 KiB chunk of a reset")
    p.add_argument("--control", type=int, default=0, help="loopback port for JSON-line commands")
    p.add_argument("--seed", type=int, default=0)
    try:
        trio.run(main_async, p.parse_args())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
