"""A js-libp2p peer (npm `libp2p` with tcp, noise, yamux, identify, ping) dials a daemon."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.waits]
JS = Path(__file__).resolve().parents[1] / "js"


@pytest.fixture(scope="session")
def js_peer() -> Path:
    """tests/js with its node_modules installed from package.json (npm install on first use)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise RuntimeError("node and npm are needed for the js-libp2p interop test (Node 20 or later)")
    if not (JS / "node_modules" / "libp2p").is_dir():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=JS, check=True,
                       timeout=300)
    return JS / "dial.mjs"


def test_a_js_libp2p_peer_gets_identify_and_ping_answers(daemons, js_peer):
    d = daemons("d").start().wait_ready()
    done = subprocess.run(["node", str(js_peer), d.addresses[0]], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["peerId"] == d.peer_id
    assert {"/ipfs/id/1.0.0", "/ipfs/ping/1.0.0", "/meshsub/1.1.0", "/swarmd/probe/1.0.0"} <= set(answer["protocols"])
    assert len(answer["pingMs"]) == 3 and all(rtt >= 0 for rtt in answer["pingMs"])
    assert d.proc.poll() is None and d.status()["self"]["peer_id"] == d.peer_id
