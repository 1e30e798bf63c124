"""The link emulator of a one-machine fleet, as a process of its own: `python -m swarmd.cluster.emulator SPEC`.

SPEC is a JSON file: {"links": [{"name", "listen", "target", "delay_ms", "bandwidth_mbit"}, ...]}, as
`swarmd.cluster.wan` lays them out; each link is a `swarmd.testing.linkemu.Link` on loopback. Once every link
listens, it prints `control on 127.0.0.1:PORT` and answers JSON lines there:

    {"wan": false}      every delay to 0 (bandwidth kept); {"wan": true} puts the spec's delays back
    {"stats": true}     connections, resets and bytes forwarded per link
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import trio

from swarmd.cluster.wan import HOST, EmulatedLink
from swarmd.testing.linkemu import Link, LinkConfig, json_lines_handler


def load_links(path: Path) -> list[EmulatedLink]:
    return [EmulatedLink(**link) for link in json.loads(Path(path).read_text())["links"]]


def command(links: dict[str, tuple[EmulatedLink, Link]], cmd: Any) -> dict[str, Any]:
    if not isinstance(cmd, dict):
        return {"error": "a command is a JSON object"}
    if "wan" in cmd:
        for spec, link in links.values():
            link.update(delay_ms=spec.delay_ms if cmd["wan"] else 0.0)
        return {"wan": bool(cmd["wan"]), "links": len(links)}
    if cmd.get("stats"):
        return {name: {**asdict(link.stats), "delay_ms": link.config.delay_ms} for name, (_, link) in links.items()}
    return {"error": "commands: {\"wan\": true|false}, {\"stats\": true}"}


async def serve_control(links: dict[str, tuple[EmulatedLink, Link]], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    listeners = await trio.open_tcp_listeners(0, host=HOST)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(json_lines_handler(partial(command, links)), listeners)


async def run(specs: list[EmulatedLink]) -> None:
    links: dict[str, tuple[EmulatedLink, Link]] = {}
    async with trio.open_nursery() as nursery:
        for i, spec in enumerate(specs):
            link = Link(LinkConfig(delay_ms=spec.delay_ms, bandwidth_mbit=spec.bandwidth_mbit), (HOST, spec.target),
                        seed=i)
            await nursery.start(partial(link.serve, host=HOST, port=spec.listen))
            links[spec.name] = (spec, link)
        port = await nursery.start(serve_control, links)
        print(f"control on {HOST}:{port}", flush=True)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m swarmd.cluster.emulator SPEC.json")
    try:
        trio.run(run, load_links(Path(sys.argv[1])))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
