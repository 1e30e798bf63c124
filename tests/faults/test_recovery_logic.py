"""Moving a request to a new chain, without a network: what the head replays, how stages take it, and what a
stage forgets when a request's head is gone (sans-IO: `swarmd.inference.head.recovery`, `StageBook`); and how soon a killed
stage is declared dead and re-planned (`swarmd.swarm.membership`, `swarmd.swarm.planning`)."""

from __future__ import annotations

import numpy as np

from planner.plan import ModelRef, Plan, Stage
from swarmd.config import LAN
from swarmd.inference.head.recovery import Recovery, attempt_id, chain_changed, replay_forward
from swarmd.inference.registry import Registry
from swarmd.inference.stage.book import Sampled, StageBook
from swarmd.swarm.membership import (
    REFUSALS_TO_DIE,
    ConnectionLost,
    HeartbeatReceived,
    Membership,
    ProbeResult,
    State,
    StateChanged,
)
from swarmd.swarm.planning import Candidates, Leadership, MakePlan, PlanCoordinator, PlanMade, plan_broken
from swarmd.wire import Forward, Sampling, Token, WireTensor
from tests.swarm.swarm_helpers import descriptor, heartbeat, peer

HIDDEN, VOCAB = 8, 100
ME, A, B = sorted(peer(i) for i in range(1, 4))
SAMPLING = Sampling(temperature=0.0, seed=5, max_tokens=10, stop_ids=(2,))


def registry(epoch: int, *stages: tuple[str, int, int]) -> Registry:
    return Registry(epoch, tuple(p for p, _, _ in stages), tuple((a, b) for _, a, b in stages), {})


def test_a_chain_changes_when_a_peer_or_a_block_range_changes_not_when_only_the_epoch_does():
    old = registry(1, ("A", 0, 15), ("B", 15, 30))
    assert not chain_changed(old, registry(2, ("A", 0, 15), ("B", 15, 30)))
    assert chain_changed(old, registry(2, ("A", 0, 30)))
    assert chain_changed(old, registry(2, ("A", 0, 10), ("B", 10, 30)))
    assert not chain_changed(old, Registry(0, (), (), {}))  # no plan yet: nothing to move to


def test_the_replay_carries_prompt_and_generated_tokens_from_position_0_at_the_next_step():
    msg = replay_forward("req-1", 2, "H", (5, 6, 7), [40, 41], SAMPLING, 9, prompt_scores=False)
    assert msg.request_id == attempt_id("req-1", 2) == "req-1.r2"
    assert (msg.step, msg.hop, msg.start_pos, msg.head, msg.epoch) == (2, 0, 0, "H", 9)
    assert list(msg.tokens.to_array()) == [5, 6, 7, 40, 41] and msg.sampling == SAMPLING
    msg.check()
    scored = replay_forward("req-1", 1, "H", (5, 6, 7), [40], SAMPLING, 9, prompt_scores=True)
    assert scored.step == 0 and scored.all_logits and list(scored.targets.to_array()) == [6, 7]


def test_every_stage_takes_a_replay_as_a_new_request_and_the_chain_goes_on_at_the_next_step():
    first, last = StageBook(0, 2, 64, VOCAB), StageBook(1, 2, 64, VOCAB)
    replay = replay_forward("req-1", 1, "H", (5, 6, 7), [40, 41], SAMPLING, 4, prompt_scores=False)
    work = first.on_forward(replay, now=1.0)
    assert work.new and (work.step, work.start_pos, work.rows) == (2, 0, 5)
    (out,) = first.complete(work, np.zeros((5, HIDDEN), np.float32), next_peer="S1", first_peer="S0", now=2.0)
    assert isinstance(out.msg, Forward) and out.msg.step == 2 and out.msg.sampling == SAMPLING  # the next stage's first
    work = last.on_forward(out.msg, now=2.0)
    assert work.new and work.sampling == SAMPLING
    outs = last.complete(work, Sampled(42), next_peer=None, first_peer="S0", now=3.0)
    assert [(o.msg.step, o.msg.hop) for o in outs] == [(2, 0), (2, 1)]  # token of step 2, numbered as undisturbed
    work = first.on_token(Token("req-1.r1", 2, 42), now=4.0)
    assert (work.step, work.start_pos, work.new) == (3, 5, False)


