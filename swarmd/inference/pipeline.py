"""Pipeline inference on a daemon: the stage, head and MoE actors on the actor transport.

`Pipeline(node, transport, lane)` builds the actors and `install()` routes the transport's messages to them,
and the hot lane's (a stage's short decode steps on its reader threads) (`swarmd.daemon.serving` starts it all,
with its HTTP routes):

    Forward          -> stage      (checked against this daemon's stage: hop, hidden size, dtype, vocabulary)
    Token hop 0      -> stage      (stage 0: the next step's input)
    Token hop 1      -> head       (a token for a request this daemon heads)
    Logprobs         -> head
    Speculate        -> stage      (the last stage: a speculative request's head takes the loop back)
    Verified         -> head       (a speculative request's step: the head drafts and sends the next one)
    Cancel           -> stage      (free the request's KV cache)
    ExpertBatch      -> expert     (MoE: rows for the routed experts this daemon holds)
    ExpertResult     -> MoE router (the answer to a batch this daemon's stage sent)
    Error            -> MoE router (about one of its batches), head, or passed on to the request's head

The registry (actor -> peer) follows the node's current plan; the stage actor follows the node's loaded
assignment.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import trio

from swarmd.errors import UserError
from swarmd.inference.head.service import HeadError, HeadService, ModelInfo
from swarmd.inference.head.slots import StageSlots
from swarmd.inference.moe.expert import ExpertActor
from swarmd.inference.moe.local import LocalExperts
from swarmd.inference.moe.router import MoERouter
from swarmd.inference.registry import EMPTY, ChainStatus, Registry, chain_status, stage_slots
from swarmd.inference.spec.draft_model import DraftRefused, check_draft_model
from swarmd.inference.spec.head import SpecHead
from swarmd.inference.stage.actor import Loaded, StageActor
from swarmd.observe.clock import ClockOffsets
from swarmd.observe.hop_timer import HopTimer
from swarmd.observe.pipeline_metrics import register_pipeline_metrics
from swarmd.observe.spans import SpanRecorder
from swarmd.observe.trace_collect import TraceCollector
from swarmd.spec_settings import SpecSettings
from swarmd.swarm.membership import State, StateChanged
from swarmd.transport.lane import DECLINE, HotLane
from swarmd.transport.transport import HandlerResult, Send, TransportConfig
from swarmd.wire.codec import FLOAT_DTYPES, WireError
from swarmd.wire.expect import (
    Expect,
    ExpectExpertBatch,
    ExpectExpertResult,
    ExpectForward,
    ExpectToken,
    ExpectVerified,
)
from swarmd.wire.messages import (
    Cancel,
    Error,
    ExpertBatch,
    ExpertResult,
    Forward,
    Logprobs,
    Message,
    Speculate,
    Token,
    TraceQuery,
    TraceSpans,
    Verified,
)

log = logging.getLogger(__name__)


def transport_config(max_requests: int, send_timeout: float = TransportConfig.send_timeout) -> TransportConfig:
    """Windows and handler limits above the requests a stage can hold (below them the chain would deadlock)."""
    return TransportConfig(window=max(32, 4 * max_requests), max_handlers_per_peer=max(64, 8 * max_requests),
                           max_handlers=max(256, 32 * max_requests), send_timeout=send_timeout)


class Pipeline:
    def __init__(self, node: Any, transport: Any, lane: HotLane | None = None) -> None:
        self.node = node
        self.transport = transport
        self.lane = lane
        cfg = node.config
        self._registry: Registry = EMPTY
        self._plan_key: Any = None
        wire_dtype = None if cfg.wire_dtype in ("", "float32") else cfg.wire_dtype
        self.router = MoERouter(transport, self._expert_holders, wire_dtype=wire_dtype, cannot_hold=self._cannot_hold)
        self.expert = ExpertActor(self._expert_shard, compute=node.compute, wire_dtype=wire_dtype)
        local = LocalExperts(self._expert_shard, self.router.record_local, clock=self._span_clock)
        self.stage = StageActor(self.loaded, compute=node.compute, max_context=cfg.max_context,
                                wire_dtype=wire_dtype, idle_timeout=cfg.timings.request_idle_timeout,
                                experts=self.router.call, local_experts=local, plan_epoch=lambda: self.registry().epoch,
                                inline_step_s=cfg.inline_step_ms / 1e3,
                                post_all=lane.post_all if lane is not None else transport.post_all)
        speculation = SpecHead(node.peer_id, SpecSettings(cfg.speculate, cfg.draft_tokens), compute=node.compute,
                               max_requests=cfg.max_requests)
        self.head = HeadService(node.peer_id, transport, chain=self.chain, registry=self.registry,
                                timings=cfg.timings, load_model=self._load_model, in_flight=self._count,
                                leaving=lambda: node.leaving, hop_local=not cfg.full_replay,
                                capacity=self.capacity, max_queued=cfg.max_queued,
                                blocking=getattr(node, "blocking", trio.to_thread.run_sync), speculation=speculation)
        if getattr(node, "assignment", None) is not None:
            node.assignment.kv_slots = self.stage.slot_state  # this stage's slots go into its heartbeats
        self._observe()
        transport.on_link_lost = self.router.link_lost  # batches with a replica leave a broken link at once
        transport.on_given_up = self.router.given_up  # a hot fan-out's batch the transport gave up is asked again
        if lane is not None:  # a hot step fans its MoE layers out from its own thread, on the lane
            self.router.lane = lane
            self.stage.experts_hot, self.stage.experts_done = self.router.fan_out, self.router.finished_hot
        swarm = getattr(node, "swarm", None)
        if swarm is not None:  # batches waiting on a node end as soon as membership says it died
            swarm.state_listeners.append(self._member_state)

    def _member_state(self, change: StateChanged) -> None:
        self.router.peer_state(change.peer_id, dead=change.new == State.DEAD)

    def _cannot_hold(self) -> str | None:
        """On the leader: why no plan can hold the model now (its last planning error), else None."""
        swarm = getattr(self.node, "swarm", None)
        return (swarm.coordinator.error or None) if swarm is not None and swarm.coordinator.is_leader else None

    def _observe(self) -> None:
        """Spans of traced requests, clock offsets from the swarm's probes, and the pipeline's metrics."""
        swarm = getattr(self.node, "swarm", None)
        recorder = SpanRecorder(clock=swarm.clock) if swarm is not None else SpanRecorder()
        clocks = swarm.clocks if swarm is not None else ClockOffsets()
        self.tracing = TraceCollector(self.node.peer_id, self.transport, recorder, clocks)
        self.stage.recorder = recorder
        self.router.recorder = recorder
        self.expert.recorder = recorder
        self.head.tracing = self.tracing
        metrics = getattr(self.node, "metrics", None)
        wire = None
        if metrics is not None:
            wire, ttft = register_pipeline_metrics(metrics.registry, self)
            self.head.on_first_token = ttft.observe
        self.transport.observer = HopTimer(recorder, wire)

    # --- what the plan and the assignment say now ---------------------------------------------------------

    def registry(self) -> Registry:
        plan = self.node.plan
        key = (plan.epoch, id(plan)) if plan is not None else None
        if key != self._plan_key:
            self._registry, self._plan_key = Registry.from_plan(plan), key
        return self._registry

    def loaded(self) -> Loaded | None:
        """This daemon's stage, if the current plan gives it one and its blocks are loaded."""
        registry = self.registry()
        hop = registry.hop_of(self.node.peer_id)
        assignment = self.node.assignment
        if hop is None or assignment is None or assignment.stage is None:
            return None
        if assignment.loaded_layers != registry.layers[hop]:
            return None
        return Loaded(assignment.stage, hop, registry)

    def _expert_holders(self, block: int) -> dict[int, tuple[str, ...]]:
        plan = self.node.plan
        return dict(plan.experts.get(block, {})) if plan is not None else {}

    def _span_clock(self) -> float:
        """The clock the router stamps its spans with (its recorder's, once `_observe` has set one)."""
        recorder = self.router.recorder
        return recorder.clock() if recorder is not None else time.perf_counter()

    def _expert_shard(self) -> Any:
        assignment = self.node.assignment
        return assignment.experts if assignment is not None else None

    def chain(self) -> ChainStatus:
        swarm = self.node.swarm
        if swarm is None:
            return ChainStatus(False, "the daemon is starting")
        status = chain_status(*swarm.chain_view())
        error = swarm.coordinator.error
        if not status.ready and error:  # on the leader: why no plan can replace the broken one
            return replace(status, detail=f"{status.detail}; the swarm cannot hold the model: {error}", cannot_hold=True)
        return status

    def capacity(self) -> dict[str, StageSlots | None]:
        """The members' KV slots as gossiped (this daemon's own as they are now)."""
        swarm = self.node.swarm
        return stage_slots(swarm.chain_view()[1]) if swarm is not None else {}

    async def forget_dead_heads(self, interval: float = 1.0) -> None:
        """Requests whose head died hold KV caches no one reads: free them as soon as membership says so."""
        while True:
            await trio.sleep(interval)
            swarm = self.node.swarm
            if swarm is not None:
                gone = {m["peer_id"] for m in swarm.chain_view()[1] if m["state"] == "dead"}
                self.stage.forget_heads(gone)

    def _count(self, delta: int) -> None:
        self.node.requests_in_flight += delta

    def _load_model(self) -> ModelInfo:
        from models.config import config_from_header
        from models.errors import ModelError
        from models.gguf.header import read_header
        from models.text.tokenizer import Tokenizer

        served = self.node.model
        if served is not None and served.seeded is not None:
            config = served.seeded.config(self.node.config.max_context)
            return ModelInfo(served.name, Tokenizer(served.seeded.tokenizer_kv()), config.max_context,
                             config.vocab_size)
        if served is None or served.path is None:
            raise HeadError("no_weights", f"this daemon has no weights for {served.name if served else 'its model'}: "
                                          "it can plan, not generate", 503)
        try:
            header = read_header(served.path)
            tokenizer = Tokenizer(header.kv)
            config = config_from_header(header, self.node.config.max_context)
        except ModelError as e:
            raise HeadError("model_error", f"{served.name}: {e}", 503) from None
        return ModelInfo(served.name, tokenizer, config.max_context, config.vocab_size)

    # --- transport routes -----------------------------------------------------------------------------------

    def install(self) -> None:
        install_actor_routes(self.transport, self.stage, self.head, peer_id=self.node.peer_id,
                             expect_forward=self._expect_forward, expect_token=self._expect_token,
                             router=self.router)
        if self.lane is not None:
            install_lane_routes(self.lane, self.stage, self.expert, self.router)
        served = self.node.model
        self.transport.route(Verified, self.head.on_verified,
                             expect=ExpectVerified(served.layout.vocab_size) if served is not None else None)
        moe = [b.moe for b in served.layout.blocks if b.moe is not None] if served is not None else []
        if moe:
            hidden = served.layout.hidden_size
            self.transport.route(ExpertBatch, self.expert.on_batch, expect=ExpectExpertBatch(
                hidden, max(m.n_experts for m in moe), max(m.top_k for m in moe), dtypes=FLOAT_DTYPES))
            self.transport.route(ExpertResult, self.router.on_result,
                                 expect=ExpectExpertResult(hidden, dtypes=FLOAT_DTYPES))
        self.transport.route(TraceQuery, self.tracing.on_query)
        self.transport.route(TraceSpans, self.tracing.on_spans)

    def _expect_forward(self, msg: Message) -> None:
        loaded = self.loaded()
        if loaded is None:
            return  # the stage actor answers the head with a clear error instead of refusing the frame
        model = loaded.model
        ExpectForward(hop=loaded.hop, hidden_size=model.hidden_size, vocab_size=model.vocab_size,
                      dtypes=FLOAT_DTYPES, max_pos=model.max_context)(msg)

    def _expect_token(self, msg: Message) -> None:
        served = self.node.model
        if served is not None:
            ExpectToken(served.layout.vocab_size)(msg)

    # --- status ----------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        loaded = self.loaded()
        book = self.stage.book
        chain = self.chain()
        return {
            "stage": None if loaded is None else {
                "hop": loaded.hop, "of": loaded.registry.n_stages, "blocks": [loaded.model.start, loaded.model.end],
                "requests": len(book.requests) if book else 0, **self.stage.queue_state(),
                **self.stage.stats.to_json()},
            "queue": self.head.admission.status(),
            "speculation": self.speculation_status(),
            "head": {"in_flight": len(self.head.requests), **self.head.stats,
                     "requests": [{"request_id": h.request_id, "tokens": h.timing.tokens, "where": h.whereabouts()}
                                  for h in self.head.handles()]},
            "moe": {"router": self.router.status(), "expert": self.expert.status()},
            "chain": {"ready": chain.ready, "detail": chain.detail},
            "transport": {k: v for k, v in vars(self.transport.stats).items()},
            "lane": self.lane.status() if self.lane is not None else None,
            "links": self.transport.link_state(),
            "clock_offsets": self.tracing.clocks.to_json(),  # NTP-style, from probes and trace queries
        }


    async def check_draft_model(self) -> None:
        """`--speculate model:NAME`: refuse to start (UserError) unless NAME is a model with the served model's
        vocabulary (a daemon without the served model's weights heads nothing and checks nothing)."""
        name = self.head.speculation.default.draft_model
        served = self.node.model
        if name is None or served is None or (served.path is None and served.seeded is None):
            return
        try:
            info = await self.head.model()
        except HeadError:
            return  # the head says why when a request comes
        try:
            await self.node.compute.run(check_draft_model, name, info.tokenizer.tokens)
        except DraftRefused as e:
            raise UserError(f"--speculate model:{name}: {e}") from None

    def speculation_status(self) -> dict[str, Any]:
        """This daemon's speculation setting and the passes of the speculative requests it headed."""
        spec = self.head.speculation
        return {"mode": spec.default.mode, "draft_tokens": spec.default.draft_tokens, **spec.stats.to_json()}

    def moe_status(self) -> dict[str, Any]:
        """Where each block's experts live (the plan's), and the tokens routed to each expert: by this
        daemon's routers (the blocks its stage owns) and computed by its expert actor."""
        router, expert = self.router.status(), self.expert.status()
        plan = self.node.plan
        placement = {str(b): {str(e): list(peers) for e, peers in sorted(by.items())}
                     for b, by in sorted(plan.experts.items())} if plan is not None else {}
        return {"placement": placement, "routed": router["layers"], "replica_latency_ms": router["latency_ms"],
                "computed_here": expert}


