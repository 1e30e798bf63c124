"""Chat messages -> prompt text, through the Jinja chat template stored in the GGUF.

Rendered the way HF transformers renders `chat_template`s (sandboxed Jinja, trim_blocks, lstrip_blocks,
`raise_exception`, `tojson`, `strftime_now`), so templates written for it work unchanged.
SmolLM2's template inserts its default system prompt when the first message is not a system one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from models.errors import ModelError

# What llama.cpp falls back to when a GGUF carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ModelError):
    """The template refused the messages (its `raise_exception`) or could not be rendered."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the model's chat template does not parse: {exc}") from None


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A non-empty list of {role: str, content: str, ...} maps, copied; anything else is a ModelError."""
    if not messages:
        raise ChatTemplateError("a chat needs at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ChatTemplateError(f"message {i} must have a string 'role' and a string 'content'")
        out.append(dict(message))
    return out


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = ""):
        self.source = source or CHATML_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _compile(self.source)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> ChatTemplate:
        """The template of the GGUF the tokenizer came from (`models.text.tokenizer.Tokenizer`)."""
        return cls(tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text for `messages`; with `add_generation_prompt`, it ends where the assistant's
        reply begins."""
        import jinja2

        context = {"messages": check_messages(messages), "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token, "eos_token": self.eos_token, **extra}
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None
