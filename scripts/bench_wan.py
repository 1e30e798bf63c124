#!/usr/bin/env python3
"""Decode over an emulated WAN: N daemons whose every link has a one-way delay and a bandwidth cap.

    .venv/bin/python scripts/bench_wan.py --daemons 2,4 --rounds 3 --tokens 32 --delay-ms 10 --bandwidth-mbit 100

Each daemon listens on its own loopback port and announces a port of the link emulator
(`scripts/link_emulator.py`, one link per daemon) that forwards to it, so every connection between daemons,
and every hop of a token, goes through an emulated link. Activations travel on libp2p streams
(`--data-plane libp2p`): the TLS data plane would dial the daemons' own ports, around the emulator.

Every round, on the same swarm: a traced request with the links at 0 ms (same bandwidth cap), then one at
`--delay-ms`, then `--concurrent` requests at once at `--delay-ms`. From the 0 ms request: the sum over
stages of the model's compute per decode step (stage.forward + stage.sample medians) and the loopback cost
of a hop, ((time between tokens) - compute) / N, the emulator's own cost included. The limit is then

    1 / (compute + N x (one-way delay + loopback hop cost))

and the 10 ms rate is compared with it (target >= 0.9). Results as Markdown on stdout (JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pipeline import PROMPTS, start_swarm  # noqa: E402
from bench_trace import request  # noqa: E402
from local_swarm import say  # noqa: E402


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Emulator:
    """scripts/link_emulator.py in a process of its own, driven over its control port."""

    def __init__(self, links: dict[str, tuple[int, int]], bandwidth_mbit: float) -> None:
        self.control_port = free_ports(1)[0]
        cmd = [sys.executable, str(ROOT / "scripts" / "link_emulator.py"), "--control", str(self.control_port),
               "--bandwidth-mbit", str(bandwidth_mbit)]
        for name, (listen, target) in links.items():
            cmd += ["--link", f"{name}={listen}:127.0.0.1:{target}"]
        self.names = list(links)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        for _ in range(len(links) + 1):
            if not self.proc.stdout.readline().startswith(("link ", "control ")):
                self.proc.kill()
                raise RuntimeError(f"the link emulator did not start (exit code {self.proc.wait(10)})")

    def set_delay(self, ms: float) -> None:
        with socket.create_connection(("127.0.0.1", self.control_port), timeout=10) as s:
            f = s.makefile("rw")
            for name in self.names:
                f.write(json.dumps({"link": name, "set": {"delay_ms": ms}}) + "\n")
                f.flush()
                reply = json.loads(f.readline())
                if "error" in reply:
                    raise RuntimeError(reply["error"])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def compute_ms(events: list[dict[str, Any]]) -> tuple[float, float]:
    """(sum over stages of the median decode compute, median time between tokens), ms, from a trace."""
    from swarmd.observe.trace_summary import breakdown

    b = breakdown(events)
    compute = sum(r.median_ms or 0.0 for r in b.rows if r.phase in ("stage.forward", "stage.sample"))
    assert b.token_interval_ms is not None
    return compute, b.token_interval_ms[0]


def concurrent_rate(api: str, n: int, tokens: int) -> float | str:
    """Aggregate tok/s of n requests at once, or what went wrong (the round's other figures are kept)."""
    def one(i: int) -> int:
        return request(api, PROMPTS[i % len(PROMPTS)], tokens, False)["usage"]["completion_tokens"]

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(n) as pool:
            total = sum(pool.map(one, range(n)))
    except RuntimeError as e:
        return str(e)
    return total / (time.perf_counter() - start)


@contextmanager
def emulated_swarm(n: int, context: int, max_requests: int, bandwidth_mbit: float) -> Iterator[tuple[Any, Emulator]]:
    """N daemons (an even plan) each behind its own emulated link, activations on libp2p so they cross it;
    (swarm, emulator), both stopped on the way out."""
    listen, front = free_ports(n), free_ports(n)
    emu = Emulator({f"d{i}": (front[i], listen[i]) for i in range(n)}, bandwidth_mbit)
    swarm = None
    try:
        swarm = start_swarm(n, context, max_requests,
                            listen_of=lambda i: f"/ip4/127.0.0.1/tcp/{listen[i]}",
                            extra_of=lambda i: ("--announce", f"/ip4/127.0.0.1/tcp/{front[i]}",
                                                "--data-plane", "libp2p"),
                            bootstrap_of=lambda peers: f"/ip4/127.0.0.1/tcp/{front[0]}/p2p/{peers[0]}")
        yield swarm, emu
    finally:
        if swarm is not None:
            swarm.stop()
        emu.stop()


def run_n(n: int, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"n": n, "lan_interval_ms": [], "compute_ms": [], "hop_ms": [], "wan_tok_s": [],
                           "limit_tok_s": [], "ratio": [], "concurrent_tok_s": [], "wan_interval_ms": []}
    with emulated_swarm(n, args.context, max(8, args.concurrent), args.bandwidth_mbit) as (swarm, emu):
        say(f"N = {n}: warming up")
        emu.set_delay(0)
        request(swarm.api, PROMPTS[0], 8, True)
        for c in (2, 4, 8) if args.concurrent else ():  # compile and capture each batch size before timing
            if c <= args.concurrent:
                got = concurrent_rate(swarm.api, c, 4)
                say(f"N = {n}: warm-up, {c} at once: {got if isinstance(got, str) else 'done'}")
        for r in range(args.rounds):
            prompt = PROMPTS[r % len(PROMPTS)]
            emu.set_delay(0)
            compute, lan = compute_ms(request(swarm.api, prompt, args.tokens, True)["trace"])
            hop = (lan - compute) / n
            emu.set_delay(args.delay_ms)
            wan_events = request(swarm.api, prompt, args.tokens, True)["trace"]
            _, wan = compute_ms(wan_events)
            limit = 1e3 / (compute + n * (args.delay_ms + hop))
            rate = 1e3 / wan
            out["lan_interval_ms"].append(lan)
            out["compute_ms"].append(compute)
            out["hop_ms"].append(hop)
            out["wan_interval_ms"].append(wan)
            out["wan_tok_s"].append(rate)
            out["limit_tok_s"].append(limit)
            out["ratio"].append(rate / limit)
            say(f"N = {n}, round {r + 1}: compute {compute:.1f} ms, loopback hop {hop:.2f} ms, "
                f"{args.delay_ms:g} ms links {rate:.2f} tok/s of a {limit:.2f} limit ({rate / limit:.3f})")
            out["last_wan_trace"] = wan_events
            if args.concurrent and not out.get("concurrent_error"):
                got = concurrent_rate(swarm.api, args.concurrent, args.tokens)
                if isinstance(got, str):  # the swarm may be stuck for this request's life: stop asking
                    out["concurrent_error"] = got
                    say(f"N = {n}: {args.concurrent} at once failed: {got}")
                else:
                    out["concurrent_tok_s"].append(got)
                    say(f"N = {n}: {args.concurrent} at once {got:.2f} tok/s")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", default="2,4", help="swarm sizes, comma-separated (default: 2,4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay of every link (default: 10)")
    parser.add_argument("--bandwidth-mbit", type=float, default=100.0, help="per direction (default: 100)")
    parser.add_argument("--concurrent", type=int, default=8, help="requests at once (default: 8)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for n in args.daemons.split(","):
        try:
            results.append(run_n(int(n), args))
        except Exception as e:  # one size failing keeps the other's figures
            say(f"N = {n} failed: {type(e).__name__}: {e}")
            results.append({"n": int(n), "error": f"{type(e).__name__}: {e}"})
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "last_wan_trace"} for r in results], indent=2))
        return 0
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"Command: `.venv/bin/python scripts/bench_wan.py --daemons {args.daemons} --rounds {args.rounds} "
          f"--tokens {args.tokens} --delay-ms {args.delay_ms:g} --bandwidth-mbit {args.bandwidth_mbit:g} "
          f"--concurrent {args.concurrent}`  ")
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; {load}  ")
    print(f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    print(f"| N | compute per token | loopback hop | time between tokens, 0 ms / {args.delay_ms:g} ms | "
          f"decode tok/s at {args.delay_ms:g} ms (rounds) | limit | × limit (rounds) | "
          f"{args.concurrent} at once, tok/s (rounds) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r or not r.get("ratio"):
            print(f"| {r['n']} | failed: {r.get('error', 'no round finished')} |||||||")
            continue
        m = {k: statistics.median(v) for k, v in r.items() if k != "last_wan_trace" and isinstance(v, list) and v}
        concurrent = (f"{m['concurrent_tok_s']:.2f} ({', '.join(f'{x:.2f}' for x in r['concurrent_tok_s'])})"
                      if r["concurrent_tok_s"] else "")
        if r.get("concurrent_error"):
            concurrent += f" then failed: {r['concurrent_error']}"
        print(f"| {r['n']} | {m['compute_ms']:.1f} ms | {m['hop_ms']:.2f} ms | {m['lan_interval_ms']:.1f} / "
              f"{m['wan_interval_ms']:.1f} ms | {m['wan_tok_s']:.2f} ({', '.join(f'{x:.2f}' for x in r['wan_tok_s'])}) | "
              f"{m['limit_tok_s']:.2f} | **{m['ratio']:.3f}** ({', '.join(f'{x:.3f}' for x in r['ratio'])}) | "
              f"{concurrent} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
