"""Chat templates render in Jinja2's immutable sandbox with the helpers real templates use:
raise_exception, strftime_now, tools, add_generation_prompt."""
from __future__ import annotations

import datetime

import pytest

from octavo.serving.chat_template import render_chat

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tok(smollm_oracle_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_oracle_folder)


def _text(tok, template, messages=USER, **kwargs):
    return tok.decode(render_chat(tok, messages, template, **kwargs))


def test_raise_exception_is_a_clear_error(tok):
    template = ("{% if messages[0]['role'] != 'system' %}"
                "{{ raise_exception('system first') }}{% endif %}")
    with pytest.raises(ValueError, match="system first"):
        render_chat(tok, USER, template)


def test_strftime_now(tok):
    year = str(datetime.datetime.now().year)
    assert year in _text(tok, "{{ strftime_now('%Y') }}{{ messages[0]['content'] }}")


def test_tools_reach_the_template():
    from transformers import AutoTokenizer

    from tests.oracle import oracle_folder

    qwen = AutoTokenizer.from_pretrained(oracle_folder("qwen2.5-coder-0.5b-instruct"))
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    text = qwen.decode(render_chat(qwen, USER, template_kwargs={"tools": tools}))
    assert "<tools>" in text and "get_weather" in text
    assert "<tools>" not in qwen.decode(render_chat(qwen, USER))


def test_add_generation_prompt(tok):
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert _text(tok, template).endswith("[assistant]")
    assert _text(tok, template, add_generation_prompt=False).endswith("Hi")


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the sandbox forbids dunder access
    "{% set xs = [1] %}{{ xs.append(2) }}",  # immutable: no mutating methods
])
def test_the_sandbox_blocks_unsafe_templates(tok, template):
    with pytest.raises(ValueError, match="chat template failed"):
        render_chat(tok, USER, template)
