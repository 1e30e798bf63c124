"""The head's side of speculative decoding: each speculative request's drafter and k, and its step loop.

A speculative request's last stage answers each step to the head with a `Verified`. `SpecHead.on_verified` hands
its tokens to the request's session, tells the request's `Speculation` how the pass went, drafts (prompt lookup at
once; a draft model on the compute thread) and returns the next step for stage 0 as the handler's result, which the
transport sends and keeps for a repeated frame (a repeated `Verified` gets the same next step, never a second one).
Traced requests get a `spec.draft` span per drafting and a `spec.verify` span per pass (step sent -> tokens back).

Where the controller drafts nothing (drafts fail), the head hands the loop back to the chain: its step carries
`chain`, and from then on the last stage sends each token to stage 0 and the head as without speculation, which
spares the hop to the head and back. The head still scores prompt lookup's guesses against the tokens as they come
(and probes now and then), and takes the loop back (`Speculate` to the last stage) when drafting would pay again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import trio

from models.sampling import SamplingParams
from swarmd.inference.spec.adaptive import Learned
from swarmd.inference.spec.draft_model import DraftModel, DraftRefused, ModelDrafter, load_draft_model
from swarmd.inference.spec.drafting import EMPTY, Drafter, NgramSource
from swarmd.inference.spec.speculation import SpecStats, Speculation, verify_forward
from swarmd.spec_settings import SpecError, SpecRequest, SpecSettings
from swarmd.transport.transport import Send
from swarmd.wire.messages import Speculate, Token, Verified

log = logging.getLogger(__name__)


def as_tokens(msg: Verified) -> list[Token]:
    """A `Verified`'s tokens as the `Token`s a session takes (the finish on the last)."""
    n = len(msg.tokens)
    out = []
    for i, token in enumerate(msg.tokens):
        top = msg.top(i)
        out.append(Token(msg.request_id, msg.step + i, token, msg.logprobs[i] if msg.logprobs else None,
                         tuple(t for t, _ in top), tuple(p for _, p in top), hop=1,
                         finish=msg.finish if i == n - 1 else ""))
    return out


