#!/usr/bin/env python3
"""What tracing costs, and where a token's time goes: N daemons on loopback (SmolLM2-135M, one stage each).

    .venv/bin/python scripts/bench_trace.py --rounds 8 --tokens 48 --plot docs/img/token-breakdown.png

* Overhead: every round sends one greedy request with tracing off and one with it on, in alternating order
  (off first in even rounds, on first in odd ones), and compares their decode tokens/s as the head measures
  them; the traced request's trace is collected too (as `swarmd submit-prompt --trace` does). Reported: the
  medians, the median of the per-round ratios and their spread (min-max).
* With tracing off, what stays on every frame is the metrics (`HopTimer` counts bytes and send-to-ack
  latency); its cost per frame is timed here in-process over 100,000 frames.
* Breakdown: the per-token table (`swarmd trace summarize`) of the last traced request, and a PNG of it.

Results go to stdout as Markdown (and as JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pipeline import PROMPTS, start_swarm  # noqa: E402
from local_swarm import say  # noqa: E402


def request(api: str, prompt: str, tokens: int, trace: bool) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": tokens, "trace": trace}
    with httpx.stream("POST", f"{api}/api/v0/generate", json=body, timeout=httpx.Timeout(30, read=900)) as r:
        for line in r.iter_lines():
            event = json.loads(line)
            if event["event"] == "done":
                return event
            if event["event"] == "error":
                raise RuntimeError(f"{event['code']}: {event['message']}")
    raise RuntimeError("the stream ended early")


def observer_cost_us(frames: int = 100_000, traced: bool = False) -> float:
    """Microseconds per frame and step of what a daemon does for timing: HopTimer's four calls for a Forward
    with the Prometheus counters (always on), and with `traced` the hop spans and a stage step's spans too."""
    from types import SimpleNamespace

    import numpy as np
    from prometheus_client import CollectorRegistry

    from swarmd.observe.hop_timer import HopTimer
    from swarmd.observe.pipeline_metrics import WireMetrics
    from swarmd.observe.spans import SpanRecorder, record_stage_step
    from swarmd.wire.codec import WireTensor
    from swarmd.wire.messages import Forward

    recorder = SpanRecorder(max_spans=10 * frames)
    timer = HopTimer(recorder, WireMetrics(CollectorRegistry()))
    msg = Forward("req-x", 3, 1, 7, "head", hidden=WireTensor.from_array(np.zeros((1, 576), np.float32)))
    work = SimpleNamespace(request_id="req-x", step=3, rows=1, sampling=None)
    job = SimpleNamespace(work=work, batch=1, received=1.0, taken=1.1, started=1.2, computed=1.3, ended=1.3)
    if traced:
        recorder.trace("req-x")
    start = time.perf_counter()
    for seq in range(frames):
        t = timer.now()
        timer.encoded("peer", seq, msg, t, 2400)
        timer.settled("peer", seq, True)
        timer.decoded("peer", msg, t, 2400)
        timer.handling(msg)
        if recorder.wants("req-x"):
            record_stage_step(recorder, job, 1.4, 1)
    return (time.perf_counter() - start) / frames * 1e6


