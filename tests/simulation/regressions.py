"""Scenarios the simulation once failed, kept as values (a change to how seeds draw scenarios leaves them as they
were), each with what it found."""

from __future__ import annotations

from tests.simulation.scenario import Fault, Request, Scenario

REGRESSIONS: dict[str, Scenario] = {
    # A hung member, then the leader's crash: the hung one and the others each elected a leader on the same
    # term. Terms are ballots now (a round and the leader's tag).
    "two leaders on one term": Scenario(
        seed=24, model="dense", daemons=8, behind_nat=(2,),
        requests=(Request(at=2.01, head=1, prompt=(99,), max_tokens=4, seed=825, temperature=0.8),
                  Request(at=2.17, head=0, prompt=(250, 3), max_tokens=6, seed=886, temperature=0.8)),
        faults=(Fault(at=0.46, kind="freeze", pick=22105, lasts=5.79, amount=0.138),
                Fault(at=2.0, kind="crash_leader", pick=33280, lasts=0.0, amount=0.138),
                Fault(at=3.84, kind="crash_leader", pick=48103, lasts=0.0, amount=0.185))),
    # A black hole between a head and a stage: the stage's input frames arrived once it lifted, after the head
    # had given up telling the stage the request was over, and the stage held the request. Cancels are now
    # retried as long as a frame may arrive.
    "a late frame after a lost cancel": Scenario(
        seed=14, model="moe", daemons=6, behind_nat=(),
        requests=(Request(at=2.21, head=2, prompt=(99,), max_tokens=4, seed=674, temperature=0.0),
                  Request(at=1.4, head=3, prompt=(250, 3), max_tokens=4, seed=269, temperature=0.0),
                  Request(at=2.7, head=2, prompt=(7, 100, 7, 100, 9), max_tokens=6, seed=823, temperature=0.0)),
        faults=(Fault(at=0.6, kind="black_hole", pick=36088, lasts=0.0, amount=0.029),
                Fault(at=1.35, kind="crash_expert_holder", pick=35920, lasts=2.02, amount=0.084))),
    # The head's daemon stopped while one of its requests unwound: the head asked its closed nursery to tell
    # the stages, and the daemon ended with an error instead of stopping.
    "a head stopping mid-request": Scenario(
        seed=47, model="dense", daemons=4, behind_nat=(),
        requests=(Request(at=1.03, head=3, prompt=(250, 3), max_tokens=8, seed=41, temperature=0.8),
                  Request(at=1.98, head=0, prompt=(1, 2, 3, 4), max_tokens=6, seed=965, temperature=0.8),
                  Request(at=1.44, head=0, prompt=(7, 100, 7, 100, 9), max_tokens=8, seed=437, temperature=0.0),
                  Request(at=1.57, head=2, prompt=(250, 3), max_tokens=4, seed=34, temperature=0.0)),
        faults=(Fault(at=0.39, kind="delay", pick=33139, lasts=0.0, amount=0.186),
                Fault(at=2.75, kind="partition", pick=25687, lasts=0.0, amount=0.029),
                Fault(at=3.38, kind="crash_any", pick=61738, lasts=4.72, amount=0.123))),
    # A black hole between a MoE stage and the only holder of some experts: the stage's step waited for their
    # answer after the head had cancelled every request in it, and held the stage (and the requests' KV slots)
    # until the expert call timed out. A step whose requests are all cancelled now stops waiting.
    "a stage waiting on experts for cancelled requests": Scenario(
        seed=781, model="moe", daemons=4, behind_nat=(1, 2), stages=3,
        requests=(Request(at=0.33, head=3, prompt=(40, 41, 42), max_tokens=6, seed=449, temperature=0.8),
                  Request(at=2.97, head=2, prompt=(7, 100, 7, 100, 9), max_tokens=4, seed=615, temperature=0.0),
                  Request(at=2.38, head=0, prompt=(12, 13, 14, 15, 16, 17), max_tokens=4, seed=452, temperature=0.8)),
        faults=(Fault(at=0.21, kind="black_hole", pick=15115, lasts=0.0, amount=0.089),)),
    # A crashed head and a link reset while a MoE stage's hot step waited on an expert holder's answer: the head
    # cancelled the request, the step stopped waiting and failed, and the part it had asked stayed awaited in the
    # router until the expert call's timeout. A hot fan-out's parts are now awaited no more once its answer (or
    # failure) is taken. Found by a longer sweep (seeds 1917 and 2180).
    "a hot fan-out part left awaited after its step was given up": Scenario(
        seed=1917, model="moe", daemons=3, behind_nat=(), stages=2,
        requests=(Request(at=1.76, head=2, prompt=(99,), max_tokens=8, seed=856, temperature=0.0),
                  Request(at=0.32, head=1, prompt=(12, 13, 14, 15, 16, 17), max_tokens=4, seed=339, temperature=0.0)),
        faults=(Fault(at=0.54, kind="delay", pick=42567, lasts=0.0, amount=0.109),
                Fault(at=0.55, kind="crash_head", pick=22148, lasts=1.54, amount=0.163),
                Fault(at=2.93, kind="reset", pick=59565, lasts=4.69, amount=0.092))),
    # A stage frozen mid-prefill sent its output, after the thaw, to the peer that had been the next stage; that
    # peer had restarted and held other blocks at the same hop under a newer plan, computed them on it and sent
    # a token that was wrong, and the head's replay went on from it. A stage now refuses a step sent for a plan
    # older than the one it has held its blocks under (`stale_plan`), and the head moves the request.
    "a step computed by a stage re-planned under it": Scenario(
        seed=6635, model="dense", daemons=3, behind_nat=(), stages=3,
        requests=(Request(at=0.78, head=2, prompt=(99,), max_tokens=6, seed=903, temperature=0.0),
                  Request(at=2.4, head=1, prompt=(99,), max_tokens=6, seed=308, temperature=0.0)),
        faults=(Fault(at=1.7, kind="freeze", pick=18452, lasts=3.82, amount=0.098),
                Fault(at=1.7, kind="reset", pick=50557, lasts=3.34, amount=0.02),
                Fault(at=2.06, kind="crash_head", pick=25181, lasts=2.51, amount=0.097),
                Fault(at=2.35, kind="crash_any", pick=10828, lasts=0.0, amount=0.109))),
    # A MoE stage's step waited for experts on a hung holder while the prefill of another request queued behind
    # it; a new plan replaced the stage's model, its book let the request go and queued its KV cache's free. The
    # next batch of the old model freed it, then ran the queued prefill, which took a slot nobody would free. A
    # queued step whose request its book no longer holds is now dropped before it runs.
    "a queued prefill of a request its replaced stage had let go": Scenario(
        seed=8387, model="moe", daemons=4, behind_nat=(),
        requests=(Request(at=1.47, head=2, prompt=(12, 13, 14, 15, 16, 17), max_tokens=4, seed=615, temperature=0.0),
                  Request(at=2.73, head=1, prompt=(1, 2, 3, 4), max_tokens=6, seed=973, temperature=0.0),
                  Request(at=2.88, head=0, prompt=(12, 13, 14, 15, 16, 17), max_tokens=6, seed=860, temperature=0.0),
                  Request(at=2.14, head=2, prompt=(250, 3), max_tokens=8, seed=819, temperature=0.8)),
        faults=(Fault(at=0.71, kind="reset", pick=28381, lasts=0.0, amount=0.137),
                Fault(at=0.93, kind="black_hole", pick=6578, lasts=0.0, amount=0.188),
                Fault(at=2.48, kind="freeze", pick=32364, lasts=0.0, amount=0.086))),
}
