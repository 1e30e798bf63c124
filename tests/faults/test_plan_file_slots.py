"""A plan file's slots with whole daemons in one process (`swarmd.testing.twin`, virtual time): each daemon claims
its slot, the leader binds them and runs the file's plan with their peer ids; a second claim of a held slot stops
its daemon with a one-line error; when the leader dies the next one plans around its slot, and once the daemon is
back with the same slot the file's plan is adopted again, with the same tokens all along."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from planner.plan_file import PlanFile
from swarmd.cli.main import main
from swarmd.errors import UserError
from swarmd.testing.memory_network import MemoryHub
from swarmd.testing.twin import SwarmTwin, TwinDaemon
from tests.swarm.tiny_model import write_tiny_llama
from tests.twin_swarm import TWIN_POOL

pytestmark = pytest.mark.slow  # a few seconds: tinygrad runs the tiny model's steps

PROMPT = [40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf", n_blocks=6, vocab=300,
                            byte_tokenizer=True, scale=0.5)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory, model) -> tuple[Path, PlanFile]:
    path = tmp_path_factory.mktemp("plan") / "tiny.json"
    assert main(["plan", "--model", str(model), "--fleet", "3x3060", "--out", str(path)]) == 0
    return path, PlanFile.loads(path.read_text())


def stage_peers(d: TwinDaemon) -> list[str]:
    assert d.node is not None and d.node.plan is not None
    return [s.peer_id for s in d.node.plan.stages]


def leader_of(daemons: list[TwinDaemon]) -> TwinDaemon:
    return next(d for d in daemons if d.alive and d.node is not None and d.node.swarm.election.is_leader)


def leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for e in group.exceptions for leaf in leaves(e)]
    return [group]


async def wait_for(predicate, within: float = 30.0) -> None:
    with trio.fail_after(within):
        while not predicate():  # noqa: ASYNC110 - a status snapshot
            await trio.sleep(0.25)


async def test_slots_are_bound_once_and_a_new_leader_brings_the_files_plan_back(nursery, tmp_path, model, plan_file,
                                                                                 autojump_clock):
    path, pf = plan_file
    first, second, third = pf.fleet.names
    hub = await nursery.start(MemoryHub().run)
    twin = SwarmTwin(hub, tmp_path, str(model), pool=TWIN_POOL, plan=path)
    claims = {0: second, 1: third, 2: first}  # not in the order the daemons start
    d0 = await twin.start(nursery, 0, slot=claims[0])
    daemons = [d0] + [await twin.start(nursery, i, via=d0, slot=claims[i]) for i in (1, 2)]
    await twin.wait_ready(d0)
    by_slot = {claims[d.index]: d.peer_id for d in daemons}
    assert stage_peers(d0) == [by_slot[s.peer_id] for s in pf.plan.stages]  # the file's stages, slots bound
    assert all(stage_peers(d) == stage_peers(d0) for d in daemons)
    reference = await twin.generate(d0, PROMPT, max_tokens=8)
    assert not reference.error and len(reference.tokens) == 8

    with pytest.raises(BaseExceptionGroup) as refused, trio.fail_after(60):  # a second claim: its daemon stops
        async with trio.open_nursery() as own:
            await twin.start(own, 3, via=d0, slot=second)
            await trio.sleep_forever()
    (error,) = leaves(refused.value)
    assert isinstance(error, UserError)
    assert str(error).startswith(f"slot {second} of tiny.json is held by {by_slot[second]}")
    assert stage_peers(d0) == [by_slot[s.peer_id] for s in pf.plan.stages]  # the refused claim changed nothing

    gone = leader_of(daemons)
    twin.crash(gone)
    heir = next(d for d in daemons if d is not gone)
    await wait_for(lambda: gone.peer_id not in stage_peers(heir) and heir.pipeline.chain().ready)
    assert (await twin.generate(heir, PROMPT, max_tokens=8)) == reference  # planned around the missing slot
    leader = leader_of([d for d in daemons if d is not gone])
    assert leader.node is not None and leader.node.claim is not None
    assert leader.node.claim.status()["unclaimed"] == [claims[gone.index]]  # free while its daemon is gone

    back = await twin.restart(nursery, gone)  # same identity, same slot
    await wait_for(lambda: stage_peers(heir) == [by_slot[s.peer_id] for s in pf.plan.stages]
                   and heir.pipeline.chain().ready)
    assert stage_peers(back) == stage_peers(heir)
    assert (await twin.generate(back, PROMPT, max_tokens=8)) == reference
