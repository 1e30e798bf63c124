"""A transport link's state under random events: one table says which event moves it where, anything else is a
LocalProtocolError that leaves it as it was; sessions count the streams opened; the backoff starts again once a
session carried frames, and grows, capped, while tries carry nothing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.errors import LocalProtocolError
from swarmd.transport.delivery import LINK_TRANSITIONS, Link, LinkEvent, LinkState, RetryPolicy

CALLS = {
    LinkEvent.OPEN: lambda link: link.open(),
    LinkEvent.OPENED: lambda link: link.opened(),
    LinkEvent.OPEN_FAILED: lambda link: link.open_failed(),
    LinkEvent.SESSION_ENDED: lambda link: link.session_ended(carried=False),
    LinkEvent.IDLE_TIMEOUT: lambda link: link.retire(),
}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(LinkEvent)), max_size=40))
def test_an_event_moves_the_link_as_the_table_says_or_raises_and_changes_nothing(events):
    link, opened = Link(), 0
    for event in events:
        before = (link.state, link.session, link.failures)
        want = LINK_TRANSITIONS.get((link.state, event))
        if want is None:
            with pytest.raises(LocalProtocolError, match=f"link: {event.value} while {link.state.value}"):
                CALLS[event](link)
            assert (link.state, link.session, link.failures) == before
            continue
        CALLS[event](link)
        opened += event is LinkEvent.OPENED
        assert link.state is want and link.session == opened
        assert link.connected == (want is LinkState.CONNECTED) and link.retired == (want is LinkState.RETIRED)
    if link.retired:  # for good: a new link takes its place
        assert all((LinkState.RETIRED, e) not in LINK_TRANSITIONS for e in LinkEvent)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=30), st.integers(0, 9))
def test_the_link_task_backs_off_exponentially_until_a_session_carries_frames(tries, seed):
    """Each try, as the transport's link task makes it: (frames waiting, the stream opens, the session carries)."""
    policy, rng, link = RetryPolicy(initial=0.1, multiplier=2.0, maximum=1.0, jitter=0.5), random.Random(seed), Link()
    nothing_carried = 0
    for waiting, opens, carries in tries:
        if not waiting:
            link.retire()
            assert link.retired
            return
        link.open()
        if opens:
            link.opened()
            assert link.connected
            link.session_ended(carried=carries)
            nothing_carried = 0 if carries else nothing_carried + 1
        else:
            link.open_failed()
            nothing_carried += 1
        base = min(policy.maximum, policy.initial * policy.multiplier ** max(nothing_carried - 1, 0))
        assert base * (1 - policy.jitter) <= link.backoff(policy, rng) <= base
        assert link.state is LinkState.IDLE and link.failures == nothing_carried
