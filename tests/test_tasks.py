"""`spawn`: a callback starts a task in a service's nursery, or learns that the daemon is stopping."""

from __future__ import annotations

import trio

from swarmd.tasks import spawn


async def test_a_task_starts_in_an_open_nursery():
    ran = trio.Event()

    async def task():
        ran.set()

    async with trio.open_nursery() as nursery:
        assert spawn(nursery, task)
    assert ran.is_set()


async def test_nothing_starts_without_a_nursery_or_once_it_is_closed():
    async def task():
        raise AssertionError("must not run")

    assert not spawn(None, task)
    async with trio.open_nursery() as nursery:
        pass
    assert not spawn(nursery, task)  # closed to new arrivals, as a stopped service's nursery is
