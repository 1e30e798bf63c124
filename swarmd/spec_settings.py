"""How a request speculates: the daemon's default (`swarmd join --speculate ... --draft-tokens K`) and a request's
own choice (`"speculate": {"mode": ..., "draft_tokens": K}` in the API). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODES = ("off", "ngram", "model:NAME")
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 32


class SpecError(ValueError):
    """A speculation setting that cannot be served (HTTP 400 on a request, a refused start on a daemon)."""


def check_mode(mode: str) -> str:
    """`mode` if it is off, ngram or model:NAME; SpecError otherwise."""
    if mode in ("off", "ngram") or (mode.startswith("model:") and mode[len("model:"):].strip()):
        return mode
    raise SpecError(f"unknown speculation mode {mode!r}: use off, ngram or model:NAME (a draft model with the "
                    "served model's vocabulary, e.g. model:smollm2-135m)")


@dataclass(frozen=True)
class SpecSettings:
    mode: str = "off"
    draft_tokens: int = DEFAULT_DRAFT_TOKENS  # the most tokens drafted per pass
    adaptive: bool = True  # k follows the acceptance seen (False: always draft_tokens, for comparisons)

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise SpecError(f"draft_tokens must be 1 to {MAX_DRAFT_TOKENS}, not {self.draft_tokens}")

    @property
    def on(self) -> bool:
        return self.mode != "off"

    @property
    def draft_model(self) -> str | None:
        return self.mode[len("model:"):].strip() if self.mode.startswith("model:") else None


@dataclass(frozen=True)
class SpecRequest:
    """A request's `speculate` field as given (None parts: the daemon's default)."""

    mode: str | None = None
    draft_tokens: int | None = None
    adaptive: bool | None = None

    def resolve(self, default: SpecSettings) -> SpecSettings:
        """The settings the request runs with; SpecError when it asks for more drafts than the daemon allows."""
        k = default.draft_tokens if self.draft_tokens is None else self.draft_tokens
        if not 1 <= k <= default.draft_tokens:
            raise SpecError(f"speculate.draft_tokens must be 1 to {default.draft_tokens} (this daemon's "
                            f"--draft-tokens), not {k}")
        return SpecSettings(self.mode or default.mode, k, default.adaptive if self.adaptive is None else self.adaptive)


def parse_spec_field(value: Any) -> SpecRequest | None:
    """The API's `speculate` field: {"mode": "off" | "ngram" | "model:NAME", "draft_tokens": K, "adaptive": bool},
    every key optional (a bare string is the mode); SpecError for anything else."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"mode": value}
    if not isinstance(value, dict):
        raise SpecError("'speculate' must be an object like {\"mode\": \"ngram\", \"draft_tokens\": 4}")
    unknown = sorted(set(value) - {"mode", "draft_tokens", "adaptive"})
    if unknown:
        raise SpecError(f"'speculate' has unknown key(s) {unknown}: use mode, draft_tokens, adaptive")
    mode = value.get("mode")
    if mode is not None:
        if not isinstance(mode, str):
            raise SpecError("speculate.mode must be a string: off, ngram or model:NAME")
        check_mode(mode)
    k = value.get("draft_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise SpecError(f"speculate.draft_tokens must be an integer of at least 1, not {k!r}")
    adaptive = value.get("adaptive")
    if adaptive is not None and not isinstance(adaptive, bool):
        raise SpecError("speculate.adaptive must be true or false")
    return SpecRequest(mode, k, adaptive)
