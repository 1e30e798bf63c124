"""A daemon's assignment under random plans and load failures: it ends each plan in the state the plan and the
failures call for, holding what that state says, and only through the rows of its transition table (a pair
not in it raises LocalProtocolError)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from models.errors import ModelError
from planner.plan import ModelRef, Plan, Stage
from swarmd.daemon.assignment import Assignment
from swarmd.daemon.assignment_machine import TRANSITIONS, AssignmentEvent, next_state
from swarmd.daemon.served_model import ServedModel
from swarmd.errors import LocalProtocolError
from swarmd.wire.gossip import AssignmentState, AssignmentStatus, PlanAnnouncement
from tests.swarm.swarm_helpers import peer

ME, OTHER = peer(1), peer(2)
RANGES = ((0, 2), (0, 4), (2, 4))
EXPERTS = ({}, {1: (0,)}, {1: (0, 1)}, {3: (1,)})


class InlineCompute:
    """The compute thread's `run`, on the event loop: these loads are instant."""

    async def run(self, fn, *args):
        await trio.lowlevel.checkpoint()
        return fn(*args)


class Loads:
    """Stage and expert loaders whose loads of `bad` ranges and blocks fail."""

    def __init__(self, bad_ranges: set, bad_blocks: set) -> None:
        self.bad_ranges, self.bad_blocks = bad_ranges, bad_blocks

    def stage(self, model, a, b, device, max_context, max_requests, reuse=None):
        if (a, b) in self.bad_ranges:
            raise ModelError(f"blocks {a}-{b} cannot be read")
        return ("stage", a, b)

    def experts(self, model, experts, device):
        if set(experts) & self.bad_blocks:
            raise ModelError("experts cannot be read")
        return ("experts", tuple(sorted(experts.items())))


wants = st.tuples(st.sampled_from(["stage", "copy", "nothing"]), st.sampled_from(RANGES), st.sampled_from(EXPERTS))


def announcement(epoch: int, kind: str, layers: tuple[int, int], experts: dict) -> PlanAnnouncement:
    stages = [Stage(ME if kind == "stage" else OTHER, layers)]
    return PlanAnnouncement(OTHER, 1, Plan(epoch, ModelRef("tiny"), tuple(stages),
                                           experts={b: {e: (ME,) for e in es} for b, es in experts.items()},
                                           standbys={ME: layers} if kind == "copy" else {}))


def expected(kind: str, layers: tuple[int, int], experts: dict, loads: Loads) -> AssignmentState:
    if set(experts) & loads.bad_blocks or (kind != "nothing" and layers in loads.bad_ranges):
        return AssignmentState.FAILED
    if kind == "stage" or experts:
        return AssignmentState.READY
    return AssignmentState.STANDBY if kind == "copy" else AssignmentState.IDLE


@settings(max_examples=150, deadline=None)
@given(st.lists(wants, min_size=1, max_size=12), st.sets(st.sampled_from(RANGES), max_size=1),
       st.sets(st.sampled_from([1, 3]), max_size=1))
def test_each_plan_ends_in_the_state_it_calls_for_through_legal_transitions(plans, bad_ranges, bad_blocks):
    loads = Loads(bad_ranges, bad_blocks)
    model = ServedModel("tiny", "", None, None)  # type: ignore[arg-type]

    async def main() -> None:
        a = Assignment(ME, model, "CPU", InlineCompute(), loader=loads.stage,  # type: ignore[arg-type]
                       expert_loader=loads.experts)
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            for epoch, (kind, layers, experts) in enumerate(plans, start=1):
                a.apply(announcement(epoch, kind, layers, experts))
                await trio.testing.wait_all_tasks_blocked()
                status, want = a.status(), expected(kind, layers, experts, loads)
                assert status.state == want and status.epoch == epoch, (kind, layers, experts, status)
                if want == AssignmentState.FAILED:
                    continue
                target = layers if kind != "nothing" else None
                assert status.layers == target and a.loaded_layers == target
                assert a.stage == (("stage", *target) if target else None)
                assert a.loaded_experts == experts and (a.experts is None) == (not experts)
                if want == AssignmentState.READY and target:
                    assert await a.wait_ready() == ("stage", *target)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_illegal_transition_raises_a_local_protocol_error():
    with pytest.raises(LocalProtocolError, match="assignment: load failed while ready"):
        next_state(AssignmentState.READY, AssignmentEvent.LOAD_FAILED)
    with pytest.raises(LocalProtocolError, match="assignment: stage held while idle"):
        next_state(AssignmentState.IDLE, AssignmentEvent.STAGE_HELD)


def test_every_state_can_start_a_load_and_only_loading_can_fail():
    assert all(TRANSITIONS[(s, AssignmentEvent.LOAD_STARTED)] == AssignmentState.LOADING for s in AssignmentState)
    assert {s for (s, e) in TRANSITIONS if e == AssignmentEvent.LOAD_FAILED} == {AssignmentState.LOADING}


def test_the_status_keeps_its_strings_on_the_wire():
    assert [s.value for s in AssignmentState] == ["idle", "loading", "ready", "standby", "failed"]
    doc = {"epoch": 1, "layers": [0, 2], "experts": {}, "state": "standby", "progress": 1.0, "error": "",
           "fetch": {"bytes": 0, "total": 0, "rate": 0.0}}
    status = AssignmentStatus.from_json(doc)
    assert status.state is AssignmentState.STANDBY and status.to_json() == doc
