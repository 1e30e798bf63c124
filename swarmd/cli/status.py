"""`swarmd status`: ask the local daemon how the swarm is doing, as tables or as JSON."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from swarmd.cli.client import add_token_option, auth_headers, check_authorised
from swarmd.errors import UserError
from swarmd.swarm.election import term_round

ORDER = 20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="members, leader, plan and load of the local daemon's swarm",
                       description="Show the swarm as the local daemon sees it. The daemon is found through "
                                   "$SWARMD_HOME/api, or named with --api.")
    p.add_argument("--api", metavar="HOST:PORT|URL", help="the daemon's API address (default: from $SWARMD_HOME/api)")
    p.add_argument("--home", type=Path, help="the daemon's state directory (default: $SWARMD_HOME or ~/.swarmd)")
    add_token_option(p)
    p.add_argument("--json", action="store_true", help="print the status document as JSON")
    p.add_argument("--watch", nargs="?", type=float, const=1.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 1) until Ctrl-C")
    p.set_defaults(func=run)


def daemon_url(api: str | None, home: Path | None) -> str:
    """The API base URL: --api, else the URL the daemon wrote to its home."""
    from swarmd.api.app import api_url
    from swarmd.config import default_home, parse_api_address

    if api:
        if api.startswith(("http://", "https://")):
            return api.rstrip("/")
        return api_url(*parse_api_address(api))
    home = (home or default_home()).expanduser()
    path = home / "api"
    try:
        return str(json.loads(path.read_text())["url"]).rstrip("/")
    except FileNotFoundError:
        raise UserError(f"no daemon is running for {home} (no {path}): start one with `swarmd join`, "
                        f"or name it with --api HOST:PORT") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{path} is unreadable: is `swarmd join` running with --home {home}?") from None


def fetch_status(url: str, timeout: float = 5.0, token: str | None = None) -> dict[str, Any]:
    import httpx

    try:
        response = httpx.get(f"{url}/api/v0/status", timeout=timeout, headers=auth_headers(token))
    except httpx.HTTPError as e:
        raise UserError(f"no daemon answers at {url} ({type(e).__name__}): is `swarmd join` running?") from None
    check_authorised(response, url, token)
    if response.status_code != 200:
        raise UserError(f"the daemon at {url} answered {response.status_code}: {response.text.strip()[:200]}")
    return response.json()


def run(args: argparse.Namespace) -> int:
    url = daemon_url(args.api, args.home)
    token = args.api_token
    if args.json and not args.watch:
        print(json.dumps(fetch_status(url, token=token), indent=2), flush=True)
        return 0
    from rich.console import Console

    console = Console()
    if not args.watch:
        console.print(render(fetch_status(url, token=token)))
        return 0
    from rich.live import Live

    with Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            try:
                doc = fetch_status(url, token=token)
                view: Any = json.dumps(doc, indent=2) if args.json else render(doc)
            except UserError as e:
                view = f"[red]{e}[/red]"
            live.update(view, refresh=True)
            time.sleep(args.watch)


# --- rendering ----------------------------------------------------------------------------------
def _short(peer_id: str | None) -> str:
    from swarmd.net.identity import short_id

    return short_id(peer_id) if peer_id else "-"


def _bytes(n: int | None) -> str:
    if not n:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _assignment(a: dict[str, Any]) -> tuple[str, str]:
    layers = a.get("layers")
    what = f"{layers[0]}-{layers[1] - 1}" if layers else "-"
    if a.get("experts"):
        what += f" +{sum(len(v) for v in a['experts'].values())} experts"
    state = a.get("state", "idle")
    if state == "failed":
        state = f"failed: {a.get('error', '')}"
    fetch = a.get("fetch") or {}
    if fetch.get("total"):
        state += f" ({fetch_line(fetch['bytes'], fetch['total'], fetch.get('rate', 0.0))})"
    return what, state


def fetch_line(done: int, total: int, rate: float) -> str:
    """'fetching 12.0 of 39.3 MiB, 3.1 MiB/s, 9 s left' (the time left only once a rate is known)."""
    line = f"fetching {done / 2**20:.1f} of {total / 2**20:.1f} MiB"
    if rate > 0:
        line += f", {rate / 2**20:.1f} MiB/s, {(total - done) / rate:.0f} s left"
    return line


def weights_line(w: dict[str, Any]) -> str:
    """What this daemon holds of the model, fetches and serves, in one line."""
    line = f"{_bytes(w.get('held_bytes'))} of {_bytes(w.get('model_bytes'))} held here"
    line += " (a partial model: the rest is fetched from members as the plan assigns it)" if w.get("partial") else ""
    fetch = w.get("fetch") or {}
    if fetch.get("active"):
        line += f"; {fetch_line(fetch['bytes'], fetch['total'], fetch.get('rate_bytes_per_s', 0.0))}"
        line += f" from {fetch.get('sources', 0)} peer(s)" + (f"; waiting: {fetch['waiting']}" if fetch.get("waiting") else "")
    served = (w.get("served") or {}).get("bytes_served", 0)
    if served:
        line += f"; served {_bytes(served)} to others"
    return line


def _slots(a: dict[str, Any]) -> str:
    """'3/16 used' (requests waiting for a slot count as used), or '-' when the member reports none."""
    kv = a.get("kv")
    return f"{kv['used']}/{kv['slots']} used" if kv else "-"


def requests_line(doc: dict[str, Any]) -> str:
    """This daemon's requests: running, waiting in its queue (and its bound), refused for a full queue."""
    queue = doc.get("queue")
    if not queue:
        return f"{doc.get('requests_in_flight', 0)} in flight"
    line = f"{queue['running']} running, {queue['queued']} queued (max {queue['max_queued']})"
    if queue["refused"]:
        line += f", {queue['refused']} refused (429, queue full)"
    return line


