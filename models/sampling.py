"""Choosing the next token from logits: greedy, temperature, top-k, top-p; pure numpy.

Every random draw comes from a generator seeded by (request seed, step), so a step that is retried
(after a dropped stream, or on another node) picks the same token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # None: the caller picks one per request
    max_tokens: int = 256
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The generator for one (request seed, step): the same pair always draws the same numbers."""
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, step])


def sample_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution `sample` draws from (float64, sums to 1), after temperature, top-k and top-p."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    x = np.where(np.isnan(x), -np.inf, x)
    if params.greedy:
        probs = np.zeros_like(x)
        probs[int(np.argmax(x))] = 1.0
        return probs
    z = x / params.temperature
    if 0 < params.top_k < z.size:
        kth = np.partition(z, z.size - params.top_k)[z.size - params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    z = z - np.max(z)
    probs = np.exp(z)
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]  # mass of the tokens ranked above each one
        keep = np.zeros(probs.size, dtype=bool)
        keep[order[before < params.top_p]] = True  # the top token always stays
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


def sample(logits: np.ndarray, params: SamplingParams, *, seed: int, step: int) -> int:
    """The token for one step. Greedy (temperature 0) is argmax, lowest id on ties."""
    if params.greedy:
        x = np.asarray(logits, dtype=np.float64).reshape(-1)
        return int(np.argmax(np.where(np.isnan(x), -np.inf, x)))
    probs = sample_probs(logits, params)
    cdf = np.cumsum(probs)
    u = step_rng(seed, step).random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.size - 1))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities (float64); a NaN logit counts as -inf, as in `sample`."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    x = np.where(np.isnan(x), -np.inf, x)
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


def top_logprobs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens and their log-probabilities under the raw logits, most likely first
    (OpenAI's `logprobs.top_logprobs`)."""
    lp = log_softmax(logits)
    k = max(0, min(k, lp.size))
    if k == 0:
        return []
    top = np.argpartition(-lp, k - 1)[:k]
    top = top[np.lexsort((top, -lp[top]))]
    return [(int(i), float(lp[i])) for i in top]


def token_logprob(logits: np.ndarray, token_id: int) -> float:
    """Log-probability of the chosen token under the raw logits (OpenAI's `logprobs.content[].logprob`)."""
    return float(log_softmax(logits)[token_id])
