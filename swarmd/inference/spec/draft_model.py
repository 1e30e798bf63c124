"""A small draft model on the head: `--speculate model:NAME`, e.g. smollm2-135m drafting for smollm2-moe-8x2.

The draft model is the whole model in one `models.stage.StageModel` on the head's compute thread, with a KV slot per
request that drafts with it. A `ModelDrafter` keeps that slot in step with the request: before each proposal it
rolls the cache back to the longest prefix it shares with the accepted tokens and feeds what follows (one verify-
style call: every row as a one-position step), then decodes k tokens one at a time. Each drafted token is drawn as
`models.sampling.sample` draws the target's at that step (the argmax for greedy requests; for sampled ones the same
random number of (request seed, step)), so where the two models agree the target accepts it
(`swarmd.inference.spec.acceptance`).

A draft model must have the target's vocabulary (the same token strings, in the same order): `load_draft_model`
refuses any other with a clear error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.sampling import SamplingParams, sample
from swarmd.inference.spec.drafting import EMPTY, Proposal

log = logging.getLogger(__name__)

PREFILL_FROM = 8  # this many tokens or more to catch up with go through a prefill, fewer as one-position rows


class DraftRefused(Exception):
    """The named draft model cannot draft for this target (unknown, or another vocabulary)."""


@dataclass
class DraftModel:
    name: str
    stage: Any  # models.stage.StageModel, every block

    @property
    def max_context(self) -> int:
        return int(self.stage.max_context)


def check_draft_model(name: str, target_tokens: Sequence[str]) -> Path:
    """The GGUF of the draft model `name` (a known model name or a .gguf path); DraftRefused when there is none or
    its vocabulary is not the target's. Reads the header only."""
    from models.catalog.names import resolve_model
    from models.errors import ModelError
    from models.gguf.header import read_header

    try:
        path = resolve_model(name).path
        header = read_header(path)
    except (ModelError, OSError) as e:
        raise DraftRefused(f"draft model {name!r}: {e}") from None
    tokens = list(header.kv.get("tokenizer.ggml.tokens", []))
    if tokens != list(target_tokens):
        differ = next((i for i, (a, b) in enumerate(zip(tokens, target_tokens, strict=False)) if a != b),
                      min(len(tokens), len(target_tokens)))
        raise DraftRefused(f"draft model {name!r} has another vocabulary than the served model ({len(tokens)} "
                           f"tokens against {len(target_tokens)}, first difference at id {differ}): a draft model "
                           "must share the target's tokenizer")
    return path


def load_draft_model(name: str, target_tokens: Sequence[str], *, max_context: int, max_requests: int,
                     device: str | None = None) -> DraftModel:
    """Load `name` as a draft model (`check_draft_model` first). Blocking: the compute thread's work."""
    from models.stage import SERVING_NUMERICS, StageModel

    path = check_draft_model(name, target_tokens)
    stage = StageModel.from_gguf(path, max_context=max_context, max_requests=max_requests, device=device,
                                 numerics=SERVING_NUMERICS)
    log.info("draft model %s loaded (%d blocks)", name, stage.n_blocks)
    return DraftModel(name, stage)


class ModelDrafter:
    """One request's drafts from a `DraftModel`. `propose` is blocking (call it on the compute thread)."""

    blocking = True

    def __init__(self, model: DraftModel, request_id: str, context: Sequence[int], params: SamplingParams,
                 seed: int) -> None:
        self.model, self.request_id, self.params, self.seed = model, f"draft-{request_id}", params, seed
        self.context: list[int] = [int(t) for t in context]
        self.fed: list[int] = []  # the tokens whose KV rows the draft model's cache holds for this request
        self.slot = False

    def accept(self, tokens: Sequence[int]) -> None:
        self.context += [int(t) for t in tokens]

    def propose(self, k: int, step: int) -> Proposal:
        from models.kv_cache import KVCacheFull
        from models.stage import StageInput

        stage = self.model.stage
        k = min(k, self.model.max_context - len(self.context))
        if k <= 0:
            return EMPTY
        if not self.slot:
            try:
                stage.add_request(self.request_id)
            except KVCacheFull:
                return EMPTY  # every draft slot is taken: this pass goes without
            self.slot = True
        common = 0
        for a, b in zip(self.fed, self.context, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(self.context) - 1)  # the last token is fed again: its row gives the next logits
        stage.rollback(self.request_id, common)
        todo = np.asarray(self.context[common:], dtype=np.int32)
        verify = len(todo) < PREFILL_FROM
        out = stage.forward([StageInput(self.request_id, common, todo, verify=verify)])[0]
        logits = out[-1] if out.ndim == 2 else out
        self.fed = list(self.context)
        tokens: list[int] = []
        for i in range(k):
            token = sample(logits, self.params, seed=self.seed, step=step + i)
            tokens.append(token)
            if i + 1 < k:
                logits = stage.forward([StageInput(self.request_id, len(self.fed), np.asarray([token], np.int32))])[0]
                self.fed.append(token)
        return Proposal(tuple(tokens))

    def close(self) -> None:
        if self.slot:
            self.model.stage.free_request(self.request_id)
            self.slot = False