def plot(b: Any, path: Path, title: str) -> None:
    """A bar per stage, hop and phase: its median ms per decode step (a `trace_summary.Breakdown`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"stage.forward": "#4c72b0", "stage.sample": "#64b5cd", "stage.queue": "#dd8452",
               "stage.handover": "#c44e52", "stage.output": "#937860", "hop.serialise": "#8172b3",
               "hop.send": "#cccccc", "hop.wire": "#55a868", "hop.deserialise": "#da8bc3", "hop.admit": "#8c8c8c",
               "head.detokenize": "#ccb974"}
    parts = [r for r in b.rows if r.median_ms and r.phase in colours and r.phase != "hop.send"]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(parts) + 1.8))
    labels = [f"{r.where}: {r.phase}" for r in parts][::-1]
    values = [r.median_ms for r in parts][::-1]
    bars = ax.barh(labels, values, color=[colours[r.phase] for r in parts][::-1])
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], padding=3, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("median ms per decode step (log scale)")
    sub = (f"a decode step's parts add up to {b.parts_ms:.1f} ms (median over steps)" if b.parts_ms else "")
    if b.token_interval_ms:
        sub += f"; time between tokens at the head {b.token_interval_ms[0]:.1f} ms (median)"
    ax.set_title(f"{title}\n{sub}", fontsize=10)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--plot", type=Path, help="write the breakdown as a PNG here")
    parser.add_argument("--trace-out", type=Path, help="write the last traced request's trace here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from swarmd.observe.trace_summary import breakdown

    say(f"starting {args.daemons} daemons")
    swarm = start_swarm(args.daemons, args.context, 8)
    rates: dict[bool, list[float]] = {False: [], True: []}
    ratios: list[float] = []
    events: list[dict[str, Any]] = []
    try:
        say("warming up")
        request(swarm.api, PROMPTS[0], 8, False)
        request(swarm.api, PROMPTS[0], 8, True)
        for r in range(args.rounds):
            prompt = PROMPTS[r % len(PROMPTS)]
            got = {}
            for traced in ((False, True) if r % 2 == 0 else (True, False)):
                done = request(swarm.api, prompt, args.tokens, traced)
                got[traced] = done["timings"]["decode_tokens_per_s"]
                rates[traced].append(got[traced])
                if traced:
                    events = done["trace"]
            ratios.append(got[True] / got[False])
            say(f"round {r + 1}: off {got[False]:.2f}, on {got[True]:.2f} tok/s (on/off {ratios[-1]:.3f})")
    finally:
        swarm.stop()
    per_frame, per_traced = observer_cost_us(), observer_cost_us(traced=True)
    b = breakdown(events)
    if args.trace_out:
        args.trace_out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    if args.plot:
        plot(b, args.plot, f"SmolLM2-135M over {args.daemons} daemons on loopback, one request, {args.tokens} tokens")
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    result = {"off_tok_s": rates[False], "on_tok_s": rates[True], "ratios": ratios, "observer_us_per_frame": per_frame,
              "traced_us_per_frame_and_step": per_traced,
              "rows": [r.__dict__ for r in b.rows], "token_interval_ms": b.token_interval_ms}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"Command: `.venv/bin/python scripts/bench_trace.py --daemons {args.daemons} --rounds {args.rounds} "
          f"--tokens {args.tokens}`  ")
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; {load}  ")
    print(f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    print("| tracing | decode tok/s (median) | rounds |")
    print("|---|---|---|")
    print(f"| off | {off:.2f} | {', '.join(f'{x:.2f}' for x in rates[False])} |")
    print(f"| on | {on:.2f} | {', '.join(f'{x:.2f}' for x in rates[True])} |")
    med = statistics.median(ratios)
    print(f"\nOn/off per round: median **{med:.3f}** (cost {100 * (1 - med):+.1f} %), spread {min(ratios):.3f} to "
          f"{max(ratios):.3f}; ratio of the medians {on / off:.3f}. Always on (tracing off): the metrics' "
          f"frame observer, {per_frame:.2f} µs per frame; traced, the same plus the hop's and a stage step's "
          f"spans: {per_traced:.2f} µs (in-process, 100,000 frames each).\n")
    print("Per-token breakdown of the last traced request (median and p95 over its decode steps, ms):\n")
    print("| where | phase | prefill | decode median | decode p95 |")
    print("|---|---|---|---|---|")
    for row in b.rows:
        cells = [f"{v:.3f}" if v is not None else "" for v in (row.prefill_ms, row.median_ms, row.p95_ms)]
        print(f"| {row.where} | {row.phase} | {' | '.join(cells)} |")
    if b.token_interval_ms:
        print(f"\nTime between tokens at the head: median {b.token_interval_ms[0]:.2f} ms, "
              f"p95 {b.token_interval_ms[1]:.2f} ms; a decode step's parts add up to {b.parts_ms or 0:.2f} ms "
              "(median over steps).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
