"""Acceptance: SmolLM2 split over 4 real `swarmd join` processes on loopback, used as a user would.

One set of daemons serves every test of this module (a plan file splits the blocks evenly). Every output is
compared with the same model run whole in this process by `models.generate`, the loop behind `swarmd run` (the
reference), with the same context size. Other numbers of stages run as whole daemons in one process
(`test_pipeline_twin.py`) and in the fault simulation.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.pipeline.daemon_swarm import DaemonSwarm
from tests.swarm.daemons import Daemon, http, wait_until

# The module's swarm of 6 starts in the first test's setup: on a loaded machine that alone can take minutes.
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(900)]

CONTEXT = 256  # as the other 4-daemon SmolLM2 swarms: their graphs are these stages' graphs
N_TOKENS = 8
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")
CHAT = "Give me three reasons to learn Python."
MODEL = "smollm2-135m"


@dataclass
class Reference:
    tokenizer: object
    greedy: dict[str, list[int]]  # prompt text (as sent to the model) -> greedy completion tokens
    chat_text: str  # CHAT through the chat template
    forced_ids: list[int]  # a prompt and its greedy continuation
    forced_top1: list[int]  # argmax of the logits at every position of forced_ids but the last


@pytest.fixture(scope="module")
def ref(smollm2_gguf) -> Reference:
    from models.generate import generate
    from models.sampling import SamplingParams
    from models.stage import SERVING_NUMERICS, StageInput, StageModel
    from models.text.chat import ChatTemplate
    from models.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf)
    chat_text = ChatTemplate.for_tokenizer(tok).render([{"role": "user", "content": CHAT}])

    def compute() -> Reference:  # on this thread: no daemon runs yet
        model = StageModel.from_gguf(smollm2_gguf, max_context=CONTEXT, max_requests=1, numerics=SERVING_NUMERICS)
        greedy = {}
        for text in (*PROMPTS, chat_text):
            gen = generate(model, tok, tok.encode(text), SamplingParams(max_tokens=N_TOKENS))
            for _ in gen:
                pass
            greedy[text] = gen.token_ids
        forced = tok.encode(PROMPTS[0]) + greedy[PROMPTS[0]]
        model.add_request("forced")
        logits = model.forward([StageInput("forced", 0, np.asarray(forced, dtype=np.int32), all_logits=True)])[0]
        return Reference(tok, greedy, chat_text, forced, [int(i) for i in np.argmax(logits[:-1], axis=1)])

    return compute()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, bench_file, ref):  # the reference first: its compile would starve starting daemons
    swarm = DaemonSwarm(tmp_path_factory.mktemp("swarm"), bench_file, 4, extra=("--max-context", str(CONTEXT)))
    try:
        yield swarm.start()
    finally:
        swarm.stop()


def check_greedy(swarm: DaemonSwarm, ref: Reference, prompts: tuple[str, ...] = PROMPTS, chat: bool = True) -> None:
    """Each prompt, through a different daemon each time, gives the reference tokens."""
    for i, prompt in enumerate(prompts):
        tokens, end = swarm.generate(via=i % len(swarm.running), prompt=prompt, max_tokens=N_TOKENS)
        assert end["event"] == "done", f"{end}\n{swarm.logs()}"
        assert tokens == ref.greedy[prompt], f"{len(swarm.running)} daemons, prompt {prompt!r}"
    if chat:
        tokens, end = swarm.generate(via=len(swarm.running) - 1, chat=CHAT, max_tokens=N_TOKENS)
        assert tokens == ref.greedy[ref.chat_text] and end["event"] == "done"


def test_four_daemons_generate_token_for_token_what_swarmd_run_generates(swarm, ref):
    plan = swarm.wait_chain(4)
    bounds = [s["layers"] for s in plan["stages"]]
    assert bounds[0][0] == 0 and bounds[-1][1] == 30 and all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    check_greedy(swarm, ref)
    stage = swarm.pipeline(1)["stage"]  # every step went through every stage, batched or not
    assert stage["jobs"] >= 2 * N_TOKENS


def test_two_and_four_prompts_at_once_each_equal_their_single_request_output(swarm, ref):
    swarm.wait_chain(4)
    prompts = [*PROMPTS, PROMPTS[0]]
    for n in (2, 4):
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda ip: swarm.generate(via=ip[0], prompt=ip[1], max_tokens=N_TOKENS),
                                    enumerate(prompts[:n])))
        for prompt, (tokens, end) in zip(prompts, results, strict=False):
            assert end["event"] == "done" and tokens == ref.greedy[prompt], f"{n} at once: {prompt!r}"
    assert max(swarm.pipeline(i)["stage"]["largest_batch"] for i in range(4)) >= 2  # decode steps were batched


def swarmd_cli(*args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"SWARMD_HOME": str(home)} if home else {})}
    return subprocess.run([sys.executable, "-m", "swarmd", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_submit_prompt_streams_only_the_completion_to_stdout_and_a_summary_to_stderr(swarm, ref, tmp_path):
    swarm.wait_chain(4)
    daemon = swarm.running[2]
    done = swarmd_cli("submit-prompt", "--max-tokens", str(N_TOKENS), PROMPTS[1], home=daemon.home)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ref.tokenizer.decode(ref.greedy[PROMPTS[1]])
    assert f"{N_TOKENS} tokens" in done.stderr and "time to first token" in done.stderr and "tok/s" in done.stderr
    trace = tmp_path / "trace.json"
    done = swarmd_cli("submit-prompt", "--api", daemon.api, "--chat", CHAT, "-n", str(N_TOKENS), "--json",
                      "--trace", str(trace))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["token_ids"] == ref.greedy[ref.chat_text] and doc["finish_reason"] in ("stop", "length")
    assert doc["usage"]["prompt_tokens"] == len(ref.tokenizer.encode(ref.chat_text))
    events = json.loads(trace.read_text())["traceEvents"]
    assert {"submit_prompt", "head.wait_for_chain", "head.prefill", "head.decode", "token"} <= \
        {e["name"] for e in events}
    empty = swarmd_cli("submit-prompt", "", "--api", daemon.api)
    assert empty.returncode != 0 and "prompt is empty" in empty.stderr and "Traceback" not in empty.stderr


def test_the_official_openai_client_works_against_any_daemon(swarm, ref):
    from openai import OpenAI

    swarm.wait_chain(4)
    client = OpenAI(base_url=f"{swarm.running[3].api}/v1", api_key="not-needed")
    assert [m.id for m in client.models.list()] == [MODEL]
    want_chat = ref.tokenizer.decode(ref.greedy[ref.chat_text])
    messages = [{"role": "user", "content": CHAT}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N_TOKENS, temperature=0)
    assert chat.choices[0].message.content == want_chat and chat.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_chat
    want = ref.tokenizer.decode(ref.greedy[PROMPTS[0]])
    done = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0)
    assert done.choices[0].text == want and done.choices[0].finish_reason == "length"
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == want


def test_teacher_forcing_through_completions_reproduces_the_top_1_of_swarmd_run_at_every_position(swarm, ref):
    from openai import OpenAI

    swarm.wait_chain(4)
    client = OpenAI(base_url=f"{swarm.running[1].api}/v1", api_key="not-needed")
    scored = client.completions.create(model=MODEL, prompt=ref.forced_ids, max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    tok = ref.tokenizer
    assert lp.tokens == [tok.decode([i], skip_special=False) for i in ref.forced_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    top1 = [next(iter(top)) for top in lp.top_logprobs[1:]]
    assert top1 == [tok.decode([i], skip_special=False) for i in ref.forced_top1]
    n_prompt = len(tok.encode(PROMPTS[0]))  # in the greedy continuation, each top-1 is the next token itself
    assert top1[n_prompt - 1:] == lp.tokens[n_prompt:]
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and scored.usage.completion_tokens == 0


def test_bad_requests_get_a_clear_error_and_no_daemon_dies(swarm, ref):
    swarm.wait_chain(4)
    api = swarm.running[2].api
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt is empty"),
        ("/v1/completions", {"model": MODEL, "prompt": "word " * (CONTEXT + 10)}, 400, f"context holds {CONTEXT}"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "Hi"}, 404, "does not exist"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "Hi"}, 400, "'messages' must be"),
        ("/v1/completions", {"model": MODEL, "prompt": [99999999]}, 400, "outside the vocabulary"),
        ("/api/v0/generate", {"prompt": ""}, 400, "prompt is empty"),
    ]
    for path, body, status, words in cases:
        r = http.post(f"{api}{path}", json=body, timeout=30)
        assert r.status_code == status and words in r.json()["error"]["message"], (path, body, r.text)
    r = http.post(f"{api}/v1/chat/completions", content=b'{"model": "smollm2-135m", "messages": [', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert all(d.proc.poll() is None for d in swarm.running)
    tokens, end = swarm.generate(via=2, prompt=PROMPTS[0], max_tokens=4)
    assert tokens == ref.greedy[PROMPTS[0]][:4] and end["event"] == "done"


async def test_bad_frames_on_the_actor_protocol_get_clear_errors_and_no_daemon_dies(swarm, ref):
    from tests.pipeline.raw_frames import bad_frame_replies

    plan = swarm.wait_chain(4)
    stage1 = plan["stages"][1]["peer_id"]  # takes hidden states of width 576 for hop 1
    target = next(d for d in swarm.running if d.peer_id == stage1)
    replies = await bad_frame_replies(target.addresses[0], target.peer_id)
    assert replies == {"not_cbor": "not_cbor", "unknown_type": "unknown_type", "wrong_width": "bad_shape",
                       "wrong_dtype": "bad_dtype", "oversized": "frame_too_large"}
    assert all(d.proc.poll() is None for d in swarm.running)
    assert swarm.pipeline(0)["chain"]["ready"]


def test_a_client_that_goes_away_cancels_its_request_and_every_stage_frees_its_cache(swarm):
    swarm.wait_chain(4)
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "stream": True}
    chunks = 0
    with http.stream("POST", f"{swarm.running[0].api}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:
                break  # and hang up
    cancelled = swarm.pipeline(0)["head"]["cancelled"]

    def freed() -> bool:
        return swarm.pipeline(0)["head"]["cancelled"] >= 1 and \
            all(swarm.pipeline(i)["stage"]["requests"] == 0 for i in range(4))

    wait_until(freed, 60, "the request to be cancelled at every stage")
    assert cancelled <= 1


def test_a_prompt_sent_before_the_swarm_is_ready_waits_and_says_so_on_stderr(tmp_path, bench_file):
    daemon = Daemon(tmp_path / "early", None, bench_file=bench_file, swarm="early").start().wait_ready(60)
    try:
        done = swarmd_cli("submit-prompt", "--api", daemon.api, "--wait", "1", "Hello")
    finally:
        daemon.stop()
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.startswith("waiting for the swarm: ")
    assert "not ready after 1 s" in done.stderr and "Traceback" not in done.stderr
