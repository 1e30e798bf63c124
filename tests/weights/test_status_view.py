"""`swarmd status` shows what a daemon holds and fetches, and every member's fetch from its heartbeat."""

from __future__ import annotations

from rich.console import Console

from swarmd.cli.status import render


def test_the_status_view_shows_the_manifest_the_weights_held_and_each_members_fetch():
    me, other = "12D3KooW" + "A" * 44, "12D3KooW" + "B" * 44
    row = {"state": "alive", "last_seen_s": 0.4, "rtt_ms": 1.0, "label": "cpu", "device": "CPU",
           "memory_free": 8 << 30}
    fetching = {"layers": [15, 30], "state": "loading", "experts": {},
                "fetch": {"bytes": 12 << 20, "total": 48 << 20, "rate": 3 << 20}}
    doc = {"self": {"peer_id": me, "label": "cpu", "device": "CPU", "api": "http://127.0.0.1:1",
                    "model": {"name": "smollm2-135m", "digest": "dad89e17ca467f6d" + "0" * 48}},
           "swarm": {"name": "lab", "private": False, "key_fingerprint": None, "allowlist": None, "penalised": []},
           "admitted": True, "leader": me, "term": 1, "plan": {"epoch": 2}, "coverage": "layers 0-29 planned",
           "requests_in_flight": 0, "plan_error": None, "refused": [],
           "weights": {"held_bytes": 12 << 20, "model_bytes": 92 << 20, "partial": True,
                       "fetch": {"active": True, "bytes": 12 << 20, "total": 48 << 20, "rate_bytes_per_s": 3 << 20,
                                 "sources": 2, "waiting": ""},
                       "served": {"bytes_served": 5 << 20}},
           "members": [{**row, "peer_id": me, "assignment": fetching},
                       {**row, "peer_id": other, "assignment": {"layers": [0, 15], "state": "ready", "experts": {}}}]}
    console = Console(width=320, record=True)
    console.print(render(doc))
    text = console.export_text()
    for expected in ("manifest dad89e17ca46", "12.0 MiB of 92.0 MiB held here (a partial model",
                     "fetching 12.0 of 48.0 MiB, 3.0 MiB/s, 12 s left from 2 peer(s)", "served 5.0 MiB to others",
                     "loading (fetching 12.0 of 48.0 MiB, 3.0 MiB/s, 12 s left)"):
        assert expected in text, expected
