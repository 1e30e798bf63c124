"""The namespace tests' own topology code: it removes everything it made (veths too) even when building fails,
caps bandwidth with tc tbf on a veth, and adds delay through the link emulator where a proxy fits (this kernel
has no netem)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns.topology import CommandFailed, Netns, leftovers

EMULATOR = Path(__file__).resolve().parents[2] / "scripts" / "link_emulator.py"

SINK = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5001)); s.listen()
print("ready", flush=True)
c, _ = s.accept()
while True:
    data = c.recv(1 << 16)
    if not data:
        break
    if data.startswith(b"ping"):
        c.sendall(b"pong")
"""

SEND = """
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = socket.create_connection((host, port))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(5):
    t0 = time.perf_counter(); c.sendall(b"ping"); c.recv(4); rtts.append(time.perf_counter() - t0)
t0 = time.perf_counter()
c.sendall(b"x" * n)
c.shutdown(socket.SHUT_WR); c.recv(1)
print(sorted(rtts)[2], n * 8 / (time.perf_counter() - t0) / 1e6)
"""


def test_close_removes_every_namespace_and_veth_even_after_a_failed_build():
    net = Netns.create()
    net.bridge_lan(2)
    with pytest.raises(CommandFailed):
        net.link(net.hosts["h1"].ns, "h1e", net.hosts["h2"].ns, "x")  # that name exists: the build fails midway
    assert leftovers(net.prefix)
    net.close()
    assert leftovers(net.prefix) == []


def measure(net: Netns, host: str, port: int, nbytes: int) -> tuple[float, float]:
    """(median ping RTT in ms, Mbit/s of a bulk send) from h1 to host:port."""
    done = net.run("h1", sys.executable, "-c", SEND, host, str(port), str(nbytes), timeout=60)
    rtt, mbit = done.stdout.split()
    return float(rtt) * 1e3, float(mbit)


def sink(net: Netns) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*net.exec_prefix("h2"), sys.executable, "-c", SINK, net.hosts["h2"].ip],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_tbf_caps_bandwidth_and_the_link_emulator_adds_delay():
    with Netns.create() as net:
        h1, h2 = net.bridge_lan(2)
        proc = sink(net)
        _, free = measure(net, h2.ip, 5001, 8 << 20)
        proc.wait(timeout=10)
        net.limit_bandwidth(h1.ns, net.name("h1e"), 40)
        proc = sink(net)
        rtt0, capped = measure(net, h2.ip, 5001, 8 << 20)
        proc.wait(timeout=10)
        assert capped < 40 * 1.15 and capped > 10 and free > 2 * capped, (free, capped)

        proc = sink(net)
        emulator = subprocess.Popen([*net.exec_prefix("h1"), sys.executable, str(EMULATOR), "--link",
                                     f"wan=7001:{h2.ip}:5001", "--delay-ms", "20"], stdout=subprocess.PIPE, text=True)
        try:
            assert emulator.stdout is not None and emulator.stdout.readline().startswith("link wan")
            rtt, _ = measure(net, "127.0.0.1", 7001, 1 << 16)
        finally:
            emulator.kill()
            emulator.wait(timeout=10)
            proc.kill()
        assert 35 <= rtt - rtt0 <= 80, (rtt0, rtt)  # 20 ms each way
