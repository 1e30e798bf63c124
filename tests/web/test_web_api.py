"""What the web page is served with and reads, over a real socket: the page open without the token and its data
behind it, the status stream, the head's recent traces, and the RTT groups of the map."""

from __future__ import annotations

import json
import re
import time

import httpx
import trio

from planner.node import NodeDescriptor
from swarmd.api.app import Api
from swarmd.api.page import FILES, serve_page, static_file
from swarmd.api.status_events import StatusEvents
from swarmd.api.swarm_map import rtt_groups
from swarmd.api.traces_route import TracesRoute
from swarmd.observe.trace_store import TraceStore

TOKEN = "page-token-0123456789"
GOOD = {"Authorization": f"Bearer {TOKEN}"}


def trace_events(pids: dict[int, str], steps: int) -> list[dict]:
    """A merged trace as the head makes it: a process per daemon, a stage.forward per step, a token per step."""
    events: list[dict] = []
    for pid, name in pids.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        for step in range(steps):
            events.append({"name": "stage.forward", "ph": "X", "ts": 1000.0 * step + pid, "dur": 50.0, "pid": pid,
                           "tid": 1, "args": {"step": step}})
    events += [{"name": "token", "ph": "i", "s": "t", "ts": 1000.0 * s + 99, "pid": 1, "tid": 2, "args": {"step": s}}
               for s in range(steps)]
    return events


async def serve(nursery: trio.Nursery, store: TraceStore, events: StatusEvents) -> str:
    api = Api(token=TOKEN)
    serve_page(api)
    events.install(api)
    TracesRoute(store).install(api)
    return await nursery.start(api.serve, "127.0.0.1:0")


async def test_the_page_is_served_without_the_token_and_everything_it_reads_wants_it():
    doc = {"members": []}
    async with trio.open_nursery() as nursery:
        url = await serve(nursery, TraceStore(), StatusEvents(lambda: doc))
        async with httpx.AsyncClient(base_url=url) as client:
            page = await client.get("/")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            csp = page.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
            for name in FILES:
                r = await client.get(f"/ui/{name}")
                assert r.status_code == 200 and r.content == static_file(name)
            assert (await client.get("/ui/secret.txt")).status_code == 404
            for path in ("/api/v0/traces", "/api/v0/status/events", "/ui/../api/v0/traces", "/ui/x/y"):
                assert (await client.get(path)).status_code == 401, path
            assert (await client.get("/api/v0/traces", headers=GOOD)).json() == {"traces": [], "keep": 20}
        nursery.cancel_scope.cancel()


def test_the_page_loads_nothing_from_elsewhere():
    html = static_file("index.html").decode()
    for ref in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert ref.startswith(("ui/", "data:")) or ref == "", ref
    js = static_file("app.js").decode()
    assert "innerHTML" not in js  # text from the swarm is set as text
    for call in re.findall(r'\b(?:api|getJson)\("([^"]*)"', js):
        assert not call.startswith(("/", "http")), call  # relative to the page: this daemon


async def test_the_status_stream_sends_at_once_on_a_change_and_every_interval_otherwise():
    count = {"n": 0}

    def status() -> dict:
        count["n"] += 1
        return {"n": count["n"]}

    events = StatusEvents(status, interval=30.0, min_gap=0.05)
    async with trio.open_nursery() as nursery:
        url = await serve(nursery, TraceStore(), events)
        async with httpx.AsyncClient(base_url=url, headers=GOOD, timeout=10) as client:
            async with client.stream("GET", "/api/v0/status/events") as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                lines = r.aiter_lines()
                seen = []
                async for line in lines:
                    if line.startswith("data: "):
                        seen.append(json.loads(line[6:]))
                        if len(seen) == 1:
                            await trio.sleep(0.2)
                            changed_at = time.monotonic()
                            events.changed()  # a member changed state
                        else:
                            break
                assert seen == [{"n": 1}, {"n": 2}]
                assert time.monotonic() - changed_at < 2.0  # not the 30 s interval
        nursery.cancel_scope.cancel()


async def test_the_head_serves_its_recent_traces_newest_first_as_chrome_traces():
    store = TraceStore(keep=3)
    for i in range(5):
        store.put(f"req-{i}", trace_events({1: f"head, stage 0 12D3Koo{i}aaaaaa", 2: "stage 1 12D3KoobbbbbB"}, 4),
                  finished=1000.0 + i)
    async with trio.open_nursery() as nursery:
        url = await serve(nursery, store, StatusEvents(dict))
        async with httpx.AsyncClient(base_url=url, headers=GOOD) as client:
            listed = (await client.get("/api/v0/traces")).json()["traces"]
            assert [t["request_id"] for t in listed] == ["req-4", "req-3", "req-2"]
            assert listed[0]["tokens"] == 4 and listed[0]["steps"] == 4 and len(listed[0]["nodes"]) == 2
            one = (await client.get("/api/v0/traces/req-3")).json()
            assert one["traceEvents"] == store.get("req-3") and one["otherData"]["request_id"] == "req-3"
            gone = await client.get("/api/v0/traces/req-0")
            assert gone.status_code == 404 and "last 3 traced requests" in gone.json()["error"]["message"]
        nursery.cancel_scope.cancel()


def test_the_trace_store_is_bounded_in_events_as_well_as_in_count():
    store = TraceStore(keep=20, max_events=100)
    store.put("a", [{"ph": "i", "name": "token"}] * 60)
    store.put("b", [{"ph": "i", "name": "token"}] * 60)  # 120 events in all: "a" goes
    assert [t.request_id for t in store.recent()] == ["b"]
    store.put("c", [{"ph": "i", "name": "token"}] * 500)  # the newest is kept even alone over the bound
    assert [t.request_id for t in store.recent()] == ["c"]


def test_members_fall_into_the_planners_low_latency_groups():
    rtt = {("a", "b"): 2.0, ("a", "c"): 80.0, ("b", "c"): 80.0, ("c", "d"): 3.0, ("a", "d"): 80.0, ("b", "d"): 80.0}

    def node(peer: str) -> NodeDescriptor:
        return NodeDescriptor(peer, 1 << 30, 1 << 30, rtt_ms={q: v for (x, q), v in rtt.items() if x == peer}
                              | {x: v for (x, q), v in rtt.items() if q == peer})

    doc = rtt_groups([node(p) for p in "dcba"], default_rtt_ms=1.0, group_rtt_ms=10.0)
    assert sorted(sorted(g) for g in doc["groups"]) == [["a", "b"], ["c", "d"]]
    assert doc["group_rtt_ms"][0][1] == 80.0
