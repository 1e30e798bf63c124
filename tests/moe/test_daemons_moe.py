"""Acceptance: MoE models served by 4 real `swarmd join` processes on loopback, experts spread over them.

Each stage runs its blocks up to each MoE router, sends one batch per node holding selected experts,
and continues with their gated sum; the output must be the single-process MoE's (and, for
SmolLM2-MoE with top-8 of 8, dense SmolLM2's). A node holding only experts, killed under a request, costs
the request nothing but time: its replicated experts are asked of the replica, the others wait for the
leader's plan that re-places them on survivors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.plan import Plan
from tests.moe.moe_swarm import ExpertNodeSwarm, MoESwarm, write_tiny_moe
from tests.swarm.daemons import http

pytestmark = [pytest.mark.slow, pytest.mark.serial]

N_TOKENS = 8
PROMPTS = ("The capital of France is", "def fibonacci(n):")


def reference(path, max_context: int, prompts=PROMPTS) -> dict[str, list[int]]:
    """Greedy tokens of the whole model in this process (`models.generate`, the loop of `swarmd run`)."""
    from models.generate import generate
    from models.sampling import SamplingParams
    from models.stage import StageModel
    from models.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    model = StageModel.from_gguf(path, max_context=max_context, max_requests=1)
    out = {}
    for text in prompts:
        gen = generate(model, tok, tok.encode(text), SamplingParams(max_tokens=N_TOKENS))
        for _ in gen:
            pass
        out[text] = gen.token_ids
    return out


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory) -> Path:
    """A device benchmark measured once, copied into every daemon's home (as the pipeline tests do)."""
    from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

    home = tmp_path_factory.mktemp("bench")
    device = resolve_device("auto")
    load_or_measure(home, device, device_name(device))
    return home / BENCH_FILE


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory, smollm2_gguf):
    """A 4-block synthetic MoE (8 experts, top-2, sigmoid scores with a selection bias, a shared expert,
    one leading dense block) with SmolLM2's tokenizer."""
    return write_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf")


def check_greedy(swarm: MoESwarm, want: dict[str, list[int]]) -> None:
    for i, prompt in enumerate(want):
        tokens, end = swarm.generate(via=i % len(swarm.running), prompt=prompt, max_tokens=N_TOKENS)
        assert end["event"] == "done", f"{end}\n{swarm.logs()}"
        assert tokens == want[prompt], f"prompt {prompt!r}"


