"""The GGUF's chat template renders messages exactly as llama.cpp's reference prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.text.chat import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError
from models.text.tokenizer import Tokenizer

REFERENCE = Path(__file__).parent / "data" / "llamacpp-reference-smollm2.json"
CHAT_CASES = [c for c in json.loads(REFERENCE.read_text())["cases"] if c["kind"] == "chat"]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.mark.parametrize("case", CHAT_CASES, ids=lambda c: c["user"][:24])
def test_smollm2_template_inserts_default_system_prompt_like_llamacpp(smollm2, case):
    text = ChatTemplate.for_tokenizer(smollm2).render([{"role": "user", "content": case["user"]}])
    assert text == case["prompt"]
    assert smollm2.encode(text) == case["prompt_ids"]


def test_own_system_prompt_replaces_the_default_and_generation_prompt_is_optional(smollm2):
    template = ChatTemplate.for_tokenizer(smollm2)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert template.render(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert template.render(messages).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_template_sees_bos_token_and_raise_exception():
    source = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
              "{{ raise_exception('tools are not supported') }}{% endif %}{{ m['content'] | tojson }}{% endfor %}")
    template = ChatTemplate(source, bos_token="<s>")
    assert template.render([{"role": "user", "content": "é"}]) == '<s>"é"'
    with pytest.raises(ChatTemplateError, match="tools are not supported"):
        template.render([{"role": "tool", "content": "x"}])


def test_templates_run_sandboxed():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_missing_template_falls_back_to_chatml():
    assert ChatTemplate(None).source == CHATML_TEMPLATE
    assert ChatTemplate(None).render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"]])
def test_malformed_messages_are_rejected(messages):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(None).render(messages)


def test_a_template_that_does_not_parse_is_a_model_error():
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
