"""One daemon: a Node owns one trio nursery and starts its parts in dependency order.

    identity, model, device  (blocking work on the compute thread)
    network                  the Network (libp2p + gossipsub)     await nursery.start(network.run)
    assignment               loads the stage the plan gives us    await nursery.start(assignment.run)
    swarm                    membership, election, planning       await nursery.start(swarm.run)
    extensions               actors added by other modules        await nursery.start(fn, node)
    api                      HTTP on loopback                     await nursery.start(api.serve, bind)

Other parts of the daemon extend it before `run`: `node.add_extension(fn)` for a service that
needs the swarm (fn(node, task_status=...) is started after the swarm, before the API), and
`node.api.add_route(...)` for HTTP routes. Every byte to peers goes through `node.network`, a
`swarmd.net.seam.Network`: libp2p by default, or what `Node(config, network=factory)` makes (the in-memory
twin in `swarmd.testing`). `compute=` and `blocking=` likewise take twins of the compute thread and of the
worker threads, and `serve_api=False` leaves the HTTP API out (a daemon driven in-process).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from planner import PlanOptions, make_plan
from planner.plan import Plan
from swarmd import WIRE_VERSION, __version__
from swarmd.api.app import Api
from swarmd.api.page import install_page
from swarmd.config import DaemonConfig, warms_up
from swarmd.daemon.assignment import Assignment, ExpertLoader, StageLoader, load_experts, load_stage
from swarmd.daemon.descriptor import (
    LocalDescriptor,
    device_name,
    load_or_measure,
    next_incarnation,
    resolve_device,
    uplink_bps,
)
from swarmd.daemon.model_source import resolve_served
from swarmd.daemon.served_model import ServedModel
from swarmd.errors import UserError
from swarmd.inference.compute import Compute, ComputeThread
from swarmd.net.access import Access, load_access
from swarmd.net.dial_map import DialMap, install_dial_map
from swarmd.net.identity import Signer, load_or_create_identity, peer_id_of, short_id
from swarmd.net.link_paths import links_document
from swarmd.net.seam import Network
from swarmd.observe.metrics import CONTENT_TYPE, NodeMetrics
from swarmd.swarm.fixed_plan import FixedPlan
from swarmd.swarm.membership import State
from swarmd.swarm.planning import MakePlan
from swarmd.swarm.service import SwarmService, SwarmSettings
from swarmd.swarm.slot_claim import SlotClaim, fixed_plan
from swarmd.weights.metrics import WeightsCollector
from swarmd.weights.service import Activity, WeightsService, weight_holders
from swarmd.wire.gossip import AssignmentStatus

log = logging.getLogger(__name__)

API_FILE = "api"
Extension = Callable[..., Awaitable[Any]]  # async fn(node, *, task_status)
NetworkFactory = Callable[[Any, DaemonConfig, Access], Network]  # (key pair, config, access) -> an endpoint


def libp2p_network(key_pair: Any, cfg: DaemonConfig, access: Access) -> Network:
    """The daemon's real network: a py-libp2p host, with the TLS data plane unless --data-plane libp2p, and what
    takes it across NATs (reachability, relays, hole punching)."""
    from swarmd.net.connectivity import ConnectivityConfig
    from swarmd.net.libp2p_network import Libp2pNetwork
    from swarmd.net.tls_plane import DataPlaneConfig

    return Libp2pNetwork(key_pair, cfg.listen, cfg.announce, timings=cfg.timings, mdns=cfg.mdns,
                         swarm_key=access.swarm_key, allow=access.allow,
                         data_plane=DataPlaneConfig(bind_port=cfg.data_plane_port) if cfg.data_plane == "tls" else None,
                         connectivity=ConnectivityConfig(relay_service=cfg.relay_service is not False,
                                                         relays=cfg.relays, hole_punching=cfg.hole_punching is not False))


class Node:
    def __init__(self, config: DaemonConfig, *, network: NetworkFactory = libp2p_network,
                 compute: Compute | None = None, blocking: Callable[..., Awaitable[Any]] | None = None,
                 loader: StageLoader = load_stage, expert_loader: ExpertLoader = load_experts,
                 serve_api: bool = True, process_bytes: Callable[[], int] | None = None) -> None:
        self.config = config
        self.process_bytes = process_bytes  # what the process holds (None: its RSS), for a CPU stage's KV slots
        self.blocking = blocking or trio.to_thread.run_sync  # other blocking work: planning, tokenizer loads
        self._make_network = network
        self._serve_api = serve_api
        self.home = Path(config.home)
        self.loader = loader
        self.expert_loader = expert_loader
        self.extension_results: dict[str, Any] = {}  # what each extension's start handed back, by its name
        self.api = Api(token=config.api_token, max_request_bytes=config.api_max_request_bytes,
                       max_tokens=config.api_max_tokens)
        self.extensions: list[Extension] = []
        self.requests_in_flight = 0  # the pipeline raises and lowers it; gossiped as the node's load
        self.leaving = False  # draining: new requests are refused, those in flight finish first
        self.status_parts: dict[str, Callable[[], Any]] = {}  # extensions' sections of the status document
        self.compute: Compute = compute or ComputeThread()  # every tinygrad call of this daemon runs on it
        self.ready = trio.Event()
        # set while running
        self.peer_id = ""
        self.model: ServedModel | None = None
        self.network: Network | None = None
        self.swarm: SwarmService | None = None
        self.assignment: Assignment | None = None
        self.weights: WeightsService | None = None
        self.descriptor: LocalDescriptor | None = None
        self.metrics: NodeMetrics | None = None
        self.api_url: str | None = None
        self.fixed_plan: FixedPlan | None = None
        self.claim: SlotClaim | None = None  # this daemon's side of a plan file's slots
        self.access: Access | None = None
        self._nursery: trio.Nursery | None = None
        self._add_routes()

    def add_extension(self, fn: Extension) -> None:
        """Start `fn(node, task_status=...)` after the swarm is up and before the API (call before run)."""
        self.extensions.append(fn)

    @property
    def plan(self) -> Plan | None:
        return self.swarm.plan if self.swarm else None

    @property
    def stage(self) -> Any:
        """The loaded StageModel of this node's assignment, or None."""
        return self.assignment.stage if self.assignment else None

    # --- lifecycle ------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        bootstrap = tuple((_peer_of(a), a) for a in cfg.bootstrap)
        self.access = access = load_access(cfg)
        for peer, _ in bootstrap:
            if access.allow is not None and peer not in access.allow:
                log.warning("bootstrap peer %s is not on the allowlist: it will be refused", short_id(peer))
        self.home.mkdir(parents=True, exist_ok=True)
        key_pair = load_or_create_identity(self.home)
        self.peer_id = peer_id_of(key_pair)
        install_dial_map(DialMap.parse(cfg.dial_map))
        device = await self.compute.run(resolve_device, cfg.device)
        name = device_name(device)
        bench = await self.compute.run(load_or_measure, self.home, device, name)
        incarnation = next_incarnation(self.home)
        network = self._make_network(key_pair, cfg, access)
        (log.info if access.private else log.warning)(access.describe())
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.network = await nursery.start(network.run)
            # the model: on this machine, else (partly) fetched from the members named by --bootstrap
            self.model = await resolve_served(cfg.model, network, bootstrap, blocking=self.compute.run)
            if cfg.plan is not None:
                self.fixed_plan = fixed_plan(cfg, self.model.layout, self.plan_options)
            self.weights = weights = WeightsService(
                network, self.model, members=lambda: weight_holders(self.swarm),
                serve_bytes_per_s=cfg.weights_serve_mbps * 1e6 / 8, busy_bytes_per_s=cfg.weights_busy_mbps * 1e6 / 8,
                busy=Activity(lambda: (self.requests_in_flight, self.compute.busy_seconds)), blocking=self.blocking)
            await nursery.start(weights.run)
            self.status_parts["weights"] = weights.status
            self.descriptor = LocalDescriptor(
                peer_id=self.peer_id, device=device, device_name=name, bench=bench, memory_limit=cfg.memory_limit,
                label=cfg.device_label, model_name=self.model.name, model_digest=self.model.digest,
                incarnation=incarnation, uplink=uplink_bps(cfg.uplink_mbps), addresses=network.addresses,
                load=lambda: self.requests_in_flight, standby=cfg.standby, slot=cfg.slot, holds=weights.holds,
                links=lambda: {peer: info.path.value for peer, info in network.link_paths().items()})
            self.assignment = Assignment(self.peer_id, self.model, device, self.compute,
                                         max_context=cfg.max_context, max_requests=cfg.max_requests,
                                         loader=self.loader, expert_loader=self.expert_loader,
                                         warmup=warms_up(cfg.warmup, device),
                                         reuse_blocks=not cfg.full_reload, prepare=weights.ensure,
                                         memory=self.descriptor.memory, options=self.plan_options,
                                         process_bytes=self.process_bytes)
            await nursery.start(self.assignment.run)
            settings = SwarmSettings(cfg.swarm, cfg.timings, bootstrap)
            self.swarm = swarm = SwarmService(network, Signer(key_pair), settings, describe_self=self.descriptor,
                                              assignment_status=self._assignment_status, make_plan=self._make_plan,
                                              on_plan=self.assignment.apply, blocking=self.blocking)
            if self.fixed_plan is not None and self.fixed_plan.file is not None:
                self.claim = SlotClaim(self.fixed_plan, cfg.slot, self.peer_id, leading=lambda: swarm.election.is_leader,
                                       live=swarm.membership.live)
                swarm.slot_bindings, swarm.on_slots = self.claim.bindings, self.claim.on_slots
                self.status_parts["slots"] = self.claim.status
                nursery.start_soon(self.claim.watch)
            await nursery.start(self.swarm.run)
            self._show_links(network)
            if cfg.mdns:
                nursery.start_soon(self._follow_mdns)
            self.metrics = NodeMetrics(self.status, lambda: {**swarm.stats, **self.security_counters(),
                                                             **weights.counters(),
                                                             "compute_busy_seconds": self.compute.busy_seconds})
            self.metrics.registry.register(WeightsCollector(weights))
            for ext in self.extensions:
                self.extension_results[getattr(ext, "__name__", repr(ext))] = await nursery.start(ext, self)
            if self._serve_api:
                self.api_url = await nursery.start(self.api.serve, cfg.api)
                self._write_api_file()
            try:
                self.ready.set()
                task_status.started(self)
                await trio.sleep_forever()
            finally:
                self._remove_api_file()
                self.compute.close()

    def _assignment_status(self) -> AssignmentStatus:
        """The assignment's state, with the weights it is fetching (bytes, rate) for every member's status."""
        assert self.assignment is not None and self.weights is not None
        return replace(self.assignment.status(), fetch=self.weights.fetch_status())

    def security_counters(self) -> dict[str, float]:
        """Refusals, strikes and penalties of the peer gate, and the API's refusals, for /metrics."""
        out: dict[str, float] = {}
        if self.network is not None:
            gate, guard = self.network.gate, self.network.guard
            out.update({f"peer_gate:{k}": v for k, v in gate.stats.items()})
            out.update({f"served_streams:{k}": v for k, v in guard.stats.items()})
            out["peer_gate:connections_refused"] = getattr(self.network, "connections_refused", 0)
        out.update({f"api_refused:{k}": v for k, v in self.api.guard_stats.items()})
        return out

    async def leave(self) -> None:
        """Leave the swarm cleanly, then stop: drain first (refuse new requests, let those this daemon heads
        finish, up to `drain_timeout`, still serving its stage), then tell the swarm (a leader hands over a plan
        without itself); requests passing through this daemon's stage move when the plan changes."""
        self.leaving = True
        with trio.move_on_after(self.config.timings.drain_timeout):
            while self.requests_in_flight:  # noqa: ASYNC110 - polled: the count changes in many places
                await trio.sleep(0.1)
        if self.requests_in_flight:
            log.warning("leaving with %d requests still in flight after %.0f s", self.requests_in_flight,
                        self.config.timings.drain_timeout)
        if self.swarm is not None:
            await self.swarm.leave()
        self._remove_api_file()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _make_plan(self, action: MakePlan) -> Plan:
        if self.fixed_plan is not None:
            return self.fixed_plan.make(action, self._compute_plan)
        return self._compute_plan(action)

    def _compute_plan(self, action: MakePlan) -> Plan:
        assert self.model is not None
        return make_plan(self.model.layout, action.nodes, epoch=action.epoch, previous=action.previous,
                         options=self.plan_options)

    @property
    def plan_options(self) -> PlanOptions:
        """What the planner budgets per node: the KV cache this daemon's stages really allocate."""
        return PlanOptions(context_length=self.config.max_context, concurrency=self.config.planned_requests,
                           expert_placement=self.config.expert_placement,
                           fetch_bytes_per_s=max(1.0, self.config.weights_serve_mbps * 1e6 / 8))

    async def _follow_mdns(self) -> None:
        assert self.network is not None and self.swarm is not None
        async for peer, addresses in self.network.discovered():  # type: ignore[attr-defined]
            if peer != self.peer_id:
                self.swarm.add_discovered(peer, tuple(addresses))

    # --- $SWARMD_HOME/api -------------------------------------------------------------------
    def _write_api_file(self) -> None:
        path = self.home / API_FILE
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        doc = {"url": self.api_url, "peer_id": self.peer_id, "pid": os.getpid(), "token_required": bool(self.api.token)}
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, path)

    def _remove_api_file(self) -> None:
        path = self.home / API_FILE
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()

    # --- status -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What `GET /api/v0/status` returns (and `swarmd status --json` prints)."""
        assert self.swarm is not None and self.assignment is not None and self.model is not None
        snap = self.swarm.snapshot()
        me = snap["members"][0]
        return {
            "self": {
                "peer_id": self.peer_id,
                "addresses": me["addresses"],
                "api": self.api_url,
                "version": __version__,
                "wire_version": WIRE_VERSION,
                "incarnation": me["incarnation"],
                "device": me["device"],
                "device_name": me["device_name"],
                "label": me["label"],
                "model": {"name": self.model.name, "digest": self.model.digest},
            },
            "swarm": {"name": snap["swarm"], **(self.access.status() if self.access else {}),
                      "penalised": self.network.gate.penalised(trio.current_time()) if self.network else []},
            "admitted": snap["admitted"],
            "leader": snap["leader"],
            "term": snap["term"],
            "members": snap["members"],
            "refused": snap["refused"],
            "plan": snap["plan"],
            "plan_error": self.claim.plan_error(snap["plan_error"], snap["plan"] is not None) if self.claim
            else snap["plan_error"],
            "coverage": coverage(snap["plan"], snap["members"], self.model.layout),
            "assignment": self.assignment.status().to_json(),
            "requests_in_flight": self.requests_in_flight,
            **{name: part() for name, part in self.status_parts.items()},
        }

    def _show_links(self, network: Network) -> None:
        """`links` in status: how activations reach each member, and why; on a real network also `connectivity`
        (addresses, reachability, relays, hole punching: what `swarmd doctor` reads)."""
        assert self.swarm is not None
        members = self.swarm.membership.members

        def live() -> dict[str, tuple[str, ...]]:
            return {p: m.descriptor.addresses for p, m in list(members.items()) if m.state != State.DEAD}

        connectivity = getattr(network, "connectivity", None)
        if connectivity is not None:
            connectivity.members = live
            self.status_parts.update(links=connectivity.links, connectivity=connectivity.status)
        else:
            self.status_parts["links"] = lambda: links_document(network.link_paths(), live(), self.peer_id)

    def _add_routes(self) -> None:
        async def status(request: Request) -> JSONResponse:
            return JSONResponse(self.status())

        async def health(request: Request) -> JSONResponse:
            ok = self.swarm is not None and self.ready.is_set()
            body = {"ok": ok, "peer_id": self.peer_id,
                    "admitted": bool(self.swarm and self.swarm.admitted)}
            return JSONResponse(body, status_code=200 if ok else 503)

        async def metrics(request: Request) -> Response:
            if self.metrics is None:
                return Response("starting\n", status_code=503)
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)

        async def leave(request: Request) -> JSONResponse:
            if self._nursery is None:
                return JSONResponse({"leaving": False, "error": "not started"}, status_code=503)
            self._nursery.start_soon(self.leave)
            return JSONResponse({"leaving": True, "peer_id": self.peer_id})

        self.api.add_route("/api/v0/status", status)
        self.api.add_route("/api/v0/leave", leave, methods=("POST",))
        self.api.add_route("/health", health)
        self.api.add_route("/metrics", metrics)
        install_page(self)  # the web page at "/", its status stream and the status's `groups`


