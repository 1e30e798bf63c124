"""The quick tier's one real-process test: two `swarmd join` daemons form a swarm and answer a prompt through
`swarmd submit-prompt`, as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from swarmd.daemon.descriptor import BENCH_FILE
from tests.swarm.daemons import Daemon, stop_all, wait_until
from tests.swarm.tiny_model import write_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.smoke]


def test_two_daemons_form_a_swarm_and_answer_a_prompt(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf", n_blocks=4, vocab=300, byte_tokenizer=True, scale=0.5)
    timings = ("--timings", "local-test")
    a = Daemon(tmp_path / "a", model, extra=timings)
    b: Daemon | None = None
    try:
        a.start().wait_ready(60)
        # b is the same machine: it takes a's device benchmark rather than measuring while a loads (on a busy
        # CPU that measure can come out slow enough that the planner leaves b without blocks)
        b = Daemon(tmp_path / "b", model, extra=timings, bench_file=a.home / BENCH_FILE)
        b.start(bootstrap=(a.addresses[0],)).wait_ready(60)
        wait_until(lambda: len(a.status()["plan"]["stages"]) == 2 if a.status()["plan"] else False, 60,
                   "a plan over both daemons")
        env = {**os.environ, "SWARMD_HOME": str(b.home)}
        done = subprocess.run([sys.executable, "-m", "swarmd", "submit-prompt", "--max-tokens", "5", "hello"],
                              capture_output=True, text=True, env=env, timeout=180)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip(), "the swarm answered nothing"
    finally:
        assert all(code == 0 for code in stop_all([d for d in (a, b) if d is not None], timeout=15))
