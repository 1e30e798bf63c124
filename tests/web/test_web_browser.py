"""Acceptance: the web page of a swarm of 4 real `swarmd join` processes serving SmolLM2, in a real headless
Chromium (Debian's, driven by Playwright), used as an operator would.

One swarm (with an API token) and one browser tab serve every test of this module, in the order written: the
token asked once; the map with 4 members and the whole chain; the chat, whose answer is `swarmd submit-prompt`'s;
the waterfall of that traced request across every daemon and its download; the experts heatmap; a daemon killed
with kill -9 shown dead within the membership's detection time plus 2 s; nothing fetched from elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmd.config import LOCAL_TEST
from tests.pipeline.daemon_swarm import even_plan
from tests.swarm.daemons import Daemon, http, stop_all

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(900)]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKEN = "web-page-token-0123456789"
CHAT = "What is the capital of France?"
N_TOKENS = 12
N_BLOCKS = 30  # SmolLM2-135M
DETECTION_S = LOCAL_TEST.suspect_after + LOCAL_TEST.probe_timeout  # suspicion (x log10 of 4 members: 1), a probe


@pytest.fixture(scope="module")
def browser_ready() -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"no browser at {CHROMIUM}: install Debian's chromium (scripts/bootstrap.sh does, as root)")
    pytest.importorskip("playwright.sync_api", reason="Playwright's Python API is missing (pip install playwright)")


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory) -> Path:
    from swarmd.daemon.descriptor import BENCH_FILE, device_name, load_or_measure, resolve_device

    home = tmp_path_factory.mktemp("bench")
    device = resolve_device("auto")
    load_or_measure(home, device, device_name(device))
    return home / BENCH_FILE


@pytest.fixture(scope="module")
def swarm(browser_ready, tmp_path_factory, bench_file):
    """4 daemons with an even plan (the founder adopts it), local-test timings and an API token."""
    from swarmd.net.identity import load_or_create_identity, peer_id_of

    base = tmp_path_factory.mktemp("web")
    extra = ("--timings", "local-test", "--max-context", "256", "--api-token", TOKEN)
    daemons = [Daemon(base / f"d{i}", None, bench_file=bench_file, swarm="web", extra=extra) for i in range(4)]
    peers = [peer_id_of(load_or_create_identity(d.home)) for d in daemons]
    plan = base / "plan.json"
    plan.write_text(even_plan(peers).dumps())
    try:
        first = daemons[0].start(extra=("--plan", str(plan))).wait_ready(60)
        for d in daemons[1:]:
            d.start(bootstrap=(first.addresses[0],))
        for d in daemons[1:]:
            d.wait_ready(60)
        yield daemons
    finally:
        stop_all(daemons)


@pytest.fixture(scope="module")
def page(swarm, tmp_path_factory):
    """One tab on the first daemon's page; every request it makes is recorded (url, Authorization header)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, accept_downloads=True)
        try:
            tab = context.new_page()
            tab.requests = []  # type: ignore[attr-defined]
            tab.errors = []  # type: ignore[attr-defined]
            tab.on("request", lambda r: tab.requests.append((r.url, r.headers.get("authorization"))))
            tab.on("pageerror", lambda e: tab.errors.append(str(e)))
            tab.goto(swarm[0].api + "/")
            yield tab
        finally:
            context.close()


def api(daemon: Daemon, path: str) -> dict:
    return http.get(f"{daemon.api}{path}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()


def blocks(ranges: str) -> list[int]:
    out = []
    for part in filter(None, ranges.split(",")):
        a, b = part.split("–")
        out += range(int(a), int(b) + 1)
    return out


def test_the_page_asks_for_the_token_once_then_maps_four_members_and_the_whole_chain(swarm, page):
    page.wait_for_selector("#auth:not([hidden])", timeout=10_000)
    page.fill("#auth-token", TOKEN)
    page.tokened = len(page.requests)  # type: ignore[attr-defined]  # the requests from here on carry it
    page.click("#auth button")
    page.wait_for_function("() => document.querySelectorAll('#map .member[data-state=alive]').length === 4 "
                           "&& /layers 0-29 covered/.test(document.getElementById('coverage').textContent)",
                           timeout=300_000)
    assert page.evaluate("() => sessionStorage.getItem('swarmd.apiToken')") == TOKEN
    doc = api(swarm[0], "/api/v0/status")
    members = page.eval_on_selector_all("#map .member", "gs => gs.map(g => ({peer: g.dataset.peer, short: "
                                        "g.dataset.short, leader: g.dataset.leader, blocks: g.dataset.blocks, "
                                        "text: g.textContent}))")
    assert sorted(m["peer"] for m in members) == sorted(d.peer_id for d in swarm)
    for m in members:
        assert m["short"] == m["peer"][-6:] and m["text"].startswith(m["short"])  # as `swarmd status` shows it
        for word in ("alive", "memory", "free", "group", "load", "stage", "blocks"):
            assert word in m["text"], (word, m["text"])
        assert (m["leader"] == "true") == (m["peer"] == doc["leader"]) and ("★ leader" in m["text"]) == (
            m["peer"] == doc["leader"])
    assert sorted(b for m in members for b in blocks(m["blocks"])) == list(range(N_BLOCKS))
    arrows = page.eval_on_selector_all("#map g.chain", "gs => gs.map(g => [g.dataset.blocks, "
                                       "g.querySelector('text').textContent])")
    assert [blocks(a) for a, _ in arrows] == [list(range(*s["layers"])) for s in doc["plan"]["stages"]]
    assert all(label == f"blocks {a}" for a, label in arrows)


def test_the_chat_answers_what_submit_prompt_answers(swarm, page):
    env = {**os.environ, "SWARMD_API_TOKEN": TOKEN}
    cli = subprocess.run([sys.executable, "-m", "swarmd", "submit-prompt", "--api", swarm[0].api, "--chat", CHAT,
                          "-n", str(N_TOKENS)], capture_output=True, text=True, env=env, timeout=600)
    assert cli.returncode == 0, cli.stderr
    page.fill("#chat-max-tokens", str(N_TOKENS))
    page.fill("#chat-input", CHAT)
    page.click("#chat-send")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=600_000)
    assert page.text_content(".msg.assistant") == cli.stdout
    assert re.search(r"\d+ tokens · [\d.]+ tokens/s", page.text_content("#chat-stats"))


