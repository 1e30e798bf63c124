"""`swarmd status` without a daemon to ask: a hint and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from swarmd.cli.status import render


def status(*args: str, home=None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    if home is not None:
        env["SWARMD_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "swarmd", "status", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_no_daemon_in_the_home_says_how_to_start_one(tmp_path):
    done = status("--json", home=tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "no daemon is running" in done.stderr and "swarmd join" in done.stderr


def test_a_stale_api_file_or_a_dead_address_says_nobody_answers(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "api").write_text(json.dumps({"url": f"http://127.0.0.1:{port}"}))
    done = status(home=tmp_path)
    assert done.returncode != 0 and f"no daemon answers at http://127.0.0.1:{port}" in done.stderr
    done = status("--api", f"127.0.0.1:{port}")
    assert done.returncode != 0 and "is `swarmd join` running?" in done.stderr


def test_the_human_view_shows_swarm_members_plan_and_refusals():
    from rich.console import Console

    me, other = "12D3KooW" + "A" * 44, "12D3KooW" + "B" * 44
    row = {"state": "alive", "last_seen_s": 0.4, "rtt_ms": 1.25, "label": "RTX 3060 12GB", "device": "CPU",
           "memory_free": 12 << 30, "assignment": {"layers": [0, 15], "state": "ready", "experts": {}}}
    doc = {"self": {"peer_id": me, "label": "RTX 3060 12GB", "device": "CPU", "api": "http://127.0.0.1:1",
                    "model": {"name": "smollm2-135m"}},
           "swarm": {"name": "lab", "private": False, "key_fingerprint": None, "allowlist": None, "penalised": []},
           "admitted": True, "leader": me, "term": (3 << 32) | 0xBEEF, "plan": {"epoch": 7},
           "coverage": "layers 0-29 covered", "requests_in_flight": 2, "plan_error": None,
           "members": [{**row, "peer_id": me},
                       {**row, "peer_id": other, "state": "suspect",
                        "assignment": {"layers": [15, 30], "state": "loading", "experts": {}}}],
           "refused": [{"peer_id": "12D3KooW" + "C" * 44, "reason": "serves model 'x'"}]}
    console = Console(width=140, record=True)
    console.print(render(doc))
    text = console.export_text()
    for expected in ("leader AAAAAA (this node)", "term 3", "plan epoch 7", "1 alive, 1 suspect",
                     "layers 0-29 covered", "2 in flight", "RTX 3060 12GB", "12.0 GiB", "0-14", "15-29",
                     "loading", "1.2 ms", "serves model 'x'", "OPEN: anyone who can reach"):
        assert expected in text, expected
