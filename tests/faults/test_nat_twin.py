"""Daemons behind NAT in one process (`swarmd.testing.twin`): a public founder and two daemons nobody can dial.
The pair reaches each other through the founder's relay, and status, the descriptors the planner reads and the
requests all know it: `links` says `relayed` (and through whom) for the pair, the founder's links are the twin's
own; a request whose activations cannot reach a stage ends within the head's first-token wait, saying why."""

from __future__ import annotations

import pytest
import trio

from swarmd.net.identity import short_id
from swarmd.testing.memory_network import MemoryHub
from tests.swarm.tiny_model import write_tiny_llama
from tests.twin_swarm import twin_swarm

pytestmark = pytest.mark.slow  # a few seconds: tinygrad runs the tiny model's steps

PROMPT = [40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf", n_blocks=6, vocab=300,
                            byte_tokenizer=True, scale=0.5)


def peer_of(index: int) -> str:
    """The peer id the twin gives daemon `index`."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from swarmd.net.identity import peer_id_of

    return peer_id_of(create_new_key_pair(bytes([index + 1]) * 32))


async def nated_swarm(nursery, tmp_path, model):
    hub = await nursery.start(MemoryHub().run)
    for i in (1, 2):
        hub.behind_nat(peer_of(i))
    return await twin_swarm(nursery, tmp_path, model, 3, hub=hub)


def links_of(daemon) -> dict[str, dict[str, str]]:
    return {link["peer_id"]: link for link in daemon.node.status()["links"]}


async def test_the_nated_pair_is_relayed_in_status_and_in_the_descriptors_the_planner_reads(nursery, tmp_path, model,
                                                                                            autojump_clock):
    twin, (founder, home1, home2) = await nated_swarm(nursery, tmp_path, model)
    await trio.sleep(5)  # a few heartbeats: the descriptors carry the links
    pair = links_of(home1)[home2.peer_id]
    assert pair["path"] == "relayed" and short_id(founder.peer_id)[-6:] in pair["reason"]
    assert links_of(home2)[home1.peer_id]["path"] == "relayed"
    assert {link["path"] for link in links_of(founder).values()} == {"memory"}
    seen_by_leader = founder.node.swarm.membership.members[home1.peer_id].descriptor
    assert seen_by_leader.links.get(home2.peer_id) == "relayed"  # the planner prices that hop as two
    outcome = await twin.generate(home1, PROMPT, max_tokens=8)  # headed behind NAT, through the relay
    assert not outcome.error and len(outcome.tokens) == 8


async def test_a_request_whose_activations_cannot_reach_a_stage_ends_with_the_reason(nursery, tmp_path, model,
                                                                                     autojump_clock):
    twin, (founder, home1, home2) = await nated_swarm(nursery, tmp_path, model)
    twin.hub.black_hole(founder.peer_id, home2.peer_id)  # what goes to home2, relayed or not, vanishes unheard
    start = trio.current_time()
    outcome = await twin.generate(home1, PROMPT, max_tokens=8)
    took = trio.current_time() - start
    assert outcome.error.startswith("timeout: ") and not outcome.tokens  # within the head's first-token wait,
    assert took <= twin.timings.first_token_timeout + 1, took
    assert "could not deliver forward" in outcome.error  # and saying what the stage before home2 ran into
