"""Acceptance: speculative decoding through 4 real `swarmd join` processes serving smollm2-moe-8x2.

One swarm serves every test of the module: daemon 0 heads its requests with `--speculate ngram`, daemon 1 with
`--speculate model:smollm2-135m` (the dense model drafting for its MoE split), daemons 2 and 3 without speculation;
the planner spreads the experts over the four daemons.
Each prompt's greedy tokens through the speculating heads are exactly those through a head that does not
speculate, and those of the model run whole in this process (`models.generate`, the loop behind `swarmd run`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.moe.moe_swarm import MoESwarm
from tests.swarm.daemons import http

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(1500)]

MODEL = "smollm2-moe-8x2"
DRAFT = "smollm2-135m"
CONTEXT = 256
N_TOKENS = 16
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "# The same two functions, each with a docstring:\n\ndef add(a, b):\n")
PROMPTS = ("import numpy as np\n\ndef softmax(x):\n", "The three primary colors are", "1, 2, 3, 5, 8, 13,", CODE)
CHAT = "What is the difference between a list and a tuple in Python?"
DRAFTED = (PROMPTS[2], CODE)  # through the draft model (each of its passes runs a second model): fewer prompts
FIXED_K = {"adaptive": False}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy tokens of the whole model in this process (computed before any daemon starts: its compile would
    starve them)."""
    from models.catalog.names import resolve_model
    from models.config import config_from_header
    from models.generate import generate
    from models.gguf.header import read_header
    from models.sampling import SamplingParams
    from models.stage import StageModel, serving_numerics
    from models.text.chat import ChatTemplate
    from models.text.tokenizer import Tokenizer

    path = resolve_model(MODEL).path
    tok = Tokenizer.from_gguf(path)
    model = StageModel.from_gguf(path, max_context=CONTEXT, max_requests=1,
                                 numerics=serving_numerics(config_from_header(read_header(path))))
    texts = {p: p for p in PROMPTS} | {CHAT: ChatTemplate.for_tokenizer(tok).render([{"role": "user",
                                                                                      "content": CHAT}])}
    out = {}
    for key, text in texts.items():
        gen = generate(model, tok, tok.encode(text), SamplingParams(max_tokens=N_TOKENS))
        for _ in gen:
            pass
        out[key] = gen.token_ids
    return out


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, bench_file, reference):
    swarm = MoESwarm(tmp_path_factory.mktemp("spec"), bench_file, 4, MODEL, max_context=CONTEXT)  # experts spread
    for d in swarm.daemons:
        d.extra += ("--timings", "local-test")
    swarm.daemons[0].extra += ("--speculate", "ngram", "--draft-tokens", "6")
    swarm.daemons[1].extra += ("--speculate", f"model:{DRAFT}", "--draft-tokens", "4")
    try:
        yield swarm.start(timeout=900)
    finally:
        swarm.stop()


def test_speculating_heads_answer_with_exactly_the_tokens_of_heads_that_do_not(swarm, reference):
    swarm.wait_chain(4)
    # all at once, so that the stages batch the requests' steps and verify passes: k fixed at the head's draft
    # tokens (how much is drafted does not follow the machine's load)
    asked = [(2, "prompt", PROMPTS[0], None), *((0, "prompt", p, FIXED_K) for p in PROMPTS),
             *((1, "prompt", p, FIXED_K) for p in DRAFTED), (3, "chat", CHAT, None),
             *((via, "chat", CHAT, FIXED_K) for via in (0, 1))]

    def ask(via: int, kind: str, text: str, speculate: dict | None) -> tuple[list[int], dict]:
        return swarm.generate(via=via, max_tokens=N_TOKENS, **{kind: text}, **({"speculate": speculate} if speculate
                                                                                 else {}))

    with ThreadPoolExecutor(len(asked)) as pool:
        answers = list(pool.map(lambda a: ask(*a), asked))
    for (via, _kind, text, speculate), (tokens, end) in zip(asked, answers, strict=True):
        assert end["event"] == "done", f"{via} {text!r}: {end}\n{swarm.logs()}"
        assert tokens == reference[text], (via, text)  # speculating or not, the whole model's tokens
        if speculate is None:
            assert "speculation" not in end, end
        elif text != CHAT:
            assert end["speculation"]["passes"] >= 1
    spec = [swarm.running[i].status()["speculation"] for i in (0, 1)]
    assert spec[0]["mode"] == "ngram" and spec[1]["mode"] == f"model:{DRAFT}"
    assert all(s["accepted"] > 0 and s["tokens_per_pass"] > 1 for s in spec), spec
    metrics = http.get(f"{swarm.running[1].api}/metrics", timeout=10).text
    for name in ("swarmd_spec_drafted_tokens_total", "swarmd_spec_accepted_tokens_total",
                 "swarmd_spec_verify_passes_total", "swarmd_spec_draft_seconds_total",
                 "swarmd_spec_accepted_length_bucket"):
        assert name in metrics
    shown = subprocess.run([sys.executable, "-m", "swarmd", "status", "--api", swarm.running[0].api],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "speculation" in shown.stdout and "accepted" in shown.stdout, shown.stderr


def test_a_traced_speculative_request_shows_its_drafts_and_verify_passes(swarm, reference):
    swarm.wait_chain(4)
    with http.stream("POST", f"{swarm.running[0].api}/api/v0/generate", timeout=httpx.Timeout(30, read=600),
                      json={"prompt": CODE, "max_tokens": N_TOKENS, "trace": True}) as r:
        events = [json.loads(line) for line in r.iter_lines()]
    done = events[-1]
    assert done["event"] == "done" and [e["id"] for e in events if e["event"] == "token"] == reference[CODE]
    names = {e["name"] for e in done["trace"]}
    assert {"spec.draft", "spec.verify", "head.prefill"} <= names


def test_a_request_chooses_its_own_speculation_and_bad_choices_are_a_clear_400(swarm, reference):
    swarm.wait_chain(4)
    api = swarm.running[0].api
    tokens, end = swarm.generate(via=1, prompt=PROMPTS[0], max_tokens=N_TOKENS,
                                 speculate={"mode": "ngram", "draft_tokens": 2})
    assert tokens == reference[PROMPTS[0]] and end["speculation"]["mode"] == "ngram"
    tokens, end = swarm.generate(via=0, prompt=PROMPTS[0], max_tokens=N_TOKENS, speculate={"mode": "off"})
    assert tokens == reference[PROMPTS[0]] and "speculation" not in end
    cases = [
        ("/api/v0/generate", {"prompt": "Hi", "speculate": {"mode": "ngram", "draft_tokens": 7}}, "1 to 6"),
        ("/api/v0/generate", {"prompt": "Hi", "speculate": {"draft_tokens": 0}}, "at least 1"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "speculate": {"mode": "trigram"}},
         "unknown speculation mode"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                  "speculate": {"mode": "model:no-such-model"}}, "no-such-model"),
    ]
    for path, body, words in cases:
        r = http.post(f"{api}{path}", json=body, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (path, body, r.text)
    assert all(d.proc.poll() is None for d in swarm.running)