def access_line(swarm: dict[str, Any]) -> str:
    """Who can join, in one line (rich markup): open swarms in red."""
    if swarm.get("private"):
        line = f"[green]private[/green] (swarm key {swarm.get('key_fingerprint')})"
    else:
        line = ("[bold red]OPEN[/bold red]: anyone who can reach this daemon's address can join, read the gossip "
                "and receive a plan (start the swarm with --swarm-key FILE)")
    if swarm.get("allowlist") is not None:
        line += f"; allowlist of {len(swarm['allowlist'])} peer(s)"
    if swarm.get("api_token_required"):
        line += "; API needs a token"
    return line


def render(doc: dict[str, Any]):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    me, plan = doc["self"], doc.get("plan")
    top = Table.grid(padding=(0, 2))
    top.add_column(style="bold")
    top.add_column()
    top.add_row("self", f"{me['peer_id']}  ({me.get('label') or me.get('device')}, {me['model']['name']}, "
                        f"manifest {me['model'].get('digest', '')[:12] or '-'})")
    top.add_row("api", str(me.get("api")))
    leader = doc.get("leader")
    lead = _short(leader) + (" (this node)" if leader == me["peer_id"] else "") if leader else "none"
    if not doc.get("admitted"):
        lead += "  (not admitted yet: waiting for a member to accept this node)"
    counts = {s: sum(1 for m in doc["members"] if m["state"] == s) for s in ("alive", "suspect", "dead")}
    swarm = doc["swarm"] if isinstance(doc["swarm"], dict) else {"name": doc["swarm"]}
    top.add_row("swarm", f"{swarm['name']}  leader {lead}  term {term_round(doc['term'] or 0)}  "
                         f"plan epoch {plan['epoch'] if plan else '-'}  members {counts['alive']} alive"
                         + (f", {counts['suspect']} suspect" if counts["suspect"] else "")
                         + (f", {counts['dead']} dead" if counts["dead"] else ""))
    top.add_row("plan", doc.get("coverage", "-") + (f"  [red]({doc['plan_error']})[/red]" if doc.get("plan_error") else ""))
    if doc.get("slots"):
        top.add_row("slots", slots_line(doc["slots"], leader == me["peer_id"]))
    top.add_row("requests", requests_line(doc))
    if doc.get("speculation"):
        top.add_row("speculation", speculation_line(doc["speculation"]))
    if (doc.get("weights") or {}).get("model_bytes"):
        top.add_row("weights", weights_line(doc["weights"]))
    top.add_row("access", access_line(swarm))
    reach = (doc.get("connectivity") or {}).get("reachability")
    if reach:
        top.add_row("network", f"{reach['summary']}  (details: swarmd doctor)")

    table = Table(title="members", title_justify="left", expand=False)
    for col in ("peer", "state", "last seen", "rtt", "device", "memory free", "layers", "stage", "kv slots"):
        table.add_column(col)
    styles = {"alive": "green", "suspect": "yellow", "dead": "red"}
    for m in doc["members"]:
        layers, stage = _assignment(m["assignment"])
        peer = _short(m["peer_id"]) + (" *" if m["peer_id"] == me["peer_id"] else "")
        table.add_row(peer, Text(m["state"], style=styles.get(m["state"], "")),
                      "now" if m["peer_id"] == me["peer_id"] else f"{m['last_seen_s']:.1f} s ago",
                      "-" if m.get("rtt_ms") is None else f"{m['rtt_ms']:.1f} ms",
                      m.get("label") or m.get("device") or "-", _bytes(m.get("memory_free")), layers, stage,
                      _slots(m["assignment"]))
    parts: list[Any] = [top, table]
    if doc.get("links"):
        links = Table(title="links (how activations reach each peer)", title_justify="left")
        for col in ("peer", "path", "why"):
            links.add_column(col)
        colour = {"data-plane": "green", "direct": "green", "relayed": "yellow", "none": "red"}
        for link in doc["links"]:
            links.add_row(_short(link["peer_id"]), Text(link["path"], style=colour.get(link["path"], "")),
                          link["reason"])
        parts.append(links)
    if doc.get("moe", {}).get("placement"):
        parts.append(experts_table(doc["moe"]))
    if swarm.get("penalised"):
        box = Table(title="penalised peers", title_justify="left")
        for col in ("peer", "for", "reason"):
            box.add_column(col)
        for p in swarm["penalised"]:
            box.add_row(_short(p["peer_id"]), f"{p['seconds_left']:.0f} s", p["reason"])
        parts.append(box)
    if doc.get("refused"):
        refused = Table(title="refused", title_justify="left")
        refused.add_column("peer")
        refused.add_column("reason")
        for r in doc["refused"]:
            refused.add_row(_short(r["peer_id"]), r["reason"])
        parts.append(refused)
    return Group(*parts)


