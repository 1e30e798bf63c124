#!/usr/bin/env python3
"""A screenshot of a daemon's web page after one chat, in headless Chromium (the README's picture).

    ./scripts/demo.sh --keep                     # in one terminal: 4 daemons; note an "api http://..." line
    .venv/bin/python scripts/page_screenshot.py http://127.0.0.1:PORT --out docs/img/web-page.png

It opens the page (typing --api-token where the daemon wants one), waits for the map to show every member and the
chain covered, sends --chat through the page's chat (traced; --rounds times, each in a new chat), waits for the
answer and the token's waterfall, and saves the whole page as PNG. It drives Debian's chromium (/usr/bin/chromium) through Playwright.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", help="the daemon's API address, e.g. http://127.0.0.1:8765")
    p.add_argument("--out", type=Path, default=Path("docs/img/web-page.png"))
    p.add_argument("--chat", default="Give me three reasons to learn Python.")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2, help="chats sent, each in a new chat (the first compiles "
                                                         "kernels on a fresh machine); the last one is shown")
    p.add_argument("--api-token", default="")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--width", type=int, default=1280)
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        context = pw.chromium.launch_persistent_context(profile, executable_path=args.chromium, headless=True,
                                                        args=CHROMIUM_ARGS,
                                                        viewport={"width": args.width, "height": 900})
        page = context.new_page()
        page.goto(args.url.rstrip("/") + "/")
        if args.api_token:
            page.wait_for_selector("#auth:not([hidden])")
            page.fill("#auth-token", args.api_token)
            page.click("#auth button")
        print("waiting for the map...", file=sys.stderr)
        page.wait_for_function("() => /covered/.test(document.getElementById('coverage').textContent)",
                               timeout=600_000)
        page.fill("#chat-max-tokens", str(args.max_tokens))
        for i in range(args.rounds):
            page.click("#chat-new")
            page.fill("#chat-input", args.chat)
            page.click("#chat-send")
            print(f"waiting for answer {i + 1} of {args.rounds}...", file=sys.stderr)
            page.wait_for_selector(".msg.assistant[data-state=done]", timeout=600_000)
        page.wait_for_selector("#waterfall .wf-node", timeout=60_000)
        page.wait_for_timeout(1500)  # a status event after the request: load back to 0
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out), full_page=True)
        context.close()
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
