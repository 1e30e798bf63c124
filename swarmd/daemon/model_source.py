"""Which model a daemon serves, and where its weights come from, when it starts.

In order:
1. a seeded model (`random/...`): drawn, nothing to find;
2. the whole file on this machine (a known name already in the cache, a .gguf path, an Ollama model);
3. a complete model fetched into the cache earlier;
4. the members named by `--bootstrap`: the first that serves the model (`NAME`, or `manifest:HASH`) sends its
   manifest, and the daemon serves it as a partial model in the cache (resuming one it has), fetching what its
   assignment needs once the plan says what that is;
5. a partial model in the cache, if no member answered (a restart while the swarm is away);
6. fetched or written locally (`swarmd pull`'s way: a wheel, a derived or seeded file), only now.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from models.catalog.chunk_store import PartialModel, find_partial
from models.errors import ModelError
from models.gguf.manifest import Manifest, parse_manifest_name
from swarmd.daemon.served_model import ServedModel, from_store, seeded_model, served_model, whole_file_store
from swarmd.net.identity import short_id
from swarmd.net.seam import Network, PeerUnreachable, StreamClosed
from swarmd.net.streams import read_frame, write_frame
from swarmd.weights.protocol import (
    MAX_MANIFEST_FRAME,
    PROTOCOL,
    ManifestReply,
    ManifestRequest,
    Refusal,
    decode_reply,
    encode,
)

log = logging.getLogger("swarmd.weights")

ASK_ATTEMPTS = 3


async def resolve_served(spec: str, network: Network, bootstrap: Sequence[tuple[str, str]], *,
                         wait_s: float = 10.0,
                         blocking: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync) -> ServedModel:
    """The model `spec` names, as this daemon serves it (see the module's docstring); `blocking` runs file work
    and hashing."""
    from models.catalog.seeded import parse_seeded_name

    seeded = parse_seeded_name(spec)
    if seeded is not None:
        return seeded_model(seeded)
    digest = parse_manifest_name(spec)
    if digest is None:
        local = await blocking(_local_file, spec)
        if local is not None:
            name, path = local
            return from_store(name, await blocking(whole_file_store, path))
    partial = await blocking(lambda: find_partial(name="" if digest else spec, digest=digest or ""))
    if partial is not None and partial.complete:
        return from_store(_name(partial, spec), partial)
    if bootstrap:
        answer = await ask_members(network, bootstrap, spec, wait_s=wait_s, blocking=blocking)
        if answer is not None:
            name, peer, manifest = answer
            if partial is None or partial.digest != manifest.digest:
                partial = await blocking(PartialModel.create, manifest, name)
            else:
                partial.add_name(name)
            log.info("%s (manifest %s) is served by the swarm (%s answered): %.1f of %.1f MiB held here; the "
                     "plan's share is fetched from the members", name, manifest.digest[:12], short_id(peer),
                     partial.held_bytes() / 2**20, manifest.tensor_bytes / 2**20)
            return from_store(name, partial)
        if partial is not None:
            log.warning("no member answered for %s: serving the %.1f MiB of it held here until one does", spec,
                        partial.held_bytes() / 2**20)
            return from_store(_name(partial, spec), partial)
    if digest is not None:
        if partial is not None:
            return from_store(_name(partial, spec), partial)
        raise ModelError(f"no member serves {spec} and it is not in the model cache: join through a member that "
                         "serves it (--bootstrap)")
    return await blocking(served_model, spec)


def _local_file(spec: str):
    """(name, path) of the whole file `spec` names on this machine, without fetching or writing anything."""
    from models.catalog.names import resolve_model

    try:
        source = resolve_model(spec, fetch=False)
    except ModelError:
        return None
    return source.name, source.path


def _name(partial: PartialModel, spec: str) -> str:
    return spec if spec in partial.names else (partial.names[0] if partial.names else partial.manifest.name_in_swarm)


async def ask_members(network: Network, bootstrap: Sequence[tuple[str, str]], spec: str, *,
                      wait_s: float = 10.0, blocking: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync,
                      ) -> tuple[str, str, Manifest] | None:
    """(served name, peer, manifest) from the first bootstrap peer that serves `spec`; None if none does within
    `wait_s` (a peer that serves another model says so at once)."""
    digest = parse_manifest_name(spec)
    with trio.move_on_after(wait_s):
        for attempt in range(ASK_ATTEMPTS):
            refused = 0
            for peer, address in bootstrap:
                try:
                    answer = await _ask(network, peer, address, spec, blocking)
                except (PeerUnreachable, StreamClosed, ModelError) as e:
                    log.info("asking %s for %s: %s", short_id(peer), spec, e)
                    continue
                except Exception as e:  # a peer's garbage never stops a start
                    log.info("asking %s for %s: %s: %s", short_id(peer), spec, type(e).__name__, e)
                    continue
                if isinstance(answer, str):
                    refused += 1
                    log.info("%s does not serve %s: %s", short_id(peer), spec, answer)
                    continue
                name, manifest = answer
                if digest is not None and not manifest.digest.startswith(digest):
                    log.info("%s answered for %s with manifest %s", short_id(peer), spec, manifest.digest[:12])
                    continue
                return name, peer, manifest
            if refused == len(bootstrap):
                return None
            await trio.sleep(0.5 * (attempt + 1))
    return None


async def _ask(network: Network, peer: str, address: str, spec: str, blocking: Callable[..., Awaitable[Any]],
               ) -> tuple[str, Manifest] | str:
    if not network.is_connected(peer):
        await network.connect(peer, [address if "/p2p/" in address else f"{address}/p2p/{peer}"])
    stream = await network.open_stream(peer, PROTOCOL)
    try:
        await write_frame(stream, encode(ManifestRequest(spec)))
        reply = decode_reply(await read_frame(stream, MAX_MANIFEST_FRAME))
    finally:
        try:
            await stream.close()
        except Exception:
            pass
    if isinstance(reply, Refusal):
        return reply.reason
    if not isinstance(reply, ManifestReply):
        raise StreamClosed(f"answered a manifest request with {type(reply).__name__}")
    manifest = await blocking(Manifest.decode, reply.manifest)
    return reply.name, manifest