def test_the_waterfall_of_the_chats_traced_request_lists_every_daemon_and_downloads_as_perfetto_json(swarm, page):
    page.wait_for_function("() => document.querySelectorAll('#waterfall .wf-node').length >= 4", timeout=30_000)
    chosen = page.input_value("#trace-select")
    assert api(swarm[0], "/api/v0/traces")["traces"][0]["request_id"] == chosen
    decoded = [s for s in map(int, page.eval_on_selector_all("#trace-step option", "os => os.map(o => o.value)"))
               if s >= 1]
    assert len(decoded) >= 2 and page.input_value("#trace-step") == str(decoded[len(decoded) // 2])  # a typical token
    nodes = page.eval_on_selector_all("#waterfall .wf-node", "ns => ns.map(n => n.dataset.peer)")
    assert sorted(set(nodes)) == sorted(d.peer_id for d in swarm)
    kinds = set(page.eval_on_selector_all("#waterfall .wf-row", "rs => rs.map(r => r.dataset.kind)"))
    assert {"queue", "compute", "hop"} <= kinds
    hops = page.eval_on_selector_all("#waterfall .wf-row[data-span='hop.send']", "rs => rs.map(r => r.textContent)")
    assert hops and all(re.search(r"→ \w{6} [\d.]+ (B|KiB|MiB)", h) for h in hops), hops
    with page.expect_download() as download:
        page.click("#trace-download")
    saved = json.loads(Path(download.value.path()).read_text())
    assert saved["traceEvents"] == api(swarm[0], f"/api/v0/traces/{chosen}")["traceEvents"]


def test_the_experts_heatmap_colours_each_holders_experts_by_tokens_routed(page):
    moe = {"placement": {"1": {"0": ["12D3KooWaaaaaa"], "1": ["12D3KooWbbbbbb"], "2": ["12D3KooWbbbbbb",
                                                                                       "12D3KooWaaaaaa"]}},
           "routed": {"1": {"tokens": {"0": 7, "1": 0, "2": 30}}}, "computed_here": {"tokens": {}}}
    cells = page.evaluate("""moe => {
        renderExperts({moe});
        return [...document.querySelectorAll('#experts tr[data-holder]')].map(r => [r.dataset.holder,
            [...r.querySelectorAll('td')].map(td => td.classList.contains('held') ? Number(td.dataset.tokens) : null),
            r.querySelector('th').textContent, getComputedStyle(r.querySelector('td.held')).backgroundColor]);
    }""", moe)
    assert [c[:3] for c in cells] == [["12D3KooWaaaaaa", [7, None, 30], "block 1 · aaaaaa"],
                                      ["12D3KooWbbbbbb", [None, 0, 30], "block 1 · bbbbbb"]]
    assert cells[0][3] != cells[1][3]  # 7 tokens and 0 tokens are not the same colour


def test_a_daemon_killed_turns_dead_on_the_page_within_the_detection_time_plus_two_seconds(swarm, page):
    victim = swarm[2]
    start = time.monotonic()
    victim.kill9()
    page.wait_for_selector(f"#map .member[data-peer='{victim.peer_id}'][data-state=dead]", timeout=20_000)
    took = time.monotonic() - start
    print(f"dead on the page {took:.2f} s after kill -9")
    assert took <= DETECTION_S + 2.0, f"dead on the page after {took:.2f} s"


def test_the_page_fetched_nothing_from_elsewhere_and_sent_the_token_with_every_data_request(swarm, page):
    assert page.errors == []  # no script error all along
    origin = swarm[0].api
    assert page.requests
    for i, (url, authorization) in enumerate(page.requests):
        assert url.startswith((origin + "/", "blob:", "data:")), url
        if url.startswith((origin + "/api/", origin + "/v1/")) and i >= page.tokened:
            assert authorization == f"Bearer {TOKEN}", url
