#!/usr/bin/env python3
"""Speculative decoding over an emulated WAN: tokens/s of one stream with and without speculation, side by side.

    .venv/bin/python scripts/bench_spec.py --rounds 3 --tokens 48 --delay-ms 10

N daemons (default 4) serve `--model` (smollm2-moe-8x2 by default), each behind its own emulated link
(`scripts/link_emulator.py`: its libp2p port and its TLS data-plane port, which the others dial through `--dial-map`,
so that every hop crosses it; `--data-plane libp2p` carries activations on the libp2p streams instead). Daemon 0 holds stage 0
and heads every request, started with `--speculate ngram --draft-tokens K`; each request picks its mode with the
`speculate` field: off, ngram, or model:smollm2-135m (the dense model drafting for its MoE split; left out when
`--model smollm2-135m` is served, which would draft for itself). smollm2-moe-8x2 keeps 2 of the 8 parts of each
MLP and writes no coherent text, so its output rarely repeats its context and prompt lookup finds nothing to draft:
`--model smollm2-135m` (the dense model, 4 dense stages) measures ngram on text a model really writes. Rounds are
interleaved: every round runs every prompt of every set in every mode, one request at a time.

Sets: code editing (prompts whose continuation rewrites code the prompt shows), code editing via chat (the same edits
asked through the chat template, as a user asks an assistant) and chat (questions through the chat template); pick
them with --sets. Per (set, mode): the median decode tokens/s over the set's requests (the head's timings: tokens
after the first over the time from the first to the last), its ratio to `off` in the same rounds (the median of
the requests' ratios; per prompt, the ratio of the rounds' medians), and what the passes did:
drafted tokens accepted (per cent), tokens per pass through the chain. Greedy outputs must be identical in every
mode; a difference is reported (and fails the run).

`--loopback-rounds` also measures at 0 ms delay (loopback: compute and the hops' own cost dominate), where drafts
that fail cost their rows' compute: the chat set with ngram (adaptive k, and a fixed k without adaptation) against
off. `--far-delay-ms 25` adds a round set at that delay with the draft model at several fixed k (a chain's budget of
drafted tokens per pass). The measured acceptance per mode goes to stdout as JSON with --json, or to a file with
--json-out FILE besides the tables (scale_kimi.py --acceptance FILE takes it).
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

from bench_wan import Emulator, free_ports  # noqa: E402
from local_swarm import LocalSwarm, say  # noqa: E402

DRAFT_MODEL = "smollm2-135m"
DRAFT = f"model:{DRAFT_MODEL}"
N_BLOCKS = 30
N_EXPERTS = {"smollm2-moe-8x2": 8, "smollm2-135m": 0}  # the models this bench serves: routed experts per block

CODE_EDITING = (
    "Rename the variable x to value.\n\nBefore:\n```python\ndef scale(x, factor):\n    y = x * factor\n"
    "    if y > 100:\n        return 100\n    return y + x\n```\n\nAfter:\n```python\ndef scale(value, factor):\n",
    "Add a docstring to each function.\n\n```python\ndef area(width, height):\n    return width * height\n\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n```\n\nWith docstrings:\n\n```python\n"
    "def area(width, height):\n",
    "Change the port to 8080 and keep everything else.\n\n{\n  \"host\": \"localhost\",\n  \"port\": 8000,\n"
    "  \"debug\": true,\n  \"workers\": 4,\n  \"timeout\": 30\n}\n\nUpdated:\n\n{\n",
    "Fix the typo in the loop.\n\n```python\nfor item in itmes:\n    total = total + item.price * item.count\n"
    "    print(item.name, item.price, item.count)\n```\n\nFixed:\n\n```python\nfor item in items:\n",
)
# The same edits asked of the chat model as a user asks an assistant: the instruction and the code in one message
CODE_EDITING_CHAT = (
    "Rename the variable x to value in this function and show the whole function:\n\n```python\ndef scale(x, "
    "factor):\n    y = x * factor\n    if y > 100:\n        return 100\n    return y + x\n```",
    "Add a docstring to each function and show the code:\n\n```python\ndef area(width, height):\n    return width "
    "* height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n```",
    "Change the port to 8080 and keep everything else:\n\n{\n  \"host\": \"localhost\",\n  \"port\": 8000,\n  "
    "\"debug\": true,\n  \"workers\": 4,\n  \"timeout\": 30\n}",
    "Fix the typo in this loop and show the fixed code:\n\n```python\nfor item in itmes:\n    total = total + "
    "item.price * item.count\n    print(item.name, item.price, item.count)\n```",
)
CHAT = (
    "What is the difference between a list and a tuple in Python?",
    "Give me a short tip for sleeping better.",
    "Explain photosynthesis to a ten-year-old in two sentences.",
    "Write a haiku about autumn leaves.",
)
SETS = {"code editing": ("prompt", CODE_EDITING), "code editing via chat": ("chat", CODE_EDITING_CHAT),
        "chat": ("chat", CHAT)}


def start(model: str, n: int, context: int, draft_tokens: int, bandwidth_mbit: float,
          data_plane: str = "tls") -> tuple[LocalSwarm, Emulator]:
    """N daemons with an even plan, each behind an emulated link (its libp2p port and, on the TLS data plane, its
    data-plane port, which the others reach through `--dial-map`); daemon 0 speculates."""
    import tempfile

    from planner.plan import ModelRef, Plan, Stage, stage_actor
    from swarmd.net.identity import load_or_create_identity, peer_id_of

    base = Path(tempfile.mkdtemp(prefix="swarmd-bench-spec-"))
    peers = []
    for i in range(n):
        (base / f"daemon-{i}").mkdir(parents=True)
        peers.append(peer_id_of(load_or_create_identity(base / f"daemon-{i}")))
    bounds = [round(i * N_BLOCKS / n) for i in range(n + 1)]
    # each stage's daemon holds its blocks' experts (every block of the model is a MoE block)
    experts = {b: {e: (p,) for e in range(N_EXPERTS[model])} for i, p in enumerate(peers)
               for b in range(bounds[i], bounds[i + 1])} if N_EXPERTS[model] else {}
    plan = Plan(1, ModelRef(model), tuple(Stage(p, (bounds[i], bounds[i + 1]), (stage_actor(i),))
                                          for i, p in enumerate(peers)), experts=experts)
    (base / "plan.json").write_text(plan.dumps())
    listen, front = free_ports(n), free_ports(n)
    links = {f"d{i}": (front[i], listen[i]) for i in range(n)}
    plane: dict[int, tuple[str, ...]] = {i: ("--data-plane", "libp2p") for i in range(n)}
    if data_plane == "tls":  # the data plane's own ports behind links of their own, dialled through the emulator
        data, data_front = free_ports(n), free_ports(n)
        links |= {f"p{i}": (data_front[i], data[i]) for i in range(n)}
        plane = {i: ("--data-plane-port", str(data[i]),
                     *(arg for j in range(n) if j != i
                       for arg in ("--dial-map", f"127.0.0.1:{data[j]}=127.0.0.1:{data_front[j]}"))) for i in range(n)}
    emu = Emulator(links, bandwidth_mbit)
    spec = ("--speculate", "ngram", "--draft-tokens", str(draft_tokens))
    swarm = LocalSwarm(n, model=model, base=base, swarm="benchspec", first_extra=("--plan", str(base / "plan.json")),
                       extra=("--max-context", str(context), "--max-requests", "4"),
                       listen_of=lambda i: f"/ip4/127.0.0.1/tcp/{listen[i]}",
                       extra_of=lambda i: ("--announce", f"/ip4/127.0.0.1/tcp/{front[i]}", *plane[i],
                                           *(spec if i == 0 else ())),
                       bootstrap=f"/ip4/127.0.0.1/tcp/{front[0]}/p2p/{peers[0]}")
    try:
        swarm.start(timeout=600)
        swarm.wait_ready(900)
    except BaseException:
        swarm.stop()
        emu.stop()
        raise
    return swarm, emu


def generate(api: str, kind: str, text: str, tokens: int, speculate: dict[str, Any]) -> dict[str, Any]:
    body = {kind: text, "max_tokens": tokens, "speculate": speculate}
    ids: list[int] = []
    with httpx.stream("POST", f"{api}/api/v0/generate", json=body, timeout=httpx.Timeout(30, read=1800)) as r:
        for line in r.iter_lines():
            event = json.loads(line)
            if event["event"] == "token":
                ids.append(event["id"])
            elif event["event"] == "done":
                return {"ids": ids, "timings": event["timings"], "speculation": event.get("speculation")}
            elif event["event"] == "error":
                raise RuntimeError(f"{event['code']}: {event['message']}")
    raise RuntimeError("the stream ended early")


def modes(model: str, draft_tokens: int) -> dict[str, dict[str, Any]]:
    out = {"off": {"mode": "off"}, "ngram": {"mode": "ngram", "draft_tokens": draft_tokens}}
    if model != DRAFT_MODEL:
        out["draft model"] = {"mode": DRAFT, "draft_tokens": draft_tokens}
    return out


class Tally:
    """Per (set, mode): the requests' decode rates and their passes."""

    def __init__(self) -> None:
        self.rates: dict[tuple[str, str], list[float]] = {}
        self.spec: dict[tuple[str, str], dict[str, float]] = {}
        self.outputs: dict[tuple[str, str], list[int]] = {}  # (set, prompt) -> ids in the first mode
        self.mismatches: list[str] = []
        self.by_prompt: dict[tuple[str, str, str], list[float]] = {}  # (set, prompt, mode) -> rates

    def add(self, set_name: str, mode: str, prompt: str, got: dict[str, Any]) -> float:
        rate = got["timings"]["decode_tokens_per_s"] or 0.0
        self.rates.setdefault((set_name, mode), []).append(rate)
        self.by_prompt.setdefault((set_name, prompt, mode), []).append(rate)
        s = got["speculation"] or {}
        acc = self.spec.setdefault((set_name, mode), {"passes": 0, "drafted": 0, "accepted": 0, "draft_s": 0.0,
                                                      "rejections": 0})
        acc["rejections"] += s.get("rejections", 0)
        acc["passes"] += s.get("passes", 0)
        acc["drafted"] += s.get("drafted", 0)
        acc["accepted"] += s.get("accepted", 0)
        acc["draft_s"] += s.get("draft_seconds", 0.0)
        first = self.outputs.setdefault((set_name, prompt), got["ids"])
        if got["ids"] != first:
            self.mismatches.append(f"{set_name} / {mode}: {prompt[:40]!r}")
        return rate

    def prompt_ratios(self, set_name: str, mode: str, base: str = "off") -> list[float]:
        """Per prompt of the set (in order): the median tok/s in `mode` over the median in `base`."""
        prompts = [p for s, p, m in self.by_prompt if s == set_name and m == base]
        return [statistics.median(self.by_prompt[(set_name, p, mode)]) / statistics.median(self.by_prompt[
            (set_name, p, base)]) for p in prompts if (set_name, p, mode) in self.by_prompt]

    def row(self, set_name: str, mode: str, base: str = "off") -> dict[str, Any]:
        rates = self.rates.get((set_name, mode), [])
        base_rates = self.rates.get((set_name, base), [])
        ratios = [a / b for a, b in zip(rates, base_rates, strict=False) if b]
        s = self.spec.get((set_name, mode), {})
        drafted, accepted, passes = s.get("drafted", 0), s.get("accepted", 0), s.get("passes", 0)
        trials = accepted + s.get("rejections", 0)
        return {"set": set_name, "mode": mode, "requests": len(rates),
                "tok_s": statistics.median(rates) if rates else None,
                "ratio": statistics.median(ratios) if ratios and mode != base else None,
                "acceptance": accepted / drafted if drafted else None, "drafted": drafted, "accepted": accepted,
                "token_acceptance": accepted / trials if trials else None,
                "drafted_per_pass": drafted / passes if passes else None,
                "passes": passes, "tokens_per_pass": (passes + accepted) / passes if passes else None,
                "accepted_per_pass": accepted / passes if passes else None,
                "per_prompt": self.prompt_ratios(set_name, mode, base) if mode != base else None}


