"""What weights a node holds on its disk, in the layout's terms, as its descriptor carries them.

`NodeDescriptor.holds` is a tuple of short strings, so that a heartbeat stays small for any model:

    "*"            every weight of the model (a whole file, or a seeded model drawn locally)
    "e"            the token embedding
    "h"            the output norm and head (the embedding again, when the head is tied to it)
    "b0-7", "b9"   blocks whose weights (routed experts apart) are all held
    "x3:0-5,9"     routed experts 0-5 and 9 of block 3

An empty tuple holds nothing: every assigned byte must be fetched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from planner.errors import PlanSchemaError

EVERYTHING = "*"


@dataclass(frozen=True)
class Holdings:
    everything: bool = False
    embedding: bool = False
    head: bool = False
    blocks: frozenset[int] = frozenset()
    experts: Mapping[int, frozenset[int]] = field(default_factory=dict)

    def has_block(self, block: int) -> bool:
        return self.everything or block in self.blocks

    def has_expert(self, block: int, expert: int) -> bool:
        return self.everything or expert in self.experts.get(block, frozenset())

    @property
    def anything(self) -> bool:
        return self.everything or self.embedding or self.head or bool(self.blocks) or any(self.experts.values())


def format_holdings(*, everything: bool = False, embedding: bool = False, head: bool = False,
                    blocks: Iterable[int] = (), experts: Mapping[int, Iterable[int]] | None = None) -> tuple[str, ...]:
    if everything:
        return (EVERYTHING,)
    out = [*(["e"] if embedding else []), *(["h"] if head else [])]
    out += [f"b{r}" for r in _ranges(sorted(set(blocks)))]
    for block, es in sorted((experts or {}).items()):
        spans = _ranges(sorted(set(es)))
        if spans:
            out.append(f"x{block}:{','.join(spans)}")
    return tuple(out)


def parse_holdings(items: Iterable[str]) -> Holdings:
    """PlanSchemaError for anything that is not the syntax above (descriptors come from peers)."""
    everything = embedding = head = False
    blocks: set[int] = set()
    experts: dict[int, set[int]] = {}
    for item in items:
        if item == EVERYTHING:
            everything = True
        elif item == "e":
            embedding = True
        elif item == "h":
            head = True
        elif item.startswith("b"):
            blocks |= _parse_span(item[1:], item)
        elif item.startswith("x") and ":" in item:
            block, spans = item[1:].split(":", 1)
            if not block.isdigit():
                raise PlanSchemaError(f"bad holdings entry {item[:40]!r}")
            for span in spans.split(","):
                experts.setdefault(int(block), set()).update(_parse_span(span, item))
        else:
            raise PlanSchemaError(f"bad holdings entry {item[:40]!r}")
    return Holdings(everything, embedding, head, frozenset(blocks),
                    {b: frozenset(es) for b, es in experts.items()})


MAX_SPAN = 1 << 20  # no model has more blocks or experts; a peer's "b0-999999999" is refused, not expanded


def _parse_span(text: str, item: str) -> set[int]:
    lo, _, hi = text.partition("-")
    if not lo.isdigit() or (hi and not hi.isdigit()):
        raise PlanSchemaError(f"bad holdings entry {item[:40]!r}")
    a, b = int(lo), int(hi or lo)
    if b < a or b - a > MAX_SPAN:
        raise PlanSchemaError(f"bad holdings range {item[:40]!r}")
    return set(range(a, b + 1))


def _ranges(values: list[int]) -> list[str]:
    """[0, 1, 2, 5, 7, 8] -> ["0-2", "5", "7-8"] (values sorted)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return [f"{a}-{b}" if b != a else str(a) for a, b in runs]