def _peer_of(address: str) -> str:
    """The peer id at the end of a bootstrap address ('/.../p2p/<id>'; `swarmd join` checks it is a multiaddr)."""
    if "/p2p/" not in address:
        raise UserError(f"--bootstrap {address!r} must end in /p2p/<peer id>")
    return address.rsplit("/p2p/", 1)[1]


def coverage(plan: dict[str, Any] | None, members: list[dict[str, Any]], layout: Any = None) -> str:
    """'layers 0-29 covered', or which layers lack a live, ready holder; for a MoE model also how many
    routed experts have a live holder that loaded them ('experts 240/240 placed')."""
    layers = _layer_coverage(plan, members)
    if plan and layout is not None and layout.is_moe:
        layers += f"; experts {placed_experts(plan, members)}/{sum(b.moe.n_experts for b in layout.blocks if b.moe)} placed"
    return layers


def placed_experts(plan: dict[str, Any], members: list[dict[str, Any]]) -> int:
    """Routed experts of `plan` held by at least one live member whose assignment has them loaded."""
    state = {m["peer_id"]: m for m in members}

    def holds(peer: str, block: str, expert: str) -> bool:
        m = state.get(peer)
        if m is None or m["state"] == "dead" or m["assignment"]["state"] != "ready":
            return False
        return int(expert) in m["assignment"].get("experts", {}).get(block, ())

    return sum(any(holds(p, b, e) for p in peers)
               for b, by_expert in (plan.get("experts") or {}).items() for e, peers in by_expert.items())


def _layer_coverage(plan: dict[str, Any] | None, members: list[dict[str, Any]]) -> str:
    if not plan:
        return "no plan yet"
    n = plan["stages"][-1]["layers"][1] if plan["stages"] else 0
    state = {m["peer_id"]: m for m in members}
    missing, loading = [], []
    for s in plan["stages"]:
        a, b = s["layers"]
        m = state.get(s["peer_id"])
        if m is None or m["state"] == "dead":
            missing.append(f"{a}-{b - 1} ({short_id(s['peer_id'])} is gone)")
        elif m["assignment"]["state"] != "ready" or m["assignment"]["layers"] != [a, b]:
            loading.append(f"{a}-{b - 1}")
    if missing:
        return f"layers {', '.join(missing)} not covered"
    if loading:
        return f"layers 0-{n - 1} planned; loading {', '.join(loading)}"
    return f"layers 0-{n - 1} covered"
