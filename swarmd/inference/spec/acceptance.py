"""Which drafted tokens the target accepts: the last stage's decision for a verify step. Pure numpy.

A verify step's rows are the last accepted token and the k drafted ones; row i's logits give the target's
distribution for the token of step `step + i`. That token is drawn exactly as `models.sampling.sample` draws it at
that step (from the request's seed and the step; the argmax at temperature 0), and drafted token d_{i+1} is
accepted if it is that token: the first that differs ends the pass with the target's token; when every draft is
accepted, row k gives one more. So a speculative request yields, token for token, what decoding one at a time
yields, greedy or sampled, whatever was drafted and however many drafts each pass held (the controller's k follows
timings): a seeded request replays exactly.

A draft is accepted with the target's probability of it: for deterministic drafts (prompt lookup, a greedy draft
model) as under the speculative-sampling rule of Leviathan et al.; a sampled draft model draws with the target's
random number of that step (`swarmd.inference.spec.draft_model`), so where its distribution is close to the
target's it draws the same token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from models.sampling import SamplingParams, sample


@dataclass(frozen=True)
class Verdict:
    """The tokens a verify step yields (steps step, step+1, ...): the accepted drafts, then the target's own."""

    tokens: tuple[int, ...]
    accepted: int  # drafted tokens accepted: len(tokens) - 1


def verify(logits: np.ndarray, draft: Sequence[int], params: SamplingParams, *, seed: int, step: int) -> Verdict:
    """Decide a verify step: `logits` (k+1, vocab) for the rows [last token, d_1..d_k]; `draft` = d_1..d_k. Row i
    decides the token of step `step + i`."""
    k = len(draft)
    if logits.ndim != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"a verify step of {k} drafts needs {k + 1} rows of logits, not {logits.shape}")
    out: list[int] = []
    for i, d in enumerate(draft):
        token = sample(logits[i], params, seed=seed, step=step + i)
        if token != d:
            return Verdict((*out, token), i)
        out.append(token)
    return Verdict((*out, sample(logits[k], params, seed=seed, step=step + k)), k)
