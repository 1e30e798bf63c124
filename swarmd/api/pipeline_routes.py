"""The HTTP routes of a daemon's pipeline: `/v1/*` (OpenAI-compatible), `/api/v0/generate` (for `swarmd
submit-prompt`), `/api/v0/traces`, `/api/v0/trace/ID` and `/api/v0/pipeline` (this daemon's stage and head)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from swarmd.api.app import Api
from swarmd.api.generate_route import GenerateRoute
from swarmd.api.openai_routes import OpenAIRoutes
from swarmd.api.traces_route import TracesRoute
from swarmd.inference.pipeline import Pipeline
from swarmd.observe.spans import NodeSpans, chrome_trace
from swarmd.observe.trace_store import KEEP_TRACES


def install_pipeline_routes(api: Api, pipeline: Pipeline, peer_id: str) -> None:
    OpenAIRoutes(pipeline.head).install(api)
    GenerateRoute(pipeline.head).install(api)
    TracesRoute(pipeline.tracing.traces).install(api)

    async def status(request: Request) -> JSONResponse:
        return JSONResponse(pipeline.status())

    async def trace(request: Request) -> JSONResponse:
        rid = request.path_params["request_id"]
        events: Any = pipeline.tracing.traces.get(rid)
        if events is None:  # not headed here: this daemon's own spans of it, on its own clock
            spans = pipeline.tracing.recorder.spans(rid)
            if not spans:
                return JSONResponse({"error": {"message": f"no trace of {rid} on this daemon (traced requests "
                                                          f"only, the latest {KEEP_TRACES})", "code": "not_found"}},
                                    status_code=404)
            events = chrome_trace([NodeSpans(peer_id, "node", spans)], request_id=rid)
        return JSONResponse({"traceEvents": events, "displayTimeUnit": "ms"})

    api.add_route("/api/v0/pipeline", status)
    api.add_route("/api/v0/trace/{request_id}", trace)
