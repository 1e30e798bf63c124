"""`swarmd keygen --out FILE`: make a swarm key, the pre-shared secret of a private swarm."""

from __future__ import annotations

import argparse
from pathlib import Path

ORDER = 15


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", help="make a swarm key for a private swarm",
                       description="Write a new swarm key (32 random bytes, libp2p's swarm.key format) readable by "
                                   "you only (mode 0600). Every member starts with `swarmd join --swarm-key FILE` "
                                   "and a copy of it; peers without it cannot connect at all. Copy it over a "
                                   "channel you trust (scp, a secrets manager), never in the clear.")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="where to write the key")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from swarmd.net.swarm_key import SwarmKey, write_swarm_key

    key = SwarmKey.generate()
    write_swarm_key(args.out, key, overwrite=args.force)
    print(f"wrote swarm key {key.fingerprint} to {args.out} (mode 0600)", flush=True)
    print(f"start every member with: swarmd join --swarm-key {args.out} ...", flush=True)
    return 0