def run_rounds(api: str, tally: Tally, sets: dict[str, tuple[str, tuple[str, ...]]], by_mode: dict[str, dict],
               rounds: int, tokens: int, label: str) -> None:
    for r in range(rounds):
        for set_name, (kind, prompts) in sets.items():
            for prompt in prompts:
                for mode, speculate in by_mode.items():
                    got = generate(api, kind, prompt, tokens, speculate)
                    rate = tally.add(set_name, mode, prompt, got)
                    s = got["speculation"] or {}
                    say(f"{label} round {r + 1}, {set_name}, {mode}: {rate:.2f} tok/s"
                        + (f", {s['accepted']}/{s['drafted']} accepted in {s['passes']} passes" if s else ""))


def warm_up(api: str, model: str, draft_tokens: int, tokens: int) -> None:
    """Compile every verify size a run will use (each padded batch size captures its graphs once) and load the
    draft model, before anything is timed."""
    ks = sorted({1, 3, 7, draft_tokens} & set(range(1, draft_tokens + 1)))
    for k in ks:
        for mode in ("ngram", DRAFT) if model != DRAFT_MODEL else ("ngram",):
            got = generate(api, "prompt", CODE_EDITING[0], tokens, {"mode": mode, "draft_tokens": k,
                                                                     "adaptive": False})
            say(f"warm-up {mode} k={k}: {got['timings']['decode_tokens_per_s']} tok/s")
    generate(api, "chat", CHAT[0], tokens, {"mode": "off"})


