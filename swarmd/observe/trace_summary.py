"""The per-token breakdown of a request's Chrome trace (as `swarmd submit-prompt --trace` writes it). Pure.

Every span carries the step it belongs to: step 0 is the prefill, steps 1.. the decode steps, one token each.
Spans are grouped by where they ran (a stage, the head, a hop between two nodes) and what they are; each group
gets its median and 95th percentile over the decode steps. A hop's one-way time on the wire is derived from
the two ends of the same message (flow id): the receiver began decoding minus the sender had its frame ready,
both on the head's clock.

A MoE stage's `stage.forward` includes its routers' fan-out: per block, `moe.fan_out` (batches out -> every
answer in) and per expert node `moe.send` (batch -> ack) and `moe.call` (batch -> answer); on the expert's
node `expert.queue`, `expert.forward` and `expert.batch` (all of its handling). They are listed under the
stage and block they serve and are not added again into a step's parts.

    rows = breakdown(json.load(open("out.json"))["traceEvents"])
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# The order rows are listed in: a token's way round the chain.
PHASES = ("tokenize", "hop.serialise", "hop.send", "hop.wire", "hop.deserialise", "hop.admit", "stage.queue",
          "stage.handover", "stage.forward", "moe.fan_out", "moe.send", "moe.call", "expert.batch", "expert.queue",
          "expert.forward", "stage.sample", "stage.output", "head.detokenize")
MOE = frozenset({"moe.fan_out", "moe.send", "moe.call", "expert.batch", "expert.queue", "expert.forward"})
# What adds up to a token's time round the chain (hop.send overlaps the receiver's parts; head.* are totals;
# the MoE spans are inside stage.forward).
PARTS = frozenset(PHASES) - {"tokenize", "hop.send", "head.detokenize"} - MOE
_PEER = re.compile(r"\s(\S+)$")


@dataclass(frozen=True)
class Row:
    where: str  # "stage 1", "head", "stage 0 -> stage 1 (forward)"
    phase: str
    prefill_ms: float | None  # step 0 (summed if a step has several)
    median_ms: float | None  # over decode steps
    p95_ms: float | None
    steps: int  # decode steps seen

    @property
    def is_hop(self) -> bool:
        return self.phase.startswith("hop.")


@dataclass(frozen=True)
class Breakdown:
    rows: list[Row]
    token_interval_ms: tuple[float, float] | None  # median, p95 of the time between tokens at the head
    tokens: int
    nodes: dict[str, str]  # role -> peer id
    parts_ms: float | None = None  # median over decode steps of the step's parts summed (hop.send excluded)


def _roles(events: Sequence[dict[str, Any]]) -> tuple[dict[int, str], dict[str, str]]:
    """pid -> role, and peer id -> role, from the process names ("stage 1 12D3Koo...")."""
    by_pid, by_peer = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            name = str(e["args"]["name"])
            m = _PEER.search(name)
            role = name[: m.start()] if m else name
            by_pid[e["pid"]] = role
            if m:
                by_peer[m.group(1)] = role
    return by_pid, by_peer


def _where_of_stage(role: str, thread: str) -> str:
    return thread if thread.startswith("stage") or thread == "head" else role


def breakdown(events: Sequence[dict[str, Any]]) -> Breakdown:
    by_pid, by_peer = _roles(events)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    samples: dict[tuple[str, str], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    sends: dict[int, tuple[str, float]] = {}
    recvs: dict[int, tuple[str, float, int, str]] = {}
    tokens: list[float] = []
    for e in events:
        if e.get("ph") == "i" and e.get("name") == "token":
            tokens.append(e["ts"])
        if e.get("ph") != "X":
            continue
        args, name, role = e.get("args", {}), e["name"], by_pid.get(e["pid"], "?")
        step = args.get("step")
        if not isinstance(step, int):
            if name == "tokenize":
                samples[("head", name)][0] += e["dur"] / 1e3
            continue
        if name.startswith("hop."):
            other = by_peer.get(args.get("to") or args.get("sender") or "", "?")
            src, dst = (role, other) if name in ("hop.serialise", "hop.send") else (other, role)
            where = _hop_name(args.get("msg", "?"), args.get("hop"), _short(src), _short(dst))
            if name == "hop.send" and "flow" in args:
                sends[args["flow"]] = (where, e["ts"])
            if name == "hop.deserialise" and "flow" in args:
                recvs[args["flow"]] = (where, e["ts"], step, args.get("msg", "?"))
        elif name in MOE:
            where = _where_of_moe(name, args, role, by_peer)
        else:
            thread = threads.get((e["pid"], e["tid"]), "")
            where = _where_of_stage(role, thread)
        samples[(where, name)][step] += e["dur"] / 1e3
    for flow, (where, ts, step, _) in recvs.items():
        if flow in sends:
            samples[(where, "hop.wire")][step] += (ts - sends[flow][1]) / 1e3
    per_step_total: dict[int, float] = defaultdict(float)
    for (_, phase), per_step in samples.items():
        if phase in PARTS:
            for step, v in per_step.items():
                per_step_total[step] += v
    decode_totals = [v for s, v in per_step_total.items() if s >= 1]
    rows = []
    for (where, phase), per_step in samples.items():
        decode = [v for s, v in per_step.items() if s >= 1]
        rows.append(Row(where, phase, per_step.get(0), _pct(decode, 50), _pct(decode, 95), len(decode)))
    rows.sort(key=_order)
    tokens.sort()
    gaps = np.diff(tokens) / 1e3 if len(tokens) > 1 else np.array([])
    interval = (float(np.median(gaps)), float(np.percentile(gaps, 95))) if len(gaps) else None
    return Breakdown(rows, interval, len(tokens), {role: peer for peer, role in by_peer.items()},
                     _pct(decode_totals, 50))


def _where_of_moe(name: str, args: dict[str, Any], role: str, by_peer: dict[str, str]) -> str:
    """'stage 0, block 1' (its router's fan-out), 'stage 0, block 1 -> experts 3f9a1c' (one expert node's
    batch), 'experts 3f9a1c, block 1' (that node's side)."""
    block = f"block {args.get('block', '?')}"
    if name.startswith("expert."):
        return f"{_short(role)}, {block}" if role.startswith("experts") else f"{_short(role)} experts, {block}"
    if name == "moe.fan_out":
        return f"{_short(role)}, {block}"
    to = str(args.get("to", ""))
    return f"{_short(role)}, {block} -> {_short(by_peer.get(to, to[-6:]))}"


def _hop_name(msg: str, hop: Any, src: str, dst: str) -> str:
    """Which hop a message makes, by what it is: a Forward's hop is the stage it goes to (0: from the head),
    a Token goes to stage 0 (hop 0) or to the head (hop 1)."""
    if msg == "forward" and isinstance(hop, int):
        src, dst = ("head" if hop == 0 else f"stage {hop - 1}"), f"stage {hop}"
    elif msg == "token" and hop in (0, 1):
        dst = "stage 0" if hop == 0 else "head"
    return f"{src} -> {dst} ({msg})"


def _short(role: str) -> str:
    """'head, stage 0' -> 'stage 0' when the message is a stage's; keeps the names of a hop short."""
    return role.split(", ")[-1] if role.startswith("head, ") else role


def _order(row: Row) -> tuple:
    phase = PHASES.index(row.phase) if row.phase in PHASES else len(PHASES)
    stage = re.search(r"stage (\d+)", row.where)
    n = int(stage.group(1)) if stage else (-1 if row.where == "head" else 99)
    return (n, row.is_hop, row.where, phase)


def _pct(values: Iterable[float], q: float) -> float | None:
    v = list(values)
    return float(np.percentile(v, q)) if v else None


def per_token_parts(b: Breakdown) -> dict[str, float]:
    """Median decode ms per kind of work, summed over stages and hops: what a token's time is made of."""
    out: dict[str, float] = defaultdict(float)
    for r in b.rows:
        if r.median_ms is not None:
            out[r.phase] += r.median_ms
    return dict(out)


def render(b: Breakdown, *, title: str = "per-token breakdown") -> Any:
    """A rich Table of the breakdown."""
    from rich.table import Table

    t = Table(title=title, caption=_caption(b))
    for col in ("where", "phase", "prefill ms", "decode median ms", "decode p95 ms", "steps"):
        t.add_column(col, justify="left" if col in ("where", "phase") else "right")
    for r in b.rows:
        t.add_row(r.where, r.phase, _ms(r.prefill_ms), _ms(r.median_ms), _ms(r.p95_ms), str(r.steps))
    return t


def _caption(b: Breakdown) -> str:
    if b.token_interval_ms is None:
        return f"{b.tokens} token(s)"
    med, p95 = b.token_interval_ms
    parts = f"; a decode step's parts add up to {b.parts_ms:.2f} ms (median)" if b.parts_ms else ""
    return (f"{b.tokens} tokens; time between tokens at the head: median {med:.2f} ms, p95 {p95:.2f} ms "
            f"({1e3 / med:.1f} tok/s){parts}")


def _ms(v: float | None) -> str:
    return "" if v is None else f"{v:.3f}"