@pytest.mark.timeout(600)
def test_a_moe_model_on_four_daemons_equals_the_single_process_moe(tmp_path_factory, bench_file, tiny_moe):
    want = reference(tiny_moe, 256)
    swarm = MoESwarm(tmp_path_factory.mktemp("swarm"), bench_file, 4, str(tiny_moe))
    assert len(swarm.expert_nodes()) >= 3
    try:
        swarm.start()
        check_greedy(swarm, want)

        status = swarm.running[0].status()
        assert "experts 24/24 placed" in status["coverage"]  # 3 MoE blocks of 8 experts
        assert status["plan"]["experts"] == json.loads(swarm.plan.dumps())["experts"]
        routed = {}
        for d in swarm.running:
            for block, layer in d.status()["moe"]["routed"].items():
                routed[block] = layer
                # at most one message per node hit per step, never one per token per expert; what the stage's
                # own daemon holds is computed there, without a message
                assert layer["messages"] + layer["local"] <= round(layer["nodes_per_call"] * layer["calls"])
                assert layer["nodes_per_call"] <= 2  # top-2: at most two nodes per layer and step
        assert sorted(routed) == ["1", "2", "3"]
        assert sum(routed["2"]["tokens"].values()) == 2 * routed["2"]["rows"]  # every row went to 2 experts
        # /metrics carries the same expert load, summed over the daemons whose routers sent it
        metered = 0.0
        for d in swarm.running:
            for line in http.get(f"{d.api}/metrics", timeout=10).text.splitlines():
                if line.startswith('swarmd_expert_tokens_total{block="2"'):
                    metered += float(line.rsplit(" ", 1)[1])
        assert metered == 2 * routed["2"]["rows"]

        text = subprocess.run([sys.executable, "-m", "swarmd", "status", "--api", swarm.running[0].api],
                              capture_output=True, text=True, timeout=60)
        assert text.returncode == 0, text.stderr
        assert "experts 24/24 placed" in text.stdout and "tokens routed" in text.stdout
        as_json = json.loads(subprocess.run([sys.executable, "-m", "swarmd", "status", "--json", "--api",
                                             swarm.running[0].api], capture_output=True, text=True,
                                            timeout=60).stdout)
        assert as_json["plan"]["experts"]["1"]
        pipeline = http.get(f"{swarm.running[1].api}/api/v0/pipeline", timeout=10).json()
        assert pipeline["moe"]["expert"]["batches"] > 0 or pipeline["moe"]["router"]["layers"]
        moe = [http.get(f"{d.api}/api/v0/pipeline", timeout=10).json()["moe"] for d in swarm.running]
        served = [m["expert"] for m in moe if m["expert"]["batches"]]  # its recent batches' median compute
        assert served and all(e["compute_ms_median"] > 0 for e in served)
        hot = [m["router"]["hot_call_ms_median"] for m in moe if m["router"]["hot_call_ms_median"] is not None]
        assert hot and all(ms > 0 for ms in hot)  # remote parts of hot steps, batch out -> answer in

        check_moe_trace(swarm, want, tmp_path_factory.mktemp("trace") / "out.json")
    finally:
        swarm.stop()


