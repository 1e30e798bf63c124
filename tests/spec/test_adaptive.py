"""How many tokens the head drafts (`AdaptiveK`): more while they are accepted and passes cost about the same
whatever their rows, none where drafts fail, and probes now and then to notice when they work again."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from swarmd.inference.spec.adaptive import PROBES_MODEL, AdaptiveK


def run(control: AdaptiveK, passes: int, accept, seconds) -> list[int]:
    """Drive `control` for `passes` passes: `accept(k)` drafted tokens accepted, `seconds(k)` a pass's time."""
    ks = []
    for _ in range(passes):
        k = control.next_k()
        ks.append(k)
        control.observe(k, accept(k), seconds(k))
    return ks


def test_drafts_that_are_always_accepted_over_a_slow_link_draft_the_limit():
    ks = run(AdaptiveK(8), 30, accept=lambda k: k, seconds=lambda k: 0.100 + 0.001 * k)
    assert ks[-10:] == [8] * 10


def test_drafts_that_always_fail_switch_speculation_off_but_for_rarer_and_rarer_probes():
    ks = run(AdaptiveK(8), 200, accept=lambda k: 0, seconds=lambda k: 0.050 + 0.010 * k)
    late = ks[40:]
    assert set(late) <= {0, 1} and 0 < sum(late) <= 6
    probes = [i for i, k in enumerate(ks) if k and i >= 10]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps)  # each failed probe waits longer for the next


def test_when_rows_cost_compute_an_extra_draft_must_pay_for_itself():
    # each extra row costs 30 % of a pass; half the drafts accepted: one or two drafts beat eight
    half = iter([1, 0] * 200)
    ks = run(AdaptiveK(8), 200, accept=lambda k: min(k, next(half)), seconds=lambda k: 0.010 * (1 + 0.3 * k))
    assert max(ks[-50:]) <= 2


def test_a_fixed_controller_always_drafts_its_limit():
    assert run(AdaptiveK(5, adaptive=False), 10, accept=lambda k: 0, seconds=lambda k: 1.0) == [5] * 10


@given(st.integers(0, 16), st.lists(st.tuples(st.integers(0, 16), st.integers(0, 16), st.floats(0.001, 1.0)),
                                    max_size=40))
def test_k_never_exceeds_the_limit_and_the_estimates_stay_in_range(limit, passes):
    control = AdaptiveK(limit)
    for drafted, accepted, seconds in passes:
        k = control.next_k()
        assert 0 <= k <= limit
        control.observe(drafted, min(accepted, drafted), seconds)
        assert 0.0 <= control.acceptance <= 1.0
        slope, intercept = control.cost_line()
        assert slope >= 0 and intercept > 0


def test_a_request_starts_where_the_last_request_of_its_draft_source_ended():
    failing = AdaptiveK(8)
    run(failing, 12, accept=lambda k: 0, seconds=lambda k: 0.050 + 0.010 * k)
    learned = failing.learned()
    assert learned.probe_gap is not None
    # the next request drafts nothing from its first pass, and its probes keep the spacing the failures earned
    nxt = AdaptiveK.starting_from(learned, 8)
    ks = run(nxt, learned.probe_gap - learned.off_passes, accept=lambda k: 0, seconds=lambda k: 0.05)
    assert ks[:-1] == [0] * (len(ks) - 1) and ks[-1] == 1
    # a source whose drafts were accepted starts drafting at once
    good = AdaptiveK(8)
    run(good, 12, accept=lambda k: k, seconds=lambda k: 0.100 + 0.001 * k)
    assert good.learned().probe_gap is None
    assert AdaptiveK.starting_from(good.learned(), 8).next_k() > 0


def test_a_request_soon_outweighs_what_it_was_handed():
    failing = AdaptiveK(8)
    run(failing, 12, accept=lambda k: 0, seconds=lambda k: 0.050 + 0.010 * k)
    # the text changed: the probes' drafts are accepted now, and drafting resumes within a few probes
    nxt = AdaptiveK.starting_from(failing.learned(), 8)
    ks = run(nxt, 200, accept=lambda k: k, seconds=lambda k: 0.100 + 0.001 * k)
    assert ks[-10:] == [8] * 10
    assert sum(1 for k in ks[:ks.index(8)] if k) <= 3


def test_a_draft_models_probes_are_spaced_further_apart_than_prompt_lookups():
    def probes(control: AdaptiveK) -> int:
        return sum(1 for k in run(control, 3000, accept=lambda k: 0, seconds=lambda k: 0.05)[100:] if k)

    first, longest = PROBES_MODEL
    lookup, model = probes(AdaptiveK(8)), probes(AdaptiveK(8, probe_every=first, max_probe=longest))
    assert lookup >= 40 and 0 < model <= lookup // 5