def table(rows: list[dict[str, Any]]) -> str:
    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    out = ["| set | mode | requests | tok/s (median) | vs off | per prompt, vs off | drafted accepted | tokens per pass |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f} % ({r['accepted']}/{r['drafted']})"
        each = ", ".join(f"{x:.2f}" for x in r["per_prompt"]) if r.get("per_prompt") else "-"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        out.append(f"| {r['set']} | {r['mode']} | {r['requests']} | {f(r['tok_s'], '.2f')} | {ratio} | {each} | {acc} "
                   f"| {f(r['tokens_per_pass'], '.2f')} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(N_EXPERTS), default="smollm2-moe-8x2")
    p.add_argument("--daemons", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--draft-tokens", type=int, default=7, help="the daemon's limit and each mode's k (default 7)")
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--bandwidth-mbit", type=float, default=100.0)
    p.add_argument("--data-plane", choices=("tls", "libp2p"), default="tls",
                   help="where activations travel: the TLS data plane and its hot lane (default, as daemons run), "
                        "or the libp2p streams (the benchmark's runs before 2026-12-05)")
    p.add_argument("--loopback-rounds", type=int, default=2, help="rounds at 0 ms (0: none)")
    p.add_argument("--far-delay-ms", type=float, default=0.0, help="also the draft model at fixed k at this delay "
                   f"(not with --model {DRAFT_MODEL})")
    p.add_argument("--far-k", default="2,4,7", help="the fixed k of the --far-delay-ms rounds")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--sets", default=",".join(SETS), help=f"the sets of the WAN rounds (default {','.join(SETS)})")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the tables")
    p.add_argument("--json-out", type=Path, metavar="FILE", help="also write the results as JSON to FILE (the "
                   "acceptance scale_kimi.py --acceptance reads, e.g. docs/data/spec_acceptance.json)")
    args = p.parse_args()
    if args.far_delay_ms and args.model == DRAFT_MODEL:
        p.error(f"--far-delay-ms measures the draft model, which --model {DRAFT_MODEL} would be drafting for itself")
    by_set = modes(args.model, args.draft_tokens)
    names = args.sets.split(",")
    if unknown := [n for n in names if n not in SETS]:
        p.error(f"no set {unknown[0]!r}: --sets takes names among {', '.join(SETS)}")
    sets = {n: SETS[n] for n in names}
    results: dict[str, Any] = {"command": " ".join(sys.argv[1:])}
    swarm, emu = start(args.model, args.daemons, args.context, args.draft_tokens, args.bandwidth_mbit, args.data_plane)
    try:
        api = swarm.daemons[0].api
        emu.set_delay(0)
        warm_up(api, args.model, args.draft_tokens, 12)
        emu.set_delay(args.delay_ms)
        wan = Tally()
        run_rounds(api, wan, sets, by_set, args.rounds, args.tokens, f"{args.delay_ms:g} ms")
        results["wan"] = [wan.row(s, m) for s in sets for m in by_set]
        results["mismatches"] = list(wan.mismatches)
        if args.loopback_rounds:
            emu.set_delay(0)
            loop = Tally()
            by_mode = {"off": {"mode": "off"}, "ngram": {"mode": "ngram", "draft_tokens": args.draft_tokens},
                       "ngram, fixed k": {"mode": "ngram", "draft_tokens": args.draft_tokens, "adaptive": False}}
            run_rounds(api, loop, {"chat": SETS["chat"]}, by_mode, args.loopback_rounds, args.tokens, "loopback")
            results["loopback"] = [loop.row("chat", m) for m in by_mode]
            results["mismatches"] += loop.mismatches
        if args.far_delay_ms:
            emu.set_delay(args.far_delay_ms)
            far = Tally()
            by_mode = {"off": {"mode": "off"}} | {
                f"draft model, k={k}": {"mode": DRAFT, "draft_tokens": int(k), "adaptive": False}
                for k in args.far_k.split(",")} | {"draft model, adaptive": {"mode": DRAFT,
                                                                             "draft_tokens": args.draft_tokens}}
            run_rounds(api, far, {"code editing": SETS["code editing"]}, by_mode, args.rounds, args.tokens,
                       f"{args.far_delay_ms:g} ms")
            results["far"] = [far.row("code editing", m) for m in by_mode]
            results["mismatches"] += far.mismatches
        results["status"] = swarm.daemons[0].status().get("speculation")
    finally:
        swarm.stop()
        emu.stop()
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    if args.json:
        print(json.dumps(results, indent=2))
        return 1 if results["mismatches"] else 0
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"Command: `.venv/bin/python scripts/bench_spec.py {results['command']}`  ")
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; {load}  ")
    print(f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    print(f"{args.model} on {args.daemons} daemons, {args.delay_ms:g} ms one way per link, one stream, "
          f"{args.tokens} tokens a request:\n")
    print(table(results["wan"]))
    if "loopback" in results:
        print("\nLoopback (0 ms), chat set:\n")
        print(table(results["loopback"]))
    if "far" in results:
        print(f"\n{args.far_delay_ms:g} ms one way per link, code editing, the draft model:\n")
        print(table(results["far"]))
    print(f"\nGreedy outputs that differed between modes: {results['mismatches'] or 'none'}")
    return 1 if results["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
