"""`GET /api/v0/traces` and `GET /api/v0/traces/{request_id}`: the traced requests this daemon headed.

A request is traced when its client asks: `"trace": true` in `/api/v0/generate` (`swarmd submit-prompt
--trace`), or the header `X-Swarmd-Trace: 1` on `/v1/chat/completions` and `/v1/completions` (the web page's
chat sends it). The head merges the spans of every daemon on the request's path into one Chrome trace and keeps
the latest ones (`swarmd.observe.trace_store`).

    GET /api/v0/traces      {"traces": [{"request_id", "finished", "tokens", "steps", "nodes", "duration_ms",
                                         "events"}, ...]}    newest first
    GET /api/v0/traces/ID   {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}   (opens in Perfetto)
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from swarmd.api.app import Api
from swarmd.observe.trace_store import TraceStore


class TracesRoute:
    def __init__(self, store: TraceStore) -> None:
        self.store = store

    def install(self, api: Api) -> None:
        api.add_route("/api/v0/traces", self.list)
        api.add_route("/api/v0/traces/{request_id}", self.one)

    async def list(self, request: Request) -> JSONResponse:
        return JSONResponse({"traces": [t.summary for t in self.store.recent()], "keep": self.store.keep})

    async def one(self, request: Request) -> JSONResponse:
        rid = request.path_params["request_id"]
        kept = self.store.kept(rid)
        if kept is None:
            return JSONResponse({"error": {"message": f"no trace of {rid} here: this daemon keeps the traces of the "
                                                      f"last {self.store.keep} traced requests it headed",
                                           "type": "invalid_request_error", "code": "not_found", "param": None}},
                                status_code=404)
        return JSONResponse(kept.chrome_json(), headers={"content-disposition": f'inline; filename="{rid}.json"'})
