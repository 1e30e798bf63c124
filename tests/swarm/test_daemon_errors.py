"""Bad input to `swarmd join`: one clear line and no traceback; where it makes sense the daemon stays up."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.swarm.daemons import wait_until
from tests.swarm.tiny_model import write_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def join(home, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "swarmd", "join", "--home", str(home), "--api", "127.0.0.1:0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("swarmd join: error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def test_an_unparseable_bootstrap_address_is_one_line(tmp_path):
    line = one_error_line(join(tmp_path, "--bootstrap", "/ip4/1.2.3/tcp/4001"))
    assert "--bootstrap '/ip4/1.2.3/tcp/4001' is not a multiaddr" in line
    line = one_error_line(join(tmp_path, "--bootstrap", "/ip4/127.0.0.1/tcp/4001"))
    assert "must end in /p2p/<peer id>" in line


def test_ports_in_use_are_one_line(tmp_path, tiny_model, bench_file):
    (tmp_path / bench_file.name).write_bytes(bench_file.read_bytes())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_error_line(join(tmp_path, "--model", str(tiny_model), "--listen", f"/ip4/127.0.0.1/tcp/{port}"))
        assert f"could not listen on /ip4/127.0.0.1/tcp/{port}" in line
        cmd = [sys.executable, "-m", "swarmd", "join", "--home", str(tmp_path), "--model", str(tiny_model),
               "--listen", "/ip4/127.0.0.1/tcp/0", "--api", f"127.0.0.1:{port}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert f"--api 127.0.0.1:{port}: cannot listen: the port is in use" in one_error_line(done)
    assert not (tmp_path / "api").exists()


def test_an_unreachable_bootstrap_peer_keeps_the_daemon_up_and_unadmitted(daemons, tmp_path):
    nobody = daemons("nobody")
    from swarmd.net.identity import load_or_create_identity, peer_id_of

    ghost = peer_id_of(load_or_create_identity(tmp_path / "ghost"))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = nobody.start(bootstrap=(f"/ip4/127.0.0.1/tcp/{port}/p2p/{ghost}",)).wait_ready()
    wait_until(lambda: "unreachable" in d.log() and "retrying in" in d.log(), 30, "a retry message")
    status = d.status()
    assert status["admitted"] is False and status["leader"] is None and status["plan"] is None
    assert [m["peer_id"] for m in status["members"]] == [d.peer_id]
    assert d.terminate() == 0


def test_a_member_of_another_model_is_refused_on_both_sides(daemons, tmp_path):
    other_model = write_tiny_llama(tmp_path / "other-llama.gguf", seed=1)
    a = daemons("a").start().wait_ready()
    b = daemons("b")
    b.model = other_model
    b.start(bootstrap=(a.addresses[0],)).wait_ready()

    def refused(d, peer):
        return next((r["reason"] for r in d.status()["refused"] if r["peer_id"] == peer), None)

    reason_a = wait_until(lambda: refused(a, b.peer_id), 30, "a to refuse b")
    reason_b = wait_until(lambda: refused(b, a.peer_id), 30, "b to refuse a")
    assert "other-llama.gguf" in reason_a and "tiny-llama.gguf" in reason_b
    assert b.status()["admitted"] is False and b.status()["leader"] is None
    assert [m["peer_id"] for m in a.status()["members"]] == [a.peer_id]
    assert "refused" in b.status_cli().stdout


def test_swarmd_leave_stops_the_daemon_and_the_others_see_it_leave(daemons):
    a = daemons("a").start().wait_ready()
    b = daemons("b").start(bootstrap=(a.addresses[0],)).wait_ready()
    wait_until(lambda: len([m for m in a.status()["members"] if m["state"] == "alive"]) == 2, 30, "b to join")
    done = b.status_cli()  # through b's home, as a user would
    assert done.returncode == 0
    import os

    left = subprocess.run([sys.executable, "-m", "swarmd", "leave"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SWARMD_HOME": str(b.home)})
    assert left.returncode == 0 and "left the swarm" in left.stdout, left.stderr
    assert b.proc.wait(timeout=15) == 0
    member = next(m for m in a.status()["members"] if m["peer_id"] == b.peer_id)
    assert member["state"] == "dead" and member["reason"] == "left the swarm"
