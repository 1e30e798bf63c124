"""`swarmd leave`: ask the local daemon to leave its swarm cleanly and stop (as Ctrl-C would)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from swarmd.cli.client import add_token_option, auth_headers, check_authorised
from swarmd.errors import UserError

ORDER = 30


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("leave", help="make the local daemon leave its swarm and stop",
                       description="The daemon tells the swarm it goes (a leader first hands over a plan "
                                   "without itself), then exits.")
    p.add_argument("--api", metavar="HOST:PORT|URL", help="the daemon's API address (default: from $SWARMD_HOME/api)")
    p.add_argument("--home", type=Path, help="the daemon's state directory (default: $SWARMD_HOME or ~/.swarmd)")
    add_token_option(p)
    p.add_argument("--wait", type=float, default=15.0, metavar="SECONDS", help="how long to wait for it to stop")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    from swarmd.cli.status import daemon_url

    url = daemon_url(args.api, args.home)
    try:
        response = httpx.post(f"{url}/api/v0/leave", timeout=5, headers=auth_headers(args.api_token))
        check_authorised(response, url, args.api_token)
        answer = response.json()
    except (httpx.HTTPError, ValueError) as e:
        raise UserError(f"no daemon answers at {url} ({type(e).__name__}): is `swarmd join` running?") from None
    peer = answer.get("peer_id", "?")
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.HTTPError:
            print(f"{peer} left the swarm", flush=True)
            return 0
        time.sleep(0.2)
    raise UserError(f"{peer} was asked to leave but still answers after {args.wait:g} s")
