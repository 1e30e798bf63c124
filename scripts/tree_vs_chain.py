#!/usr/bin/env python3
"""Draft trees against draft chains at the same token budget: accepted tokens per pass, measured in one process.

    .venv/bin/python scripts/tree_vs_chain.py --budgets 2,4,8 --tokens 48

The target's greedy continuation of each prompt is decoded first (smollm2-moe-8x2, whole, one token at a time).
Then, position by position as speculative decoding would advance, the draft model (smollm2-135m) proposes either a
chain (its greedy k tokens) or a tree of the same number of tokens, grown best first by the draft's probability of
each path (SpecExec's rule: the next node is the child, among the top 4 of an expanded node, whose path is most
likely). A greedy target accepts, from a chain, the longest prefix that equals its own continuation, and from a tree
the longest branch that does; the pass yields that many tokens plus one. No chain of daemons is involved: what a
pass costs over a WAN is measured by scripts/bench_spec.py, and is about the same for either shape (a pass of a
few rows costs its hops).
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_spec import CHAT, CODE_EDITING  # noqa: E402

TARGET, DRAFT = "smollm2-moe-8x2", "smollm2-135m"
FANOUT = 4  # children considered per expanded node


def load(name: str, context: int):
    from models.catalog.names import resolve_model
    from models.config import config_from_header
    from models.gguf.header import read_header
    from models.stage import StageModel, serving_numerics
    from models.text.tokenizer import Tokenizer

    path = resolve_model(name).path
    numerics = serving_numerics(config_from_header(read_header(path)))  # as the served stages compute
    return StageModel.from_gguf(path, max_context=context, max_requests=2, numerics=numerics), \
        Tokenizer.from_gguf(path)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    from models.stage import StageInput

    model.add_request("t")
    try:
        logits = model.forward([StageInput("t", 0, np.asarray(prompt, np.int32))])[0]
        out = []
        for i in range(n):
            out.append(int(np.argmax(logits)))
            logits = model.forward([StageInput("t", len(prompt) + i, np.asarray([out[-1]], np.int32))])[0]
        return out
    finally:
        model.free_request("t")


class Drafter:
    """The draft model over one context, evaluating any path after it (rolled back after each)."""

    def __init__(self, model, context: list[int]) -> None:
        from models.stage import StageInput

        self.model, self.length = model, len(context)
        model.add_request("d")
        self.root = model.forward([StageInput("d", 0, np.asarray(context, np.int32))])[0]
        self.evaluations = 0

    def logits(self, path: list[int]) -> np.ndarray:
        from models.stage import StageInput

        if not path:
            return self.root
        self.evaluations += 1
        self.model.rollback("d", self.length)
        out = self.model.forward([StageInput("d", self.length, np.asarray(path, np.int32), verify=True)])[0]
        return out[-1]

    def close(self) -> None:
        self.model.free_request("d")


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def chain_accepted(drafter: Drafter, budget: int, truth: list[int]) -> int:
    path: list[int] = []
    for _ in range(budget):
        path.append(int(np.argmax(drafter.logits(path))))
    return next((i for i, (a, b) in enumerate(zip(path, truth, strict=False)) if a != b), min(len(path), len(truth)))


def tree_accepted(drafter: Drafter, budget: int, truth: list[int]) -> int:
    """Grow a tree of `budget` tokens best first; the longest branch equal to the target's continuation."""
    nodes: set[tuple[int, ...]] = set()
    frontier: list[tuple[float, tuple[int, ...]]] = []

    def expand(path: tuple[int, ...], logp: float) -> None:
        lp = log_softmax(drafter.logits(list(path)))
        for t in np.argsort(-lp)[:FANOUT]:
            heapq.heappush(frontier, (-(logp + lp[t]), (*path, int(t))))

    expand((), 0.0)
    while len(nodes) < budget and frontier:
        neg, path = heapq.heappop(frontier)
        nodes.add(path)
        if len(nodes) < budget:
            expand(path, -neg)
    depth = 0
    while depth < len(truth) and tuple(truth[:depth + 1]) in nodes:
        depth += 1
    return depth


def run(args: argparse.Namespace) -> dict:
    from models.text.chat import ChatTemplate

    target, tok = load(TARGET, args.context)
    draft, _ = load(DRAFT, args.context)
    chat = ChatTemplate.for_tokenizer(tok)
    sets = {"code editing": [tok.encode(p) for p in CODE_EDITING],
            "chat": [tok.encode(chat.render([{"role": "user", "content": c}])) for c in CHAT]}
    out: dict = {"budgets": args.budgets, "tokens": args.tokens, "sets": {}}
    for name, prompts in sets.items():
        per: dict[str, list[float]] = {}
        for prompt in prompts:
            truth = greedy(target, prompt, args.tokens)
            for shape in ("chain", "tree"):
                for budget in args.budgets:
                    i, passes, accepted = 1, 0, []  # the prompt's pass gave the first token, undrafted
                    while i < len(truth):
                        drafter = Drafter(draft, prompt + truth[:i])
                        try:
                            rest = truth[i:]  # what the drafts must equal
                            acc = (chain_accepted if shape == "chain" else tree_accepted)(drafter, budget, rest)
                        finally:
                            drafter.close()
                        accepted.append(acc)
                        passes += 1
                        i += acc + 1
                    per.setdefault(f"{shape} {budget}", []).append(statistics.fmean(accepted))
                    print(f"{name} / {shape} of {budget}: {statistics.fmean(accepted):.2f} accepted per pass "
                          f"({passes} passes)", file=sys.stderr, flush=True)
        out["sets"][name] = {k: statistics.fmean(v) for k, v in per.items()}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    t0 = time.time()
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"Command: `.venv/bin/python scripts/tree_vs_chain.py --budgets {','.join(map(str, args.budgets))} "
          f"--tokens {args.tokens}`; {time.time() - t0:.0f} s\n")
    print("| set | " + " | ".join(f"chain of {b} | tree of {b}" for b in args.budgets) + " |")
    print("|---|" + "---|" * (2 * len(args.budgets)))
    for name, by in out["sets"].items():
        cells = [f"{by[f'{s} {b}']:.2f}" for b in args.budgets for s in ("chain", "tree")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n(drafted tokens accepted per pass; a pass yields one more)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