def check_moe_trace(swarm: MoESwarm, want: dict[str, list[int]], out: Path) -> None:
    """A traced request's trace holds each MoE block's fan-out on its stage, every batch it sent, and each
    expert node's compute on that node, on one time axis; `swarmd trace summarize` lists them."""
    prompt = PROMPTS[0]
    tokens, end = swarm.generate(via=0, prompt=prompt, max_tokens=N_TOKENS, trace=True)
    assert end["event"] == "done" and tokens == want[prompt], f"{end}\n{swarm.logs()}"
    events = end["trace"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    peer_of = {pid: name.rsplit(" ", 1)[1] for pid, name in names.items()}
    spans = [e for e in events if e["ph"] == "X"]
    fan_outs = [e for e in spans if e["name"] == "moe.fan_out"]
    # a block whose experts the stage computes inside its own graph records no fan-out
    asked = {e["args"]["block"] for e in fan_outs}
    assert asked and asked <= {1, 2, 3}
    for block in sorted(asked):  # every MoE block asked of other daemons, every step (prefill and decode), once
        steps = sorted(e["args"]["step"] for e in fan_outs if e["args"]["block"] == block)
        assert steps == list(range(N_TOKENS)), f"block {block}"
    for e in fan_outs:  # one batch per node hit, none when the stage's own daemon answered it whole
        assert 1 <= e["args"]["messages"] <= len(swarm.expert_nodes()) or (e["args"]["messages"] == 0
                                                                        and e["args"]["local"])
    calls = [e for e in spans if e["name"] == "moe.call"]
    assert sum(e["args"]["messages"] for e in fan_outs) == len(calls)
    batches = {e["args"]["flow"]: e for e in spans if e["name"] == "expert.batch"}
    computes = [e for e in spans if e["name"] == "expert.forward"]
    assert len(computes) == len(batches) == len(calls)
    for call in calls:  # each batch was computed on the node it went to, inside the router's wait for it
        batch = batches[call["args"]["flow"]]
        assert peer_of[batch["pid"]] == call["args"]["to"] and batch["args"]["step"] == call["args"]["step"]
        assert call["ts"] - 1000 <= batch["ts"] and batch["ts"] + batch["dur"] <= call["ts"] + call["dur"] + 1000
    assert {peer_of[e["pid"]] for e in computes} <= swarm.expert_nodes()
    assert len({e["pid"] for e in computes}) >= 2  # experts spread: more than one node computed them

    out.write_text(json.dumps({"traceEvents": events}))
    summary = subprocess.run([sys.executable, "-m", "swarmd", "trace", "summarize", "--json", str(out)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    phases = {(r["where"], r["phase"]) for r in json.loads(summary.stdout)["rows"]}
    assert {where.rsplit(", ", 1)[1] for where, phase in phases if phase == "moe.fan_out"} == {
        f"block {b}" for b in asked}
    assert {"moe.fan_out", "moe.send", "moe.call", "expert.queue", "expert.forward"} <= {p for _, p in phases}


@pytest.mark.timeout(300)
def test_a_killed_expert_node_is_replaced_by_replicas_and_re_placed_experts_and_the_text_is_the_undisturbed_runs(
        tmp_path_factory, bench_file, tiny_moe):
    # block 2's experts on the expert node have a replica on a stage node; blocks 1 and 3's have none
    swarm = ExpertNodeSwarm(tmp_path_factory.mktemp("experts"), bench_file, 4, str(tiny_moe),
                            replicated=frozenset({2}))
    victim, n_tokens = swarm.peers[swarm.expert_node], 16
    try:
        swarm.start()
        undisturbed, end = swarm.stream(0, prompt=PROMPTS[0], max_tokens=n_tokens)
        assert end["event"] == "done" and [s for s, _ in undisturbed] == list(range(n_tokens)), end
        assert swarm.pipeline(swarm.expert_node)["moe"]["expert"]["batches"] > 0  # it served this prompt

        def kill(n: int) -> None:
            if n == 3:
                swarm.daemons[swarm.expert_node].kill9()

        pairs, end = swarm.stream(0, prompt=PROMPTS[0], max_tokens=n_tokens, on_token=kill)
        assert end["event"] == "done", f"{end}\n{swarm.logs()}"
        assert pairs == undisturbed  # the same text, no token repeated, none skipped
        assert not end.get("recoveries")  # the chain never changed: the request was not moved or replayed
        after = Plan.from_json(swarm.running[0].status()["plan"])
        assert victim not in after.peers() and after.stages == swarm.plan.stages
        for blk, by in swarm.plan.experts.items():
            for e, holders in by.items():
                survivors = tuple(p for p in holders if p != victim)
                if survivors:  # a replica survived: it serves the expert, nothing moved
                    assert after.experts[blk][e] == survivors, (blk, e)
                else:  # re-placed on a survivor, which loaded it
                    assert after.experts[blk][e] and victim not in after.experts[blk][e], (blk, e)
        moved = {(blk, e) for blk, by in swarm.plan.experts.items() for e, holders in by.items() if holders == (victim,)}
        served = set()  # re-placed experts that survivors computed for the rest of the request
        for i in range(len(swarm.running)):
            for blk, by in swarm.pipeline(i)["moe"]["expert"]["tokens"].items():
                served |= {(int(blk), int(e)) for e in by} & moved
        assert served, f"{moved}\n{swarm.logs()}"
    finally:
        swarm.stop()


@pytest.mark.timeout(1200)
def test_smollm2_moe_top8_on_four_daemons_equals_dense_smollm2(tmp_path_factory, bench_file, smollm2_gguf):
    from models.catalog.names import resolve_model

    want = reference(smollm2_gguf, 256, PROMPTS[:1])
    resolve_model("smollm2-moe-8x8")  # written into the model cache once, before the daemons look for it
    swarm = MoESwarm(tmp_path_factory.mktemp("swarm"), bench_file, 4, "smollm2-moe-8x8")
    assert len(swarm.expert_nodes()) >= 3
    try:
        swarm.start(timeout=600)
        check_greedy(swarm, want)
    finally:
        swarm.stop()