def test_a_stage_forgets_the_requests_of_a_dead_head_and_frees_them_once_the_model_is_done():
    book = StageBook(1, 2, 64, VOCAB)
    hidden = WireTensor.from_array(np.ones((2, HIDDEN), np.float32))
    idle = book.on_forward(Forward("a", 0, 1, 0, "DEAD", hidden=hidden, sampling=SAMPLING), now=1.0)
    book.complete(idle, Sampled(3), next_peer=None, first_peer="S0", now=1.5)
    book.on_forward(Forward("b", 0, 1, 0, "DEAD", hidden=hidden, sampling=SAMPLING), now=2.0)  # with the model
    book.on_forward(Forward("c", 0, 1, 0, "ALIVE", hidden=hidden, sampling=SAMPLING), now=2.0)
    assert book.drop_heads({"DEAD"}) == ["a"]  # free now; "b" when its step is done
    assert set(book.requests) == {"b", "c"} and book.requests["b"].cancelled


def test_a_recovery_reports_its_parts_in_seconds():
    r = Recovery("plan epoch 3 changed the chain", noticed=10.0, ready=12.5, sent=12.5, first_token=13.0)
    assert r.to_json()["wait_for_chain_s"] == 2.5 and r.to_json()["replay_s"] == 0.5
    assert r.to_json()["total_s"] == 3.0


def test_the_chain_status_names_the_peers_gone_so_heads_know_which_requests_to_move():
    from swarmd.inference.registry import chain_status

    plan = {"epoch": 2, "stages": [{"peer_id": "A", "layers": [0, 15]}, {"peer_id": "B", "layers": [15, 30]}]}
    ready = {"state": "ready", "layers": [0, 15]}
    status = chain_status(plan, [{"peer_id": "A", "state": "alive", "assignment": ready},
                                 {"peer_id": "B", "state": "dead", "assignment": {"state": "ready", "layers": [15, 30]}}])
    assert not status.ready and status.gone == {"B"} and "gone" in status.detail


# --- detection and re-planning: how fast a dead stage is noticed and replaced (sans-IO) ----------------------


def founder() -> Membership:
    return Membership(local=descriptor(ME), timings=LAN, founder=True)


def deaths(actions) -> list[str]:
    return [a.reason for a in actions if isinstance(a, StateChanged) and a.new == State.DEAD]


def test_a_member_whose_connection_dropped_and_whose_address_refuses_redials_is_dead_within_a_heartbeat():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    m.handle(ConnectionLost(A), now=10.0)
    died = None
    for k in range(1, 8):  # tick probes the suspect again every quarter second; each dial is refused at once
        out = m.handle(ProbeResult(A, ok=False, error="connection refused", refused=True), now=10.0 + 0.25 * k)
        if deaths(out):
            died = (10.0 + 0.25 * k, deaths(out))
            break
    assert died == (10.0 + LAN.heartbeat_interval, ["connection lost and 4 redials refused: connection refused"])
    assert REFUSALS_TO_DIE <= 4
    assert LAN.heartbeat_interval < LAN.suspicion_timeout(2)  # sooner than silence would have


def test_a_reset_link_whose_redials_fail_but_then_reconnect_is_never_dead():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    m.handle(ConnectionLost(A), now=10.0)
    m.handle(ProbeResult(A, ok=False, refused=True), now=10.1)
    m.handle(ProbeResult(A, ok=False, refused=True), now=10.3)
    m.handle(ProbeResult(A, ok=True, rtt_ms=1.0), now=10.5)  # the link is back
    assert m.state_of(A) == State.ALIVE
    m.handle(ConnectionLost(A), now=20.0)  # the count starts again with every drop
    for now in (20.1, 20.3, 20.5):
        m.handle(ProbeResult(A, ok=False, refused=True), now=now)
    m.handle(HeartbeatReceived(heartbeat(A, 2)), now=20.7)  # its heartbeats come round through other members
    m.handle(ProbeResult(A, ok=False, refused=True), now=21.5)
    assert m.state_of(A) == State.ALIVE


def test_redials_that_time_out_or_interleave_with_other_failures_wait_for_the_suspicion_timeout():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    m.handle(ConnectionLost(A), now=10.0)
    for k in range(1, 12):  # a flaky link: refusals never come twice in a row, the other dials time out
        m.handle(ProbeResult(A, ok=False, error="timed out", refused=k % 2 == 0), now=10.0 + 0.25 * k)
    assert m.state_of(A) == State.SUSPECT
    assert deaths(m.tick(now=10.0 + LAN.suspicion_timeout(2) + 0.1)) == ["suspect for a whole timeout without an answer"]


