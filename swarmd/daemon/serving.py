"""What a serving daemon runs beside its swarm: the actor transport, the pipeline's actors and their HTTP routes.

`run_pipeline` is a Node extension (`node.add_extension(run_pipeline)`; `swarmd join` adds it).
"""

from __future__ import annotations

from typing import Any

import trio

from swarmd.api.pipeline_routes import install_pipeline_routes
from swarmd.inference.pipeline import Pipeline, transport_config
from swarmd.transport.links import start_actor_transport


async def run_pipeline(node: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve pipeline requests until the node stops; `task_status.started(pipeline)` once the routes are in."""
    cfg = node.config
    async with trio.open_nursery() as nursery:
        transport = await start_actor_transport(node.network, nursery,
                                                transport_config(cfg.max_requests, cfg.timings.send_timeout))
        pipeline = Pipeline(node, transport)
        pipeline.install()
        await nursery.start(pipeline.stage.run)
        await nursery.start(pipeline.head.run)
        nursery.start_soon(pipeline.forget_dead_heads)
        install_pipeline_routes(node.api, pipeline, node.peer_id)
        if node.model is not None and node.model.layout.is_moe:
            node.status_parts["moe"] = pipeline.moe_status
        task_status.started(pipeline)
        await trio.sleep_forever()
