"""`swarmd doctor`: what the local daemon's network looks like from inside, one line each, with fixes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from swarmd.cli.client import add_token_option
from swarmd.errors import UserError

ORDER = 25
MARKS = {"ok": "ok  ", "warn": "warn", "fail": "FAIL", "info": "    "}

DESCRIPTION = """\
Check a running daemon's network (found through $SWARMD_HOME/api, or named with --api): its listen addresses and
what peers see them as, whether peers can reach it (public, or behind NAT and of which kind), its relay
reservations, hole punching with each member, the path each member's link takes (TLS data plane, direct, relayed),
whether its data plane can be reached, and its clock offset to the leader. Each line that needs work says how
to fix it.

exit status: 0 nothing needs fixing (warnings allowed), 1 something does, 2 no daemon answers.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="reachability: addresses, NAT, relays, hole punching, data plane",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api", metavar="HOST:PORT|URL", help="the daemon's API address (default: from $SWARMD_HOME/api)")
    p.add_argument("--home", type=Path, help="the daemon's state directory (default: $SWARMD_HOME or ~/.swarmd)")
    add_token_option(p)
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from swarmd.cli.status import daemon_url, fetch_status
    from swarmd.net.diagnosis import diagnose

    try:
        url = daemon_url(args.api, args.home)
        status = fetch_status(url, token=args.api_token)
    except UserError as e:
        if args.json:
            print(json.dumps({"ok": False, "situation": "no daemon answers", "error": str(e), "checks": []}))
        print(f"swarmd doctor: {e}", file=sys.stderr)
        return 2
    diagnosis = diagnose(status, _pipeline(url, args.api_token))
    if args.json:
        print(json.dumps(diagnosis.to_json(), indent=2))
    else:
        print(f"{status['self']['peer_id']}: {diagnosis.situation}")
        for check in diagnosis.checks:
            print(f"{MARKS.get(check.status, check.status)}  {check.name:<20} {check.line}")
            if check.fix and check.status in ("warn", "fail"):
                print(f"{'':6}{'':<20} fix: {check.fix}")
    return 1 if diagnosis.failed else 0


def _pipeline(url: str, token: str | None) -> dict[str, Any] | None:
    """The pipeline's status (clock offsets), if the daemon serves one."""
    import httpx

    from swarmd.cli.client import auth_headers

    try:
        response = httpx.get(f"{url}/api/v0/pipeline", timeout=5.0, headers=auth_headers(token))
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
