"""A speculative request's loop on its head, without a chain (`Speculation`, sans-IO): the tokens are those of
decoding one at a time whatever the drafts; k stays within what the request has left; the loop goes back to the
chain where drafts fail and returns when they would pay."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from models.sampling import SamplingParams
from swarmd.inference.spec.acceptance import verify
from swarmd.inference.spec.adaptive import Learned
from swarmd.inference.spec.drafting import NgramSource
from swarmd.inference.spec.head import SpecHead
from swarmd.inference.spec.speculation import SpecStats, Speculation, verify_forward
from swarmd.spec_settings import SpecSettings
from swarmd.wire import Verified

VOCAB = 16


def target_logits(context: list[int], a: int, b: int) -> np.ndarray:
    """A toy target: the next token is a function of the last two (so its text falls into cycles)."""
    logits = np.zeros(VOCAB, np.float32)
    logits[(a * context[-1] + b * context[-2]) % VOCAB] = 1.0
    return logits


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=12), st.integers(1, 7), st.integers(0, 7),
       st.integers(1, 6), st.integers(4, 40))
def test_the_loop_yields_the_tokens_of_decoding_one_at_a_time(prompt, a, b, k, max_tokens):
    want = list(prompt)
    for _ in range(max_tokens):
        want.append(int(np.argmax(target_logits(want, a, b))))
    spec = Speculation(SpecSettings("ngram", k), NgramSource(prompt), prompt_len=len(prompt), max_tokens=max_tokens,
                       max_context=10_000)
    context = list(prompt)
    first = int(np.argmax(target_logits(context, a, b)))  # the prompt's step
    msg = Verified("r", 0, (first,))
    passes = 0
    while True:
        context += msg.tokens
        spec.on_result(msg, now=float(passes), taken=msg.tokens)
        step = len(context) - len(prompt)
        if step >= max_tokens:
            break
        n = spec.next_k(step)
        assert 0 <= n <= min(k, max_tokens - 1 - step)
        proposal = spec.drafter.propose(n, step) if n else None
        drafts = list(proposal.tokens) if proposal else []
        rows = [target_logits(context + drafts[:i], a, b) for i in range(len(drafts) + 1)]
        verdict = verify(np.stack(rows), drafts, SamplingParams(), seed=1, step=step)
        msg = Verified("r", step, verdict.tokens, drafted=len(drafts))
        passes += 1
    assert context[len(prompt):len(prompt) + max_tokens] == want[len(prompt):]
    assert spec.stats.passes == passes and spec.stats.accepted <= spec.stats.drafted


def test_where_drafts_fail_the_loop_goes_back_to_the_chain_and_returns_when_guesses_come_true():
    spec = Speculation(SpecSettings("ngram", 4), NgramSource([1, 2, 3, 4]), prompt_len=4, max_tokens=500,
                       max_context=10_000)
    spec.on_result(Verified("r", 0, (9,)), 0.0, (9,))
    step, k, now = 1, None, 0.0
    for i in range(30):  # every draft fails: k falls to 0, which hands the loop back
        k = spec.next_k(step)
        if spec.hands_back(k):
            break
        now += 0.1 + 0.005 * k  # a pass over a WAN: its rows cost little beside the hops
        spec.on_result(Verified("r", step, (20 + i,), drafted=k), now, (20 + i,))
        step += 1
    assert spec.hands_back(k)
    spec.handed_back()
    took_back = []
    for t in [5, 6, 7, 8] * 10:  # the chain's tokens now repeat: prompt lookup guesses them right
        took_back.append(spec.on_chain_tokens([t], step))
        step += 1
        if took_back[-1]:
            break
    planned = spec.planned_k
    assert took_back[-1] and len(took_back) < 40 and planned
    assert spec.next_k(step) == planned  # the first pass after taking the loop back drafts what made it take it


def _fail_every_draft(spec: Speculation) -> int:
    """Run `spec` with every draft rejected until it hands the loop to the chain; the passes it took."""
    spec.on_result(Verified("r", 0, (9,)), 0.0, (9,))
    step, now = 1, 0.0
    while not spec.hands_back(k := spec.next_k(step)):
        now += 0.1 + 0.03 * k
        spec.on_result(Verified("r", step, (20 + step,), drafted=k), now, (20 + step,))
        step += 1
    return step


def test_a_heads_next_request_of_a_failing_draft_model_hands_the_loop_to_the_chain_at_once():
    head = SpecHead("H", SpecSettings("ngram", 4))
    settings = SpecSettings("model:small", 4)

    def start() -> Speculation:  # (any drafter: the controller goes by the draft source, the mode)
        return head.start(settings, NgramSource([1, 2, 3, 4]), prompt_len=4, max_tokens=500, max_context=10_000)

    first = start()
    assert _fail_every_draft(first) > 2  # the first request paid a few passes of drafts to learn that
    head.close(first)
    second = start()
    second.on_result(Verified("r2", 0, (9,)), 0.0, (9,))
    assert second.hands_back(second.next_k(1))
    # another draft source learns for itself
    other = head.start(SpecSettings("model:other", 4), NgramSource([1]), prompt_len=1, max_tokens=500,
                       max_context=10_000)
    assert other.next_k(1) > 0


def test_prompt_lookups_next_request_drafts_from_its_own_text_and_keeps_only_the_cost_of_a_draft():
    head = SpecHead("H", SpecSettings("ngram", 4))
    settings = SpecSettings("ngram", 4)

    def start() -> Speculation:
        return head.start(settings, NgramSource([1, 2, 3, 4]), prompt_len=4, max_tokens=500, max_context=10_000)

    first = start()
    _fail_every_draft(first)
    slope = first.control.learned().slope
    head.close(first)
    second = start()  # a chat request that never repeats itself says nothing of one that quotes what it edits
    second.on_result(Verified("r2", 0, (9,)), 0.0, (9,))
    assert second.next_k(1) > 0
    assert second.control.prior_slope == slope != Learned().slope


def test_k_leaves_room_for_the_requests_last_token_and_its_context():
    spec = Speculation(SpecSettings("ngram", 6, adaptive=False), NgramSource([]), prompt_len=10, max_tokens=8,
                       max_context=20)
    assert spec.next_k(5) == 2  # steps 5, 6, 7: the last is max_tokens - 1
    assert spec.next_k(1) == 6
    tight = Speculation(SpecSettings("ngram", 6, adaptive=False), NgramSource([]), prompt_len=16, max_tokens=64,
                        max_context=20)
    assert tight.next_k(2) == 2  # the last token sits at position 17: rows up to 19


def test_a_verify_step_carries_the_last_token_and_the_drafts():
    from swarmd.inference.spec.drafting import Proposal

    msg = verify_forward("r", 6, 20, "H", 3, Proposal((4, 5)), 2)
    assert msg.rows == 3 and list(msg.tokens.to_array()) == [3, 4, 5] and msg.draft.k == 2
    assert list(msg.draft.tokens.to_array()) == [4, 5]
    assert verify_forward("r", 6, 20, "H", 3, Proposal(()), 2, chain=True).draft is None


def test_the_accepted_length_histogram_counts_passes_by_bucket():
    stats = SpecStats()
    for accepted in (0, 0, 1, 4, 5, 40):
        stats.record_pass(8, min(accepted, 8))
    out = stats.to_json()
    assert out["passes"] == 6 and out["accepted"] == 18 and out["drafted"] == 48
    assert out["accepted_length"]["0"] == 2 and out["accepted_length"]["4"] == 1 and out["accepted_length"]["6"] == 1
    assert out["accepted_length"]["8"] == 1
