"""A bounded flood from one member (a process of its own holding the swarm key: gossip, probes and redials
as fast as it can) does not stop the others: the victim keeps hearing an honest member's heartbeats, never
suspects it, and takes its activations; the flooder is cut off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from swarmd.net.gate import GuardLimits
from swarmd.net.swarm_key import SwarmKey, write_swarm_key
from swarmd.transport.links import start_actor_transport
from swarmd.wire import Forward
from tests.security.helpers import SWARM, TIMINGS, eventually, forward, start_member

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # about 20 s
ROOT = Path(__file__).resolve().parents[2]
FLOOD_SECONDS = 6.0
# The victim calls a flood at 60 messages over the rate within 10 s (the default is 200): the flooder's pace
# follows the CPU it gets, and on a loaded machine it drops about 120 in its 6 s, still over 300 messages sent.
LIMITS = GuardLimits(flood_drops=60)


async def test_a_flood_from_one_member_does_not_stop_the_others(tmp_path):
    key = SwarmKey.generate()
    write_swarm_key(tmp_path / "swarm.key", key)
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            victim = await start_member(nursery, tmp_path / "victim", key=key, limits=LIMITS)
            honest = await start_member(nursery, tmp_path / "honest", key=key, bootstrap=(victim,))
            v_transport = await start_actor_transport(victim.net, nursery)
            h_transport = await start_actor_transport(honest.net, nursery)
            got: list[Forward] = []

            async def stage(peer, msg):
                got.append(msg)

            v_transport.route(Forward, stage)
            await eventually(lambda: honest.peer_id in victim.swarm.membership.live()
                             and victim.peer_id in honest.swarm.membership.live(), 20, "the two members meet")
            changes: list = []
            victim.swarm.state_listeners.append(changes.append)

            flooder = await trio.lowlevel.open_process(
                [sys.executable, "-m", "tests.security.flooder", str(tmp_path / "swarm.key"), victim.address, SWARM,
                 str(FLOOD_SECONDS)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            try:
                gaps, sent, slowest, step = [], 0, 0.0, 0
                end = trio.current_time() + FLOOD_SECONDS + 3
                while trio.current_time() < end:  # activations every 0.25 s, each within its deadline
                    step += 1
                    t0 = trio.current_time()
                    await h_transport.send(victim.peer_id, forward(step), within=3)
                    slowest = max(slowest, trio.current_time() - t0)
                    sent += 1
                    member = victim.swarm.membership.members[honest.peer_id]
                    gaps.append(trio.current_time() - member.last_heard)
                    await trio.sleep(0.25)
                with trio.fail_after(30):
                    out = (await flooder.stdout.receive_some(65536)).decode()
                    await flooder.wait()
            finally:
                if flooder.returncode is None:
                    flooder.kill()
            report = json.loads(out.strip().splitlines()[-1])
            assert report["gossip"] + report["probes"] > 300, report  # it did flood
            assert len(got) == sent and max(gaps) < TIMINGS.suspect_after, (max(gaps), slowest)
            assert [c for c in changes if c.peer_id == honest.peer_id] == []  # never suspected
            assert str(victim.swarm.membership.members[honest.peer_id].state) == "alive"
            assert victim.net.gate.stats["penalised"] >= 1, (report, dict(victim.net.gate.stats), dict(victim.net.guard.stats))
            assert report["peer_id"] not in victim.swarm.membership.live()
            print(f"flood: {report}; victim gate {dict(victim.net.gate.stats)}; honest activations {sent}, slowest {slowest * 1e3:.0f} ms, "
                  f"longest heartbeat gap {max(gaps):.2f} s")
            nursery.cancel_scope.cancel()
