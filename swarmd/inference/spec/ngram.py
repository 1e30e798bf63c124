"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the context's last n-gram
(n from 3 down to 2).

No model: a request's own context (its prompt and what it generated) is the draft's only source, which is strong
where the output repeats its input (code being edited, quoting, summaries that reuse phrases) and proposes nothing
elsewhere. Sans-IO: `extend` with the tokens as they are accepted, `propose(k)` for up to k drafted tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_NGRAM = 3  # the longest suffix looked up; the longest that matches wins
MIN_NGRAM = 2  # a single token recurs everywhere ("the", a space): too weak a cue to draft from


class NgramDrafter:
    """Keeps, for every n-gram (n in [MIN_NGRAM, MAX_NGRAM]) of the context, where it last ended."""

    def __init__(self, context: Iterable[int] = (), *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, not {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # n-gram -> the index just past its latest occurrence that is not the context's own suffix
        self._latest: dict[tuple[int, ...], int] = {}
        self._pending: dict[tuple[int, ...], int] = {}  # the suffixes' own ends, filed once a token follows them
        self.extend(context)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append accepted tokens to the context."""
        for t in tokens:
            self._latest.update(self._pending)  # the suffixes now have a token after them: they can be looked up
            self.tokens.append(int(t))
            end = len(self.tokens)
            self._pending = {tuple(self.tokens[end - n:]): end for n in range(self.min_ngram, self.max_ngram + 1)
                             if end >= n}

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens of the context (rebuilt: rare, after a request moved)."""
        if n < len(self.tokens):
            kept = self.tokens[:n]
            self.tokens, self._latest, self._pending = [], {}, {}
            self.extend(kept)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix ([] if none)."""
        if k <= 0:
            return []
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            at = self._latest.get(tuple(self.tokens[end - n:]))
            if at is not None:
                # what followed; a match close to the end runs into the suffix itself, which continues the pattern
                out = []
                for i in range(k):
                    j = at + i
                    out.append(self.tokens[j] if j < end else out[j - end])
                return out
        return []
