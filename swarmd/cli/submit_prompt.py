"""`swarmd submit-prompt`: stream a completion from the swarm through the local daemon.

stdout carries only the completion, flushed token by token; everything else (waiting for the swarm, the
summary with tokens, time to first token and tokens/s) goes to stderr, as with `swarmd run`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from swarmd.cli.client import add_token_option, auth_headers, check_authorised
from swarmd.errors import UserError

ORDER = 30

HELP = "stream a completion from the swarm (through the local daemon)"
DESCRIPTION = """\
Send a prompt to the swarm through a running daemon (found through $SWARMD_HOME/api, or named with --api)
and stream the completion. The daemon heads the request: it tokenizes it, sends it down the pipeline of
daemons the plan names, and streams the tokens back as the last stage samples them.

The completion, and nothing else, is written to stdout as it arrives; waiting for the swarm and the final
summary (tokens, time to first token, tokens/s) go to stderr. Sampling is greedy unless --temperature is set;
with the same --seed the same completion comes back. While the swarm is busy the request waits its turn in
the daemon's queue (stderr says how many are ahead); when that queue is full the command says so in one line
and exits with status 75 (try again later).

examples:
  swarmd submit-prompt "The capital of France is"
  swarmd submit-prompt --chat "Give me three reasons to learn Python." --max-tokens 100
  swarmd submit-prompt --temperature 0.7 --top-p 0.9 --seed 1 --json "Once upon a time"
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit-prompt", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="text to continue as it is (no chat template)")
    p.add_argument("--chat", metavar="TEXT", help="send TEXT as the user's message through the model's chat "
                                                  "template, and answer it as the assistant; instead of PROMPT")
    p.add_argument("--max-tokens", "-n", type=int, default=128, metavar="N",
                   help="stop after N generated tokens (default: 128)")
    p.add_argument("--temperature", "-t", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 picks the most likely token every step (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the most likely tokens whose probabilities add up to P (default: 1)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep only the K most likely tokens (default: all)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random per request)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the completion where TEXT appears (not printed); may be repeated")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, finish reason, usage, timings) instead of the text")
    p.add_argument("--trace", type=Path, metavar="FILE",
                   help="write the request's spans as Chrome trace-event JSON (open it in Perfetto)")
    p.add_argument("--wait", type=float, metavar="SECONDS",
                   help="how long to wait for the swarm to be ready (default: the daemon's, 120 s)")
    p.add_argument("--speculate", metavar="MODE",
                   help="speculative decoding for this request: off, ngram or model:NAME (default: the daemon's "
                        "--speculate)")
    p.add_argument("--draft-tokens", type=int, metavar="K",
                   help="the most tokens drafted per pass (at most the daemon's --draft-tokens)")
    p.add_argument("--api", metavar="HOST:PORT|URL", help="the daemon's API address (default: from $SWARMD_HOME/api)")
    p.add_argument("--home", type=Path, help="the daemon's state directory (default: $SWARMD_HOME or ~/.swarmd)")
    add_token_option(p)
    p.set_defaults(func=run)


class SwarmBusy(UserError):
    """The daemon's queue is full (HTTP 429): nothing is wrong, try again later."""

    exit_code = 75  # EX_TEMPFAIL


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def request_body(args: argparse.Namespace) -> dict[str, Any]:
    if (args.prompt is None) == (args.chat is None):
        raise UserError("give either a PROMPT to continue or --chat TEXT, exactly one of them")
    if args.max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise UserError("--temperature must be >= 0, --top-p in (0, 1] and --top-k >= 0")
    if args.seed is not None and not 0 <= args.seed < 1 << 63:
        raise UserError("--seed must be between 0 and 2**63 - 1")
    if any(not s for s in args.stop):
        raise UserError("--stop strings must not be empty")
    body: dict[str, Any] = {"chat": args.chat} if args.chat is not None else {"prompt": args.prompt}
    body.update(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                stop=args.stop, trace=args.trace is not None)
    if args.seed is not None:
        body["seed"] = args.seed
    if args.wait is not None:
        body["wait"] = args.wait
    speculate = {k: v for k, v in (("mode", args.speculate), ("draft_tokens", args.draft_tokens)) if v is not None}
    if speculate:
        body["speculate"] = speculate
    return body


