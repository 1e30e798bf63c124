"""Which drafted tokens the target accepts: the last stage's decision for a verify step. Pure numpy.

A verify step's rows are the last accepted token and the k drafted ones; row i's logits give the target's
distribution p_i for the token after row i. Drafted token d_{i+1} is accepted with probability
min(1, p_i(d) / q_i(d)), where q_i is the distribution the draft was drawn from (one-hot for a deterministic
draft: prompt lookup, or a greedy draft model); at the first rejection the token is drawn from the residual
max(0, p_i - q_i), normalised, and the pass ends; when every draft is accepted, row k gives one more token.
That is the standard speculative-sampling rule (Leviathan et al.; Chen et al.): each token is distributed as the
target's own sampler would draw it. Greedy (temperature 0) is its limit: a draft is accepted while it is the
target's argmax, and the first argmax that differs ends the pass, so the tokens are exactly those of decoding one
at a time.

Every random number comes from a generator seeded by (request seed, step of the token, purpose), so a retried or
replayed pass decides the same; a row that no draft reaches (the bonus token) draws exactly as `models.sampling.
sample` does at that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from models.sampling import SamplingParams, sample, sample_probs

ACCEPT_DRAW, RESIDUAL_DRAW = 1, 2  # purposes of a step's draws beside the plain sample's


@dataclass(frozen=True)
class DraftDistribution:
    """A drafted position's q, sparse: the tokens it gives mass to and their probabilities (summing to 1)."""

    ids: np.ndarray  # int [m]
    probs: np.ndarray  # float [m]

    def of(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def dense(self, vocab: int) -> np.ndarray:
        q = np.zeros(vocab, np.float64)
        np.add.at(q, self.ids.astype(np.int64), self.probs.astype(np.float64))
        return q


@dataclass(frozen=True)
class Verdict:
    """The tokens a verify step yields (steps step, step+1, ...): the accepted drafts, then the target's own."""

    tokens: tuple[int, ...]
    accepted: int  # drafted tokens accepted: len(tokens) - 1


def step_draw(seed: int, step: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, step, purpose])


def verify(logits: np.ndarray, draft: Sequence[int], params: SamplingParams, *, seed: int, step: int,
           q: Sequence[DraftDistribution] | None = None) -> Verdict:
    """Decide a verify step: `logits` (k+1, vocab) for the rows [last token, d_1..d_k]; `draft` = d_1..d_k; `q` the
    draft's distribution at each drafted position (None: deterministic drafts, q = one-hot). Row i decides the
    token of step `step + i`."""
    k = len(draft)
    if logits.ndim != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"a verify step of {k} drafts needs {k + 1} rows of logits, not {logits.shape}")
    if q is not None and len(q) != k:
        raise ValueError(f"{k} drafts but {len(q)} draft distributions")
    out: list[int] = []
    for i, d in enumerate(draft):
        s = step + i
        if params.greedy:
            token = sample(logits[i], params, seed=seed, step=s)
            if token != d:
                return Verdict((*out, token), i)
            out.append(token)
            continue
        p = sample_probs(logits[i], params)
        qd = 1.0 if q is None else q[i].of(int(d))
        if qd > 0 and step_draw(seed, s, ACCEPT_DRAW).random() * qd < p[d]:
            out.append(int(d))
            continue
        residual = p.copy()
        if q is None:
            residual[d] = 0.0
        else:
            residual = np.maximum(residual - q[i].dense(p.size), 0.0)
        return Verdict((*out, _draw(residual if residual.sum() > 0 else p, seed, s)), i)
    return Verdict((*out, sample(logits[k], params, seed=seed, step=step + k)), k)


def _draw(weights: np.ndarray, seed: int, step: int) -> int:
    cdf = np.cumsum(weights)
    u = step_draw(seed, step, RESIDUAL_DRAW).random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), weights.size - 1))
