"""Real `swarmd join` processes, as a user runs them: a private swarm keeps out a daemon without the key,
`swarmd status` says who can join, and an API bound beyond loopback wants its token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from swarmd.net.swarm_key import SwarmKey, write_swarm_key
from tests.swarm.daemons import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # three daemons: about 25 s
TOKEN = "test-token-0123456789abcdef"


def alive(d) -> set[str]:
    return {m["peer_id"] for m in d.status()["members"] if m["state"] == "alive"}


def test_a_daemon_without_the_swarm_key_cannot_join_a_private_swarm(private_daemons, tmp_path):
    key = tmp_path / "swarm.key"
    write_swarm_key(key, SwarmKey.generate())
    founder = private_daemons("founder", "--swarm-key", str(key)).start().wait_ready()
    member = private_daemons("member", "--swarm-key", str(key)).start(bootstrap=(founder.addresses[0],)).wait_ready()
    outsider = private_daemons("outsider").start(bootstrap=(founder.addresses[0],)).wait_ready()
    wait_until(lambda: alive(founder) == alive(member) == {founder.peer_id, member.peer_id}
               and member.status()["plan"], 30, "founder and member to share a plan")
    time.sleep(3)  # the outsider has been dialing all along

    doc = json.loads(founder.status_cli("--json").stdout)
    assert doc["swarm"]["private"] is True and doc["swarm"]["key_fingerprint"] == founder_fingerprint(key)
    assert {m["peer_id"] for m in doc["members"]} == {founder.peer_id, member.peer_id}
    assert outsider.peer_id not in {s["peer_id"] for s in doc["plan"]["stages"]}

    out = outsider.status()
    assert out["swarm"]["private"] is False and not out["admitted"] and out["plan"] is None
    assert [m["peer_id"] for m in out["members"]] == [outsider.peer_id]  # no descriptor of anyone
    assert "OPEN" in outsider.status_cli().stdout
    assert "private" in founder.status_cli().stdout


def founder_fingerprint(path) -> str:
    from swarmd.net.swarm_key import load_swarm_key

    return load_swarm_key(path).fingerprint


def test_an_api_beyond_loopback_needs_a_token_and_the_clients_send_it(private_daemons):
    refused = subprocess.run([sys.executable, "-m", "swarmd", "join", "--api", "0.0.0.0:0"],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "SWARMD_API_TOKEN": ""})
    assert refused.returncode != 0 and "--api-token" in refused.stderr and "Traceback" not in refused.stderr

    # With a token the API wants it on every route, wherever it listens (here on loopback: tests bind nothing else).
    d = private_daemons("d", "--api-token", TOKEN).start().wait_ready()
    without = d.status_cli("--json")
    assert without.returncode != 0 and "wants an API token" in without.stderr
    with_env = subprocess.run([sys.executable, "-m", "swarmd", "status", "--json"], capture_output=True, text=True,
                              timeout=30, env={**os.environ, "SWARMD_HOME": str(d.home), "SWARMD_API_TOKEN": TOKEN})
    assert with_env.returncode == 0, with_env.stderr
    assert json.loads(with_env.stdout)["swarm"]["api_token_required"] is True
    wrong = d.status_cli("--json", "--api-token", "x" * 20)
    assert wrong.returncode != 0 and "refused the API token" in wrong.stderr
    prompt = ("submit-prompt", "hello", "--max-tokens", "2", "--wait", "60")
    no_token = subprocess.run([sys.executable, "-m", "swarmd", *prompt], capture_output=True, text=True, timeout=90,
                              env={**os.environ, "SWARMD_HOME": str(d.home), "SWARMD_API_TOKEN": ""})
    assert no_token.returncode != 0 and "wants an API token" in no_token.stderr
    answered = subprocess.run([sys.executable, "-m", "swarmd", *prompt, "--api-token", TOKEN], capture_output=True,
                              text=True, timeout=90, env={**os.environ, "SWARMD_HOME": str(d.home)})
    # With it the request gets past the guard to the swarm, whose answer is that this tiny model has no tokenizer.
    assert "API token" not in answered.stderr and "tokenizer 'None' is not supported" in answered.stderr
    left = subprocess.run([sys.executable, "-m", "swarmd", "leave", "--api-token", TOKEN], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "SWARMD_HOME": str(d.home)})
    assert left.returncode == 0, left.stderr
    assert d.proc.wait(timeout=30) == 0