def run(args: argparse.Namespace) -> int:
    import httpx

    from swarmd.cli.status import daemon_url
    from swarmd.observe.chrome_trace import Tracer, write_trace

    body = request_body(args)
    url = daemon_url(args.api, args.home)
    out = sys.stdout
    tracer = Tracer("submit-prompt", pid=0) if args.trace else None
    started = time.perf_counter()
    result: dict[str, Any] = {"text": "", "token_ids": []}
    wrote = False
    try:
        with httpx.stream("POST", f"{url}/api/v0/generate", json=body,
                          timeout=httpx.Timeout(10.0, read=None), headers=auth_headers(args.api_token)) as response:
            check_authorised(response, url, args.api_token)
            if response.status_code == 429:
                raise SwarmBusy(_busy(response))
            if response.status_code != 200:
                raise UserError(_http_error(response))
            for line in response.iter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = event.get("event")
                if kind == "waiting":
                    _say(f"waiting for the swarm: {event['detail']}")
                elif kind == "start":
                    result.update(request_id=event["request_id"], seed=event["seed"])
                elif kind == "token":
                    result["token_ids"].append(event["id"])
                    result["text"] += event["text"]
                    if not args.json and event["text"]:
                        out.write(event["text"])
                        out.flush()
                        wrote = True
                elif kind == "done":
                    result["text"] += event["text"]
                    if not args.json and event["text"]:
                        out.write(event["text"])
                        out.flush()
                        wrote = True
                    result.update(finish_reason=event["finish_reason"], usage=event["usage"],
                                  timings=event["timings"])
                    if "speculation" in event:
                        result["speculation"] = event["speculation"]
                    if tracer is not None:
                        tracer.complete("submit_prompt", started * 1e6, tracer.now_us(), thread="client")
                        write_trace(args.trace, tracer.events + event.get("trace", []))
                elif kind == "error":
                    if wrote:
                        out.write("\n")
                    if event.get("code") == "queue_full":
                        raise SwarmBusy(event["message"])
                    raise UserError(f"the swarm could not finish the request: {event['message']} ({event['code']})")
    except httpx.HTTPError as e:
        raise UserError(f"no answer from the daemon at {url} ({type(e).__name__}: {e}): is `swarmd join` "
                        "running?") from None
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly; the daemon cancels the request
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0
    if "finish_reason" not in result:
        raise UserError("the daemon ended the stream before the request finished")
    if args.json:
        print(json.dumps(result, indent=2), flush=True)
    _say(("\n" if wrote and out.isatty() else "") + summary(result))
    return 0


def summary(result: dict[str, Any]) -> str:
    """The stderr line: tokens, time to first token, decode tokens/s, why it ended."""
    usage, t = result["usage"], result["timings"]
    parts = [f"{usage['prompt_tokens']} prompt tokens", f"{usage['completion_tokens']} tokens"]
    if t.get("time_to_first_token_s") is not None:
        parts.append(f"time to first token {t['time_to_first_token_s']:.2f} s")
    if t.get("decode_tokens_per_s"):
        parts.append(f"decode {t['decode_tokens_per_s']:.1f} tok/s")
    spec = result.get("speculation")
    if spec and spec.get("passes"):
        parts.append(f"speculation {spec['mode']}: {spec['accepted']}/{spec['drafted']} drafted tokens accepted, "
                     f"{spec['tokens_per_pass']:.2f} tokens a pass")
    parts.append(f"finish: {result['finish_reason']}")
    return "; ".join(parts)


def _busy(response: Any) -> str:
    """The 429's message (it says how long to wait), else one made from its Retry-After header."""
    response.read()
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        wait = response.headers.get("retry-after", "a few")
        return f"the swarm is busy: the daemon's queue is full; retry in {wait} s"


def _http_error(response: Any) -> str:
    response.read()
    try:
        err = response.json()["error"]
        return f"the daemon refused the request: {err['message']}"
    except (ValueError, KeyError, TypeError):
        return f"the daemon answered {response.status_code}: {response.text.strip()[:200]}"