def speculation_line(spec: dict[str, Any]) -> str:
    """The speculative requests this daemon headed, in one line."""
    line = f"{spec['mode']}" + (f" (up to {spec['draft_tokens']} drafts a pass)" if spec["mode"] != "off" else "")
    if spec.get("passes"):
        rate = f"{100 * spec['acceptance']:.0f} %" if spec.get("acceptance") is not None else "-"
        line += (f"  {spec['passes']} passes, {spec['drafted']} drafted, {spec['accepted']} accepted ({rate}), "
                 f"{spec['tokens_per_pass']:.2f} tokens a pass, {spec['draft_seconds']:.2f} s drafting")
    return line


def slots_line(slots: dict[str, Any], leading: bool) -> str:
    """This daemon's slot of the plan file, and (as the leader binds them) how many are claimed and which not."""
    bound = slots["bound"]
    line = f"{slots['file']}" + (f", this daemon: {slots['slot']}" if slots.get("slot") else "")
    if leading or any(bound.values()):
        line += f"; {sum(1 for p in bound.values() if p)}/{len(bound)} claimed"
    if slots.get("overdue"):
        line += f"  [red](not claimed within {slots['claim_timeout_s']:.0f} s: {', '.join(slots['overdue'])})[/red]"
    elif slots.get("unclaimed") and (leading or any(bound.values())):
        line += f" (waiting for {', '.join(slots['unclaimed'])})"
    if slots.get("refused"):
        line += "; refused: " + ", ".join(f"{_short(p)} for {s}" for p, s in slots["refused"].items())
    return line


def _list(items: list[str], limit: int = 24) -> str:
    return " ".join(items[:limit]) + (f" ... (+{len(items) - limit})" if len(items) > limit else "")


def experts_table(moe: dict[str, Any]):
    """Per MoE block: which node holds which experts, and the tokens routed to each expert (by this
    daemon's router where its stage owns the block, else those its own expert actor computed)."""
    from rich.table import Table

    table = Table(title="experts (block: holder -> experts; tokens routed per expert)", title_justify="left")
    for col in ("block", "where", "tokens routed"):
        table.add_column(col)
    here = moe.get("computed_here", {}).get("tokens", {})
    for block, by_expert in moe["placement"].items():
        holders: dict[str, list[str]] = {}
        for expert, peers in by_expert.items():
            for peer in peers:
                holders.setdefault(_short(peer), []).append(expert)
        where = "  ".join(f"{peer}: {','.join(es)}" for peer, es in sorted(holders.items()))
        routed = moe.get("routed", {}).get(block, {}).get("tokens") or here.get(block) or {}
        load = _list([f"{e}:{n}" for e, n in sorted(routed.items(), key=lambda kv: int(kv[0]))]) if routed else "-"
        table.add_row(block, where, load)
    return table
