"""Acceptance: `kimi-k2-mini` (Kimi-K2's architecture at CPU scale) served by 4 real `swarmd join` processes,
the blocks split into stages and the 384 routed experts of each MoE block spread over the daemons, gives
exactly the text `swarmd run --model kimi-k2-mini` prints: one arithmetic (llama.cpp's, on the Q4_0 blocks)
in stages, expert shards and the single process, and each row's expert outputs summed in the order of its
selections wherever the experts live."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.moe.moe_swarm import MoESwarm

pytestmark = [pytest.mark.slow, pytest.mark.serial]

MODEL = "kimi-k2-mini"
N_TOKENS = 10
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory) -> Path:
    from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

    home = tmp_path_factory.mktemp("bench")
    device = resolve_device("auto")
    load_or_measure(home, device, device_name(device))
    return home / BENCH_FILE


@pytest.fixture(scope="module")
def mini() -> Path:
    """Written into the model cache once, before any daemon asks for it."""
    from models.catalog.names import resolve_model

    return resolve_model(MODEL).path


def swarmd_run(prompt: str) -> str:
    done = subprocess.run([sys.executable, "-m", "swarmd", "run", "--model", MODEL, "--max-tokens", str(N_TOKENS),
                           "--max-context", "256", prompt], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.timeout(1500)
def test_kimi_k2_mini_on_four_daemons_gives_swarmd_runs_tokens(tmp_path_factory, bench_file, mini):
    from models.text.tokenizer import Tokenizer

    # swarmd run on a CPU runs the experts inside its graph; the swarm cuts its stages' graphs after each router
    # and asks the holders: one arithmetic all the same, so the very text
    want = swarmd_run(PROMPT)
    swarm = MoESwarm(tmp_path_factory.mktemp("swarm"), bench_file, 4, MODEL)
    assert len(swarm.plan.stages) >= 2 and len(swarm.expert_nodes()) >= 3
    try:
        swarm.start(timeout=900)
        tokens, end = swarm.generate(via=1, prompt=PROMPT, max_tokens=N_TOKENS)
        assert end["event"] == "done", f"{end}\n{swarm.logs()}"
        assert want and Tokenizer.from_gguf(mini).decode(tokens) == want
        status = swarm.running[0].status()
        assert "experts 1152/1152 placed" in status["coverage"]  # 3 MoE blocks of 384 experts
        calls = sum(layer["calls"] for d in swarm.running for layer in d.status()["moe"]["routed"].values())
        messages = sum(layer["messages"] for d in swarm.running for layer in d.status()["moe"]["routed"].values())
        assert calls >= 3 * N_TOKENS and messages > 0  # experts were asked of other daemons
    finally:
        swarm.stop()
