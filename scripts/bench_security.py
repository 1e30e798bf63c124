#!/usr/bin/env python3
"""What a private swarm costs: py-libp2p 0.8.1's private network (`new_host(psk=...)`) against the open host.

A second process runs two py-libp2p hosts (TCP, noise, yamux), one open and one with a swarm key, each serving
an ack protocol (N bytes in, a 4-byte ack out) and the actor transport on the libp2p plane. This process runs
the matching two dialers. Measured in the same run, the two stacks taking turns in every round and at every
size (medians over all rounds):

  connect   a fresh connection (TCP, the private network's nonces, noise, yamux) until `connect()` returns
  hop       N bytes one way on a reused libp2p stream and a 4-byte ack back
  actor     `ActorTransport.send` of a `Forward` with an N-byte float32 hidden state on the libp2p plane
  cpu       CPU of both processes per hop (psutil, 10 ms tick, batch averages)

The TLS data plane is a separate TCP listener that the private network does not wrap (its tokens travel over
the private libp2p stream), so its per-hop cost does not change; `scripts/bench_hop.py` measures it.

    .venv/bin/python scripts/bench_security.py --rounds 7 --batch 40
    (internal) scripts/bench_security.py serve
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import select
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LOOP = "127.0.0.1"
ACK_PROTOCOL = "/swarmd/bench/ack/1.0.0"
SIZES = [2304, 8 << 10, 64 << 10, 1 << 20]
LEN = struct.Struct(">I")
STACKS = ["open", "private"]


def quiet_logs() -> None:
    logging.basicConfig(level=logging.CRITICAL)
    logging.getLogger().setLevel(logging.CRITICAL)


def make_network(seed: int, psk: str | None):
    """The daemon's libp2p network (bulk streams on libp2p itself), private when `psk` is given."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from swarmd.net.libp2p_network import Libp2pNetwork
    from swarmd.net.swarm_key import SwarmKey

    key = SwarmKey(bytes.fromhex(psk)) if psk else None
    return Libp2pNetwork(create_new_key_pair(bytes([seed]) * 32), [f"/ip4/{LOOP}/tcp/0"], swarm_key=key)


