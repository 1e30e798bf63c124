"""The states of what a daemon holds for the plan, and the one table of their transitions. Sans-IO.

    idle, ready, standby, failed, loading --LOAD_STARTED--> loading --LOAD_FAILED--> failed
    loading, ready, standby, failed --STAGE_HELD--> ready      (a stage or experts loaded, or kept)
    loading, ready, standby, failed --COPY_HELD--> standby     (a spare's warm copy loaded, or kept)
    any --NOTHING_HELD--> idle                                 (the plan gives this daemon nothing)

So a daemon is never ready for something it did not load, and fails only while loading. The trio driver
(`swarmd.daemon.assignment.Assignment`) fires the events; a pair not in the table raises LocalProtocolError.
"""

from __future__ import annotations

import enum

from swarmd.errors import LocalProtocolError
from swarmd.wire.gossip import AssignmentState

IDLE, LOADING, READY, STANDBY, FAILED = (AssignmentState.IDLE, AssignmentState.LOADING, AssignmentState.READY,
                                         AssignmentState.STANDBY, AssignmentState.FAILED)


class AssignmentEvent(enum.Enum):
    LOAD_STARTED = "load started"
    LOAD_FAILED = "load failed"
    STAGE_HELD = "stage held"  # the plan's stage or experts for this daemon are loaded
    COPY_HELD = "copy held"  # the plan's standby copy for this daemon is loaded and warm
    NOTHING_HELD = "nothing held"  # the plan gives this daemon nothing


TRANSITIONS: dict[tuple[AssignmentState, AssignmentEvent], AssignmentState] = {
    **{(s, AssignmentEvent.LOAD_STARTED): LOADING for s in AssignmentState},
    (LOADING, AssignmentEvent.LOAD_FAILED): FAILED,
    **{(s, AssignmentEvent.STAGE_HELD): READY for s in (LOADING, READY, STANDBY, FAILED)},
    **{(s, AssignmentEvent.COPY_HELD): STANDBY for s in (LOADING, READY, STANDBY, FAILED)},
    **{(s, AssignmentEvent.NOTHING_HELD): IDLE for s in AssignmentState},
}


def next_state(state: AssignmentState, event: AssignmentEvent) -> AssignmentState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise LocalProtocolError(f"assignment: {event.value} while {state}") from None


def held(layers: tuple[int, int] | None, copy: tuple[int, int] | None, experts: dict[int, tuple[int, ...]]
         ) -> AssignmentEvent:
    """What a loaded assignment holds: a stage or experts, a spare's copy, or nothing."""
    if layers or experts:
        return AssignmentEvent.STAGE_HELD
    return AssignmentEvent.COPY_HELD if copy else AssignmentEvent.NOTHING_HELD
