"""A stage's batch on the compute thread: free finished requests' KV caches, reserve slots for new ones, run
every job in one forward, and on the last stage sample each request's token (seeded by request and step).
A job may run only part of its rows (`Job.take`: a chunk of a long prefill); its step's output is made once
its last rows have run.

`run_batch` is a generator: a MoE stage whose experts live elsewhere yields an `ExpertCall` per block and is
resumed with the answer (`advance`); `advance_here` answers from this daemon's own shard without leaving the
thread. Only blocking compute happens here; the stage actor (`swarmd.inference.stage.actor`) does the I/O around it.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from swarmd.inference.moe.local import LocalExperts
from swarmd.inference.stage.book import Sampled, Work
from swarmd.inference.stage.job import Job

PROMPT_SCORE_ROWS = 64  # rows of (rows, vocab) logits turned into log-probs at a time (bounds the memory)


class ExpertsFailed(Exception):
    """Asking a MoE block's experts failed; thrown into the stage's forward where it waits for them."""


def advance(steps: Generator[Any, Any, None], answer: Any, error: Exception | None) -> tuple[bool, Any]:
    """Resume `steps` with the answer to its last question (or the error getting it raised there):
    (True, None) when it is finished, else (False, its next question)."""
    try:
        return False, steps.throw(error) if error is not None else steps.send(answer)
    except StopIteration:
        return True, None


def advance_here(steps: Generator[Any, Any, None], answer: Any, error: Exception | None,
                 local: LocalExperts | None) -> tuple[bool, Any]:
    """`advance`, then, on this same thread, every expert call that this daemon's own shard can answer (`local`);
    (True, None) when the batch is finished, else (False, the call for the router)."""
    done, call = advance(steps, answer, error)
    while not done and local is not None:
        here = local.answer(call)
        if here is None:
            break
        done, call = advance(steps, here, None)
    return done, call


def run_batch(jobs: Sequence[Job], frees: Sequence[tuple[Any, str]]) -> Generator[Any, Any, None]:
    """Free finished requests, reserve KV slots for new ones, run every job in one forward (blocking;
    a generator that yields a MoE block's `ExpertCall` whenever the stage's experts live elsewhere)."""
    from models.errors import ModelError
    from models.kv_cache import KVCacheFull

    for model, rid in frees:
        model.free_request(rid)
    ready: list[Job] = []
    for job in jobs:
        if job.offset:
            pass  # a prefill's next chunk: its slot is held since its first
        elif job.work.adopt:
            try:
                job.model.adopt_request(job.work.adopt, job.work.request_id, job.work.start_pos)
            except ModelError as e:  # the head moves the request again, with a full replay
                job.model.free_request(job.work.adopt)
                job.error = ("resume_failed", f"stage {_stage_name(job.model)}: {e}")
                continue
        elif job.work.new:
            try:
                job.model.add_request(job.work.request_id)
            except KVCacheFull as e:
                job.error = ("kv_cache_full", f"stage {_stage_name(job.model)}: {e} (retry when a request ends)")
                continue
        elif job.work.rollback is not None:  # the drafts a verify step wrote and the target rejected
            try:
                job.model.rollback(job.work.request_id, job.work.rollback)
            except ModelError as e:
                job.error = ("model_error", f"stage {_stage_name(job.model)}: {e}")
                continue
        ready.append(job)
    if not ready:
        return
    try:
        yield from _forward(ready)
    except ModelError as e:
        if len(ready) == 1:
            ready[0].error = ("model_error", str(e))
            return
        for job in ready:  # find the job at fault; the others run alone (cache rows are overwritten, not appended)
            try:
                yield from _forward([job])
            except ModelError as one:
                job.error = ("model_error", str(one))
    except ExpertsFailed as e:  # the MoE router found no expert to answer: the step fails, the stage goes on
        for job in ready:
            job.error = ("experts_unavailable", f"stage {_stage_name(job.model)}: {e}")


def _forward(jobs: Sequence[Job]) -> Generator[Any, Any, None]:
    from models.stage import StageInput

    model = jobs[0].model
    inputs = []
    for j in jobs:
        rows = j.take or j.rows_left
        inputs.append(StageInput(j.work.request_id, j.work.start_pos + j.offset, j.work.data[j.offset:j.offset + rows],
                                 j.work.all_logits and model.is_last, verify=j.work.verify,
                                 greedy=model.is_last and picks_greedily(j.work)))
    started = time.perf_counter()
    outputs = yield from model.forward_steps(inputs)
    computed = time.perf_counter()
    for job, inp, out in zip(jobs, inputs, outputs, strict=True):
        job.offset += len(inp.data)
        if not model.is_last or job.work.all_logits:  # every row's output is the step's; else the last row's
            job.parts.append(out)
        if job.offset < job.work.rows:
            continue  # more chunks to run
        if len(job.parts) > 1:
            out = np.concatenate(job.parts)
        job.parts = []
        job.output = sample_step(out, job.work) if model.is_last else out.reshape(job.work.rows, model.hidden_size)
    ended = time.perf_counter()
    for job in jobs:
        job.started, job.computed, job.ended, job.batch = started, computed, ended, len(jobs)


def _stage_name(model: Any) -> str:
    return f"blocks {model.start}-{model.end - 1}"


def picks_greedily(work: Work) -> bool:
    """Whether the last stage needs only the step's greedy token (the stage picks it, on its device), not the logits."""
    s = work.sampling
    return s is not None and s.temperature == 0 and not s.logprobs and work.draft is None and not work.all_logits


