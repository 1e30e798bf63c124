"""A pytest plugin that counts, per test, the graphs the test (and the daemons it started) stored in the graph cache.

With an empty cache, as on a clean clone, every stored graph is one that was captured: the census says which tests
pay for captures, and for which graphs.

    SWARMD_GRAPH_CACHE=$(mktemp -d) PYTHONPATH=scripts .venv/bin/python -m pytest -p graph_census tests ...

Writes `graph-census.log` (or `$GRAPH_CENSUS`): a line per test (its seconds, setup included, and the graphs it
stored), then each new graph's model, owner and name.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

_seen: set[str] = set()
_started = [time.monotonic()]


def _label(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.readline()  # the format's magic line
            (n,) = struct.unpack("<Q", f.read(8))
            label = json.loads(f.read(n))["label"]
    except (OSError, ValueError, KeyError, struct.error) as e:
        return f"unreadable: {e}"
    return " | ".join(str(label.get(k, "?")) for k in ("model", "owner", "graph"))


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _started[0] = time.monotonic()


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    root = Path(os.environ.get("SWARMD_GRAPH_CACHE", ""))
    now = {p.name for p in root.glob("*.graph")} if root.is_dir() else set()
    new = sorted(now - _seen)
    _seen.update(new)
    with open(os.environ.get("GRAPH_CENSUS", "graph-census.log"), "a") as log:
        print(f"TEST {time.monotonic() - _started[0]:8.1f}s {len(new):4d} {nodeid}", file=log)
        for name in new:
            print(f"   {_label(root / name)}", file=log)