def install_lane_routes(lane: HotLane, stage: StageActor, expert: ExpertActor, router: MoERouter) -> None:
    """What runs on the hot lane's reader threads: a stage's short decode steps (the next one of a running
    request recognised from its bytes), the expert batches its MoE layers fan out and their answers (the rest is
    declined to the transport's routes)."""

    def on_token(peer: str, msg: Token, reply: Any) -> Any:
        return stage.take_hot(peer, msg, reply) if msg.hop == 0 else DECLINE

    lane.route(Forward, stage.take_hot)
    lane.route(Token, on_token)
    lane.shortcut = stage.next_step  # the step after one `take_hot` ran, from its frame's bytes
    lane.route(ExpertBatch, expert.take_hot)
    lane.route(ExpertResult, router.take_hot_result)


def install_actor_routes(transport: Any, stage: StageActor, head: HeadService, *, peer_id: str,
                         expect_forward: Expect | None = None, expect_token: Expect | None = None,
                         router: MoERouter | None = None) -> None:
    """Route the pipeline's messages on `transport` to this daemon's stage and head actors."""

    async def on_token(peer: str, msg: Token) -> HandlerResult:
        if msg.hop == 0:
            return await stage.on_token(peer, msg)
        if msg.hop == 1:
            return await head.on_token(peer, msg)
        raise WireError("wrong_hop", f"a token copy is for stage 0 (hop 0) or the head (hop 1), not hop {msg.hop}",
                        request_id=msg.request_id)

    async def on_error(peer: str, msg: Error) -> HandlerResult:
        if router is not None and router.on_error(msg):
            return None
        if head.on_error(msg):
            return None
        request_head = stage.head_of(msg.request_id)
        if request_head is not None and request_head not in (peer_id, peer):
            return Send(request_head, msg)  # a stage further down failed: its head must hear it
        log.info("error about %s from %s: %s: %s", msg.request_id or "-", peer[:16], msg.code, msg.message)
        return None

    transport.route(Forward, stage.on_forward, expect=expect_forward)
    transport.route(Token, on_token, expect=expect_token)
    transport.route(Logprobs, head.on_logprobs)
    transport.route(Cancel, stage.on_cancel)
    transport.route(Speculate, stage.on_speculate)
    transport.route(Error, on_error)
