"""Prompt lookup (`NgramDrafter`): a draft is what followed the latest earlier occurrence of the context's end."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from swarmd.inference.spec.ngram import NgramDrafter

tokens = st.lists(st.integers(0, 6), max_size=60)


def reference(context: list[int], k: int, max_n: int = 3, min_n: int = 2) -> list[int]:
    """The rule by brute force: longest suffix first, latest earlier occurrence, continued periodically."""
    end = len(context)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = context[end - n:]
        for at in range(end - 1, n - 1, -1):  # `at` is just past an occurrence that ends before the context does
            if context[at - n:at] == suffix:
                seq = list(context)
                return [seq.append(seq[at + i]) or seq[at + i] for i in range(k)]
    return []


@given(tokens, st.integers(0, 8))
def test_a_proposal_is_what_followed_the_latest_earlier_occurrence_of_the_longest_matching_suffix(context, k):
    assert NgramDrafter(context).propose(k) == reference(context, k)


@given(tokens, tokens, st.integers(1, 8))
def test_extending_token_by_token_proposes_what_the_whole_context_does(a, b, k):
    grown = NgramDrafter(a)
    for t in b:
        grown.extend([t])
    assert grown.propose(k) == NgramDrafter(a + b).propose(k)


@given(tokens, st.integers(0, 60), st.integers(1, 8))
def test_truncating_forgets_what_came_after(context, n, k):
    d = NgramDrafter(context)
    d.truncate(n)
    assert d.tokens == context[:n] and d.propose(k) == NgramDrafter(context[:n]).propose(k)


def test_code_being_rewritten_is_drafted_from_the_original():
    original = [10, 11, 12, 13, 14, 15, 16, 17]
    d = NgramDrafter([*original, 99, 10, 11])
    assert d.propose(4) == [12, 13, 14, 15]


def test_a_repeating_pattern_continues_past_the_end_of_the_context():
    assert NgramDrafter([1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]
    assert NgramDrafter([7, 7, 7]).propose(3) == [7, 7, 7]


def test_nothing_is_proposed_for_a_fresh_pair_a_lone_recurring_token_or_an_empty_context():
    assert NgramDrafter([1, 2, 3]).propose(4) == []
    assert NgramDrafter([5, 1, 2, 3, 5]).propose(4) == []
    assert NgramDrafter([5, 1, 2, 3, 5], min_ngram=1).propose(2) == [1, 2]
    assert NgramDrafter([]).propose(4) == []