class SpecHead:
    def __init__(self, peer_id: str, default: SpecSettings, *, compute: Any = None, max_requests: int = 4,
                 device: str | None = None) -> None:
        self.peer_id = peer_id
        self.default = default
        self.compute = compute  # the daemon's compute thread: draft models run there
        self.max_requests, self.device = max_requests, device
        self.stats = SpecStats()
        self._models: dict[str, DraftModel | DraftRefused] = {}
        self._learned: dict[str, Learned] = {}  # per draft source (the mode): where its next request starts
        self._lock = trio.Lock()

    # --- settings and drafters ---------------------------------------------------------------------------------

    def settings(self, asked: SpecRequest | None) -> SpecSettings:
        """What a request speculates with (the daemon's default unless it asks); SpecError when it cannot."""
        return self.default if asked is None else asked.resolve(self.default)

    async def draft_model(self, name: str, target_tokens: Sequence[str], max_context: int) -> DraftModel:
        """The draft model `name`, loaded on the compute thread on first use; DraftRefused (remembered) when it
        cannot draft for the served model."""
        async with self._lock:
            if name not in self._models:
                if self.compute is None:
                    self._models[name] = DraftRefused("this daemon cannot run a draft model")
                else:
                    try:
                        self._models[name] = await self.compute.run(
                            lambda: load_draft_model(name, target_tokens, max_context=max_context,
                                                     max_requests=self.max_requests, device=self.device))
                    except DraftRefused as e:
                        self._models[name] = e
            got = self._models[name]
        if isinstance(got, DraftRefused):
            raise got
        return got

    async def drafter(self, settings: SpecSettings, request_id: str, prompt: Sequence[int], params: SamplingParams,
                      seed: int, target_tokens: Sequence[str], max_context: int) -> Drafter:
        name = settings.draft_model
        if name is None:
            return NgramSource(prompt)
        model = await self.draft_model(name, target_tokens, max_context)
        return ModelDrafter(model, request_id, prompt, params, seed)

    def start(self, settings: SpecSettings, drafter: Drafter, *, prompt_len: int, max_tokens: int,
              max_context: int) -> Speculation:
        """A request's speculation, its controller where the last request with the same draft source left off (for
        prompt lookup, whose drafts come from the request's own text: only what a drafted token cost)."""
        learned = self._learned.get(settings.mode)
        if learned is not None and settings.draft_model is None:
            learned = learned.costs_only()
        return Speculation(settings, drafter, prompt_len=prompt_len, max_tokens=max_tokens, max_context=max_context,
                           learned=learned)

    def close(self, spec: Speculation) -> None:
        """The request is over: keep what its controller learned for the next request of its draft source, and free
        its drafter (after any proposal still running on the compute thread)."""
        self._learned[spec.settings.mode] = spec.control.learned()
        if spec.drafter.blocking and self.compute is not None:
            try:
                self.compute.submit(spec.drafter.close, then=lambda value, error: None)
            except RuntimeError:  # the compute handle is closed: the daemon stops, nothing to free
                pass
        else:
            spec.drafter.close()

    # --- the step loop ---------------------------------------------------------------------------------------

    async def on_verified(self, handle: Any, msg: Verified) -> Send | None:
        """A step's tokens for `handle` (a `RequestHandle` whose `spec` is set): its next step, or None when the
        request is over (or moved meanwhile)."""
        spec: Speculation = handle.spec
        now = time.perf_counter()
        if msg.step > 0 and spec.sent_at:
            drafted = msg.drafted
            handle.record("spec.verify", spec.sent_at, now, step=msg.step, drafted=drafted,
                          accepted=min(len(msg.tokens) - 1, drafted) if drafted else 0)
        session = handle.session
        spec.on_verified()
        before = len(session.tokens)
        events = []
        for token in as_tokens(msg):
            events += session.on_token(token)
        drafted, accepted = spec.on_result(msg, now, session.tokens[before:])
        if msg.step > 0:
            self.stats.record_pass(drafted, accepted)
        handle.push(events)
        if session.ended or handle.closed or not session.tokens:
            return None
        # the next step continues the session's history (the same as this step's end unless the request moved)
        next_step = len(session.tokens)
        k = spec.next_k(next_step)
        start = time.perf_counter()
        proposal = EMPTY
        if k > 0:
            proposal = (await self.compute.run(spec.drafter.propose, k, next_step) if spec.drafter.blocking
                        else spec.drafter.propose(k, next_step))
        drafted_at = time.perf_counter()
        if k > 0:
            spec.stats.draft_seconds += drafted_at - start
            self.stats.draft_seconds += drafted_at - start
            handle.record("spec.draft", start, drafted_at, step=next_step, k=len(proposal.tokens))
        if session.ended or handle.closed or msg.request_id != handle.wire_id or len(session.tokens) != next_step:
            return None  # over, or moved meanwhile: the move's replay continues from the session's history
        chain = spec.hands_back(k)
        forward = verify_forward(handle.wire_id, next_step, spec.prompt_len + next_step - 1, self.peer_id,
                                 session.tokens[-1], proposal, handle.registry.epoch, chain=chain)
        spec.in_flight, spec.sent_at = proposal, time.perf_counter()
        if chain:
            spec.handed_back()
        return Send(handle.registry.stage_peer(0), forward)

    def on_chain_token(self, handle: Any, msg: Token, taken: Sequence[int]) -> Send | None:
        """A token that came round the chain (it drives while drafting does not pay): asks the last stage for the
        loop back (`Speculate`) when the controller would draft again."""
        spec: Speculation = handle.spec
        session = handle.session
        if not spec.on_chain_tokens(taken, len(session.tokens)) or session.ended or handle.closed:
            return None
        last = handle.registry.n_stages - 1
        return Send(handle.registry.stage_peer(last), Speculate(handle.wire_id, msg.step, last))


__all__ = ["DraftRefused", "SpecError", "SpecHead", "as_tokens"]
