"""What a pipeline stage knows about the requests passing through it, and what it sends on. Sans-IO.

`StageBook` takes the stage's messages (a `Forward`, on stage 0 a `Token`, a `Cancel`) and the clock, and
answers with `Work` for the model and, once the model has run it, the messages to send: hidden states to the
next stage; on the last stage the sampled token to stage 0 (the next step) and to the head, plus the prompt's
log-probs for teacher forcing. It checks that each step follows the last (the transport already drops
repeats) and that a cache is never written out of order. A request ends on `Cancel`, on an error, or when
it has been idle too long; the trio code (`swarmd.inference.stage.actor`) then frees its KV cache. The model itself (forward,
sampling) is not called from here.

A stage holds at most `slots` requests (its KV cache slots). A new request that finds them all taken waits in
line here (`must_wait`, `wait`: `in_line`, before it has a phase), first come first served, until one frees
(`release_line`, which reserves the slot for it); at most `max_in_line` wait, and one more is refused as `busy`
(its head puts it back in its queue). `version` changes whenever a request takes or leaves a slot or lines up:
heads read it, with `used`, from the stage's heartbeat (`swarmd.inference.head.slots`).

A moved request's first Forward may name the attempt it continues: the stage then adopts that attempt's KV cache
if it holds it, and computes only the positions it lacks (`swarmd.inference.head.hop_local`).

A request's phase changes only through `REQUEST_TRANSITIONS` (a pair not in it raises LocalProtocolError):

    waiting --BEGIN--> running --COMPLETE--> waiting          (a step goes to the model and comes back)
    running --CANCEL--> cancelled --COMPLETE or FAIL--> gone   (freed once the model is done with it)
    waiting --CANCEL, EXPIRE, ADOPTED or FAIL--> gone;  running --FAIL--> gone;  any --CLEAR--> gone
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from swarmd.errors import LocalProtocolError, RemoteProtocolError
from swarmd.inference.head.hop_local import SentRows, keep_positions
from swarmd.wire.codec import WireTensor
from swarmd.wire.messages import Draft, Error, Forward, Logprobs, Message, Sampling, Token, Verified


class StageRefusal(RemoteProtocolError):
    """A message the stage will not act on; `code` and the message go to the request's head."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Work:
    """One step of one request for the model: rows from `start_pos`."""

    request_id: str
    step: int
    start_pos: int
    data: np.ndarray  # int32 token ids (stage 0) or float32 hidden states
    new: bool = False  # the request needs a KV slot first
    all_logits: bool = False
    targets: np.ndarray | None = None  # teacher forcing, last stage: the token each row but the last predicts
    sampling: Sampling | None = None  # last stage
    adopt: str = ""  # the KV slot is this earlier attempt's, its first `start_pos` positions kept
    resume_of: str = ""  # the request continues this attempt: send the next stage every row from position 0
    draft: Draft | None = None  # a verify step: the rows after the first are these drafted tokens
    chain: bool = False  # a speculative request's head hands the loop back to the chain from this step on
    rollback: int | None = None  # the cache holds positions past `start_pos` (rejected drafts): drop them first

    @property
    def verify(self) -> bool:
        return self.draft is not None

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])