def test_refusals_within_the_first_heartbeat_interval_are_not_yet_enough():
    m = founder()
    m.handle(HeartbeatReceived(heartbeat(A, 1)), now=0.0)
    m.handle(ConnectionLost(A), now=10.0)
    for now in (10.1, 10.2, 10.3, 10.4):
        assert m.handle(ProbeResult(A, ok=False, refused=True), now=now) == []
    assert deaths(m.handle(ProbeResult(A, ok=False, refused=True), now=10.0 + LAN.heartbeat_interval))


def stages_plan(epoch: int, *peers: str) -> Plan:
    n = len(peers)
    return Plan(epoch=epoch, model=ModelRef("smollm2-135m"),
                stages=tuple(Stage(p, (i * 30 // n, (i + 1) * 30 // n)) for i, p in enumerate(peers)))


def leader_planned(*peers: str, experts: dict | None = None) -> PlanCoordinator:
    c = PlanCoordinator(ME, LAN)
    c.handle(Leadership(1, ME), now=0.0)
    members = sorted({*peers, *(p for by in (experts or {}).values() for hs in by.values() for p in hs)})
    c.handle(Candidates(tuple(descriptor(p) for p in members)), now=0.0)
    [make] = c.tick(now=LAN.replan_debounce)
    plan = stages_plan(make.epoch, *peers)
    if experts:
        plan = Plan(epoch=plan.epoch, model=plan.model, stages=plan.stages, experts=experts)
    c.handle(PlanMade(plan, make.basis, make.term), now=LAN.replan_debounce)
    return c


def plans(actions) -> list[MakePlan]:
    return [a for a in actions if isinstance(a, MakePlan)]


def test_the_leader_re_plans_at_once_when_a_stage_holder_is_gone_but_debounces_joins_and_spares():
    c = leader_planned(ME, A)
    c.handle(Candidates((descriptor(ME), descriptor(A), descriptor(B))), now=5.0)  # B joins: no stage lost
    assert plans(c.tick(now=5.0 + LAN.replan_after_loss)) == []
    [make] = plans(c.tick(now=5.0 + LAN.replan_debounce))
    c.handle(PlanMade(stages_plan(make.epoch, ME, A), make.basis, make.term), now=6.5)
    c.handle(Candidates((descriptor(ME), descriptor(A))), now=8.0)  # B held no stage: its loss can wait
    assert plans(c.tick(now=8.0 + LAN.replan_after_loss)) == []
    assert plans(c.tick(now=8.0 + LAN.replan_debounce))
    c = leader_planned(ME, A)
    c.handle(Candidates((descriptor(ME),)), now=5.0)  # A held a stage: the chain is broken
    [make] = plans(c.tick(now=5.0 + LAN.replan_after_loss + 1e-6))
    assert [n.peer_id for n in make.nodes] == [ME] and LAN.replan_after_loss < LAN.replan_debounce


def test_a_plan_is_broken_by_a_lost_stage_or_a_lost_last_holder_of_an_expert_not_by_a_lost_replica():
    experts = {1: {0: (ME,), 1: (A, B), 2: (B,)}}
    plan = Plan(epoch=1, model=ModelRef("smollm2-135m"), stages=(Stage(ME, (0, 30)),), experts=experts)
    assert not plan_broken(plan, frozenset({ME, A, B}))
    assert not plan_broken(plan, frozenset({ME, B}))  # expert 1 keeps its replica on B
    assert plan_broken(plan, frozenset({ME, A}))  # expert 2 lost its only holder
    assert plan_broken(plan, frozenset({A, B}))  # the stage is gone


def test_the_leader_re_plans_at_once_when_an_expert_loses_its_last_holder():
    c = leader_planned(ME, experts={1: {0: (ME,), 1: (A, B), 2: (B,)}})
    c.handle(Candidates((descriptor(ME), descriptor(B))), now=5.0)  # A held only a replica: no hurry
    assert plans(c.tick(now=5.0 + LAN.replan_after_loss + 1e-6)) == []
    [make] = plans(c.tick(now=5.0 + LAN.replan_debounce))
    c.handle(PlanMade(Plan(epoch=make.epoch, model=ModelRef("smollm2-135m"), stages=(Stage(ME, (0, 30)),),
                           experts={1: {0: (ME,), 1: (B,), 2: (B,)}}), make.basis, make.term), now=6.5)
    c.handle(Candidates((descriptor(ME),)), now=8.0)  # B was the last holder of experts 1 and 2
    [make] = plans(c.tick(now=8.0 + LAN.replan_after_loss + 1e-6))
    assert [n.peer_id for n in make.nodes] == [ME]
