"""Acceptance: a traced request over three real `swarmd join` processes on loopback (a seeded SmolLM2-135M,
one stage each, the head on the middle one): the daemons generate what one process generates, the Chrome trace has every node's spans on one time axis with
flow arrows for the hops, `swarmd trace summarize` reads it, the API serves it, and /metrics counts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.pipeline.daemon_swarm import DaemonSwarm
from tests.swarm.daemons import http

pytestmark = [pytest.mark.slow, pytest.mark.serial]

CONTEXT = 256
N_TOKENS = 8
MODEL = "random/smollm2-135m@3"
PROMPT = "Seeded weights, real shapes:"


@pytest.fixture(scope="module")
def one_process() -> list[int]:
    """The seeded model's greedy tokens for PROMPT with the whole model in this process (`swarmd run`'s loop)."""
    from models.catalog.seeded import parse_seeded_name
    from models.generate import generate
    from models.sampling import SamplingParams
    from models.stage import StageModel
    from models.text.tokenizer import Tokenizer

    seeded = parse_seeded_name(MODEL)
    tokenizer = Tokenizer(seeded.tokenizer_kv())
    whole = StageModel.random(seeded.config(CONTEXT), seeded.seed, max_context=CONTEXT, max_requests=1)
    run = generate(whole, tokenizer, tokenizer.encode(PROMPT), SamplingParams(max_tokens=N_TOKENS))
    for _ in run:
        pass
    return run.token_ids


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, bench_file, one_process):  # the reference first: its compile would starve the daemons
    swarm = DaemonSwarm(tmp_path_factory.mktemp("trace"), bench_file, 3, model=MODEL,
                        extra=("--max-context", str(CONTEXT)))
    try:
        yield swarm.start()
    finally:
        swarm.stop()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarmd", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)


def test_three_daemons_serve_the_seeded_model_token_for_token_as_one_process(swarm, one_process):
    tokens, end = swarm.generate(via=2, prompt=PROMPT, max_tokens=N_TOKENS)
    assert end["event"] == "done", f"{end}\n{swarm.logs()}"
    assert tokens == one_process
    assert swarm.running[0].status()["plan"]["model"]["name"] == MODEL


def test_a_traced_request_shows_every_node_and_hop_on_one_time_axis(swarm, tmp_path):
    head = swarm.running[1]
    out = tmp_path / "out.json"
    done = cli("submit-prompt", "--api", head.api, "-n", str(N_TOKENS), "--json", "--trace", str(out), "Hello")
    assert done.returncode == 0, done.stderr + swarm.logs()
    request_id = json.loads(done.stdout)["request_id"]
    events = json.loads(out.read_text())["traceEvents"]

    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    for hop, peer in enumerate(swarm.peers):  # one pid per node, named with its role and peer id
        (name,) = [n for n in names.values() if n.endswith(peer)]
        assert f"stage {hop}" in name and (("head" in name) == (hop == 1))
    spans = [e for e in events if e["ph"] == "X"]
    pid_of = {peer: pid for pid, n in names.items() for peer in swarm.peers if n.endswith(peer)}
    for hop, peer in enumerate(swarm.peers):
        steps = sorted(e["args"]["step"] for e in spans if e["name"] == "stage.forward" and e["pid"] == pid_of[peer])
        assert steps == list(range(N_TOKENS)), f"stage {hop} ran every step once"
    assert {"tokenize", "head.wait_for_chain", "head.prefill", "head.decode", "head.detokenize", "hop.serialise",
            "hop.send", "hop.deserialise", "hop.admit", "stage.queue", "stage.handover", "stage.sample",
            "stage.output", "submit_prompt"} <= {e["name"] for e in spans}
    assert all(e["dur"] >= 0 for e in spans)

    # Flow arrows: each starts at a hop.send and ends at the hop.deserialise of the same message, later on
    # the (offset-corrected) common clock; every hop of the chain, the token back to stage 0 and to the head.
    flows = defaultdict(dict)
    for e in events:
        if e["ph"] in ("s", "f"):
            flows[e["id"]][e["ph"]] = e
    assert len(flows) >= 4 * N_TOKENS
    for ends in flows.values():
        assert set(ends) == {"s", "f"} and ends["s"]["pid"] != ends["f"]["pid"]
        assert ends["f"]["ts"] >= ends["s"]["ts"] - 1000, "the receiver decodes after the sender wrote (±1 ms)"
    sends = [e for e in spans if e["name"] == "hop.send"]
    assert all(e["args"]["bytes"] > 0 and e["args"]["acked"] for e in sends)
    forward_bytes = [e["args"]["bytes"] for e in sends if e["args"]["msg"] == "forward" and e["args"]["step"] > 0]
    assert min(forward_bytes) > 576 * 4, "a decode step's hidden state travels in float32"

    # The summary: per stage and per hop, prefill and decode medians.
    summary = cli("trace", "summarize", str(out))
    assert summary.returncode == 0, summary.stderr
    for text in ("stage.forward", "stage 0 -> stage 1 (forward)", "stage 2 -> stage 0 (token)", "hop.wire",
                 "time between tokens"):
        assert text in summary.stdout
    rows = json.loads(cli("trace", "summarize", "--json", str(out)).stdout)["rows"]
    forward = [r for r in rows if r["phase"] == "stage.forward"]
    assert len(forward) == 3 and all(r["steps"] == N_TOKENS - 1 and r["median_ms"] > 0 for r in forward)

    # The API: the head keeps the merged trace; a stage serves its own spans; nothing for unknown ids.
    merged = http.get(f"{head.api}/api/v0/trace/{request_id}", timeout=10).json()["traceEvents"]
    assert len([e for e in merged if e["ph"] == "X"]) == len(spans) - 1  # all but the client's own span
    own = http.get(f"{swarm.running[2].api}/api/v0/trace/{request_id}", timeout=10).json()["traceEvents"]
    assert {e["name"] for e in own if e["ph"] == "X"} >= {"stage.forward", "hop.send"}
    assert http.get(f"{head.api}/api/v0/trace/req-unknown", timeout=10).status_code == 404


def test_untraced_requests_leave_no_spans_and_metrics_count_every_request(swarm):
    head = swarm.running[1]
    before = http.get(f"{head.api}/metrics", timeout=10).text
    _, end = swarm.generate(via=1, prompt="Hi", max_tokens=4)
    assert end["event"] == "done" and "trace" not in end
    rid = None
    for line in http.get(f"{head.api}/api/v0/pipeline", timeout=10).json()["stage"]["recent_steps"]:
        rid = line["request_id"]
    for d in swarm.running:
        assert http.get(f"{d.api}/api/v0/trace/{rid}", timeout=10).status_code == 404
    after = http.get(f"{head.api}/metrics", timeout=10).text
    assert metric(after, "swarmd_tokens_total") == metric(before, "swarmd_tokens_total") + 4
    assert metric(after, 'swarmd_requests_total{outcome="finished"}') >= 2
    assert metric(after, "swarmd_time_to_first_token_seconds_count") >= 2
    assert metric(after, 'swarmd_hop_latency_seconds_count{msg="forward"}') >= 4
    assert metric(after, 'swarmd_wire_bytes_total{direction="sent",msg="forward"}') > 4 * 576 * 4
    assert metric(after, 'swarmd_wire_bytes_total{direction="received",msg="forward"}') > 4 * 576 * 4
    assert metric(after, "swarmd_kv_cache_bytes") > 0
    assert metric(after, 'swarmd_kv_cache_slots{state="used"}') == 0  # every request freed its slot
    assert 'swarmd_transport_frames_total{event="resent"}' in after


def test_probes_find_the_daemons_of_one_machine_on_one_clock(swarm):
    """Daemons of one machine share perf_counter: every offset the probes estimate is zero within its error."""
    head = swarm.running[1]
    offsets = swarm.pipeline(1)["clock_offsets"]
    assert set(offsets) == {d.peer_id for d in swarm.running if d is not head}
    for o in offsets.values():
        assert abs(o["offset_ms"]) <= o["error_ms"] + 0.05


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in the metrics")
