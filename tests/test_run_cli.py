"""`swarmd run`, `pull` and `models` as a user runs them: real subprocesses, the real model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_vocab import write_vocab_gguf

REFERENCE = Path(__file__).parent / "data" / "llamacpp-reference-smollm2.json"
CASES = json.loads(REFERENCE.read_text())["cases"]


def swarmd(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarmd", *args], capture_output=True, text=True, timeout=timeout)


# The completion is compared with llama.cpp's greedy tokens up to its first near-tie (`firm_text`):
# "The capital of France is" (which float arithmetic leaves at a 0.33 gap) and a chat prompt.
@pytest.mark.slow
def test_run_prints_llamacpps_greedy_completion(smollm2_gguf):
    case = next(c for c in CASES if c["prompt"] == "The capital of France is")
    done = swarmd("run", case["prompt"], "--max-tokens", str(len(case["firm_ids"])))
    assert done.returncode == 0, done.stderr
    assert done.stdout == case["firm_text"]


@pytest.mark.slow
def test_run_chat_prints_only_the_completion_on_stdout(smollm2_gguf):
    chat = next(c for c in CASES if c["kind"] == "chat" and "three good reasons" in c["user"])
    done = swarmd("run", "--chat", chat["user"], "--max-tokens", str(len(chat["firm_ids"])))
    assert done.returncode == 0, done.stderr
    assert done.stdout == chat["firm_text"]
    assert f"{len(chat['prompt_ids'])} prompt tokens" in done.stderr
    assert "decode" in done.stderr and "finish: length" in done.stderr


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_unknown_model_name(smollm2_gguf):
    line = one_error_line(swarmd("run", "--model", "no-such-model", "hi"))
    assert line.startswith("swarmd run: error: unknown model 'no-such-model': known names are ")
    assert "smollm2-135m, " in line and "kimi-k2-mini, " in line


def test_missing_model_file(tmp_path):
    line = one_error_line(swarmd("run", "--model", str(tmp_path / "gone.gguf"), "hi"))
    assert line == f"swarmd run: error: no such model file: {tmp_path / 'gone.gguf'}"


def test_unsupported_architecture(tmp_path):
    path = write_vocab_gguf(tmp_path / "encoder.gguf", pre="gpt-2", arch="bert")
    line = one_error_line(swarmd("run", "--model", str(path), "hi"))
    assert "architecture 'bert' is not supported" in line


def test_empty_prompt(smollm2_gguf):
    assert one_error_line(swarmd("run", "")).endswith("the prompt is empty: give some text to continue")


def test_prompt_longer_than_the_context(smollm2_gguf):
    line = one_error_line(swarmd("run", "--max-context", "8", "one two three four five six seven eight nine"))
    assert "the prompt is 9 tokens but the context holds 8" in line and "--max-context" in line


@pytest.mark.parametrize("args, message", [
    ((), "give either a PROMPT to continue or --chat TEXT"),
    (("x", "--chat", "y"), "give either a PROMPT to continue or --chat TEXT"),
    (("--top-p", "0", "x"), "top_p must be in (0, 1]"),
])
def test_bad_arguments(args, message):
    assert message in one_error_line(swarmd("run", *args))


def test_pull_prints_the_path_and_models_lists_it_with_its_identity(smollm2_gguf):
    from models.catalog.chunk_store import whole_file

    identity = whole_file(smollm2_gguf).digest
    pulled = swarmd("pull", "smollm2-135m")
    assert pulled.returncode == 0 and pulled.stdout.strip() == str(smollm2_gguf)
    assert f"manifest {identity}" in pulled.stderr
    listed = swarmd("models")
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if line.startswith("smollm2-135m"))
    assert row.split() == ["smollm2-135m", "93.8", "MiB", "wheel", identity[:16], str(smollm2_gguf)]


def test_run_help_explains_the_streams():
    done = swarmd("run", "--help")
    assert done.returncode == 0
    assert "stdout" in done.stdout and "--chat" in done.stdout and "--temperature" in done.stdout