def sample_step(logits: np.ndarray, work: Work) -> Sampled:
    """The last stage's part of a step: the token (seeded by request and step) and the log-probs asked for;
    `logits` is the token itself (shape ()) where the stage picked it (`picks_greedily`)."""
    from models.sampling import SamplingParams, sample, token_logprob, top_logprobs

    s = work.sampling
    assert s is not None
    if logits.ndim == 0:
        return Sampled(int(logits))
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)
    if work.draft is not None:
        return verify_step(logits, work, params)
    last = logits[-1] if logits.ndim == 2 else logits
    token = sample(last, params, seed=s.seed, step=work.step)
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    if s.logprobs:
        logprob = token_logprob(last, token)
        top = tuple(top_logprobs(last, s.logprobs))
    if not work.all_logits:
        return Sampled(token, logprob, top)
    lps, ids, tops = score_rows(logits[:-1], work.targets, s.logprobs)
    return Sampled(token, logprob, top, lps, ids, tops)


def verify_step(logits: np.ndarray, work: Work, params: Any) -> Sampled:
    """The last stage's part of a verify step: which drafts the target accepts, and the token after them."""
    from models.sampling import token_logprob, top_logprobs
    from swarmd.inference.spec.acceptance import verify

    s, draft = work.sampling, work.draft
    assert s is not None and draft is not None
    verdict = verify(logits, [int(t) for t in draft.tokens.to_array()], params, seed=s.seed, step=work.step)
    logprobs: tuple[float, ...] = ()
    tops: tuple[tuple[tuple[int, float], ...], ...] = ()
    if s.logprobs:
        logprobs = tuple(token_logprob(logits[i], t) for i, t in enumerate(verdict.tokens))
        tops = tuple(tuple(top_logprobs(logits[i], s.logprobs)) for i in range(len(verdict.tokens)))
    return Sampled(verdict.tokens[-1], tokens=verdict.tokens, logprobs=logprobs, tops=tops)


def score_rows(logits: np.ndarray, targets: np.ndarray | None, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: the log-prob of its target token and the k most likely tokens with theirs (most likely first)."""
    n = logits.shape[0]
    lps = np.zeros(n, dtype=np.float32)
    ids = np.zeros((n, k), dtype=np.int32)
    tops = np.zeros((n, k), dtype=np.float32)
    for lo in range(0, n, PROMPT_SCORE_ROWS):
        x = logits[lo:lo + PROMPT_SCORE_ROWS].astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        logp = x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))
        rows = np.arange(len(x))
        if targets is not None:
            lps[lo:lo + len(x)] = logp[rows, targets[lo:lo + len(x)]]
        if k:
            part = np.argpartition(-logp, k - 1, axis=1)[:, :k]
            for r in rows:
                order = part[r][np.lexsort((part[r], -logp[r, part[r]]))]  # most likely first, then lower id
                ids[lo + r] = order
                tops[lo + r] = logp[r, order]
    return lps, ids, tops
