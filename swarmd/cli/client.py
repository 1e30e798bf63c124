"""What the CLI clients (`swarmd status`, `leave`, `submit-prompt`) share to talk to a daemon's API: its
bearer token, from `--api-token` or SWARMD_API_TOKEN, and a clear line when the daemon refuses it."""

from __future__ import annotations

import argparse
from typing import Any

from swarmd.config import api_token_from_env
from swarmd.errors import UserError


def add_token_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-token", metavar="TOKEN",
                        help="bearer token the daemon's API wants (default: $SWARMD_API_TOKEN)")


def auth_headers(token: str | None) -> dict[str, str]:
    """The Authorization header for `token` (or SWARMD_API_TOKEN), or none."""
    token = (token or api_token_from_env()).strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_authorised(response: Any, url: str, token: str | None) -> None:
    """A 401 from the daemon becomes one line that says what to do."""
    if response.status_code != 401:
        return
    if auth_headers(token):
        raise UserError(f"the daemon at {url} refused the API token given (--api-token / SWARMD_API_TOKEN)")
    raise UserError(f"the daemon at {url} wants an API token: pass --api-token TOKEN or set SWARMD_API_TOKEN")
