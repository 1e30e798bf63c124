"""How many tokens to draft for the next pass: from the acceptance seen so far and what passes cost. Sans-IO.

With a per-token acceptance rate a, a pass of k drafts yields on average E(k) = 1 + a + ... + a^k tokens and costs
t(k) seconds from one result to the next (drafting included). The controller drafts the k in [0, limit] that makes
E(k) / t(k) largest: over a WAN, where a pass costs about the same for one position or many, k grows with a; where
computing the rows dominates (loopback), each extra row must pay for itself; where drafts fail (a below MIN_ACCEPT,
or no k promising MIN_GAIN over none), k = 0: speculation switches itself off, and every `probe_every` passes (doubling while probes fail, up to `max_probe`)
one pass drafts a token again to see whether the text has changed.

A request's controller starts where the last request with the same draft source ended (`Learned`): its acceptance,
weighed as PRIOR_TRIALS trials, what a drafted token cost beside a pass (the prior slope), and its probe spacing if it
ended off. So a draft model that fails for the served model is not paid for again by every request (its catch-up
prefill and a few passes of drafts), only by its probes, which are spaced further apart than prompt lookup's; the
request's own passes soon outweigh what it was handed. Prompt lookup drafts from each request's own context, so its
requests take over only the cost of a drafted token (`Learned.costs_only`): a chat request whose text never repeats
says nothing of the next request, which may edit code it quotes.

a is estimated from recent passes (successes over trials, each pass decayed by `decay`): a pass of k drafts with m
accepted is m successes in m + (1 if m < k) trials. t(k) is a line a0 + a1 k fitted to the recent passes' times per
k (a prior slope until two values of k have been seen).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ACCEPT = 0.4  # acceptance assumed before any pass: try a couple of drafts, more once they are accepted
PRIOR_TRIALS = 2.0  # its weight in trials
PRIOR_SLOPE = 0.1  # an extra drafted row costs this fraction of a one-row pass until measured
MIN_ACCEPT = 0.1  # below this acceptance drafting gains at most 11 %: within the noise of the costs, so none
MIN_GAIN = 0.03  # drafting must promise this much more than a pass without drafts
PROBES = (8, 64)  # the first and the longest spacing of probes, in passes (or tokens while the chain drives)
# a draft model's probe first catches up on every token since it last ran (a prefill, on the head's compute): about
# 6 tokens' time where it shares the stages' CPU (docs/BENCHMARKS.md), so from 128 tokens apart it costs under 5 %
PROBES_MODEL = (128, 1024)


@dataclass(frozen=True)
class Learned:
    """Where a draft source's next request starts: the acceptance its last request ended with, a drafted token's
    cost as a fraction of a pass without drafts, and (if that request ended with drafting off) its probe spacing and
    the passes since its last probe."""

    acceptance: float = PRIOR_ACCEPT
    slope: float = PRIOR_SLOPE
    probe_gap: int | None = None
    off_passes: int = 0

    def costs_only(self) -> Learned:
        """What the chain taught (a drafted token's cost), without what the text taught (acceptance, probes): for
        prompt lookup, whose drafts come from each request's own context, so that one request's text says nothing
        of the next one's."""
        return Learned(slope=self.slope)


@dataclass
class AdaptiveK:
    limit: int  # the most tokens drafted per pass
    adaptive: bool = True  # False: always `limit` (for comparisons)
    decay: float = 0.9  # weight of the history at each new pass
    probe_every: int = PROBES[0]
    max_probe: int = PROBES[1]
    successes: float = PRIOR_ACCEPT * PRIOR_TRIALS
    trials: float = PRIOR_TRIALS
    prior_slope: float = PRIOR_SLOPE  # a drafted token's cost as a fraction of a pass, until two k are measured
    _times: dict[int, tuple[float, float]] = field(default_factory=dict)  # k -> (decayed weight, mean seconds)
    _off_passes: int = 0  # passes in a row without drafts since the controller chose 0
    _probe_gap: int = 0

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"limit must be >= 0, not {self.limit}")
        self._probe_gap = self.probe_every

    @property
    def acceptance(self) -> float:
        return self.successes / self.trials if self.trials > 0 else PRIOR_ACCEPT

    @classmethod
    def starting_from(cls, learned: Learned, limit: int, *, adaptive: bool = True,
                      probes: tuple[int, int] = PROBES) -> AdaptiveK:
        control = cls(limit, adaptive=adaptive, successes=learned.acceptance * PRIOR_TRIALS, trials=PRIOR_TRIALS,
                      prior_slope=learned.slope, probe_every=probes[0], max_probe=probes[1])
        if learned.probe_gap is not None:
            control._probe_gap, control._off_passes = learned.probe_gap, learned.off_passes
        return control

    def learned(self) -> Learned:
        """What the next request of this source starts from."""
        off = self.adaptive and self.best_k() == 0
        slope, intercept = self.cost_line()
        return Learned(self.acceptance, slope / intercept, self._probe_gap if off else None,
                       self._off_passes if off else 0)

    def next_k(self) -> int:
        """Drafts for the next pass (the head may propose fewer: a draft source can run dry)."""
        if not self.adaptive or self.limit == 0:
            return self.limit
        best = self.best_k()
        if best > 0:
            self._off_passes, self._probe_gap = 0, self.probe_every
            return best
        self._off_passes += 1
        if self._off_passes >= self._probe_gap:  # a probe: one draft, to see whether drafts are accepted again
            self._off_passes = 0
            self._probe_gap = min(2 * self._probe_gap, self.max_probe)
            return 1
        return 0

    def best_k(self) -> int:
        a = min(self.acceptance, 0.999)
        if a < MIN_ACCEPT:
            return 0
        slope, intercept = self.cost_line()
        best, best_rate, expected, term = 0, 0.0, 0.0, 1.0
        plain = 1.0 / max(intercept, 1e-9)  # a pass without drafts
        for k in range(self.limit + 1):
            expected += term  # E(k) = 1 + a + ... + a^k
            term *= a
            rate = expected / max(intercept + slope * k, 1e-9)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best if best_rate >= plain * (1 + MIN_GAIN) else 0

    def cost_line(self) -> tuple[float, float]:
        """(seconds per drafted token, seconds of a pass without drafts), from the passes seen."""
        if not self._times:
            return self.prior_slope, 1.0
        ws = [(w, k, t) for k, (w, t) in self._times.items()]
        total = sum(w for w, _, _ in ws)
        mk = sum(w * k for w, k, _ in ws) / total
        mt = sum(w * t for w, _, t in ws) / total
        var = sum(w * (k - mk) ** 2 for w, k, _ in ws)
        if len(ws) >= 2 and var > 0:
            slope = max(sum(w * (k - mk) * (t - mt) for w, k, t in ws) / var, 0.0)
            return slope, max(mt - slope * mk, 1e-6)
        base = mt / (1 + self.prior_slope * mk)
        return self.prior_slope * base, base

    def observe(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """A pass with `drafted` tokens drafted, `accepted` of them accepted, `seconds` from the last result to
        this one (None: not timed, e.g. the first pass)."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted")
        if drafted:
            self.successes = self.successes * self.decay + accepted
            self.trials = self.trials * self.decay + accepted + (1 if accepted < drafted else 0)
        if seconds is not None and seconds > 0:
            for k, (w, t) in list(self._times.items()):
                self._times[k] = (w * self.decay, t)
            w, t = self._times.get(drafted, (0.0, seconds))
            self._times[drafted] = (w + 1.0, t + (seconds - t) / (w + 1.0))
