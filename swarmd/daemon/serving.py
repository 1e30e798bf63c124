"""What a serving daemon runs beside its swarm: the actor transport, the hot lane beside it (unless
`--no-hot-lane`), the pipeline's actors and their HTTP routes.

`run_pipeline` is a Node extension (`node.add_extension(run_pipeline)`; `swarmd join` adds it).
"""

from __future__ import annotations

from typing import Any

import trio

from swarmd.api.pipeline_routes import install_pipeline_routes
from swarmd.inference.pipeline import Pipeline, transport_config
from swarmd.inference.undeliverable import ReportUndeliverable
from swarmd.transport.lane import HotLane
from swarmd.transport.links import start_actor_transport


async def run_pipeline(node: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve pipeline requests until the node stops; `task_status.started(pipeline)` once the routes are in."""
    cfg = node.config
    undeliverable = ReportUndeliverable()  # a stuck request's head hears of it at once, with the reason
    async with trio.open_nursery() as nursery:
        transport = await start_actor_transport(node.network, nursery,
                                                transport_config(cfg.max_requests, cfg.timings.send_timeout),
                                                on_undeliverable=undeliverable)
        lane = await nursery.start(HotLane(node.network, transport).run) if cfg.hot_lane is not False else None
        pipeline = Pipeline(node, transport, lane)
        undeliverable.install(transport, pipeline.stage, node.peer_id, nursery)
        await pipeline.check_draft_model()
        pipeline.install()
        await nursery.start(pipeline.stage.run)
        await nursery.start(pipeline.router.run)
        await nursery.start(pipeline.head.run)
        nursery.start_soon(pipeline.forget_dead_heads)
        install_pipeline_routes(node.api, pipeline, node.peer_id)
        if node.model is not None and node.model.layout.is_moe:
            node.status_parts["moe"] = pipeline.moe_status
        node.status_parts["queue"] = pipeline.head.admission.status
        node.status_parts["speculation"] = pipeline.speculation_status
        task_status.started(pipeline)
        await trio.sleep_forever()
