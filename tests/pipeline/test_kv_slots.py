"""KV slots: how many a stage gets from its memory, how a stage lines up new requests when they are all taken,
and how a head counts the free ones from the stages' reports and its own requests (all sans-IO)."""

from __future__ import annotations

import numpy as np
import pytest

from planner import BUILTIN_ARCHS, PlanOptions, layout_from_arch
from planner.memory import kv_slots, stage_bytes
from swarmd.inference.head.slots import FULL_HOLD, SlotView, StageSlots
from swarmd.inference.stage.book import StageBook, StageRefusal, Work
from swarmd.wire import Forward, Sampling, WireTensor

MiB = 1 << 20


def first_step(rid: str, **kw) -> Forward:
    return Forward(rid, 0, 0, 0, "H", tokens=WireTensor.from_array(np.arange(3, dtype=np.int32)),
                   sampling=Sampling(max_tokens=4), **kw)


def ran(book: StageBook, work: Work) -> None:
    """The model ran the step: the request is idle here until its next one."""
    book.complete(work, np.zeros((work.rows, 4), np.float32), next_peer="S1", first_peer="S0", now=1.5)


# --- a stage's slots from its memory ---------------------------------------------------------------------------

def test_a_stage_holds_as_many_requests_as_its_memory_allows_up_to_the_most_asked():
    layout = layout_from_arch(BUILTIN_ARCHS["llama-3.2-1b"], "f16")
    opts = PlanOptions(context_length=4096)
    per_request = sum(b.kv_bytes_per_token for b in layout.blocks[0:8]) * 4096
    weights = stage_bytes(layout, 0, 8, opts) - per_request * opts.concurrency
    room_for = lambda n: int(weights + opts.runtime_overhead_bytes + (n + 1) * per_request)  # noqa: E731 - one spare
    assert kv_slots(layout, 0, 8, opts, room_for(10), most=64) == 10
    assert kv_slots(layout, 0, 8, opts, room_for(10) - 1, most=64) == 9
    assert kv_slots(layout, 0, 8, opts, room_for(10), most=6) == 6
    assert kv_slots(layout, 0, 8, opts, 0, most=64) == 1  # the plan budgeted for some: never none
    # a float32 cache where the layout counts 16-bit values takes twice the room per request
    assert kv_slots(layout, 0, 8, opts, room_for(10), most=64, kv_scale=2.0) == 4
    # more blocks, fewer requests in the same memory
    assert kv_slots(layout, 0, 16, opts, room_for(10), most=64) < 10


# --- a stage's line of new requests ----------------------------------------------------------------------------

def test_a_new_request_finding_every_slot_taken_waits_in_line_and_takes_the_first_slot_freed():
    b = StageBook(0, 2, max_context=16, vocab_size=100, slots=2)
    for rid in ("a", "b"):
        assert not b.must_wait(first_step(rid))
        ran(b, b.on_forward(first_step(rid), now=1.0))
    assert b.must_wait(first_step("c")) and b.must_wait(first_step("d"))
    b.wait("c", "H")
    b.wait("d", "H")
    v = b.version
    assert b.release_line() == [] and b.used == 2
    assert b.cancel("a") and b.version > v
    assert b.release_line() == ["c"] and b.reserved == {"c"} and b.used == 2
    assert b.must_wait(first_step("e"))  # d waits before it, even once a slot frees
    work = b.on_forward(first_step("c"), now=2.0)
    assert work.new and b.reserved == set() and set(b.requests) == {"b", "c"}


def test_too_many_waiting_are_refused_as_busy_and_a_cancelled_one_leaves_the_line():
    b = StageBook(0, 2, max_context=16, vocab_size=100, slots=1)
    b.on_forward(first_step("a"), now=1.0)  # its step runs: a cancel would only mark it
    assert b.must_wait(first_step("b"))
    b.wait("b", "H")
    with pytest.raises(StageRefusal) as refused:
        b.must_wait(first_step("c"))
    assert refused.value.code == "busy" and "1 KV cache slots" in str(refused.value)
    assert not b.cancel("b") and b.in_line == {}  # nothing to free: it never held a slot
    b.wait("c", "H2")
    assert b.drop_heads({"H2"}) == [] and b.in_line == {}


def test_a_moved_request_continuing_an_attempt_held_here_never_waits():
    b = StageBook(0, 2, max_context=16, vocab_size=100, slots=1)
    ran(b, b.on_forward(first_step("r"), now=1.0))
    assert not b.must_wait(first_step("r.r1", resume_of="r"))
    assert b.must_wait(first_step("other"))


def test_a_refused_first_step_gives_its_reserved_slot_back():
    b = StageBook(0, 2, max_context=2, vocab_size=100, slots=1)
    b.wait("long", "H")
    assert b.release_line() == ["long"]
    with pytest.raises(StageRefusal):
        b.on_forward(first_step("long"), now=1.0)  # 3 tokens in a context of 2
    assert b.used == 0


# --- a head's view of the chain's free slots -------------------------------------------------------------------

def test_a_head_counts_its_own_requests_since_each_report_and_trusts_the_next():
    view = SlotView()
    view.report({"s0": StageSlots(4, 2, version=7), "s1": StageSlots(8, 2, version=3)})
    assert view.free("s0", now=0.0) == 2 and view.can_start(["s0", "s1"], now=0.0)
    view.started(["s0", "s1"])
    view.started(["s0", "s1"])
    assert view.free("s0", now=0.0) == 0 and not view.can_start(["s0", "s1"], now=0.0)
    view.report({"s0": StageSlots(4, 2, version=7)})  # the same version: nothing new
    assert view.free("s0", now=0.0) == 0
    view.report({"s0": StageSlots(4, 3, version=8)})  # one of them landed, another head's request left
    assert view.free("s0", now=0.0) == 1
    view.ended(["s0", "s1"])
    assert view.free("s0", now=0.0) == 2 and view.used("s1") == 3


def test_a_head_never_counts_fewer_requests_on_a_stage_than_its_own():
    view = SlotView()
    view.report({"s0": StageSlots(4, 0, version=1)})
    for _ in range(3):
        view.started(["s0"])
    view.report({"s0": StageSlots(4, 1, version=2)})  # a report that saw only one of them
    assert view.used("s0") == 3 and view.free("s0", now=0.0) == 1


def test_a_stage_that_answered_busy_counts_as_full_until_it_says_otherwise():
    view = SlotView()
    view.report({"s0": StageSlots(4, 1, version=1)})
    view.refused("s0", now=10.0)
    assert view.free("s0", now=10.0) == 0
    assert view.free("s0", now=10.0 + FULL_HOLD) == 3  # at most FULL_HOLD seconds
    view.refused("s0", now=20.0)
    view.report({"s0": StageSlots(4, 2, version=2)})  # or its next report
    assert view.free("s0", now=20.0) == 2
    view.refused("s0", now=30.0)
    view.started(["s0"])
    view.ended(["s0"])  # or one of this head's requests there ending
    assert view.free("s0", now=30.0) == 2


def test_a_stage_that_reports_no_slots_never_holds_a_request_back():
    view = SlotView()
    view.report({"s0": None})
    view.started(["s0"])
    assert view.free("s0", now=0.0) is None and view.can_start(["s0", "unknown"], now=0.0)
