"""Which chunk to ask of whom: the sans-IO core of a fetch (`swarmd.weights.fetcher` does its I/O).

A fetch wants a set of chunks. Sources (peers serving the model) offer the chunks they hold; `take(peer, n)`
hands a source up to n wanted chunks it offers, rarest first (fewest sources offer it), then in file order,
never a chunk already asked of another source. What comes back moves the chunk on:

    WANTED --take--> ASKED --arrived--> HELD
                     ASKED --corrupt / refused / lost--> WANTED   (asked elsewhere next)

A source that sends a chunk that fails its check is banned from this fetch (and the driver strikes it);
a source whose stream broke is gone until it offers again; a chunk a source refused is not asked of it
again until it offers anew. Chunks held at the start (a resumed fetch) are HELD from the beginning.
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from swarmd.errors import LocalProtocolError


class ChunkState(enum.Enum):
    WANTED = "wanted"
    ASKED = "asked"
    HELD = "held"


class SourceState(enum.Enum):
    ACTIVE = "active"
    GONE = "gone"  # its stream broke; it may offer again
    BANNED = "banned"  # it sent a bad chunk: never asked again in this fetch


# (state, event) -> next state: every transition a chunk may make.
TRANSITIONS: dict[tuple[ChunkState, str], ChunkState] = {
    (ChunkState.WANTED, "take"): ChunkState.ASKED,
    (ChunkState.ASKED, "arrived"): ChunkState.HELD,
    (ChunkState.ASKED, "corrupt"): ChunkState.WANTED,
    (ChunkState.ASKED, "refused"): ChunkState.WANTED,
    (ChunkState.ASKED, "lost"): ChunkState.WANTED,
}


# --- inputs -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Offered:
    peer: str
    chunks: frozenset[int]  # every chunk the source holds now


@dataclass(frozen=True)
class Arrived:
    peer: str
    chunk: int


@dataclass(frozen=True)
class Corrupt:
    peer: str
    chunk: int
    reason: str


@dataclass(frozen=True)
class Refused:
    peer: str
    chunk: int


@dataclass(frozen=True)
class SourceLost:
    peer: str
    reason: str


FetchInput = Offered | Arrived | Corrupt | Refused | SourceLost


# --- actions ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Strike:
    peer: str
    reason: str


@dataclass(frozen=True)
class StopSource:
    peer: str
    reason: str


FetchAction = Strike | StopSource


class FetchState:
    def __init__(self, sizes: Mapping[int, int], held: Iterable[int] = ()) -> None:
        """`sizes`: the wanted chunks and their lengths; `held`: those already on disk."""
        self.sizes = dict(sizes)
        have = set(held)
        self.state = {i: ChunkState.HELD if i in have else ChunkState.WANTED for i in self.sizes}
        self.asked_of: dict[int, str] = {}
        self.offers: dict[str, frozenset[int]] = {}
        self.sources: dict[str, SourceState] = {}
        self.refused: dict[str, set[int]] = {}
        self.bytes_held = sum(n for i, n in self.sizes.items() if i in have)
        self.bytes_total = sum(self.sizes.values())
        # the WANTED chunks, kept with `state` (every query starts from them, not from all the chunks)
        self._wanted = {i for i, st in self.state.items() if st is ChunkState.WANTED}
        self._askable_sources: Counter[int] | None = None  # `_sources_per_chunk`, None once a source changed

    # --- queries --------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return not self._wanted and not self.asked_of

    def active(self) -> list[str]:
        return sorted(p for p, s in self.sources.items() if s is SourceState.ACTIVE)

    def unsourced(self) -> list[int]:
        """Wanted chunks no active source offers (or every one that does has refused them)."""
        rarity = self._sources_per_chunk()
        return sorted(i for i in self._wanted if not rarity.get(i))

    # --- transitions ----------------------------------------------------------------------------------------
    def take(self, peer: str, limit: int) -> list[int]:
        """Up to `limit` wanted chunks to ask of `peer` now (they become ASKED)."""
        if self.sources.get(peer) is not SourceState.ACTIVE or limit <= 0:
            return []
        rarity = self._sources_per_chunk()
        chosen = heapq.nsmallest(limit, self._candidates(peer), key=lambda i: (rarity[i], i))
        for i in chosen:
            self._move(i, "take")
            self.asked_of[i] = peer
        return chosen

    def handle(self, msg: FetchInput) -> list[FetchAction]:
        if not isinstance(msg, Arrived):
            self._askable_sources = None  # who may be asked for what changes
        if isinstance(msg, Offered):
            if self.sources.get(msg.peer) is not SourceState.BANNED:
                self.sources[msg.peer] = SourceState.ACTIVE
                self.offers[msg.peer] = msg.chunks
                self.refused.pop(msg.peer, None)
            return []
        if isinstance(msg, Arrived):
            self._answered(msg.peer, msg.chunk, "arrived")
            self.bytes_held += self.sizes[msg.chunk]
            return []
        if isinstance(msg, Corrupt):
            self._answered(msg.peer, msg.chunk, "corrupt")
            self._drop(msg.peer, SourceState.BANNED)
            return [Strike(msg.peer, f"weights chunk {msg.chunk}: {msg.reason}"),
                    StopSource(msg.peer, f"sent a bad chunk ({msg.reason})")]
        if isinstance(msg, Refused):
            self._answered(msg.peer, msg.chunk, "refused")
            self.refused.setdefault(msg.peer, set()).add(msg.chunk)
            return []
        if isinstance(msg, SourceLost):
            if self.sources.get(msg.peer) is SourceState.ACTIVE:
                self._drop(msg.peer, SourceState.GONE)
            return []
        raise LocalProtocolError(f"not a fetch input: {msg!r}")

    # --- helpers --------------------------------------------------------------------------------------------
    def _candidates(self, peer: str) -> list[int]:
        offered, refused = self.offers.get(peer, frozenset()), self.refused.get(peer, set())
        return [i for i in self._wanted if i in offered and i not in refused]

    def _sources_per_chunk(self) -> Counter[int]:
        """Chunk -> the active sources that offer it and have not refused it (kept until a source changes)."""
        if self._askable_sources is None:
            self._askable_sources = Counter(i for p, st in self.sources.items() if st is SourceState.ACTIVE
                                            for i in self.offers.get(p, frozenset()) - self.refused.get(p, set()))
        return self._askable_sources

    def _answered(self, peer: str, chunk: int, event: str) -> None:
        if self.asked_of.get(chunk) != peer:
            raise LocalProtocolError(f"chunk {chunk} was not asked of {peer}")
        del self.asked_of[chunk]
        self._move(chunk, event)

    def _drop(self, peer: str, state: SourceState) -> None:
        """`peer` is no source any more: what was asked of it is wanted again."""
        self.sources[peer] = state
        self.offers.pop(peer, None)
        for chunk in [i for i, p in self.asked_of.items() if p == peer]:
            del self.asked_of[chunk]
            self._move(chunk, "lost")

    def _move(self, chunk: int, event: str) -> None:
        nxt = TRANSITIONS.get((self.state[chunk], event))
        if nxt is None:
            raise LocalProtocolError(f"chunk {chunk}: no transition from {self.state[chunk].value} on {event}")
        self.state[chunk] = nxt
        if nxt is ChunkState.WANTED:
            self._wanted.add(chunk)
        else:
            self._wanted.discard(chunk)
