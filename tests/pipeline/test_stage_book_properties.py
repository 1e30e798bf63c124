"""A stage's requests under random message sequences, as the stage actor drives its book: each request's phase
changes only along the transition table, and every KV slot a request takes is freed exactly once, never while
the model still runs it, or handed on whole to the attempt that adopts it. Nothing leaks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.errors import LocalProtocolError
from swarmd.inference.stage.book import (
    REQUEST_TRANSITIONS,
    RequestEvent,
    RequestPhase,
    StageBook,
    StageRefusal,
    Work,
)
from swarmd.wire import Forward, Sampling, Token, WireTensor

HIDDEN, VOCAB, CONTEXT = 4, 50, 24
SAMPLING = Sampling(temperature=0.0, seed=1, max_tokens=8)
NAMES = ("a", "b", "c")

requests = st.sampled_from(NAMES)
ops = st.one_of(
    st.tuples(st.just("start"), requests, st.integers(1, 4)),
    st.tuples(st.just("token"), requests),
    st.tuples(st.just("move"), requests),  # the head replays the request as a new attempt that resumes it
    st.tuples(st.just("complete"), st.integers(0, 3)),
    st.tuples(st.just("fail"), st.integers(0, 3)),
    st.tuples(st.just("cancel"), requests),
    st.tuples(st.just("expire"), st.floats(0.0, 10.0)),
    st.tuples(st.just("head gone"), st.booleans()),
    st.tuples(st.just("new model"),),
)


class Stage:
    """What `StageActor` does around its book, with KV slots counted instead of a model."""

    def __init__(self) -> None:
        self.book = StageBook(0, 2, max_context=CONTEXT, vocab_size=VOCAB)
        self.now = 0.0
        self.running: list[Work] = []  # with the model
        self.slots: set[str] = set()  # requests holding a KV slot
        self.attempt = dict.fromkeys(NAMES, 0)
        self.history: dict[str, list[int]] = {}  # tokens of each live attempt (prompt and generated)
        self.cancelled: set[str] = set()  # cancelled while the model ran them: they must not come back

    def wire_id(self, name: str) -> str:
        return f"{name}.r{self.attempt[name]}" if self.attempt[name] else name

    def free(self, request_id: str) -> None:
        assert request_id in self.slots, f"{request_id} freed twice or never held"
        assert all(w.request_id != request_id for w in self.running), f"{request_id} freed while the model runs it"
        self.slots.remove(request_id)

    def give_model(self, work: Work) -> None:
        if work.adopt:  # the earlier attempt's slot, positions kept, is now this attempt's
            self.slots.remove(work.adopt)
            assert work.adopt not in self.book.requests
        if work.new:
            assert work.request_id not in self.slots
            self.slots.add(work.request_id)
        self.running.append(work)

    def step(self, op: tuple) -> None:
        kind, *args = op
        try:
            if kind == "start":
                rid, prompt = args[0], list(range(10, 10 + args[1]))
                work = self.book.on_forward(self.forward(rid, prompt), self.now)
                self.history[rid] = prompt
                self.give_model(work)
            elif kind == "token":
                rid = self.wire_id(args[0])
                state = self.book.requests.get(rid)
                step = state.step if state else 0
                work = self.book.on_token(Token(rid, step, 7), self.now)
                self.history[rid].append(7)
                self.give_model(work)
            elif kind == "move":
                old = self.wire_id(args[0])
                if old not in self.history:
                    return
                self.attempt[args[0]] += 1
                new = self.wire_id(args[0])
                tokens = self.history[old]
                work = self.book.on_forward(self.forward(new, tokens, step=len(tokens), resume_of=old), self.now)
                self.history[new] = list(tokens)
                self.give_model(work)
                if self.book.cancel(old):  # not adopted: the old attempt is over here
                    self.free(old)
            elif kind in ("complete", "fail") and self.running:
                work = self.running.pop(args[0] % len(self.running))
                if kind == "fail":
                    if self.book.fail(work, "model_error", "it broke") is not None:
                        self.free(work.request_id)
                else:
                    self.book.complete(work, np.zeros((work.rows, HIDDEN), np.float32), next_peer="S1",
                                       first_peer="S0", now=self.now)
                    if work.request_id not in self.book.requests:  # cancelled while the model ran it
                        self.free(work.request_id)
                    assert not (work.request_id in self.cancelled and work.request_id in self.book.requests)
            elif kind == "cancel":
                rid = self.wire_id(args[0])
                if self.book.cancel(rid):
                    self.free(rid)
                elif rid in self.book.requests:
                    self.cancelled.add(rid)
            elif kind == "expire":
                self.now += args[0]
                for rid in self.book.expire(self.now, idle=5.0):
                    self.free(rid)
            elif kind == "head gone":
                for rid in self.book.drop_heads({"H" if args[0] else "elsewhere"}):
                    self.free(rid)
            elif kind == "new model":
                for rid in self.book.clear():
                    self.slots.discard(rid)  # the old model goes whole, with its slots
                self.running.clear()
        except StageRefusal:
            pass
        self.check()

    def forward(self, rid: str, tokens: list[int], step: int = 0, resume_of: str = "") -> Forward:
        return Forward(rid, step, 0, 0, "H", tokens=WireTensor.from_array(np.asarray(tokens, np.int32)),
                       sampling=SAMPLING, resume_of=resume_of)

    def check(self) -> None:
        running = {w.request_id for w in self.running}
        for rid, state in self.book.requests.items():
            assert state.phase is not RequestPhase.GONE and state.busy == (rid in running)
        assert running <= set(self.book.requests)  # the model never runs a request the book forgot
        assert self.slots == set(self.book.requests)  # a slot for each request it knows, and no other
        for rid in list(self.cancelled):
            if rid in self.book.requests:
                assert self.book.requests[rid].cancelled
            else:
                self.cancelled.discard(rid)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=50))
def test_phases_follow_the_table_and_every_kv_slot_is_freed_once(sequence):
    stage = Stage()
    for op in sequence:
        stage.step(op)
    while stage.running:  # the model finishes what it has, then the requests go idle and expire
        stage.step(("complete", 0))
    stage.step(("expire", 10.0))
    assert stage.book.requests == {} and stage.slots == set()


def test_an_illegal_transition_raises_a_local_protocol_error():
    stage = Stage()
    stage.step(("start", "a", 2))
    state = stage.book.requests["a"]
    with pytest.raises(LocalProtocolError, match="request a: begin while running"):
        stage.book._fire(state, RequestEvent.BEGIN)
    with pytest.raises(LocalProtocolError, match="request a: adopted while running"):
        stage.book._fire(state, RequestEvent.ADOPTED)
    assert state.phase is RequestPhase.RUNNING


def test_only_begin_sets_a_request_running():
    assert {(p, e) for (p, e), new in REQUEST_TRANSITIONS.items() if new is RequestPhase.RUNNING} == {
        (RequestPhase.WAITING, RequestEvent.BEGIN)}