async def read_exactly(stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


async def ack_handler(stream) -> None:
    try:
        while True:
            (n,) = LEN.unpack(await read_exactly(stream, 4))
            await read_exactly(stream, n)
            await stream.write(LEN.pack(0))
    except Exception:
        return


# --- the receiving process ---------------------------------------------------------------------------------------


async def serve_main(args: argparse.Namespace) -> None:
    from swarmd.transport.links import start_actor_transport
    from swarmd.wire import Forward

    quiet_logs()

    async def accept(peer, msg):
        return None

    info = {"pid": os.getpid()}
    async with trio.open_nursery() as nursery:
        for seed, stack, psk in ((11, "open", None), (12, "private", args.psk)):
            network = make_network(seed, psk)
            await nursery.start(network.run)
            host = network.host
            host.set_stream_handler(ACK_PROTOCOL, ack_handler)
            transport = await start_actor_transport(network, nursery)
            transport.route(Forward, accept)
            info[stack] = {"peer": str(host.get_id()), "addrs": [str(a) for a in host.get_addrs()]}
        print(json.dumps(info), flush=True)
        with trio.move_on_after(args.lifetime):
            await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
        nursery.cancel_scope.cancel()


# --- the measuring process ---------------------------------------------------------------------------------------


class Receiver:
    def __init__(self, psk: str, lifetime: float) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "serve", "--psk", psk, "--lifetime", str(lifetime)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        if not ready:
            self.stop()
            raise RuntimeError("the receiving process did not start within 60 s")
        assert self.proc.stdout is not None
        self.info = json.loads(self.proc.stdout.readline())

    def cpu_seconds(self) -> float:
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


async def measure(args: argparse.Namespace) -> dict:
    import multiaddr
    import numpy as np
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo

    from swarmd.net.swarm_key import SwarmKey
    from swarmd.transport.links import start_actor_transport
    from swarmd.wire import Forward, WireTensor

    quiet_logs()
    sizes = [int(s) for s in args.sizes.split(",")]
    psk = SwarmKey.generate().hex
    receiver = Receiver(psk, lifetime=args.budget + 120)
    kinds = ["hop", "actor"]
    samples = {k: {s: {n: [] for n in sizes} for s in STACKS} for k in kinds}
    cpu = {k: {s: {n: [] for n in sizes} for s in STACKS} for k in kinds}
    connects: dict[str, list[float]] = {s: [] for s in STACKS}
    try:
        async with trio.open_nursery() as nursery:
            hosts, streams, transports, targets = {}, {}, {}, {}
            for seed, stack, key in ((21, "open", None), (22, "private", psk)):
                network = make_network(seed, key)
                await nursery.start(network.run)
                host = network.host
                target = ID.from_base58(receiver.info[stack]["peer"])
                addrs = [multiaddr.Multiaddr(a) for a in receiver.info[stack]["addrs"]]
                host.get_peerstore().add_addrs(target, addrs, 3600)
                hosts[stack], targets[stack] = host, (target, addrs)
                streams[stack] = await host.new_stream(target, [ACK_PROTOCOL])
                transports[stack] = await start_actor_transport(network, nursery)

            payloads = {n: os.urandom(n) for n in sizes}
            hidden = {n: WireTensor.from_array(np.random.default_rng(n).standard_normal((1, n // 4), dtype=np.float32))
                      for n in sizes}

            async def hop(kind: str, stack: str, n: int, step: int) -> float:
                t0 = time.perf_counter()
                if kind == "hop":
                    await streams[stack].write(LEN.pack(n) + payloads[n])
                    await read_exactly(streams[stack], 4)
                else:
                    msg = Forward("bench", step, 1, 0, "head", hidden=hidden[n])
                    await transports[stack].send(str(targets[stack][0]), msg, within=30)
                return time.perf_counter() - t0

            async def connect_once(stack: str) -> float:
                """A fresh connection: a second dialer host each time would skew nothing but cost a key; instead
                the kept one drops its connection (its streams are reopened afterwards)."""
                host = hosts[stack]
                target, addrs = targets[stack]
                await host.disconnect(target)
                await trio.sleep(0.15)  # py-libp2p removes a closed connection after a fixed 0.1 s
                host.get_network().unblock_peer(target)
                t0 = time.perf_counter()
                with trio.fail_after(10):
                    await host.connect(PeerInfo(target, addrs))
                return time.perf_counter() - t0

            step = 0
            for n in sizes:  # warm-up
                for stack in STACKS:
                    for kind in kinds:
                        for _ in range(3):
                            step += 1
                            await hop(kind, stack, n, step)
            deadline = time.monotonic() + args.budget
            for rnd in range(args.rounds):
                order = STACKS if rnd % 2 == 0 else STACKS[::-1]
                for n in sizes:
                    batch = max(3, args.batch if n < (1 << 20) else args.batch // 4)
                    for kind in kinds:
                        for stack in order:
                            c0, s0 = time.process_time(), receiver.cpu_seconds()
                            for _ in range(batch):
                                step += 1
                                samples[kind][stack][n].append(await hop(kind, stack, n, step))
                            cpu[kind][stack][n].append((time.process_time() - c0 + receiver.cpu_seconds() - s0) / batch)
                for stack in order:
                    connects[stack].append(await connect_once(stack))
                    streams[stack] = await hosts[stack].new_stream(targets[stack][0], [ACK_PROTOCOL])
                print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
                if time.monotonic() > deadline:
                    print("time budget reached", file=sys.stderr)
                    break
            nursery.cancel_scope.cancel()
    finally:
        receiver.stop()
    return summarise(samples, cpu, connects, sizes)


def summarise(samples, cpu, connects, sizes) -> dict:
    out: dict = {"connect_ms": {}, "hop": {}, "actor": {}}
    for stack in STACKS:
        out["connect_ms"][stack] = {"n": len(connects[stack]), "median": round(statistics.median(connects[stack]) * 1e3, 2)}
    for kind in ("hop", "actor"):
        for n in sizes:
            row = {}
            base = statistics.median(samples[kind]["open"][n])
            for stack in STACKS:
                xs = samples[kind][stack][n]
                med = statistics.median(xs)
                row[stack] = {"n": len(xs), "median_ms": round(med * 1e3, 3),
                              "p90_ms": round(sorted(xs)[int(0.9 * (len(xs) - 1))] * 1e3, 3),
                              "extra_ms": round((med - base) * 1e3, 3), "ratio": round(med / base, 3),
                              "cpu_ms_both_ends": round(statistics.median(cpu[kind][stack][n]) * 1e3, 3)}
            out[kind][str(n)] = row
    return out


def print_table(result: dict) -> None:
    c = result["connect_ms"]
    print(f"\nconnect: open {c['open']['median']:.1f} ms, private {c['private']['median']:.1f} ms "
          f"(n = {c['open']['n']} each)")
    for kind in ("hop", "actor"):
        print(f"\n{kind}: | payload | open | private | extra | ratio | cpu open | cpu private |")
        for n, row in result[kind].items():
            o, p = row["open"], row["private"]
            print(f"| {int(n):,} B | {o['median_ms']:.3f} | {p['median_ms']:.3f} | {p['extra_ms']:+.3f} | "
                  f"{p['ratio']:.2f} | {o['cpu_ms_both_ends']:.2f} | {p['cpu_ms_both_ends']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", nargs="?", default="measure", choices=["measure", "serve"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=40, help="hops per stack, kind, size and round (a quarter at 1 MiB)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--budget", type=float, default=300.0, help="stop starting rounds after this many seconds")
    ap.add_argument("--psk", default="", help=argparse.SUPPRESS)
    ap.add_argument("--lifetime", type=float, default=600.0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    args = ap.parse_args()
    if args.cmd == "serve":
        trio.run(serve_main, args)
        return
    meta = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()], "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    result = {**meta, "command": " ".join(sys.argv), **trio.run(measure, args)}
    print(json.dumps(result, indent=1))
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
