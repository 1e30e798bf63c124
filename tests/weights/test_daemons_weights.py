"""Acceptance: weights through the swarm, with real `swarmd join` processes on loopback.

Four daemons serve SmolLM2-135M; only the founder has the GGUF, each has a model cache of its own, and all are
started with `--model smollm2-135m`. Every daemon gets a stage, the others fetch exactly the tensors of the
ranges they were given (their caches hold those bytes and the manifest, within 5 %), and the answer equals the
whole model's in this process (`models.generate`, the loop behind `swarmd run`). Then spares join: one that
serves corrupt chunks (a test switch), one that knows the model only by its manifest's hash and must fetch
its copy past the liar.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from models.gguf.header import read_header
from models.gguf.manifest import Manifest
from tests.swarm.daemons import http
from tests.weights.cache_swarm import CONTEXT, CacheSwarm, check_fetched_only_what_was_assigned, generate

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(900)]

SMOLLM2_IN_CACHE = "smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def dense(tmp_path_factory, bench_file, smollm2_gguf, want):  # the reference first: it compiles what daemons reuse
    swarm = CacheSwarm(tmp_path_factory.mktemp("dense"), bench_file, "smollm2-135m",
                       extra=("--max-context", str(CONTEXT)))
    try:
        founder = swarm.daemon("a", holding=smollm2_gguf, in_cache=SMOLLM2_IN_CACHE).start().wait_ready(120)
        joiners = [swarm.daemon(n).start(bootstrap=(founder.addresses[0],)) for n in "bcd"]
        for d in joiners:
            d.wait_ready(120)
        swarm.wait_ready_plan({d.peer_id for d in swarm.daemons.values()})
        yield swarm
    finally:
        swarm.stop()


def test_every_daemon_gets_a_stage_and_the_others_fetch_only_their_ranges(dense, smollm2_gguf, want):
    header = read_header(smollm2_gguf)
    identity = Manifest.from_gguf(smollm2_gguf).digest
    plan = dense.daemons["a"].status()["plan"]
    assert len(plan["stages"]) == 4 and plan["model"]["digest"] == identity
    for name in "bcd":
        assert dense.daemons[name].status()["self"]["model"] == {"name": "smollm2-135m", "digest": identity}
        check_fetched_only_what_was_assigned(dense, name, header)
    assert not any((dense.models_dir(n) / "smollm2-135m").exists() for n in "bcd")  # nothing was downloaded
    for name in "ab":
        assert generate(dense.daemons[name].api) == want


def test_status_models_and_metrics_show_the_manifest_and_what_was_fetched(dense, smollm2_gguf):
    identity = Manifest.from_gguf(smollm2_gguf).digest
    b = dense.daemons["b"]
    text = b.status_cli()
    assert text.returncode == 0, text.stderr
    assert f"manifest {identity[:12]}" in text.stdout and "(a partial model" in text.stdout
    env = {**os.environ, "XDG_CACHE_HOME": str(b.home / "cache")}
    env.pop("SWARMD_MODELS", None)
    listing = subprocess.run([sys.executable, "-m", "swarmd", "models"], capture_output=True, text=True, env=env,
                             timeout=60)
    assert listing.returncode == 0, listing.stderr
    [row] = [line for line in listing.stdout.splitlines() if "smollm2-135m" in line]
    assert "swarm (partial)" in row and identity[:16] in row
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in
               http.get(f"{b.api}/metrics", timeout=10).text.splitlines() if line.startswith("swarmd_weights")}
    assert metrics["swarmd_weights_bytes_fetched_total"] > 1 << 20
    assert metrics["swarmd_weights_fetch_total_bytes"] > 0 and metrics["swarmd_weights_fetching"] == 0
    served = http.get(f"{dense.daemons['a'].api}/metrics", timeout=10).text
    assert "swarmd_weights_bytes_served_total" in served


def test_a_peer_serving_corrupt_chunks_is_detected_and_avoided(dense, smollm2_gguf, want):
    identity = Manifest.from_gguf(smollm2_gguf).digest
    founder = dense.daemons["a"]
    liar = dense.daemon("e", holding=smollm2_gguf, in_cache=SMOLLM2_IN_CACHE, extra=("--standby",),
                        env={"SWARMD_TEST_CORRUPT_CHUNKS": "1"})
    liar.start(bootstrap=(founder.addresses[0],)).wait_ready(120)
    dense.wait_ready_plan({dense.daemons[n].peer_id for n in "abcd"}, standbys=1)
    # a spare that knows the model only by its identity, and fetches its copy from the members, the liar among them
    spare = dense.daemon("f", model=f"manifest:{identity[:16]}", extra=("--standby",))
    spare.start(bootstrap=(founder.addresses[0],)).wait_ready(120)
    dense.wait_ready_plan({dense.daemons[n].peer_id for n in "abcd"}, standbys=2)
    log = spare.log_path.read_text()
    assert "sent a bad chunk" in log and "fetching it elsewhere" in log
    fetched = spare.status()["weights"]["fetched_from"]
    assert liar.peer_id not in fetched and sum(fetched.values()) > 0
    assert http.get(f"{liar.api}/api/v0/status", timeout=10).json()["weights"]["served"]["chunks_served"] >= 1
    check_fetched_only_what_was_assigned(dense, "f", read_header(smollm2_gguf))
    assert spare.status()["self"]["model"]["name"] == "smollm2-135m"
    assert generate(spare.api) == want