@dataclass(frozen=True)
class Sampled:
    """What the last stage computed for one step: the token and, when asked, log-probs."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: np.ndarray | None = None  # float32 [rows - 1], with all_logits
    prompt_top_ids: np.ndarray | None = None  # int32 [rows - 1, k]
    prompt_top_logprobs: np.ndarray | None = None  # float32 [rows - 1, k]
    # a verify step: the tokens of steps step, step + 1, ... (accepted drafts, then the target's own), each
    # token's log-prob and top alternatives when asked for
    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    tops: tuple[tuple[tuple[int, float], ...], ...] = ()


class RequestPhase(enum.Enum):
    WAITING = "waiting"  # between steps: the next one may begin
    RUNNING = "running"  # a step is with the model
    CANCELLED = "cancelled"  # cancelled while running: forgotten once the model is done
    GONE = "gone"  # forgotten here: its KV cache is to be freed (or was adopted by a later attempt)


class RequestEvent(enum.Enum):
    BEGIN = "begin"  # a step goes to the model
    COMPLETE = "complete"  # the model ran it
    FAIL = "fail"  # the model could not run it, or its output could not be built
    CANCEL = "cancel"
    EXPIRE = "expire"  # idle too long
    ADOPTED = "adopted"  # a later attempt of the request took its KV cache over
    CLEAR = "clear"  # the stage's model was replaced


_P, _E = RequestPhase, RequestEvent
REQUEST_TRANSITIONS: dict[tuple[RequestPhase, RequestEvent], RequestPhase] = {
    (_P.WAITING, _E.BEGIN): _P.RUNNING,
    (_P.RUNNING, _E.COMPLETE): _P.WAITING,
    (_P.CANCELLED, _E.COMPLETE): _P.GONE,
    (_P.RUNNING, _E.CANCEL): _P.CANCELLED,
    (_P.CANCELLED, _E.CANCEL): _P.CANCELLED,
    (_P.WAITING, _E.CANCEL): _P.GONE,
    (_P.WAITING, _E.EXPIRE): _P.GONE,
    (_P.WAITING, _E.ADOPTED): _P.GONE,
    **{(p, _E.FAIL): _P.GONE for p in (_P.WAITING, _P.RUNNING, _P.CANCELLED)},
    **{(p, _E.CLEAR): _P.GONE for p in (_P.WAITING, _P.RUNNING, _P.CANCELLED)},
}


@dataclass
class RequestState:
    request_id: str
    head: str
    epoch: int
    sampling: Sampling
    position: int = 0  # tokens this stage's cache holds for the request
    floor: int = 0  # a speculative request's next step may start from here (positions before it are accepted)
    drives: bool = False  # a speculative request's head drafts its steps (else the chain closes the loop itself)
    step: int = -1  # the last step this stage has run (or is running)
    phase: RequestPhase = RequestPhase.WAITING
    last_active: float = 0.0
    sent: SentRows | None = None  # the rows sent on, by position (every stage but the last)

    @property
    def busy(self) -> bool:
        """A step is with the model."""
        return self.phase in (RequestPhase.RUNNING, RequestPhase.CANCELLED)

    @property
    def cancelled(self) -> bool:
        """Cancelled while busy: free once the model is done."""
        return self.phase is RequestPhase.CANCELLED


@dataclass(frozen=True)
class Out:
    """A message to send: `peer` is a peer id."""

    peer: str
    msg: Message


def finish_reason(token: int, step: int, cache_len: int, sampling: Sampling, max_context: int) -> str:
    """Why the request ends after the token of `step` ("" if it goes on). The same rule as `swarmd run`:
    an end-of-generation token stops; max_tokens or a full context ends it for length."""
    if token in sampling.stop_ids:
        return "stop"
    if (sampling.max_tokens and step + 1 >= sampling.max_tokens) or cache_len >= max_context:
        return "length"
    return ""


@dataclass
class StageBook:
    hop: int
    n_stages: int
    max_context: int
    vocab_size: int
    wire_dtype: str | None = None  # None: hidden states travel in their compute dtype (lossless)
    slots: int = 1 << 30  # requests held at once (the model's KV cache slots)
    max_in_line: int = 0  # new requests that may wait for a slot; 0: as many as there are slots
    requests: dict[str, RequestState] = field(default_factory=dict)
    in_line: dict[str, str] = field(default_factory=dict)  # request id -> head: first steps waiting for a slot
    reserved: set[str] = field(default_factory=set)  # taken from `waiting`: their slot is held for them
    version: int = 0  # changes whenever `used` may have
    since_epoch: int = 0  # the plan epoch since which this stage has held its blocks at this hop

    @property
    def is_first(self) -> bool:
        return self.hop == 0

    @property
    def is_last(self) -> bool:
        return self.hop == self.n_stages - 1

    # --- slots -------------------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Slots taken (a cancelled request still running keeps its slot until the model is done with it)."""
        return len(self.requests) + len(self.reserved)

    def must_wait(self, msg: Forward) -> bool:
        """Whether this request's first step must wait for a slot (every slot taken, or others wait first);
        StageRefusal `busy` when too many wait already. A moved request continuing an attempt this stage holds
        idle takes that attempt's slot over and never waits."""
        self._check_plan(msg)
        first = msg.step == 0 or msg.sampling is not None
        if not first or msg.request_id in self.reserved or msg.request_id in self.requests:
            return False
        old = self.requests.get(msg.resume_of) if msg.resume_of else None
        if old is not None and not old.busy and not old.cancelled:
            return False
        if not self.in_line and self.used < self.slots:
            return False
        if len(self.in_line) >= (self.max_in_line or self.slots):
            raise StageRefusal("busy", f"all {self.slots} KV cache slots of stage {self.hop} are taken and "
                                       f"{len(self.in_line)} requests wait for one")
        return True

    def wait(self, request_id: str, head: str) -> None:
        self.in_line[request_id] = head
        self.version += 1

    def release_line(self) -> list[str]:
        """Waiting requests that now have a slot (reserved for them), first come first served."""
        out = []
        while self.in_line and self.used < self.slots:
            rid = next(iter(self.in_line))
            del self.in_line[rid]
            self.reserved.add(rid)
            out.append(rid)
        return out

    # --- messages in -> work ------------------------------------------------------------------------------

    def _check_plan(self, msg: Forward) -> None:
        """A step sent for a plan older than this stage's blocks came through a chain cut elsewhere: its hidden
        state need not start at this stage's first block (a stage that restarted, or was re-planned, with the
        same hop). StageRefusal `stale_plan`: the head moves the request to the current chain."""
        if msg.epoch < self.since_epoch:
            raise StageRefusal("stale_plan", f"step {msg.step} of {msg.request_id} was sent for plan epoch "
                                             f"{msg.epoch}; this stage has held its blocks since epoch "
                                             f"{self.since_epoch}")

    def on_forward(self, msg: Forward, now: float) -> Work:
        self._check_plan(msg)
        self.reserved.discard(msg.request_id)  # the slot held for it is now its own, or free again if refused
        data = self._rows(msg)
        # A request's first Forward is step 0, or a later step carrying the sampling settings: the head moved
        # the request to a new chain and replays its tokens so far (prompt and generated) from position 0.
        first = msg.step == 0 or msg.sampling is not None
        if first:
            if msg.request_id in self.requests:
                raise StageRefusal("duplicate_request", f"request {msg.request_id} is already running here")
            if msg.start_pos != 0:
                raise StageRefusal("bad_position", "a request's first step must start at position 0")
            position = 0
        else:
            state = self._ready(msg.request_id, msg.step)
            position = state.position
            if state.sampling.speculative:  # the step may start before the cache's end: drafts were rejected
                if not state.floor <= msg.start_pos <= position:
                    raise StageRefusal("bad_position", f"step {msg.step} starts at position {msg.start_pos}; this "
                                                       f"stage holds {position} tokens of request {msg.request_id}, "
                                                       f"{state.floor} of them accepted")
            elif msg.draft is not None:
                raise StageRefusal("bad_draft", f"request {msg.request_id} was not started as a speculative one")
            elif msg.start_pos != position:
                raise StageRefusal("bad_position", f"step {msg.step} starts at position {msg.start_pos}; this "
                                                   f"stage holds {position} tokens of request {msg.request_id}")
        if msg.start_pos + len(data) > self.max_context:
            raise StageRefusal("context_full", f"{msg.start_pos + len(data)} tokens exceed this stage's context "
                                               f"of {self.max_context}")
        start, adopt = msg.start_pos, ""
        if first:
            state = RequestState(msg.request_id, msg.head, msg.epoch, msg.sampling or Sampling(), last_active=now,
                                 sent=None if self.is_last else SentRows(self.max_context),
                                 drives=msg.sampling is not None and msg.sampling.speculative)
            start = self._adopt(msg.resume_of, state, len(data)) if msg.resume_of else 0
            adopt = msg.resume_of if start else ""
            self.requests[msg.request_id] = state
            self.version += 1
        state = self.requests[msg.request_id]
        targets = msg.targets.to_array().astype(np.int32) if msg.targets is not None else None
        rollback = msg.start_pos if not first and msg.start_pos < state.position else None
        return self._begin(state, Work(msg.request_id, msg.step, start, data[start - msg.start_pos:], first,
                                       msg.all_logits, targets, state.sampling if self.is_last else None,
                                       adopt=adopt, resume_of=msg.resume_of, draft=msg.draft, rollback=rollback,
                                       chain=msg.chain), now)

    def _adopt(self, old_id: str, state: RequestState, total: int) -> int:
        """Take over what this stage holds of the attempt `old_id` (idle, not cancelled) for `state`: the
        positions kept (0: nothing, the stage computes them all; the old attempt is then left to `cancel`)."""
        old = self.requests.get(old_id)
        if old is None or old.busy or old.cancelled:
            return 0
        keep = keep_positions(old.position, None if old.sent is None else old.sent.length, total)
        if keep == 0:
            return 0
        self._fire(old, RequestEvent.ADOPTED)
        state.position, state.sent = keep, old.sent
        if state.sent is not None:
            state.sent.truncate(keep)
        return keep

    def on_token(self, msg: Token, now: float) -> Work:
        """Stage 0: the token sampled at `msg.step` is the input of the next step."""
        if not self.is_first:
            raise StageRefusal("wrong_hop", f"tokens go to stage 0; this is stage {self.hop}")
        if msg.token >= self.vocab_size:
            raise StageRefusal("bad_token", f"token {msg.token} outside the vocabulary of {self.vocab_size}")
        state = self._ready(msg.request_id, msg.step + 1)
        data = np.asarray([msg.token], dtype=np.int32)
        if state.position + 1 > self.max_context:
            raise StageRefusal("context_full", f"request {msg.request_id} fills this stage's context of "
                                               f"{self.max_context}")
        return self._begin(state, Work(msg.request_id, msg.step + 1, state.position, data,
                                       sampling=state.sampling if self.is_last else None), now)

    def next_decode(self, request_id: str, step: int, start_pos: int | None, epoch: int | None, data: np.ndarray,
                    now: float) -> Work | None:
        """A plain one-row decode step (not a request's first, not a speculative one's) that follows the request's
        last where it ends: its Work, begun. None, with nothing changed, when it is not such a step or would be
        refused (`on_forward` and `on_token` say why). Stage 0 takes the token (`start_pos`, `epoch`: None)."""
        state = self.requests.get(request_id)
        if (state is None or state.busy or state.sampling.speculative or step != state.step + 1
                or state.position + 1 > self.max_context):
            return None
        if start_pos is None:
            if not self.is_first or not 0 <= int(data[0]) < self.vocab_size:
                return None
        elif self.is_first or start_pos != state.position or epoch is None or epoch < self.since_epoch:
            return None
        return self._begin(state, Work(request_id, step, state.position, data,
                                       sampling=state.sampling if self.is_last else None), now)

    def _rows(self, msg: Forward) -> np.ndarray:
        if self.is_first:
            if msg.tokens is None:
                raise StageRefusal("bad_shape", "stage 0 takes token ids")
            return msg.tokens.to_array().astype(np.int32)
        if msg.hidden is None:
            raise StageRefusal("bad_shape", f"stage {self.hop} takes hidden states")
        return msg.hidden.to_array("float32")

    def _ready(self, request_id: str, step: int) -> RequestState:
        state = self.requests.get(request_id)
        if state is None or state.cancelled:
            raise StageRefusal("unknown_request", f"request {request_id} is not running here (finished, "
                                                  "cancelled or timed out)")
        # a speculative request's steps advance by the tokens each pass yielded
        ahead = step > state.step if state.sampling.speculative else step == state.step + 1
        if state.busy or not ahead:
            raise StageRefusal("out_of_order", f"step {step} of request {request_id} arrived while this stage "
                                               f"{'runs' if state.busy else 'has run'} step {state.step}")
        return state

    def _begin(self, state: RequestState, work: Work, now: float) -> Work:
        self._fire(state, RequestEvent.BEGIN)
        state.step, state.last_active = work.step, now
        return work

    def _fire(self, state: RequestState, event: RequestEvent) -> RequestPhase:
        """Move the request along `REQUEST_TRANSITIONS`; gone: it is forgotten here."""
        try:
            state.phase = REQUEST_TRANSITIONS[(state.phase, event)]
        except KeyError:
            raise LocalProtocolError(f"request {state.request_id}: {event.value} while {state.phase.value}") from None
        if state.phase is RequestPhase.GONE:
            del self.requests[state.request_id]
            self.version += 1  # its slot is free
        return state.phase

    # --- the model's output -> messages out -----------------------------------------------------------------

    def complete(self, work: Work, output: np.ndarray | Sampled, *, next_peer: str | None, first_peer: str,
                 now: float) -> list[Out]:
        """The model ran `work`: advance the request and say what to send (nothing if it was cancelled)."""
        if not self.completed(work, output, now):
            return []
        return self.outputs(work, output, next_peer=next_peer, first_peer=first_peer)

    def completed(self, work: Work, output: np.ndarray | Sampled, now: float) -> bool:
        """`complete`'s transition: the request moves past `work`; False if it was cancelled while the model ran
        it (it is gone here)."""
        state = self.requests[work.request_id]
        state.last_active = now
        state.position = work.start_pos + work.rows
        state.floor = work.start_pos + 1 if work.verify else state.position  # a verify step's drafts may be rejected
        if self._fire(state, RequestEvent.COMPLETE) is RequestPhase.GONE:  # cancelled while the model ran it
            return False
        if not self.is_last:
            assert isinstance(output, np.ndarray) and state.sent is not None
            state.sent.put(work.start_pos, output)
        return True

    def outputs(self, work: Work, output: np.ndarray | Sampled, *, next_peer: str | None,
                first_peer: str) -> list[Out]:
        """What a `completed` step sends."""
        state = self.requests[work.request_id]
        if not self.is_last:
            assert isinstance(output, np.ndarray) and next_peer is not None and state.sent is not None
            # a moved request's next stage may hold nothing of it: it gets every row, and keeps what it can
            start, rows = (0, state.sent.upto(state.position)) if work.resume_of else (work.start_pos, output)
            hidden = _wire_tensor(rows, self.wire_dtype)
            targets = WireTensor.from_array(work.targets) if work.targets is not None else None
            return [Out(next_peer, Forward(work.request_id, work.step, self.hop + 1, start, state.head,
                                           hidden=hidden, epoch=state.epoch, all_logits=work.all_logits,
                                           sampling=state.sampling if work.new else None, targets=targets,
                                           resume_of=work.resume_of, draft=work.draft, chain=work.chain))]
        assert isinstance(output, Sampled)
        if work.chain:
            state.drives = False
        if state.sampling.speculative and state.drives:
            return [Out(state.head, self._verified(work, output, state))]
        out: list[Out] = []
        if output.prompt_logprobs is not None:
            assert output.prompt_top_ids is not None and output.prompt_top_logprobs is not None
            out.append(Out(state.head, Logprobs(work.request_id, work.step,
                                                WireTensor.from_array(output.prompt_logprobs.astype(np.float32)),
                                                WireTensor.from_array(output.prompt_top_ids.astype(np.int32)),
                                                WireTensor.from_array(output.prompt_top_logprobs.astype(np.float32)))))
        finish = finish_reason(output.token, work.step, state.position, state.sampling, self.max_context)
        ids = tuple(i for i, _ in output.top)
        lps = tuple(p for _, p in output.top)
        if not finish:
            out.append(Out(first_peer, Token(work.request_id, work.step, output.token, output.logprob, ids, lps,
                                             hop=0)))
        out.append(Out(state.head, Token(work.request_id, work.step, output.token, output.logprob, ids, lps, hop=1,
                                         finish=finish)))
        return out

    def _verified(self, work: Work, output: Sampled, state: RequestState) -> Verified:
        """A speculative request's step, for its head: the tokens it yielded, up to the one that ends the request."""
        if work.verify:
            tokens, logprobs, tops = output.tokens, output.logprobs, output.tops
        else:
            tokens = (output.token,)
            logprobs = () if output.logprob is None else (output.logprob,)
            tops = (output.top,)
        finish, n = "", 0
        for i, token in enumerate(tokens):
            n = i + 1
            # the cache as decoding one token at a time would hold it when this token is sampled
            held = work.start_pos + (i if work.verify else work.rows - 1) + 1
            finish = finish_reason(token, work.step + i, held, state.sampling, self.max_context)
            if finish:
                break
        top = [t for per in tops[:n] for t in per] if state.sampling.logprobs else []
        return Verified(work.request_id, work.step, tuple(tokens[:n]), drafted=work.draft.k if work.draft else 0,
                        logprobs=tuple(logprobs[:n]), top_ids=tuple(i for i, _ in top),
                        top_logprobs=tuple(p for _, p in top), finish=finish)

    def drive(self, request_id: str) -> bool:
        """A speculative request's head takes the loop back: its next steps go to the head (False: not here)."""
        state = self.requests.get(request_id)
        if state is None or not self.is_last or not state.sampling.speculative:
            return False
        state.drives = True
        return True

    def fail(self, work: Work, code: str, message: str) -> Out | None:
        """The model could not run `work`, or its output could not be built: the request ends here; the head is
        told why."""
        state = self.requests.get(work.request_id)
        if state is None:
            return None
        self._fire(state, RequestEvent.FAIL)
        return Out(state.head, Error(code, message, request_id=work.request_id, step=work.step, hop=self.hop))

    # --- ends ---------------------------------------------------------------------------------------------

    def cancel(self, request_id: str) -> bool:
        """Forget the request; True if its KV cache can be freed now (False: none, or the model still runs it).
        A request waiting for a slot, or given one it has not taken yet, just leaves."""
        if self.in_line.pop(request_id, None) is not None or request_id in self.reserved:
            self.reserved.discard(request_id)
            self.version += 1
            return False
        state = self.requests.get(request_id)
        if state is None:
            return False
        return self._fire(state, RequestEvent.CANCEL) is RequestPhase.GONE

    def expire(self, now: float, idle: float) -> list[str]:
        """Requests idle for `idle` seconds (their head is gone or forgot them): forgotten; free their caches."""
        stale = [s for s in self.requests.values() if not s.busy and now - s.last_active >= idle]
        for s in stale:
            self._fire(s, RequestEvent.EXPIRE)
        return [s.request_id for s in stale]

    def drop_heads(self, heads: set[str]) -> list[str]:
        """Forget the requests whose head is gone (dead or left): those to free now (busy ones: when done).
        Those waiting for a slot leave the line."""
        for rid in [r for r, head in self.in_line.items() if head in heads]:
            self.cancel(rid)
        return [rid for rid, st in list(self.requests.items()) if st.head in heads and self.cancel(rid)]

    def elsewhere(self, state: RequestState) -> bool:
        """Whether the request is elsewhere in the chain and will be back for another step: not running here,
        and (as far as this stage knows) not at its last step (max_tokens; its head's Cancel comes next)."""
        last = bool(state.sampling.max_tokens) and state.step + 1 >= state.sampling.max_tokens
        return not state.busy and not state.cancelled and not last

    def head_of(self, request_id: str) -> str | None:
        state = self.requests.get(request_id)
        return state.head if state else None

    def clear(self) -> list[str]:
        """The model was replaced (a new plan): every request here is lost."""
        gone = list(self.requests.values())
        for s in gone:
            self._fire(s, RequestEvent.CLEAR)
        self.in_line.clear()
        self.reserved.clear()
        self.version += 1
        return [s.request_id for s in gone]


def _wire_tensor(hidden: np.ndarray, wire_dtype: str | None) -> WireTensor:
    if wire_dtype is None:
        return WireTensor.from_array(np.ascontiguousarray(hidden, dtype=np.float32))
    try:
        return WireTensor.from_array(hidden, wire_dtype)
    except LocalProtocolError:  # float16 cannot hold this tensor's outliers: send it losslessly instead
        return WireTensor.from_array(np.ascontiguousarray(hidden, dtype=np.float32))
